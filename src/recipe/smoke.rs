//! `[smoke]` resolved against the run it checks: what `k3mini smoke` runs and asserts, validated
//! once here so the smoke itself re-checks nothing.

use super::plan::RunPlan;
use super::schema::SmokeConfig;
use k3mini_gguf::mix::FileType;

/// A recipe's run and what its smoke asserts.
#[derive(Clone, Debug)]
pub struct SmokePlan {
    pub run: RunPlan,
    /// `1 ≤ resume_at < run.train.steps`.
    pub resume_at: usize,
    /// In `[0, 1)`.
    pub loss_drop: f64,
    pub quant: FileType,
    pub max_gguf_kl: f64,
    pub tolerances: BaselineTolerances,
}

/// How far a smoke may fall behind its baseline, as ratios (all positive).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaselineTolerances {
    pub min_tokens_per_s_ratio: f64,
    pub max_peak_memory_ratio: f64,
    pub max_final_loss_ratio: f64,
}

/// `[smoke]` (its defaults when absent) for `run`; a refusal names the key.
pub fn resolve_smoke(
    run: RunPlan,
    smoke: Option<SmokeConfig>,
) -> Result<SmokePlan, (String, String)> {
    let s = match smoke {
        Some(s) => s,
        None => toml::from_str("").expect("every [smoke] key has a default"),
    };
    let refuse = |key: &str, message: String| Err((format!("smoke.{key}"), message));
    let steps = run.train.steps;
    if steps < 2 {
        return refuse(
            "resume_at",
            format!(
                "train.steps = {steps}: a smoke stops and resumes, so it needs 2 steps or more"
            ),
        );
    }
    let resume_at = s.resume_at.unwrap_or(steps / 2);
    if resume_at == 0 || resume_at >= steps {
        return refuse(
            "resume_at",
            format!(
                "{resume_at} is not a step inside the run: 1 to {}",
                steps - 1
            ),
        );
    }
    if !(0.0..1.0).contains(&s.loss_drop) {
        return refuse(
            "loss_drop",
            format!(
                "{} is not a fraction of the first loss in [0, 1)",
                s.loss_drop
            ),
        );
    }
    let quant = match FileType::parse(&s.quant) {
        Ok(q) => q,
        Err(e) => return refuse("quant", e.to_string()),
    };
    for (key, v) in [
        ("max_gguf_kl", s.max_gguf_kl),
        ("min_tokens_per_s_ratio", s.min_tokens_per_s_ratio),
        ("max_peak_memory_ratio", s.max_peak_memory_ratio),
        ("max_final_loss_ratio", s.max_final_loss_ratio),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return refuse(key, format!("{v} must be positive"));
        }
    }
    Ok(SmokePlan {
        run,
        resume_at,
        loss_drop: s.loss_drop,
        quant,
        max_gguf_kl: s.max_gguf_kl,
        tolerances: BaselineTolerances {
            min_tokens_per_s_ratio: s.min_tokens_per_s_ratio,
            max_peak_memory_ratio: s.max_peak_memory_ratio,
            max_final_loss_ratio: s.max_final_loss_ratio,
        },
    })
}
