//! Interop with transformers' `KimiLinearForCausalLM`: its config.json maps to a [`ModelConfig`] and its
//! safetensors load into [`K3Mini`] by name. The module tree mirrors transformers' names, so the only
//! entries here are the differences.

use crate::config::{Activation, KdaConfig, KdaKernel, MlaConfig, ModelConfig, MoeConfig};
use crate::model::K3Mini;
use burn::store::{BurnToPyTorchAdapter, ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore};
use serde_json::Value;
use std::path::{Path, PathBuf};

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
                balance_loss_weight: 0.0,
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
        balance_loss_weight: 0.0,
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

/// Loads one transformers-named safetensors file into `model`; every parameter must be present
/// and every tensor used.
pub fn load_hf_safetensors(model: &mut K3Mini, path: &Path) -> Result<(), HfError> {
    load_hf_files(model, &[path.to_path_buf()])
}

/// The weights file of an unsharded model, and the index beside sharded ones (transformers' names).
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Weight files are split past this many bytes (transformers' `max_shard_size` default, 5 GB).
pub const DEFAULT_SHARD_BYTES: u64 = 5_000_000_000;

/// The name of shard `i` (0-based) of `n`, as transformers writes them.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// A store of the safetensors file at `path` in transformers' names and layouts: for saving
/// (`to_hf`) or loading.
fn hf_store(path: &Path, to_hf: bool) -> SafetensorsStore {
    let mut store = SafetensorsStore::from_file(path).skip_enum_variants(true);
    store = match to_hf {
        true => store.overwrite(true).with_to_adapter(BurnToPyTorchAdapter),
        false => store
            .with_from_adapter(PyTorchToBurnAdapter)
            .allow_partial(true),
    };
    for (from, to) in renames(to_hf) {
        store = store.with_key_remapping(from, to);
    }
    store
}

/// A safetensors file's header: the offset where its data starts, and the JSON object that
/// describes each tensor (`dtype`, `shape`, `data_offsets` relative to that start).
pub fn safetensors_header(path: &Path) -> Result<(u64, serde_json::Map<String, Value>), String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| format!("no header: {e}"))?;
    let len = u64::from_le_bytes(len);
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    if len > size.saturating_sub(8) {
        return Err(format!(
            "its header claims {len} bytes of a {size}-byte file"
        ));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).map_err(|e| e.to_string())?;
    let mut map: serde_json::Map<String, Value> =
        serde_json::from_slice(&header).map_err(|e| format!("header: {e}"))?;
    map.remove("__metadata__");
    Ok((8 + len, map))
}

/// Writes the model's weights into `dir` with transformers' names and layouts, a tensor at a time
/// (no second copy of the model in memory): [`WEIGHTS_FILE`], or, when they pass `shard_bytes`,
/// `model-00001-of-0000N.safetensors`… (whole tensors, in module order) and [`WEIGHTS_INDEX`]
/// (`weight_map` tensor → file, `metadata.total_size`). Returns the file names written.
pub fn save_hf_files(model: &K3Mini, dir: &Path, shard_bytes: u64) -> Result<Vec<String>, HfError> {
    let err = |path: &Path, e: String| HfError::Load {
        path: path.display().to_string(),
        message: e,
    };
    // Names (as the store's filter sees them) and sizes, without reading any tensor's data.
    let tensors = model.collect(None, Some(Box::new(BurnToPyTorchAdapter)), true);
    let mut groups: Vec<(Vec<String>, u64)> = Vec::new();
    for t in &tensors {
        let bytes = (t.shape.num_elements() * t.dtype.size()) as u64;
        match groups.last_mut() {
            Some((names, total)) if *total + bytes <= shard_bytes => {
                names.push(t.name.clone());
                *total += bytes;
            }
            _ => groups.push((vec![t.name.clone()], bytes)),
        }
    }
    drop(tensors);
    if groups.len() <= 1 {
        let path = dir.join(WEIGHTS_FILE);
        model
            .save_into(&mut hf_store(&path, true))
            .map_err(|e| err(&path, e.to_string()))?;
        return Ok(vec![WEIGHTS_FILE.into()]);
    }
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut files = Vec::with_capacity(n + 1);
    for (i, (names, _)) in groups.iter().enumerate() {
        let name = shard_file_name(i, n);
        let path = dir.join(&name);
        let mut store = hf_store(&path, true).with_full_paths(names.iter().cloned());
        model
            .save_into(&mut store)
            .map_err(|e| err(&path, e.to_string()))?;
        for (tensor, _) in safetensors_header(&path).map_err(|e| err(&path, e))?.1 {
            weight_map.insert(tensor, Value::String(name.clone()));
        }
        files.push(name);
    }
    let total: u64 = groups.iter().map(|g| g.1).sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    let path = dir.join(WEIGHTS_INDEX);
    let text = serde_json::to_vec_pretty(&index).expect("an index serialises");
    std::fs::write(&path, text).map_err(|e| err(&path, e.to_string()))?;
    files.push(WEIGHTS_INDEX.into());
    Ok(files)
}

/// The safetensors files of a weights directory: [`WEIGHTS_FILE`], or the shards its
/// [`WEIGHTS_INDEX`] names (each must exist).
pub fn hf_weight_files(dir: &Path) -> Result<Vec<PathBuf>, HfError> {
    let index = dir.join(WEIGHTS_INDEX);
    let err = |path: &Path, message: String| HfError::Load {
        path: path.display().to_string(),
        message,
    };
    if !index.is_file() {
        let single = dir.join(WEIGHTS_FILE);
        return match single.is_file() {
            true => Ok(vec![single]),
            false => Err(err(
                dir,
                format!("neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}"),
            )),
        };
    }
    let text = std::fs::read(&index).map_err(|e| err(&index, e.to_string()))?;
    let v: Value = serde_json::from_slice(&text).map_err(|e| err(&index, e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| err(&index, "no weight_map object".into()))?;
    let mut names: Vec<&str> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .filter(|f| !f.contains('/') && !f.contains('\\') && f.ends_with(".safetensors"))
            .ok_or_else(|| {
                err(
                    &index,
                    format!("{tensor}: not a safetensors file in this directory"),
                )
            })?;
        if !names.contains(&file) {
            names.push(file);
        }
    }
    names.sort();
    names
        .into_iter()
        .map(|f| {
            let path = dir.join(f);
            match path.is_file() {
                true => Ok(path),
                false => Err(err(&path, format!("listed in {WEIGHTS_INDEX} but missing"))),
            }
        })
        .collect()
}

/// Loads transformers-named weights from safetensors `files` (one, or a sharded set) into
/// `model`, a tensor at a time from disk: every parameter must be in some file and every tensor
/// of every file must be used.
pub fn load_hf_files(model: &mut K3Mini, files: &[PathBuf]) -> Result<(), HfError> {
    let mut applied = std::collections::BTreeSet::new();
    let mut missing = None::<std::collections::BTreeSet<String>>;
    for path in files {
        let load_err = |message: String| HfError::Load {
            path: path.display().to_string(),
            message,
        };
        if !path.is_file() {
            return Err(load_err("file not found".into()));
        }
        // Partial: a shard holds some of the model; coverage is checked over all of them.
        let mut store = hf_store(path, false);
        let result = model
            .load_from(&mut store)
            .map_err(|e| load_err(e.to_string()))?;
        if !result.errors.is_empty() || !result.unused.is_empty() {
            return Err(load_err(format!(
                "errors {:?}, tensors the model does not have {:?}",
                result.errors, result.unused
            )));
        }
        let here: std::collections::BTreeSet<String> =
            result.missing.into_iter().map(|(p, _)| p).collect();
        missing = Some(match missing {
            None => here,
            Some(m) => m.intersection(&here).cloned().collect(),
        });
        for p in result.applied {
            if !applied.insert(p.clone()) {
                return Err(load_err(format!("{p} is in more than one file")));
            }
        }
    }
    match missing {
        Some(m) if m.is_empty() => Ok(()),
        Some(m) => Err(HfError::Weights(format!("missing {:?}", m))),
        None => Err(HfError::Weights("no weight files".into())),
    }
}
