//! Throughput and memory measurements behind `k3mini bench` (numbers go in the README, not in tests).

use crate::config::{ConfigError, KdaKernel, ModelConfig, bad};
use crate::head::{HeadChunks, head_loss};
use crate::info::{Footprint, train_flops_per_token, training_memory};
use crate::loss::cross_entropy;
use crate::model::K3Mini;
use burn::module::Module;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData, activation};
use k3mini_kernels::recompute::ComposedRegions;
use k3mini_kernels::{KdaInputs, kda::default_scale};
use serde::{Deserialize, Serialize};
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// A global allocator that counts the bytes live on the heap and their peak, around another
/// (the binary installs it over mimalloc). Resident memory (VmHWM) also counts what the allocator
/// keeps after a free, so it overstates a peak by however much the allocator retains; live bytes
/// are what the estimate in [`crate::info`] predicts.
pub struct CountingAlloc<A>(pub A);

static HEAP_LIVE: AtomicUsize = AtomicUsize::new(0);
static HEAP_PEAK: AtomicUsize = AtomicUsize::new(0);
static COUNTING: AtomicBool = AtomicBool::new(false);

// SAFETY: every call goes to the inner allocator unchanged; the counters are only arithmetic.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { self.0.dealloc(ptr, layout) };
        HEAP_LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Both buffers may be live while a moving realloc copies: counted first, then freed.
            grew(new_size);
            HEAP_LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

fn grew(size: usize) {
    if !COUNTING.load(Ordering::Relaxed) {
        COUNTING.store(true, Ordering::Relaxed);
    }
    let live = HEAP_LIVE.fetch_add(size, Ordering::Relaxed) + size;
    if live > HEAP_PEAK.load(Ordering::Relaxed) {
        HEAP_PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

/// Whether [`CountingAlloc`] sees `device`'s tensors: flex's buffers are Rust allocations;
/// libtorch's and the GPUs' are not.
pub fn counts_heap(device: &Device) -> bool {
    let probe = Tensor::<1>::zeros([1], device).inner();
    matches!(
        probe.into_dispatch().kind,
        burn::backend::DispatchTensorKind::Flex(_)
    )
}

/// Bytes live on the heap now; `None` where [`CountingAlloc`] is not the global allocator.
pub fn heap_live_bytes() -> Option<usize> {
    COUNTING
        .load(Ordering::Relaxed)
        .then(|| HEAP_LIVE.load(Ordering::Relaxed))
}

/// The most bytes live on the heap at once since the last [`reset_heap_peak`].
pub fn heap_peak_bytes() -> Option<usize> {
    COUNTING
        .load(Ordering::Relaxed)
        .then(|| HEAP_PEAK.load(Ordering::Relaxed))
}

/// Starts a new heap peak from what is live now.
pub fn reset_heap_peak() {
    HEAP_PEAK.store(HEAP_LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// What [`bench_train_step`] runs: a model shape, its micro-batch and how the step keeps memory.
#[derive(Clone, Debug)]
pub struct StepSpec {
    pub name: String,
    pub config: ModelConfig,
    pub batch: usize,
    pub seq_len: usize,
    /// Measured steps, after one warm-up step.
    pub steps: usize,
    pub head: HeadChunks,
    /// Activation checkpointing (`train.activation_checkpointing`, [`K3Mini::with_checkpointing`]).
    pub checkpointing: bool,
    /// Every recompute region composed, its reference twin
    /// ([`k3mini_kernels::recompute::ComposedRegions`]).
    pub composed_regions: bool,
}

/// A [`StepSpec`] named by its shape (a preset or one of [`BENCH_SHAPES`]): what
/// `k3mini bench model` measures, and what a benchmark sends to the child process that measures it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShapeStep {
    pub shape: String,
    pub batch: usize,
    pub seq_len: usize,
    /// Measured steps, after one warm-up step.
    pub steps: usize,
    pub kernel: KdaKernel,
    /// `train.head_chunk` ([`HeadChunks::resolve`]).
    pub head_chunk: Option<usize>,
    pub checkpointing: bool,
    pub composed_regions: bool,
}

impl ShapeStep {
    /// `shape` on the training path: the fused KDA op, the head chunked as training chunks it,
    /// recompute regions, no activation checkpointing.
    pub fn new(shape: &str, batch: usize, seq_len: usize, steps: usize) -> Self {
        Self {
            shape: shape.into(),
            batch,
            seq_len,
            steps,
            kernel: KdaKernel::Chunk,
            head_chunk: None,
            checkpointing: false,
            composed_regions: false,
        }
    }

    /// The same step on the reference: the composed KDA kernel, the whole head at once and
    /// composed regions.
    pub fn reference(self) -> Self {
        Self {
            kernel: KdaKernel::Composed,
            head_chunk: Some(0),
            composed_regions: true,
            ..self
        }
    }

    pub fn spec(&self) -> Result<StepSpec, ConfigError> {
        if self.seq_len < 2 || self.batch == 0 || self.steps == 0 {
            return Err(bad(
                "bench",
                format_args!(
                    "batch {} x seq_len {}, {} steps: a step needs at least one sequence of at \
                     least 2 tokens, and a measurement at least one step",
                    self.batch, self.seq_len, self.steps
                ),
            ));
        }
        let mut config = bench_shape(&self.shape)?;
        config.kda.kernel = self.kernel;
        Ok(StepSpec {
            name: self.shape.clone(),
            head: HeadChunks::resolve(self.head_chunk, config.vocab_size),
            config,
            batch: self.batch,
            seq_len: self.seq_len,
            steps: self.steps,
            checkpointing: self.checkpointing,
            composed_regions: self.composed_regions,
        })
    }
}

/// The memory model's validation: four sizes from tiny to smoke-300m and the 3B preset's layers at
/// small width ([`BENCH_SHAPES`]), each without and then with activation checkpointing.
pub fn memory_steps(steps: usize) -> Vec<ShapeStep> {
    let [b50, b150, k3] = BENCH_SHAPES;
    let shapes = [
        ("tiny", 4, 128),
        (b50, 4, 256),
        (b150, 2, 512),
        ("smoke-300m", 2, 256),
        (k3, 1, 1024),
    ];
    shapes
        .iter()
        .flat_map(|&(shape, batch, seq)| {
            [false, true].map(|checkpointing| ShapeStep {
                checkpointing,
                ..ShapeStep::new(shape, batch, seq, steps)
            })
        })
        .collect()
}

/// The training path against its reference ([`ShapeStep::reference`]) at tiny and `bench-50m`,
/// interleaved A B A B (these machines are shared: compare neighbours).
pub fn training_path_steps(steps: usize) -> Vec<ShapeStep> {
    [("tiny", 8, 256), (BENCH_SHAPES[0], 4, 256)]
        .iter()
        .flat_map(|&(shape, batch, seq)| {
            let path = ShapeStep::new(shape, batch, seq, steps);
            let reference = path.clone().reference();
            [path.clone(), reference.clone(), path, reference]
        })
        .collect()
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
    pub checkpointing: bool,
    pub composed_regions: bool,
    pub steps: usize,
    /// Tokens per second through forward + backward (no optimizer step).
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Peak RSS during the measured steps (weights included), when the OS reports it.
    pub peak_rss_bytes: Option<usize>,
    /// Heap bytes the graph holds at the end of the forward, over those live before it (the
    /// most of the measured steps), where [`CountingAlloc`] counts them ([`counts_heap`]).
    pub kept_bytes: Option<usize>,
    /// The most heap bytes live during a step (forward, backward, the gradients), over those
    /// live before it.
    pub step_peak_bytes: Option<usize>,
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

    /// `model info`'s activation estimate for this step: (kept after the forward; kept plus the
    /// largest transient and the weights' gradients, what a forward + backward may peak at).
    pub fn estimate(&self) -> Result<(usize, usize), ConfigError> {
        let mut config = bench_shape(&self.name)?;
        config.kda.kernel = self.kernel;
        let footprint = Footprint {
            head_chunk: Some(match self.head {
                HeadChunks::Tokens(n) => n,
                HeadChunks::Whole => 0,
            }),
            activation_checkpointing: self.checkpointing,
            ..Footprint::new(self.batch, self.seq_len)
        };
        let m = training_memory(&config, &footprint);
        Ok((m.kept(), m.activations + m.grads))
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

/// Forward + backward of the next-token loss, `spec.steps` times after one warm-up step.
pub fn bench_train_step(spec: &StepSpec, device: &Device) -> TrainStepBench {
    let StepSpec {
        config,
        batch,
        seq_len,
        steps,
        head,
        ..
    } = spec;
    let (batch, seq_len, steps, head) = (*batch, *seq_len, *steps, *head);
    let peak_gflops = matmul_gflops(1024, 10, device);
    let counted = counts_heap(device);
    let device = device.clone().autodiff();
    let _composed = spec.composed_regions.then(ComposedRegions::new);
    let model = K3Mini::new(config, &device)
        .expect("valid bench config")
        .with_checkpointing(spec.checkpointing);
    let tokens = random_tokens(batch, seq_len, config.vocab_size, &device);
    let n = batch * (seq_len - 1);
    let targets = tokens.clone().narrow(1, 1, seq_len - 1).reshape([n]);
    // (kept at the end of the forward, the step's peak), over what was live before it.
    let step = || {
        let before = heap_live_bytes();
        reset_heap_peak();
        let hidden = model.trunk(tokens.clone(), None).predicting();
        let loss = head_loss(&model, hidden, head, |logits, r| {
            cross_entropy(logits, targets.clone().narrow(0, r.start, r.len())).sum() / n as f64
        });
        let kept = heap_live_bytes();
        let grads = loss.backward();
        drop(grads);
        let peak = heap_peak_bytes();
        let heap = before.zip(kept).zip(peak).filter(|_| counted);
        heap.map(|((b, k), p)| (k.saturating_sub(b), p.saturating_sub(b)))
    };
    step();
    reset_peak_rss();
    let start = Instant::now();
    let heap: Vec<_> = (0..steps).filter_map(|_| step()).collect();
    let secs = start.elapsed().as_secs_f64();
    let tokens_per_s = (batch * seq_len * steps) as f64 / secs;
    TrainStepBench {
        name: spec.name.clone(),
        params: model.num_params(),
        batch,
        seq_len,
        kernel: config.kda.kernel,
        head,
        checkpointing: spec.checkpointing,
        composed_regions: spec.composed_regions,
        steps,
        tokens_per_s,
        ms_per_step: 1e3 * secs / steps as f64,
        peak_rss_bytes: peak_rss_bytes(),
        kept_bytes: heap.iter().map(|h| h.0).max(),
        step_peak_bytes: heap.iter().map(|h| h.1).max(),
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

/// Benchmark shapes between the presets: on smoke-300m's layer recipe and vocabulary,
/// `bench-50m` (width 512, 8 layers) and `bench-150m` (width 768, 12 layers); `bench-k3`, the
/// 3B preset's layers (safe gate, full-rank gate, q-LoRA, Gated MLA, AttnRes) at width 384 over 8
/// layers and a 24,576 vocabulary.
pub const BENCH_SHAPES: [&str; 3] = ["bench-50m", "bench-150m", "bench-k3"];

/// A preset or one of [`BENCH_SHAPES`] by name.
pub fn bench_shape(name: &str) -> Result<ModelConfig, ConfigError> {
    let mut c = crate::presets::smoke_300m();
    match name {
        "bench-k3" => {
            c = crate::presets::k3_mini_3b();
            c.vocab_size = 24_576;
            c.d_model = 384;
            c.n_layers = 8;
            c.n_heads = 3;
            c.ffn_hidden = 1024;
            c.mla.q_lora_rank = Some(192);
            c.mla.kv_lora_rank = 128;
        }
        "bench-50m" => {
            c.vocab_size = 24_576;
            c.d_model = 512;
            c.n_layers = 8;
            c.n_heads = 4;
            c.ffn_hidden = 1408;
            c.mla.kv_lora_rank = 256;
        }
        "bench-150m" => {
            c.d_model = 768;
            c.n_layers = 12;
            c.n_heads = 6;
            c.ffn_hidden = 2048;
            c.mla.kv_lora_rank = 384;
        }
        name => return crate::presets::preset(name),
    }
    Ok(c)
}
