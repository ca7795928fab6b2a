//! Activation checkpointing (each sub-layer, a mixer or a dense FFN, one recompute region that
//! keeps its input) against the same model without it: the loss and every parameter's gradient,
//! packed documents and KDA's chunk padding included, K3's layer features (safe gate, q-LoRA,
//! Gated MLA) on; with MoE layers (not regions) and AttnRes between the sub-layers.

use crate::common::model_config;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_student::K3Mini;
use k3mini_student::loss::cross_entropy;

/// Every float parameter's gradient (empty where it has none), in module order.
struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let g = self.0.get::<D>(param.id);
        self.1.push(g.map_or(Vec::new(), |g| {
            g.into_data().convert::<f32>().try_into_vec().unwrap()
        }));
    }
}

/// The next-token loss over two packed rows of `t` tokens and every weight's gradient (a model
/// built from the same seed each time).
fn run(recipe: &str, t: usize, checkpointing: bool) -> (f32, Vec<Vec<f32>>) {
    let cfg = model_config(recipe);
    let device = &Device::flex().autodiff();
    device.seed(5);
    let model = K3Mini::new(&cfg, device)
        .unwrap()
        .with_checkpointing(checkpointing);
    let ids: Vec<i64> = (0..2 * t).map(|i| ((i * 37 + 11) % 300) as i64).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, t]), device);
    let starts: Vec<f32> = (0..2 * t)
        .map(|i| {
            if [0, 30, t + 7, t + 64].contains(&i) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    let starts = Tensor::<2>::from_data(TensorData::new(starts, [2, t]), device);
    let hidden = model.trunk(tokens.clone(), Some(&starts)).predicting();
    let n = 2 * (t - 1);
    let targets = tokens.narrow(1, 1, t - 1).reshape([n]);
    let loss = cross_entropy(model.head(hidden), targets).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut collect = Collect(&grads, Vec::new());
    model.visit(&mut collect);
    (loss.into_scalar::<f32>(), collect.1)
}

fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let received = |x: &[Vec<f32>]| x.iter().map(|g| !g.is_empty()).collect::<Vec<_>>();
    assert_eq!(
        received(a),
        received(b),
        "the same weights receive gradients"
    );
    assert!(
        received(b).iter().filter(|r| **r).count() > 30,
        "the layers' weights"
    );
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        })
        .fold(0.0, f32::max)
}

#[test]
fn checkpointed_layers_give_the_losses_and_gradients_of_the_plain_ones() {
    let dense = "preset = \"tiny\"\nvocab_size = 300\nd_model = 64\nn_layers = 4\n\
                 [kda]\ngate_rank = 16\ngate_lower_bound = -5.0\n\
                 [mla]\nq_lora_rank = 32\noutput_gate = true\n";
    let moe = "preset = \"tiny\"\nvocab_size = 300\nd_model = 64\nn_layers = 4\n\
               [moe]\nnum_experts = 4\ntop_k = 2\nnum_shared_experts = 1\nexpert_hidden = 32\n\
               [attn_res]\nblock_size = 2\n";
    for (name, recipe) in [("dense", dense), ("moe + attn-res", moe)] {
        let plain = run(recipe, 83, false);
        let checkpointed = run(recipe, 83, true);
        assert_eq!(plain.0, checkpointed.0, "{name}: loss");
        let err = worst_relative(&checkpointed.1, &plain.1);
        assert!(err <= 1e-5, "{name}: gradients differ by {err:e}");
    }
}
