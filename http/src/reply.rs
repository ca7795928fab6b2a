//! What a handler answers: a JSON reply or a stream of server-sent events, and the errors it
//! answers with, in vLLM's shape.

use crate::json::{ErrorResponse, parse_request};
pub use hyper::body::Bytes;

/// A JSON response, or a stream of server-sent events.
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u32>,
    /// Server-sent events: the frames, sent as they arrive until the sender is dropped (`body`
    /// is not sent).
    pub events: Option<tokio::sync::mpsc::Receiver<Bytes>>,
    /// Kept until hyper is done with the body (it has taken the last bytes to write, or the client
    /// has gone), then dropped off the connection's thread: what sending the answer should not
    /// wait for ([`Reply::hold`]).
    pub held: Option<Box<dyn Send + Sync>>,
}

/// Where a producer sends a streamed reply's frames: a send fails once the client has gone.
pub type EventSender = tokio::sync::mpsc::Sender<Bytes>;

/// Frames a stream may hold unsent before its producer waits on the client.
const EVENTS_QUEUED: usize = 64;

impl Reply {
    pub fn json(status: u16, value: &impl serde::Serialize) -> Self {
        Self {
            status,
            body: serde_json::to_vec(value).expect("a response serialises"),
            retry_after: None,
            events: None,
            held: None,
        }
    }

    /// A 200 `text/event-stream` and the sender of its frames (send them from a thread of their
    /// own with `blocking_send`: the handler returns this reply before the stream is written).
    pub fn events() -> (Self, EventSender) {
        let (tx, rx) = tokio::sync::mpsc::channel(EVENTS_QUEUED);
        let reply = Self {
            status: 200,
            body: Vec::new(),
            retry_after: None,
            events: Some(rx),
            held: None,
        };
        (reply, tx)
    }

    /// `GET /health`'s answer.
    pub fn health() -> Self {
        Self::json(
            200,
            &crate::json::Health {
                status: "ok".into(),
            },
        )
    }

    /// A status without a body.
    pub fn empty(status: u16) -> Self {
        Self {
            status,
            body: Vec::new(),
            retry_after: None,
            events: None,
            held: None,
        }
    }

    /// An error in vLLM's shape; a 503 says when to retry.
    pub fn error(status: u16, message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status,
            body: ErrorResponse::new(status, message, param).to_json(),
            retry_after: (status == 503).then_some(1),
            events: None,
            held: None,
        }
    }

    /// This reply, keeping `value` until hyper is done with its body: dropping it then does what
    /// must follow the answer without delaying it (a journal's line for what the answer names).
    pub fn hold(mut self, value: impl Send + Sync + 'static) -> Self {
        self.held = Some(Box::new(value));
        self
    }
}

/// An error answered to the client: status, message, the request field at fault.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    /// As a reply, in vLLM's shape.
    pub fn reply(&self) -> Reply {
        Reply::error(self.status, self.message.clone(), self.param.as_deref())
    }
}

/// A 400 naming the request field at fault.
pub fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError {
        status: 400,
        message: message.into(),
        param: Some(param.to_string()),
    }
}

/// [`parse_request`], its failure a 400 naming the field.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse_request(body).map_err(|(param, message)| bad(&param, message))
}
