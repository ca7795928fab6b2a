//! The Parquet plumbing k3mini's own files share (teacher-signal and trajectory shards): column
//! builders for ragged and top-k lists, an atomic zstd writer with `k3mini.*` metadata, and a
//! reader that checks metadata and column types before anything is cast.

use crate::error::DataError;
use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, Int32Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int32Type};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::DataType;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, Encoding, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// The `doc_id` (int64, the key as two's complement) and `segment` (int32) columns every
/// per-segment file begins with.
pub(crate) fn segment_columns(
    keys: impl Iterator<Item = (u64, u32)> + Clone,
) -> [(&'static str, ArrayRef); 2] {
    [
        (
            "doc_id",
            Arc::new(Int64Array::from_iter_values(
                keys.clone().map(|k| k.0 as i64),
            )),
        ),
        (
            "segment",
            Arc::new(Int32Array::from_iter_values(keys.map(|k| k.1 as i32))),
        ),
    ]
}

/// `list<int32>`, one list per item.
pub(crate) fn int_lists<'a>(lists: impl Iterator<Item = &'a [u32]>) -> ArrayRef {
    let mut b = ListBuilder::new(Int32Builder::new());
    for l in lists {
        b.values()
            .append_slice(&l.iter().map(|&x| x as i32).collect::<Vec<_>>());
        b.append(true);
    }
    Arc::new(b.finish())
}

/// `list<float32>`, one list per item.
pub(crate) fn float_lists<'a>(lists: impl Iterator<Item = &'a [f32]>) -> ArrayRef {
    let mut b = ListBuilder::new(Float32Builder::new());
    for l in lists {
        b.values().append_slice(l);
        b.append(true);
    }
    Arc::new(b.finish())
}

/// `list<fixed_size_list<int32, k>>`: each item's `positions × k` values, row-major.
pub(crate) fn topk_int_lists<'a>(lists: impl Iterator<Item = &'a [u32]>, k: usize) -> ArrayRef {
    let mut b = ListBuilder::new(FixedSizeListBuilder::new(Int32Builder::new(), k as i32));
    for l in lists {
        for pos in l.chunks_exact(k) {
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

/// `list<fixed_size_list<float32, k>>`.
pub(crate) fn topk_float_lists<'a>(lists: impl Iterator<Item = &'a [f32]>, k: usize) -> ArrayRef {
    let mut b = ListBuilder::new(FixedSizeListBuilder::new(Float32Builder::new(), k as i32));
    for l in lists {
        for pos in l.chunks_exact(k) {
            let inner = b.values();
            inner.values().append_slice(pos);
            inner.append(true);
        }
        b.append(true);
    }
    Arc::new(b.finish())
}

pub(crate) fn strings<'a>(values: impl Iterator<Item = Option<&'a str>>) -> ArrayRef {
    Arc::new(StringArray::from_iter(values))
}

/// What a column must hold.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Col {
    Int64,
    Int32,
    Utf8,
    IntList,
    FloatList,
    TopkInt(usize),
    TopkFloat(usize),
    Binary,
}

impl Col {
    fn matches(self, dt: &DataType) -> bool {
        let list_of = |inner: &DataType| matches!(dt, DataType::List(f) if f.data_type() == inner);
        let topk_of = |inner: &DataType, k: usize| {
            matches!(dt, DataType::List(f) if matches!(f.data_type(),
                DataType::FixedSizeList(g, n) if g.data_type() == inner && *n as usize == k))
        };
        match self {
            Col::Int64 => *dt == DataType::Int64,
            Col::Int32 => *dt == DataType::Int32,
            Col::Utf8 => *dt == DataType::Utf8,
            Col::IntList => list_of(&DataType::Int32),
            Col::FloatList => list_of(&DataType::Float32),
            Col::TopkInt(k) => topk_of(&DataType::Int32, k),
            Col::TopkFloat(k) => topk_of(&DataType::Float32, k),
            Col::Binary => *dt == DataType::Binary,
        }
    }
}

pub(crate) fn file_err(path: &Path, what: &str, message: impl std::fmt::Display) -> DataError {
    DataError::io(path, format!("{what}: {message}"))
}

/// Writes `batch` atomically and durably (a temporary file synced and renamed into place, the
/// directory synced) with zstd, `k3mini.KEY` metadata,
/// and the float columns at `float_paths` byte-stream-split (so zstd finds the exponent bytes'
/// redundancy; dictionaries never help logprobs) and the binary `blob_columns` plain (their bytes
/// are already coded; zstd does the rest). Returns the bytes written.
pub(crate) fn write_parquet(
    path: &Path,
    what: &str,
    batch: &RecordBatch,
    metadata: &[(&str, String)],
    float_paths: &[&[&str]],
    blob_columns: &[&str],
) -> Result<u64, DataError> {
    let mut props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(
            ZstdLevel::try_new(3).expect("valid level"),
        ))
        .set_key_value_metadata(Some(
            metadata
                .iter()
                .map(|(k, v)| KeyValue::new(format!("k3mini.{k}"), v.clone()))
                .collect(),
        ));
    for parts in float_paths {
        let column = ColumnPath::new(parts.iter().map(|s| s.to_string()).collect());
        props = props
            .set_column_dictionary_enabled(column.clone(), false)
            .set_column_encoding(column, Encoding::BYTE_STREAM_SPLIT);
    }
    for name in blob_columns {
        let column = ColumnPath::new(vec![name.to_string()]);
        // Min/max statistics of coded bytes mean nothing and would only fill the footer.
        props = props
            .set_column_dictionary_enabled(column.clone(), false)
            .set_column_statistics_enabled(column.clone(), EnabledStatistics::None)
            .set_column_encoding(column, Encoding::PLAIN);
    }
    // Errors of the Parquet writer travel through the I/O closure and come out as themselves.
    let mut failed = None;
    k3mini_durable::write_with(path, |file| {
        ArrowWriter::try_new(file, batch.schema(), Some(props.build()))
            .and_then(|mut w| {
                w.write(batch)?;
                w.close()
            })
            .map(drop)
            .map_err(|e| {
                failed = Some(file_err(path, what, e));
                std::io::Error::other("parquet")
            })
    })
    .map_err(|e| failed.take().unwrap_or_else(|| DataError::io(path, e)))?;
    Ok(std::fs::metadata(path)
        .map_err(|e| DataError::io(path, e))?
        .len())
}

/// An opened k3mini Parquet file: its `k3mini.*` metadata (prefix stripped) and a reader builder.
pub(crate) struct Opened {
    pub meta: HashMap<String, String>,
    pub builder: ParquetRecordBatchReaderBuilder<bytes::Bytes>,
}

impl Opened {
    /// Opens `path`, read once: when `sha256` is given the bytes must have it (a damaged or
    /// replaced file is refused before any value of it is used), and the parse reads the same
    /// bytes.
    pub fn open(path: &Path, what: &str, sha256: Option<&str>) -> Result<Self, DataError> {
        let data = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        if let Some(expected) = sha256 {
            let found = crate::digest::sha256_hex(&data);
            if found != expected {
                return Err(file_err(
                    path,
                    what,
                    format!(
                        "checksum mismatch: the manifest records SHA-256 {expected}, the file has \
                         {found} (damaged or replaced since it was written; rerun the command \
                         that wrote it)"
                    ),
                ));
            }
        }
        let builder = ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(data))
            .map_err(|e| file_err(path, what, format!("not a readable Parquet file: {e}")))?;
        let meta = builder
            .metadata()
            .file_metadata()
            .key_value_metadata()
            .map(|kvs| {
                kvs.iter()
                    .filter_map(|kv| {
                        Some((kv.key.strip_prefix("k3mini.")?.into(), kv.value.clone()?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Self { meta, builder })
    }

    /// Opens a k3mini file of `kind` at one of the schema `versions`, returning the one it has.
    /// Files without a `kind` key predate it and are taken as `default_kind`.
    pub fn open_versioned(
        path: &Path,
        what: &str,
        kind: &str,
        default_kind: Option<&str>,
        versions: &[u32],
        sha256: Option<&str>,
    ) -> Result<(Self, u32), DataError> {
        let opened = Self::open(path, what, sha256)?;
        let found: u32 = opened.parse(path, what, "schema_version")?;
        let found_kind = match (opened.meta.get("kind"), default_kind) {
            (Some(k), _) => k.as_str(),
            (None, Some(d)) => d,
            (None, None) => opened.get(path, what, "kind")?,
        };
        if found_kind != kind {
            return Err(file_err(
                path,
                what,
                format!("holds {found_kind}, not {kind}"),
            ));
        }
        if !versions.contains(&found) {
            let known: Vec<String> = versions.iter().map(u32::to_string).collect();
            return Err(file_err(
                path,
                what,
                format!(
                    "schema version {found}; this k3mini reads version {}",
                    known.join(" and ")
                ),
            ));
        }
        Ok((opened, found))
    }

    /// A metadata value, or an error naming the missing key.
    pub fn get(&self, path: &Path, what: &str, key: &str) -> Result<&str, DataError> {
        self.meta.get(key).map(String::as_str).ok_or_else(|| {
            file_err(
                path,
                what,
                format!("no k3mini.{key} metadata (not a k3mini {what}?)"),
            )
        })
    }

    /// A metadata value parsed as `T`.
    pub fn parse<T: std::str::FromStr>(
        &self,
        path: &Path,
        what: &str,
        key: &str,
    ) -> Result<T, DataError>
    where
        T::Err: std::fmt::Display,
    {
        self.get(path, what, key)?
            .parse()
            .map_err(|e| file_err(path, what, format!("k3mini.{key}: {e}")))
    }

    /// Every named column exists with the type the reader's casts assume (a file with the right
    /// metadata but other columns is refused, never a panic).
    pub fn check_columns(&self, columns: &[(&str, Col)]) -> Result<(), String> {
        let schema = self.builder.schema();
        for &(name, col) in columns {
            let field = schema
                .field_with_name(name)
                .map_err(|_| format!("no column {name}"))?;
            if !col.matches(field.data_type()) {
                return Err(format!(
                    "column {name} has type {}, expected {col:?}",
                    field.data_type()
                ));
            }
        }
        Ok(())
    }

    /// Whether the file has the optional column `name`, which must then be a `col`.
    pub fn has_column(&self, name: &str, col: Col) -> Result<bool, String> {
        match self.builder.schema().field_with_name(name) {
            Err(_) => Ok(false),
            Ok(_) => self.check_columns(&[(name, col)]).map(|()| true),
        }
    }

    /// Every record batch (checked columns may be cast freely).
    pub fn batches(self, path: &Path, what: &str) -> Result<Vec<RecordBatch>, DataError> {
        let reader = self.builder.build().map_err(|e| file_err(path, what, e))?;
        reader
            .map(|b| b.map_err(|e| file_err(path, what, e)))
            .collect()
    }
}

/// A checked column of a batch read by [`Opened::batches`].
pub(crate) fn column<'a>(batch: &'a RecordBatch, name: &str) -> &'a ArrayRef {
    batch
        .column_by_name(name)
        .expect("columns are checked before reading")
}

/// Row `i` of a `list<int32>` or `list<fixed_size_list<int32, k>>` column, flattened.
pub(crate) fn u32s(list: &ArrayRef, i: usize) -> Vec<u32> {
    let values = flat(list.as_list::<i32>().value(i));
    values
        .as_primitive::<Int32Type>()
        .values()
        .iter()
        .map(|&x| x as u32)
        .collect()
}

/// Row `i` of a `list<float32>` or `list<fixed_size_list<float32, k>>` column, flattened.
pub(crate) fn f32s(list: &ArrayRef, i: usize) -> Vec<f32> {
    let values = flat(list.as_list::<i32>().value(i));
    values.as_primitive::<Float32Type>().values().to_vec()
}

/// The values under a fixed-size list (a slice of one slices its values: exactly this row's).
fn flat(a: ArrayRef) -> ArrayRef {
    match a.data_type() {
        DataType::FixedSizeList(..) => a.as_fixed_size_list().values().clone(),
        _ => a,
    }
}
