//! SGLang's native `POST /generate` (`GenerateReqInput` and the response's `meta_info`).

use serde::{Deserialize, Serialize};

/// `POST /generate`: `input_ids` or `text`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_ids: Option<Vec<u64>>,
    #[serde(default)]
    pub sampling_params: SamplingParams,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_logprob: Option<bool>,
    /// Where in the prompt logprobs start; −1 (SGLang's default) is the prompt's last token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprob_start_len: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs_num: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub return_routed_experts: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts_start_len: Option<u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// SGLang's name for the seed (it refuses unknown keys in `sampling_params`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u64>,
}

/// `/generate`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    #[serde(default)]
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_ids: Option<Vec<u64>>,
    pub meta_info: MetaInfo,
}

/// A logprob entry: `[logprob, token id, token text or null]`; the logprob is `null` for a
/// prompt's first token.
pub type Entry = (Option<f32>, u64, Option<String>);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetaInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_token_logprobs: Option<Vec<Entry>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_top_logprobs: Option<Vec<Option<Vec<Entry>>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_token_logprobs: Option<Vec<Entry>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_top_logprobs: Option<Vec<Option<Vec<Entry>>>>,
    /// Base64 of raw little-endian int32 `[tokens, layers, k]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
}

/// `{"type": "length", "length": N}` or `{"type": "stop", "matched": id}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinishReason {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched: Option<Matched>,
}

/// What a stop matched: a stop token's id, or a stop string.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Matched {
    Id(u64),
    Text(String),
}
