//! The burn engine: a llama-architecture GGUF ([`crate::llama::Llama`], weights dequantised to
//! f32) on a burn device. Pure Rust: the engine of builds without a C++ toolchain
//! (`--no-default-features`), of burn's GPU backends, and the reference llama.cpp is tested
//! against.

use crate::TeacherError;
use crate::engine::{Limits, Model, Session};
use crate::llama::{KvCache, Llama};
use burn::tensor::{Int, Tensor, TensorData};

/// Positions per forward pass when scoring or prefilling: attention memory stays
/// `heads × CHUNK × context` however long the sequence.
pub const CHUNK: usize = 512;

impl Model for Llama {
    fn limits(&self) -> Limits {
        Limits {
            vocab: self.config.vocab_size,
            context: self.config.context_length,
            chunk: CHUNK,
        }
    }

    fn session(&self, _len: usize, _routing: bool) -> Result<Box<dyn Session + '_>, TeacherError> {
        // A llama-architecture model routes nothing.
        Ok(Box::new(BurnSession {
            model: self,
            cache: KvCache::default(),
        }))
    }
}

/// One sequence through the burn model: its KV cache.
struct BurnSession<'a> {
    model: &'a Llama,
    cache: KvCache,
}

impl Session for BurnSession<'_> {
    /// Logits `[ids.len(), vocab]` (row-major), extending the cache.
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>, TeacherError> {
        let device = self.model.device();
        let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, ids.len()]), &device);
        self.model
            .forward(tokens, &mut self.cache)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| TeacherError::Request(format!("burn returned no f32 logits: {e:?}")))
    }
}
