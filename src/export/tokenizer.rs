//! The tokenizer a GGUF carries, so llama.cpp runs text end to end: the GGUF teacher's copied
//! when the student uses it, else the student's byte-level BPE tokenizer.json converted to
//! llama.cpp's `gpt2` tokenizer.

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::TokenizerSpec;
use k3mini_data::Tokenizer;
use k3mini_data::tokenizer::PreTokenizer;
use k3mini_gguf::Value;

/// The student's tokenizer as a shippable tokenizer.json, by the plan's tokenizer spec: a local
/// teacher's (`tokenizer = "teacher"`) or the file. Built-in vocabularies (Kimi's tiktoken) have
/// none to ship.
pub fn plan_tokenizer(spec: &TokenizerSpec) -> Result<Option<Tokenizer>> {
    Ok(match spec {
        TokenizerSpec::Builtin { .. } => None,
        _ => Some(crate::teachers::student_tokenizer(spec)?),
    })
}

/// The `tokenizer.*` metadata llama.cpp needs to run text end to end: copied from the local GGUF
/// teacher when the student uses its tokenizer (`data.tokenizer = "teacher"`), else converted
/// from the student's tokenizer.json (`tokenizer`, or the plan's).
pub fn gguf_tokenizer_metadata(
    spec: &TokenizerSpec,
    tokenizer: Option<&Tokenizer>,
    n_vocab: usize,
) -> Result<Vec<(String, Value)>> {
    if let (TokenizerSpec::Teacher { model }, None) = (spec, tokenizer) {
        let path = crate::teachers::local_model_path(model)?;
        let file = k3mini_gguf::GgufFile::open(&path)?;
        return Ok(file
            .keys
            .iter()
            .filter_map(|k| Some((k.clone(), file.get(k)?.clone())))
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .collect());
    }
    let found = match tokenizer {
        Some(t) => Some(t.clone()),
        None => plan_tokenizer(spec)?,
    };
    let (json, eos) = found
        .as_ref()
        .and_then(|t| Some((t.json()?, t.special_ids().eos)))
        .with_context(|| {
            format!(
                "the GGUF carries the tokenizer, and the run's ({spec:?}) is not a tokenizer.json: \
                 pass --tokenizer FILE"
            )
        })?;
    bpe_tokenizer_metadata(&serde_json::from_str(&json)?, eos, n_vocab)
}

/// A byte-level BPE tokenizer.json as llama.cpp's `gpt2` tokenizer, as convert_hf_to_gguf.py
/// writes it: tokens by id (ids the model has beyond the vocabulary as `[PAD{i}]`, unused),
/// special added tokens as control tokens, merges as "a b", and the GPT-2 pre-tokenizer (`gpt-2`), which is
/// what a `ByteLevel` pre-tokenizer with `use_regex` splits by; `eos` (the tokenizer's
/// [`k3mini_data::tokenizer::SpecialIds`]) as the end of text, and the beginning too, as GPT-2's
/// convention. Anything else is refused by name.
pub fn bpe_tokenizer_metadata(
    json: &serde_json::Value,
    eos: Option<u32>,
    n_vocab: usize,
) -> Result<Vec<(String, Value)>> {
    const NORMAL: i32 = 1;
    const CONTROL: i32 = 3;
    const USER_DEFINED: i32 = 4;
    const UNUSED: i32 = 5;
    let model = &json["model"];
    if model["type"] != "BPE" {
        bail!(
            "tokenizer model {}: only byte-level BPE converts to GGUF",
            model["type"]
        );
    }
    let pre = &json["pre_tokenizer"];
    if pre["type"] != "ByteLevel" || pre["use_regex"] == false || !json["normalizer"].is_null() {
        bail!(
            "tokenizer pre-tokenizer {pre} / normalizer {}: llama.cpp's gpt2 pre-tokenizer is \
             ByteLevel with use_regex and no normalizer",
            json["normalizer"]
        );
    }
    let vocab = model["vocab"]
        .as_object()
        .context("tokenizer.json: no model.vocab")?;
    let mut tokens: Vec<Option<String>> = vec![None; n_vocab];
    let mut types = vec![NORMAL; tokens.len()];
    for (piece, id) in vocab {
        let id = id.as_u64().context("tokenizer.json: a non-integer id")? as usize;
        crate::ensure!(
            id < n_vocab,
            "tokenizer token {piece:?} has id {id}, past the student's {n_vocab} ids"
        );
        tokens[id] = Some(piece.clone());
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            bail!("tokenizer.json: malformed added token {added}");
        };
        let id = id as usize;
        crate::ensure!(
            id < n_vocab,
            "tokenizer token {content:?} has id {id}, past the student's {n_vocab} ids"
        );
        tokens[id] = Some(content.into());
        types[id] = if added["special"] == true {
            CONTROL
        } else {
            USER_DEFINED
        };
    }
    let tokens: Vec<Value> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            Value::String(t.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            }))
        })
        .collect();
    let merges = model["merges"]
        .as_array()
        .context("tokenizer.json: no model.merges")?
        .iter()
        .map(|m| match (m.as_str(), m.as_array()) {
            (Some(s), _) => Ok(Value::String(s.into())),
            (_, Some(pair)) if pair.len() == 2 => Ok(Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap_or_default(),
                pair[1].as_str().unwrap_or_default()
            ))),
            _ => bail!("tokenizer.json: malformed merge {m}"),
        })
        .collect::<Result<Vec<_>>>()?;
    let mut metadata = vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String(PreTokenizer::Gpt2.gguf_name().into()),
        ),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    if let Some(id) = eos {
        metadata.extend([
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(id)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(id)),
        ]);
    }
    Ok(metadata)
}
