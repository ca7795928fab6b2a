//! AdamW with decoupled weight decay on matrices only, and global-norm gradient clipping.
//!
//! ```text
//! m ← β1 m + (1 − β1) g,   v ← β2 v + (1 − β2) g²
//! θ ← θ (1 − lr·λ) − lr · m̂ / (sqrt(v̂) + ε)          λ = 0 for norms, biases, decay/gate vectors
//! clipping:  g ← g · min(1, c / ‖g‖₂)                 ‖g‖₂ over ALL parameters together
//! ```
//! burn's own AdamW defaults (ε 1e-5, λ 1e-4) differ from PyTorch's, so every field is set from the recipe.

use crate::recipe::OptimConfig;
use burn::module::{Module, ModuleVisitor, Param, ParamGroup, ParamId};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;

fn adamw(cfg: &OptimConfig, weight_decay: f64) -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(cfg.betas[0] as f32)
        .with_beta_2(cfg.betas[1] as f32)
        .with_epsilon(cfg.eps as f32)
        .with_weight_decay(weight_decay as f32)
        .with_cautious_weight_decay(false)
        .with_amsgrad(false)
        .with_grad_clipping(None)
}

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

/// The optimizer: AdamW with `weight_decay` on matrices, a second AdamW group without it.
pub fn build_optimizer<M: Module>(cfg: &OptimConfig, module: &M) -> ModuleOptimizer {
    adamw(cfg, cfg.weight_decay).init().with_group(
        ParamGroup::from_ids(no_decay_params(module)),
        adamw(cfg, 0.0).build(),
        None,
    )
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
    if norm > max_norm && norm.is_finite() {
        scale_grads(module, grads, max_norm / norm);
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Int, TensorData};
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
        let mut optim = build_optimizer(&cfg(), &model);
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
}
