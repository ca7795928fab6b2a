//! The `k3mini` crate's integration tests, one binary (one link of burn) with a module per area.
#[cfg(feature = "llama-cpp")]
mod agent;
mod bench;
mod cli;
mod devices;
mod distill;
mod docs;
mod eval;
mod export;
#[cfg(feature = "llama-cpp")]
mod export_llama_cpp;
mod fixture;
mod held_out;
mod layout;
mod mixture;
#[cfg(feature = "llama-cpp")]
mod prune;
mod quickstart;
#[cfg(feature = "c10d")]
mod ranks;
mod recipe;
#[cfg(feature = "llama-cpp")]
mod routing;
mod routing_design;
mod routing_stats;
mod sandbox;
#[cfg(feature = "llama-cpp")]
mod smoke;
mod teacher_http;
mod teacher_server;
mod tensorboard;
mod train;
