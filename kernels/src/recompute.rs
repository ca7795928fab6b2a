//! A region of tensor arithmetic that keeps only its inputs for the backward pass and recomputes
//! its intermediates there (activation checkpointing of one region, as `torch.utils.checkpoint`
//! does, on the ops' own terms).
//!
//! Forward: `y = f(x_1, …, x_n)`, computed without a graph. Backward, from `dy`: `f` is run again
//! on the inputs as leaves of a graph of the backward's own, and the inputs' gradients are those
//! of `⟨f(x_1, …, x_n), dy⟩`. What `f`'s ops would have kept (a softmax's probabilities, an
//! activation's pre- and post-values, a norm's statistics) lives only while one region is
//! differentiated; the graph around the region holds `x_1, …, x_n`.
//!
//! Worth it where a region's intermediates outweigh its inputs and cost little to recompute:
//! elementwise gates and norms, and attention over a chunk of queries (its `[Tq, S]` scores).
//!
//! A backend extension (SPEC.md, custom ops) on flex and libtorch, and on `Autodiff<B>` with a
//! [`Backward`] that holds the inputs; on other backends `f` runs composed.

use crate::extension::{grad_or_zeros, implemented_for};
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, Dispatch, ExtensionType, backend_extension};
use burn::tensor::Tensor;
use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// The most inputs a region takes (a whole decoder layer: its input, the document starts and
/// every weight).
pub const MAX_INPUTS: usize = 32;

/// A region's arithmetic: rank-4 inputs to one rank-4 output (callers add unit dimensions). It
/// must be a pure function of its inputs: the backward runs it again.
#[derive(Clone)]
pub struct Region(Arc<dyn Fn(&[Tensor<4>]) -> Tensor<4> + Send + Sync>);

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Region")
    }
}

thread_local! {
    static COMPOSED: Cell<bool> = const { Cell::new(false) };
}

/// Every region this thread runs while the guard lives is composed (its ops under autodiff as
/// usual, every intermediate kept): the reference twin, for tests and A/B measurements.
pub struct ComposedRegions(bool, PhantomData<*const ()>);

impl ComposedRegions {
    pub fn new() -> Self {
        Self(COMPOSED.replace(true), PhantomData)
    }

    /// Whether this thread runs its regions composed (a guard lives): what a thread that works
    /// for this one (a data-parallel replica) takes on.
    pub fn active() -> bool {
        COMPOSED.get()
    }
}

impl Default for ComposedRegions {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ComposedRegions {
    fn drop(&mut self) {
        COMPOSED.set(self.0);
    }
}

/// `f(inputs)`, keeping only `inputs` for the backward pass (at most [`MAX_INPUTS`]).
pub fn recompute(
    inputs: Vec<Tensor<4>>,
    f: impl Fn(&[Tensor<4>]) -> Tensor<4> + Send + Sync + 'static,
) -> Tensor<4> {
    assert!(
        (1..=MAX_INPUTS).contains(&inputs.len()),
        "a region takes 1 to {MAX_INPUTS} inputs"
    );
    if COMPOSED.get() || !implemented_for(&inputs[0]) {
        return f(&inputs);
    }
    let region = Region(Arc::new(f));
    let inputs = Inputs::new(inputs.into_iter().map(Tensor::into_dispatch).collect());
    Tensor::from_dispatch(<Dispatch as RecomputeOps>::recompute(inputs, region))
}

/// The inputs' gradients: those of `⟨f(inputs), grad⟩`, on a graph of the backward's own.
fn backward(inputs: Vec<Tensor<4>>, grad: Tensor<4>, region: &Region) -> Vec<Tensor<4>> {
    let leaves: Vec<_> = inputs
        .into_iter()
        .map(|x| x.autodiff().require_grad())
        .collect();
    let grads = ((region.0)(&leaves) * grad).sum().backward();
    leaves.iter().map(|x| grad_or_zeros(x, &grads)).collect()
}

/// Up to four of a region's inputs (burn's extension types hold fixed fields, no `Vec`).
#[derive(ExtensionType)]
pub enum Group<B: Backend> {
    Empty,
    One(FloatTensor<B>),
    Two(FloatTensor<B>, FloatTensor<B>),
    Three(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
    Four(
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    ),
}

/// A region's inputs across the op boundary, four to a [`Group`].
#[derive(ExtensionType)]
pub struct Inputs<B: Backend> {
    #[extension_type]
    a: Group<B>,
    #[extension_type]
    b: Group<B>,
    #[extension_type]
    c: Group<B>,
    #[extension_type]
    d: Group<B>,
    #[extension_type]
    e: Group<B>,
    #[extension_type]
    f: Group<B>,
    #[extension_type]
    g: Group<B>,
    #[extension_type]
    h: Group<B>,
}

impl<B: Backend> Group<B> {
    /// The next up-to-four tensors of `x`.
    fn take(x: &mut impl Iterator<Item = FloatTensor<B>>) -> Self {
        match (x.next(), x.next(), x.next(), x.next()) {
            (Some(a), Some(b), Some(c), Some(d)) => Self::Four(a, b, c, d),
            (Some(a), Some(b), Some(c), None) => Self::Three(a, b, c),
            (Some(a), Some(b), None, None) => Self::Two(a, b),
            (Some(a), None, None, None) => Self::One(a),
            _ => Self::Empty,
        }
    }

    fn extend_into(self, out: &mut Vec<FloatTensor<B>>) {
        match self {
            Self::Empty => {}
            Self::One(a) => out.push(a),
            Self::Two(a, b) => out.extend([a, b]),
            Self::Three(a, b, c) => out.extend([a, b, c]),
            Self::Four(a, b, c, d) => out.extend([a, b, c, d]),
        }
    }
}

impl<B: Backend> Inputs<B> {
    /// 1 to [`MAX_INPUTS`] tensors, in order.
    fn new(x: Vec<FloatTensor<B>>) -> Self {
        let mut x = x.into_iter();
        let mut group = || Group::take(&mut x);
        Self {
            a: group(),
            b: group(),
            c: group(),
            d: group(),
            e: group(),
            f: group(),
            g: group(),
            h: group(),
        }
    }

    fn into_vec(self) -> Vec<FloatTensor<B>> {
        let mut out = Vec::with_capacity(MAX_INPUTS);
        for group in [
            self.a, self.b, self.c, self.d, self.e, self.f, self.g, self.h,
        ] {
            group.extend_into(&mut out);
        }
        out
    }
}

/// The region op on each backend k3mini builds.
#[backend_extension(Flex, LibTorch: cfg(feature = "tch"), Autodiff)]
pub trait RecomputeOps: Backend {
    /// `f(inputs)`.
    fn recompute(#[extension_type] inputs: Inputs<Self>, region: Region) -> FloatTensor<Self>;

    /// The inputs' gradients, each in its input's shape, from the output's gradient.
    fn recompute_backward(
        #[extension_type] inputs: Inputs<Self>,
        grad: FloatTensor<Self>,
        region: Region,
    ) -> Vec<FloatTensor<Self>>;
}

/// [`RecomputeOps`] for a concrete backend: `f` and [`backward`] on its primitives as tensors.
macro_rules! concrete_recompute_ops {
    ($(#[$cfg:meta])* $backend:ty, $variant:ident, $module:ident) => {
        $(#[$cfg])*
        mod $module {
            crate::extension::tensor_bridge!($backend, $variant);
        }

        $(#[$cfg])*
        impl RecomputeOps for $backend {
            fn recompute(inputs: Inputs<Self>, region: Region) -> FloatTensor<Self> {
                let inputs: Vec<_> = inputs.into_vec().into_iter().map($module::wrap).collect();
                $module::unwrap((region.0)(&inputs))
            }

            fn recompute_backward(
                inputs: Inputs<Self>,
                grad: FloatTensor<Self>,
                region: Region,
            ) -> Vec<FloatTensor<Self>> {
                let inputs = inputs.into_vec().into_iter().map($module::wrap).collect();
                backward(inputs, $module::wrap(grad), &region)
                    .into_iter()
                    .map($module::unwrap)
                    .collect()
            }
        }
    };
}

concrete_recompute_ops!(burn::backend::Flex, Flex, flex);
concrete_recompute_ops!(
    #[cfg(feature = "tch")]
    burn::backend::LibTorch,
    LibTorch,
    libtorch
);

/// The backward of a region of `N` inputs: the inputs and the region.
#[derive(Debug)]
struct RecomputeBackward<const N: usize>;

impl<B: Backend + RecomputeOps, const N: usize> Backward<B, N> for RecomputeBackward<N> {
    type State = (Vec<FloatTensor<B>>, Region);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (inputs, region) = ops.state;
        let d = B::recompute_backward(Inputs::new(inputs), grad, region);
        for (parent, d) in ops.parents.into_iter().zip(d) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, d);
            }
        }
    }
}

/// The region op over `N` inputs on `Autodiff<B, C>`, tracked when any input is.
fn recompute_n<B: Backend + RecomputeOps, C: CheckpointStrategy, const N: usize>(
    inputs: Vec<FloatTensor<Autodiff<B, C>>>,
    region: Region,
) -> FloatTensor<Autodiff<B, C>> {
    let parents: [FloatTensor<Autodiff<B, C>>; N] = inputs.try_into().expect("N inputs");
    let nodes = parents.each_ref().map(|p| p.node());
    let inner: Vec<_> = parents.into_iter().map(|p| p.into_primitive()).collect();
    match RecomputeBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::recompute(Inputs::new(inner.clone()), region.clone());
            prep.finish((inner, region), y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::recompute(Inputs::new(inner), region)),
    }
}

impl<B: Backend + RecomputeOps, C: CheckpointStrategy> RecomputeOps for Autodiff<B, C> {
    fn recompute(inputs: Inputs<Self>, region: Region) -> FloatTensor<Self> {
        let inputs = inputs.into_vec();
        macro_rules! by_count {
            ($($n:literal)+) => {
                match inputs.len() {
                    $($n => recompute_n::<B, C, $n>(inputs, region),)+
                    n => unreachable!("recompute checks 1..={MAX_INPUTS} inputs, got {n}"),
                }
            };
        }
        by_count!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32)
    }

    fn recompute_backward(
        inputs: Inputs<Self>,
        grad: FloatTensor<Self>,
        region: Region,
    ) -> Vec<FloatTensor<Self>> {
        // Not differentiated again: the inner backend's gradients, as constants.
        let inputs = inputs.into_vec().into_iter().map(|t| t.into_primitive());
        B::recompute_backward(Inputs::new(inputs.collect()), grad.into_primitive(), region)
            .into_iter()
            .map(Self::from_inner)
            .collect()
    }
}
