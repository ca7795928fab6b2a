//! Interop with transformers' `KimiLinearForCausalLM`: its config.json maps to a [`ModelConfig`] and its
//! safetensors load into [`K3Mini`] by name. The module tree mirrors transformers' names, so the only
//! entries here are the differences.

use crate::config::{Activation, KdaConfig, KdaKernel, MlaConfig, ModelConfig, MoeConfig};
use crate::model::K3Mini;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use serde_json::Value;
use std::path::Path;

/// Parameter-name suffixes that differ from transformers': (theirs, ours).
pub const HF_RENAMES: [(&str, &str); 1] = [(".A_log", ".a_log")];

/// Key remappings `(regex, replacement)` between transformers' names and ours, in either direction.
fn renames(to_hf: bool) -> impl Iterator<Item = (String, String)> {
    HF_RENAMES.iter().map(move |&(theirs, ours)| {
        let (from, to) = if to_hf {
            (ours, theirs)
        } else {
            (theirs, ours)
        };
        (format!("{}$", from.replace('.', r"\.")), to.to_string())
    })
}

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("Kimi Linear config: `{field}`: {message}")]
    Config { field: String, message: String },
    #[error("loading {path}: {message}")]
    Load { path: String, message: String },
    /// Weights in memory that do not load into the model, or a model that does not serialise.
    #[error("weights: {0}")]
    Weights(String),
}

fn cfg_err(field: &str, message: impl Into<String>) -> HfError {
    HfError::Config {
        field: field.into(),
        message: message.into(),
    }
}

fn get_usize(v: &Value, field: &str) -> Result<usize, HfError> {
    v.get(field)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| cfg_err(field, "missing or not a non-negative integer"))
}

fn get_str_list(v: &Value, field: &str) -> Result<Vec<String>, HfError> {
    v.get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| cfg_err(field, "missing or not a list"))?
        .iter()
        .map(|x| {
            x.as_str()
                .map(str::to_owned)
                .ok_or_else(|| cfg_err(field, "entries must be strings"))
        })
        .collect()
}

/// A [`ModelConfig`] from a Kimi Linear config.json (explicit `layer_types` / `mlp_layer_types` required).
pub fn config_from_kimi_linear(v: &Value) -> Result<ModelConfig, HfError> {
    let heads = get_usize(v, "num_attention_heads")?;
    if get_usize(v, "linear_num_heads")? != heads {
        return Err(cfg_err(
            "linear_num_heads",
            "k3mini uses one head count for KDA and MLA layers",
        ));
    }
    let pattern: String = get_str_list(v, "layer_types")?
        .iter()
        .map(|t| match t.as_str() {
            "linear_attention" => Ok('K'),
            "full_attention" => Ok('M'),
            other => Err(cfg_err(
                "layer_types",
                format!("unknown layer type {other:?}"),
            )),
        })
        .collect::<Result<_, _>>()?;
    let mlp_types = get_str_list(v, "mlp_layer_types")?;
    let first_dense = mlp_types.iter().take_while(|t| *t == "dense").count();
    if mlp_types[first_dense..].iter().any(|t| t != "sparse") {
        return Err(cfg_err(
            "mlp_layer_types",
            "expected dense layers first, then sparse",
        ));
    }
    let moe = (first_dense < mlp_types.len())
        .then(|| -> Result<MoeConfig, HfError> {
            Ok(MoeConfig {
                num_experts: get_usize(v, "num_local_experts")?,
                top_k: get_usize(v, "num_experts_per_tok")?,
                num_shared_experts: get_usize(v, "n_shared_experts")?,
                expert_hidden: get_usize(v, "moe_intermediate_size")?,
                routed_scaling_factor: v
                    .get("routed_scaling_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(2.446),
                latent_dim: None,
                first_dense_layers: first_dense,
                bias_update_rate: 1e-3,
            })
        })
        .transpose()?;
    let head_dim = get_usize(v, "linear_head_dim")?;
    let config = ModelConfig {
        vocab_size: get_usize(v, "vocab_size")?,
        d_model: get_usize(v, "hidden_size")?,
        n_layers: get_usize(v, "num_hidden_layers")?,
        n_heads: heads,
        layer_pattern: pattern,
        last_layer_mla: false,
        ffn_hidden: get_usize(v, "intermediate_size")?,
        activation: Activation::Swiglu,
        kda: KdaConfig {
            head_dim,
            conv_kernel: get_usize(v, "linear_conv_kernel_dim")?,
            gate_rank: Some(head_dim),
            gate_lower_bound: None,
            chunk_size: 64,
            kernel: KdaKernel::Chunk,
        },
        mla: MlaConfig {
            q_lora_rank: v
                .get("q_lora_rank")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
            kv_lora_rank: get_usize(v, "kv_lora_rank")?,
            qk_nope_head_dim: get_usize(v, "qk_nope_head_dim")?,
            qk_rope_head_dim: get_usize(v, "qk_rope_head_dim")?,
            v_head_dim: get_usize(v, "v_head_dim")?,
            output_gate: false,
        },
        moe,
        attn_res: None,
        rms_eps: v
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5),
        max_seq_len: 4096,
        precision: Default::default(),
    };
    config
        .validate()
        .map_err(|e| cfg_err(&e.field, e.message))?;
    Ok(config)
}

/// The first K3 feature of `cfg` that Kimi Linear cannot express, as (config field, feature name).
pub fn kimi_linear_gap(cfg: &ModelConfig) -> Option<(&'static str, &'static str)> {
    if cfg.attn_res.is_some() {
        Some(("attn_res", "Attention Residuals (AttnRes)"))
    } else if cfg.activation != Activation::Swiglu {
        Some(("activation", "the SiTU activation"))
    } else if cfg.mla.output_gate {
        Some(("mla.output_gate", "the MLA output gate"))
    } else if cfg.kda.gate_lower_bound.is_some() {
        Some(("kda.gate_lower_bound", "a KDA gate lower bound"))
    } else if cfg.kda.gate_rank != Some(cfg.kda.head_dim) {
        Some(("kda.gate_rank", "a KDA gate rank other than head_dim"))
    } else if cfg.moe.as_ref().is_some_and(|m| m.latent_dim.is_some()) {
        Some(("moe.latent_dim", "LatentMoE"))
    } else {
        None
    }
}

/// The Kimi Linear config.json of `cfg`, for transformers' `KimiLinearForCausalLM` (and vLLM /
/// SGLang, which load it natively). Features Kimi Linear cannot express are refused, naming them.
/// `special` holds the tokenizer's (bos, eos, pad) ids where it has them.
pub fn config_to_kimi_linear(
    cfg: &ModelConfig,
    special: [Option<u32>; 3],
) -> Result<Value, HfError> {
    if let Some((field, feature)) = kimi_linear_gap(cfg) {
        return Err(cfg_err(
            field,
            format!(
                "{feature} has no Kimi Linear equivalent (transformers' KimiLinearForCausalLM)"
            ),
        ));
    }
    let kinds = cfg
        .layer_kinds()
        .map_err(|e| cfg_err(&e.field, e.message))?;
    let layer_types: Vec<&str> = kinds
        .iter()
        .map(|k| match k {
            crate::LayerKind::Kda => "linear_attention",
            crate::LayerKind::Mla => "full_attention",
        })
        .collect();
    let mlp_layer_types: Vec<&str> = (0..cfg.n_layers)
        .map(|i| {
            if cfg.is_moe_layer(i) {
                "sparse"
            } else {
                "dense"
            }
        })
        .collect();
    let moe = cfg.moe.clone().unwrap_or(MoeConfig {
        num_experts: 1,
        top_k: 1,
        num_shared_experts: 0,
        expert_hidden: cfg.ffn_hidden,
        routed_scaling_factor: 1.0,
        latent_dim: None,
        first_dense_layers: cfg.n_layers,
        bias_update_rate: 0.0,
    });
    let [bos, eos, pad] = special;
    Ok(serde_json::json!({
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "kv_lora_rank": cfg.mla.kv_lora_rank,
        "q_lora_rank": cfg.mla.q_lora_rank,
        "qk_nope_head_dim": cfg.mla.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
        "v_head_dim": cfg.mla.v_head_dim,
        "linear_num_heads": cfg.n_heads,
        "linear_head_dim": cfg.kda.head_dim,
        "linear_conv_kernel_dim": cfg.kda.conv_kernel,
        "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.num_shared_experts,
        "moe_intermediate_size": moe.expert_hidden,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "rms_norm_eps": cfg.rms_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        // Moonshot's original field names, which vLLM and llama.cpp's converter read.
        "linear_attn_config": {
            "full_attn_layers": kinds.iter().enumerate()
                .filter(|(_, k)| **k == crate::LayerKind::Mla)
                .map(|(i, _)| i + 1)
                .collect::<Vec<_>>(),
            "kda_layers": kinds.iter().enumerate()
                .filter(|(_, k)| **k == crate::LayerKind::Kda)
                .map(|(i, _)| i + 1)
                .collect::<Vec<_>>(),
            "head_dim": cfg.kda.head_dim,
            "num_heads": cfg.n_heads,
            "short_conv_kernel_size": cfg.kda.conv_kernel,
        },
        "first_k_dense_replace": moe.first_dense_layers,
        "num_shared_experts": moe.num_shared_experts,
        "num_experts": moe.num_experts,
    }))
}

/// Loads transformers-named safetensors into `model`; every parameter must be present and used.
pub fn load_hf_safetensors(model: &mut K3Mini, path: &Path) -> Result<(), HfError> {
    let load_err = |message: String| HfError::Load {
        path: path.display().to_string(),
        message,
    };
    if !path.is_file() {
        return Err(load_err("file not found".into()));
    }
    load_hf_store(model, SafetensorsStore::from_file(path)).map_err(load_err)
}

/// [`load_hf_safetensors`] from bytes in memory.
pub fn load_hf_bytes(model: &mut K3Mini, bytes: Vec<u8>) -> Result<(), HfError> {
    load_hf_store(model, SafetensorsStore::from_bytes(Some(bytes))).map_err(HfError::Weights)
}

fn load_hf_store(model: &mut K3Mini, store: SafetensorsStore) -> Result<(), String> {
    let mut store = store
        .with_from_adapter(PyTorchToBurnAdapter)
        .skip_enum_variants(true)
        .allow_partial(false);
    for (from, to) in renames(false) {
        store = store.with_key_remapping(from, to);
    }
    let result = model.load_from(&mut store).map_err(|e| e.to_string())?;
    if !result.errors.is_empty() || !result.missing.is_empty() || !result.unused.is_empty() {
        return Err(format!(
            "errors {:?}, missing {:?}, unused {:?}",
            result.errors, result.missing, result.unused
        ));
    }
    Ok(())
}

/// The model's weights as safetensors bytes with transformers' Kimi Linear names and layouts.
pub fn to_hf_bytes(model: &K3Mini) -> Result<Vec<u8>, HfError> {
    let mut store = SafetensorsStore::from_bytes(None)
        .with_to_adapter(BurnToPyTorchAdapter)
        .skip_enum_variants(true);
    for (from, to) in renames(true) {
        store = store.with_key_remapping(from, to);
    }
    model
        .save_into(&mut store)
        .map_err(|e| HfError::Weights(e.to_string()))?;
    store
        .get_bytes()
        .map_err(|e| HfError::Weights(e.to_string()))
}
