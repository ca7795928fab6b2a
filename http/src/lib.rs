//! The one HTTP stack k3mini's servers stand on, `teacher serve` and `agent serve` alike:
//!
//! - [`transport`]: hyper's HTTP/1.1 with the [`limits`] a shared machine needs (connection and
//!   per-peer slots, deadlines, body caps, the API key, a client's disconnect seen), calling a
//!   handler that answers a [`reply`];
//! - [`origin`]: what a web page could send a server on loopback, refused;
//! - [`admission`]: the model's queue, which a request joins before its prompt is tokenized;
//! - [`json`]: errors in vLLM's shape and request bodies read into typed structs, naming the
//!   field at fault;
//! - the routes every server has ([`Reply::health`], [`unrouted`]) and the reasons work stops early
//!   ([`cancelled`]).

pub mod admission;
pub mod json;
pub mod limits;
pub mod origin;
pub mod reply;
pub mod transport;

pub use admission::{Admitted, Busy, Queue, Turn};
pub use json::{ErrorInfo, ErrorResponse, Health};
pub use limits::Limits;
pub use reply::{ApiError, Bytes, EventSender, Reply, bad, parse_body};
pub use transport::{Peer, Request, serve};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

/// A listener on `addr` and the address it got (port 0 picks a free one).
pub fn bind(addr: &str) -> Result<(std::net::TcpListener, SocketAddr), String> {
    let listen_err = |e: std::io::Error| format!("cannot listen on {addr}: {e}");
    let listener = std::net::TcpListener::bind(addr).map_err(listen_err)?;
    let local = listener.local_addr().map_err(listen_err)?;
    Ok((listener, local))
}

/// The risk of serving on `addr` as configured, for the operator to read; None when there is none
/// (a loopback address, or an API key set).
pub fn exposure_warning(addr: &SocketAddr, limits: &Limits) -> Option<String> {
    (!addr.ip().is_loopback() && limits.api_key.is_none()).then(|| {
        format!(
            "warning: serving on {addr} without an API key: anyone who can reach this port can run \
             the model (its compute and its answers); set --api-key or K3MINI_API_KEY, or bind \
             127.0.0.1"
        )
    })
}

/// The error for a request no route took: a 405 on one of the server's `paths`, else a 404.
pub fn unrouted(method: &str, path: &str, paths: &[&str]) -> ApiError {
    match paths.contains(&path) {
        true => ApiError {
            status: 405,
            message: format!("{method} is not allowed on {path}"),
            param: None,
        },
        false => ApiError {
            status: 404,
            message: format!("no route {path}"),
            param: None,
        },
    }
}

/// Why a request's work should stop now: the server is stopping, or its client left (`gone`:
/// [`Peer::gone`], or a stream's closed channel).
pub fn cancelled(stop: &AtomicBool, gone: bool) -> Option<&'static str> {
    if stop.load(Ordering::SeqCst) {
        Some("the server is shutting down")
    } else if gone {
        Some("the client disconnected")
    } else {
        None
    }
}
