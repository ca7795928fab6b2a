//! Aux-loss-free balancing: the correction bias moves load from busy experts to idle ones; the
//! sequence-wise balance loss is its definition.

use crate::common::{device, random_tokens};
use burn::tensor::{Distribution, Tensor, TensorData};
use k3mini_student::config::{ModelConfig, MoeConfig};
use k3mini_student::moe::{balance_bias, sequence_balance_loss};
use k3mini_student::{K3Mini, presets};

/// `Σ_i f_i P_i` averaged over sequences, straight from the definition in f64.
fn balance_reference(scores: &[f64], ids: &[i64], b: usize, t: usize, e: usize, k: usize) -> f64 {
    let mut total = 0.0;
    for s in 0..b {
        let mut f = vec![0.0; e];
        let mut p = vec![0.0; e];
        for tok in 0..t {
            let row = &scores[(s * t + tok) * e..][..e];
            let sum: f64 = row.iter().sum();
            for i in 0..e {
                p[i] += row[i] / sum / t as f64;
            }
            for &ex in &ids[(s * t + tok) * k..][..k] {
                f[ex as usize] += e as f64 / (k * t) as f64;
            }
        }
        total += (0..e).map(|i| f[i] * p[i]).sum::<f64>();
    }
    total / b as f64
}

#[test]
fn sequence_balance_loss_is_its_definition() {
    let (b, t, e, k) = (2, 5, 4, 2);
    device().seed(7);
    let tensor = Tensor::<3>::random([b, t, e], Distribution::Uniform(0.05, 0.95), &device());
    let scores: Vec<f64> = tensor.to_data().convert::<f64>().try_into_vec().unwrap();
    // Each token's top-k by score, best first.
    let ids: Vec<i64> = scores
        .chunks(e)
        .flat_map(|row| {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&x, &y| row[y].total_cmp(&row[x]));
            order.into_iter().take(k).map(|i| i as i64)
        })
        .collect();
    let got = sequence_balance_loss(tensor, &ids, k).into_scalar::<f32>() as f64;
    let want = balance_reference(&scores, &ids, b, t, e, k);
    assert!((got - want).abs() < 1e-5, "{got} vs {want}");

    // Even scores and even picks give 1; one expert taking every pick with all the score gives E.
    let even = Tensor::<3>::ones([1, 4, e], &device());
    let spread: Vec<i64> = vec![0, 1, 2, 3, 0, 1, 2, 3];
    let one = sequence_balance_loss(even, &spread, k).into_scalar::<f32>();
    assert!((one - 1.0).abs() < 1e-6, "{one}");
    let mut peaked = vec![1e-6f32; t * e];
    for tok in 0..t {
        peaked[tok * e] = 1.0;
    }
    let peaked = Tensor::<3>::from_data(TensorData::new(peaked, [1, t, e]), &device());
    let all_zero = vec![0i64; t];
    let worst = sequence_balance_loss(peaked, &all_zero, 1).into_scalar::<f32>();
    assert!((worst - e as f32).abs() < 1e-3, "{worst}");
}

#[test]
fn bias_moves_against_the_load() {
    let b = balance_bias(&[0.0, 0.0, 0.0, 0.0], &[10, 2, 4, 0], 0.01);
    assert_eq!(b, vec![-0.01, 0.01, 0.0, 0.01]); // mean load 4
}

#[test]
fn repeated_updates_balance_a_skewed_router() {
    let device = device();
    device.seed(11);
    let moe = MoeConfig {
        num_experts: 4,
        top_k: 1,
        num_shared_experts: 0,
        expert_hidden: 16,
        routed_scaling_factor: 1.0,
        latent_dim: None,
        first_dense_layers: 0,
        bias_update_rate: 0.02,
        balance_loss_weight: 0.0,
    };
    let config = ModelConfig {
        vocab_size: 64,
        n_layers: 1,
        moe: Some(moe),
        ..presets::tiny()
    };
    let mut model = K3Mini::new(&config, &device).unwrap();
    let tokens = random_tokens(4, 64, 64, 3);
    let spread = |load: &[usize]| load.iter().max().unwrap() - load.iter().min().unwrap();
    // Skew the router: 25 updates as if expert 0 were idle put +0.5 on its bias, −0.5 on the others.
    for _ in 0..25 {
        model.update_router_biases(&[vec![0, 100, 100, 100]]);
    }
    let first = model.forward_with(tokens.clone(), None).expert_load;
    assert_eq!(first.len(), 1);
    assert_eq!(
        first[0].iter().sum::<usize>(),
        4 * 64,
        "top-1: every token routed once"
    );
    assert_eq!(
        first[0][0],
        4 * 64,
        "the skewed router sends everything to expert 0: {:?}",
        first[0]
    );
    let mut load = first.clone();
    for _ in 0..200 {
        model.update_router_biases(&load);
        load = model.forward_with(tokens.clone(), None).expert_load;
    }
    assert!(
        spread(&load[0]) <= 64,
        "load {:?} did not balance from {:?}",
        load[0],
        first[0]
    );
}
