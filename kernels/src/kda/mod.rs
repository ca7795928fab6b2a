//! Kimi Delta Attention (Kimi Linear report, arXiv 2510.26692, Eq. 1-9).
//!
//! Per head, with a state `S ∈ R^{dk×dv}` kept in fp32:
//!
//! ```text
//! S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,   α_t = exp(g_t) ∈ (0, 1]^{dk}
//! o_t = S_tᵀ (scale · q_t)
//! ```
//!
//! The decay acts on the KEY dimension, one log-decay `g_t[d] ≤ 0` per key channel.
//!
//! Packed documents: with `starts`, `S_{t-1}` is taken as zero at each document's first token.
//!
//! Layout (as flash-linear-attention): `q, k, g: [B, T, H, dk]`, `v: [B, T, H, dv]`, `beta: [B, T, H]`,
//! state `[B, H, dk, dv]`, output `[B, T, H, dv]`.

mod chunk;
mod fused;
mod recurrent;

pub use chunk::{DEFAULT_CHUNK, SUB_CHUNK, chunk_kda, sub_chunk};
pub use fused::{RECOMPUTE_GROUPS, fused_chunk_kda, group_chunks};
pub use recurrent::{kda_step, naive_recurrent_kda};

use burn::tensor::Tensor;

/// The per-token tensors one KDA layer feeds its recurrence.
#[derive(Clone, Debug)]
pub struct KdaInputs {
    /// Queries `[B, T, H, dk]` (L2-normalised by the layer; `scale` is applied by the op).
    pub q: Tensor<4>,
    /// Keys `[B, T, H, dk]` (L2-normalised).
    pub k: Tensor<4>,
    /// Values `[B, T, H, dv]`.
    pub v: Tensor<4>,
    /// Log-decay per key channel `[B, T, H, dk]`, every entry `<= 0`.
    pub g: Tensor<4>,
    /// Delta-rule learning rate `[B, T, H]`, in (0, 1).
    pub beta: Tensor<3>,
    /// Packed sequences: `[B, T]`, 1.0 where a token begins a new document. The state is reset before
    /// such a token, so nothing crosses a document boundary. `None`: one document per row.
    pub starts: Option<Tensor<2>>,
}

impl KdaInputs {
    /// `[B, T, H, dk, dv]`.
    pub fn dims(&self) -> [usize; 5] {
        let [b, t, h, dk] = self.q.dims();
        [b, t, h, dk, self.v.dims()[3]]
    }
}

/// Output of a KDA op: `o: [B, T, H, dv]` and the final state `[B, H, dk, dv]`.
#[derive(Clone, Debug)]
pub struct KdaOutput {
    pub o: Tensor<4>,
    pub state: Tensor<4>,
}

/// The default query scale `dk^-1/2`.
pub fn default_scale(dk: usize) -> f64 {
    (dk as f64).powf(-0.5)
}

/// A zero state `[B, H, dk, dv]` matching `x`'s shapes and device.
fn zero_state(x: &KdaInputs) -> Tensor<4> {
    let [b, _, h, dk, dv] = x.dims();
    Tensor::zeros([b, h, dk, dv], &x.q.device())
}
