//! The student crate's integration tests, one binary (one link) with a module per area.
mod checkpointing;
mod common;
mod config_and_info;
mod decode;
mod distill;
mod golden_references;
mod gradcheck;
mod head;
mod moe_balance;
mod packing;
mod precision;
