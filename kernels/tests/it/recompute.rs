//! The recompute region (keeps its inputs, recomputes the rest in its backward) against the same
//! arithmetic composed under burn's autodiff: values, and the gradients of every input, on a
//! gated activation and on attention over chunks of queries with a constant mask, with and
//! without gradient checkpointing.

use burn::tensor::{Device, Distribution, Tensor, activation};
use k3mini_kernels::recompute::{ComposedRegions, recompute};

fn normal(shape: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device)
}

fn flat(t: Tensor<4>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

/// Largest |a − b| over the largest |b|.
fn relative(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-20);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// `silu(gate) ⊙ up`, as the student's FFNs compute it.
fn swiglu(x: &[Tensor<4>]) -> Tensor<4> {
    activation::silu(x[0].clone()) * x[1].clone()
}

/// The output and the gradients of the tracked inputs under a loss with fixed random weights:
/// `forward` receives the inputs as leaves (the first `tracked` of them require gradients).
fn run(
    forward: &dyn Fn(&[Tensor<4>]) -> Tensor<4>,
    inputs: &[Tensor<4>],
    tracked: usize,
    device: &Device,
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let leaves: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let x = Tensor::<4>::from_data(x.to_data(), device);
            if i < tracked { x.require_grad() } else { x }
        })
        .collect();
    let y = forward(&leaves);
    device.seed(7);
    let w = normal(y.dims(), device);
    let grads = (y.clone() * w).sum().backward();
    let grads = leaves[..tracked]
        .iter()
        .map(|x| flat(x.grad(&grads).expect("a gradient")))
        .collect();
    (flat(y.inner()), grads)
}

fn devices() -> [(&'static str, Device); 2] {
    let flex = Device::flex();
    [
        ("autodiff", flex.clone().autodiff()),
        ("checkpointing", flex.autodiff().gradient_checkpointing()),
    ]
}

#[test]
fn a_gated_activation_recomputed_equals_the_composed_one() {
    let device = Device::flex();
    device.seed(1);
    let inputs = [
        normal([1, 2, 37, 24], &device),
        normal([1, 2, 37, 24], &device),
    ];
    for (name, device) in devices() {
        let fused = run(&|x| recompute(x.to_vec(), swiglu), &inputs, 2, &device);
        let composed = run(&swiglu, &inputs, 2, &device);
        assert_eq!(fused.0, composed.0, "{name}: values");
        for (i, (a, b)) in fused.1.iter().zip(&composed.1).enumerate() {
            let err = relative(a, b);
            assert!(err <= 1e-6, "{name}: input {i} gradient {err:e}");
        }
    }
    // Without autodiff: the region's value.
    let plain = recompute(inputs.to_vec(), swiglu);
    assert_eq!(flat(plain), flat(swiglu(&inputs)));
    // The reference switch composes the region: the same values and gradients.
    let device = Device::flex().autodiff();
    let fused = run(&|x| recompute(x.to_vec(), swiglu), &inputs, 2, &device);
    let reference = {
        let _composed = ComposedRegions::new();
        run(&|x| recompute(x.to_vec(), swiglu), &inputs, 2, &device)
    };
    assert_eq!(fused.0, reference.0);
    for (a, b) in fused.1.iter().zip(&reference.1) {
        assert!(relative(a, b) <= 1e-6);
    }
}

/// Causal attention `softmax(q kᵀ / √d + mask) v` with the mask an input the region does not
/// differentiate: `[B, H, Tq, d]` queries against `[B, H, S, d]` keys and values.
fn attention(x: &[Tensor<4>]) -> Tensor<4> {
    let [q, k, v, mask] = [&x[0], &x[1], &x[2], &x[3]].map(|t| t.clone());
    let d = q.dims()[3] as f64;
    let scores = q.matmul(k.swap_dims(2, 3)) / d.sqrt() + mask;
    activation::softmax(scores, 3).matmul(v)
}

#[test]
fn attention_over_chunks_of_queries_recomputed_equals_the_composed_one() {
    let (b, h, t, d) = (2, 3, 45, 8);
    let device = Device::flex();
    device.seed(2);
    let q = normal([b, h, t, d], &device);
    let k = normal([b, h, t, d], &device);
    let v = normal([b, h, t, d], &device);
    // Causal, with a document starting at 20 in every row: −1e9 where a key is hidden.
    let mask: Vec<f32> = (0..t * t)
        .map(|n| {
            let (i, j) = (n / t, n % t);
            let visible = j <= i && (i < 20 || j >= 20);
            if visible { 0.0 } else { -1e9 }
        })
        .collect();
    let mask = Tensor::<1>::from_floats(mask.as_slice(), &device).reshape([1, 1, t, t]);
    let inputs = [q, k, v, mask];
    let chunked = |x: &[Tensor<4>]| {
        let parts = (0..t)
            .step_by(16)
            .map(|i| {
                let n = 16.min(t - i);
                let q = x[0].clone().narrow(2, i, n);
                let mask = x[3].clone().narrow(2, i, n);
                recompute(vec![q, x[1].clone(), x[2].clone(), mask], attention)
            })
            .collect();
        Tensor::cat(parts, 2)
    };
    for (name, device) in devices() {
        let fused = run(&chunked, &inputs, 3, &device);
        let composed = run(&attention, &inputs, 3, &device);
        assert!(relative(&fused.0, &composed.0) <= 1e-6, "{name}: values");
        for (i, (a, b)) in fused.1.iter().zip(&composed.1).enumerate() {
            let err = relative(a, b);
            assert!(err <= 1e-5, "{name}: input {i} gradient {err:e}");
        }
    }
}
