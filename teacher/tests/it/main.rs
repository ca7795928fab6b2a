//! The teacher crate's integration tests, one binary (one link) with a module per area.
mod http;
mod smollm2;
