//! Training: the loop, one objective per mode, the shared held-out evaluator, the optimizer,
//! schedules and QAT.

pub mod batch;
pub mod distill;
pub mod held_out;
pub mod lm;
pub mod modes;
pub mod objective;
pub mod on_policy;
pub mod online;
pub mod optim;
pub mod parallel;
pub mod qat;
pub mod ranks;
pub mod schedule;
pub mod trainer;
