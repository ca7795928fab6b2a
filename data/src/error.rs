//! Data errors: each names the file and, where it has one, the place in it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: not valid UTF-8 at byte {offset}")]
    NotUtf8 { path: PathBuf, offset: usize },
    #[error("{path}: empty")]
    Empty { path: PathBuf },
    #[error("{path}:{line}: {message}")]
    Record {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: row {row}: {message}")]
    Row {
        path: PathBuf,
        row: usize,
        message: String,
    },
    #[error("tokenizer {source_name}: {message}")]
    Tokenizer {
        source_name: String,
        message: String,
    },
    /// A conversation the chat templates cannot render.
    #[error("{0}")]
    Conversation(String),
    /// A chat template whose markers are not single tokens of the tokenizer.
    #[error(
        "the {template} chat template's markers {missing} are not single tokens of {tokenizer}{hint}"
    )]
    Markers {
        template: String,
        missing: String,
        tokenizer: String,
        hint: &'static str,
    },
}

impl DataError {
    pub(crate) fn io(path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
    }
}
