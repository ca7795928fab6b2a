//! Distillation from shards: the student trains with the recipe's `[distill]` objectives on the
//! teacher's signals over the corpus (`mode = "offline"`: scored segments) or on the teacher's own
//! completions (`mode = "sequence"`: trajectory shards, completion tokens only), one row per
//! segment or prompt (`k3mini_data::signals`).
//!
//! Held-out documents are chosen as in plain training (`data.held_out_fraction`, seeded, over the
//! scoring job's documents); their segments never train and are what evaluation measures: the
//! held-out cross-entropy (perplexity), the student's top-1 agreement with the teacher, and the
//! forward KL `KL(p̂ ‖ q̂)` at τ = 1 over the teacher's top-k plus tail.

use crate::recipe::{DistillConfig, DistillMode, LoadedRecipe, ObjectiveKind};
use crate::train::trainer::tokenized_documents;
use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_data::chat::THINK_CLOSE;
use k3mini_data::pack::{split_held_out, splitmix64};
use k3mini_data::signals::{
    ShardFile, SignalBatch, SignalCursor, SignalSource, SignalSpec, SignalStream, assemble,
};
use k3mini_student::K3Mini;
use k3mini_student::distill::{
    Objective, TeacherTopK, masked_mean, objective_per_position, sample_targets, teacher_buckets,
};
use k3mini_teacher::generate::GenerateManifestJob;
use k3mini_teacher::manifest::{MANIFEST, Manifest, ids_sha256};
use k3mini_teacher::score::{ScoreManifestJob, segments};
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

/// The teacher shards of a distillation recipe, checked against it.
pub struct SignalData {
    pub files: Vec<ShardFile>,
    pub spec: SignalSpec,
    pub held_out: Arc<HashSet<u64>>,
}

/// A finished job's manifest under `dir`, or an error saying which command completes it.
fn finished_manifest<J: serde::de::DeserializeOwned>(
    dir: &Path,
    command: &str,
    recipe: &LoadedRecipe,
    items: impl Fn(&J) -> (usize, usize),
) -> Result<Manifest<J>> {
    let path = dir.join(MANIFEST);
    let rerun = format!("k3mini teacher {command} {}", recipe.path.display());
    let text = std::fs::read(&path).with_context(|| {
        format!(
            "{}: no teacher shards (run `{rerun}` first)",
            path.display()
        )
    })?;
    let m: Manifest<J> = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not a `teacher {command}` manifest", path.display()))?;
    let (total, per_shard) = items(&m.job);
    let expected = total.div_ceil(per_shard.max(1));
    if m.shards.len() != expected {
        bail!(
            "{}: {} of {expected} shards are finished: rerun `{rerun}` to complete them",
            dir.display(),
            m.shards.len(),
        );
    }
    Ok(m)
}

/// Reads the shard manifest of the recipe's mode and checks it is complete and made for it.
pub fn signal_data(
    recipe: &LoadedRecipe,
    tokenizer: &k3mini_data::Tokenizer,
) -> Result<SignalData> {
    let r = &recipe.recipe;
    let tc = r.teacher.as_ref().expect("[distill] requires [teacher]");
    let mode = r.distill.as_ref().map_or(DistillMode::Offline, |d| d.mode);
    let fingerprint = tokenizer.fingerprint();
    // Scored segments are checked against (and masked by) the recipe's own documents.
    let mut corpus = None;
    let (dir, documents, files, source, made_with) = match mode {
        DistillMode::Online => unreachable!("online runs ask the teacher, not shards"),
        // On-policy runs mix in offline micro-batches and evaluate on the scored shards.
        DistillMode::Offline | DistillMode::OnPolicy => {
            let dir = recipe
                .shards_dir()
                .expect("a [teacher] recipe has a shard dir");
            let m: Manifest<ScoreManifestJob> =
                finished_manifest(&dir, "score", recipe, |j: &ScoreManifestJob| {
                    (j.segments, j.segments_per_shard)
                })?;
            if m.job.seq_len != r.data.seq_len {
                bail!(
                    "{}: the shards hold {}-token segments but data.seq_len is {}: rescore or match them",
                    dir.display(),
                    m.job.seq_len,
                    r.data.seq_len
                );
            }
            let docs = tokenized_documents(recipe, tokenizer)?;
            let scored = docs.iter().flat_map(|d| segments(&d.ids, r.data.seq_len));
            if ids_sha256(scored) != m.job.inputs_sha256 {
                bail!(
                    "{}: the recipe's corpus changed since scoring (its segments' hash differs): \
                     rescore it into a new directory",
                    dir.display()
                );
            }
            corpus = Some(Arc::new(docs));
            let files = shard_files(&dir, &m);
            (
                dir,
                m.job.documents,
                files,
                SignalSource::Scores,
                (m.job.tokenizer_sha256, m.job.k),
            )
        }
        DistillMode::Sequence => {
            let dir = recipe
                .trajectories_dir()
                .expect("sequence mode requires [teacher.generate]");
            let m: Manifest<GenerateManifestJob> =
                finished_manifest(&dir, "generate", recipe, |j: &GenerateManifestJob| {
                    (j.prompts, j.prompts_per_shard)
                })?;
            let files = shard_files(&dir, &m);
            let source = SignalSource::Trajectories {
                think_close: tokenizer.token_id(THINK_CLOSE),
                train_on: r.data.train_on.clone(),
            };
            (
                dir,
                m.job.prompts,
                files,
                source,
                (m.job.tokenizer_sha256, m.job.k),
            )
        }
    };
    if made_with.0 != fingerprint {
        bail!(
            "{}: the shards were made with another tokenizer than the student's",
            dir.display()
        );
    }
    if made_with.1 < tc.k {
        bail!(
            "{}: the shards hold top-{} but teacher.k is {}",
            dir.display(),
            made_with.1,
            tc.k
        );
    }
    let (_, held) = split_held_out(documents, r.data.held_out_fraction, r.run.seed);
    Ok(SignalData {
        files,
        spec: SignalSpec {
            source,
            documents: corpus,
            seq_len: r.data.seq_len,
            k: tc.k,
            vocab: recipe.model.vocab_size,
            tokenizer_sha256: fingerprint,
        },
        held_out: Arc::new(held.into_iter().map(|d| d as u64).collect()),
    })
}

fn shard_files<J>(dir: &Path, m: &Manifest<J>) -> Vec<ShardFile> {
    m.shards
        .iter()
        .map(|s| ShardFile {
            path: dir.join(&s.file),
            first: s.items[0] as u64,
        })
        .collect()
}

impl SignalData {
    /// The training stream from `cursor`.
    pub fn train_stream(&self, seed: u64, cursor: SignalCursor) -> Result<SignalStream> {
        let held = self.held_out.clone();
        Ok(SignalStream::new(
            self.files.clone(),
            self.spec.clone(),
            Arc::new(move |doc| !held.contains(&doc)),
            seed,
            cursor,
        )?)
    }

    /// The first `n` held-out segments in shard order (the same every evaluation).
    pub fn held_out_batches(&self, n_batches: usize, rows: usize) -> Result<Vec<SignalBatch>> {
        let held = self.held_out.clone();
        let keep = move |doc: u64| held.contains(&doc);
        let mut segments = Vec::new();
        for f in &self.files {
            if segments.len() >= n_batches * rows {
                break;
            }
            segments.extend(self.spec.read(f, &keep)?);
        }
        segments.truncate(n_batches * rows);
        Ok(segments
            .chunks(rows)
            .map(|c| {
                let refs: Vec<_> = c.iter().collect();
                assemble(&refs, self.spec.seq_len, self.spec.k, self.spec.vocab)
            })
            .collect())
    }
}

/// One batch as flat `[N = rows·(T−1)]` tensors: logits' positions, targets, mask, teacher top-k.
struct Flat {
    tokens: Tensor<2, Int>,
    targets: Tensor<1, Int>,
    mask: Tensor<1>,
    teacher: TeacherTopK,
}

fn flatten(b: &SignalBatch, device: &Device) -> Flat {
    let (rows, t, k) = (b.rows, b.seq_len, b.k);
    let n = rows * (t - 1);
    let tokens: Tensor<2, Int> =
        Tensor::from_data(TensorData::new(b.tokens.clone(), [rows, t]), device);
    let targets = tokens.clone().narrow(1, 1, t - 1).reshape([n]);
    let mask = Tensor::<2>::from_data(TensorData::new(b.loss_mask.clone(), [rows, t]), device)
        .narrow(1, 0, t - 1)
        .reshape([n]);
    let ids = Tensor::<3, Int>::from_data(TensorData::new(b.top_ids.clone(), [rows, t, k]), device)
        .narrow(1, 0, t - 1)
        .reshape([n, k]);
    let logprobs = Tensor::<3>::from_data(
        TensorData::new(b.top_logprobs.clone(), [rows, t, k]),
        device,
    )
    .narrow(1, 0, t - 1)
    .reshape([n, k]);
    Flat {
        tokens,
        targets,
        mask,
        teacher: TeacherTopK {
            ids,
            logprobs,
            sampled: None,
        },
    }
}

/// The student's logits at every predicting position: `[rows, T] → [rows·(T−1), V]`.
fn position_logits(model: &K3Mini, tokens: Tensor<2, Int>) -> Tensor<2> {
    let logits = model.forward(tokens); // [rows, T, V]
    let [rows, t, v] = logits.dims();
    logits.narrow(1, 0, t - 1).reshape([rows * (t - 1), v])
}

/// `Σ weight · objective` over one batch. `seed` draws the sampled-KD targets.
pub fn distill_loss(
    model: &K3Mini,
    batch: &SignalBatch,
    cfg: &DistillConfig,
    tau_gen: f64,
    seed: u64,
) -> Tensor<1> {
    let device = model.lm_head.weight.device();
    let mut flat = flatten(batch, &device);
    let logits = position_logits(model, flat.tokens.clone());
    if let Some(o) = cfg
        .objectives
        .iter()
        .find(|o| o.kind == ObjectiveKind::Sampled)
    {
        let Objective::Sampled { samples } = o.objective() else {
            unreachable!("kind sampled")
        };
        let p_hat = teacher_buckets(flat.teacher.logprobs.clone(), tau_gen, cfg.temperature);
        let [n, k1] = p_hat.dims();
        let probs: Vec<f32> = p_hat
            .exp()
            .into_data()
            .try_into_vec()
            .expect("f32 probabilities");
        let mut state = seed;
        let freq = sample_targets(&probs, k1, samples, &mut || {
            (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64
        });
        flat.teacher.sampled = Some(Tensor::from_data(TensorData::new(freq, [n, k1]), &device));
    }
    cfg.objectives
        .iter()
        .filter(|o| o.weight > 0.0)
        .map(|o| {
            let per = objective_per_position(
                o.objective(),
                logits.clone(),
                flat.targets.clone(),
                &flat.teacher,
                tau_gen,
                cfg.temperature,
            );
            masked_mean(per, flat.mask.clone()) * o.weight
        })
        .reduce(|a, b| a + b)
        .expect("validation requires a positive weight")
}

/// Held-out measurements of a distillation run.
#[derive(Clone, Copy, Debug, Default)]
pub struct SignalEval {
    /// Mean cross-entropy of the actual next tokens (nats).
    pub loss: f64,
    /// Fraction of positions where the student's argmax is the teacher's top-1.
    pub top1: f64,
    /// Mean `KL(p̂ ‖ q̂)` at τ = 1.
    pub kl: f64,
}

/// Evaluates the student on held-out batches (token-weighted means).
pub fn signal_eval(model: &K3Mini, batches: &[SignalBatch], tau_gen: f64) -> SignalEval {
    let device = model.lm_head.weight.device().without_autodiff();
    let inference = burn::module::Module::valid(model);
    let (mut ce, mut kl, mut agree, mut count) = (0.0, 0.0, 0.0, 0.0);
    for b in batches {
        let flat = flatten(b, &device);
        let logits = position_logits(&inference, flat.tokens.clone());
        let weight = flat.mask.clone().sum().into_scalar::<f32>() as f64;
        let per = |o| {
            let v = objective_per_position(
                o,
                logits.clone(),
                flat.targets.clone(),
                &flat.teacher,
                tau_gen,
                1.0,
            );
            masked_mean(v, flat.mask.clone()).into_scalar::<f32>() as f64 * weight
        };
        ce += per(Objective::CrossEntropy);
        kl += per(Objective::ForwardKl);
        let n = flat.mask.dims()[0];
        let student_top = logits.argmax(1).reshape([n]);
        let teacher_top = flat.teacher.ids.clone().narrow(1, 0, 1).reshape([n]);
        agree += (student_top.equal(teacher_top).float() * flat.mask.clone())
            .sum()
            .into_scalar::<f32>() as f64;
        count += weight;
    }
    let count = f64::max(count, 1.0);
    SignalEval {
        loss: ce / count,
        top1: agree / count,
        kl: kl / count,
    }
}
