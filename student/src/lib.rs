//! The K3 Mini student: a Kimi Delta Attention / Gated MLA hybrid (3:1) in burn, with optional
//! Attention Residuals and a small MoE variant.
//!
//! One file per layer, each with its equations: [`kda`], [`mla`], [`mlp`], [`moe`], [`norm`],
//! [`attnres`]; the stack in [`model`]; the LM head and its loss in token chunks in [`head`];
//! shapes and validation in [`config`]; named shapes in
//! [`presets`]; analytic parameter/memory accounting in [`info`].

pub mod attnres;
pub mod bench;
pub mod config;
pub mod distill;
pub mod generate;
pub mod head;
pub mod hf;
pub mod info;
pub mod kda;
pub mod loss;
pub mod mla;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod precision;
pub mod presets;

pub use config::{ConfigError, LayerKind, ModelConfig};
pub use model::{InferenceState, K3Mini, ModelOutput, Trunk};
pub use presets::{PRESETS, preset};

use burn::nn::{Initializer, Linear, LinearConfig};
use burn::tensor::Device;

/// Standard deviation of every projection's initial weights (transformers' `initializer_range`).
pub const INIT_STD: f64 = 0.02;

/// A bias-free projection `d_in → d_out` (every projection in the student is bias-free).
pub(crate) fn linear(d_in: usize, d_out: usize, device: &Device) -> Linear {
    LinearConfig::new(d_in, d_out)
        .with_bias(false)
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: INIT_STD,
        })
        .init(device)
}
