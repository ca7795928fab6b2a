//! Heavy ops the K3 Mini student calls, kept apart from the layers (as in flash-linear-attention):
//! every fast form is tested against its naive twin.
//!
//! - [`kda`]: Kimi Delta Attention, as a naive recurrence, a chunkwise-parallel (WY/UT) form
//!   composed of tensor ops, the same form as one op that recomputes in its backward (the
//!   training path), and a single-token decode step.
//! - [`norm`]: RMS normalisation without a weight (the student's layers and the llama teacher).
//! - [`recompute`]: a region of arithmetic that keeps only its inputs and recomputes the rest in
//!   its backward (the student's gates, norms and attention scores).

mod extension;
pub mod kda;
pub mod norm;
pub mod recompute;

pub use extension::implemented_on;
pub use kda::{KdaInputs, KdaOutput, chunk_kda, fused_chunk_kda, kda_step, naive_recurrent_kda};
