//! Distillation from shards: the student trains with the plan's `[distill]` objectives on the
//! teacher's signals over the corpus (`mode = "offline"`: scored segments) or on the teacher's own
//! completions (`mode = "sequence"`: trajectory shards, completion tokens only), one row per
//! segment or prompt (`k3mini_data::signals`).
//!
//! Held-out documents are the ones plain training holds out: a scored segment's document key is
//! hashed with the seed (`k3mini_data::stream::is_held_out`); trajectories are held out by a
//! seeded draw over the prompts. Held-out segments never train and are what evaluation measures:
//! the held-out cross-entropy (perplexity), the student's top-1 agreement with the teacher, and
//! the forward KL `KL(p̂ ‖ q̂)` at τ = 1 over the teacher's top-k plus tail. Training reads only
//! the shards: the corpus is checked, by its files' names and sizes, to be the one scored.

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::{DistillPlan, ModePlan, RouterKlPlan, RunPlan, Vocabulary};
use crate::run_dir::DataCursor;
use crate::train::batch::{flatten, position_hidden};
use crate::train::held_out::HeldOut;
use crate::train::objective::{Job, MicroBatch, StepModel, TrainingObjective};
use burn::tensor::{Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_data::chat::ChatFormat;
use k3mini_data::pack::split_held_out;
use k3mini_data::rng::uniform;
use k3mini_data::signals::{
    ShardFile, SignalBatch, SignalCursor, SignalSource, SignalSpec, SignalStream, assemble,
};
use k3mini_data::stream::is_held_out;
use k3mini_student::K3Mini;
use k3mini_student::distill::{
    Objective, alm_chunk, masked_count, masked_mean, masked_share, objective_per_position,
    router_kl, sample_targets, teacher_buckets,
};
use k3mini_student::head::{HeadChunks, head_loss, target_logprobs};
use k3mini_student::moe::Route;
use k3mini_teacher::LOGPROB_TEMPERATURE;
use k3mini_teacher::generate::GenerateManifestJob;
use k3mini_teacher::manifest::{MANIFEST, Manifest, read_traffic, shards_digest};
use k3mini_teacher::score::ScoreManifestJob;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether a row's document (a corpus document's key, or a prompt's index) is held out.
type HeldOutDoc = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// The teacher shards of a distillation plan, checked against it.
pub struct SignalData {
    pub files: Vec<ShardFile>,
    pub spec: SignalSpec,
    pub held_out: HeldOutDoc,
    pub held_out_fraction: f64,
    /// The temperature the shards' logprobs were scored at.
    pub temperature: f64,
}

/// A finished job's manifest under `dir`, or an error saying which command completes it.
fn finished_manifest<J: serde::de::DeserializeOwned>(
    dir: &Path,
    command: &str,
    plan: &RunPlan,
    items: impl Fn(&J) -> (usize, usize),
) -> Result<Manifest<J>> {
    let path = dir.join(MANIFEST);
    let rerun = format!("k3mini teacher {command} {}", plan.recipe_name());
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
    if m.shards.len() > expected {
        bail!(
            "{}: the manifest lists {} shards but its job has {expected}: it is inconsistent \
             (edited, or mixed with another job's); rescore into a new directory with `{rerun}`",
            path.display(),
            m.shards.len(),
        );
    }
    if m.shards.len() < expected {
        bail!(
            "{}: {} of {expected} shards are finished: rerun `{rerun}` to complete them",
            dir.display(),
            m.shards.len(),
        );
    }
    Ok(m)
}

/// One mode's shards, opened and checked against the plan: where they are, how their rows are
/// read and held out, and what they were made with.
struct Opened {
    dir: PathBuf,
    files: Vec<ShardFile>,
    held_out: HeldOutDoc,
    source: SignalSource,
    /// The tokenizer fingerprint and top-k the shards were made with.
    tokenizer_sha256: String,
    k: usize,
    /// The temperature their logprobs were scored at.
    temperature: f64,
}

/// Sequence-level KD's shards: `teacher generate`'s trajectories, held out by prompt.
/// The chat format `teacher generate` rendered the plan's prompts in (ChatML without a
/// `[teacher.generate]` table, as before formats were per vocabulary).
fn generated_in(plan: &RunPlan) -> ChatFormat {
    plan.distill
        .as_ref()
        .and_then(|d| d.teacher.generate.as_ref())
        .map_or(ChatFormat::Chatml, |g| g.prompts.template)
}

fn open_trajectories(plan: &RunPlan, dir: &Path, tokenizer: &Tokenizer) -> Result<Opened> {
    let m: Manifest<GenerateManifestJob> =
        finished_manifest(dir, "generate", plan, |j: &GenerateManifestJob| {
            (j.prompts, j.prompts_per_shard)
        })?;
    // Prompt sets are small and in memory: a draw over their indices.
    let (_, held) = split_held_out(m.job.prompts, plan.data.held_out_fraction, plan.seed);
    let held: HashSet<u64> = held.into_iter().map(|d| d as u64).collect();
    Ok(Opened {
        dir: dir.to_path_buf(),
        files: shard_files(dir, &m),
        held_out: Arc::new(move |doc| held.contains(&doc)),
        source: SignalSource::Trajectories {
            thinking_end: generated_in(plan).thinking_end(tokenizer)?,
            train_on: plan.data.train_on.clone(),
        },
        tokenizer_sha256: m.job.tokenizer_sha256,
        k: m.job.k,
        // Generation samples at its own temperature; the logprobs it returns are untempered.
        temperature: LOGPROB_TEMPERATURE,
    })
}

/// The traffic mode's shards: the first `shards` of a gateway's traffic directory, as the plan
/// pinned them by `digest`.
fn open_traffic(plan: &RunPlan, dir: &Path, shards: usize, digest: &str) -> Result<Opened> {
    let Some(mut m) = read_traffic(dir)? else {
        bail!("{}: its traffic manifest is gone", dir.display());
    };
    if m.shards.len() < shards || shards_digest(&m.shards[..shards]) != digest {
        bail!(
            "{}: the {shards} shards this run's plan pinned are no longer the manifest's \
             first (the directory was rewritten): train on it from a fresh plan",
            dir.display()
        );
    }
    m.shards.truncate(shards);
    let (seed, fraction) = (plan.seed, plan.data.held_out_fraction);
    Ok(Opened {
        dir: dir.to_path_buf(),
        files: shard_files(dir, &m),
        held_out: Arc::new(move |key| is_held_out(seed, key, fraction)),
        source: SignalSource::Traffic {
            train_on: plan.data.train_on.clone(),
        },
        tokenizer_sha256: m.job.tokenizer_sha256,
        k: m.job.k,
        temperature: f64::from(m.job.temperature),
    })
}

/// `teacher score`'s shards of the recipe's corpus (offline runs; online runs' held-out set;
/// on-policy runs' offline micro-batches), checked to be of this corpus and segment length, and
/// to hold the routing `router_kl` distils.
fn open_scores(plan: &RunPlan, distill: &DistillPlan) -> Result<Opened> {
    let data = &plan.data;
    let dir = &distill.teacher.shards_dir;
    let m: Manifest<ScoreManifestJob> =
        finished_manifest(dir, "score", plan, |j: &ScoreManifestJob| {
            (j.segments, j.segments_per_shard)
        })?;
    if m.job.seq_len != data.seq_len {
        bail!(
            "{}: the shards hold {}-token segments but data.seq_len is {}: rescore or match them",
            dir.display(),
            m.job.seq_len,
            data.seq_len
        );
    }
    if m.job.sources_sha256.is_empty() {
        bail!(
            "{}: these shards number documents by their place in an in-memory list (a \
             k3mini from before corpora streamed), not by their key: rescore into a new \
             directory with `k3mini teacher score {}`",
            dir.display(),
            plan.recipe_name()
        );
    }
    if crate::corpus::sources_sha256(data)? != m.job.sources_sha256 {
        bail!(
            "{}: the recipe's corpus changed since scoring (its sources' files, their \
             sizes or settings differ): rescore it into a new directory",
            dir.display()
        );
    }
    if !(m.job.temperature > 0.0 && m.job.temperature.is_finite()) {
        bail!(
            "{}: the shards say they were scored at temperature {}",
            dir.display(),
            m.job.temperature
        );
    }
    if let Some(rk) = &distill.router_kl {
        match &m.job.routing {
            None => bail!(
                "{}: these shards hold no routing, which router_kl distils: rescore with \
                 teacher.routing = true",
                dir.display()
            ),
            Some(shape) if *shape != rk.design.teacher_shape => bail!(
                "{}: the shards hold the routing of a teacher shaped {:?}; {} was \
                 designed from {:?}",
                dir.display(),
                shape,
                rk.path.display(),
                rk.design.teacher_shape
            ),
            Some(_) => {}
        }
    }
    let train_on = data.train_on.clone();
    let source = match (&m.job.teacher_tokenizer_sha256, distill.vocabulary) {
        (None, Vocabulary::Same) => SignalSource::Scores { train_on },
        (Some(_), _) => {
            if let Some(o) = distill
                .objectives
                .iter()
                .find(|o| !matches!(o.objective, Objective::CrossEntropy | Objective::Xtoken))
            {
                bail!(
                    "{}: these shards are a cross-tokenizer job's (the teacher has its own \
                     vocabulary), but {} compares the teacher's ids with the student's: \
                     weight ce, alm and xtoken only",
                    dir.display(),
                    o.objective.name()
                );
            }
            SignalSource::Aligned { train_on }
        }
        (None, Vocabulary::Cross) => bail!(
            "{}: these shards hold a teacher of the student's own vocabulary, not aligned \
             chunks, which alm and xtoken read: score the corpus into a new directory with \
             `k3mini teacher score {}`",
            dir.display(),
            plan.recipe_name()
        ),
    };
    let (seed, fraction) = (plan.seed, data.held_out_fraction);
    Ok(Opened {
        dir: dir.clone(),
        files: shard_files(dir, &m),
        held_out: Arc::new(move |key| is_held_out(seed, key, fraction)),
        source,
        tokenizer_sha256: m.job.tokenizer_sha256,
        k: m.job.k,
        temperature: m.job.temperature as f64,
    })
}

/// The shards the plan's mode trains from, opened by the mode, checked complete and made for
/// this plan's tokenizer and top-k.
pub fn signal_data(
    plan: &RunPlan,
    distill: &DistillPlan,
    tokenizer: &Tokenizer,
) -> Result<SignalData> {
    let data = &plan.data;
    let teacher = &distill.teacher;
    let fingerprint = tokenizer.fingerprint();
    let opened = match &distill.mode {
        ModePlan::Sequence { trajectories } => open_trajectories(plan, trajectories, tokenizer)?,
        ModePlan::Traffic {
            dir,
            shards,
            digest,
        } => open_traffic(plan, dir, *shards, digest)?,
        // Online runs ask the teacher instead; on-policy runs mix in offline micro-batches and
        // evaluate on the scored shards.
        ModePlan::Offline | ModePlan::Online | ModePlan::OnPolicy(_) => open_scores(plan, distill)?,
    };
    let Opened {
        dir,
        files,
        held_out,
        source,
        tokenizer_sha256,
        k,
        temperature,
    } = opened;
    if tokenizer_sha256 != fingerprint {
        bail!(
            "{}: the shards were made with another tokenizer than the student's",
            dir.display()
        );
    }
    if k < teacher.k {
        bail!(
            "{}: the shards hold top-{} but teacher.k is {}",
            dir.display(),
            k,
            teacher.k
        );
    }
    Ok(SignalData {
        files,
        spec: SignalSpec {
            source,
            seq_len: data.seq_len,
            k: teacher.k,
            vocab: plan.model.vocab_size,
            tokens: tokenizer.vocab_size(),
            tokenizer_sha256: fingerprint,
            routing: distill
                .router_kl
                .as_ref()
                .map(|rk| rk.design.teacher_shape.clone()),
        },
        held_out,
        held_out_fraction: data.held_out_fraction,
        temperature,
    })
}

fn shard_files<J>(dir: &Path, m: &Manifest<J>) -> Vec<ShardFile> {
    m.shards
        .iter()
        .map(|s| ShardFile {
            path: dir.join(&s.file),
            first: s.items[0] as u64,
            sha256: s.sha256.clone(),
            routing: s
                .routing
                .as_ref()
                .map(|c| (dir.join(&c.file), c.sha256.clone())),
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
            Arc::new(move |doc| !held(doc)),
            seed,
            cursor,
        )?)
    }

    /// The first `n` held-out segments in shard order (the same every evaluation).
    pub fn held_out_batches(&self, n_batches: usize, rows: usize) -> Result<Vec<SignalBatch>> {
        let held = self.held_out.clone();
        let keep = move |doc: u64| held(doc);
        let mut segments = Vec::new();
        for f in &self.files {
            if segments.len() >= n_batches * rows {
                break;
            }
            segments.extend(self.spec.read(f, &keep)?);
        }
        if segments.is_empty() && self.held_out_fraction > 0.0 && n_batches > 0 {
            let dir = self.files[0].path.parent().unwrap_or(Path::new("."));
            bail!(
                "{}: no held-out segment: the split hashes each document, so a corpus of few \
                 documents may hold none out; raise data.held_out_fraction or set it to 0",
                dir.display()
            );
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

/// `router_kl`'s term for one batch: over the design's layers, the mean of the masked mean
/// `KL(r ‖ π)` per position (positions the teacher routed; `Route::scores` are `[rows·T, E]`).
fn router_kl_loss(
    routes: &[Route],
    batch: &SignalBatch,
    rk: &RouterKlPlan,
    device: &burn::tensor::Device,
) -> Tensor<1> {
    let (rows, t, e) = (batch.rows, batch.seq_len, rk.design.num_experts);
    let mut total = Tensor::zeros([1], device);
    for map in &rk.design.layers {
        let route = routes
            .iter()
            .find(|r| r.layer == map.student_layer)
            .expect("the plan matched the design's layers to the student's MoE layers");
        let expert_of = map.expert_of(rk.design.teacher_shape.experts);
        let (mut target, mut mask) = (vec![0f32; rows * t * e], vec![0f32; rows * t]);
        for (r, routing) in batch.routing.iter().enumerate() {
            let routing = routing
                .as_ref()
                .expect("the stream reads every row's routing");
            let teacher = routing
                .layers
                .iter()
                .find(|l| l.layer == map.teacher_layer)
                .expect("routing shards were checked against the design's teacher");
            map.target(
                teacher,
                &expert_of,
                &mut target[r * t * e..(r + 1) * t * e],
                &mut mask[r * t..(r + 1) * t],
            );
        }
        let target = Tensor::from_data(TensorData::new(target, [rows * t, e]), device);
        let mask = Tensor::from_data(TensorData::new(mask, [rows * t]), device);
        total = total + masked_mean(router_kl(route.scores.clone(), target), mask);
    }
    total / rk.design.layers.len() as f64
}

/// ALM over one micro-batch (`weight` times the mean over its chunks `c` of
/// [`alm_chunk`]`(t_c, s_c)`, `s_c = Σ_{n ∈ c} log q(x_n)`), applied through the chunked head:
/// its value from a first, undifferentiated pass over the head, and its gradient as the
/// surrogate `Σ_n w_n log q(x_n)` (minus its own value) with `w_n = weight · ∂L_c/∂s_c / C` at
/// chunk `c`'s positions: a function of sums of token log-probabilities differentiates through
/// them linearly, so the head may cut a chunk across its own pieces.
struct AlmTerms {
    /// The loss's value.
    value: f64,
    /// `w_n` per flat position (0 outside every chunk), `[N]`.
    coefficients: Vec<f32>,
}

impl AlmTerms {
    /// From the batch's chunks (rows of `seq_len`) and `lq[n] = log q(x_n)` per flat position.
    fn new(
        plan: &crate::recipe::AlmPlan,
        chunks: &[k3mini_data::signals::BatchChunk],
        seq_len: usize,
        lq: &[f32],
    ) -> Self {
        let mut coefficients = vec![0f32; lq.len()];
        let mut value = 0.0;
        let per_chunk = plan.weight / chunks.len().max(1) as f64;
        for c in chunks {
            let at = c.row * (seq_len - 1);
            let positions = at + c.first..=at + c.last;
            let s: f64 = lq[positions.clone()].iter().map(|&l| l as f64).sum();
            let (loss, grad) = alm_chunk(c.logprob as f64, s, plan.temperature);
            value += loss * per_chunk;
            coefficients[positions].fill((grad * per_chunk) as f32);
        }
        Self {
            value,
            coefficients,
        }
    }

    /// The gradient-carrying share of positions `rows` (value 0): `Σ w_n log q(x_n)` less itself
    /// detached.
    fn share(
        &self,
        logits: Tensor<2>,
        targets: Tensor<1, burn::tensor::Int>,
        rows: std::ops::Range<usize>,
    ) -> Tensor<1> {
        let device = logits.device();
        let w = Tensor::<1>::from_data(
            TensorData::new(self.coefficients[rows.clone()].to_vec(), [rows.len()]),
            &device,
        );
        let term = (-k3mini_student::loss::cross_entropy(logits, targets) * w).sum();
        term.clone() - term.detach()
    }
}

/// `Σ weight · objective` over one batch whose teacher logprobs are at `temperature`, the LM head
/// and the objectives run `chunks` of positions at a time. `seed` draws the sampled-KD targets.
pub fn distill_loss(
    model: &K3Mini,
    batch: &SignalBatch,
    distill: &DistillPlan,
    temperature: f64,
    chunks: HeadChunks,
    seed: u64,
) -> MicroBatch {
    let device = model.lm_head.weight.device();
    let mut flat = flatten(batch, &device);
    // The sampled targets are drawn on the host from the teacher's data alone: before the
    // forward, so reading them waits on nothing of the student's.
    let sampled = distill.objectives.iter().find_map(|o| match o.objective {
        Objective::Sampled { samples } => Some(samples),
        _ => None,
    });
    if let Some(samples) = sampled {
        let p_hat = teacher_buckets(flat.teacher.logprobs.clone(), temperature, distill.tau);
        let [n, k1] = p_hat.dims();
        let probs: Vec<f32> = p_hat
            .exp()
            .into_data()
            .try_into_vec()
            .expect("f32 probabilities");
        let mut state = seed;
        let freq = sample_targets(&probs, k1, samples, &mut || uniform(&mut state));
        flat.teacher.sampled = Some(Tensor::from_data(TensorData::new(freq, [n, k1]), &device));
    }
    let (hidden, routers) = position_hidden(model, flat.tokens.clone(), None);
    let (count, teacher_count) = (
        masked_count(flat.mask.clone()),
        masked_count(flat.teacher_mask.clone()),
    );
    let alm = distill.alm.as_ref().map(|a| {
        let lq = target_logprobs(model, hidden.clone(), chunks, flat.targets.clone());
        AlmTerms::new(a, &batch.chunks, batch.seq_len, &lq)
    });
    let loss = head_loss(model, hidden, chunks, |logits, rows| {
        let slice = |x: &Tensor<1>| x.clone().narrow(0, rows.start, rows.len());
        let (targets, mask, teacher_mask) = (
            flat.targets.clone().narrow(0, rows.start, rows.len()),
            slice(&flat.mask),
            slice(&flat.teacher_mask),
        );
        let teacher = flat.teacher.rows(rows.clone());
        let objectives = distill
            .objectives
            .iter()
            .map(|o| {
                let per = objective_per_position(
                    o.objective,
                    logits.clone(),
                    targets.clone(),
                    &teacher,
                    temperature,
                    distill.tau,
                );
                // Projected top-k exist at chunk starts only.
                let share = match o.objective {
                    Objective::Xtoken => {
                        masked_share(per, teacher_mask.clone(), teacher_count.clone())
                    }
                    _ => masked_share(per, mask.clone(), count.clone()),
                };
                share * o.weight
            })
            .fold(Tensor::zeros([1], &device), |a, b| a + b);
        match &alm {
            Some(alm) => objectives + alm.share(logits, targets, rows),
            None => objectives,
        }
    });
    let loss = match &alm {
        Some(alm) => {
            loss + Tensor::from_data(TensorData::new(vec![alm.value as f32], [1]), &device)
        }
        None => loss,
    };
    let loss = match &distill.router_kl {
        Some(rk) => loss + router_kl_loss(&routers.routing, batch, rk, &device) * rk.weight,
        None => loss,
    };
    MicroBatch {
        loss,
        routers,
        on_policy: None,
    }
}

/// [`distill_loss`] on `batch`, as a replica's job.
pub fn distill_job(
    batch: SignalBatch,
    distill: &DistillPlan,
    temperature: f64,
    chunks: HeadChunks,
    seed: u64,
) -> Job {
    let distill = distill.clone();
    Box::new(move |model: &K3Mini| distill_loss(model, &batch, &distill, temperature, chunks, seed))
}

/// Offline and sequence-level distillation: micro-batches of stored teacher signals.
pub struct Shards {
    stream: SignalStream,
    distill: DistillPlan,
    temperature: f64,
    rows: usize,
    chunks: HeadChunks,
    held: HeldOut,
}

impl Shards {
    pub fn open(
        plan: &RunPlan,
        distill: &DistillPlan,
        tokenizer: &k3mini_data::Tokenizer,
        cursor: SignalCursor,
    ) -> Result<Self> {
        let signals = signal_data(plan, distill, tokenizer)?;
        let rows = plan.train.micro_batch;
        Ok(Self {
            held: HeldOut::Signals {
                batches: signals.held_out_batches(plan.train.eval_batches, rows)?,
                temperature: signals.temperature,
            },
            stream: signals.train_stream(plan.seed, cursor)?,
            distill: distill.clone(),
            temperature: signals.temperature,
            rows,
            chunks: plan.head_chunks(),
        })
    }
}

impl TrainingObjective for Shards {
    fn next(&mut self, _student: &StepModel, seed: u64) -> Result<Job> {
        let batch = self.stream.next_batch(self.rows)?;
        Ok(distill_job(
            batch,
            &self.distill,
            self.temperature,
            self.chunks,
            seed,
        ))
    }

    fn skip(&mut self, _student: &StepModel, _seed: u64) -> Result<()> {
        Ok(self.stream.skip_batch(self.rows)?)
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Signals(self.stream.cursor()), None)
    }
}
