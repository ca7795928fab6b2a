//! RMSNorm.
//!
//! ```text
//! y = w ⊙ x / sqrt(mean(x²) + eps)
//! ```
//! computed in fp32 (the KDA output norm and the MLA latent norm rely on it). A recompute region
//! ([`k3mini_kernels::recompute`]): the backward keeps `x` and recomputes the statistics.

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};
use k3mini_kernels::recompute::recompute;

#[derive(Module, Debug)]
pub struct RmsNorm {
    pub weight: Param<Tensor<1>>,
    #[module(skip)]
    pub eps: f64,
}

impl RmsNorm {
    /// Unit weight, as every reference initialises it.
    pub fn new(dim: usize, eps: f64, device: &Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([dim], device)),
            eps,
        }
    }

    /// Normalises over the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let eps = self.eps;
        let w = self.weight.val().unsqueeze::<4>();
        recompute(vec![rows(x), w], move |x| {
            rms_normalize(x[0].clone(), eps) * x[1].clone()
        })
        .reshape(dims)
    }
}

/// `[..., X]` → `[1, 1, rows, X]`: a region's rank-4 view of a tensor normalised or gated
/// along its last dimension.
pub fn rows<const D: usize>(x: Tensor<D>) -> Tensor<4> {
    let dims = x.dims();
    let last = dims[D - 1];
    x.reshape([1, 1, dims.iter().product::<usize>() / last.max(1), last])
}

pub use k3mini_kernels::norm::rms_normalize;
