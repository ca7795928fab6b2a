//! The kernels crate's integration tests, one binary (one link) with a module per area.
mod common;
mod fused;
mod golden_fla;
mod kda_forms;
mod packed_documents;
mod recompute;
