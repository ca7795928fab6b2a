//! SGLang's `/generate`: `input_ids` or `text`, `sampling_params` (`max_new_tokens`, default 128,
//! `temperature`, `top_p`, `stop_token_ids`, `ignore_eos`, `sampling_seed`), `return_logprob`,
//! `logprob_start_len` (−1, the default, is the prompt's last token), `top_logprobs_num`;
//! `meta_info.input_token_logprobs` / `input_top_logprobs` / `output_token_logprobs` /
//! `output_top_logprobs` as `[logprob, id, null]`. `meta_info.routed_experts` (base64 raw int32)
//! when the request sets `return_routed_experts`, from `routed_experts_start_len`.

use super::{ApiError, SamplingFields, State, bad, count};
use crate::local::Ran;
use crate::routing::wire;
use crate::wire::finite_logprob;
use crate::wire::sglang::{
    Entry, FinishReason, GenerateRequest, GenerateResponse, Matched, MetaInfo,
};
use crate::{FinishReason as Finish, Interrupt, Teacher};

pub(super) fn generate(
    state: &State,
    req: GenerateRequest,
    interrupt: Interrupt,
) -> Result<GenerateResponse, ApiError> {
    let malformed = || {
        bad(
            "input_ids",
            "give `input_ids` (a non-empty list of ids) or `text`",
        )
    };
    let sp = &req.sampling_params;
    let top = count(req.top_logprobs_num, "top_logprobs_num")?.unwrap_or(0);
    let p = state.params(SamplingFields {
        max_tokens: sp.max_new_tokens,
        default_max: 128,
        temperature: sp.temperature,
        top_p: sp.top_p,
        seed: sp.sampling_seed,
        n: sp.n,
        best_of: None,
        stop_token_ids: sp.stop_token_ids.as_deref(),
        ignore_eos: sp.ignore_eos,
        logprobs: top,
    })?;
    let (ids, admitted) = match (&req.input_ids, &req.text) {
        (Some(ids), _) if ids.is_empty() => return Err(malformed()),
        (Some(ids), _) => state.admit_ids(ids, "input_ids")?,
        (None, Some(text)) if !text.is_empty() => state.admit_text(text, "text")?,
        _ => return Err(malformed()),
    };
    state.check_length(ids.len(), &p)?;
    let want = req.return_logprob.unwrap_or(false);
    // SGLang: −1 (its default) starts at the prompt's last token.
    let start = match req.logprob_start_len.unwrap_or(-1) {
        -1 => ids.len() - 1,
        n if n >= 0 => n as usize,
        n => {
            return Err(bad(
                "logprob_start_len",
                format!("{n} is not −1 or a position"),
            ));
        }
    };
    let return_routed = req.return_routed_experts.unwrap_or(false);
    if return_routed && state.teacher.routing().is_none() {
        return Err(bad(
            "return_routed_experts",
            "this server does not return routed experts: start it with \
             --enable-return-routed-experts (the model must be a MoE)",
        ));
    }
    let Ran {
        scored,
        generated,
        routing,
    } = {
        let _turn = state.turn(admitted, interrupt)?;
        let score_k = (want && ids.len() >= 2).then_some(top.max(1));
        state
            .teacher
            .run(&ids, score_k, (p.max_tokens > 0).then_some(&p), interrupt)?
    };
    let out_ids: Vec<u32> = generated.as_ref().map_or_else(Vec::new, |g| g.ids.clone());
    let entry = |lp: Option<f32>, id: u32| -> Entry { (lp.map(finite_logprob), id as u64, None) };
    let tops = |ids: &[u32], lps: &[f32]| -> Option<Vec<Entry>> {
        Some(
            ids.iter()
                .zip(lps)
                .map(|(&i, &l)| entry(Some(l), i))
                .collect(),
        )
    };
    let mut meta = MetaInfo {
        prompt_tokens: ids.len() as u64,
        completion_tokens: out_ids.len() as u64,
        finish_reason: Some(match generated.as_ref().map(|g| g.finish) {
            Some(Finish::Stop) => FinishReason {
                kind: "stop".into(),
                length: None,
                matched: out_ids.last().map(|&id| Matched::Id(id as u64)),
            },
            _ => FinishReason {
                kind: "length".into(),
                length: Some(out_ids.len() as u64),
                matched: None,
            },
        }),
        ..Default::default()
    };
    if return_routed {
        let r = state.routed(routing, req.routed_experts_start_len.unwrap_or(0) as usize);
        meta.routed_experts = r.map(|r| wire::to_sglang(&r));
    }
    if want {
        // Position i's logprob is that of token i given the tokens before it: none for token 0.
        let (mut input, mut input_top) = (Vec::new(), Vec::new());
        for (i, &id) in ids.iter().enumerate().skip(start) {
            match &scored {
                Some(s) if i >= 1 => {
                    let r = (i - 1) * s.k..i * s.k;
                    input.push(entry(Some(s.target_logprobs[i - 1]), id));
                    input_top.push(if top > 0 {
                        tops(&s.top_ids[r.clone()], &s.top_logprobs[r])
                    } else {
                        None
                    });
                }
                _ => {
                    input.push(entry(None, id));
                    input_top.push(None);
                }
            }
        }
        meta.input_token_logprobs = Some(input);
        meta.input_top_logprobs = Some(input_top);
        if let Some(g) = &generated {
            meta.output_token_logprobs = Some(
                g.ids
                    .iter()
                    .zip(&g.logprobs)
                    .map(|(&i, &l)| entry(Some(l), i))
                    .collect(),
            );
            meta.output_top_logprobs = Some(
                (0..g.ids.len())
                    .map(|i| {
                        tops(
                            &g.top_ids[i * g.k..(i + 1) * g.k],
                            &g.top_logprobs[i * g.k..(i + 1) * g.k],
                        )
                    })
                    .collect(),
            );
        }
    }
    Ok(GenerateResponse {
        text: state.text(&out_ids),
        output_ids: Some(out_ids.iter().map(|&i| i as u64).collect()),
        meta_info: meta,
    })
}
