//! Training: schedules, the optimizer, and the loop.

pub mod optim;
pub mod schedule;
pub mod trainer;
