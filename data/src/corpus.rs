//! Corpus readers: plain text files (or a directory of `.txt` files) and JSONL. Every document is
//! validated as UTF-8 and non-empty so a bad file fails loudly with its name, never silently.

use crate::error::DataError;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Corpus file formats.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceFormat {
    /// Plain UTF-8 text: one document per file (a directory: every `.txt` file in it, sorted).
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
        SourceFormat::Text if path.is_dir() => {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| DataError::io(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "txt"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(DataError::io(path, "directory holds no .txt files"));
            }
            files
                .iter()
                .enumerate()
                .map(|(index, f)| {
                    Ok(Document {
                        source: f.clone(),
                        index,
                        text: read_text(f)?,
                    })
                })
                .collect()
        }
        SourceFormat::Text => Ok(vec![Document {
            source: path.to_path_buf(),
            index: 0,
            text: read_text(path)?,
        }]),
        SourceFormat::Jsonl => read_jsonl(path, field),
        SourceFormat::Parquet => Err(DataError::io(path, "Parquet sources are not supported yet")),
    }
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
        let doc = match value.get(field) {
            Some(serde_json::Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(serde_json::Value::String(_)) => {
                return Err(record(format!("`{field}` is empty")));
            }
            Some(_) => return Err(record(format!("`{field}` is not a string"))),
            None => return Err(record(format!("no `{field}` field"))),
        };
        docs.push(Document {
            source: path.to_path_buf(),
            index: i,
            text: doc,
        });
    }
    if docs.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(docs)
}
