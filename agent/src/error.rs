//! What the agent fails with: a request it could not answer ([`AgentError`]), and the rest of its
//! work (policy, bench and task files, the traffic directory, calibration) as [`Error`]: each
//! lower crate's error, a refusal that says what to do, or what a file or line met.

use k3mini_teacher::TeacherError;
use std::fmt::Display;

/// A request the gateway could not answer.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The student failed (or the request asked it for the impossible).
    #[error("the local model: {0}")]
    Local(TeacherError),
    /// The remote failed and the policy says to fail with it.
    #[error("the remote: {0}")]
    Remote(TeacherError),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Answer(#[from] AgentError),
    #[error(transparent)]
    Teacher(#[from] TeacherError),
    #[error(transparent)]
    Data(#[from] k3mini_data::DataError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// Something the agent will not do with these inputs, and why.
    #[error("{0}")]
    Refused(String),
    /// What reading or writing something (a file, a line of one, a task) met.
    #[error("{what}: {message}")]
    At { what: String, message: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The [`Error::At`] of `what`, for `map_err`.
pub fn at<E: Display>(what: impl Display) -> impl FnOnce(E) -> Error {
    move |e| Error::At {
        what: what.to_string(),
        message: e.to_string(),
    }
}

/// An [`Error::Refused`] with a formatted message.
macro_rules! refuse {
    ($($arg:tt)*) => {
        $crate::error::Error::Refused(format!($($arg)*))
    };
}
pub(crate) use refuse;
