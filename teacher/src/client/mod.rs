//! A teacher behind an HTTP server: vLLM's OpenAI-compatible surface, SGLang's native API, or
//! OpenAI legacy completions with `echo` (all three served by `k3mini teacher serve` too). One
//! client type per API ([`vllm`], [`sglang`], [`openai`]) behind [`ApiClient`]; what they share
//! (endpoints, retries, the key, error mapping) is [`endpoints`], and what they check every id
//! against is [`Vocab`].
//!
//! Requests go round-robin over the endpoints; a connection error, a timeout, 429 or a 5xx is
//! retried on the next endpoint after an exponential backoff with jitter; a malformed response (a
//! missing position, an id outside the vocabulary, the actual token absent) is an error naming
//! what is wrong, never a silently wrong shard.

mod endpoints;
mod openai;
mod sglang;
mod vllm;

use crate::routing::Routing;
use crate::routing::wire::{RoutedExperts, RoutingShape, WireError};
use crate::wire::{ModelList, openai::CompletionResponse};
use crate::{GenerateParams, Generation, Scored, Teacher, TeacherError};
use endpoints::Endpoints;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Which server API to speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Vllm,
    Sglang,
    /// OpenAI legacy completions with `echo` (llama-cpp-python's server).
    Openai,
}

/// Token text → id for servers that name tokens by text: `None` where several ids share a text.
pub type PieceMap = HashMap<String, Option<u32>>;

/// The map from each id's text (`decode(id)`) back to the id.
pub fn piece_map(vocab_size: usize, decode: impl Fn(u32) -> Option<String>) -> PieceMap {
    let mut map = PieceMap::new();
    for id in 0..vocab_size as u32 {
        if let Some(text) = decode(id) {
            map.entry(text)
                .and_modify(|e| *e = None)
                .or_insert(Some(id));
        }
    }
    map
}

#[derive(Clone, Debug)]
pub struct ClientOptions {
    pub api: Api,
    pub timeout: Duration,
    /// Attempts after the first.
    pub retries: usize,
    /// First backoff; doubles per retry (with up to 50% jitter).
    pub backoff: Duration,
    /// Most tokens per scoring request: a server builds a `[tokens × vocab]` logprob tensor for
    /// the prompt (~7.5 GiB at 8192 × 152k), so longer sequences are scored in windows.
    pub max_request_tokens: usize,
    /// Tokens of left context each window after the first re-reads (their positions are not
    /// kept again): positions past the first window see at least this much context.
    pub window_overlap: usize,
    /// For [`Api::Openai`] servers that name tokens by text (see [`piece_map`]).
    pub pieces: Option<Arc<PieceMap>>,
    /// Read every scored sequence's routed experts (the server started with
    /// `--enable-return-routed-experts`), checked against the teacher's routing as given.
    pub routing: Option<RoutingShape>,
    /// Sent as `Authorization: Bearer …` (vLLM's `--api-key`).
    pub api_key: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            api: Api::Vllm,
            timeout: Duration::from_secs(600),
            retries: 5,
            backoff: Duration::from_millis(500),
            max_request_tokens: 4096,
            window_overlap: 1024,
            pieces: None,
            routing: None,
            api_key: None,
        }
    }
}

fn server_err(message: impl Into<String>) -> TeacherError {
    TeacherError::Server(message.into())
}

/// The ids a server may name: below the student's vocabulary, or (servers that name tokens by
/// text) mapped back through its pieces.
pub(crate) struct Vocab {
    size: usize,
    pieces: Option<Arc<PieceMap>>,
}

impl Vocab {
    fn check(&self, id: u64, what: &str) -> Result<u32, TeacherError> {
        if id >= self.size as u64 {
            return Err(server_err(format!(
                "{what}: id {id} is outside the vocabulary of {} (teacher and student \
                 vocabularies differ?)",
                self.size
            )));
        }
        Ok(id as u32)
    }

    fn check_all(&self, ids: &[u64], what: &str) -> Result<Vec<u32>, TeacherError> {
        ids.iter().map(|&id| self.check(id, what)).collect()
    }

    /// A token as an OpenAI-style response names it: `token_id:N`, or its text.
    fn key(&self, key: &str, what: &str) -> Result<u32, TeacherError> {
        if let Some(id) = key.strip_prefix("token_id:") {
            let id = id
                .parse::<u64>()
                .map_err(|_| server_err(format!("{what}: {key:?} is not token_id:N")))?;
            return self.check(id, what);
        }
        let Some(pieces) = &self.pieces else {
            return Err(server_err(format!(
                "{what}: the server names tokens by text ({key:?}), not token_id:N, and no \
                 tokenizer was given to map text to ids"
            )));
        };
        match pieces.get(key) {
            Some(Some(id)) => Ok(*id),
            Some(None) => Err(server_err(format!(
                "{what}: token text {key:?} is ambiguous (several ids decode to it): this server \
                 cannot be scored exactly; use one that returns token ids"
            ))),
            None => Err(server_err(format!(
                "{what}: token text {key:?} is not in the tokenizer (teacher and student \
                 tokenizers differ?)"
            ))),
        }
    }
}

/// What every API's client works with: the endpoints, the vocabulary, the served model's name
/// and the teacher's routing (when it is read).
pub(crate) struct Shared {
    http: Endpoints,
    vocab: Vocab,
    model: String,
    routing: Option<RoutingShape>,
}

impl Shared {
    /// The routing of a scored window's `n − 1` tokens from the `sent` tokens of a payload,
    /// checked against the teacher's routing; None when it was not asked for.
    fn routing_of(
        &self,
        payload: impl FnOnce(&RoutingShape) -> Result<Option<RoutedExperts>, WireError>,
        sent: usize,
        n: usize,
    ) -> Result<Option<Routing>, TeacherError> {
        let Some(shape) = &self.routing else {
            return Ok(None);
        };
        let r = payload(shape)
            .and_then(|r| {
                let r = r.ok_or_else(|| {
                    WireError::Malformed(
                        "the response has none (was the server started with \
                         --enable-return-routed-experts?)"
                            .into(),
                    )
                })?;
                r.check(sent, shape)?;
                Ok(r)
            })
            .map_err(|e| server_err(e.to_string()))?;
        Ok(Some(r.routing(shape, n - 1)))
    }

    /// The one choice of a completions response.
    fn only_choice<T>(choices: Vec<T>) -> Result<T, TeacherError> {
        let n = choices.len();
        choices
            .into_iter()
            .next()
            .filter(|_| n == 1)
            .ok_or_else(|| server_err(format!("the response has {n} choices, not 1")))
    }

    fn completion(
        &self,
        request: &crate::wire::openai::CompletionRequest,
    ) -> Result<CompletionResponse, TeacherError> {
        self.http.post("/v1/completions", request)
    }
}

/// One server API: scoring one window, generating, and the server's tokenization of a text.
pub(crate) trait ApiClient: Send + Sync {
    /// Top-k logprobs at every position of `ids` (at most `max_request_tokens` of them).
    fn score(&self, s: &Shared, ids: &[u32], k: usize) -> Result<Scored, TeacherError>;
    /// OpenAI legacy completions with per-token logprobs, by default (vLLM's and OpenAI's).
    fn generate(
        &self,
        s: &Shared,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        openai::generate(s, prompt, params)
    }
    fn token_ids(&self, s: &Shared, text: &str) -> Result<Vec<u32>, TeacherError>;
}

pub struct HttpTeacher {
    shared: Shared,
    api: Box<dyn ApiClient>,
    max_request_tokens: usize,
    window_overlap: usize,
}

/// Appends the `k` best of `entries` (by logprob, ties by id) to `ids` / `logprobs`.
fn push_top(mut entries: Vec<(u32, f32)>, k: usize, ids: &mut Vec<u32>, logprobs: &mut Vec<f32>) {
    entries.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for (id, lp) in entries.into_iter().take(k) {
        ids.push(id);
        logprobs.push(lp);
    }
}

/// `row` (at least `k` entries, or an error naming `what`) pushed as its top `k`.
fn push_row(
    row: Vec<(u32, f32)>,
    k: usize,
    what: &str,
    ids: &mut Vec<u32>,
    logprobs: &mut Vec<f32>,
) -> Result<(), TeacherError> {
    if row.len() < k {
        return Err(server_err(format!(
            "{what} holds {} entries, fewer than k = {k}",
            row.len()
        )));
    }
    push_top(row, k, ids, logprobs);
    Ok(())
}

impl HttpTeacher {
    /// Connects to `endpoints` (`http://host:port`), asking the first that answers for its model.
    /// `vocab_size` is the student's (the ids the server returns must fall inside it).
    pub fn connect(
        endpoints: &[String],
        vocab_size: usize,
        opts: ClientOptions,
    ) -> Result<Self, TeacherError> {
        if endpoints.is_empty() {
            return Err(server_err("no teacher endpoints given"));
        }
        let api: Box<dyn ApiClient> = match opts.api {
            Api::Vllm => Box::new(vllm::Vllm),
            Api::Sglang => Box::new(sglang::Sglang),
            Api::Openai if opts.routing.is_some() => {
                return Err(TeacherError::Request(
                    "OpenAI-echo servers return no routed experts: use api = \"vllm\" or \
                     \"sglang\""
                        .into(),
                ));
            }
            Api::Openai => Box::new(openai::Openai),
        };
        let http = Endpoints::new(endpoints, &opts);
        let models: ModelList = http.get("/v1/models")?;
        let model = models
            .data
            .into_iter()
            .next()
            .ok_or_else(|| server_err("/v1/models lists no model"))?
            .id;
        Ok(Self {
            shared: Shared {
                http,
                vocab: Vocab {
                    size: vocab_size,
                    pieces: opts.pieces,
                },
                model,
                routing: opts.routing,
            },
            api,
            max_request_tokens: opts.max_request_tokens,
            window_overlap: opts.window_overlap,
        })
    }

    /// The server's tokenization of `text` (for the tokenizer-agreement probe).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, TeacherError> {
        self.api.token_ids(&self.shared, text)
    }
}

impl Teacher for HttpTeacher {
    fn name(&self) -> &str {
        &self.shared.model
    }

    fn requests(&self) -> Option<crate::Requests> {
        Some(self.shared.http.requests())
    }

    fn vocab_size(&self) -> usize {
        self.shared.vocab.size
    }

    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        if ids.len() < 2 {
            return Err(TeacherError::Request(
                "scoring needs 2 or more tokens".into(),
            ));
        }
        let (m, overlap) = (self.max_request_tokens, self.window_overlap);
        if m <= overlap + 1 {
            return Err(TeacherError::Request(format!(
                "max_request_tokens {m} must exceed window_overlap {overlap} + 1"
            )));
        }
        let mut out = Scored::empty(ids, k);
        let mut start = 0;
        // Windows [start, start + m) stepping by m − overlap; each contributes the positions it
        // is the first to reach.
        loop {
            let end = (start + m).min(ids.len());
            let s = self.api.score(&self.shared, &ids[start..end], k)?;
            let skip = out.positions() - start; // positions this window repeats
            out.target_logprobs
                .extend_from_slice(&s.target_logprobs[skip..]);
            out.top_ids.extend_from_slice(&s.top_ids[skip * k..]);
            out.top_logprobs
                .extend_from_slice(&s.top_logprobs[skip * k..]);
            if let Some(r) = s.routing {
                let r = r.from_token(skip);
                match &mut out.routing {
                    Some(all) => all.extend(r),
                    None => out.routing = Some(r),
                }
            }
            if end == ids.len() {
                return Ok(out);
            }
            start = end - overlap - 1;
        }
    }

    fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        self.api.generate(&self.shared, prompt, params)
    }

    fn routing(&self) -> Option<&RoutingShape> {
        self.shared.routing.as_ref()
    }
}
