//! Distillation objectives over a teacher's sparse top-k: small pure functions, formula above each.
//!
//! Per position `n` (rows of `[N, ·]` tensors; batch and time flattened): the student's logits
//! `z[n, V]`, the teacher's top-k ids `i[n, k]` and logprobs `ℓ[n, k]`, and a loss mask `m[n]`.
//!
//! ```text
//! q = softmax(z / τ)                    student, at the distillation temperature τ
//! p_K = exp ℓ'                          teacher on its top-k set K (ℓ' = ℓ tempered, see below)
//! P = Σ_K p,  Q = Σ_K q                 mass each puts on K
//! p̂ = [p_K, 1 − P],  q̂ = [q_K, 1 − Q]   distributions over K ∪ {tail}: the tail bucket
//! ```
//!
//! Every objective is the masked mean over positions, `Σ_n m_n L_n / Σ_n m_n`; divergences are
//! multiplied by τ² so their gradients keep their scale as τ changes (Hinton et al.). Bucket masses
//! are floored at [`FLOOR`] before logs (a teacher whose top-k holds all its mass has a zero tail).
//!
//! Temperature from logprobs only (the teacher gave `ℓ` at τ_gen, usually 1; DistillKit):
//! `a = τ_gen / τ`, `ℓ'_i = a ℓ_i − log(Σ_K e^{a ℓ_j} + (1 − P)^a)`, tail `(1 − P)^a / (…)`: exact on K,
//! and the tail approximated as one token.

use burn::tensor::{Int, Tensor, activation};

/// The smallest mass a bucket may hold (logs of zero tails would be −∞).
pub const FLOOR: f64 = 1e-8;

/// A distillation objective (the recipe's `kind`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Objective {
    /// Hard labels: `− log q(x_{t+1})` (no teacher; no τ).
    CrossEntropy,
    /// Forward KL with a tail bucket: `KL(p̂ ‖ q̂) = Σ_K p log(p/q) + (1−P) log((1−P)/(1−Q))`.
    ForwardKl,
    /// DistillKit's renormalised top-k ("zero" tail): `Σ_K (p/P)[log(p/P) − log q]`.
    TopkKl,
    /// ModelOpt's renormalised top-k: `KL(p_K/P ‖ q_K/Q)`.
    TopkKlRenormalised,
    /// Reverse KL on the sparse support: `KL(q̂ ‖ p̂) = Σ q̂ log(q̂/p̂)`.
    ReverseKl,
    /// Generalised JSD (GKD): `M = β p̂ + (1−β) q̂`, `β KL(p̂ ‖ M) + (1−β) KL(q̂ ‖ M)`.
    Jsd { beta: f64 },
    /// Skew KL (DistiLLM): `KL(p̂ ‖ α p̂ + (1−α) q̂)`.
    SkewKl { alpha: f64 },
    /// Skew reverse KL (DistiLLM): `KL(q̂ ‖ α q̂ + (1−α) p̂)`.
    SkewReverseKl { alpha: f64 },
    /// Random-sampling KD (arXiv 2503.16870): `− Σ t log q̂` with `t` the frequencies of
    /// `samples` draws from `p̂` ([`sample_targets`]): unbiased for `p̂` where top-k truncation is not.
    Sampled { samples: usize },
    /// Cross-vocabulary forward KL (X-Token style): [`Objective::ForwardKl`]'s formula on the
    /// teacher's top-k projected onto the student's vocabulary, at each aligned chunk's first
    /// position only (`k3mini_data::align`).
    Xtoken,
}

impl Objective {
    /// As a recipe names it (`kind`).
    pub fn name(self) -> &'static str {
        match self {
            Self::CrossEntropy => "ce",
            Self::ForwardKl => "forward_kl",
            Self::TopkKl => "topk_kl",
            Self::TopkKlRenormalised => "topk_kl_renormalised",
            Self::ReverseKl => "reverse_kl",
            Self::Jsd { .. } => "jsd",
            Self::SkewKl { .. } => "skew_kl",
            Self::SkewReverseKl { .. } => "skew_reverse_kl",
            Self::Sampled { .. } => "sampled",
            Self::Xtoken => "xtoken",
        }
    }
}

/// Router distillation at one MoE layer, per position: `KL(r ‖ π) = Σ_e r_e (log r_e − log π_e)`
/// with `π = s / Σ_e s_e` the student router's normalised scores `s [N, E]` and `r [N, E]` the
/// teacher's routing mass gathered onto the student's experts (rows sum to 1, or are all zero
/// where the teacher routed nothing the map keeps; mask those). `[N, E] → [N]`
pub fn router_kl(scores: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    let log_pi = scores.clone().log() - scores.sum_dim(1).log();
    let n = target.dims()[0];
    (target.clone() * (target.clamp_min(FLOOR).log() - log_pi))
        .sum_dim(1)
        .reshape([n])
}

/// Teacher signals for `N` positions, as constants (no gradient flows to the teacher).
#[derive(Clone, Debug)]
pub struct TeacherTopK {
    /// `[N, k]`
    pub ids: Tensor<2, Int>,
    /// `[N, k]`, at the temperature the teacher was run at.
    pub logprobs: Tensor<2>,
    /// `[N, k + 1]`: sampled-target frequencies over `K ∪ {tail}`, for [`Objective::Sampled`].
    pub sampled: Option<Tensor<2>>,
}

impl TeacherTopK {
    /// The positions `rows` of every field.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Self {
        let take = |x: Tensor<2>| x.narrow(0, rows.start, rows.len());
        Self {
            ids: self.ids.clone().narrow(0, rows.start, rows.len()),
            logprobs: take(self.logprobs.clone()),
            sampled: self.sampled.clone().map(take),
        }
    }
}

/// `log(a e^x + b e^y)` elementwise, stably (mixtures of distributions given as logs).
fn log_mix(a: f64, x: Tensor<2>, b: f64, y: Tensor<2>) -> Tensor<2> {
    let m = x.clone().max_pair(y.clone());
    let s = (x - m.clone()).exp() * a + (y - m.clone()).exp() * b;
    m + s.log()
}

/// `Σ_j e^{a_j} (a_j − b_j)` per row: `KL(A ‖ B)` for rows of log-probabilities. `[N, C] → [N]`.
fn kl_rows(log_a: Tensor<2>, log_b: Tensor<2>) -> Tensor<1> {
    let n = log_a.dims()[0];
    (log_a.clone().exp() * (log_a - log_b))
        .sum_dim(1)
        .reshape([n])
}

/// `log(1 − Σ_K e^{log_k})` per row, floored: the log of the tail bucket. `[N, k] → [N, 1]`.
fn log_tail(log_k: Tensor<2>) -> Tensor<2> {
    (-log_k.exp().sum_dim(1) + 1.0).clamp_min(FLOOR).log()
}

/// The teacher's bucketed log-distribution `log p̂ [N, k + 1]` at temperature `tau`, from
/// logprobs given at `tau_gen`.
pub fn teacher_buckets(logprobs: Tensor<2>, tau_gen: f64, tau: f64) -> Tensor<2> {
    let a = tau_gen / tau;
    let tail = log_tail(logprobs.clone()); // log(1 − P), floored
    let scaled = Tensor::cat(vec![logprobs * a, tail * a], 1); // a ℓ, a log(1 − P)
    let lse = scaled.clone().exp().sum_dim(1).log(); // log(Σ_K p^a + (1 − P)^a)
    scaled - lse
}

/// The student's bucketed log-distribution `log q̂ [N, k + 1]`, and `log q` on K alone `[N, k]`.
pub fn student_buckets(log_q: Tensor<2>, ids: Tensor<2, Int>) -> (Tensor<2>, Tensor<2>) {
    let on_k = log_q.gather(1, ids); // [N, k]
    let tail = log_tail(on_k.clone());
    (Tensor::cat(vec![on_k.clone(), tail], 1), on_k)
}

/// Masked mean of per-position losses `[N]` (an all-zero mask gives 0 with zero gradient).
pub fn masked_mean(per_position: Tensor<1>, mask: Tensor<1>) -> Tensor<1> {
    masked_share(per_position, mask.clone(), masked_count(mask))
}

/// The denominator of [`masked_mean`]: `max(Σ_n m_n, 1)`, `[1]`.
pub fn masked_count(mask: Tensor<1>) -> Tensor<1> {
    mask.sum().clamp_min(1.0)
}

/// A chunk of positions' share of a masked mean whose denominator `count` ([`masked_count`]) is
/// the whole batch's: `Σ_{n ∈ chunk} m_n L_n / count`. The shares of a batch's chunks sum to its
/// masked mean.
pub fn masked_share(per_position: Tensor<1>, mask: Tensor<1>, count: Tensor<1>) -> Tensor<1> {
    (per_position * mask).sum() / count
}

/// Per-position loss `[N]` of one objective. `logits [N, V]`, `targets [N]` (the actual next ids,
/// for cross-entropy), teacher signals at `tau_gen`; `tau` is the distillation temperature.
pub fn objective_per_position(
    objective: Objective,
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    teacher: &TeacherTopK,
    tau_gen: f64,
    tau: f64,
) -> Tensor<1> {
    let [n, _] = logits.dims();
    if objective == Objective::CrossEntropy {
        return crate::loss::cross_entropy(logits, targets);
    }
    let log_q = activation::log_softmax(logits / tau, 1);
    let (q_hat, q_k) = student_buckets(log_q, teacher.ids.clone());
    let p_hat = teacher_buckets(teacher.logprobs.clone(), tau_gen, tau);
    let k = q_k.dims()[1];
    let p_k = p_hat.clone().narrow(1, 0, k);
    let renormalise = |log_k: Tensor<2>| {
        let lse = log_k.clone().exp().sum_dim(1).log();
        log_k - lse
    };
    let loss = match objective {
        Objective::CrossEntropy => unreachable!("handled above"),
        Objective::ForwardKl | Objective::Xtoken => kl_rows(p_hat, q_hat),
        Objective::TopkKl => kl_rows(renormalise(p_k), q_k),
        Objective::TopkKlRenormalised => kl_rows(renormalise(p_k), renormalise(q_k)),
        Objective::ReverseKl => kl_rows(q_hat, p_hat),
        Objective::Jsd { beta } => {
            let m = log_mix(beta, p_hat.clone(), 1.0 - beta, q_hat.clone());
            kl_rows(p_hat, m.clone()) * beta + kl_rows(q_hat, m) * (1.0 - beta)
        }
        Objective::SkewKl { alpha } => {
            let m = log_mix(alpha, p_hat.clone(), 1.0 - alpha, q_hat);
            kl_rows(p_hat, m)
        }
        Objective::SkewReverseKl { alpha } => {
            let m = log_mix(alpha, q_hat.clone(), 1.0 - alpha, p_hat);
            kl_rows(q_hat, m)
        }
        Objective::Sampled { .. } => {
            let t = teacher
                .sampled
                .clone()
                .expect("Objective::Sampled needs TeacherTopK::sampled");
            -(t * q_hat).sum_dim(1).reshape([n])
        }
    };
    loss * (tau * tau)
}

/// `samples` draws with replacement from each row of `p̂` (`[N][k + 1]` probabilities, tail last),
/// as frequencies `count / samples`: the targets of [`Objective::Sampled`]. `uniform` yields draws
/// in `[0, 1)` (a seeded stream makes a step's targets reproducible).
pub fn sample_targets(
    p_hat: &[f32],
    k1: usize,
    samples: usize,
    uniform: &mut dyn FnMut() -> f64,
) -> Vec<f32> {
    let mut out = vec![0f32; p_hat.len()];
    for (row, freq) in p_hat.chunks_exact(k1).zip(out.chunks_exact_mut(k1)) {
        let total: f64 = row.iter().map(|&p| p as f64).sum();
        for _ in 0..samples {
            let mut u = uniform() * total;
            let mut pick = k1 - 1;
            for (j, &p) in row.iter().enumerate() {
                u -= p as f64;
                if u < 0.0 {
                    pick = j;
                    break;
                }
            }
            freq[pick] += 1.0 / samples as f32;
        }
    }
    out
}

/// On-policy distillation's policy-gradient loss on the student's own samples `x_t`, per position
/// (the loss is their [`masked_mean`]):
///
/// ```text
/// A_t = −(log q(x_t) − log p(x_t))        per-token reverse-KL advantage, held constant
/// L   = − Σ_t m_t A_t log q(x_t) / Σ_t m_t
/// ```
/// Its gradient is the REINFORCE estimate of `∇ KL(q ‖ p)` along the sampled path (Thinking
/// Machines, "On-Policy Distillation"). `logits [N, V]` at the positions that predicted `sampled [N]`;
/// `teacher_logprobs [N]` = `log p(x_t)` from scoring the student's sequence.
pub fn on_policy_per_position(
    logits: Tensor<2>,
    sampled: Tensor<1, Int>,
    teacher_logprobs: Tensor<1>,
) -> Tensor<1> {
    let log_q = -crate::loss::cross_entropy(logits, sampled);
    let advantage = (teacher_logprobs - log_q.clone()).detach();
    -(advantage * log_q)
}

/// `log(1 − e^x)` for `x < 0`, stably (Mächler's two branches).
fn log1mexp(x: f64) -> f64 {
    if x < -std::f64::consts::LN_2 {
        (-x.exp()).ln_1p()
    } else {
        (-x.exp_m1()).ln()
    }
}

/// ALM's chunk divergence (approximate likelihood matching, Minixhofer et al. 2025; tokenkit's
/// `binary_ce` main path, less the teacher's entropy so it is 0 where the two agree). A chunk's
/// log-likelihoods `t` (teacher) and `s` (student, `Σ log q` over its tokens), read at
/// binarisation temperature `T` as Bernoulli probabilities `y = e^a`, `ŷ = e^b`:
///
/// ```text
/// a = t/T − ε,  b = s/T − ε                              (ε = 1e-6 keeps both below 0)
/// L = y (a − b) + (1 − y) (log(1 − y) − log(1 − ŷ))      KL(Bernoulli(y) ‖ Bernoulli(ŷ))
/// ∂L/∂s = (ŷ − y) / (T (1 − ŷ))
/// ```
/// Returns `(L, ∂L/∂s)`: the loss is a function of chunk sums, so the trainer applies the
/// derivative to each chunk's token log-probabilities (see `k3mini::train::distill`).
pub fn alm_chunk(t: f64, s: f64, temperature: f64) -> (f64, f64) {
    const EPS: f64 = 1e-6;
    // Log-likelihoods are ≤ 0; f32 rounding must not take either Bernoulli past 1.
    let (t, s) = (t.min(0.0), s.min(0.0));
    let (a, b) = (t / temperature - EPS, s / temperature - EPS);
    let (y, y_hat) = (a.exp(), b.exp());
    let loss = y * (a - b) + (1.0 - y) * (log1mexp(a) - log1mexp(b));
    let grad = (y_hat - y) / (temperature * (-b.exp_m1()));
    (loss, grad)
}
