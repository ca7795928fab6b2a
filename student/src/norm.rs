//! RMSNorm.
//!
//! ```text
//! y = w ⊙ x / sqrt(mean(x²) + eps)
//! ```
//! computed in fp32 (the KDA output norm and the MLA latent norm rely on it).

use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor};

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
        rms_normalize(x, self.eps) * self.weight.val().unsqueeze::<D>()
    }
}

pub use k3mini_kernels::norm::rms_normalize;
