//! The language-modelling loss (the distillation losses arrive with the trainer).

use burn::tensor::{Int, Tensor, activation};

/// Mean next-token cross-entropy: `−mean_{b,t} log softmax(logits[b,t])[tokens[b,t+1]]`.
/// `logits [B, T, V]`, `tokens [B, T]`; the last position has no target.
pub fn next_token_cross_entropy(logits: Tensor<3>, tokens: Tensor<2, Int>) -> Tensor<1> {
    let [b, t, _] = logits.dims();
    assert!(t >= 2, "next-token loss needs at least two tokens");
    let log_probs = activation::log_softmax(logits.narrow(1, 0, t - 1), 2); // [B, T−1, V]
    let targets = tokens.narrow(1, 1, t - 1).reshape([b, t - 1, 1]);
    -log_probs.gather(2, targets).mean()
}
