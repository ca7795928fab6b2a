//! The ways a training step gets its loss, behind one trait: each mode is a feed of micro-batches,
//! the loss it computes on them, the held-out set it is measured on and a cursor that resumes its
//! stream exactly.
//!
//! | mode | feed | loss |
//! |---|---|---|
//! | plain (no `[distill]`) | packed corpus documents | next-token cross-entropy |
//! | `offline` | `teacher score` shards | `Σ weight · objective` on the stored top-k |
//! | `sequence` | `teacher generate` trajectories | the same, on completion tokens |
//! | `online` | corpus segments, scored by the teacher in the loop | the same |
//! | `on_policy` | the student's own samples, scored by the teacher (a `mix` share; the rest offline) | the reverse-KL advantage |

use crate::error::Result;
use crate::run_dir::DataCursor;
use crate::train::held_out::HeldOut;
use burn::tensor::Tensor;
use k3mini_data::signals::SignalCursor;
use k3mini_student::moe::{ExpertLoad, Route};
use k3mini_student::{K3Mini, Trunk};

/// What one micro-batch gave.
pub struct MicroBatch {
    /// The mean loss over the micro-batch's trained positions.
    pub loss: Tensor<1>,
    pub routers: RouterTerms,
    /// On-policy micro-batches: what the student's samples measured.
    pub on_policy: Option<OnPolicyStats>,
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

/// What one on-policy micro-batch measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnPolicyStats {
    /// Tokens the student sampled.
    pub tokens: usize,
    /// Mean `log q(x_t) − log p(x_t)` over them: a one-sample estimate of `KL(q ‖ p)` per token.
    pub reverse_kl: f64,
}

/// One training mode.
pub trait TrainingObjective {
    /// The next micro-batch's loss. `seed` (a function of the step and micro-batch) seeds what it
    /// samples.
    fn micro_batch(&mut self, model: &K3Mini, seed: u64) -> Result<MicroBatch>;
    /// The held-out batches this mode is measured on.
    fn held_out(&self) -> &HeldOut;
    /// Where the streams are, for the checkpoint: the data, and on-policy runs' prompts.
    fn cursor(&self) -> (DataCursor, Option<SignalCursor>);
}
