//! `k3mini compare RUN…`: runs side by side, from their `metrics.jsonl`.

use crate::error::{Context, Result};
use crate::run_dir::{METRICS, StepMetrics, read_metrics};
use std::path::{Path, PathBuf};

/// What a run reached: its last logged step and its last held-out evaluation.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    pub run: PathBuf,
    pub last: StepMetrics,
    pub eval: Option<StepMetrics>,
}

/// A run's last logged step and last held-out evaluation.
pub fn summarise(run: &Path) -> Result<RunSummary> {
    let lines = read_metrics(run)?;
    let path = run.join(METRICS);
    let last = lines
        .last()
        .cloned()
        .with_context(|| format!("{}: no steps logged", path.display()))?;
    let eval = lines.iter().rev().find(|m| m.eval_loss.is_some()).cloned();
    Ok(RunSummary {
        run: run.to_path_buf(),
        last,
        eval,
    })
}

/// A Markdown table of runs: tokens, held-out loss and perplexity, agreement with the teacher.
pub fn table(runs: &[RunSummary]) -> String {
    let opt = |x: Option<f64>, f: &dyn Fn(f64) -> String| x.map_or("–".into(), f);
    let mut out = String::from(
        "| run | steps | tokens | train loss | held-out loss | held-out ppl | top-1 agreement | KL(teacher ‖ student) |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let e = r.eval.as_ref();
        let loss = e.and_then(|e| e.eval_loss);
        out.push_str(&format!(
            "| {} | {} | {} | {:.4} | {} | {} | {} | {} |\n",
            r.run.display(),
            r.last.step,
            r.last.tokens,
            r.last.loss,
            opt(loss, &|v| format!("{v:.4}")),
            opt(loss, &|v| format!("{:.2}", v.exp())),
            opt(e.and_then(|e| e.eval_top1), &|v| format!(
                "{:.1}%",
                100.0 * v
            )),
            opt(e.and_then(|e| e.eval_kl), &|v| format!("{v:.4}")),
        ));
    }
    out
}
