//! Training across processes: ranks a launcher started (torchrun, srun; see `k3mini_dist::launch`),
//! one device each, meeting through PyTorch's c10d on host buffers (any backend's tensors cross as
//! f32 on the host): Gloo's, or NCCL's through the rank's CUDA device in a `nccl` build.
//!
//! ```text
//! step:   micro-batch i is trained by rank i mod W; every rank reads the whole stream in order
//!         (its order is one function of the cursor), skipping the others' micro-batches (teacher
//!         shards' rows unassembled; text must still be tokenized to know where rows end)
//! ring:     g_r = Σ_{i ≡ r} g_i (in order, on the rank)  →  all-reduce (Gloo's ring): every rank
//!           gets Σ_r g_r and keeps the parameters it owns
//! ordered:  each round of W micro-batches is all-gathered; every rank sums G = Σ_i g_i in
//!           micro-batch order (one process's bits), then keeps the parameters it owns
//! then:   ‖G‖ global (ordered: from every G, as one process; ring: Σ_r ‖G_owned(r)‖²) → clip →
//!         AdamW on the owned parameters (ZeRO-1: each rank holds its shard's moments) →
//!         each rank broadcasts the parameters it owns
//! ```
//!
//! Parameters are shared among ranks by bytes, whole ([`shard_by_bytes`]). An exchanged gradient
//! is every parameter's, flat in the module's order (one model's worth of host memory, whatever
//! the rank count); a rank's broadcast piece is its own parameters, in that order. A parameter
//! with no gradient in a micro-batch is marked absent, not zero: AdamW leaves a parameter without
//! a gradient alone, and a zero would decay it.

use crate::device::DeviceList;
use crate::error::{Error, Result};
use crate::recipe::{ModePlan, Reduction, RunPlan};
use crate::run_dir::{self, Start, TrainState};
use crate::train::optim::AutodiffMarks;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use k3mini_checkpoints::moments::Moments;
use k3mini_checkpoints::param_ids::{param_entries, restore_param_ids};
use k3mini_dist::Collective;
pub use k3mini_dist::launch::Attempt;
use k3mini_dist::launch::{self, Launched};
use k3mini_student::K3Mini;
use k3mini_student::info::shard_by_bytes;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// This process's place in a group of ranks, and the group.
pub struct Ranks {
    group: Box<dyn Collective>,
    pub rank: usize,
    pub world: usize,
    /// This rank's device.
    pub device: DeviceList,
    /// Which launch this is, and how many times the launcher has restarted the group.
    pub attempt: Attempt,
    pub reduction: Reduction,
    /// Micro-batches a step: rank r trains those ≡ r mod `world`.
    accumulation: usize,
}

/// The rank a launcher (torchrun, srun) started this process as, checked as joining would
/// check it: this build reaches c10d, and a step has a micro-batch for every rank. None for one
/// process.
pub fn launched(plan: &RunPlan) -> Result<Option<Launched>> {
    let env = |name: &str| std::env::var(name).ok();
    let timeout = Duration::from_secs(plan.train.collective_timeout_s);
    let Some(l) = launch::from_env(&env, timeout)? else {
        return Ok(None);
    };
    let (rank, world) = (l.rendezvous.rank, l.rendezvous.world);
    fits(plan, world, &format!("{} started", l.launcher))?;
    crate::ensure!(
        cfg!(feature = "c10d"),
        "{} started this process as rank {rank} of {world}, but this k3mini was built without \
         PyTorch's c10d: build it with `--features c10d` (see docs/gpus.md) to train across \
         processes",
        l.launcher
    );
    Ok(Some(l))
}

/// The device of a rank the launcher started: `plan.devices` for its local rank, among the GPUs
/// `CUDA_VISIBLE_DEVICES` leaves it ([`DeviceList::for_local_rank`]).
pub fn device_of(plan: &RunPlan, launched: &Launched) -> Result<DeviceList> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .map(|v| v.split(',').filter(|d| !d.trim().is_empty()).count());
    plan.devices.for_local_rank(launched.local_rank, visible)
}

/// Refuses a plan `world` ranks cannot train (`who` started them): fewer micro-batches a step
/// than ranks, or a teacher in the loop.
fn fits(plan: &RunPlan, world: usize, who: &str) -> Result<()> {
    crate::ensure!(
        plan.accumulation >= world,
        "{}: a step has {} micro-batches (train.batch_tokens / (micro_batch · seq_len)) but \
         {who} {world} ranks: each rank needs one; raise train.batch_tokens or start fewer \
         ranks",
        plan.recipe_name(),
        plan.accumulation,
    );
    // A rank skips the others' micro-batches, but a teacher in the loop scores (or samples) a
    // micro-batch as it loads, and skipping one still loads it.
    let mode = plan.distill.as_ref().map(|d| &d.mode);
    crate::ensure!(
        !matches!(mode, Some(ModePlan::Online | ModePlan::OnPolicy(_))),
        "{}: distill.mode = {} queries the teacher for each micro-batch while it loads, and \
         across processes every rank loads every micro-batch to skip it: train it in one process \
         (score the corpus with `teacher score` and train offline across ranks instead)",
        plan.recipe_name(),
        match mode {
            Some(ModePlan::Online) => "online",
            _ => "on_policy",
        }
    );
    Ok(())
}

/// The group a launcher started this process in ([`launched`]), joined, with this rank's device
/// ([`device_of`]).
pub fn join(plan: &RunPlan, l: Launched) -> Result<Ranks> {
    let device = device_of(plan, &l)?;
    let group = open_group(&l.rendezvous, &device)?;
    Ranks::new(plan, group, device, l.attempt)
}

/// The group on c10d: NCCL's when this rank trains on a CUDA device and the build has NCCL, else
/// Gloo's (host buffers, whatever the device).
#[cfg(feature = "c10d")]
fn open_group(r: &launch::Rendezvous, device: &DeviceList) -> Result<Box<dyn Collective>> {
    use k3mini_dist::c10d::{Backend, Group};
    let backend = match device.kinds() {
        [crate::device::DeviceKind::Cuda(cuda)] if cfg!(feature = "nccl") => {
            Backend::Nccl { cuda: *cuda }
        }
        _ => Backend::Gloo,
    };
    Ok(Box::new(Group::join(r, backend)?))
}

#[cfg(not(feature = "c10d"))]
fn open_group(_: &launch::Rendezvous, _: &DeviceList) -> Result<Box<dyn Collective>> {
    unreachable!("`launched` refuses a rank in a build without c10d")
}

/// What a rank's step gave before the ranks meet.
pub enum Local {
    /// Ring: Σ of this rank's micro-batches' gradients, in order, on its device.
    Running(GradientsParams),
    /// Ordered: each of this rank's micro-batches' gradients (its micro-batch of each round, in
    /// order), on the host ([`Layout::to_host`]).
    Each(Vec<Vec<f32>>),
}

/// Where each parameter sits in an exchanged buffer.
pub struct Layout {
    /// In the module's order.
    slots: Vec<Slot>,
    index: HashMap<ParamId, usize>,
    /// Elements of every parameter.
    whole: usize,
    /// Elements each rank owns.
    owned: Vec<usize>,
}

struct Slot {
    owner: usize,
    /// Offset in a buffer of every parameter.
    at: usize,
    /// Offset in its owner's piece.
    in_piece: usize,
    len: usize,
}

impl Layout {
    /// `model`'s float parameters shared among `world` ranks by bytes.
    pub fn new(model: &K3Mini, world: usize) -> Self {
        let params = param_sizes(model);
        let sizes: Vec<usize> = params.iter().map(|p| p.1).collect();
        let owners = shard_by_bytes(&sizes, world);
        let (mut owned, mut whole) = (vec![0usize; world], 0);
        let slots = sizes
            .iter()
            .zip(&owners)
            .map(|(&len, &owner)| {
                let slot = Slot {
                    owner,
                    at: whole,
                    in_piece: owned[owner],
                    len,
                };
                whole += len;
                owned[owner] += len;
                slot
            })
            .collect();
        Self {
            index: params.iter().enumerate().map(|(i, p)| (p.0, i)).collect(),
            slots,
            whole,
            owned,
        }
    }

    /// The rank that owns parameter `id`.
    pub fn owner(&self, id: ParamId) -> Option<usize> {
        self.index.get(&id).map(|&i| self.slots[i].owner)
    }

    /// A micro-batch's gradients on the host: every parameter's, then a presence flag each.
    pub fn to_host(&self, model: &K3Mini, grads: &GradientsParams) -> Vec<f32> {
        let mut host = vec![0f32; self.whole + self.slots.len()];
        let (buffer, flags) = host.split_at_mut(self.whole);
        let mut present = vec![0f64; self.slots.len()];
        flatten_grads(model, self, grads, buffer, &mut present);
        for (f, p) in flags.iter_mut().zip(present) {
            *f = p as f32;
        }
        host
    }
}

impl Ranks {
    /// A rank of `group` (a launcher's processes, or threads of one process) training `plan` on
    /// `device`, in the launch `attempt` names. Checks first that the run
    /// directory is one every rank sees: a checkpoint is written by all of them into it.
    pub fn new(
        plan: &RunPlan,
        group: Box<dyn Collective>,
        device: DeviceList,
        attempt: Attempt,
    ) -> Result<Self> {
        fits(plan, group.world(), "the group has")?;
        let mut ranks = Ranks {
            rank: group.rank(),
            world: group.world(),
            group,
            device,
            attempt,
            reduction: plan.train.reduction,
            accumulation: plan.accumulation,
        };
        ranks.see_one_directory(&plan.out_dir)?;
        Ok(ranks)
    }

    /// Sums the ranks' gradients: the parameters this rank owns, summed over every micro-batch of
    /// the step, on `device` (where this rank's gradients are).
    pub fn reduce_grads(
        &mut self,
        model: &K3Mini,
        layout: &Layout,
        local: Local,
        device: &Device,
    ) -> Result<Summed> {
        match local {
            Local::Running(grads) => self.ring(model, layout, grads, device),
            Local::Each(each) => self.ordered(model, layout, each, device),
        }
    }

    /// Ring: this rank's sum, all-reduced; presence counted the same way.
    fn ring(
        &mut self,
        model: &K3Mini,
        layout: &Layout,
        grads: GradientsParams,
        device: &Device,
    ) -> Result<Summed> {
        let (mut whole, mut present) = (vec![0f32; layout.whole], vec![0f64; layout.slots.len()]);
        flatten_grads(model, layout, &grads, &mut whole, &mut present);
        drop(grads);
        self.group
            .all_reduce(&mut whole)
            .map_err(|e| self.lost(e))?;
        self.group
            .all_reduce_f64(&mut present)
            .map_err(|e| self.lost(e))?;
        let present: Vec<bool> = present.iter().map(|&n| n > 0.0).collect();
        let grads = unflatten_grads(model, layout, &whole, &present, Some(self.rank), device);
        // ‖G‖² is the ranks' owned shares' sum.
        let own = crate::train::optim::global_grad_norm(model, &grads);
        let mut squares = [own * own];
        self.group
            .all_reduce_f64(&mut squares)
            .map_err(|e| self.lost(e))?;
        Ok(Summed {
            grads,
            norm: squares[0].sqrt(),
        })
    }

    /// Ordered: every round of micro-batches gathered and summed in micro-batch order.
    fn ordered(
        &mut self,
        model: &K3Mini,
        layout: &Layout,
        each: Vec<Vec<f32>>,
        device: &Device,
    ) -> Result<Summed> {
        let (n, whole) = (layout.slots.len(), layout.whole);
        // Per rank: its micro-batch's buffer, then one presence flag per parameter.
        let width = whole + n;
        let mut total = vec![0f32; whole];
        let mut seen = vec![false; n];
        let rounds = self.accumulation.div_ceil(self.world);
        let mut each = each.into_iter();
        let mut all = vec![0f32; width * self.world];
        for round in 0..rounds {
            // A rank without a micro-batch in the last round sends nothing present.
            let mine = each.next().unwrap_or_else(|| vec![0f32; width]);
            self.group
                .all_gather(&mine, &mut all)
                .map_err(|e| self.lost(e))?;
            drop(mine);
            // Rank r's buffer of this round is micro-batch round · W + r's.
            let ranks_this_round = (self.accumulation - round * self.world).min(self.world);
            for piece in all.chunks_exact(width).take(ranks_this_round) {
                let (buffer, flags) = piece.split_at(whole);
                for (i, slot) in layout.slots.iter().enumerate() {
                    if flags[i] == 0.0 {
                        continue;
                    }
                    let (to, from) = (
                        &mut total[slot.at..slot.at + slot.len],
                        &buffer[slot.at..slot.at + slot.len],
                    );
                    if seen[i] {
                        for (t, x) in to.iter_mut().zip(from) {
                            *t += x;
                        }
                    } else {
                        to.copy_from_slice(from);
                        seen[i] = true;
                    }
                }
            }
        }
        drop(all);
        // The norm as one process takes it, from every parameter's sum; then the owned ones.
        let every = unflatten_grads(model, layout, &total, &seen, None, device);
        let norm = crate::train::optim::global_grad_norm(model, &every);
        drop(every);
        // The first rank's, on all: ranks on unlike devices could round it apart, and every rank
        // must skip (a non-finite norm) or step alike.
        let norm = self.from_first(norm)?;
        let grads = unflatten_grads(model, layout, &total, &seen, Some(self.rank), device);
        Ok(Summed { grads, norm })
    }

    /// The model every rank starts from: the first rank's weights, sent to the others. A fresh
    /// model's parameter ids (random per process) become its parameters' places in the module,
    /// the same on every rank: they key the optimizer shards each rank writes. (A resumed model
    /// has the checkpoint's.)
    pub fn start_from_first(&mut self, model: K3Mini, fresh: bool) -> Result<K3Mini> {
        let model = match fresh {
            true => {
                let ids = param_entries(&model)
                    .into_iter()
                    .enumerate()
                    .map(|(i, p)| (p.path, i as u64 + 1))
                    .collect();
                restore_param_ids(model, &ids)?
            }
            false => model,
        };
        let all_first = Layout::new(&model, 1);
        self.share_from(model, &all_first, 0)
    }

    /// After the optimizer step: each rank's updated parameters, broadcast to the others.
    pub fn share_params(&mut self, mut model: K3Mini, layout: &Layout) -> Result<K3Mini> {
        for root in 0..self.world {
            model = self.share_from(model, layout, root)?;
        }
        Ok(model)
    }

    /// The parameters `root` owns, from `root` to every rank.
    fn share_from(&mut self, model: K3Mini, layout: &Layout, root: usize) -> Result<K3Mini> {
        let mut piece = vec![0f32; layout.owned[root]];
        if self.rank == root {
            flatten_params(&model, layout, root, &mut piece);
        }
        self.group
            .broadcast(&mut piece, root)
            .map_err(|e| self.lost(e))?;
        if self.rank == root {
            return Ok(model);
        }
        Ok(model.map(&mut SetParams {
            layout,
            piece: &piece,
            owner: root,
        }))
    }

    /// Fails every rank unless each sees the file the first writes into `dir`: ranks whose run
    /// directories are not one shared directory are stopped before they train, not at their
    /// first checkpoint.
    fn see_one_directory(&mut self, dir: &Path) -> Result<()> {
        let probe = dir.join(format!(".ranks-{}", std::process::id()));
        // A value this launch alone writes: the first rank's process id and clock.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mine = f64::from(std::process::id() ^ nanos);
        let written = match self.rank {
            0 => std::fs::create_dir_all(dir)
                .and_then(|()| k3mini_durable::write(&probe, mine.to_string().as_bytes()))
                .map_err(|e| crate::refused!("{}: {e}", probe.display())),
            _ => Ok(()),
        };
        self.agree("write a file into the run directory", written)?;
        let value = self.from_first(mine)?;
        let name = self.from_first(f64::from(std::process::id()))?;
        let probe = dir.join(format!(".ranks-{name}"));
        let seen = match std::fs::read_to_string(&probe) {
            Ok(text) if text == value.to_string() => Ok(()),
            Ok(_) => Err(crate::refused!(
                "{} holds another launch's value",
                probe.display()
            )),
            Err(e) => Err(crate::refused!(
                "{}: {e}: every rank's run directory must be the first's (a file system all \
                 of them see)",
                probe.display()
            )),
        };
        let agreed = self.agree("see the first rank's run directory", seen);
        if self.rank == 0 {
            std::fs::remove_file(&probe).ok();
        }
        agreed
    }

    /// Whether the group resumes: when `asked`, or, a group its launcher restarted (torchrun's
    /// `--max-restarts`), by itself from the newest checkpoint if an attempt of its own launch
    /// started in the run directory ([`run_dir::launched_by`]) and wrote one: an earlier launch's
    /// checkpoints are refused as they were at the first attempt. The first rank decides.
    pub fn resumes(&mut self, plan: &RunPlan, asked: bool) -> Result<bool> {
        let decided = match (self.rank, asked || self.attempt.restart == 0) {
            (0, false) => run_dir::launched_by(&plan.out_dir, &self.launch_name())
                .and_then(|own| Ok(own && k3mini_checkpoints::latest(&plan.out_dir)?.is_some())),
            _ => Ok(asked),
        };
        let decided = self.agree("decide whether to resume", decided)?;
        Ok(self.from_first(f64::from(u8::from(decided)))? > 0.0)
    }

    /// The name the first rank marks the run directory with: the launch's, or where the launcher
    /// names none (torchrun without `--rdzv-id` or `--standalone` calls every launch `none`) its
    /// agent's, this process's parent (pid and start time), which lives across the restarts of
    /// its group.
    fn launch_name(&self) -> String {
        if self.attempt.run != "none" {
            return self.attempt.run.clone();
        }
        let agent = std::os::unix::process::parent_id();
        // /proc/PID/stat: field 22, the start time, is the 20th after the `(comm)` field.
        let started = std::fs::read_to_string(format!("/proc/{agent}/stat"))
            .ok()
            .and_then(|stat| {
                let (_, fields) = stat.rsplit_once(')')?;
                fields.split_whitespace().nth(19).map(String::from)
            })
            .unwrap_or_default();
        format!("none/agent-{agent}-{started}")
    }

    /// The first rank's `value`, on every rank.
    pub fn from_first(&mut self, value: f64) -> Result<f64> {
        let mut v = [if self.rank == 0 { value } else { 0.0 }];
        self.group
            .all_reduce_f64(&mut v)
            .map_err(|e| self.lost(e))?;
        Ok(v[0])
    }

    /// How the run starts, the first rank's decision ([`run_dir::start`]) followed by the
    /// others: a fresh run, or the checkpoint of the step it resumes from, on every rank.
    pub fn start(
        &mut self,
        plan: &RunPlan,
        resume: bool,
        accept_changes: bool,
        stop_after: Option<usize>,
    ) -> Result<Start> {
        // Every rank resolved its own recipe (and a traffic run pinned its shards as it did): a
        // rank training another plan, or stopping elsewhere, would draw other micro-batches and
        // could hang the group.
        let mine = plan_digest(plan, stop_after);
        let first_digest = self.from_first(mine)?;
        let same = match mine == first_digest {
            true => Ok(()),
            false => Err(crate::refused!(
                "{}: this rank's plan differs from the first rank's: start every rank with the \
                 same recipe, options and data",
                plan.recipe_name()
            )),
        };
        self.agree("resolve the first rank's plan", same)?;
        let first = match self.rank {
            0 => run_dir::start(plan, resume, accept_changes).map(Some),
            _ => Ok(None),
        };
        let first = self.agree("start the run", first)?;
        let marked = match self.rank {
            0 => run_dir::mark_launch(&plan.out_dir, &self.launch_name()),
            _ => Ok(()),
        };
        self.agree("mark the run directory with its launch", marked)?;
        // 0 for a fresh run, else the step resumed from, plus one.
        let at = match &first {
            Some(Start::Resume { checkpoint, .. }) => checkpoint.step as f64 + 1.0,
            _ => 0.0,
        };
        let at = self.from_first(at)?;
        if at == 0.0 {
            return Ok(first.unwrap_or(Start::Fresh));
        }
        // Every rank agrees on the opening, the first (which has opened it) included.
        let step = at as usize - 1;
        let opened = match first {
            Some(start) => Ok(start),
            // Where `list` finds it: a rewrite cut short leaves it set aside under another name.
            None => k3mini_checkpoints::list(&plan.out_dir)
                .map_err(Error::from)
                .and_then(|all| {
                    let (_, dir) = all.into_iter().find(|(s, _)| *s == step).ok_or_else(|| {
                        crate::refused!(
                            "{}: the first rank resumes from step {step}, which this rank does \
                             not see",
                            plan.out_dir.display()
                        )
                    })?;
                    run_dir::open_checkpoint(&dir)
                })
                .map(|checkpoint| Start::Resume {
                    checkpoint,
                    changes: Vec::new(),
                }),
        };
        self.agree(&format!("open the checkpoint of step {step}"), opened)
    }

    /// Writes a checkpoint of step `state.step` together: the ranks fill one temporary directory
    /// (the first the weights, ids, state and plan; each its optimizer shard, in parallel), and
    /// the first publishes it once all have written ([`run_dir::write_checkpoint`] for one
    /// process). The run directory must be one file system every rank sees. A rank that fails
    /// makes every rank fail, naming it, and the newest published checkpoint stays as it was.
    pub fn write_checkpoint(
        &mut self,
        plan: &RunPlan,
        model: &K3Mini,
        moments: &HashMap<u64, Moments>,
        state: &TrainState,
    ) -> Result<PathBuf> {
        let (dir, step, keep) = (&plan.out_dir, state.step, plan.train.keep_checkpoints);
        let lead = self.rank == 0;
        let tmp = k3mini_checkpoints::temp_dir(dir, step, "ranks");
        let made = match lead {
            true => k3mini_checkpoints::fresh_temp(dir, step, "ranks").map(drop),
            false => Ok(()),
        };
        self.agree(
            "create the checkpoint's directory",
            made.map_err(Error::from),
        )?;
        let shard = tmp.join(run_dir::optimizer_shard(self.rank, self.world));
        let mut filled = run_dir::write_moments(&shard, model, moments);
        if lead && filled.is_ok() {
            filled = run_dir::fill_checkpoint(plan, model, state, &tmp);
        }
        self.agree("write its part of the checkpoint", filled)?;
        // Published only whole: every rank's shard where the first can see it.
        let published = match lead {
            true => match missing_shard(&tmp, self.world) {
                Some(missing) => Err(crate::refused!(
                    "{}: {missing} is not listed though its rank wrote it: the run directory is \
                     not one file system every rank sees alike",
                    tmp.display()
                )),
                None => k3mini_checkpoints::publish(dir, step, keep, &tmp)
                    .map(drop)
                    .map_err(Error::from),
            },
            false => Ok(()),
        };
        self.agree("publish the checkpoint", published)?;
        Ok(k3mini_checkpoints::step_dir(dir, step))
    }

    /// A collective that failed: almost always another rank gone (killed, crashed, out of
    /// memory) or unreachable, which its own output explains.
    fn lost(&self, e: k3mini_dist::DistError) -> Error {
        Error::Ranks(format!(
            "rank {} of {}: another rank has stopped or cannot be reached (a collective failed: \
             {e})",
            self.rank, self.world
        ))
    }

    /// Sums `figures` over ranks, element-wise, exactly where at most one rank's entry is
    /// non-zero (each micro-batch's figures are its rank's alone).
    pub fn sum_figures(&mut self, figures: &mut [f64]) -> Result<()> {
        self.group.all_reduce_f64(figures).map_err(|e| self.lost(e))
    }

    /// Every rank's `outcome`, agreed: an error on any rank becomes an error on every rank (this
    /// rank's own, or one naming the first rank that failed to do `what`), so no rank goes on to
    /// wait in a collective for one that left.
    pub fn agree<T>(&mut self, what: &str, outcome: Result<T>) -> Result<T> {
        let mut failed = vec![0f64; self.world];
        failed[self.rank] = f64::from(u8::from(outcome.is_err()));
        if let Err(e) = self.group.all_reduce_f64(&mut failed) {
            // This rank's own failure says more than the group's.
            outcome?;
            return Err(self.lost(e));
        }
        let value = outcome?;
        match failed.iter().position(|&f| f > 0.0) {
            Some(r) => Err(Error::Ranks(format!(
                "rank {r} of {} failed to {what} (its own output says why)",
                self.world
            ))),
            None => Ok(value),
        }
    }
}

/// A digest of `plan` but its devices (each rank has its own) and of where the run stops, as a
/// whole number below 2^52 that an f64 carries exactly.
fn plan_digest(plan: &RunPlan, stop_after: Option<usize>) -> f64 {
    let mut plan = plan.clone();
    plan.devices = DeviceList::default();
    let text = format!("{}\nstop_after = {stop_after:?}", plan.to_toml());
    let hex = k3mini_data::digest::sha256_hex(text.as_bytes());
    // 13 hex digits: 52 bits.
    u64::from_str_radix(&hex[..13], 16).map_or(0.0, |bits| bits as f64)
}

/// The first of the `world` optimizer shards the listing of `tmp` lacks (the listing the
/// checkpoint's manifest is made from), if any.
fn missing_shard(tmp: &Path, world: usize) -> Option<String> {
    let listed: std::collections::HashSet<String> = std::fs::read_dir(tmp)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    (0..world)
        .map(|r| run_dir::optimizer_shard(r, world))
        .find(|name| !listed.contains(name))
}

/// Every float parameter's id and element count, in the module's order.
pub fn param_sizes(model: &K3Mini) -> Vec<(ParamId, usize)> {
    struct Sizes(Vec<(ParamId, usize)>);
    impl ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push((param.id, param.dims().iter().product()));
        }
    }
    let mut sizes = Sizes(Vec::new());
    model.visit(&mut sizes);
    sizes.0
}

/// The step's gradients once the ranks have met: the parameters this rank owns, and the global
/// norm of all of them (before clipping).
pub struct Summed {
    pub grads: GradientsParams,
    pub norm: f64,
}

/// Copies each parameter's gradient in `grads` to its slot of `buffer` and counts it in
/// `present`.
fn flatten_grads(
    model: &K3Mini,
    layout: &Layout,
    grads: &GradientsParams,
    buffer: &mut [f32],
    present: &mut [f64],
) {
    struct Flatten<'a> {
        layout: &'a Layout,
        grads: &'a GradientsParams,
        buffer: &'a mut [f32],
        present: &'a mut [f64],
    }
    impl ModuleVisitor for Flatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let (Some(g), Some(&i)) = (
                self.grads.get::<D>(param.id),
                self.layout.index.get(&param.id),
            ) else {
                return;
            };
            let slot = &self.layout.slots[i];
            copy_out(g, &mut self.buffer[slot.at..slot.at + slot.len]);
            self.present[i] += 1.0;
        }
    }
    model.visit(&mut Flatten {
        layout,
        grads,
        buffer,
        present,
    });
}

/// The gradients of the `present` parameters (those `owner` owns, or all) from their slots of
/// `buffer`, on `device`.
fn unflatten_grads(
    model: &K3Mini,
    layout: &Layout,
    buffer: &[f32],
    present: &[bool],
    owner: Option<usize>,
    device: &Device,
) -> GradientsParams {
    struct Unflatten<'a> {
        layout: &'a Layout,
        buffer: &'a [f32],
        present: &'a [bool],
        owner: Option<usize>,
        device: &'a Device,
        grads: GradientsParams,
    }
    impl ModuleVisitor for Unflatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(&i) = self.layout.index.get(&param.id) else {
                return;
            };
            let slot = &self.layout.slots[i];
            if !self.present[i] || self.owner.is_some_and(|o| o != slot.owner) {
                return;
            }
            let values = self.buffer[slot.at..slot.at + slot.len].to_vec();
            let data = TensorData::new(values, param.shape());
            self.grads
                .register(param.id, Tensor::<D>::from_data(data, self.device));
        }
    }
    let mut u = Unflatten {
        layout,
        buffer,
        present,
        owner,
        device,
        grads: GradientsParams::new(),
    };
    model.visit(&mut u);
    u.grads
}

/// Copies the parameters `owner` owns into its piece.
fn flatten_params(model: &K3Mini, layout: &Layout, owner: usize, piece: &mut [f32]) {
    struct Flatten<'a> {
        layout: &'a Layout,
        owner: usize,
        piece: &'a mut [f32],
    }
    impl ModuleVisitor for Flatten<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(&i) = self.layout.index.get(&param.id) else {
                return;
            };
            let slot = &self.layout.slots[i];
            if slot.owner == self.owner {
                let at = slot.in_piece;
                copy_out(param.val(), &mut self.piece[at..at + slot.len]);
            }
        }
    }
    model.visit(&mut Flatten {
        layout,
        owner,
        piece,
    });
}

/// A tensor's values, as f32, into `to`.
fn copy_out<const D: usize>(t: Tensor<D>, to: &mut [f32]) {
    let data = t.into_data().convert::<f32>();
    to.copy_from_slice(data.as_slice::<f32>().expect("converted to f32"));
}

/// Sets the parameters `owner` owns from its `piece`, keeping what autodiff knows of each.
struct SetParams<'a> {
    layout: &'a Layout,
    piece: &'a [f32],
    owner: usize,
}

impl ModuleMapper for SetParams<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let slot = match self.layout.index.get(&id) {
            Some(&i) if self.layout.slots[i].owner == self.owner => &self.layout.slots[i],
            _ => return Param::from_mapped_value(id, tensor, mapper),
        };
        let marks = AutodiffMarks::of(&tensor);
        let inner = tensor.inner();
        let values = &self.piece[slot.in_piece..slot.in_piece + slot.len];
        let data = TensorData::new(values.to_vec(), inner.shape());
        let updated = Tensor::<D>::from_data(data, &inner.device());
        Param::from_mapped_value(id, marks.put(id, updated), mapper)
    }
}
