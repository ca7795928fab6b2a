//! The JSON that crosses the wire between k3mini and teacher servers, as typed serde structs: one
//! module per API, each used by `teacher serve` (which reads the requests and writes the responses)
//! and by k3mini's clients (which write the requests and read the responses), so a field that
//! drifts on one side fails to compile or fails the golden fixtures (`tests/fixtures/wire/`), not a
//! run.
//!
//! - [`openai`]: `/v1/completions` and `/v1/chat/completions`, with vLLM's extensions to them;
//! - [`vllm`]: what only vLLM sends (`prompt_logprobs` entries, routed experts);
//! - [`sglang`]: SGLang's native `/generate`.
//!
//! Unknown request fields are accepted and ignored, as vLLM's request models (`extra = "allow"`)
//! treat them. Every field a server may leave out is an `Option` (or defaults), and a response's
//! absent optional field is left out, not sent as `null`.

pub mod openai;
pub mod sglang;
pub mod vllm;

pub use k3mini_http::json::{
    ErrorInfo, ErrorResponse, Health, parse_request, parse_request_naming_unknown,
};
use serde::{Deserialize, Serialize};

/// `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    #[serde(default = "list")]
    pub object: String,
    pub data: Vec<ModelCard>,
}

fn list() -> String {
    "list".into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    #[serde(default)]
    pub object: String,
    #[serde(default)]
    pub created: u64,
    #[serde(default)]
    pub owned_by: String,
    /// vLLM's: the model the card serves (a LoRA adapter's base, else the model itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// vLLM's: the context length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
}

/// A logprob as the servers send it: vLLM writes −inf as −9999.0 (JSON has no infinities).
pub fn finite_logprob(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { -9999.0 }
}
