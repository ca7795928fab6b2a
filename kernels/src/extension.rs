//! What the crate's custom ops (burn backend extensions, SPEC.md's note on custom ops) share:
//! which backends run them, and the bridge between a backend's primitives and tensors.
//!
//! The ops' arithmetic is written once, on tensors: a concrete backend's primitives are wrapped
//! as tensors without autodiff, computed on and unwrapped again.

use burn::backend::DispatchTensorKind;
use burn::tensor::Tensor;

/// Whether the crate's ops run on `x`'s backend (flex and libtorch); elsewhere (CubeCL's
/// backends) each op's composed form, which every backend runs, takes its place.
pub(crate) fn implemented_for<const D: usize>(x: &Tensor<D>) -> bool {
    let kind = match x.clone().into_dispatch().kind {
        DispatchTensorKind::Autodiff(inner) => *inner,
        kind => kind,
    };
    match kind {
        DispatchTensorKind::Flex(_) => true,
        #[cfg(feature = "tch")]
        DispatchTensorKind::LibTorch(_) => true,
        _ => false,
    }
}

/// Whether the crate's ops run on `device`'s backend (see [`implemented_for`]).
pub fn implemented_on(device: &burn::tensor::Device) -> bool {
    implemented_for(&Tensor::<1>::zeros([1], device))
}

/// `wrap` (a primitive of `$backend` as a tensor without autodiff) and `unwrap` (back), in the
/// module it is invoked in.
macro_rules! tensor_bridge {
    ($backend:ty, $variant:ident) => {
        pub(super) fn wrap<const D: usize>(
            p: burn::backend::tensor::FloatTensor<$backend>,
        ) -> burn::tensor::Tensor<D> {
            burn::tensor::Tensor::from_dispatch(burn::backend::DispatchTensor {
                kind: burn::backend::DispatchTensorKind::$variant(
                    burn::backend::BackendTensor::Float(p),
                ),
                autodiff: burn::backend::DispatchAutodiffContext::Disabled,
            })
        }

        pub(super) fn unwrap<const D: usize>(
            t: burn::tensor::Tensor<D>,
        ) -> burn::backend::tensor::FloatTensor<$backend> {
            match t.into_dispatch().kind {
                burn::backend::DispatchTensorKind::$variant(
                    burn::backend::BackendTensor::Float(p),
                ) => p,
                _ => unreachable!("an op's arithmetic stays on its backend"),
            }
        }
    };
}
pub(crate) use tensor_bridge;

/// The gradient of `leaf` in `grads`, or zeros where nothing reached it.
pub(crate) fn grad_or_zeros<const D: usize>(
    leaf: &Tensor<D>,
    grads: &burn::tensor::Gradients,
) -> Tensor<D> {
    leaf.grad(grads)
        .unwrap_or_else(|| Tensor::zeros(leaf.dims(), &leaf.device()).inner())
}
