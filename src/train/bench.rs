//! Benchmark of a recipe's real training steps (packing, forward, backward, clipping, AdamW), as
//! `k3mini bench train RECIPE` reports them for the README.

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
}

/// Runs `steps` optimizer steps of `recipe` in a scratch directory (removed afterwards).
pub fn bench_recipe(plan: &RunPlan, steps: usize) -> Result<RecipeBench> {
    if steps < 2 {
        bail!("bench train needs at least 2 steps (the first is warm-up)");
    }
    let out = std::env::temp_dir().join(format!("k3mini-bench-{}", std::process::id()));
    std::fs::remove_dir_all(&out).ok();
    let opts = TrainOptions {
        out_dir: Some(out.clone()),
        stop_after: Some(steps),
        quiet: true,
        ..Default::default()
    };
    let result =
        train(plan, &opts).and_then(|_| read_metrics(&out).context("reading the bench metrics"));
    std::fs::remove_dir_all(&out).ok();
    let lines = result?;
    if lines.len() < steps {
        bail!(
            "the recipe logs every {} steps: bench needs log_every = 1",
            plan.train.log_every
        );
    }
    let mut rates: Vec<f64> = lines[1..].iter().map(|m| m.tokens_per_s).collect();
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    let tokens = plan.train.batch_tokens;
    Ok(RecipeBench {
        recipe: plan.recipe_name(),
        params: k3mini_student::info::param_breakdown(&plan.model).total(),
        tokens_per_step: tokens,
        steps,
        median_tokens_per_s: median,
        median_step_s: tokens as f64 / median,
        peak_rss_bytes: lines.iter().filter_map(|m| m.peak_rss_bytes).max(),
    })
}
