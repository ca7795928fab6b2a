//! A recipe's real training steps (packing, forward, backward, clipping, AdamW;
//! `k3mini bench train RECIPE`): tokens/s, how many devices worked at once, and peak memory.

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::RunPlan;
use crate::run_dir::read_metrics;
use crate::train::trainer::{TrainOptions, train};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct RecipeBench {
    pub recipe: String,
    pub params: usize,
    pub tokens_per_step: usize,
    pub steps: usize,
    /// Median over the steps after the first (which pays one-off allocation and warm-up).
    pub median_tokens_per_s: f64,
    pub median_step_s: f64,
    /// Peak resident memory of the process over the run.
    pub peak_rss_bytes: Option<usize>,
    /// Resident memory before the run began (the binary, its libraries, the allocator's pools).
    pub baseline_rss_bytes: Option<usize>,
    /// The most heap bytes live at once during a step (checkpoints written between steps
    /// excluded), and those live before the run, where the binary counts them
    /// (`k3mini_student::bench::CountingAlloc`): unlike resident memory, not inflated by what the
    /// allocator keeps after a free.
    pub peak_heap_bytes: Option<usize>,
    pub baseline_heap_bytes: Option<usize>,
    /// Model FLOPs of one training token (`k3mini_student::info::train_flops_per_token`).
    pub flops_per_token: f64,
    /// Devices the step runs on, and how many of them worked at once: the median over the steps
    /// after the first of Σ (each device's forward and backward seconds) / the step's seconds.
    /// Near the device count when the replicas overlap, at most 1 when they take turns.
    pub devices: usize,
    pub median_concurrency: f64,
}

impl RecipeBench {
    /// Activation memory as the issue tracker measures it: the peak less what was live before and
    /// the f32 weights, gradients and AdamW moments (16 bytes a parameter); from the heap where it
    /// is counted, else from resident memory.
    pub fn measured_activations(&self) -> Option<usize> {
        let (peak, base) = match (self.peak_heap_bytes, self.baseline_heap_bytes) {
            (Some(p), Some(b)) => (p, b),
            _ => (self.peak_rss_bytes?, self.baseline_rss_bytes?),
        };
        Some(peak.saturating_sub(base + 16 * self.params))
    }
}

/// Runs `steps` optimizer steps of `recipe` in a scratch directory (removed afterwards).
pub fn bench_recipe(plan: &RunPlan, steps: usize) -> Result<RecipeBench> {
    if steps < 2 {
        bail!("bench train needs at least 2 steps (the first is warm-up)");
    }
    let scratch = crate::scratch::Scratch::new("bench-train")?;
    let out = scratch.path().join("run");
    let baseline_rss_bytes = k3mini_student::bench::rss_bytes();
    let main = plan.devices.open()?.into_iter().next();
    let counted = main.is_some_and(|d| k3mini_student::bench::counts_heap(&d));
    let baseline_heap_bytes = k3mini_student::bench::heap_live_bytes().filter(|_| counted);
    let opts = TrainOptions {
        out_dir: Some(out.clone()),
        stop_after: Some(steps),
        ..Default::default()
    };
    train(plan, &opts)?;
    let lines = read_metrics(&out).context("reading the bench metrics")?;
    if lines.len() < steps {
        bail!(
            "the recipe logs every {} steps: bench needs log_every = 1",
            plan.train.log_every
        );
    }
    let tokens = plan.train.batch_tokens;
    let median = |f: &dyn Fn(&crate::run_dir::StepMetrics) -> f64| {
        let mut v: Vec<f64> = lines[1..].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let concurrency =
        median(&|m| m.replica_busy_s.iter().sum::<f64>() * m.tokens_per_s / tokens as f64);
    let median = median(&|m| m.tokens_per_s);
    Ok(RecipeBench {
        recipe: plan.recipe_name(),
        params: k3mini_student::info::param_breakdown(&plan.model).total(),
        tokens_per_step: tokens,
        steps,
        median_tokens_per_s: median,
        median_step_s: tokens as f64 / median,
        peak_rss_bytes: lines.iter().filter_map(|m| m.peak_rss_bytes).max(),
        baseline_rss_bytes,
        peak_heap_bytes: lines
            .iter()
            .filter_map(|m| m.step_peak_heap_bytes)
            .max()
            .filter(|_| counted),
        baseline_heap_bytes,
        flops_per_token: k3mini_student::info::train_flops_per_token(
            &plan.model,
            plan.data.seq_len,
        ),
        devices: plan.devices.replicas(),
        median_concurrency: concurrency,
    })
}
