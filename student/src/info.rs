//! Analytic accounting from a config alone (no weights allocated, so it works for the 16B preset):
//! exact parameter counts per component, a training-memory estimate and inference-state sizes.
//! `tests/it/config_and_info.rs` checks the counts against instantiated models.

use crate::config::{KdaKernel, LayerKind, ModelConfig};
use crate::head::HeadChunks;
use serde::Serialize;

/// Parameters per component. Every field is an exact count.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct ParamBreakdown {
    pub embedding: usize,
    pub lm_head: usize,
    pub kda_mixers: usize,
    pub mla_mixers: usize,
    pub dense_ffn: usize,
    pub moe_router: usize,
    pub moe_routed_experts: usize,
    pub moe_shared_experts: usize,
    pub moe_latent: usize,
    pub norms: usize,
    pub attn_res: usize,
}

impl ParamBreakdown {
    pub fn total(&self) -> usize {
        self.embedding
            + self.lm_head
            + self.kda_mixers
            + self.mla_mixers
            + self.dense_ffn
            + self.moe_router
            + self.moe_routed_experts
            + self.moe_shared_experts
            + self.moe_latent
            + self.norms
            + self.attn_res
    }

    /// Component name and count, in display order.
    pub fn rows(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("embedding", self.embedding),
            ("lm_head", self.lm_head),
            ("kda mixers", self.kda_mixers),
            ("mla mixers", self.mla_mixers),
            ("dense ffn", self.dense_ffn),
            ("moe router", self.moe_router),
            ("moe routed experts", self.moe_routed_experts),
            ("moe shared experts", self.moe_shared_experts),
            ("moe latent proj", self.moe_latent),
            ("norms", self.norms),
            ("attn_res", self.attn_res),
        ]
    }
}

/// Parameters of one KDA mixer.
pub fn kda_params(c: &ModelConfig) -> usize {
    let (d, h, hd) = (c.d_model, c.n_heads, c.kda.head_dim);
    let inner = h * hd;
    let gate = match c.kda.gate_rank {
        Some(r) => d * r + r * inner,
        None => d * inner,
    };
    3 * d * inner                       // q, k, v
        + 3 * inner * c.kda.conv_kernel // short conv
        + d * hd + hd * inner + inner + h // forget gate: f_a, f_b, dt_bias, A_log
        + d * h                         // beta
        + gate
        + hd                            // o_norm
        + inner * d // o_proj
}

/// Parameters of one MLA mixer.
pub fn mla_params(c: &ModelConfig) -> usize {
    let (d, h, m) = (c.d_model, c.n_heads, &c.mla);
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let q = match m.q_lora_rank {
        None => d * h * qk,
        Some(r) => d * r + r + r * h * qk,
    };
    q + d * (m.kv_lora_rank + m.qk_rope_head_dim)
        + m.kv_lora_rank
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
        + if m.output_gate {
            d * h * m.v_head_dim
        } else {
            0
        }
        + h * m.v_head_dim * d
}

/// Exact parameter counts. The config must be valid.
pub fn param_breakdown(c: &ModelConfig) -> ParamBreakdown {
    let kinds = c.layer_kinds().expect("validated config");
    let d = c.d_model;
    let mut p = ParamBreakdown {
        embedding: c.vocab_size * d,
        lm_head: d * c.vocab_size,
        norms: d + 2 * d * c.n_layers,
        ..Default::default()
    };
    for (i, kind) in kinds.iter().enumerate() {
        match kind {
            LayerKind::Kda => p.kda_mixers += kda_params(c),
            LayerKind::Mla => p.mla_mixers += mla_params(c),
        }
        match &c.moe {
            Some(m) if c.is_moe_layer(i) => {
                let d_in = m.latent_dim.unwrap_or(d);
                p.moe_router += m.num_experts * d + m.num_experts;
                p.moe_routed_experts += 3 * m.num_experts * m.expert_hidden * d_in;
                p.moe_shared_experts += 3 * d * m.expert_hidden * m.num_shared_experts;
                p.moe_latent += m.latent_dim.map_or(0, |l| 2 * d * l + l);
            }
            _ => p.dense_ffn += 3 * d * c.ffn_hidden,
        }
    }
    if c.attn_res.is_some() {
        // A depth attention (query + key norm: 2d) before every sub-layer but the first (2L − 1),
        // plus the final aggregation.
        p.attn_res = 2 * d * 2 * c.n_layers;
    }
    p
}

/// Parameters one token touches (routed experts counted for top-k only).
pub fn active_params(c: &ModelConfig) -> usize {
    let p = param_breakdown(c);
    match &c.moe {
        None => p.total(),
        Some(m) => {
            let moe_layers = (0..c.n_layers).filter(|&i| c.is_moe_layer(i)).count();
            let d_in = m.latent_dim.unwrap_or(c.d_model);
            p.total() - moe_layers * 3 * (m.num_experts - m.top_k) * m.expert_hidden * d_in
        }
    }
}

/// Model FLOPs of one training token (forward + backward, the convention of PaLM's MFU): `6` per
/// weight a token multiplies by (active parameters less the embedding table, which is a lookup),
/// and the token mixers' sequence terms, forward `×3`:
///
/// ```text
/// MLA, causal (a token attends to (T + 1)/2 on average):  2 · h · (d_qk + d_v) · (T + 1)/2
/// KDA, chunk C: intra-chunk scores and their use          2 · h · C · (2 d_k + d_v)
///               state read, write and output               2 · h · 3 · d_k · d_v
/// ```
/// (KDA's `d_k = d_v`: one `kda.head_dim`.)
pub fn train_flops_per_token(c: &ModelConfig, seq_len: usize) -> f64 {
    let kinds = c.layer_kinds().expect("validated config");
    let (h, m) = (c.n_heads as f64, &c.mla);
    let (dk, chunk) = (c.kda.head_dim as f64, c.kda.chunk_size.min(seq_len) as f64);
    let mla = 2.0
        * h
        * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) as f64
        * (seq_len as f64 + 1.0)
        / 2.0;
    let kda = 2.0 * h * chunk * 3.0 * dk + 2.0 * h * 3.0 * dk * dk;
    let mixers: f64 = kinds
        .iter()
        .map(|k| match k {
            LayerKind::Kda => kda,
            LayerKind::Mla => mla,
        })
        .sum();
    let matmul_params = (active_params(c) - param_breakdown(c).embedding) as f64;
    6.0 * matmul_params + 3.0 * mixers
}

/// How a training step is laid out on devices, for [`training_memory`].
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Footprint {
    /// Sequences per micro-batch.
    pub batch: usize,
    pub seq_len: usize,
    /// Activation checkpointing: each sub-layer keeps its input ([`crate::K3Mini::with_checkpointing`]).
    pub activation_checkpointing: bool,
    /// Data-parallel replicas (1: one device).
    pub replicas: usize,
    /// Micro-batches a step sums (`train.batch_tokens` over a micro-batch's tokens): beyond one,
    /// the step's gradient sum is held while the next micro-batch's gradients form.
    pub micro_batches: usize,
    /// `train.head_chunk` (see [`HeadChunks::resolve`]); unset, the default.
    pub head_chunk: Option<usize>,
}

impl Footprint {
    pub fn new(batch: usize, seq_len: usize) -> Self {
        Self {
            batch,
            seq_len,
            activation_checkpointing: false,
            replicas: 1,
            micro_batches: 1,
            head_chunk: None,
        }
    }
}

/// `[c, V]` tensors a chunk of the head holds at its peak: the logits, the log-softmax the loss
/// keeps, and in the chunk's backward the gradients of both.
pub const HEAD_CHUNK_COPIES: usize = 4;

/// Training memory of the busiest device, in bytes: f32 master weights, gradients and AdamW
/// moments, and the activations of one micro-batch. A step of several micro-batches holds the
/// sum of the gradients so far while the next micro-batch's form. With replicas every device
/// holds the weights and its micro-batch's gradients, and the optimizer state is sharded
/// (`k3mini::train::parallel`): a device holds the summed gradients and AdamW moments of the
/// parameters it owns, and the gradients of those parameters arriving from another replica.
#[derive(Clone, Debug, Serialize)]
pub struct TrainingMemory {
    pub footprint: Footprint,
    /// Parameters the busiest device owns: all on one device; with replicas the estimate
    /// [`owned_params`] makes of [`shard_by_bytes`]'s sharing.
    pub owned_params: usize,
    pub weights: usize,
    /// The micro-batch's gradients, and where a step sums several (micro-batches or replicas)
    /// the owned parameters' sum besides.
    pub grads: usize,
    pub adamw: usize,
    /// The owned parameters' gradients arriving from another replica (0 on one device).
    pub replica_grads: usize,
    /// Values the autodiff graph keeps for backward (an estimate from the layer formulas): what
    /// is kept of the trunk and the head's, then the largest transient.
    pub activations: usize,
    /// The activations by part: each kind before checkpointing, what is kept of the trunk, the
    /// head and the largest transient.
    pub parts: ActivationParts,
}

/// A micro-batch's activation bytes by where they are kept.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ActivationParts {
    /// What the graph keeps of the trunk: all of it, or with activation checkpointing each
    /// sub-layer's input (a mixer or a dense FFN is one recompute region, `crate::model`) and a
    /// MoE FFN's activations.
    pub trunk_kept: usize,
    /// KDA token mixers, all layers.
    pub kda: usize,
    /// Gated MLA token mixers, all layers.
    pub mla: usize,
    /// Dense and MoE FFNs, all layers.
    pub ffn: usize,
    /// Norms and residual streams of every layer (AttnRes's partial sums), the final norm.
    pub residual: usize,
    /// The LM head and its loss, kept after the forward: with chunks, the gradient of the head's
    /// input per token and the head weight's gradient; whole, the log-softmax of every token's
    /// logits.
    pub head: usize,
    /// The largest transient on top of what is kept: one chunk of the head (its `[c, V]` tensors,
    /// [`HEAD_CHUNK_COPIES`], and the weight gradient arriving), or a region the backward
    /// recomputes with its gradients (one layer's KDA chunk terms for a group of chunks, one FFN's
    /// gated product, one chunk of attention scores).
    pub transient: usize,
}

impl ActivationParts {
    /// Everything but the head, before checkpointing.
    pub fn trunk(&self) -> usize {
        self.kda + self.mla + self.ffn + self.residual
    }
}

impl TrainingMemory {
    /// What the graph holds at the end of the forward: the activations but the transient.
    pub fn kept(&self) -> usize {
        self.activations - self.parts.transient
    }

    pub fn total(&self) -> usize {
        self.weights + self.grads + self.adamw + self.replica_grads + self.activations
    }
}

/// Shares `sizes` (parameters' element counts, in the model's order) among `devices` by bytes:
/// the largest first, each to the device holding the fewest so far (ties to the lowest index).
/// Returns each parameter's device. The busiest device holds at most `Σ/devices` plus the largest
/// parameter it was given last (Graham's bound for largest-first scheduling).
pub fn shard_by_bytes(sizes: &[usize], devices: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i])); // stable: ties keep the model's order
    let mut held = vec![0usize; devices.max(1)];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let d = (0..held.len()).min_by_key(|&d| held[d]).expect("a device");
        owner[i] = d;
        held[d] += sizes[i];
    }
    owner
}

/// The parameters the busiest of `devices` owns under [`shard_by_bytes`], estimated from the
/// config: an even share, or the largest tensor (the embedding or the head, `vocab × d`) when
/// that is more. Largest-first sharing exceeds it by at most the last tensor it places; the
/// presets' real sharing is within 1% of it (`tests/it/config_and_info.rs`).
pub fn owned_params(c: &ModelConfig, devices: usize) -> usize {
    let params = param_breakdown(c).total();
    match devices {
        0 | 1 => params,
        n => params.div_ceil(n).max(c.vocab_size * c.d_model),
    }
}

/// GPUs the fit table names, with the memory `nvidia-smi` reports for each.
pub const GPUS: [(&str, usize); 3] = [
    ("24 GB (RTX 4090, L4)", 24_564 << 20),
    ("80 GB (A100, H100)", 81_559 << 20),
    ("141 GB (H200)", 143_771 << 20),
];

/// Of a device's memory, what training may plan on: the rest is the CUDA context, the
/// allocator's fragmentation and workspace.
pub const USABLE_SHARE: f64 = 0.9;

/// Estimates training memory for `f`'s micro-batch and layout.
pub fn training_memory(c: &ModelConfig, f: &Footprint) -> TrainingMemory {
    let (batch, seq_len) = (f.batch, f.seq_len);
    const F32: usize = 4;
    let params = param_breakdown(c).total();
    let owned = owned_params(c, f.replicas);
    let sharded = f.replicas > 1;
    let kinds = c.layer_kinds().expect("validated config");
    let (d, h) = (c.d_model, c.n_heads);
    let inner = h * c.kda.head_dim;
    let chunk = c.kda.chunk_size.min(seq_len.max(1));
    let m = &c.mla;
    // Saved values per token (recompute regions keep their inputs, not their intermediates).
    // KDA: the padded conv input (conv, silu and L2 norms are one region), q, k, v, the forget
    // gate's input and g, β, the kernel, its output and the output gate's input (norm and gate:
    // one region), and the region's output; the low-rank gate inputs (dk each). The fused op
    // keeps the state entering each chunk (dk·dv per head per chunk). The composed forms keep the
    // chunk kernel's decays within and across sub-chunks (k3mini_kernels::kda::chunk), the UT
    // inverse's blocks, A_kk and A_qk (the naive recurrence: more, not modelled).
    let sub = k3mini_kernels::kda::sub_chunk(chunk);
    let composed_kernel =
        3 * sub * inner + 3 * (chunk / sub) * inner + sub * sub * h + 2 * chunk * h;
    let kernel = match c.kda.kernel {
        KdaKernel::Chunk => inner * c.kda.head_dim / chunk,
        KdaKernel::Composed | KdaKernel::Naive => composed_kernel,
    };
    let kda = 11 * inner + kernel + 2 * c.kda.head_dim + h;
    // MLA: q (with q-LoRA also its latent, into and out of its norm), the latents (into and out
    // of their norm), k_n | v as projected, k, then the
    // attention's output, the gate and their product; the scores are recomputed (a chunk of
    // queries at a time, [`crate::mla::SCORES_AT_ONCE`]).
    let mla = h * (m.qk_nope_head_dim + m.qk_rope_head_dim) * 2
        + 2 * (m.kv_lora_rank + m.qk_rope_head_dim)
        + h * (m.qk_nope_head_dim + m.v_head_dim)
        + 3 * h * m.v_head_dim
        + m.q_lora_rank.map_or(0, |r| 2 * r);
    let tokens = batch * seq_len;
    let bytes = |per_token: usize| per_token * tokens * F32;
    let mut parts = ActivationParts::default();
    let mut widest_ffn = 0;
    // With checkpointing, one sub-layer recomputed while it is differentiated.
    let mut widest_layer = 0;
    for (i, kind) in kinds.iter().enumerate() {
        let mixer = match kind {
            LayerKind::Kda => bytes(kda),
            LayerKind::Mla => bytes(mla),
        };
        match kind {
            LayerKind::Kda => parts.kda += mixer,
            LayerKind::Mla => parts.mla += mixer,
        }
        // The gated product is a region: gate and up, and the product the down projection reads.
        let moe = c.moe.as_ref().filter(|_| c.is_moe_layer(i));
        let hidden = match moe {
            Some(moe) => moe.expert_hidden * (moe.top_k + moe.num_shared_experts),
            None => c.ffn_hidden,
        };
        widest_ffn = widest_ffn.max(hidden);
        // Router scores of a MoE layer.
        let ffn = bytes(3 * hidden) + moe.map_or(0, |m| bytes(2 * m.num_experts));
        parts.ffn += ffn;
        // Per sub-layer: its input and its norm's output (regions), with AttnRes also the depth
        // stream's partial sum (the aggregation is a region reading it).
        let stream = if c.attn_res.is_some() { 3 } else { 2 };
        parts.residual += bytes(2 * stream * d);
        // With checkpointing a sub-layer (a mixer, a dense FFN) is one region keeping its input
        // (and, with AttnRes, the partial sum); a MoE FFN keeps what it did.
        parts.trunk_kept += if f.activation_checkpointing {
            let input = bytes((stream - 1) * d);
            widest_layer = widest_layer.max(mixer + bytes(d));
            input
                + match moe {
                    Some(_) => ffn + bytes(stream * d),
                    None => {
                        widest_layer = widest_layer.max(ffn + bytes(d));
                        input
                    }
                }
        } else {
            mixer + ffn + bytes(2 * stream * d)
        };
    }
    // The final norm's input and output.
    parts.residual += bytes(2 * d);
    parts.trunk_kept += bytes(2 * d);
    // The largest transient: the fused op's chunk terms for one group of chunks of one layer,
    // one FFN's gated product (its activation's three intermediates), one chunk of attention
    // scores (scores, probabilities, their gradient), or one chunk of the head.
    let n_chunks = seq_len.max(1).div_ceil(chunk);
    let kda_group = if c.kda.kernel == KdaKernel::Chunk && kinds.contains(&LayerKind::Kda) {
        2 * bytes(composed_kernel) / n_chunks * k3mini_kernels::kda::group_chunks(n_chunks)
    } else {
        0
    };
    let attention = if kinds.contains(&LayerKind::Mla) {
        let per_row = batch * h * seq_len;
        3 * F32 * per_row * crate::mla::query_rows(per_row, seq_len, crate::mla::SCORES_AT_ONCE)
    } else {
        0
    };
    let within = kda_group.max(bytes(3 * widest_ffn)).max(attention);
    let mut transient = widest_layer + within;
    let v = c.vocab_size;
    let chunks = HeadChunks::resolve(f.head_chunk, v);
    parts.head = if chunks.cuts(tokens) {
        let chunk = HEAD_CHUNK_COPIES * chunks.tokens_at_once(tokens) * v * F32 + d * v * F32;
        transient = transient.max(chunk);
        bytes(d) + d * v * F32
    } else {
        // Forming the log-softmax and, in the backward, the logits' gradient: a few more copies.
        transient = transient.max((HEAD_CHUNK_COPIES - 1) * bytes(v));
        bytes(v)
    };
    parts.transient = transient;
    TrainingMemory {
        footprint: *f,
        owned_params: owned,
        weights: params * F32,
        grads: if sharded || f.micro_batches > 1 {
            (params + owned) * F32
        } else {
            params * F32
        },
        adamw: 2 * owned * F32,
        replica_grads: if sharded { owned * F32 } else { 0 },
        activations: parts.trunk_kept + parts.head + parts.transient,
        parts,
    }
}

/// Inference state for one sequence at a context length, f32 values.
#[derive(Clone, Debug, Serialize)]
pub struct StateSize {
    pub context: usize,
    /// The hybrid: KDA states (constant) + MLA latent caches (linear in context).
    pub hybrid_bytes: usize,
    /// An all-MLA model of the same shape.
    pub all_mla_bytes: usize,
}

impl StateSize {
    /// Fraction saved versus all-MLA.
    pub fn saving(&self) -> f64 {
        1.0 - self.hybrid_bytes as f64 / self.all_mla_bytes as f64
    }
}

/// Inference state bytes at `context` tokens.
pub fn state_size(c: &ModelConfig, context: usize) -> StateSize {
    const F32: usize = 4;
    let kinds = c.layer_kinds().expect("validated config");
    let inner = c.n_heads * c.kda.head_dim;
    let kda_layer =
        c.n_heads * c.kda.head_dim * c.kda.head_dim + (c.kda.conv_kernel - 1) * 3 * inner;
    let mla_layer = context * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim);
    let hybrid: usize = kinds
        .iter()
        .map(|k| match k {
            LayerKind::Kda => kda_layer,
            LayerKind::Mla => mla_layer,
        })
        .sum();
    StateSize {
        context,
        hybrid_bytes: hybrid * F32,
        all_mla_bytes: c.n_layers * mla_layer * F32,
    }
}

/// Everything `k3mini model info` shows.
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    pub name: String,
    pub config: ModelConfig,
    pub layer_pattern: String,
    pub total_params: usize,
    pub active_params: usize,
    pub breakdown: ParamBreakdown,
    pub training_memory: TrainingMemory,
    pub training_memory_total: usize,
    pub inference_state: Vec<StateSize>,
}

/// Contexts the state comparison is shown at.
pub const STATE_CONTEXTS: [usize; 3] = [4096, 32_768, 131_072];

/// Gathers [`ModelInfo`] for a validated config.
pub fn model_info(name: &str, c: &ModelConfig, footprint: &Footprint) -> ModelInfo {
    let breakdown = param_breakdown(c);
    let training_memory = training_memory(c, footprint);
    let pattern = c
        .layer_kinds()
        .expect("validated config")
        .iter()
        .map(|k| match k {
            LayerKind::Kda => 'K',
            LayerKind::Mla => 'M',
        })
        .collect();
    ModelInfo {
        name: name.into(),
        config: c.clone(),
        layer_pattern: pattern,
        total_params: breakdown.total(),
        active_params: active_params(c),
        training_memory_total: training_memory.total(),
        breakdown,
        training_memory,
        inference_state: STATE_CONTEXTS.iter().map(|&n| state_size(c, n)).collect(),
    }
}
