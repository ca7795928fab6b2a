//! Online distillation: the teacher (local, or served over HTTP) scores each micro-batch while the
//! student trains on the one before, so nothing is stored and the two overlap.
//!
//! The rows are the recipe's documents cut into `seq_len` segments (as `k3mini teacher score` cuts
//! them); each epoch takes the training segments in a seeded permutation, and the stream's whole
//! state is a cursor `(epoch, row)`, so a resumed run asks the teacher for exactly the batches an
//! uninterrupted one would have.

use crate::error::Result;
use crate::recipe::{DistillPlan, RunPlan};
use crate::run_dir::DataCursor;
use crate::train::distill::distill_loss;
use crate::train::held_out::HeldOut;
use crate::train::objective::{MicroBatch, TrainingObjective};
use k3mini_data::pack::split_held_out;
use k3mini_data::shards::ShardRow;
use k3mini_data::signals::{SignalBatch, SignalCursor, SignalRow, assemble, take_in_epoch_order};
use k3mini_data::{TokenDoc, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_teacher::score::{score_many, segments};
use k3mini_teacher::{LOGPROB_TEMPERATURE, Teacher};
use std::sync::Arc;
use std::thread::JoinHandle;

/// How batches are shaped and scored.
#[derive(Clone, Debug)]
pub struct OnlineSpec {
    pub seq_len: usize,
    pub k: usize,
    pub vocab: usize,
    /// Requests in flight per batch (served teachers).
    pub concurrency: usize,
}

/// A segment of a document, with the positions that train (chat documents train on the parts
/// `data.train_on` names).
#[derive(Clone, Debug)]
pub struct Segment {
    pub doc: u64,
    pub ids: Vec<u32>,
    pub targets: Vec<bool>,
}

type Segments = Arc<Vec<Segment>>;

/// Scores `rows` with the teacher and lays them out as a batch.
pub fn score_batch(
    teacher: &dyn Teacher,
    rows: &[Segment],
    spec: &OnlineSpec,
) -> Result<SignalBatch> {
    let inputs: Vec<&[u32]> = rows.iter().map(|s| &s.ids[..]).collect();
    let scored = score_many(teacher, &inputs, spec.k, spec.concurrency, &mut |_| {})?;
    let rows: Vec<SignalRow> = rows
        .iter()
        .zip(scored)
        .map(|(seg, s)| {
            let row = ShardRow {
                doc_id: seg.doc,
                segment: 0,
                input_ids: s.ids,
                target_logprobs: s.target_logprobs,
                top_ids: s.top_ids,
                top_logprobs: s.top_logprobs,
            };
            SignalRow {
                targets: seg.targets.clone(),
                ..SignalRow::from_scores(row, spec.k, spec.k)
            }
        })
        .collect();
    let refs: Vec<&SignalRow> = rows.iter().collect();
    Ok(assemble(&refs, spec.seq_len, spec.k, spec.vocab))
}

/// Training and held-out segments of `docs`, split by document as plain training splits them.
pub fn split_segments(
    docs: &[TokenDoc],
    seq_len: usize,
    held_out_fraction: f64,
    seed: u64,
) -> (Vec<Segment>, Vec<Segment>) {
    let (train, held) = split_held_out(docs.len(), held_out_fraction, seed);
    let cut = |idx: Vec<usize>| -> Vec<Segment> {
        idx.into_iter()
            .flat_map(|d| {
                let doc = &docs[d];
                segments(&doc.ids, seq_len)
                    .enumerate()
                    .map(move |(i, ids)| Segment {
                        doc: d as u64,
                        targets: (0..ids.len() - 1)
                            .map(|pos| doc.is_target(i * seq_len + pos + 1))
                            .collect(),
                        ids: ids.to_vec(),
                    })
            })
            .collect()
    };
    (cut(train), cut(held))
}

/// An endless stream of teacher-scored batches, one always being scored ahead.
pub struct OnlineStream {
    teacher: Arc<dyn Teacher + Send + Sync>,
    segments: Segments,
    spec: Arc<OnlineSpec>,
    seed: u64,
    rows: usize,
    cursor: SignalCursor,
    /// The next batch (being scored) and the cursor after it.
    next: Option<(SignalCursor, JoinHandle<Result<SignalBatch>>)>,
}

impl OnlineStream {
    pub fn new(
        teacher: Arc<dyn Teacher + Send + Sync>,
        segments: Vec<Segment>,
        spec: OnlineSpec,
        seed: u64,
        rows: usize,
        cursor: SignalCursor,
    ) -> Result<Self> {
        crate::ensure!(
            !segments.is_empty(),
            "no training segments left after the held-out split"
        );
        let mut s = Self {
            teacher,
            segments: Arc::new(segments),
            spec: Arc::new(spec),
            seed,
            rows,
            cursor,
            next: None,
        };
        s.prefetch();
        Ok(s)
    }

    pub fn cursor(&self) -> SignalCursor {
        self.cursor
    }

    /// The segments of the batch at `at`, and the cursor after it.
    fn pick(&self, mut at: SignalCursor) -> (Vec<Segment>, SignalCursor) {
        let picked = take_in_epoch_order(self.segments.len(), self.seed, &mut at, self.rows);
        let rows = picked
            .into_iter()
            .map(|i| self.segments[i].clone())
            .collect();
        (rows, at)
    }

    /// Starts scoring the batch at the cursor.
    fn prefetch(&mut self) {
        let (rows, after) = self.pick(self.cursor);
        let (teacher, spec) = (self.teacher.clone(), self.spec.clone());
        let handle = std::thread::spawn(move || score_batch(teacher.as_ref(), &rows, &spec));
        self.next = Some((after, handle));
    }

    /// The scored batch at the cursor; the one after it starts scoring before this returns.
    pub fn next_batch(&mut self) -> Result<SignalBatch> {
        let (after, handle) = self.next.take().expect("a batch is always being scored");
        let batch = handle
            .join()
            .map_err(|_| crate::refused!("the teacher thread panicked"))??;
        self.cursor = after;
        self.prefetch();
        Ok(batch)
    }
}

impl OnlineSpec {
    fn of(plan: &RunPlan, distill: &DistillPlan) -> Self {
        Self {
            seq_len: plan.data.seq_len,
            k: distill.teacher.k,
            vocab: plan.model.vocab_size,
            concurrency: distill.teacher.concurrency,
        }
    }
}

/// The plan's training and held-out segments.
fn plan_segments(plan: &RunPlan, tokenizer: &Tokenizer) -> Result<(Vec<Segment>, Vec<Segment>)> {
    let docs = crate::corpus::tokenized_documents(&plan.data, tokenizer)?;
    Ok(split_segments(
        &docs,
        plan.data.seq_len,
        plan.data.held_out_fraction,
        plan.seed,
    ))
}

/// The first `n` micro-batches of held-out segments, scored by `teacher`.
fn score_held_out(
    teacher: &dyn Teacher,
    held: &[Segment],
    spec: &OnlineSpec,
    rows: usize,
    n: usize,
) -> Result<HeldOut> {
    Ok(HeldOut::Signals {
        batches: held
            .chunks(rows)
            .take(n)
            .map(|c| score_batch(teacher, c, spec))
            .collect::<Result<_>>()?,
        temperature: LOGPROB_TEMPERATURE,
    })
}

/// An online run's held-out set, as its training evaluates it.
pub fn held_out(
    plan: &RunPlan,
    distill: &DistillPlan,
    teacher: &dyn Teacher,
    tokenizer: &Tokenizer,
    n: usize,
) -> Result<HeldOut> {
    let (_, held) = plan_segments(plan, tokenizer)?;
    let spec = OnlineSpec::of(plan, distill);
    score_held_out(teacher, &held, &spec, plan.train.micro_batch, n)
}

/// Online distillation: the teacher scores the next micro-batch while the student trains.
pub struct Online {
    stream: OnlineStream,
    distill: DistillPlan,
    held: HeldOut,
}

impl Online {
    pub fn open(
        plan: &RunPlan,
        distill: &DistillPlan,
        tokenizer: &Tokenizer,
        cursor: SignalCursor,
    ) -> Result<Self> {
        let teacher = crate::teachers::plan_teacher(distill, &plan.devices, tokenizer)?;
        let (train, held) = plan_segments(plan, tokenizer)?;
        let spec = OnlineSpec::of(plan, distill);
        let rows = plan.train.micro_batch;
        let held = score_held_out(
            teacher.as_ref(),
            &held,
            &spec,
            rows,
            plan.train.eval_batches,
        )?;
        Ok(Self {
            stream: OnlineStream::new(teacher, train, spec, plan.seed, rows, cursor)?,
            distill: distill.clone(),
            held,
        })
    }
}

impl TrainingObjective for Online {
    fn micro_batch(&mut self, model: &K3Mini, seed: u64) -> Result<MicroBatch> {
        let batch = self.stream.next_batch()?;
        Ok(distill_loss(
            model,
            &batch,
            &self.distill,
            LOGPROB_TEMPERATURE,
            seed,
        ))
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Signals(self.stream.cursor()), None)
    }
}
