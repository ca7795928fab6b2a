//! Held-out language-modelling metrics from a mean next-token loss.
//!
//! ```text
//! ppl = exp(L)                      L = mean −ln q(x_t | x_<t) over the N scored positions (nats)
//! bpb = L · N / (B · ln 2)          B = UTF-8 bytes of the text those N positions predict
//! ```
//! Bits per byte are the summed negative log-likelihood in bits over the bytes it encodes (no
//! padding, no special tokens, no unscored token in either), as language-model evaluations define
//! them, so students with different tokenizers compare.

/// Perplexity of a mean next-token loss in nats.
pub fn perplexity(mean_nll: f64) -> f64 {
    mean_nll.exp()
}

/// Bits per UTF-8 byte: `mean_nll` over `positions` scored positions, which predict text of
/// `bytes` bytes.
pub fn bits_per_byte(mean_nll: f64, positions: usize, bytes: usize) -> f64 {
    mean_nll * positions as f64 / (bytes as f64 * std::f64::consts::LN_2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uniform_byte_model_has_eight_bits_per_byte() {
        // One token per byte, uniform over 256 values: L = ln 256.
        let l = 256f64.ln();
        assert!((bits_per_byte(l, 1000, 1000) - 8.0).abs() < 1e-12);
        assert!((perplexity(l) - 256.0).abs() < 1e-9);
        // Four bytes per token at the same loss: a quarter of the bits per byte.
        assert!((bits_per_byte(l, 250, 1000) - 2.0).abs() < 1e-12);
    }
}
