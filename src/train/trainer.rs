//! The training loop: a plan → its objective's micro-batches → forward/backward with gradient
//! accumulation → global-norm clipping → AdamW at the scheduled rate → the MoE router-bias update,
//! with metrics, held-out evaluation, checkpoints and exact resume.
//!
//! Resumption is bit-identical: a checkpoint holds the weights (transformers-named safetensors,
//! the router biases among them), the parameter ids and AdamW moments, the step and the data
//! cursors, and the plan. Training draws no randomness after initialisation (no dropout; the data
//! order is a function of the seed and the cursor, sampling of the step).

use crate::bail;
use crate::device::DeviceKind;
use crate::error::{Context, Error, Result};
use crate::progress::Bar;
use crate::recipe::RunPlan;
use crate::run_dir::{self, SavedMoments, Start, StepMetrics, TrainState};
use crate::tensorboard::{self, EventLog};
use crate::train::modes;
use crate::train::objective::TrainingObjective;
use crate::train::optim::{AdamW, clip_to};
use crate::train::parallel::Parallel;
use crate::train::ranks::Ranks;
use crate::train::schedule::lr_at;
use crate::units::bytes;
use burn::tensor::Device;
use k3mini_data::stream::{Split, StreamCursor};
use k3mini_data::{DocFeed, Tokenizer};
use k3mini_dist::launch::Launched;
use k3mini_student::K3Mini;
use k3mini_student::moe::ExpertLoad;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Instant, SystemTime};

/// How to run a plan.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Overrides the plan's output directory.
    pub out_dir: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output directory.
    pub resume: bool,
    /// Resume even though the plan differs from the checkpoint's (the changes are printed).
    pub accept_changes: bool,
    /// Stop (with a checkpoint) after this many optimizer steps of this invocation.
    pub stop_after: Option<usize>,
}

/// What a finished (or stopped) run reports.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub first_step: usize,
    pub last_step: usize,
    pub first_loss: Option<f64>,
    pub last_loss: Option<f64>,
    pub eval_loss: Option<f64>,
    pub tokens: usize,
    pub wall_s: f64,
    pub interrupted: bool,
    /// Whether this process reported the run (one process, or the first of its ranks): the others
    /// print nothing.
    pub leads: bool,
}

/// Set by Ctrl-C or SIGTERM: the loop finishes its step, checkpoints and returns.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the Ctrl-C handler (once per process).
pub fn handle_ctrl_c() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    });
}

/// Runs (or resumes) a plan. Everything that can refuse the run does so before it writes.
/// A resumed traffic run keeps the shards its checkpoint's plan pinned: requests escalated into
/// the directory since belong to a later run, not to this one's epoch (whose order depends on
/// the shard count). signal_data checks that the pinned shards are still the manifest's first.
fn keep_traffic_pin(plan: &RunPlan, resume: bool) -> Result<RunPlan> {
    let mut plan = plan.clone();
    let Some(crate::recipe::ModePlan::Traffic { dir, .. }) = plan.distill.as_ref().map(|d| &d.mode)
    else {
        return Ok(plan);
    };
    if !resume {
        return Ok(plan);
    }
    let dir = dir.clone();
    let Some((_, latest)) = k3mini_checkpoints::latest(&plan.out_dir)? else {
        return Ok(plan);
    };
    let old = run_dir::open_checkpoint(&latest)?.plan;
    if let (Some(d), Some(o)) = (plan.distill.as_mut(), old.distill)
        && matches!(&o.mode, crate::recipe::ModePlan::Traffic { dir: at, .. } if *at == dir)
    {
        d.mode = o.mode;
    }
    Ok(plan)
}

/// Runs (or resumes) a plan: in one process, or, when a launcher started this process as one
/// rank of several, across all of them.
pub fn train(plan: &RunPlan, opts: &TrainOptions) -> Result<TrainSummary> {
    let plan = &with_out_dir(plan, opts);
    let ranks = match crate::train::ranks::launched(plan)? {
        Some(l) => Some(crate::train::ranks::join(plan, l)?),
        None => None,
    };
    train_in(plan, opts, ranks)
}

fn with_out_dir(plan: &RunPlan, opts: &TrainOptions) -> RunPlan {
    match &opts.out_dir {
        Some(dir) => plan.clone().with_out_dir(dir),
        None => plan.clone(),
    }
}

/// [`train`] as one of `ranks` (None: one process); their group's first rank decides what the
/// others follow.
pub fn train_in(
    plan: &RunPlan,
    opts: &TrainOptions,
    mut ranks: Option<Ranks>,
) -> Result<TrainSummary> {
    let plan = &with_out_dir(plan, opts);
    let resume = match ranks.as_mut() {
        Some(r) => r.resumes(plan, opts.resume)?,
        None => opts.resume,
    };
    let plan = &keep_traffic_pin(plan, resume)?;
    let Begun {
        tokenizer,
        mut model,
        saved,
        mut state,
        devices,
        ranks,
    } = begin(plan, opts, resume, ranks)?;
    let mut parallel = Parallel::new(&model, devices, ranks);
    let mut optim = AdamW::new(&plan.optim, &model);
    if let Some(saved) = saved {
        let read = saved.read(&model, |id| parallel.owner(id));
        optim = optim.with_moments(parallel.agree("read its optimizer state", read)?);
    }
    let objective = modes::open(plan, &tokenizer, &state);
    let mut objective = parallel.agree("open its data", objective)?;
    let log = RunLog::open(plan, &state, parallel.leads());
    let mut log = parallel.agree("open the run's log", log)?;
    let (total, first) = (plan.train.steps, state.step);
    let last = opts.stop_after.map_or(total, |n| (first + n).min(total));
    let mut interrupted = false;
    while state.step < last {
        let started = Instant::now();
        k3mini_student::bench::reset_heap_peak();
        let lr = lr_at(&plan.schedule, plan.optim.lr, state.step, total);
        let step;
        (model, step) = match train_step(
            plan,
            model,
            &mut parallel,
            &mut optim,
            objective.as_mut(),
            &state,
            lr,
        ) {
            Ok(stepped) => stepped,
            // The step's data would not load (a corrupt file mid-stream, a teacher gone): nothing
            // of it was applied, so the steps before it are checkpointed and kept.
            Err((model, e)) => {
                // Across ranks the others may be waiting in a collective this rank would now
                // mismatch: it leaves instead, and they stop on its absence.
                let alone = parallel.ranks().is_none();
                if let Some(model) = model.filter(|_| alone)
                    && state.step > first
                    && state.step % plan.train.checkpoint_every != 0
                {
                    run_dir::write_checkpoint(plan, &model, optim.moments(), &state)?;
                    return Err(e).with_context(|| {
                        format!(
                            "step {} (checkpoint at step {} written)",
                            state.step + 1,
                            state.step
                        )
                    });
                }
                return Err(e).with_context(|| format!("step {}", state.step + 1));
            }
        };
        state.consecutive_bad_steps = if step.skipped {
            state.consecutive_bad_steps + 1
        } else {
            0
        };
        state.step += 1;
        (state.cursor, state.prompts) = objective.cursor();
        // Throughput of the step itself, before any held-out evaluation.
        let tokens_per_s = plan.train.batch_tokens as f64 / started.elapsed().as_secs_f64();
        let eval = match state.step % plan.train.eval_every == 0 || state.step == total {
            true => parallel.evaluate(objective.held_out(), &model)?,
            false => None,
        };
        log.step(
            plan,
            &state,
            &step.metrics(plan, &state, lr, tokens_per_s, eval),
        )?;
        if state.consecutive_bad_steps >= plan.train.max_bad_steps {
            return Err(log.abandon_bad_steps(plan, &state));
        }
        // Every rank stops at the same step (a signal reaches each at its own moment, or one
        // rank alone).
        interrupted = parallel.any(INTERRUPTED.load(Ordering::SeqCst))?;
        if state.step % plan.train.checkpoint_every == 0 || state.step == last || interrupted {
            match parallel.ranks() {
                Some(ranks) => ranks.write_checkpoint(plan, &model, optim.moments(), &state)?,
                None => run_dir::write_checkpoint(plan, &model, optim.moments(), &state)?,
            };
        }
        if interrupted {
            log.progress.message(format!(
                "interrupted: checkpoint at step {} written",
                state.step
            ));
            log.progress.finish(false);
            break;
        }
    }
    Ok(log.finish(plan, first, state.step, parallel.leads(), interrupted))
}

/// What a run starts from.
struct Begun {
    tokenizer: Tokenizer,
    /// On the first device.
    model: K3Mini,
    /// The checkpoint's optimizer state, to read once the parameters have owners.
    saved: Option<SavedMoments>,
    state: TrainState,
    devices: Vec<Device>,
    /// The other processes of a run a launcher started.
    ranks: Option<Ranks>,
}

/// The checks that can refuse a run, then its tokenizer, its model and state (fresh, or from the
/// newest checkpoint when `resume`), and its devices (the model is on the first). Across `ranks`
/// the first decides and the others follow.
fn begin(
    plan: &RunPlan,
    opts: &TrainOptions,
    resume: bool,
    mut ranks: Option<Ranks>,
) -> Result<Begun> {
    // Opened first: a device this build or machine lacks is refused before anything else.
    // Checkpointing is the model's recompute regions where the backend runs them; elsewhere
    // (burn's CubeCL backends) burn's balanced gradient checkpointing stands in.
    let devices = match &ranks {
        Some(r) => r.device.clone(),
        None => plan.devices.clone(),
    };
    let devices: Vec<Device> = devices
        .open()?
        .into_iter()
        .map(|d| {
            let regions = k3mini_kernels::implemented_on(&d);
            let d = d.autodiff();
            if plan.train.activation_checkpointing && !regions {
                d.gradient_checkpointing()
            } else {
                d
            }
        })
        .collect();
    let device = devices[0].clone();
    let tokenizer = preflight(plan)?;
    let start = match ranks.as_mut() {
        None => run_dir::start(plan, resume, opts.accept_changes)?,
        Some(r) => r.start(plan, resume, opts.accept_changes, opts.stop_after)?,
    };
    device.seed(plan.seed);
    let (model, saved, state) = match start {
        Start::Fresh => {
            let model = match &plan.init {
                Some(init) => {
                    let ck = run_dir::open_checkpoint(init)?;
                    // Its embeddings are of its own vocabulary's ids.
                    crate::teachers::same_tokenizer(&ck.plan, &tokenizer).with_context(|| {
                        format!("{}: model.init {}", plan.recipe_name(), ck.dir.display())
                    })?;
                    ck.model(&device)?
                }
                None => K3Mini::new(&plan.model, &device)?,
            };
            let state = TrainState::fresh(plan, modes::fresh_cursor(plan));
            (model, None, state)
        }
        Start::Resume {
            checkpoint,
            changes,
        } => {
            if ranks.as_ref().is_none_or(|r| r.rank == 0) {
                for change in changes {
                    crate::progress::observer()
                        .note(&format!("resuming under a changed plan: {change}"));
                }
            }
            let (model, saved, state) = checkpoint.resume(&device)?;
            (model, Some(saved), state)
        }
    };
    if state.step > plan.train.steps {
        bail!(
            "{}: the checkpoint is at step {} but the plan has train.steps = {}: nothing to do",
            plan.out_dir.display(),
            state.step,
            plan.train.steps
        );
    }
    let mut model = model.with_checkpointing(plan.train.activation_checkpointing);
    if let Some(r) = ranks.as_mut() {
        // Every rank starts from the first's weights, with the same parameter ids (which key the
        // optimizer shards every rank writes).
        model = r.start_from_first(model, saved.is_none())?;
    }
    Ok(Begun {
        tokenizer,
        model,
        saved,
        state,
        devices,
        ranks,
    })
}

/// What a run reports as it goes: `metrics.jsonl`, TensorBoard's event file, the progress bar,
/// the summary.
struct RunLog {
    written: Option<Written>,
    progress: Box<dyn Bar>,
    started: Instant,
    first_loss: Option<f64>,
    last_loss: Option<f64>,
    last_eval: Option<f64>,
}

/// A run's files and bar, on the process that writes them (one process, or the first rank).
struct Written {
    metrics: std::fs::File,
    events: EventLog,
}

impl RunLog {
    /// The run's log; a rank that does not `lead` writes nothing and draws no bar.
    fn open(plan: &RunPlan, state: &TrainState, lead: bool) -> Result<Self> {
        let (steps, step) = (plan.train.steps as u64, state.step as u64);
        if !lead {
            return Ok(Self {
                written: None,
                progress: crate::progress::silent().bar("steps", steps, step),
                started: Instant::now(),
                first_loss: None,
                last_loss: None,
                last_eval: None,
            });
        }
        std::fs::create_dir_all(&plan.out_dir)?;
        k3mini_checkpoints::remove_stale_temps(&plan.out_dir)?;
        let metrics = run_dir::open_metrics(&plan.out_dir, state.step)?;
        let events = EventLog::open(&plan.out_dir, state.step, SystemTime::now(), || {
            run_dir::read_metrics(&plan.out_dir)
        })?;
        let progress = crate::progress::observer().bar("steps", steps, step);
        if let Some(repaired) = &events.repaired {
            progress.note(repaired.clone());
        }
        Ok(Self {
            written: Some(Written { metrics, events }),
            progress,
            started: Instant::now(),
            first_loss: None,
            last_loss: None,
            last_eval: None,
        })
    }

    fn step(&mut self, plan: &RunPlan, state: &TrainState, m: &StepMetrics) -> Result<()> {
        if m.skipped {
            self.progress.note(format!(
                "step {}: non-finite loss or gradient, update skipped",
                m.step - 1
            ));
        }
        if let Some(w) = &mut self.written
            && (state.step % plan.train.log_every == 0 || m.eval_loss.is_some() || m.skipped)
        {
            run_dir::log_metrics(&mut w.metrics, m)?;
            w.events
                .write(m.step, SystemTime::now(), tensorboard::scalars(m))?;
        }
        self.first_loss.get_or_insert(m.loss);
        self.last_loss = Some(m.loss);
        self.last_eval = m.eval_loss.or(self.last_eval);
        self.progress.set(state.step as u64);
        self.progress.message(format!(
            "loss {:.4}{}  lr {:.2e}  {:.0} tok/s",
            m.loss,
            m.eval_loss
                .map_or(String::new(), |e| format!("  eval {e:.4}")),
            m.lr,
            m.tokens_per_s
        ));
        Ok(())
    }

    fn abandon_bad_steps(&self, plan: &RunPlan, state: &TrainState) -> crate::error::Error {
        self.progress.finish(false);
        crate::refused!(
            "{} consecutive steps had a non-finite loss or gradient (last at step {}); stopping. \
             The last good checkpoint in {} is intact; lower optim.lr or check the data.",
            state.consecutive_bad_steps,
            state.step,
            plan.out_dir.display()
        )
    }

    fn finish(
        self,
        plan: &RunPlan,
        first_step: usize,
        last_step: usize,
        leads: bool,
        interrupted: bool,
    ) -> TrainSummary {
        self.progress.finish(false);
        TrainSummary {
            out_dir: plan.out_dir.clone(),
            first_step,
            last_step,
            first_loss: self.first_loss,
            last_loss: self.last_loss,
            eval_loss: self.last_eval,
            tokens: (last_step - first_step) * plan.train.batch_tokens,
            wall_s: self.started.elapsed().as_secs_f64(),
            interrupted,
            leads,
        }
    }
}

/// What one optimizer step did.
struct Step {
    /// The step's loss (the micro-batches' mean).
    loss: f64,
    /// The MoE balance term `Σ α · L_bal` (micro-batches' mean), when the config sets α.
    balance_loss: Option<f64>,
    grad_norm: f64,
    /// Non-finite loss or gradient: nothing was updated.
    skipped: bool,
    /// Tokens per expert over the step's micro-batches, per MoE layer.
    expert_load: Vec<ExpertLoad>,
    /// Σ (reverse-KL estimate · tokens) and tokens over the on-policy micro-batches.
    on_policy: (f64, usize),
    /// Seconds of forward and backward per device.
    replica_busy_s: Vec<f64>,
    /// Across processes, seconds in collectives.
    collective_s: Option<f64>,
}

/// One optimizer step: the accumulated micro-batches on every device at once
/// ([`Parallel::run`]), clipping to the global norm, AdamW at `lr` (each parameter on the device
/// that owns it), DeepSeek-V3's aux-loss-free balancing of the routers' biases from the step's
/// expert loads, and the updated weights copied to every device.
///
/// A micro-batch that fails to load fails the step before any weight changes: the model comes
/// back with the error (none when the ranks failed to share the updated parameters).
fn train_step(
    plan: &RunPlan,
    mut model: K3Mini,
    parallel: &mut Parallel,
    optim: &mut AdamW,
    objective: &mut dyn TrainingObjective,
    state: &TrainState,
    lr: f64,
) -> std::result::Result<(K3Mini, Step), (Option<K3Mini>, Error)> {
    let qat = match &plan.train.qat {
        Some(q) if state.step >= q.start_step => Some(q.format),
        _ => None,
    };
    let mut reduced = match parallel.run(&model, objective, plan, state, qat) {
        Ok(r) => r,
        Err(e) => return Err((Some(model), e)),
    };
    let grad_norm = reduced.grad_norm;
    if let Some(c) = plan.optim.grad_clip {
        clip_to(&model, &mut reduced.grads, grad_norm, c);
    }
    let skipped = !(reduced.loss.is_finite() && grad_norm.is_finite());
    if !skipped {
        let mut stepped = optim.step(lr, model, reduced.grads);
        stepped.update_router_biases(&reduced.expert_load);
        // Across ranks the others' parameters arrive; a rank that left fails the step, and the
        // half-shared model is no one's to checkpoint.
        model = parallel.broadcast(stepped).map_err(|e| (None, e))?;
    }
    let has_balance_loss = model
        .config
        .moe
        .as_ref()
        .is_some_and(|m| m.balance_loss_weight > 0.0);
    let step = Step {
        loss: reduced.loss,
        balance_loss: has_balance_loss.then_some(reduced.balance),
        grad_norm,
        skipped,
        expert_load: reduced.expert_load,
        on_policy: reduced.on_policy,
        replica_busy_s: reduced.busy_s,
        collective_s: parallel.take_collective_s(),
    };
    Ok((model, step))
}

impl Step {
    fn metrics(
        &self,
        plan: &RunPlan,
        state: &TrainState,
        lr: f64,
        tokens_per_s: f64,
        eval: Option<crate::train::held_out::HeldOutEval>,
    ) -> StepMetrics {
        let finite = |x: f64| x.is_finite().then_some(x);
        let per_layer = |f: fn(&ExpertLoad) -> usize| self.expert_load.iter().map(f).collect();
        StepMetrics {
            step: state.step,
            tokens: state.step * plan.train.batch_tokens,
            loss: self.loss,
            lr,
            grad_norm: self.grad_norm,
            tokens_per_s,
            skipped: self.skipped,
            eval_loss: eval.map(|e| e.loss),
            eval_top1: eval.and_then(|e| finite(e.top1)),
            eval_kl: eval.and_then(|e| finite(e.kl)),
            on_policy_kl: (self.on_policy.1 > 0)
                .then(|| self.on_policy.0 / self.on_policy.1 as f64),
            balance_loss: self.balance_loss,
            replica_busy_s: self.replica_busy_s.clone(),
            collective_s: self.collective_s,
            expert_load_max: per_layer(|l| l.iter().copied().max().unwrap_or(0)),
            expert_load_min: per_layer(|l| l.iter().copied().min().unwrap_or(0)),
            peak_rss_bytes: k3mini_student::bench::peak_rss_bytes(),
            step_peak_heap_bytes: k3mini_student::bench::heap_peak_bytes(),
        }
    }
}

/// The refusals a run meets before it allocates, after its devices open: the fit in this
/// machine's memory, and the tokenizer against the model's vocabulary. Returns the tokenizer.
fn preflight(plan: &RunPlan) -> Result<Tokenizer> {
    check_fits_this_machine(plan)?;
    let tokenizer = crate::teachers::student_tokenizer(&plan.data.tokenizer)?;
    if tokenizer.vocab_size() > plan.model.vocab_size {
        bail!(
            "{}: data.tokenizer has {} ids but model.vocab_size is {}: set [model] vocab_size = {}",
            plan.recipe_name(),
            tokenizer.vocab_size(),
            plan.model.vocab_size,
            tokenizer.vocab_size()
        );
    }
    Ok(tokenizer)
}

/// What `k3mini recipe check` runs beyond the plan: what `train` would refuse before its first
/// step — the devices, [`preflight`], and a document in each split of the corpus that training
/// reads (plain and online runs; shards are `teacher score`'s to write, and it reads the same
/// corpus's training split).
///
/// Under a launcher, what it sees of the group (without joining it) and this rank's device.
pub fn check_run(plan: &RunPlan) -> Result<Option<Launched>> {
    let launched = crate::train::ranks::launched(plan)?;
    let devices = match &launched {
        Some(l) => crate::train::ranks::device_of(plan, l)?,
        None => plan.devices.clone(),
    };
    devices.open()?;
    let tokenizer = preflight(plan)?;
    if plan.data.sources.is_empty() {
        return Ok(launched);
    }
    let reads_held_out = plan.data.holds_out()
        && plan
            .distill
            .as_ref()
            .is_none_or(|d| d.mode == crate::recipe::ModePlan::Online);
    let splits: &[Split] = match reads_held_out {
        true => &[Split::Train, Split::HeldOut],
        false => &[Split::Train],
    };
    for &split in splits {
        let mut stream = crate::corpus::document_stream(
            &plan.data,
            &tokenizer,
            plan.seed,
            split,
            StreamCursor::default(),
        )?;
        stream.next_doc()?;
    }
    Ok(launched)
}

/// Refuses a CPU run whose estimated training memory (weights, gradients, AdamW moments and the
/// activations of one micro-batch, and each further replica's gradients and activations) exceeds
/// this machine's, before anything is allocated. (A GPU's
/// memory is the backend's to report: `k3mini model info --recipe` shows the fit.)
fn check_fits_this_machine(plan: &RunPlan) -> Result<()> {
    if plan.devices.kinds()[0] != DeviceKind::Cpu {
        return Ok(());
    }
    // CPU replicas share this machine's memory and their weights (a tensor moved between two
    // CPU devices is not copied): each further replica adds its micro-batch's gradients and
    // activations to one device's whole.
    let one = k3mini_student::info::training_memory(
        &plan.model,
        &k3mini_student::info::Footprint {
            replicas: 1,
            ..plan.footprint()
        },
    );
    let more = plan.devices.replicas() - 1;
    let need = (one.total() + more * (one.grads + one.activations)) as f64;
    if let Some(have) = k3mini_student::bench::total_memory_bytes()
        && need > have as f64
    {
        bail!(
            "{}: training this model needs about {} (weights, gradients, AdamW moments and one \
             micro-batch's activations; `k3mini model info --recipe` itemises it) but this \
             machine has {}",
            plan.recipe_name(),
            bytes(need),
            bytes(have as f64)
        );
    }
    Ok(())
}
