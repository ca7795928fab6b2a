//! The run directory: one place for its file names, the `metrics.jsonl` schema and checkpoint I/O.
//!
//! ```text
//! RUN/metrics.jsonl                 one StepMetrics per logged step
//! RUN/step-NNNNNNNN/model.safetensors   weights under transformers' names
//!                   param_ids.json      parameter ids (the optimizer's moments are keyed by them)
//!                   optimizer.bpk       AdamW moments
//!                   state.json          step, data cursors, bad-step count
//!                   plan.toml           the resolved plan the run was trained with
//!                   manifest.json       SHA-256 of each file (k3mini_checkpoints)
//! ```
//!
//! Checkpoints are written to a temporary directory and renamed; every file is verified against
//! the manifest when read. The plan makes a checkpoint self-contained: export, eval and resume
//! rebuild the run from it, not from the recipe file or the presets as they are now.

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::RunPlan;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::tensor::Device;
use k3mini_checkpoints::param_ids::{param_ids, restore_param_ids};
use k3mini_data::Cursor;
use k3mini_data::signals::SignalCursor;
use k3mini_student::K3Mini;
use k3mini_student::hf::{load_hf_bytes, to_hf_bytes};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const METRICS: &str = "metrics.jsonl";
const WEIGHTS: &str = "model.safetensors";
const IDS: &str = "param_ids.json";
const OPTIMIZER: &str = "optimizer.bpk";
const STATE: &str = "state.json";
const PLAN: &str = "plan.toml";

/// One line of `metrics.jsonl`. A non-finite loss or norm is written as `null` (JSON has no NaN).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    /// Tokens trained on so far (`step · train.batch_tokens`).
    #[serde(default)]
    pub tokens: usize,
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    pub lr: f64,
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    /// Non-finite loss or gradient: the update was skipped.
    pub skipped: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_loss: Option<f64>,
    /// Distillation runs: held-out top-1 agreement with the teacher and `KL(p̂ ‖ q̂)`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_top1: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_kl: Option<f64>,
    /// On-policy steps: mean `log q(x) − log p(x)` over the tokens the student sampled.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub on_policy_kl: Option<f64>,
    /// MoE students: per MoE layer, the most and the fewest tokens one expert took this step.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub expert_load_max: Vec<usize>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub expert_load_min: Vec<usize>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peak_rss_bytes: Option<usize>,
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// Everything besides weights and optimizer moments that a checkpoint restores.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: usize,
    pub cursor: DataCursor,
    /// On-policy runs: where the prompt stream is.
    #[serde(default)]
    pub prompts: Option<SignalCursor>,
    pub seed: u64,
    pub consecutive_bad_steps: usize,
}

impl TrainState {
    /// The state of a run that has not started.
    pub fn fresh(plan: &RunPlan) -> Self {
        Self {
            step: 0,
            cursor: match plan.distill {
                Some(_) => DataCursor::Signals(SignalCursor::default()),
                None => DataCursor::Packed(Cursor::default()),
            },
            prompts: None,
            seed: plan.seed,
            consecutive_bad_steps: 0,
        }
    }
}

/// Where the training data stream is: packed documents, or teacher signals.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataCursor {
    Packed(Cursor),
    Signals(SignalCursor),
}

/// A checkpoint, read and verified.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// The optimizer steps it was written after.
    pub step: usize,
    /// The plan the run was trained with.
    pub plan: RunPlan,
    /// transformers-named safetensors.
    pub weights: Vec<u8>,
    /// The rest of its files, by name.
    files: BTreeMap<String, Vec<u8>>,
}

/// A checkpoint directory, or a run directory (its newest checkpoint), read and verified.
pub fn open_checkpoint(path: &Path) -> Result<Checkpoint> {
    let (step, dir) = if path.join(WEIGHTS).is_file() {
        // A checkpoint directory is named step-NNNNNNNN.
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let digits = name.as_deref().and_then(|n| n.rsplit('-').next());
        (
            digits.and_then(|d| d.parse().ok()).unwrap_or(0),
            path.to_path_buf(),
        )
    } else {
        k3mini_checkpoints::latest(path)?.with_context(|| {
            format!(
                "{}: neither a checkpoint nor a run directory with checkpoints",
                path.display()
            )
        })?
    };
    let mut files = k3mini_checkpoints::read(&dir)?;
    let weights = files
        .remove(WEIGHTS)
        .with_context(|| format!("checkpoint {}: no {WEIGHTS}", dir.display()))?;
    check_finite(&dir, &weights)?;
    let plan = files.remove(PLAN).with_context(|| {
        format!(
            "checkpoint {}: no {PLAN} (written by a k3mini before runs stored their resolved \
             plan; train it again with this version)",
            dir.display()
        )
    })?;
    let plan = std::str::from_utf8(&plan)
        .ok()
        .and_then(|text| RunPlan::from_toml(text).ok())
        .with_context(|| format!("checkpoint {}: {PLAN} is not a run plan", dir.display()))?;
    Ok(Checkpoint {
        dir,
        step,
        plan,
        weights,
        files,
    })
}

/// Refuses weights holding NaN or ±inf (a checksum proves the bytes are the ones written, not
/// that they are a model anything should be exported or evaluated from).
fn check_finite(dir: &Path, weights: &[u8]) -> Result<()> {
    let st = safetensors::SafeTensors::deserialize(weights)
        .with_context(|| format!("checkpoint {}: {WEIGHTS}", dir.display()))?;
    for (name, view) in st.tensors() {
        let finite = view.dtype() != safetensors::Dtype::F32
            || view
                .data()
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite());
        crate::ensure!(
            finite,
            "checkpoint {}: tensor {name} holds NaN or infinite values; refusing to load it",
            dir.display()
        );
    }
    Ok(())
}

impl Checkpoint {
    /// The model of the plan with the checkpoint's weights.
    pub fn model(&self, device: &Device) -> Result<K3Mini> {
        let mut model = K3Mini::new(&self.plan.model, device)?;
        load_hf_bytes(&mut model, self.weights.clone())
            .map_err(|e| crate::refused!("checkpoint {}: {WEIGHTS}: {e}", self.dir.display()))?;
        Ok(model)
    }

    fn take(&mut self, name: &str) -> Result<Vec<u8>> {
        self.files
            .remove(name)
            .with_context(|| format!("checkpoint {}: no {name}", self.dir.display()))
    }

    /// Model (with its parameter ids), optimizer record and state, to continue training on
    /// `device`.
    pub fn resume(mut self, device: &Device) -> Result<(K3Mini, OptimizerRecord, TrainState)> {
        let dir = self.dir.display().to_string();
        let ids: BTreeMap<String, u64> =
            serde_json::from_slice(&self.take(IDS)?).with_context(|| format!("{dir}: {IDS}"))?;
        let state: TrainState = serde_json::from_slice(&self.take(STATE)?)
            .with_context(|| format!("{dir}: {STATE}"))?;
        let optimizer = self.take(OPTIMIZER)?;
        let model = restore_param_ids(self.model(device)?, &ids)
            .map_err(|e| crate::refused!("{dir}: {IDS}: {e}"))?;
        let record = OptimizerRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(optimizer))
            .map_err(|e| {
                crate::refused!("{dir}: {OPTIMIZER} is not an optimizer state k3mini wrote ({e:?})")
            })?;
        Ok((model, record, state))
    }
}

/// Writes a checkpoint of step `state.step` into `plan.out_dir`, keeping the newest
/// `train.keep_checkpoints`.
pub fn write_checkpoint(
    plan: &RunPlan,
    model: &K3Mini,
    optim: &ModuleOptimizer,
    state: &TrainState,
) -> Result<PathBuf> {
    let weights = to_hf_bytes(model)?;
    let optimizer = optim
        .to_record()
        .into_bytes()
        .map_err(|e| crate::refused!("{e:?}"))?
        .to_vec();
    let files = [
        (WEIGHTS, weights),
        (IDS, serde_json::to_vec(&param_ids(model))?),
        (OPTIMIZER, optimizer),
        (STATE, serde_json::to_vec_pretty(state)?),
        (PLAN, plan.to_toml().into_bytes()),
    ];
    Ok(k3mini_checkpoints::write(
        &plan.out_dir,
        state.step,
        &files,
        plan.train.keep_checkpoints,
    )?)
}

/// Writes a checkpoint of a model that has not trained (tests, benchmarks): weights and plan.
pub fn write_weights(plan: &RunPlan, model: &K3Mini, step: usize) -> Result<PathBuf> {
    let weights = to_hf_bytes(model)?;
    let files = [(WEIGHTS, weights), (PLAN, plan.to_toml().into_bytes())];
    Ok(k3mini_checkpoints::write(&plan.out_dir, step, &files, 1)?)
}

/// `metrics.jsonl`, opened for appending after `step`: lines of later steps (written by a run
/// killed after its last checkpoint) and a half-written last line are dropped first, so the
/// resumed run's lines follow on exactly.
pub fn open_metrics(run: &Path, step: usize) -> Result<std::fs::File> {
    let path = run.join(METRICS);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let kept: String = text
            .lines()
            .filter(|l| serde_json::from_str::<StepMetrics>(l).is_ok_and(|m| m.step <= step))
            .map(|l| format!("{l}\n"))
            .collect();
        if kept.len() != text.len() {
            k3mini_checkpoints::write_atomic(&path, kept.as_bytes())?;
        }
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))
}

/// Appends one line to `metrics.jsonl`.
pub fn log_metrics(file: &mut std::fs::File, m: &StepMetrics) -> Result<()> {
    writeln!(file, "{}", serde_json::to_string(m)?).context("writing metrics.jsonl")
}

/// Every line of a run directory's `metrics.jsonl`.
pub fn read_metrics(run: &Path) -> Result<Vec<StepMetrics>> {
    let path = run.join(METRICS);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let m: StepMetrics = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a metrics line", path.display(), i + 1))?;
        lines.push(m);
    }
    Ok(lines)
}

/// How a run begins in its directory.
pub enum Start {
    Fresh,
    /// From the newest checkpoint; `changes` lists what the plan changed since (accepted).
    Resume {
        checkpoint: Checkpoint,
        changes: Vec<String>,
    },
}

/// Refuses what a run directory would make a run do wrong, before anything is written: a fresh
/// run over existing checkpoints, or a resume under a plan other than the checkpoint's (unless
/// `accept_changes`).
pub fn start(plan: &RunPlan, resume: bool, accept_changes: bool) -> Result<Start> {
    let latest = k3mini_checkpoints::latest(&plan.out_dir)?;
    match (resume, latest) {
        (false, Some(_)) => bail!(
            "{} already holds checkpoints: pass --resume to continue, or choose another --out",
            plan.out_dir.display()
        ),
        (false, None) => Ok(Start::Fresh),
        (true, None) => bail!("--resume: no checkpoint under {}", plan.out_dir.display()),
        (true, Some((_, dir))) => {
            let checkpoint = open_checkpoint(&dir)?;
            let changes = plan.changes_from(&checkpoint.plan);
            if !changes.is_empty() && !accept_changes {
                bail!(
                    "--resume: {} was trained with another plan; changed since:\n  {}\nresume \
                     with the recipe it was trained with, or pass --accept-changes to continue \
                     under the new one",
                    dir.display(),
                    changes.join("\n  ")
                );
            }
            Ok(Start::Resume {
                checkpoint,
                changes,
            })
        }
    }
}
