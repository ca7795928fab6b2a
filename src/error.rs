//! The `k3mini` library's error: each lower crate's typed error (the agent's among them), the
//! recipe's (defined here, so this module depends on no other of the crate's and every module can
//! use it), I/O and format errors, a refusal that says what to do, and context around any of them
//! (what was being done). The binary
//! prints the chain; tests match on the variants or the message.

use std::fmt::{self, Display};
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Recipe(#[from] RecipeError),
    #[error(transparent)]
    Config(#[from] k3mini_student::ConfigError),
    #[error(transparent)]
    Hf(#[from] k3mini_student::hf::HfError),
    #[error(transparent)]
    Data(#[from] k3mini_data::DataError),
    #[error(transparent)]
    Gguf(#[from] k3mini_gguf::GgufError),
    #[error(transparent)]
    Checkpoint(#[from] k3mini_checkpoints::CheckpointError),
    #[error(transparent)]
    Teacher(#[from] k3mini_teacher::TeacherError),
    #[error(transparent)]
    Agent(#[from] k3mini_agent::Error),
    #[error(transparent)]
    Dist(#[from] k3mini_dist::DistError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// A device failed mid-step (a worker's panic: libtorch's errors, CUDA out of memory).
    #[error("{0}")]
    Device(String),
    /// Another rank of a run across processes failed, left, or cannot be reached.
    #[error("{0}")]
    Ranks(String),
    /// Something k3mini will not do with these inputs, and why (usually with what to do instead).
    #[error("{0}")]
    Refused(String),
    /// What was being done when `inner` happened (the message holds both, so the chain is
    /// printed once).
    #[error("{context}: {inner}")]
    Context { context: String, inner: Box<Error> },
}

/// A recipe problem, located in its file (`k3mini::recipe`).
#[derive(Debug, Clone, PartialEq)]
pub struct RecipeError {
    pub file: PathBuf,
    /// 1-based line of the offending key (or of its table), when it is in the file.
    pub line: Option<usize>,
    /// Dotted key, e.g. `optim.lr`; empty for syntax errors.
    pub key: String,
    pub message: String,
}

impl fmt::Display for RecipeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for RecipeError {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Context for an error, or for a missing value (as `anyhow::Context`).
pub trait Context<T> {
    fn context(self, context: impl Display) -> Result<T>;
    fn with_context<C: Display>(self, context: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Display) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: context.to_string(),
            inner: Box::new(e.into()),
        })
    }

    fn with_context<C: Display>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: context().to_string(),
            inner: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, context: impl Display) -> Result<T> {
        self.ok_or_else(|| Error::Refused(context.to_string()))
    }

    fn with_context<C: Display>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.ok_or_else(|| Error::Refused(context().to_string()))
    }
}

/// Returns [`Error::Refused`] with a formatted message.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::error::Error::Refused(format!($($arg)*)))
    };
}

/// [`bail!`] unless `cond` holds.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            $crate::bail!($($arg)*);
        }
    };
}

/// An [`Error::Refused`] with a formatted message.
#[macro_export]
macro_rules! refused {
    ($($arg:tt)*) => {
        $crate::error::Error::Refused(format!($($arg)*))
    };
}
