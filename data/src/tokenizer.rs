//! Tokenizers: any Hugging Face `tokenizer.json` (the `tokenizers` crate), the Kimi K2/K3 vocabulary
//! (tiktoken, 163,840 ids), and training a byte-level BPE on a corpus.

use crate::error::DataError;
use std::path::Path;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, TokenizerBuilder};

/// Kimi's tokenizer reserves 256 special-token ids after its 163,584 BPE ranks (163,840 in all: the
/// model's embedding rows), whether or not each slot is named.
pub const KIMI_RESERVED_SPECIALS: usize = 256;

/// Kimi's reasoning tags: reserved ids that the tiktoken crate's special-token table does not name.
pub const KIMI_THINK_TAGS: [(&str, u32); 2] = [("<think>", 163_606), ("</think>", 163_607)];

/// The end-of-document token a trained byte-level BPE reserves (id 0).
pub const BPE_EOS: &str = "<|endoftext|>";

/// The names each special id is found by, first found wins: the one table every consumer reads
/// through [`Tokenizer::special_ids`]. (Kimi's `[EOS]` is not among the ends of text: its text
/// documents have never ended in one, and teacher shards do not record which id ends them, so
/// adding it would mix shards of two tokenizations in one job.)
const EOS_NAMES: [&str; 3] = [BPE_EOS, "</s>", "<|end_of_text|>"];
/// The marker that ends every turn of both chat templates (ChatML's and Kimi K2's): where
/// sampling stops.
pub const END_OF_TURN: &str = "<|im_end|>";
/// ChatML's and Kimi K2's end of turn, then Kimi K3's.
const END_OF_TURN_NAMES: [&str; 2] = [END_OF_TURN, "<|end_of_msg|>"];
/// SmolLM2's and ChatML's configs name `<|im_start|>` their beginning of sequence.
const BOS_NAMES: [&str; 3] = ["<|im_start|>", "<s>", "<|begin_of_text|>"];
const PAD_NAMES: [&str; 2] = [BPE_EOS, "<pad>"];

/// A tokenizer's special ids, resolved once: training ends documents in `eos`, exports write
/// them into config.json and GGUF metadata, generation stops at `end_of_turn` and `eos`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecialIds {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of text: every text document ends in it.
    pub eos: Option<u32>,
    /// End of a chat turn.
    pub end_of_turn: Option<u32>,
    pub pad: Option<u32>,
}

impl SpecialIds {
    /// What generation stops at: the end of a turn, then the end of text.
    pub fn stops(&self) -> Vec<u32> {
        self.end_of_turn.into_iter().chain(self.eos).collect()
    }
}

/// The byte-level pre-tokenizers k3mini implements, by llama.cpp's `tokenizer.ggml.pre` names
/// (llama-vocab.cpp): the one table GGUF export writes from and GGUF reading parses with.
pub const GGUF_PRE_TOKENIZERS: [(&str, PreTokenizer); 2] = [
    ("gpt-2", PreTokenizer::Gpt2),
    ("smollm", PreTokenizer::SmolLm),
];

/// How text is split before byte-level BPE merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex split (a `ByteLevel` pre-tokenizer with `use_regex`).
    Gpt2,
    /// Each digit alone, then GPT-2's split.
    SmolLm,
}

impl PreTokenizer {
    /// llama.cpp's name for it.
    pub fn gguf_name(self) -> &'static str {
        GGUF_PRE_TOKENIZERS
            .iter()
            .find(|(_, p)| *p == self)
            .map(|(n, _)| *n)
            .expect("every pre-tokenizer is in the table")
    }

    /// The pre-tokenizer llama.cpp's `name` means, `None` for one k3mini does not implement.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        GGUF_PRE_TOKENIZERS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| *p)
    }
}

/// A loaded tokenizer.
#[derive(Clone)]
pub enum Tokenizer {
    Hf {
        /// Reads special-token strings in text as text ([`Tokenizer::encode`]).
        tokenizer: Box<tokenizers::Tokenizer>,
        /// Hugging Face's own reading, special tokens recognised
        /// ([`Tokenizer::encode_with_specials`]).
        raw: Box<tokenizers::Tokenizer>,
        source: String,
    },
    Tiktoken {
        bpe: &'static tiktoken::CoreBpe,
        name: &'static str,
    },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({}, {} ids)", self.name(), self.vocab_size())
    }
}

impl Tokenizer {
    /// The built-in vocabulary a spec names: `kimi` / `kimi_k3` / `kimi_k2` (tiktoken); `None` for a path.
    pub fn builtin(spec: &str) -> Option<&'static str> {
        match spec {
            "kimi" | "kimi_k3" => Some("kimi_k3"),
            "kimi_k2" => Some("kimi_k2"),
            _ => None,
        }
    }

    /// A built-in vocabulary (see [`Self::builtin`]) or a path to a `tokenizer.json`.
    pub fn load(spec: &str) -> Result<Self, DataError> {
        if let Some(name) = Self::builtin(spec) {
            let bpe = tiktoken::get_encoding(name).ok_or_else(|| DataError::Tokenizer {
                source_name: spec.into(),
                message: "vocabulary not compiled in".into(),
            })?;
            return Ok(Self::Tiktoken { bpe, name });
        }
        let path = Path::new(spec);
        if !path.is_file() {
            return Err(DataError::Tokenizer {
                source_name: spec.into(),
                message: "not `kimi` and no such tokenizer.json file".into(),
            });
        }
        let err = |message: String| DataError::Tokenizer {
            source_name: spec.into(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        // Tell a file that is not JSON from JSON that is not a tokenizer (the tokenizers crate
        // reports both as a syntax error at its first unexpected key).
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(format!("is not JSON: {e}")))?;
        if json.get("model").is_none() {
            return Err(err(
                "is JSON but not a tokenizer.json (no `model` section)".into()
            ));
        }
        let tokenizer = text
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| err(format!("does not parse as a tokenizer: {e}")))?;
        Ok(Self::hf(tokenizer, spec))
    }

    /// An HF tokenizer twice: one that reads special-token strings in plain text as text
    /// ([`Self::encode`]), and Hugging Face's own ([`Self::encode_with_specials`]). Non-special
    /// added tokens (Qwen's `<tool_call>`) stay whole either way, as Hugging Face keeps them.
    fn hf(raw: tokenizers::Tokenizer, source: &str) -> Self {
        let mut tokenizer = raw.clone();
        tokenizer.set_encode_special_tokens(true);
        Self::Hf {
            tokenizer: Box::new(tokenizer),
            raw: Box::new(raw),
            source: source.into(),
        }
    }

    /// A byte-level BPE from its vocabulary (id order), merges (`"a b"`) and special-token ids, as
    /// GGUF files carry them (`tokenizer.ggml.model = "gpt2"`), split by `pre`.
    pub fn from_byte_level_bpe(
        name: &str,
        tokens: &[String],
        merges: &[String],
        specials: &[u32],
        pre: PreTokenizer,
    ) -> Result<Self, DataError> {
        use tokenizers::pre_tokenizers::{digits::Digits, sequence::Sequence};
        let err = |message: String| DataError::Tokenizer {
            source_name: name.into(),
            message,
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| err(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| err(format!("BPE: {e}")))?;
        let split = ByteLevel::new(false, true, true);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            PreTokenizer::SmolLm => {
                Sequence::new(vec![Digits::new(true).into(), split.into()]).into()
            }
            PreTokenizer::Gpt2 => split.into(),
        };
        let mut tokenizer = byte_level(model, pre_tokenizer).map_err(err)?;
        let special: Vec<AddedToken> = specials
            .iter()
            .filter_map(|&id| tokens.get(id as usize))
            .map(|t| AddedToken::from(t.clone(), true))
            .collect();
        tokenizer.add_special_tokens(&special);
        Ok(Self::hf(tokenizer.into(), name))
    }

    /// Writes a `tokenizer.json` (atomically and durably). Built-in vocabularies are named, not saved.
    pub fn save(&self, path: &Path) -> Result<(), DataError> {
        let Self::Hf { tokenizer, .. } = self else {
            return Err(DataError::Tokenizer {
                source_name: self.name().into(),
                message: "a built-in vocabulary: name it in recipes instead of saving it".into(),
            });
        };
        save_json(path, |tmp| {
            tokenizer.save(tmp, false).map_err(|e| e.to_string())
        })
    }

    /// The `tokenizer.json` text of a file-backed tokenizer; `None` for built-in vocabularies.
    pub fn json(&self) -> Option<String> {
        match self {
            Self::Hf { tokenizer, .. } => tokenizer.to_string(false).ok(),
            Self::Tiktoken { .. } => None,
        }
    }

    /// Where the tokenizer came from.
    pub fn name(&self) -> &str {
        match self {
            Self::Hf { source, .. } => source,
            Self::Tiktoken { name, .. } => name,
        }
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Hf { tokenizer, .. } => tokenizer.get_vocab_size(true),
            Self::Tiktoken { bpe, .. } => {
                bpe.vocab_size() + KIMI_RESERVED_SPECIALS.max(bpe.num_special_tokens())
            }
        }
    }

    /// Plain text to ids (special-token strings in the text are encoded as text).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Self::Hf {
                tokenizer, source, ..
            } => tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    source_name: source.clone(),
                    message: e.to_string(),
                }),
            Self::Tiktoken { bpe, .. } => Ok(bpe.encode(text)),
        }
    }

    /// Text in which special-token strings (`<|im_end|>`, and Kimi's `<think>` / `</think>`, which
    /// the tiktoken table lacks) become their ids, as a server tokenizes a raw prompt.
    pub fn encode_with_specials(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Self::Hf { raw, source, .. } => raw
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer {
                    source_name: source.clone(),
                    message: e.to_string(),
                }),
            Self::Tiktoken { bpe, .. } => {
                let mut ids = Vec::new();
                let mut rest = text;
                while let Some((at, tag, id)) = KIMI_THINK_TAGS
                    .iter()
                    .filter_map(|&(tag, id)| rest.find(tag).map(|at| (at, tag, id)))
                    .min()
                {
                    ids.extend(bpe.encode_with_special_tokens(&rest[..at]));
                    ids.push(id);
                    rest = &rest[at + tag.len()..];
                }
                ids.extend(bpe.encode_with_special_tokens(rest));
                Ok(ids)
            }
        }
    }

    /// Ids back to text (lossy for ids that split a UTF-8 character).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Self::Hf {
                tokenizer, source, ..
            } => tokenizer
                .decode(ids, false)
                .map_err(|e| DataError::Tokenizer {
                    source_name: source.clone(),
                    message: e.to_string(),
                }),
            Self::Tiktoken { bpe, .. } => {
                let mut bytes = Vec::new();
                for run in ids.split_inclusive(|id| KIMI_THINK_TAGS.iter().any(|t| t.1 == *id)) {
                    let (last, head) = run
                        .split_last()
                        .expect("split_inclusive runs are non-empty");
                    bytes.extend(bpe.decode(head));
                    match KIMI_THINK_TAGS.iter().find(|t| t.1 == *last) {
                        Some((tag, _)) => bytes.extend(tag.as_bytes()),
                        None => bytes.extend(bpe.decode(&[*last])),
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// The UTF-8 bytes of the text `ids` spell, special tokens spelling nothing: the denominator
    /// of bits per byte. Exact for tiktoken's byte ranks; an HF tokenizer decodes the run, so a
    /// character split at either end of it counts as U+FFFD.
    pub fn text_bytes(&self, ids: &[u32]) -> Result<usize, DataError> {
        match self {
            Self::Hf {
                tokenizer, source, ..
            } => tokenizer
                .decode(ids, true)
                .map(|s| s.len())
                .map_err(|e| DataError::Tokenizer {
                    source_name: source.clone(),
                    message: e.to_string(),
                }),
            Self::Tiktoken { bpe, .. } => {
                let ranks = bpe.vocab_size() as u32;
                let text: Vec<u32> = ids.iter().copied().filter(|&id| id < ranks).collect();
                Ok(bpe.decode(&text).len())
            }
        }
    }

    /// The bytes each id spells, `None` for a special token (which spells no text): what
    /// cross-tokenizer alignment compares. Tiktoken ranks are bytes already; a byte-level BPE's
    /// token strings map back through GPT-2's byte ↔ character table; a SentencePiece-style
    /// vocabulary's `<0xHH>` byte-fallback tokens are their byte and `▁` is a space. Any other
    /// `tokenizer.json` is refused by name (its tokens do not say which bytes they are).
    pub fn token_bytes(&self) -> Result<Vec<Option<Vec<u8>>>, DataError> {
        match self {
            Self::Tiktoken { bpe, .. } => {
                let ranks = bpe.vocab_size() as u32;
                Ok((0..self.vocab_size() as u32)
                    .map(|id| (id < ranks).then(|| bpe.decode(&[id])))
                    .collect())
            }
            Self::Hf {
                tokenizer, source, ..
            } => {
                let specials: std::collections::HashSet<u32> = tokenizer
                    .get_added_tokens_decoder()
                    .into_iter()
                    .filter(|(_, t)| t.special)
                    .map(|(id, _)| id)
                    .collect();
                let byte_level =
                    matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
                let sentencepiece = matches!(
                    tokenizer.get_decoder(),
                    Some(
                        DecoderWrapper::Sequence(_)
                            | DecoderWrapper::Metaspace(_)
                            | DecoderWrapper::ByteFallback(_)
                    )
                );
                if !(byte_level || sentencepiece) {
                    return Err(DataError::Tokenizer {
                        source_name: source.clone(),
                        message: "its decoder is neither byte-level nor SentencePiece-style, so \
                                  its tokens do not say which bytes they spell (cross-tokenizer \
                                  alignment needs that)"
                            .into(),
                    });
                }
                let unicode_byte = gpt2_char_bytes();
                Ok((0..self.vocab_size() as u32)
                    .map(|id| {
                        if specials.contains(&id) {
                            return None;
                        }
                        let token = tokenizer.id_to_token(id)?;
                        Some(if byte_level {
                            // A character outside the table is not byte-level output: take its
                            // UTF-8 (an added token written as plain text).
                            token
                                .chars()
                                .flat_map(|c| match unicode_byte.get(&c) {
                                    Some(&b) => vec![b],
                                    None => c.to_string().into_bytes(),
                                })
                                .collect()
                        } else {
                            sentencepiece_bytes(&token)
                        })
                    })
                    .collect())
            }
        }
    }

    /// SHA-256 (hex) of the id → token table: equal fingerprints mean the same ids for the same
    /// strings, which is what a teacher and its student must share.
    pub fn fingerprint(&self) -> String {
        use crate::digest::{Digest, Sha256, hex};
        let mut h = Sha256::new();
        for id in 0..self.vocab_size() as u32 {
            match self {
                Self::Hf { tokenizer, .. } => {
                    h.update(tokenizer.id_to_token(id).unwrap_or_default().as_bytes())
                }
                Self::Tiktoken { bpe, .. } => h.update(bpe.decode(&[id])),
            }
            h.update([0xFF]); // never inside a UTF-8 token: separates entries unambiguously
        }
        hex(h)
    }

    /// Its special ids (see [`SpecialIds`]).
    pub fn special_ids(&self) -> SpecialIds {
        let first = |names: &[&str]| names.iter().find_map(|n| self.token_id(n));
        SpecialIds {
            bos: first(&BOS_NAMES),
            eos: first(&EOS_NAMES),
            end_of_turn: first(&END_OF_TURN_NAMES),
            pad: first(&PAD_NAMES),
        }
    }

    /// The id of a special (or any whole) token string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Self::Hf { tokenizer, .. } => tokenizer.token_to_id(token),
            Self::Tiktoken { .. } => match self.encode_with_specials(token).ok()?.as_slice() {
                [id] => Some(*id),
                _ => None,
            },
        }
    }
}

/// GPT-2's byte-level table inverted: the printable character each byte is written as → the byte
/// (bytes that print as themselves keep their character; the rest map to U+0100 onwards in order).
/// The tokenizers crate keeps its own copy of this table crate-private.
fn gpt2_char_bytes() -> std::collections::HashMap<char, u8> {
    let prints = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if prints(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).expect("U+0100..U+0143 are characters")
            };
            (c, b)
        })
        .collect()
}

/// A SentencePiece token's bytes: `<0xHH>` is the byte, `▁` a space, the rest its UTF-8.
fn sentencepiece_bytes(token: &str) -> Vec<u8> {
    if let Some(hex) = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && hex.len() == 2
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    token.replace('\u{2581}', " ").into_bytes()
}

/// A byte-level BPE tokenizer (GPT-2 style: no normaliser, byte-level post-processing and decoding).
fn byte_level(
    model: BPE,
    pre_tokenizer: PreTokenizerWrapper,
) -> Result<
    tokenizers::TokenizerImpl<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >,
    String,
> {
    TokenizerBuilder::new()
        .with_model(model)
        .with_normalizer(None)
        .with_pre_tokenizer(Some(pre_tokenizer))
        .with_post_processor(Some(ByteLevel::default().into()))
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .map_err(|e| e.to_string())
}

/// The largest vocabulary k3mini accepts anywhere, ~100× Kimi's 163,840 ids: what
/// [`train_byte_level_bpe`] trains at most (it allocates per id up front, so an absurd size would
/// abort on memory rather than fail), and the bound on a vocabulary a shard records.
pub const MAX_VOCAB: usize = 1 << 24;

/// Trains a byte-level BPE (GPT-2 style, no normaliser) with `vocab_size` ids on text files and
/// writes it as `tokenizer.json` at `out`. Id 0 is [`BPE_EOS`]; `specials` (chat markers such as
/// `<|im_start|>`) follow it as whole tokens.
pub fn train_byte_level_bpe(
    files: &[String],
    vocab_size: usize,
    specials: &[&str],
    out: &Path,
) -> Result<(), DataError> {
    let err = |message: String| DataError::Tokenizer {
        source_name: out.display().to_string(),
        message,
    };
    if let Some(bad) = specials.iter().find(|s| s.is_empty() || s.trim() != **s) {
        return Err(err(format!(
            "special token {bad:?}: a special token is a non-empty string without surrounding \
             whitespace"
        )));
    }
    if vocab_size <= 257 || vocab_size > MAX_VOCAB {
        return Err(err(format!(
            "a vocabulary of {vocab_size} ids: it must exceed 257 (256 bytes and the end-of-text \
             token) and be at most {MAX_VOCAB}"
        )));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(
            std::iter::once(BPE_EOS)
                .chain(specials.iter().copied())
                .map(|t| AddedToken::from(t, true))
                .collect(),
        )
        .build();
    let mut tokenizer =
        byte_level(BPE::default(), ByteLevel::new(false, true, true).into()).map_err(err)?;
    tokenizer
        .train_from_files(&mut trainer, files.to_vec())
        .map_err(|e| err(format!("training failed: {e}")))?;
    save_json(out, |tmp| {
        tokenizer.save(tmp, false).map_err(|e| e.to_string())
    })
}

/// A tokenizer.json the tokenizers crate writes (`save`, to the path it is given) put in place at
/// `path` atomically and durably; a failed save leaves no temporary file.
fn save_json(path: &Path, save: impl FnOnce(&Path) -> Result<(), String>) -> Result<(), DataError> {
    let tmp = k3mini_durable::temp_path(path);
    save(&tmp)
        .map_err(std::io::Error::other)
        .and_then(|()| k3mini_durable::sync_file(&tmp))
        .and_then(|()| k3mini_durable::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            DataError::io(path, e)
        })
}
