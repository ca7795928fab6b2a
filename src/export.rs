//! `k3mini export`: a trained student in the formats other runtimes load.
//!
//! `--format hf` writes `model.safetensors` (the checkpoint's weights, already under transformers'
//! `KimiLinearForCausalLM` names), `config.json` (`k3mini_student::hf::config_to_kimi_linear`,
//! which refuses what Kimi Linear cannot express) and, where the run's tokenizer has one,
//! `tokenizer.json`. Every file is written atomically. `--with-reference` adds
//! `k3mini_reference.safetensors`: fixed input ids and k3mini's logits for them, which
//! `scripts/interop/check_hf.py` compares with transformers' forward of the export.
//!
//! `--format gguf` maps the student to llama.cpp's `kimi-linear` or, for students with K3
//! features, `kimi-k3` ([`GgufArch`]), quantised with ggml's own quantisers in llama.cpp's
//! tensor-type mix; its `--with-reference` writes `FILE.reference.safetensors` for
//! `scripts/interop/check_gguf.py`.

use crate::recipe::TokenizerSpec;
use crate::run_dir::Checkpoint;
use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_checkpoints::write_atomic;
use k3mini_data::Tokenizer;
use k3mini_data::chat::END_OF_TURN;
use k3mini_gguf::Value;
use k3mini_gguf::mix::{FileType, tensor_types};
use k3mini_gguf::quantize::quantize;
use k3mini_gguf::writer::GgufWriter;
use k3mini_student::config::Activation;
use k3mini_student::hf::{config_to_kimi_linear, kimi_linear_gap};
use k3mini_student::mlp::{SITU_BETA, SITU_LINEAR_BETA};
use k3mini_student::{K3Mini, LayerKind, ModelConfig};
use std::path::{Path, PathBuf};

/// The student's tokenizer as a shippable tokenizer.json, by the plan's tokenizer spec: a local
/// teacher's (`tokenizer = "teacher"`) or the file. Built-in vocabularies (Kimi's tiktoken) have
/// none to ship.
pub fn plan_tokenizer(spec: &TokenizerSpec) -> Result<Option<Tokenizer>> {
    Ok(match spec {
        TokenizerSpec::Builtin { .. } => None,
        _ => Some(crate::teachers::student_tokenizer(spec)?),
    })
}

/// Writes the Hugging Face export into `out`; returns the files written.
pub fn export_hf(
    ck: &Checkpoint,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
    with_reference: bool,
) -> Result<Vec<PathBuf>> {
    let id = |names: &[&str]| tokenizer.and_then(|t| names.iter().find_map(|n| t.token_id(n)));
    let special = [
        id(&["<|im_start|>", "<s>", "<|begin_of_text|>"]),
        id(&[END_OF_TURN, "</s>", "<|endoftext|>", "<|end_of_text|>"]),
        id(&["<|endoftext|>", "<pad>"]),
    ];
    let config = config_to_kimi_linear(&ck.plan.model, special)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        let path = out.join(name);
        write_atomic(&path, bytes)?;
        written.push(path);
        Ok(())
    };
    put("model.safetensors", &ck.weights)?;
    put(
        "config.json",
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    if with_reference {
        put(
            "k3mini_reference.safetensors",
            &reference_logits(ck, tokenizer)?,
        )?;
    }
    if let Some(t) = tokenizer {
        let path = out.join("tokenizer.json");
        t.save(&path)?;
        written.push(path);
    }
    Ok(written)
}

/// Writes [`reference_logits`] to `path` (atomically).
pub fn write_reference(ck: &Checkpoint, tokenizer: Option<&Tokenizer>, path: &Path) -> Result<()> {
    Ok(write_atomic(path, &reference_logits(ck, tokenizer)?)?)
}

/// A text with spaces, newlines, punctuation, digits and non-ASCII, for tokenizer checks.
const REFERENCE_TEXT: &str =
    "To be, or not to be: that is the question.\n  Whether 'tis nobler — Act III, 1603.\n";

/// Fixed input ids (two rows of 40, seeded) and k3mini's logits for them, as safetensors; with a
/// tokenizer, also `text_ids`, its encoding of the `text` in the metadata.
fn reference_logits(ck: &Checkpoint, tokenizer: Option<&Tokenizer>) -> Result<Vec<u8>> {
    let device = Device::default();
    let model = ck.model(&device)?;
    let (rows, t) = (2usize, 40usize);
    let mut state = 0x5EED_u64;
    let ids: Vec<i64> = (0..rows * t)
        .map(|_| {
            (k3mini_data::rng::splitmix64(&mut state) % ck.plan.model.vocab_size as u64) as i64
        })
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [rows, t]), &device);
    let logits: Vec<f32> = model
        .forward(tokens)
        .into_data()
        .try_into_vec()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let v = ck.plan.model.vocab_size;
    let to_bytes = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        f(&mut b);
        b
    };
    let id_bytes = to_bytes(&|b| {
        ids.iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
    });
    let logit_bytes = to_bytes(&|b| {
        logits
            .iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
    });
    let text_ids: Option<Vec<u8>> = tokenizer
        .map(|t| t.encode(REFERENCE_TEXT))
        .transpose()?
        .map(|ids| ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect());
    let mut views = vec![
        (
            "input_ids",
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::I64,
                vec![rows, t],
                &id_bytes,
            )?,
        ),
        (
            "logits",
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![rows, t, v],
                &logit_bytes,
            )?,
        ),
    ];
    let mut metadata = None;
    if let Some(b) = &text_ids {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![b.len() / 8], b)?;
        views.push(("text_ids", view));
        metadata = Some([("text".to_string(), REFERENCE_TEXT.to_string())].into());
    }
    Ok(safetensors::serialize(views, metadata)?)
}

/// Refuses an output path that would overwrite the checkpoint itself.
pub fn check_out(ck: &Checkpoint, out: &Path) -> Result<()> {
    if out.canonicalize().ok() == Some(ck.dir.canonicalize()?) {
        bail!("--out {} is the checkpoint itself", out.display());
    }
    Ok(())
}

/// The student's tensors by transformers name: (shape, f32 values).
fn hf_tensors(
    ck: &Checkpoint,
) -> Result<std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>> {
    let st = safetensors::SafeTensors::deserialize(&ck.weights)?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            anyhow::ensure!(
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

/// The llama.cpp architecture a student maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    /// `kimi-linear`: Kimi Linear's own graph, for students without K3 features.
    KimiLinear,
    /// `kimi-k3`: adds AttnRes, SiTU, the MLA output gate and q-LoRA, the full-rank and safe KDA
    /// gates, and LatentMoE.
    KimiK3,
}

impl GgufArch {
    /// `kimi-linear` where it expresses the student (the graph more llama.cpp builds have),
    /// `kimi-k3` otherwise.
    pub fn for_config(cfg: &ModelConfig) -> Self {
        if kimi_linear_gap(cfg).is_none() && cfg.mla.q_lora_rank.is_none() {
            Self::KimiLinear
        } else {
            Self::KimiK3
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::KimiLinear => "kimi-linear",
            Self::KimiK3 => "kimi-k3",
        }
    }
}

/// kimi-k3 applies SiTU in every FFN. SwiGLU is its limit as the caps go to infinity: with
/// β = 1e6, `β·tanh(g/β) = g·(1 − (g/β)²/3 + …)` equals `g` to f32 rounding for |g| < 100, and a
/// linear β of 0 turns the up-branch cap off (llama.cpp's convention).
const SWIGLU_AS_SITU: (f32, f32) = (1e6, 0.0);

/// One GGUF tensor before quantisation: name, ggml `ne`, f32 values in ggml order.
type GgufTensor = (String, Vec<u64>, Vec<f32>);

/// Moves checkpoint tensors (transformers names) into GGUF tensors, so that a tensor left over at
/// the end is one the mapping forgot.
struct Mapper<'a> {
    tensors: std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>,
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

    /// Same data under a new name; ggml's `ne` is the numpy shape reversed.
    fn plain(&mut self, from: &str, to: String) -> Result<()> {
        let (shape, v) = self.take(from)?;
        self.push(to, shape.iter().rev().map(|&d| d as u64).collect(), v);
        Ok(())
    }

    /// An AttnRes point as kimi-k3's score vector: `w · RMSNorm_γ(v) = (γ ⊙ w) · v̂`, so llama.cpp
    /// stores the product of the pseudo-query and the key norm's weight.
    fn res_score(&mut self, from: &str, to: String) -> Result<()> {
        let (_, query) = self.take(&format!("{from}.query"))?;
        let (_, gamma) = self.take(&format!("{from}.key_norm.weight"))?;
        let score = query.iter().zip(&gamma).map(|(w, g)| w * g).collect();
        self.push(to, vec![query.len() as u64], score);
        Ok(())
    }

    /// An MoE block: the router, its score-correction bias, the routed experts stacked as 3-D
    /// tensors (transformers' fused `gate_up_proj [E, 2I, d]` split into gate and up), LatentMoE's
    /// projections and norm, and the shared expert.
    fn moe(&mut self, p: &str, b: &str) -> Result<()> {
        let m = format!("{p}.mlp");
        self.plain(
            &format!("{m}.gate.weight"),
            format!("{b}.ffn_gate_inp.weight"),
        )?;
        self.plain(
            &format!("{m}.gate.e_score_correction_bias"),
            format!("{b}.exp_probs_b.bias"),
        )?;
        let (shape, gate_up) = self.take(&format!("{m}.experts.gate_up_proj"))?;
        let (e, two_i, d) = (shape[0], shape[1], shape[2]);
        let i = two_i / 2;
        let (mut gate, mut up) = (Vec::new(), Vec::new());
        for expert in gate_up.chunks_exact(two_i * d) {
            gate.extend_from_slice(&expert[..i * d]);
            up.extend_from_slice(&expert[i * d..]);
        }
        let ne = vec![d as u64, i as u64, e as u64];
        self.push(format!("{b}.ffn_gate_exps.weight"), ne.clone(), gate);
        self.push(format!("{b}.ffn_up_exps.weight"), ne, up);
        self.plain(
            &format!("{m}.experts.down_proj"),
            format!("{b}.ffn_down_exps.weight"),
        )?;
        if self
            .tensors
            .contains_key(&format!("{m}.latent_down_proj.weight"))
        {
            for (from, to) in [
                ("latent_down_proj.weight", "ffn_routed_down.weight"),
                ("latent_norm.weight", "ffn_routed_norm.weight"),
                ("latent_up_proj.weight", "ffn_routed_up.weight"),
            ] {
                self.plain(&format!("{m}.{from}"), format!("{b}.{to}"))?;
            }
        }
        for (from, to) in [
            ("gate_proj", "gate"),
            ("up_proj", "up"),
            ("down_proj", "down"),
        ] {
            self.plain(
                &format!("{m}.shared_experts.{from}.weight"),
                format!("{b}.ffn_{to}_shexp.weight"),
            )?;
        }
        Ok(())
    }

    /// A KDA mixer, mapped as llama.cpp's converters map Kimi Linear and K3 checkpoints: the fused
    /// conv split into q/k/v, `ssm_a = −exp(A_log)` and `dt_bias` as `ssm_dt.bias`. kimi-linear
    /// keeps the low-rank output gate `g_b·g_a`; kimi-k3 has one full-rank `ssm_g`, which a
    /// low-rank student fills with the product.
    fn kda(&mut self, a: &str, b: &str, arch: GgufArch) -> Result<()> {
        for (from, to) in [
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
        ] {
            self.plain(&format!("{a}.{from}.weight"), format!("{b}.{to}.weight"))?;
        }
        // conv1d [3D, 1, K] (channels q | k | v) → three [D, 1, K], ne [K, 1, D].
        let (shape, v) = self.take(&format!("{a}.conv1d.weight"))?;
        let (channels, k) = (shape[0], shape[2]);
        let d = channels / 3;
        for (j, name) in ["q", "k", "v"].iter().enumerate() {
            let part = v[j * d * k..(j + 1) * d * k].to_vec();
            self.push(
                format!("{b}.ssm_conv1d_{name}.weight"),
                vec![k as u64, 1, d as u64],
                part,
            );
        }
        let g = format!("{a}.forget_gate");
        self.plain(
            &format!("{g}.f_a_proj.weight"),
            format!("{b}.ssm_f_a.weight"),
        )?;
        self.plain(
            &format!("{g}.f_b_proj.weight"),
            format!("{b}.ssm_f_b.weight"),
        )?;
        self.plain(
            &format!("{a}.b_proj.weight"),
            format!("{b}.ssm_beta.weight"),
        )?;
        let (_, a_log) = self.take(&format!("{g}.A_log"))?;
        let heads = a_log.len() as u64;
        // kimi-linear's ssm_a is [1, H] (as its checkpoints); K3's a plain [H].
        let ne = match arch {
            GgufArch::KimiLinear => vec![1, heads],
            GgufArch::KimiK3 => vec![heads],
        };
        self.push(
            format!("{b}.ssm_a"),
            ne,
            a_log.iter().map(|x| -x.exp()).collect(),
        );
        self.plain(&format!("{g}.dt_bias"), format!("{b}.ssm_dt.bias"))?;
        let low_rank = format!("{a}.g_a_proj.weight");
        match (arch, self.tensors.contains_key(&low_rank)) {
            (GgufArch::KimiLinear, _) => {
                self.plain(&low_rank, format!("{b}.ssm_g_a.weight"))?;
                self.plain(
                    &format!("{a}.g_b_proj.weight"),
                    format!("{b}.ssm_g_b.weight"),
                )?;
            }
            (GgufArch::KimiK3, true) => {
                let (sa, ga) = self.take(&low_rank)?; // [r, d]
                let (sb, gb) = self.take(&format!("{a}.g_b_proj.weight"))?; // [HD, r]
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
                self.push(
                    format!("{b}.ssm_g.weight"),
                    vec![dm as u64, hd as u64],
                    full,
                );
            }
            (GgufArch::KimiK3, false) => {
                self.plain(&format!("{a}.g_b_proj.weight"), format!("{b}.ssm_g.weight"))?;
            }
        }
        self.plain(
            &format!("{a}.o_norm.weight"),
            format!("{b}.ssm_norm.weight"),
        )
    }

    /// A Gated MLA mixer: q (or K3's q-LoRA), the compressed KV, `kv_b` split per head into
    /// `attn_k_b` (transposed) and `attn_v_b`, and K3's output gate.
    fn mla(&mut self, a: &str, b: &str, cfg: &ModelConfig) -> Result<()> {
        if cfg.mla.q_lora_rank.is_some() {
            for (from, to) in [
                ("q_a_proj.weight", "attn_q_a.weight"),
                ("q_a_layernorm.weight", "attn_q_a_norm.weight"),
                ("q_b_proj.weight", "attn_q_b.weight"),
            ] {
                self.plain(&format!("{a}.{from}"), format!("{b}.{to}"))?;
            }
        } else {
            self.plain(&format!("{a}.q_proj.weight"), format!("{b}.attn_q.weight"))?;
        }
        self.plain(
            &format!("{a}.kv_a_proj_with_mqa.weight"),
            format!("{b}.attn_kv_a_mqa.weight"),
        )?;
        self.plain(
            &format!("{a}.kv_a_layernorm.weight"),
            format!("{b}.attn_kv_a_norm.weight"),
        )?;
        // kv_b [H·(nope + v), r] per head [nope | v] → k_b [H, r, nope] (transposed), v_b [H, v, r].
        let (_, kv_b) = self.take(&format!("{a}.kv_b_proj.weight"))?;
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
            format!("{b}.attn_k_b.weight"),
            vec![nope as u64, r as u64, h as u64],
            k_b,
        );
        self.push(
            format!("{b}.attn_v_b.weight"),
            vec![r as u64, vd as u64, h as u64],
            v_b,
        );
        if cfg.mla.output_gate {
            self.plain(
                &format!("{a}.g_proj.weight"),
                format!("{b}.attn_gate.weight"),
            )?;
        }
        Ok(())
    }
}

/// The student as a llama.cpp GGUF (metadata and f32 tensors) of architecture
/// [`GgufArch::for_config`], mapped as llama.cpp's converters (conversion/kimi_linear.py,
/// kimi_k3.py) map Moonshot's checkpoints. What neither architecture expresses is refused by name.
pub fn student_gguf(ck: &Checkpoint) -> Result<(Vec<(String, Value)>, Vec<GgufTensor>)> {
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
    let kinds = cfg.layer_kinds()?;
    let mut m = Mapper {
        tensors: hf_tensors(ck)?,
        dir: &ck.dir,
        out: Vec::new(),
    };
    m.plain("model.embed_tokens.weight", "token_embd.weight".into())?;
    for (i, kind) in kinds.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let b = format!("blk.{i}");
        if cfg.attn_res.is_some() {
            let score = format!("{b}.attn_res_score.weight");
            if i == 0 {
                // Layer 0's mixer reads the embedding alone, so k3mini has no depth attention
                // there and llama.cpp skips the mix; its loader still wants the tensor.
                m.push(score, vec![cfg.d_model as u64], vec![0.0; cfg.d_model]);
            } else {
                m.res_score(&format!("{p}.attn_res"), score)?;
            }
            m.res_score(&format!("{p}.mlp_res"), format!("{b}.ffn_res_score.weight"))?;
        }
        m.plain(
            &format!("{p}.input_layernorm.weight"),
            format!("{b}.attn_norm.weight"),
        )?;
        let a = format!("{p}.self_attn");
        match kind {
            LayerKind::Kda => m.kda(&a, &b, arch)?,
            LayerKind::Mla => m.mla(&a, &b, cfg)?,
        }
        m.plain(
            &format!("{a}.o_proj.weight"),
            format!("{b}.attn_output.weight"),
        )?;
        m.plain(
            &format!("{p}.post_attention_layernorm.weight"),
            format!("{b}.ffn_norm.weight"),
        )?;
        if cfg.is_moe_layer(i) {
            m.moe(&p, &b)?;
            continue;
        }
        for (from, to) in [
            ("gate_proj", "ffn_gate"),
            ("up_proj", "ffn_up"),
            ("down_proj", "ffn_down"),
        ] {
            m.plain(
                &format!("{p}.mlp.{from}.weight"),
                format!("{b}.{to}.weight"),
            )?;
        }
    }
    if cfg.attn_res.is_some() {
        m.res_score("model.final_res", "output_res_score.weight".into())?;
    }
    m.plain("model.norm.weight", "output_norm.weight".into())?;
    m.plain("lm_head.weight", "output.weight".into())?;
    if let Some(left) = m.tensors.keys().next() {
        bail!(
            "checkpoint tensor {left} has no {} counterpart",
            arch.name()
        );
    }
    Ok((gguf_metadata(cfg, arch, &kinds), m.out))
}

/// The architecture's hyperparameter keys.
fn gguf_metadata(cfg: &ModelConfig, arch: GgufArch, kinds: &[LayerKind]) -> Vec<(String, Value)> {
    let name = arch.name();
    let u = |x: usize| Value::U32(x as u32);
    let k = |key: &str| format!("{name}.{key}");
    let (mla, kda) = (&cfg.mla, &cfg.kda);
    // Dense students still give the MoE keys llama.cpp requires, with every block dense.
    let moe = cfg.moe.as_ref();
    let head_count_kv = kinds.iter().map(|k| u((*k == LayerKind::Mla) as usize));
    let mut metadata = vec![
        ("general.architecture".into(), Value::String(name.into())),
        ("general.name".into(), Value::String("K3 Mini".into())),
        (k("context_length"), u(cfg.max_seq_len)),
        (k("embedding_length"), u(cfg.d_model)),
        (k("block_count"), u(cfg.n_layers)),
        (k("feed_forward_length"), u(cfg.ffn_hidden)),
        (k("attention.head_count"), u(cfg.n_heads)),
        (
            k("attention.head_count_kv"),
            Value::Array(head_count_kv.collect()),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_eps as f32),
        ),
        (k("vocab_size"), u(cfg.vocab_size)),
        (k("rope.dimension_count"), u(mla.qk_rope_head_dim)),
        (k("attention.kv_lora_rank"), u(mla.kv_lora_rank)),
        (
            k("attention.key_length"),
            u(mla.kv_lora_rank + mla.qk_rope_head_dim),
        ),
        (k("attention.value_length"), u(mla.kv_lora_rank)),
        (
            k("attention.key_length_mla"),
            u(mla.qk_nope_head_dim + mla.qk_rope_head_dim),
        ),
        (k("attention.value_length_mla"), u(mla.v_head_dim)),
        (k("ssm.conv_kernel"), u(kda.conv_kernel)),
        (k("kda.head_dim"), u(kda.head_dim)),
        (
            k("expert_feed_forward_length"),
            u(moe.map_or(cfg.ffn_hidden, |m| m.expert_hidden)),
        ),
        (
            k("expert_shared_count"),
            u(moe.map_or(0, |m| m.num_shared_experts)),
        ),
        (
            k("leading_dense_block_count"),
            u(moe.map_or(cfg.n_layers, |m| m.first_dense_layers)),
        ),
        (
            k("expert_weights_scale"),
            Value::F32(moe.map_or(1.0, |m| m.routed_scaling_factor) as f32),
        ),
        (k("expert_gating_func"), u(2)), // sigmoid, as Kimi's router
    ];
    if let Some(m) = moe {
        metadata.extend([
            (k("expert_count"), u(m.num_experts)),
            (k("expert_used_count"), u(m.top_k)),
        ]);
    }
    if arch == GgufArch::KimiK3 {
        let (beta, linear_beta) = match cfg.activation {
            Activation::Situ => (SITU_BETA as f32, SITU_LINEAR_BETA as f32),
            Activation::Swiglu => SWIGLU_AS_SITU,
        };
        metadata.extend([
            // llama.cpp counts AttnRes blocks in layers, k3mini in sub-layers; 0 = off.
            (
                k("attn_res.block_size"),
                u(cfg.attn_res.as_ref().map_or(0, |a| a.block_size / 2)),
            ),
            (k("activation.situ_beta"), Value::F32(beta)),
            (k("activation.situ_linear_beta"), Value::F32(linear_beta)),
            (k("expert_weights_norm"), Value::Bool(true)),
        ]);
        if let Some(r) = mla.q_lora_rank {
            metadata.push((k("attention.q_lora_rank"), u(r)));
        }
        if let Some(lb) = kda.gate_lower_bound {
            metadata.push((k("kda.gate_lower_bound"), Value::F32(lb as f32)));
        }
        if let Some(l) = moe.and_then(|m| m.latent_dim) {
            metadata.push((k("expert_latent_length"), u(l)));
        }
    }
    metadata
}

/// The `tokenizer.*` metadata llama.cpp needs to run text end to end: copied from the local GGUF
/// teacher when the student uses its tokenizer (`data.tokenizer = "teacher"`), else converted
/// from the student's tokenizer.json (`tokenizer`, or the plan's).
pub fn gguf_tokenizer_metadata(
    spec: &TokenizerSpec,
    tokenizer: Option<&Tokenizer>,
    n_vocab: usize,
) -> Result<Vec<(String, Value)>> {
    if let (TokenizerSpec::Teacher { model }, None) = (spec, tokenizer) {
        let path = crate::teachers::local_model_path(model)?;
        let file = k3mini_gguf::GgufFile::open(&path)?;
        return Ok(file
            .keys
            .iter()
            .filter_map(|k| Some((k.clone(), file.get(k)?.clone())))
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .collect());
    }
    let found = match tokenizer {
        Some(t) => Some(t.clone()),
        None => plan_tokenizer(spec)?,
    };
    let json = found.as_ref().and_then(Tokenizer::json).with_context(|| {
        format!(
            "the GGUF carries the tokenizer, and the run's ({spec:?}) is not a tokenizer.json: \
             pass --tokenizer FILE"
        )
    })?;
    bpe_tokenizer_metadata(&serde_json::from_str(&json)?, n_vocab)
}

/// A byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer, as convert_hf_to_gguf.py
/// writes it: tokens by id (ids the model has beyond the vocabulary as `[PAD{i}]`, unused),
/// special added tokens as control tokens, merges as "a b", and the GPT-2 pre-tokenizer (`gpt-2`), which is
/// what a `ByteLevel` pre-tokenizer with `use_regex` splits by. Anything else is refused by name.
pub fn bpe_tokenizer_metadata(
    json: &serde_json::Value,
    n_vocab: usize,
) -> Result<Vec<(String, Value)>> {
    const NORMAL: i32 = 1;
    const CONTROL: i32 = 3;
    const USER_DEFINED: i32 = 4;
    const UNUSED: i32 = 5;
    let model = &json["model"];
    if model["type"] != "BPE" {
        bail!(
            "tokenizer model {}: only byte-level BPE converts to GGUF",
            model["type"]
        );
    }
    let pre = &json["pre_tokenizer"];
    if pre["type"] != "ByteLevel" || pre["use_regex"] == false || !json["normalizer"].is_null() {
        bail!(
            "tokenizer pre-tokenizer {pre} / normalizer {}: llama.cpp's gpt2 pre-tokenizer is \
             ByteLevel with use_regex and no normalizer",
            json["normalizer"]
        );
    }
    let vocab = model["vocab"]
        .as_object()
        .context("tokenizer.json: no model.vocab")?;
    let mut tokens: Vec<Option<String>> = vec![None; n_vocab];
    let mut types = vec![NORMAL; tokens.len()];
    for (piece, id) in vocab {
        let id = id.as_u64().context("tokenizer.json: a non-integer id")? as usize;
        anyhow::ensure!(
            id < n_vocab,
            "tokenizer token {piece:?} has id {id}, past the student's {n_vocab} ids"
        );
        tokens[id] = Some(piece.clone());
    }
    let mut eos = None;
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            bail!("tokenizer.json: malformed added token {added}");
        };
        let id = id as usize;
        anyhow::ensure!(
            id < n_vocab,
            "tokenizer token {content:?} has id {id}, past the student's {n_vocab} ids"
        );
        tokens[id] = Some(content.into());
        types[id] = if added["special"] == true {
            CONTROL
        } else {
            USER_DEFINED
        };
        if content == k3mini_data::tokenizer::BPE_EOS {
            eos = Some(id as u32);
        }
    }
    let tokens: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            Value::String(t.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            }))
        })
        .collect();
    let merges = model["merges"]
        .as_array()
        .context("tokenizer.json: no model.merges")?
        .iter()
        .map(|m| match (m.as_str(), m.as_array()) {
            (Some(s), _) => Ok(Value::String(s.into())),
            (_, Some(pair)) if pair.len() == 2 => Ok(Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap_or_default(),
                pair[1].as_str().unwrap_or_default()
            ))),
            _ => bail!("tokenizer.json: malformed merge {m}"),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut metadata = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt-2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    if let Some(id) = eos {
        metadata.extend([
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(id)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(id)),
        ]);
    }
    Ok(metadata)
}

/// `f` over `items` on every core (tensors quantise independently; K-quants are slow), in order.
fn parallel_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut out: Vec<(usize, R)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers.min(items.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break done };
                        done.push((i, f(item)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("quantiser thread panicked"))
            .collect()
    });
    out.sort_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, r)| r).collect()
}

/// Writes the student as a llama.cpp GGUF of file type `ftype` with its tokenizer (see
/// [`gguf_tokenizer_metadata`]); returns the bytes written.
pub fn export_gguf(
    ck: &Checkpoint,
    ftype: FileType,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
) -> Result<u64> {
    let (metadata, tensors) = student_gguf(ck)?;
    let tokenizer =
        gguf_tokenizer_metadata(&ck.plan.data.tokenizer, tokenizer, ck.plan.model.vocab_size)?;
    let mut w = GgufWriter::new();
    for (k, v) in metadata.into_iter().chain(tokenizer) {
        w.set(&k, v);
    }
    w.set("general.file_type", Value::U32(ftype.id()));
    if ftype != FileType::F32 && ftype != FileType::F16 {
        w.set("general.quantization_version", Value::U32(2));
    }
    let shapes: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|(n, ne, _)| (n.as_str(), &ne[..]))
        .collect();
    let types = tensor_types(&shapes, ck.plan.model.n_layers, ftype);
    let jobs: Vec<_> = tensors.iter().zip(types).collect();
    let bar = indicatif::ProgressBar::new(jobs.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "quantising {bar:30} {pos}/{len} tensors {elapsed}",
        )
        .expect("template"),
    );
    let quantised = parallel_map(&jobs, |((name, _, values), ty)| {
        let bytes = quantize(*ty, values).map_err(|e| anyhow::anyhow!("{name}: {e}"));
        bar.inc(1);
        bytes
    });
    bar.finish_and_clear();
    for (((name, ne, _), ty), bytes) in jobs.iter().zip(quantised) {
        w.add_tensor(name, ne, *ty, bytes?)?;
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    Ok(w.write(out)?)
}

/// One export of [`bench_export`].
#[derive(Debug, serde::Serialize)]
pub struct ExportTiming {
    pub quant: String,
    pub arch: &'static str,
    pub params: usize,
    pub seconds: f64,
    pub bytes: u64,
    pub path: PathBuf,
}

/// Times `k3mini export --format gguf` of a freshly initialised `preset` student (the export's
/// cost does not depend on the weights' values) for each file type, writing the files into `dir`.
/// The checkpoint's plan names the SmolLM2 teacher's tokenizer, so the preset's vocabulary must
/// be SmolLM2's (`smoke-300m`, `tiny` with `vocab_size = 49152`).
pub fn bench_export(preset: &str, quants: &[FileType], dir: &Path) -> Result<Vec<ExportTiming>> {
    // A real plan for the checkpoint: the preset student on the SmolLM2 teacher's tokenizer.
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("corpus.txt"), "Export benchmark.\n")?;
    let recipe = dir.join("bench-export.toml");
    std::fs::write(
        &recipe,
        format!(
            "[run]\nname = \"bench-export\"\nout_dir = {:?}\n[model]\npreset = \"{preset}\"\n\
             [data]\ntokenizer = \"teacher\"\nseq_len = 64\n[[data.sources]]\npath = \"corpus.txt\"\n\
             [teacher]\nmodel = \"smollm2\"\n[distill]\nobjectives = [{{ kind = \"ce\" }}]\n\
             [optim]\nlr = 1e-3\n[schedule]\nkind = \"constant\"\nwarmup_steps = 0\n\
             [train]\nsteps = 1\nbatch_tokens = 64\nmicro_batch = 1\n",
            dir.join("checkpoint").display().to_string()
        ),
    )?;
    let plan = crate::recipe::load(&recipe)?;
    let model = K3Mini::new(&plan.model, &Device::default())?;
    let params = k3mini_student::info::param_breakdown(&plan.model).total();
    let ck_dir = crate::run_dir::write_weights(&plan, &model, 0)?;
    drop(model);
    let ck = crate::run_dir::open_checkpoint(&ck_dir)?;
    quants
        .iter()
        .map(|&q| {
            let path = dir.join(format!("{preset}.{}.gguf", q.name()));
            let t0 = std::time::Instant::now();
            let bytes = export_gguf(&ck, q, None, &path)?;
            Ok(ExportTiming {
                quant: q.name().into(),
                arch: GgufArch::for_config(&ck.plan.model).name(),
                params,
                seconds: t0.elapsed().as_secs_f64(),
                bytes,
                path,
            })
        })
        .collect()
}
