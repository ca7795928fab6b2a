//! The `k3mini` library's error: each lower crate's typed error, I/O and format errors, a refusal
//! that says what to do, and context around any of them (what was being done). The binary
//! prints the chain; tests match on the variants or the message.

use std::fmt::Display;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Recipe(#[from] crate::recipe::RecipeError),
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
    Agent(#[from] crate::agent::AgentError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// A device failed mid-step (a worker's panic: libtorch's errors, CUDA out of memory).
    #[error("{0}")]
    Device(String),
    /// Something k3mini will not do with these inputs, and why (usually with what to do instead).
    #[error("{0}")]
    Refused(String),
    /// What was being done when `inner` happened (the message holds both, so the chain is
    /// printed once).
    #[error("{context}: {inner}")]
    Context { context: String, inner: Box<Error> },
}

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
