//! Presets, validation errors and the analytic parameter counts (checked against real models).

use crate::common::device;
use burn::module::Module;
use k3mini_student::config::{AttnResConfig, ModelConfig, MoeConfig};
use k3mini_student::info::{
    Footprint, GPUS, USABLE_SHARE, active_params, model_info, owned_params, param_breakdown,
    shard_by_bytes, state_size, training_memory,
};
use k3mini_student::presets::{self, preset};
use k3mini_student::{K3Mini, PRESETS};

fn small_variants() -> Vec<ModelConfig> {
    let tiny = presets::tiny();
    let moe = MoeConfig {
        num_experts: 5,
        top_k: 2,
        num_shared_experts: 2,
        expert_hidden: 24,
        routed_scaling_factor: 1.0,
        latent_dim: Some(48),
        first_dense_layers: 2,
        bias_update_rate: 1e-3,
        balance_loss_weight: 0.0,
    };
    let mut k3 = tiny.clone();
    k3.kda.gate_rank = None;
    k3.kda.gate_lower_bound = Some(-5.0);
    k3.mla.q_lora_rank = Some(40);
    k3.mla.output_gate = true;
    k3.attn_res = Some(AttnResConfig { block_size: 2 });
    k3.moe = Some(moe);
    vec![
        tiny.clone(),
        k3,
        ModelConfig {
            n_layers: 7,
            layer_pattern: "KMK".into(),
            ..tiny
        },
    ]
}

#[test]
fn analytic_counts_equal_instantiated_models() {
    for config in small_variants() {
        let model = K3Mini::new(&config, &device()).unwrap();
        assert_eq!(
            param_breakdown(&config).total(),
            model.num_params(),
            "{config:?}"
        );
    }
}

#[test]
fn presets_have_their_advertised_sizes() {
    let total = |name: &str| param_breakdown(&preset(name).unwrap()).total();
    assert!((2_000_000..6_000_000).contains(&total("tiny")));
    assert!((280_000_000..340_000_000).contains(&total("smoke-300m")));
    assert!((3_000_000_000..4_000_000_000).contains(&total("k3-mini-3b")));
    let moe = preset("k3-mini-moe").unwrap();
    assert!((12_000_000_000..20_000_000_000).contains(&param_breakdown(&moe).total()));
    assert!((2_000_000_000..3_000_000_000).contains(&active_params(&moe)));
    for name in PRESETS {
        let c = preset(name).unwrap();
        c.validate().unwrap();
        let kinds = c.layer_kinds().unwrap();
        assert_eq!(
            *kinds.last().unwrap(),
            k3mini_student::LayerKind::Mla,
            "{name}: last layer MLA"
        );
        let mla = kinds
            .iter()
            .filter(|k| **k == k3mini_student::LayerKind::Mla)
            .count();
        let ratio = if name.ends_with("-transformer") { 1 } else { 4 };
        assert_eq!(
            mla * ratio,
            kinds.len(),
            "{name}: 3 KDA : 1 MLA, or all MLA"
        );
    }
}

#[test]
fn transformer_twins_match_their_hybrids_parameters_with_overrides_too() {
    let total = |c: &ModelConfig| param_breakdown(c).total() as f64;
    let overrides: toml::Table = "vocab_size = 49152\nd_model = 64".parse().unwrap();
    for (hybrid, o) in [
        ("tiny", toml::Table::new()),
        ("smoke-300m", toml::Table::new()),
        ("tiny", overrides),
    ] {
        let h = presets::resolve(hybrid, &o).unwrap();
        let t = presets::resolve(&format!("{hybrid}-transformer"), &o).unwrap();
        assert_eq!(t.layer_pattern, "M");
        assert_eq!(
            (t.d_model, t.n_layers, t.vocab_size),
            (h.d_model, h.n_layers, h.vocab_size)
        );
        // Within one 32-column step of the FFN: 3·d·layers·16 parameters either way.
        let step = (3 * h.d_model * h.n_layers * 16) as f64;
        assert!(
            (total(&t) - total(&h)).abs() <= step,
            "{hybrid}: {} vs {}",
            total(&t),
            total(&h)
        );
        assert!(t.ffn_hidden > h.ffn_hidden && t.ffn_hidden % 32 == 0);
    }
    let e = presets::resolve("tiny-transformer", &"ffn_hidden = 64".parse().unwrap()).unwrap_err();
    assert_eq!(e.field, "ffn_hidden");
}

#[test]
fn hybrid_state_is_a_quarter_of_all_mla_at_long_context() {
    let c = preset("k3-mini-3b").unwrap();
    let s = state_size(&c, 131_072);
    assert!(
        s.saving() > 0.74 && s.saving() < 0.75,
        "saving {}",
        s.saving()
    );
    // The KDA part does not grow with context.
    let short = state_size(&c, 1);
    let kda_layers = 24;
    let per_token = (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4 * 8;
    assert_eq!(
        s.hybrid_bytes - short.hybrid_bytes,
        per_token * (131_072 - 1)
    );
    assert!(short.hybrid_bytes > kda_layers * c.n_heads * 128 * 128 * 4);
}

#[test]
fn info_serialises_total_params() {
    let info = model_info("tiny", &presets::tiny(), &Footprint::new(2, 128));
    let json = serde_json::to_value(&info).unwrap();
    assert_eq!(
        json["total_params"].as_u64().unwrap() as usize,
        info.total_params
    );
}

fn field_of(result: Result<impl std::fmt::Debug, k3mini_student::ConfigError>) -> String {
    result.unwrap_err().field
}

/// The field a tiny config modified by `edit` is rejected for.
fn rejected_field(edit: impl FnOnce(&mut ModelConfig)) -> String {
    let mut c = presets::tiny();
    edit(&mut c);
    field_of(c.validate())
}

#[test]
fn bad_configs_name_the_field() {
    assert_eq!(field_of(preset("k3-giant")), "preset");
    assert_eq!(
        rejected_field(|c| c.layer_pattern = "KKXM".into()),
        "layer_pattern"
    );
    assert_eq!(
        rejected_field(|c| c.layer_pattern = "".into()),
        "layer_pattern"
    );
    assert_eq!(rejected_field(|c| c.n_heads = 3), "n_heads");
    assert_eq!(rejected_field(|c| c.d_model = 0), "d_model");
    assert_eq!(
        rejected_field(|c| c.attn_res = Some(AttnResConfig { block_size: 3 })),
        "attn_res.block_size"
    );
    assert_eq!(
        rejected_field(|c| c.kda.gate_lower_bound = Some(2.0)),
        "kda.gate_lower_bound"
    );
    let moe = MoeConfig {
        num_experts: 4,
        top_k: 5,
        num_shared_experts: 0,
        expert_hidden: 8,
        routed_scaling_factor: 1.0,
        latent_dim: None,
        first_dense_layers: 0,
        bias_update_rate: 0.0,
        balance_loss_weight: 0.0,
    };
    assert_eq!(rejected_field(|c| c.moe = Some(moe.clone())), "moe.top_k");
    let wide_latent = MoeConfig {
        top_k: 2,
        latent_dim: Some(4096),
        ..moe
    };
    assert_eq!(
        rejected_field(|c| c.moe = Some(wide_latent)),
        "moe.latent_dim"
    );
    // The model constructor refuses an invalid config instead of panicking.
    assert_eq!(
        field_of(K3Mini::new(
            &ModelConfig {
                n_heads: 3,
                ..presets::tiny()
            },
            &device()
        )),
        "n_heads"
    );
}

#[test]
fn recipes_override_presets_and_reject_unknown_keys() {
    let over = |text: &str| presets::resolve("tiny", &text.parse::<toml::Table>().unwrap());
    let c = over("d_model = 256\n[kda]\nhead_dim = 32\n").unwrap();
    assert_eq!((c.d_model, c.kda.head_dim, c.kda.conv_kernel), (256, 32, 4));
    let err = over("d_modle = 256\n").unwrap_err();
    assert!(err.message.contains("d_modle"), "{err}");
    assert_eq!(over("n_heads = 5\n").unwrap_err().field, "n_heads");
    assert!(presets::resolve("tinyy", &toml::Table::new()).is_err());
}

#[test]
fn kimi_linear_config_round_trips_and_refuses_what_it_cannot_express() {
    use k3mini_student::hf::{config_from_kimi_linear, config_to_kimi_linear};
    for name in ["tiny", "smoke-300m", "k3-mini-moe"] {
        let cfg = k3mini_student::preset(name).unwrap();
        let json = config_to_kimi_linear(&cfg, [Some(1), Some(2), None]).unwrap();
        assert_eq!(json["model_type"], "kimi_linear");
        assert_eq!(json["eos_token_id"], 2);
        let back = config_from_kimi_linear(&json).unwrap();
        assert_eq!(
            back.layer_kinds().unwrap(),
            cfg.layer_kinds().unwrap(),
            "{name}"
        );
        assert_eq!(
            (
                back.vocab_size,
                back.d_model,
                back.n_layers,
                back.ffn_hidden
            ),
            (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.ffn_hidden)
        );
        assert_eq!((&back.mla, &back.moe), (&cfg.mla, &cfg.moe), "{name}");
        assert_eq!(back.kda.head_dim, cfg.kda.head_dim);
    }
    // The full K3 Mini (AttnRes, MLA gate) is kimi-k3 only.
    let e = config_to_kimi_linear(&k3mini_student::preset("k3-mini-3b").unwrap(), [None; 3])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no Kimi Linear equivalent"), "{e}");
}

#[test]
fn the_3b_preset_at_1_x_4096_fits_one_80_gb_gpu_with_checkpointing_only() {
    let c = preset("k3-mini-3b").unwrap();
    let usable = GPUS[1].1 as f64 * USABLE_SHARE;
    let need = |activation_checkpointing| {
        let f = Footprint {
            activation_checkpointing,
            ..Footprint::new(1, 4096)
        };
        training_memory(&c, &f).total() as f64
    };
    assert!(
        need(true) <= usable,
        "{:.1} GiB",
        need(true) / (1u64 << 30) as f64
    );
    assert!(
        need(false) > usable,
        "without checkpointing the trunk's activations do not fit"
    );
    // Summing several micro-batches a step holds the sum beside each micro-batch's gradients.
    let one = training_memory(&c, &Footprint::new(1, 4096));
    let summed = training_memory(
        &c,
        &Footprint {
            micro_batches: 256,
            ..Footprint::new(1, 4096)
        },
    );
    assert_eq!((one.grads, summed.grads), (one.weights, 2 * one.weights));
}

#[test]
fn parameters_shared_by_bytes_load_devices_as_estimated_and_the_3b_fits_eight_80_gb_gpus() {
    // Largest-first sharing of real models' parameters (what training does): the busiest
    // device owns what `owned_params` estimates from the config, within 1%.
    struct Sizes(Vec<usize>);
    impl burn::module::ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<burn::Tensor<D>>) {
            self.0.push(p.dims().iter().product());
        }
    }
    for c in [presets::tiny(), preset("smoke-300m").unwrap()] {
        let mut sizes = Sizes(Vec::new());
        K3Mini::new(&c, &device()).unwrap().visit(&mut sizes);
        for n in [1, 2, 3, 8] {
            let mut held = vec![0usize; n];
            for (size, d) in sizes.0.iter().zip(shard_by_bytes(&sizes.0, n)) {
                held[d] += size;
            }
            let busiest = *held.iter().max().unwrap();
            let estimate = owned_params(&c, n);
            eprintln!(
                "d_model {} on {n}: busiest owns {busiest}, estimated {estimate}",
                c.d_model
            );
            assert_eq!(held.iter().sum::<usize>(), sizes.0.iter().sum::<usize>());
            assert!(
                (busiest as f64 / estimate as f64 - 1.0).abs() <= 0.01,
                "{n} devices: {busiest} against {estimate}"
            );
        }
    }
    // The 3B recipe's 1 x 4096 micro-batches with checkpointing, one per device on eight:
    // each device fits 80 GB with the optimizer state sharded.
    let c = preset("k3-mini-3b").unwrap();
    let f = Footprint {
        activation_checkpointing: true,
        replicas: 8,
        ..Footprint::new(1, 4096)
    };
    let m = training_memory(&c, &f);
    let usable = GPUS[1].1 as f64 * USABLE_SHARE;
    assert!(
        m.total() as f64 <= usable,
        "{:.1} GiB",
        m.total() as f64 / (1u64 << 30) as f64
    );
    assert_eq!(m.adamw, 2 * 4 * owned_params(&c, 8));
}
