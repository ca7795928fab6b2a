//! Benchmark of a recipe's real training steps (packing, forward, backward, clipping, AdamW), as
//! `k3mini bench train RECIPE` reports them for the README.

use crate::recipe::LoadedRecipe;
use crate::train::trainer::{StepMetrics, TrainOptions, train};
use anyhow::{Context, Result, bail};
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
pub fn bench_recipe(recipe: &LoadedRecipe, steps: usize) -> Result<RecipeBench> {
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
    let result = train(recipe, &opts).and_then(|_| {
        std::fs::read_to_string(out.join("metrics.jsonl")).context("reading the bench metrics")
    });
    std::fs::remove_dir_all(&out).ok();
    let lines: Vec<StepMetrics> = result?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    if lines.len() < steps {
        bail!(
            "the recipe logs every {} steps: bench needs log_every = 1",
            recipe.recipe.train.log_every
        );
    }
    let mut rates: Vec<f64> = lines[1..].iter().map(|m| m.tokens_per_s).collect();
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    let tokens = recipe.recipe.train.batch_tokens;
    Ok(RecipeBench {
        recipe: recipe.path.display().to_string(),
        params: k3mini_student::info::param_breakdown(&recipe.model).total(),
        tokens_per_step: tokens,
        steps,
        median_tokens_per_s: median,
        median_step_s: tokens as f64 / median,
        peak_rss_bytes: lines.iter().filter_map(|m| m.peak_rss_bytes).max(),
    })
}
