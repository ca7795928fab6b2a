// Shared helpers for the kernel tests (included with `mod common;`).
#![allow(dead_code)]

use burn::tensor::{Device, Distribution, Tensor, activation};
use k3mini_kernels::KdaInputs;

pub fn device() -> Device {
    Device::flex()
}

/// Random KDA inputs shaped like a real layer's: L2-normalised q/k, log-decay in (-5, 0), β in (0, 1).
pub fn random_inputs(b: usize, t: usize, h: usize, dk: usize, dv: usize, seed: u64) -> KdaInputs {
    let device = device();
    device.seed(seed);
    let normal =
        |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let l2 = |x: Tensor<4>| x.clone() / (x.square().sum_dim(3) + 1e-6).sqrt();
    KdaInputs {
        q: l2(normal([b, t, h, dk])),
        k: l2(normal([b, t, h, dk])),
        v: normal([b, t, h, dv]),
        g: activation::log_sigmoid(normal([b, t, h, dk]) * 2.0 + 2.0).clamp_min(-5.0),
        beta: activation::sigmoid(Tensor::<3>::random(
            [b, t, h],
            Distribution::Normal(0.0, 1.0),
            &device,
        )),
        starts: None,
    }
}

pub fn max_abs_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    (a - b).abs().max().into_scalar::<f32>()
}

/// Reads an f32 tensor from a golden safetensors file in `tests/golden/` at the repository root.
pub fn golden<const D: usize>(file: &str, name: &str) -> Tensor<D> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(file);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("golden file parses");
    let view = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("{file}: {name}: {e}"));
    assert_eq!(
        view.dtype(),
        safetensors::Dtype::F32,
        "{file}: {name} must be f32"
    );
    let values: Vec<f32> = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Tensor::from_data(
        burn::tensor::TensorData::new(values, view.shape().to_vec()),
        &device(),
    )
}
