//! Gated Multi-head Latent Attention with NoPE (Kimi Linear's `KimiLinearAttention`; K3 adds the gate
//! and q-LoRA).
//!
//! ```text
//! q            = W_q x                  or  W_qb RMSNorm(W_qa x)           (q-LoRA)   [H, nope+rope]
//! [c ; k_r]    = W_kva x,   c ← RMSNorm(c)                                 c: kv_lora, k_r: rope (shared by heads)
//! [k_n ; v]    = W_kvb c                                                   [H, nope+v]
//! k            = [k_n ; k_r]                                               NoPE: k_r is never rotated
//! o            = softmax(q kᵀ / sqrt(nope+rope) + causal) v
//! y            = W_o( o ⊙ σ(W_gate x) )                                    gate optional (K3)
//! ```
//!
//! The inference cache holds only `c` and `k_r` per token (kv_lora + rope values): the compressed form.
//! Training keeps `q`, `k` and `v` for the attention's backward, which recomputes the scores a
//! chunk of queries at a time ([`SCORES_AT_ONCE`]).

use crate::config::MlaConfig;
use crate::linear;
use crate::norm::RmsNorm;
use crate::precision::Precision;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Bool, Device, Tensor, activation};
use k3mini_kernels::recompute::recompute;

/// Epsilon of the latent RMSNorms (transformers' `KimiLinearRMSNorm` default).
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// The compressed KV cache of one MLA layer.
#[derive(Clone, Debug)]
pub struct MlaCache {
    /// Normalised latents `[B, S, kv_lora]`.
    pub latent: Tensor<3>,
    /// Shared rope-slice keys `[B, S, rope]`.
    pub k_rope: Tensor<3>,
}

impl MlaCache {
    pub fn len(&self) -> usize {
        self.latent.dims()[1]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Module, Debug)]
pub struct GatedMla {
    /// Full q projection (no q-LoRA).
    pub q_proj: Option<Linear>,
    pub q_a_proj: Option<Linear>,
    pub q_a_layernorm: Option<RmsNorm>,
    pub q_b_proj: Option<Linear>,
    pub kv_a_proj_with_mqa: Linear,
    pub kv_a_layernorm: RmsNorm,
    pub kv_b_proj: Linear,
    /// Output gate d → H·v (K3's Gated MLA).
    pub g_proj: Option<Linear>,
    pub o_proj: Linear,
    #[module(skip)]
    pub heads: usize,
    #[module(skip)]
    pub dims: MlaConfig,
    /// Of the projections and the attention products (softmax stays f32).
    #[module(skip)]
    pub precision: Precision,
    /// Scores one chunk of queries may hold ([`SCORES_AT_ONCE`]).
    #[module(skip)]
    pub scores_at_once: usize,
}

impl GatedMla {
    pub fn new(d_model: usize, heads: usize, cfg: &MlaConfig, device: &Device) -> Self {
        let qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim;
        let (q_proj, q_a_proj, q_a_layernorm, q_b_proj) = match cfg.q_lora_rank {
            None => (Some(linear(d_model, heads * qk, device)), None, None, None),
            Some(r) => (
                None,
                Some(linear(d_model, r, device)),
                Some(RmsNorm::new(r, LATENT_NORM_EPS, device)),
                Some(linear(r, heads * qk, device)),
            ),
        };
        Self {
            q_proj,
            q_a_proj,
            q_a_layernorm,
            q_b_proj,
            kv_a_proj_with_mqa: linear(d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim, device),
            kv_a_layernorm: RmsNorm::new(cfg.kv_lora_rank, LATENT_NORM_EPS, device),
            kv_b_proj: linear(
                cfg.kv_lora_rank,
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                device,
            ),
            g_proj: cfg
                .output_gate
                .then(|| linear(d_model, heads * cfg.v_head_dim, device)),
            o_proj: linear(heads * cfg.v_head_dim, d_model, device),
            heads,
            dims: cfg.clone(),
            precision: Precision::F32,
            scores_at_once: SCORES_AT_ONCE,
        }
    }

    pub fn empty_cache(&self, batch: usize, device: &Device) -> MlaCache {
        MlaCache {
            latent: Tensor::zeros([batch, 0, self.dims.kv_lora_rank], device),
            k_rope: Tensor::zeros([batch, 0, self.dims.qk_rope_head_dim], device),
        }
    }

    /// `x [B, T, d]` → `[B, T, d]`. With a cache, attends over the cached tokens too and appends to it.
    /// `starts [B, T]` (packed documents): attention is also block-diagonal over documents (cached
    /// tokens belong to the document open before `x`).
    pub fn forward(
        &self,
        x: Tensor<3>,
        cache: Option<&mut MlaCache>,
        starts: Option<&Tensor<2>>,
    ) -> Tensor<3> {
        let [b, t, _] = x.dims();
        let (h, mm) = (self.heads, self.precision);
        let MlaConfig {
            kv_lora_rank: kvl,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope,
            v_head_dim: vd,
            ..
        } = self.dims;
        let q = match (
            &self.q_proj,
            &self.q_a_proj,
            &self.q_a_layernorm,
            &self.q_b_proj,
        ) {
            (Some(p), ..) => mm.linear(p, x.clone()),
            (None, Some(a), Some(n), Some(bp)) => mm.linear(bp, n.forward(mm.linear(a, x.clone()))),
            _ => unreachable!("GatedMla::new builds one q path"),
        };
        let q = q.reshape([b, t, h, nope + rope]).swap_dims(1, 2); // [B, H, T, nope+rope]

        let ckv = mm.linear(&self.kv_a_proj_with_mqa, x.clone()); // [B, T, kvl+rope]
        let mut latent = self.kv_a_layernorm.forward(ckv.clone().narrow(2, 0, kvl));
        let mut k_rope = ckv.narrow(2, kvl, rope);
        let past = cache.as_ref().map_or(0, |c| c.len());
        if let Some(c) = cache {
            latent = Tensor::cat(vec![c.latent.clone(), latent], 1);
            k_rope = Tensor::cat(vec![c.k_rope.clone(), k_rope], 1);
            c.latent = latent.clone();
            c.k_rope = k_rope.clone();
        }
        let s = past + t;
        let kv = mm
            .linear(&self.kv_b_proj, latent)
            .reshape([b, s, h, nope + vd])
            .swap_dims(1, 2); // [B,H,S,nope+v]
        let k_nope = kv.clone().narrow(3, 0, nope);
        let v = kv.narrow(3, nope, vd);
        let k_rope = k_rope.unsqueeze_dim::<4>(1).expand([b, h, s, rope]);
        let k = Tensor::cat(vec![k_nope, k_rope], 3); // [B, H, S, nope+rope]

        let scale = ((nope + rope) as f64).powf(-0.5);
        // Document ids `[B, 1, T, 1]` of the queries and `[B, 1, 1, S]` of the keys (cached
        // tokens belong to the document open before `x`: id 0).
        let docs = starts.map(|starts| {
            let doc = starts.clone().cumsum(1); // [B, T]
            let doc_k = Tensor::cat(
                vec![Tensor::zeros([b, past], &doc.device()), doc.clone()],
                1,
            );
            (doc.reshape([b, 1, t, 1]), doc_k.reshape([b, 1, 1, s]))
        });
        // Queries in chunks, each a recompute region: the backward keeps q, k and v, never the
        // `[B, H, T, S]` scores and probabilities.
        let rows = query_rows(b * h * s, t, self.scores_at_once);
        let parts = (0..t)
            .step_by(rows)
            .map(|i| {
                let n = rows.min(t - i);
                let mut inputs = vec![q.clone().narrow(2, i, n), k.clone(), v.clone()];
                if let Some((doc_q, doc_k)) = &docs {
                    inputs.extend([doc_q.clone().narrow(2, i, n), doc_k.clone()]);
                }
                recompute(inputs, move |x| attend(x, scale, past + i, mm))
            })
            .collect();
        let o = Tensor::cat(parts, 2); // [B, H, T, v]
        let mut o = o.swap_dims(1, 2).reshape([b, t, h * vd]);
        if let Some(g) = &self.g_proj {
            o = o * activation::sigmoid(mm.linear(g, x));
        }
        mm.linear(&self.o_proj, o)
    }
}

/// Scores one attention region holds at a time (`[B, H, rows, S]`, f32): 64 MiB.
pub const SCORES_AT_ONCE: usize = 1 << 24;

/// Queries a chunk of attention takes: as many as keep its `[B, H, rows, S]` scores within
/// `budget` (`per_row = B·H·S`), at least one, at most all `t`.
pub fn query_rows(per_row: usize, t: usize, budget: usize) -> usize {
    (budget / per_row.max(1)).clamp(1, t.max(1))
}

/// `softmax(q kᵀ · scale + causal + documents) v` for `[q, k, v]` or `[q, k, v, doc_q, doc_k]`:
/// queries `[B, H, Tq, ·]` at key positions `offset..offset + Tq` of keys and values `[B, H, S, ·]`.
fn attend(x: &[Tensor<4>], scale: f64, offset: usize, mm: Precision) -> Tensor<4> {
    let (q, k, v) = (x[0].clone(), x[1].clone(), x[2].clone());
    let [b, h, tq, _] = q.dims();
    let s = k.dims()[2];
    let device = q.device();
    let scores = mm.matmul(q, k.swap_dims(2, 3)) * scale; // [B, H, Tq, S]
    let future = Tensor::<2, Bool>::tril_mask([tq, s], offset as i64, &device); // true where j > i+offset
    let mut scores = scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY);
    if let [_, _, _, doc_q, doc_k] = x {
        let other = doc_q
            .clone()
            .expand([b, 1, tq, s])
            .not_equal(doc_k.clone().expand([b, 1, tq, s]));
        scores = scores.mask_fill(other.expand([b, h, tq, s]), f32::NEG_INFINITY);
    }
    mm.matmul(activation::softmax(scores, 3), v)
}
