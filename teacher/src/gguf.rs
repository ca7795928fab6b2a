//! A llama-architecture GGUF file → [`Llama`] weights (dequantised to f32) and its tokenizer.
//!
//! Tensor names (llama.cpp): `token_embd`, `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
//! ffn_norm, ffn_gate, ffn_up, ffn_down}`, `output_norm`, `output` (absent when tied). A 2-D
//! tensor with `ne = [in, out]` is row-major `[out, in]`, as PyTorch stores it.

use crate::TeacherError;
use crate::llama::{Llama, LlamaConfig, LlamaLayer};
use burn::tensor::{Device, Tensor, TensorData};
use k3mini_data::Tokenizer;
use k3mini_data::tokenizer::{GGUF_PRE_TOKENIZERS, PreTokenizer};
use k3mini_gguf::{GgufFile, Value};
use std::path::Path;

/// What a GGUF says about its tokenizer besides the vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerMeta {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

fn err(path: &Path, message: impl Into<String>) -> TeacherError {
    TeacherError::Load {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Reads the model configuration of a `general.architecture = "llama"` file.
pub fn llama_config(f: &GgufFile) -> Result<LlamaConfig, TeacherError> {
    let arch = f.require("general.architecture", Value::as_str)?;
    if arch != "llama" {
        return Err(err(
            &f.path,
            format!("architecture {arch:?} is not supported as a teacher (llama only)"),
        ));
    }
    let int = |key: &str| -> Result<usize, TeacherError> {
        Ok(f.require(&format!("llama.{key}"), Value::as_u64)? as usize)
    };
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    let vocab_size = match f.get("llama.vocab_size").and_then(Value::as_u64) {
        Some(v) => v as usize,
        None => f.require("tokenizer.ggml.tokens", Value::as_array)?.len(),
    };
    let head_dim = hidden / heads;
    if let Some(rope) = f.get("llama.rope.dimension_count").and_then(Value::as_u64)
        && rope as usize != head_dim
    {
        return Err(err(
            &f.path,
            "partial RoPE (rope.dimension_count < head dim) is not supported",
        ));
    }
    Ok(LlamaConfig {
        vocab_size,
        hidden,
        layers: int("block_count")?,
        heads,
        kv_heads: f
            .get("llama.attention.head_count_kv")
            .and_then(Value::as_u64)
            .map_or(heads, |v| v as usize),
        head_dim,
        ffn: int("feed_forward_length")?,
        rope_theta: f
            .get("llama.rope.freq_base")
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0),
        rms_eps: f.require("llama.attention.layer_norm_rms_epsilon", Value::as_f64)?,
        context_length: int("context_length")?,
    })
}

/// GGUF stores q/k rows in llama.cpp's interleaved-pair RoPE order; transformers' rotate-half order
/// is row `h·d + s·d/2 + j` for GGUF row `h·d + 2j + s` (the inverse of convert_hf_to_gguf's permute).
pub fn unpermute_rope_rows(w: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    let half = head_dim / 2;
    for h in 0..heads {
        for j in 0..half {
            for s in 0..2 {
                let src = (h * head_dim + 2 * j + s) * cols;
                let dst = (h * head_dim + s * half + j) * cols;
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

/// `[rows, cols]` row-major → `[cols, rows]` row-major.
fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = w[r * cols + c];
        }
    }
    out
}

/// Loads every weight (dequantised) onto `device`.
pub fn load_llama(f: &GgufFile, device: &Device) -> Result<Llama, TeacherError> {
    let c = llama_config(f)?;
    // A 2-D weight checked against its expected `[out, in]`, returned as `[in, out]`.
    let matrix = |name: &str, out: usize, inp: usize, rope_heads: Option<usize>| {
        let (w, dims) = f.dequantize(name)?;
        if dims != [inp as u64, out as u64] {
            return Err(err(
                &f.path,
                format!("tensor {name} has shape {dims:?}, expected [{inp}, {out}]"),
            ));
        }
        let w = match rope_heads {
            Some(h) => unpermute_rope_rows(&w, h, c.head_dim, inp),
            None => w,
        };
        Ok::<_, TeacherError>(Tensor::<2>::from_data(
            TensorData::new(transpose(&w, out, inp), [inp, out]),
            device,
        ))
    };
    let vector = |name: &str, n: usize| {
        let (w, dims) = f.dequantize(name)?;
        if dims != [n as u64] {
            return Err(err(
                &f.path,
                format!("tensor {name} has shape {dims:?}, expected [{n}]"),
            ));
        }
        Ok::<_, TeacherError>(Tensor::<1>::from_data(TensorData::new(w, [n]), device))
    };
    let (embed, dims) = f.dequantize("token_embd.weight")?;
    if dims != [c.hidden as u64, c.vocab_size as u64] {
        return Err(err(
            &f.path,
            format!("token_embd.weight has shape {dims:?}"),
        ));
    }
    let lm_head = if f.tensor("output.weight").is_some() {
        matrix("output.weight", c.vocab_size, c.hidden, None)?
    } else {
        Tensor::from_data(
            TensorData::new(
                transpose(&embed, c.vocab_size, c.hidden),
                [c.hidden, c.vocab_size],
            ),
            device,
        )
    };
    let embed = Tensor::from_data(TensorData::new(embed, [c.vocab_size, c.hidden]), device);
    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let layers = (0..c.layers)
        .map(|i| {
            let n = |t: &str| format!("blk.{i}.{t}.weight");
            Ok(LlamaLayer {
                attn_norm: vector(&n("attn_norm"), c.hidden)?,
                wq: matrix(&n("attn_q"), q, c.hidden, Some(c.heads))?,
                wk: matrix(&n("attn_k"), kv, c.hidden, Some(c.kv_heads))?,
                wv: matrix(&n("attn_v"), kv, c.hidden, None)?,
                wo: matrix(&n("attn_output"), c.hidden, q, None)?,
                ffn_norm: vector(&n("ffn_norm"), c.hidden)?,
                w_gate: matrix(&n("ffn_gate"), c.ffn, c.hidden, None)?,
                w_up: matrix(&n("ffn_up"), c.ffn, c.hidden, None)?,
                w_down: matrix(&n("ffn_down"), c.hidden, c.ffn, None)?,
            })
        })
        .collect::<Result<Vec<_>, TeacherError>>()?;
    Ok(Llama {
        norm: vector("output_norm.weight", c.hidden)?,
        config: c,
        embed,
        layers,
        lm_head,
    })
}

/// The tokenizer a GGUF carries (`tokenizer.ggml.model = "gpt2"`: byte-level BPE).
pub fn load_tokenizer(f: &GgufFile) -> Result<(Tokenizer, TokenizerMeta), TeacherError> {
    let model = f.require("tokenizer.ggml.model", Value::as_str)?;
    if model != "gpt2" {
        return Err(err(
            &f.path,
            format!("tokenizer model {model:?} is not supported (gpt2-style byte-level BPE only)"),
        ));
    }
    let strings = |key: &str| -> Result<Vec<String>, TeacherError> {
        f.require(key, Value::as_array)?
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| err(&f.path, format!("{key} holds a non-string")))
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    // Control (3) and user-defined (4) tokens match whole in text, as llama.cpp treats them.
    let specials: Vec<u32> = match f.get("tokenizer.ggml.token_type").and_then(Value::as_array) {
        Some(types) => types
            .iter()
            .enumerate()
            .filter(|(_, t)| matches!(t, Value::I32(3 | 4)))
            .map(|(i, _)| i as u32)
            .collect(),
        None => Vec::new(),
    };
    // llama.cpp reads a missing name as `default`, a split of its own that k3mini does not
    // implement: refused with the rest.
    let pre_name = f
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre = PreTokenizer::from_gguf_name(pre_name).ok_or_else(|| {
        let known: Vec<&str> = GGUF_PRE_TOKENIZERS.iter().map(|(n, _)| *n).collect();
        err(
            &f.path,
            format!(
                "tokenizer.ggml.pre {pre_name:?} is a pre-tokenizer k3mini does not implement \
                 (it reads {})",
                known.join(", ")
            ),
        )
    })?;
    let name = f.path.display().to_string();
    let tokenizer = Tokenizer::from_byte_level_bpe(&name, &tokens, &merges, &specials, pre)?;
    let id = |key: &str| f.get(key).and_then(Value::as_u64).map(|v| v as u32);
    Ok((
        tokenizer,
        TokenizerMeta {
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: matches!(
                f.get("tokenizer.ggml.add_bos_token"),
                Some(Value::Bool(true))
            ),
            chat_template: f
                .get("tokenizer.chat_template")
                .and_then(Value::as_str)
                .map(str::to_string),
        },
    ))
}
