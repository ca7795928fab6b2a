//! `k3mini teacher serve`: a local teacher behind the vLLM-compatible OpenAI surface, so every
//! client k3mini has (and any OpenAI-style tool) can talk to it.
//!
//! - `GET /health`, `GET /v1/models`
//! - `POST /v1/completions`: `prompt` (text or token ids), `max_tokens` (default 16, 0 allowed with
//!   `echo`), `temperature`, `top_p`, `seed`, `stop_token_ids`, `ignore_eos`; `logprobs: K` (top-K
//!   per generated token, OpenAI legacy shape), `echo` (with `logprobs`: the prompt's tokens and
//!   logprobs first, the first one `null`), `prompt_logprobs: K` (vLLM shape: `[null, {"<id>":
//!   {"logprob", "rank", "decoded_token"}}, …]`, the actual token always included),
//!   `return_token_ids`, `return_tokens_as_token_ids` (`"token_id:123"` keys).
//! - `POST /v1/chat/completions`: `messages` (ChatML), `max_tokens`, `temperature`, `logprobs`,
//!   `top_logprobs`.
//! - `POST /generate` (SGLang's native API): `input_ids` or `text`, `sampling_params`
//!   (`max_new_tokens`, `temperature`, `top_p`, `stop_token_ids`), `return_logprob`,
//!   `logprob_start_len`, `top_logprobs_num`; `meta_info.input_token_logprobs` /
//!   `input_top_logprobs` / `output_token_logprobs` / `output_top_logprobs` as `[logprob, id, null]`.
//! - Routed experts, from a MoE teacher recording its routing (`--enable-return-routed-experts`,
//!   [`LocalTeacher::record_routing`]): the prompt's tokens and every generated one's but the last,
//!   `[tokens, layers, k]` with a dense layer's rows zero. vLLM's `choices[0].routed_experts` (base64
//!   `np.save`, int32) on every completion, from `routed_experts_prompt_start`; SGLang's
//!   `meta_info.routed_experts` (base64 raw int32) when the request sets `return_routed_experts`,
//!   from `routed_experts_start_len`.
//!
//! Bad requests get OpenAI-style errors (`{"error": {"message", "type", "param", "code"}}`) with
//! status 400/404/405; a failure inside the model is a 500 with the reason. Each connection has its
//! thread ([`http`]); the model runs one request at a time (it uses every core already), so
//! `/health` and `/v1/models` answer while it works. A request the model cannot serve whole
//! (prompt + `max_tokens` beyond its context) or that names an id outside the vocabulary is a 400;
//! beyond `max_queued` model requests running or waiting, another is a 503 with `Retry-After`
//! (k3mini's client retries it). A request stops between tokens at its time limit (504), when its
//! client disconnects, or when the server stops (503).

use crate::http;
use crate::local::{LocalTeacher, Ran};
use crate::routing::Routing;
use crate::routing::wire::{self, RoutedExperts};
use crate::{FinishReason, GenerateParams, Interrupt, Teacher, TeacherError};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k3mini_data::ChatFormat;
use k3mini_data::chat::{Message, render};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::Duration;

/// Largest `logprobs` / `prompt_logprobs` / `top_logprobs` accepted (vLLM's `--max-logprobs`).
pub const MAX_LOGPROBS: usize = 1000;

/// An OpenAI-style error.
struct ApiError {
    status: u16,
    message: String,
    param: Option<&'static str>,
}

/// The routed experts of tokens `start..` (the prompt's, then every generated one's but the last)
/// in the servers' `[tokens, layers, k]`, where the teacher records routing.
fn routed(state: &State, routing: Option<Routing>, start: usize) -> Option<RoutedExperts> {
    let shape = state.teacher.routing()?;
    Some(RoutedExperts::of(&routing?.from_token(start), shape))
}

fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        status: 400,
        message: message.into(),
        param: Some(param),
    }
}

impl From<TeacherError> for ApiError {
    fn from(e: TeacherError) -> Self {
        let status = match e {
            TeacherError::Request(_) => 400,
            TeacherError::TimedOut(_) => 504,
            TeacherError::Cancelled(_) => 503,
            _ => 500,
        };
        ApiError {
            status,
            message: e.to_string(),
            param: None,
        }
    }
}

impl ApiError {
    fn body(&self) -> Value {
        let kind = if self.status >= 500 {
            "internal_server_error"
        } else {
            "invalid_request_error"
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}})
    }
}

struct State {
    teacher: Arc<LocalTeacher>,
    /// Each id's text, decoded once (responses name thousands of tokens per request).
    pieces: Vec<String>,
    /// One forward pass at a time.
    compute: Mutex<()>,
    /// Model requests running or waiting for `compute`, and how many may.
    admitted: AtomicUsize,
    capacity: usize,
    /// How long one model request may take, queueing included.
    request_timeout: Option<Duration>,
    stop: Arc<AtomicBool>,
    created: u64,
}

/// A model request's place among the admitted, given back when dropped.
struct Admitted<'a>(&'a AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A model request's turn: the compute lock, and its place among the admitted.
struct Turn<'a> {
    _compute: std::sync::MutexGuard<'a, ()>,
    _admitted: Admitted<'a>,
}

impl State {
    /// Waits for the model, or refuses with a 503 (and `Retry-After`) when the queue is full. A
    /// queued request whose `interrupt` fires leaves the queue.
    fn turn(&self, interrupt: Interrupt) -> Result<Turn<'_>, ApiError> {
        let before = self.admitted.fetch_add(1, Ordering::SeqCst);
        let admitted = Admitted(&self.admitted);
        if before >= self.capacity {
            return Err(ApiError {
                status: 503,
                message: format!(
                    "the teacher is busy: {before} requests are running or queued (at most {}); \
                     retry shortly",
                    self.capacity
                ),
                param: None,
            });
        }
        let compute = loop {
            match self.compute.try_lock() {
                Ok(guard) => break guard,
                Err(TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    interrupt.check()?;
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        Ok(Turn {
            _compute: compute,
            _admitted: admitted,
        })
    }
}

/// Serves until `stop` is set. `ready` receives the bound address (port 0 picks a free one). At
/// most `max_queued` model requests run or wait for the model; one that takes longer than
/// `request_timeout` (queueing included) is stopped with a 504, and one whose client disconnects
/// is stopped at the next token.
pub fn serve(
    teacher: Arc<LocalTeacher>,
    addr: &str,
    max_queued: usize,
    request_timeout: Option<Duration>,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<(), TeacherError> {
    let listen_err =
        |e: std::io::Error| TeacherError::Request(format!("cannot listen on {addr}: {e}"));
    let listener = std::net::TcpListener::bind(addr).map_err(listen_err)?;
    let local = listener.local_addr().map_err(listen_err)?;
    let pieces = (0..teacher.vocab_size() as u32)
        .map(|id| teacher.tokenizer.decode(&[id]).unwrap_or_default())
        .collect();
    let state = State {
        pieces,
        teacher,
        compute: Mutex::new(()),
        admitted: AtomicUsize::new(0),
        capacity: max_queued.max(1),
        request_timeout,
        stop: stop.clone(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    ready(local);
    http::serve(listener, &stop, &|request, peer| {
        handle(&state, request, peer)
    })
    .map_err(|e| TeacherError::Server(format!("serving {local}: {e}")))
}

fn handle(
    state: &State,
    request: Result<&http::Request, http::HttpError>,
    peer: &http::Peer,
) -> http::Response {
    let cancelled = || {
        if state.stop.load(Ordering::SeqCst) {
            Some("the server is shutting down")
        } else if peer.gone() {
            Some("the client disconnected")
        } else {
            None
        }
    };
    let interrupt = Interrupt {
        deadline: state
            .request_timeout
            .map(|limit| (std::time::Instant::now() + limit, limit)),
        cancelled: Some(&cancelled),
    };
    let result = match request {
        Ok(r) => route(state, &r.method, &r.path, &r.body, interrupt),
        Err(e) => Err(ApiError {
            status: e.status,
            message: e.message,
            param: None,
        }),
    };
    let (status, value) = match result {
        Ok(v) => (200, v),
        Err(e) => (e.status, e.body()),
    };
    http::Response {
        status,
        content_type: "application/json",
        body: value.to_string().into_bytes(),
        retry_after: (status == 503).then_some(1),
    }
}

fn route(
    state: &State,
    method: &str,
    url: &str,
    body: &[u8],
    interrupt: Interrupt,
) -> Result<Value, ApiError> {
    let name = state.teacher.name();
    match (method, url) {
        ("GET", "/health") => Ok(json!({"status": "ok"})),
        ("GET", "/v1/models") => Ok(json!({"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "k3mini",
            "max_model_len": state.teacher.context_length()}]})),
        ("POST", "/v1/completions") => completions(state, &parse(body)?, interrupt),
        ("POST", "/v1/chat/completions") => chat(state, &parse(body)?, interrupt),
        ("POST", "/generate") => sglang_generate(state, &parse(body)?, interrupt),
        (
            _,
            "/health" | "/v1/models" | "/v1/completions" | "/v1/chat/completions" | "/generate",
        ) => Err(ApiError {
            status: 405,
            message: format!("{method} is not allowed on {url}"),
            param: None,
        }),
        _ => Err(ApiError {
            status: 404,
            message: format!("no route {url}"),
            param: None,
        }),
    }
}

fn parse(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad("body", format!("invalid JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad("body", "the request must be a JSON object"));
    }
    Ok(v)
}

fn uint(req: &Value, key: &'static str, default: usize) -> Result<usize, ApiError> {
    match req.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| bad(key, format!("`{key}` must be a non-negative integer"))),
    }
}

fn float(req: &Value, key: &'static str, default: f32) -> Result<f32, ApiError> {
    match req.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| bad(key, format!("`{key}` must be a number"))),
    }
}

fn flag(req: &Value, key: &'static str) -> Result<bool, ApiError> {
    match req.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(key, format!("`{key}` must be a boolean"))),
    }
}

/// `logprobs`-style counts: absent or null = none; capped at [`MAX_LOGPROBS`].
fn count(req: &Value, key: &'static str) -> Result<Option<usize>, ApiError> {
    if req.get(key).is_none_or(Value::is_null) {
        return Ok(None);
    }
    let k = uint(req, key, 0)?;
    if k > MAX_LOGPROBS {
        return Err(bad(
            key,
            format!("`{key}` = {k} exceeds the maximum {MAX_LOGPROBS}"),
        ));
    }
    Ok(Some(k))
}

/// A JSON list of token ids, each inside the vocabulary (an id past it, `2^32 + 5` included, is a
/// 400, never wrapped or clamped); `None` when `v` is not a list of non-negative integers.
fn token_ids(state: &State, v: &[Value], key: &'static str) -> Option<Result<Vec<u32>, ApiError>> {
    let vocab = state.teacher.vocab_size() as u64;
    let ids: Vec<u64> = v.iter().map(Value::as_u64).collect::<Option<_>>()?;
    Some(match ids.iter().find(|&&id| id >= vocab) {
        Some(id) => Err(bad(
            key,
            format!("token id {id} is outside the vocabulary of {vocab} ids"),
        )),
        None => Ok(ids.into_iter().map(|id| id as u32).collect()),
    })
}

/// Refuses a request the model cannot serve whole: the prompt plus `max_tokens` beyond its
/// context (vLLM answers this with a 400 too).
fn check_length(state: &State, prompt: usize, p: &GenerateParams) -> Result<(), ApiError> {
    let max = state.teacher.context_length();
    if prompt.saturating_add(p.max_tokens) > max {
        return Err(bad(
            "max_tokens",
            format!(
                "this model's maximum context length is {max} tokens; the prompt has {prompt} \
                 and max_tokens asks for {} more",
                p.max_tokens
            ),
        ));
    }
    Ok(())
}

/// The prompt as ids: a string (tokenized, special tokens recognised) or a list of ids.
fn prompt_ids(state: &State, req: &Value) -> Result<Vec<u32>, ApiError> {
    let ids = match req.get("prompt") {
        Some(Value::String(s)) => state
            .teacher
            .tokenizer
            .encode(s)
            .map_err(|e| bad("prompt", e.to_string()))?,
        Some(Value::Array(a)) => token_ids(state, a, "prompt").unwrap_or_else(|| {
            Err(bad(
                "prompt",
                "a prompt list must hold token ids (one prompt per request)",
            ))
        })?,
        _ => {
            return Err(bad(
                "prompt",
                "`prompt` must be a string or a list of token ids",
            ));
        }
    };
    if ids.is_empty() {
        return Err(bad("prompt", "the prompt is empty"));
    }
    Ok(ids)
}

/// A token as the response names it: its text, or `token_id:N`.
fn token_key(state: &State, id: u32, as_ids: bool) -> String {
    if as_ids {
        format!("token_id:{id}")
    } else {
        state.pieces[id as usize].clone()
    }
}

fn params(state: &State, req: &Value, default_max: usize) -> Result<GenerateParams, ApiError> {
    let list = |v: &Value| match v {
        Value::Array(a) => token_ids(state, a, "stop_token_ids"),
        _ => None,
    };
    let mut stop: Vec<u32> = match req.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => list(v).unwrap_or_else(|| {
            Err(bad(
                "stop_token_ids",
                "`stop_token_ids` must be a list of ids",
            ))
        })?,
    };
    // One completion per request: more are refused rather than silently not made.
    for key in ["n", "best_of"] {
        if uint(req, key, 1)? != 1 {
            return Err(bad(
                key,
                format!("`{key}` must be 1: this server makes one completion per request"),
            ));
        }
    }
    if !flag(req, "ignore_eos")? {
        stop.extend(state.teacher.meta.eos);
    }
    let temperature = float(req, "temperature", 1.0)?;
    let top_p = float(req, "top_p", 1.0)?;
    if !(temperature >= 0.0) || !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad(
            "temperature",
            "temperature must be ≥ 0 and top_p in (0, 1]",
        ));
    }
    Ok(GenerateParams {
        max_tokens: uint(req, "max_tokens", default_max)?,
        temperature,
        top_p,
        seed: uint(req, "seed", 0)? as u64,
        logprobs: 0,
        stop,
    })
}

fn completions(state: &State, req: &Value, interrupt: Interrupt) -> Result<Value, ApiError> {
    let ids = prompt_ids(state, req)?;
    let mut p = params(state, req, 16)?;
    check_length(state, ids.len(), &p)?;
    let logprobs = count(req, "logprobs")?;
    let prompt_logprobs = count(req, "prompt_logprobs")?;
    let echo = flag(req, "echo")?;
    let as_ids = flag(req, "return_tokens_as_token_ids")?;
    p.logprobs = logprobs.unwrap_or(0);
    let t = &state.teacher;
    let _guard = state.turn(interrupt)?;
    // Prompt scoring (for echo + logprobs and for prompt_logprobs) over the whole prompt.
    let want_prompt = prompt_logprobs.or(if echo { logprobs } else { None });
    let score_k = want_prompt.filter(|_| ids.len() >= 2).map(|k| k.max(1));
    // One prefill serves both the prompt's logprobs and the generation.
    let Ran {
        scored,
        generated,
        routing,
    } = t.run(&ids, score_k, (p.max_tokens > 0).then_some(&p), interrupt)?;
    drop(_guard);
    let tok = |id: u32| token_key(state, id, as_ids);
    let text = |ids: &[u32]| t.tokenizer.decode(ids).unwrap_or_default();
    let out_ids: Vec<u32> = generated.as_ref().map_or_else(Vec::new, |g| g.ids.clone());
    let mut choice = json!({
        "index": 0,
        "text": if echo { text(&ids) + &text(&out_ids) } else { text(&out_ids) },
        "finish_reason": match generated.as_ref().map(|g| g.finish) {
            Some(FinishReason::Stop) => "stop",
            _ => "length",
        },
        "logprobs": Value::Null,
    });
    if let (Some(k), Some(s)) = (prompt_logprobs, &scored) {
        // vLLM: position 0 has no distribution; each entry holds the top-k and the actual token.
        let mut entries = vec![Value::Null];
        for pos in 0..s.positions() {
            let mut m = serde_json::Map::new();
            let actual = s.ids[pos + 1];
            for r in 0..k.max(1).min(s.k) {
                let (id, lp) = (s.top_ids[pos * s.k + r], s.top_logprobs[pos * s.k + r]);
                m.insert(
                    id.to_string(),
                    json!({"logprob": lp, "rank": r + 1, "decoded_token": tok(id)}),
                );
            }
            if !m.contains_key(&actual.to_string()) {
                let lp = s.target_logprobs[pos];
                let rank = 1 + s.top_logprobs[pos * s.k..(pos + 1) * s.k]
                    .iter()
                    .filter(|&&x| x > lp)
                    .count();
                m.insert(
                    actual.to_string(),
                    json!({"logprob": lp, "rank": rank, "decoded_token": tok(actual)}),
                );
            }
            entries.push(Value::Object(m));
        }
        choice["prompt_logprobs"] = Value::Array(entries);
    }
    if let Some(k) = logprobs {
        let top_map = |ids: &[u32], lps: &[f32]| -> Value {
            let mut m = serde_json::Map::new();
            for (id, lp) in ids.iter().zip(lps).take(k) {
                m.insert(tok(*id), json!(lp));
            }
            Value::Object(m)
        };
        let (mut tokens, mut token_logprobs, mut tops) = (Vec::new(), Vec::new(), Vec::new());
        if echo {
            tokens.push(json!(tok(ids[0])));
            token_logprobs.push(Value::Null);
            tops.push(Value::Null);
            if let Some(s) = &scored {
                for pos in 0..s.positions() {
                    tokens.push(json!(tok(s.ids[pos + 1])));
                    token_logprobs.push(json!(s.target_logprobs[pos]));
                    let r = pos * s.k..(pos + 1) * s.k;
                    tops.push(top_map(&s.top_ids[r.clone()], &s.top_logprobs[r]));
                }
            }
        }
        if let Some(g) = &generated {
            for (i, id) in g.ids.iter().enumerate() {
                tokens.push(json!(tok(*id)));
                token_logprobs.push(json!(g.logprobs[i]));
                let r = i * g.k..(i + 1) * g.k;
                tops.push(top_map(&g.top_ids[r.clone()], &g.top_logprobs[r]));
            }
        }
        choice["logprobs"] =
            json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops});
    }
    if flag(req, "return_token_ids")? {
        choice["prompt_token_ids"] = json!(ids);
        choice["token_ids"] = json!(out_ids);
    }
    // vLLM returns them on every request once the server is started to.
    let start = uint(req, "routed_experts_prompt_start", 0)?;
    if let Some(r) = routed(state, routing, start) {
        choice["routed_experts"] = json!(STANDARD.encode(wire::to_npy(&r)));
    }
    Ok(json!({
        "id": format!("cmpl-{}", state.created),
        "object": "text_completion",
        "created": state.created,
        "model": t.name(),
        "choices": [choice],
        "usage": {"prompt_tokens": ids.len(), "completion_tokens": out_ids.len(),
                  "total_tokens": ids.len() + out_ids.len()},
    }))
}

fn chat(state: &State, req: &Value, interrupt: Interrupt) -> Result<Value, ApiError> {
    let messages: Vec<Message> = serde_json::from_value(
        req.get("messages").cloned().unwrap_or(Value::Null),
    )
    .map_err(|e| {
        bad(
            "messages",
            format!("`messages` must be a list of {{role, content}}: {e}"),
        )
    })?;
    let rendered =
        render(&messages, ChatFormat::Chatml, true).map_err(|e| bad("messages", e.to_string()))?;
    let t = &state.teacher;
    let (ids, _) = rendered
        .encode(&t.tokenizer)
        .map_err(|e| bad("messages", e.to_string()))?;
    let mut p = params(state, req, 256)?;
    check_length(state, ids.len(), &p)?;
    let want = flag(req, "logprobs")?;
    let top = count(req, "top_logprobs")?.unwrap_or(0);
    if top > 0 && !want {
        return Err(bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    p.logprobs = top;
    let g = {
        let _guard = state.turn(interrupt)?;
        t.run(&ids, None, Some(&p), interrupt)?
            .generated
            .expect("generation was asked for")
    };
    let content_ids: Vec<u32> = g
        .ids
        .iter()
        .copied()
        .filter(|id| !p.stop.contains(id))
        .collect();
    let mut choice = json!({
        "index": 0,
        "message": {"role": "assistant", "content": t.tokenizer.decode(&content_ids).unwrap_or_default()},
        "finish_reason": if g.finish == FinishReason::Stop { "stop" } else { "length" },
        "logprobs": Value::Null,
    });
    if want {
        let content: Vec<Value> = g
            .ids
            .iter()
            .enumerate()
            .map(|(i, &id)| {
                let tops: Vec<Value> = (0..g.k)
                    .map(|r| {
                        let tid = g.top_ids[i * g.k + r];
                        json!({"token": token_key(state, tid, false), "logprob": g.top_logprobs[i * g.k + r]})
                    })
                    .collect();
                json!({"token": token_key(state, id, false), "logprob": g.logprobs[i], "top_logprobs": tops})
            })
            .collect();
        choice["logprobs"] = json!({"content": content});
    }
    Ok(json!({
        "id": format!("chatcmpl-{}", state.created),
        "object": "chat.completion",
        "created": state.created,
        "model": t.name(),
        "choices": [choice],
        "usage": {"prompt_tokens": ids.len(), "completion_tokens": g.ids.len(),
                  "total_tokens": ids.len() + g.ids.len()},
    }))
}

/// SGLang's `/generate`.
fn sglang_generate(state: &State, req: &Value, interrupt: Interrupt) -> Result<Value, ApiError> {
    let t = &state.teacher;
    let malformed = || {
        bad(
            "input_ids",
            "give `input_ids` (a non-empty list of ids) or `text`",
        )
    };
    let listed = match req.get("input_ids") {
        Some(Value::Array(a)) if !a.is_empty() => {
            Some(token_ids(state, a, "input_ids").unwrap_or_else(|| Err(malformed())))
        }
        Some(_) => Some(Err(malformed())),
        None => None,
    };
    let ids: Vec<u32> = match (listed, req.get("text")) {
        (Some(ids), _) => ids?,
        (None, Some(Value::String(text))) if !text.is_empty() => t
            .tokenizer
            .encode(text)
            .map_err(|e| bad("text", e.to_string()))?,
        _ => return Err(malformed()),
    };
    let sampling = req.get("sampling_params").cloned().unwrap_or(json!({}));
    if !sampling.is_object() {
        return Err(bad(
            "sampling_params",
            "`sampling_params` must be an object",
        ));
    }
    let mut p = params(state, &sampling, 128)?;
    if let Some(n) = sampling.get("max_new_tokens") {
        p.max_tokens = n
            .as_u64()
            .ok_or_else(|| bad("sampling_params", "`max_new_tokens` must be an integer"))?
            as usize;
    }
    check_length(state, ids.len(), &p)?;
    let want = flag(req, "return_logprob")?;
    let top = count(req, "top_logprobs_num")?.unwrap_or(0);
    let start = uint(req, "logprob_start_len", 0)?;
    p.logprobs = top;
    let Ran {
        scored,
        generated,
        routing,
    } = {
        let _guard = state.turn(interrupt)?;
        let score_k = (want && ids.len() >= 2).then_some(top.max(1));
        t.run(&ids, score_k, (p.max_tokens > 0).then_some(&p), interrupt)?
    };
    let routed_start = uint(req, "routed_experts_start_len", 0)?;
    let routed = match flag(req, "return_routed_experts")? {
        true => Some(routed(state, routing, routed_start).ok_or_else(|| {
            bad(
                "return_routed_experts",
                "this server does not return routed experts: start it with \
                 --enable-return-routed-experts (the model must be a MoE)",
            )
        })?),
        false => None,
    };
    let out_ids: Vec<u32> = generated.as_ref().map_or_else(Vec::new, |g| g.ids.clone());
    let entry = |lp: Option<f32>, id: u32| json!([lp, id, Value::Null]);
    let tops = |ids: &[u32], lps: &[f32]| -> Value {
        Value::Array(
            ids.iter()
                .zip(lps)
                .map(|(&i, &l)| entry(Some(l), i))
                .collect(),
        )
    };
    let mut meta = json!({
        "prompt_tokens": ids.len(),
        "completion_tokens": out_ids.len(),
        "finish_reason": {"type": match generated.as_ref().map(|g| g.finish) {
            Some(FinishReason::Stop) => "stop",
            _ => "length",
        }},
    });
    if let Some(r) = routed {
        meta["routed_experts"] = json!(wire::to_sglang(&r));
    }
    if want {
        // Position i's logprob is that of token i given the tokens before it: none for token 0.
        let (mut input, mut input_top) = (Vec::new(), Vec::new());
        for (i, &id) in ids.iter().enumerate().skip(start) {
            match (&scored, i) {
                (Some(s), i) if i >= 1 => {
                    let r = (i - 1) * s.k..i * s.k;
                    input.push(entry(Some(s.target_logprobs[i - 1]), id));
                    input_top.push(if top > 0 {
                        tops(&s.top_ids[r.clone()], &s.top_logprobs[r])
                    } else {
                        Value::Null
                    });
                }
                _ => {
                    input.push(entry(None, id));
                    input_top.push(Value::Null);
                }
            }
        }
        meta["input_token_logprobs"] = Value::Array(input);
        meta["input_top_logprobs"] = Value::Array(input_top);
        if let Some(g) = &generated {
            meta["output_token_logprobs"] = Value::Array(
                g.ids
                    .iter()
                    .zip(&g.logprobs)
                    .map(|(&i, &l)| entry(Some(l), i))
                    .collect(),
            );
            meta["output_top_logprobs"] = Value::Array(
                (0..g.ids.len())
                    .map(|i| {
                        tops(
                            &g.top_ids[i * g.k..(i + 1) * g.k],
                            &g.top_logprobs[i * g.k..(i + 1) * g.k],
                        )
                    })
                    .collect(),
            );
        }
    }
    Ok(json!({
        "text": t.tokenizer.decode(&out_ids).unwrap_or_default(),
        "output_ids": out_ids,
        "meta_info": meta,
    }))
}
