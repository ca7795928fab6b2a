//! Finite-difference gradient checks of every layer, in f64: the autodiff backward of each layer's
//! forward (input gradients and the gate parameters that go through hand-written math) must match
//! central differences.
use burn::module::Param;
use burn::tensor::{Device, Distribution, FloatDType, Tensor, TensorData};
use k3mini_student::attnres::attn_res;
use k3mini_student::config::{Activation, MoeConfig};
use k3mini_student::kda::KimiDeltaAttention;
use k3mini_student::mla::GatedMla;
use k3mini_student::mlp::Mlp;
use k3mini_student::moe::Moe;
use k3mini_student::norm::RmsNorm;
use k3mini_student::presets;
use std::sync::OnceLock;

/// The flex device with f64 as its default float type, with autodiff.
fn device() -> Device {
    static CONFIGURED: OnceLock<()> = OnceLock::new();
    CONFIGURED.get_or_init(|| {
        let mut d = Device::flex();
        d.configure(FloatDType::F64)
            .expect("flex supports f64 and nothing used it yet");
    });
    Device::flex().autodiff()
}

fn values<const D: usize>(t: &Tensor<D>) -> Vec<f64> {
    t.to_data().convert::<f64>().try_into_vec::<f64>().unwrap()
}

fn with_value<const D: usize>(t: &Tensor<D>, i: usize, delta: f64) -> Tensor<D> {
    let mut v = values(t);
    v[i] += delta;
    Tensor::from_data(TensorData::new(v, t.shape()), &t.device())
}

/// Compares d(Σ f(x)·w)/dx from autodiff with central differences at up to `samples` coordinates.
fn check_input_grad<const D: usize, const E: usize>(
    name: &str,
    x: Tensor<D>,
    f: impl Fn(Tensor<D>) -> Tensor<E>,
) {
    let dev = x.device();
    let probe_shape = f(x.clone()).shape();
    let w = Tensor::<E>::random(probe_shape, Distribution::Normal(0.0, 1.0), &dev);
    let loss = |x: Tensor<D>| (f(x) * w.clone()).sum().into_scalar::<f64>();
    let xg = x.clone().require_grad();
    let grads = (f(xg.clone()) * w.clone()).sum().backward();
    let analytic = values(&xg.grad(&grads).expect("input has a gradient"));
    let n = analytic.len();
    // Errors relative to the largest gradient entry: tiny entries carry only rounding noise.
    let scale = analytic.iter().fold(0.0f64, |m, g| m.max(g.abs()));
    assert!(
        scale > 1e-8,
        "{name}: gradient vanishes, the check would be vacuous"
    );
    let eps = 1e-6;
    let mut worst = 0.0f64;
    for i in (0..n).step_by((n / 24).max(1)) {
        let numeric = (loss(with_value(&x, i, eps)) - loss(with_value(&x, i, -eps))) / (2.0 * eps);
        worst = worst.max((numeric - analytic[i]).abs() / scale);
    }
    assert!(
        worst < 1e-6,
        "{name}: worst gradient error {worst:e} (relative to max |grad| {scale:e})"
    );
}

fn input(shape: [usize; 3]) -> Tensor<3> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &device())
}

#[test]
fn rms_norm() {
    let norm = RmsNorm::new(16, 1e-5, &device());
    check_input_grad("rmsnorm", input([2, 3, 16]), |x| norm.forward(x));
}

#[test]
fn swiglu_and_situ_mlp() {
    for act in [Activation::Swiglu, Activation::Situ] {
        device().seed(1);
        let mlp = Mlp::new(16, 24, act, &device());
        check_input_grad("mlp", input([2, 3, 16]) * 20.0, |x| mlp.forward(x));
    }
}

#[test]
fn kda_layer_chunked_and_decay_parameters() {
    let c = presets::tiny();
    for lower_bound in [None, Some(-5.0)] {
        device().seed(2);
        let mut kda_cfg = c.kda.clone();
        kda_cfg.head_dim = 8;
        kda_cfg.chunk_size = 4; // several chunks plus a ragged tail over T = 10
        kda_cfg.gate_lower_bound = lower_bound;
        let layer = KimiDeltaAttention::new(16, 2, &kda_cfg, 1e-5, &device());
        let x = input([1, 10, 16]);
        check_input_grad("kda input", x.clone(), |x| layer.forward(x, None, None));
        // The decay parameters go through hand-written gate math: check them too.
        let a_log = layer.forget_gate.a_log.val();
        check_input_grad("kda A_log", a_log, |a| {
            let mut l = layer.clone();
            l.forget_gate.a_log = Param::from_tensor(a);
            l.forward(x.clone(), None, None)
        });
        let dt_bias = layer.forget_gate.dt_bias.val();
        check_input_grad("kda dt_bias", dt_bias, |b| {
            let mut l = layer.clone();
            l.forget_gate.dt_bias = Param::from_tensor(b);
            l.forward(x.clone(), None, None)
        });
    }
}

#[test]
fn kda_layer_over_packed_documents() {
    let mut kda_cfg = presets::tiny().kda;
    kda_cfg.head_dim = 8;
    kda_cfg.chunk_size = 4;
    device().seed(6);
    let layer = KimiDeltaAttention::new(16, 2, &kda_cfg, 1e-5, &device());
    let mut starts = vec![0.0; 10];
    starts[3] = 1.0;
    starts[6] = 1.0;
    let starts = Tensor::<2>::from_data(TensorData::new(starts, [1, 10]), &device());
    check_input_grad("kda packed", input([1, 10, 16]), |x| {
        layer.forward(x, None, Some(&starts))
    });
}

#[test]
fn gated_mla_with_q_lora() {
    let mut cfg = presets::tiny().mla;
    cfg.q_lora_rank = Some(8);
    cfg.output_gate = true;
    cfg.kv_lora_rank = 12;
    device().seed(3);
    let layer = GatedMla::new(16, 2, &cfg, &device());
    check_input_grad("mla", input([2, 5, 16]) * 10.0, |x| {
        layer.forward(x, None, None)
    });
}

#[test]
fn moe_with_latent_and_shared_experts() {
    let cfg = MoeConfig {
        num_experts: 4,
        top_k: 2,
        num_shared_experts: 1,
        expert_hidden: 8,
        routed_scaling_factor: 2.0,
        latent_dim: Some(8),
        first_dense_layers: 0,
        bias_update_rate: 0.0,
        balance_loss_weight: 0.5,
    };
    device().seed(4);
    let moe = Moe::new(16, &cfg, Activation::Swiglu, 1e-5, &device());
    // Routing is piecewise constant in x: small perturbations do not flip the top-k.
    check_input_grad("moe", input([1, 6, 16]) * 10.0, |x| moe.forward(x).y);
    check_input_grad("moe balance loss", input([2, 6, 16]) * 10.0, |x| {
        moe.forward(x).balance_loss.expect("α is set")
    });
}

#[test]
fn attn_res_sources_and_query() {
    device().seed(5);
    let norm = RmsNorm::new(8, 1e-5, &device());
    let sources: Vec<_> = (0..4).map(|_| input([2, 3, 8])).collect();
    let q = Tensor::<1>::random([8], Distribution::Normal(0.0, 1.0), &device());
    check_input_grad("attnres source", sources[2].clone(), |s| {
        let mut all = sources.clone();
        all[2] = s;
        attn_res(q.clone(), &all, &norm)
    });
    check_input_grad("attnres query", q.clone(), |q| attn_res(q, &sources, &norm));
}
