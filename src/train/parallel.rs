//! Data parallelism in one process: one worker thread per device runs forward and backward of its
//! micro-batches at the same time as the others; each parameter is owned by one device, which
//! reduces its gradient, holds its AdamW moments and updates it (the ZeRO-1 idea); the updated
//! parameters are then copied to the replicas, which keep their weights between steps.
//!
//! ```text
//! step:   this thread              worker d (one per device, weights W_d = W)
//!         load micro-batch i  ──►  forward + backward of i on device i mod N → g_i
//!         reduce g_i in order:     G_p += g_i,p   on owner(p), for every parameter p
//! after:  ‖G‖ (global, clipped) → AdamW on owner(p) for each p → W_d ← W_owner(p),p for every d
//! ```
//!
//! The sums run in micro-batch order whatever the device count, so N devices give the weights one
//! device doing every micro-batch gives, up to the devices' arithmetic (equal on CPU replicas).
//! There are no collectives in one process: burn 0.22's all-reduce exists only for its CubeCL
//! backends, and libtorch's (`tch`) has none; the reduction and the copies are `to_device` moves,
//! ordered by this thread. Across processes ([`Ranks`]), each rank is one device and trains the
//! micro-batches `i ≡ rank mod world`; the ranks' sums meet through c10d (`train::ranks`).

use crate::error::Result;
use crate::recipe::{Reduction as RankReduction, RunPlan};
use crate::run_dir::TrainState;
use crate::train::held_out::{HeldOut, HeldOutEval};
use crate::train::objective::{Job, OnPolicyGap, StepModel, TrainingObjective};
use crate::train::optim::global_grad_norm;
use crate::train::qat::{FakeQuantizer, QatFormat};
use crate::train::ranks::{Layout, Local, Ranks};
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor};
use k3mini_kernels::recompute::ComposedRegions;
use k3mini_student::K3Mini;
use k3mini_student::info::shard_by_bytes;
use k3mini_student::moe::ExpertLoad;
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::time::Instant;

/// The devices a run trains on and what each holds between steps.
pub struct Parallel {
    /// Every device, the model's first.
    devices: Vec<Device>,
    /// The device (an index into `devices`) that owns each parameter: reduces its gradient, holds
    /// its AdamW moments and updates it.
    owners: HashMap<ParamId, usize>,
    /// The weights on `devices[1..]`, kept between steps.
    replicas: Vec<K3Mini>,
    /// The other processes this one trains with (then `devices` is this rank's one device), and
    /// which rank owns each parameter.
    ranks: Option<(Ranks, Layout)>,
    /// Seconds spent in collectives since last taken.
    collective_s: f64,
}

/// What the micro-batches of a step gave: the summed gradients (each parameter's on its owner;
/// across ranks, this rank's parameters only) and the step's figures, read from the devices once.
pub struct Reduced {
    pub grads: GradientsParams,
    /// The global L2 norm of every parameter's summed gradient, before clipping.
    pub grad_norm: f64,
    /// Σ over micro-batches of `loss / accumulation`: the step's mean loss.
    pub loss: f64,
    /// The MoE balance term, the same way.
    pub balance: f64,
    /// Tokens per expert over the step, per MoE layer.
    pub expert_load: Vec<ExpertLoad>,
    /// Σ (reverse-KL estimate · tokens) and tokens over the on-policy micro-batches.
    pub on_policy: (f64, usize),
    /// Seconds of forward and backward per device, the model's first (across ranks: per rank).
    pub busy_s: Vec<f64>,
}

impl Parallel {
    /// `model` on `devices[0]`, a copy of it on each other device, and the parameters shared out
    /// among the devices (or, across processes, among the ranks) by bytes.
    pub fn new(model: &K3Mini, devices: Vec<Device>, ranks: Option<Ranks>) -> Self {
        let params = crate::train::ranks::param_sizes(model);
        let sizes: Vec<usize> = params.iter().map(|p| p.1).collect();
        let owners = params
            .iter()
            .map(|p| p.0)
            .zip(shard_by_bytes(&sizes, devices.len()))
            .collect();
        let replicas = devices[1..].iter().map(|d| model.clone().fork(d)).collect();
        let ranks = ranks.map(|r| {
            let layout = Layout::new(model, r.world);
            (r, layout)
        });
        Self {
            devices,
            owners,
            replicas,
            ranks,
            collective_s: 0.0,
        }
    }

    /// Across processes, the seconds spent in collectives since the last call.
    pub fn take_collective_s(&mut self) -> Option<f64> {
        let s = std::mem::take(&mut self.collective_s);
        self.ranks.is_some().then_some(s)
    }

    /// The group this process trains in, if it is one rank of several.
    pub fn ranks(&mut self) -> Option<&mut Ranks> {
        self.ranks.as_mut().map(|(r, _)| r)
    }

    /// `outcome` on one process; across ranks, agreed ([`Ranks::agree`]): a failure on any rank
    /// fails every rank, naming it.
    pub fn agree<T>(&mut self, what: &str, outcome: Result<T>) -> Result<T> {
        match &mut self.ranks {
            Some((ranks, _)) => ranks.agree(what, outcome),
            None => outcome,
        }
    }

    /// The held-out measurements of `model`: across ranks, each evaluates its share of the
    /// batches and the sums meet ([`HeldOut::evaluate_shared`]).
    pub fn evaluate(&mut self, held: &HeldOut, model: &K3Mini) -> Result<Option<HeldOutEval>> {
        let Some((ranks, _)) = &mut self.ranks else {
            return Ok(held.evaluate(model));
        };
        let (rank, world) = (ranks.rank, ranks.world);
        held.evaluate_shared(model, rank, world, |sums| ranks.sum_figures(sums))
    }

    /// Whether `flag` is set on any rank (on this process, for one).
    pub fn any(&mut self, flag: bool) -> Result<bool> {
        let Some((ranks, _)) = &mut self.ranks else {
            return Ok(flag);
        };
        let mut count = [f64::from(u8::from(flag))];
        ranks.sum_figures(&mut count)?;
        Ok(count[0] > 0.0)
    }

    /// Whether this process writes what a run reports (metrics, events, the progress bar and
    /// the weights of a checkpoint): one process, or rank 0 of several.
    pub fn leads(&self) -> bool {
        self.ranks.as_ref().is_none_or(|(r, _)| r.rank == 0)
    }

    /// Runs a step's micro-batches on every device at once and reduces their gradients.
    ///
    /// Micro-batch `i` runs on device `i mod N`. This thread loads the micro-batches in order
    /// (while the other devices compute) and reduces each one's gradients in micro-batch order
    /// onto the parameters' owners; a worker takes its next micro-batch once its previous one is
    /// reduced, so at most one micro-batch's gradients wait on each device. The step's figures
    /// (losses, the balance term, the on-policy statistic) stay on the devices until the last
    /// micro-batch is reduced and are read once; what still reads the host mid-step is data's,
    /// not the loss's: a MoE layer's dispatch reads its routing, sampled KD draws from the
    /// teacher's top-k, QAT reads each weight once a step, on-policy sampling decodes. A
    /// micro-batch that fails to load ends the step with its error before anything is applied.
    pub fn run(
        &mut self,
        model: &K3Mini,
        objective: &mut dyn TrainingObjective,
        plan: &RunPlan,
        state: &TrainState,
        qat: Option<QatFormat>,
    ) -> Result<Reduced> {
        let accumulation = plan.accumulation;
        // QAT: the forward passes see fake-quantised linear weights, quantised once for the
        // step's workers; the gradients reach the weights.
        let quantizer = qat.map(FakeQuantizer::new);
        let quantizer = quantizer.as_ref();
        let student = StepModel::new(model, quantizer);
        let composed = ComposedRegions::active();
        std::thread::scope(|scope| {
            let (finished, results) = mpsc::channel();
            let workers: Vec<mpsc::SyncSender<(usize, Job)>> = std::iter::once(model)
                .chain(&self.replicas)
                .map(|copy| {
                    let (jobs, inbox) = mpsc::sync_channel(1);
                    let (copy, finished) = (copy.clone(), finished.clone());
                    scope.spawn(move || {
                        let _composed = composed.then(ComposedRegions::new);
                        worker(copy, quantizer, accumulation, inbox, finished)
                    });
                    jobs
                })
                .collect();
            drop(finished);
            // This process's micro-batches (all of them, or its rank's), in order; the worker
            // loop and the reduction count in this list's indices.
            let mine: Vec<usize> = match &self.ranks {
                None => (0..accumulation).collect(),
                Some((r, _)) => (r.rank..accumulation).step_by(r.world).collect(),
            };
            let ordered =
                matches!(&self.ranks, Some((r, _)) if r.reduction == RankReduction::Ordered);
            let mut reduction = Reduction::new(model, self, mine.clone(), accumulation, ordered);
            let n = workers.len();
            let mut local = 0;
            for micro in 0..accumulation {
                // Seeds what a micro-batch samples: a function of the step.
                let seed = plan.seed ^ ((state.step * accumulation + micro) as u64 + 1);
                // Another rank's micro-batch is skipped: the stream's order is one function of
                // its cursor, which every rank advances alike.
                if mine.get(local) != Some(&micro) {
                    objective.skip(&student, seed)?;
                    continue;
                }
                // The device's previous micro-batch is reduced first: then loading (which may
                // sample the student on the first device) overlaps the other devices' work, not
                // that device's own.
                if local >= n {
                    reduction.until(local - n + 1, &results)?;
                }
                let job = objective.next(&student, seed)?;
                workers[local % n]
                    .send((local, job))
                    .expect("a worker runs until its jobs end");
                local += 1;
            }
            drop(workers);
            reduction.until(mine.len(), &results)?;
            Ok(reduction.finish())
        })
        .and_then(|local| self.meet(model, local))
    }

    /// One process: the step as reduced, its norm taken. Across ranks: the ranks' sums and
    /// figures meet ([`Ranks::reduce_grads`]).
    fn meet(&mut self, model: &K3Mini, local: LocalStep) -> Result<Reduced> {
        let LocalStep { grads, mut figures } = local;
        let Some((ranks, layout)) = &mut self.ranks else {
            let Local::Running(grads) = grads else {
                unreachable!("one process sums its micro-batches as they come")
            };
            let grad_norm = global_grad_norm(model, &grads);
            return Ok(figures.reduced(grads, grad_norm));
        };
        let started = Instant::now();
        ranks.sum_figures(&mut figures.flat)?;
        let summed = ranks.reduce_grads(model, layout, grads, &self.devices[0])?;
        self.collective_s += started.elapsed().as_secs_f64();
        Ok(figures.reduced(summed.grads, summed.norm))
    }

    /// The device that owns parameter `id`: reduces its gradient, holds its AdamW moments. None
    /// when another rank owns it.
    pub fn owner(&self, id: ParamId) -> Option<Device> {
        if let Some((ranks, layout)) = &self.ranks {
            return (layout.owner(id) == Some(ranks.rank)).then(|| self.devices[0].clone());
        }
        let at = self.owners.get(&id).copied().unwrap_or(0);
        Some(self.devices[at].clone())
    }

    /// After the optimizer step (each parameter updated on its owner): the model on the first
    /// device and every replica (or every rank) receive the parameters others own.
    pub fn broadcast(&mut self, stepped: K3Mini) -> Result<K3Mini> {
        if let Some((ranks, layout)) = &mut self.ranks {
            let started = Instant::now();
            let shared = ranks.share_params(stepped, layout);
            self.collective_s += started.elapsed().as_secs_f64();
            return shared;
        }
        if self.replicas.is_empty() {
            return Ok(stepped);
        }
        for (replica, device) in self.replicas.iter_mut().zip(&self.devices[1..]) {
            *replica = stepped.clone().fork(device);
        }
        Ok(stepped.fork(&self.devices[0]))
    }
}

/// What a worker hands back for one micro-batch: its gradients and figures, on its device.
struct Done {
    grads: GradientsParams,
    /// The micro-batch's share of the step's loss, `loss / accumulation`, `[1]`.
    loss: Tensor<1>,
    balance: Option<Tensor<1>>,
    expert_load: Vec<ExpertLoad>,
    on_policy: Option<OnPolicyGap>,
    /// Seconds its forward and backward took on the worker.
    busy_s: f64,
}

/// A device's worker: forward and backward of each micro-batch it is sent, in order, on its copy
/// of the weights. A panic ends the worker and is handed to the step, which re-raises it.
fn worker(
    copy: K3Mini,
    quantizer: Option<&FakeQuantizer>,
    accumulation: usize,
    jobs: mpsc::Receiver<(usize, Job)>,
    finished: mpsc::Sender<(usize, std::thread::Result<Done>)>,
) {
    for (micro, job) in jobs {
        let started = Instant::now();
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let forward = match quantizer {
                Some(q) => q.apply(&copy),
                None => copy.clone(),
            };
            let out = job(&forward);
            let loss = out.loss / accumulation as f64;
            // The reported loss stays the mode's; the balance term only adds its gradient.
            let balance = out.routers.balance_loss.map(|b| b / accumulation as f64);
            let total = match &balance {
                Some(b) => loss.clone() + b.clone(),
                None => loss.clone(),
            };
            Done {
                grads: GradientsParams::from_grads(total.backward(), &copy),
                loss: loss.detach(),
                balance: balance.map(Tensor::detach),
                expert_load: out.routers.expert_load,
                on_policy: out.on_policy,
                busy_s: started.elapsed().as_secs_f64(),
            }
        }));
        let panicked = out.is_err();
        if finished.send((micro, out)).is_err() || panicked {
            return;
        }
    }
}

/// What this process's micro-batches gave, before the ranks (if any) meet.
struct LocalStep {
    grads: Local,
    figures: Figures,
}

/// A step's figures by micro-batch, flat, so ranks sum them in one all-reduce (each entry is one
/// rank's, the others' zero: the sum is exact):
///
/// ```text
/// [loss_i]·A  [balance_i]·A  [has balance_i]·A  [reverse-KL gap_i]·A  [tokens_i]·A
/// [has gap_i]·A  [busy seconds]·W  [tokens per expert, layer by layer]
/// ```
///
/// with A the micro-batches of the step and W the devices (or ranks).
struct Figures {
    flat: Vec<f64>,
    accumulation: usize,
    workers: usize,
    /// Experts per MoE layer.
    experts: Vec<usize>,
}

impl Figures {
    const PER_MICRO: usize = 6;

    fn new(accumulation: usize, workers: usize, experts: Vec<usize>) -> Self {
        let loads: usize = experts.iter().sum();
        Self {
            flat: vec![0.0; Self::PER_MICRO * accumulation + workers + loads],
            accumulation,
            workers,
            experts,
        }
    }

    /// The step's sums, in micro-batch order: each micro-batch's f32 loss added in f64.
    fn reduced(self, grads: GradientsParams, grad_norm: f64) -> Reduced {
        let (f, a) = (&self.flat, self.accumulation);
        let column = |c: usize| &f[c * a..(c + 1) * a];
        let (loss, balance, has_balance) = (column(0), column(1), column(2));
        let (gap, tokens, has_gap) = (column(3), column(4), column(5));
        let balance = (0..a)
            .filter(|&i| has_balance[i] > 0.0)
            .map(|i| balance[i])
            .sum::<f64>();
        let on_policy = (0..a)
            .filter(|&i| has_gap[i] > 0.0)
            .fold((0.0, 0), |(s, n), i| {
                // Each micro-batch's mean reverse-KL, weighted by its tokens.
                let t = tokens[i] as usize;
                let reverse_kl = gap[i] / (t as f64).max(1.0);
                (s + reverse_kl * t as f64, n + t)
            });
        let (busy_s, mut loads) = f[Self::PER_MICRO * a..].split_at(self.workers);
        let expert_load = self
            .experts
            .iter()
            .map(|&n| {
                let (layer, rest) = loads.split_at(n);
                loads = rest;
                layer.iter().map(|&x| x as usize).collect()
            })
            .collect();
        Reduced {
            grads,
            grad_norm,
            loss: loss.iter().sum::<f64>(),
            balance,
            expert_load,
            on_policy,
            busy_s: busy_s.to_vec(),
        }
    }
}

/// A step's gradients, summed in micro-batch order on each parameter's owner, and its figures.
struct Reduction<'a> {
    model: &'a K3Mini,
    parallel: &'a Parallel,
    /// The step's micro-batches this process trains, in order; "local" indices count in it.
    mine: Vec<usize>,
    /// Micro-batches in the step, this process's and the other ranks'.
    accumulation: usize,
    sum: Sum,
    /// Local micro-batches reduced so far.
    next: usize,
    /// Finished ahead of their turn.
    waiting: BTreeMap<usize, Done>,
    /// By local micro-batch: the f32 figures, read once at the end.
    losses: Vec<Tensor<1>>,
    balances: Vec<(usize, Tensor<1>)>,
    on_policy: Vec<(usize, OnPolicyGap)>,
    expert_load: Vec<ExpertLoad>,
    busy_s: Vec<f64>,
}

/// How a process sums its micro-batches' gradients.
enum Sum {
    /// As they come, in order, on each parameter's owner.
    Running(GradientsAccumulator<K3Mini>),
    /// Kept apart on the host, for the ranks to sum in micro-batch order.
    Each(Vec<Vec<f32>>),
}

impl<'a> Reduction<'a> {
    fn new(
        model: &'a K3Mini,
        parallel: &'a Parallel,
        mine: Vec<usize>,
        accumulation: usize,
        each: bool,
    ) -> Self {
        Self {
            model,
            parallel,
            mine,
            accumulation,
            sum: match each {
                true => Sum::Each(Vec::new()),
                false => Sum::Running(GradientsAccumulator::new()),
            },
            next: 0,
            waiting: BTreeMap::new(),
            losses: Vec::new(),
            balances: Vec::new(),
            on_policy: Vec::new(),
            expert_load: Vec::new(),
            busy_s: vec![0.0; parallel.devices.len()],
        }
    }

    /// Reduces local micro-batches until the first `end` are in, waiting on the workers as
    /// needed. A worker that panicked (libtorch reports a CUDA out-of-memory so) ends the step
    /// with an error, before anything is applied, so the steps before it can be checkpointed.
    fn until(
        &mut self,
        end: usize,
        results: &mpsc::Receiver<(usize, std::thread::Result<Done>)>,
    ) -> Result<()> {
        let main = &self.parallel.devices[0];
        while self.next < end {
            let done = match self.waiting.remove(&self.next) {
                Some(done) => done,
                None => {
                    let (local, out) = results
                        .recv()
                        .expect("every worker reports its micro-batches or its panic");
                    let done = out.map_err(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic without a message".into());
                        let device = &self.parallel.devices[local % self.busy_s.len()];
                        crate::error::Error::Device(format!(
                            "micro-batch {} failed on {device:?}: {what}",
                            self.mine[local]
                        ))
                    })?;
                    if local != self.next {
                        self.waiting.insert(local, done);
                        continue;
                    }
                    done
                }
            };
            let grads = self.to_owners(done.grads);
            match &mut self.sum {
                Sum::Running(accumulator) => accumulator.accumulate(self.model, grads),
                // To the host at once: the device holds one micro-batch's gradients at a time.
                Sum::Each(each) => {
                    let (_, layout) = self.parallel.ranks.as_ref().expect("ordered across ranks");
                    each.push(layout.to_host(self.model, &grads));
                }
            }
            let micro = self.mine[self.next];
            self.losses.push(done.loss.to_device(main));
            self.balances
                .extend(done.balance.map(|b| (micro, b.to_device(main))));
            add_loads(&mut self.expert_load, &done.expert_load);
            self.on_policy.extend(done.on_policy.map(|mut g| {
                g.gap = g.gap.to_device(main);
                (micro, g)
            }));
            let devices = self.busy_s.len();
            self.busy_s[self.next % devices] += done.busy_s;
            self.next += 1;
        }
        Ok(())
    }

    /// Moves each parameter's gradient to the device that owns it.
    fn to_owners(&self, grads: GradientsParams) -> GradientsParams {
        struct Route<'a> {
            grads: GradientsParams,
            parallel: &'a Parallel,
        }
        impl ModuleVisitor for Route<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if let Some(g) = self.grads.remove::<D>(param.id) {
                    let owner = &self.parallel.devices[self.parallel.owners[&param.id]];
                    self.grads.register(param.id, g.to_device(owner));
                }
            }
        }
        if self.parallel.devices.len() == 1 {
            return grads;
        }
        let mut route = Route {
            grads,
            parallel: self.parallel,
        };
        self.model.visit(&mut route);
        route.grads
    }

    /// This process's gradients and its figures by micro-batch, read from the devices once.
    fn finish(self) -> LocalStep {
        let read = |t: Vec<Tensor<1>>| -> Vec<f32> {
            if t.is_empty() {
                return Vec::new();
            }
            Tensor::cat(t, 0)
                .into_data()
                .try_to_vec::<f32>()
                .expect("f32 figures")
        };
        let a = self.accumulation;
        let workers = match &self.parallel.ranks {
            Some((r, _)) => r.world,
            None => self.busy_s.len(),
        };
        let experts = self.expert_load.iter().map(Vec::len).collect();
        let mut figures = Figures::new(a, workers, experts);
        let f = &mut figures.flat;
        for (&micro, loss) in self.mine.iter().zip(read(self.losses)) {
            f[micro] = loss as f64;
        }
        let (at, balances): (Vec<usize>, Vec<Tensor<1>>) = self.balances.into_iter().unzip();
        for (micro, b) in at.into_iter().zip(read(balances)) {
            f[a + micro] = b as f64;
            f[2 * a + micro] = 1.0;
        }
        let (at, gaps): (Vec<(usize, usize)>, Vec<Tensor<1>>) = self
            .on_policy
            .into_iter()
            .map(|(micro, g)| ((micro, g.tokens), g.gap))
            .unzip();
        for ((micro, tokens), gap) in at.into_iter().zip(read(gaps)) {
            f[3 * a + micro] = gap as f64;
            f[4 * a + micro] = tokens as f64;
            f[5 * a + micro] = 1.0;
        }
        let busy = &mut f[Figures::PER_MICRO * a..Figures::PER_MICRO * a + workers];
        match &self.parallel.ranks {
            Some((r, _)) => busy[r.rank] = self.busy_s.iter().sum(),
            None => busy.copy_from_slice(&self.busy_s),
        }
        let loads = self.expert_load.iter().flatten();
        for (x, &n) in f[Figures::PER_MICRO * a + workers..].iter_mut().zip(loads) {
            *x = n as f64;
        }
        LocalStep {
            grads: match self.sum {
                Sum::Running(mut accumulator) => Local::Running(accumulator.grads()),
                Sum::Each(each) => Local::Each(each),
            },
            figures,
        }
    }
}

/// `total += loads`, layer by layer and expert by expert.
fn add_loads(total: &mut Vec<ExpertLoad>, loads: &[ExpertLoad]) {
    if total.is_empty() {
        total.extend(loads.iter().cloned());
        return;
    }
    for (t, l) in total.iter_mut().zip(loads) {
        for (a, b) in t.iter_mut().zip(l) {
            *a += b;
        }
    }
}
