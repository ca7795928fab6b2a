//! AdamW with decoupled weight decay on matrices only, and global-norm gradient clipping.
//!
//! ```text
//! m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²          (m = (1 − β1) g, v = (1 − β2) g² at t = 1)
//! m̂ = m / (1 − β1^t),      v̂ = v / (1 − β2^t)
//! θ ← θ (1 − lr·λ) − lr · m̂ / (sqrt(v̂) + ε)          λ = 0 for norms, biases, decay/gate vectors
//! clipping:  g ← g · min(1, c / ‖g‖₂)                 ‖g‖₂ over ALL parameters together
//! ```
//!
//! k3mini keeps its own AdamW rather than burn's `ModuleOptimizer` so that the moments can be
//! saved and restored a tensor at a time on the devices that own them
//! ([`k3mini_checkpoints::moments`], which `run_dir` calls); burn's record goes through host memory
//! whole. The arithmetic is burn's, operation for operation (β and ε in f32 as burn holds them), so
//! runs resume and repeat bit for bit across the change; a test steps both side by side (on the CPU).

use crate::recipe::OptimConfig;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use k3mini_checkpoints::moments::Moments;
use std::collections::{HashMap, HashSet};

/// Whether a parameter of this shape is exempt from weight decay: anything with fewer than two
/// non-unit dimensions (norm weights, biases, `dt_bias`, `A_log [1,1,H,1]`, AttnRes queries, router bias).
pub fn is_no_decay(shape: &[usize]) -> bool {
    shape.iter().filter(|&&d| d > 1).count() < 2
}

/// Ids of the parameters exempt from weight decay.
pub fn no_decay_params<M: Module>(module: &M) -> Vec<ParamId> {
    struct Collect(Vec<ParamId>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if is_no_decay(&param.dims()) {
                self.0.push(param.id);
            }
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// AdamW's constants, in the precision burn's AdamW keeps them (f32), so a run's numbers do not
/// move with the optimizer's owner.
#[derive(Clone, Copy, Debug)]
struct Hyper {
    beta_1: f32,
    beta_2: f32,
    eps: f32,
    weight_decay: f32,
}

/// The optimizer: AdamW over every float parameter the gradients cover, each parameter's moments
/// on the device its gradient arrives on (its owner).
pub struct AdamW {
    hyper: Hyper,
    no_decay: HashSet<ParamId>,
    state: HashMap<u64, Moments>,
}

impl AdamW {
    pub fn new<M: Module>(cfg: &OptimConfig, module: &M) -> Self {
        Self {
            hyper: Hyper {
                beta_1: cfg.betas[0] as f32,
                beta_2: cfg.betas[1] as f32,
                eps: cfg.eps as f32,
                weight_decay: cfg.weight_decay as f32,
            },
            no_decay: no_decay_params(module).into_iter().collect(),
            state: HashMap::new(),
        }
    }

    /// One update at `lr` of every parameter of `module` that has a gradient in `grads`, on the
    /// gradient's device.
    pub fn step<M: Module>(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        module.map(&mut Update {
            optim: self,
            grads: &mut grads,
            lr,
        })
    }

    /// Each parameter's moments, by parameter id: what a checkpoint saves
    /// ([`k3mini_checkpoints::moments`]).
    pub fn moments(&self) -> &HashMap<u64, Moments> {
        &self.state
    }

    /// Continues from saved moments (read onto their owners, keyed by the ids the model's
    /// parameters carry).
    pub fn with_moments(mut self, state: HashMap<u64, Moments>) -> Self {
        self.state = state;
        self
    }
}

/// `(m, v, t)` after a step with gradient `g` (all `[n]`), and the update `m̂ / (sqrt(v̂) + ε)`.
/// The operations and their order are burn's AdamW's.
fn moments_step(h: Hyper, g: Tensor<1>, prev: Option<Moments>) -> (Moments, Tensor<1>) {
    let (f1, f2) = (1.0 - h.beta_1, 1.0 - h.beta_2);
    let next = match prev {
        Some(Moments { steps, m, v }) => Moments {
            steps: steps + 1,
            m: m.mul_scalar(h.beta_1).add(g.clone().mul_scalar(f1)),
            v: v.mul_scalar(h.beta_2).add(g.square().mul_scalar(f2)),
        },
        None => Moments {
            steps: 1,
            m: g.clone().mul_scalar(f1),
            v: g.square().mul_scalar(f2),
        },
    };
    let t = next.steps as i32;
    let m_hat = next.m.clone().div_scalar(1f32 - h.beta_1.powi(t));
    let v_hat = next.v.clone().div_scalar(1f32 - h.beta_2.powi(t));
    let delta = m_hat.div(v_hat.sqrt().add_scalar(h.eps));
    (next, delta)
}

struct Update<'a> {
    optim: &'a mut AdamW,
    grads: &'a mut GradientsParams,
    lr: f64,
}

impl ModuleMapper for Update<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let device = grad.device();
        let marks = AutodiffMarks::of(&tensor);
        let tensor = match tensor.device() == device {
            true => tensor,
            false => tensor.to_device(&device),
        }
        .inner();
        let shape = tensor.shape();
        let n = shape.num_elements();
        let prev = self
            .optim
            .state
            .remove(&id.val())
            .map(|s| match s.m.device() == device {
                true => s,
                false => Moments {
                    steps: s.steps,
                    m: s.m.to_device(&device),
                    v: s.v.to_device(&device),
                },
            });
        // [..shape] → [n]: the moments are element-wise, so one flat form serves every rank.
        let (next, delta) = moments_step(self.optim.hyper, grad.reshape([n]), prev);
        self.optim.state.insert(id.val(), next);
        let decay = match self.optim.no_decay.contains(&id) {
            true => 0.0,
            false => self.lr * self.optim.hyper.weight_decay as f64,
        };
        let decayed = match decay == 0.0 {
            true => tensor,
            false => tensor.mul_scalar(1.0 - decay),
        };
        let updated = decayed - delta.reshape(shape).mul_scalar(self.lr);
        Param::from_mapped_value(id, marks.put(id, updated), mapper)
    }
}

/// What autodiff knows of a parameter's tensor, to put back on a new value of it (as burn's
/// optimizers do).
pub(crate) struct AutodiffMarks {
    require_grad: bool,
    checkpointing: Option<burn::tensor::GradientCheckpointingStrategy>,
    distributed: bool,
}

impl AutodiffMarks {
    pub(crate) fn of<const D: usize>(tensor: &Tensor<D>) -> Self {
        Self {
            require_grad: tensor.is_require_grad(),
            checkpointing: tensor.gradient_checkpointing_strategy(),
            distributed: tensor.is_distributed(),
        }
    }

    /// `inner` (a value without autodiff) as parameter `id`'s tensor.
    pub(crate) fn put<const D: usize>(self, id: ParamId, inner: Tensor<D>) -> Tensor<D> {
        let mut t = Tensor::from_inner(inner);
        if let Some(strategy) = self.checkpointing {
            t = t.with_gradient_checkpointing_strategy(strategy);
        }
        if self.require_grad {
            t = t.require_grad();
        }
        if self.distributed {
            t = t.set_distributed(id);
        }
        t
    }
}

/// The global L2 norm of all gradients of `module`'s parameters, wherever each gradient is.
pub fn global_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    struct SumSq<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for SumSq<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let s = g.square().sum();
                // Sharded gradients live on their owners' devices: the partial sums meet on
                // the first one's, in the module's order whatever the device count.
                self.total = Some(match self.total.take() {
                    Some(t) => {
                        let s = s.to_device(&t.device());
                        t + s
                    }
                    None => s,
                });
            }
        }
    }
    let mut v = SumSq { grads, total: None };
    module.visit(&mut v);
    v.total
        .map_or(0.0, |t| (t.into_scalar::<f32>() as f64).sqrt())
}

/// Scales every gradient by `factor`.
pub fn scale_grads<M: Module>(module: &M, grads: &mut GradientsParams, factor: f64) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f64,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g * self.factor);
            }
        }
    }
    module.visit(&mut Scale { grads, factor });
}

/// Clips to a global norm of `max_norm` when it is exceeded. Returns the norm before clipping.
pub fn clip_global_norm<M: Module>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_grad_norm(module, grads);
    clip_to(module, grads, norm, max_norm);
    norm
}

/// Scales `grads`, whose global norm (theirs, or with other ranks' shares) is `norm`, down to
/// `max_norm` when it is exceeded.
pub fn clip_to<M: Module>(module: &M, grads: &mut GradientsParams, norm: f64, max_norm: f64) {
    if norm > max_norm && norm.is_finite() {
        scale_grads(module, grads, max_norm / norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Int, TensorData};
    use k3mini_checkpoints::moments;
    use k3mini_checkpoints::param_ids::param_entries;
    use k3mini_student::{K3Mini, loss::next_token_cross_entropy, presets};

    fn cfg() -> OptimConfig {
        OptimConfig {
            lr: 0.1,
            betas: [0.9, 0.95],
            eps: 1e-8,
            weight_decay: 0.5,
            grad_clip: Some(1.0),
        }
    }

    fn values<const D: usize>(p: &Param<Tensor<D>>) -> Vec<f32> {
        p.val()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn decay_exemptions_follow_shape() {
        assert!(is_no_decay(&[128]) && is_no_decay(&[1, 1, 4, 1]) && is_no_decay(&[1, 64]));
        assert!(!is_no_decay(&[64, 128]) && !is_no_decay(&[8, 64, 32]));
        let model = K3Mini::new(&presets::tiny(), &Device::flex()).unwrap();
        // 2 per layer + final norm; per KDA: dt_bias, A_log, o_norm; per MLA: kv_a_layernorm.
        assert_eq!(no_decay_params(&model).len(), 2 * 4 + 1 + 3 * 3 + 1);
    }

    #[test]
    fn zero_gradients_decay_matrices_only() {
        let device = Device::flex().autodiff();
        let model = K3Mini::new(&presets::tiny(), &device).unwrap();
        let mut optim = AdamW::new(&cfg(), &model);
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 2, 3, 4], [1, 4]), &device);
        // A loss that touches every parameter but has zero gradient: 0 · loss.
        let loss = next_token_cross_entropy(model.forward(tokens.clone()), tokens, None) * 0.0;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let before_q = values(&model.lm_head.weight);
        let before_norm = values(&model.model.norm.weight);
        let model = optim.step(0.1, model, grads);
        let after_q = values(&model.lm_head.weight);
        for (a, b) in after_q.iter().zip(&before_q) {
            assert!(
                (a - b * (1.0 - 0.1 * 0.5)).abs() < 1e-7,
                "matrix decayed by lr·λ"
            );
        }
        assert_eq!(
            values(&model.model.norm.weight),
            before_norm,
            "norm weights are not decayed"
        );
    }

    #[test]
    fn clipping_uses_the_global_norm() {
        let device = Device::flex().autodiff();
        let model = K3Mini::new(&presets::tiny(), &device).unwrap();
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(vec![5i64, 9, 2, 7, 1], [1, 5]), &device);
        let loss = next_token_cross_entropy(model.forward(tokens.clone()), tokens, None) * 1000.0;
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let norm = clip_global_norm(&model, &mut grads, 1.0);
        assert!(norm > 1.0, "a x1000 loss has a large gradient: {norm}");
        let clipped = global_grad_norm(&model, &grads);
        assert!((clipped - 1.0).abs() < 1e-4, "clipped to 1: {clipped}");
        let again = clip_global_norm(&model, &mut grads, 10.0);
        assert!(
            (again - clipped).abs() < 1e-6
                && (global_grad_norm(&model, &grads) - clipped).abs() < 1e-6
        );
    }

    /// burn's AdamW as k3mini built it before keeping its own: the reference.
    fn burns_adamw<M: Module>(cfg: &OptimConfig, module: &M) -> burn::optim::ModuleOptimizer {
        use burn::optim::AdamWConfig;
        let adamw = |weight_decay: f64| {
            AdamWConfig::new()
                .with_beta_1(cfg.betas[0] as f32)
                .with_beta_2(cfg.betas[1] as f32)
                .with_epsilon(cfg.eps as f32)
                .with_weight_decay(weight_decay as f32)
                .with_cautious_weight_decay(false)
                .with_amsgrad(false)
                .with_grad_clipping(None)
        };
        adamw(cfg.weight_decay).init().with_group(
            burn::module::ParamGroup::from_ids(no_decay_params(module)),
            adamw(0.0).build(),
            None,
        )
    }

    fn grads(model: &K3Mini, step: i64, device: &Device) -> GradientsParams {
        let ids: Vec<i64> = (0..6).map(|i| (i * 7 + step * 13) % 60 + 1).collect();
        let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, 6]), device);
        let loss = next_token_cross_entropy(model.forward(tokens.clone()), tokens, None);
        GradientsParams::from_grads(loss.backward(), model)
    }

    /// Every parameter's bits, in module order.
    fn bits(model: &K3Mini) -> Vec<Vec<u32>> {
        struct Bits(Vec<Vec<u32>>);
        impl ModuleVisitor for Bits {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0
                    .push(values(param).into_iter().map(f32::to_bits).collect());
            }
        }
        let mut b = Bits(Vec::new());
        model.visit(&mut b);
        b.0
    }

    #[test]
    fn steps_as_burns_adamw_does_bit_for_bit_and_resumes_from_either_ones_file() {
        let device = Device::flex().autodiff();
        let model = K3Mini::new(&presets::tiny(), &device).unwrap();
        let (mut ours, mut theirs) = (AdamW::new(&cfg(), &model), burns_adamw(&cfg(), &model));
        let initial = bits(&model);
        let (mut a, mut b) = (model.clone(), model);
        for step in 0..3 {
            let lr = 0.01 / (step + 1) as f64;
            let (ga, gb) = (grads(&a, step, &device), grads(&b, step, &device));
            a = ours.step(lr, a, ga);
            b = theirs.step(lr, b, gb);
            assert_eq!(bits(&a), bits(&b), "step {step}");
        }
        assert!(
            bits(&a).iter().zip(&initial).all(|(x, y)| x != y),
            "every parameter moved"
        );
        // Each side's file, read by the other, carries on as the original would.
        let dir = crate::scratch::Scratch::new("adamw").unwrap();
        let (our_file, their_file) = (dir.path().join("ours.bpk"), dir.path().join("theirs.bpk"));
        let params = param_entries(&a);
        moments::write(&our_file, &params, ours.moments()).unwrap();
        theirs.to_record().save(&their_file).unwrap();
        // Each moment is built where its owner says, every parameter's asked once.
        let asked = std::cell::RefCell::new(Vec::new());
        let read = moments::read(&their_file, &params, 3, |id| {
            asked.borrow_mut().push(id);
            Some(device.clone().inner())
        })
        .unwrap();
        let mut ours_from_burn = AdamW::new(&cfg(), &a).with_moments(read);
        let mut expected_ids: Vec<u64> = params.iter().map(|p| p.id).collect();
        let mut asked = asked.into_inner();
        expected_ids.sort();
        asked.sort();
        assert_eq!(asked, expected_ids);
        let record = burn::optim::OptimizerRecord::load(&our_file).unwrap();
        let mut burn_from_ours = burns_adamw(&cfg(), &b).load_record(record);
        let g = |m: &K3Mini| grads(m, 3, &device);
        let expected = bits(&ours.step(0.005, a.clone(), g(&a)));
        assert_eq!(
            bits(&ours_from_burn.step(0.005, a.clone(), g(&a))),
            expected
        );
        assert_eq!(
            bits(&burn_from_ours.step(0.005, b.clone(), g(&b))),
            expected
        );
        assert_eq!(bits(&theirs.step(0.005, b.clone(), g(&b))), expected);
    }
}
