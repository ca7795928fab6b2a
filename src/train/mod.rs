//! Training: schedules, the optimizer, the loop, and its benchmark.

pub mod bench;
pub mod distill;
pub mod on_policy;
pub mod online;
pub mod optim;
pub mod qat;
pub mod schedule;
pub mod trainer;
