//! The data crate's integration tests, one binary (one link) with a module per area.
mod chat;
mod corpus;
mod packing;
mod shards;
mod signals;
mod tokenizers;
mod trajectories;
