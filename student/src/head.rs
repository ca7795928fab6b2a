//! The LM head and its loss, one chunk of tokens at a time (as Liger-Kernel's fused linear
//! cross-entropy, on burn's autodiff): the `[N, vocab]` logits of a micro-batch never exist at once.
//!
//! For hidden states `h [N, d]` (the final norm's output), the head `W [d, V]` and a loss that is
//! a sum over tokens (each objective's masked sum divided by the micro-batch's count), with the
//! tokens cut into chunks `c`:
//!
//! ```text
//! L = Σ_c ℓ_c(h_c W)
//! G_h[c] = ∂ℓ_c/∂h_c,   G_W = Σ_c ∂ℓ_c/∂W              computed chunk by chunk inside the forward
//! L̃ = L + (⟨h, G_h⟩ + ⟨W, G_W⟩ − stop_grad(⟨h, G_h⟩ + ⟨W, G_W⟩))
//! ```
//!
//! Each chunk's logits `[c, V]` are formed, consumed by the loss and differentiated on a graph of
//! their own whose leaves are detached copies of `h_c` and `W`; the logits, their softmax and their
//! gradient are freed before the next chunk. `L̃` has the value `L` exactly (the bracket is
//! `x − x = 0`) and the gradients `G_h` and `G_W`, so the step's graph keeps `h`, `G_h [N, d]` and
//! `G_W [d, V]` instead of the logits and what their loss saved. Under QAT `W` is the
//! fake-quantised weight, so `G_W` reaches the f32 weight through the straight-through estimator
//! as the unchunked head's gradient does.

use crate::K3Mini;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Logits one chunk holds by default: 2^26 values (256 MiB in f32). The 3B preset's 163,840-id
/// vocabulary gives chunks of 409 tokens; SmolLM2's 49,152 ids, 1,365.
pub const CHUNK_LOGITS: usize = 1 << 26;

/// How many tokens' logits exist at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadChunks {
    /// The micro-batch's logits whole, under the step's graph: the unchunked reference.
    Whole,
    /// At most this many tokens (at least 1).
    Tokens(usize),
}

impl HeadChunks {
    /// As many tokens as fit [`CHUNK_LOGITS`] logits of a `vocab`-id head.
    pub fn for_vocab(vocab: usize) -> Self {
        Self::Tokens((CHUNK_LOGITS / vocab.max(1)).max(1))
    }

    /// A recipe's `train.head_chunk`: unset, the default for `vocab`; `0`, the whole micro-batch;
    /// otherwise that many tokens.
    pub fn resolve(head_chunk: Option<usize>, vocab: usize) -> Self {
        match head_chunk {
            None => Self::for_vocab(vocab),
            Some(0) => Self::Whole,
            Some(tokens) => Self::Tokens(tokens),
        }
    }

    /// Tokens whose logits exist at once in a micro-batch of `tokens`.
    pub fn tokens_at_once(self, tokens: usize) -> usize {
        match self {
            Self::Whole => tokens,
            Self::Tokens(size) => size.clamp(1, tokens.max(1)),
        }
    }

    /// Whether a micro-batch of `tokens` is cut at all: one chunk holding every token is the
    /// whole head (the chunked path would only add the gradient buffers).
    pub fn cuts(self, tokens: usize) -> bool {
        self.tokens_at_once(tokens) < tokens
    }
}

/// `Σ_c loss(logits_c, rows_c)` over the chunks of `hidden [N, d]`, differentiated as the module
/// doc says. `loss` gets a chunk's logits `[len, V]` and the range of rows of `hidden` they are
/// of, and returns that chunk's share of the loss `[1]`; it must reach the model only through
/// those logits (a tensor of the step's graph used inside it would be differentiated on the
/// chunk's graph). A share that does not depend on the logits (a recipe whose only objective is
/// router distillation) is added as a constant.
pub fn head_loss(
    model: &K3Mini,
    hidden: Tensor<2>,
    chunks: HeadChunks,
    mut loss: impl FnMut(Tensor<2>, Range<usize>) -> Tensor<1>,
) -> Tensor<1> {
    let n = hidden.dims()[0];
    if !chunks.cuts(n) {
        return loss(model.head(hidden), 0..n);
    }
    let size = chunks.tokens_at_once(n);
    let precision = model.config.precision;
    let weight = model.lm_head.weight.val(); // [d, V]
    let ranges = (0..n).step_by(size).map(move |s| s..(s + size).min(n));
    let (hidden_tracked, weight_tracked) = (hidden.is_tracked(), weight.is_tracked());
    if !(hidden_tracked || weight_tracked) {
        // Evaluation: nothing to differentiate, only the chunking.
        return ranges
            .map(|r| {
                let h = hidden.clone().narrow(0, r.start, r.len());
                loss(precision.project(h, weight.clone()), r)
            })
            .reduce(|a, b| a + b)
            .unwrap_or_else(|| Tensor::zeros([1], &hidden.device()));
    }
    // Leaves of each chunk's graph; a gradient only for what the step differentiates.
    let leaf = |x: Tensor<2>, tracked: bool| if tracked { x.require_grad() } else { x };
    let w = leaf(weight.clone().detach(), weight_tracked);
    let detached = hidden.clone().detach();
    let d = hidden.dims()[1];
    let mut value: Option<Tensor<1>> = None;
    let mut g_w: Option<Tensor<2>> = None;
    let mut g_h = Vec::new();
    for r in ranges {
        let h = leaf(detached.clone().narrow(0, r.start, r.len()), hidden_tracked); // [len, d]
        let chunk_loss = loss(precision.project(h.clone(), w.clone()), r.clone()); // [1]
        let zeros = || Tensor::zeros([r.len(), d], &h.device()).inner();
        if chunk_loss.is_tracked() {
            let grads = chunk_loss.backward();
            g_h.push(h.grad(&grads).unwrap_or_else(zeros));
            if let Some(g) = w.grad(&grads) {
                g_w = Some(match g_w {
                    Some(sum) => sum + g,
                    None => g,
                });
            }
        } else {
            g_h.push(zeros());
        }
        let chunk_loss = chunk_loss.detach();
        value = Some(match value {
            Some(sum) => sum + chunk_loss,
            None => chunk_loss,
        });
    }
    let value = value.expect("a micro-batch that is cut has two chunks or more");
    // Constants (no autodiff) in the products: their backward hands G_h and G_W to h and W.
    let mut surrogate = (hidden * Tensor::cat(g_h, 0)).sum();
    if let Some(g_w) = g_w {
        surrogate = surrogate + (weight * g_w).sum();
    }
    value + (surrogate.clone() - surrogate.detach())
}

/// `log q(targets[n])` at every row of `hidden [N, d]`, as constants (no graph is built): the
/// head run `chunks` of rows at a time. What a loss that is a function of sums of token
/// log-probabilities (ALM's chunk likelihoods) evaluates before the differentiated pass.
pub fn target_logprobs(
    model: &K3Mini,
    hidden: Tensor<2>,
    chunks: HeadChunks,
    targets: Tensor<1, burn::tensor::Int>,
) -> Vec<f32> {
    let n = hidden.dims()[0];
    let size = chunks.tokens_at_once(n);
    let (hidden, weight) = (hidden.detach(), model.lm_head.weight.val().detach());
    let mut out = Vec::with_capacity(n);
    for s in (0..n).step_by(size.max(1)) {
        let len = size.min(n - s);
        let logits = model
            .config
            .precision
            .project(hidden.clone().narrow(0, s, len), weight.clone());
        let lq = -crate::loss::cross_entropy(logits, targets.clone().narrow(0, s, len));
        out.extend(lq.into_data().iter::<f32>());
    }
    out
}
