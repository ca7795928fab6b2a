//! Online distillation: the teacher (local, or served over HTTP) scores each micro-batch while the
//! student trains on the one before, so nothing is stored and the two overlap.
//!
//! The rows are the corpus's documents, streamed as plain training streams them (weighted,
//! shuffled in blocks, the held-out split hashed per document), cut into `seq_len` segments as
//! `k3mini teacher score` cuts them. The stream's whole state is a [`PackCursor`]: the document
//! stream's cursor at the current document and the offset of its next segment, so a resumed run
//! asks the teacher for exactly the batches an uninterrupted one would have.

use crate::error::Result;
use crate::recipe::{DistillPlan, RunPlan};
use crate::run_dir::DataCursor;
use crate::train::distill::distill_job;
use crate::train::held_out::HeldOut;
use crate::train::objective::{Job, StepModel, TrainingObjective};
use k3mini_data::pack::{DocFeed, PackCursor};
use k3mini_data::signals::{SignalBatch, SignalCursor, SignalRow, assemble};
use k3mini_data::stream::{DocStream, Split, StreamCursor};
use k3mini_data::{TokenDoc, Tokenizer};
use k3mini_student::head::HeadChunks;
use k3mini_teacher::score::score_many;
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
    pub ids: Vec<u32>,
    pub targets: Vec<bool>,
}

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
        .map(|(seg, s)| SignalRow {
            doc: 0,
            targets: seg.targets.clone(),
            ids: s.ids,
            top_ids: s.top_ids,
            top_logprobs: s.top_logprobs,
            routing: None,
            chunks: None,
        })
        .collect();
    let refs: Vec<&SignalRow> = rows.iter().collect();
    Ok(assemble(&refs, spec.seq_len, spec.k, spec.vocab))
}

/// A document stream cut into segments: windows of at most `seq_len` ids, at least two each.
pub struct SegmentFeed {
    docs: DocStream,
    seq_len: usize,
    /// The document being cut, the stream's cursor before it, and its next segment's offset.
    doc: TokenDoc,
    at: StreamCursor,
    offset: usize,
}

impl SegmentFeed {
    /// Cuts `docs` from its next document, at `offset` into it (a resumed [`PackCursor`]'s).
    pub fn new(mut docs: DocStream, seq_len: usize, offset: usize) -> Result<Self> {
        let at = docs.cursor();
        let doc = docs.next_doc()?;
        crate::ensure!(
            offset == 0 || offset + 2 <= doc.ids.len(),
            "the run's data cursor is at offset {offset} of a document of {} tokens: the corpus \
             changed since the checkpoint",
            doc.ids.len()
        );
        Ok(Self {
            docs,
            seq_len,
            doc,
            at,
            offset,
        })
    }

    pub fn cursor(&self) -> PackCursor<StreamCursor> {
        PackCursor {
            feed: self.at.clone(),
            offset: self.offset,
        }
    }

    /// The next segment.
    pub fn next_segment(&mut self) -> Result<Segment> {
        while self.offset + 2 > self.doc.ids.len() {
            self.at = self.docs.cursor();
            self.doc = self.docs.next_doc()?;
            self.offset = 0;
        }
        let (start, end) = (
            self.offset,
            (self.offset + self.seq_len).min(self.doc.ids.len()),
        );
        self.offset = end;
        Ok(Segment {
            ids: self.doc.ids[start..end].to_vec(),
            targets: (start + 1..end).map(|j| self.doc.is_target(j)).collect(),
        })
    }

    fn take(&mut self, n: usize) -> Result<Vec<Segment>> {
        (0..n).map(|_| self.next_segment()).collect()
    }
}

/// What the scoring thread hands back: the feed, where it is after the batch, and the batch.
type Scoring = JoinHandle<(SegmentFeed, PackCursor<StreamCursor>, Result<SignalBatch>)>;

/// An endless stream of teacher-scored batches, one always being read and scored ahead.
pub struct OnlineStream {
    teacher: Arc<dyn Teacher + Send + Sync>,
    spec: Arc<OnlineSpec>,
    rows: usize,
    /// Where the batch being scored begins.
    cursor: PackCursor<StreamCursor>,
    next: Option<Scoring>,
}

impl OnlineStream {
    pub fn new(
        teacher: Arc<dyn Teacher + Send + Sync>,
        feed: SegmentFeed,
        spec: OnlineSpec,
        rows: usize,
    ) -> Self {
        let mut s = Self {
            teacher,
            spec: Arc::new(spec),
            rows,
            cursor: feed.cursor(),
            next: None,
        };
        s.prefetch(feed);
        s
    }

    pub fn cursor(&self) -> PackCursor<StreamCursor> {
        self.cursor.clone()
    }

    /// Starts reading and scoring the batch at the feed's position.
    fn prefetch(&mut self, mut feed: SegmentFeed) {
        let (teacher, spec, rows) = (self.teacher.clone(), self.spec.clone(), self.rows);
        self.next = Some(std::thread::spawn(move || {
            let batch = feed
                .take(rows)
                .and_then(|segments| score_batch(teacher.as_ref(), &segments, &spec));
            let after = feed.cursor();
            (feed, after, batch)
        }));
    }

    /// The scored batch at the cursor; the one after it starts scoring before this returns.
    pub fn next_batch(&mut self) -> Result<SignalBatch> {
        let handle = self.next.take().expect("a batch is always being scored");
        let (feed, after, batch) = handle
            .join()
            .map_err(|_| crate::refused!("the teacher thread panicked"))?;
        let batch = batch?;
        self.cursor = after;
        self.prefetch(feed);
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

/// The plan's `split` segments from `cursor`.
fn plan_segments(
    plan: &RunPlan,
    tokenizer: &Tokenizer,
    split: Split,
    cursor: PackCursor<StreamCursor>,
) -> Result<SegmentFeed> {
    let docs =
        crate::corpus::document_stream(&plan.data, tokenizer, plan.seed, split, cursor.feed)?;
    SegmentFeed::new(docs, plan.data.seq_len, cursor.offset)
}

/// An online run's held-out set, as its training evaluates it: the first `n` micro-batches of
/// held-out segments, scored by `teacher` (none when the plan holds nothing out).
pub fn held_out(
    plan: &RunPlan,
    distill: &DistillPlan,
    teacher: &dyn Teacher,
    tokenizer: &Tokenizer,
    n: usize,
) -> Result<HeldOut> {
    let mut batches = Vec::new();
    if plan.data.holds_out() {
        let mut held = plan_segments(plan, tokenizer, Split::HeldOut, PackCursor::default())?;
        let spec = OnlineSpec::of(plan, distill);
        for _ in 0..n {
            let segments = held.take(plan.train.micro_batch)?;
            batches.push(score_batch(teacher, &segments, &spec)?);
        }
    }
    Ok(HeldOut::Signals {
        batches,
        temperature: LOGPROB_TEMPERATURE,
    })
}

/// Online distillation: the teacher scores the next micro-batch while the student trains.
pub struct Online {
    stream: OnlineStream,
    distill: DistillPlan,
    chunks: HeadChunks,
    held: HeldOut,
}

impl Online {
    pub fn open(
        plan: &RunPlan,
        distill: &DistillPlan,
        tokenizer: &Tokenizer,
        cursor: PackCursor<StreamCursor>,
    ) -> Result<Self> {
        let teacher = crate::teachers::plan_teacher(distill, &plan.devices, tokenizer, None)?;
        let held = held_out(
            plan,
            distill,
            teacher.as_ref(),
            tokenizer,
            plan.train.eval_batches,
        )?;
        let train = plan_segments(plan, tokenizer, Split::Train, cursor)?;
        let spec = OnlineSpec::of(plan, distill);
        Ok(Self {
            stream: OnlineStream::new(teacher, train, spec, plan.train.micro_batch),
            distill: distill.clone(),
            chunks: plan.head_chunks(),
            held,
        })
    }
}

impl TrainingObjective for Online {
    fn next(&mut self, _student: &StepModel, seed: u64) -> Result<Job> {
        let batch = self.stream.next_batch()?;
        Ok(distill_job(
            batch,
            &self.distill,
            LOGPROB_TEMPERATURE,
            self.chunks,
            seed,
        ))
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Stream(self.stream.cursor()), None)
    }
}
