//! The held-out evaluator, one for training and `k3mini eval`: the same batches every evaluation,
//! fixed when the run opens, so a checkpoint evaluated later reproduces the logged numbers.
//!
//! - plain runs: the first packed rows of the held-out stream, cross-entropy of the next token;
//! - distillation: held-out teacher-scored segments (from shards, or scored by the teacher for
//!   online runs), cross-entropy plus the student's top-1 agreement with the teacher and the
//!   forward `KL(p̂ ‖ q̂)` at τ = 1 over the teacher's top-k and tail (a cross-tokenizer run's:
//!   at chunk starts, over the top-k projected onto the student's vocabulary).

use crate::error::Result;
use crate::recipe::RunPlan;
use crate::train::batch::{flatten, packed_tensors, position_hidden};
use burn::tensor::Device;
use k3mini_data::signals::SignalBatch;
use k3mini_data::stream::Split;
use k3mini_data::{PackCursor, PackedBatch, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_student::distill::{Objective, masked_mean, objective_per_position};
use k3mini_student::loss::next_token_cross_entropy;

/// Held-out measurements: means over every scored position of every batch (a batch weighs by its
/// scored positions, not as one); `top1` and `kl` are NaN without a teacher.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeldOutEval {
    /// Mean cross-entropy of the actual next tokens (nats).
    pub loss: f64,
    /// The scored positions the means are over.
    pub positions: usize,
    /// Fraction of positions where the student's argmax is the teacher's top-1.
    pub top1: f64,
    /// Mean `KL(p̂ ‖ q̂)` at τ = 1.
    pub kl: f64,
}

/// A run's held-out batches.
pub enum HeldOut {
    /// The first micro-batches of the plan's held-out documents, streamed and packed.
    Documents { batches: Vec<PackedBatch> },
    /// Held-out teacher-scored segments, whose logprobs are at `temperature`.
    Signals {
        batches: Vec<SignalBatch>,
        temperature: f64,
    },
}

impl HeldOut {
    /// The first `n` micro-batches of `rows` packed held-out documents (none when the plan holds
    /// nothing out).
    pub fn documents(plan: &RunPlan, tokenizer: &Tokenizer, rows: usize, n: usize) -> Result<Self> {
        let data = &plan.data;
        if !data.holds_out() {
            return Ok(Self::Documents {
                batches: Vec::new(),
            });
        }
        let mut packer = crate::corpus::row_packer(
            data,
            tokenizer,
            plan.seed,
            Split::HeldOut,
            PackCursor::default(),
        )?;
        let batches = (0..n)
            .map(|_| packer.next_batch(rows))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self::Documents { batches })
    }

    pub fn is_empty(&self) -> bool {
        match self {
            Self::Documents { batches, .. } => batches.is_empty(),
            Self::Signals { batches, .. } => batches.is_empty(),
        }
    }

    /// The measurements of `model`, `None` when nothing is held out.
    pub fn evaluate(&self, model: &K3Mini) -> Option<HeldOutEval> {
        let one = |_: &mut [f64]| Ok(());
        self.evaluate_shared(model, 0, 1, one)
            .expect("one process sums nothing")
    }

    /// [`HeldOut::evaluate`] with the batches shared among the `world` ranks of a run across
    /// processes: this one scores the batches `≡ rank (mod world)`, `sum` adds every rank's
    /// per-batch sums (each batch's are one rank's, the rest zero: exact), and the means fold in
    /// batch order, as one process folds them.
    pub fn evaluate_shared(
        &self,
        model: &K3Mini,
        rank: usize,
        world: usize,
        sum: impl FnOnce(&mut [f64]) -> Result<()>,
    ) -> Result<Option<HeldOutEval>> {
        if self.is_empty() {
            return Ok(None);
        }
        let device = model.lm_head.weight.device().without_autodiff();
        let inference = burn::module::Module::valid(model);
        let mine = |i: usize| i % world == rank;
        let mut sums: Vec<f64> = match self {
            Self::Documents { batches, .. } => batches
                .iter()
                .enumerate()
                .flat_map(|(i, b)| match mine(i) {
                    true => documents_sums(&inference, b, &device),
                    false => [0.0; SUMS],
                })
                .collect(),
            Self::Signals {
                batches,
                temperature,
            } => batches
                .iter()
                .enumerate()
                .flat_map(|(i, b)| match mine(i) {
                    true => signals_sums(&inference, b, *temperature, &device),
                    false => [0.0; SUMS],
                })
                .collect(),
        };
        sum(&mut sums)?;
        let teacher = matches!(self, Self::Signals { .. });
        Ok(Some(fold(&sums, teacher)))
    }

    /// The UTF-8 bytes of the text the scored positions predict (for bits per byte): each run of
    /// consecutive scored positions in a row predicts a stretch of one document, decoded without
    /// padding or special tokens.
    pub fn predicted_bytes(&self, tokenizer: &Tokenizer) -> Result<usize> {
        // Each batch as (tokens, loss mask, row length): both kinds lay rows out alike.
        let batches: Vec<(&[i64], &[f32], usize)> = match self {
            Self::Documents { batches } => batches
                .iter()
                .map(|b| (&b.tokens[..], &b.loss_mask[..], b.seq_len))
                .collect(),
            Self::Signals { batches, .. } => batches
                .iter()
                .map(|b| (&b.tokens[..], &b.loss_mask[..], b.seq_len))
                .collect(),
        };
        let rows = batches
            .into_iter()
            .flat_map(|(tokens, mask, t)| tokens.chunks(t).zip(mask.chunks(t)));
        let mut bytes = 0;
        for (tokens, mask) in rows {
            for run in scored_targets(tokens, mask) {
                bytes += tokenizer.text_bytes(&run)?;
            }
        }
        Ok(bytes)
    }
}

/// The target ids of a row's runs of consecutive scored positions: position `t` (mask 1) predicts
/// token `t + 1`.
fn scored_targets(tokens: &[i64], mask: &[f32]) -> Vec<Vec<u32>> {
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut open = false;
    for t in 0..tokens.len().saturating_sub(1) {
        if mask[t] > 0.0 {
            if !open {
                runs.push(Vec::new());
            }
            runs.last_mut().expect("opened").push(tokens[t + 1] as u32);
        }
        open = mask[t] > 0.0;
    }
    runs
}

/// What one held-out batch adds: `[Σ CE, Σ KL, positions where the student's top-1 is the
/// teacher's, scored positions, positions with the teacher's top-k]`, CE weighted by the
/// batch's scored positions, KL and agreement by its positions with the teacher's top-k (the
/// same positions unless the batch is a cross-tokenizer one's: its chunk starts).
const SUMS: usize = 5;

/// Token-weighted cross-entropy over the scored positions of a batch of packed rows.
fn documents_sums(model: &K3Mini, b: &PackedBatch, device: &Device) -> [f64; SUMS] {
    let (tokens, starts, mask) = packed_tensors(b, device);
    let logits = model.forward_packed(tokens.clone(), starts).logits;
    let t = b.seq_len;
    let weight = mask.clone().narrow(1, 0, t - 1).sum().into_scalar::<f32>() as f64;
    let mean = next_token_cross_entropy(logits, tokens, Some(mask)).into_scalar::<f32>() as f64;
    [mean * weight, 0.0, 0.0, weight, 0.0]
}

fn signals_sums(model: &K3Mini, b: &SignalBatch, temperature: f64, device: &Device) -> [f64; SUMS] {
    let flat = flatten(b, device);
    let logits = model.head(position_hidden(model, flat.tokens.clone(), None).0);
    let weight = flat.mask.clone().sum().into_scalar::<f32>() as f64;
    let per = |o, mask: &burn::tensor::Tensor<1>, weight: f64| {
        let v = objective_per_position(
            o,
            logits.clone(),
            flat.targets.clone(),
            &flat.teacher,
            temperature,
            1.0,
        );
        masked_mean(v, mask.clone()).into_scalar::<f32>() as f64 * weight
    };
    let ce = per(Objective::CrossEntropy, &flat.mask, weight);
    // The teacher's top-k are where its mask says (a cross-tokenizer batch's chunk starts).
    let teacher_weight = flat.teacher_mask.clone().sum().into_scalar::<f32>() as f64;
    let kl = per(Objective::ForwardKl, &flat.teacher_mask, teacher_weight);
    let n = flat.mask.dims()[0];
    let student_top = logits.argmax(1).reshape([n]);
    let teacher_top = flat.teacher.ids.clone().narrow(1, 0, 1).reshape([n]);
    let agree = (student_top.equal(teacher_top).float() * flat.teacher_mask.clone())
        .sum()
        .into_scalar::<f32>() as f64;
    [ce, kl, agree, weight, teacher_weight]
}

/// The means over every scored position, the batches' sums added in batch order; `top1` and `kl`
/// are NaN without a `teacher`.
fn fold(sums: &[f64], teacher: bool) -> HeldOutEval {
    let mut total = [0.0; SUMS];
    for batch in sums.chunks_exact(SUMS) {
        for (t, x) in total.iter_mut().zip(batch) {
            *t += x;
        }
    }
    let [ce, kl, agree, count, teacher_count] = total;
    let per_position = |x: f64| match teacher {
        true => x / f64::max(teacher_count, 1.0),
        false => f64::NAN,
    };
    HeldOutEval {
        loss: ce / f64::max(count, 1.0),
        positions: count as usize,
        top1: per_position(agree),
        kl: per_position(kl),
    }
}
