//! Throughput and memory measurements behind `k3mini bench` (numbers go in the README, not in tests).

use crate::config::{KdaKernel, ModelConfig};
use crate::head::{HeadChunks, head_loss};
use crate::info::train_flops_per_token;
use crate::loss::cross_entropy;
use crate::model::K3Mini;
use burn::module::Module;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, activation};
use k3mini_kernels::{KdaInputs, kda::default_scale};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// A `KEY: N kB` line of a /proc file, in bytes; `None` off Linux.
fn proc_kib(file: &str, key: &str) -> Option<usize> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak resident memory of this process (VmHWM), in bytes; `None` off Linux.
pub fn peak_rss_bytes() -> Option<usize> {
    proc_kib("/proc/self/status", "VmHWM:")
}

/// Resident memory of this process now (VmRSS), in bytes; `None` off Linux.
pub fn rss_bytes() -> Option<usize> {
    proc_kib("/proc/self/status", "VmRSS:")
}

/// This machine's memory (MemTotal), in bytes; `None` off Linux.
pub fn total_memory_bytes() -> Option<usize> {
    proc_kib("/proc/meminfo", "MemTotal:")
}

/// Resets the peak-RSS watermark so the next [`peak_rss_bytes`] covers only what follows.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// One forward+backward measurement of a whole model.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainStepBench {
    pub name: String,
    pub params: usize,
    pub batch: usize,
    pub seq_len: usize,
    pub kernel: KdaKernel,
    /// How the LM head and loss ran.
    pub head: HeadChunks,
    pub steps: usize,
    /// Tokens per second through forward + backward (no optimizer step).
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Peak RSS during the measured steps (weights included), when the OS reports it.
    pub peak_rss_bytes: Option<usize>,
    /// Model FLOPs per second ([`crate::info::train_flops_per_token`] × tokens/s).
    pub model_gflops: f64,
    /// This device's f32 peak as measured in the same process: the best of [`matmul_gflops`].
    pub peak_gflops: f64,
}

impl TrainStepBench {
    /// Model FLOPs utilisation: the share of the measured f32 peak the step reaches.
    pub fn mfu(&self) -> f64 {
        self.model_gflops / self.peak_gflops
    }
}

/// Square f32 matmuls `n × n · n × n` on `device`: the best GFLOP/s of `reps` (after a warm-up),
/// the practical peak a training step's FLOPs are measured against.
pub fn matmul_gflops(n: usize, reps: usize, device: &Device) -> f64 {
    let a = Tensor::<2>::random([n, n], Distribution::Normal(0.0, 1.0), device);
    let b = Tensor::<2>::random([n, n], Distribution::Normal(0.0, 1.0), device);
    let run = || {
        let start = Instant::now();
        // Reading one value waits for the product on asynchronous backends.
        let _ = a
            .clone()
            .matmul(b.clone())
            .narrow(0, 0, 1)
            .narrow(1, 0, 1)
            .into_scalar::<f32>();
        start.elapsed().as_secs_f64()
    };
    run();
    let best = (0..reps.max(1))
        .map(|_| run())
        .fold(f64::INFINITY, f64::min);
    2.0 * (n as f64).powi(3) / best / 1e9
}

fn random_tokens(batch: usize, seq_len: usize, vocab: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..batch * seq_len)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq_len]), device)
}

/// Forward + backward of the next-token loss, the head in `head`'s chunks, `steps` times after
/// one warm-up step.
pub fn bench_train_step(
    name: &str,
    config: &ModelConfig,
    batch: usize,
    seq_len: usize,
    steps: usize,
    head: HeadChunks,
    device: &Device,
) -> TrainStepBench {
    let peak_gflops = matmul_gflops(1024, 10, device);
    let device = device.clone().autodiff();
    let model = K3Mini::new(config, &device).expect("valid bench config");
    let tokens = random_tokens(batch, seq_len, config.vocab_size, &device);
    let n = batch * (seq_len - 1);
    let targets = tokens.clone().narrow(1, 1, seq_len - 1).reshape([n]);
    let step = || {
        let hidden = model.trunk(tokens.clone(), None).predicting();
        let loss = head_loss(&model, hidden, head, |logits, r| {
            cross_entropy(logits, targets.clone().narrow(0, r.start, r.len())).sum() / n as f64
        });
        let grads = loss.backward();
        drop(grads);
    };
    step();
    reset_peak_rss();
    let start = Instant::now();
    for _ in 0..steps {
        step();
    }
    let secs = start.elapsed().as_secs_f64();
    let tokens_per_s = (batch * seq_len * steps) as f64 / secs;
    TrainStepBench {
        name: name.into(),
        params: model.num_params(),
        batch,
        seq_len,
        kernel: config.kda.kernel,
        head,
        steps,
        tokens_per_s,
        ms_per_step: 1e3 * secs / steps as f64,
        peak_rss_bytes: peak_rss_bytes(),
        model_gflops: train_flops_per_token(config, seq_len) * tokens_per_s / 1e9,
        peak_gflops,
    }
}

/// One KDA op measurement.
#[derive(Clone, Debug, Serialize)]
pub struct KdaBench {
    pub kernel: String,
    pub seq_len: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub forward_ms: f64,
    pub forward_backward_ms: f64,
}

/// Forward and forward+backward time of the KDA op's three forms (naive, composed, fused chunk)
/// on random inputs.
pub fn bench_kda(
    batch: usize,
    seq_len: usize,
    heads: usize,
    head_dim: usize,
    reps: usize,
    device: &Device,
) -> Vec<KdaBench> {
    let device = device.clone().autodiff();
    let normal =
        |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let l2 = |x: Tensor<4>| x.clone() / (x.square().sum_dim(3) + 1e-6).sqrt();
    let shape = [batch, seq_len, heads, head_dim];
    let x = KdaInputs {
        q: l2(normal(shape)),
        k: l2(normal(shape)),
        v: normal(shape),
        g: activation::log_sigmoid(normal(shape) + 3.0),
        beta: activation::sigmoid(Tensor::random(
            [batch, seq_len, heads],
            Distribution::Normal(0.0, 1.0),
            &device,
        )),
        starts: None,
    };
    let scale = default_scale(head_dim);
    [KdaKernel::Naive, KdaKernel::Composed, KdaKernel::Chunk]
        .into_iter()
        .map(|kernel| {
            let run = |backward: bool| {
                // With a backward every input is a leaf, as in a layer: each form computes all
                // five gradients. The forward alone records no graph.
                let leaf = |t: &Tensor<4>| t.clone().set_require_grad(backward);
                let inputs = KdaInputs {
                    q: leaf(&x.q),
                    k: leaf(&x.k),
                    v: leaf(&x.v),
                    g: leaf(&x.g),
                    beta: x.beta.clone().set_require_grad(backward),
                    starts: None,
                };
                let out = kernel.apply(&inputs, scale, None, 64);
                if backward {
                    let _ = out.o.sum().backward();
                } else {
                    let _ = out.o.into_data();
                }
            };
            let time = |backward: bool| {
                run(backward);
                let start = Instant::now();
                for _ in 0..reps {
                    run(backward);
                }
                1e3 * start.elapsed().as_secs_f64() / reps as f64
            };
            KdaBench {
                kernel: format!("{kernel:?}").to_lowercase(),
                seq_len,
                heads,
                head_dim,
                forward_ms: time(false),
                forward_backward_ms: time(true),
            }
        })
        .collect()
}

/// The ~50M-parameter shape the benchmarks use alongside `tiny`: smoke-300m's layer recipe at width 512.
pub fn bench_50m() -> ModelConfig {
    let mut c = crate::presets::smoke_300m();
    c.vocab_size = 24_576;
    c.d_model = 512;
    c.n_layers = 8;
    c.n_heads = 4;
    c.ffn_hidden = 1408;
    c.mla.kv_lora_rank = 256;
    c
}
