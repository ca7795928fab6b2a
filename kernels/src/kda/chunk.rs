//! The chunkwise-parallel KDA form used for training (WY representation with the UT transform).
//!
//! Within a chunk of `C` tokens, with `Γ` the in-chunk cumulative sum of `g` (per key channel):
//!
//! ```text
//! A_kk[i,j] = β_i Σ_d k_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])      j < i
//! M = (I + A_kk)⁻¹ Diag(β)                                     UT transform (forward substitution)
//! W = M (exp(Γ) ⊙ K),   U = M V                                WY representation
//! A_qk[i,j] = Σ_d q_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])          j ≤ i
//! per chunk, carrying S:
//!   Ṽ = U − W S
//!   O = (Q ⊙ exp(Γ)) S + A_qk Ṽ
//!   S ← exp(Γ_C) ⊙_rows S + (K ⊙ exp(Γ_C − Γ))ᵀ Ṽ
//! ```
//!
//! Numerics: only `exp(Γ_i − Γ_j)` with `j ≤ i` is ever used (exponent ≤ 0). The masked entries
//! (`j > i`) are clamped to exponent 0 before `exp`, so neither they nor their gradients overflow.
//! Never factor the decay as `(Q e^Γ)(K / e^Γ)ᵀ`: the division overflows on long chunks.
//!
//! Padding to a multiple of `C` uses `k = v = q = g = β = 0`: a padded token neither decays nor
//! writes the state, so any `T` is exact.

use super::{KdaInputs, KdaOutput, zero_state};
use burn::tensor::Tensor;

/// Chunk length used for training (as flash-linear-attention).
pub const DEFAULT_CHUNK: usize = 64;

/// Chunkwise KDA. Same contract as [`super::naive_recurrent_kda`].
pub fn chunk_kda(
    x: &KdaInputs,
    scale: f64,
    initial_state: Option<Tensor<4>>,
    chunk: usize,
) -> KdaOutput {
    assert!(chunk > 0, "chunk size must be positive");
    let [b, t, h, dk, dv] = x.dims();
    let n = t.div_ceil(chunk);
    let padded = n * chunk;
    let bhn = b * h * n;

    // [B,T,H,X] -> [B*H*N, C, X], zero-padded in time.
    let blocks = |x: Tensor<4>| -> Tensor<3> {
        let d = x.dims()[3];
        let x = x.swap_dims(1, 2); // [B,H,T,X]
        let x = if padded > t {
            let pad = Tensor::zeros([b, h, padded - t, d], &x.device());
            Tensor::cat(vec![x, pad], 2)
        } else {
            x
        };
        x.reshape([bhn, chunk, d])
    };
    let q = blocks(x.q.clone() * scale);
    let k = blocks(x.k.clone());
    let v = blocks(x.v.clone());
    let g = blocks(x.g.clone());
    let beta = blocks(x.beta.clone().unsqueeze_dim::<4>(3)); // [BHN, C, 1]

    let gamma = g.cumsum(1); // Γ: [BHN, C, dk]
    // decay[i,j,d] = exp(min(Γ_i − Γ_j, 0)): [BHN, C(i), C(j), dk]
    let decay = (gamma.clone().unsqueeze_dim::<4>(2) - gamma.clone().unsqueeze_dim::<4>(1))
        .clamp_max(0.0)
        .exp();
    let k_decayed = decay * k.clone().unsqueeze_dim::<4>(1); // k_j[d] exp(Γ_i − Γ_j)
    // Contract over d with row i's key / query: [BHN, C, C, dk] · [BHN, C, dk, 1] -> [BHN, C, C]
    let contract = |rows: Tensor<3>| {
        k_decayed
            .clone()
            .matmul(rows.unsqueeze_dim::<4>(3))
            .squeeze_dim::<3>(3)
    };
    let a_kk = (contract(k.clone()) * beta.clone()).tril(-1); // strictly lower, row-scaled by β_i
    let a_qk = contract(q.clone()).tril(0);

    let m = unit_lower_inverse(a_kk) * beta.swap_dims(1, 2); // (I + A)⁻¹ Diag(β)
    let w = m.clone().matmul(k.clone() * gamma.clone().exp()); // [BHN, C, dk]
    let u = m.matmul(v); // [BHN, C, dv]
    let q_decayed = q * gamma.clone().exp();
    let gamma_last = gamma.clone().narrow(1, chunk - 1, 1); // Γ_C: [BHN, 1, dk]
    let k_to_end = k * (gamma_last.clone() - gamma).exp(); // [BHN, C, dk]
    let decay_last = gamma_last.exp().swap_dims(1, 2); // [BHN, dk, 1]

    // Sequential pass over chunks, batched over B*H: [B*H, N, ...].
    let per_chunk = |x: Tensor<3>| {
        let [_, c, d] = x.dims();
        x.reshape([b * h, n, c, d])
    };
    let (w, u, q_decayed, a_qk, k_to_end, decay_last) = (
        per_chunk(w),
        per_chunk(u),
        per_chunk(q_decayed),
        per_chunk(a_qk),
        per_chunk(k_to_end),
        per_chunk(decay_last),
    );
    let mut state = initial_state
        .unwrap_or_else(|| zero_state(x))
        .reshape([b * h, dk, dv]);
    let mut outs = Vec::with_capacity(n);
    for c in 0..n {
        let at = |x: &Tensor<4>| x.clone().narrow(1, c, 1).squeeze_dim::<3>(1);
        let v_new = at(&u) - at(&w).matmul(state.clone()); // Ṽ: [BH, C, dv]
        outs.push(at(&q_decayed).matmul(state.clone()) + at(&a_qk).matmul(v_new.clone()));
        state = state * at(&decay_last) + at(&k_to_end).swap_dims(1, 2).matmul(v_new);
    }
    let o = Tensor::cat(outs, 1) // [BH, N*C, dv]
        .narrow(1, 0, t)
        .reshape([b, h, t, dv])
        .swap_dims(1, 2);
    KdaOutput {
        o,
        state: state.reshape([b, h, dk, dv]),
    }
}

/// `(I + A)⁻¹` for a batch of strictly lower-triangular `A: [N, C, C]`, by forward substitution:
/// row i of the inverse is `e_i − A[i, :] · T` (rows `≥ i` of T do not contribute since A is strictly lower).
fn unit_lower_inverse(a: Tensor<3>) -> Tensor<3> {
    let [n, c, _] = a.dims();
    let eye = Tensor::<2>::eye(c, &a.device());
    let mut inv = eye.clone().unsqueeze_dim::<3>(0).repeat_dim(0, n);
    for i in 1..c {
        let row = eye.clone().narrow(0, i, 1).unsqueeze_dim::<3>(0)
            - a.clone().narrow(1, i, 1).matmul(inv.clone()); // [N, 1, C]
        inv = inv.slice_assign([0..n, i..i + 1, 0..c], row);
    }
    inv
}
