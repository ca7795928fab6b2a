//! Attention Residuals (arXiv 2603.15031): each sub-layer reads a softmax mixture over depth instead
//! of the plain residual sum.
//!
//! ```text
//! h_l     = Σ_i a_{i→l} v_i,     a_{i→l} = softmax_i( w_l · RMSNorm(v_i) )
//! ```
//! `w_l ∈ R^d` is a learned pseudo-query, ZERO-initialised so training starts from a uniform mean; the
//! values `v_i` are un-normalised. In the block form the sources are `[b_0 = embedding, completed
//! blocks…, the partial current block]`, a block summing `block_size` sub-layer outputs
//! (`block_size = 1` is the full form). The layer wiring follows fla's `KDABlock`.

use crate::norm::{RmsNorm, rms_normalize};
use burn::module::{Module, Param};
use burn::tensor::{Device, Tensor, activation};
use k3mini_kernels::recompute::{MAX_INPUTS, recompute};

/// One depth-attention point: a pseudo-query and the RMSNorm applied to its keys.
#[derive(Module, Debug)]
pub struct DepthAttention {
    /// `[d]`, zero-initialised.
    pub query: Param<Tensor<1>>,
    pub key_norm: RmsNorm,
}

impl DepthAttention {
    pub fn new(d_model: usize, eps: f64, device: &Device) -> Self {
        Self {
            query: Param::from_tensor(Tensor::zeros([d_model], device)),
            key_norm: RmsNorm::new(d_model, eps, device),
        }
    }

    /// Mixes `sources` (each `[B, T, d]`) over depth → `[B, T, d]`.
    pub fn forward(&self, sources: &[Tensor<3>]) -> Tensor<3> {
        attn_res(self.query.val(), sources, &self.key_norm)
    }
}

/// `Σ_i softmax_i(w · RMSNorm(v_i)) v_i` (fla's `naive_attnres` with scale 1), one recompute
/// region: the backward keeps the sources (already alive as the depth stream), not their stack,
/// keys and weights.
pub fn attn_res(query: Tensor<1>, sources: &[Tensor<3>], key_norm: &RmsNorm) -> Tensor<3> {
    assert!(!sources.is_empty(), "AttnRes needs at least one source");
    let d = query.dims()[0];
    let eps = key_norm.eps;
    let mut inputs = vec![
        query.reshape([1, 1, 1, d]),
        key_norm.weight.val().reshape([1, 1, 1, d]),
    ];
    // Past the region's inputs, the sources go in stacked (a copy).
    let one_by_one = sources.len() + inputs.len() <= MAX_INPUTS;
    if one_by_one {
        inputs.extend(sources.iter().map(|s| s.clone().unsqueeze_dim::<4>(0)));
    } else {
        inputs.push(Tensor::stack(sources.to_vec(), 0));
    }
    recompute(inputs, move |x| {
        let values = match one_by_one {
            true => Tensor::cat(x[2..].to_vec(), 0), // [L, B, T, d]
            false => x[2].clone(),
        };
        let keys = rms_normalize(values.clone(), eps) * x[1].clone();
        let logits = keys.matmul(x[0].clone().reshape([1, 1, d, 1])); // [L, B, T, 1]
        let weights = activation::softmax(logits, 0);
        (weights * values).sum_dim(0)
    })
    .squeeze_dim::<3>(0)
}

/// The running depth sources of one token stream.
#[derive(Clone, Debug, Default)]
pub struct DepthSources {
    /// `[b_0, completed blocks…]`.
    pub done: Vec<Tensor<3>>,
    /// Sum of the current block's outputs so far.
    pub partial: Option<Tensor<3>>,
}

impl DepthSources {
    /// Sources for sub-layer `index`; a sub-layer at a block boundary first closes the partial block.
    pub fn sources_for(&mut self, index: usize, block_size: usize) -> Vec<Tensor<3>> {
        let mut all = self.done.clone();
        all.extend(self.partial.clone());
        if index % block_size == 0
            && let Some(p) = self.partial.take()
        {
            self.done.push(p);
        }
        all
    }

    /// Adds a sub-layer output to the current block.
    pub fn push_output(&mut self, out: Tensor<3>) {
        self.partial = Some(match self.partial.take() {
            Some(p) => p + out,
            None => out,
        });
    }

    /// All sources, for the final aggregation.
    pub fn all(&self) -> Vec<Tensor<3>> {
        let mut all = self.done.clone();
        all.extend(self.partial.clone());
        all
    }
}
