//! Chat templates: a conversation rendered as tagged segments, so the token stream knows which ids
//! are template markup, prompt, thinking or answer and a loss mask can cover or skip each part. One
//! format per vocabulary, each held to its reference template by golden tests
//! (`scripts/golden/chat_templates.py`).
//!
//! ChatML (SmolLM2, Qwen; [`chatml`]):
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, an assistant turn with reasoning as
//! `<|im_start|>assistant\n<think>\n{thinking}\n</think>\n\n{answer}<|im_end|>\n`, its tool calls
//! as Hermes' `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`.
//!
//! Kimi K2 ([`k2`]):
//! `<|im_system|>system<|im_middle|>{content}<|im_end|>`, `<|im_user|>user<|im_middle|>…<|im_end|>`,
//! `<|im_assistant|>assistant<|im_middle|><think>{thinking}</think>{answer}<|im_end|>`, its tool
//! calls in `<|tool_calls_section_begin|>`, results as `<|im_system|>tool<|im_middle|>## Return of …`.
//!
//! Kimi K3 ("XTML", [`xtml`]): `<|open|>message role="user"<|sep|>…<|close|>message<|sep|><|end_of_msg|>`,
//! the assistant's reasoning in `<|open|>think<|sep|>`, its answer in `<|open|>response<|sep|>`, its
//! tool calls in `<|open|>tools<|sep|>`, one `<|open|>argument key="K" type="T"<|sep|>` per key.
//!
//! What an assistant turn trains on: its answer and the marker that closes it (the model must
//! learn to stop) are [`Part::Answer`], tool calls included; its reasoning with the tags the model
//! writes is [`Part::Thinking`]; the turn header is [`Part::Markup`]; system, user and tool content
//! is [`Part::Prompt`]. Segments are tokenized one by one, so every id has exactly one part.

pub mod chatml;
mod json;
pub mod k2;
pub mod xtml;

pub use json::Json;

use crate::error::DataError;
use crate::tokenizer::{END_OF_TURN, KIMI_THINK_TAGS, Tokenizer};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role as OpenAI (and every template) names it.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One turn, in OpenAI's message shape. `thinking` is the assistant's reasoning (also accepted as
/// `reasoning_content`, the field vLLM and SGLang return). An assistant turn may call tools; a
/// `tool` turn answers the call `tool_call_id` names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: Role,
    /// Empty when absent or null (an assistant turn that only calls tools).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    #[serde(default, alias = "reasoning_content", alias = "reasoning")]
    pub thinking: Option<String>,
    /// Who speaks (OpenAI's `name`): K3 writes it as an attribute; a tool turn's tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A plain turn: `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            thinking: None,
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// An assistant's call of a tool (OpenAI's `tool_calls` entry).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

impl ToolCall {
    /// A call as a model writes it: no id (the server gives one).
    pub fn new(name: String, arguments: Arguments) -> Self {
        Self {
            id: None,
            kind: function_kind(),
            function: FunctionCall { name, arguments },
        }
    }
}

/// What a model wrote after a format's generation prompt, read whole
/// ([`ChatFormat::parse_reply`]): its reasoning, its answer and its tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub thinking: Option<String>,
    pub content: String,
    pub calls: Vec<ToolCall>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: Arguments,
}

/// A call's arguments: a JSON object, its keys in the order written. OpenAI sends it as a string
/// of JSON (and so is it written back); an object is taken too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arguments(pub Vec<(String, Json)>);

impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        arguments_object(Json::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A call's arguments from what a request or a model wrote: an object, or a string of one.
pub fn arguments_object(value: Json) -> Result<Arguments, String> {
    let value = match value {
        Json::String(text) => {
            Json::parse(&text).map_err(|e| format!("arguments are not JSON: {e}"))?
        }
        other => other,
    };
    match value {
        Json::Object(entries) => Ok(Arguments(entries)),
        _ => Err("arguments are not a JSON object".into()),
    }
}

impl Serialize for Arguments {
    /// As `json.dumps` writes them (vLLM's arguments strings): integers of any size kept exact.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&Json::Object(self.0.clone()).python_dumps())
    }
}

impl Arguments {
    /// Refuses what a model's reply may not hand a client as a call's arguments: a key given
    /// twice (clients would read one of the two) and a number JSON cannot write (NaN, ±Infinity).
    pub fn strict(self) -> Result<Self, String> {
        fn finite(v: &Json) -> bool {
            match v {
                Json::Number(json::Number::Float(x)) => x.is_finite(),
                Json::Array(items) => items.iter().all(finite),
                Json::Object(entries) => entries.iter().all(|(_, v)| finite(v)),
                _ => true,
            }
        }
        for (i, (key, value)) in self.0.iter().enumerate() {
            if self.0[..i].iter().any(|(k, _)| k == key) {
                return Err(format!("the argument {key:?} is given twice"));
            }
            if !finite(value) {
                return Err(format!("the argument {key:?} holds NaN or Infinity"));
            }
        }
        Ok(self)
    }
}

/// A tool declared to a conversation (OpenAI's `tools` entry).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDecl,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionDecl {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON Schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl Tool {
    /// The declaration as its JSON, the fields given in OpenAI's order.
    pub fn to_json(&self) -> Json {
        let f = &self.function;
        let mut function = vec![("name".to_string(), Json::String(f.name.clone()))];
        let optional = [
            ("description", f.description.clone().map(Json::String)),
            ("parameters", f.parameters.clone()),
            ("strict", f.strict.map(Json::Bool)),
        ];
        function.extend(
            optional
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), v?))),
        );
        Json::Object(vec![
            ("type".into(), Json::String(self.kind.clone())),
            ("function".into(), Json::Object(function)),
        ])
    }
}

/// A conversation and the tools declared to it: a JSONL record of chat data (OpenAI's request
/// shape, `{"messages": [...], "tools": [...]}`).
#[derive(Clone, Debug, PartialEq)]
pub struct Chat {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
}

impl Chat {
    /// The conversation in JSON record `line`: its messages under `field`, its tools under
    /// `tools` (optional). Read in order, so calls' arguments written as objects keep their keys'.
    pub fn from_record(line: &str, field: &str) -> Result<Self, String> {
        let record = Json::parse(line)?;
        if !matches!(record, Json::Object(_)) {
            return Err("not a JSON object".into());
        }
        let typed = |value: &Json| serde_json::to_string(value).map_err(|e| e.to_string());
        let listed = record
            .get(field)
            .ok_or_else(|| format!("no `{field}` field"))?;
        let mut messages: Vec<Message> = serde_json::from_str(&typed(listed)?)
            .map_err(|e| format!("`{field}` is not a list of messages: {e}"))?;
        if messages.is_empty() {
            return Err(format!("`{field}` holds no messages"));
        }
        // The typed read went through serde_json's float parsing: arguments are taken from the
        // exact read.
        if let Json::Array(listed) = listed {
            for (m, json) in messages.iter_mut().zip(listed) {
                let Some(Json::Array(calls)) = json.get("tool_calls") else {
                    continue;
                };
                for (call, json) in m.tool_calls.iter_mut().zip(calls) {
                    let exact = match json.get("function").and_then(|f| f.get("arguments")) {
                        Some(Json::String(text)) => Json::parse(text)?,
                        Some(object) => object.clone(),
                        None => continue,
                    };
                    if let Json::Object(entries) = exact {
                        call.function.arguments = Arguments(entries);
                    }
                }
            }
        }
        let tools = match record.get("tools") {
            None | Some(Json::Null) => Vec::new(),
            Some(t) => serde_json::from_str(&typed(t)?)
                .map_err(|e| format!("`tools` is not a list of tool declarations: {e}"))?,
        };
        Ok(Chat { messages, tools })
    }
}

/// How a completion written after a format's generation prompt splits into reasoning and answer,
/// in ids: the reasoning runs through the first `ids` (ChatML's and K2's `</think>`, K3's
/// `<|close|>think<|sep|>`), the rest is answer; a completion without them is all `unclosed`
/// (answer, where the prompt opens nothing; thinking, after K3's prompt opened the section).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThinkingEnd {
    pub ids: Vec<u32>,
    pub unclosed: Part,
}

impl ThinkingEnd {
    /// How many of `completion`'s ids are reasoning.
    pub fn thinking_len(&self, completion: &[u32]) -> usize {
        let n = self.ids.len();
        match completion.windows(n.max(1)).position(|w| w == self.ids) {
            Some(at) => at + n,
            None if self.unclosed == Part::Thinking => completion.len(),
            None => 0,
        }
    }
}

/// A chat format: one per vocabulary, named as recipes name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatFormat {
    Chatml,
    KimiK2,
    /// `kimi` too: the `kimi` vocabulary is K3's.
    #[serde(alias = "kimi")]
    KimiK3,
}

/// What a span of a rendered conversation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    Markup,
    Prompt,
    Thinking,
    Answer,
}

/// Which parts carry loss (the targets a chat document trains on).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossParts {
    #[serde(default)]
    pub prompt: bool,
    #[serde(default = "yes")]
    pub thinking: bool,
    #[serde(default = "yes")]
    pub answer: bool,
}

fn yes() -> bool {
    true
}

impl Default for LossParts {
    fn default() -> Self {
        Self {
            prompt: false,
            thinking: true,
            answer: true,
        }
    }
}

impl LossParts {
    pub fn trains(&self, part: Part) -> bool {
        match part {
            Part::Markup => false,
            Part::Prompt => self.prompt,
            Part::Thinking => self.thinking,
            Part::Answer => self.answer,
        }
    }
}

/// A span of a rendered conversation. `special` spans (template markup, think tags) are encoded with
/// special tokens recognised; everything people wrote is encoded as plain text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub part: Part,
    pub special: bool,
    pub text: String,
}

/// A conversation as tagged text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    pub segments: Vec<Segment>,
}

impl Rendered {
    fn push(&mut self, part: Part, special: bool, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.segments.last_mut() {
            Some(s) if s.part == part && s.special == special => s.text.push_str(text),
            _ => self.segments.push(Segment {
                part,
                special,
                text: text.into(),
            }),
        }
    }

    /// The whole conversation as one string.
    pub fn text(&self) -> String {
        self.segments.iter().map(|s| s.text.as_str()).collect()
    }

    /// The bytes of its text, markup included.
    pub fn text_len(&self) -> usize {
        self.segments.iter().map(|s| s.text.len()).sum()
    }

    /// Token ids and the part of each.
    pub fn encode(&self, tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<Part>), DataError> {
        let (mut ids, mut parts) = (Vec::new(), Vec::new());
        for s in &self.segments {
            let piece = if s.special {
                tokenizer.encode_with_specials(&s.text)?
            } else {
                tokenizer.encode(&s.text)?
            };
            parts.extend(std::iter::repeat_n(s.part, piece.len()));
            ids.extend(piece);
        }
        Ok((ids, parts))
    }
}

/// The reasoning tags (one place: Kimi's vocabulary gives them reserved ids).
pub const THINK_OPEN: &str = KIMI_THINK_TAGS[0].0;
pub const THINK_CLOSE: &str = KIMI_THINK_TAGS[1].0;

/// Renders a conversation and the tools declared to it. `generation_prompt` appends the
/// assistant header (for sampling).
pub fn render(
    messages: &[Message],
    tools: &[Tool],
    format: ChatFormat,
    generation_prompt: bool,
) -> Result<Rendered, DataError> {
    if messages.is_empty() {
        return Err(DataError::Conversation(
            "the conversation has no messages".into(),
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let only = match (m.role, m.thinking.is_some(), m.tool_calls.is_empty()) {
            (Role::Assistant, _, _) | (_, false, true) => continue,
            (_, true, _) => "carry thinking",
            (_, false, false) => "call tools",
        };
        return Err(DataError::Conversation(format!(
            "message {i}: only assistant turns {only}"
        )));
    }
    match format {
        ChatFormat::KimiK3 => xtml::render(messages, tools, generation_prompt),
        ChatFormat::KimiK2 => k2::render(messages, tools, generation_prompt),
        ChatFormat::Chatml => chatml::render(messages, tools, generation_prompt),
    }
}

/// Splits a completion into its reasoning and its answer: the text between `<think>` and `</think>`
/// (or before a lone `</think>`, for templates whose generation header opens the block) and what
/// follows, both trimmed. Without the tags it is all answer.
pub fn split_thinking(text: &str) -> (Option<String>, String) {
    let Some((before, after)) = text.split_once(THINK_CLOSE) else {
        return (None, text.trim().to_string());
    };
    let thinking = before.split_once(THINK_OPEN).map_or(before, |(_, t)| t);
    (Some(thinking.trim().to_string()), after.trim().to_string())
}

impl ChatFormat {
    /// The marker that ends a turn in this template.
    pub fn end_of_turn(self) -> &'static str {
        match self {
            ChatFormat::Chatml | ChatFormat::KimiK2 => END_OF_TURN,
            ChatFormat::KimiK3 => xtml::END_OF_MSG,
        }
    }

    /// Splits a completion written after this format's generation prompt into its reasoning and
    /// its answer, both trimmed ([`split_thinking`]; K3's: [`xtml::split_completion`]).
    pub fn split_completion(self, text: &str) -> (Option<String>, String) {
        match self {
            ChatFormat::Chatml | ChatFormat::KimiK2 => split_thinking(text),
            ChatFormat::KimiK3 => xtml::split_completion(text),
        }
    }

    /// Reads a whole reply written after this format's generation prompt, its end-of-turn id cut
    /// off, into reasoning, answer and tool calls; refused, naming why, where it is not one the
    /// format's parser reads cleanly (a call cut short, a marker left over, text where none goes).
    pub fn parse_reply(self, text: &str) -> Result<Reply, String> {
        match self {
            ChatFormat::Chatml => chatml::parse_reply(text),
            ChatFormat::KimiK2 => k2::parse_reply(text),
            ChatFormat::KimiK3 => xtml::parse_reply(text),
        }
    }

    /// The format whose template (as [`ChatFormat::jinja`] writes it) `template` is: an exported
    /// GGUF's `tokenizer.chat_template`.
    pub fn of_template(template: &str) -> Option<ChatFormat> {
        [ChatFormat::Chatml, ChatFormat::KimiK2, ChatFormat::KimiK3]
            .into_iter()
            .find(|f| f.jinja() == template)
    }

    /// The format a model with `tokenizer` speaks: `named` (its plan's, or its GGUF template's)
    /// where the vocabulary holds that format's markers, else the one its markers name.
    pub fn spoken(named: Option<ChatFormat>, tokenizer: &Tokenizer) -> Option<ChatFormat> {
        named
            .filter(|&f| check_markers(f, tokenizer).is_ok())
            .or_else(|| ChatFormat::of_tokenizer(tokenizer))
    }

    /// The format whose markers are all single tokens of `tokenizer`: K3's, K2's (the two name
    /// the same reserved ids otherwise), then ChatML; None when no format's are.
    pub fn of_tokenizer(tokenizer: &Tokenizer) -> Option<ChatFormat> {
        [ChatFormat::KimiK3, ChatFormat::KimiK2, ChatFormat::Chatml]
            .into_iter()
            .find(|&f| check_markers(f, tokenizer).is_ok())
    }

    /// Where a completion's reasoning ends in `tokenizer`'s ids ([`ThinkingEnd`]); None when the
    /// format's closing tag is not one token of it (nothing can be told apart then).
    pub fn thinking_end(self, tokenizer: &Tokenizer) -> Result<Option<ThinkingEnd>, DataError> {
        Ok(match self {
            ChatFormat::Chatml | ChatFormat::KimiK2 => {
                tokenizer.token_id(THINK_CLOSE).map(|id| ThinkingEnd {
                    ids: vec![id],
                    unclosed: Part::Answer,
                })
            }
            ChatFormat::KimiK3 => {
                let close = format!("{}think{}", xtml::CLOSE, xtml::SEP);
                Some(ThinkingEnd {
                    ids: tokenizer.encode_with_specials(&close)?,
                    unclosed: Part::Thinking,
                })
            }
        })
    }

    /// The format a vocabulary's models speak: K3's and K2's own for the Kimi vocabularies (as
    /// `Tokenizer::builtin` names them), ChatML for every other.
    pub fn of_vocabulary(builtin: Option<&str>) -> ChatFormat {
        match builtin {
            Some("kimi_k3") => ChatFormat::KimiK3,
            Some("kimi_k2") => ChatFormat::KimiK2,
            _ => ChatFormat::Chatml,
        }
    }

    /// The format as a Jinja chat template: `tokenizer.chat_template` of an exported GGUF, so
    /// llama.cpp renders chats and tools as the student was trained on them, and picks the
    /// format's tool-call parser. ChatML's is k3mini's own (`templates/chatml.jinja`); the Kimi
    /// formats' are the reference templates themselves (llama.cpp's `Kimi-K3.jinja`, Moonshot's
    /// `Kimi-K2-Thinking.jinja`, copied by `scripts/golden/chat_templates.py`), which llama.cpp
    /// recognises by their text. Each is held to this renderer by the golden cases (K2's where it
    /// keeps the reasoning k3mini keeps; see docs/export.md for what the Kimi ones render beyond).
    pub fn jinja(self) -> &'static str {
        match self {
            ChatFormat::Chatml => include_str!("templates/chatml.jinja"),
            ChatFormat::KimiK2 => include_str!("templates/Kimi-K2-Thinking.jinja"),
            ChatFormat::KimiK3 => include_str!("templates/Kimi-K3.jinja"),
        }
    }

    /// The name recipes give it.
    pub fn name(self) -> &'static str {
        match self {
            ChatFormat::Chatml => "chatml",
            ChatFormat::KimiK2 => "kimi_k2",
            ChatFormat::KimiK3 => "kimi_k3",
        }
    }
}

/// The special tokens a template's markup is made of.
pub fn markers(format: ChatFormat) -> &'static [&'static str] {
    match format {
        ChatFormat::Chatml => &["<|im_start|>", END_OF_TURN],
        ChatFormat::KimiK2 => &k2::MARKERS,
        ChatFormat::KimiK3 => &xtml::MARKERS,
    }
}

/// Refuses a tokenizer in which a template marker is not one token (the markup would be trained as
/// ordinary text and the model would never see the ids its runtime sends).
pub fn check_markers(format: ChatFormat, tokenizer: &Tokenizer) -> Result<(), DataError> {
    let missing: Vec<&str> = markers(format)
        .iter()
        .copied()
        .filter(|m| tokenizer.token_id(m).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let hint = match (format, tokenizer.name()) {
        (ChatFormat::KimiK2, "kimi_k3") => {
            ": K3's vocabulary renames K2's chat markers; K3's own format is chat = \"kimi_k3\""
        }
        (ChatFormat::KimiK3, "kimi_k2") => {
            ": K2's vocabulary names K3's marker ids otherwise; K2's own format is chat = \"kimi_k2\""
        }
        (ChatFormat::Chatml, _) => {
            ": a trained BPE needs them as specials (`k3mini data tokenizer train --special '<|im_start|>' --special '<|im_end|>'`)"
        }
        _ => "",
    };
    Err(DataError::Markers {
        template: format.name().to_string(),
        missing: missing.join(" "),
        tokenizer: tokenizer.name().to_string(),
        hint,
    })
}
