//! The training loop: recipe → tokenizer → packed batches → forward/backward with gradient
//! accumulation → global-norm clipping → AdamW at the scheduled rate, with metrics, held-out loss,
//! checkpoints and exact resume.
//!
//! Resumption is bit-identical: a checkpoint holds the weights (transformers-named safetensors), the
//! parameter ids and AdamW moments, the step and the data cursor. Training draws no randomness after
//! initialisation (no dropout; the data order is a function of the seed and the cursor).

use crate::recipe::LoadedRecipe;
use crate::recipe::{DistillConfig, DistillMode};
use crate::teachers::{recipe_prompts, recipe_teacher, student_tokenizer};
use crate::train::distill::{SignalEval, distill_loss, signal_data, signal_eval};
use crate::train::on_policy::{OnPolicy, OnPolicyStats, SamplingSpec};
use crate::train::online::{OnlineSpec, OnlineStream, score_batch, split_segments};
use crate::train::optim::{build_optimizer, clip_global_norm, global_grad_norm};
use crate::train::qat::FakeQuantizer;
use crate::train::schedule::lr_at;
use anyhow::{Context, Result, bail};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer, OptimizerRecord};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_checkpoints::param_ids::{param_ids, restore_param_ids};
use k3mini_data::chat::{check_markers, render};
use k3mini_data::pack::split_held_out;
use k3mini_data::signals::{SignalBatch, SignalCursor, SignalStream};
use k3mini_data::tokenizer::BPE_EOS;
use k3mini_data::{Cursor, Packer, SourceFormat, TokenDoc, Tokenizer, read_chats, read_source};
use k3mini_student::K3Mini;
use k3mini_student::hf::{load_hf_bytes, to_hf_bytes};
use k3mini_student::loss::next_token_cross_entropy;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// How to run a recipe.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Overrides the recipe's output directory.
    pub out_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output directory.
    pub resume: bool,
    /// Stop (with a checkpoint) after this many optimizer steps of this invocation.
    pub stop_after: Option<usize>,
    /// No progress bar (tests, CI logs).
    pub quiet: bool,
}

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
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub peak_rss_bytes: Option<usize>,
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// What a finished (or stopped) run reports.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub first_step: usize,
    pub last_step: usize,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub eval_loss: Option<f64>,
    pub tokens: usize,
    pub wall_s: f64,
    pub interrupted: bool,
}

/// Everything besides weights and optimizer moments that a checkpoint restores.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainState {
    /// Optimizer steps completed.
    step: usize,
    cursor: DataCursor,
    /// On-policy runs: where the prompt stream is.
    #[serde(default)]
    prompts: Option<SignalCursor>,
    seed: u64,
    consecutive_bad_steps: usize,
}

/// Where the training data stream is: packed documents, or teacher shards.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum DataCursor {
    Packed(Cursor),
    Signals(SignalCursor),
}

/// Where distillation batches come from.
enum Feed {
    /// Teacher shards on disk (offline and sequence modes).
    Shards(SignalStream),
    /// The teacher in the loop.
    Online(OnlineStream),
}

/// The training stream and the held-out data of a run.
enum Data {
    Packed {
        packer: Packer,
        held: Arc<Vec<TokenDoc>>,
    },
    Signals {
        feed: Feed,
        held: Vec<SignalBatch>,
        config: DistillConfig,
        tau_gen: f64,
        on_policy: Option<OnPolicy>,
    },
}

impl Data {
    fn cursor(&self) -> DataCursor {
        match self {
            Data::Packed { packer, .. } => DataCursor::Packed(packer.cursor()),
            Data::Signals {
                feed: Feed::Shards(s),
                ..
            } => DataCursor::Signals(s.cursor()),
            Data::Signals {
                feed: Feed::Online(s),
                ..
            } => DataCursor::Signals(s.cursor()),
        }
    }

    fn prompt_cursor(&self) -> Option<SignalCursor> {
        match self {
            Data::Signals {
                on_policy: Some(op),
                ..
            } => Some(op.cursor),
            _ => None,
        }
    }

    /// The next micro-batch's loss (the caller divides by the accumulation factor), with what an
    /// on-policy micro-batch measured.
    fn micro_loss(
        &mut self,
        model: &K3Mini,
        recipe: &LoadedRecipe,
        seed: u64,
    ) -> Result<(Tensor<1>, Option<OnPolicyStats>)> {
        let r = &recipe.recipe;
        let device = model.lm_head.weight.device();
        if let Data::Signals {
            on_policy: Some(op),
            ..
        } = self
            && op.takes(seed)
        {
            let (loss, stats) = op.loss(model, r.train.micro_batch, seed)?;
            return Ok((loss, Some(stats)));
        }
        let loss = match self {
            Data::Packed { packer, .. } => {
                let batch = packer.next_batch(r.train.micro_batch);
                let (tokens, starts, mask) = batch_tensors(&batch, &device);
                let logits = model.forward_packed(tokens.clone(), starts).logits;
                next_token_cross_entropy(logits, tokens, Some(mask))
            }
            Data::Signals {
                feed,
                config,
                tau_gen,
                ..
            } => {
                let batch = match feed {
                    Feed::Shards(s) => s.next_batch(r.train.micro_batch)?,
                    Feed::Online(s) => s.next_batch()?,
                };
                distill_loss(model, &batch, config, *tau_gen, seed)
            }
        };
        Ok((loss, None))
    }

    /// Held-out loss (and, for distillation, agreement with the teacher).
    fn evaluate(&self, model: &K3Mini, recipe: &LoadedRecipe) -> Option<SignalEval> {
        match self {
            Data::Packed { held, .. } if !held.is_empty() => Some(SignalEval {
                loss: eval_loss(model, held, recipe, recipe.recipe.train.eval_batches),
                top1: f64::NAN,
                kl: f64::NAN,
            }),
            Data::Signals { held, tau_gen, .. } if !held.is_empty() => {
                Some(signal_eval(model, held, *tau_gen))
            }
            _ => None,
        }
    }
}

/// A run directory's record of the recipe file it was trained from.
pub const RECIPE_SOURCE: &str = "recipe-source";

const WEIGHTS: &str = "model.safetensors";
const IDS: &str = "param_ids.json";
const OPTIMIZER: &str = "optimizer.bpk";
const STATE: &str = "state.json";
const RECIPE: &str = "recipe.toml";

/// Set by Ctrl-C: the loop finishes its step, checkpoints and returns.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the Ctrl-C handler (once per process).
pub fn handle_ctrl_c() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    });
}

/// The documents of a recipe, tokenized. Text documents end in the end-of-text id when the
/// tokenizer has one and train on every token; chat documents are rendered with their template and
/// train on the parts `data.train_on` names.
pub fn tokenized_documents(recipe: &LoadedRecipe, tokenizer: &Tokenizer) -> Result<Vec<TokenDoc>> {
    let data = &recipe.recipe.data;
    let eos = [BPE_EOS, "</s>", "<|end_of_text|>"]
        .iter()
        .find_map(|t| tokenizer.token_id(t));
    let mut docs = Vec::new();
    for source in &data.sources {
        let path = recipe.resolve_path(&source.path);
        if let Some(template) = source.chat {
            check_markers(template, tokenizer)
                .map_err(|e| anyhow::anyhow!("{}: {e}", recipe.path.display()))?;
            for chat in read_chats(&path, source.field())? {
                let rendered = render(&chat.messages, template, false)
                    .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), chat.index + 1))?;
                let (ids, parts) = rendered.encode(tokenizer)?;
                let targets = parts.iter().map(|&p| data.train_on.trains(p)).collect();
                if ids.len() >= 2 {
                    docs.push(TokenDoc {
                        ids,
                        targets: Some(targets),
                    });
                }
            }
            continue;
        }
        let format = source.format.unwrap_or_else(|| SourceFormat::infer(&path));
        for doc in read_source(&path, format, source.field())? {
            let mut ids = tokenizer.encode(&doc.text)?;
            ids.extend(eos);
            if ids.len() >= 2 {
                docs.push(ids.into());
            }
        }
    }
    if docs.is_empty() {
        bail!(
            "{}: the data sources hold no document of two or more tokens",
            recipe.path.display()
        );
    }
    Ok(docs)
}

fn batch_tensors(
    b: &k3mini_data::PackedBatch,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2>, Tensor<2>) {
    let shape = [b.rows, b.seq_len];
    (
        Tensor::from_data(TensorData::new(b.tokens.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.starts.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.loss_mask.clone(), shape), device),
    )
}

/// Held-out loss over the first `batches` micro-batches of the held-out stream (the same ones every time).
fn eval_loss(
    model: &K3Mini,
    docs: &Arc<Vec<TokenDoc>>,
    recipe: &LoadedRecipe,
    batches: usize,
) -> f64 {
    let r = &recipe.recipe;
    let device = model.lm_head.weight.device();
    let inference = burn::module::Module::valid(model);
    let mut packer = Packer::new(docs.clone(), r.data.seq_len, r.run.seed, r.data.packing, 0);
    let total: f64 = (0..batches)
        .map(|_| {
            let batch = packer.next_batch(r.train.micro_batch);
            let (tokens, starts, mask) = batch_tensors(&batch, &device.clone().without_autodiff());
            let logits = inference.forward_packed(tokens.clone(), starts).logits;
            next_token_cross_entropy(logits, tokens, Some(mask)).into_scalar::<f32>() as f64
        })
        .sum();
    total / batches as f64
}

fn write_checkpoint(
    out: &Path,
    recipe: &LoadedRecipe,
    model: &K3Mini,
    optim: &ModuleOptimizer,
    state: &TrainState,
) -> Result<PathBuf> {
    let weights = to_hf_bytes(model)
        .map_err(anyhow::Error::msg)
        .context("serialising weights")?;
    let ids = serde_json::to_vec(&param_ids(model))?;
    let optimizer = optim
        .to_record()
        .into_bytes()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?
        .to_vec();
    let recipe_text = std::fs::read(&recipe.path)
        .with_context(|| format!("reading {} for the checkpoint", recipe.path.display()))?;
    let files = [
        (WEIGHTS, weights),
        (IDS, ids),
        (OPTIMIZER, optimizer),
        (STATE, serde_json::to_vec_pretty(state)?),
        (RECIPE, recipe_text),
    ];
    Ok(k3mini_checkpoints::write(
        out,
        state.step,
        &files,
        recipe.recipe.train.keep_checkpoints,
    )?)
}

/// Restores model, optimizer and state from the newest checkpoint under `out`.
fn resume(
    out: &Path,
    recipe: &LoadedRecipe,
    model: K3Mini,
) -> Result<(K3Mini, ModuleOptimizer, TrainState)> {
    let Some((_, dir)) = k3mini_checkpoints::latest(out)? else {
        bail!("--resume: no checkpoint under {}", out.display());
    };
    let mut files = k3mini_checkpoints::read(&dir)?;
    let mut take = |name: &str| {
        files
            .remove(name)
            .with_context(|| format!("checkpoint {}: no {name}", dir.display()))
    };
    let weights = take(WEIGHTS)?;
    let ids: std::collections::BTreeMap<String, u64> =
        serde_json::from_slice(&take(IDS)?).with_context(|| format!("{}: {IDS}", dir.display()))?;
    let optimizer = take(OPTIMIZER)?;
    let state: TrainState = serde_json::from_slice(&take(STATE)?)
        .with_context(|| format!("{}: {STATE}", dir.display()))?;
    let mut model = model;
    load_hf_bytes(&mut model, weights)
        .map_err(|e| anyhow::anyhow!("{}: {WEIGHTS}: {e}", dir.display()))?;
    let model = restore_param_ids(model, &ids)
        .map_err(|e| anyhow::anyhow!("{}: {IDS}: {e}", dir.display()))?;
    let record = OptimizerRecord::from_bytes(burn::tensor::Bytes::from_bytes_vec(optimizer))
        .map_err(|e| anyhow::anyhow!("{}: {OPTIMIZER}: {e:?}", dir.display()))?;
    let optim = build_optimizer(&recipe.recipe.optim, &model).load_record(record);
    Ok((model, optim, state))
}

/// Drops the lines of `metrics.jsonl` after `step` (written by a run that was killed after its last
/// checkpoint, and a half-written last line), so the resumed run's lines follow on exactly.
fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| serde_json::from_str::<StepMetrics>(l).is_ok_and(|m| m.step <= step))
        .map(|l| format!("{l}\n"))
        .collect();
    if kept.len() != text.len() {
        let tmp = path.with_extension("jsonl.tmp");
        std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    }
    Ok(())
}

/// The student's tokenizer: the recipe's, or the local teacher's own for `tokenizer = "teacher"`.
/// The on-policy sampler: `[teacher.generate]`'s prompts that leave room for a completion.
fn open_on_policy(
    recipe: &LoadedRecipe,
    tokenizer: &Tokenizer,
    cursor: Option<SignalCursor>,
) -> Result<OnPolicy> {
    let r = &recipe.recipe;
    let tc = r.teacher.as_ref().expect("checked");
    let g = tc
        .generate
        .as_ref()
        .expect("the recipe check requires prompts");
    let cfg = r
        .distill
        .as_ref()
        .and_then(|d| d.on_policy.clone())
        .unwrap_or_default();
    let (_, teacher, agreed) = recipe_teacher(recipe)?;
    anyhow::ensure!(
        agreed.fingerprint() == tokenizer.fingerprint(),
        "the teacher's tokenizer is not the student's"
    );
    let prompts: Vec<_> = recipe_prompts(recipe, g, tokenizer, None)?
        .into_iter()
        .filter(|p| p.ids.len() >= 2 && p.ids.len() < r.data.seq_len)
        .collect();
    anyhow::ensure!(
        !prompts.is_empty(),
        "{}: no prompt is shorter than data.seq_len {}: nothing to sample",
        recipe.path.display(),
        r.data.seq_len
    );
    Ok(OnPolicy {
        teacher,
        prompts,
        spec: SamplingSpec {
            max_tokens: cfg.max_tokens,
            temperature: cfg.temperature,
            stop: tokenizer.encode_with_specials("<|im_end|>")?,
            seq_len: r.data.seq_len,
        },
        mix: cfg.mix,
        concurrency: tc.concurrency,
        seed: r.run.seed,
        cursor: cursor.unwrap_or_default(),
    })
}

/// The training stream from `cursor` and the held-out data.
/// The recipe's documents, tokenized, split into training and held-out ones (seeded).
fn split_documents(
    recipe: &LoadedRecipe,
    tokenizer: &Tokenizer,
) -> Result<(Arc<Vec<TokenDoc>>, Arc<Vec<TokenDoc>>)> {
    let r = &recipe.recipe;
    let docs = tokenized_documents(recipe, tokenizer)?;
    let (train_idx, held_idx) = split_held_out(docs.len(), r.data.held_out_fraction, r.run.seed);
    let pick = |idx: &[usize]| Arc::new(idx.iter().map(|&i| docs[i].clone()).collect::<Vec<_>>());
    Ok((pick(&train_idx), pick(&held_idx)))
}

fn open_data(
    recipe: &LoadedRecipe,
    tokenizer: &Tokenizer,
    cursor: DataCursor,
    prompts: Option<SignalCursor>,
) -> Result<Data> {
    let r = &recipe.recipe;
    if let Some(config) = &r.distill {
        let DataCursor::Signals(cursor) = cursor else {
            bail!("the checkpoint was written by a plain run, and this recipe distils");
        };
        let tc = r.teacher.as_ref().expect("checked");
        let (feed, held) = if config.mode == DistillMode::Online {
            let (_, teacher, agreed) = recipe_teacher(recipe)?;
            anyhow::ensure!(
                agreed.fingerprint() == tokenizer.fingerprint(),
                "the teacher's tokenizer is not the student's"
            );
            let docs = tokenized_documents(recipe, tokenizer)?;
            let (train, held) =
                split_segments(&docs, r.data.seq_len, r.data.held_out_fraction, r.run.seed);
            let spec = OnlineSpec {
                seq_len: r.data.seq_len,
                k: tc.k,
                vocab: recipe.model.vocab_size,
                concurrency: tc.concurrency,
            };
            let rows = r.train.micro_batch;
            let held: Vec<SignalBatch> = held
                .chunks(rows)
                .take(r.train.eval_batches)
                .map(|c| score_batch(teacher.as_ref(), c, &spec))
                .collect::<Result<_>>()?;
            let stream = OnlineStream::new(teacher, train, spec, r.run.seed, rows, cursor)?;
            (Feed::Online(stream), held)
        } else {
            let sd = signal_data(recipe, tokenizer)?;
            (
                Feed::Shards(sd.train_stream(r.run.seed, cursor)?),
                sd.held_out_batches(r.train.eval_batches, r.train.micro_batch)?,
            )
        };
        let on_policy = match config.mode {
            DistillMode::OnPolicy => Some(open_on_policy(recipe, tokenizer, prompts)?),
            _ => None,
        };
        return Ok(Data::Signals {
            feed,
            held,
            config: config.clone(),
            tau_gen: tc.temperature as f64,
            on_policy,
        });
    }
    let DataCursor::Packed(cursor) = cursor else {
        bail!("the checkpoint was written by a distillation run, and this recipe trains plainly");
    };
    let (train_docs, held) = split_documents(recipe, tokenizer)?;
    if train_docs.is_empty() {
        bail!(
            "{}: no training documents left after the held-out split",
            recipe.path.display()
        );
    }
    Ok(Data::Packed {
        packer: Packer::new(train_docs, r.data.seq_len, r.run.seed, r.data.packing, 0)
            .with_cursor(cursor),
        held,
    })
}

/// A checkpoint on its recipe's held-out data, as training evaluates it, plus what bits per byte
/// need: the evaluated tokens and the UTF-8 bytes they spell.
pub struct HeldOut {
    pub eval: SignalEval,
    pub tokens: usize,
    pub bytes: usize,
}

/// Evaluates `model` on `batches` held-out micro-batches of `recipe` (its split and seed): teacher
/// shards for offline and sequence distillation (with top-1 agreement and KL), its documents
/// otherwise.
pub fn held_out(
    recipe: &LoadedRecipe,
    tokenizer: &Tokenizer,
    model: &K3Mini,
    batches: usize,
) -> Result<HeldOut> {
    let r = &recipe.recipe;
    let count =
        |ids: &[u32]| -> Result<(usize, usize)> { Ok((ids.len(), tokenizer.decode(ids)?.len())) };
    let from_shards = r
        .distill
        .as_ref()
        .is_some_and(|d| d.mode != DistillMode::Online);
    let (eval, (tokens, bytes)) = if from_shards {
        let held =
            signal_data(recipe, tokenizer)?.held_out_batches(batches, r.train.micro_batch)?;
        anyhow::ensure!(
            !held.is_empty(),
            "{}: no held-out teacher segments",
            recipe.path.display()
        );
        let ids: Vec<u32> = held
            .iter()
            .flat_map(|b| b.tokens.iter().map(|&t| t as u32))
            .collect();
        let tau = r.teacher.as_ref().map_or(1.0, |t| t.temperature as f64);
        (signal_eval(model, &held, tau), count(&ids)?)
    } else {
        let (_, held) = split_documents(recipe, tokenizer)?;
        anyhow::ensure!(
            !held.is_empty(),
            "{}: no held-out documents",
            recipe.path.display()
        );
        let ids: Vec<u32> = held.iter().flat_map(|d| d.ids.iter().copied()).collect();
        let eval = SignalEval {
            loss: eval_loss(model, &held, recipe, batches),
            top1: f64::NAN,
            kl: f64::NAN,
        };
        (eval, count(&ids)?)
    };
    Ok(HeldOut {
        eval,
        tokens,
        bytes,
    })
}

/// Runs (or resumes) a recipe.
pub fn train(recipe: &LoadedRecipe, opts: &TrainOptions) -> Result<TrainSummary> {
    let r = &recipe.recipe;
    if r.teacher.is_some() && r.distill.is_none() {
        bail!(
            "{}: this recipe names a [teacher] but no [distill] objectives: add [distill] to train \
             from the teacher's shards, or drop [teacher] for plain training",
            recipe.path.display()
        );
    }
    let out = opts.out_dir.clone().unwrap_or_else(|| recipe.out_dir());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    // `k3mini eval RUN` finds the recipe (its data, held-out split and shards) through this.
    let source = std::path::absolute(&recipe.path)?;
    std::fs::write(out.join(RECIPE_SOURCE), source.display().to_string())
        .with_context(|| format!("writing {}", out.join(RECIPE_SOURCE).display()))?;
    let tokenizer = student_tokenizer(recipe)?;
    if tokenizer.vocab_size() > recipe.model.vocab_size {
        bail!(
            "{}: data.tokenizer has {} ids but model.vocab_size is {}: set [model] vocab_size = {}",
            recipe.path.display(),
            tokenizer.vocab_size(),
            recipe.model.vocab_size,
            tokenizer.vocab_size()
        );
    }
    let device = Device::default();
    device.seed(r.run.seed);
    let device = device.autodiff();
    let fresh = K3Mini::new(&recipe.model, &device)?;
    let (mut model, mut optim, mut state) = if opts.resume {
        resume(&out, recipe, fresh)?
    } else {
        if k3mini_checkpoints::latest(&out)?.is_some() {
            bail!(
                "{} already holds checkpoints: pass --resume to continue, or choose another --out",
                out.display()
            );
        }
        let optim = build_optimizer(&r.optim, &fresh);
        (
            fresh,
            optim,
            TrainState {
                step: 0,
                cursor: match r.distill {
                    Some(_) => DataCursor::Signals(SignalCursor::default()),
                    None => DataCursor::Packed(Cursor::default()),
                },
                prompts: None,
                seed: r.run.seed,
                consecutive_bad_steps: 0,
            },
        )
    };
    let mut data = open_data(recipe, &tokenizer, state.cursor, state.prompts)?;
    k3mini_checkpoints::remove_stale_temps(&out)?;
    let metrics_path = out.join("metrics.jsonl");
    truncate_metrics(&metrics_path, state.step)?;
    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&metrics_path)
        .with_context(|| format!("opening {}", metrics_path.display()))?;

    let total = r.train.steps;
    let first_step = state.step;
    let last = opts
        .stop_after
        .map_or(total, |n| (first_step + n).min(total));
    let progress = if opts.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed} < {eta}]",
            )
            .expect("valid template"),
        );
        bar.set_position(first_step as u64);
        bar
    };
    let started = Instant::now();
    let (mut first_loss, mut last_loss, mut last_eval) = (None, None, None);
    let mut tokens_seen = 0usize;
    while state.step < last {
        let step_start = Instant::now();
        let lr = lr_at(&r.schedule, r.optim.lr, state.step, total);
        let mut accumulator = GradientsAccumulator::new();
        let mut loss_sum = 0.0f64;
        // Σ reverse-KL estimate · tokens, and tokens, over this step's on-policy micro-batches.
        let mut on_policy = (0.0f64, 0usize);
        // QAT: the forward pass sees fake-quantised linear weights; gradients reach `model`'s.
        let mut qat = match &r.train.qat {
            Some(q) if state.step >= q.start_step => Some(FakeQuantizer::new(q.format)),
            _ => None,
        };
        for micro in 0..recipe.accumulation {
            let forward_model = match &mut qat {
                Some(q) => q.apply(&model),
                None => model.clone(),
            };
            // Seeds what a micro-batch samples (sampled-KD targets): a function of the step.
            let seed = r.run.seed ^ ((state.step * recipe.accumulation + micro) as u64 + 1);
            let (loss, stats) = data.micro_loss(&forward_model, recipe, seed)?;
            let loss = loss / recipe.accumulation as f64;
            if let Some(s) = stats {
                on_policy.0 += s.reverse_kl * s.tokens as f64;
                on_policy.1 += s.tokens;
            }
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            accumulator.accumulate(&model, GradientsParams::from_grads(loss.backward(), &model));
        }
        let mut grads = accumulator.grads();
        let grad_norm = match r.optim.grad_clip {
            Some(c) => clip_global_norm(&model, &mut grads, c),
            None => global_grad_norm(&model, &grads),
        };
        let skipped = !(loss_sum.is_finite() && grad_norm.is_finite());
        if skipped {
            state.consecutive_bad_steps += 1;
            progress.println(format!(
                "step {}: non-finite loss or gradient, update skipped",
                state.step
            ));
        } else {
            state.consecutive_bad_steps = 0;
            model = optim.step(lr, model, grads);
        }
        state.step += 1;
        state.cursor = data.cursor();
        state.prompts = data.prompt_cursor();
        let step_tokens = r.train.batch_tokens;
        tokens_seen += step_tokens;
        // Throughput of the step itself, before any held-out evaluation.
        let tokens_per_s = step_tokens as f64 / step_start.elapsed().as_secs_f64();
        let eval = (state.step % r.train.eval_every == 0 || state.step == total)
            .then(|| data.evaluate(&model, recipe))
            .flatten();
        let eval_loss = eval.map(|e| e.loss);
        let finite = |x: f64| x.is_finite().then_some(x);
        let m = StepMetrics {
            step: state.step,
            tokens: state.step * step_tokens,
            loss: loss_sum,
            lr,
            grad_norm,
            tokens_per_s,
            skipped,
            eval_loss,
            eval_top1: eval.and_then(|e| finite(e.top1)),
            eval_kl: eval.and_then(|e| finite(e.kl)),
            on_policy_kl: (on_policy.1 > 0).then(|| on_policy.0 / on_policy.1 as f64),
            peak_rss_bytes: k3mini_student::bench::peak_rss_bytes(),
        };
        if state.step % r.train.log_every == 0 || eval_loss.is_some() || skipped {
            writeln!(metrics, "{}", serde_json::to_string(&m)?).context("writing metrics.jsonl")?;
        }
        first_loss.get_or_insert(loss_sum);
        last_loss = Some(loss_sum);
        last_eval = eval_loss.or(last_eval);
        progress.set_position(state.step as u64);
        progress.set_message(format!(
            "loss {loss_sum:.4}{}  lr {lr:.2e}  {:.0} tok/s",
            eval_loss.map_or(String::new(), |e| format!("  eval {e:.4}")),
            m.tokens_per_s
        ));
        if state.consecutive_bad_steps >= r.train.max_bad_steps {
            progress.abandon();
            bail!(
                "{} consecutive steps had a non-finite loss or gradient (last at step {}); stopping. \
                 The last good checkpoint in {} is intact; lower optim.lr or check the data.",
                state.consecutive_bad_steps,
                state.step,
                out.display()
            );
        }
        let interrupted = INTERRUPTED.load(Ordering::SeqCst);
        if state.step % r.train.checkpoint_every == 0 || state.step == last || interrupted {
            write_checkpoint(&out, recipe, &model, &optim, &state)?;
        }
        if interrupted {
            progress.abandon_with_message(format!(
                "interrupted: checkpoint at step {} written",
                state.step
            ));
            break;
        }
    }
    progress.finish();
    Ok(TrainSummary {
        out_dir: out,
        first_step,
        last_step: state.step,
        first_loss,
        last_loss,
        eval_loss: last_eval,
        tokens: tokens_seen,
        wall_s: started.elapsed().as_secs_f64(),
        interrupted: INTERRUPTED.load(Ordering::SeqCst),
    })
}
