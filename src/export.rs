//! `k3mini export`: a trained student in the formats other runtimes load.
//!
//! `--format hf` writes `model.safetensors` (the checkpoint's weights, already under transformers'
//! `KimiLinearForCausalLM` names), `config.json` (`k3mini_student::hf::config_to_kimi_linear`,
//! which refuses what Kimi Linear cannot express) and, where the recipe's tokenizer can be found,
//! `tokenizer.json`. Every file is written atomically. `--with-reference` adds
//! `k3mini_reference.safetensors`: fixed input ids and k3mini's logits for them, which
//! `scripts/interop/check_hf.py` compares with transformers' forward of the export.

use anyhow::{Context, Result, bail};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_student::hf::{config_to_kimi_linear, load_hf_bytes};
use k3mini_student::presets::from_recipe_toml;
use k3mini_student::{K3Mini, ModelConfig};
use std::path::{Path, PathBuf};

/// A checkpoint's model: its config (from the recipe it was trained with) and weights.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    /// transformers-named safetensors.
    pub weights: Vec<u8>,
    /// The recipe text the run was trained with.
    pub recipe: String,
}

/// A checkpoint directory, or a run directory (its newest checkpoint), read and verified.
pub fn open_checkpoint(path: &Path) -> Result<Checkpoint> {
    let dir = if path.join("model.safetensors").is_file() {
        path.to_path_buf()
    } else {
        k3mini_checkpoints::latest(path)?
            .map(|(_, d)| d)
            .with_context(|| {
                format!(
                    "{}: neither a checkpoint nor a run directory with checkpoints",
                    path.display()
                )
            })?
    };
    let mut files = k3mini_checkpoints::read(&dir)?;
    let mut take = |name: &str| {
        files
            .remove(name)
            .with_context(|| format!("checkpoint {}: no {name}", dir.display()))
    };
    let weights = take("model.safetensors")?;
    let recipe = String::from_utf8(take("recipe.toml")?)
        .with_context(|| format!("checkpoint {}: recipe.toml is not UTF-8", dir.display()))?;
    let config = from_recipe_toml(&recipe)
        .map_err(|e| anyhow::anyhow!("checkpoint {}: recipe.toml: {e}", dir.display()))?;
    Ok(Checkpoint {
        dir,
        config,
        weights,
        recipe,
    })
}

/// The student tokenizer named by the recipe, where it can be found from here: a built-in
/// vocabulary, a built-in teacher's (`tokenizer = "teacher"`), or a file relative to the working
/// directory.
pub fn recipe_tokenizer(recipe: &str) -> Option<Tokenizer> {
    let table: toml::Table = recipe.parse().ok()?;
    let spec = table.get("data")?.get("tokenizer")?.as_str()?;
    if spec == crate::recipe::TEACHER_TOKENIZER {
        let model = table.get("teacher")?.get("model")?.as_str()?;
        let file = k3mini_checkpoints::gguf::GgufFile::open(&crate::teachers::resolve(model).ok()?)
            .ok()?;
        return k3mini_teacher::gguf::load_tokenizer(&file)
            .ok()
            .map(|t| t.0);
    }
    Tokenizer::load(spec).ok()
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// The model, loaded from a checkpoint's weights.
pub fn load_model(ck: &Checkpoint, device: &Device) -> Result<K3Mini> {
    let mut model = K3Mini::new(&ck.config, device)?;
    load_hf_bytes(&mut model, ck.weights.clone())
        .map_err(|e| anyhow::anyhow!("checkpoint {}: {e}", ck.dir.display()))?;
    Ok(model)
}

/// Writes the Hugging Face export into `out`; returns the files written.
pub fn export_hf(
    ck: &Checkpoint,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
    with_reference: bool,
) -> Result<Vec<PathBuf>> {
    let id = |names: &[&str]| tokenizer.and_then(|t| names.iter().find_map(|n| t.token_id(n)));
    let special = [
        id(&["<|im_start|>", "<s>", "<|begin_of_text|>"]),
        id(&["<|im_end|>", "</s>", "<|endoftext|>", "<|end_of_text|>"]),
        id(&["<|endoftext|>", "<pad>"]),
    ];
    let config = config_to_kimi_linear(&ck.config, special)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        let path = out.join(name);
        write_atomic(&path, bytes)?;
        written.push(path);
        Ok(())
    };
    put("model.safetensors", &ck.weights)?;
    put(
        "config.json",
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    if with_reference {
        put("k3mini_reference.safetensors", &reference_logits(ck)?)?;
    }
    if let Some(t) = tokenizer {
        let path = out.join("tokenizer.json");
        t.save(&path)?;
        written.push(path);
    }
    Ok(written)
}

/// Fixed input ids (two rows of 40, seeded) and k3mini's logits for them, as safetensors.
fn reference_logits(ck: &Checkpoint) -> Result<Vec<u8>> {
    let device = Device::default();
    let model = load_model(ck, &device)?;
    let (rows, t) = (2usize, 40usize);
    let mut state = 0x5EED_u64;
    let ids: Vec<i64> = (0..rows * t)
        .map(|_| (k3mini_data::pack::splitmix64(&mut state) % ck.config.vocab_size as u64) as i64)
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [rows, t]), &device);
    let logits: Vec<f32> = model
        .forward(tokens)
        .into_data()
        .try_into_vec()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let v = ck.config.vocab_size;
    let to_bytes = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        f(&mut b);
        b
    };
    let id_bytes = to_bytes(&|b| {
        ids.iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
    });
    let logit_bytes = to_bytes(&|b| {
        logits
            .iter()
            .for_each(|x| b.extend_from_slice(&x.to_le_bytes()))
    });
    let views = [
        (
            "input_ids",
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::I64,
                vec![rows, t],
                &id_bytes,
            )?,
        ),
        (
            "logits",
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![rows, t, v],
                &logit_bytes,
            )?,
        ),
    ];
    Ok(safetensors::serialize(views, None)?)
}

/// Refuses an output path that would overwrite the checkpoint itself.
pub fn check_out(ck: &Checkpoint, out: &Path) -> Result<()> {
    if out.canonicalize().ok() == Some(ck.dir.canonicalize()?) {
        bail!("--out {} is the checkpoint itself", out.display());
    }
    Ok(())
}
