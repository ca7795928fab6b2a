//! Quantisation-aware training: from a chosen step the forward pass sees every linear weight
//! fake-quantised, and the gradient passes straight through to the f32 weights:
//!
//! ```text
//! w_fq = w + stop_gradient(Q(w) − w)        so  ∂L/∂w = ∂L/∂w_fq   (straight-through estimator)
//! ```
//!
//! `Q` quantises blocks of 32 along the input dimension (ggml's rows), as the export will:
//! - `q4_0`: ggml's Q4_0 exactly (`d = max/−8` with max the signed value of largest |x|, stored as
//!   f16; `q = min(15, ⌊x/d + 8.5⌋)`; `x' = (q − 8)·d`), through k3mini's byte-exact quantiser.
//! - `mxfp4` (OCP MX): a power-of-two scale `2^(⌊log₂ amax⌋ − 2)` (UE8M0) per block and E2M1
//!   elements `±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`, rounded to nearest (ties to even), saturating at 6.

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use k3mini_gguf::GgmlType;
use k3mini_gguf::quantize::quantize;
use k3mini_gguf::quants::dequantize;
use k3mini_student::K3Mini;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use crate::recipe::QatFormat;

/// The E2M1 magnitudes.
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The nearest E2M1 magnitude to `y ≥ 0` (ties to the even code), saturating at 6.
fn e2m1(y: f32) -> f32 {
    let mut best = 0;
    for (i, &v) in E2M1.iter().enumerate() {
        let (d, db) = ((y - v).abs(), (y - E2M1[best]).abs());
        if d < db || (d == db && i % 2 == 0 && best % 2 == 1) {
            best = i;
        }
    }
    E2M1[best]
}

/// One MXFP4 block of 32, quantised and dequantised.
fn mxfp4_block(x: &[f32], out: &mut Vec<f32>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        out.extend(std::iter::repeat_n(0.0, x.len()));
        return;
    }
    let e = (amax.log2().floor() as i32 - 2).clamp(-127, 127);
    let scale = (e as f32).exp2();
    out.extend(
        x.iter()
            .map(|&v| v.signum() * e2m1(v.abs() / scale) * scale),
    );
}

/// `rows` (row-major, each row a whole number of 32-blocks) as the format stores them, back in f32.
pub fn fake_quantize_rows(rows: &[f32], format: QatFormat) -> Vec<f32> {
    match format {
        QatFormat::Q4_0 => {
            let q = quantize(GgmlType::Q4_0, rows).expect("whole blocks");
            dequantize(GgmlType::Q4_0, &q, rows.len()).expect("our own blocks")
        }
        QatFormat::Mxfp4 => {
            let mut out = Vec::with_capacity(rows.len());
            for b in rows.chunks(32) {
                mxfp4_block(b, &mut out);
            }
            out
        }
    }
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

    /// The model whose linear weights are fake-quantised (gradients reach the original weights).
    pub fn apply(&self, model: &K3Mini) -> K3Mini {
        model.clone().map(&mut FakeQuant {
            quantizer: self,
            containers: Vec::new(),
        })
    }
}

struct FakeQuant<'a> {
    quantizer: &'a FakeQuantizer,
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
        let in_linear = self.containers.last().is_some_and(|c| c == "Struct:Linear");
        if D != 2 || !in_linear {
            return param;
        }
        let (format, id) = (self.quantizer.format, param.id);
        let cache = &self.quantizer.cache;
        param.map(|w| {
            let [d_in, d_out] = [w.dims()[0], w.dims()[1]];
            if d_in % 32 != 0 {
                return w;
            }
            let cached = cache
                .lock()
                .expect("no panic holds the cache")
                .get(&id)
                .cloned();
            let q = cached.unwrap_or_else(|| {
                // ggml's rows run along the input dimension: quantise w^T [out, in]. Outside the
                // lock: two workers may both quantise a weight, to the same values.
                let rows: Vec<f32> = w
                    .clone()
                    .transpose()
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec()
                    .expect("f32 weights");
                let q = Arc::new(fake_quantize_rows(&rows, format));
                let mut cache = cache.lock().expect("no panic holds the cache");
                cache.entry(id).or_insert(q).clone()
            });
            let q: Tensor<D> =
                Tensor::<2>::from_data(TensorData::new(q.to_vec(), [d_out, d_in]), &w.device())
                    .transpose()
                    .reshape(w.dims());
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
        assert_eq!(e2m1(0.2), 0.0);
        assert_eq!(e2m1(0.3), 0.5);
        assert_eq!(e2m1(2.5), 2.0, "tie between 2 (even code) and 3");
        assert_eq!(e2m1(5.0), 4.0, "tie between 4 (even code) and 6");
        assert_eq!(e2m1(100.0), 6.0, "saturates");
        // amax 6 → scale 2^(2 − 2) = 1: the grid itself.
        let mut x = vec![0.0f32; 32];
        x[..4].copy_from_slice(&[6.0, -1.4, 0.74, 2.6]);
        let q = fake_quantize_rows(&x, QatFormat::Mxfp4);
        assert_eq!(&q[..4], &[6.0, -1.5, 0.5, 3.0]);
        // amax 0.3 → scale 2^(−2 − 2): every value lands on a multiple of the scale.
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
