//! The language-modelling loss (the distillation losses are in [`crate::distill`]).

use burn::tensor::{Int, Tensor, activation};

/// Per-position cross-entropy `− log softmax(logits[n])[targets[n]]` `[N]`, for `logits [N, V]`
/// and `targets [N]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let n = logits.dims()[0];
    -activation::log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .reshape([n])
}

/// Mean next-token cross-entropy over the positions `mask` keeps:
///
/// ```text
/// L = − Σ_{b,t} m[b,t] · log softmax(logits[b,t])[tokens[b,t+1]]  /  Σ m[b,t]
/// ```
/// `logits [B, T, V]`, `tokens [B, T]`, `mask [B, T]` (1.0 = train on predicting token t+1 from t;
/// `None` = every position but the last). The last position has no target and is always dropped.
pub fn next_token_cross_entropy(
    logits: Tensor<3>,
    tokens: Tensor<2, Int>,
    mask: Option<Tensor<2>>,
) -> Tensor<1> {
    let [b, t, _] = logits.dims();
    assert!(t >= 2, "next-token loss needs at least two tokens");
    let log_probs = activation::log_softmax(logits.narrow(1, 0, t - 1), 2); // [B, T−1, V]
    let targets = tokens.narrow(1, 1, t - 1).reshape([b, t - 1, 1]);
    let picked = log_probs.gather(2, targets).reshape([b, t - 1]); // log p(token t+1 | ≤ t)
    match mask {
        None => -picked.mean(),
        Some(mask) => {
            let mask = mask.narrow(1, 0, t - 1);
            // Guard against an all-masked batch (0/0): the loss is then 0 with zero gradient.
            -(picked * mask.clone()).sum() / mask.sum().clamp_min(1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Distribution, TensorData};

    #[test]
    fn mask_selects_positions_and_matches_a_hand_computation() {
        let device = Device::flex();
        let logits = Tensor::<3>::random([1, 3, 4], Distribution::Normal(0.0, 1.0), &device);
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(vec![0i64, 2, 1], [1, 3]), &device);
        let lp: Vec<f32> = activation::log_softmax(logits.clone(), 2)
            .into_data()
            .convert::<f32>()
            .try_into_vec()
            .unwrap();
        let (p0, p1) = (lp[2], lp[4 + 1]); // log p(2 | pos 0), log p(1 | pos 1)
        let all =
            next_token_cross_entropy(logits.clone(), tokens.clone(), None).into_scalar::<f32>();
        assert!((all + (p0 + p1) / 2.0).abs() < 1e-6);
        let ones = Tensor::<2>::ones([1, 3], &device);
        let same = next_token_cross_entropy(logits.clone(), tokens.clone(), Some(ones))
            .into_scalar::<f32>();
        assert!((same - all).abs() < 1e-6, "the last position never counts");
        let only_second =
            Tensor::<2>::from_data(TensorData::new(vec![0.0f32, 1.0, 1.0], [1, 3]), &device);
        let second = next_token_cross_entropy(logits.clone(), tokens.clone(), Some(only_second))
            .into_scalar::<f32>();
        assert!((second + p1).abs() < 1e-6);
        let none = Tensor::<2>::zeros([1, 3], &device);
        assert_eq!(
            next_token_cross_entropy(logits, tokens, Some(none)).into_scalar::<f32>(),
            0.0
        );
    }
}
