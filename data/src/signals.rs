//! Training batches from teacher-signal shards: one scored segment per row, padded to `seq_len`.
//!
//! The order is a function of the seed and a [`SignalCursor`] `(epoch, shard, row)`: each epoch
//! visits the shards in a seeded permutation and each shard's rows in another, so a resumed run sees
//! exactly the batches an uninterrupted one would. While a shard is consumed the next one is read on
//! a background thread, so the trainer does not wait on disk. Which rows train and which are held
//! out is decided by their document (`keep(doc_id)`).
//!
//! Position `t` of a row predicts token `t + 1`: it carries the teacher's top-k for that token and a
//! mask of 1 while `t + 1` is inside the segment. Padding positions carry a harmless uniform top-k
//! (ids 0, logprobs `ln(1/k)`) under a zero mask, so every loss stays finite. Teacher ids outside the
//! student's vocabulary (a padded teacher vocabulary) are given logprob −10⁴: their mass goes to the
//! tail bucket, where a token the student cannot produce belongs.

use crate::error::DataError;
use crate::pack::epoch_order;
use crate::shards::{ShardMeta, ShardRow, read_shard};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Logprob given to teacher ids the student's vocabulary lacks (`exp` of it is 0 in f32).
pub const OUT_OF_VOCAB_LOGPROB: f32 = -1.0e4;

/// Where a [`SignalStream`] is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalCursor {
    pub epoch: u64,
    /// Position in the epoch's shard order.
    pub shard: usize,
    /// Position in that shard's row order.
    pub row: usize,
}

/// `[rows, seq_len]` tokens and mask, `[rows, seq_len, k]` teacher top-k, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct SignalBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub k: usize,
    pub tokens: Vec<i64>,
    pub loss_mask: Vec<f32>,
    pub top_ids: Vec<i64>,
    pub top_logprobs: Vec<f32>,
}

/// Lays `rows` out as a batch (see the module doc for padding and out-of-vocabulary ids).
pub fn assemble(rows: &[&ShardRow], seq_len: usize, k: usize, vocab: usize) -> SignalBatch {
    let t = seq_len;
    let mut b = SignalBatch {
        rows: rows.len(),
        seq_len: t,
        k,
        tokens: vec![0; rows.len() * t],
        loss_mask: vec![0.0; rows.len() * t],
        top_ids: vec![0; rows.len() * t * k],
        top_logprobs: vec![-(k as f32).ln(); rows.len() * t * k],
    };
    for (r, row) in rows.iter().enumerate() {
        for (i, &id) in row.input_ids.iter().enumerate() {
            b.tokens[r * t + i] = id as i64;
        }
        for pos in 0..row.positions() {
            b.loss_mask[r * t + pos] = 1.0;
            for j in 0..k {
                let (src, dst) = (pos * k + j, (r * t + pos) * k + j);
                let id = row.top_ids[src];
                let in_vocab = (id as usize) < vocab;
                b.top_ids[dst] = if in_vocab { id as i64 } else { 0 };
                b.top_logprobs[dst] = if in_vocab {
                    row.top_logprobs[src]
                } else {
                    OUT_OF_VOCAB_LOGPROB
                };
            }
        }
    }
    b
}

/// What a stream expects of every shard it reads.
#[derive(Clone, Debug)]
pub struct SignalSpec {
    pub seq_len: usize,
    pub k: usize,
    /// The student's vocabulary size.
    pub vocab: usize,
    /// The student tokenizer's fingerprint: shards made with another tokenizer are refused.
    pub tokenizer_sha256: String,
}

impl SignalSpec {
    /// Reads a shard, keeping the rows whose document `keep` accepts, after checking its metadata.
    pub fn read(
        &self,
        path: &std::path::Path,
        keep: &(dyn Fn(u64) -> bool + Send + Sync),
    ) -> Result<Vec<ShardRow>, DataError> {
        let (meta, rows) = read_shard(path)?;
        self.check(path, &meta)?;
        // Rows stride by the shard's k; from here on by ours.
        let mut kept = Vec::new();
        for row in rows {
            if row.input_ids.len() > self.seq_len {
                return Err(DataError::io(
                    path,
                    format!(
                        "document {} segment {} has {} ids, more than seq_len {}",
                        row.doc_id,
                        row.segment,
                        row.input_ids.len(),
                        self.seq_len
                    ),
                ));
            }
            if keep(row.doc_id) {
                kept.push(top_prefix(row, meta.k, self.k));
            }
        }
        Ok(kept)
    }

    fn check(&self, path: &std::path::Path, meta: &ShardMeta) -> Result<(), DataError> {
        if meta.tokenizer_sha256 != self.tokenizer_sha256 {
            return Err(DataError::io(
                path,
                "made with another tokenizer than the student's (fingerprints differ): the teacher's \
                 ids would mean other tokens",
            ));
        }
        if meta.k < self.k {
            return Err(DataError::io(
                path,
                format!(
                    "holds top-{} signals; the recipe asks for k = {}",
                    meta.k, self.k
                ),
            ));
        }
        Ok(())
    }
}

type Keep = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// An endless, resumable stream of [`SignalBatch`]es over a set of shards.
pub struct SignalStream {
    files: Arc<Vec<PathBuf>>,
    spec: Arc<SignalSpec>,
    keep: Keep,
    seed: u64,
    cursor: SignalCursor,
    /// The rows of the shard at `cursor.shard`, in this epoch's row order.
    current: Vec<ShardRow>,
    next: Option<JoinHandle<Result<Vec<ShardRow>, DataError>>>,
}

impl SignalStream {
    /// A stream over `files` (shards in index order) from `cursor`. Fails if a shard is unreadable
    /// or mismatched, or if no shard holds a row `keep` accepts.
    pub fn new(
        files: Vec<PathBuf>,
        spec: SignalSpec,
        keep: Keep,
        seed: u64,
        cursor: SignalCursor,
    ) -> Result<Self, DataError> {
        if files.is_empty() {
            return Err(DataError::Empty {
                path: PathBuf::from("(no teacher shards)"),
            });
        }
        let mut s = Self {
            files: Arc::new(files),
            spec: Arc::new(spec),
            keep,
            seed,
            cursor,
            current: Vec::new(),
            next: None,
        };
        // Find the first shard with rows, starting at the cursor (at most one full pass).
        for _ in 0..=s.files.len() {
            s.current = s.load(s.cursor)?;
            if s.cursor.row < s.current.len() {
                s.prefetch();
                return Ok(s);
            }
            s.step_shard();
        }
        Err(DataError::io(
            &s.files[0],
            "no shard holds a training row (every document is held out?)",
        ))
    }

    pub fn cursor(&self) -> SignalCursor {
        self.cursor
    }

    /// The rows of the shard at `at`, in `at.epoch`'s row order.
    fn load(&self, at: SignalCursor) -> Result<Vec<ShardRow>, DataError> {
        let order = epoch_order(self.files.len(), self.seed, at.epoch);
        let index = order[at.shard];
        let rows = self.spec.read(&self.files[index], self.keep.as_ref())?;
        Ok(permute(rows, self.seed, at.epoch, index))
    }

    /// Starts reading the shard after the current one.
    fn prefetch(&mut self) {
        let mut at = self.cursor;
        at.shard += 1;
        if at.shard == self.files.len() {
            at = SignalCursor {
                epoch: at.epoch + 1,
                shard: 0,
                row: 0,
            };
        }
        let (files, spec, keep, seed) = (
            self.files.clone(),
            self.spec.clone(),
            self.keep.clone(),
            self.seed,
        );
        self.next = Some(std::thread::spawn(move || {
            let order = epoch_order(files.len(), seed, at.epoch);
            let index = order[at.shard];
            let rows = spec.read(&files[index], keep.as_ref())?;
            Ok(permute(rows, seed, at.epoch, index))
        }));
    }

    fn step_shard(&mut self) {
        self.cursor.shard += 1;
        self.cursor.row = 0;
        if self.cursor.shard == self.files.len() {
            self.cursor.epoch += 1;
            self.cursor.shard = 0;
        }
    }

    /// The next `rows` rows as a batch.
    pub fn next_batch(&mut self, rows: usize) -> Result<SignalBatch, DataError> {
        let mut picked = Vec::with_capacity(rows);
        while picked.len() < rows {
            if self.cursor.row < self.current.len() {
                picked.push(self.current[self.cursor.row].clone());
                self.cursor.row += 1;
                continue;
            }
            self.step_shard();
            self.current = match self.next.take() {
                Some(handle) => handle.join().expect("the shard reader does not panic")?,
                None => self.load(self.cursor)?,
            };
            self.prefetch();
        }
        let refs: Vec<&ShardRow> = picked.iter().collect();
        Ok(assemble(
            &refs,
            self.spec.seq_len,
            self.spec.k,
            self.spec.vocab,
        ))
    }
}

/// A row's signals cut from the top-`from` to the top-`to` (rows are sorted by logprob).
fn top_prefix(mut row: ShardRow, from: usize, to: usize) -> ShardRow {
    if from != to {
        let cut = |v: &[u32]| {
            v.chunks_exact(from)
                .flat_map(|c| &c[..to])
                .copied()
                .collect()
        };
        row.top_ids = cut(&row.top_ids);
        row.top_logprobs = row
            .top_logprobs
            .chunks_exact(from)
            .flat_map(|c| &c[..to])
            .copied()
            .collect();
    }
    row
}

/// `rows` in the seeded order of `(epoch, shard index)`.
fn permute(rows: Vec<ShardRow>, seed: u64, epoch: u64, index: usize) -> Vec<ShardRow> {
    let order = epoch_order(
        rows.len(),
        seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
        epoch,
    );
    let mut slots: Vec<Option<ShardRow>> = rows.into_iter().map(Some).collect();
    order
        .into_iter()
        .map(|i| slots[i].take().expect("a permutation"))
        .collect()
}
