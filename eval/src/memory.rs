//! Inference memory against context length, measured: prefill a sequence into an
//! [`InferenceState`](k3mini_student::InferenceState) and count the bytes it holds, for the
//! student and for an all-MLA model of the same shape (every layer MLA, nothing else changed).
//! KDA layers hold a fixed `H·dk·dv` state (+ the conv window); MLA layers a latent cache that
//! grows with every token, so the saving tends to the share of KDA layers.

use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_student::{K3Mini, ModelConfig};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MemoryRow {
    pub context: usize,
    pub hybrid_bytes: usize,
    pub all_mla_bytes: usize,
}

impl MemoryRow {
    /// Fraction of the all-MLA state the hybrid saves.
    pub fn saving(&self) -> f64 {
        1.0 - self.hybrid_bytes as f64 / self.all_mla_bytes as f64
    }
}

/// Bytes of `model`'s state after prefilling `context` tokens (in chunks of `chunk`, so the
/// logits of a long prefill never exist at once).
pub fn state_bytes(model: &K3Mini, context: usize, chunk: usize, device: &Device) -> usize {
    let mut state = model.empty_state(1, device);
    let vocab = model.config.vocab_size as i64;
    let mut done = 0;
    while done < context {
        let n = chunk.min(context - done);
        let ids: Vec<i64> = (done..done + n)
            .map(|i| (i as i64 * 7919) % vocab)
            .collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), device);
        model.forward_with(tokens, Some(&mut state));
        done += n;
    }
    state.bytes()
}

/// The student's state and the all-MLA twin's at each context length (weights are freshly
/// initialised: state sizes do not depend on them).
pub fn memory_vs_context(
    cfg: &ModelConfig,
    contexts: &[usize],
    device: &Device,
) -> Result<Vec<MemoryRow>, k3mini_student::ConfigError> {
    let hybrid = K3Mini::new(cfg, device)?;
    let all_mla = K3Mini::new(
        &ModelConfig {
            layer_pattern: "M".into(),
            ..cfg.clone()
        },
        device,
    )?;
    Ok(contexts
        .iter()
        .map(|&context| MemoryRow {
            context,
            hybrid_bytes: state_bytes(&hybrid, context, 512, device),
            all_mla_bytes: state_bytes(&all_mla, context, 512, device),
        })
        .collect())
}
