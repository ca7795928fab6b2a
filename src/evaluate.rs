//! `k3mini eval`: a checkpoint measured on its recipe's held-out data (perplexity, bits per byte,
//! agreement with the teacher), on greedy generation tasks (passkey retrieval, exact-match
//! reasoning answers), for inference memory against an all-MLA twin and for decode speed; written
//! as `eval.json`, `report.md` and SVG plots by `k3mini_eval::report`.

use crate::compare::read_metrics;
use crate::export::{load_model, open_checkpoint};
use crate::recipe::{self, LoadedRecipe};
use crate::teachers::recipe_prompts;
use crate::train::trainer::{RECIPE_SOURCE, held_out};
use anyhow::{Context, Result};
use burn::tensor::Device;
use k3mini_eval::memory::memory_vs_context;
use k3mini_eval::metrics::{bits_per_byte, perplexity};
use k3mini_eval::report::{Curves, EvalReport};
use k3mini_eval::tasks::{Problem, decode_tokens_per_s, exact_match, passkey};
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

/// A recipe file, a run directory or a checkpoint directory → the recipe and the run directory.
pub fn locate(path: &Path) -> Result<(LoadedRecipe, PathBuf)> {
    if path.is_file() {
        let recipe = recipe::load(path)?;
        let run = recipe.out_dir();
        return Ok((recipe, run));
    }
    let run = [path, path.parent().unwrap_or(path)]
        .into_iter()
        .find(|d| d.join(RECIPE_SOURCE).is_file())
        .with_context(|| {
            format!(
                "{}: no {RECIPE_SOURCE} naming the recipe it was trained with (older runs): pass the recipe file instead",
                path.display()
            )
        })?
        .to_path_buf();
    let source = std::fs::read_to_string(run.join(RECIPE_SOURCE))?;
    Ok((recipe::load(Path::new(source.trim()))?, run))
}

/// Evaluates the newest checkpoint of `run` (or the checkpoint `path` names).
pub fn evaluate(path: &Path, suite: Suite) -> Result<(EvalReport, Curves)> {
    let (recipe, run) = locate(path)?;
    let ck = open_checkpoint(if path.is_file() { &run } else { path })?;
    let device = Device::default();
    let model = load_model(&ck, &device)?;
    let r = &recipe.recipe;
    let batches = match suite {
        Suite::Quick => r.train.eval_batches,
        Suite::Full => 4 * r.train.eval_batches,
    };
    let progress = |what: &str| eprintln!("eval {}: {what}", run.display());
    let tokenizer = crate::teachers::student_tokenizer(&recipe)?;
    progress("held-out data");
    let h = held_out(&recipe, &tokenizer, &model, batches)?;
    let (contexts, depths): (&[usize], &[f64]) = match suite {
        Suite::Quick => (&[256, 1024], &[0.1, 0.5, 0.9]),
        Suite::Full => (&[256, 1024, 4096], &[0.0, 0.25, 0.5, 0.75, 1.0]),
    };
    progress("passkey retrieval");
    let passkeys = passkey(&model, &tokenizer, contexts, depths, r.run.seed)?;
    let (n_problems, max_tokens) = match suite {
        Suite::Quick => (4, 48),
        Suite::Full => (16, 128),
    };
    let problems: Vec<Problem> = match r.teacher.as_ref().and_then(|t| t.generate.as_ref()) {
        Some(g) => recipe_prompts(&recipe, g, &tokenizer, Some(n_problems))?
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
    let stop: Vec<u32> = ["<|im_end|>", k3mini_data::tokenizer::BPE_EOS]
        .iter()
        .filter_map(|t| tokenizer.token_id(t))
        .collect();
    let answers = exact_match(&model, &tokenizer, &problems, max_tokens, &stop)?;
    progress("memory against context");
    let memory_contexts: &[usize] = match suite {
        Suite::Quick => &[512, 2048, 8192],
        Suite::Full => &[512, 2048, 8192, 16384],
    };
    let memory = memory_vs_context(&recipe.model, memory_contexts, &device)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    progress("decode speed");
    let decode = decode_tokens_per_s(&model, 64, 64);
    let finite = |x: f64| x.is_finite().then_some(x);
    let report = EvalReport {
        run: r.run.name.clone(),
        step: ck.step,
        suite: suite.name().into(),
        params: k3mini_student::info::param_breakdown(&recipe.model).total(),
        ppl: perplexity(h.eval.loss),
        loss: h.eval.loss,
        bits_per_byte: bits_per_byte(h.eval.loss, h.tokens, h.bytes),
        teacher_top1: finite(h.eval.top1),
        teacher_kl: finite(h.eval.kl),
        passkey: passkeys,
        exact_match: answers,
        memory,
        decode_tokens_per_s: decode,
    };
    Ok((report, curves(&run)))
}

/// A run's training curves from its metrics.jsonl (empty when it has none).
pub fn curves(run: &Path) -> Curves {
    let rows = read_metrics(run).unwrap_or_default();
    let at = |f: &dyn Fn(&crate::train::trainer::StepMetrics) -> Option<f64>| {
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
