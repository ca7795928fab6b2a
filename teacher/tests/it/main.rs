//! The teacher crate's integration tests, one binary (one link) with a module per area.
#[cfg(feature = "llama-cpp")]
mod llama_cpp;
mod routing_client;
mod routing_wire;
mod smollm2;
mod top_k;
mod wire;
