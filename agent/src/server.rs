//! `k3mini agent serve`: the gateway behind OpenAI's surface, on the HTTP stack `teacher serve`
//! stands on too (`k3mini_http`: the transport, limits, origin checks and the queue) and the
//! teacher server's request plumbing (`k3mini_teacher::server`: the prompt cap, sampling fields,
//! `/v1/models`).
//!
//! - `GET /health`, `GET /v1/models`
//! - `POST /v1/completions` (`prompt` as text or ids) and `POST /v1/chat/completions`
//!   (`messages` in the student's chat format, [`super::student::Student::format`]): `max_tokens`,
//!   `temperature`, `top_p`, `seed`, `stop_token_ids`, `ignore_eos`, `stream`, `response_format`,
//!   and `tools` with `tool_choice` and `parallel_tool_calls`.
//!
//! A request with tools is rendered with their declarations, and the answer (the student's or the
//! remote's: both write the student's format, the remote reading the same ids) is read by the
//! format's parser into `content`, `reasoning` and OpenAI's `tool_calls`; under a gate or
//! confidence policy a student's reply that fails the [`super::gate::ToolGate`] escalates, and a
//! kept reply that fails it says why (`gate_failure`). So is every answer of a K3-format student
//! (its raw text is markup). Streamed, such an answer is held until it is final and then sent as
//! one delta: a call is never sent before it has passed the gate.
//!
//! One request runs at a time, its remote calls included (the student uses every core, and a
//! cascade alternates between the two); `--max-queued` more wait, and the next is a 503.
//!
//! Every response carries a `k3mini` object beside OpenAI's fields ([`super::Report`]): who
//! answered, whether and why it escalated, the signals, tokens and cost. Streamed, text arrives as
//! it becomes final (a cascade's after each round; a local answer once the policy has judged it)
//! and the last event carries `finish_reason`, `usage` and `k3mini`, then `data: [DONE]`. A
//! failure after the stream began is an `error` event. Fields the gateway does not serve
//! (`logprobs`, `echo`, `prompt_logprobs`, vLLM's `return_token_ids`,
//! `return_tokens_as_token_ids` and `routed_experts_prompt_start`) are refused with a 400 rather
//! than ignored.

use super::gate::{Gate, ToolGate};
use super::policy::{Policy, Route};
use super::wire::{self, CodeTests};
use super::{Agent, AgentError, Answer, Ask, Report};
use k3mini_data::ChatFormat;
use k3mini_data::chat::{Part, render};
use k3mini_http::ErrorResponse;
use k3mini_http::{
    Admitted, ApiError, Bytes, EventSender, Limits, Peer, Queue, Reply, Request, bad,
};
use k3mini_teacher::server::{
    PromptCap, SamplingFields, ServeOptions, admit, admit_text, check_length, models, now_secs,
    token_ids, turn,
};
use k3mini_teacher::stop::{cut_text, stop_strings};
use k3mini_teacher::wire::openai::{
    ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatMessage, ChatRequest, ChatResponse,
    CompletionChoice, CompletionChunk, CompletionChunkChoice, CompletionRequest,
    CompletionResponse, Prompt, Stop, ToolCallDelta, Usage,
};
use k3mini_teacher::{FinishReason, GenerateParams, Interrupt, Teacher, TeacherError};
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An OpenAI response (or stream event) with the gateway's report beside its fields.
#[derive(Serialize)]
pub struct Annotated<T> {
    #[serde(flatten)]
    pub response: T,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k3mini: Option<Report>,
}

struct Gateway {
    agent: Agent,
    /// The student's chat format ([`super::student::Student::format`]).
    format: ChatFormat,
    queue: Queue,
    prompt_cap: PromptCap,
    request_timeout: Option<Duration>,
    stop: Arc<AtomicBool>,
    created: u64,
    requests: AtomicU64,
}

/// Which endpoint a request came to: the shape of its answer. A chat's answer is read in `read`'s
/// format (content, reasoning and tool calls) where it has tools or the format is K3's; otherwise
/// its text is the content.
#[derive(Clone, Copy, PartialEq)]
enum Endpoint {
    Completions,
    Chat { read: Option<ChatFormat> },
}

/// Whether `policy` may be served under `limits`, and the warning to print if so. A policy that
/// runs request-supplied tests (`[gate] run_tests = true`) runs Python its clients write (the
/// prompt, the tests and the entry point all come from the request): it is refused without an
/// API key, and without a working sandbox ([`super::sandbox`]).
pub fn check_policy(policy: &Policy, limits: &Limits) -> Result<Option<String>, TeacherError> {
    if !policy.gate.run_tests {
        return Ok(None);
    }
    if limits.api_key.is_none() {
        return Err(TeacherError::Request(format!(
            "policy {:?} says [gate] run_tests = true, which runs Python that clients send (a \
             request's k3mini_tests: its prompt, tests and entry point): serve it with an API key \
             (--api-key or K3MINI_API_KEY), so only clients you trust can",
            policy.name
        )));
    }
    super::sandbox::sandbox().map_err(|e| TeacherError::Request(e.to_string()))?;
    Ok(Some(format!(
        "warning: policy {:?} runs the Python of any client holding the API key (k3mini_tests), \
         in a bubblewrap sandbox: no network, a read-only /usr, its own processes and limits; \
         the kernel is shared, so give the key only to clients you would let run code here",
        policy.name
    )))
}

/// Serves `agent` until `stop` is set; `ready` receives the bound address (port 0 picks one).
/// Refuses a policy [`check_policy`] refuses.
pub fn serve(
    agent: Agent,
    addr: &str,
    options: ServeOptions,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), TeacherError> {
    check_policy(&agent.policy, &options.limits)?;
    let (listener, local) = k3mini_http::bind(addr).map_err(TeacherError::Request)?;
    let student = &agent.student.model;
    let prompt_cap = PromptCap::of(
        &student.tokenizer,
        student.vocab_size(),
        student.context_length(),
    );
    let format = agent.student.format();
    let gateway = Arc::new(Gateway {
        format,
        prompt_cap,
        agent,
        queue: Queue::new(options.max_queued),
        request_timeout: options.request_timeout,
        stop: stop.clone(),
        created: now_secs(),
        requests: AtomicU64::new(0),
    });
    ready(local);
    k3mini_http::serve(listener, options.limits, &stop, move |request, peer| {
        route(&gateway, request, peer).unwrap_or_else(|e| e.reply())
    })
    .map_err(|e| TeacherError::Server(format!("serving {local}: {e}")))
}

/// The paths the gateway routes.
const PATHS: [&str; 4] = [
    "/health",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
];

fn route(gw: &Arc<Gateway>, r: &Request, peer: &Peer) -> Result<Reply, ApiError> {
    let student = &gw.agent.student.model;
    let (method, path) = (r.method.as_str(), r.path.as_str());
    match (method, path) {
        ("GET", "/health") => Ok(Reply::health()),
        ("GET", "/v1/models") => Ok(models(student.name(), gw.created, student.context_length())),
        ("POST", "/v1/completions") => {
            let (req, tests) = wire::parse::<CompletionRequest>(&r.body, &wire::EXTENSIONS)?;
            let (ask, admitted) = completion_ask(gw, &req, tests)?;
            let stream = req.stream.unwrap_or(false);
            respond(gw, ask, admitted, Endpoint::Completions, stream, peer)
        }
        ("POST", "/v1/chat/completions") => {
            let (req, _) = wire::parse::<ChatRequest>(&r.body, &[])?;
            let (ask, admitted) = chat_ask(gw, &req)?;
            let stream = req.stream.unwrap_or(false);
            let structured = req.tools.is_some() || gw.format == ChatFormat::KimiK3;
            let read = structured.then_some(gw.format);
            respond(gw, ask, admitted, Endpoint::Chat { read }, stream, peer)
        }
        _ => Err(k3mini_http::unrouted(method, path, &PATHS)),
    }
}

/// Refuses a field the gateway does not serve rather than answer without it.
fn unserved(set: bool, field: &str) -> Result<(), ApiError> {
    if set {
        return Err(bad(
            field,
            format!("the agent gateway does not serve `{field}` (a teacher server does)"),
        ));
    }
    Ok(())
}

/// What a request asks of the student before its prompt is read: its sampling checked against
/// the student's vocabulary and context, and its stop strings. Unless `ignore_eos`, an answer
/// ends at the end of a turn or of text, as the tokenizer names them.
fn sampling(
    gw: &Gateway,
    fields: SamplingFields,
    stop: Option<&Stop>,
) -> Result<(GenerateParams, Vec<String>), ApiError> {
    let stop_text = stop_strings(stop).map_err(|e| bad("stop", e))?;
    let student = &gw.agent.student.model;
    let ignore_eos = fields.ignore_eos.unwrap_or(false);
    let mut params = fields.params(student.vocab_size(), student.meta.eos)?;
    if !ignore_eos {
        for id in gw.agent.student.stops() {
            if !params.stop.contains(&id) {
                params.stop.push(id);
            }
        }
    }
    // Room for at least one prompt token, known before the request queues.
    check_length(1, params.max_tokens, student.context_length())?;
    Ok((params, stop_text))
}

/// The request as the student answers it, its prompt's length checked against the context.
fn ask(
    gw: &Gateway,
    prompt: Vec<u32>,
    (params, stop_text): (GenerateParams, Vec<String>),
    gate: Option<Gate>,
    parts: Option<Vec<Part>>,
) -> Result<Ask, ApiError> {
    let context = gw.agent.student.model.context_length();
    check_length(prompt.len(), params.max_tokens, context)?;
    Ok(Ask {
        prompt,
        params,
        stop_text,
        gate,
        parts,
    })
}

/// Refuses a request asking for a check (`field`) the policy does not make: its route never
/// judges a local answer.
fn gated(gw: &Gateway, field: &str) -> Result<(), ApiError> {
    let policy = &gw.agent.policy;
    if matches!(policy.route, Route::Gate | Route::Confidence) {
        return Ok(());
    }
    Err(bad(
        field,
        format!(
            "policy {:?} does not check the student's answers (route {:?}); serve with a gate or \
             confidence policy, or leave {field} out",
            policy.name, policy.route
        ),
    ))
}

/// The tests a completion request carries, as a gate, where the policy runs them.
fn tests_gate(
    gw: &Gateway,
    req: &CompletionRequest,
    tests: Option<CodeTests>,
) -> Result<Option<Gate>, ApiError> {
    let Some(t) = tests else {
        return Ok(None);
    };
    gated(gw, "k3mini_tests")?;
    let settings = &gw.agent.policy.gate;
    if !settings.run_tests {
        return Err(bad(
            "k3mini_tests",
            "running a request's tests runs the client's Python (in a sandbox): the policy must \
             say [gate] run_tests = true",
        ));
    }
    let Prompt::Text(prompt) = &req.prompt else {
        return Err(bad(
            "k3mini_tests",
            "tests go with a text prompt the answer completes",
        ));
    };
    Ok(Some(Gate::Tests {
        prompt: prompt.clone(),
        tests: t.tests,
        entry_point: t.entry_point,
        limit: std::time::Duration::from_secs_f64(settings.test_seconds),
    }))
}

/// The request checked and admitted: its prompt is tokenized only once it has a place in the
/// queue, and only if its text could fit the student's context.
fn completion_ask(
    gw: &Gateway,
    req: &CompletionRequest,
    tests: Option<CodeTests>,
) -> Result<(Ask, Admitted), ApiError> {
    unserved(req.logprobs.is_some(), "logprobs")?;
    unserved(req.echo == Some(true), "echo")?;
    unserved(req.prompt_logprobs.is_some(), "prompt_logprobs")?;
    unserved(req.return_token_ids == Some(true), "return_token_ids")?;
    unserved(
        req.return_tokens_as_token_ids == Some(true),
        "return_tokens_as_token_ids",
    )?;
    unserved(
        req.routed_experts_prompt_start.is_some(),
        "routed_experts_prompt_start",
    )?;
    let student = &gw.agent.student.model;
    let asked = sampling(gw, SamplingFields::of_completion(req, 0), req.stop.as_ref())?;
    let gate = tests_gate(gw, req, tests)?;
    let (prompt, admitted) = match &req.prompt {
        Prompt::Text(s) => admit_text(&gw.queue, &student.tokenizer, &gw.prompt_cap, s, "prompt")?,
        Prompt::Ids(ids) if ids.is_empty() => return Err(bad("prompt", "the prompt is empty")),
        Prompt::Ids(ids) => (
            token_ids(ids, student.vocab_size(), "prompt")?,
            admit(&gw.queue)?,
        ),
    };
    Ok((ask(gw, prompt, asked, gate, None)?, admitted))
}

/// As [`completion_ask`], for a chat.
fn chat_ask(gw: &Gateway, req: &ChatRequest) -> Result<(Ask, Admitted), ApiError> {
    unserved(req.logprobs == Some(true), "logprobs")?;
    unserved(req.top_logprobs.is_some(), "top_logprobs")?;
    let student = &gw.agent.student.model;
    let asked = sampling(gw, SamplingFields::of_chat(req, 0), req.stop.as_ref())?;
    let gate = match &req.response_format {
        Some(f) => Gate::of(f).map_err(|e| bad("response_format", e))?,
        None => None,
    };
    if gate.is_some() {
        gated(gw, "response_format")?;
    }
    let tools = req.tools.as_deref().unwrap_or_default();
    let gate = match tool_gate(gw, req)? {
        Some(_) if gate.is_some() => {
            return Err(bad(
                "response_format",
                "a request with tools is checked as tool calls: leave response_format out",
            ));
        }
        Some(tools) => Some(Gate::Tools(tools)),
        None => gate,
    };
    let rendered = render(&req.messages, tools, gw.format, true)
        .map_err(|e| bad("messages", e.to_string()))?;
    gw.prompt_cap.check(rendered.text_len(), "messages")?;
    let admitted = admit(&gw.queue)?;
    let (prompt, parts) = rendered
        .encode(&student.tokenizer)
        .map_err(|e| bad("messages", e.to_string()))?;
    Ok((ask(gw, prompt, asked, gate, Some(parts))?, admitted))
}

/// The gate a request's `tools` ask for (none without tools), or why they cannot be served.
fn tool_gate(gw: &Gateway, req: &ChatRequest) -> Result<Option<ToolGate>, ApiError> {
    let Some(tools) = &req.tools else {
        for (set, field) in [
            (req.tool_choice.is_some(), "tool_choice"),
            (req.parallel_tool_calls.is_some(), "parallel_tool_calls"),
        ] {
            if set {
                return Err(bad(field, format!("`{field}` goes with `tools`")));
            }
        }
        return Ok(None);
    };
    if tools.is_empty() {
        return Err(bad(
            "tools",
            "`tools` is empty: leave it out, or declare a function",
        ));
    }
    ToolGate::of(
        gw.format,
        tools,
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )
    .map(Some)
    .map_err(|(field, e)| bad(&field, e))
}

fn agent_error(e: AgentError) -> ApiError {
    match e {
        AgentError::Local(e) => e.into(),
        AgentError::Remote(e) => ApiError {
            status: 502,
            message: format!("the remote failed and the policy answers no local fallback: {e}"),
            param: None,
        },
    }
}

fn finish_reason(f: FinishReason) -> Option<String> {
    Some(
        match f {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
        .into(),
    )
}

fn usage(a: &Answer) -> Usage {
    let (p, c) = (
        a.report.usage.prompt_tokens,
        a.report.usage.completion_tokens,
    );
    Usage {
        prompt_tokens: p,
        completion_tokens: c,
        total_tokens: p + c,
    }
}

impl Gateway {
    /// The text of answer ids as the endpoint returns it: a chat's content without its stop id,
    /// ended before the first of `stop_text` it holds; and whether it was.
    fn text(
        &self,
        ids: &[u32],
        endpoint: Endpoint,
        stop: &[u32],
        stop_text: &[String],
    ) -> (String, bool) {
        let kept: Vec<u32> = match endpoint {
            Endpoint::Chat { .. } => ids
                .iter()
                .copied()
                .filter(|id| !stop.contains(id))
                .collect(),
            Endpoint::Completions => ids.to_vec(),
        };
        let text = self
            .agent
            .student
            .model
            .tokenizer
            .decode(&kept)
            .unwrap_or_default();
        let whole = text.len();
        let text = cut_text(text, stop_text);
        let cut = text.len() < whole;
        (text, cut)
    }

    fn id(&self, endpoint: Endpoint) -> String {
        let n = self.requests.fetch_add(1, Ordering::SeqCst);
        match endpoint {
            Endpoint::Chat { .. } => format!("chatcmpl-{}-{n}", self.created),
            Endpoint::Completions => format!("cmpl-{}-{n}", self.created),
        }
    }

    fn model(&self) -> String {
        self.agent.student.model.name().to_string()
    }

    /// A chat answer's message and finish reason: its text as the content, or, where the answer
    /// is read (`read`) and passes the request's gate, its content, reasoning and tool calls (ids
    /// `call-{id}-{k}`); a reply that fails the gate or does not read is returned as text.
    fn message(
        &self,
        answer: &Answer,
        (stop, stop_text): (&[u32], &[String]),
        read: Option<ChatFormat>,
        id: &str,
    ) -> (ChatMessage, Option<String>) {
        let (text, _) = self.text(&answer.ids, Endpoint::Chat { read }, stop, stop_text);
        let finish = finish_reason(answer.finish);
        let plain = |text: String| ChatMessage {
            role: "assistant".into(),
            content: Some(text),
            reasoning: None,
            tool_calls: Vec::new(),
        };
        // A reply that fails the gate goes out as text: a client acting on `tool_calls` never
        // gets a call the gate refused (the report says why).
        let Some(format) = read.filter(|_| answer.report.gate_failure.is_none()) else {
            return (plain(text), finish);
        };
        let Ok(reply) = format.parse_reply(&text) else {
            return (plain(text), finish);
        };
        let calls: Vec<_> = reply
            .calls
            .into_iter()
            .enumerate()
            .map(|(k, mut c)| {
                c.id = Some(format!("call-{id}-{k}"));
                c
            })
            .collect();
        let finish = match calls.is_empty() {
            true => finish,
            false => Some("tool_calls".into()),
        };
        let content = (!reply.content.is_empty() || calls.is_empty()).then_some(reply.content);
        let message = ChatMessage {
            role: "assistant".into(),
            content,
            reasoning: reply.thinking.filter(|t| !t.is_empty()),
            tool_calls: calls,
        };
        (message, finish)
    }
}

fn respond(
    gw: &Arc<Gateway>,
    ask: Ask,
    admitted: Admitted,
    endpoint: Endpoint,
    stream: bool,
    peer: &Peer,
) -> Result<Reply, ApiError> {
    if stream {
        return stream_answer(gw.clone(), ask, admitted, endpoint, peer.clone());
    }
    let cancelled = || k3mini_http::cancelled(&gw.stop, peer.gone());
    let interrupt = Interrupt::from_now(gw.request_timeout, &cancelled);
    let answer = {
        let _turn = turn(&gw.queue, admitted, interrupt)?;
        gw.agent
            .answer(&ask, interrupt, &mut |_| {})
            .map_err(agent_error)?
    };
    let (id, model, created) = (gw.id(endpoint), gw.model(), gw.created);
    let report = Some(answer.report.clone());
    let reply = match endpoint {
        Endpoint::Completions => Reply::json(
            200,
            &Annotated {
                response: CompletionResponse {
                    id,
                    object: "text_completion".into(),
                    created,
                    model,
                    choices: vec![CompletionChoice {
                        index: 0,
                        text: gw
                            .text(&answer.ids, endpoint, &ask.params.stop, &ask.stop_text)
                            .0,
                        finish_reason: finish_reason(answer.finish),
                        logprobs: None,
                        prompt_logprobs: None,
                        prompt_token_ids: None,
                        token_ids: Some(answer.ids.iter().map(|&i| i as u64).collect()),
                        routed_experts: None,
                    }],
                    usage: Some(usage(&answer)),
                    prompt_routed_experts: None,
                },
                k3mini: report,
            },
        ),
        Endpoint::Chat { read } => {
            let stops = (ask.params.stop.as_slice(), ask.stop_text.as_slice());
            let (message, finish_reason) = gw.message(&answer, stops, read, &id);
            Reply::json(
                200,
                &Annotated {
                    response: ChatResponse {
                        id,
                        object: "chat.completion".into(),
                        created,
                        model,
                        choices: vec![ChatChoice {
                            index: 0,
                            message,
                            finish_reason,
                            logprobs: None,
                        }],
                        usage: Some(usage(&answer)),
                    },
                    k3mini: report,
                },
            )
        }
    };
    // The traffic journal's line for the shard the report names is written once it is sent.
    Ok(match answer.unjournaled {
        Some(line) => reply.hold(line),
        None => reply,
    })
}

/// A stream's events, written as the answer's ids become final: each event the text added since
/// the last (held back while it ends inside a UTF-8 character, or might be the start of a stop
/// string; nothing past a stop string is sent).
struct Events<'a> {
    gw: &'a Gateway,
    tx: &'a EventSender,
    endpoint: Endpoint,
    stop: Vec<u32>,
    stop_text: Vec<String>,
    id: String,
    ids: Vec<u32>,
    sent: String,
}

impl Events<'_> {
    fn send(&self, value: &impl Serialize) {
        let json = serde_json::to_string(value).expect("an event serialises");
        // A failed send means the client left: the interrupt sees it and stops the work.
        let _ = self
            .tx
            .blocking_send(Bytes::from(format!("data: {json}\n\n")));
    }

    /// An event adding `text` (a chat's as its `delta`), or the last, which carries the finish
    /// reason (`finish`'s own unless `reason` says), the usage and the report.
    fn event(&self, text: Option<String>, finish: Option<&Answer>) {
        let delta = ChatDelta {
            role: (self.sent.is_empty() && finish.is_none() && text.is_none())
                .then(|| "assistant".into()),
            content: text.clone(),
            ..ChatDelta::default()
        };
        self.event_with(text, delta, finish, None);
    }

    fn event_with(
        &self,
        text: Option<String>,
        delta: ChatDelta,
        finish: Option<&Answer>,
        reason: Option<String>,
    ) {
        let (finish_reason, usage_, report) = match finish {
            Some(a) => (
                reason.or_else(|| finish_reason(a.finish)),
                Some(usage(a)),
                Some(a.report.clone()),
            ),
            None => (None, None, None),
        };
        let (id, model, created) = (self.id.clone(), self.gw.model(), self.gw.created);
        match self.endpoint {
            Endpoint::Completions => self.send(&Annotated {
                response: CompletionChunk {
                    id,
                    object: "text_completion".into(),
                    created,
                    model,
                    choices: vec![CompletionChunkChoice {
                        index: 0,
                        text: text.unwrap_or_default(),
                        finish_reason,
                    }],
                    usage: usage_,
                },
                k3mini: report,
            }),
            Endpoint::Chat { .. } => self.send(&Annotated {
                response: ChatChunk {
                    id,
                    object: "chat.completion.chunk".into(),
                    created,
                    model,
                    choices: vec![ChatChunkChoice {
                        index: 0,
                        delta,
                        finish_reason,
                    }],
                    usage: usage_,
                },
                k3mini: report,
            }),
        }
    }

    /// The text not yet sent, whole at the `end`, else up to a character that is complete. Should
    /// decoding more ids respell text already sent (it does not for byte-level BPE), what follows
    /// the part both spell alike is sent, so nothing is lost.
    fn delta(&mut self, end: bool) -> Option<String> {
        let (mut text, stopped) =
            self.gw
                .text(&self.ids, self.endpoint, &self.stop, &self.stop_text);
        if !end && !stopped {
            if text.ends_with('\u{FFFD}') {
                return None;
            }
            // The longest stop string less a byte could be ending the text: kept back.
            let longest = self.stop_text.iter().map(String::len).max().unwrap_or(0);
            let keep =
                text.floor_char_boundary(text.len().saturating_sub(longest.saturating_sub(1)));
            text.truncate(keep);
        }
        let same = self
            .sent
            .char_indices()
            .zip(text.chars())
            .find(|((_, a), b)| a != b)
            .map_or(self.sent.len().min(text.len()), |((i, _), _)| i);
        let new = text.get(same..).unwrap_or_default().to_string();
        self.sent = text;
        (!new.is_empty()).then_some(new)
    }

    /// Ids that became final: sent as text, unless the answer is read whole at its end.
    fn push(&mut self, ids: &[u32]) {
        self.ids.extend(ids);
        if let Endpoint::Chat { read: Some(_) } = self.endpoint {
            return;
        }
        if let Some(text) = self.delta(false) {
            self.event(Some(text), None);
        }
    }

    fn finish(&mut self, answer: &Answer) {
        if let Endpoint::Chat {
            read: read @ Some(_),
        } = self.endpoint
        {
            let stops = (self.stop.as_slice(), self.stop_text.as_slice());
            let (m, reason) = self.gw.message(answer, stops, read, &self.id);
            let tool_calls = m
                .tool_calls
                .into_iter()
                .enumerate()
                .map(|(k, c)| ToolCallDelta {
                    index: k as u32,
                    id: c.id,
                    kind: Some(c.kind),
                    function: c.function,
                })
                .collect();
            let delta = ChatDelta {
                role: None,
                content: m.content.clone(),
                reasoning: m.reasoning,
                tool_calls,
            };
            self.event_with(m.content, delta, None, None);
            self.event_with(None, ChatDelta::default(), Some(answer), reason);
        } else {
            if let Some(text) = self.delta(true) {
                self.event(Some(text), None);
            }
            self.event(None, Some(answer));
        }
        let _ = self
            .tx
            .blocking_send(Bytes::from_static(b"data: [DONE]\n\n"));
    }

    fn fail(&self, e: ApiError) {
        self.send(&ErrorResponse::new(e.status, e.message, e.param.as_deref()));
    }
}

/// Streams the answer from a thread of its own: the reply (or the queue's refusal) is returned
/// once the request has its turn at the model. While it waits, the connection says whether its
/// client left; once the stream is handed to hyper, the stream does (a send to it fails).
fn stream_answer(
    gw: Arc<Gateway>,
    ask: Ask,
    admitted: Admitted,
    endpoint: Endpoint,
    peer: Peer,
) -> Result<Reply, ApiError> {
    // The request's time runs from here, queueing included, as a whole answer's does.
    let deadline = k3mini_teacher::deadline_in(gw.request_timeout);
    let (reply, tx) = Reply::events();
    // The traffic journal's line for the shard the report names, dropped (so written) by the last
    // to let go of it: the stream once sent, or this thread once it has finished.
    let unjournaled = Arc::new(Mutex::new(None));
    let reply = match gw.agent.traffic {
        Some(_) => reply.hold(unjournaled.clone()),
        None => reply,
    };
    let (started, began) = std::sync::mpsc::channel::<Result<(), ApiError>>();
    std::thread::spawn(move || {
        // Once the stream is handed to hyper, the stream says whether its client left.
        let waiting = || k3mini_http::cancelled(&gw.stop, peer.gone());
        let cancelled = || k3mini_http::cancelled(&gw.stop, tx.is_closed());
        let queued = Interrupt {
            deadline,
            cancelled: Some(&waiting),
        };
        let interrupt = Interrupt {
            deadline,
            cancelled: Some(&cancelled),
        };
        let _turn = match turn(&gw.queue, admitted, queued) {
            Ok(t) => {
                let _ = started.send(Ok(()));
                t
            }
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        let mut events = Events {
            gw: &gw,
            tx: &tx,
            endpoint,
            stop: ask.params.stop.clone(),
            stop_text: ask.stop_text.clone(),
            id: gw.id(endpoint),
            ids: Vec::new(),
            sent: String::new(),
        };
        if matches!(endpoint, Endpoint::Chat { .. }) {
            events.event(None, None);
        }
        let answered = gw
            .agent
            .answer(&ask, interrupt, &mut |ids| events.push(ids));
        match answered {
            Ok(mut answer) => {
                *unjournaled.lock().unwrap_or_else(|p| p.into_inner()) = answer.unjournaled.take();
                events.finish(&answer);
            }
            Err(e) => events.fail(agent_error(e)),
        }
    });
    match began.recv() {
        Ok(Ok(())) => Ok(reply),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError {
            status: 500,
            message: "the request's stream failed before it began".into(),
            param: None,
        }),
    }
}
