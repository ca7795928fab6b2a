//! Which ggml type each tensor gets in a quantised file, with llama.cpp's rules
//! (`llama_tensor_get_type` in src/llama-quant.cpp, llama.cpp 0c1e57098), for the file types
//! k3mini exports.
//!
//! - Never quantised (kept as exported, F32): tensors of fewer than 2 dimensions, names not ending
//!   in `weight`, `*_norm.weight`, `ffn_gate_inp.weight`, `ssm_conv1d*`.
//! - `output.weight` (or `token_embd.weight` when there is no `output.weight`): Q6_K for K-quant
//!   mixes; Q8_0 when its rows are not whole 256-blocks.
//! - Q4_K_M: Q4_K by default; Q6_K for attention-value tensors (`attn_v`, `attn_qkv`, `attn_kv_b`)
//!   where `use_more_bits(i, n)` holds over their running count, and for `ffn_down` where it holds
//!   over the layer index (a running count; with experts, the `blk.N` of the name):
//!   `use_more_bits(i, n) = i < n/8 ∨ i ≥ 7n/8 ∨ (i − n/8) mod 3 = 2`.
//! - Rows that are not whole blocks fall back: Q4_K → Q5_0, Q6_K → Q8_0, then F16 if those do
//!   not fit either.
//! - MXFP4 (llama.cpp's `MOSTLY_MXFP4_MOE`): MXFP4 for exactly the weights `[train.qat] format =
//!   "mxfp4"` trains quantised, so a QAT student is stored as it was trained, not re-quantised:
//!   with experts, the routed experts (`*_exps`, as K3 ships them) and Q8_0 for every other
//!   weight (llama.cpp also gives MXFP4 to MLA's 3-D `attn_k_b`/`attn_v_b`, which QAT leaves
//!   alone in a MoE student); without, every linear weight (`output.weight` too) and Q8_0 for
//!   `token_embd` (an embedding, which QAT leaves alone). A dense student's `attn_k_b` is kv_b's
//!   key rows transposed per head, so QAT's blocks run across its rows: BF16, which holds MXFP4
//!   values exactly (F16 when kv_b's rows are not whole blocks, which QAT leaves alone). (The
//!   export writes a tensor it computed from two trained ones, off any grid, as F16.)

use super::GgmlType;

/// A file type k3mini exports (`general.file_type` ids as in llama.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4KM,
    Mxfp4,
}

impl FileType {
    /// Every file type with the name `--quant` takes.
    pub const ALL: [(&'static str, Self); 6] = [
        ("f32", Self::F32),
        ("f16", Self::F16),
        ("q8_0", Self::Q8_0),
        ("q4_0", Self::Q4_0),
        ("q4_k_m", Self::Q4KM),
        ("mxfp4", Self::Mxfp4),
    ];

    pub fn parse(s: &str) -> Result<Self, crate::GgufError> {
        Self::ALL
            .iter()
            .find(|(name, _)| *name == s)
            .map(|&(_, t)| t)
            .ok_or_else(|| crate::GgufError::UnknownFileType(s.to_string()))
    }

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, t)| *t == self)
            .expect("listed")
            .0
    }

    /// `general.file_type`.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q8_0 => 7,
            Self::Q4KM => 15,
            Self::Mxfp4 => 38,
        }
    }

    fn default_type(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::F16 => GgmlType::F16,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4KM => GgmlType::Q4K,
            Self::Mxfp4 => GgmlType::MXFP4,
        }
    }
}

fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
}

fn quantisable(name: &str, ne: &[u64]) -> bool {
    ne.len() >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

fn is_attn_v(name: &str) -> bool {
    ["attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"]
        .iter()
        .any(|p| name.contains(p))
}

/// The type each tensor (name, ggml `ne`) gets, in order, for a model of `n_layers` layers.
pub fn tensor_types(tensors: &[(&str, &[u64])], n_layers: usize, ftype: FileType) -> Vec<GgmlType> {
    let default = ftype.default_type();
    let has_output = tensors.iter().any(|(n, _)| *n == "output.weight");
    let n_attn_v = tensors.iter().filter(|(n, _)| is_attn_v(n)).count();
    // With experts, llama.cpp takes ffn_down's layer from its name (`blk.N.`), not a running count.
    let has_experts = tensors.iter().any(|(n, _)| n.contains("_exps"));
    let layer_of = |name: &str| {
        name.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|n| n.parse::<usize>().ok())
    };
    let (mut i_attn_v, mut i_ffn_down) = (0, 0);
    tensors
        .iter()
        .map(|&(name, ne)| {
            if ftype == FileType::Mxfp4 {
                return mxfp4_type(name, ne, has_experts);
            }
            if !quantisable(name, ne)
                || !matches!(ftype, FileType::Q8_0 | FileType::Q4_0 | FileType::Q4KM)
            {
                return if quantisable(name, ne) {
                    default
                } else {
                    GgmlType::F32
                };
            }
            let mut t = default;
            let is_output = name == "output.weight" || (!has_output && name == "token_embd.weight");
            if is_output {
                t = if ne[0] % 256 != 0 {
                    GgmlType::Q8_0
                } else if t != GgmlType::Q8_0 {
                    GgmlType::Q6K
                } else {
                    t
                };
            } else if is_attn_v(name) {
                if ftype == FileType::Q4KM && use_more_bits(i_attn_v, n_attn_v) {
                    t = GgmlType::Q6K;
                }
                i_attn_v += 1;
            } else if name.contains("ffn_down") {
                let layer = match (has_experts, layer_of(name)) {
                    (true, Some(l)) => l,
                    _ => i_ffn_down,
                };
                if ftype == FileType::Q4KM && use_more_bits(layer, n_layers) {
                    t = GgmlType::Q6K;
                }
                i_ffn_down += 1;
            }
            fallback(t, ne[0])
        })
        .collect()
}

/// The type of a tensor in an MXFP4 file (see the module's doc).
fn mxfp4_type(name: &str, ne: &[u64], has_experts: bool) -> GgmlType {
    let t = if !quantisable(name, ne) {
        GgmlType::F32
    } else if has_experts {
        if name.contains("_exps") {
            GgmlType::MXFP4
        } else {
            GgmlType::Q8_0
        }
    } else if name == "token_embd.weight" {
        GgmlType::Q8_0
    } else if name.contains("attn_k_b.weight") {
        match ne[1] % GgmlType::MXFP4.block_size() as u64 {
            0 => GgmlType::BF16,
            _ => GgmlType::F16,
        }
    } else {
        GgmlType::MXFP4
    };
    fallback(t, ne[0])
}

/// llama.cpp's `tensor_type_fallback`: a type whose blocks do not divide the rows.
fn fallback(t: GgmlType, cols: u64) -> GgmlType {
    if cols % t.block_size() as u64 == 0 {
        return t;
    }
    let next = match t {
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q6K => GgmlType::Q8_0,
        other => other,
    };
    if cols % next.block_size() as u64 == 0 {
        next
    } else {
        GgmlType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An 8-layer hybrid (KDA at 0-2 and 4-6, MLA at 3 and 7) with 256-wide rows.
    fn model() -> Vec<(String, Vec<u64>)> {
        let mut t = vec![("token_embd.weight".to_string(), vec![256, 1000])];
        for i in 0..8 {
            t.push((format!("blk.{i}.attn_norm.weight"), vec![256]));
            if i % 4 == 3 {
                t.push((format!("blk.{i}.attn_kv_a_mqa.weight"), vec![256, 96]));
                t.push((format!("blk.{i}.attn_v_b.weight"), vec![64, 64, 2]));
            } else {
                t.push((format!("blk.{i}.attn_v.weight"), vec![256, 256]));
                t.push((format!("blk.{i}.ssm_conv1d_v"), vec![4, 1, 256]));
            }
            t.push((format!("blk.{i}.ffn_down.weight"), vec![512, 256]));
        }
        t.push(("output_norm.weight".to_string(), vec![256]));
        t.push(("output.weight".to_string(), vec![256, 1000]));
        t
    }

    fn types(ftype: FileType) -> Vec<(String, GgmlType)> {
        let m = model();
        let refs: Vec<(&str, &[u64])> = m.iter().map(|(n, s)| (n.as_str(), &s[..])).collect();
        m.iter()
            .map(|(n, _)| n.clone())
            .zip(tensor_types(&refs, 8, ftype))
            .collect()
    }

    fn of(ts: &[(String, GgmlType)], name: &str) -> GgmlType {
        ts.iter().find(|(n, _)| n == name).unwrap().1
    }

    #[test]
    fn q4_k_m_follows_llama_cpp() {
        let t = types(FileType::Q4KM);
        assert_eq!(of(&t, "output.weight"), GgmlType::Q6K);
        assert_eq!(of(&t, "token_embd.weight"), GgmlType::Q4K);
        assert_eq!(of(&t, "output_norm.weight"), GgmlType::F32);
        assert_eq!(of(&t, "blk.0.ssm_conv1d_v"), GgmlType::F32);
        // ffn_down: use_more_bits(i, 8) holds for layers 0, 3, 6 and 7.
        let down: Vec<bool> = (0..8)
            .map(|i| of(&t, &format!("blk.{i}.ffn_down.weight")) == GgmlType::Q6K)
            .collect();
        assert_eq!(down, [true, false, false, true, false, false, true, true]);
        // attn_v: six of them (KDA layers); the 3rd and 6th (layers 2 and 6) get Q6_K.
        let v: Vec<bool> = [0, 1, 2, 4, 5, 6]
            .iter()
            .map(|i| of(&t, &format!("blk.{i}.attn_v.weight")) == GgmlType::Q6K)
            .collect();
        assert_eq!(v, [false, false, true, false, false, true]);
        // 64-wide rows are not 256-blocks: Q4_K falls back to Q5_0.
        assert_eq!(of(&t, "blk.3.attn_v_b.weight"), GgmlType::Q5_0);
    }

    #[test]
    fn other_file_types() {
        let t = types(FileType::Q4_0);
        assert_eq!(of(&t, "output.weight"), GgmlType::Q6K);
        assert_eq!(of(&t, "blk.0.ffn_down.weight"), GgmlType::Q4_0);
        let t = types(FileType::Q8_0);
        assert_eq!(of(&t, "output.weight"), GgmlType::Q8_0);
        let t = types(FileType::F16);
        assert_eq!(of(&t, "blk.0.attn_v.weight"), GgmlType::F16);
        assert_eq!(of(&t, "blk.0.attn_norm.weight"), GgmlType::F32);
        // Tied embeddings: without output.weight, token_embd is the output.
        let refs: Vec<(&str, &[u64])> = vec![("token_embd.weight", &[256, 10])];
        assert_eq!(tensor_types(&refs, 1, FileType::Q4KM), [GgmlType::Q6K]);
        // MXFP4 of a dense student: every linear weight but attn_k_b, whose blocks would cut
        // across QAT's; the embedding Q8_0.
        let t = types(FileType::Mxfp4);
        assert_eq!(of(&t, "output.weight"), GgmlType::MXFP4);
        assert_eq!(of(&t, "token_embd.weight"), GgmlType::Q8_0);
        assert_eq!(of(&t, "blk.0.attn_v.weight"), GgmlType::MXFP4);
        assert_eq!(of(&t, "blk.3.attn_v_b.weight"), GgmlType::MXFP4);
        assert_eq!(of(&t, "blk.0.attn_norm.weight"), GgmlType::F32);
        // With experts, only they are MXFP4.
        let refs: Vec<(&str, &[u64])> = vec![
            ("blk.1.ffn_down_exps.weight", &[64, 256, 4]),
            ("blk.1.attn_k_b.weight", &[32, 64, 2]),
            ("blk.1.ffn_gate_inp.weight", &[256, 4]),
            ("output.weight", &[256, 10]),
        ];
        assert_eq!(
            tensor_types(&refs, 2, FileType::Mxfp4),
            [
                GgmlType::MXFP4,
                GgmlType::Q8_0,
                GgmlType::F32,
                GgmlType::Q8_0
            ]
        );
        assert!(
            FileType::parse("q5_k")
                .unwrap_err()
                .to_string()
                .contains("q4_k_m")
        );
    }
}
