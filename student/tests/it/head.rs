//! The LM head and loss in token chunks (`k3mini_student::head`) against the whole micro-batch's
//! logits under one graph: the loss value and the gradient of every parameter, for cross-entropy,
//! every distillation objective on sparse top-k targets (tail bucket and sampled targets
//! included), the on-policy loss, f32 and bf16 heads; chunks that do not divide the positions.
use crate::common::model_config;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use k3mini_student::K3Mini;
use k3mini_student::distill::{
    Objective, TeacherTopK, masked_count, masked_share, objective_per_position,
    on_policy_per_position,
};
use k3mini_student::head::{HeadChunks, head_loss};
use k3mini_student::loss::cross_entropy;
use k3mini_student::precision::Precision;

const VOCAB: usize = 300;
const K: usize = 6;

/// Every float parameter's gradient, in module order.
struct Collect<'a> {
    grads: &'a GradientsParams,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            self.out
                .push(g.into_data().convert::<f32>().try_into_vec().unwrap());
        }
    }
}

/// One micro-batch's inputs: rows of tokens, a mask over the predicting positions and a
/// teacher's top-k (distinct ids, logprobs with a tail mass left over), sampled targets.
struct Batch {
    tokens: Tensor<2, Int>,
    targets: Tensor<1, Int>,
    mask: Tensor<1>,
    teacher: TeacherTopK,
    teacher_lp: Tensor<1>,
}

fn batch(device: &Device, rows: usize, t: usize) -> Batch {
    let n = rows * (t - 1);
    let ids: Vec<i64> = (0..rows * t)
        .map(|i| ((i * 37 + 11) % VOCAB) as i64)
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, t]), device);
    let targets = tokens.clone().narrow(1, 1, t - 1).reshape([n]);
    let mask: Vec<f32> = (0..n).map(|i| if i % 5 == 3 { 0.0 } else { 1.0 }).collect();
    let top: Vec<i64> = (0..n * K)
        .map(|i| (((i / K) * 13 + (i % K) * 41) % VOCAB) as i64)
        .collect();
    // Logprobs of a distribution holding ~90% of its mass on the top-k, sorted descending.
    let raw = Tensor::<2>::random([n, K], Distribution::Normal(0.0, 1.0), device);
    let logprobs = burn::tensor::activation::log_softmax(raw, 1) + 0.9f64.ln();
    let sampled = burn::tensor::activation::softmax(
        Tensor::<2>::random([n, K + 1], Distribution::Normal(0.0, 1.0), device),
        1,
    );
    Batch {
        tokens,
        targets,
        mask: Tensor::from_data(TensorData::new(mask, [n]), device),
        teacher: TeacherTopK {
            ids: Tensor::from_data(TensorData::new(top, [n, K]), device),
            logprobs,
            sampled: Some(sampled),
        },
        teacher_lp: Tensor::<1>::random([n], Distribution::Uniform(-6.0, -0.1), device),
    }
}

/// What a training loss consumes from the head, as the training objectives call it.
#[derive(Clone, Copy, Debug)]
enum Loss {
    Objective(Objective),
    OnPolicy,
}

/// The loss of `b` under `model` with the head in `chunks`, and every parameter's gradient.
fn run(model: &K3Mini, b: &Batch, loss: Loss, chunks: HeadChunks) -> (f64, Vec<Vec<f32>>) {
    let hidden = model.trunk(b.tokens.clone(), None).predicting();
    let count = masked_count(b.mask.clone());
    let value = head_loss(model, hidden, chunks, |logits, r| {
        let at = |x: Tensor<1>| x.narrow(0, r.start, r.len());
        let targets = b.targets.clone().narrow(0, r.start, r.len());
        let per = match loss {
            Loss::Objective(Objective::CrossEntropy) => cross_entropy(logits, targets),
            Loss::Objective(o) => {
                objective_per_position(o, logits, targets, &b.teacher.rows(r.clone()), 1.0, 2.0)
            }
            Loss::OnPolicy => on_policy_per_position(logits, targets, at(b.teacher_lp.clone())),
        };
        masked_share(per, at(b.mask.clone()), count.clone())
    });
    let grads = GradientsParams::from_grads(value.backward(), model);
    let mut collect = Collect {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    (value.into_scalar::<f32>() as f64, collect.out)
}

/// Largest |a − b| over the largest |b|, per parameter.
fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len(), "the same parameters receive gradients");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            let diff = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            (diff / scale) as f64
        })
        .fold(0.0, f64::max)
}

fn model(precision: Precision, device: &Device) -> K3Mini {
    let cfg = model_config(&format!(
        "preset = \"tiny\"\nvocab_size = {VOCAB}\nd_model = 64\nn_layers = 4\n"
    ));
    device.seed(11);
    K3Mini::new(&cfg, device).unwrap().with_precision(precision)
}

#[test]
fn chunked_head_losses_and_gradients_equal_the_whole_head() {
    let device = Device::flex().autodiff();
    let losses = [
        Loss::Objective(Objective::CrossEntropy),
        Loss::Objective(Objective::ForwardKl),
        Loss::Objective(Objective::TopkKl),
        Loss::Objective(Objective::TopkKlRenormalised),
        Loss::Objective(Objective::ReverseKl),
        Loss::Objective(Objective::Jsd { beta: 0.3 }),
        Loss::Objective(Objective::SkewKl { alpha: 0.1 }),
        Loss::Objective(Objective::SkewReverseKl { alpha: 0.1 }),
        Loss::Objective(Objective::Sampled { samples: 8 }),
        Loss::OnPolicy,
    ];
    // 2 rows × 23 positions = 46: chunks of 7 leave a short last chunk; 46 is one chunk.
    for precision in [Precision::F32, Precision::Bf16] {
        let model = model(precision, &device);
        let b = batch(&device, 2, 24);
        for loss in losses {
            let (want, want_grads) = run(&model, &b, loss, HeadChunks::Whole);
            assert!(want.is_finite() && want.abs() > 1e-3, "{loss:?}: {want}");
            for chunks in [
                HeadChunks::Tokens(7),
                HeadChunks::Tokens(46),
                HeadChunks::Tokens(1),
            ] {
                let (got, grads) = run(&model, &b, loss, chunks);
                let value_err = (got - want).abs() / want.abs();
                let grad_err = worst_relative(&grads, &want_grads);
                // bf16 rounds each chunk's logits as the whole head's, so values agree as f32's do;
                // but a backend returns each bf16 product in bf16, so the head's weight gradient
                // is Σ_c round(h_cᵀ G_c) rather than round(hᵀ G): within bf16's 2^-8 steps.
                let grad_tol = if precision.is_f32() {
                    1e-5
                } else {
                    2f64.powi(-6)
                };
                assert!(
                    value_err <= 1e-5 && grad_err <= grad_tol,
                    "{precision:?} {loss:?} {chunks:?}: value {value_err:e}, gradient {grad_err:e}"
                );
            }
        }
    }
}

#[test]
fn a_chunked_head_under_evaluation_gives_the_same_value() {
    // No autodiff: the chunks are only summed.
    let device = Device::flex();
    let model = model(Precision::F32, &device);
    let b = batch(&device, 3, 17);
    let value = |chunks| {
        let hidden = model.trunk(b.tokens.clone(), None).predicting();
        let count = masked_count(b.mask.clone());
        head_loss(&model, hidden, chunks, |logits, r| {
            let targets = b.targets.clone().narrow(0, r.start, r.len());
            let mask = b.mask.clone().narrow(0, r.start, r.len());
            masked_share(cross_entropy(logits, targets), mask, count.clone())
        })
        .into_scalar::<f32>() as f64
    };
    let (whole, chunked) = (value(HeadChunks::Whole), value(HeadChunks::Tokens(5)));
    assert!(
        (whole - chunked).abs() <= 1e-5 * whole.abs(),
        "{whole} vs {chunked}"
    );
}

#[test]
fn the_default_chunk_holds_at_most_the_logit_budget() {
    use k3mini_student::head::CHUNK_LOGITS;
    for vocab in [1, 300, 49_152, 163_840, CHUNK_LOGITS * 2] {
        let HeadChunks::Tokens(tokens) = HeadChunks::for_vocab(vocab) else {
            panic!("a default is a chunk size")
        };
        assert!(tokens >= 1);
        assert!(
            tokens == 1 || tokens * vocab <= CHUNK_LOGITS,
            "{vocab}: {tokens}"
        );
    }
    assert_eq!(HeadChunks::for_vocab(163_840), HeadChunks::Tokens(409));
}

#[test]
fn a_loss_that_does_not_read_the_logits_is_a_constant_of_the_head() {
    // A recipe whose only objective is router distillation: every chunk's share is zero.
    let device = Device::flex().autodiff();
    let model = model(Precision::F32, &device);
    let b = batch(&device, 2, 24);
    let hidden = model.trunk(b.tokens.clone(), None).predicting();
    let value = head_loss(&model, hidden.clone(), HeadChunks::Tokens(7), |_, _| {
        Tensor::zeros([1], &device)
    });
    // The step adds a tracked term and differentiates the sum: the head contributes nothing.
    let total = value.clone() + hidden.sum() * 0.0;
    let grads = GradientsParams::from_grads(total.backward(), &model);
    assert_eq!(value.into_scalar::<f32>(), 0.0);
    let head: Vec<f32> = grads
        .get::<2>(model.lm_head.weight.id)
        .map(|g| g.into_data().try_into_vec().unwrap())
        .unwrap_or_default();
    assert!(head.iter().all(|&g| g == 0.0));
}
