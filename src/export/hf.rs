//! The Hugging Face export (transformers' `KimiLinearForCausalLM`), and the reference logits
//! that the transformers and llama.cpp checks compare against.

use crate::error::{Context, Result};
use crate::run_dir::Checkpoint;
use burn::tensor::{Int, Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_student::hf::{WEIGHTS_FILE, WEIGHTS_INDEX, config_to_kimi_linear};
use k3mini_student::precision::Precision;
use std::path::{Path, PathBuf};

/// Writes the Hugging Face export into `out`; returns the files written.
pub fn export_hf(
    ck: &Checkpoint,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
    with_reference: bool,
) -> Result<Vec<PathBuf>> {
    let ids = tokenizer.map(Tokenizer::special_ids).unwrap_or_default();
    // config.json's eos is where generation stops: the end of a turn, else of the text.
    let special = [ids.bos, ids.end_of_turn.or(ids.eos), ids.pad];
    let config = config_to_kimi_linear(&ck.plan.model, special)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = copy_weights(ck, out)?;
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        let path = out.join(name);
        k3mini_durable::write(&path, bytes)
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
        Ok(())
    };
    put(
        "config.json",
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    if with_reference {
        put(
            "k3mini_reference.safetensors",
            &reference_logits(ck, tokenizer)?,
        )?;
    }
    if let Some(t) = tokenizer {
        let path = out.join("tokenizer.json");
        t.save(&path)?;
        written.push(path);
    }
    Ok(written)
}

/// The checkpoint's weight files as they are — one, or shards with the index transformers reads
/// (the run's `train.weights_shard_bytes`) — each copied through a temporary file, never held in
/// memory; weight files of an earlier export in `out` that this one does not have are removed.
fn copy_weights(ck: &Checkpoint, out: &Path) -> Result<Vec<PathBuf>> {
    let mut sources = ck.weights.clone();
    let index = ck.dir.join(WEIGHTS_INDEX);
    if index.is_file() {
        sources.push(index);
    }
    let names: Vec<String> = sources
        .iter()
        .filter_map(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
        .collect();
    let weight_file = |n: &str| {
        n == WEIGHTS_FILE
            || n == WEIGHTS_INDEX
            || (n.starts_with("model-") && n.contains("-of-") && n.ends_with(".safetensors"))
    };
    for entry in std::fs::read_dir(out).with_context(|| format!("{}", out.display()))? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(n) = name.filter(|n| weight_file(n) && !names.contains(n)) {
            std::fs::remove_file(&path)
                .with_context(|| format!("removing the stale {}", out.join(n).display()))?;
        }
    }
    let mut written = Vec::new();
    for (src, name) in sources.iter().zip(&names) {
        let dst = out.join(name);
        k3mini_durable::write_with(&dst, |f| std::io::copy(&mut std::fs::File::open(src)?, f))
            .with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
        written.push(dst);
    }
    Ok(written)
}

/// Writes [`reference_logits`] to `path` (atomically).
pub fn write_reference(ck: &Checkpoint, tokenizer: Option<&Tokenizer>, path: &Path) -> Result<()> {
    k3mini_durable::write(path, &reference_logits(ck, tokenizer)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// A text with spaces, newlines, punctuation, digits and non-ASCII, for tokenizer checks.
pub const REFERENCE_TEXT: &str =
    "To be, or not to be: that is the question.\n  Whether 'tis nobler — Act III, 1603.\n";

/// Fixed input ids (two rows of 40, seeded) and k3mini's logits for them, as safetensors; with a
/// tokenizer, also `text_ids`, its encoding of the `text` in the metadata.
fn reference_logits(ck: &Checkpoint, tokenizer: Option<&Tokenizer>) -> Result<Vec<u8>> {
    let device = ck.plan.devices.open_main()?;
    // What an f32 engine (transformers, llama.cpp at F32) computes, whatever the run trained at.
    let model = ck.model(&device)?.with_precision(Precision::F32);
    let (rows, t) = (2usize, 40usize);
    let mut state = 0x5EED_u64;
    let ids: Vec<i64> = (0..rows * t)
        .map(|_| {
            (k3mini_data::rng::splitmix64(&mut state) % ck.plan.model.vocab_size as u64) as i64
        })
        .collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids.clone(), [rows, t]), &device);
    let logits: Vec<f32> = model
        .forward(tokens)
        .into_data()
        .try_into_vec()
        .map_err(|e| crate::refused!("{e:?}"))?;
    let v = ck.plan.model.vocab_size;
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
    let text_ids: Option<Vec<u8>> = tokenizer
        .map(|t| t.encode(REFERENCE_TEXT))
        .transpose()?
        .map(|ids| ids.iter().flat_map(|&i| (i as i64).to_le_bytes()).collect());
    let mut views = vec![
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
    let mut metadata = None;
    if let Some(b) = &text_ids {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![b.len() / 8], b)?;
        views.push(("text_ids", view));
        metadata = Some([("text".to_string(), REFERENCE_TEXT.to_string())].into());
    }
    Ok(safetensors::serialize(views, metadata)?)
}
