//! What vLLM adds to OpenAI's completions response: `prompt_logprobs` and routed experts
//! (SPEC §6, §10; the routed-expert payloads themselves are decoded in [`crate::routing::wire`]).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `choices[i].prompt_logprobs`: `null` for the first prompt token (it has no distribution), then
/// per position `{"<id>": entry}` holding the top-k and, always, the actual token (so up to k + 1).
pub type PromptLogprobs = Vec<Option<BTreeMap<String, PromptLogprob>>>;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PromptLogprob {
    pub logprob: f32,
    #[serde(default)]
    pub rank: Option<u64>,
    #[serde(default)]
    pub decoded_token: Option<String>,
}

/// `choices[i].routed_experts` (`--enable-return-routed-experts`): the base64 of an `np.save` file
/// (current vLLM), or nested `[tokens][layers][k]` lists of the generated tokens (0.21).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RoutedExpertsField {
    Npy(String),
    Lists(Vec<Vec<Vec<i64>>>),
}
