//! Training batches from teacher shards, one [`SignalRow`] per batch row, padded to `seq_len`:
//! a scored segment (teacher-signal shards: every position is a target), or a prompt and the
//! teacher's completion (trajectory shards: only completion positions are targets, and of those
//! the parts `data.train_on` names; the completion's top-k are the teacher's signals there).
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

use crate::align::{ChunkSignals, merge_projected};
use crate::aligned::{AlignedRow, read_aligned_shard};
use crate::chat::{LossParts, ThinkingEnd};
use crate::error::DataError;
use crate::pack::epoch_order;
use crate::routing::{Routing, RoutingRow, RoutingShape, read_routing_shard};
use crate::shards::{Shard, ShardMeta, ShardRow, read_shard};
use crate::trajectories::{TrajectoryRow, read_trajectories};
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

/// The next `rows` of `0..n` in seeded per-epoch order from `at` (wrapping into new epochs),
/// advancing `at` past them: how the online and on-policy streams walk their items.
pub fn take_in_epoch_order(n: usize, seed: u64, at: &mut SignalCursor, rows: usize) -> Vec<usize> {
    assert!(n > 0, "nothing to take from");
    let mut order = epoch_order(n, seed, at.epoch);
    let mut out = Vec::with_capacity(rows);
    while out.len() < rows {
        if at.row >= n {
            at.epoch += 1;
            at.row = 0;
            order = epoch_order(n, seed, at.epoch);
        }
        out.push(order[at.row]);
        at.row += 1;
    }
    out
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
    /// Per row, the teacher's routing of its `n − 1` scored positions, when the stream reads the
    /// routing shards (router distillation).
    pub routing: Vec<Option<Routing>>,
    /// Cross-tokenizer batches: `[rows, seq_len]`, 1 where the top-k is the teacher's projected
    /// onto the student's vocabulary (a chunk's first position, and a target); `None`: the
    /// top-k is the teacher's wherever the loss mask is 1.
    pub teacher_mask: Option<Vec<f32>>,
    /// Cross-tokenizer batches: the chunks whose positions are all targets.
    pub chunks: Vec<BatchChunk>,
}

/// A chunk of a cross-tokenizer batch: positions `[first, last]` of `row` predict its tokens
/// (position `t` predicts token `t + 1`), whose bytes the teacher gives log-likelihood `logprob`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchChunk {
    pub row: usize,
    pub first: usize,
    pub last: usize,
    pub logprob: f32,
}

/// One training row: `n` ids and, at each of the `n − 1` positions, whether it is a target and the
/// teacher's top-k there (`(n − 1) × k`, anything where it is not a target).
#[derive(Clone, Debug, PartialEq)]
pub struct SignalRow {
    /// The document (segment source or prompt) it belongs to, for the held-out split.
    pub doc: u64,
    pub ids: Vec<u32>,
    pub targets: Vec<bool>,
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
    /// The teacher's routing of the `n − 1` positions (scored segments, when read).
    pub routing: Option<Routing>,
    /// A cross-tokenizer row's chunks; its top-k holds their projected top-k at each chunk's
    /// first position (`start − 1`) and a placeholder elsewhere.
    pub chunks: Option<Vec<ChunkSignals>>,
}

impl SignalRow {
    /// A scored segment, its top-k cut from the shard's `from` to `to`: every position of a text
    /// document trains; in a conversation, those whose next token is a part `train_on` names.
    pub fn from_scores(row: ShardRow, from: usize, to: usize, train_on: &LossParts) -> Self {
        let targets = match &row.parts {
            None => vec![true; row.positions()],
            Some(parts) => parts[1..].iter().map(|&p| train_on.trains(p)).collect(),
        };
        Self {
            doc: row.doc_id,
            targets,
            top_ids: top_prefix(&row.top_ids, from, to),
            top_logprobs: top_prefix(&row.top_logprobs, from, to),
            ids: row.input_ids,
            routing: None,
            chunks: None,
        }
    }

    /// A cross-tokenizer segment: targets as [`Self::from_scores`]; at each chunk's first
    /// position the first `k` entries of its projected top-k merged into distinct student ids
    /// ([`merge_projected`]), padded with ids of no teacher mass; a placeholder elsewhere.
    pub fn from_aligned(row: AlignedRow, k: usize, train_on: &LossParts) -> Self {
        let n = row.input_ids.len();
        let targets = match &row.parts {
            None => vec![true; n - 1],
            Some(parts) => parts[1..].iter().map(|&p| train_on.trains(p)).collect(),
        };
        let mut top_ids: Vec<u32> = (0..n - 1).flat_map(|_| 0..k as u32).collect();
        let mut top_logprobs = vec![-(k as f32).ln(); (n - 1) * k];
        for c in &row.chunks {
            let at = (c.start as usize - 1) * k;
            let merged = merge_projected(&c.top_ids[..k], &c.top_logprobs[..k]);
            let used: Vec<u32> = merged.iter().map(|m| m.0).collect();
            let pads = (0u32..).filter(|id| !used.contains(id));
            let entries = merged
                .into_iter()
                .chain(pads.map(|id| (id, OUT_OF_VOCAB_LOGPROB)))
                .take(k);
            for (j, (id, l)) in entries.enumerate() {
                top_ids[at + j] = id;
                top_logprobs[at + j] = l;
            }
        }
        Self {
            doc: row.doc_id,
            ids: row.input_ids,
            targets,
            top_ids,
            top_logprobs,
            routing: None,
            chunks: Some(row.chunks),
        }
    }

    /// Prompt `doc`'s trajectory, cut to `seq_len` ids: prompt positions never train; completion
    /// tokens are thinking or answer as `thinking_end` tells them apart (all answer without one),
    /// and `train_on` picks which of the two train. `None` when no completion token fits.
    pub fn from_trajectory(
        row: TrajectoryRow,
        doc: u64,
        from: usize,
        to: usize,
        seq_len: usize,
        thinking_end: Option<&ThinkingEnd>,
        train_on: &LossParts,
    ) -> Option<Self> {
        let p = row.prompt_ids.len();
        let n = (p + row.completion_ids.len()).min(seq_len);
        if n <= p || p == 0 {
            return None;
        }
        let completion = &row.completion_ids[..n - p];
        let thinking_until = thinking_end.map_or(0, |t| t.thinking_len(completion));
        let mut targets = vec![false; p - 1];
        targets.extend((0..n - p).map(|j| {
            let part = if j < thinking_until {
                crate::chat::Part::Thinking
            } else {
                crate::chat::Part::Answer
            };
            train_on.trains(part)
        }));
        // Prompt positions get a placeholder top-k (never read: not targets).
        let mut top_ids = vec![0; (p - 1) * to];
        let mut top_logprobs = vec![-(to as f32).ln(); (p - 1) * to];
        top_ids.extend(top_prefix(&row.top_ids[..(n - p) * from], from, to));
        top_logprobs.extend(top_prefix(&row.top_logprobs[..(n - p) * from], from, to));
        let mut ids = row.prompt_ids;
        ids.extend(completion);
        Some(Self {
            doc,
            ids,
            targets,
            top_ids,
            top_logprobs,
            routing: None,
            chunks: None,
        })
    }
}

/// Lays `rows` out as a batch (see the module doc for padding and out-of-vocabulary ids).
pub fn assemble(rows: &[&SignalRow], seq_len: usize, k: usize, vocab: usize) -> SignalBatch {
    let t = seq_len;
    let mut b = SignalBatch {
        rows: rows.len(),
        seq_len: t,
        k,
        tokens: vec![0; rows.len() * t],
        loss_mask: vec![0.0; rows.len() * t],
        top_ids: vec![0; rows.len() * t * k],
        top_logprobs: vec![-(k as f32).ln(); rows.len() * t * k],
        routing: rows.iter().map(|r| r.routing.clone()).collect(),
        teacher_mask: rows
            .iter()
            .any(|r| r.chunks.is_some())
            .then(|| vec![0.0; rows.len() * t]),
        chunks: Vec::new(),
    };
    for (r, row) in rows.iter().enumerate() {
        for c in row.chunks.iter().flatten() {
            let (first, last) = (c.start as usize - 1, c.end as usize - 2);
            if !row.targets[first..=last].iter().all(|&x| x) {
                continue; // a chunk part of which does not train
            }
            // A chunk start whose projected top-k is all tail (nothing mapped: its first entry is
            // a pad) has no teacher distribution over the student's ids to learn or agree with.
            if let Some(m) = &mut b.teacher_mask
                && row.top_logprobs[first * k] > OUT_OF_VOCAB_LOGPROB
            {
                m[r * t + first] = 1.0;
            }
            b.chunks.push(BatchChunk {
                row: r,
                first,
                last,
                logprob: c.logprob,
            });
        }
        for (i, &id) in row.ids.iter().enumerate() {
            b.tokens[r * t + i] = id as i64;
        }
        for (pos, _) in row.targets.iter().enumerate().filter(|(_, t)| **t) {
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

/// The most ids a teacher may have over a tokenizer of `tokens` ids: its embedding padded by up to
/// 1/32 more rows, rounded up to a multiple of 1,024 (Qwen2.5 puts 151,665 tokens in 151,936 rows,
/// DeepSeek-V2 100,015 in 102,400). Teacher ids past the tokenizer's are padding rows, which no
/// text holds; ids past the student's vocabulary go to the tail bucket (see the module doc).
pub fn padded_vocab_bound(tokens: usize) -> usize {
    (tokens + tokens / 32).next_multiple_of(1024)
}

/// Which kind of shard a stream reads.
#[derive(Clone, Debug, PartialEq)]
pub enum SignalSource {
    /// Teacher-signal shards (`k3mini teacher score`); conversations train on `train_on`.
    Scores { train_on: LossParts },
    /// Teacher-signal shards of a gateway's escalated requests (`k3mini agent serve
    /// --traffic`): read as scores, a request longer than `seq_len` cut into segments with
    /// context ([`ShardRow::windows`]), segments with no target dropped.
    Traffic { train_on: LossParts },
    /// Cross-tokenizer shards (`k3mini teacher score` with a teacher of another vocabulary):
    /// chunks and projected top-k ([`crate::aligned`]); conversations train on `train_on`.
    Aligned { train_on: LossParts },
    /// Trajectory shards (`k3mini teacher generate`): sequence-level distillation.
    Trajectories {
        thinking_end: Option<ThinkingEnd>,
        train_on: LossParts,
    },
}

/// A shard file, the job index of its first row (trajectory rows are numbered by prompt) and the
/// SHA-256 its manifest records, which the file must still have when it is read.
#[derive(Clone, Debug)]
pub struct ShardFile {
    pub path: PathBuf,
    pub first: u64,
    pub sha256: String,
    /// Its routing shard and that one's SHA-256 (`teacher score` with routing).
    pub routing: Option<(PathBuf, String)>,
}

/// What a stream expects of every shard it reads.
#[derive(Clone, Debug)]
pub struct SignalSpec {
    pub source: SignalSource,
    pub seq_len: usize,
    pub k: usize,
    /// The student's vocabulary size.
    pub vocab: usize,
    /// The student tokenizer's ids: a shard's teacher vocabulary may exceed them by padding
    /// only ([`padded_vocab_bound`]).
    pub tokens: usize,
    /// The student tokenizer's fingerprint: shards made with another tokenizer are refused.
    pub tokenizer_sha256: String,
    /// Read each scored shard's routing shard too, refusing one whose teacher routing is not this.
    pub routing: Option<RoutingShape>,
}

impl SignalSpec {
    /// Reads a shard, keeping the rows whose document `keep` accepts, after checking its metadata.
    pub fn read(
        &self,
        file: &ShardFile,
        keep: &(dyn Fn(u64) -> bool + Send + Sync),
    ) -> Result<Vec<SignalRow>, DataError> {
        let path = &file.path;
        match &self.source {
            SignalSource::Scores { train_on } => {
                let Shard { meta, rows, .. } = read_shard(path, Some(&file.sha256))?;
                self.check(path, &meta)?;
                let mut routing = self.read_routing(file, rows.len())?.map(Vec::into_iter);
                let mut kept = Vec::new();
                for row in rows {
                    let row_routing = match &mut routing {
                        Some(it) => Some(aligned(path, &row, it.next())?),
                        None => None,
                    };
                    self.check_len(path, row.doc_id, row.segment, row.input_ids.len())?;
                    if keep(row.doc_id) {
                        kept.push(SignalRow {
                            routing: row_routing,
                            ..SignalRow::from_scores(row, meta.k, self.k, train_on)
                        });
                    }
                }
                Ok(kept)
            }
            SignalSource::Traffic { train_on } => {
                let Shard { meta, rows, .. } = read_shard(path, Some(&file.sha256))?;
                self.check(path, &meta)?;
                Ok(rows
                    .into_iter()
                    .filter(|row| keep(row.doc_id))
                    .flat_map(|row| row.windows(self.seq_len, meta.k))
                    .filter_map(|(row, context)| {
                        let mut r = SignalRow::from_scores(row, meta.k, self.k, train_on);
                        r.targets[..context].fill(false);
                        // A segment with nothing to learn (all prompt) only fills a batch.
                        r.targets.contains(&true).then_some(r)
                    })
                    .collect())
            }
            SignalSource::Aligned { train_on } => {
                let (meta, rows) = read_aligned_shard(path, Some(&file.sha256))?;
                self.check(path, &meta.signals)?;
                let mut kept = Vec::new();
                for row in rows {
                    self.check_len(path, row.doc_id, row.segment, row.input_ids.len())?;
                    if keep(row.doc_id) {
                        kept.push(SignalRow::from_aligned(row, self.k, train_on));
                    }
                }
                Ok(kept)
            }
            SignalSource::Trajectories {
                thinking_end,
                train_on,
            } => {
                let (meta, rows) = read_trajectories(path, Some(&file.sha256))?;
                self.check(path, &meta.signals)?;
                Ok(rows
                    .into_iter()
                    .zip(file.first..)
                    .filter(|(_, doc)| keep(*doc))
                    .filter_map(|(row, doc)| {
                        let (from, to) = (meta.signals.k, self.k);
                        SignalRow::from_trajectory(
                            row,
                            doc,
                            from,
                            to,
                            self.seq_len,
                            thinking_end.as_ref(),
                            train_on,
                        )
                    })
                    .collect())
            }
        }
    }

    /// The routing shard's rows, when this spec reads routing: verified by checksum, against the
    /// expected teacher routing, and to hold one row per signal row.
    fn read_routing(
        &self,
        file: &ShardFile,
        rows: usize,
    ) -> Result<Option<Vec<RoutingRow>>, DataError> {
        let Some(shape) = &self.routing else {
            return Ok(None);
        };
        let Some((path, sha)) = &file.routing else {
            return Err(DataError::io(
                &file.path,
                "has no routing shard beside it: score with teacher.routing = true",
            ));
        };
        let shard = read_routing_shard(path, Some(sha))?;
        if shard.meta.shape != *shape {
            return Err(DataError::io(
                path,
                format!(
                    "holds the routing of a teacher shaped {:?}; the run expects {:?}",
                    shard.meta.shape, shape
                ),
            ));
        }
        if shard.rows.len() != rows {
            return Err(DataError::io(
                path,
                format!("has {} rows; its signal shard has {rows}", shard.rows.len()),
            ));
        }
        Ok(Some(shard.rows))
    }

    /// A scored segment fits a row of `seq_len` (the job scored `seq_len`-id windows).
    fn check_len(
        &self,
        path: &std::path::Path,
        doc: u64,
        segment: u32,
        n: usize,
    ) -> Result<(), DataError> {
        match n > self.seq_len {
            true => Err(DataError::io(
                path,
                format!(
                    "document {doc} segment {segment} has {n} ids, more than seq_len {}",
                    self.seq_len
                ),
            )),
            false => Ok(()),
        }
    }

    fn check(&self, path: &std::path::Path, meta: &ShardMeta) -> Result<(), DataError> {
        if meta.tokenizer_sha256 != self.tokenizer_sha256 {
            return Err(DataError::io(
                path,
                "made with another tokenizer than the student's (fingerprints differ): the teacher's \
                 ids would mean other tokens",
            ));
        }
        if let Some(v) = meta.vocab.filter(|&v| v > padded_vocab_bound(self.tokens)) {
            return Err(DataError::io(
                path,
                format!(
                    "records a teacher vocabulary of {v} ids, more than the tokenizer's {} padded \
                     to {}: the ids past the tokenizer's are no tokens, and this many is no padding",
                    self.tokens,
                    padded_vocab_bound(self.tokens)
                ),
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

/// A signal row's routing row: the same segment, covering its `n − 1` scored positions.
fn aligned(
    path: &std::path::Path,
    row: &ShardRow,
    routing: Option<RoutingRow>,
) -> Result<Routing, DataError> {
    let r = routing.expect("row counts were matched");
    if (r.doc_id, r.segment) != (row.doc_id, row.segment) || r.routing.tokens() != row.positions() {
        return Err(DataError::io(
            path,
            format!(
                "routing row for document {} segment {} ({} tokens) does not match signal row \
                 document {} segment {} ({} positions)",
                r.doc_id,
                r.segment,
                r.routing.tokens(),
                row.doc_id,
                row.segment,
                row.positions()
            ),
        ));
    }
    Ok(r.routing)
}

type Keep = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// An endless, resumable stream of [`SignalBatch`]es over a set of shards.
pub struct SignalStream {
    files: Arc<Vec<ShardFile>>,
    spec: Arc<SignalSpec>,
    keep: Keep,
    seed: u64,
    cursor: SignalCursor,
    /// The rows of the shard at `cursor.shard`, in this epoch's row order.
    current: Vec<SignalRow>,
    next: Option<JoinHandle<Result<Vec<SignalRow>, DataError>>>,
}

impl SignalStream {
    /// A stream over `files` (shards in index order) from `cursor`. Fails if a shard is unreadable
    /// or mismatched, or if no shard holds a row `keep` accepts.
    pub fn new(
        files: Vec<ShardFile>,
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
        if cursor.shard >= files.len() {
            let dir = files[0]
                .path
                .parent()
                .unwrap_or(&files[0].path)
                .to_path_buf();
            return Err(DataError::io(
                &dir,
                format!(
                    "the run's data cursor is at shard {} (epoch {}), but there are {} shards: \
                     they were rescored since the checkpoint was written, or its state.json is \
                     damaged. Resume with the shards it trained on, or start a new run",
                    cursor.shard,
                    cursor.epoch,
                    files.len()
                ),
            ));
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
            &s.files[0].path,
            "no shard holds a training row (every document is held out?)",
        ))
    }

    pub fn cursor(&self) -> SignalCursor {
        self.cursor
    }

    /// The rows of the shard at `at`, in `at.epoch`'s row order.
    fn load(&self, at: SignalCursor) -> Result<Vec<SignalRow>, DataError> {
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
        self.advance(rows, |row| picked.push(row.clone()))?;
        let refs: Vec<&SignalRow> = picked.iter().collect();
        Ok(assemble(
            &refs,
            self.spec.seq_len,
            self.spec.k,
            self.spec.vocab,
        ))
    }

    /// Moves past the next `rows` rows without copying or assembling them: another rank's
    /// micro-batch. (Shards are read whole either way: their rows are shuffled.)
    pub fn skip_batch(&mut self, rows: usize) -> Result<(), DataError> {
        self.advance(rows, |_| ())
    }

    /// Hands the next `rows` rows to `visit` in order, reading on into the next shards.
    fn advance(&mut self, rows: usize, mut visit: impl FnMut(&SignalRow)) -> Result<(), DataError> {
        for _ in 0..rows {
            while self.cursor.row >= self.current.len() {
                self.step_shard();
                self.current = match self.next.take() {
                    Some(handle) => handle.join().expect("the shard reader does not panic")?,
                    None => self.load(self.cursor)?,
                };
                self.prefetch();
            }
            visit(&self.current[self.cursor.row]);
            self.cursor.row += 1;
        }
        Ok(())
    }
}

/// Rows of `from` values (top-k lists, best first) cut to their first `to`.
fn top_prefix<T: Copy>(rows: &[T], from: usize, to: usize) -> Vec<T> {
    rows.chunks_exact(from)
        .flat_map(|c| &c[..to])
        .copied()
        .collect()
}

/// `rows` in the seeded order of `(epoch, shard index)`.
fn permute(rows: Vec<SignalRow>, seed: u64, epoch: u64, index: usize) -> Vec<SignalRow> {
    let order = epoch_order(
        rows.len(),
        seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407),
        epoch,
    );
    let mut slots: Vec<Option<SignalRow>> = rows.into_iter().map(Some).collect();
    order
        .into_iter()
        .map(|i| slots[i].take().expect("a permutation"))
        .collect()
}
