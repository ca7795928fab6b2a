//! Teacher-signal shards: what a teacher said about each token, as Parquet (zstd), schema version 1.
//!
//! One row per scored segment (a document, or a `seq_len` window of a long one):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `doc_id` | int64 | index of the source document in the scoring job's document list |
//! | `segment` | int32 | which window of that document (0-based) |
//! | `input_ids` | list<int32> | the `n` ids scored |
//! | `target_logprobs` | list<float32> | `log p(ids[t+1] \| ids[..=t])`, `n − 1` values |
//! | `top_ids` | list<fixed_size_list<int32, k>> | the teacher's top-k ids at each of the `n − 1` positions, by descending logprob |
//! | `top_logprobs` | list<fixed_size_list<float32, k>> | their logprobs |
//! | `tail_mass` | list<float32> | `1 − Σ_k p`: the mass outside the top-k, per position |
//!
//! Position `t` is the distribution of token `t + 1`, aligned with the student's logits at `t`.
//! Logprobs are stored losslessly (float32, byte-stream-split encoded so zstd finds the exponent
//! bytes' redundancy). File metadata: `k3mini.schema_version`, `k3mini.teacher`,
//! `k3mini.tokenizer_sha256`, `k3mini.k`, `k3mini.temperature`, and `k3mini.vocab` (the teacher's
//! vocabulary size, which every id is below; optional, as older shards lack it).
//!
//! Reading verifies: the file's SHA-256 when the caller has the manifest's, the kind and schema
//! version, column types, every row's lengths, log-probabilities finite and ≤ 0, top-k masses at
//! most 1, `tail_mass` equal to what the top-k leaves, and ids below `k3mini.vocab`.

use crate::error::DataError;
use crate::parquet_io::{
    Col, Opened, column, f32s, file_err, float_lists, int_lists, topk_float_lists, topk_int_lists,
    u32s, write_atomic,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch};
use std::path::Path;
use std::sync::Arc;

pub const SCHEMA_VERSION: u32 = 1;
/// What the `k3mini.kind` metadata of a teacher-signal shard says.
pub const KIND: &str = "teacher-signals";
const WHAT: &str = "teacher shard";

/// Who made a shard and how: stored as Parquet file metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardMeta {
    pub teacher: String,
    /// SHA-256 of the tokenizer's id ↔ token table (see `Tokenizer::fingerprint`).
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
    /// The teacher's vocabulary size: every id the shard holds is below it (`k3mini.vocab`;
    /// absent in shards written before it was recorded, which are not checked for it).
    pub vocab: Option<usize>,
}

impl ShardMeta {
    /// As `k3mini.*` metadata pairs, after the file's kind and schema version.
    pub(crate) fn pairs(&self, kind: &str, version: u32) -> Vec<(&'static str, String)> {
        let mut pairs = vec![
            ("kind", kind.into()),
            ("schema_version", version.to_string()),
            ("teacher", self.teacher.clone()),
            ("tokenizer_sha256", self.tokenizer_sha256.clone()),
            ("k", self.k.to_string()),
            ("temperature", self.temperature.to_string()),
        ];
        pairs.extend(self.vocab.map(|v| ("vocab", v.to_string())));
        pairs
    }

    pub(crate) fn read(opened: &Opened, path: &Path, what: &str) -> Result<Self, DataError> {
        Ok(Self {
            teacher: opened.get(path, what, "teacher")?.into(),
            tokenizer_sha256: opened.get(path, what, "tokenizer_sha256")?.into(),
            k: opened.parse(path, what, "k")?,
            temperature: opened.parse(path, what, "temperature")?,
            vocab: match opened.meta.contains_key("vocab") {
                true => Some(opened.parse(path, what, "vocab")?),
                false => None,
            },
        })
    }

    /// Refuses ids at or past the teacher's vocabulary (a negative id stored as int32 reads as
    /// one past it too), naming the column.
    pub(crate) fn check_ids(&self, at: &str, column: &str, ids: &[u32]) -> Result<(), String> {
        let Some(vocab) = self.vocab else {
            return Ok(());
        };
        match ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            Some((j, id)) => Err(format!(
                "{at}: column {column}, entry {j}: id {} is not below the teacher's vocabulary of \
                 {vocab}",
                *id as i32
            )),
            None => Ok(()),
        }
    }
}

/// One scored segment.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardRow {
    pub doc_id: u64,
    pub segment: u32,
    pub input_ids: Vec<u32>,
    pub target_logprobs: Vec<f32>,
    /// `(n − 1) × k`, row-major.
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
}

/// `1 − Σ_k exp(logprob)` for each row of `k` top logprobs, clamped at 0: the mass outside the top-k.
/// How far above 0 a stored log-probability may be (f32 rounding of `log_softmax`).
const LOGPROB_SLACK: f32 = 1e-6;
/// How far above 1 a top-k's summed probabilities may be (f32 rounding).
const MASS_SLACK: f64 = 1e-4;

/// Refuses a value of `column` that cannot be a log-probability (NaN, infinite, above 0).
pub(crate) fn check_logprobs(at: &str, column: &str, values: &[f32]) -> Result<(), String> {
    match values
        .iter()
        .enumerate()
        .find(|(_, v)| !(v.is_finite() && **v <= LOGPROB_SLACK))
    {
        Some((j, v)) => Err(format!(
            "{at}: column {column}, entry {j}: {v} is not a log-probability (finite, ≤ 0)"
        )),
        None => Ok(()),
    }
}

pub fn tail_mass(top_logprobs: &[f32], k: usize) -> Vec<f32> {
    top_logprobs
        .chunks_exact(k)
        .map(|row| (1.0 - row.iter().map(|&l| (l as f64).exp()).sum::<f64>()).max(0.0) as f32)
        .collect()
}

impl ShardRow {
    /// Every id (the input and the teacher's top-k) below the teacher's vocabulary.
    fn check_ids(&self, meta: &ShardMeta) -> Result<(), String> {
        let at = format!("document {} segment {}", self.doc_id, self.segment);
        meta.check_ids(&at, "input_ids", &self.input_ids)?;
        meta.check_ids(&at, "top_ids", &self.top_ids)
    }

    pub fn positions(&self) -> usize {
        self.target_logprobs.len()
    }

    /// Lengths, and values that can be log-probabilities: finite, at most 0 (up to f32 rounding),
    /// and a top-k whose probabilities sum to at most 1.
    fn check(&self, k: usize) -> Result<(), String> {
        let n = self.input_ids.len();
        let p = n.saturating_sub(1);
        let at = format!("document {} segment {}", self.doc_id, self.segment);
        if n < 2
            || self.target_logprobs.len() != p
            || self.top_ids.len() != p * k
            || self.top_logprobs.len() != p * k
        {
            return Err(format!(
                "{at}: {n} ids need {p} target logprobs and {p}×{k} top-k entries, got {}, {} and {}",
                self.target_logprobs.len(),
                self.top_ids.len(),
                self.top_logprobs.len()
            ));
        }
        check_logprobs(&at, "target_logprobs", &self.target_logprobs)?;
        check_logprobs(&at, "top_logprobs", &self.top_logprobs)?;
        for (pos, top) in self.top_logprobs.chunks_exact(k).enumerate() {
            let mass: f64 = top.iter().map(|&l| (l as f64).exp()).sum();
            if mass > 1.0 + MASS_SLACK {
                return Err(format!(
                    "{at}: column top_logprobs, position {pos}: the top-{k} probabilities sum to \
                     {mass}, more than 1"
                ));
            }
        }
        Ok(())
    }
}

/// Writes a shard atomically (a temporary file renamed into place). Returns the bytes written.
pub fn write_shard(path: &Path, meta: &ShardMeta, rows: &[ShardRow]) -> Result<u64, DataError> {
    let k = meta.k;
    for r in rows {
        r.check(k)
            .and_then(|()| r.check_ids(meta))
            .map_err(|m| file_err(path, WHAT, m))?;
    }
    let tails: Vec<Vec<f32>> = rows.iter().map(|r| tail_mass(&r.top_logprobs, k)).collect();
    let batch = RecordBatch::try_from_iter([
        (
            "doc_id",
            Arc::new(Int64Array::from_iter_values(
                rows.iter().map(|r| r.doc_id as i64),
            )) as ArrayRef,
        ),
        (
            "segment",
            Arc::new(Int32Array::from_iter_values(
                rows.iter().map(|r| r.segment as i32),
            )),
        ),
        (
            "input_ids",
            int_lists(rows.iter().map(|r| &r.input_ids[..])),
        ),
        (
            "target_logprobs",
            float_lists(rows.iter().map(|r| &r.target_logprobs[..])),
        ),
        (
            "top_ids",
            topk_int_lists(rows.iter().map(|r| &r.top_ids[..]), k),
        ),
        (
            "top_logprobs",
            topk_float_lists(rows.iter().map(|r| &r.top_logprobs[..]), k),
        ),
        ("tail_mass", float_lists(tails.iter().map(Vec::as_slice))),
    ])
    .map_err(|e| file_err(path, WHAT, e))?;
    write_atomic(
        path,
        WHAT,
        &batch,
        &meta.pairs(KIND, SCHEMA_VERSION),
        &[
            &["top_logprobs", "list", "element", "item"],
            &["target_logprobs", "list", "element"],
        ],
    )
}

/// Reads and validates a shard: its checksum when `sha256` is given (the manifest's), kind,
/// schema version, metadata, column types and every row's lengths.
pub fn read_shard(
    path: &Path,
    sha256: Option<&str>,
) -> Result<(ShardMeta, Vec<ShardRow>), DataError> {
    // Shards from before `kind` existed are teacher-signal shards.
    let opened = Opened::open_versioned(path, WHAT, KIND, Some(KIND), SCHEMA_VERSION, sha256)?;
    let meta = ShardMeta::read(&opened, path, WHAT)?;
    let k = meta.k;
    opened
        .check_columns(&[
            ("doc_id", Col::Int64),
            ("segment", Col::Int32),
            ("input_ids", Col::IntList),
            ("target_logprobs", Col::FloatList),
            ("top_ids", Col::TopkInt(k)),
            ("top_logprobs", Col::TopkFloat(k)),
            ("tail_mass", Col::FloatList),
        ])
        .map_err(|m| file_err(path, WHAT, m))?;
    let mut rows = Vec::new();
    for batch in opened.batches(path, WHAT)? {
        let doc = column(&batch, "doc_id").as_primitive::<Int64Type>();
        let seg = column(&batch, "segment").as_primitive::<Int32Type>();
        let (ids, targets) = (
            column(&batch, "input_ids"),
            column(&batch, "target_logprobs"),
        );
        let (top_ids, top_lp) = (column(&batch, "top_ids"), column(&batch, "top_logprobs"));
        let tails = column(&batch, "tail_mass");
        for i in 0..batch.num_rows() {
            let row = ShardRow {
                doc_id: doc.value(i) as u64,
                segment: seg.value(i) as u32,
                input_ids: u32s(ids, i),
                target_logprobs: f32s(targets, i),
                top_ids: u32s(top_ids, i),
                top_logprobs: f32s(top_lp, i),
            };
            row.check(k)
                .and_then(|()| row.check_ids(&meta))
                .map_err(|m| file_err(path, WHAT, m))?;
            // The stored tail mass is what the top-k leaves (the writer computed it so).
            let (stored, left) = (f32s(tails, i), tail_mass(&row.top_logprobs, k));
            if stored.len() != left.len()
                || stored.iter().zip(&left).any(|(s, l)| (s - l).abs() > 1e-5)
            {
                return Err(file_err(
                    path,
                    WHAT,
                    format!(
                        "document {} segment {}: column tail_mass is not the 1 − Σp its top-{k} \
                         leaves (first values {:?}, expected {:?})",
                        row.doc_id,
                        row.segment,
                        &stored[..stored.len().min(3)],
                        &left[..left.len().min(3)]
                    ),
                ));
            }
            rows.push(row);
        }
    }
    Ok((meta, rows))
}
