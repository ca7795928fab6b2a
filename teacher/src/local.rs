//! A teacher run in-process: a GGUF on one of the [`crate::engine`]s, with the tokenizer it
//! carries (k3mini's reading of the GGUF's vocabulary, so the student's fingerprint check is the
//! same whichever engine runs it).

use crate::engine::{Model, Session};
use crate::gguf::{TokenizerMeta, load_llama, load_tokenizer};
use crate::routing::wire::RoutingShape;
use crate::routing::{Routing, gguf_routing};
use crate::{GenerateParams, Generation, Interrupt, Scored, Teacher, TeacherError};
use burn::tensor::Device;
use k3mini_data::Tokenizer;
use k3mini_gguf::GgufFile;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Which engine runs a local teacher.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// llama.cpp (feature `llama-cpp`, default): any GGUF it runs, quantised as stored.
    LlamaCpp,
    /// burn: llama-architecture GGUFs, dequantised to f32, on any burn device.
    Burn,
}

impl Engine {
    pub const NAMES: &str = "llama-cpp, burn";

    /// Whether this build has the engine.
    pub fn built(self) -> bool {
        match self {
            Engine::LlamaCpp => cfg!(feature = "llama-cpp"),
            Engine::Burn => true,
        }
    }
}

/// The engine of choice in this build: llama.cpp where it is built in, else burn.
impl Default for Engine {
    fn default() -> Self {
        if Engine::LlamaCpp.built() {
            Engine::LlamaCpp
        } else {
            Engine::Burn
        }
    }
}

impl std::str::FromStr for Engine {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "llama-cpp" | "llama.cpp" => Ok(Engine::LlamaCpp),
            "burn" => Ok(Engine::Burn),
            _ => Err(format!("{s:?}: the engines are {}", Engine::NAMES)),
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Engine::LlamaCpp => "llama-cpp",
            Engine::Burn => "burn",
        })
    }
}

/// An engine and where it computes.
pub enum EngineSpec {
    #[cfg(feature = "llama-cpp")]
    LlamaCpp(crate::engine::llama_cpp::Placement),
    Burn(Device),
}

/// What [`LocalTeacher::run`] returns: what was asked for.
pub struct Ran {
    pub scored: Option<Scored>,
    pub generated: Option<Generation>,
    /// The routing of every id fed, while recording.
    pub routing: Option<Routing>,
}

pub struct LocalTeacher {
    pub name: String,
    pub engine: Engine,
    pub tokenizer: Tokenizer,
    pub meta: TokenizerMeta,
    model: Box<dyn Model>,
    /// The model's routing, from its GGUF (None for a dense model).
    shape: Option<RoutingShape>,
    /// Whether every sequence's routing is recorded ([`LocalTeacher::record_routing`]).
    record: bool,
}

impl LocalTeacher {
    /// Loads a GGUF into `spec`'s engine. k3mini's own reader goes first: it names what is wrong
    /// with a malformed file, and it reads the tokenizer.
    pub fn open(path: &Path, spec: EngineSpec) -> Result<Self, TeacherError> {
        let file = GgufFile::open(path)?;
        let (tokenizer, meta) = load_tokenizer(&file)?;
        let shape = gguf_routing(&file)?;
        let (engine, model): (Engine, Box<dyn Model>) = match spec {
            #[cfg(feature = "llama-cpp")]
            EngineSpec::LlamaCpp(placement) => {
                let model = crate::engine::llama_cpp::LlamaCppModel::load(path, placement)?;
                // llama.cpp tokenises prompts served as text with its own reading of the
                // vocabulary: it must be k3mini's.
                if model.tokenize(crate::PROBE)? != tokenizer.encode(crate::PROBE)? {
                    return Err(TeacherError::Load {
                        path: path.to_path_buf(),
                        message: "llama.cpp and k3mini read this GGUF's tokenizer differently \
                                  (they split a probe text into different ids)"
                            .into(),
                    });
                }
                (Engine::LlamaCpp, Box::new(model))
            }
            EngineSpec::Burn(device) => (Engine::Burn, Box::new(load_llama(&file, &device)?)),
        };
        let file = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        // The name goes into shard metadata, so shards scored by one engine are not resumed by
        // the other (they agree only to llama.cpp's quantised arithmetic). burn's stays the bare
        // file name that shard sets from before llama.cpp carry.
        let name = match engine {
            Engine::Burn => file,
            Engine::LlamaCpp => format!("{file} on llama.cpp"),
        };
        Ok(Self {
            name,
            engine,
            tokenizer,
            meta,
            model,
            shape,
            record: false,
        })
    }

    /// The model's routing as its GGUF describes it (None for a dense model).
    pub fn routing_shape(&self) -> Option<&RoutingShape> {
        self.shape.as_ref()
    }

    /// From now on every sequence's routing is recorded through llama.cpp's graph hooks, with the
    /// router weights and expert output norms; refused for a dense model or on burn (which runs
    /// dense llama models only). Recording costs a fresh llama.cpp context per sequence.
    pub fn record_routing(mut self) -> Result<Self, TeacherError> {
        let refuse = |why: &str| TeacherError::Request(format!("{}: {why}", self.name));
        if self.shape.is_none() {
            return Err(refuse(
                "a dense model (no layer has routed experts): there is no routing to record",
            ));
        }
        if self.engine != Engine::LlamaCpp {
            return Err(refuse("only the llama-cpp engine records routing"));
        }
        self.record = true;
        Ok(self)
    }

    /// The burn engine on `device` (tests and benchmarks compare against it).
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self, TeacherError> {
        Self::open(path, EngineSpec::Burn(device.clone()))
    }

    /// A fresh sequence with room for `len` ids, and what the model takes: for callers that
    /// drive decoding themselves (the agent reads every drafted position's whole distribution).
    pub fn session(
        &self,
        len: usize,
    ) -> Result<(Box<dyn Session + '_>, crate::engine::Limits), TeacherError> {
        Ok((self.model.session(len, false)?, self.model.limits()))
    }

    /// The longest sequence it takes (prompt and completion).
    pub fn context_length(&self) -> usize {
        self.model.limits().context
    }

    /// Logits per position (the model's ids, which may pass its tokenizer's).
    pub fn n_vocab(&self) -> usize {
        self.model.limits().vocab
    }

    /// Scores `ids` at top-`k` and/or generates after them (see [`crate::engine::run`]), until
    /// `interrupt` says stop; while recording, the routing of every id fed (the prompt's, then
    /// each generated id's but the last: what vLLM returns), checked against the GGUF's.
    pub fn run(
        &self,
        ids: &[u32],
        k: Option<usize>,
        params: Option<&GenerateParams>,
        interrupt: Interrupt,
    ) -> Result<Ran, TeacherError> {
        let limits = self.model.limits();
        let len = ids.len() + params.map_or(0, |p| p.max_tokens);
        let mut session: Box<dyn Session + '_> = self.model.session(len, self.record)?;
        let (scored, generated) =
            crate::engine::run(session.as_mut(), limits, ids, k, params, interrupt)?;
        let routing = match (self.record, &self.shape) {
            (true, Some(shape)) => {
                let fed = match &generated {
                    Some(g) => ids.len() + g.ids.len().saturating_sub(1),
                    None => ids.len() - 1,
                };
                let routing = session.routing()?.ok_or_else(|| {
                    TeacherError::Request(format!(
                        "{}: llama.cpp's graph showed no routing for a MoE model",
                        self.name
                    ))
                })?;
                routing
                    .check(fed, shape)
                    .map_err(|e| TeacherError::Request(format!("{}: {e}", self.name)))?;
                Some(routing)
            }
            _ => None,
        };
        Ok(Ran {
            scored,
            generated,
            routing,
        })
    }
}

impl Teacher for LocalTeacher {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.model.limits().vocab
    }

    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let ran = self.run(ids, Some(k), None, Interrupt::default())?;
        let mut scored = ran
            .scored
            .ok_or_else(|| TeacherError::Request("nothing was scored".into()))?;
        scored.routing = ran.routing;
        Ok(scored)
    }

    fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        let ran = self.run(prompt, None, Some(params), Interrupt::default())?;
        ran.generated
            .ok_or_else(|| TeacherError::Request("nothing was generated".into()))
    }

    fn routing(&self) -> Option<&RoutingShape> {
        self.shape.as_ref().filter(|_| self.record)
    }
}
