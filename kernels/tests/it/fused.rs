//! The fused chunkwise op (its own backward, recomputing from the chunk-boundary states) against
//! its twins: the composed chunk form and the naive recurrence under burn's autodiff, values and
//! the gradients of every input and of the initial state; and against fla's goldens.

use crate::common::{golden, max_abs_diff, random_inputs};
use burn::tensor::{Device, Distribution, Tensor, TensorData};
use k3mini_kernels::kda::{KdaOutput, default_scale, fused_chunk_kda};
use k3mini_kernels::{KdaInputs, chunk_kda, naive_recurrent_kda};

/// The inputs on an autodiff device, each a leaf that keeps its gradient.
fn leaves(x: &KdaInputs, s0: &Tensor<4>) -> (KdaInputs, Tensor<4>) {
    let leaf = |t: &Tensor<4>| t.clone().autodiff().require_grad();
    (
        KdaInputs {
            q: leaf(&x.q),
            k: leaf(&x.k),
            v: leaf(&x.v),
            g: leaf(&x.g),
            beta: x.beta.clone().autodiff().require_grad(),
            starts: x.starts.clone().map(|s| s.autodiff()),
        },
        leaf(s0),
    )
}

/// The output, the final state, and the gradients `[q, k, v, g, β, S_0]` of a loss that reads
/// both outputs through fixed random weights.
fn run(
    op: impl Fn(&KdaInputs, Option<Tensor<4>>) -> KdaOutput,
    x: &KdaInputs,
    s0: &Tensor<4>,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let (x, s0) = leaves(x, s0);
    let out = op(&x, Some(s0.clone()));
    let device = Device::flex();
    device.seed(seed);
    let w_o = Tensor::<4>::random(out.o.dims(), Distribution::Normal(0.0, 1.0), &device);
    let w_s = Tensor::<4>::random(out.state.dims(), Distribution::Normal(0.0, 1.0), &device);
    let loss = (out.o.clone() * w_o).sum() + (out.state.clone() * w_s).sum();
    let grads = loss.backward();
    let flat = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().unwrap();
    let g4 = |t: &Tensor<4>| flat(t.grad(&grads).expect("a gradient"));
    let beta: Vec<f32> = x
        .beta
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_into_vec()
        .unwrap();
    (
        flat(out.o.inner()),
        flat(out.state.inner()),
        vec![g4(&x.q), g4(&x.k), g4(&x.v), g4(&x.g), beta, g4(&s0)],
    )
}

/// Largest |a − b| over the largest |b|.
fn relative(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-20);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn packed(x: KdaInputs, at: &[usize]) -> KdaInputs {
    let [b, t, ..] = x.dims();
    let mut v = vec![0f32; b * t];
    for row in 0..b {
        for &p in at {
            v[row * t + p + row] = 1.0; // rows differ
        }
    }
    KdaInputs {
        starts: Some(Tensor::from_data(TensorData::new(v, [b, t]), &x.q.device())),
        ..x
    }
}

#[test]
fn fused_values_and_gradients_equal_the_composed_and_naive_forms() {
    let names = ["q", "k", "v", "g", "beta", "initial state"];
    // Odd lengths, a padded last chunk, packed documents across and at chunk boundaries; 26
    // chunks: the backward's groups of several chunks, a document across a group's edge.
    for (t, chunk, docs) in [
        (37, 16, &[][..]),
        (64, 16, &[5, 16, 40][..]),
        (99, 32, &[0, 31, 33, 70][..]),
        (203, 8, &[3, 50, 64, 120][..]),
    ] {
        let x = random_inputs(2, t, 2, 16, 8, t as u64);
        let x = if docs.is_empty() { x } else { packed(x, docs) };
        let device = Device::flex();
        device.seed(3);
        let s0 = Tensor::<4>::random([2, 2, 16, 8], Distribution::Normal(0.0, 1.0), &device);
        let scale = default_scale(16);
        let fused = run(|x, s| fused_chunk_kda(x, scale, s, chunk), &x, &s0, 9);
        let composed = run(|x, s| chunk_kda(x, scale, s, chunk), &x, &s0, 9);
        let naive = run(|x, s| naive_recurrent_kda(x, scale, s), &x, &s0, 9);
        // The forward is the composed form's arithmetic: identical values.
        assert_eq!(fused.0, composed.0, "T={t}: outputs");
        assert_eq!(fused.1, composed.1, "T={t}: final states");
        for (twin, reference) in [("composed chunk", &composed), ("naive", &naive)] {
            assert!(
                relative(&fused.0, &reference.0) <= 1e-5,
                "T={t} vs {twin}: o"
            );
            for (i, name) in names.iter().enumerate() {
                let err = relative(&fused.2[i], &reference.2[i]);
                assert!(err <= 1e-5, "T={t} C={chunk} vs {twin}: d{name} {err:e}");
            }
        }
    }
}

#[test]
fn fused_op_matches_fla_goldens() {
    const FILE: &str = "kda_ops.safetensors";
    let x = KdaInputs {
        q: golden(FILE, "q"),
        k: golden(FILE, "k"),
        v: golden(FILE, "v"),
        g: golden(FILE, "g"),
        beta: golden(FILE, "beta"),
        starts: None,
    };
    let scale = golden::<1>(FILE, "scale").into_scalar::<f32>() as f64;
    let s0 = golden::<4>(FILE, "initial_state");
    // Without autodiff (inference) and with it (training), the same values.
    let plain = fused_chunk_kda(&x, scale, Some(s0.clone()), 64);
    let (leaves, s0) = leaves(&x, &s0);
    let tracked = fused_chunk_kda(&leaves, scale, Some(s0), 64);
    for out in [plain, tracked] {
        let d_o = max_abs_diff(out.o.inner(), golden(FILE, "o_chunk"));
        let d_s = max_abs_diff(out.state.inner(), golden(FILE, "state_chunk"));
        assert!(d_o < 1e-5 && d_s < 1e-5, "|Δo| {d_o:e} |ΔS| {d_s:e}");
    }
}

#[test]
fn fused_gradients_without_an_initial_state_and_with_the_output_alone() {
    // As a training layer calls it: no initial state, the final state unused.
    let x = packed(random_inputs(1, 45, 2, 16, 16, 5), &[0, 20]);
    let scale = default_scale(16);
    let grads = |op: &dyn Fn(&KdaInputs) -> KdaOutput| {
        let (x, _) = leaves(&x, &Tensor::zeros([1, 2, 16, 16], &Device::flex()));
        let out = op(&x);
        let w = Tensor::<4>::random(
            out.o.dims(),
            Distribution::Normal(0.0, 1.0),
            &Device::flex(),
        );
        let grads = (out.o * w).sum().backward();
        let flat = |t: Tensor<4>| t.into_data().try_into_vec::<f32>().unwrap();
        [&x.q, &x.k, &x.v, &x.g].map(|t| flat(t.grad(&grads).expect("a gradient")))
    };
    Device::flex().seed(1);
    let fused = grads(&|x| fused_chunk_kda(x, scale, None, 16));
    Device::flex().seed(1);
    let composed = grads(&|x| chunk_kda(x, scale, None, 16));
    for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
        let err = relative(a, b);
        assert!(err <= 1e-5, "input {i}: {err:e}");
    }
}
