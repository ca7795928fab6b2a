//! The student answering locally: a GGUF on llama.cpp (or burn), decoded here rather than through
//! the teacher engine's loop, because the agent reads every position's whole distribution — its
//! confidence signals, and the draft distribution `q` the sampling acceptance rule divides by.

use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::{Interrupt, TeacherError, log_softmax};

/// How tokens are drawn: greedy at temperature 0, else from [`sampling_dist`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
}

impl Sampling {
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// A sparse distribution, by descending probability (ties by ascending id).
pub type Dist = Vec<(u32, f64)>;

/// The probability `dist` gives `id` (0 outside its support).
pub fn prob(dist: &Dist, id: u32) -> f64 {
    dist.iter()
        .find(|&&(i, _)| i == id)
        .map_or(0.0, |&(_, p)| p)
}

/// What a sampler at `s` draws from, given each candidate's logprob:
/// `softmax(logprob / T)` over the candidates, cut to the smallest set of top ids holding `top_p`
/// of the mass and renormalised (as [`k3mini_teacher::sample`] draws).
pub fn sampling_dist(candidates: impl IntoIterator<Item = (u32, f32)>, s: Sampling) -> Dist {
    let t = s.temperature.max(f32::MIN_POSITIVE) as f64;
    let mut d: Dist = candidates
        .into_iter()
        .map(|(id, lp)| (id, lp as f64 / t))
        .collect();
    d.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = d.first().map_or(0.0, |x| x.1);
    let z: f64 = d.iter().map(|x| (x.1 - max).exp()).sum();
    for x in &mut d {
        x.1 = (x.1 - max).exp() / z;
    }
    let mut kept = 0.0;
    let mut n = 0;
    for x in &d {
        kept += x.1;
        n += 1;
        if kept >= s.top_p as f64 {
            break;
        }
    }
    d.truncate(n);
    for x in &mut d {
        x.1 /= kept;
    }
    d
}

/// One draw from `dist` with `u` uniform in `[0, 1)`.
pub fn draw(dist: &Dist, u: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, p) in dist {
        acc += p;
        if u < acc {
            return id;
        }
    }
    dist.last().expect("a distribution has support").0
}

/// A token the student wrote, with what its own distribution (at temperature 1) said there.
#[derive(Clone, Debug, PartialEq)]
pub struct Token {
    pub id: u32,
    pub logprob: f32,
    /// `−Σ p log p` over the whole vocabulary, nats.
    pub entropy: f32,
    /// Top-1 minus top-2 logprob.
    pub margin: f32,
    /// The distribution it was drawn from (sampling only): the `q` of speculative sampling.
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
}

impl Student {
    pub fn new(model: LocalTeacher) -> Self {
        Self { model }
    }

    /// Up to `max` tokens after `context` (stopping after any of `stop`), drawn at `s` with `rng`
    /// (a SplitMix64 state), each with its signals. One prefill of `context`, then one token at
    /// a time; `interrupt` is checked between tokens.
    pub fn decode(
        &self,
        context: &[u32],
        max: usize,
        s: Sampling,
        stop: &[u32],
        rng: &mut u64,
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
            let (id, q) = if s.greedy() {
                (best, None)
            } else {
                let q = sampling_dist(lp.iter().enumerate().map(|(i, &l)| (i as u32, l)), s);
                (draw(&q, k3mini_data::rng::uniform(rng)), Some(q))
            };
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
    fn sampling_dist_tempers_and_cuts_to_top_p() {
        let lps = [(0, (0.5f32).ln()), (1, (0.3f32).ln()), (2, (0.2f32).ln())];
        let d = sampling_dist(
            lps,
            Sampling {
                temperature: 1.0,
                top_p: 1.0,
            },
        );
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!((d[1].1 - 0.3).abs() < 1e-6);
        // top_p 0.7: {0, 1} hold 0.8 ≥ 0.7, renormalised.
        let d = sampling_dist(
            lps,
            Sampling {
                temperature: 1.0,
                top_p: 0.7,
            },
        );
        assert_eq!(d.len(), 2);
        assert!((d[0].1 - 0.5 / 0.8).abs() < 1e-6);
        // T = 0.5 squares the odds: 0.25 : 0.09 : 0.04.
        let d = sampling_dist(
            lps,
            Sampling {
                temperature: 0.5,
                top_p: 1.0,
            },
        );
        assert!((d[0].1 - 0.25 / 0.38).abs() < 1e-6);
        assert_eq!(draw(&d, 0.0), 0);
        assert_eq!(draw(&d, 0.999_999), 2);
        assert_eq!(prob(&d, 7), 0.0);
    }

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
