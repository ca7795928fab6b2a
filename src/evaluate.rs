//! `k3mini eval`: a checkpoint measured on its recipe's held-out data (perplexity, bits per byte,
//! agreement with the teacher), on greedy generation tasks (passkey retrieval, exact-match
//! reasoning answers), for inference memory against an all-MLA twin and for decode speed; written
//! as `eval.json`, `report.md` and SVG plots by `k3mini_eval::report`.

use crate::device::DeviceList;
use crate::error::Result;
use crate::recipe;
use crate::recipe::RunPlan;
use crate::run_dir::{Checkpoint, StepMetrics, open_checkpoint, read_metrics};
use crate::teachers::{plan_prompts, same_tokenizer, student_tokenizer};
use crate::train::modes::held_out;
use k3mini_data::Tokenizer;
use k3mini_eval::memory::memory_vs_context;
use k3mini_eval::metrics::{bits_per_byte, perplexity};
use k3mini_eval::report::{Curves, EvalReport};
use k3mini_eval::tasks::{Problem, decode_tokens_per_s, exact_match, passkey};
use k3mini_student::K3Mini;
use std::path::{Path, PathBuf};

/// How much to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    /// Minutes on a laptop CPU: the training evaluation's batches, short passkeys, 4 problems.
    Quick,
    /// Longer contexts, more depths and problems, 16K memory.
    Full,
}

impl Suite {
    pub fn name(self) -> &'static str {
        match self {
            Suite::Quick => "quick",
            Suite::Full => "full",
        }
    }
}

/// A recipe file (its run's newest checkpoint), a run directory (its newest checkpoint) or a
/// checkpoint directory → the checkpoint and the run directory.
pub fn locate(path: &Path) -> Result<(Checkpoint, PathBuf)> {
    if path.is_file() {
        let run = recipe::load(path)?.out_dir;
        return Ok((open_checkpoint(&run)?, run));
    }
    let ck = open_checkpoint(path)?;
    let run = ck.dir.parent().unwrap_or(&ck.dir).to_path_buf();
    Ok((ck, run))
}

/// Evaluates the newest checkpoint of a run (or the checkpoint `path` names) on the plan it was
/// trained with, on `devices`' main device (default: the plan's); held-out figures on
/// `held_out_from`'s held-out set when given (another recipe's, in the same vocabulary: so that
/// models trained on different plans, a pruned one and its recovery, are measured alike).
pub fn evaluate(
    path: &Path,
    suite: Suite,
    devices: Option<&DeviceList>,
    held_out_from: Option<&RunPlan>,
) -> Result<(EvalReport, Curves)> {
    let (mut ck, run) = locate(path)?;
    if let Some(d) = devices {
        ck.plan.devices = d.clone();
    }
    let device = ck.plan.devices.open_main()?;
    let model = ck.model(&device)?;
    let plan = &ck.plan;
    let held_plan = held_out_from.unwrap_or(plan);
    let batches = match suite {
        Suite::Quick => held_plan.train.eval_batches,
        Suite::Full => 4 * held_plan.train.eval_batches,
    };
    let progress =
        |what: &str| crate::progress::observer().note(&format!("eval {}: {what}", run.display()));
    let tokenizer = student_tokenizer(&plan.data.tokenizer)?;
    progress("held-out data");
    if held_out_from.is_some() {
        same_tokenizer(held_plan, &tokenizer)?;
    }
    let h = held_out_score(held_plan, &tokenizer, &model, batches)?;
    let (contexts, depths): (&[usize], &[f64]) = match suite {
        Suite::Quick => (&[256, 1024], &[0.1, 0.5, 0.9]),
        Suite::Full => (&[256, 1024, 4096], &[0.0, 0.25, 0.5, 0.75, 1.0]),
    };
    progress("passkey retrieval");
    let passkeys = passkey(&model, &tokenizer, contexts, depths, plan.seed)?;
    let (n_problems, max_tokens) = match suite {
        Suite::Quick => (4, 48),
        Suite::Full => (16, 128),
    };
    let problems: Vec<Problem> = match plan.prompts() {
        Some(p) => plan_prompts(p, &tokenizer, Some(n_problems))?
            .into_iter()
            .filter_map(|p| {
                Some(Problem {
                    answer: p.reference?,
                    id: p.id,
                    prompt: p.ids,
                })
            })
            .collect(),
        None => Vec::new(),
    };
    progress("reasoning problems");
    let stop = tokenizer.special_ids().stops();
    let answers = exact_match(&model, &tokenizer, &problems, max_tokens, &stop)?;
    progress("memory against context");
    let memory_contexts: &[usize] = match suite {
        Suite::Quick => &[512, 2048, 8192],
        Suite::Full => &[512, 2048, 8192, 16384],
    };
    let memory = memory_vs_context(&plan.model, memory_contexts, &device)
        .map_err(|e| crate::refused!("{e}"))?;
    progress("decode speed");
    let decode = decode_tokens_per_s(&model, 64, 64);
    let finite = |x: f64| x.is_finite().then_some(x);
    let report = EvalReport {
        run: plan.name.clone(),
        step: ck.step,
        suite: suite.name().into(),
        params: k3mini_student::info::param_breakdown(&plan.model).total(),
        ppl: perplexity(h.loss),
        loss: h.loss,
        bits_per_byte: h.bits_per_byte,
        teacher_top1: finite(h.top1),
        teacher_kl: finite(h.kl),
        passkey: passkeys,
        exact_match: answers,
        memory,
        decode_tokens_per_s: decode,
        tokenizer_sha256: tokenizer.fingerprint(),
    };
    Ok((report, curves(&run)))
}

/// A model on a plan's held-out data.
#[derive(Clone, Copy, Debug)]
pub struct HeldOutScore {
    /// Mean next-token loss (nats).
    pub loss: f64,
    pub bits_per_byte: f64,
    /// Distillation plans: top-1 agreement with the teacher and `KL(p̂ ‖ q̂)` (NaN otherwise).
    pub top1: f64,
    pub kl: f64,
}

/// `model` on `batches` of `plan`'s held-out set (read with the student's `tokenizer`).
pub fn held_out_score(
    plan: &RunPlan,
    tokenizer: &Tokenizer,
    model: &K3Mini,
    batches: usize,
) -> Result<HeldOutScore> {
    let held = held_out(plan, tokenizer, batches)?;
    let Some(h) = held.evaluate(model) else {
        crate::bail!("{}: nothing is held out to evaluate on", plan.recipe_name());
    };
    let bytes = held.predicted_bytes(tokenizer)?;
    if bytes == 0 {
        crate::bail!(
            "{}: the held-out positions predict no text (only special tokens): bits per byte \
             would divide by nothing",
            plan.recipe_name()
        );
    }
    Ok(HeldOutScore {
        loss: h.loss,
        bits_per_byte: bits_per_byte(h.loss, h.positions, bytes),
        top1: h.top1,
        kl: h.kl,
    })
}

/// A run's training curves from its metrics.jsonl (empty when it has none).
pub fn curves(run: &Path) -> Curves {
    let rows = read_metrics(run).unwrap_or_default();
    let at = |f: &dyn Fn(&StepMetrics) -> Option<f64>| {
        rows.iter()
            .filter_map(|m| f(m).map(|v| (m.step as f64, v)))
            .collect()
    };
    Curves {
        train_loss: at(&|m| (!m.skipped).then_some(m.loss)),
        eval_loss: at(&|m| m.eval_loss),
        eval_top1: at(&|m| m.eval_top1),
    }
}
