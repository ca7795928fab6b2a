//! Corpus readers: plain text files (or a directory of `.txt` files), JSONL and Parquet (a string
//! column), and chat conversations from JSONL. Every document is validated as UTF-8 and non-empty
//! so a bad file fails loudly with its name (and line or row), never silently.

use crate::chat::{Message, Tool};
use crate::error::DataError;
use crate::stream::{RawDoc, SourceFormat, file_items, read_text, source_files};
use std::path::{Path, PathBuf};

/// One document and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    pub source: PathBuf,
    /// Position within the source (file order for directories, line index for JSONL).
    pub index: usize,
    pub text: String,
}

/// Reads every document of one source (a file, or a directory of the format's files in name
/// order), through the same readers the streaming loader uses.
pub fn read_source(
    path: &Path,
    format: SourceFormat,
    field: &str,
) -> Result<Vec<Document>, DataError> {
    let mut docs = Vec::new();
    for (i, f) in source_files(path, format)?.into_iter().enumerate() {
        for (item, raw) in file_items(&f, format, field, false)? {
            let RawDoc::Text(text) = raw else {
                unreachable!("text items")
            };
            // Text files are one document each: a directory's are numbered by file.
            let index = match format {
                SourceFormat::Text => i,
                _ => item as usize,
            };
            docs.push(Document {
                source: f.clone(),
                index,
                text,
            });
        }
    }
    Ok(docs)
}

/// A conversation and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatDocument {
    pub source: PathBuf,
    /// Line index in the JSONL file.
    pub index: usize,
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
}

/// Reads conversations: JSONL whose `field` holds `[{"role", "content", "thinking"?, …}, …]`
/// (OpenAI's message shape) and whose `tools` the tools declared to them.
pub fn read_chats(path: &Path, field: &str) -> Result<Vec<ChatDocument>, DataError> {
    Ok(file_items(path, SourceFormat::Jsonl, field, true)?
        .into_iter()
        .map(|(line, raw)| {
            let RawDoc::Chat(chat) = raw else {
                unreachable!("chat items")
            };
            ChatDocument {
                source: path.to_path_buf(),
                index: line as usize,
                messages: chat.messages,
                tools: chat.tools,
            }
        })
        .collect())
}

/// `parse(record, line)` for every non-blank line, with (line index, value); errors name the line.
pub(crate) fn jsonl_records<T>(
    path: &Path,
    parse: impl Fn(&serde_json::Value, &str) -> Result<T, String>,
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
        docs.push((i, parse(&value, line).map_err(record)?));
    }
    if docs.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(docs)
}

/// Writes `texts` as a Parquet file with one string column `field` (zstd), atomically: how
/// benchmarks and tests build corpora in the Hugging Face datasets layout. Returns its bytes.
pub fn write_text_parquet(path: &Path, field: &str, texts: &[String]) -> Result<u64, DataError> {
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    let batch = RecordBatch::try_from_iter([(
        field,
        std::sync::Arc::new(StringArray::from_iter_values(texts)) as ArrayRef,
    )])
    .map_err(|e| DataError::io(path, e))?;
    crate::parquet_io::write_parquet(path, "corpus file", &batch, &[], &[], &[])
}
