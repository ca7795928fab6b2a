//! On-policy distillation: the student samples continuations of the recipe's prompts, the teacher
//! scores the student's own tokens, and the student follows the per-token reverse-KL advantage
//! `A_t = log p(x_t) − log q(x_t)` (`k3mini_student::distill::on_policy_per_position`). A recipe mixes
//! these micro-batches with offline ones (`[distill.on_policy] mix`).
//!
//! Prompts are taken in a seeded per-epoch order from a cursor stored in checkpoints; sampling is
//! seeded per micro-batch and row, so a resumed run samples what an uninterrupted one would.

use crate::bail;
use crate::error::Result;
use crate::recipe::{DistillPlan, OnPolicyPlan, RunPlan};
use crate::run_dir::DataCursor;
use crate::train::batch::position_hidden;
use crate::train::distill::Shards;
use crate::train::held_out::HeldOut;
use crate::train::objective::{Job, MicroBatch, OnPolicyGap, StepModel, TrainingObjective};
use burn::tensor::{Int, Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_data::rng::uniform;
use k3mini_data::signals::{SignalCursor, take_in_epoch_order};
use k3mini_student::K3Mini;
use k3mini_student::distill::{masked_count, masked_share, on_policy_per_position};
use k3mini_student::generate::{argmax, decode};
use k3mini_student::head::{HeadChunks, head_loss};
use k3mini_student::loss::cross_entropy;
use k3mini_teacher::generate::PromptIds;
use k3mini_teacher::score::score_many;
use k3mini_teacher::{Teacher, sample};
use std::sync::Arc;

/// How the student samples.
#[derive(Clone, Debug)]
pub struct SamplingSpec {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Sampling stops after any of these ids (the end-of-turn marker).
    pub stop: Vec<u32>,
    pub seq_len: usize,
}

/// Up to `max_tokens` ids the student draws after `prompt` (incremental decoding, no gradient).
pub fn student_sample(model: &K3Mini, prompt: &[u32], spec: &SamplingSpec, seed: u64) -> Vec<u32> {
    let budget = spec
        .max_tokens
        .min(spec.seq_len.saturating_sub(prompt.len()));
    let mut rng = seed;
    decode(model, prompt, budget, &spec.stop, |row| {
        if spec.temperature <= 0.0 {
            argmax(row)
        } else {
            sample(row, spec.temperature, 1.0, &mut rng)
        }
    })
}

/// The on-policy half of a run.
pub struct Sampler {
    pub teacher: Arc<dyn Teacher + Send + Sync>,
    pub prompts: Vec<PromptIds>,
    pub spec: SamplingSpec,
    /// Fraction of micro-batches that are on-policy.
    pub mix: f64,
    pub concurrency: usize,
    pub seed: u64,
    pub cursor: SignalCursor,
    pub chunks: HeadChunks,
}

impl Sampler {
    /// Whether micro-batch `seed` is on-policy (a seeded draw against `mix`).
    pub fn takes(&self, seed: u64) -> bool {
        let mut s = seed ^ 0x0F0F_1CE5;
        uniform(&mut s) < self.mix
    }

    /// Samples `rows` continuations from `model`, has the teacher score them, and returns the
    /// job that computes their loss.
    pub fn job(&mut self, model: &K3Mini, rows: usize, seed: u64) -> Result<Job> {
        let sampler = burn::module::Module::valid(model);
        let picked = take_in_epoch_order(self.prompts.len(), self.seed, &mut self.cursor, rows);
        let seqs: Vec<(usize, Vec<u32>)> = picked
            .iter()
            .enumerate()
            .map(|(r, &i)| {
                let prompt = &self.prompts[i].ids;
                let row_seed = seed ^ (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let completion = student_sample(&sampler, prompt, &self.spec, row_seed);
                (prompt.len(), [prompt.clone(), completion].concat())
            })
            .collect();
        let inputs: Vec<&[u32]> = seqs.iter().map(|(_, s)| &s[..]).collect();
        let scored = score_many(
            self.teacher.as_ref(),
            &inputs,
            1,
            self.concurrency,
            &mut |_| {},
        )?;
        let t = self.spec.seq_len;
        let mut tokens = vec![0i64; rows * t];
        let mut mask = vec![0f32; rows * t];
        let mut teacher_lp = vec![0f32; rows * t];
        let mut sampled_tokens = 0;
        for (r, ((p, ids), s)) in seqs.iter().zip(&scored).enumerate() {
            for (i, &id) in ids.iter().enumerate() {
                tokens[r * t + i] = id as i64;
            }
            // Position `pos` predicts `ids[pos + 1]`: the completion starts at `p`.
            for pos in p - 1..ids.len() - 1 {
                mask[r * t + pos] = 1.0;
                teacher_lp[r * t + pos] = s.target_logprobs[pos];
            }
            sampled_tokens += ids.len() - p;
        }
        let chunks = self.chunks;
        Ok(Box::new(move |model: &K3Mini| {
            let device = model.lm_head.weight.device();
            let n = rows * (t - 1);
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(tokens, [rows, t]), &device);
            let flat = |v: Vec<f32>| {
                Tensor::<2>::from_data(TensorData::new(v, [rows, t]), &device)
                    .narrow(1, 0, t - 1)
                    .reshape([n])
            };
            let (mask, teacher_lp) = (flat(mask), flat(teacher_lp));
            let (hidden, routers) = position_hidden(model, tokens.clone(), None); // [n, d]
            let sampled = tokens.narrow(1, 1, t - 1).reshape([n]);
            let count = masked_count(mask.clone());
            let mut gap = Tensor::<1>::zeros([1], &device).inner();
            let loss = head_loss(model, hidden, chunks, |logits, rows| {
                let at = |x: Tensor<1>| x.narrow(0, rows.start, rows.len());
                let (mask, teacher_lp) = (at(mask.clone()), at(teacher_lp.clone()));
                let sampled = sampled.clone().narrow(0, rows.start, rows.len());
                // The statistics, from the same logits (no gradient needed).
                let log_q = -cross_entropy(logits.clone().detach(), sampled.clone());
                gap = gap.clone() + ((log_q - teacher_lp.clone()) * mask.clone()).sum().inner();
                let per = on_policy_per_position(logits, sampled, teacher_lp);
                masked_share(per, mask, count.clone())
            });
            MicroBatch {
                loss,
                routers,
                on_policy: Some(OnPolicyGap {
                    tokens: sampled_tokens,
                    gap: Tensor::from_inner(gap),
                }),
            }
        }))
    }
}

/// On-policy distillation: a `mix` share of micro-batches samples the student, the rest train
/// offline on the shards (which also give the held-out set).
pub struct OnPolicy {
    offline: Shards,
    sampler: Sampler,
    rows: usize,
}

impl OnPolicy {
    pub fn open(
        plan: &RunPlan,
        distill: &DistillPlan,
        on_policy: &OnPolicyPlan,
        tokenizer: &Tokenizer,
        cursor: SignalCursor,
        prompts: SignalCursor,
    ) -> Result<Self> {
        let OnPolicyPlan {
            mix,
            max_tokens,
            sampling_temperature,
            prompts: prompt_plan,
        } = on_policy;
        let offline = Shards::open(plan, distill, tokenizer, cursor)?;
        let teacher = crate::teachers::plan_teacher(distill, &plan.devices, tokenizer, None)?;
        let seq_len = plan.data.seq_len;
        let sampled: Vec<_> = crate::teachers::plan_prompts(prompt_plan, tokenizer, None)?
            .into_iter()
            .filter(|p| p.ids.len() >= 2 && p.ids.len() < seq_len)
            .collect();
        if sampled.is_empty() {
            bail!(
                "{}: no prompt is shorter than data.seq_len {seq_len}: nothing to sample",
                plan.recipe_name()
            );
        }
        let sampler = Sampler {
            teacher,
            prompts: sampled,
            spec: SamplingSpec {
                max_tokens: *max_tokens,
                temperature: *sampling_temperature,
                stop: tokenizer.encode_with_specials(prompt_plan.template.end_of_turn())?,
                seq_len,
            },
            mix: *mix,
            concurrency: distill.teacher.concurrency,
            seed: plan.seed,
            cursor: prompts,
            chunks: plan.head_chunks(),
        };
        Ok(Self {
            offline,
            sampler,
            rows: plan.train.micro_batch,
        })
    }
}

impl TrainingObjective for OnPolicy {
    fn next(&mut self, student: &StepModel, seed: u64) -> Result<Job> {
        if self.sampler.takes(seed) {
            self.sampler.job(student.get(), self.rows, seed)
        } else {
            self.offline.next(student, seed)
        }
    }

    fn held_out(&self) -> &HeldOut {
        self.offline.held_out()
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (self.offline.cursor().0, Some(self.sampler.cursor))
    }
}
