//! Plain next-token training: the plan's sources streamed (weighted, shuffled in blocks, resumed
//! from their cursor) and packed into rows, cross-entropy on the trained positions.

use crate::error::Result;
use crate::recipe::RunPlan;
use crate::run_dir::DataCursor;
use crate::train::batch::{packed_tensors, position_hidden};
use crate::train::held_out::HeldOut;
use crate::train::objective::{Job, MicroBatch, StepModel, TrainingObjective};
use k3mini_data::signals::SignalCursor;
use k3mini_data::stream::{DocStream, Split, StreamCursor};
use k3mini_data::{PackCursor, Packer, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_student::distill::{masked_count, masked_share};
use k3mini_student::head::{HeadChunks, head_loss};
use k3mini_student::loss::cross_entropy;

pub struct Lm {
    packer: Packer<DocStream>,
    rows: usize,
    chunks: HeadChunks,
    held: HeldOut,
}

impl Lm {
    pub fn open(
        plan: &RunPlan,
        tokenizer: &Tokenizer,
        cursor: PackCursor<StreamCursor>,
    ) -> Result<Self> {
        let data = &plan.data;
        let rows = plan.train.micro_batch;
        Ok(Self {
            packer: crate::corpus::row_packer(data, tokenizer, plan.seed, Split::Train, cursor)?,
            rows,
            chunks: plan.head_chunks(),
            held: HeldOut::documents(plan, tokenizer, rows, plan.train.eval_batches)?,
        })
    }
}

impl TrainingObjective for Lm {
    fn next(&mut self, _student: &StepModel, _seed: u64) -> Result<Job> {
        let batch = self.packer.next_batch(self.rows)?;
        let chunks = self.chunks;
        Ok(Box::new(move |model: &K3Mini| {
            let (tokens, starts, mask) = packed_tensors(&batch, &model.lm_head.weight.device());
            let (hidden, routers) = position_hidden(model, tokens.clone(), Some(&starts));
            // Position t predicts token t + 1: [rows, T] → [rows·(T−1)].
            let (n, t) = (hidden.dims()[0], batch.seq_len);
            let targets = tokens.narrow(1, 1, t - 1).reshape([n]);
            let mask = mask.narrow(1, 0, t - 1).reshape([n]);
            let count = masked_count(mask.clone());
            let loss = head_loss(model, hidden, chunks, |logits, rows| {
                let targets = targets.clone().narrow(0, rows.start, rows.len());
                let mask = mask.clone().narrow(0, rows.start, rows.len());
                masked_share(cross_entropy(logits, targets), mask, count.clone())
            });
            MicroBatch {
                loss,
                routers,
                on_policy: None,
            }
        }))
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Stream(self.packer.cursor()), None)
    }
}
