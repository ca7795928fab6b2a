//! Throughput and memory measurements behind `k3mini bench` (numbers go in the README, not in tests).

use crate::config::{KdaKernel, ModelConfig};
use crate::loss::next_token_cross_entropy;
use crate::model::K3Mini;
use burn::module::Module;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, activation};
use k3mini_kernels::{KdaInputs, chunk_kda, kda::default_scale, naive_recurrent_kda};
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
    pub kernel: String,
    pub steps: usize,
    /// Tokens per second through forward + backward (no optimizer step).
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Peak RSS during the measured steps (weights included), when the OS reports it.
    pub peak_rss_bytes: Option<usize>,
}

fn random_tokens(batch: usize, seq_len: usize, vocab: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..batch * seq_len)
        .map(|i| ((i * 7919 + 13) % vocab) as i64)
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq_len]), device)
}

/// Forward + backward of the next-token loss, `steps` times after one warm-up step.
pub fn bench_train_step(
    name: &str,
    config: &ModelConfig,
    batch: usize,
    seq_len: usize,
    steps: usize,
    device: &Device,
) -> TrainStepBench {
    let device = device.clone().autodiff();
    let model = K3Mini::new(config, &device).expect("valid bench config");
    let tokens = random_tokens(batch, seq_len, config.vocab_size, &device);
    let step = || {
        let loss = next_token_cross_entropy(model.forward(tokens.clone()), tokens.clone(), None);
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
    TrainStepBench {
        name: name.into(),
        params: model.num_params(),
        batch,
        seq_len,
        kernel: format!("{:?}", config.kda.kernel).to_lowercase(),
        steps,
        tokens_per_s: (batch * seq_len * steps) as f64 / secs,
        ms_per_step: 1e3 * secs / steps as f64,
        peak_rss_bytes: peak_rss_bytes(),
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

/// Forward and forward+backward time of the naive and chunked KDA ops on random inputs.
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
    [KdaKernel::Naive, KdaKernel::Chunk]
        .into_iter()
        .map(|kernel| {
            let run = |backward: bool| {
                let q = x.q.clone().require_grad();
                let inputs = KdaInputs {
                    q: q.clone(),
                    ..x.clone()
                };
                let out = match kernel {
                    KdaKernel::Naive => naive_recurrent_kda(&inputs, scale, None),
                    KdaKernel::Chunk => chunk_kda(&inputs, scale, None, 64),
                };
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
