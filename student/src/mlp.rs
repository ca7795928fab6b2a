//! The gated FFN: SwiGLU (Kimi Linear) or SiTU (K3).
//!
//! ```text
//! SwiGLU:  y = W_down( silu(W_gate x) ⊙ W_up x )
//! SiTU:    y = W_down( [b·tanh(gate/b)·σ(gate)] ⊙ [b_lin·tanh(up/b_lin)] ),  b = 4, b_lin = 25
//! ```
//! SiTU soft-caps both branches so activations stay bounded under low-precision experts.

use crate::config::Activation;
use crate::linear;
use crate::norm::rows;
use crate::precision::Precision;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, activation};
use k3mini_kernels::recompute::recompute;

/// SiTU's cap on the gate branch.
pub const SITU_BETA: f64 = 4.0;
/// SiTU's cap on the linear branch.
pub const SITU_LINEAR_BETA: f64 = 25.0;

#[derive(Module, Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    #[module(skip)]
    pub activation: Activation,
    #[module(skip)]
    pub precision: Precision,
}

impl Mlp {
    pub fn new(d_model: usize, hidden: usize, act: Activation, device: &Device) -> Self {
        Self {
            gate_proj: linear(d_model, hidden, device),
            up_proj: linear(d_model, hidden, device),
            down_proj: linear(hidden, d_model, device),
            activation: act,
            precision: Precision::F32,
        }
    }

    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mm = self.precision;
        let gate = mm.linear(&self.gate_proj, x.clone());
        let up = mm.linear(&self.up_proj, x);
        mm.linear(&self.down_proj, glu(self.activation, gate, up))
    }
}

/// The gated product `act(gate) ⊙ up` shared by dense FFNs and experts: a recompute region, so
/// the backward keeps `gate` and `up` (not the activation's intermediates, `[.., hidden]` each).
pub fn glu<const D: usize>(act: Activation, gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    let dims = gate.dims();
    recompute(vec![rows(gate), rows(up)], move |x| {
        gated(act, x[0].clone(), x[1].clone())
    })
    .reshape(dims)
}

/// [`glu`]'s arithmetic.
fn gated<const D: usize>(act: Activation, gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    match act {
        Activation::Swiglu => activation::silu(gate) * up,
        Activation::Situ => {
            let capped = (gate.clone() / SITU_BETA).tanh() * SITU_BETA * activation::sigmoid(gate);
            capped * (up / SITU_LINEAR_BETA).tanh() * SITU_LINEAR_BETA
        }
    }
}
