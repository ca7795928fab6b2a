//! Plain next-token training: the plan's sources streamed (weighted, shuffled in blocks, resumed
//! from their cursor) and packed into rows, cross-entropy on the trained positions.

use crate::error::Result;
use crate::recipe::RunPlan;
use crate::run_dir::DataCursor;
use crate::train::batch::packed_tensors;
use crate::train::held_out::HeldOut;
use crate::train::objective::{MicroBatch, RouterTerms, TrainingObjective};
use k3mini_data::signals::SignalCursor;
use k3mini_data::stream::{DocStream, Split, StreamCursor};
use k3mini_data::{PackCursor, Packer, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_student::loss::next_token_cross_entropy;

pub struct Lm {
    packer: Packer<DocStream>,
    rows: usize,
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
            held: HeldOut::documents(plan, tokenizer, rows, plan.train.eval_batches)?,
        })
    }
}

impl TrainingObjective for Lm {
    fn micro_batch(&mut self, model: &K3Mini, _seed: u64) -> Result<MicroBatch> {
        let batch = self.packer.next_batch(self.rows)?;
        let (tokens, starts, mask) = packed_tensors(&batch, &model.lm_head.weight.device());
        let (logits, routers) = RouterTerms::split(model.forward_packed(tokens.clone(), starts));
        Ok(MicroBatch {
            loss: next_token_cross_entropy(logits, tokens, Some(mask)),
            routers,
            on_policy: None,
        })
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Stream(self.packer.cursor()), None)
    }
}
