//! Normalisation without weights, shared by the student's layers and the llama teacher.

use burn::tensor::Tensor;

/// `x / sqrt(mean(x²) + eps)` over the last dimension, without a weight.
pub fn rms_normalize<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    let rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt();
    x / rms
}
