//! Incremental decoding: prefill the prompt into an [`InferenceState`], then one token per step,
//! each chosen from the last position's logits by a caller's rule (greedy, sampling).

use crate::K3Mini;
use burn::tensor::{Int, Tensor, TensorData};

/// Up to `max_tokens` ids after `prompt`, each `pick(logits of the last position)`; stops after an
/// id in `stop`.
pub fn decode(
    model: &K3Mini,
    prompt: &[u32],
    max_tokens: usize,
    stop: &[u32],
    mut pick: impl FnMut(&[f32]) -> u32,
) -> Vec<u32> {
    let device = model.lm_head.weight.device();
    let mut state = model.empty_state(1, &device);
    let ids = |v: &[u32]| {
        let data = TensorData::new(v.iter().map(|&i| i as i64).collect(), [1, v.len()]);
        Tensor::<2, Int>::from_data(data, &device)
    };
    let last_row = |logits: Tensor<3>| -> Vec<f32> {
        let [_, t, v] = logits.dims();
        logits
            .narrow(1, t - 1, 1)
            .reshape([v])
            .into_data()
            .try_into_vec()
            .expect("f32 logits")
    };
    let mut out = Vec::new();
    if max_tokens == 0 || prompt.is_empty() {
        return out;
    }
    let mut row = last_row(model.forward_with(ids(prompt), Some(&mut state)).logits);
    loop {
        let id = pick(&row);
        out.push(id);
        if stop.contains(&id) || out.len() == max_tokens {
            return out;
        }
        row = last_row(model.forward_with(ids(&[id]), Some(&mut state)).logits);
    }
}

/// The highest logit's id (the lowest id on ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}
