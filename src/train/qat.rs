//! Quantisation-aware training: from a chosen step the forward pass sees the weights the export
//! will quantise fake-quantised, and the gradient passes straight through to the f32 weights:
//!
//! ```text
//! w_fq = w + stop_gradient(Q(w) − w)        so  ∂L/∂w = ∂L/∂w_fq   (straight-through estimator)
//! ```
//!
//! `Q` is the export's own byte-exact ggml quantiser and dequantiser, in blocks of 32 along the
//! input dimension (ggml's rows), so the exported file computes with exactly the trained weights:
//! - `q4_0`: every linear weight; `d = max/−8` (max the signed value of largest |x|, stored as
//!   f16), `q = min(15, ⌊x/d + 8.5⌋)`, `x' = (q − 8)·d`.
//! - `mxfp4` (OCP MX, ggml's `MXFP4`): a MoE student's routed experts (K3 trains and ships its
//!   experts so), a dense student's linear weights; a power-of-two scale `2^(⌊log₂ amax⌋ − 2)`
//!   (UE8M0) per block and E2M1 elements `±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`, nearest, ties to the
//!   smaller magnitude, saturating at 6 (ggml's `quantize_row_mxfp4_ref`).

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use k3mini_gguf::GgmlType;
use k3mini_gguf::quantize::fake_quantize;
use k3mini_student::K3Mini;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use crate::recipe::QatFormat;

/// `rows` (row-major, each row a whole number of 32-blocks) as the format stores them, back in f32.
pub fn fake_quantize_rows(rows: &[f32], format: QatFormat) -> Vec<f32> {
    let ty = match format {
        QatFormat::Q4_0 => GgmlType::Q4_0,
        QatFormat::Mxfp4 => GgmlType::MXFP4,
    };
    fake_quantize(ty, rows).expect("whole blocks")
}

/// Fake-quantises a model's `Linear` weights (burn's `[in, out]`, `in` a multiple of 32) for one
/// optimizer step: the quantised values are computed once (the weights do not change within a
/// step, and every replica holds the same ones), shared by the step's worker threads, and each
/// `apply` builds a fresh straight-through graph over them, since every micro-batch's backward
/// consumes its own.
pub struct FakeQuantizer {
    format: QatFormat,
    /// Quantised values of each weight, `[out, in]` row-major, by parameter.
    cache: Mutex<HashMap<ParamId, Arc<Vec<f32>>>>,
}

impl FakeQuantizer {
    pub fn new(format: QatFormat) -> Self {
        Self {
            format,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The model whose quantised weights (see the module's doc) are fake-quantised (gradients
    /// reach the original weights).
    pub fn apply(&self, model: &K3Mini) -> K3Mini {
        let cfg = &model.config;
        let has_experts = (0..cfg.n_layers).any(|i| cfg.is_moe_layer(i));
        let experts_only = self.format == QatFormat::Mxfp4 && has_experts;
        model.clone().map(&mut FakeQuant {
            quantizer: self,
            experts_only,
            containers: Vec::new(),
        })
    }
}

struct FakeQuant<'a> {
    quantizer: &'a FakeQuantizer,
    /// Quantise the routed experts and nothing else (MXFP4 of a MoE student).
    experts_only: bool,
    /// Container types entered, innermost last.
    containers: Vec<String>,
}

impl ModuleMapper for FakeQuant<'_> {
    fn enter_module(&mut self, _name: &str, container_type: &str) {
        self.containers.push(container_type.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.containers.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let container = self.containers.last().map(String::as_str);
        // burn's Linear stores `[in, out]`: ggml's rows (along the input) are its transpose's.
        // The experts are stacked `[E, out, in]`: their rows already run along the input.
        let transposed = match (container, D, self.experts_only) {
            (Some("Struct:Linear"), 2, false) => true,
            (Some("Struct:Experts"), 3, true) => false,
            _ => return param,
        };
        let (format, id) = (self.quantizer.format, param.id);
        let cache = &self.quantizer.cache;
        param.map(|w| {
            let dims = w.dims();
            let d_in = if transposed { dims[0] } else { dims[D - 1] };
            if d_in % 32 != 0 {
                return w;
            }
            let rows_of = |w: Tensor<D>| {
                let w = if transposed { w.transpose() } else { w };
                w.into_data().convert::<f32>().try_into_vec::<f32>()
            };
            let cached = cache
                .lock()
                .expect("no panic holds the cache")
                .get(&id)
                .cloned();
            let q = cached.unwrap_or_else(|| {
                // Outside the lock: two workers may both quantise a weight, to the same values.
                let rows = rows_of(w.clone()).expect("f32 weights");
                let q = Arc::new(fake_quantize_rows(&rows, format));
                let mut cache = cache.lock().expect("no panic holds the cache");
                cache.entry(id).or_insert(q).clone()
            });
            let q: Tensor<D> = if transposed {
                Tensor::<2>::from_data(TensorData::new(q.to_vec(), [dims[1], dims[0]]), &w.device())
                    .transpose()
                    .reshape(dims)
            } else {
                Tensor::from_data(TensorData::new(q.to_vec(), dims), &w.device())
            };
            w.clone() + (q - w).detach()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::Module;
    use burn::optim::GradientsParams;
    use burn::tensor::{Device, Int};

    #[test]
    fn mxfp4_rounds_to_e2m1_times_a_power_of_two() {
        // amax 6 → scale 2^(2 − 2) = 1: the grid itself; ties go to the smaller magnitude.
        let mut x = vec![0.0f32; 32];
        x[..8].copy_from_slice(&[6.0, -1.4, 0.74, 2.6, 2.5, -5.0, 0.25, 0.2]);
        let q = fake_quantize_rows(&x, QatFormat::Mxfp4);
        assert_eq!(&q[..8], &[6.0, -1.5, 0.5, 3.0, 2.0, -4.0, 0.0, 0.0]);
        // amax 7.9 saturates at 6; amax 0.3 → scale 2^(−2 − 2), values on the grid times it.
        x[0] = 7.9;
        assert_eq!(fake_quantize_rows(&x, QatFormat::Mxfp4)[0], 6.0);
        let y: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.3 / 16.0).collect();
        let s = 2f32.powi(-4);
        for v in fake_quantize_rows(&y, QatFormat::Mxfp4) {
            assert!(
                (v / s).fract() == 0.0 || (2.0 * v / s).fract() == 0.0,
                "{v}"
            );
        }
    }

    #[test]
    fn mxfp4_of_a_moe_student_quantises_its_experts_alone() {
        let device = Device::default();
        let overrides = "vocab_size = 256\nd_model = 64\nn_layers = 4\nn_heads = 2\n\
                         ffn_hidden = 128\n[kda]\nhead_dim = 32\ngate_rank = 32\n[mla]\n\
                         kv_lora_rank = 32\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\n\
                         v_head_dim = 16\n[moe]\nnum_experts = 4\ntop_k = 2\nexpert_hidden = 32"
            .parse()
            .unwrap();
        let cfg = k3mini_student::presets::resolve("k3-mini-moe", &overrides).unwrap();
        let model = K3Mini::new(&cfg, &device).unwrap();
        let fq = FakeQuantizer::new(QatFormat::Mxfp4).apply(&model);
        let values = |t: Tensor<3>| -> Vec<f32> { t.into_data().try_into_vec().unwrap() };
        let layer = cfg.moe.as_ref().unwrap().first_dense_layers;
        use k3mini_student::model::Ffn;
        let (Ffn::Moe(moe), Ffn::Moe(moe_q)) =
            (&model.model.layers[layer].mlp, &fq.model.layers[layer].mlp)
        else {
            panic!("layer {layer} is a MoE layer");
        };
        // Each expert's down_proj row [E, d, I] (along I, its input) is one MXFP4 block.
        let w = values(moe.experts.down_proj.val());
        assert_eq!(
            values(moe_q.experts.down_proj.val()),
            fake_quantize_rows(&w, QatFormat::Mxfp4)
        );
        assert_ne!(w, values(moe_q.experts.down_proj.val()));
        // The head, a linear weight, is left alone.
        assert_eq!(
            model.lm_head.weight.val().into_data(),
            fq.lm_head.weight.val().into_data()
        );
    }

    #[test]
    fn the_gradient_passes_straight_through_to_the_f32_weights() {
        let device = Device::default().autodiff();
        let overrides = "vocab_size = 256\nd_model = 64".parse().unwrap();
        let cfg = k3mini_student::presets::resolve("tiny", &overrides).unwrap();
        device.seed(5);
        let model = K3Mini::new(&cfg, &device).unwrap();
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new((0..32).map(|i| (i * 7 % 256) as i64).collect(), [2, 16]),
            &device,
        );
        for format in [QatFormat::Q4_0, QatFormat::Mxfp4] {
            // The STE model, and a model whose weights simply are the quantised values.
            let fq = FakeQuantizer::new(format).apply(&model);
            let loss = fq.forward(ids.clone()).powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let hard = fq.clone().valid();
            let hard = K3Mini::new(&cfg, &device)
                .unwrap()
                .load_record(hard.into_record());
            let loss_hard = hard.forward(ids.clone()).powi_scalar(2).mean();
            let grads_hard = GradientsParams::from_grads(loss_hard.backward(), &hard);
            let g = |grads: &GradientsParams, m: &K3Mini| -> Vec<f32> {
                grads
                    .get::<2>(m.lm_head.weight.id)
                    .unwrap()
                    .into_data()
                    .try_into_vec()
                    .unwrap()
            };
            let (a, b) = (g(&grads, &model), g(&grads_hard, &hard));
            let worst = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-6, "{format:?}: {worst}");
            // And the quantised weights differ from the f32 ones (the check is not vacuous).
            let w: Vec<f32> = model
                .lm_head
                .weight
                .val()
                .into_data()
                .try_into_vec()
                .unwrap();
            let wq: Vec<f32> = fq.lm_head.weight.val().into_data().try_into_vec().unwrap();
            assert!(w.iter().zip(&wq).any(|(x, y)| x != y));
        }
    }

    #[test]
    fn a_chunked_head_gives_the_fake_quantised_heads_gradients() {
        use k3mini_student::head::{HeadChunks, head_loss};
        use k3mini_student::loss::cross_entropy;
        let device = Device::default().autodiff();
        let overrides = "vocab_size = 256\nd_model = 64".parse().unwrap();
        let cfg = k3mini_student::presets::resolve("tiny", &overrides).unwrap();
        device.seed(7);
        let model = K3Mini::new(&cfg, &device).unwrap();
        let ids = Tensor::<2, Int>::from_data(
            TensorData::new((0..48).map(|i| (i * 11 % 256) as i64).collect(), [2, 24]),
            &device,
        );
        let targets = ids.clone().narrow(1, 1, 23).reshape([46]);
        let quantizer = FakeQuantizer::new(QatFormat::Q4_0);
        // Gradients reaching the f32 weights: the head's (through the STE) and the embedding's.
        let grads = |chunks| {
            // A fake-quantised model per backward, as training makes one per micro-batch.
            let fq = quantizer.apply(&model);
            let hidden = fq.trunk(ids.clone(), None).predicting();
            let loss = head_loss(&fq, hidden, chunks, |logits, r| {
                cross_entropy(logits, targets.clone().narrow(0, r.start, r.len())).sum() / 46.0
            });
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let take = |g: Tensor<2>| -> Vec<f32> { g.into_data().try_into_vec().unwrap() };
            (
                take(grads.get::<2>(model.lm_head.weight.id).unwrap()),
                take(grads.get::<2>(model.model.embed_tokens.weight.id).unwrap()),
            )
        };
        let (head, embed) = grads(HeadChunks::Whole);
        let (head_c, embed_c) = grads(HeadChunks::Tokens(5));
        for (name, a, b) in [("lm_head", head_c, head), ("embed", embed_c, embed)] {
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                scale > 0.0 && worst <= 1e-5 * scale,
                "{name}: {worst} of {scale}"
            );
        }
    }
}
