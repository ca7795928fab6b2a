//! The held-out evaluator, one for training and `k3mini eval`: the same batches every evaluation,
//! fixed when the run opens, so a checkpoint evaluated later reproduces the logged numbers.
//!
//! - plain runs: the first packed rows of the held-out stream, cross-entropy of the next token;
//! - distillation: held-out teacher-scored segments (from shards, or scored by the teacher for
//!   online runs), cross-entropy plus the student's top-1 agreement with the teacher and the
//!   forward `KL(p̂ ‖ q̂)` at τ = 1 over the teacher's top-k and tail.

use crate::error::Result;
use crate::recipe::RunPlan;
use crate::train::batch::{flatten, packed_tensors, position_logits};
use burn::tensor::Device;
use k3mini_data::signals::SignalBatch;
use k3mini_data::stream::{Split, StreamCursor};
use k3mini_data::{PackedBatch, Packer, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_student::distill::{Objective, masked_mean, objective_per_position};
use k3mini_student::loss::next_token_cross_entropy;

/// Held-out measurements (token-weighted means); `top1` and `kl` are NaN without a teacher.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeldOutEval {
    /// Mean cross-entropy of the actual next tokens (nats).
    pub loss: f64,
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
        let stream = crate::corpus::document_stream(
            data,
            tokenizer,
            plan.seed,
            Split::HeldOut,
            StreamCursor::default(),
        )?;
        let mut packer = Packer::new(stream, data.seq_len, data.packing, 0, 0)?;
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
        if self.is_empty() {
            return None;
        }
        let device = model.lm_head.weight.device().without_autodiff();
        let inference = burn::module::Module::valid(model);
        Some(match self {
            Self::Documents { batches, .. } => HeldOutEval {
                loss: documents_loss(&inference, batches, &device),
                top1: f64::NAN,
                kl: f64::NAN,
            },
            Self::Signals {
                batches,
                temperature,
            } => signals_eval(&inference, batches, *temperature, &device),
        })
    }

    /// The held-out tokens and the UTF-8 bytes they spell (for bits per byte): the evaluated
    /// rows' or segments'.
    pub fn tokens_and_bytes(&self, tokenizer: &Tokenizer) -> Result<(usize, usize)> {
        let ids: Vec<u32> = match self {
            Self::Documents { batches } => batches
                .iter()
                .flat_map(|b| b.tokens.iter().map(|&t| t as u32))
                .collect(),
            Self::Signals { batches, .. } => batches
                .iter()
                .flat_map(|b| b.tokens.iter().map(|&t| t as u32))
                .collect(),
        };
        Ok((ids.len(), tokenizer.decode(&ids)?.len()))
    }
}

fn documents_loss(model: &K3Mini, batches: &[PackedBatch], device: &Device) -> f64 {
    let total: f64 = batches
        .iter()
        .map(|b| {
            let (tokens, starts, mask) = packed_tensors(b, device);
            let logits = model.forward_packed(tokens.clone(), starts).logits;
            next_token_cross_entropy(logits, tokens, Some(mask)).into_scalar::<f32>() as f64
        })
        .sum();
    total / batches.len() as f64
}

fn signals_eval(
    model: &K3Mini,
    batches: &[SignalBatch],
    temperature: f64,
    device: &Device,
) -> HeldOutEval {
    let (mut ce, mut kl, mut agree, mut count) = (0.0, 0.0, 0.0, 0.0);
    for b in batches {
        let flat = flatten(b, device);
        let logits = position_logits(model, flat.tokens.clone()).0;
        let weight = flat.mask.clone().sum().into_scalar::<f32>() as f64;
        let per = |o| {
            let v = objective_per_position(
                o,
                logits.clone(),
                flat.targets.clone(),
                &flat.teacher,
                temperature,
                1.0,
            );
            masked_mean(v, flat.mask.clone()).into_scalar::<f32>() as f64 * weight
        };
        ce += per(Objective::CrossEntropy);
        kl += per(Objective::ForwardKl);
        let n = flat.mask.dims()[0];
        let student_top = logits.argmax(1).reshape([n]);
        let teacher_top = flat.teacher.ids.clone().narrow(1, 0, 1).reshape([n]);
        agree += (student_top.equal(teacher_top).float() * flat.mask.clone())
            .sum()
            .into_scalar::<f32>() as f64;
        count += weight;
    }
    let count = f64::max(count, 1.0);
    HeldOutEval {
        loss: ce / count,
        top1: agree / count,
        kl: kl / count,
    }
}
