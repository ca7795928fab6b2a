//! The training loop's building blocks (the loop itself lands with the data pipeline and checkpoints).

pub mod optim;
pub mod schedule;
