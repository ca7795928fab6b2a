//! Evaluation of K3 Mini students: held-out metrics, retrieval and reasoning tasks, inference
//! memory and decode speed, and the report (JSON, Markdown, SVG plots) that shows them.
//!
//! The pieces take a model and token data; `k3mini eval` (src/evaluate.rs) feeds them a
//! checkpoint and its recipe's held-out data.

pub mod memory;
pub mod metrics;
pub mod plots;
pub mod report;
pub mod tasks;
