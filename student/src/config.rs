//! Model configuration: every hyperparameter of the K3 Mini student, with validation that names the
//! offending field instead of panicking deep inside a layer.

/// This file, for `k3mini recipe reference`: its doc comments document `[model]`'s keys.
pub const CONFIG_SOURCE: &str = include_str!("config.rs");

use crate::precision::Precision;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The token mixer of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerKind {
    /// Kimi Delta Attention: linear attention with a fixed-size state.
    Kda,
    /// Gated Multi-head Latent Attention: softmax attention over a compressed KV cache.
    Mla,
}

/// FFN activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// `silu(gate) * up`.
    #[default]
    Swiglu,
    /// K3's soft-capped `[b tanh(gate/b) sigmoid(gate)] * [b_lin tanh(up/b_lin)]`.
    Situ,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KdaConfig {
    /// Head dimension dk = dv.
    pub head_dim: usize,
    /// Short causal depthwise convolution width.
    #[serde(default = "default_conv")]
    pub conv_kernel: usize,
    /// Rank of the output-gate projection d -> r -> H*dv; `None` = K3's full-rank gate d -> H*dv.
    #[serde(default)]
    pub gate_rank: Option<usize>,
    /// K3's "safe gate": g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in (lower_bound, 0).
    #[serde(default)]
    pub gate_lower_bound: Option<f64>,
    /// Chunk length of the chunkwise training kernel.
    #[serde(default = "default_chunk")]
    pub chunk_size: usize,
    /// Which KDA kernel the training forward uses.
    #[serde(default)]
    pub kernel: KdaKernel,
}

/// KDA kernel used for multi-token forwards (decode always uses the single-token step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum KdaKernel {
    /// Chunkwise-parallel WY/UT form as one op that keeps its inputs and the chunk-boundary
    /// states and recomputes the rest in its backward (`k3mini_kernels::fused_chunk_kda`).
    #[default]
    Chunk,
    /// The same form composed of tensor ops, every intermediate kept for the backward
    /// (reference; the same forward values, more memory).
    Composed,
    /// Token-by-token recurrence (reference; slow).
    Naive,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlaConfig {
    /// q-LoRA rank (K3: 1536); `None` = a full q projection (Kimi Linear).
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    /// The un-rotated "rope" slice (NoPE: it exists but is never rotated), shared across heads.
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// K3's per-head sigmoid gate on the attention output.
    #[serde(default)]
    pub output_gate: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: usize,
    pub num_shared_experts: usize,
    /// Width of one routed (and shared) expert.
    pub expert_hidden: usize,
    #[serde(default = "default_scaling")]
    pub routed_scaling_factor: f64,
    /// LatentMoE: routed experts run in this latent width (< d_model).
    #[serde(default)]
    pub latent_dim: Option<usize>,
    /// The first layers keep a dense FFN (Kimi Linear: 1).
    #[serde(default = "default_dense_layers")]
    pub first_dense_layers: usize,
    /// Aux-loss-free balancing step: b_i += rate * sign(mean_load - load_i).
    #[serde(default = "default_bias_rate")]
    pub bias_update_rate: f64,
    /// α of DeepSeek-V3's complementary sequence-wise balance loss, added to the training loss
    /// (0 = off). The bias update only decides which expert wins; this gradient keeps a router
    /// from sending every token the same way (see `moe::sequence_balance_loss`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub balance_loss_weight: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttnResConfig {
    /// Block size in sub-layers (attention and FFN each count one): 1 = full AttnRes, else even.
    pub block_size: usize,
}

/// The whole student.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Token vocabulary: the teacher's (the student must use its tokenizer).
    pub vocab_size: usize,
    /// Hidden width.
    pub d_model: usize,
    /// Layers (mixer + FFN each).
    pub n_layers: usize,
    /// One head count for KDA and MLA layers (llama.cpp's kimi-linear graph requires it).
    pub n_heads: usize,
    /// Mixer pattern, `K` = KDA and `M` = MLA, repeated over the depth (default `KKKM`).
    #[serde(default = "default_pattern")]
    pub layer_pattern: String,
    /// Force the last layer to MLA (Kimi Linear does).
    #[serde(default = "yes")]
    pub last_layer_mla: bool,
    /// Dense FFN width.
    pub ffn_hidden: usize,
    #[serde(default)]
    pub activation: Activation,
    pub kda: KdaConfig,
    pub mla: MlaConfig,
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    #[serde(default)]
    pub attn_res: Option<AttnResConfig>,
    #[serde(default = "default_eps")]
    pub rms_eps: f64,
    /// Context length the model is trained for (metadata for export and memory estimates).
    #[serde(default = "default_ctx")]
    pub max_seq_len: usize,
    /// The precision of the matrix products (`f32`, or `bf16` with f32 everything else; see
    /// [`crate::precision`]).
    #[serde(default, skip_serializing_if = "Precision::is_f32")]
    pub precision: Precision,
}

fn default_conv() -> usize {
    4
}
fn default_chunk() -> usize {
    64
}
fn default_scaling() -> f64 {
    2.446
}
fn default_dense_layers() -> usize {
    1
}
fn default_bias_rate() -> f64 {
    1e-3
}
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}
fn default_pattern() -> String {
    "KKKM".into()
}
fn yes() -> bool {
    true
}
fn default_eps() -> f64 {
    1e-5
}
fn default_ctx() -> usize {
    4096
}

/// A configuration error, naming the offending field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid model config: `{field}`: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

pub(crate) fn bad(field: &str, message: impl fmt::Display) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.to_string(),
    }
}

impl ModelConfig {
    /// The mixer of every layer: the pattern repeated over the depth, last layer MLA if asked.
    pub fn layer_kinds(&self) -> Result<Vec<LayerKind>, ConfigError> {
        let unit = self
            .layer_pattern
            .chars()
            .filter(|c| !c.is_whitespace() && *c != ',')
            .map(|c| match c.to_ascii_uppercase() {
                'K' => Ok(LayerKind::Kda),
                'M' => Ok(LayerKind::Mla),
                other => Err(bad(
                    "layer_pattern",
                    format!("unknown layer type {other:?} (use K for KDA, M for MLA)"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if unit.is_empty() {
            return Err(bad("layer_pattern", "is empty"));
        }
        let mut kinds: Vec<_> = unit.iter().copied().cycle().take(self.n_layers).collect();
        if self.last_layer_mla
            && let Some(last) = kinds.last_mut()
        {
            *last = LayerKind::Mla;
        }
        Ok(kinds)
    }

    /// Whether layer `i` uses the MoE FFN.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| i >= m.first_dense_layers)
    }

    /// Checks every constraint the layers rely on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("ffn_hidden", self.ffn_hidden),
            ("kda.head_dim", self.kda.head_dim),
            ("kda.conv_kernel", self.kda.conv_kernel),
            ("kda.chunk_size", self.kda.chunk_size),
            ("mla.kv_lora_rank", self.mla.kv_lora_rank),
            ("mla.qk_nope_head_dim", self.mla.qk_nope_head_dim),
            ("mla.v_head_dim", self.mla.v_head_dim),
            ("max_seq_len", self.max_seq_len),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(bad(field, "must be positive"));
            }
        }
        self.layer_kinds()?;
        if self.d_model % self.n_heads != 0 {
            return Err(bad(
                "n_heads",
                format!(
                    "d_model {} is not divisible by n_heads {}",
                    self.d_model, self.n_heads
                ),
            ));
        }
        if self.kda.gate_rank == Some(0) {
            return Err(bad(
                "kda.gate_rank",
                "must be positive (omit it for a full-rank gate)",
            ));
        }
        if let Some(lb) = self.kda.gate_lower_bound
            && !(lb < 0.0 && lb.is_finite())
        {
            return Err(bad(
                "kda.gate_lower_bound",
                format!("must be a finite negative number, got {lb}"),
            ));
        }
        if self.mla.q_lora_rank == Some(0) {
            return Err(bad(
                "mla.q_lora_rank",
                "must be positive (omit it for a full q projection)",
            ));
        }
        if !(self.rms_eps > 0.0) {
            return Err(bad("rms_eps", "must be positive"));
        }
        if let Some(moe) = &self.moe {
            if moe.num_experts == 0 || moe.expert_hidden == 0 {
                return Err(bad(
                    "moe.num_experts",
                    "experts and their width must be positive",
                ));
            }
            if moe.top_k == 0 || moe.top_k > moe.num_experts {
                return Err(bad(
                    "moe.top_k",
                    format!(
                        "must be in 1..={} (num_experts), got {}",
                        moe.num_experts, moe.top_k
                    ),
                ));
            }
            if let Some(l) = moe.latent_dim
                && (l == 0 || l >= self.d_model)
            {
                return Err(bad(
                    "moe.latent_dim",
                    format!("must be in 1..{} (d_model), got {l}", self.d_model),
                ));
            }
            if moe.first_dense_layers > self.n_layers {
                return Err(bad("moe.first_dense_layers", "exceeds n_layers"));
            }
        }
        if let Some(ar) = &self.attn_res
            && (ar.block_size == 0 || (ar.block_size != 1 && ar.block_size % 2 != 0))
        {
            return Err(bad(
                "attn_res.block_size",
                format!(
                    "must be 1 (full AttnRes) or an even number of sub-layers, got {}",
                    ar.block_size
                ),
            ));
        }
        Ok(())
    }
}
