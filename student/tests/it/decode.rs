//! Incremental decoding: prefill then token-by-token decode equals the full forward, for every mixer,
//! FFN and residual variant.

use crate::common::{device, max_abs_diff, random_tokens};
use burn::tensor::Tensor;
use k3mini_student::config::{Activation, AttnResConfig, ModelConfig, MoeConfig};
use k3mini_student::{K3Mini, presets};

fn check(config: &ModelConfig, prefill: usize, total: usize) {
    let device = device();
    device.seed(5);
    let model = K3Mini::new(config, &device).unwrap();
    let tokens = random_tokens(2, total, config.vocab_size, 9);
    let full = model.forward(tokens.clone()); // [2, total, V]

    let mut state = model.empty_state(2, &device);
    let mut got = vec![
        model
            .forward_with(tokens.clone().narrow(1, 0, prefill), Some(&mut state))
            .logits,
    ];
    for t in prefill..total {
        got.push(
            model
                .forward_with(tokens.clone().narrow(1, t, 1), Some(&mut state))
                .logits,
        );
    }
    assert_eq!(state.position, total);
    let d = max_abs_diff(Tensor::cat(got, 1), full);
    assert!(d < 1e-5, "max |Δlogit| = {d:e}");
}

/// Tiny with a smaller vocabulary (the logits check is over every vocabulary entry).
fn tiny() -> ModelConfig {
    ModelConfig {
        vocab_size: 512,
        ..presets::tiny()
    }
}

#[test]
fn kda_mla_hybrid() {
    check(&tiny(), 13, 24);
}

#[test]
fn prefill_longer_than_a_chunk() {
    check(
        &ModelConfig {
            kda: k3mini_student::config::KdaConfig {
                chunk_size: 16,
                ..tiny().kda
            },
            ..tiny()
        },
        37,
        45,
    );
}

#[test]
fn k3_features_safe_gate_full_rank_gate_q_lora_gated_mla_situ() {
    let mut c = tiny();
    c.kda.gate_rank = None;
    c.kda.gate_lower_bound = Some(-5.0);
    c.mla.q_lora_rank = Some(48);
    c.mla.output_gate = true;
    c.activation = Activation::Situ;
    check(&c, 9, 20);
}

#[test]
fn attn_res_full_and_block() {
    for block_size in [1, 2, 4] {
        check(
            &ModelConfig {
                attn_res: Some(AttnResConfig { block_size }),
                ..tiny()
            },
            7,
            15,
        );
    }
}

#[test]
fn moe_and_latent_moe() {
    for latent_dim in [None, Some(64)] {
        let moe = MoeConfig {
            num_experts: 6,
            top_k: 2,
            num_shared_experts: 1,
            expert_hidden: 32,
            routed_scaling_factor: 2.446,
            latent_dim,
            first_dense_layers: 1,
            bias_update_rate: 1e-3,
            balance_loss_weight: 0.0,
        };
        check(
            &ModelConfig {
                moe: Some(moe),
                ..tiny()
            },
            6,
            14,
        );
    }
}
