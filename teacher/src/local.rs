//! A teacher run in-process: a llama-architecture GGUF on a burn device.

use crate::engine::{Limits, Session};
use crate::gguf::{TokenizerMeta, load_llama, load_tokenizer};
use crate::llama::{KvCache, Llama};
use crate::{GenerateParams, Generation, Interrupt, Scored, Teacher, TeacherError};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_gguf::GgufFile;
use std::path::Path;

/// Positions per forward pass when scoring or prefilling: attention memory stays
/// `heads × CHUNK × context` however long the sequence.
pub const CHUNK: usize = 512;

pub struct LocalTeacher {
    pub name: String,
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub meta: TokenizerMeta,
}

impl LocalTeacher {
    /// Loads a llama-architecture GGUF (weights dequantised to f32) and the tokenizer it carries.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self, TeacherError> {
        let file = GgufFile::open(path)?;
        let model = load_llama(&file, device)?;
        let (tokenizer, meta) = load_tokenizer(&file)?;
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        Ok(Self {
            name,
            model,
            tokenizer,
            meta,
        })
    }

    /// Logits `[t, vocab]` (row-major) of `ids`, extending `cache`.
    fn logits(&self, ids: &[u32], cache: &mut KvCache) -> Vec<f32> {
        let device = self.model.device();
        let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, ids.len()]), &device);
        self.model
            .forward(tokens, cache)
            .into_data()
            .try_into_vec::<f32>()
            .expect("f32 logits")
    }
}

impl Teacher for LocalTeacher {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        Ok(self
            .run(ids, Some(k), None, Interrupt::default())?
            .0
            .expect("scoring was asked for"))
    }

    fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        Ok(self
            .run(prompt, None, Some(params), Interrupt::default())?
            .1
            .expect("generation was asked for"))
    }
}

impl LocalTeacher {
    /// Scores `ids` at top-`k` and/or generates after them (see [`crate::engine::run`]), until
    /// `interrupt` says stop.
    pub fn run(
        &self,
        ids: &[u32],
        k: Option<usize>,
        params: Option<&GenerateParams>,
        interrupt: Interrupt,
    ) -> Result<(Option<Scored>, Option<Generation>), TeacherError> {
        let mut session = BurnSession {
            teacher: self,
            cache: KvCache::default(),
        };
        let limits = Limits {
            vocab: self.vocab_size(),
            context: self.model.config.context_length,
            chunk: CHUNK,
        };
        crate::engine::run(&mut session, limits, ids, k, params, interrupt)
    }
}

/// One sequence through the burn model: its KV cache.
struct BurnSession<'a> {
    teacher: &'a LocalTeacher,
    cache: KvCache,
}

impl Session for BurnSession<'_> {
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>, TeacherError> {
        Ok(self.teacher.logits(ids, &mut self.cache))
    }
}
