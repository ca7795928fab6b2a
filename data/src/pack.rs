//! Sequence packing with a deterministic, resumable order.
//!
//! Documents (token ids, each ending in the end-of-document id when the tokenizer has one) come
//! from a [`DocFeed`] (a [`crate::stream::DocStream`] in training) and are laid back to back into
//! rows of `seq_len` tokens. Each row carries `starts` (1 where a document begins: the model
//! resets its KDA state and masks attention there) and a loss mask (0 where the next token starts
//! another document, so no position is trained to predict across a boundary, and 0 where the next
//! token is not a target of its document, e.g. the prompt of a chat). The packer's state is a
//! [`PackCursor`]: the feed's cursor at the current document and the offset into it; reopening the
//! feed there and packing again reproduces the batches exactly.

use crate::error::DataError;
use crate::rng::{splitmix64, uniform};
use serde::{Deserialize, Serialize};

/// Where a [`Packer`] is: the feed's cursor at the document being packed, and the next token's
/// offset into it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackCursor<C> {
    pub feed: C,
    pub offset: usize,
}

/// A source of documents for a [`Packer`].
pub trait DocFeed {
    type Cursor: Clone;
    /// The cursor from which a reopened feed yields the next document again.
    fn cursor(&self) -> Self::Cursor;
    /// The next document (non-empty, one target flag per token when it has flags).
    fn next_doc(&mut self) -> Result<TokenDoc, DataError>;
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
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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

    /// The tokens it trains as targets: every one but the first, less a chat's untrained parts.
    pub fn trained_tokens(&self) -> usize {
        (1..self.ids.len()).filter(|&j| self.is_target(j)).count()
    }

    /// Keeps the first `n` tokens: what a row without packing holds of it.
    pub fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
        if let Some(t) = &mut self.targets {
            t.truncate(n);
        }
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

/// Packs a feed's documents into fixed-length rows.
pub struct Packer<F: DocFeed> {
    feed: F,
    seq_len: usize,
    /// Pack back to back; otherwise each row holds the head of one document, padded with `pad`.
    packing: bool,
    pad: u32,
    /// The document being packed, the feed's cursor before it, and the offset into it.
    doc: TokenDoc,
    at: F::Cursor,
    offset: usize,
}

impl<F: DocFeed> Packer<F> {
    /// Packs `feed` from its next document (at `offset` into it when resuming a [`PackCursor`],
    /// the feed reopened at its `feed` cursor).
    pub fn new(
        mut feed: F,
        seq_len: usize,
        packing: bool,
        pad: u32,
        offset: usize,
    ) -> Result<Self, DataError> {
        assert!(seq_len >= 2, "seq_len must be at least 2");
        let at = feed.cursor();
        let doc = Self::checked(feed.next_doc()?);
        if offset >= doc.ids.len() {
            return Err(DataError::Io {
                path: "(data cursor)".into(),
                message: format!(
                    "offset {offset} is past its document of {} tokens: the corpus changed since \
                     the checkpoint",
                    doc.ids.len()
                ),
            });
        }
        Ok(Self {
            feed,
            seq_len,
            packing,
            pad,
            doc,
            at,
            offset,
        })
    }

    fn checked(doc: TokenDoc) -> TokenDoc {
        assert!(
            !doc.ids.is_empty()
                && doc
                    .targets
                    .as_ref()
                    .is_none_or(|t| t.len() == doc.ids.len()),
            "documents must be non-empty, with one target flag per token"
        );
        doc
    }

    pub fn cursor(&self) -> PackCursor<F::Cursor> {
        PackCursor {
            feed: self.at.clone(),
            offset: self.offset,
        }
    }

    pub fn feed(&self) -> &F {
        &self.feed
    }

    fn advance_doc(&mut self) -> Result<(), DataError> {
        self.at = self.feed.cursor();
        self.doc = Self::checked(self.feed.next_doc()?);
        self.offset = 0;
        Ok(())
    }

    /// The next `rows` rows.
    pub fn next_batch(&mut self, rows: usize) -> Result<PackedBatch, DataError> {
        let t = self.seq_len;
        let mut tokens = Vec::with_capacity(rows * t);
        let mut starts = Vec::with_capacity(rows * t);
        let mut loss_mask = Vec::with_capacity(rows * t);
        for _ in 0..rows {
            let row_start = tokens.len();
            while tokens.len() - row_start < t {
                let doc = &self.doc;
                let len = doc.ids.len();
                let take = (len - self.offset).min(t - (tokens.len() - row_start));
                for (i, &id) in doc.ids[self.offset..self.offset + take].iter().enumerate() {
                    tokens.push(id as i64);
                    let j = self.offset + i;
                    starts.push(if j == 0 { 1.0 } else { 0.0 });
                    // The last token of a document has no same-document target.
                    let trained = j + 1 < len && doc.is_target(j + 1);
                    loss_mask.push(if trained { 1.0 } else { 0.0 });
                }
                self.offset += take;
                // Without packing one document fills a row: the rest of it is dropped.
                if self.offset == len || !self.packing {
                    self.advance_doc()?;
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
        Ok(PackedBatch {
            rows,
            seq_len: t,
            tokens,
            starts,
            loss_mask,
        })
    }
}
