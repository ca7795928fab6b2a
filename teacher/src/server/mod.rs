//! `k3mini teacher serve`: a local teacher behind the vLLM-compatible OpenAI surface, so every
//! client k3mini has (and any OpenAI-style tool) can talk to it. Requests and responses are the
//! typed structs of [`crate::wire`].
//!
//! - `GET /health`, `GET /v1/models`
//! - `POST /v1/completions`, `POST /v1/chat/completions` ([`openai`])
//! - `POST /generate`, SGLang's native API ([`sglang`])
//! - Routed experts, from a MoE teacher recording its routing (`--enable-return-routed-experts`,
//!   [`LocalTeacher::record_routing`]): the prompt's tokens and every generated one's but the last,
//!   `[tokens, layers, k]` with a dense layer's rows zero.
//!
//! Bad requests get errors in vLLM's JSON shape with status 400/401/404/405/413; a failure inside
//! the model is a 500 with the reason. The HTTP layer is `k3mini_http`'s (hyper); the model runs one
//! request at a time (it uses every core already), so `/health` and `/v1/models` answer while it
//! works. A request the model cannot serve whole (prompt + `max_tokens` beyond its context) or that
//! names an id outside the vocabulary is a 400; beyond `max_queued` model requests running or
//! waiting, another is a 503 with `Retry-After` (k3mini's client retries it). A request stops
//! between tokens at its time limit (504), when its client disconnects, or when the server stops
//! (503).

mod openai;
mod sglang;

use crate::local::LocalTeacher;
use crate::routing::Routing;
use crate::routing::wire::RoutedExperts;
use crate::wire::openai::{ChatRequest, CompletionRequest};
use crate::wire::{ModelCard, ModelList};
use crate::{GenerateParams, Interrupt, Teacher, TeacherError};
use k3mini_http::{Admitted, Peer, Queue, Reply, Request, Turn, bind, parse_body};
pub use k3mini_http::{ApiError, Limits, bad};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Largest `logprobs` / `prompt_logprobs` / `top_logprobs` accepted (vLLM's `--max-logprobs`).
pub const MAX_LOGPROBS: usize = 1000;

/// How `teacher serve` runs.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Model requests running or waiting for the model, at most (at least 1).
    pub max_queued: usize,
    /// How long one model request may take, queueing included.
    pub request_timeout: Option<Duration>,
    /// Connections, heads, bodies, deadlines and the API key.
    pub limits: Limits,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            max_queued: 3,
            request_timeout: Some(Duration::from_secs(300)),
            limits: Limits::default(),
        }
    }
}

/// A place in `queue`, or a 503 (with `Retry-After`) when it is full.
pub fn admit(queue: &Queue) -> Result<Admitted, ApiError> {
    queue
        .admit()
        .map_err(|busy| ApiError::from(TeacherError::Busy(busy.0)))
}

/// The model's turn in `queue`, or the error `interrupt` gives while the request waits.
pub fn turn<'q>(
    queue: &'q Queue,
    admitted: Admitted,
    interrupt: Interrupt,
) -> Result<Turn<'q>, ApiError> {
    Ok(queue.turn(admitted, || interrupt.check())?)
}

impl From<TeacherError> for ApiError {
    fn from(e: TeacherError) -> Self {
        let status = match e {
            TeacherError::Request(_) => 400,
            TeacherError::TimedOut(_) => 504,
            TeacherError::Cancelled(_) | TeacherError::Busy(_) => 503,
            _ => 500,
        };
        ApiError {
            status,
            message: e.to_string(),
            param: None,
        }
    }
}

pub(crate) struct State {
    teacher: Arc<LocalTeacher>,
    /// Each id's text, decoded once (responses name thousands of tokens per request).
    pieces: Vec<String>,
    /// One model request at a time, and a bounded queue for it.
    queue: Queue,
    /// How long one model request may take, queueing included.
    request_timeout: Option<Duration>,
    prompt_cap: PromptCap,
    stop: Arc<AtomicBool>,
    created: u64,
}

/// The most bytes of text a prompt that fits the model's context can hold: the context times
/// the longest token's text. A longer prompt is refused before any of it is tokenized, so a
/// 60 MB prompt costs a comparison, not CPU-seconds and gigabytes.
#[derive(Clone, Copy, Debug)]
pub struct PromptCap {
    pub max_bytes: usize,
    pub context: usize,
}

impl PromptCap {
    /// For a model of `context` tokens whose tokenizer decodes each of its `vocab` ids.
    pub fn of(tokenizer: &k3mini_data::Tokenizer, vocab: usize, context: usize) -> Self {
        let pieces = (0..vocab as u32).map(|id| tokenizer.decode(&[id]).unwrap_or_default());
        Self::of_pieces(pieces, context)
    }

    /// For a model of `context` tokens whose ids decode to `pieces`.
    pub fn of_pieces(pieces: impl IntoIterator<Item = impl AsRef<str>>, context: usize) -> Self {
        let longest = pieces
            .into_iter()
            .map(|p| p.as_ref().len())
            .max()
            .unwrap_or(0)
            // Special tokens decode to nothing, but a prompt may spell one (`<|im_end|>`).
            .max(32);
        Self {
            max_bytes: context.saturating_mul(longest),
            context,
        }
    }

    /// A 400 for `bytes` of prompt text past the cap.
    pub fn check(&self, bytes: usize, param: &str) -> Result<(), ApiError> {
        if bytes <= self.max_bytes {
            return Ok(());
        }
        Err(bad(
            param,
            format!(
                "the prompt's {bytes} bytes cannot fit the model's context of {} tokens (at most \
                 {} bytes): refused without tokenizing it",
                self.context, self.max_bytes
            ),
        ))
    }
}

impl State {
    /// A place for a model request (see [`Queue::admit`]).
    fn admit(&self) -> Result<Admitted, ApiError> {
        admit(&self.queue)
    }

    /// The model's turn for an admitted request (see [`Queue::turn`]).
    fn turn(&self, admitted: Admitted, interrupt: Interrupt) -> Result<Turn<'_>, ApiError> {
        turn(&self.queue, admitted, interrupt)
    }

    /// The routed experts of tokens `start..` (the prompt's, then every generated one's but the
    /// last) in the servers' `[tokens, layers, k]`, where the teacher records routing.
    fn routed(&self, routing: Option<Routing>, start: usize) -> Option<RoutedExperts> {
        let shape = self.teacher.routing()?;
        Some(RoutedExperts::of(&routing?.from_token(start), shape))
    }

    fn token_ids(&self, ids: &[u64], param: &str) -> Result<Vec<u32>, ApiError> {
        token_ids(ids, self.teacher.vocab_size(), param)
    }

    /// A text prompt's ids and its place in the queue (see [`admit_text`]).
    fn admit_text(&self, text: &str, param: &str) -> Result<(Vec<u32>, Admitted), ApiError> {
        admit_text(
            &self.queue,
            &self.teacher.tokenizer,
            &self.prompt_cap,
            text,
            param,
        )
    }

    /// Ids a request gives, checked before they queue, and their place in the queue.
    fn admit_ids(&self, ids: &[u64], param: &str) -> Result<(Vec<u32>, Admitted), ApiError> {
        if ids.is_empty() {
            return Err(bad(param, "the prompt is empty"));
        }
        let ids = self.token_ids(ids, param)?;
        Ok((ids, self.admit()?))
    }

    fn check_length(&self, prompt: usize, p: &GenerateParams) -> Result<(), ApiError> {
        check_length(prompt, p.max_tokens, self.teacher.context_length())
    }

    /// A token as the response names it: its text, or `token_id:N`.
    fn token_key(&self, id: u32, as_ids: bool) -> String {
        if as_ids {
            format!("token_id:{id}")
        } else {
            self.pieces[id as usize].clone()
        }
    }

    fn text(&self, ids: &[u32]) -> String {
        self.teacher.tokenizer.decode(ids).unwrap_or_default()
    }
}

/// A text prompt's ids (special tokens recognised) and its place in `queue`: refused (a 400
/// naming `param`) before it queues when it is longer than any prompt that fits, tokenized only
/// once admitted, and refused when it holds no token.
pub fn admit_text(
    queue: &Queue,
    tokenizer: &k3mini_data::Tokenizer,
    cap: &PromptCap,
    text: &str,
    param: &str,
) -> Result<(Vec<u32>, Admitted), ApiError> {
    cap.check(text.len(), param)?;
    let admitted = admit(queue)?;
    // Special-token strings are read as their ids, as vLLM reads a raw prompt (often one a client
    // rendered from a chat).
    let ids = tokenizer
        .encode_with_specials(text)
        .map_err(|e| bad(param, e.to_string()))?;
    if ids.is_empty() {
        return Err(bad(param, "the prompt is empty"));
    }
    Ok((ids, admitted))
}

/// Refuses a request the model cannot serve whole: the prompt plus `max_tokens` beyond its
/// `context` (vLLM answers this with a 400 too).
pub fn check_length(prompt: usize, max_tokens: usize, context: usize) -> Result<(), ApiError> {
    if prompt.saturating_add(max_tokens) > context {
        return Err(bad(
            "max_tokens",
            format!(
                "this model's maximum context length is {context} tokens; the prompt has \
                 {}{prompt} and max_tokens asks for {max_tokens} more",
                if prompt == 1 { "at least " } else { "" }
            ),
        ));
    }
    Ok(())
}

/// Ids given in a request, each inside a vocabulary of `vocab` (an id past it, `2^32 + 5`
/// included, is a 400, never wrapped or clamped).
pub fn token_ids(ids: &[u64], vocab: usize, param: &str) -> Result<Vec<u32>, ApiError> {
    let vocab = vocab as u64;
    match ids.iter().find(|&&id| id >= vocab) {
        Some(id) => Err(bad(
            param,
            format!("token id {id} is outside the vocabulary of {vocab} ids"),
        )),
        None => Ok(ids.iter().map(|&id| id as u32).collect()),
    }
}

/// The sampling fields every endpoint shares, as a request gives them.
pub struct SamplingFields<'a> {
    pub max_tokens: Option<u64>,
    pub default_max: usize,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub n: Option<u64>,
    pub best_of: Option<u64>,
    pub stop_token_ids: Option<&'a [u64]>,
    pub ignore_eos: Option<bool>,
    pub logprobs: usize,
}

impl State {
    /// The request's sampling, checked: a `max_tokens` that leaves no room for a prompt is
    /// refused here, before the request queues.
    fn params(&self, s: SamplingFields) -> Result<GenerateParams, ApiError> {
        let p = generate_params(s, self.teacher.vocab_size(), self.teacher.meta.eos)?;
        check_length(1, p.max_tokens, self.teacher.context_length())?;
        Ok(p)
    }
}

impl<'a> SamplingFields<'a> {
    /// A `/v1/completions` request's, writing `logprobs` top-k per token.
    pub fn of_completion(req: &'a CompletionRequest, logprobs: usize) -> Self {
        Self {
            max_tokens: req.max_tokens,
            default_max: 16,
            temperature: req.temperature,
            top_p: req.top_p,
            seed: req.seed,
            n: req.n,
            best_of: req.best_of,
            stop_token_ids: req.stop_token_ids.as_deref(),
            ignore_eos: req.ignore_eos,
            logprobs,
        }
    }

    /// A `/v1/chat/completions` request's, writing `logprobs` top-k per token.
    pub fn of_chat(req: &'a ChatRequest, logprobs: usize) -> Self {
        Self {
            max_tokens: req.max_tokens.or(req.max_completion_tokens),
            default_max: 256,
            temperature: req.temperature,
            top_p: req.top_p,
            seed: req.seed,
            n: req.n,
            best_of: None,
            stop_token_ids: req.stop_token_ids.as_deref(),
            ignore_eos: req.ignore_eos,
            logprobs,
        }
    }

    /// The fields of a request for a model of `vocab` ids ending text with `eos`, checked.
    pub fn params(self, vocab: usize, eos: Option<u32>) -> Result<GenerateParams, ApiError> {
        generate_params(self, vocab, eos)
    }
}

fn generate_params(
    s: SamplingFields,
    vocab: usize,
    eos: Option<u32>,
) -> Result<GenerateParams, ApiError> {
    // One completion per request: more are refused rather than silently not made.
    for (key, v) in [("n", s.n), ("best_of", s.best_of)] {
        if v.is_some_and(|v| v != 1) {
            return Err(bad(
                key,
                format!("`{key}` must be 1: this server makes one completion per request"),
            ));
        }
    }
    let mut stop = token_ids(s.stop_token_ids.unwrap_or(&[]), vocab, "stop_token_ids")?;
    if !s.ignore_eos.unwrap_or(false) {
        stop.extend(eos);
    }
    let (temperature, top_p) = (s.temperature.unwrap_or(1.0), s.top_p.unwrap_or(1.0));
    if !(temperature >= 0.0 && temperature.is_finite()) || !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(
            "temperature",
            "temperature must be finite and ≥ 0, and top_p in (0, 1]",
        ));
    }
    Ok(GenerateParams {
        max_tokens: s
            .max_tokens
            .map_or(s.default_max, |n| usize::try_from(n).unwrap_or(usize::MAX)),
        temperature,
        top_p,
        seed: s.seed.unwrap_or(0),
        logprobs: s.logprobs,
        stop,
    })
}

/// `logprobs`-style counts, capped at [`MAX_LOGPROBS`].
pub fn count(v: Option<u64>, key: &str) -> Result<Option<usize>, ApiError> {
    match v {
        Some(k) if k > MAX_LOGPROBS as u64 => Err(bad(
            key,
            format!("`{key}` = {k} exceeds the maximum {MAX_LOGPROBS}"),
        )),
        k => Ok(k.map(|k| k as usize)),
    }
}

/// Serves until `stop` is set. `ready` receives the bound address (port 0 picks a free one). At
/// most `max_queued` model requests run or wait for the model; one that takes longer than
/// `request_timeout` (queueing included) is stopped with a 504, and one whose client disconnects
/// is stopped at the next token.
pub fn serve(
    teacher: Arc<LocalTeacher>,
    addr: &str,
    options: ServeOptions,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), TeacherError> {
    let (listener, local) = bind(addr).map_err(TeacherError::Request)?;
    let pieces: Vec<String> = (0..teacher.vocab_size() as u32)
        .map(|id| teacher.tokenizer.decode(&[id]).unwrap_or_default())
        .collect();
    let prompt_cap = PromptCap::of_pieces(&pieces, teacher.context_length());
    let state = Arc::new(State {
        prompt_cap,
        pieces,
        teacher,
        queue: Queue::new(options.max_queued),
        request_timeout: options.request_timeout,
        stop: stop.clone(),
        created: now_secs(),
    });
    ready(local);
    k3mini_http::serve(listener, options.limits, &stop, move |request, peer| {
        handle(&state, request, peer)
    })
    .map_err(|e| TeacherError::Server(format!("serving {local}: {e}")))
}

/// Seconds since the Unix epoch: a server's `created`.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `GET /v1/models`: the one model a k3mini server serves.
pub fn models(name: &str, created: u64, context: usize) -> Reply {
    Reply::json(
        200,
        &ModelList {
            object: "list".into(),
            data: vec![ModelCard {
                id: name.into(),
                object: "model".into(),
                created,
                owned_by: "k3mini".into(),
                root: Some(name.into()),
                max_model_len: Some(context as u64),
            }],
        },
    )
}

fn handle(state: &State, request: &Request, peer: &Peer) -> Reply {
    let cancelled = || k3mini_http::cancelled(&state.stop, peer.gone());
    let interrupt = Interrupt::from_now(state.request_timeout, &cancelled);
    route(state, request, interrupt).unwrap_or_else(|e| e.reply())
}

/// The paths this server routes.
const PATHS: [&str; 5] = [
    "/health",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
];

fn route(state: &State, r: &Request, interrupt: Interrupt) -> Result<Reply, ApiError> {
    let t = &state.teacher;
    let (method, path) = (r.method.as_str(), r.path.as_str());
    match (method, path) {
        ("GET", "/health") => Ok(Reply::health()),
        ("GET", "/v1/models") => Ok(models(t.name(), state.created, t.context_length())),
        ("POST", "/v1/completions") => Ok(Reply::json(
            200,
            &openai::completions(state, parse_body(&r.body)?, interrupt)?,
        )),
        ("POST", "/v1/chat/completions") => Ok(Reply::json(
            200,
            &openai::chat(state, parse_body(&r.body)?, interrupt)?,
        )),
        ("POST", "/generate") => Ok(Reply::json(
            200,
            &sglang::generate(state, parse_body(&r.body)?, interrupt)?,
        )),
        _ => Err(k3mini_http::unrouted(method, path, &PATHS)),
    }
}
