//! Teacher-signal shards: what a teacher said about each token, as Parquet (zstd). This is the
//! one description of their schema; [`crate::topk_codec`] holds the v2 codec's arithmetic.
//!
//! One row per scored segment (a document, or a `seq_len` window of a long one) of `n` ids and
//! `n − 1` positions; position `t` is the distribution of token `t + 1`, aligned with the
//! student's logits at `t`, its top-k sorted by descending logprob.
//!
//! **Schema version 2** (compact; what `teacher score` writes unless `teacher.logprob_step = 0`):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `doc_id` | int64 | the source document's key (`k3mini_data::stream::doc_key`, as two's complement): what the held-out split hashes |
//! | `segment` | int32 | which window of that document (0-based) |
//! | `input_ids` | list<int32> | the `n` ids scored |
//! | `tail_mass` | list<float32> | `1 − Σ_k p` per position, exact: the top-k mass `P` |
//! | `top_ids` | binary | `(n − 1)·k` LEB128 varints: each id's index in the id table, or `T + id` for an id the table of `T` lacks (lossless) |
//! | `top_logprobs` | binary | per position `k − 1` varints `c_j − c_{j−1}`, `c_j = round((ℓ_0 − ℓ_j)/s)` |
//! | `target_logprobs` | list<float32> | `log p(ids[t+1])` for the positions whose next id is *not* in the top-k, in order |
//! | `parts` | binary, optional | what each of the `n` ids is in its conversation (one byte each: 0 markup, 1 prompt, 2 thinking, 3 answer); empty for a text document, every position of which trains; absent when no row is a conversation |
//!
//! Metadata beyond v1's: `k3mini.logprob_step` (`s`, nats) and `k3mini.id_table` (base64 of a
//! varint count and the file's most frequent ids, at most 2048, most frequent first). A reader rebuilds `ℓ'_j = L − s c_j` with `L`
//! chosen so the top-k mass is exactly `P`: every logprob within `s` of the teacher's, the tail
//! bucket exact. Where the next id is in the top-k its target logprob is that entry's.
//!
//! **Schema version 1** (exact; still read, and written when `teacher.logprob_step = 0`):
//! `doc_id`, `segment`, `input_ids` as above; `target_logprobs` list<float32> (all `n − 1`);
//! `top_ids` list<fixed_size_list<int32, k>>; `top_logprobs` list<fixed_size_list<float32, k>>
//! (byte-stream-split so zstd finds the exponent bytes' redundancy); `tail_mass` and `parts` as
//! above.
//!
//! Both: file metadata `k3mini.kind`, `k3mini.schema_version`, `k3mini.teacher`,
//! `k3mini.tokenizer_sha256`, `k3mini.k`, `k3mini.temperature`, and `k3mini.vocab` (the teacher's
//! vocabulary size, which every id is below, at most [`MAX_VOCAB`]; v2 always records it, v1
//! shards from before it was recorded lack it).
//!
//! Reading verifies: the file's SHA-256 when the caller has the manifest's, the kind and schema
//! version, column types, every row's lengths (every varint stream exactly consumed), ids below
//! `k3mini.vocab` and no id twice in a position's top-k (checked before the target logprobs are
//! matched to the ids, so damaged ids are named as such), an id table without repeats,
//! log-probabilities finite and ≤ 0, top-k masses at most 1, and (v1) `tail_mass` equal to what
//! the top-k leaves.

use crate::chat::Part;
use crate::error::DataError;
use crate::parquet_io::{
    Col, Opened, column, f32s, file_err, float_lists, int_lists, segment_columns, topk_float_lists,
    topk_int_lists, u32s, write_parquet,
};
use crate::tokenizer::MAX_VOCAB;
use crate::topk_codec::{self, ID_TABLE_MAX, IdTable};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{ArrayRef, BinaryArray, RecordBatch};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use std::path::Path;
use std::sync::Arc;

/// The compact schema (quantised logprobs, coded ids).
pub const SCHEMA_VERSION: u32 = 2;
/// The exact schema (f32 logprobs, int32 ids).
pub const EXACT_SCHEMA_VERSION: u32 = 1;
/// The logprob step `teacher score` stores at by default (nats): every logprob within 1/32 of the
/// teacher's; measured KL(exact ‖ stored) ≈ 1.4e-5 nats per token at k = 50 (see the README).
pub const DEFAULT_LOGPROB_STEP: f32 = 1.0 / 32.0;
/// What the `k3mini.kind` metadata of a teacher-signal shard says.
pub const KIND: &str = "teacher-signals";
const WHAT: &str = "teacher shard";

/// How a shard stores its top-k logprobs; in recipes and plans, its step in nats (`0` = exact).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(into = "f32", try_from = "f32")]
pub enum Storage {
    /// Schema v1: f32 logprobs, int32 ids.
    Exact,
    /// Schema v2: logprobs as offsets of `step` nats below the best (each within `step` of the
    /// teacher's, the top-k mass exact), ids coded losslessly.
    Quantised { step: f32 },
}

impl Storage {
    /// `0` → exact; a positive step → quantised. `None` for a negative or non-finite step.
    pub fn from_step(step: f32) -> Option<Self> {
        match step {
            0.0 => Some(Self::Exact),
            s if s > 0.0 && s.is_finite() => Some(Self::Quantised { step: s }),
            _ => None,
        }
    }

    /// The logprob step in nats (0 when exact).
    pub fn step(self) -> f32 {
        match self {
            Self::Exact => 0.0,
            Self::Quantised { step } => step,
        }
    }

    /// The schema version of shards stored this way.
    pub fn version(self) -> u32 {
        match self {
            Self::Exact => EXACT_SCHEMA_VERSION,
            Self::Quantised { .. } => SCHEMA_VERSION,
        }
    }
}

impl From<Storage> for f32 {
    fn from(s: Storage) -> f32 {
        s.step()
    }
}

impl TryFrom<f32> for Storage {
    type Error = String;
    fn try_from(step: f32) -> Result<Self, String> {
        Self::from_step(step).ok_or_else(|| {
            format!("{step} is not a logprob step: 0 (exact) or a positive number of nats")
        })
    }
}

/// A shard as read: who made it, how it stores logprobs, its rows (logprobs decoded).
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    pub meta: ShardMeta,
    pub storage: Storage,
    pub rows: Vec<ShardRow>,
}

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
        let k: usize = opened.parse(path, what, "k")?;
        if k == 0 {
            return Err(file_err(
                path,
                what,
                "k3mini.k is 0: a top-k holds at least one id",
            ));
        }
        let vocab: Option<usize> = match opened.meta.contains_key("vocab") {
            true => Some(opened.parse(path, what, "vocab")?),
            false => None,
        };
        if let Some(v) = vocab.filter(|v| !(1..=MAX_VOCAB).contains(v)) {
            return Err(file_err(
                path,
                what,
                format!(
                    "k3mini.vocab {v} is no tokenizer's vocabulary (k3mini reads 1 to {MAX_VOCAB} ids)"
                ),
            ));
        }
        Ok(Self {
            teacher: opened.get(path, what, "teacher")?.into(),
            tokenizer_sha256: opened.get(path, what, "tokenizer_sha256")?.into(),
            k,
            temperature: opened.parse(path, what, "temperature")?,
            vocab,
        })
    }

    /// Refuses ids at or past the teacher's vocabulary (a negative id stored as int32 reads as
    /// one past it too, and is printed as the unsigned number it is), naming the column.
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
                "{at}: column {column}, entry {j}: id {id} is not below the teacher's vocabulary \
                 of {vocab}"
            )),
            None => Ok(()),
        }
    }
}

/// One scored segment.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardRow {
    /// The source document's key (`k3mini_data::stream::doc_key`).
    pub doc_id: u64,
    pub segment: u32,
    pub input_ids: Vec<u32>,
    /// What each id is in its conversation (`None`: a text document, every position trains).
    pub parts: Option<Vec<Part>>,
    pub target_logprobs: Vec<f32>,
    /// `(n − 1) × k`, row-major.
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
}

/// `1 − Σ_k exp(logprob)` for each row of `k` top logprobs, clamped at 0: the mass outside the top-k.
/// How far above 0 a stored log-probability may be (f32 rounding of `log_softmax`).
pub(crate) const LOGPROB_SLACK: f32 = 1e-6;
/// How far above 1 a top-k's summed probabilities may be (f32 rounding).
pub(crate) const MASS_SLACK: f64 = 1e-4;

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

/// Refuses a position whose top-k holds an id twice: a teacher's top-k are k distinct tokens, so
/// the ids are damaged.
fn distinct_top_ids(at: &str, top_ids: &[u32], k: usize) -> Result<(), String> {
    let mut sorted = Vec::with_capacity(k);
    for (t, ids) in top_ids.chunks(k).enumerate() {
        sorted.clear();
        sorted.extend_from_slice(ids);
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "{at}: column top_ids, position {t}: id {} appears twice in the top-{k}: the ids \
                 are damaged",
                w[0]
            ));
        }
    }
    Ok(())
}

pub fn tail_mass(top_logprobs: &[f32], k: usize) -> Vec<f32> {
    top_logprobs
        .chunks_exact(k)
        .map(|row| (1.0 - row.iter().map(|&l| (l as f64).exp()).sum::<f64>()).max(0.0) as f32)
        .collect()
}

impl ShardRow {
    /// Every id (the input and the teacher's top-k) below the teacher's vocabulary, and no id
    /// twice in one position's top-k.
    fn check_ids(&self, meta: &ShardMeta) -> Result<(), String> {
        let at = format!("document {} segment {}", self.doc_id, self.segment);
        meta.check_ids(&at, "input_ids", &self.input_ids)?;
        meta.check_ids(&at, "top_ids", &self.top_ids)?;
        distinct_top_ids(&at, &self.top_ids, meta.k)
    }

    pub fn positions(&self) -> usize {
        self.target_logprobs.len()
    }

    /// The row cut into segments of at most `len` ids (`len` ≥ 2; top-k `k` wide), numbered
    /// from 0, each with how many of its leading positions are context only. Every position is
    /// trained in exactly one segment; a segment after the first starts `(len − 1) / 2` ids
    /// before its first trained position, so what it trains on keeps context the teacher saw.
    pub fn windows(self, len: usize, k: usize) -> Vec<(ShardRow, usize)> {
        let n = self.input_ids.len();
        if n <= len {
            return vec![(self, 0)];
        }
        let len = len.max(2);
        let ctx = (len - 1) / 2;
        let mut out = Vec::new();
        let mut a = 0;
        while a + 1 < n {
            let start = if a == 0 { 0 } else { a - ctx };
            let end = (start + len).min(n);
            let b = end - 1;
            out.push((
                ShardRow {
                    doc_id: self.doc_id,
                    segment: out.len() as u32,
                    input_ids: self.input_ids[start..end].to_vec(),
                    parts: self.parts.as_ref().map(|p| p[start..end].to_vec()),
                    target_logprobs: self.target_logprobs[start..b].to_vec(),
                    top_ids: self.top_ids[start * k..b * k].to_vec(),
                    top_logprobs: self.top_logprobs[start * k..b * k].to_vec(),
                },
                a - start,
            ));
            a = b;
        }
        out
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
        if let Some(parts) = self.parts.as_ref().filter(|p| p.len() != n) {
            return Err(format!("{at}: {} parts for {n} ids", parts.len()));
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
pub fn write_shard(
    path: &Path,
    meta: &ShardMeta,
    storage: Storage,
    rows: &[ShardRow],
) -> Result<u64, DataError> {
    let k = meta.k;
    if k == 0 {
        return Err(file_err(
            path,
            WHAT,
            "k is 0: a top-k holds at least one id",
        ));
    }
    for r in rows {
        r.check(k)
            .and_then(|()| r.check_ids(meta))
            .map_err(|m| file_err(path, WHAT, m))?;
    }
    let step = match storage {
        Storage::Exact => return write_exact(path, meta, rows),
        Storage::Quantised { step } => step,
    };
    if meta.vocab.is_none() {
        return Err(file_err(
            path,
            WHAT,
            "a compact (v2) shard must record the teacher's vocabulary (k3mini.vocab) and none \
             was given: shards from before it was recorded convert to the exact schema only",
        ));
    }
    let mut sorted = rows.to_vec();
    for r in &mut sorted {
        for (ids, lps) in r.top_ids.chunks_mut(k).zip(r.top_logprobs.chunks_mut(k)) {
            topk_codec::sort_best_first(ids, lps);
        }
    }
    let table = IdTable::build(sorted.iter().map(|r| &r.top_ids[..]), ID_TABLE_MAX);
    let mut top_ids = Vec::with_capacity(sorted.len());
    let mut top_lps = Vec::with_capacity(sorted.len());
    let mut outside = Vec::with_capacity(sorted.len());
    for r in &sorted {
        let mut ids = Vec::new();
        for &id in &r.top_ids {
            let code = table.code(id).ok_or_else(|| {
                let at = format!("document {} segment {}", r.doc_id, r.segment);
                file_err(
                    path,
                    WHAT,
                    format!("{at}: id {id} is too large for any vocabulary"),
                )
            })?;
            topk_codec::put_varint(&mut ids, code);
        }
        let mut lps = Vec::new();
        r.top_logprobs
            .chunks_exact(k)
            .for_each(|l| topk_codec::put_logprobs(&mut lps, l, step));
        top_ids.push(ids);
        top_lps.push(lps);
        outside.push(
            (0..r.positions())
                .filter(|&t| !r.top_ids[t * k..(t + 1) * k].contains(&r.input_ids[t + 1]))
                .map(|t| r.target_logprobs[t])
                .collect::<Vec<f32>>(),
        );
    }
    let tails: Vec<Vec<f32>> = sorted
        .iter()
        .map(|r| tail_mass(&r.top_logprobs, k))
        .collect();
    let blobs = |b: &[Vec<u8>]| Arc::new(BinaryArray::from_iter_values(b)) as ArrayRef;
    let batch = record_batch(
        path,
        rows,
        vec![
            ("tail_mass", float_lists(tails.iter().map(Vec::as_slice))),
            ("top_ids", blobs(&top_ids)),
            ("top_logprobs", blobs(&top_lps)),
            (
                "target_logprobs",
                float_lists(outside.iter().map(Vec::as_slice)),
            ),
        ],
    )?;
    let mut pairs = meta.pairs(KIND, SCHEMA_VERSION);
    pairs.push(("logprob_step", step.to_string()));
    pairs.push((
        "id_table",
        BASE64.encode(topk_codec::put_counted(table.ids())),
    ));
    write_parquet(
        path,
        WHAT,
        &batch,
        &pairs,
        &[
            &["tail_mass", "list", "element"],
            &["target_logprobs", "list", "element"],
        ],
        &["top_ids", "top_logprobs"],
    )
}

/// The `parts` column's byte for each part (its index here).
const PART_CODES: [Part; 4] = [Part::Markup, Part::Prompt, Part::Thinking, Part::Answer];

/// The optional `parts` column, when a row is a conversation.
pub(crate) fn parts_column<'a>(
    parts: impl Iterator<Item = Option<&'a [Part]>> + Clone,
) -> Option<(&'static str, ArrayRef)> {
    parts.clone().any(|p| p.is_some()).then(|| {
        let code = |p: &Part| PART_CODES.iter().position(|c| c == p).expect("a part") as u8;
        let bytes = parts.map(|p| p.iter().copied().flatten().map(code).collect::<Vec<u8>>());
        let array: ArrayRef = Arc::new(BinaryArray::from_iter_values(bytes));
        ("parts", array)
    })
}

/// Row `i`'s parts from the `parts` column of `batch` (when the file has one), checked to cover
/// its `n` ids.
pub(crate) fn read_parts(
    batch: &RecordBatch,
    i: usize,
    n: usize,
) -> Result<Option<Vec<Part>>, String> {
    let Some(column) = batch.column_by_name("parts") else {
        return Ok(None);
    };
    let bytes = column.as_binary::<i32>().value(i);
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.len() != n {
        return Err(format!("column parts: {} entries for {n} ids", bytes.len()));
    }
    bytes
        .iter()
        .map(|&b| {
            PART_CODES
                .get(b as usize)
                .copied()
                .ok_or_else(|| format!("column parts: {b} is not a part's code"))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// A batch of the columns both schemas begin with ([`SEGMENT_COLUMNS`]), then the schema's own
/// `columns`, then `parts` when a row has them.
fn record_batch(
    path: &Path,
    rows: &[ShardRow],
    columns: Vec<(&'static str, ArrayRef)>,
) -> Result<RecordBatch, DataError> {
    let ids = (
        "input_ids",
        int_lists(rows.iter().map(|r| &r.input_ids[..])),
    );
    let parts = parts_column(rows.iter().map(|r| r.parts.as_deref()));
    RecordBatch::try_from_iter(
        segment_columns(rows.iter().map(|r| (r.doc_id, r.segment)))
            .into_iter()
            .chain([ids])
            .chain(columns)
            .chain(parts),
    )
    .map_err(|e| file_err(path, WHAT, e))
}

/// Schema v1 (rows already checked).
fn write_exact(path: &Path, meta: &ShardMeta, rows: &[ShardRow]) -> Result<u64, DataError> {
    let k = meta.k;
    let tails: Vec<Vec<f32>> = rows.iter().map(|r| tail_mass(&r.top_logprobs, k)).collect();
    let batch = record_batch(
        path,
        rows,
        vec![
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
        ],
    )?;
    write_parquet(
        path,
        WHAT,
        &batch,
        &meta.pairs(KIND, EXACT_SCHEMA_VERSION),
        &[
            &["top_logprobs", "list", "element", "item"],
            &["target_logprobs", "list", "element"],
        ],
        &[],
    )
}

/// Reads and validates a shard of either schema: its checksum when `sha256` is given (the
/// manifest's), kind, schema version, metadata, column types and every row.
pub fn read_shard(path: &Path, sha256: Option<&str>) -> Result<Shard, DataError> {
    // Shards from before `kind` existed are teacher-signal shards.
    let (opened, version) = Opened::open_versioned(
        path,
        WHAT,
        KIND,
        Some(KIND),
        &[EXACT_SCHEMA_VERSION, SCHEMA_VERSION],
        sha256,
    )?;
    let meta = ShardMeta::read(&opened, path, WHAT)?;
    if version == SCHEMA_VERSION && meta.vocab.is_none() {
        return Err(file_err(
            path,
            WHAT,
            "has no k3mini.vocab, which every compact (v2) shard records: it is damaged or not \
             written by k3mini",
        ));
    }
    let (storage, rows) = if version == EXACT_SCHEMA_VERSION {
        (Storage::Exact, read_exact(opened, path, &meta)?)
    } else {
        let step: f32 = opened.parse(path, WHAT, "logprob_step")?;
        let storage = Storage::from_step(step)
            .filter(|s| *s != Storage::Exact)
            .ok_or_else(|| {
                file_err(
                    path,
                    WHAT,
                    format!("k3mini.logprob_step {step} is not a positive step"),
                )
            })?;
        let table = BASE64
            .decode(opened.get(path, WHAT, "id_table")?)
            .map_err(|e| e.to_string())
            .and_then(|b| topk_codec::get_counted(&b))
            .and_then(IdTable::from_ids)
            .map_err(|e| file_err(path, WHAT, format!("k3mini.id_table: {e}")))?;
        (storage, read_quantised(opened, path, &meta, step, &table)?)
    };
    Ok(Shard {
        meta,
        storage,
        rows,
    })
}

/// The columns both schemas begin with: which segment a row is, and its ids.
const SEGMENT_COLUMNS: [(&str, Col); 3] = [
    ("doc_id", Col::Int64),
    ("segment", Col::Int32),
    ("input_ids", Col::IntList),
];

/// The rows of a v1 shard.
fn read_exact(opened: Opened, path: &Path, meta: &ShardMeta) -> Result<Vec<ShardRow>, DataError> {
    let k = meta.k;
    opened
        .check_columns(
            &[
                &SEGMENT_COLUMNS[..],
                &[
                    ("target_logprobs", Col::FloatList),
                    ("top_ids", Col::TopkInt(k)),
                    ("top_logprobs", Col::TopkFloat(k)),
                    ("tail_mass", Col::FloatList),
                ],
            ]
            .concat(),
        )
        .map_err(|m| file_err(path, WHAT, m))?;
    opened
        .has_column("parts", Col::Binary)
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
            let input_ids = u32s(ids, i);
            let (doc_id, segment) = (doc.value(i) as u64, seg.value(i) as u32);
            let at = format!("document {doc_id} segment {segment}");
            let row = ShardRow {
                doc_id,
                segment,
                parts: read_parts(&batch, i, input_ids.len())
                    .map_err(|m| file_err(path, WHAT, format!("{at}: {m}")))?,
                input_ids,
                target_logprobs: f32s(targets, i),
                top_ids: u32s(top_ids, i),
                top_logprobs: f32s(top_lp, i),
            };
            row.check(k)
                .and_then(|()| row.check_ids(meta))
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
    Ok(rows)
}

/// The rows of a v2 shard, decoded (see the module doc).
fn read_quantised(
    opened: Opened,
    path: &Path,
    meta: &ShardMeta,
    step: f32,
    table: &IdTable,
) -> Result<Vec<ShardRow>, DataError> {
    let k = meta.k;
    opened
        .check_columns(
            &[
                &SEGMENT_COLUMNS[..],
                &[
                    ("tail_mass", Col::FloatList),
                    ("top_ids", Col::Binary),
                    ("top_logprobs", Col::Binary),
                    ("target_logprobs", Col::FloatList),
                ],
            ]
            .concat(),
        )
        .map_err(|m| file_err(path, WHAT, m))?;
    opened
        .has_column("parts", Col::Binary)
        .map_err(|m| file_err(path, WHAT, m))?;
    let mut rows = Vec::new();
    for batch in opened.batches(path, WHAT)? {
        let doc = column(&batch, "doc_id").as_primitive::<Int64Type>();
        let seg = column(&batch, "segment").as_primitive::<Int32Type>();
        let (ids, tails) = (column(&batch, "input_ids"), column(&batch, "tail_mass"));
        let (top_ids, top_lp) = (
            column(&batch, "top_ids").as_binary::<i32>(),
            column(&batch, "top_logprobs").as_binary::<i32>(),
        );
        let outside = column(&batch, "target_logprobs");
        for i in 0..batch.num_rows() {
            let (doc_id, segment) = (doc.value(i) as u64, seg.value(i) as u32);
            let at = format!("document {doc_id} segment {segment}");
            let decode = || -> Result<ShardRow, String> {
                let input_ids = u32s(ids, i);
                let tail = f32s(tails, i);
                let p = tail.len();
                if input_ids.len() != p + 1 || p == 0 {
                    return Err(format!(
                        "{at}: {} ids need {} tail masses, got {p}",
                        input_ids.len(),
                        input_ids.len().saturating_sub(1)
                    ));
                }
                let at = at.as_str();
                let column_err =
                    |c: &'static str| move |e: String| format!("{at}: column {c}: {e}");
                let top_ids: Vec<u32> = topk_codec::get_varints(top_ids.value(i), p * k)
                    .map_err(column_err("top_ids"))?
                    .into_iter()
                    .map(|code| table.id(code))
                    .collect();
                // Damaged ids would otherwise show as a target-logprob count that disagrees.
                meta.check_ids(at, "input_ids", &input_ids)?;
                meta.check_ids(at, "top_ids", &top_ids)?;
                distinct_top_ids(at, &top_ids, k)?;
                let increments = topk_codec::get_varints(top_lp.value(i), p * (k - 1))
                    .map_err(column_err("top_logprobs"))?;
                let mut top_logprobs = Vec::with_capacity(p * k);
                for (t, &tail) in tail.iter().enumerate() {
                    if !(0.0..1.0).contains(&tail) {
                        return Err(format!(
                            "{at}: column tail_mass, position {t}: {tail} is not a tail mass in [0, 1)"
                        ));
                    }
                    let inc = &increments[t * (k - 1)..(t + 1) * (k - 1)];
                    top_logprobs.extend(topk_codec::logprobs_from(inc, 1.0 - tail as f64, step));
                }
                let mut outside_lp = f32s(outside, i).into_iter();
                let mut target_logprobs = Vec::with_capacity(p);
                for t in 0..p {
                    let top = &top_ids[t * k..(t + 1) * k];
                    let lp = match top.iter().position(|&id| id == input_ids[t + 1]) {
                        Some(j) => top_logprobs[t * k + j],
                        None => outside_lp.next().ok_or_else(|| {
                            format!(
                                "{at}: column target_logprobs has too few values for the \
                                 positions whose next id is outside the top-{k} (from position \
                                 {t}): it or the ids are damaged"
                            )
                        })?,
                    };
                    target_logprobs.push(lp);
                }
                if outside_lp.next().is_some() {
                    return Err(format!("{at}: column target_logprobs has values left over"));
                }
                let row = ShardRow {
                    doc_id,
                    segment,
                    parts: read_parts(&batch, i, input_ids.len())
                        .map_err(|m| format!("{at}: {m}"))?,
                    input_ids,
                    target_logprobs,
                    top_ids,
                    top_logprobs,
                };
                row.check(k)?;
                Ok(row)
            };
            rows.push(decode().map_err(|m| file_err(path, WHAT, m))?);
        }
    }
    Ok(rows)
}

/// The compressed bytes of each top-level column of a shard (summed over row groups), and of the
/// file's metadata footer: where a shard's size goes.
pub fn column_bytes(path: &Path) -> Result<Vec<(String, u64)>, DataError> {
    let opened = Opened::open(path, WHAT, None)?;
    let meta = opened.builder.metadata();
    let mut by_column: Vec<(String, u64)> = Vec::new();
    for rg in meta.row_groups() {
        for c in rg.columns() {
            let name = c.column_path().parts()[0].clone();
            let bytes = c.compressed_size().max(0) as u64;
            match by_column.iter_mut().find(|(n, _)| *n == name) {
                Some((_, b)) => *b += bytes,
                None => by_column.push((name, bytes)),
            }
        }
    }
    let file = std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len();
    let columns: u64 = by_column.iter().map(|(_, b)| b).sum();
    by_column.push(("(footer and metadata)".into(), file.saturating_sub(columns)));
    Ok(by_column)
}
