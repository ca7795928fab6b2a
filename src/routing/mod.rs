//! What k3mini does with a MoE teacher's routing once `teacher score` has harvested it into
//! routing shards: [`stats`] sums it per layer and expert, overall and per corpus source;
//! [`report`] writes `k3mini routing report`'s table, markdown and heatmaps; [`design`] turns it
//! into a MoE student's `[model.moe]` and teacher-group map; [`prune`] removes a MoE model's
//! least salient experts (REAP) from a checkpoint or a GGUF.

pub mod design;
pub mod prune;
pub mod report;
pub mod stats;
