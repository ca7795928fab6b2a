//! The student's tensors as a llama.cpp architecture's, mapped as llama.cpp's converters
//! (conversion/kimi_linear.py, kimi_k3.py) map Moonshot's checkpoints. The names come from the
//! architecture's table (`arch.rs`); what is computed rather than renamed is here, beside the
//! reason.

use super::arch::{GgufArch, KdaGate, Rename, TensorNames, gguf_metadata, twin_gap};
use crate::bail;
use crate::error::{Context, Result};
use crate::run_dir::Checkpoint;
use k3mini_gguf::Value;
use k3mini_student::{LayerKind, ModelConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One GGUF tensor before quantisation: name, ggml `ne`, f32 values in ggml order.
pub type GgufTensor = (String, Vec<u64>, Vec<f32>);

/// GGUF metadata, in the order it is written.
pub type Metadata = Vec<(String, Value)>;

/// Checkpoint tensors by transformers name: (shape, f32 values).
type HfTensors = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// The student as a llama.cpp GGUF (metadata and f32 tensors) of architecture
/// [`GgufArch::for_config`]. What no architecture expresses is refused by name.
pub fn student_gguf(ck: &Checkpoint) -> Result<(Metadata, Vec<GgufTensor>)> {
    student_gguf_of(ck, &ck.weights)
}

/// [`student_gguf`] with the checkpoint's weights read from `weights` (safetensors files under
/// transformers' names) instead of its own files.
pub fn student_gguf_of(
    ck: &Checkpoint,
    weights: &[PathBuf],
) -> Result<(Metadata, Vec<GgufTensor>)> {
    let cfg = &ck.plan.model;
    let arch = GgufArch::for_config(cfg);
    if let Some(ar) = &cfg.attn_res
        && ar.block_size == 1
    {
        bail!(
            "attn_res.block_size = 1 (full AttnRes) has no llama.cpp equivalent: kimi-k3 mixes \
             over blocks of whole layers (an even block_size)"
        );
    }
    let t = arch.tensors();
    let kinds = cfg.layer_kinds()?;
    if !kinds.contains(&LayerKind::Kda)
        && let Some((field, feature)) = twin_gap(cfg)
    {
        bail!(
            "a student without KDA layers (layer_pattern {:?}, a Transformer twin) runs in llama.cpp \
             as deepseek2 (the Kimi graphs abort without a recurrent layer), which has no \
             equivalent of {feature} ({field})",
            cfg.layer_pattern
        );
    }
    let mut m = Mapper {
        tensors: hf_tensors(weights)?,
        dir: &ck.dir,
        out: Vec::new(),
    };
    m.rename("", "", t.embedding)?;
    for (i, kind) in kinds.iter().enumerate() {
        m.layer(
            &format!("model.layers.{i}."),
            &format!("blk.{i}."),
            i,
            *kind,
            cfg,
            t,
        )?;
    }
    if let (Some(names), Some(_)) = (&t.attn_res, &cfg.attn_res) {
        m.res_score("", "", names.output)?;
    }
    for r in t.output {
        m.rename("", "", r)?;
    }
    if let Some(left) = m.tensors.keys().next() {
        bail!(
            "checkpoint tensor {left} has no {} counterpart",
            arch.name()
        );
    }
    Ok((gguf_metadata(cfg, arch, &kinds), m.out))
}

/// The student's tensors by transformers name: (shape, f32 values), from each weight file in turn.
fn hf_tensors(weights: &[PathBuf]) -> Result<HfTensors> {
    let mut all = HfTensors::new();
    for path in weights {
        let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
        all.extend(file_tensors(&bytes)?);
    }
    Ok(all)
}

fn file_tensors(bytes: &[u8]) -> Result<HfTensors> {
    let st = safetensors::SafeTensors::deserialize(bytes)?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            crate::ensure!(
                view.dtype() == safetensors::Dtype::F32,
                "{name}: {:?}, expected F32",
                view.dtype()
            );
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Ok((name, (view.shape().to_vec(), values)))
        })
        .collect()
}

/// Moves checkpoint tensors (transformers names) into GGUF tensors, so that a tensor left over at
/// the end is one the mapping forgot.
struct Mapper<'a> {
    tensors: HfTensors,
    dir: &'a Path,
    out: Vec<GgufTensor>,
}

impl Mapper<'_> {
    fn take(&mut self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.tensors
            .remove(name)
            .with_context(|| format!("checkpoint {}: no tensor {name}", self.dir.display()))
    }

    fn push(&mut self, name: String, ne: Vec<u64>, values: Vec<f32>) {
        self.out.push((name, ne, values));
    }

    /// Same data under the GGUF name (prefixed `b`) of a student tensor (prefixed `p`); ggml's
    /// `ne` is the numpy shape reversed.
    fn rename(&mut self, p: &str, b: &str, (from, to): Rename) -> Result<()> {
        let (shape, v) = self.take(&format!("{p}{from}"))?;
        self.push(
            format!("{b}{to}"),
            shape.iter().rev().map(|&d| d as u64).collect(),
            v,
        );
        Ok(())
    }

    fn renames(&mut self, p: &str, b: &str, names: &[Rename]) -> Result<()> {
        names.iter().try_for_each(|&r| self.rename(p, b, r))
    }

    /// An AttnRes point as kimi-k3's score vector: `w · RMSNorm_γ(v) = (γ ⊙ w) · v̂`, so llama.cpp
    /// stores the product of the pseudo-query and the key norm's weight.
    fn res_score(&mut self, p: &str, b: &str, (from, to): Rename) -> Result<()> {
        let (_, query) = self.take(&format!("{p}{from}.query"))?;
        let (_, gamma) = self.take(&format!("{p}{from}.key_norm.weight"))?;
        let score = query.iter().zip(&gamma).map(|(w, g)| w * g).collect();
        self.push(format!("{b}{to}"), vec![query.len() as u64], score);
        Ok(())
    }

    /// Layer `i`: AttnRes scores, the mixer with its norm and output, the FFN or MoE.
    fn layer(
        &mut self,
        p: &str,
        b: &str,
        i: usize,
        kind: LayerKind,
        cfg: &ModelConfig,
        t: &TensorNames,
    ) -> Result<()> {
        if let (Some(names), Some(_)) = (&t.attn_res, &cfg.attn_res) {
            if i == 0 {
                // Layer 0's mixer reads the embedding alone, so k3mini has no depth attention
                // there and llama.cpp skips the mix; its loader still wants the tensor.
                let d = cfg.d_model;
                self.push(
                    format!("{b}{}", names.mixer.1),
                    vec![d as u64],
                    vec![0.0; d],
                );
            } else {
                self.res_score(p, b, names.mixer)?;
            }
            self.res_score(p, b, names.ffn)?;
        }
        self.rename(p, b, t.mixer_norm)?;
        match kind {
            LayerKind::Kda => self.kda(p, b, t)?,
            LayerKind::Mla => self.mla(p, b, cfg, t)?,
        }
        self.renames(p, b, &t.mixer_out)?;
        if cfg.is_moe_layer(i) {
            self.moe(p, b, t)
        } else {
            self.renames(p, b, &t.dense_ffn)
        }
    }

    /// A KDA mixer: the fused conv split into q/k/v, `ssm_a = −exp(A_log)`, and the output gate
    /// as the architecture keeps it (a low-rank student's `g_b·g_a` multiplied out for kimi-k3).
    fn kda(&mut self, p: &str, b: &str, t: &TensorNames) -> Result<()> {
        self.renames(p, b, &t.kda_proj)?;
        // conv1d [3D, 1, K] (channels q | k | v) → three [D, 1, K], ne [K, 1, D].
        let (conv, parts) = t.kda_conv;
        let (shape, v) = self.take(&format!("{p}{conv}"))?;
        let (channels, k) = (shape[0], shape[2]);
        let d = channels / 3;
        for (j, name) in parts.iter().enumerate() {
            let part = v[j * d * k..(j + 1) * d * k].to_vec();
            self.push(format!("{b}{name}"), vec![k as u64, 1, d as u64], part);
        }
        self.renames(p, b, &t.kda_gates)?;
        let (a_log, ssm_a, two_d) = t.kda_decay;
        let (_, a_log) = self.take(&format!("{p}{a_log}"))?;
        let heads = a_log.len() as u64;
        let ne = if two_d { vec![1, heads] } else { vec![heads] };
        self.push(
            format!("{b}{ssm_a}"),
            ne,
            a_log.iter().map(|x| -x.exp()).collect(),
        );
        self.rename(p, b, t.kda_dt_bias)?;
        match &t.kda_out_gate {
            KdaGate::LowRank(pair) => self.renames(p, b, pair)?,
            KdaGate::Full {
                low_rank: [g_a, g_b],
                gguf,
            } if self.tensors.contains_key(&format!("{p}{g_a}")) => {
                let (sa, ga) = self.take(&format!("{p}{g_a}"))?; // [r, d]
                let (sb, gb) = self.take(&format!("{p}{g_b}"))?; // [HD, r]
                let (r, dm, hd) = (sa[0], sa[1], sb[0]);
                let mut full = vec![0f32; hd * dm]; // [HD, d] = g_b · g_a
                for (row, out) in full.chunks_exact_mut(dm).enumerate() {
                    for j in 0..r {
                        let w = gb[row * r + j];
                        for (o, x) in out.iter_mut().zip(&ga[j * dm..(j + 1) * dm]) {
                            *o += w * x;
                        }
                    }
                }
                self.push(format!("{b}{gguf}"), vec![dm as u64, hd as u64], full);
            }
            KdaGate::Full {
                low_rank: [_, g_b],
                gguf,
            } => self.rename(p, b, (g_b, gguf))?,
        }
        self.rename(p, b, t.kda_norm)
    }

    /// A Gated MLA mixer: q (or K3's q-LoRA), the compressed KV, `kv_b` split per head into
    /// `attn_k_b` (transposed) and `attn_v_b`, and K3's output gate.
    fn mla(&mut self, p: &str, b: &str, cfg: &ModelConfig, t: &TensorNames) -> Result<()> {
        match (&t.mla_q_lora, cfg.mla.q_lora_rank) {
            (Some(lora), Some(_)) => self.renames(p, b, lora)?,
            _ => self.rename(p, b, t.mla_q)?,
        }
        self.renames(p, b, &t.mla_kv_a)?;
        // kv_b [H·(nope + v), r] per head [nope | v] → k_b [H, r, nope] (transposed), v_b [H, v, r].
        let (kv_b, [k_name, v_name]) = t.mla_kv_b;
        let (_, kv_b) = self.take(&format!("{p}{kv_b}"))?;
        let (h, r) = (cfg.n_heads, cfg.mla.kv_lora_rank);
        let (nope, vd) = (cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim);
        let (mut k_b, mut v_b) = (Vec::new(), Vec::new());
        for head in 0..h {
            let rows = &kv_b[head * (nope + vd) * r..(head + 1) * (nope + vd) * r];
            for c in 0..r {
                k_b.extend((0..nope).map(|n| rows[n * r + c]));
            }
            v_b.extend_from_slice(&rows[nope * r..]);
        }
        self.push(
            format!("{b}{k_name}"),
            vec![nope as u64, r as u64, h as u64],
            k_b,
        );
        self.push(
            format!("{b}{v_name}"),
            vec![r as u64, vd as u64, h as u64],
            v_b,
        );
        match (t.mla_gate, cfg.mla.output_gate) {
            (Some(gate), true) => self.rename(p, b, gate),
            _ => Ok(()),
        }
    }

    /// An MoE block: the router and its bias, the routed experts stacked as 3-D tensors
    /// (transformers' fused `gate_up_proj [E, 2I, d]` split into gate and up), LatentMoE's
    /// projections and norm, and the shared expert.
    fn moe(&mut self, p: &str, b: &str, t: &TensorNames) -> Result<()> {
        self.renames(p, b, &t.moe_router)?;
        let (gate_up, [gate_name, up_name]) = t.moe_gate_up;
        let (shape, gate_up) = self.take(&format!("{p}{gate_up}"))?;
        let (e, two_i, d) = (shape[0], shape[1], shape[2]);
        let i = two_i / 2;
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for expert in gate_up.chunks_exact(two_i * d) {
            gate.extend_from_slice(&expert[..i * d]);
            up.extend_from_slice(&expert[i * d..]);
        }
        let ne = vec![d as u64, i as u64, e as u64];
        self.push(format!("{b}{gate_name}"), ne.clone(), gate);
        self.push(format!("{b}{up_name}"), ne, up);
        self.rename(p, b, t.moe_down)?;
        if let Some(latent) = &t.moe_latent
            && self.tensors.contains_key(&format!("{p}{}", latent[0].0))
        {
            self.renames(p, b, latent)?;
        }
        self.renames(p, b, &t.moe_shared)
    }
}
