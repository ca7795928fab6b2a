//! Cross-tokenizer teacher-signal shards: what a teacher with another vocabulary said about each
//! scored segment, already aligned to the student's tokens ([`crate::align`]), so training needs
//! neither tokenizer nor the corpus. Parquet (zstd), one row per segment:
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `doc_id`, `segment`, `input_ids`, `parts` | as teacher-signal shards ([`crate::shards`]) | the segment in the *student's* ids |
//! | `chunk_bounds` | list<int32> | two per chunk: its first student token and one past its last (`1 ≤ start < end ≤ n`, chunks in order, disjoint) |
//! | `chunk_logprobs` | list<float32> | per chunk, the teacher's log-likelihood of its bytes |
//! | `top_ids` | list<fixed_size_list<int32, k>> | per chunk, the teacher's top-k at its first position, each projected onto a student id (−1: none, the tail) |
//! | `top_logprobs` | list<fixed_size_list<float32, k>> | those entries' teacher logprobs, descending |
//!
//! Metadata: as teacher-signal shards (`k3mini.tokenizer_sha256` the student's, `k3mini.vocab` the
//! student's vocabulary, which every id is below), kind `aligned-signals`, schema version 1, and
//! `k3mini.teacher_tokenizer_sha256`. Reading verifies the checksum, kind, version, column types,
//! every row's lengths, chunk bounds, ids, and log-probabilities (finite, ≤ 0, a top-k mass ≤ 1).

use crate::align::{ChunkSignals, UNMAPPED};
use crate::chat::Part;
use crate::error::DataError;
use crate::parquet_io::{
    Col, Opened, column, f32s, file_err, float_lists, int_lists, segment_columns, topk_float_lists,
    topk_int_lists, u32s, write_parquet,
};
use crate::shards::{MASS_SLACK, ShardMeta, check_logprobs, parts_column, read_parts};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{ArrayRef, RecordBatch};
use std::path::Path;

pub const KIND: &str = "aligned-signals";
pub const SCHEMA_VERSION: u32 = 1;
const WHAT: &str = "cross-tokenizer shard";

/// Who made an aligned shard: the teacher-signal metadata (the student's tokenizer and
/// vocabulary) and the teacher's tokenizer.
#[derive(Clone, Debug, PartialEq)]
pub struct AlignedMeta {
    pub signals: ShardMeta,
    pub teacher_tokenizer_sha256: String,
}

/// One scored segment, in the student's ids, with its chunks' teacher signals.
#[derive(Clone, Debug, PartialEq)]
pub struct AlignedRow {
    pub doc_id: u64,
    pub segment: u32,
    pub input_ids: Vec<u32>,
    pub parts: Option<Vec<Part>>,
    pub chunks: Vec<ChunkSignals>,
}

impl AlignedRow {
    /// Lengths, bounds, ids and log-probabilities, as the module doc says.
    fn check(&self, meta: &AlignedMeta) -> Result<(), String> {
        let (n, k) = (self.input_ids.len(), meta.signals.k);
        let at = format!("document {} segment {}", self.doc_id, self.segment);
        if n < 2 {
            return Err(format!("{at}: {n} ids: a scored segment has at least 2"));
        }
        if let Some(parts) = self.parts.as_ref().filter(|p| p.len() != n) {
            return Err(format!("{at}: {} parts for {n} ids", parts.len()));
        }
        meta.signals.check_ids(&at, "input_ids", &self.input_ids)?;
        let mut previous_end = 1;
        for (c, chunk) in self.chunks.iter().enumerate() {
            let (start, end) = (chunk.start as usize, chunk.end as usize);
            if !(start >= previous_end && start < end && end <= n) {
                return Err(format!(
                    "{at}: column chunk_bounds, chunk {c}: [{start}, {end}) is not a run of its \
                     {n} ids after the previous chunk's end {previous_end}"
                ));
            }
            previous_end = end;
            if chunk.top_ids.len() != k || chunk.top_logprobs.len() != k {
                return Err(format!(
                    "{at}: chunk {c}: a top-{k} of {} entries",
                    chunk.top_ids.len()
                ));
            }
            let mapped: Vec<u32> = chunk
                .top_ids
                .iter()
                .copied()
                .filter(|&i| i != UNMAPPED)
                .collect();
            meta.signals.check_ids(&at, "top_ids", &mapped)?;
            check_logprobs(&at, "chunk_logprobs", &[chunk.logprob])?;
            check_logprobs(&at, "top_logprobs", &chunk.top_logprobs)?;
            let mass: f64 = chunk.top_logprobs.iter().map(|&l| (l as f64).exp()).sum();
            if mass > 1.0 + MASS_SLACK {
                return Err(format!(
                    "{at}: column top_logprobs, chunk {c}: the top-{k} probabilities sum to {mass}, \
                     more than 1"
                ));
            }
        }
        Ok(())
    }
}

/// Writes an aligned shard atomically and durably (rows checked first). Returns the bytes written.
pub fn write_aligned_shard(
    path: &Path,
    meta: &AlignedMeta,
    rows: &[AlignedRow],
) -> Result<u64, DataError> {
    for row in rows {
        row.check(meta).map_err(|m| file_err(path, WHAT, m))?;
    }
    let k = meta.signals.k;
    let per_row = |f: &dyn Fn(&ChunkSignals) -> Vec<f32>| -> Vec<Vec<f32>> {
        rows.iter()
            .map(|r| r.chunks.iter().flat_map(f).collect())
            .collect()
    };
    let bounds: Vec<Vec<u32>> = rows
        .iter()
        .map(|r| r.chunks.iter().flat_map(|c| [c.start, c.end]).collect())
        .collect();
    // −1 (as u32: UNMAPPED) stays −1 in the int32 column.
    let top_ids: Vec<Vec<u32>> = rows
        .iter()
        .map(|r| {
            r.chunks
                .iter()
                .flat_map(|c| c.top_ids.iter().copied())
                .collect()
        })
        .collect();
    let chunk_logprobs = per_row(&|c| vec![c.logprob]);
    let top_logprobs = per_row(&|c| c.top_logprobs.clone());
    let keys = rows.iter().map(|r| (r.doc_id, r.segment));
    let columns: Vec<(&'static str, ArrayRef)> = vec![
        (
            "input_ids",
            int_lists(rows.iter().map(|r| &r.input_ids[..])),
        ),
        ("chunk_bounds", int_lists(bounds.iter().map(Vec::as_slice))),
        (
            "chunk_logprobs",
            float_lists(chunk_logprobs.iter().map(Vec::as_slice)),
        ),
        (
            "top_ids",
            topk_int_lists(top_ids.iter().map(Vec::as_slice), k),
        ),
        (
            "top_logprobs",
            topk_float_lists(top_logprobs.iter().map(Vec::as_slice), k),
        ),
    ];
    let parts = parts_column(rows.iter().map(|r| r.parts.as_deref()));
    let batch = RecordBatch::try_from_iter(
        segment_columns(keys)
            .into_iter()
            .chain(columns)
            .chain(parts),
    )
    .map_err(|e| file_err(path, WHAT, e))?;
    let mut pairs = meta.signals.pairs(KIND, SCHEMA_VERSION);
    pairs.push((
        "teacher_tokenizer_sha256",
        meta.teacher_tokenizer_sha256.clone(),
    ));
    write_parquet(
        path,
        WHAT,
        &batch,
        &pairs,
        &[
            &["top_logprobs", "list", "element", "item"],
            &["chunk_logprobs", "list", "element"],
        ],
        &[],
    )
}

/// Reads and verifies an aligned shard (its checksum when `sha256` is given: the manifest's).
pub fn read_aligned_shard(
    path: &Path,
    sha256: Option<&str>,
) -> Result<(AlignedMeta, Vec<AlignedRow>), DataError> {
    let (opened, _) = Opened::open_versioned(path, WHAT, KIND, None, &[SCHEMA_VERSION], sha256)?;
    let meta = AlignedMeta {
        signals: ShardMeta::read(&opened, path, WHAT)?,
        teacher_tokenizer_sha256: opened
            .get(path, WHAT, "teacher_tokenizer_sha256")?
            .to_string(),
    };
    let k = meta.signals.k;
    opened
        .check_columns(&[
            ("doc_id", Col::Int64),
            ("segment", Col::Int32),
            ("input_ids", Col::IntList),
            ("chunk_bounds", Col::IntList),
            ("chunk_logprobs", Col::FloatList),
            ("top_ids", Col::TopkInt(k)),
            ("top_logprobs", Col::TopkFloat(k)),
        ])
        .and_then(|()| opened.has_column("parts", Col::Binary).map(drop))
        .map_err(|m| file_err(path, WHAT, m))?;
    let mut rows = Vec::new();
    for batch in opened.batches(path, WHAT)? {
        let doc = column(&batch, "doc_id").as_primitive::<Int64Type>();
        let seg = column(&batch, "segment").as_primitive::<Int32Type>();
        for i in 0..batch.num_rows() {
            let (doc_id, segment) = (doc.value(i) as u64, seg.value(i) as u32);
            let at = format!("document {doc_id} segment {segment}");
            let input_ids = u32s(column(&batch, "input_ids"), i);
            let bounds = u32s(column(&batch, "chunk_bounds"), i);
            let logprobs = f32s(column(&batch, "chunk_logprobs"), i);
            let top_ids = u32s(column(&batch, "top_ids"), i);
            let top_logprobs = f32s(column(&batch, "top_logprobs"), i);
            let c = logprobs.len();
            if bounds.len() != 2 * c || top_ids.len() != c * k || top_logprobs.len() != c * k {
                return Err(file_err(
                    path,
                    WHAT,
                    format!(
                        "{at}: {c} chunk logprobs need {} bounds and {c}×{k} top-k entries, got \
                         {}, {} and {}",
                        2 * c,
                        bounds.len(),
                        top_ids.len(),
                        top_logprobs.len()
                    ),
                ));
            }
            let chunks = (0..c)
                .map(|j| ChunkSignals {
                    start: bounds[2 * j],
                    end: bounds[2 * j + 1],
                    logprob: logprobs[j],
                    top_ids: top_ids[j * k..(j + 1) * k].to_vec(),
                    top_logprobs: top_logprobs[j * k..(j + 1) * k].to_vec(),
                })
                .collect();
            let row = AlignedRow {
                doc_id,
                segment,
                parts: read_parts(&batch, i, input_ids.len())
                    .map_err(|m| file_err(path, WHAT, format!("{at}: {m}")))?,
                input_ids,
                chunks,
            };
            row.check(&meta).map_err(|m| file_err(path, WHAT, m))?;
            rows.push(row);
        }
    }
    Ok((meta, rows))
}
