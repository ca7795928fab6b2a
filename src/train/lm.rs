//! Plain next-token training: the plan's documents packed into rows (a seeded per-epoch order,
//! resumed from its cursor), cross-entropy on the trained positions.

use crate::bail;
use crate::error::Result;
use crate::recipe::RunPlan;
use crate::run_dir::DataCursor;
use crate::train::batch::packed_tensors;
use crate::train::held_out::HeldOut;
use crate::train::objective::{MicroBatch, TrainingObjective};
use k3mini_data::signals::SignalCursor;
use k3mini_data::{Cursor, Packer, Tokenizer};
use k3mini_student::K3Mini;
use k3mini_student::loss::next_token_cross_entropy;

pub struct Lm {
    packer: Packer,
    rows: usize,
    held: HeldOut,
}

impl Lm {
    pub fn open(plan: &RunPlan, tokenizer: &Tokenizer, cursor: Cursor) -> Result<Self> {
        let data = &plan.data;
        let docs = crate::corpus::tokenized_documents(data, tokenizer)?;
        let (train, held) =
            crate::corpus::split_documents(&docs, data.held_out_fraction, plan.seed);
        if train.is_empty() {
            bail!(
                "{}: no training documents left after the held-out split",
                plan.recipe_name()
            );
        }
        let rows = plan.train.micro_batch;
        Ok(Self {
            packer: Packer::new(train, data.seq_len, plan.seed, data.packing, 0)
                .with_cursor(cursor),
            rows,
            held: HeldOut::documents(held, data, plan.seed, rows, plan.train.eval_batches),
        })
    }
}

impl TrainingObjective for Lm {
    fn micro_batch(&mut self, model: &K3Mini, _seed: u64) -> Result<MicroBatch> {
        let batch = self.packer.next_batch(self.rows);
        let (tokens, starts, mask) = packed_tensors(&batch, &model.lm_head.weight.device());
        let out = model.forward_packed(tokens.clone(), starts);
        Ok(MicroBatch {
            loss: next_token_cross_entropy(out.logits, tokens, Some(mask)),
            expert_load: out.expert_load,
            on_policy: None,
        })
    }

    fn held_out(&self) -> &HeldOut {
        &self.held
    }

    fn cursor(&self) -> (DataCursor, Option<SignalCursor>) {
        (DataCursor::Packed(self.packer.cursor()), None)
    }
}
