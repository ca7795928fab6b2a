//! vLLM. Scoring a fixed sequence: `POST /v1/completions {"prompt": ids, "max_tokens": 1,
//! "prompt_logprobs": k, "temperature": 0}`; `choices[0].prompt_logprobs` is `[null, {"<id>":
//! {"logprob", "rank"}}, …]` with the actual token always present (so up to k + 1 entries).
//! Generation: `logprobs: k` with `return_token_ids` and `return_tokens_as_token_ids`
//! (the default [`ApiClient::generate`]). Routed experts: `choices[0].routed_experts` (base64 `.npy`), or
//! 0.21's nested lists (`prompt_routed_experts` beside the choices).

use super::{ApiClient, Shared, push_row, server_err};
use crate::routing::wire;
use crate::wire::openai::{CompletionRequest, Prompt};
use crate::wire::vllm::RoutedExpertsField;
use crate::{Scored, TeacherError};

pub(crate) struct Vllm;

impl ApiClient for Vllm {
    fn score(&self, s: &Shared, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let response = s.completion(&CompletionRequest {
            model: Some(s.model.clone()),
            prompt: Prompt::Ids(ids.iter().map(|&i| i as u64).collect()),
            max_tokens: Some(1),
            prompt_logprobs: Some(k as u64),
            temperature: Some(0.0),
            ..Default::default()
        })?;
        let prompt_routed = response.prompt_routed_experts;
        let choice = Shared::only_choice(response.choices)?;
        let entries = choice
            .prompt_logprobs
            .ok_or_else(|| server_err("the response has no choices[0].prompt_logprobs"))?;
        if entries.len() != ids.len() {
            return Err(server_err(format!(
                "prompt_logprobs has {} entries for {} tokens",
                entries.len(),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for (pos, entry) in entries.into_iter().skip(1).enumerate() {
            let what = format!("prompt_logprobs[{}]", pos + 1);
            let map = entry.ok_or_else(|| server_err(format!("{what} is null")))?;
            let row = map
                .iter()
                .map(|(key, e)| {
                    let id = key.parse::<u64>().map_err(|_| {
                        server_err(format!("{what}: key {key:?} is not a token id"))
                    })?;
                    Ok((s.vocab.check(id, &what)?, e.logprob))
                })
                .collect::<Result<Vec<_>, TeacherError>>()?;
            let target = ids[pos + 1];
            let target_lp = row
                .iter()
                .find(|(id, _)| *id == target)
                .map(|(_, lp)| *lp)
                .ok_or_else(|| server_err(format!("{what} lacks the actual token {target}")))?;
            out.target_logprobs.push(target_lp);
            // The top k of the (k or k + 1) entries.
            push_row(row, k, &what, &mut out.top_ids, &mut out.top_logprobs)?;
        }
        // Current vLLM: a base64 `.npy` per choice; 0.21: the prompt's as nested lists at the
        // top level (the one generated token's, in the choice, is not needed).
        out.routing = s.routing_of(
            |shape| match (&choice.routed_experts, &prompt_routed) {
                (Some(RoutedExpertsField::Npy(b64)), _) => wire::from_vllm(b64).map(Some),
                (_, Some(lists)) => wire::from_vllm_lists(lists, shape.layers, shape.k).map(Some),
                _ => Ok(None),
            },
            ids.len(),
            ids.len(),
        )?;
        Ok(out)
    }

    fn token_ids(&self, s: &Shared, text: &str) -> Result<Vec<u32>, TeacherError> {
        let response = s.completion(&CompletionRequest {
            model: Some(s.model.clone()),
            prompt: Prompt::Text(text.into()),
            max_tokens: Some(1),
            return_token_ids: Some(true),
            ..Default::default()
        })?;
        let ids = Shared::only_choice(response.choices)?
            .prompt_token_ids
            .ok_or_else(|| server_err("no choices[0].prompt_token_ids (return_token_ids)"))?;
        s.vocab.check_all(&ids, "prompt_token_ids")
    }
}
