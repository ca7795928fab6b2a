//! The student answering locally: a GGUF on llama.cpp (or burn), decoded here rather than through
//! the teacher engine's loop, because the agent reads every position's whole distribution — its
//! confidence signals, and the draft distribution `q` the sampling acceptance rule divides by.

use crate::grammar::CallGrammars;
use k3mini_data::ChatFormat;
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::sampling::{Dist, Sampling, draw, sampling_dist};
use k3mini_teacher::{Interrupt, TeacherError, log_softmax};
use llguidance::Matcher;
use std::sync::OnceLock;

/// A token the student wrote, with what its own distribution (at temperature 1) said there.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    pub logprob: f32,
    /// `−Σ p log p` over the whole vocabulary, nats.
    pub entropy: f32,
    /// Top-1 minus top-2 logprob.
    pub margin: f32,
    /// The distribution it was drawn from, where the caller keeps it (a cascade's sampled
    /// drafts): the `q` of speculative sampling.
    pub q: Option<Dist>,
}

/// Position statistics of one logits row, and the greedy choice.
fn read_row(row: &[f32]) -> (Vec<f32>, f32, f32, u32) {
    let lp = log_softmax(row);
    let entropy = -lp
        .iter()
        .map(|&l| {
            if l.is_finite() {
                (l as f64).exp() * l as f64
            } else {
                0.0
            }
        })
        .sum::<f64>() as f32;
    let top = k3mini_teacher::top_k(&lp, 2);
    let margin = match top.as_slice() {
        [a, b] => a.1 - b.1,
        _ => f32::INFINITY,
    };
    (lp, entropy, margin, top[0].0)
}

/// The student: a local model.
pub struct Student {
    pub model: LocalTeacher,
    /// Its tool-call grammars, built at the first request that asks for them.
    grammars: OnceLock<Result<CallGrammars, String>>,
}

impl Student {
    pub fn new(model: LocalTeacher) -> Self {
        Self {
            model,
            grammars: OnceLock::new(),
        }
    }

    /// The grammars that constrain its tool calls, or why it has none.
    pub fn call_grammars(&self) -> Result<&CallGrammars, String> {
        self.grammars
            .get_or_init(|| {
                let format = self.format();
                let tokenizer = &self.model.tokenizer;
                let end = tokenizer
                    .token_id(format.end_of_turn())
                    .ok_or_else(|| format!("{} is not one id", format.end_of_turn()))?;
                CallGrammars::new(format, tokenizer, self.model.n_vocab(), end)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The chat format the student speaks: the one whose template its GGUF carries (k3mini's
    /// exports write it) where its vocabulary holds that format's markers, else the one its
    /// vocabulary's markers name (ChatML where they name none).
    pub fn format(&self) -> ChatFormat {
        let template = self.model.meta.chat_template.as_deref();
        ChatFormat::spoken(
            template.and_then(ChatFormat::of_template),
            &self.model.tokenizer,
        )
        .unwrap_or(ChatFormat::Chatml)
    }

    /// The ids an answer ends at unless the request ignores them: the end of a turn in the
    /// student's format and the end of text, as the tokenizer and the GGUF name them.
    pub fn stops(&self) -> Vec<u32> {
        let tokenizer = &self.model.tokenizer;
        let turn = tokenizer.token_id(self.format().end_of_turn());
        let mut stops: Vec<u32> = turn
            .into_iter()
            .chain(tokenizer.special_ids().eos)
            .collect();
        stops.extend(self.model.meta.eos.filter(|id| !stops.contains(id)));
        stops
    }

    /// Up to `max` tokens after `context` (stopping after any of `stop`), drawn at `s` with `rng`
    /// (a SplitMix64 state), each with its signals, and with the distribution it was drawn from
    /// where `keep_q` (a whole vocabulary per token: for drafts only). One prefill of `context`,
    /// then one token at a time; `interrupt` is checked between tokens. Under `grammar`, each
    /// token is drawn from those it allows (the signals stay the model's own); a grammar that
    /// fails midway is dropped and the rest decodes free (the gate judges the reply anyway).
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &self,
        context: &[u32],
        max: usize,
        s: Sampling,
        stop: &[u32],
        keep_q: bool,
        rng: &mut u64,
        mut grammar: Option<&mut Matcher>,
        interrupt: Interrupt,
    ) -> Result<Vec<Token>, TeacherError> {
        let limit = self.model.context_length();
        if context.is_empty() || context.len() + max > limit {
            return Err(TeacherError::Request(format!(
                "the student takes {limit} tokens; this context has {} and asks for {max} more",
                context.len()
            )));
        }
        let (mut session, limits) = self.model.session(context.len() + max)?;
        let mut last = Vec::new();
        for piece in context.chunks(limits.chunk) {
            interrupt.check()?;
            last = session.feed(piece)?;
        }
        let vocab = limits.vocab;
        let mut out = Vec::with_capacity(max);
        while out.len() < max {
            interrupt.check()?;
            let row = &last[last.len() - vocab..];
            let (lp, entropy, margin, best) = read_row(row);
            let allowed = grammar.as_mut().and_then(|m| m.compute_mask_or_eos().ok());
            if allowed.is_none() {
                grammar = None;
            }
            let open = |i: usize| allowed.as_ref().is_none_or(|a| a.is_allowed(i as u32));
            let (id, q) = if s.greedy() {
                let best = match &allowed {
                    None => best,
                    Some(_) => (0..vocab)
                        .filter(|&i| open(i))
                        .max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)))
                        .map_or(best, |i| i as u32),
                };
                (best, None)
            } else {
                let q = sampling_dist(
                    lp.iter()
                        .enumerate()
                        .filter(|&(i, _)| open(i))
                        .map(|(i, &l)| (i as u32, l)),
                    s,
                );
                (
                    draw(&q, k3mini_data::rng::uniform(rng)),
                    keep_q.then_some(q),
                )
            };
            if let Some(m) = grammar.as_mut()
                && m.consume_token(id).is_err()
            {
                grammar = None;
            }
            out.push(Token {
                id,
                logprob: lp[id as usize],
                entropy,
                margin,
                q,
            });
            if stop.contains(&id) || out.len() == max {
                break;
            }
            last = session.feed(&[id])?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_as_entropy_margin_and_argmax() {
        let (lp, entropy, margin, best) = read_row(&[0.0, 0.0, (2.0f32).ln()]);
        assert_eq!(best, 2);
        assert!((lp[2] - (0.5f32).ln()).abs() < 1e-6);
        // p = (0.25, 0.25, 0.5): H = 1.5 ln 2.
        assert!((entropy - 1.5 * std::f32::consts::LN_2).abs() < 1e-6);
        assert!((margin - std::f32::consts::LN_2).abs() < 1e-6);
    }
}
