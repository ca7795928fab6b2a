//! Aux-loss-free balancing: the correction bias moves load from busy experts to idle ones.

use crate::common::{device, random_tokens};
use k3mini_student::config::{ModelConfig, MoeConfig};
use k3mini_student::moe::balance_bias;
use k3mini_student::{K3Mini, presets};

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
