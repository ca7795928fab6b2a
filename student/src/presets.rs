//! Named model shapes. A recipe picks one and may override fields.

use crate::config::{
    Activation, AttnResConfig, ConfigError, KdaConfig, KdaKernel, MlaConfig, ModelConfig, MoeConfig,
};

/// Every preset name, in size order: the hybrids, and the same-size Transformer twins of the two a
/// laptop trains (`NAME-transformer`, [`transformer_twin`]).
pub const PRESETS: [&str; 6] = [
    "tiny",
    "tiny-transformer",
    "smoke-300m",
    "smoke-300m-transformer",
    "k3-mini-3b",
    "k3-mini-moe",
];

/// The suffix of a Transformer twin's preset name.
const TWIN: &str = "-transformer";

/// Kimi K2/K3 vocabulary size (tiktoken, 163,840 ids).
pub const KIMI_VOCAB: usize = 163_840;
/// SmolLM2 vocabulary size (the local teacher used in CI and the quickstart).
pub const SMOLLM2_VOCAB: usize = 49_152;

/// Looks a preset up by name.
pub fn preset(name: &str) -> Result<ModelConfig, ConfigError> {
    match name {
        "tiny" => Ok(tiny()),
        "tiny-transformer" => Ok(transformer_twin(&tiny())),
        "smoke-300m" => Ok(smoke_300m()),
        "smoke-300m-transformer" => Ok(transformer_twin(&smoke_300m())),
        "k3-mini-3b" => Ok(k3_mini_3b()),
        "k3-mini-moe" => Ok(k3_mini_moe()),
        other => Err(ConfigError {
            field: "preset".into(),
            message: format!(
                "unknown preset {other:?}; known presets: {}",
                PRESETS.join(", ")
            ),
        }),
    }
}

/// The same-size Transformer twin of a hybrid: every layer Gated MLA, the hybrid's own attention
/// (so a comparison isolates KDA against full attention), with the KDA layers' parameters moved
/// into the dense FFNs: `ffn_hidden` grows by the
/// multiple of 32 (ggml's block) that brings the total nearest to the hybrid's. Each FFN column is
/// `3·d` parameters (SwiGLU's and SiTU's gate, up and down) in every dense layer.
pub fn transformer_twin(hybrid: &ModelConfig) -> ModelConfig {
    let mut twin = ModelConfig {
        layer_pattern: "M".into(),
        ..hybrid.clone()
    };
    let total = |c: &ModelConfig| crate::info::param_breakdown(c).total() as f64;
    let dense = (0..twin.n_layers)
        .filter(|&i| !twin.is_moe_layer(i))
        .count();
    if dense > 0 {
        let per_block = (3 * twin.d_model * dense * 32) as f64;
        let blocks = ((total(hybrid) - total(&twin)) / per_block).round() as i64;
        twin.ffn_hidden = (twin.ffn_hidden as i64 + 32 * blocks).max(32) as usize;
    }
    twin
}

fn kimi_linear_kda(head_dim: usize) -> KdaConfig {
    KdaConfig {
        head_dim,
        conv_kernel: 4,
        gate_rank: Some(head_dim),
        gate_lower_bound: None,
        chunk_size: 64,
        kernel: KdaKernel::Chunk,
    }
}

/// Kimi Linear's MLA dimensions (kv_lora 512, nope 128, rope 64, v 128; no q-LoRA, no gate).
fn kimi_linear_mla() -> MlaConfig {
    MlaConfig {
        q_lora_rank: None,
        kv_lora_rank: 512,
        qk_nope_head_dim: 128,
        qk_rope_head_dim: 64,
        v_head_dim: 128,
        output_gate: false,
    }
}

/// CI scale (~3.5M params): 4 layers `KKKM`, Kimi Linear-shaped so it maps onto transformers.
pub fn tiny() -> ModelConfig {
    ModelConfig {
        vocab_size: 8192,
        d_model: 128,
        n_layers: 4,
        n_heads: 2,
        layer_pattern: "KKKM".into(),
        last_layer_mla: true,
        ffn_hidden: 384,
        activation: Activation::Swiglu,
        kda: kimi_linear_kda(64),
        mla: MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 64,
            output_gate: false,
        },
        moe: None,
        attn_res: None,
        rms_eps: 1e-5,
        max_seq_len: 2048,
        precision: Default::default(),
    }
}

/// The nightly smoke (~312M params): Kimi Linear's layer recipe at width 1024, SmolLM2 vocabulary.
pub fn smoke_300m() -> ModelConfig {
    ModelConfig {
        vocab_size: SMOLLM2_VOCAB,
        d_model: 1024,
        n_layers: 16,
        n_heads: 8,
        layer_pattern: "KKKM".into(),
        last_layer_mla: true,
        ffn_hidden: 2816,
        activation: Activation::Swiglu,
        kda: kimi_linear_kda(128),
        mla: kimi_linear_mla(),
        moe: None,
        attn_res: None,
        rms_eps: 1e-5,
        max_seq_len: 4096,
        precision: Default::default(),
    }
}

/// The full dense student (~3.5B): K3's layer features (safe gate, full-rank KDA gate, q-LoRA, Gated
/// MLA) at 32 layers, Kimi vocabulary.
pub fn k3_mini_3b() -> ModelConfig {
    ModelConfig {
        vocab_size: KIMI_VOCAB,
        d_model: 2560,
        n_layers: 32,
        n_heads: 20,
        layer_pattern: "KKKM".into(),
        last_layer_mla: true,
        ffn_hidden: 6912,
        activation: Activation::Swiglu,
        kda: KdaConfig {
            gate_rank: None,
            gate_lower_bound: Some(-5.0),
            ..kimi_linear_kda(128)
        },
        mla: MlaConfig {
            q_lora_rank: Some(1536),
            output_gate: true,
            ..kimi_linear_mla()
        },
        moe: None,
        attn_res: Some(AttnResConfig { block_size: 8 }),
        rms_eps: 1e-5,
        max_seq_len: 131_072,
        precision: Default::default(),
    }
}

/// The small MoE variant (~16B total, ~2.8B active): 64 experts top-6 plus one shared, first layer dense.
pub fn k3_mini_moe() -> ModelConfig {
    ModelConfig {
        vocab_size: KIMI_VOCAB,
        d_model: 2048,
        n_layers: 28,
        n_heads: 16,
        layer_pattern: "KKKM".into(),
        last_layer_mla: true,
        ffn_hidden: 5632,
        activation: Activation::Swiglu,
        kda: kimi_linear_kda(128),
        mla: kimi_linear_mla(),
        moe: Some(MoeConfig {
            num_experts: 64,
            top_k: 6,
            num_shared_experts: 1,
            expert_hidden: 1408,
            routed_scaling_factor: 2.446,
            latent_dim: None,
            first_dense_layers: 1,
            bias_update_rate: 1e-3,
            balance_loss_weight: 0.0,
        }),
        attn_res: None,
        rms_eps: 1e-5,
        max_seq_len: 131_072,
        precision: Default::default(),
    }
}

/// A preset with fields overridden by a TOML table (nested tables merge, e.g. `[model.kda]`).
/// Unknown keys are rejected by name.
pub fn resolve(name: &str, overrides: &toml::Table) -> Result<ModelConfig, ConfigError> {
    // A twin is the twin of its hybrid as the overrides make it (a recipe's vocabulary, say).
    if let Some(hybrid) = name.strip_suffix(TWIN).filter(|_| PRESETS.contains(&name)) {
        if let Some(key) = ["layer_pattern", "ffn_hidden"]
            .into_iter()
            .find(|k| overrides.contains_key(*k))
        {
            return Err(ConfigError {
                field: key.into(),
                message: format!(
                    "is what {name:?} sets (the all-MLA twin of {hybrid:?}, matched to its \
                     parameters): override the hybrid's shape instead"
                ),
            });
        }
        return Ok(transformer_twin(&resolve(hybrid, overrides)?));
    }
    let base = preset(name)?;
    let base = toml::Table::try_from(&base).expect("a config serialises to TOML");
    let mut value = base.clone();
    merge(&mut value, overrides);
    let config = parse_config(value).map_err(|e| {
        // Name the override that does not fit (an unknown key, a wrong type), not the preset.
        culprit(&base, overrides, &[]).unwrap_or_else(|| ConfigError {
            field: "model".into(),
            message: e.message().to_string(),
        })
    })?;
    config.validate()?;
    Ok(config)
}

fn parse_config(table: toml::Table) -> Result<ModelConfig, toml::de::Error> {
    toml::Value::Table(table).try_into()
}

/// The first override (by dotted path) that alone makes `base` fail to parse, with the reason.
fn culprit(base: &toml::Table, overrides: &toml::Table, path: &[&str]) -> Option<ConfigError> {
    for (key, value) in overrides {
        let here: Vec<&str> = path.iter().copied().chain([key.as_str()]).collect();
        if let toml::Value::Table(inner) = value
            && let Some(e) = culprit(base, inner, &here)
        {
            return Some(e);
        }
        // `value` alone, at its path, over the preset.
        let mut single = toml::Table::from_iter([(key.clone(), value.clone())]);
        for k in path.iter().rev() {
            single = toml::Table::from_iter([(k.to_string(), toml::Value::Table(single))]);
        }
        let mut trial = base.clone();
        merge(&mut trial, &single);
        if let Err(e) = parse_config(trial) {
            return Some(ConfigError {
                field: here.join("."),
                message: e.message().to_string(),
            });
        }
    }
    None
}

fn merge(base: &mut toml::Table, overrides: &toml::Table) {
    for (key, value) in overrides {
        match (base.get_mut(key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            _ => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}
