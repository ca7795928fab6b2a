//! A teacher run in-process: a llama-architecture GGUF on a burn device.

use crate::gguf::{TokenizerMeta, load_llama, load_tokenizer};
use crate::llama::{KvCache, Llama};
use crate::{
    FinishReason, GenerateParams, Generation, Interrupt, Scored, Teacher, TeacherError,
    log_softmax, sample, top_k,
};
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

    fn check_ids(&self, ids: &[u32]) -> Result<(), TeacherError> {
        let vocab = self.model.config.vocab_size;
        if let Some((i, &bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, id)| **id as usize >= vocab)
        {
            return Err(TeacherError::Request(format!(
                "token {bad} at position {i} is outside the teacher's vocabulary of {vocab}"
            )));
        }
        Ok(())
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
    /// Scores `ids` at top-`k` and/or generates after them, with one prefill for both (a vLLM
    /// request with `prompt_logprobs` and `max_tokens ≥ 1` needs both), until `interrupt` says stop
    /// (checked between prefill chunks and generated tokens).
    pub fn run(
        &self,
        ids: &[u32],
        k: Option<usize>,
        params: Option<&GenerateParams>,
        interrupt: Interrupt,
    ) -> Result<(Option<Scored>, Option<Generation>), TeacherError> {
        let check = || interrupt.check();
        self.check_ids(ids)?;
        let (vocab, context) = (self.vocab_size(), self.model.config.context_length);
        if let Some(k) = k {
            if ids.len() < 2 || ids.len() > context {
                return Err(TeacherError::Request(format!(
                    "scoring needs 2 to {context} tokens, got {}",
                    ids.len()
                )));
            }
            if k == 0 || k > vocab {
                return Err(TeacherError::Request(format!(
                    "k = {k} must be in 1..={vocab}"
                )));
            }
        }
        if params.is_some() && (ids.is_empty() || ids.len() >= context) {
            return Err(TeacherError::Request(format!(
                "the prompt needs 1 to {} tokens, got {}",
                context - 1,
                ids.len()
            )));
        }
        let mut scored = k.map(|k| Scored::empty(ids, k));
        let mut cache = KvCache::default();
        // Scoring alone never needs the last id's distribution (it is only a target).
        let fed = if params.is_some() {
            ids
        } else {
            &ids[..ids.len() - 1]
        };
        let mut last = Vec::new();
        let mut t = 0;
        for chunk in fed.chunks(CHUNK) {
            check()?;
            last = self.logits(chunk, &mut cache);
            for row in last.chunks_exact(vocab) {
                if let Some(out) = scored.as_mut().filter(|_| t + 1 < ids.len()) {
                    let logprobs = log_softmax(row);
                    out.target_logprobs.push(logprobs[ids[t + 1] as usize]);
                    for (id, lp) in top_k(&logprobs, out.k) {
                        out.top_ids.push(id);
                        out.top_logprobs.push(lp);
                    }
                }
                t += 1;
            }
        }
        let Some(params) = params else {
            return Ok((scored, None));
        };
        let mut rng = params.seed;
        let k = params.logprobs;
        let mut g = Generation {
            ids: Vec::new(),
            logprobs: Vec::new(),
            k,
            top_ids: Vec::new(),
            top_logprobs: Vec::new(),
            finish: FinishReason::Length,
        };
        let budget = params.max_tokens.min(context - ids.len());
        for _ in 0..budget {
            check()?;
            let row = &last[last.len() - vocab..];
            let logprobs = log_softmax(row);
            let id = if params.temperature <= 0.0 {
                top_k(&logprobs, 1)[0].0
            } else {
                sample(row, params.temperature, params.top_p, &mut rng)
            };
            g.ids.push(id);
            g.logprobs.push(logprobs[id as usize]);
            for (tid, lp) in top_k(&logprobs, k) {
                g.top_ids.push(tid);
                g.top_logprobs.push(lp);
            }
            if params.stop.contains(&id) {
                g.finish = FinishReason::Stop;
                break;
            }
            last = self.logits(&[id], &mut cache);
        }
        Ok((scored, Some(g)))
    }
}
