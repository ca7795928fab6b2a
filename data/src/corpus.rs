//! Corpus readers: plain text files (or a directory of `.txt` files), JSONL and Parquet (a string
//! column), and chat conversations from JSONL. Every document is validated as UTF-8 and non-empty
//! so a bad file fails loudly with its name (and line or row), never silently.

use crate::chat::Message;
use crate::error::DataError;
use arrow_array::Array;
use arrow_array::cast::AsArray;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Corpus file formats.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceFormat {
    /// Plain UTF-8 text: one document per file. A directory of any format means every file of that
    /// format's extension in it (`.txt`, `.jsonl`, `.parquet`), sorted by name.
    Text,
    /// One JSON object per line; the document is the string at `field`.
    Jsonl,
    /// A Parquet file; the document is the string column `field`.
    Parquet,
}

impl SourceFormat {
    /// `.jsonl` → JSONL, `.parquet` → Parquet, anything else (files or directories) → text.
    pub fn infer(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => Self::Jsonl,
            Some("parquet") => Self::Parquet,
            _ => Self::Text,
        }
    }
}

/// One document and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub source: PathBuf,
    /// Position within the source (file order for directories, line index for JSONL).
    pub index: usize,
    pub text: String,
}

/// Reads every document of one source.
pub fn read_source(
    path: &Path,
    format: SourceFormat,
    field: &str,
) -> Result<Vec<Document>, DataError> {
    match format {
        _ if path.is_dir() => {
            // A directory: every file of the format's extension in it, sorted by name.
            let ext = match format {
                SourceFormat::Text => "txt",
                SourceFormat::Jsonl => "jsonl",
                SourceFormat::Parquet => "parquet",
            };
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| DataError::io(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == ext))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(DataError::io(
                    path,
                    format!("directory holds no .{ext} files"),
                ));
            }
            let mut docs = Vec::new();
            for (i, f) in files.iter().enumerate() {
                if format == SourceFormat::Text {
                    docs.push(Document {
                        source: f.clone(),
                        index: i,
                        text: read_text(f)?,
                    });
                } else {
                    docs.extend(read_source(f, format, field)?);
                }
            }
            Ok(docs)
        }
        SourceFormat::Text => Ok(vec![Document {
            source: path.to_path_buf(),
            index: 0,
            text: read_text(path)?,
        }]),
        SourceFormat::Jsonl => read_jsonl(path, field),
        SourceFormat::Parquet => read_parquet(path, field),
    }
}

/// A conversation and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatDocument {
    pub source: PathBuf,
    /// Line index in the JSONL file.
    pub index: usize,
    pub messages: Vec<Message>,
}

/// Reads conversations: JSONL whose `field` holds `[{"role", "content", "thinking"?}, …]`.
pub fn read_chats(path: &Path, field: &str) -> Result<Vec<ChatDocument>, DataError> {
    jsonl_field(path, field, |value| {
        let messages: Vec<Message> = serde_json::from_value(value.clone())
            .map_err(|e| format!("`{field}` is not a list of messages: {e}"))?;
        if messages.is_empty() {
            return Err(format!("`{field}` holds no messages"));
        }
        Ok(messages)
    })
    .map(|docs| {
        docs.into_iter()
            .map(|(index, messages)| ChatDocument {
                source: path.to_path_buf(),
                index,
                messages,
            })
            .collect()
    })
}

/// A whole file as UTF-8 text; empty files and invalid UTF-8 are errors naming the file.
fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

fn read_jsonl(path: &Path, field: &str) -> Result<Vec<Document>, DataError> {
    let docs = jsonl_field(path, field, |value| match value {
        serde_json::Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
        serde_json::Value::String(_) => Err(format!("`{field}` is empty")),
        _ => Err(format!("`{field}` is not a string")),
    })?;
    Ok(docs
        .into_iter()
        .map(|(index, text)| Document {
            source: path.to_path_buf(),
            index,
            text,
        })
        .collect())
}

/// `parse(record[field])` for every non-blank line, with (line index, value); errors name the line.
fn jsonl_field<T>(
    path: &Path,
    field: &str,
    parse: impl Fn(&serde_json::Value) -> Result<T, String>,
) -> Result<Vec<(usize, T)>, DataError> {
    jsonl_records(path, |record| {
        let value = record
            .get(field)
            .ok_or_else(|| format!("no `{field}` field"))?;
        parse(value)
    })
}

/// `parse(record)` for every non-blank line, with (line index, value); errors name the line.
pub(crate) fn jsonl_records<T>(
    path: &Path,
    parse: impl Fn(&serde_json::Value) -> Result<T, String>,
) -> Result<Vec<(usize, T)>, DataError> {
    let text = read_text(path)?;
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = |message: String| DataError::Record {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| record(format!("invalid JSON: {e}")))?;
        docs.push((i, parse(&value).map_err(record)?));
    }
    if docs.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(docs)
}

/// The string column `field` of a Parquet file (utf8, large_utf8 or utf8_view), one document per row.
fn read_parquet(path: &Path, field: &str) -> Result<Vec<Document>, DataError> {
    use parquet::arrow::ProjectionMask;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
    let bad = |e: &dyn std::fmt::Display| {
        DataError::io(path, format!("not a readable Parquet file: {e}"))
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| bad(&e))?;
    let schema = builder.schema().clone();
    let Some((column, _)) = schema.column_with_name(field) else {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        return Err(DataError::io(
            path,
            format!("no column `{field}` (columns: {})", names.join(", ")),
        ));
    };
    let mask = ProjectionMask::roots(builder.parquet_schema(), [column]);
    let reader = builder.with_projection(mask).build().map_err(|e| bad(&e))?;
    let mut docs = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| bad(&e))?;
        let array = batch.column(0);
        let row = |i: usize| -> Option<&str> {
            if array.is_null(i) {
                return None;
            }
            array
                .as_string_opt::<i32>()
                .map(|a| a.value(i))
                .or_else(|| array.as_string_opt::<i64>().map(|a| a.value(i)))
                .or_else(|| array.as_string_view_opt().map(|a| a.value(i)))
        };
        if array.as_string_opt::<i32>().is_none()
            && array.as_string_opt::<i64>().is_none()
            && array.as_string_view_opt().is_none()
        {
            return Err(DataError::io(
                path,
                format!("column `{field}` is {}, not a string", array.data_type()),
            ));
        }
        for i in 0..array.len() {
            let index = docs.len();
            let error = |message: &str| DataError::Row {
                path: path.to_path_buf(),
                row: index,
                message: format!("`{field}` {message}"),
            };
            match row(i) {
                None => return Err(error("is null")),
                Some(t) if t.trim().is_empty() => return Err(error("is empty")),
                Some(t) => docs.push(Document {
                    source: path.to_path_buf(),
                    index,
                    text: t.to_owned(),
                }),
            }
        }
    }
    if docs.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(docs)
}
