//! The `k3mini` library behind the CLI: recipes and their plans, the run directory, training,
//! teachers, evaluation, export and the quickstart. The binary in
//! `main.rs` only parses arguments and calls these functions.

pub mod bench;
pub mod compare;
pub mod corpus;
pub mod device;
pub mod error;
pub mod evaluate;
pub mod export;
pub mod quickstart;
pub mod recipe;
pub mod routing;
pub mod run_dir;
pub mod scratch;
pub mod smoke;
pub mod teachers;
pub mod tensorboard;
pub mod train;
pub mod units;

/// The local agent gateway (its own crate: a product with its own users).
pub use k3mini_agent as agent;
/// What long work reports, through the observer the binary installs.
pub use k3mini_progress as progress;
