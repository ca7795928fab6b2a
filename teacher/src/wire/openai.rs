//! OpenAI's `/v1/completions` (legacy) and `/v1/chat/completions`, with the fields vLLM adds to
//! them (`prompt_logprobs`, `return_token_ids`, `return_tokens_as_token_ids`, `stop_token_ids`,
//! `ignore_eos`, `routed_experts_prompt_start`; in responses [`vllm`] types).
//!
//! Token ids in requests are `u64`, so an id past `u32` arrives intact and is refused by range
//! rather than wrapped.

use super::vllm::{PromptLogprobs, RoutedExpertsField};
use k3mini_data::chat::{FunctionCall, Message, Tool, ToolCall};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A completion's prompt: text, or token ids (one prompt per request).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u64>),
}

impl Default for Prompt {
    fn default() -> Self {
        Self::Text(String::new())
    }
}

/// By hand rather than `untagged`, so a wrong prompt is named for what it must be.
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Prompt;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list of token ids")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(s.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Prompt, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<serde_json::Number>()? {
                    ids.push(id.as_u64().ok_or_else(|| {
                        serde::de::Error::custom(format!(
                            "a prompt list must hold token ids (one prompt per request), not {id}"
                        ))
                    })?);
                }
                Ok(Prompt::Ids(ids))
            }
        }
        d.deserialize_any(Visitor).map_err(|e: D::Error| {
            serde::de::Error::custom(format!(
                "`prompt` must be a string or a list of token ids: {e}"
            ))
        })
    }
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<u64>,
    /// Top-k logprobs per token (legacy shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<bool>,
    /// vLLM: top-k logprobs of every prompt position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_token_ids: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_tokens_as_token_ids: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// vLLM: the first token whose routed experts are returned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts_prompt_start: Option<u64>,
    /// Server-sent events ([`CompletionChunk`]s) instead of one response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// OpenAI's stop sequences: a string or up to 4 (the text ends before the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
}

/// OpenAI's `stop`: one string or a list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn strings(&self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        }
    }
}

/// `/v1/completions`' answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM 0.21: the prompt's routed experts, `[tokens][layers][k]`, beside the choices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_routed_experts: Option<Vec<Vec<Vec<i64>>>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub text: String,
    /// `stop` or `length`.
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<LegacyLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<RoutedExpertsField>,
}

/// OpenAI legacy `logprobs`: per token its name (text, or `token_id:N`), its logprob (`null` for a
/// prompt's first token) and its top-k as `{token: logprob}` (`null` where there is none).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LegacyLogprobs {
    #[serde(default)]
    pub text_offset: Vec<u64>,
    pub token_logprobs: Vec<Option<f32>>,
    pub tokens: Vec<String>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// OpenAI's newer name for `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Server-sent events ([`ChatChunk`]s) instead of one response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// What the answer must be (JSON, or JSON a schema accepts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Whether and which tools the answer must call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Whether the answer may call more than one tool (OpenAI's default: yes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI's stop sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
}

/// A chat request's `tool_choice`: `none` (no call), `auto` (the model decides), `required` (at
/// least one call), or one function by name (`{"type": "function", "function": {"name": …}}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(ToolMode),
    Named(NamedTool),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolMode {
    None,
    Auto,
    Required,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedTool {
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolName,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolName {
    pub name: String,
}

/// A chat request's `response_format`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`: a user's JSON Schema, arbitrary JSON by nature.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub schema: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    #[serde(default)]
    pub index: u32,
    pub message: ChatMessage,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<String>,
    /// vLLM's reasoning parsers put the thinking here.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        alias = "reasoning_content"
    )]
    pub reasoning: Option<String>,
    /// The calls the answer makes (its `content` then null when it says nothing else).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Option<Vec<ChatTokenLogprob>>,
}

/// A generated token: its text, logprob, UTF-8 bytes, and its top-k alternatives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
    #[serde(default)]
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    #[serde(default)]
    pub bytes: Option<Vec<u8>>,
}

/// One event of a streamed `/v1/chat/completions` (`data: {…}` lines, then `data: [DONE]`): the
/// text added since the previous event; the last carries `finish_reason` (and `usage`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunk {
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    #[serde(default)]
    pub index: u32,
    pub delta: ChatDelta,
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// What a chat event adds: the role (first event), then content, then tool calls.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        alias = "reasoning_content"
    )]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A tool call in a stream: its place in the answer's calls, then its id, type and function (a
/// server may send the arguments in pieces; k3mini sends each call whole).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCall,
}

/// One event of a streamed `/v1/completions`: the text added since the previous event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunk {
    pub id: String,
    /// `text_completion`, as OpenAI's stream names it.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunkChoice {
    #[serde(default)]
    pub index: u32,
    pub text: String,
    #[serde(default)]
    pub finish_reason: Option<String>,
}
