//! Batches as the model takes them: packed rows as `[rows, T]` tensors, teacher-signal batches
//! flattened to one row per predicting position.

use crate::train::objective::RouterTerms;
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_data::PackedBatch;
use k3mini_data::signals::SignalBatch;
use k3mini_student::K3Mini;
use k3mini_student::distill::TeacherTopK;

/// A packed batch as `[rows, T]` tensors: tokens, document starts, loss mask.
pub fn packed_tensors(b: &PackedBatch, device: &Device) -> (Tensor<2, Int>, Tensor<2>, Tensor<2>) {
    let shape = [b.rows, b.seq_len];
    (
        Tensor::from_data(TensorData::new(b.tokens.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.starts.clone(), shape), device),
        Tensor::from_data(TensorData::new(b.loss_mask.clone(), shape), device),
    )
}

/// One batch as flat `[N = rows·(T−1)]` tensors: logits' positions, targets, mask, teacher top-k.
pub struct Flat {
    pub tokens: Tensor<2, Int>,
    pub targets: Tensor<1, Int>,
    pub mask: Tensor<1>,
    pub teacher: TeacherTopK,
}

pub fn flatten(b: &SignalBatch, device: &Device) -> Flat {
    let (rows, t, k) = (b.rows, b.seq_len, b.k);
    let n = rows * (t - 1);
    let tokens: Tensor<2, Int> =
        Tensor::from_data(TensorData::new(b.tokens.clone(), [rows, t]), device);
    let targets = tokens.clone().narrow(1, 1, t - 1).reshape([n]);
    let mask = Tensor::<2>::from_data(TensorData::new(b.loss_mask.clone(), [rows, t]), device)
        .narrow(1, 0, t - 1)
        .reshape([n]);
    let ids = Tensor::<3, Int>::from_data(TensorData::new(b.top_ids.clone(), [rows, t, k]), device)
        .narrow(1, 0, t - 1)
        .reshape([n, k]);
    let logprobs = Tensor::<3>::from_data(
        TensorData::new(b.top_logprobs.clone(), [rows, t, k]),
        device,
    )
    .narrow(1, 0, t - 1)
    .reshape([n, k]);
    Flat {
        tokens,
        targets,
        mask,
        teacher: TeacherTopK {
            ids,
            logprobs,
            sampled: None,
        },
    }
}

/// The LM head's input at every predicting position, `[rows, T] → [rows·(T−1), d]` (documents
/// packed with `starts`), and the forward's router terms.
pub fn position_hidden(
    model: &K3Mini,
    tokens: Tensor<2, Int>,
    starts: Option<&Tensor<2>>,
) -> (Tensor<2>, RouterTerms) {
    RouterTerms::split(model.trunk(tokens, starts))
}
