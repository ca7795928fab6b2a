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
use crate::train::batch::RouterTerms;
use crate::train::held_out::HeldOut;
use crate::train::qat::FakeQuantizer;
use burn::tensor::Tensor;
use k3mini_data::signals::SignalCursor;
use k3mini_student::K3Mini;
use std::cell::OnceCell;

/// What one micro-batch gave. Its tensors stay on the replica's device, unread: the step reads
/// its figures once, after the last micro-batch is reduced (`crate::train::parallel`).
pub struct MicroBatch {
    /// The mean loss over the micro-batch's trained positions.
    pub loss: Tensor<1>,
    pub routers: RouterTerms,
    /// On-policy micro-batches: what the student's samples measured.
    pub on_policy: Option<OnPolicyGap>,
}

/// A loaded micro-batch: the work that computes its loss on a replica's model, on whichever
/// thread and device that replica runs. It holds the micro-batch's data on the host and makes
/// its tensors on the replica's device.
pub type Job = Box<dyn FnOnce(&K3Mini) -> MicroBatch + Send>;

/// What one on-policy micro-batch measured, before it is read: the sampled tokens (counted on
/// the host) and `Σ (log q(x_t) − log p(x_t))` over them, a `[1]` tensor on the replica (over
/// the tokens, a one-sample estimate of `KL(q ‖ p)`).
pub struct OnPolicyGap {
    pub tokens: usize,
    pub gap: Tensor<1>,
}

/// One training mode.
pub trait TrainingObjective {
    /// Loads the next micro-batch, in order, on the step's thread: reads its data and, on-policy,
    /// samples `student` and has the teacher score the samples. `seed` (a function of the step and
    /// micro-batch) seeds what it samples. The loss is the returned job's, run on a replica.
    fn next(&mut self, student: &StepModel, seed: u64) -> Result<Job>;
    /// Moves past the next micro-batch, another rank's: its stream advances as [`Self::next`]'s
    /// would. Loads it and drops it unless the mode can skip it for less (text must be tokenized
    /// to know where a row ends; teacher shards' rows are skipped unassembled).
    fn skip(&mut self, student: &StepModel, seed: u64) -> Result<()> {
        self.next(student, seed).map(drop)
    }
    /// The held-out batches this mode is measured on.
    fn held_out(&self) -> &HeldOut;
    /// Where the streams are, for the checkpoint: the data, and on-policy runs' prompts.
    fn cursor(&self) -> (DataCursor, Option<SignalCursor>);
}

/// The weights this step's micro-batches run with, for what a micro-batch's data depends on (the
/// on-policy samples): the model, fake-quantised when QAT is on, made on first use.
pub struct StepModel<'a> {
    model: &'a K3Mini,
    qat: Option<&'a FakeQuantizer>,
    made: OnceCell<K3Mini>,
}

impl<'a> StepModel<'a> {
    pub fn new(model: &'a K3Mini, qat: Option<&'a FakeQuantizer>) -> Self {
        Self {
            model,
            qat,
            made: OnceCell::new(),
        }
    }

    pub fn get(&self) -> &K3Mini {
        match self.qat {
            None => self.model,
            Some(q) => self.made.get_or_init(|| q.apply(self.model)),
        }
    }
}
