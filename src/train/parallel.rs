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
//! There are no collectives here: burn 0.22's all-reduce exists only for its CubeCL backends, and
//! libtorch's (`tch`) has none; the reduction and the copies are `to_device` moves, ordered by
//! this thread.

use crate::error::Result;
use crate::recipe::RunPlan;
use crate::run_dir::TrainState;
use crate::train::objective::{Job, OnPolicyGap, StepModel, TrainingObjective};
use crate::train::qat::{FakeQuantizer, QatFormat};
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
}

/// What the micro-batches of a step gave: the summed gradients (each parameter's on its owner)
/// and the step's figures, read from the devices once.
pub struct Reduced {
    pub grads: GradientsParams,
    /// Σ over micro-batches of `loss / accumulation`: the step's mean loss.
    pub loss: f64,
    /// The MoE balance term, the same way.
    pub balance: f64,
    /// Tokens per expert over the step, per MoE layer.
    pub expert_load: Vec<ExpertLoad>,
    /// Σ (reverse-KL estimate · tokens) and tokens over the on-policy micro-batches.
    pub on_policy: (f64, usize),
    /// Seconds of forward and backward per device, the model's first.
    pub busy_s: Vec<f64>,
}

impl Parallel {
    /// `model` on `devices[0]`, a copy of it on each other device, and the parameters shared out
    /// among the devices by bytes.
    pub fn new(model: &K3Mini, devices: Vec<Device>) -> Self {
        let params = param_sizes(model);
        let sizes: Vec<usize> = params.iter().map(|p| p.1).collect();
        let owners = params
            .iter()
            .map(|p| p.0)
            .zip(shard_by_bytes(&sizes, devices.len()))
            .collect();
        let replicas = devices[1..].iter().map(|d| model.clone().fork(d)).collect();
        Self {
            devices,
            owners,
            replicas,
        }
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
        &self,
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
            let mut reduction = Reduction::new(model, self);
            let n = workers.len();
            for micro in 0..accumulation {
                // The device's previous micro-batch is reduced first: then loading (which may
                // sample the student on the first device) overlaps the other devices' work, not
                // that device's own.
                if micro >= n {
                    reduction.until(micro - n + 1, &results)?;
                }
                // Seeds what a micro-batch samples: a function of the step.
                let seed = plan.seed ^ ((state.step * accumulation + micro) as u64 + 1);
                let job = objective.next(&student, seed)?;
                workers[micro % n]
                    .send((micro, job))
                    .expect("a worker runs until its jobs end");
            }
            drop(workers);
            reduction.until(accumulation, &results)?;
            Ok(reduction.finish())
        })
    }

    /// The device that owns parameter `id`: reduces its gradient, holds its AdamW moments.
    pub fn owner(&self, id: ParamId) -> Device {
        let at = self.owners.get(&id).copied().unwrap_or(0);
        self.devices[at].clone()
    }

    /// After the optimizer step (each parameter updated on its owner): the model on the first
    /// device and every replica receive the parameters other devices own.
    pub fn broadcast(&mut self, stepped: K3Mini) -> K3Mini {
        if self.replicas.is_empty() {
            return stepped;
        }
        for (replica, device) in self.replicas.iter_mut().zip(&self.devices[1..]) {
            *replica = stepped.clone().fork(device);
        }
        stepped.fork(&self.devices[0])
    }
}

/// Every float parameter's id and element count, in the module's order.
fn param_sizes(model: &K3Mini) -> Vec<(ParamId, usize)> {
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

/// A step's gradients, summed in micro-batch order on each parameter's owner, and its figures.
struct Reduction<'a> {
    model: &'a K3Mini,
    parallel: &'a Parallel,
    accumulator: GradientsAccumulator<K3Mini>,
    /// Micro-batches reduced so far.
    next: usize,
    /// Finished ahead of their turn.
    waiting: BTreeMap<usize, Done>,
    losses: Vec<Tensor<1>>,
    balances: Vec<Tensor<1>>,
    expert_load: Vec<ExpertLoad>,
    on_policy: Vec<OnPolicyGap>,
    busy_s: Vec<f64>,
}

impl<'a> Reduction<'a> {
    fn new(model: &'a K3Mini, parallel: &'a Parallel) -> Self {
        Self {
            model,
            parallel,
            accumulator: GradientsAccumulator::new(),
            next: 0,
            waiting: BTreeMap::new(),
            losses: Vec::new(),
            balances: Vec::new(),
            expert_load: Vec::new(),
            on_policy: Vec::new(),
            busy_s: vec![0.0; parallel.devices.len()],
        }
    }

    /// Reduces micro-batches until the first `end` are in, waiting on the workers as needed.
    /// A worker that panicked (libtorch reports a CUDA out-of-memory so) ends the step with an
    /// error, before anything is applied, so the steps before it can be checkpointed.
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
                    let (micro, out) = results
                        .recv()
                        .expect("every worker reports its micro-batches or its panic");
                    let done = out.map_err(|panic| {
                        let what = panic
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| panic.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "a panic without a message".into());
                        let device = &self.parallel.devices[micro % self.busy_s.len()];
                        crate::error::Error::Device(format!(
                            "micro-batch {micro} failed on {device:?}: {what}"
                        ))
                    })?;
                    if micro != self.next {
                        self.waiting.insert(micro, done);
                        continue;
                    }
                    done
                }
            };
            let grads = self.to_owners(done.grads);
            self.accumulator.accumulate(self.model, grads);
            self.losses.push(done.loss.to_device(main));
            self.balances
                .extend(done.balance.map(|b| b.to_device(main)));
            add_loads(&mut self.expert_load, &done.expert_load);
            self.on_policy.extend(done.on_policy.map(|mut g| {
                g.gap = g.gap.to_device(main);
                g
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

    /// The summed gradients and the figures: each micro-batch's f32 loss added in f64, in order.
    fn finish(mut self) -> Reduced {
        let read = |t: Vec<Tensor<1>>| -> Vec<f32> {
            if t.is_empty() {
                return Vec::new();
            }
            Tensor::cat(t, 0)
                .into_data()
                .try_to_vec::<f32>()
                .expect("f32 figures")
        };
        let sum = |v: Vec<f32>| v.iter().map(|&x| x as f64).sum::<f64>();
        let (tokens, gaps): (Vec<usize>, Vec<Tensor<1>>) = self
            .on_policy
            .into_iter()
            .map(|g| (g.tokens, g.gap))
            .unzip();
        let on_policy = tokens
            .iter()
            .zip(read(gaps))
            .fold((0.0, 0), |(s, n), (&t, gap)| {
                // Each micro-batch's mean reverse-KL, weighted by its tokens.
                let reverse_kl = gap as f64 / (t as f64).max(1.0);
                (s + reverse_kl * t as f64, n + t)
            });
        Reduced {
            grads: self.accumulator.grads(),
            loss: sum(read(self.losses)),
            balance: sum(read(self.balances)),
            expert_load: self.expert_load,
            on_policy,
            busy_s: self.busy_s,
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
