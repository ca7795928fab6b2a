//! Mixture of experts: sigmoid router with a correction bias, shared experts, optional LatentMoE.
//!
//! ```text
//! s        = σ(W_r h)                                   fp32, one score per expert
//! K        = top-k of (s + b)                           b: correction bias, not a gradient parameter
//! w_e      = γ · s_e / Σ_{j∈K} s_j   (e ∈ K)           renormalised, γ = routed_scaling_factor
//! y        = Σ_{e∈K} w_e Expert_e(h) + Shared(h)
//! LatentMoE (NVIDIA arXiv 2601.18089):
//! y        = W_up RMSNorm_l( Σ_{e∈K} w_e Expert_e(W_down h) ) + Shared(h)      routing stays in full d
//! ```
//!
//! Aux-loss-free balancing (DeepSeek-V3): after each step `b_e += rate · sign(mean_load − load_e)`;
//! optionally with the complementary sequence-wise balance loss ([`sequence_balance_loss`]).
//! Tensor names follow transformers' Kimi Linear (`experts.gate_up_proj [E, 2I, d]`, `experts.down_proj
//! [E, d, I]`, `gate.weight [E, d]`, `gate.e_score_correction_bias [E]`).

use crate::config::{Activation, MoeConfig};
use crate::linear;
use crate::mlp::{Mlp, glu};
use crate::norm::RmsNorm;
use crate::precision::Precision;
use burn::module::{Module, Param};
use burn::tensor::{Device, Distribution, IndexingUpdateOp, Int, Tensor, TensorData, activation};

/// Router parameters.
#[derive(Module, Debug)]
pub struct Router {
    /// `[E, d]` (PyTorch layout).
    pub weight: Param<Tensor<2>>,
    /// `[E]`, moved by [`balance_bias`], never by gradients.
    pub e_score_correction_bias: Param<Tensor<1>>,
}

/// Routed experts stored as stacked 3-D weights.
#[derive(Module, Debug)]
pub struct Experts {
    /// `[E, 2I, d_in]`: gate rows then up rows.
    pub gate_up_proj: Param<Tensor<3>>,
    /// `[E, d_in, I]`.
    pub down_proj: Param<Tensor<3>>,
}

#[derive(Module, Debug)]
pub struct Moe {
    pub gate: Router,
    pub experts: Experts,
    pub shared_experts: Option<Mlp>,
    /// LatentMoE projections (d → l, l → d) and the latent norm.
    pub latent_down_proj: Option<burn::nn::Linear>,
    pub latent_norm: Option<RmsNorm>,
    pub latent_up_proj: Option<burn::nn::Linear>,
    #[module(skip)]
    pub top_k: usize,
    #[module(skip)]
    pub scaling: f64,
    /// α of the sequence-wise balance loss (0 = none).
    #[module(skip)]
    pub balance_weight: f64,
    #[module(skip)]
    pub activation: Activation,
    /// Of the experts and the latent projections (the router stays f32: it decides the routing).
    #[module(skip)]
    pub precision: Precision,
}

/// How many tokens each expert received in one forward.
pub type ExpertLoad = Vec<usize>;

/// One MoE layer's forward.
pub struct MoeOutput {
    /// `[B, T, d]`.
    pub y: Tensor<3>,
    pub load: ExpertLoad,
    /// The routing, with `layer` unset.
    pub route: Route,
    /// `α · L_bal` when the config's `balance_loss_weight` α is set.
    pub balance_loss: Option<Tensor<1>>,
}

/// One MoE layer's routing in a forward (what llama.cpp's graph hooks read from a GGUF export).
#[derive(Clone, Debug)]
pub struct Route {
    /// The block's index in the model.
    pub layer: usize,
    pub k: usize,
    /// `[N, k]` row-major, tokens in `[B, T]` order: the chosen experts, best first.
    pub experts: Vec<u32>,
    /// `[N, k]`: their weights `w_e`.
    pub weights: Tensor<2>,
    /// `[N, k]`: the norms ‖Expert_e(x)‖₂ of the chosen experts' outputs (before `w_e`; in the
    /// latent space for LatentMoE), REAP's saliency factor. Detached: statistics, not a loss.
    pub norms: Tensor<2>,
    /// `[N, E]`: every expert's router score `s` (with its gradient), for router distillation.
    pub scores: Tensor<2>,
}

impl Moe {
    pub fn new(
        d_model: usize,
        cfg: &MoeConfig,
        act: Activation,
        rms_eps: f64,
        device: &Device,
    ) -> Self {
        let e = cfg.num_experts;
        let i = cfg.expert_hidden;
        let d_in = cfg.latent_dim.unwrap_or(d_model);
        let normal = |shape: [usize; 3]| {
            Param::from_tensor(Tensor::random(
                shape,
                Distribution::Normal(0.0, crate::INIT_STD),
                device,
            ))
        };
        Self {
            gate: Router {
                weight: Param::from_tensor(Tensor::random(
                    [e, d_model],
                    Distribution::Normal(0.0, crate::INIT_STD),
                    device,
                )),
                e_score_correction_bias: Param::from_tensor(Tensor::zeros([e], device))
                    .set_require_grad(false),
            },
            experts: Experts {
                gate_up_proj: normal([e, 2 * i, d_in]),
                down_proj: normal([e, d_in, i]),
            },
            shared_experts: (cfg.num_shared_experts > 0)
                .then(|| Mlp::new(d_model, i * cfg.num_shared_experts, act, device)),
            latent_down_proj: cfg.latent_dim.map(|l| linear(d_model, l, device)),
            latent_norm: cfg.latent_dim.map(|l| RmsNorm::new(l, rms_eps, device)),
            latent_up_proj: cfg.latent_dim.map(|l| linear(l, d_model, device)),
            top_k: cfg.top_k,
            scaling: cfg.routed_scaling_factor,
            balance_weight: cfg.balance_loss_weight,
            activation: act,
            precision: Precision::F32,
        }
    }

    /// Router decision for `h [N, d]`: expert ids `[N, k]`, their weights `[N, k]` and every
    /// expert's score `s [N, E]`.
    pub fn route(&self, h: Tensor<2>) -> (Tensor<2, Int>, Tensor<2>, Tensor<2>) {
        let scores = activation::sigmoid(h.matmul(self.gate.weight.val().transpose())); // [N, E]
        let biased =
            scores.clone().detach() + self.gate.e_score_correction_bias.val().unsqueeze::<2>();
        let (_, ids) = biased.topk_with_indices(self.top_k, 1);
        let chosen = scores.clone().gather(1, ids.clone());
        let weights = chosen.clone() / (chosen.sum_dim(1) + 1e-20) * self.scaling;
        (ids, weights, scores)
    }

    /// `x [B, T, d]` → the layer's output, tokens per expert, the routing and the balance loss.
    pub fn forward(&self, x: Tensor<3>) -> MoeOutput {
        let [b, t, d] = x.dims();
        let n = b * t;
        let h = x.clone().reshape([n, d]);
        let (ids, weights, scores) = self.route(h.clone());
        let e = self.gate.weight.dims()[0];
        let k = self.top_k;
        let device = x.device();

        // Host-side dispatch: for each expert, the tokens routed to it and the flat (token, slot) index
        // of their weight. Gradients flow through `select` / `select_assign`.
        let ids_host: Vec<i64> = ids
            .into_data()
            .try_into_vec_as::<i64>()
            .expect("router ids");
        let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); e];
        let mut slots: Vec<Vec<i64>> = vec![Vec::new(); e];
        for (flat, &ex) in ids_host.iter().enumerate() {
            tokens[ex as usize].push((flat / k) as i64);
            slots[ex as usize].push(flat as i64);
        }
        let load: ExpertLoad = tokens.iter().map(Vec::len).collect();
        let balance_loss = (self.balance_weight > 0.0).then(|| {
            sequence_balance_loss(scores.clone().reshape([b, t, e]), &ids_host, k)
                * self.balance_weight
        });
        let mut norms = Tensor::<1>::zeros([n * k], &device);

        let latent_in = match &self.latent_down_proj {
            Some(p) => self.precision.linear(p, h.clone()),
            None => h.clone(),
        };
        let d_in = latent_in.dims()[1];
        let flat_weights = weights.clone().reshape([n * k]);
        let mut routed = Tensor::<2>::zeros([n, d_in], &device);
        let [_, two_i, _] = self.experts.gate_up_proj.dims();
        for ex in 0..e {
            if tokens[ex].is_empty() {
                continue;
            }
            let idx = |v: &[i64]| {
                Tensor::<1, Int>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
            };
            let (tok, slot) = (idx(&tokens[ex]), idx(&slots[ex]));
            let xs = latent_in.clone().select(0, tok.clone()); // [n_e, d_in]
            let gu = self
                .experts
                .gate_up_proj
                .val()
                .narrow(0, ex, 1)
                .reshape([two_i, d_in]);
            let gu = self.precision.matmul(xs, gu.transpose()); // [n_e, 2I]
            let hidden = glu(
                self.activation,
                gu.clone().narrow(1, 0, two_i / 2),
                gu.narrow(1, two_i / 2, two_i / 2),
            );
            let down = self
                .experts
                .down_proj
                .val()
                .narrow(0, ex, 1)
                .reshape([d_in, two_i / 2]);
            let out = self.precision.matmul(hidden, down.transpose()); // [n_e, d_in]
            let norm = out.clone().detach().powi_scalar(2).sum_dim(1).sqrt(); // [n_e, 1]
            norms = norms.select_assign(
                0,
                slot.clone(),
                norm.reshape([tokens[ex].len()]),
                IndexingUpdateOp::Add,
            );
            let ys = out * flat_weights.clone().select(0, slot).unsqueeze_dim::<2>(1);
            routed = routed.select_assign(0, tok, ys, IndexingUpdateOp::Add);
        }
        let route = Route {
            layer: 0,
            k,
            experts: ids_host.iter().map(|&e| e as u32).collect(),
            weights,
            norms: norms.reshape([n, k]),
            scores,
        };
        let mut y = match (&self.latent_norm, &self.latent_up_proj) {
            (Some(norm), Some(up)) => self.precision.linear(up, norm.forward(routed)),
            _ => routed,
        };
        if let Some(shared) = &self.shared_experts {
            y = y + shared.forward(h);
        }
        MoeOutput {
            y: y.reshape([b, t, d]),
            load,
            route,
            balance_loss,
        }
    }

    /// The layer with only the routed experts `keep` (ascending ids; they become experts
    /// `0..keep.len()` in that order): their weights, router rows and correction biases, copied
    /// exactly. Shared experts and latent projections stay. What expert pruning (REAP) leaves.
    pub fn retain_experts(&self, keep: &[usize]) -> Moe {
        let device = self.gate.weight.device();
        let ids = Tensor::<1, Int>::from_data(
            TensorData::new(keep.iter().map(|&e| e as i64).collect(), [keep.len()]),
            &device,
        );
        let pick2 = |p: &Param<Tensor<2>>| Param::from_tensor(p.val().select(0, ids.clone()));
        let pick3 = |p: &Param<Tensor<3>>| Param::from_tensor(p.val().select(0, ids.clone()));
        Moe {
            gate: Router {
                weight: pick2(&self.gate.weight),
                e_score_correction_bias: Param::from_tensor(
                    self.gate
                        .e_score_correction_bias
                        .val()
                        .select(0, ids.clone()),
                )
                .set_require_grad(false),
            },
            experts: Experts {
                gate_up_proj: pick3(&self.experts.gate_up_proj),
                down_proj: pick3(&self.experts.down_proj),
            },
            ..self.clone()
        }
    }

    /// Applies one aux-loss-free balancing step with the loads of the last forward(s).
    pub fn update_bias(&mut self, load: &[usize], rate: f64) {
        let bias = self.gate.e_score_correction_bias.val();
        let device = bias.device();
        let current: Vec<f32> = bias.into_data().try_into_vec_as::<f32>().expect("bias");
        let next = balance_bias(&current, load, rate as f32);
        let id = self.gate.e_score_correction_bias.id;
        let next = Tensor::from_data(TensorData::new(next, [load.len()]), &device);
        self.gate.e_score_correction_bias = Param::initialized(id, next).set_require_grad(false);
    }
}

/// DeepSeek-V3's complementary sequence-wise balance loss, averaged over the `B` sequences:
///
/// ```text
/// f_i = E / (k T) · Σ_t 1[i ∈ K_t]          the share of the sequence's picks, 1 when even (no gradient)
/// P_i = 1 / T · Σ_t s_{i,t} / Σ_j s_{j,t}    the mean normalised score
/// L   = Σ_i f_i P_i                          1 at perfect balance, up to E when one expert takes all
/// ```
///
/// `scores [B, T, E]`; `ids` the chosen experts `[B·T, k]` row-major.
pub fn sequence_balance_loss(scores: Tensor<3>, ids: &[i64], k: usize) -> Tensor<1> {
    let [b, t, e] = scores.dims();
    let mut f = vec![0f32; b * e];
    let scale = e as f32 / (k * t) as f32;
    for (flat, &ex) in ids.iter().enumerate() {
        f[(flat / k / t) * e + ex as usize] += scale;
    }
    let f = Tensor::<2>::from_data(TensorData::new(f, [b, e]), &scores.device());
    let p = (scores.clone() / scores.sum_dim(2))
        .mean_dim(1)
        .reshape([b, e]); // [B, E]
    (f * p).sum_dim(1).mean().reshape([1])
}

/// DeepSeek-V3's aux-loss-free update: `b_e + rate · sign(mean_load − load_e)`.
pub fn balance_bias(bias: &[f32], load: &[usize], rate: f32) -> Vec<f32> {
    assert_eq!(bias.len(), load.len(), "one load per expert");
    let mean = load.iter().sum::<usize>() as f32 / load.len().max(1) as f32;
    bias.iter()
        .zip(load)
        .map(|(&b, &l)| {
            let gap = mean - l as f32;
            b + rate
                * if gap > 0.0 {
                    1.0
                } else if gap < 0.0 {
                    -1.0
                } else {
                    0.0
                }
        })
        .collect()
}
