//! Kimi Delta Attention layer (Kimi Linear report §3; transformers `KimiLinearDeltaAttention`).
//!
//! ```text
//! q, k, v = SiLU(ShortConv([W_q x ; W_k x ; W_v x]))        depthwise causal conv, width 4, no bias
//! q, k    = q / sqrt(Σq² + 1e-6), k / sqrt(Σk² + 1e-6)    per head; q is then scaled by dk^-1/2
//! β       = σ(W_b x)                                        one scalar per head
//! f       = W_f_up W_f_down x + dt_bias
//! g       = −exp(A_log) · softplus(f)                       (Kimi Linear)
//!         = lb · σ(exp(A_log) · f)                          (K3 "safe gate", lb = gate_lower_bound)
//! o       = KDA(q, k, v, g, β)                              see `k3mini_kernels::kda`
//! y       = W_o[ σ(W_g x) ⊙ RMSNorm_head(o) ]               W_g low-rank (d→dk→H·dv) or full-rank
//! ```
//!
//! Parameter names follow transformers' Kimi Linear so checkpoints map one to one.
//!
//! For the backward pass the layer keeps its projections' outputs and the kernel's inputs: the
//! conv with SiLU and the L2 norms, the forget gate after its projections, and the output norm
//! with its gate are each one recompute region (`k3mini_kernels::recompute`), and the kernel is
//! the fused chunk op.

use crate::config::{KdaConfig, KdaKernel};
use crate::linear;
use crate::norm::{RmsNorm, rms_normalize};
use crate::precision::Precision;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Distribution, Tensor, activation};
use k3mini_kernels::recompute::recompute;
use k3mini_kernels::{
    KdaInputs, KdaOutput, chunk_kda, fused_chunk_kda, kda::default_scale, kda_step,
    naive_recurrent_kda,
};

/// Epsilon of the q/k L2 normalisation (as fla and transformers).
const L2_EPS: f64 = 1e-6;

/// Depthwise causal convolution over the concatenated q/k/v channels: `weight [3·H·dk, 1, K]`.
/// Output at `t` is `Σ_j w[:, j] · x[t − (K−1) + j]`: the last tap multiplies the current token.
#[derive(Module, Debug)]
pub struct ShortConv {
    pub weight: Param<Tensor<3>>,
}

impl ShortConv {
    fn new(channels: usize, kernel: usize, device: &Device) -> Self {
        let bound = 1.0 / (kernel as f64).sqrt(); // PyTorch's Conv1d default for groups = channels
        let w = Tensor::random(
            [channels, 1, kernel],
            Distribution::Uniform(-bound, bound),
            device,
        );
        Self {
            weight: Param::from_tensor(w),
        }
    }

    fn kernel(&self) -> usize {
        self.weight.dims()[2]
    }

    /// `x [B, T, C]`, `tail [B, K−1, C]` (the previous K−1 inputs, zeros at the start). With
    /// `starts` (packed documents, see [`crate::model::K3Mini::forward_packed`]) a tap never reads a
    /// token of another document. Returns `(post(y) [B, T, C'], new tail)`: the conv and `post`
    /// are one recompute region, so the backward keeps the padded input alone.
    fn forward(
        &self,
        x: Tensor<3>,
        tail: Tensor<3>,
        starts: Option<&Tensor<2>>,
        post: impl Fn(Tensor<3>) -> Tensor<3> + Send + Sync + 'static,
    ) -> (Tensor<3>, Tensor<3>) {
        let [b, t, _] = x.dims();
        let k = self.kernel();
        let padded = Tensor::cat(vec![tail, x], 1); // [B, K−1+T, C]
        let new_tail = padded.clone().narrow(1, t, k - 1);
        let w = self.weight.val().squeeze_dim::<2>(1).swap_dims(0, 1); // [K, C]
        let mut inputs = vec![padded.unsqueeze_dim::<4>(0), w.unsqueeze::<4>()];
        if let Some(s) = starts {
            // Document index per padded position; the tail belongs to the document open before `x`.
            let doc = s.clone().cumsum(1); // [B, T]
            let padded_doc = Tensor::cat(vec![Tensor::zeros([b, k - 1], &doc.device()), doc], 1);
            inputs.push(padded_doc.unsqueeze::<4>());
        }
        let y = recompute(inputs, move |x| {
            let doc = x
                .get(2)
                .map(|d| d.clone().squeeze_dim::<3>(0).squeeze_dim::<2>(0));
            let w = x[1].clone().squeeze_dim::<3>(0).squeeze_dim::<2>(0);
            post(taps(x[0].clone().squeeze_dim::<3>(0), w, doc, t)).unsqueeze_dim::<4>(0)
        });
        (y.squeeze_dim::<3>(0), new_tail)
    }
}

/// The depthwise causal conv: `y_t = Σ_j w_j ⊙ padded_{t+j}` over `padded [B, K−1+T, C]` and
/// `w [K, C]`; with the document index of every padded position `[B, K−1+T]`, a tap reading
/// another document's token reads zero.
fn taps(padded: Tensor<3>, w: Tensor<2>, padded_doc: Option<Tensor<2>>, t: usize) -> Tensor<3> {
    let k = w.dims()[0];
    let mut y = Tensor::zeros(padded.clone().narrow(1, 0, t).dims(), &padded.device());
    for j in 0..k {
        let mut tap = padded.clone().narrow(1, j, t);
        if let Some(padded_doc) = &padded_doc
            && j + 1 < k
        {
            let doc = padded_doc.clone().narrow(1, k - 1, t);
            let same = padded_doc.clone().narrow(1, j, t).equal(doc).float();
            tap = tap * same.unsqueeze_dim::<3>(2);
        }
        y = y + tap * w.clone().narrow(0, j, 1).unsqueeze::<3>();
    }
    y
}

/// After the conv: `silu`, then q and k L2-normalised per head (`[B, T, 3·H·dk]`, q | k | v).
fn activated(mixed: Tensor<3>, heads: usize, head_dim: usize) -> Tensor<3> {
    let [b, t, _] = mixed.dims();
    let inner = heads * head_dim;
    let mixed = activation::silu(mixed);
    let part = |i: usize| mixed.clone().narrow(2, i * inner, inner);
    let l2 = |x: Tensor<3>| {
        let x = x.reshape([b, t, heads, head_dim]);
        (x.clone() / (x.square().sum_dim(3) + L2_EPS).sqrt()).reshape([b, t, inner])
    };
    Tensor::cat(vec![l2(part(0)), l2(part(1)), part(2)], 2)
}

/// The per-channel forget gate producing the log-decay `g`.
#[derive(Module, Debug)]
pub struct ForgetGate {
    pub f_a_proj: Linear,
    pub f_b_proj: Linear,
    /// `[H·dk]`.
    pub dt_bias: Param<Tensor<1>>,
    /// `[1, 1, H, 1]` (transformers' `A_log`, same layout), init `log U(1, 16)`.
    pub a_log: Param<Tensor<4>>,
    #[module(skip)]
    pub lower_bound: Option<f64>,
}

impl ForgetGate {
    /// Init (fla / transformers): `A_log = log U(1, 16)`, `dt ~ exp(U(ln 1e-3, ln 1e-1))` clamped ≥ 1e-4,
    /// `dt_bias = softplus⁻¹(dt)`, so the initial log-decay is `g₀ ≈ −exp(A_log)·dt`.
    /// For the safe gate (our choice; the reference init is unpublished) `dt_bias` is solved for the
    /// same `g₀`: `lb·σ(exp(A_log)·dt_bias) = g₀`. Reusing `softplus⁻¹(dt) ≈ −5` there would saturate
    /// the sigmoid: no decay and vanishing gradients.
    fn new(
        d_model: usize,
        heads: usize,
        head_dim: usize,
        lower_bound: Option<f64>,
        device: &Device,
    ) -> Self {
        let a_log =
            Tensor::<4>::random([1, 1, heads, 1], Distribution::Uniform(1.0, 16.0), device).log();
        let log_dt = Distribution::Uniform(1e-3f64.ln(), 1e-1f64.ln());
        let dt = Tensor::<1>::random([heads * head_dim], log_dt, device)
            .exp()
            .clamp_min(1e-4);
        let dt_bias = match lower_bound {
            None => dt.clone() + (-(-dt).exp() + 1.0).log(), // softplus⁻¹(dt) = dt + log(1 − e^−dt)
            Some(lb) => {
                let rate = a_log
                    .clone()
                    .exp()
                    .reshape([heads, 1])
                    .expand([heads, head_dim])
                    .reshape([heads * head_dim]);
                let ratio = rate.clone() * dt / -lb; // σ(z) = g₀ / lb, in (0, 1)
                (ratio.clone() / (-ratio + 1.0)).log() / rate // z / exp(A_log), z = logit(ratio)
            }
        };
        Self {
            f_a_proj: linear(d_model, head_dim, device),
            f_b_proj: linear(head_dim, heads * head_dim, device),
            dt_bias: Param::from_tensor(dt_bias),
            a_log: Param::from_tensor(a_log),
            lower_bound,
        }
    }

    /// `x [B, T, d]` → `g [B, T, H, dk]`, every entry ≤ 0. After the projections, a recompute
    /// region: the backward keeps their output.
    fn forward(&self, x: Tensor<3>) -> Tensor<4> {
        let [b, t, _] = x.dims();
        let [_, _, h, _] = self.a_log.dims();
        let dk = self.dt_bias.dims()[0] / h;
        let f = self.f_b_proj.forward(self.f_a_proj.forward(x));
        let inputs = vec![
            f.reshape([b, t, h, dk]),
            self.dt_bias.val().reshape([1, 1, h, dk]),
            self.a_log.val(), // [1,1,H,1]
        ];
        let lower_bound = self.lower_bound;
        recompute(inputs, move |x| {
            let f = x[0].clone() + x[1].clone();
            let rate = x[2].clone().exp();
            match lower_bound {
                None => -rate * activation::softplus_with_threshold(f, 1.0, 20.0),
                Some(lb) => activation::sigmoid(rate * f) * lb,
            }
        })
    }
}

/// Recurrent state of one KDA layer during incremental decoding.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// `[B, H, dk, dv]`, fp32.
    pub recurrent: Tensor<4>,
    /// The last K−1 conv inputs `[B, K−1, 3·H·dk]`.
    pub conv: Tensor<3>,
}

#[derive(Module, Debug)]
pub struct KimiDeltaAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub conv1d: ShortConv,
    pub forget_gate: ForgetGate,
    pub b_proj: Linear,
    /// Low-rank gate down-projection d → dk; `None` for K3's full-rank gate.
    pub g_a_proj: Option<Linear>,
    /// Gate up-projection dk → H·dv (low-rank) or d → H·dv (full-rank).
    pub g_b_proj: Linear,
    pub o_norm: RmsNorm,
    pub o_proj: Linear,
    #[module(skip)]
    pub heads: usize,
    #[module(skip)]
    pub head_dim: usize,
    #[module(skip)]
    pub chunk_size: usize,
    #[module(skip)]
    pub kernel: KdaKernel,
    /// Of the projections (the forget gate stays f32: it sets the state's decay).
    #[module(skip)]
    pub precision: Precision,
}

impl KimiDeltaAttention {
    pub fn new(
        d_model: usize,
        heads: usize,
        cfg: &KdaConfig,
        rms_eps: f64,
        device: &Device,
    ) -> Self {
        let hd = cfg.head_dim;
        let inner = heads * hd;
        let (g_a_proj, g_b_proj) = match cfg.gate_rank {
            Some(r) => (Some(linear(d_model, r, device)), linear(r, inner, device)),
            None => (None, linear(d_model, inner, device)),
        };
        Self {
            q_proj: linear(d_model, inner, device),
            k_proj: linear(d_model, inner, device),
            v_proj: linear(d_model, inner, device),
            conv1d: ShortConv::new(3 * inner, cfg.conv_kernel, device),
            forget_gate: ForgetGate::new(d_model, heads, hd, cfg.gate_lower_bound, device),
            b_proj: linear(d_model, heads, device),
            g_a_proj,
            g_b_proj,
            o_norm: RmsNorm::new(hd, rms_eps, device),
            o_proj: linear(inner, d_model, device),
            heads,
            head_dim: hd,
            chunk_size: cfg.chunk_size,
            kernel: cfg.kernel,
            precision: Precision::F32,
        }
    }

    /// A zero state for `batch` sequences.
    pub fn empty_state(&self, batch: usize, device: &Device) -> KdaState {
        let inner = self.heads * self.head_dim;
        KdaState {
            recurrent: Tensor::zeros([batch, self.heads, self.head_dim, self.head_dim], device),
            conv: Tensor::zeros([batch, self.conv1d.kernel() - 1, 3 * inner], device),
        }
    }

    /// `x [B, T, d]` → `[B, T, d]`. With a state, continues from it and updates it in place
    /// (prefill when T > 1, one decode step when T = 1).
    ///
    /// `starts [B, T]` (packed documents): 1.0 where a token begins a new document; neither the conv
    /// nor the recurrent state carries anything across the boundary.
    pub fn forward(
        &self,
        x: Tensor<3>,
        state: Option<&mut KdaState>,
        starts: Option<&Tensor<2>>,
    ) -> Tensor<3> {
        let [b, t, _] = x.dims();
        let (h, hd) = (self.heads, self.head_dim);
        let inner = h * hd;
        let device = x.device();
        let mixed = Tensor::cat(
            vec![
                self.precision.linear(&self.q_proj, x.clone()),
                self.precision.linear(&self.k_proj, x.clone()),
                self.precision.linear(&self.v_proj, x.clone()),
            ],
            2,
        ); // [B, T, 3·H·dk]
        let (conv_tail, s0) = match &state {
            Some(s) => (s.conv.clone(), Some(s.recurrent.clone())),
            None => (
                Tensor::zeros([b, self.conv1d.kernel() - 1, 3 * inner], &device),
                None,
            ),
        };
        let (mixed, new_tail) = self
            .conv1d
            .forward(mixed, conv_tail, starts, move |y| activated(y, h, hd));
        let heads = |i: usize| {
            mixed
                .clone()
                .narrow(2, i * inner, inner)
                .reshape([b, t, h, hd])
        };
        let inputs = KdaInputs {
            q: heads(0),
            k: heads(1),
            v: heads(2),
            g: self.forget_gate.forward(x.clone()),
            beta: activation::sigmoid(self.precision.linear(&self.b_proj, x.clone())),
            starts: starts.cloned(),
        };
        let scale = default_scale(hd);
        let (o, s_final) = match (t, s0) {
            (1, Some(s0)) if starts.is_none() => {
                // Decode: one recurrence step, no chunk padding.
                let at = |x: Tensor<4>| x.squeeze_dim::<3>(1);
                let beta = inputs.beta.squeeze_dim::<2>(1);
                let (o, s) = kda_step(
                    s0,
                    at(inputs.q),
                    at(inputs.k),
                    at(inputs.v),
                    at(inputs.g),
                    beta,
                    scale,
                );
                (o.unsqueeze_dim::<4>(1), s)
            }
            (_, s0) => {
                let out = self.kernel.apply(&inputs, scale, s0, self.chunk_size);
                (out.o, out.state)
            }
        };
        if let Some(s) = state {
            s.recurrent = s_final;
            s.conv = new_tail;
        }
        let gate_in = match &self.g_a_proj {
            Some(a) => self.precision.linear(a, x),
            None => x,
        };
        let gate = self
            .precision
            .linear(&self.g_b_proj, gate_in)
            .reshape([b, t, h, hd]);
        // `RMSNorm(o) ⊙ σ(gate)`, one recompute region: the backward keeps o and the gate's input.
        let eps = self.o_norm.eps;
        let w = self.o_norm.weight.val().unsqueeze::<4>();
        let o = recompute(vec![o, gate, w], move |x| {
            rms_normalize(x[0].clone(), eps) * x[2].clone() * activation::sigmoid(x[1].clone())
        })
        .reshape([b, t, inner]);
        self.precision.linear(&self.o_proj, o)
    }
}

impl KdaKernel {
    /// This kernel over a whole sequence (chunk length `chunk` where it chunks).
    pub fn apply(
        self,
        x: &KdaInputs,
        scale: f64,
        initial_state: Option<Tensor<4>>,
        chunk: usize,
    ) -> KdaOutput {
        match self {
            KdaKernel::Chunk => fused_chunk_kda(x, scale, initial_state, chunk),
            KdaKernel::Composed => chunk_kda(x, scale, initial_state, chunk),
            KdaKernel::Naive => naive_recurrent_kda(x, scale, initial_state),
        }
    }
}
