//! Sequence packing with a deterministic, resumable order.
//!
//! Documents (token ids, each ending in the end-of-document id when the tokenizer has one) are
//! shuffled per epoch by a seeded Fisher–Yates permutation and laid back to back into rows of
//! `seq_len` tokens. Each row carries `starts` (1 where a document begins: the model resets its
//! KDA state and masks attention there) and a loss mask (0 where the next token starts another
//! document, so no position is trained to predict across a boundary, and 0 where the next token is
//! not a target of its document, e.g. the prompt of a chat). The whole loader state is a
//! [`Cursor`] `(epoch, document, offset)`: saving it and packing again from it reproduces the
//! batches exactly.

use crate::rng::{splitmix64, uniform};
use serde::{Deserialize, Serialize};

/// Where the loader is: the next token to emit is `offset` into the `doc`-th document of `epoch`'s
/// permutation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub doc: usize,
    pub offset: usize,
}

/// One packed batch, row-major `[rows, seq_len]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedBatch {
    pub rows: usize,
    pub seq_len: usize,
    pub tokens: Vec<i64>,
    /// 1.0 where a document begins.
    pub starts: Vec<f32>,
    /// 1.0 where position t's next-token target (t + 1) belongs to the same document and exists.
    pub loss_mask: Vec<f32>,
}

/// A tokenized document. `targets[j]` says whether token `j` is trained as a next-token target
/// (a chat's answer but not its prompt); `None` trains every token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenDoc {
    pub ids: Vec<u32>,
    pub targets: Option<Vec<bool>>,
}

impl From<Vec<u32>> for TokenDoc {
    fn from(ids: Vec<u32>) -> Self {
        Self { ids, targets: None }
    }
}

impl TokenDoc {
    /// Whether token `j` carries loss (chat documents train on the parts `data.train_on` names).
    pub fn is_target(&self, j: usize) -> bool {
        self.targets.as_ref().is_none_or(|t| t[j])
    }
}

/// The document order of `epoch`: a Fisher–Yates shuffle of `0..n` seeded by `(seed, epoch)`.
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed ^ epoch.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    for i in (1..n).rev() {
        let j = (splitmix64(&mut state) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Splits document indices `0..n` into (train, held-out): each document is held out with
/// probability `fraction` by a seeded draw, and at least one is when `fraction > 0` and `n ≥ 2`.
pub fn split_held_out(n: usize, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut state = seed ^ 0x5EED_0F_4E1D_0u64;
    let (mut train, mut held): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
    for i in 0..n {
        let u = uniform(&mut state);
        if u < fraction {
            held.push(i)
        } else {
            train.push(i)
        }
    }
    if fraction > 0.0 && held.is_empty() && train.len() >= 2 {
        held.push(train.pop().expect("two or more"));
    }
    (train, held)
}

/// Packs documents into fixed-length rows from a cursor.
#[derive(Clone, Debug)]
pub struct Packer {
    docs: std::sync::Arc<Vec<TokenDoc>>,
    seq_len: usize,
    seed: u64,
    /// Pack back to back; otherwise each row holds the head of one document, padded with `pad`.
    packing: bool,
    pad: u32,
    cursor: Cursor,
    order: Vec<usize>,
}

impl Packer {
    /// `docs` must be non-empty and every document non-empty (with one target flag per token).
    pub fn new(
        docs: std::sync::Arc<Vec<TokenDoc>>,
        seq_len: usize,
        seed: u64,
        packing: bool,
        pad: u32,
    ) -> Self {
        assert!(
            !docs.is_empty()
                && docs.iter().all(|d| !d.ids.is_empty()
                    && d.targets.as_ref().is_none_or(|t| t.len() == d.ids.len())),
            "documents must be non-empty, with one target flag per token"
        );
        assert!(seq_len >= 2, "seq_len must be at least 2");
        let order = epoch_order(docs.len(), seed, 0);
        Self {
            docs,
            seq_len,
            seed,
            packing,
            pad,
            cursor: Cursor::default(),
            order,
        }
    }

    /// Continues from a saved cursor.
    pub fn with_cursor(mut self, cursor: Cursor) -> Self {
        self.order = epoch_order(self.docs.len(), self.seed, cursor.epoch);
        self.cursor = cursor;
        self
    }

    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    fn advance_doc(&mut self) {
        self.cursor.doc += 1;
        self.cursor.offset = 0;
        if self.cursor.doc == self.docs.len() {
            self.cursor.epoch += 1;
            self.cursor.doc = 0;
            self.order = epoch_order(self.docs.len(), self.seed, self.cursor.epoch);
        }
    }

    /// The next `rows` rows.
    pub fn next_batch(&mut self, rows: usize) -> PackedBatch {
        let t = self.seq_len;
        let mut tokens = Vec::with_capacity(rows * t);
        let mut starts = Vec::with_capacity(rows * t);
        let mut loss_mask = Vec::with_capacity(rows * t);
        for _ in 0..rows {
            let row_start = tokens.len();
            while tokens.len() - row_start < t {
                let doc = &self.docs[self.order[self.cursor.doc]];
                let len = doc.ids.len();
                let take = (len - self.cursor.offset).min(t - (tokens.len() - row_start));
                for (i, &id) in doc.ids[self.cursor.offset..self.cursor.offset + take]
                    .iter()
                    .enumerate()
                {
                    tokens.push(id as i64);
                    let j = self.cursor.offset + i;
                    starts.push(if j == 0 { 1.0 } else { 0.0 });
                    // The last token of a document has no same-document target.
                    let trained = j + 1 < len && doc.is_target(j + 1);
                    loss_mask.push(if trained { 1.0 } else { 0.0 });
                }
                self.cursor.offset += take;
                if self.cursor.offset == len {
                    self.advance_doc();
                } else if !self.packing {
                    // One document per row: the rest of this document is dropped.
                    self.advance_doc();
                }
                if !self.packing {
                    let pad = t - (tokens.len() - row_start);
                    tokens.extend(std::iter::repeat_n(self.pad as i64, pad));
                    starts.extend(std::iter::repeat_n(0.0, pad));
                    loss_mask.extend(std::iter::repeat_n(0.0, pad));
                }
            }
            // The row's last position predicts a token outside the row.
            loss_mask[row_start + t - 1] = 0.0;
        }
        PackedBatch {
            rows,
            seq_len: t,
            tokens,
            starts,
            loss_mask,
        }
    }
}
