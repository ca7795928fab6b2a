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
//! Packed documents (`starts`): scores between tokens of different documents are zeroed (A_kk, A_qk,
//! hence a block-diagonal UT inverse), only tokens of the document already open at the chunk start
//! read or decay the incoming state, and only the chunk's last document writes the outgoing state.
//!
//! Padding to a multiple of `C` uses `k = v = q = g = β = 0`: a padded token neither decays nor
//! writes the state, so any `T` is exact.

use super::{KdaInputs, KdaOutput, zero_state};
use burn::tensor::Tensor;

/// Chunk length used for training (as flash-linear-attention).
pub const DEFAULT_CHUNK: usize = 64;

/// Chunkwise KDA. Same contract as [`super::naive_recurrent_kda`]. Composed of tensor ops, so
/// under autodiff every intra-chunk intermediate is kept for the backward pass: the reference twin
/// of [`super::fused::fused_chunk_kda`], which computes the same forward.
pub fn chunk_kda(
    x: &KdaInputs,
    scale: f64,
    initial_state: Option<Tensor<4>>,
    chunk: usize,
) -> KdaOutput {
    let terms = ChunkTerms::new(x, scale, chunk);
    let state = initial_state.unwrap_or_else(|| zero_state(x));
    let (o, state, _) = terms.carry(state, false);
    KdaOutput { o, state }
}

/// What every chunk computes from its own tokens alone (no state), per chunk:
/// `[B·H, N, C, ·]` (`decay_last`: `[B·H, N, dk, 1]`).
pub(super) struct ChunkTerms {
    /// `W = M (exp(Γ) ⊙ K)`.
    pub w: Tensor<4>,
    /// `U = M V`.
    pub u: Tensor<4>,
    /// `Q ⊙ exp(Γ)` (scaled queries).
    pub q_decayed: Tensor<4>,
    /// `A_qk`, masked.
    pub a_qk: Tensor<4>,
    /// `K ⊙ exp(Γ_C − Γ)`, masked.
    pub k_to_end: Tensor<4>,
    /// `exp(Γ_C)`, masked.
    pub decay_last: Tensor<4>,
    /// `[B, T, H, dk, dv]` and the number of chunks.
    pub dims: [usize; 5],
    pub n: usize,
}

impl ChunkTerms {
    pub(super) fn new(x: &KdaInputs, scale: f64, chunk: usize) -> Self {
        assert!(chunk > 0, "chunk size must be positive");
        let [b, t, h, dk, dv] = x.dims();
        let n = t.div_ceil(chunk);
        let padded = n * chunk;
        let blocks = |x: Tensor<4>| blocks(x, chunk);
        let q = blocks(x.q.clone() * scale);
        let k = blocks(x.k.clone());
        let v = blocks(x.v.clone());
        let g = blocks(x.g.clone());
        let beta = blocks(x.beta.clone().unsqueeze_dim::<4>(3)); // [BHN, C, 1]

        let gamma = g.cumsum(1); // Γ: [BHN, C, dk]
        let scores = DecayedKeys::new(k.clone(), gamma.clone());
        let mut a_kk = scores.contract(k.clone()) * beta.clone(); // row-scaled by β_i
        let mut a_qk = scores.contract(q.clone());
        let mut decay_in = gamma.clone().exp(); // exp(Γ) ≤ 1: decay from the chunk start
        let gamma_last = gamma.clone().narrow(1, chunk - 1, 1); // Γ_C: [BHN, 1, dk]
        let mut k_to_end = k.clone() * (gamma_last.clone() - gamma).exp(); // [BHN, C, dk]
        let mut decay_last = gamma_last.exp().swap_dims(1, 2); // [BHN, dk, 1]
        if let Some(starts) = &x.starts {
            let docs = DocumentMasks::new(starts.clone(), h, chunk, padded);
            a_kk = a_kk * docs.same.clone();
            a_qk = a_qk * docs.same;
            decay_in = decay_in * docs.from_start.clone();
            k_to_end = k_to_end * docs.to_end;
            decay_last = decay_last * docs.from_start.narrow(1, chunk - 1, 1);
        }
        let a_kk = a_kk.tril(-1);
        let a_qk = a_qk.tril(0);

        let m = unit_lower_inverse(a_kk) * beta.swap_dims(1, 2); // (I + A)⁻¹ Diag(β)
        let w = m.clone().matmul(k * decay_in.clone()); // [BHN, C, dk]
        let u = m.matmul(v); // [BHN, C, dv]
        let q_decayed = q * decay_in;

        // [BHN, ...] → [B·H, N, ...] for the pass over chunks.
        let per_chunk = |x: Tensor<3>| {
            let [_, c, d] = x.dims();
            x.reshape([b * h, n, c, d])
        };
        Self {
            w: per_chunk(w),
            u: per_chunk(u),
            q_decayed: per_chunk(q_decayed),
            a_qk: per_chunk(a_qk),
            k_to_end: per_chunk(k_to_end),
            decay_last: per_chunk(decay_last),
            dims: [b, t, h, dk, dv],
            n,
        }
    }

    /// The sequential pass over chunks from `state [B, H, dk, dv]`, batched over `B·H`:
    /// `o [B, T, H, dv]`, the final state `[B, H, dk, dv]` and, with `keep`, the state entering
    /// each chunk `[B·H, N, dk, dv]`.
    pub(super) fn carry(
        &self,
        state: Tensor<4>,
        keep: bool,
    ) -> (Tensor<4>, Tensor<4>, Option<Tensor<4>>) {
        let [b, _, h, dk, dv] = self.dims;
        let mut state = state.reshape([b * h, dk, dv]);
        let mut outs = Vec::with_capacity(self.n);
        let mut entering = Vec::with_capacity(if keep { self.n } else { 0 });
        for c in 0..self.n {
            let at = |x: &Tensor<4>| x.clone().narrow(1, c, 1).squeeze_dim::<3>(1);
            if keep {
                entering.push(state.clone());
            }
            let v_new = at(&self.u) - at(&self.w).matmul(state.clone()); // Ṽ: [BH, C, dv]
            outs.push(
                at(&self.q_decayed).matmul(state.clone()) + at(&self.a_qk).matmul(v_new.clone()),
            );
            state = state * at(&self.decay_last) + at(&self.k_to_end).swap_dims(1, 2).matmul(v_new);
        }
        let o = self.unblock(Tensor::cat(outs, 1)); // [BH, N*C, dv] → [B, T, H, dv]
        (
            o,
            state.reshape([b, h, dk, dv]),
            keep.then(|| Tensor::stack(entering, 1)),
        )
    }

    /// `[B·H, N·C, X]` → `[B, T, H, X]`, dropping the padding.
    pub(super) fn unblock(&self, x: Tensor<3>) -> Tensor<4> {
        let [b, t, h, _, _] = self.dims;
        let d = x.dims()[2];
        x.narrow(1, 0, t).reshape([b, h, t, d]).swap_dims(1, 2)
    }
}

/// `[B, T, H, X]` → `[B·H·N, C, X]`, zero-padded in time to a multiple of `chunk`.
pub(super) fn blocks(x: Tensor<4>, chunk: usize) -> Tensor<3> {
    let [b, t, h, d] = x.dims();
    let padded = t.div_ceil(chunk) * chunk;
    let x = x.swap_dims(1, 2); // [B,H,T,X]
    let x = if padded > t {
        let pad = Tensor::zeros([b, h, padded - t, d], &x.device());
        Tensor::cat(vec![x, pad], 2)
    } else {
        x
    };
    x.reshape([b * h * (padded / chunk), chunk, d])
}

/// Per-chunk document masks for packed sequences, from `starts [B, T]`.
struct DocumentMasks {
    /// 1 where tokens i and j belong to the same document: `[BHN, C, C]`.
    same: Tensor<3>,
    /// 1 where token i belongs to the document open when the chunk began: `[BHN, C, 1]`.
    from_start: Tensor<3>,
    /// 1 where token j belongs to the chunk's last document: `[BHN, C, 1]`.
    to_end: Tensor<3>,
}

impl DocumentMasks {
    fn new(starts: Tensor<2>, heads: usize, chunk: usize, padded: usize) -> Self {
        let [b, t] = starts.dims();
        let starts = if padded > t {
            Tensor::cat(
                vec![
                    starts.clone(),
                    Tensor::zeros([b, padded - t], &starts.device()),
                ],
                1,
            )
        } else {
            starts
        };
        // Document index of every token (exact small integers in f32), per head and chunk.
        let per_chunk = |x: Tensor<2>| {
            x.unsqueeze_dim::<3>(1)
                .expand([b, heads, padded])
                .reshape([b * heads * (padded / chunk), chunk])
        };
        let doc = per_chunk(starts.clone().cumsum(1)); // [BHN, C]
        let starts = per_chunk(starts);
        let bhn = doc.dims()[0];
        let first = doc.clone().narrow(1, 0, 1) - starts.narrow(1, 0, 1); // document open at the chunk start
        let last = doc.clone().narrow(1, chunk - 1, 1);
        let rows = doc
            .clone()
            .unsqueeze_dim::<3>(2)
            .expand([bhn, chunk, chunk]);
        let cols = doc
            .clone()
            .unsqueeze_dim::<3>(1)
            .expand([bhn, chunk, chunk]);
        Self {
            same: rows.equal(cols).float(),
            from_start: doc
                .clone()
                .equal(first.expand([bhn, chunk]))
                .float()
                .unsqueeze_dim::<3>(2),
            to_end: doc
                .equal(last.expand([bhn, chunk]))
                .float()
                .unsqueeze_dim::<3>(2),
        }
    }
}

/// Preferred sub-chunk length for the decayed scores (fla's kernels use 16 as well).
pub const SUB_CHUNK: usize = 16;

/// The sub-chunk length used for a chunk of `chunk` tokens: the largest divisor of it up to [`SUB_CHUNK`]
/// that also divides [`SUB_CHUNK`].
pub fn sub_chunk(chunk: usize) -> usize {
    gcd(chunk, SUB_CHUNK)
}

/// Everything the decayed score matrices `A[i,j] = Σ_d x_i[d] k_j[d] exp(Γ_i[d] − Γ_j[d])` share
/// across `x = k` and `x = q`, computed per sub-chunk of `s` tokens so no exponent is ever positive
/// and memory is `O(C/s · dk)` per token rather than `O(C · dk)`:
///
/// - same sub-chunk: the exact `[s, s, dk]` decay tensor (clamped above the diagonal);
/// - sub-chunk `a` > `b`, with `e` the last token of `b`: `exp(Γ_i − Γ_j) = exp(Γ_i − Γ_e) · exp(Γ_e − Γ_j)`,
///   both factors ≤ 1, so the block is one matmul `(x_a ⊙ e^{Γ_a − Γ_e}) (k_b ⊙ e^{Γ_e − Γ_b})ᵀ`.
struct DecayedKeys {
    /// `k_j exp(min(Γ_i − Γ_j, 0))` within each sub-chunk: `[N, S, s(i), s(j), dk]`.
    intra: Tensor<5>,
    /// `exp(min(Γ_i − Γ_{e_b}, 0))`: `[N, S(a), S(b), s(i), dk]`.
    left_decay: Tensor<5>,
    /// `(k_j exp(Γ_{e_b} − Γ_j))ᵀ`: `[N, 1, S(b), dk, s(j)]`.
    right: Tensor<5>,
    /// 1 where sub-chunk a > b: `[1, S, S, 1, 1]`.
    lower_blocks: Tensor<5>,
    /// 1 where a == b: `[1, S, 1, S, 1]` (for placing the diagonal blocks).
    diag_blocks: Tensor<5>,
    sub: usize,
}

impl DecayedKeys {
    fn new(k: Tensor<3>, gamma: Tensor<3>) -> Self {
        let [n, c, dk] = k.dims();
        let sub = sub_chunk(c);
        let subs = c / sub;
        let device = k.device();
        let ks = k.reshape([n, subs, sub, dk]);
        let gs = gamma.reshape([n, subs, sub, dk]);
        let intra = (gs.clone().unsqueeze_dim::<5>(3) - gs.clone().unsqueeze_dim::<5>(2))
            .clamp_max(0.0)
            .exp()
            * ks.clone().unsqueeze_dim::<5>(2);
        let g_end = gs.clone().narrow(2, sub - 1, 1); // Γ_e per sub-chunk: [N, S, 1, dk]
        let left_decay = (gs.clone().unsqueeze_dim::<5>(2) - g_end.clone().unsqueeze_dim::<5>(1))
            .clamp_max(0.0)
            .exp();
        let right = (ks * (g_end - gs).exp())
            .swap_dims(2, 3)
            .unsqueeze_dim::<5>(1);
        let eye = Tensor::<2>::eye(subs, &device);
        let lower = Tensor::<2>::ones([subs, subs], &device).tril(-1);
        Self {
            intra,
            left_decay,
            right,
            lower_blocks: lower.reshape([1, subs, subs, 1, 1]),
            diag_blocks: eye.reshape([1, subs, 1, subs, 1]),
            sub,
        }
    }

    /// `[N, C, dk]` rows `x` → `[N, C, C]` scores, exact on and below the diagonal (above it: finite junk
    /// within diagonal sub-chunks, zero elsewhere; callers apply `tril`).
    fn contract(&self, x: Tensor<3>) -> Tensor<3> {
        let [n, c, dk] = x.dims();
        let (sub, subs) = (self.sub, c / self.sub);
        let xs = x.reshape([n, subs, sub, dk]);
        // Diagonal sub-chunks: [N,S,s,s,dk]·[N,S,s,dk,1] → [N,S,s(i),s(j)] → placed on the block diagonal.
        let intra = self
            .intra
            .clone()
            .matmul(xs.clone().unsqueeze_dim::<5>(4))
            .reshape([n, subs, sub, 1, sub]);
        let intra = (intra * self.diag_blocks.clone()).reshape([n, c, c]);
        // Earlier sub-chunks: [N,S(a),S(b),s,dk]·[N,1,S(b),dk,s] → [N,S(a),S(b),s(i),s(j)].
        let left = self.left_decay.clone() * xs.unsqueeze_dim::<5>(2);
        let inter = left.matmul(self.right.clone()) * self.lower_blocks.clone();
        intra + inter.swap_dims(2, 3).reshape([n, c, c])
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// `(I + A)⁻¹` for a batch of strictly lower-triangular `A: [N, C, C]`, blockwise: the diagonal
/// sub-chunk blocks by forward substitution, then row-block `a` from the rows above it,
/// `T_{a,<a} = −T_aa (A_{a,<a} T_{<a,<a})` (from `(I + A) T = I`).
fn unit_lower_inverse(a: Tensor<3>) -> Tensor<3> {
    let [n, c, _] = a.dims();
    let sub = sub_chunk(c);
    let subs = c / sub;
    if subs == 1 {
        return forward_substitution(a);
    }
    let diag: Vec<_> = (0..subs)
        .map(|i| a.clone().narrow(1, i * sub, sub).narrow(2, i * sub, sub))
        .collect();
    let diag_inv = forward_substitution(Tensor::cat(diag, 0)); // [S·N, s, s], block-major
    let diag_inv = |i: usize| diag_inv.clone().narrow(0, i * n, n);
    let zeros = |cols: usize| Tensor::<3>::zeros([n, sub, cols], &a.device());
    let mut inv = Tensor::cat(vec![diag_inv(0), zeros(c - sub)], 2); // finished row-blocks: [N, a·s, C]
    for blk in 1..subs {
        let done = blk * sub;
        let a_row = a.clone().narrow(1, done, sub).narrow(2, 0, done); // A_{a,<a}: [N, s, a·s]
        let t_prev = inv.clone().narrow(2, 0, done); // T_{<a,<a}: [N, a·s, a·s]
        let t_aa = diag_inv(blk);
        let off = -t_aa.clone().matmul(a_row.matmul(t_prev));
        let mut parts = vec![off, t_aa];
        if c > done + sub {
            parts.push(zeros(c - done - sub));
        }
        inv = Tensor::cat(vec![inv, Tensor::cat(parts, 2)], 1);
    }
    inv
}

/// `(I + A)⁻¹` by forward substitution: row i is `e_i − A[i, :] · T` (rows `≥ i` of T do not
/// contribute since A is strictly lower).
fn forward_substitution(a: Tensor<3>) -> Tensor<3> {
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
