//! The run directory: one place for its file names, the `metrics.jsonl` schema and checkpoint I/O.
//!
//! ```text
//! RUN/metrics.jsonl                 one StepMetrics per logged step
//! RUN/step-NNNNNNNN/model.safetensors   weights under transformers' names (past
//!                                       train.weights_shard_bytes: model-0000i-of-0000N.safetensors
//!                                       and model.safetensors.index.json, as transformers shards)
//!                   param_ids.json      parameter ids (the optimizer's moments are keyed by them)
//!                   optimizer.bpk       AdamW moments (k3mini_checkpoints::moments)
//!                   state.json          step, data cursors, bad-step count
//!                   plan.toml           the resolved plan the run was trained with
//!                   manifest.json       SHA-256 of each file (k3mini_checkpoints)
//! RUN/launch                        the launch whose ranks last started here (train::ranks)
//! ```
//!
//! Checkpoints are written to a temporary directory and renamed, every tensor streamed to disk in
//! turn; every file is verified against the manifest when opened, and weights and optimizer state
//! are read back a tensor at a time, so resuming needs little memory beyond training's own. The plan makes a checkpoint self-contained: export, eval and resume
//! rebuild the run from it, not from the recipe file or the presets as they are now.

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::{PLAN, RunPlan, checkpoint_plan};
use burn::tensor::Device;
use k3mini_checkpoints::moments::{self, Moments};
use k3mini_checkpoints::param_ids::{param_entries, param_ids, restore_param_ids};
use k3mini_data::PackCursor;
use k3mini_data::signals::SignalCursor;
use k3mini_data::stream::StreamCursor;
use k3mini_student::K3Mini;
use k3mini_student::hf::{hf_weight_files, load_hf_files, safetensors_header, save_hf_files};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const METRICS: &str = "metrics.jsonl";
const IDS: &str = "param_ids.json";
const OPTIMIZER: &str = "optimizer.bpk";
pub const STATE: &str = "state.json";
/// The launch (torchrun's run id, a SLURM job's step) whose ranks last started training here: a
/// group its launcher restarts resumes by itself only from its own launch's directory.
const LAUNCH: &str = "launch";

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
    /// MoE students with `balance_loss_weight`: the step's weighted balance loss (not in `loss`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub balance_loss: Option<f64>,
    /// MoE students: per MoE layer, the most and the fewest tokens one expert took this step.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub expert_load_max: Vec<usize>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub expert_load_min: Vec<usize>,
    /// Seconds each device's worker spent on forward and backward this step, the model's device
    /// first (on a device that runs asynchronously, the time to queue them). More in total than
    /// the step's wall time (`batch_tokens / tokens_per_s`) means the replicas overlapped.
    #[serde(default)]
    pub replica_busy_s: Vec<f64>,
    /// Across processes: seconds this step's first rank spent exchanging with the others (the
    /// gradients' and figures' sums, the global norm, the parameters' broadcasts, with their
    /// copies to and from the host), waiting for slower ranks included.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub collective_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peak_rss_bytes: Option<usize>,
    /// The most heap bytes live during this step (its held-out evaluation included, the
    /// checkpoint after it not), where the binary counts them
    /// (`k3mini_student::bench::CountingAlloc`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub step_peak_heap_bytes: Option<usize>,
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
    /// The state of a run that has not started, its data at `cursor` (the mode's start:
    /// `train::modes::fresh_cursor`).
    pub fn fresh(plan: &RunPlan, cursor: DataCursor) -> Self {
        Self {
            step: 0,
            cursor,
            prompts: None,
            seed: plan.seed,
            consecutive_bad_steps: 0,
        }
    }
}

/// Where the training data stream is: packed documents, or teacher signals.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DataCursor {
    /// Plain and online runs: where the packer or the segmenter is in the streamed corpus.
    Stream(PackCursor<StreamCursor>),
    Signals(SignalCursor),
    /// What plain runs saved before the corpus streamed (`{epoch, doc, offset}` into an in-memory
    /// document list): read only to refuse it by name.
    Legacy {
        epoch: u64,
        doc: usize,
        offset: usize,
    },
}

/// A checkpoint, verified.
pub struct Checkpoint {
    pub dir: PathBuf,
    /// The optimizer steps it was written after.
    pub step: usize,
    /// The plan the run was trained with.
    pub plan: RunPlan,
    /// Its transformers-named safetensors: one file, or the shards its index lists, in order.
    pub weights: Vec<PathBuf>,
    /// Every file it holds, by name (checked against the manifest, read when needed).
    files: BTreeMap<String, PathBuf>,
}

/// A checkpoint directory, or a run directory (its newest checkpoint), verified: every file against
/// the manifest (read in pieces, none kept in memory), the weights finite, the plan parsed.
pub fn open_checkpoint(path: &Path) -> Result<Checkpoint> {
    let (step, dir) = k3mini_checkpoints::locate(path)?;
    let files = k3mini_checkpoints::verify(&dir)?;
    let weights =
        hf_weight_files(&dir).map_err(|e| crate::refused!("checkpoint {}: {e}", dir.display()))?;
    for w in &weights {
        let name = w.file_name().map(|n| n.to_string_lossy().into_owned());
        crate::ensure!(
            name.is_some_and(|n| files.contains_key(&n)),
            "checkpoint {}: {} is not in its manifest",
            dir.display(),
            w.display()
        );
        check_finite(&dir, w)?;
    }
    let plan = checkpoint_plan(&files)
        .map_err(|e| crate::refused!("checkpoint {}: {e}", dir.display()))?;
    Ok(Checkpoint {
        dir,
        step,
        plan,
        weights,
        files,
    })
}

/// Refuses weights holding NaN or ±inf (a checksum proves the bytes are the ones written, not
/// that they are a model anything should be exported or evaluated from). Reads the file in pieces.
fn check_finite(dir: &Path, weights: &Path) -> Result<()> {
    use std::io::Read;
    let name = weights.display();
    let (data_start, header) = safetensors_header(weights)
        .map_err(|e| crate::refused!("checkpoint {}: {name}: {e}", dir.display()))?;
    // (start, end, tensor) of every f32 tensor, in file order.
    let mut spans: Vec<(u64, u64, String)> = header
        .iter()
        .filter(|(_, v)| v["dtype"] == "F32")
        .filter_map(|(k, v)| {
            let o = v["data_offsets"].as_array()?;
            Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?, k.clone()))
        })
        .collect();
    spans.sort();
    let mut f = std::io::BufReader::with_capacity(
        1 << 20,
        std::fs::File::open(weights).with_context(|| format!("{name}"))?,
    );
    let mut at = 0u64;
    std::io::copy(&mut (&mut f).take(data_start), &mut std::io::sink())
        .with_context(|| format!("{name}"))?;
    let mut buf = vec![0u8; 1 << 20];
    for (start, end, tensor) in spans {
        crate::ensure!(
            start >= at && end >= start,
            "checkpoint {}: {name}: {tensor} overlaps another tensor",
            dir.display()
        );
        std::io::copy(&mut (&mut f).take(start - at), &mut std::io::sink())
            .with_context(|| format!("{name}"))?;
        let mut left = end - start;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            f.read_exact(&mut buf[..n]).with_context(|| {
                format!(
                    "checkpoint {}: {name}: {tensor} is cut short",
                    dir.display()
                )
            })?;
            let finite = buf[..n]
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite());
            crate::ensure!(
                finite,
                "checkpoint {}: tensor {tensor} holds NaN or infinite values; refusing to load it",
                dir.display()
            );
            left -= n as u64;
        }
        at = end;
    }
    Ok(())
}

impl Checkpoint {
    /// The model of the plan with the checkpoint's weights, loaded a tensor at a time.
    pub fn model(&self, device: &Device) -> Result<K3Mini> {
        let mut model = K3Mini::new(&self.plan.model, device)?;
        load_hf_files(&mut model, &self.weights)
            .map_err(|e| crate::refused!("checkpoint {}: {e}", self.dir.display()))?;
        Ok(model)
    }

    fn path(&self, name: &str) -> Result<&Path> {
        self.files
            .get(name)
            .map(PathBuf::as_path)
            .with_context(|| format!("checkpoint {}: no {name}", self.dir.display()))
    }

    /// Model (with its parameter ids) and state, to continue training on `device`, and the
    /// AdamW moments' file, read onto each moment's owner once the devices are shared out.
    pub fn resume(self, device: &Device) -> Result<(K3Mini, SavedMoments, TrainState)> {
        let dir = self.dir.display().to_string();
        let read = |name: &str| -> Result<Vec<u8>> {
            let path = self.path(name)?;
            std::fs::read(path).with_context(|| format!("{}", path.display()))
        };
        let ids: BTreeMap<String, u64> =
            serde_json::from_slice(&read(IDS)?).with_context(|| format!("{dir}: {IDS}"))?;
        let state: TrainState =
            serde_json::from_slice(&read(STATE)?).with_context(|| format!("{dir}: {STATE}"))?;
        let moments = SavedMoments {
            paths: self.optimizer_shards()?,
            step: state.step,
        };
        let model = restore_param_ids(self.model(device)?, &ids)
            .map_err(|e| crate::refused!("{dir}: {IDS}: {e}"))?;
        Ok((model, moments, state))
    }
}

impl Checkpoint {
    /// The optimizer state's files: one process's `optimizer.bpk`, or every rank's shard of a run
    /// across `W` processes (`optimizer-rank-R-of-W.bpk`, each the moments of the parameters that
    /// rank owned), all of them.
    fn optimizer_shards(&self) -> Result<Vec<PathBuf>> {
        if let Some(one) = self.files.get(OPTIMIZER) {
            return Ok(vec![one.clone()]);
        }
        let shards: Vec<(usize, usize, &PathBuf)> = self
            .files
            .iter()
            .filter_map(|(name, path)| {
                let (rank, world) = parse_optimizer_shard(name)?;
                Some((rank, world, path))
            })
            .collect();
        let Some(&(_, world, _)) = shards.first() else {
            bail!(
                "checkpoint {}: no {OPTIMIZER} and no optimizer-rank-*.bpk",
                self.dir.display()
            );
        };
        let mut have: Vec<usize> = shards
            .iter()
            .filter(|s| s.1 == world)
            .map(|s| s.0)
            .collect();
        have.sort();
        crate::ensure!(
            shards.len() == world && have.iter().enumerate().all(|(i, &r)| i == r),
            "checkpoint {}: the optimizer state is in shards of {world} ranks but the manifest \
             lists {:?}",
            self.dir.display(),
            shards
                .iter()
                .map(|s| optimizer_shard(s.0, s.1))
                .collect::<Vec<_>>()
        );
        Ok(shards.into_iter().map(|s| s.2.clone()).collect())
    }
}

/// The file of rank `rank`'s optimizer shard in a run across `world` processes.
pub fn optimizer_shard(rank: usize, world: usize) -> String {
    format!("optimizer-rank-{rank:05}-of-{world:05}.bpk")
}

fn parse_optimizer_shard(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("optimizer-rank-")?.strip_suffix(".bpk")?;
    let (rank, world) = rest.split_once("-of-")?;
    let (rank, world) = (rank.parse().ok()?, world.parse().ok()?);
    (rank < world && name == optimizer_shard(rank, world)).then_some((rank, world))
}

/// A verified checkpoint's AdamW moments, not yet read, and the step they were saved after.
pub struct SavedMoments {
    /// One file, or one per rank of the run that wrote it.
    paths: Vec<PathBuf>,
    step: usize,
}

impl SavedMoments {
    /// Reads them for `model` (which carries the checkpoint's parameter ids), each moment straight
    /// onto `owner(id)`, a tensor at a time; a parameter whose owner is None (another rank's) is
    /// not read. Whatever the ranks that wrote them, and however many read them.
    pub fn read(
        &self,
        model: &K3Mini,
        owner: impl Fn(burn::module::ParamId) -> Option<Device>,
    ) -> Result<HashMap<u64, Moments>> {
        let params = param_entries(model);
        let mut all = HashMap::new();
        for path in &self.paths {
            let read = moments::read(path, &params, self.step, |id| {
                owner(burn::module::ParamId::from(id)).map(Device::inner)
            })?;
            for (id, m) in read {
                crate::ensure!(
                    all.insert(id, m).is_none(),
                    "{}: parameter id {id} has optimizer state in two ranks' shards",
                    path.display()
                );
            }
        }
        Ok(all)
    }
}

/// Writes a checkpoint of step `state.step` into `plan.out_dir`, keeping the newest
/// `train.keep_checkpoints`. Weights and optimizer state stream to disk a tensor at a time.
/// (Across processes the ranks write one together: `train::ranks`.)
pub fn write_checkpoint(
    plan: &RunPlan,
    model: &K3Mini,
    moments: &HashMap<u64, Moments>,
    state: &TrainState,
) -> Result<PathBuf> {
    let (dir, step, keep) = (&plan.out_dir, state.step, plan.train.keep_checkpoints);
    k3mini_checkpoints::write_with(dir, step, keep, |tmp| -> Result<()> {
        fill_checkpoint(plan, model, state, tmp)?;
        write_moments(&tmp.join(OPTIMIZER), model, moments)
    })
}

/// A checkpoint's files besides the optimizer state, into the directory being filled: the
/// weights, their parameter ids, the state and the plan.
pub fn fill_checkpoint(
    plan: &RunPlan,
    model: &K3Mini,
    state: &TrainState,
    tmp: &Path,
) -> Result<()> {
    save_hf_files(model, tmp, plan.train.weights_shard_bytes)?;
    put(tmp, IDS, &serde_json::to_vec(&param_ids(model))?)?;
    put(tmp, STATE, &serde_json::to_vec_pretty(state)?)?;
    put(tmp, PLAN, plan.to_toml().as_bytes())
}

/// `moments` (of `model`'s parameters, keyed by their ids) to `path`: `optimizer.bpk`, or a
/// rank's shard ([`optimizer_shard`]).
pub fn write_moments(path: &Path, model: &K3Mini, moments: &HashMap<u64, Moments>) -> Result<()> {
    Ok(moments::write(path, &param_entries(model), moments)?)
}

/// Writes a checkpoint of a model that has not trained (tests, benchmarks): weights and plan.
pub fn write_weights(plan: &RunPlan, model: &K3Mini, step: usize) -> Result<PathBuf> {
    k3mini_checkpoints::write_with(&plan.out_dir, step, 1, |dir| -> Result<()> {
        save_hf_files(model, dir, plan.train.weights_shard_bytes)?;
        put(dir, PLAN, plan.to_toml().as_bytes())
    })
}

fn put(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))
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
            k3mini_durable::write(&path, kept.as_bytes())
                .with_context(|| format!("rewriting {}", path.display()))?;
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

/// Records that the ranks of launch `run` started training in `dir`.
pub fn mark_launch(dir: &Path, run: &str) -> Result<()> {
    let path = dir.join(LAUNCH);
    k3mini_durable::write(&path, run.as_bytes()).with_context(|| path.display().to_string())
}

/// Whether the ranks of launch `run` were the last to start training in `dir`.
pub fn launched_by(dir: &Path, run: &str) -> Result<bool> {
    let path = dir.join(LAUNCH);
    match k3mini_durable::read_small(&path, 4096) {
        Ok(text) => Ok(text == run),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| path.display().to_string()),
    }
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
