//! The token-by-token KDA recurrence: the reference every other form is tested against, and the
//! single-token decode step used for incremental inference.

use super::{KdaInputs, KdaOutput, zero_state};
use burn::tensor::Tensor;

/// One KDA token for every batch row and head.
///
/// ```text
/// S ← Diag(exp(g)) S                      decay each key row of the state
/// S ← S + (β k) ⊗ (v − Sᵀ k)              delta rule
/// o = Sᵀ (scale · q)
/// ```
///
/// Shapes: `state [B, H, dk, dv]`, `q, k, g [B, H, dk]`, `v [B, H, dv]`, `beta [B, H]`.
/// Returns `(o [B, H, dv], state)`.
pub fn kda_step(
    state: Tensor<4>,
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    g: Tensor<3>,
    beta: Tensor<2>,
    scale: f64,
) -> (Tensor<3>, Tensor<4>) {
    let state = state * g.exp().unsqueeze_dim::<4>(3); // [B,H,dk,1] broadcast over dv
    let k_row = k.clone().unsqueeze_dim::<4>(2); // [B,H,1,dk]
    let predicted = k_row.matmul(state.clone()); // Sᵀk as a row: [B,H,1,dv]
    let delta = (v.unsqueeze_dim::<4>(2) - predicted) * beta.unsqueeze_dims::<4>(&[2, 3]);
    let state = state + k.unsqueeze_dim::<4>(3).matmul(delta); // [B,H,dk,1]·[B,H,1,dv]
    let o = (q * scale).unsqueeze_dim::<4>(2).matmul(state.clone()); // [B,H,1,dv]
    (o.squeeze_dim::<3>(2), state)
}

/// The naive recurrent form: [`kda_step`] folded over time (fla's `naive_recurrent_kda`), with the
/// state zeroed before each document start.
pub fn naive_recurrent_kda(
    x: &KdaInputs,
    scale: f64,
    initial_state: Option<Tensor<4>>,
) -> KdaOutput {
    let [_, t, _, _, _] = x.dims();
    let mut state = initial_state.unwrap_or_else(|| zero_state(x));
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let at = |x: &Tensor<4>| x.clone().narrow(1, i, 1).squeeze_dim::<3>(1);
        let beta = x.beta.clone().narrow(1, i, 1).squeeze_dim::<2>(1);
        if let Some(starts) = &x.starts {
            let keep = -starts.clone().narrow(1, i, 1) + 1.0; // [B, 1]
            state = state * keep.unsqueeze_dims::<4>(&[2, 3]);
        }
        let (o, s) = kda_step(state, at(&x.q), at(&x.k), at(&x.v), at(&x.g), beta, scale);
        state = s;
        outs.push(o);
    }
    KdaOutput {
        o: Tensor::stack(outs, 1),
        state,
    }
}
