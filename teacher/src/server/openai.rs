//! `/v1/completions` and `/v1/chat/completions`, vLLM-style.
//!
//! Completions: `prompt` (text or token ids), `max_tokens` (default 16, 0 allowed with `echo`),
//! `temperature`, `top_p`, `seed`, `stop_token_ids`, `ignore_eos`; `logprobs: K` (top-K per
//! generated token, OpenAI legacy shape), `echo` (with `logprobs`: the prompt's tokens and logprobs
//! first, the first one `null`), `prompt_logprobs: K` (vLLM shape, the actual token always
//! included), `return_token_ids`, `return_tokens_as_token_ids` (`"token_id:123"` keys); vLLM's
//! `choices[0].routed_experts` (base64 `np.save`, int32) on every completion of a server recording
//! routing, from `routed_experts_prompt_start`.
//!
//! Chat: `messages` (ChatML), `max_tokens` (or `max_completion_tokens`), `temperature`,
//! `logprobs`, `top_logprobs`.

use super::{ApiError, SamplingFields, State, bad, count};
use crate::local::Ran;
use crate::routing::wire;
use crate::stop::{cut_at_stop, cut_text, stop_strings};
use crate::wire::finite_logprob;
use crate::wire::openai::{
    ChatChoice, ChatLogprobs, ChatMessage, ChatRequest, ChatResponse, ChatTokenLogprob,
    ChatTopLogprob, CompletionChoice, CompletionRequest, CompletionResponse, LegacyLogprobs,
    Prompt, ResponseFormat, Usage,
};
use crate::wire::vllm::{PromptLogprob, RoutedExpertsField};
use crate::{FinishReason, Interrupt, Teacher};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use k3mini_data::ChatFormat;
use k3mini_data::chat::render;
use std::collections::BTreeMap;

fn finish(reason: Option<FinishReason>) -> Option<String> {
    Some(match reason {
        Some(FinishReason::Stop) => "stop".into(),
        _ => "length".into(),
    })
}

/// A teacher answers whole: asked to stream, it says so rather than answer in the wrong shape.
fn refuse_stream(stream: Option<bool>) -> Result<(), ApiError> {
    if stream == Some(true) {
        return Err(bad(
            "stream",
            "this server does not stream (`k3mini agent serve` does); send `stream: false`",
        ));
    }
    Ok(())
}

fn usage(prompt: usize, completion: usize) -> Usage {
    Usage {
        prompt_tokens: prompt as u64,
        completion_tokens: completion as u64,
        total_tokens: (prompt + completion) as u64,
    }
}

pub(super) fn completions(
    state: &State,
    req: CompletionRequest,
    interrupt: Interrupt,
) -> Result<CompletionResponse, ApiError> {
    refuse_stream(req.stream)?;
    let stops = stop_strings(req.stop.as_ref()).map_err(|e| bad("stop", e))?;
    let logprobs = count(req.logprobs, "logprobs")?;
    let prompt_logprobs = count(req.prompt_logprobs, "prompt_logprobs")?;
    let p = state.params(SamplingFields::of_completion(&req, logprobs.unwrap_or(0)))?;
    let (ids, admitted) = match &req.prompt {
        Prompt::Text(s) => state.admit_text(s, "prompt")?,
        Prompt::Ids(ids) => state.admit_ids(ids, "prompt")?,
    };
    state.check_length(ids.len(), &p)?;
    let echo = req.echo.unwrap_or(false);
    let as_ids = req.return_tokens_as_token_ids.unwrap_or(false);
    let t = &state.teacher;
    // Prompt scoring (for echo + logprobs and for prompt_logprobs) over the whole prompt.
    let want_prompt = prompt_logprobs.or(if echo { logprobs } else { None });
    let score_k = want_prompt.filter(|_| ids.len() >= 2).map(|k| k.max(1));
    // One prefill serves both the prompt's logprobs and the generation.
    let Ran {
        scored,
        mut generated,
        mut routing,
    } = {
        let _turn = state.turn(admitted, interrupt)?;
        t.run(&ids, score_k, (p.max_tokens > 0).then_some(&p), interrupt)?
    };
    if let Some(g) = generated.as_mut()
        && let Some(n) = cut_at_stop(&g.ids, &stops, |ids| state.text(ids))
    {
        g.stop_after(n);
        // The prompt's tokens and every kept one's but the last were routed.
        routing = routing.map(|r| r.until_token(ids.len() + n - 1));
    }
    let tok = |id: u32| state.token_key(id, as_ids);
    let out_ids: Vec<u32> = generated.as_ref().map_or_else(Vec::new, |g| g.ids.clone());
    let answer = cut_text(state.text(&out_ids), &stops);
    let mut choice = CompletionChoice {
        index: 0,
        text: if echo {
            state.text(&ids) + &answer
        } else {
            answer
        },
        finish_reason: finish(generated.as_ref().map(|g| g.finish)),
        logprobs: None,
        prompt_logprobs: None,
        prompt_token_ids: None,
        token_ids: None,
        routed_experts: None,
    };
    if let (Some(k), Some(s)) = (prompt_logprobs, &scored) {
        // vLLM: position 0 has no distribution; each entry holds the top-k and the actual token.
        let mut entries = vec![None];
        for pos in 0..s.positions() {
            let mut m = BTreeMap::new();
            let row = pos * s.k..(pos + 1) * s.k;
            for (r, (&id, &lp)) in s.top_ids[row.clone()]
                .iter()
                .zip(&s.top_logprobs[row.clone()])
                .take(k.max(1))
                .enumerate()
            {
                m.insert(id.to_string(), entry(lp, r + 1, tok(id)));
            }
            let actual = s.ids[pos + 1];
            if !m.contains_key(&actual.to_string()) {
                let lp = s.target_logprobs[pos];
                let rank = 1 + s.top_logprobs[row].iter().filter(|&&x| x > lp).count();
                m.insert(actual.to_string(), entry(lp, rank, tok(actual)));
            }
            entries.push(Some(m));
        }
        choice.prompt_logprobs = Some(entries);
    }
    if let Some(k) = logprobs {
        // As vLLM: the top k, and the token itself always (so up to k + 1 entries).
        let top_map = |ids: &[u32], lps: &[f32], actual: u32, lp: f32| {
            let mut m: BTreeMap<String, f32> = ids
                .iter()
                .zip(lps)
                .take(k)
                .map(|(&id, &lp)| (tok(id), finite_logprob(lp)))
                .collect();
            m.entry(tok(actual)).or_insert(finite_logprob(lp));
            Some(m)
        };
        let mut lp = LegacyLogprobs::default();
        if echo {
            lp.tokens.push(tok(ids[0]));
            lp.token_logprobs.push(None);
            lp.top_logprobs.push(None);
            if let Some(s) = &scored {
                for pos in 0..s.positions() {
                    let (actual, target) = (s.ids[pos + 1], s.target_logprobs[pos]);
                    lp.tokens.push(tok(actual));
                    lp.token_logprobs.push(Some(finite_logprob(target)));
                    let r = pos * s.k..(pos + 1) * s.k;
                    lp.top_logprobs.push(top_map(
                        &s.top_ids[r.clone()],
                        &s.top_logprobs[r],
                        actual,
                        target,
                    ));
                }
            }
        }
        if let Some(g) = &generated {
            for (i, &id) in g.ids.iter().enumerate() {
                lp.tokens.push(tok(id));
                lp.token_logprobs.push(Some(finite_logprob(g.logprobs[i])));
                let r = i * g.k..(i + 1) * g.k;
                lp.top_logprobs.push(top_map(
                    &g.top_ids[r.clone()],
                    &g.top_logprobs[r],
                    id,
                    g.logprobs[i],
                ));
            }
        }
        // Each token's offset into `text`, as OpenAI's legacy shape carries it.
        let mut offset = 0u64;
        for token in &lp.tokens {
            lp.text_offset.push(offset);
            offset += token.len() as u64;
        }
        choice.logprobs = Some(lp);
    }
    if req.return_token_ids.unwrap_or(false) {
        choice.prompt_token_ids = Some(ids.iter().map(|&i| i as u64).collect());
        choice.token_ids = Some(out_ids.iter().map(|&i| i as u64).collect());
    }
    // vLLM returns them on every request once the server is started to.
    let start = req.routed_experts_prompt_start.unwrap_or(0) as usize;
    if let Some(r) = state.routed(routing, start) {
        choice.routed_experts = Some(RoutedExpertsField::Npy(STANDARD.encode(wire::to_npy(&r))));
    }
    Ok(CompletionResponse {
        id: format!("cmpl-{}", state.created),
        object: "text_completion".into(),
        created: state.created,
        model: t.name().into(),
        choices: vec![choice],
        usage: Some(usage(ids.len(), out_ids.len())),
        prompt_routed_experts: None,
    })
}

fn entry(lp: f32, rank: usize, decoded: String) -> PromptLogprob {
    PromptLogprob {
        logprob: finite_logprob(lp),
        rank: Some(rank as u64),
        decoded_token: Some(decoded),
    }
}

pub(super) fn chat(
    state: &State,
    req: ChatRequest,
    interrupt: Interrupt,
) -> Result<ChatResponse, ApiError> {
    refuse_stream(req.stream)?;
    if req
        .response_format
        .as_ref()
        .is_some_and(|f| *f != ResponseFormat::Text)
    {
        return Err(bad(
            "response_format",
            "this server does not constrain its answers to JSON (`k3mini agent serve` checks \
             them and escalates); send `{\"type\": \"text\"}` or leave it out",
        ));
    }
    for (set, field) in [
        (req.tools.is_some(), "tools"),
        (req.tool_choice.is_some(), "tool_choice"),
        (req.parallel_tool_calls.is_some(), "parallel_tool_calls"),
    ] {
        if set {
            return Err(bad(
                field,
                format!(
                    "this server does not parse tool calls (`k3mini agent serve` does): leave \
                     `{field}` out"
                ),
            ));
        }
    }
    let stops = stop_strings(req.stop.as_ref()).map_err(|e| bad("stop", e))?;
    let rendered = render(&req.messages, &[], ChatFormat::Chatml, true)
        .map_err(|e| bad("messages", e.to_string()))?;
    state.prompt_cap.check(rendered.text_len(), "messages")?;
    let want = req.logprobs.unwrap_or(false);
    let top = count(req.top_logprobs, "top_logprobs")?.unwrap_or(0);
    if top > 0 && !want {
        return Err(bad("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    let p = state.params(SamplingFields::of_chat(&req, top))?;
    let admitted = state.admit()?;
    let t = &state.teacher;
    let (ids, _) = rendered
        .encode(&t.tokenizer)
        .map_err(|e| bad("messages", e.to_string()))?;
    state.check_length(ids.len(), &p)?;
    let mut g = {
        let _turn = state.turn(admitted, interrupt)?;
        t.run(&ids, None, Some(&p), interrupt)?
            .generated
            .expect("generation was asked for")
    };
    if let Some(n) = cut_at_stop(&g.ids, &stops, |ids| state.text(ids)) {
        g.stop_after(n);
    }
    let content_ids: Vec<u32> = g
        .ids
        .iter()
        .copied()
        .filter(|id| !p.stop.contains(id))
        .collect();
    let piece = |id: u32| {
        let token = state.token_key(id, false);
        let bytes = Some(token.as_bytes().to_vec());
        (token, bytes)
    };
    let logprobs = want.then(|| ChatLogprobs {
        content: Some(
            g.ids
                .iter()
                .enumerate()
                .map(|(i, &id)| {
                    let (token, bytes) = piece(id);
                    ChatTokenLogprob {
                        token,
                        logprob: finite_logprob(g.logprobs[i]),
                        bytes,
                        top_logprobs: (i * g.k..(i + 1) * g.k)
                            .map(|r| {
                                let (token, bytes) = piece(g.top_ids[r]);
                                ChatTopLogprob {
                                    token,
                                    logprob: finite_logprob(g.top_logprobs[r]),
                                    bytes,
                                }
                            })
                            .collect(),
                    }
                })
                .collect(),
        ),
    });
    Ok(ChatResponse {
        id: format!("chatcmpl-{}", state.created),
        object: "chat.completion".into(),
        created: state.created,
        model: t.name().into(),
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessage {
                role: "assistant".into(),
                content: Some(cut_text(state.text(&content_ids), &stops)),
                reasoning: None,
                tool_calls: Vec::new(),
            },
            finish_reason: finish(Some(g.finish)),
            logprobs,
        }],
        usage: Some(usage(ids.len(), g.ids.len())),
    })
}
