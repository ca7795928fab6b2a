//! Which objective a plan trains with, and the held-out set it is measured on: the one place the
//! modes are told apart.

use crate::bail;
use crate::error::Result;
use crate::recipe::{ModePlan, RunPlan};
use crate::run_dir::{DataCursor, TrainState};
use crate::train::distill::{Shards, signal_data};
use crate::train::held_out::HeldOut;
use crate::train::lm::Lm;
use crate::train::objective::TrainingObjective;
use crate::train::on_policy::OnPolicy;
use crate::train::online::{self, Online};
use k3mini_data::signals::SignalCursor;
use k3mini_data::{PackCursor, Tokenizer};

/// Where a fresh run of `plan` starts its data: plain and online runs stream the corpus, the
/// other modes walk shards.
pub fn fresh_cursor(plan: &RunPlan) -> DataCursor {
    match plan.distill.as_ref().map(|d| &d.mode) {
        None | Some(ModePlan::Online) => DataCursor::Stream(PackCursor::default()),
        Some(
            ModePlan::Offline
            | ModePlan::Sequence { .. }
            | ModePlan::Traffic { .. }
            | ModePlan::OnPolicy(_),
        ) => DataCursor::Signals(SignalCursor::default()),
    }
}

/// The objective of `plan`, its streams positioned at `state`'s cursors.
pub fn open(
    plan: &RunPlan,
    tokenizer: &Tokenizer,
    state: &TrainState,
) -> Result<Box<dyn TrainingObjective>> {
    let Some(distill) = &plan.distill else {
        let cursor = match &state.cursor {
            DataCursor::Stream(cursor) => cursor.clone(),
            DataCursor::Legacy { .. } => bail!(
                "the checkpoint's data position is an in-memory document list's (a k3mini from \
                 before corpora streamed); the streaming loader cannot continue it: start a new run \
                 (its weights can seed one through export)"
            ),
            DataCursor::Signals(_) => bail!(
                "the checkpoint was written by a distillation run, and this plan trains plainly"
            ),
        };
        return Ok(Box::new(Lm::open(plan, tokenizer, cursor)?));
    };
    // Online runs stream the corpus; the other modes walk shards.
    Ok(match (&distill.mode, &state.cursor) {
        (ModePlan::Online, DataCursor::Stream(cursor)) => {
            Box::new(Online::open(plan, distill, tokenizer, cursor.clone())?)
        }
        (ModePlan::Online, _) => bail!(
            "the checkpoint's data position is not an online run's corpus stream (it was written \
             by another mode, or by a k3mini from before online runs streamed): start a new run"
        ),
        (
            ModePlan::Offline | ModePlan::Sequence { .. } | ModePlan::Traffic { .. },
            DataCursor::Signals(cursor),
        ) => Box::new(Shards::open(plan, distill, tokenizer, *cursor)?),
        (ModePlan::OnPolicy(on_policy), DataCursor::Signals(cursor)) => Box::new(OnPolicy::open(
            plan,
            distill,
            on_policy,
            tokenizer,
            *cursor,
            state.prompts.unwrap_or_default(),
        )?),
        _ => bail!(
            "the checkpoint's data position is a corpus stream's (a plain or online run's), and \
             this plan reads shards"
        ),
    })
}

/// The held-out set of `plan`, as its training run evaluates it, with `n` micro-batches.
pub fn held_out(plan: &RunPlan, tokenizer: &Tokenizer, n: usize) -> Result<HeldOut> {
    let rows = plan.train.micro_batch;
    let Some(distill) = &plan.distill else {
        return HeldOut::documents(plan, tokenizer, rows, n);
    };
    if distill.mode == ModePlan::Online {
        let teacher = crate::teachers::plan_teacher(distill, &plan.devices, tokenizer, None)?;
        return online::held_out(plan, distill, teacher.as_ref(), tokenizer, n);
    }
    let signals = signal_data(plan, distill, tokenizer)?;
    Ok(HeldOut::Signals {
        batches: signals.held_out_batches(n, rows)?,
        temperature: signals.temperature,
    })
}
