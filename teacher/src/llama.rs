//! The llama architecture (SmolLM2, Llama 2/3, Mistral-style dense models), inference only, with a
//! KV cache. Per layer, pre-norm:
//!
//! ```text
//! h = x + W_o · attn(RoPE(W_q · n₁(x)), RoPE(W_k · n₁(x)), W_v · n₁(x))     n = RMSNorm
//! y = h + W_down · (silu(W_gate · n₂(h)) ⊙ W_up · n₂(h))
//! attn: softmax(q kᵀ / √d + causal) v, each of the kv heads shared by H / H_kv query heads (GQA)
//! RoPE (rotate-half, as transformers): for i < d/2, θ_i = base^(−2i/d),
//!   (x_i, x_{i+d/2}) ↦ (x_i cos tθ_i − x_{i+d/2} sin tθ_i, x_{i+d/2} cos tθ_i + x_i sin tθ_i)
//! logits = W_out · n_f(x), W_out = the embedding when tied
//! ```
//! Weights are kept in transformers' layout; GGUF's interleaved-pair q/k rows are un-permuted when
//! loading (see [`crate::gguf::unpermute_rope_rows`]).

use burn::tensor::{Bool, Device, Int, Tensor, TensorData, activation};
use k3mini_kernels::norm::rms_normalize;

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub context_length: usize,
}

/// One decoder layer's weights, each `[in, out]` (activations multiply on the right).
pub struct LlamaLayer {
    pub attn_norm: Tensor<1>,
    pub wq: Tensor<2>,
    pub wk: Tensor<2>,
    pub wv: Tensor<2>,
    pub wo: Tensor<2>,
    pub ffn_norm: Tensor<1>,
    pub w_gate: Tensor<2>,
    pub w_up: Tensor<2>,
    pub w_down: Tensor<2>,
}

pub struct Llama {
    pub config: LlamaConfig,
    /// `[vocab, hidden]`.
    pub embed: Tensor<2>,
    pub layers: Vec<LlamaLayer>,
    pub norm: Tensor<1>,
    /// `[hidden, vocab]`; the transposed embedding when tied.
    pub lm_head: Tensor<2>,
}

/// Keys and values of every position seen so far, per layer: `[B, H_kv, S, d]`.
#[derive(Clone, Default)]
pub struct KvCache {
    layers: Vec<(Tensor<4>, Tensor<4>)>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dims()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `(cos, sin)` of positions `start..start+t`, each `[t, d]` (the d/2 angles repeated for both halves).
fn rope_tables(
    start: usize,
    t: usize,
    d: usize,
    theta: f64,
    device: &Device,
) -> (Tensor<2>, Tensor<2>) {
    let half = d / 2;
    let mut cos = Vec::with_capacity(t * d);
    let mut sin = Vec::with_capacity(t * d);
    for pos in start..start + t {
        for _ in 0..2 {
            for i in 0..half {
                let angle = pos as f64 * theta.powf(-2.0 * i as f64 / d as f64);
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
    }
    (
        Tensor::from_data(TensorData::new(cos, [t, d]), device),
        Tensor::from_data(TensorData::new(sin, [t, d]), device),
    )
}

/// Rotate-half RoPE on `[B, H, T, d]`.
fn rope(x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
    let d = x.dims()[3];
    let x1 = x.clone().narrow(3, 0, d / 2);
    let x2 = x.clone().narrow(3, d / 2, d / 2);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone().unsqueeze::<4>() + rotated * sin.clone().unsqueeze::<4>()
}

impl Llama {
    pub fn device(&self) -> Device {
        self.embed.device()
    }

    /// Logits `[B, T, vocab]` of `tokens` `[B, T]`, continuing from (and extending) `cache`.
    pub fn forward(&self, tokens: Tensor<2, Int>, cache: &mut KvCache) -> Tensor<3> {
        let c = &self.config;
        let [b, t] = tokens.dims();
        let device = self.device();
        let past = cache.len();
        let (cos, sin) = rope_tables(past, t, c.head_dim, c.rope_theta, &device);
        let mut x = self
            .embed
            .clone()
            .select(0, tokens.reshape([b * t]))
            .reshape([b, t, c.hidden]);
        let future = Tensor::<2, Bool>::tril_mask([t, past + t], past as i64, &device);
        let group = c.heads / c.kv_heads;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = rms_normalize(x.clone(), c.rms_eps) * layer.attn_norm.clone().unsqueeze::<3>();
            let heads = |w: &Tensor<2>, n: usize| {
                h.clone()
                    .matmul(w.clone().unsqueeze::<3>())
                    .reshape([b, t, n, c.head_dim])
                    .swap_dims(1, 2) // [B, n, T, d]
            };
            let q = rope(heads(&layer.wq, c.heads), &cos, &sin);
            let mut k = rope(heads(&layer.wk, c.kv_heads), &cos, &sin);
            let mut v = heads(&layer.wv, c.kv_heads);
            if let Some((pk, pv)) = cache.layers.get(i) {
                k = Tensor::cat(vec![pk.clone(), k], 2);
                v = Tensor::cat(vec![pv.clone(), v], 2);
            }
            match cache.layers.get_mut(i) {
                Some(slot) => *slot = (k.clone(), v.clone()),
                None => cache.layers.push((k.clone(), v.clone())),
            }
            let s = past + t;
            // GQA: query head j reads kv head j / group.
            let expand = |x: Tensor<4>| {
                x.unsqueeze_dim::<5>(2)
                    .expand([b, c.kv_heads, group, s, c.head_dim])
                    .reshape([b, c.heads, s, c.head_dim])
            };
            let scores = q.matmul(expand(k).swap_dims(2, 3)) / (c.head_dim as f64).sqrt(); // [B, H, T, S]
            let scores = scores.mask_fill(future.clone().unsqueeze::<4>(), f32::NEG_INFINITY);
            let o = activation::softmax(scores, 3)
                .matmul(expand(v))
                .swap_dims(1, 2)
                .reshape([b, t, c.heads * c.head_dim]);
            x = x + o.matmul(layer.wo.clone().unsqueeze::<3>());
            let h = rms_normalize(x.clone(), c.rms_eps) * layer.ffn_norm.clone().unsqueeze::<3>();
            let gate = activation::silu(h.clone().matmul(layer.w_gate.clone().unsqueeze::<3>()));
            let up = h.matmul(layer.w_up.clone().unsqueeze::<3>());
            x = x + (gate * up).matmul(layer.w_down.clone().unsqueeze::<3>());
        }
        let x = rms_normalize(x, c.rms_eps) * self.norm.clone().unsqueeze::<3>();
        x.matmul(self.lm_head.clone().unsqueeze::<3>())
    }
}
