//! The HTTP crate's integration tests: the transport over loopback.
mod transport;
