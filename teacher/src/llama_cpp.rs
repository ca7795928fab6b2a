//! A local GGUF teacher on llama.cpp (feature `llama-cpp`: the `llama-cpp-2` binding builds its
//! vendored llama.cpp with CMake, a C++ compiler and libclang). It runs any GGUF llama.cpp runs,
//! quantised as stored, and shares scoring and generation with the burn teacher
//! ([`crate::engine::run`]); the tokenizer is k3mini's reading of the GGUF's own vocabulary, so
//! the student's fingerprint check is the burn teacher's.

use crate::engine::{Limits, Session};
use crate::gguf::{TokenizerMeta, load_tokenizer};
use crate::{GenerateParams, Generation, Interrupt, Scored, Teacher, TeacherError};
use k3mini_data::Tokenizer;
use k3mini_gguf::GgufFile;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::OnceLock;

/// Ids per `llama_decode` (its batch and micro-batch): scoring throughput levels off here.
pub const CHUNK: usize = 512;

/// llama.cpp's process-wide backend, initialised once, its logging off.
fn backend() -> Result<&'static LlamaBackend, TeacherError> {
    static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            let mut backend = LlamaBackend::init().map_err(|e| e.to_string())?;
            backend.void_logs();
            Ok(backend)
        })
        .as_ref()
        .map_err(|e| TeacherError::Request(format!("llama.cpp did not start: {e}")))
}

pub struct LlamaCppTeacher {
    pub name: String,
    model: LlamaModel,
    pub tokenizer: Tokenizer,
    pub meta: TokenizerMeta,
    threads: i32,
    vocab: usize,
    context: usize,
}

impl LlamaCppTeacher {
    /// Loads a GGUF into llama.cpp, computing on `threads` CPU threads.
    pub fn from_gguf(path: &Path, threads: usize) -> Result<Self, TeacherError> {
        let err = |message: String| TeacherError::Load {
            path: path.to_path_buf(),
            message,
        };
        // k3mini's own reader first: it names what is wrong with a malformed file, where
        // llama.cpp only returns null.
        let file = GgufFile::open(path)?;
        let (tokenizer, meta) = load_tokenizer(&file)?;
        let model = LlamaModel::load_from_file(backend()?, path, &LlamaModelParams::default())
            .map_err(|e| err(format!("llama.cpp could not load it ({e})")))?;
        let vocab = usize::try_from(model.n_vocab())
            .map_err(|_| err(format!("llama.cpp reports {} tokens", model.n_vocab())))?;
        Ok(Self {
            name: path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            ),
            context: model.n_ctx_train() as usize,
            model,
            tokenizer,
            meta,
            threads: threads.max(1) as i32,
            vocab,
        })
    }

    /// Scores `ids` at top-`k` and/or generates after them (see [`crate::engine::run`]).
    pub fn run(
        &self,
        ids: &[u32],
        k: Option<usize>,
        params: Option<&GenerateParams>,
        interrupt: Interrupt,
    ) -> Result<(Option<Scored>, Option<Generation>), TeacherError> {
        let limits = Limits {
            vocab: self.vocab,
            context: self.context,
            chunk: CHUNK,
        };
        // The context holds the prompt and what may be generated after it.
        let needed = ids.len() + params.map_or(0, |p| p.max_tokens);
        let n_ctx = needed.clamp(1, self.context) as u32;
        let cp = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n_ctx))
            .with_n_batch(CHUNK as u32)
            .with_n_ubatch(CHUNK as u32)
            .with_n_threads(self.threads)
            .with_n_threads_batch(self.threads);
        let ctx = self
            .model
            .new_context(backend()?, cp)
            .map_err(|e| TeacherError::Request(format!("llama.cpp context: {e}")))?;
        let mut session = CppSession {
            ctx,
            batch: LlamaBatch::new(CHUNK, 1),
            pos: 0,
        };
        crate::engine::run(&mut session, limits, ids, k, params, interrupt)
    }
}

/// One sequence in a llama.cpp context.
struct CppSession<'a> {
    ctx: LlamaContext<'a>,
    batch: LlamaBatch<'static>,
    pos: i32,
}

impl Session for CppSession<'_> {
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>, TeacherError> {
        let fail = |e: &dyn std::fmt::Display| TeacherError::Request(format!("llama.cpp: {e}"));
        self.batch.clear();
        for (i, &id) in ids.iter().enumerate() {
            self.batch
                .add(LlamaToken(id as i32), self.pos + i as i32, &[0], true)
                .map_err(|e| fail(&e))?;
        }
        self.ctx.decode(&mut self.batch).map_err(|e| fail(&e))?;
        self.pos += ids.len() as i32;
        Ok((0..ids.len() as i32)
            .flat_map(|i| self.ctx.get_logits_ith(i).iter().copied())
            .collect())
    }
}

impl Teacher for LlamaCppTeacher {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.vocab
    }

    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let (scored, _) = self.run(ids, Some(k), None, Interrupt::default())?;
        scored.ok_or_else(|| TeacherError::Request("nothing was scored".into()))
    }

    fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        let (_, generated) = self.run(prompt, None, Some(params), Interrupt::default())?;
        generated.ok_or_else(|| TeacherError::Request("nothing was generated".into()))
    }
}
