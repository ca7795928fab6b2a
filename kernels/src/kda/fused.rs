//! The chunkwise KDA as one op with its own backward (as flash-linear-attention's `chunk_kda`):
//! the forward keeps only its inputs and the state entering each chunk; the backward recomputes
//! every chunk's intra-chunk terms from them.
//!
//! Forward: exactly [`super::chunk_kda`]'s arithmetic ([`ChunkTerms`], then the pass over
//! chunks), so outputs are bit-identical to the composed twin; the autodiff graph holds
//! `q, k, v, g, β`, the document starts, the initial state and `S_c`, the state entering chunk `c`
//! (`[B·H, N, dk, dv]`), instead of every intermediate of [`ChunkTerms`].
//!
//! Backward, from `dO` and `dS_N` (the final state's gradient), with the chunk terms recomputed:
//!
//! ```text
//! Ṽ_c = U_c − W_c S_c,   O_c = Q̃_c S_c + A_qk,c Ṽ_c,   S_{c+1} = e^{Γ_C} ⊙ S_c + K̃_cᵀ Ṽ_c
//! dṼ_c = A_qk,cᵀ dO_c + K̃_c dS_{c+1}
//! dS_c = Q̃_cᵀ dO_c − W_cᵀ dṼ_c + e^{Γ_C} ⊙ dS_{c+1}           (c = N−1 … 0; dS_0: the initial state's)
//! ```
//!
//! (`Q̃ = Q ⊙ e^Γ`, `K̃ = K ⊙ e^{Γ_C − Γ}`.) Given every `S_c` and `dS_{c+1}`, a chunk's inputs reach
//! the loss only through `O_c` and `S_{c+1}`, so their gradients are those of
//! `Σ_c ⟨O_c, dO_c⟩ + ⟨S_{c+1}, dS_{c+1}⟩` with the states held constant, differentiated by burn on
//! a graph of the backward's own, a group of chunks at a time, last group first
//! ([`RECOMPUTE_GROUPS`]; the intra-chunk terms, the UT inverse and the decayed scores of one group
//! are recomputed, used and freed there; nothing of them outlives the op).
//!
//! The op is a backend extension (SPEC.md, custom ops): implemented for flex and libtorch, whose
//! primitives are wrapped as tensors to run the arithmetic above, and for `Autodiff<B>` with a
//! [`Backward`] that holds the saved tensors.

use super::chunk::{ChunkTerms, blocks};
use super::{KdaInputs, KdaOutput, zero_state};
use crate::extension::{grad_or_zeros, implemented_for};
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Dispatch, ExtensionType, backend_extension};
use burn::tensor::Tensor;

/// Chunkwise KDA as one op: same contract and forward values as [`super::chunk_kda`]; under
/// autodiff it keeps its inputs and the chunk-boundary states, and recomputes the rest in its
/// backward.
pub fn fused_chunk_kda(
    x: &KdaInputs,
    scale: f64,
    initial_state: Option<Tensor<4>>,
    chunk: usize,
) -> KdaOutput {
    assert!(chunk > 0, "chunk size must be positive");
    if !implemented_for(&x.q) {
        return super::chunk_kda(x, scale, initial_state, chunk);
    }
    let [b, t, h, dk, dv] = x.dims();
    let initial = initial_state.unwrap_or_else(|| zero_state(x));
    let mut out = <Dispatch as KdaOps>::chunk_kda(
        x.q.clone().into_dispatch(),
        x.k.clone().into_dispatch(),
        x.v.clone().into_dispatch(),
        x.g.clone().into_dispatch(),
        x.beta.clone().into_dispatch(),
        match &x.starts {
            Some(s) => Starts::Packed(s.clone().into_dispatch()),
            None => Starts::Whole,
        },
        initial.into_dispatch(),
        scale,
        chunk,
        false, // the autodiff op keeps the states itself when it will be differentiated
    );
    out.truncate(1); // the chunk-boundary states are the op's own
    let joined = Tensor::<1>::from_dispatch(out.pop().expect("the op's output"));
    let o_len = b * t * h * dv;
    KdaOutput {
        o: joined.clone().narrow(0, 0, o_len).reshape([b, t, h, dv]),
        state: joined
            .narrow(0, o_len, b * h * dk * dv)
            .reshape([b, h, dk, dv]),
    }
}

/// The op's arithmetic on tensors: `o` and the final state flattened and joined `[B·T·H·dv +
/// B·H·dk·dv]`, and with `keep` the state entering each chunk `[B·H, N, dk, dv]`.
fn forward(
    x: &KdaInputs,
    initial: Tensor<4>,
    scale: f64,
    chunk: usize,
    keep: bool,
) -> (Tensor<1>, Option<Tensor<4>>) {
    let terms = ChunkTerms::new(x, scale, chunk);
    let (o, state, entering) = terms.carry(initial, keep);
    let flat = |x: Tensor<4>| {
        let len = x.dims().iter().product::<usize>();
        x.reshape([len])
    };
    (Tensor::cat(vec![flat(o), flat(state)], 0), entering)
}

/// The gradients of the op's inputs, each in its input's shape.
struct Grads {
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    g: Tensor<4>,
    beta: Tensor<3>,
    initial: Tensor<4>,
}

/// The backward recomputes the chunk terms in at most this many groups of consecutive chunks,
/// last group first, so one group's terms and their graph are alive at a time.
pub const RECOMPUTE_GROUPS: usize = 8;

/// Chunks per recomputed group, for `n` chunks.
pub fn group_chunks(n: usize) -> usize {
    n.div_ceil(RECOMPUTE_GROUPS).max(1)
}

/// The gradients from the joined output's gradient `grad` and the states `entering
/// [B·H, N, dk, dv]` that [`forward`] kept, a group of chunks at a time (a group's chunk terms
/// depend on its own tokens only: slicing at chunk boundaries is exact, packed documents
/// included, since the document masks compare positions within a chunk).
fn backward(
    x: &KdaInputs,
    entering: Tensor<4>,
    grad: Tensor<1>,
    scale: f64,
    chunk: usize,
) -> Grads {
    let [b, t, h, dk, dv] = x.dims();
    let n = t.div_ceil(chunk);
    let o_len = b * t * h * dv;
    let d_o = grad.clone().narrow(0, 0, o_len).reshape([b, t, h, dv]);
    let mut d_state = grad
        .narrow(0, o_len, b * h * dk * dv)
        .reshape([b * h, dk, dv]); // dS_{c+1}, from the final state's gradient
    let per_group = group_chunks(n);
    let mut groups = Vec::with_capacity(n.div_ceil(per_group));
    for first in (0..n).step_by(per_group).rev() {
        let chunks = per_group.min(n - first);
        let (t0, len) = (first * chunk, (chunks * chunk).min(t - first * chunk));
        let slice = |x: &Tensor<4>| x.clone().narrow(1, t0, len);
        // The group's inputs as leaves of a graph of the backward's own.
        let leaf = |x: &Tensor<4>| slice(x).autodiff().require_grad();
        let leaves = KdaInputs {
            q: leaf(&x.q),
            k: leaf(&x.k),
            v: leaf(&x.v),
            g: leaf(&x.g),
            beta: x.beta.clone().narrow(1, t0, len).autodiff().require_grad(),
            starts: x.starts.as_ref().map(|s| s.clone().narrow(1, t0, len)),
        };
        let terms = ChunkTerms::new(&leaves, scale, chunk);
        let d_o = blocks(slice(&d_o), chunk).reshape([b * h, chunks, chunk, dv]);

        // The states' gradients, last chunk first, from the recomputed terms' values.
        let value = |x: &Tensor<4>| x.clone().detach().inner();
        let (w, q_decayed, a_qk, k_to_end, decay_last) = (
            value(&terms.w),
            value(&terms.q_decayed),
            value(&terms.a_qk),
            value(&terms.k_to_end),
            value(&terms.decay_last),
        );
        let mut leaving = Vec::with_capacity(chunks);
        for c in (0..chunks).rev() {
            let at = |x: &Tensor<4>| x.clone().narrow(1, c, 1).squeeze_dim::<3>(1);
            let d_oc = at(&d_o);
            leaving.push(d_state.clone());
            let d_v_new = at(&a_qk).swap_dims(1, 2).matmul(d_oc.clone())
                + at(&k_to_end).matmul(d_state.clone()); // dṼ: [BH, C, dv]
            d_state = at(&q_decayed).swap_dims(1, 2).matmul(d_oc)
                - at(&w).swap_dims(1, 2).matmul(d_v_new)
                + d_state * at(&decay_last);
        }
        leaving.reverse();
        let leaving = Tensor::stack::<4>(leaving, 1); // dS_{c+1}: [BH, chunks, dk, dv]

        // Σ_c ⟨O_c, dO_c⟩ + ⟨S_{c+1}, dS_{c+1}⟩ over the group's chunks, the states constant.
        let entering = entering.clone().narrow(1, first, chunks);
        let v_new = terms.u - terms.w.matmul(entering.clone()); // [BH, chunks, C, dv]
        let o = terms.q_decayed.matmul(entering.clone()) + terms.a_qk.matmul(v_new.clone());
        let next = entering * terms.decay_last + terms.k_to_end.swap_dims(2, 3).matmul(v_new);
        let grads = ((o * d_o).sum() + (next * leaving).sum()).backward();
        groups.push((
            [&leaves.q, &leaves.k, &leaves.v, &leaves.g].map(|x| grad_or_zeros(x, &grads)),
            grad_or_zeros(&leaves.beta, &grads),
        ));
    }
    groups.reverse();
    let (four, beta): (Vec<_>, Vec<_>) = groups.into_iter().unzip();
    let along_time = |i: usize| Tensor::cat(four.iter().map(|g| g[i].clone()).collect(), 1);
    Grads {
        q: along_time(0),
        k: along_time(1),
        v: along_time(2),
        g: along_time(3),
        beta: Tensor::cat(beta, 1),
        initial: d_state.reshape([b, h, dk, dv]),
    }
}

/// Document starts `[B, T]` for packed sequences, or one document per row.
#[derive(ExtensionType)]
pub enum Starts<B: Backend> {
    Packed(FloatTensor<B>),
    Whole,
}

impl<B: Backend> Starts<B> {
    fn map<C: Backend>(self, f: impl FnOnce(FloatTensor<B>) -> FloatTensor<C>) -> Starts<C> {
        match self {
            Starts::Packed(s) => Starts::Packed(f(s)),
            Starts::Whole => Starts::Whole,
        }
    }
}

/// The chunkwise KDA op on each backend k3mini builds.
#[backend_extension(Flex, LibTorch: cfg(feature = "tch"), Autodiff)]
pub trait KdaOps: Backend {
    /// `[o and the final state, flattened and joined]`, then with `keep` the state entering each
    /// chunk (the autodiff op decides `keep` itself: whether it will be differentiated).
    #[allow(clippy::too_many_arguments)]
    fn chunk_kda(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        #[extension_type] starts: Starts<Self>,
        initial: FloatTensor<Self>,
        scale: f64,
        chunk: usize,
        keep: bool,
    ) -> Vec<FloatTensor<Self>>;

    /// `[dq, dk, dv, dg, dβ, dS_0]`, each in its input's shape, from the joined output's gradient.
    #[allow(clippy::too_many_arguments)]
    fn chunk_kda_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        #[extension_type] starts: Starts<Self>,
        entering: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
        chunk: usize,
    ) -> Vec<FloatTensor<Self>>;
}

/// [`KdaOps`] for a concrete backend: its primitives wrapped as tensors without autodiff, and
/// [`forward`] / [`backward`] run on them.
macro_rules! concrete_kda_ops {
    ($(#[$cfg:meta])* $backend:ty, $variant:ident, $module:ident) => {
        $(#[$cfg])*
        mod $module {
            use super::*;

            crate::extension::tensor_bridge!($backend, $variant);

            pub(super) fn inputs(
                q: FloatTensor<$backend>,
                k: FloatTensor<$backend>,
                v: FloatTensor<$backend>,
                g: FloatTensor<$backend>,
                beta: FloatTensor<$backend>,
                starts: Starts<$backend>,
            ) -> KdaInputs {
                KdaInputs {
                    q: wrap(q),
                    k: wrap(k),
                    v: wrap(v),
                    g: wrap(g),
                    beta: wrap(beta),
                    starts: match starts {
                        Starts::Packed(s) => Some(wrap(s)),
                        Starts::Whole => None,
                    },
                }
            }
        }

        $(#[$cfg])*
        impl KdaOps for $backend {
            fn chunk_kda(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                g: FloatTensor<Self>,
                beta: FloatTensor<Self>,
                starts: Starts<Self>,
                initial: FloatTensor<Self>,
                scale: f64,
                chunk: usize,
                keep: bool,
            ) -> Vec<FloatTensor<Self>> {
                let x = $module::inputs(q, k, v, g, beta, starts);
                let (joined, entering) = forward(&x, $module::wrap(initial), scale, chunk, keep);
                std::iter::once($module::unwrap(joined))
                    .chain(entering.map($module::unwrap))
                    .collect()
            }

            fn chunk_kda_backward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                g: FloatTensor<Self>,
                beta: FloatTensor<Self>,
                starts: Starts<Self>,
                entering: FloatTensor<Self>,
                grad: FloatTensor<Self>,
                scale: f64,
                chunk: usize,
            ) -> Vec<FloatTensor<Self>> {
                let x = $module::inputs(q, k, v, g, beta, starts);
                let d = backward(&x, $module::wrap(entering), $module::wrap(grad), scale, chunk);
                use $module::unwrap;
                vec![unwrap(d.q), unwrap(d.k), unwrap(d.v), unwrap(d.g), unwrap(d.beta), unwrap(d.initial)]
            }
        }
    };
}

concrete_kda_ops!(burn::backend::Flex, Flex, flex);
concrete_kda_ops!(
    #[cfg(feature = "tch")]
    burn::backend::LibTorch,
    LibTorch,
    libtorch
);

/// What the backward reads: `[q, k, v, g, β, the entering states]`, the starts (`None`: one
/// document per row), scale and chunk.
type Saved<B> = (Vec<FloatTensor<B>>, Option<FloatTensor<B>>, f64, usize);

#[derive(Debug)]
struct ChunkKdaBackward;

impl<B: Backend + KdaOps> Backward<B, 6> for ChunkKdaBackward {
    type State = Saved<B>;

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (saved, starts, scale, chunk) = ops.state;
        let [q, k, v, g, beta, entering]: [FloatTensor<B>; 6] =
            saved.try_into().expect("six saved tensors");
        let starts = match starts {
            Some(s) => Starts::Packed(s),
            None => Starts::Whole,
        };
        let d = B::chunk_kda_backward(q, k, v, g, beta, starts, entering, grad, scale, chunk);
        for (parent, d) in ops.parents.into_iter().zip(d) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, d);
            }
        }
    }
}

impl<B: Backend + KdaOps, C: CheckpointStrategy> KdaOps for Autodiff<B, C> {
    fn chunk_kda(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        starts: Starts<Self>,
        initial: FloatTensor<Self>,
        scale: f64,
        chunk: usize,
        _keep: bool,
    ) -> Vec<FloatTensor<Self>> {
        let parents = [q, k, v, g, beta, initial];
        let nodes = parents.each_ref().map(|p| p.node());
        let [q, k, v, g, beta, initial] = parents.map(|p| p.into_primitive());
        let starts = match starts {
            Starts::Packed(s) => Some(s.into_primitive()),
            Starts::Whole => None,
        };
        let run = |keep: bool| {
            let mut out = B::chunk_kda(
                q.clone(),
                k.clone(),
                v.clone(),
                g.clone(),
                beta.clone(),
                starts.clone().map_or(Starts::Whole, Starts::Packed),
                initial,
                scale,
                chunk,
                keep,
            );
            let entering = keep.then(|| out.pop().expect("the entering states"));
            (out.pop().expect("the joined output"), entering)
        };
        match ChunkKdaBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (joined, entering) = run(true);
                let entering = entering.expect("kept");
                let saved = vec![q, k, v, g, beta, entering.clone()];
                vec![
                    prep.finish((saved, starts, scale, chunk), joined),
                    Self::from_inner(entering),
                ]
            }
            OpsKind::UnTracked(prep) => vec![prep.finish(run(false).0)],
        }
    }

    fn chunk_kda_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        starts: Starts<Self>,
        entering: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
        chunk: usize,
    ) -> Vec<FloatTensor<Self>> {
        // Not differentiated again: the inner backend's gradients, as constants.
        let p = |t: FloatTensor<Self>| t.into_primitive();
        B::chunk_kda_backward(
            p(q),
            p(k),
            p(v),
            p(g),
            p(beta),
            starts.map(p),
            p(entering),
            p(grad),
            scale,
            chunk,
        )
        .into_iter()
        .map(Self::from_inner)
        .collect()
    }
}
