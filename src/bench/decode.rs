//! Decode speed and per-sequence state of GGUF files in the llama.cpp k3mini embeds: for each
//! context length, prefill that many ids of a text, then decode greedily one id at a time. The
//! files alternate within each context, in reverse order every other round (A B, B A), so a
//! shared machine's drift and the order itself fall on both sides of a ratio.

use crate::error::{Context, Result};
use k3mini_teacher::engine::llama_cpp::{
    DecodeSpeed, FlashAttn, LlamaCppModel, Placement, decode_context,
};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What to measure: `contexts` prompt lengths, `tokens` decoded after each, `rounds` times.
pub struct DecodeBench<'a> {
    pub files: &'a [PathBuf],
    /// The prompt, tokenised by each file's own tokenizer and repeated to each context length.
    pub text: &'a Path,
    pub contexts: &'a [usize],
    pub tokens: usize,
    pub rounds: usize,
    pub threads: usize,
    pub flash: FlashAttn,
}

/// One file at one context in one round.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeRow {
    pub file: PathBuf,
    /// 1-based.
    pub round: usize,
    #[serde(flatten)]
    pub speed: DecodeSpeed,
}

/// Runs `bench`, handing each measurement to `each` as it comes.
pub fn decode(bench: &DecodeBench, mut each: impl FnMut(&DecodeRow)) -> Result<()> {
    let text = std::fs::read_to_string(bench.text)
        .with_context(|| format!("the prompt text {}", bench.text.display()))?;
    for &context in bench.contexts {
        decode_context(context, bench.tokens)?;
    }
    let longest = bench.contexts.iter().copied().max().unwrap_or(0);
    let mut models = Vec::new();
    for file in bench.files {
        let model = LlamaCppModel::load(
            file,
            Placement::Cpu {
                threads: bench.threads,
            },
        )?;
        let ids = model.tokenize(&text)?;
        crate::ensure!(
            !ids.is_empty(),
            "{} tokenises {} to nothing",
            file.display(),
            bench.text.display()
        );
        let prompt: Vec<u32> = ids.iter().copied().cycle().take(longest).collect();
        models.push((file, model, prompt));
    }
    for round in 1..=bench.rounds {
        for &context in bench.contexts {
            let order: Vec<_> = if round % 2 == 1 {
                models.iter().collect()
            } else {
                models.iter().rev().collect()
            };
            for (file, model, prompt) in order {
                let speed = model
                    .decode_speed(&prompt[..context], bench.tokens, bench.flash)
                    .with_context(|| format!("{} at {context} ids", file.display()))?;
                each(&DecodeRow {
                    file: file.to_path_buf(),
                    round,
                    speed,
                });
            }
        }
    }
    Ok(())
}
