//! `verify`: a speculative cascade across the network (speculative decoding, Leviathan et al.
//! 2023; Chen et al. 2023, with the student as the draft model and the remote as the target).
//!
//! Each round the student drafts γ tokens after the context; the remote scores context + draft
//! in one prompt-logprobs pass (its top-k at every drafted position, so it reads the draft rather
//! than writes it); the longest prefix it accepts is kept, and at the first rejection the
//! remote's token is taken before the student drafts again.
//!
//! - Greedy (temperature 0): draft token `x_i` stands while it is the remote's top-1 there; at
//!   the first mismatch the remote's top-1 is taken. Every token kept is the remote's greedy
//!   choice, so the output is the remote's greedy output token for token.
//! - Sampling: `p` is the remote's distribution at the request's temperature and top-p over its
//!   top-k (the remote sampling with top-k = `k`), `q` the student's as it drew the draft.
//!   `x_i` stands with probability `min(1, p(x_i) / q(x_i))`; else `y ~ norm(max(0, p − q))` is
//!   taken. The output is distributed exactly as `p`.
//!
//! The draft length adapts as assisted generation does (+2 after a round accepted whole, −1
//! otherwise, within `[1, max_draft]`). Once `judge_after` tokens have been drafted, a request
//! whose acceptance is below `min_acceptance` is handed to the remote whole: it generates the
//! rest after the tokens kept so far, so a weak student costs at most the rounds before that
//! judgement on top of one plain escalation.

use super::cost::Spent;
use super::student::{Student, Token};
use k3mini_data::rng::uniform;
use k3mini_teacher::sampling::{Dist, Sampling, prob, sampling_dist};
use k3mini_teacher::{FinishReason, GenerateParams, Interrupt, Scored, Teacher, TeacherError};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The `[verify]` table of a policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VerifySettings {
    /// Top-k the remote returns at each drafted position (vLLM's `--max-logprobs` is 20 by
    /// default).
    pub k: usize,
    /// The first round's draft length, and the longest.
    pub draft: usize,
    pub max_draft: usize,
    /// Hand the request to the remote whole when fewer than this share of drafted tokens were
    /// accepted, judged once `judge_after` tokens have been drafted.
    pub min_acceptance: f64,
    pub judge_after: usize,
}

impl Default for VerifySettings {
    fn default() -> Self {
        Self {
            k: 20,
            draft: 4,
            max_draft: 16,
            min_acceptance: 0.3,
            judge_after: 8,
        }
    }
}

/// The longest draft a round may make: past a few dozen tokens a rejection wastes the rest.
pub const MAX_DRAFT: usize = 256;
/// The most drafted tokens before the cascade judges its acceptance.
pub const MAX_JUDGE_AFTER: usize = 1 << 20;

impl VerifySettings {
    pub fn check(&self) -> Result<(), String> {
        let max_k = k3mini_teacher::server::MAX_LOGPROBS;
        if !(1..=max_k).contains(&self.k)
            || self.draft == 0
            || !(self.draft..=MAX_DRAFT).contains(&self.max_draft)
            || !(1..=MAX_JUDGE_AFTER).contains(&self.judge_after)
        {
            return Err(format!(
                "verify: k ({}) must be in [1, {max_k}], draft ({}) ≥ 1, max_draft ({}) in \
                 [draft, {MAX_DRAFT}], judge_after ({}) in [1, {MAX_JUDGE_AFTER}]",
                self.k, self.draft, self.max_draft, self.judge_after
            ));
        }
        if !(0.0..=1.0).contains(&self.min_acceptance) {
            return Err(format!(
                "verify.min_acceptance = {} must be in [0, 1]",
                self.min_acceptance
            ));
        }
        Ok(())
    }
}

/// Greedy acceptance: how many of `draft` stand (each equal to the remote's top-1 `best` at its
/// position), and the remote's token at the first that does not (None when all stand).
pub fn accept_greedy(draft: &[u32], best: &[u32]) -> (usize, Option<u32>) {
    match draft.iter().zip(best).position(|(d, b)| d != b) {
        Some(i) => (i, Some(best[i])),
        None => (draft.len(), None),
    }
}

/// The speculative-sampling rule for one drafted token `x ~ q`: `Ok(x)` when it stands (with
/// probability `min(1, p(x) / q(x))`), else `Err(y)` with `y ~ norm(max(0, p − q))`. `rng` is a
/// SplitMix64 state.
pub fn accept_sampled(x: u32, q: &Dist, p: &Dist, rng: &mut u64) -> Result<u32, u32> {
    let (px, qx) = (prob(p, x), prob(q, x));
    if qx > 0.0 && uniform(rng) * qx < px {
        return Ok(x);
    }
    let residual: Dist = p
        .iter()
        .map(|&(id, pi)| (id, (pi - prob(q, id)).max(0.0)))
        .filter(|x| x.1 > 0.0)
        .collect();
    let z: f64 = residual.iter().map(|x| x.1).sum();
    // z = 0 only where p ≤ q everywhere, that is p = q, when x stood with certainty: unreachable
    // but for rounding, where p itself is the answer.
    let (from, z) = if z > 0.0 { (&residual, z) } else { (p, 1.0) };
    let u = uniform(rng) * z;
    let mut acc = 0.0;
    for &(id, w) in from {
        acc += w;
        if u < acc {
            return Err(id);
        }
    }
    Err(from.last().map_or(x, |l| l.0))
}

/// The remote's distribution at scored position `pos` as its sampler at `s` would draw from it.
fn remote_dist(scored: &Scored, pos: usize, s: Sampling) -> Dist {
    let row = pos * scored.k..(pos + 1) * scored.k;
    let pairs = scored.top_ids[row.clone()]
        .iter()
        .copied()
        .zip(scored.top_logprobs[row].iter().copied());
    sampling_dist(pairs, s)
}

/// What a cascade did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Tokens the remote supplied at rejections, and after a hand-over.
    pub remote_tokens: u64,
    /// Handed to the remote whole (acceptance below `min_acceptance`).
    pub handed_over: bool,
}

/// How many leading ids `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The answer of a cascade: its tokens, why it ended, what it did and spent.
pub struct Cascaded {
    pub ids: Vec<u32>,
    pub finish: FinishReason,
    pub trace: Trace,
    pub spent: Spent,
}

/// Which side stopped a cascade short.
#[derive(Debug)]
pub enum Halt {
    /// The student failed (or the request's time ran out while it drafted).
    Local(TeacherError),
    /// The remote failed.
    Remote(TeacherError),
    /// The budget forbids the next remote call (the reason).
    Budget(String),
}

/// Why a cascade stopped short, with what it had kept and spent by then (a caller may answer
/// those tokens, marked, or fail).
pub struct Stopped {
    pub halt: Halt,
    pub partial: Cascaded,
}

/// The remote a cascade verifies with: the teacher, and the output tokens it bills for a scoring
/// call (1 where scoring generates one token, as vLLM's and OpenAI's `max_tokens: 1` do; 0 for
/// SGLang's `max_new_tokens: 0`).
#[derive(Clone, Copy)]
pub struct Verifier<'a> {
    pub teacher: &'a dyn Teacher,
    pub scoring_output: u64,
    /// Tries its client makes of one call: a failed call is booked at all of them.
    pub attempts: u64,
}

/// Runs the cascade for `prompt` under `params` (max tokens, temperature, top-p, seed, stop ids):
/// `emit` receives the tokens kept after each round, as they become final. `forbid` is asked
/// before each remote call with what was spent and what the call would send and could write, so a
/// budget can stop the cascade ([`Halt::Budget`]).
#[allow(clippy::too_many_arguments)]
pub fn cascade(
    student: &Student,
    remote: Verifier,
    prompt: &[u32],
    params: &GenerateParams,
    settings: &VerifySettings,
    interrupt: Interrupt,
    forbid: &mut dyn FnMut(&Spent, u64, u64) -> Option<String>,
    emit: &mut dyn FnMut(&[u32]),
) -> Result<Cascaded, Box<Stopped>> {
    let s = Sampling::from(params);
    let mut rng = params.seed;
    let mut out = Cascaded {
        ids: Vec::new(),
        finish: FinishReason::Length,
        trace: Trace::default(),
        spent: Spent::default(),
    };
    let mut gamma = settings.draft;
    // The previous remote call's input: the next one's cache hits are the prefix they share.
    let mut sent: Vec<u32> = Vec::new();
    macro_rules! fail {
        ($halt:expr) => {
            return Err(Box::new(Stopped {
                halt: $halt,
                partial: out,
            }))
        };
    }
    while out.ids.len() < params.max_tokens {
        let mut context = prompt.to_vec();
        context.extend(&out.ids);
        let n = gamma.min(params.max_tokens - out.ids.len());
        let t0 = Instant::now();
        let draft: Vec<Token> = match student.decode(
            &context,
            n,
            s,
            &params.stop,
            true,
            &mut rng,
            None,
            interrupt,
        ) {
            Ok(d) => d,
            Err(e) => fail!(Halt::Local(e)),
        };
        out.spent.local_seconds += t0.elapsed().as_secs_f64();
        out.spent.local_read += context.len() as u64;
        out.spent.local_written += draft.len() as u64;
        let ids: Vec<u32> = draft.iter().map(|t| t.id).collect();
        let mut scored_ids = context.clone();
        scored_ids.extend(&ids);
        if let Some(reason) = forbid(&out.spent, scored_ids.len() as u64, remote.scoring_output) {
            fail!(Halt::Budget(reason));
        }
        // The scoring call's output is billed, and not used.
        let cached = common_prefix(&sent, &scored_ids) as u64;
        let scored = out.spent.remote_call(
            remote.teacher,
            remote.attempts,
            scored_ids.len() as u64,
            remote.scoring_output,
            || remote.teacher.score(&scored_ids, settings.k),
            |_| (cached, remote.scoring_output),
        );
        let scored = match scored {
            Ok(s) => s,
            Err(e) => fail!(Halt::Remote(e)),
        };
        sent = scored_ids;
        // Position `context.len() − 1 + i` predicts draft token i.
        let first = context.len() - 1;
        let (kept, replaced) = if s.greedy() {
            let best: Vec<u32> = (0..ids.len())
                .map(|i| scored.top_ids[(first + i) * scored.k])
                .collect();
            accept_greedy(&ids, &best)
        } else {
            let mut verdict = (ids.len(), None);
            for (i, t) in draft.iter().enumerate() {
                let p = remote_dist(&scored, first + i, s);
                let q =
                    t.q.as_ref()
                        .expect("a sampled draft keeps its distribution");
                if let Err(y) = accept_sampled(t.id, q, &p, &mut rng) {
                    verdict = (i, Some(y));
                    break;
                }
            }
            verdict
        };
        let before = out.ids.len();
        out.ids.extend(&ids[..kept]);
        out.ids.extend(replaced);
        out.trace.rounds += 1;
        out.trace.drafted += ids.len() as u64;
        out.trace.accepted += kept as u64;
        out.trace.remote_tokens += replaced.is_some() as u64;
        emit(&out.ids[before..]);
        if super::finish_of(&out.ids, &params.stop) == FinishReason::Stop {
            out.finish = FinishReason::Stop;
            return Ok(out);
        }
        gamma = if replaced.is_none() {
            (gamma + 2).min(settings.max_draft)
        } else {
            gamma.saturating_sub(1).max(1)
        };
        let (drafted, accepted) = (out.trace.drafted, out.trace.accepted);
        if drafted >= settings.judge_after as u64
            && (accepted as f64) < settings.min_acceptance * drafted as f64
            && out.ids.len() < params.max_tokens
        {
            context.truncate(prompt.len());
            context.extend(&out.ids);
            let left = (params.max_tokens - out.ids.len()) as u64;
            if let Some(reason) = forbid(&out.spent, context.len() as u64, left) {
                fail!(Halt::Budget(reason));
            }
            let rest = GenerateParams {
                max_tokens: params.max_tokens - out.ids.len(),
                seed: rng,
                ..params.clone()
            };
            let cached = common_prefix(&sent, &context) as u64;
            let g = out.spent.remote_call(
                remote.teacher,
                remote.attempts,
                context.len() as u64,
                left,
                || remote.teacher.generate(&context, &rest),
                |g| (cached, g.ids.len() as u64),
            );
            let g = match g {
                Ok(g) => g,
                Err(e) => fail!(Halt::Remote(e)),
            };
            out.trace.remote_tokens += g.ids.len() as u64;
            out.trace.handed_over = true;
            emit(&g.ids);
            out.ids.extend(&g.ids);
            out.finish = g.finish;
            return Ok(out);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_keeps_the_agreeing_prefix_and_takes_the_remotes_token() {
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 7]), (3, None));
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 9, 7]), (1, Some(9)));
        assert_eq!(accept_greedy(&[5], &[4]), (0, Some(4)));
    }

    /// The rule's output is distributed as `p` whatever `q` drafts from: 200,000 seeded draws on
    /// a 6-token vocabulary, Pearson's χ² against `p` below the 0.999 quantile for 5 degrees of
    /// freedom (20.5), and the acceptance rate equal to Σ min(p, q).
    #[test]
    fn sampling_acceptance_reproduces_the_remote_distribution() {
        let p: Dist = vec![
            (2, 0.4),
            (0, 0.25),
            (5, 0.15),
            (1, 0.1),
            (3, 0.07),
            (4, 0.03),
        ];
        // q puts mass where p has little, and misses token 4 entirely.
        let q: Dist = vec![(3, 0.35), (2, 0.2), (1, 0.2), (0, 0.15), (5, 0.1)];
        let mut rng = 7u64;
        let n = 200_000;
        let (mut counts, mut accepted) = ([0u64; 6], 0u64);
        for _ in 0..n {
            let x = k3mini_teacher::sampling::draw(&q, uniform(&mut rng));
            let y = match accept_sampled(x, &q, &p, &mut rng) {
                Ok(x) => {
                    accepted += 1;
                    x
                }
                Err(y) => y,
            };
            counts[y as usize] += 1;
        }
        let chi2: f64 = p
            .iter()
            .map(|&(id, pi)| {
                let e = pi * n as f64;
                (counts[id as usize] as f64 - e).powi(2) / e
            })
            .sum();
        assert!(chi2 < 20.5, "χ² = {chi2}, counts {counts:?}");
        let overlap: f64 = p.iter().map(|&(id, pi)| pi.min(prob(&q, id))).sum();
        let rate = accepted as f64 / n as f64;
        assert!((rate - overlap).abs() < 0.005, "{rate} vs {overlap}");
    }
}
