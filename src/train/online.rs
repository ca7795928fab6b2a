//! Online distillation: the teacher (local, or served over HTTP) scores each micro-batch while the
//! student trains on the one before, so nothing is stored and the two overlap.
//!
//! The rows are the recipe's documents cut into `seq_len` segments (as `k3mini teacher score` cuts
//! them); each epoch takes the training segments in a seeded permutation, and the stream's whole
//! state is a cursor `(epoch, row)`, so a resumed run asks the teacher for exactly the batches an
//! uninterrupted one would have.

use anyhow::Result;
use k3mini_data::TokenDoc;
use k3mini_data::pack::split_held_out;
use k3mini_data::shards::ShardRow;
use k3mini_data::signals::{SignalBatch, SignalCursor, SignalRow, assemble, take_in_epoch_order};
use k3mini_teacher::Teacher;
use k3mini_teacher::score::{score_many, segments};
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
        anyhow::ensure!(
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
            .map_err(|_| anyhow::anyhow!("the teacher thread panicked"))??;
        self.cursor = after;
        self.prefetch();
        Ok(batch)
    }
}
