//! SGLang. `POST /generate {"input_ids", "sampling_params": {"max_new_tokens"}, "return_logprob":
//! true, "logprob_start_len": 0, "top_logprobs_num": k}`; `meta_info.input_token_logprobs` and
//! `input_top_logprobs` hold `[logprob, id, text|null]` per position (none for position 0),
//! `output_token_logprobs` / `output_top_logprobs` likewise for generated tokens; routed experts
//! as `meta_info.routed_experts` (base64 raw int32) when asked for.

use super::{ApiClient, Shared, push_row, server_err};
use crate::routing::wire;
use crate::wire::sglang::{Entry, GenerateRequest, GenerateResponse, SamplingParams};
use crate::{FinishReason, GenerateParams, Generation, Scored, TeacherError};

pub(crate) struct Sglang;

fn ids_of(ids: &[u32]) -> Option<Vec<u64>> {
    Some(ids.iter().map(|&i| i as u64).collect())
}

impl Shared {
    fn generate_sglang(&self, request: &GenerateRequest) -> Result<GenerateResponse, TeacherError> {
        self.http.post("/generate", request)
    }

    /// `[logprob, id, text]` → `(id, logprob)`, checked; a null logprob is an error naming `what`.
    fn sglang_entry(&self, e: &Entry, what: &str) -> Result<(u32, f32), TeacherError> {
        let lp =
            e.0.ok_or_else(|| server_err(format!("{what}: [{:?}, {}] has no logprob", e.0, e.1)))?;
        Ok((self.vocab.check(e.1, what)?, lp))
    }

    fn sglang_row(&self, row: &[Entry], what: &str) -> Result<Vec<(u32, f32)>, TeacherError> {
        row.iter().map(|e| self.sglang_entry(e, what)).collect()
    }
}

impl ApiClient for Sglang {
    fn score(&self, s: &Shared, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
        let response = s.generate_sglang(&GenerateRequest {
            input_ids: ids_of(ids),
            sampling_params: SamplingParams {
                max_new_tokens: Some(0),
                ..Default::default()
            },
            return_logprob: Some(true),
            logprob_start_len: Some(0),
            top_logprobs_num: Some(k as u64),
            return_routed_experts: Some(s.routing.is_some()),
            ..Default::default()
        })?;
        let meta = response.meta_info;
        let (Some(input), Some(tops)) = (meta.input_token_logprobs, meta.input_top_logprobs) else {
            return Err(server_err(
                "the response has no meta_info.input_token_logprobs/input_top_logprobs",
            ));
        };
        if input.len() != ids.len() || tops.len() != ids.len() {
            return Err(server_err(format!(
                "input logprobs cover {} and {} positions for {} tokens",
                input.len(),
                tops.len(),
                ids.len()
            )));
        }
        let mut out = Scored::empty(ids, k);
        for t in 1..ids.len() {
            let what = format!("input_token_logprobs[{t}]");
            let (id, lp) = s.sglang_entry(&input[t], &what)?;
            if id != ids[t] {
                return Err(server_err(format!(
                    "{what} is for token {id}, not the actual {}",
                    ids[t]
                )));
            }
            out.target_logprobs.push(lp);
            let what = format!("input_top_logprobs[{t}]");
            let row = tops[t]
                .as_deref()
                .ok_or_else(|| server_err(format!("{what} is null")))?;
            let row = s.sglang_row(row, &what)?;
            push_row(row, k, &what, &mut out.top_ids, &mut out.top_logprobs)?;
        }
        out.routing = s.routing_of(
            |shape| match &meta.routed_experts {
                Some(b64) => wire::from_sglang(b64, shape.layers, shape.k).map(Some),
                None => Ok(None),
            },
            ids.len() - 1,
            ids.len(),
        )?;
        Ok(out)
    }

    fn generate(
        &self,
        s: &Shared,
        prompt: &[u32],
        params: &GenerateParams,
    ) -> Result<Generation, TeacherError> {
        let response = s.generate_sglang(&GenerateRequest {
            input_ids: ids_of(prompt),
            sampling_params: SamplingParams {
                max_new_tokens: Some(params.max_tokens as u64),
                temperature: Some(params.temperature),
                top_p: Some(params.top_p),
                stop_token_ids: ids_of(&params.stop),
                ignore_eos: Some(true),
                sampling_seed: Some(params.seed),
                n: None,
            },
            return_logprob: Some(true),
            logprob_start_len: Some(prompt.len() as i64),
            top_logprobs_num: Some(params.logprobs as u64),
            ..Default::default()
        })?;
        let meta = response.meta_info;
        let out = meta
            .output_token_logprobs
            .ok_or_else(|| server_err("the response has no meta_info.output_token_logprobs"))?;
        let k = params.logprobs;
        let mut g = Generation {
            ids: Vec::with_capacity(out.len()),
            logprobs: Vec::with_capacity(out.len()),
            k,
            top_ids: Vec::new(),
            top_logprobs: Vec::new(),
            finish: match meta.finish_reason.as_ref().map(|f| f.kind.as_str()) {
                Some("stop") => FinishReason::Stop,
                _ => FinishReason::Length,
            },
        };
        let tops = meta.output_top_logprobs.unwrap_or_default();
        for (i, e) in out.iter().enumerate() {
            let (id, lp) = s.sglang_entry(e, &format!("output_token_logprobs[{i}]"))?;
            g.ids.push(id);
            g.logprobs.push(lp);
            if k > 0 {
                let what = format!("output_top_logprobs[{i}]");
                let row = tops.get(i).and_then(Option::as_deref).unwrap_or(&[]);
                let row = s.sglang_row(row, &what)?;
                push_row(row, k, &what, &mut g.top_ids, &mut g.top_logprobs)?;
            }
        }
        Ok(g)
    }

    fn token_ids(&self, s: &Shared, text: &str) -> Result<Vec<u32>, TeacherError> {
        // logprob_start_len 0: SGLang's default (−1) would return the last token's only.
        let response = s.generate_sglang(&GenerateRequest {
            text: Some(text.into()),
            sampling_params: SamplingParams {
                max_new_tokens: Some(0),
                ..Default::default()
            },
            return_logprob: Some(true),
            logprob_start_len: Some(0),
            ..Default::default()
        })?;
        let input = response
            .meta_info
            .input_token_logprobs
            .ok_or_else(|| server_err("no meta_info.input_token_logprobs"))?;
        input
            .iter()
            .map(|e| s.vocab.check(e.1, "input_token_logprobs"))
            .collect()
    }
}
