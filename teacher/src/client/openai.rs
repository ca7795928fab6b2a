//! OpenAI legacy echo (llama-cpp-python's server, vLLM): `POST /v1/completions {"prompt": ids,
//! "echo": true, "logprobs": k, "max_tokens": 1}`; `choices[0].logprobs` holds `tokens`,
//! `token_logprobs` (null first) and `top_logprobs` (maps token → logprob) for the prompt, then for
//! the one generated token, which is dropped. Tokens are named `token_id:N` where the server honours
//! `return_tokens_as_token_ids`, else by their text, mapped back to ids through
//! [`super::ClientOptions::pieces`] (a text two ids share is refused as ambiguous).
//!
//! [`generate`] serves vLLM too: ids from `token_ids` where the server returns them, else from
//! `logprobs.tokens`.

use super::{ApiClient, Shared, push_row, server_err};
use crate::wire::openai::{CompletionRequest, LegacyLogprobs, Prompt};
use crate::{FinishReason, GenerateParams, Generation, Scored, TeacherError};
use std::collections::BTreeMap;

pub(crate) struct Openai;

fn prompt(ids: &[u32]) -> Prompt {
    Prompt::Ids(ids.iter().map(|&i| i as u64).collect())
}

/// A legacy choice's `logprobs`, every list as long as `tokens`.
fn legacy(lp: Option<LegacyLogprobs>) -> Result<LegacyLogprobs, TeacherError> {
    let lp = lp.ok_or_else(|| server_err("the response has no choices[0].logprobs"))?;
    if lp.token_logprobs.len() != lp.tokens.len() || lp.top_logprobs.len() != lp.tokens.len() {
        return Err(server_err(format!(
            "logprobs: {} tokens, {} token_logprobs, {} top_logprobs",
            lp.tokens.len(),
            lp.token_logprobs.len(),
            lp.top_logprobs.len()
        )));
    }
    Ok(lp)
}

/// A `top_logprobs` entry (`{token: logprob}`) as `(id, logprob)` pairs.
fn top_map(
    s: &Shared,
    top: Option<&BTreeMap<String, f32>>,
    what: &str,
) -> Result<Vec<(u32, f32)>, TeacherError> {
    top.ok_or_else(|| server_err(format!("{what} is null")))?
        .iter()
        .map(|(key, &lp)| Ok((s.vocab.key(key, what)?, lp)))
        .collect()
}

impl ApiClient for Openai {
    fn score(&self, s: &Shared, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        // max_tokens 1, not 0: some servers (llama-cpp-python) read 0 as "until the context ends".
        let response = s.completion(&CompletionRequest {
            model: Some(s.model.clone()),
            prompt: prompt(ids),
            echo: Some(true),
            logprobs: Some(k as u64),
            max_tokens: Some(1),
            temperature: Some(0.0),
            return_tokens_as_token_ids: Some(true),
            ..Default::default()
        })?;
        let lp = legacy(Shared::only_choice(response.choices)?.logprobs)?;
        // The prompt's entries, then the generated token's.
        if lp.tokens.len() < ids.len() {
            return Err(server_err(format!(
                "echo returned logprobs for {} tokens of a {}-token prompt",
                lp.tokens.len(),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for t in 1..ids.len() {
            let echoed = s.vocab.key(&lp.tokens[t], "logprobs.tokens")?;
            if echoed != ids[t] {
                return Err(server_err(format!(
                    "logprobs.tokens[{t}] is token {echoed}, not the prompt's {}",
                    ids[t]
                )));
            }
            let target = lp.token_logprobs[t].ok_or_else(|| {
                server_err(format!("logprobs.token_logprobs[{t}] is not a number"))
            })?;
            out.target_logprobs.push(target);
            let what = format!("logprobs.top_logprobs[{t}]");
            let row = top_map(s, lp.top_logprobs[t].as_ref(), &what)?;
            push_row(row, k, &what, &mut out.top_ids, &mut out.top_logprobs)?;
        }
        Ok(out)
    }

    fn token_ids(&self, s: &Shared, text: &str) -> Result<Vec<u32>, TeacherError> {
        let response = s.completion(&CompletionRequest {
            model: Some(s.model.clone()),
            prompt: Prompt::Text(text.into()),
            echo: Some(true),
            logprobs: Some(0),
            max_tokens: Some(1),
            return_tokens_as_token_ids: Some(true),
            ..Default::default()
        })?;
        let lp = legacy(Shared::only_choice(response.choices)?.logprobs)?;
        // The last token is the generated one.
        let prompt = &lp.tokens[..lp.tokens.len().saturating_sub(1)];
        prompt
            .iter()
            .map(|t| s.vocab.key(t, "logprobs.tokens"))
            .collect()
    }
}

/// vLLM's generation (ids from `token_ids`) and OpenAI legacy (ids from `logprobs.tokens`).
pub(super) fn generate(
    s: &Shared,
    prompt_ids: &[u32],
    params: &GenerateParams,
) -> Result<Generation, TeacherError> {
    let response = s.completion(&CompletionRequest {
        model: Some(s.model.clone()),
        prompt: prompt(prompt_ids),
        max_tokens: Some(params.max_tokens as u64),
        temperature: Some(params.temperature),
        top_p: Some(params.top_p),
        seed: Some(params.seed),
        stop_token_ids: Some(params.stop.iter().map(|&i| i as u64).collect()),
        ignore_eos: Some(true),
        return_token_ids: Some(true),
        return_tokens_as_token_ids: Some(true),
        // Every generated token's logprob is wanted, even without a top-k.
        logprobs: Some(params.logprobs.max(1) as u64),
        ..Default::default()
    })?;
    let choice = Shared::only_choice(response.choices)?;
    let lp = legacy(choice.logprobs)?;
    let ids = match &choice.token_ids {
        Some(ids) => s.vocab.check_all(ids, "token_ids")?,
        None => lp
            .tokens
            .iter()
            .map(|t| s.vocab.key(t, "logprobs.tokens"))
            .collect::<Result<Vec<_>, _>>()?,
    };
    if lp.tokens.len() != ids.len() {
        return Err(server_err("logprobs do not cover every generated token"));
    }
    let k = params.logprobs;
    let mut g = Generation {
        logprobs: lp
            .token_logprobs
            .iter()
            .map(|l| l.unwrap_or(f32::NEG_INFINITY))
            .collect(),
        k,
        top_ids: Vec::new(),
        top_logprobs: Vec::new(),
        finish: match choice.finish_reason.as_deref() {
            Some("stop") => FinishReason::Stop,
            _ => FinishReason::Length,
        },
        ids,
    };
    if k > 0 {
        for (i, top) in lp.top_logprobs.iter().enumerate() {
            let what = format!("top_logprobs[{i}]");
            let row = top_map(s, top.as_ref(), &what)?;
            push_row(row, k, &what, &mut g.top_ids, &mut g.top_logprobs)?;
        }
    }
    Ok(g)
}
