//! `confidence`: the student answers alone, and its answer goes to the remote when its own token
//! signals say it is unsure. Signals of an answer of `n` tokens, each from the student's whole
//! distribution (temperature 1) where it wrote the token:
//!
//! - `mean_logprob` = (1/n) Σ log q(x_t), `min_logprob` = min_t log q(x_t);
//! - `entropy_p50`, `entropy_p90`: quantiles of H_t = −Σ_v q_t(v) log q_t(v) (nats);
//! - `margin_p10`: the 10th percentile of log q_t(top-1) − log q_t(top-2).
//!
//! A threshold left unset is not checked; the first that fails is the reason given.

use super::student::Token;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Signals {
    pub tokens: u64,
    pub mean_logprob: f32,
    pub min_logprob: f32,
    pub entropy_p50: f32,
    pub entropy_p90: f32,
    pub margin_p10: f32,
}

/// The value at quantile `q` of `values` (nearest rank on the sorted values; 0 for none).
pub fn quantile(values: &[f32], q: f64) -> f32 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f32::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// A signal as a finite number: a margin over a −∞ runner-up is +∞, which neither JSON nor a
/// threshold can hold, so it is capped at ±1e30 (NaN, which no row yields, as 0).
fn finite(v: f32) -> f32 {
    if v.is_nan() {
        0.0
    } else {
        v.clamp(-1e30, 1e30)
    }
}

impl Signals {
    pub fn of(tokens: &[Token]) -> Self {
        let s = Self::raw(tokens);
        Self {
            mean_logprob: finite(s.mean_logprob),
            min_logprob: finite(s.min_logprob),
            entropy_p50: finite(s.entropy_p50),
            entropy_p90: finite(s.entropy_p90),
            margin_p10: finite(s.margin_p10),
            ..s
        }
    }

    fn raw(tokens: &[Token]) -> Self {
        let lps: Vec<f32> = tokens.iter().map(|t| t.logprob).collect();
        let entropies: Vec<f32> = tokens.iter().map(|t| t.entropy).collect();
        let margins: Vec<f32> = tokens.iter().map(|t| t.margin).collect();
        let n = tokens.len();
        Self {
            tokens: n as u64,
            mean_logprob: if n == 0 {
                0.0
            } else {
                (lps.iter().map(|&l| l as f64).sum::<f64>() / n as f64) as f32
            },
            min_logprob: lps.iter().copied().fold(0.0, f32::min),
            entropy_p50: quantile(&entropies, 0.5),
            entropy_p90: quantile(&entropies, 0.9),
            margin_p10: quantile(&margins, 0.1),
        }
    }

    /// The signal `name` (as the policy's and calibration's tables name them).
    pub fn get(&self, name: Signal) -> f32 {
        match name {
            Signal::MeanLogprob => self.mean_logprob,
            Signal::MinLogprob => self.min_logprob,
            Signal::EntropyP50 => self.entropy_p50,
            Signal::EntropyP90 => self.entropy_p90,
            Signal::MarginP10 => self.margin_p10,
        }
    }
}

/// One signal, and which way is confident.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    MeanLogprob,
    MinLogprob,
    EntropyP50,
    EntropyP90,
    MarginP10,
}

impl Signal {
    pub const ALL: [Signal; 5] = [
        Signal::MeanLogprob,
        Signal::MinLogprob,
        Signal::EntropyP50,
        Signal::EntropyP90,
        Signal::MarginP10,
    ];

    /// Whether a larger value means a more confident student (logprobs, margins) or a less
    /// confident one (entropies).
    pub fn higher_is_confident(self) -> bool {
        matches!(
            self,
            Signal::MeanLogprob | Signal::MinLogprob | Signal::MarginP10
        )
    }

    /// Whether `value` is less confident than `threshold` (which escalates).
    pub fn unsure(self, value: f32, threshold: f32) -> bool {
        if self.higher_is_confident() {
            value < threshold
        } else {
            value > threshold
        }
    }

    /// The `[confidence]` key that sets this signal's threshold.
    pub fn threshold_key(self) -> &'static str {
        match self {
            Signal::MeanLogprob => "min_mean_logprob",
            Signal::MinLogprob => "min_min_logprob",
            Signal::EntropyP50 => "max_entropy_p50",
            Signal::EntropyP90 => "max_entropy_p90",
            Signal::MarginP10 => "min_margin_p10",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Signal::MeanLogprob => "mean_logprob",
            Signal::MinLogprob => "min_logprob",
            Signal::EntropyP50 => "entropy_p50",
            Signal::EntropyP90 => "entropy_p90",
            Signal::MarginP10 => "margin_p10",
        }
    }
}

/// The `[confidence]` table: the answer escalates when any set threshold is crossed. A table
/// given is whole (a threshold it leaves out is not checked); without one, [`Default`]'s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Thresholds {
    pub min_mean_logprob: Option<f32>,
    pub min_min_logprob: Option<f32>,
    pub max_entropy_p50: Option<f32>,
    pub max_entropy_p90: Option<f32>,
    pub min_margin_p10: Option<f32>,
}

impl Default for Thresholds {
    /// Uncalibrated: a mean token probability below e^−1.5 ≈ 0.22 escalates. Set thresholds
    /// for your student from held-out prompts it gets right and wrong.
    fn default() -> Self {
        Self {
            min_mean_logprob: Some(-1.5),
            min_min_logprob: None,
            max_entropy_p50: None,
            max_entropy_p90: None,
            min_margin_p10: None,
        }
    }
}

impl Thresholds {
    /// Each set threshold with its signal.
    pub fn set(&self) -> Vec<(Signal, f32)> {
        [
            (Signal::MeanLogprob, self.min_mean_logprob),
            (Signal::MinLogprob, self.min_min_logprob),
            (Signal::EntropyP50, self.max_entropy_p50),
            (Signal::EntropyP90, self.max_entropy_p90),
            (Signal::MarginP10, self.min_margin_p10),
        ]
        .into_iter()
        .filter_map(|(s, t)| t.map(|t| (s, t)))
        .collect()
    }

    pub fn check(&self) -> Result<(), String> {
        // Logprobs, entropies and margins in nats: past ±10⁴ a threshold can only mean a typo.
        const BOUND: f32 = 1e4;
        match self.set().into_iter().find(|(_, t)| !(t.abs() <= BOUND)) {
            Some((s, t)) => Err(format!(
                "confidence: the {} threshold {t} is not a number in [−{BOUND}, {BOUND}]",
                s.name()
            )),
            None => Ok(()),
        }
    }

    /// Why `signals` escalate (the first threshold crossed), or None when the student is confident.
    pub fn escalate(&self, signals: &Signals) -> Option<String> {
        self.set().into_iter().find_map(|(s, t)| {
            let v = signals.get(s);
            s.unsure(v, t).then(|| {
                let op = if s.higher_is_confident() { "<" } else { ">" };
                format!("{} {v:.3} {op} {t:.3}", s.name())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(logprob: f32, entropy: f32, margin: f32) -> Token {
        Token {
            id: 0,
            logprob,
            entropy,
            margin,
            q: None,
        }
    }

    #[test]
    fn signals_and_thresholds() {
        let tokens: Vec<Token> = (1..=10)
            .map(|i| token(-(i as f32) / 10.0, i as f32, 11.0 - i as f32))
            .collect();
        let s = Signals::of(&tokens);
        assert_eq!(s.tokens, 10);
        assert!((s.mean_logprob + 0.55).abs() < 1e-6);
        assert_eq!(s.min_logprob, -1.0);
        assert_eq!(
            (s.entropy_p50, s.entropy_p90, s.margin_p10),
            (5.0, 9.0, 1.0)
        );
        let mut t = Thresholds::default();
        assert_eq!(t.escalate(&s), None);
        t.max_entropy_p90 = Some(8.5);
        assert_eq!(t.escalate(&s).unwrap(), "entropy_p90 9.000 > 8.500");
        t.min_mean_logprob = Some(-0.5);
        assert_eq!(t.escalate(&s).unwrap(), "mean_logprob -0.550 < -0.500");
        t.min_margin_p10 = Some(f32::NAN);
        assert!(t.check().is_err());
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
