//! Batches as the model takes them: packed rows as `[rows, T]` tensors, teacher-signal batches
//! flattened to one row per predicting position.

use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_data::PackedBatch;
use k3mini_data::signals::SignalBatch;
use k3mini_student::distill::TeacherTopK;
use k3mini_student::moe::{ExpertLoad, Route};
use k3mini_student::{K3Mini, Trunk};

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
    /// Where the top-k is the teacher's: `mask`, or a cross-tokenizer batch's chunk starts.
    pub teacher_mask: Tensor<1>,
    pub teacher: TeacherTopK,
}

pub fn flatten(b: &SignalBatch, device: &Device) -> Flat {
    let (rows, t, k) = (b.rows, b.seq_len, b.k);
    let n = rows * (t - 1);
    let tokens: Tensor<2, Int> =
        Tensor::from_data(TensorData::new(b.tokens.clone(), [rows, t]), device);
    let targets = tokens.clone().narrow(1, 1, t - 1).reshape([n]);
    let positions = |m: &[f32]| {
        Tensor::<2>::from_data(TensorData::new(m.to_vec(), [rows, t]), device)
            .narrow(1, 0, t - 1)
            .reshape([n])
    };
    let mask = positions(&b.loss_mask);
    let teacher_mask = b.teacher_mask.as_deref().map_or(mask.clone(), positions);
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
        teacher_mask,
        teacher: TeacherTopK {
            ids,
            logprobs,
            sampled: None,
        },
    }
}

/// What a forward's routers hand the step, whatever the mode's loss.
pub struct RouterTerms {
    /// Tokens per expert, for each MoE layer (empty for dense students), for the bias update.
    pub expert_load: Vec<ExpertLoad>,
    /// The MoE layers' weighted balance loss, which the step adds to the mode's loss.
    pub balance_loss: Option<Tensor<1>>,
    /// Each MoE layer's routing (its scores for router distillation).
    pub routing: Vec<Route>,
}

impl RouterTerms {
    /// Splits a forward into the LM head's input at the predicting positions `[B·(T−1), d]`
    /// and its routers' terms.
    pub fn split(out: Trunk) -> (Tensor<2>, Self) {
        let hidden = out.predicting();
        let terms = Self {
            expert_load: out.expert_load,
            balance_loss: out.balance_loss,
            routing: out.routing,
        };
        (hidden, terms)
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
