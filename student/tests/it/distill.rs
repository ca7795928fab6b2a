//! Every distillation objective against an independent float64 numpy reference
//! (scripts/golden/distill_losses.py): the loss value, and the gradient with respect to the
//! student's logits against the reference's central finite differences.
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_student::distill::{
    Objective, TeacherTopK, masked_mean, objective_per_position, on_policy_per_position, router_kl,
    sample_targets,
};
use serde_json::Value;

fn golden() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/golden/distill_losses.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

fn objective(kind: &str, param: Option<f64>) -> Objective {
    match kind {
        "ce" => Objective::CrossEntropy,
        "forward_kl" => Objective::ForwardKl,
        "topk_kl" => Objective::TopkKl,
        "topk_kl_renormalised" => Objective::TopkKlRenormalised,
        "reverse_kl" => Objective::ReverseKl,
        "jsd" => Objective::Jsd {
            beta: param.unwrap(),
        },
        "skew_kl" => Objective::SkewKl {
            alpha: param.unwrap(),
        },
        "skew_reverse_kl" => Objective::SkewReverseKl {
            alpha: param.unwrap(),
        },
        "sampled" => Objective::Sampled { samples: 12 },
        _ => panic!("{kind}"),
    }
}

/// Worst |a − b| relative to the largest |b|.
fn worst(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

#[test]
fn objectives_match_the_numpy_reference_in_value_and_gradient() {
    let g = golden();
    let (n, v, k) = (
        g["n"].as_u64().unwrap() as usize,
        g["v"].as_u64().unwrap() as usize,
        g["k"].as_u64().unwrap() as usize,
    );
    let device = Device::default().autodiff();
    let logits_data = TensorData::new(floats(&g["logits"]), [n, v]);
    let teacher = TeacherTopK {
        ids: Tensor::<2, Int>::from_data(TensorData::new(ints(&g["ids"]), [n, k]), &device),
        logprobs: Tensor::from_data(TensorData::new(floats(&g["top_logprobs"]), [n, k]), &device),
        sampled: Some(Tensor::from_data(
            TensorData::new(floats(&g["sampled_freq"]), [n, k + 1]),
            &device,
        )),
    };
    let targets = Tensor::<1, Int>::from_data(TensorData::new(ints(&g["targets"]), [n]), &device);
    let mask = Tensor::<1>::from_data(TensorData::new(floats(&g["mask"]), [n]), &device);
    let cases = g["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 19);
    for case in cases {
        let kind = case["kind"].as_str().unwrap();
        let tau = case["tau"].as_f64().unwrap();
        let obj = objective(kind, case["param"].as_f64());
        let logits = Tensor::<2>::from_data(logits_data.clone(), &device).require_grad();
        let loss = masked_mean(
            objective_per_position(obj, logits.clone(), targets.clone(), &teacher, 1.0, tau),
            mask.clone(),
        );
        let value = loss.clone().into_scalar::<f32>() as f64;
        let want = case["loss"].as_f64().unwrap();
        assert!(
            (value - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{kind} τ={tau}: loss {value} vs {want}"
        );
        let grads = loss.backward();
        let grad: Vec<f32> = logits
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_into_vec()
            .unwrap();
        let err = worst(&grad, &floats(&case["grad"]));
        assert!(err < 1e-4, "{kind} τ={tau}: gradient error {err:e}");
    }
    // On-policy: the advantage is a constant; only log q(x_t) carries gradient.
    let op = &g["on_policy"];
    let logits = Tensor::<2>::from_data(logits_data, &device).require_grad();
    let per = on_policy_per_position(
        logits.clone(),
        Tensor::from_data(TensorData::new(ints(&op["sampled"]), [n]), &device),
        Tensor::from_data(
            TensorData::new(floats(&op["teacher_logprobs"]), [n]),
            &device,
        ),
    );
    let loss = masked_mean(per, mask);
    let value = loss.clone().into_scalar::<f32>() as f64;
    assert!((value - op["loss"].as_f64().unwrap()).abs() < 1e-5);
    let grad: Vec<f32> = logits
        .grad(&loss.backward())
        .unwrap()
        .into_data()
        .try_into_vec()
        .unwrap();
    assert!(worst(&grad, &floats(&op["grad"])) < 1e-4);
}

#[test]
fn router_kl_matches_the_numpy_reference_in_value_and_gradient() {
    let g = &golden()["router_kl"];
    let (n, e) = (
        g["mask"].as_array().unwrap().len(),
        g["e"].as_u64().unwrap() as usize,
    );
    let device = Device::default().autodiff();
    let z = Tensor::<2>::from_data(TensorData::new(floats(&g["logits"]), [n, e]), &device)
        .require_grad();
    let target = Tensor::from_data(TensorData::new(floats(&g["target"]), [n, e]), &device);
    let mask = Tensor::from_data(TensorData::new(floats(&g["mask"]), [n]), &device);
    let scores = burn::tensor::activation::sigmoid(z.clone());
    let loss = masked_mean(router_kl(scores, target), mask);
    let value = loss.clone().into_scalar::<f32>() as f64;
    let want = g["loss"].as_f64().unwrap();
    assert!((value - want).abs() < 1e-5, "loss {value} vs {want}");
    let grad: Vec<f32> = z
        .grad(&loss.backward())
        .unwrap()
        .into_data()
        .try_into_vec()
        .unwrap();
    let err = worst(&grad, &floats(&g["grad"]));
    assert!(err < 1e-4, "gradient error {err:e}");
}

#[test]
fn sampled_targets_are_unbiased_frequencies() {
    // A small LCG as the uniform source: the estimator, not the generator, is under test.
    let lcg = |seed: u64| {
        let mut s = seed;
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 11) as f64 / (1u64 << 53) as f64
        }
    };
    let p = [0.5f32, 0.25, 0.15, 0.1, 0.7, 0.1, 0.1, 0.1];
    let t = sample_targets(&p, 4, 20_000, &mut lcg(9));
    for (row, want) in t.chunks(4).zip(p.chunks(4)) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-3);
        for (f, w) in row.iter().zip(want) {
            assert!((f - w).abs() < 0.015, "{row:?} vs {want:?}");
        }
    }
    let few = sample_targets(&p, 4, 12, &mut lcg(9));
    assert!(
        few.iter()
            .all(|f| (f * 12.0 - (f * 12.0).round()).abs() < 1e-4)
    );
    assert_eq!(
        few,
        sample_targets(&p, 4, 12, &mut lcg(9)),
        "same draws, same targets"
    );
}

#[test]
fn alm_chunk_divergence_is_the_bernoulli_kl_and_its_derivative() {
    use k3mini_student::distill::alm_chunk;
    // Direct: KL between Bernoulli(p) and Bernoulli(q), p = e^{t/T − ε}, q = e^{s/T − ε}.
    let direct = |t: f64, s: f64, temp: f64| {
        let (p, q) = ((t / temp - 1e-6).exp(), (s / temp - 1e-6).exp());
        p * (p / q).ln() + (1.0 - p) * ((1.0 - p) / (1.0 - q)).ln()
    };
    for (t, s, temp) in [
        (-2.0, -5.0, 1.0),
        (-0.1, -3.0, 1.0),
        (-40.0, -12.0, 100.0),
        (-3.0, -0.5, 2.0),
    ] {
        let (loss, grad) = alm_chunk(t, s, temp);
        assert!((loss - direct(t, s, temp)).abs() < 1e-9, "{t} {s}: {loss}");
        let h = 1e-5;
        let fd = (alm_chunk(t, s + h, temp).0 - alm_chunk(t, s - h, temp).0) / (2.0 * h);
        assert!(
            (grad - fd).abs() < 1e-6 * fd.abs().max(1.0),
            "{t} {s}: {grad} vs {fd}"
        );
        assert!(loss > 0.0);
    }
    // Zero, with zero gradient, where the student's chunk likelihood is the teacher's.
    for t in [-0.01, -1.0, -30.0] {
        let (loss, grad) = alm_chunk(t, t, 100.0);
        assert!(
            loss.abs() < 1e-12 && grad.abs() < 1e-12,
            "{t}: {loss} {grad}"
        );
    }
    // The student below the teacher is pushed up (a negative derivative), above it down.
    assert!(alm_chunk(-1.0, -4.0, 1.0).1 < 0.0 && alm_chunk(-4.0, -1.0, 1.0).1 > 0.0);
}
