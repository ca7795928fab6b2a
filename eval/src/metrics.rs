//! Held-out language-modelling metrics from a mean next-token loss.
//!
//! ```text
//! ppl = exp(L)                      L = mean −ln q(x_t | x_<t) over scored tokens (nats)
//! bpb = L · N_tokens / (N_bytes · ln 2)
//! ```
//! Bits per byte divide the same information by the text's UTF-8 bytes, so students with
//! different tokenizers compare.

/// Perplexity of a mean next-token loss in nats.
pub fn perplexity(mean_nll: f64) -> f64 {
    mean_nll.exp()
}

/// Bits per UTF-8 byte of text that `tokens` tokens spell in `bytes` bytes.
pub fn bits_per_byte(mean_nll: f64, tokens: usize, bytes: usize) -> f64 {
    mean_nll * tokens as f64 / (bytes as f64 * std::f64::consts::LN_2)
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
