//! The evaluation report: `eval.json` (one object per run, each with a top-level `ppl`),
//! `report.md` (tables and the plots below, self-contained beside its SVGs) and the plots:
//! loss curves and teacher agreement over training (from each run's metrics.jsonl) and inference
//! memory against context.

use crate::memory::MemoryRow;
use crate::plots::line_plot;
use crate::tasks::{ExactMatchCase, PasskeyCase};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Everything `k3mini eval` measured on one checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EvalReport {
    pub run: String,
    pub step: usize,
    pub suite: String,
    pub params: usize,
    /// Held-out perplexity (the recipe's held-out split).
    pub ppl: f64,
    pub loss: f64,
    pub bits_per_byte: f64,
    /// Agreement with the teacher on held-out teacher shards (distillation recipes).
    pub teacher_top1: Option<f64>,
    pub teacher_kl: Option<f64>,
    pub passkey: Vec<PasskeyCase>,
    pub exact_match: Vec<ExactMatchCase>,
    pub memory: Vec<MemoryRow>,
    pub decode_tokens_per_s: f64,
    /// The student tokenizer's fingerprint: runs of different vocabularies compare in bits per
    /// byte only (reports from before it was recorded have none).
    #[serde(default)]
    pub tokenizer_sha256: String,
}

impl EvalReport {
    pub fn passkey_accuracy(&self) -> Option<f64> {
        mean(self.passkey.iter().map(|c| c.found))
    }

    pub fn exact_match_accuracy(&self) -> Option<f64> {
        mean(self.exact_match.iter().map(|c| c.correct))
    }
}

fn mean(v: impl Iterator<Item = bool>) -> Option<f64> {
    let (n, k) = v.fold((0, 0), |(n, k), b| (n + 1, k + b as usize));
    (n > 0).then(|| k as f64 / n as f64)
}

/// One run's training curves: (step, value) points.
#[derive(Clone, Debug, Default)]
pub struct Curves {
    pub train_loss: Vec<(f64, f64)>,
    pub eval_loss: Vec<(f64, f64)>,
    pub eval_top1: Vec<(f64, f64)>,
}

/// The runs' summary table in Markdown.
pub fn summary_table(reports: &[EvalReport]) -> String {
    let pct = |x: Option<f64>| x.map_or("–".into(), |v| format!("{:.1}%", 100.0 * v));
    let mut s = String::from(
        "| run | step | held-out ppl | bits/byte | top-1 vs teacher | KL(teacher ‖ student) | passkey | exact match | decode tok/s |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let _ = writeln!(
            s,
            "| {} | {} | {:.2} | {:.3} | {} | {} | {} | {} | {:.1} |",
            r.run,
            r.step,
            r.ppl,
            r.bits_per_byte,
            pct(r.teacher_top1),
            r.teacher_kl.map_or("–".into(), |v| format!("{v:.3}")),
            pct(r.passkey_accuracy()),
            pct(r.exact_match_accuracy()),
            r.decode_tokens_per_s
        );
    }
    let vocabularies: std::collections::BTreeSet<&str> = reports
        .iter()
        .map(|r| r.tokenizer_sha256.as_str())
        .filter(|t| !t.is_empty())
        .collect();
    if vocabularies.len() > 1 {
        let _ = writeln!(
            s,
            "\nThese runs tokenize text with {} different vocabularies: held-out perplexity counts \
             each vocabulary's own tokens, so only bits per byte compares them.",
            vocabularies.len()
        );
    }
    s
}

/// Writes eval.json, report.md and the SVG plots into `dir`; returns report.md's path.
pub fn write_report(
    dir: &Path,
    reports: &[EvalReport],
    curves: &[Curves],
) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let io = |e: Box<dyn std::error::Error>| std::io::Error::other(e.to_string());
    k3mini_durable::write(
        &dir.join("eval.json"),
        serde_json::to_string_pretty(reports)?.as_bytes(),
    )?;
    let names: Vec<&str> = reports.iter().map(|r| r.run.as_str()).collect();
    let mut md = format!("# k3mini evaluation\n\n{}\n", summary_table(reports));
    let loss: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .zip(curves)
        .flat_map(|(n, c)| {
            [
                (format!("{n} train"), c.train_loss.clone()),
                (format!("{n} held-out"), c.eval_loss.clone()),
            ]
        })
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if !loss.is_empty() {
        line_plot(&dir.join("loss.svg"), "Loss", "step", "nats/token", &loss).map_err(io)?;
        md.push_str("\n## Training\n\n![loss curves](loss.svg)\n");
    }
    let top1: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .zip(curves)
        .map(|(n, c)| {
            (
                n.to_string(),
                c.eval_top1.iter().map(|&(x, y)| (x, 100.0 * y)).collect(),
            )
        })
        .filter(|(_, p): &(String, Vec<_>)| !p.is_empty())
        .collect();
    if !top1.is_empty() {
        line_plot(
            &dir.join("agreement.svg"),
            "Top-1 agreement with the teacher (held out)",
            "step",
            "%",
            &top1,
        )
        .map_err(io)?;
        md.push_str("\n![agreement with the teacher](agreement.svg)\n");
    }
    if let Some(r) = reports.iter().find(|r| !r.memory.is_empty()) {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let series = vec![
            (
                "K3 Mini (KDA + MLA)".to_string(),
                r.memory
                    .iter()
                    .map(|m| (m.context as f64, mib(m.hybrid_bytes)))
                    .collect(),
            ),
            (
                "all-MLA, same shape".to_string(),
                r.memory
                    .iter()
                    .map(|m| (m.context as f64, mib(m.all_mla_bytes)))
                    .collect(),
            ),
        ];
        line_plot(
            &dir.join("memory.svg"),
            "Inference state per sequence (f32)",
            "context (tokens)",
            "MiB",
            &series,
        )
        .map_err(io)?;
        md.push_str("\n## Inference memory\n\n| context | K3 Mini | all-MLA | saving |\n|---|---|---|---|\n");
        for m in &r.memory {
            let _ = writeln!(
                md,
                "| {} | {:.2} MiB | {:.2} MiB | {:.1}% |",
                m.context,
                mib(m.hybrid_bytes),
                mib(m.all_mla_bytes),
                100.0 * m.saving()
            );
        }
        md.push_str("\n![memory against context](memory.svg)\n");
    }
    for r in reports {
        if !r.passkey.is_empty() {
            let _ = writeln!(
                md,
                "\n## Passkey retrieval: {}\n\n| context | depth | key | greedy answer | found |\n|---|---|---|---|---|",
                r.run
            );
            for c in &r.passkey {
                let _ = writeln!(
                    md,
                    "| {} | {:.0}% | {} | `{}` | {} |",
                    c.context,
                    100.0 * c.depth,
                    c.key,
                    c.answer.replace(['\n', '|', '`'], " "),
                    if c.found { "yes" } else { "no" }
                );
            }
        }
    }
    let path = dir.join("report.md");
    k3mini_durable::write(&path, md.as_bytes())?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(run: &str, tokenizer: &str) -> EvalReport {
        EvalReport {
            run: run.into(),
            step: 1,
            suite: "quick".into(),
            params: 1,
            ppl: 10.0,
            loss: 10f64.ln(),
            bits_per_byte: 1.0,
            teacher_top1: None,
            teacher_kl: None,
            passkey: Vec::new(),
            exact_match: Vec::new(),
            memory: Vec::new(),
            decode_tokens_per_s: 1.0,
            tokenizer_sha256: tokenizer.into(),
        }
    }

    #[test]
    fn runs_of_different_vocabularies_are_compared_in_bits_per_byte() {
        let same = summary_table(&[report("a", "x"), report("b", "x")]);
        assert!(!same.contains("vocabularies"), "{same}");
        let cross = summary_table(&[report("a", "x"), report("b", "y")]);
        assert!(cross.contains("2 different vocabularies") && cross.contains("only bits per byte"));
    }
}
