//! The `k3mini` library behind the CLI: recipes (and, as they land, the training loop). The binary in
//! `main.rs` only parses arguments and calls these functions.

pub mod compare;
pub mod evaluate;
pub mod export;
pub mod quickstart;
pub mod recipe;
pub mod teachers;
pub mod train;
