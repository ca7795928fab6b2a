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
//! `k3mini.tokenizer_sha256`, `k3mini.k`, `k3mini.temperature`.

use crate::error::DataError;
use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, Int32Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type, Int64Type};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::schema::types::ColumnPath;
use std::path::Path;
use std::sync::Arc;

pub const SCHEMA_VERSION: u32 = 1;

/// Who made a shard and how: stored as Parquet file metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardMeta {
    pub teacher: String,
    /// SHA-256 of the tokenizer's id ↔ token table (see `Tokenizer::fingerprint`).
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
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

impl ShardRow {
    pub fn positions(&self) -> usize {
        self.target_logprobs.len()
    }

    /// `1 − Σ_k exp(top logprob)` at each position, clamped at 0.
    pub fn tail_mass(&self, k: usize) -> Vec<f32> {
        self.top_logprobs
            .chunks_exact(k)
            .map(|row| (1.0 - row.iter().map(|&l| (l as f64).exp()).sum::<f64>()).max(0.0) as f32)
            .collect()
    }

    fn check(&self, k: usize) -> Result<(), String> {
        let n = self.input_ids.len();
        let p = n.saturating_sub(1);
        if n < 2
            || self.target_logprobs.len() != p
            || self.top_ids.len() != p * k
            || self.top_logprobs.len() != p * k
        {
            return Err(format!(
                "document {} segment {}: {n} ids need {p} target logprobs and {p}×{k} top-k entries, got {}, {} and {}",
                self.doc_id,
                self.segment,
                self.target_logprobs.len(),
                self.top_ids.len(),
                self.top_logprobs.len()
            ));
        }
        Ok(())
    }
}

fn shard_err(path: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::io(path, format!("teacher shard: {message}"))
}

fn int_lists(rows: &[ShardRow], f: impl Fn(&ShardRow) -> &[u32]) -> ArrayRef {
    let mut b = ListBuilder::new(Int32Builder::new());
    for r in rows {
        b.values()
            .append_slice(&f(r).iter().map(|&x| x as i32).collect::<Vec<_>>());
        b.append(true);
    }
    Arc::new(b.finish())
}

fn float_lists(rows: &[ShardRow], f: impl Fn(&ShardRow) -> Vec<f32>) -> ArrayRef {
    let mut b = ListBuilder::new(Float32Builder::new());
    for r in rows {
        b.values().append_slice(&f(r));
        b.append(true);
    }
    Arc::new(b.finish())
}

/// `list<fixed_size_list<_, k>>` of each row's `(n − 1) × k` values.
fn topk_ids(rows: &[ShardRow], k: usize) -> ArrayRef {
    let mut b = ListBuilder::new(FixedSizeListBuilder::new(Int32Builder::new(), k as i32));
    for r in rows {
        for pos in r.top_ids.chunks_exact(k) {
            let inner = b.values();
            inner
                .values()
                .append_slice(&pos.iter().map(|&x| x as i32).collect::<Vec<_>>());
            inner.append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

fn topk_logprobs(rows: &[ShardRow], k: usize) -> ArrayRef {
    let mut b = ListBuilder::new(FixedSizeListBuilder::new(Float32Builder::new(), k as i32));
    for r in rows {
        for pos in r.top_logprobs.chunks_exact(k) {
            let inner = b.values();
            inner.values().append_slice(pos);
            inner.append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

/// Writes a shard atomically (a temporary file renamed into place). Returns the bytes written.
pub fn write_shard(path: &Path, meta: &ShardMeta, rows: &[ShardRow]) -> Result<u64, DataError> {
    let k = meta.k;
    for r in rows {
        r.check(k).map_err(|m| shard_err(path, m))?;
    }
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
        ("input_ids", int_lists(rows, |r| &r.input_ids)),
        (
            "target_logprobs",
            float_lists(rows, |r| r.target_logprobs.clone()),
        ),
        ("top_ids", topk_ids(rows, k)),
        ("top_logprobs", topk_logprobs(rows, k)),
        ("tail_mass", float_lists(rows, |r| r.tail_mass(k))),
    ])
    .map_err(|e| shard_err(path, e))?;
    let kv = |key: &str, value: String| KeyValue::new(format!("k3mini.{key}"), value);
    let float_column = |name: &str, nested: &[&str]| {
        let mut parts = vec![name.to_string()];
        parts.extend(nested.iter().map(|s| s.to_string()));
        ColumnPath::new(parts)
    };
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).expect("valid level"),
        ))
        .set_key_value_metadata(Some(vec![
            kv("schema_version", SCHEMA_VERSION.to_string()),
            kv("teacher", meta.teacher.clone()),
            kv("tokenizer_sha256", meta.tokenizer_sha256.clone()),
            kv("k", k.to_string()),
            kv("temperature", meta.temperature.to_string()),
        ]))
        .set_column_dictionary_enabled(
            float_column("top_logprobs", &["list", "element", "item"]),
            false,
        )
        .set_column_encoding(
            float_column("top_logprobs", &["list", "element", "item"]),
            Encoding::BYTE_STREAM_SPLIT,
        )
        .set_column_dictionary_enabled(float_column("target_logprobs", &["list", "element"]), false)
        .set_column_encoding(
            float_column("target_logprobs", &["list", "element"]),
            Encoding::BYTE_STREAM_SPLIT,
        )
        .build();
    let tmp = path.with_extension("parquet.tmp");
    let file = std::fs::File::create(&tmp).map_err(|e| DataError::io(&tmp, e))?;
    let mut writer =
        ArrowWriter::try_new(file, batch.schema(), Some(props)).map_err(|e| shard_err(path, e))?;
    writer.write(&batch).map_err(|e| shard_err(path, e))?;
    let file = writer.into_inner().map_err(|e| shard_err(path, e))?;
    file.sync_all().map_err(|e| DataError::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| DataError::io(path, e))?;
    Ok(std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len())
}

/// Every column has the type the reader's casts assume (a file with the right metadata but other
/// columns is refused, never a panic).
fn check_schema(schema: &arrow_schema::Schema, k: usize) -> Result<(), String> {
    use arrow_schema::DataType::{self, FixedSizeList, Float32, Int32, Int64, List};
    let list_of = |dt: &DataType, inner: &DataType| matches!(dt, List(f) if f.data_type() == inner);
    let topk_of = |dt: &DataType, inner: &DataType| {
        matches!(dt, List(f) if matches!(f.data_type(),
            FixedSizeList(g, n) if g.data_type() == inner && *n as usize == k))
    };
    for name in [
        "doc_id",
        "segment",
        "input_ids",
        "target_logprobs",
        "top_ids",
        "top_logprobs",
    ] {
        let field = schema
            .field_with_name(name)
            .map_err(|_| format!("no column {name}"))?;
        let dt = field.data_type();
        let ok = match name {
            "doc_id" => *dt == Int64,
            "segment" => *dt == Int32,
            "input_ids" => list_of(dt, &Int32),
            "target_logprobs" => list_of(dt, &Float32),
            "top_ids" => topk_of(dt, &Int32),
            _ => topk_of(dt, &Float32),
        };
        if !ok {
            return Err(format!(
                "column {name} has type {dt}, not what schema version {SCHEMA_VERSION} stores at k = {k}"
            ));
        }
    }
    Ok(())
}

/// Reads and validates a shard: schema version, metadata, and every row's lengths.
pub fn read_shard(path: &Path) -> Result<(ShardMeta, Vec<ShardRow>), DataError> {
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| shard_err(path, format!("not a readable Parquet file: {e}")))?;
    let kv: std::collections::HashMap<String, String> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .map(|kvs| {
            kvs.iter()
                .filter_map(|kv| Some((kv.key.clone(), kv.value.clone()?)))
                .collect()
        })
        .unwrap_or_default();
    let get = |key: &str| {
        kv.get(&format!("k3mini.{key}")).ok_or_else(|| {
            shard_err(
                path,
                format!("no k3mini.{key} metadata (not a k3mini shard?)"),
            )
        })
    };
    let version: u32 = get("schema_version")?
        .parse()
        .map_err(|e| shard_err(path, e))?;
    if version != SCHEMA_VERSION {
        return Err(shard_err(
            path,
            format!("schema version {version}; this k3mini reads version {SCHEMA_VERSION}"),
        ));
    }
    let meta = ShardMeta {
        teacher: get("teacher")?.clone(),
        tokenizer_sha256: get("tokenizer_sha256")?.clone(),
        k: get("k")?.parse().map_err(|e| shard_err(path, e))?,
        temperature: get("temperature")?
            .parse()
            .map_err(|e| shard_err(path, e))?,
    };
    check_schema(builder.schema(), meta.k).map_err(|m| shard_err(path, m))?;
    let reader = builder.build().map_err(|e| shard_err(path, e))?;
    let mut rows = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| shard_err(path, e))?;
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| shard_err(path, format!("no column {name}")))
        };
        let doc = column("doc_id")?.as_primitive::<Int64Type>().clone();
        let seg = column("segment")?.as_primitive::<Int32Type>().clone();
        let ids = column("input_ids")?.as_list::<i32>().clone();
        let targets = column("target_logprobs")?.as_list::<i32>().clone();
        let top_ids = column("top_ids")?.as_list::<i32>().clone();
        let top_lp = column("top_logprobs")?.as_list::<i32>().clone();
        for i in 0..batch.num_rows() {
            let ints = |a: ArrayRef| -> Vec<u32> {
                a.as_primitive::<Int32Type>()
                    .values()
                    .iter()
                    .map(|&x| x as u32)
                    .collect()
            };
            let floats =
                |a: ArrayRef| -> Vec<f32> { a.as_primitive::<Float32Type>().values().to_vec() };
            // A slice of a fixed-size list slices its values: they are exactly this row's.
            let flat = |a: ArrayRef| a.as_fixed_size_list().values().clone();
            let row = ShardRow {
                doc_id: doc.value(i) as u64,
                segment: seg.value(i) as u32,
                input_ids: ints(ids.value(i)),
                target_logprobs: floats(targets.value(i)),
                top_ids: ints(flat(top_ids.value(i))),
                top_logprobs: floats(flat(top_lp.value(i))),
            };
            row.check(meta.k).map_err(|m| shard_err(path, m))?;
            rows.push(row);
        }
    }
    Ok((meta, rows))
}
