//! A teacher behind an HTTP server: vLLM's OpenAI-compatible surface or SGLang's native API (both
//! served by `k3mini teacher serve` too).
//!
//! vLLM. Scoring a fixed sequence: `POST /v1/completions {"prompt": ids, "max_tokens": 1,
//! "prompt_logprobs": k, "temperature": 0}`; `choices[0].prompt_logprobs` is `[null, {"<id>":
//! {"logprob", "rank"}}, …]` with the actual token always present (so up to k + 1 entries).
//! Generation: `logprobs: k` with `return_token_ids` and `return_tokens_as_token_ids`.
//!
//! SGLang. `POST /generate {"input_ids", "sampling_params": {"max_new_tokens"}, "return_logprob":
//! true, "logprob_start_len": 0, "top_logprobs_num": k}`; `meta_info.input_token_logprobs` and
//! `input_top_logprobs` hold `[logprob, id, text|null]` per position (none for position 0),
//! `output_token_logprobs` / `output_top_logprobs` likewise for generated tokens.
//!
//! OpenAI legacy echo (llama-cpp-python's server, vLLM): `POST /v1/completions {"prompt": ids,
//! "echo": true, "logprobs": k, "max_tokens": 1}`; `choices[0].logprobs` holds `tokens`,
//! `token_logprobs` (null first) and `top_logprobs` (maps token → logprob) for the prompt, then for
//! the one generated token, which is dropped. Tokens are named `token_id:N` where the server honours
//! `return_tokens_as_token_ids`, else by their text, mapped back to ids through
//! [`ClientOptions::pieces`] (a text two ids share is refused as ambiguous).
//!
//! Requests go round-robin over the endpoints; a connection error, a timeout, 429 or a 5xx is
//! retried on the next endpoint after an exponential backoff with jitter; a malformed response (a
//! missing position, an id outside the vocabulary, the actual token absent) is an error naming
//! what is wrong, never a silently wrong shard.

use crate::routing::Routing;
use crate::routing::wire::{self, RoutedExperts, RoutingShape, WireError};
use crate::{FinishReason, GenerateParams, Generation, Scored, Teacher, TeacherError};
use k3mini_data::rng::splitmix64;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
        }
    }
}

pub struct HttpTeacher {
    endpoints: Vec<String>,
    model: String,
    vocab_size: usize,
    agent: ureq::Agent,
    opts: ClientOptions,
    next: AtomicUsize,
    jitter: AtomicU64,
}

/// Appends the `k` best of `entries` (by logprob, ties by id) to `ids` / `logprobs`.
fn push_top(mut entries: Vec<(u32, f32)>, k: usize, ids: &mut Vec<u32>, logprobs: &mut Vec<f32>) {
    entries.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for (id, lp) in entries.into_iter().take(k) {
        ids.push(id);
        logprobs.push(lp);
    }
}

fn server_err(message: impl Into<String>) -> TeacherError {
    TeacherError::Server(message.into())
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
        if opts.routing.is_some() && opts.api == Api::Openai {
            return Err(TeacherError::Request(
                "OpenAI-echo servers return no routed experts: use api = \"vllm\" or \"sglang\""
                    .into(),
            ));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(opts.timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let mut t = Self {
            endpoints: endpoints
                .iter()
                .map(|e| e.trim_end_matches('/').to_string())
                .collect(),
            model: String::new(),
            vocab_size,
            agent,
            opts,
            next: AtomicUsize::new(0),
            jitter: AtomicU64::new(0x9E37_79B9),
        };
        let models = t.request("GET", "/v1/models", None)?;
        t.model = models["data"][0]["id"]
            .as_str()
            .ok_or_else(|| server_err(format!("/v1/models lists no model: {models}")))?
            .to_string();
        Ok(t)
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, TeacherError> {
        let mut last = String::new();
        let mut delay = self.opts.backoff;
        for attempt in 0..=self.opts.retries {
            if attempt > 0 {
                let mut s = self.jitter.fetch_add(1, Ordering::Relaxed);
                let jitter = 1.0 + (splitmix64(&mut s) % 1000) as f64 / 2000.0;
                std::thread::sleep(delay.mul_f64(jitter));
                delay *= 2;
            }
            let endpoint =
                &self.endpoints[self.next.fetch_add(1, Ordering::Relaxed) % self.endpoints.len()];
            let url = format!("{endpoint}{path}");
            let sent = match body {
                Some(b) => self
                    .agent
                    .post(&url)
                    .header("Content-Type", "application/json")
                    .send(b.to_string()),
                None if method == "GET" => self.agent.get(&url).call(),
                None => self.agent.post(&url).send_empty(),
            };
            let mut response = match sent {
                Ok(r) => r,
                Err(e) => {
                    last = format!("{url}: {e}");
                    continue;
                }
            };
            let status = response.status().as_u16();
            let text = response
                .body_mut()
                .with_config()
                .limit(1 << 30)
                .read_to_string()
                .map_err(|e| server_err(format!("{url}: reading the response: {e}")));
            let text = match text {
                Ok(t) => t,
                Err(e) => {
                    last = e.to_string();
                    continue;
                }
            };
            if status == 429 || status >= 500 {
                last = format!(
                    "{url}: HTTP {status}: {}",
                    text.chars().take(300).collect::<String>()
                );
                continue;
            }
            if status != 200 {
                return Err(server_err(format!(
                    "{url}: HTTP {status}: {}",
                    text.chars().take(500).collect::<String>()
                )));
            }
            return serde_json::from_str(&text)
                .map_err(|e| server_err(format!("{url}: the response is not JSON: {e}")));
        }
        Err(server_err(format!(
            "giving up after {} attempts; last: {last}",
            self.opts.retries + 1
        )))
    }

    /// The server's tokenization of `text` (for the tokenizer-agreement probe).
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, TeacherError> {
        let ids = match self.opts.api {
            Api::Openai => {
                let body = json!({"model": self.model, "prompt": text, "echo": true, "logprobs": 0,
                                  "max_tokens": 1, "return_tokens_as_token_ids": true});
                let v = self.request("POST", "/v1/completions", Some(&body))?;
                let tokens = v["choices"][0]["logprobs"]["tokens"]
                    .as_array()
                    .ok_or_else(|| server_err("no choices[0].logprobs.tokens (echo)"))?;
                // The last token is the generated one.
                let prompt = &tokens[..tokens.len().saturating_sub(1)];
                return prompt
                    .iter()
                    .map(|t| self.token_of(t, "logprobs.tokens"))
                    .collect();
            }
            Api::Vllm => {
                let body = json!({"model": self.model, "prompt": text, "max_tokens": 1, "return_token_ids": true});
                let v = self.request("POST", "/v1/completions", Some(&body))?;
                v["choices"][0]["prompt_token_ids"]
                    .as_array()
                    .ok_or_else(|| server_err("no choices[0].prompt_token_ids (return_token_ids)"))?
                    .iter()
                    .map(Value::as_u64)
                    .collect::<Option<Vec<_>>>()
            }
            Api::Sglang => {
                let body = json!({"text": text, "sampling_params": {"max_new_tokens": 0}, "return_logprob": true});
                let v = self.request("POST", "/generate", Some(&body))?;
                v["meta_info"]["input_token_logprobs"]
                    .as_array()
                    .ok_or_else(|| server_err("no meta_info.input_token_logprobs"))?
                    .iter()
                    .map(|e| e[1].as_u64())
                    .collect::<Option<Vec<_>>>()
            }
        };
        ids.ok_or_else(|| server_err("the server's token ids are not integers"))?
            .into_iter()
            .map(|id| self.check_id(id, "token ids"))
            .collect()
    }

    /// A token as an OpenAI-style response names it: `token_id:N`, or its text.
    fn token_of(&self, token: &Value, what: &str) -> Result<u32, TeacherError> {
        let key = token
            .as_str()
            .ok_or_else(|| server_err(format!("{what}: {token} is not a string")))?;
        self.key_id(key, what)
    }

    fn key_id(&self, key: &str, what: &str) -> Result<u32, TeacherError> {
        if let Some(id) = key.strip_prefix("token_id:") {
            let id = id
                .parse::<u64>()
                .map_err(|_| server_err(format!("{what}: {key:?} is not token_id:N")))?;
            return self.check_id(id, what);
        }
        let Some(pieces) = &self.opts.pieces else {
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

    fn check_id(&self, id: u64, what: &str) -> Result<u32, TeacherError> {
        if id as usize >= self.vocab_size {
            return Err(server_err(format!(
                "{what}: id {id} is outside the vocabulary of {} (teacher and student vocabularies differ?)",
                self.vocab_size
            )));
        }
        Ok(id as u32)
    }
}

impl Teacher for HttpTeacher {
    fn name(&self) -> &str {
        &self.model
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        if ids.len() < 2 {
            return Err(TeacherError::Request(
                "scoring needs 2 or more tokens".into(),
            ));
        }
        let (m, overlap) = (self.opts.max_request_tokens, self.opts.window_overlap);
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
            let window = &ids[start..end];
            let s = match self.opts.api {
                Api::Vllm => self.score_vllm(window, k)?,
                Api::Sglang => self.score_sglang(window, k)?,
                Api::Openai => self.score_openai(window, k)?,
            };
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
        match self.opts.api {
            Api::Vllm | Api::Openai => self.generate_openai(prompt, params),
            Api::Sglang => self.generate_sglang(prompt, params),
        }
    }

    fn routing(&self) -> Option<&RoutingShape> {
        self.opts.routing.as_ref()
    }
}

impl HttpTeacher {
    /// The routing of a scored window's `n − 1` tokens from the `sent` tokens of a payload (vLLM:
    /// the prompt and its one generated token but the last, `n`; SGLang: `n − 1`), checked
    /// against the teacher's routing; None when it was not asked for.
    fn routing_of(
        &self,
        payload: impl FnOnce(&RoutingShape) -> Result<Option<RoutedExperts>, WireError>,
        sent: usize,
        n: usize,
    ) -> Result<Option<Routing>, TeacherError> {
        let Some(shape) = &self.opts.routing else {
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
}

impl HttpTeacher {
    fn score_vllm(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let body = json!({"model": self.model, "prompt": ids, "max_tokens": 1,
                          "prompt_logprobs": k, "temperature": 0});
        let v = self.request("POST", "/v1/completions", Some(&body))?;
        let entries = v["choices"][0]["prompt_logprobs"]
            .as_array()
            .ok_or_else(|| server_err("the response has no choices[0].prompt_logprobs"))?;
        if entries.len() != ids.len() {
            return Err(server_err(format!(
                "prompt_logprobs has {} entries for {} tokens",
                entries.len(),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for (pos, entry) in entries[1..].iter().enumerate() {
            let what = format!("prompt_logprobs[{}]", pos + 1);
            let map = entry
                .as_object()
                .ok_or_else(|| server_err(format!("{what} is not an object")))?;
            let mut row = Vec::with_capacity(map.len());
            for (key, val) in map {
                let id = key
                    .parse::<u64>()
                    .map_err(|_| server_err(format!("{what}: key {key:?} is not a token id")))?;
                let lp = val["logprob"]
                    .as_f64()
                    .ok_or_else(|| server_err(format!("{what}[{key}] has no logprob")))?;
                row.push((self.check_id(id, &what)?, lp as f32));
            }
            if row.len() < k {
                return Err(server_err(format!(
                    "{what} holds {} entries, fewer than k = {k}",
                    row.len()
                )));
            }
            let target = ids[pos + 1];
            let target_lp = row
                .iter()
                .find(|(id, _)| *id == target)
                .map(|(_, lp)| *lp)
                .ok_or_else(|| server_err(format!("{what} lacks the actual token {target}")))?;
            out.target_logprobs.push(target_lp);
            // The top k of the (k or k + 1) entries.
            push_top(row, k, &mut out.top_ids, &mut out.top_logprobs);
        }
        // Current vLLM: a base64 `.npy` per choice; 0.21: the prompt's as nested lists at the
        // top level (the one generated token's, in the choice, is not needed).
        out.routing = self.routing_of(
            |shape| match (
                &v["choices"][0]["routed_experts"],
                &v["prompt_routed_experts"],
            ) {
                (Value::String(b64), _) => wire::from_vllm(b64).map(Some),
                (_, lists @ Value::Array(_)) => {
                    wire::from_vllm_lists(lists, shape.layers, shape.k).map(Some)
                }
                _ => Ok(None),
            },
            ids.len(),
            ids.len(),
        )?;
        Ok(out)
    }

    /// vLLM's generation (ids from `token_ids`) and OpenAI legacy (ids from `logprobs.tokens`).
    fn generate_openai(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        let mut body = json!({"model": self.model, "prompt": prompt, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
            "stop_token_ids": params.stop, "ignore_eos": true,
            "return_token_ids": true, "return_tokens_as_token_ids": true});
        // Every generated token's logprob is wanted, even without a top-k.
        body["logprobs"] = json!(params.logprobs.max(1));
        let v = self.request("POST", "/v1/completions", Some(&body))?;
        let choice = &v["choices"][0];
        let (tokens, lps, tops) = legacy_logprobs(choice)?;
        let ids = match choice["token_ids"].as_array() {
            Some(ids) => ids
                .iter()
                .map(|x| {
                    x.as_u64()
                        .ok_or_else(|| server_err("token_ids holds a non-integer"))
                        .and_then(|id| self.check_id(id, "token_ids"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => tokens
                .iter()
                .map(|t| self.token_of(t, "logprobs.tokens"))
                .collect::<Result<Vec<_>, _>>()?,
        };
        let k = params.logprobs;
        let mut g = Generation {
            logprobs: Vec::with_capacity(ids.len()),
            k,
            top_ids: Vec::new(),
            top_logprobs: Vec::new(),
            finish: match choice["finish_reason"].as_str() {
                Some("stop") => FinishReason::Stop,
                _ => FinishReason::Length,
            },
            ids,
        };
        if lps.len() != g.ids.len() || tops.len() != g.ids.len() {
            return Err(server_err("logprobs do not cover every generated token"));
        }
        for (i, top) in tops.iter().enumerate() {
            g.logprobs
                .push(lps[i].as_f64().unwrap_or(f64::NEG_INFINITY) as f32);
            if k == 0 {
                continue;
            }
            let row = self.top_map(top, &format!("top_logprobs[{i}]"))?;
            if row.len() < k {
                return Err(server_err(format!(
                    "top_logprobs[{i}] holds fewer than k = {k} entries"
                )));
            }
            push_top(row, k, &mut g.top_ids, &mut g.top_logprobs);
        }
        Ok(g)
    }

    /// An OpenAI `top_logprobs` entry (`{token: logprob}`) as `(id, logprob)` pairs.
    fn top_map(&self, top: &Value, what: &str) -> Result<Vec<(u32, f32)>, TeacherError> {
        let map = top
            .as_object()
            .ok_or_else(|| server_err(format!("{what} is not an object")))?;
        map.iter()
            .map(|(key, val)| {
                let lp = val
                    .as_f64()
                    .ok_or_else(|| server_err(format!("{what}[{key:?}] is not a number")))?;
                Ok((self.key_id(key, what)?, lp as f32))
            })
            .collect()
    }

    fn score_openai(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        // max_tokens 1, not 0: some servers (llama-cpp-python) read 0 as "until the context ends".
        let body = json!({"model": self.model, "prompt": ids, "echo": true, "logprobs": k,
                          "max_tokens": 1, "temperature": 0, "return_tokens_as_token_ids": true});
        let v = self.request("POST", "/v1/completions", Some(&body))?;
        let (tokens, lps, tops) = legacy_logprobs(&v["choices"][0])?;
        // The prompt's entries, then the generated token's.
        if tokens.len() < ids.len() || lps.len() < ids.len() || tops.len() < ids.len() {
            return Err(server_err(format!(
                "echo returned logprobs for {} tokens of a {}-token prompt",
                tokens.len().min(lps.len()).min(tops.len()),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for t in 1..ids.len() {
            let what = format!("logprobs.top_logprobs[{t}]");
            let echoed = self.token_of(&tokens[t], "logprobs.tokens")?;
            if echoed != ids[t] {
                return Err(server_err(format!(
                    "logprobs.tokens[{t}] is token {echoed}, not the prompt's {}",
                    ids[t]
                )));
            }
            let target = lps[t].as_f64().ok_or_else(|| {
                server_err(format!("logprobs.token_logprobs[{t}] is not a number"))
            })?;
            out.target_logprobs.push(target as f32);
            let row = self.top_map(&tops[t], &what)?;
            if row.len() < k {
                return Err(server_err(format!(
                    "{what} holds {} entries, fewer than k = {k}",
                    row.len()
                )));
            }
            push_top(row, k, &mut out.top_ids, &mut out.top_logprobs);
        }
        Ok(out)
    }
}

/// An OpenAI legacy choice's `logprobs`: `(tokens, token_logprobs, top_logprobs)`.
fn legacy_logprobs(
    choice: &Value,
) -> Result<(&Vec<Value>, &Vec<Value>, &Vec<Value>), TeacherError> {
    let lp = &choice["logprobs"];
    match (
        lp["tokens"].as_array(),
        lp["token_logprobs"].as_array(),
        lp["top_logprobs"].as_array(),
    ) {
        (Some(t), Some(l), Some(top)) => Ok((t, l, top)),
        _ => Err(server_err(
            "the response has no choices[0].logprobs.tokens/token_logprobs/top_logprobs",
        )),
    }
}

/// `[logprob, id, text]` → `(id, logprob)`; a null logprob is an error naming `what`.
fn sglang_entry(v: &Value, what: &str) -> Result<(u64, f32), TeacherError> {
    let (lp, id) = (v[0].as_f64(), v[1].as_u64());
    match (lp, id) {
        (Some(lp), Some(id)) => Ok((id, lp as f32)),
        _ => Err(server_err(format!(
            "{what}: {v} is not [logprob, id, text]"
        ))),
    }
}

impl HttpTeacher {
    /// A list of `[logprob, id, text]` as checked `(id, logprob)` pairs.
    fn sglang_row(&self, row: &[Value], what: &str) -> Result<Vec<(u32, f32)>, TeacherError> {
        row.iter()
            .map(|e| {
                let (id, lp) = sglang_entry(e, what)?;
                Ok((self.check_id(id, what)?, lp))
            })
            .collect()
    }

    fn score_sglang(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                          "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": k,
                          "return_routed_experts": self.opts.routing.is_some()});
        let v = self.request("POST", "/generate", Some(&body))?;
        let meta = &v["meta_info"];
        let (Some(input), Some(tops)) = (
            meta["input_token_logprobs"].as_array(),
            meta["input_top_logprobs"].as_array(),
        ) else {
            return Err(server_err(
                "the response has no meta_info.input_token_logprobs/input_top_logprobs",
            ));
        };
        if input.len() != ids.len() || tops.len() != ids.len() {
            return Err(server_err(format!(
                "input logprobs cover {} and {} positions for {} tokens",
                input.len(),
                tops.len(),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for t in 1..ids.len() {
            let what = format!("input_token_logprobs[{t}]");
            let (id, lp) = sglang_entry(&input[t], &what)?;
            if id != ids[t] as u64 {
                return Err(server_err(format!(
                    "{what} is for token {id}, not the actual {}",
                    ids[t]
                )));
            }
            out.target_logprobs.push(lp);
            let row = tops[t]
                .as_array()
                .ok_or_else(|| server_err(format!("input_top_logprobs[{t}] is not a list")))?;
            if row.len() < k {
                return Err(server_err(format!(
                    "input_top_logprobs[{t}] holds fewer than k = {k} entries"
                )));
            }
            let entries = self.sglang_row(row, "input_top_logprobs")?;
            push_top(entries, k, &mut out.top_ids, &mut out.top_logprobs);
        }
        out.routing = self.routing_of(
            |shape| match &meta["routed_experts"] {
                Value::String(b64) => wire::from_sglang(b64, shape.layers, shape.k).map(Some),
                _ => Ok(None),
            },
            ids.len() - 1,
            ids.len(),
        )?;
        Ok(out)
    }

    fn generate_sglang(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        let body = json!({"input_ids": prompt,
            "sampling_params": {"max_new_tokens": params.max_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "stop_token_ids": params.stop, "ignore_eos": true,
                                "seed": params.seed},
            "return_logprob": true, "logprob_start_len": prompt.len(), "top_logprobs_num": params.logprobs});
        let v = self.request("POST", "/generate", Some(&body))?;
        let meta = &v["meta_info"];
        let out = meta["output_token_logprobs"]
            .as_array()
            .ok_or_else(|| server_err("the response has no meta_info.output_token_logprobs"))?;
        let k = params.logprobs;
        let mut g = Generation {
            ids: Vec::with_capacity(out.len()),
            logprobs: Vec::with_capacity(out.len()),
            k,
            top_ids: Vec::new(),
            top_logprobs: Vec::new(),
            finish: match meta["finish_reason"]["type"].as_str() {
                Some("stop") => FinishReason::Stop,
                _ => FinishReason::Length,
            },
        };
        for (i, e) in out.iter().enumerate() {
            let (id, lp) = sglang_entry(e, &format!("output_token_logprobs[{i}]"))?;
            g.ids.push(self.check_id(id, "output_token_logprobs")?);
            g.logprobs.push(lp);
            if k > 0 {
                let row = meta["output_top_logprobs"][i]
                    .as_array()
                    .filter(|r| r.len() >= k)
                    .ok_or_else(|| {
                        server_err(format!(
                            "output_top_logprobs[{i}] holds fewer than k = {k} entries"
                        ))
                    })?;
                let entries = self.sglang_row(row, "output_top_logprobs")?;
                push_top(entries, k, &mut g.top_ids, &mut g.top_logprobs);
            }
        }
        Ok(g)
    }
}
