//! `k3mini data`: tokenizer tools, chat rendering with the part of every token, shard conversion.

use crate::cli::progress::bar as progress_bar;
use anyhow::Result;
use clap::Subcommand;
use k3mini_data::chat::{check_markers, render};
use k3mini_data::shards::Storage;
use k3mini_data::tokenizer::train_byte_level_bpe;
use k3mini_data::{ChatFormat, LossParts, Tokenizer, read_chats};
use k3mini_teacher::score::convert_shards;
use std::path::{Path, PathBuf};

/// Bytes of the shard files (`.parquet`) in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "parquet"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenizers: `train` a byte-level BPE on text files, `encode` text and print the ids.
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
    },
    /// Teacher-signal shards: `convert` a directory into the compact schema.
    Shards {
        #[command(subcommand)]
        command: ShardsCommand,
    },
    /// Render the conversations of a chat JSONL and show which tokens carry loss.
    Chat {
        /// JSONL, one conversation per line in OpenAI's shape (`messages`, and `tools`).
        file: PathBuf,
        /// `kimi_k3` (`kimi`), `kimi_k2` or `chatml`.
        #[arg(long, default_value = "kimi_k3", value_parser = parse_template)]
        template: ChatFormat,
        /// `kimi` (K3's vocabulary), `kimi_k2`, or a tokenizer.json.
        #[arg(long, default_value = "kimi")]
        tokenizer: String,
        #[arg(long, default_value = "messages")]
        field: String,
        /// Show only the first N conversations.
        #[arg(long, default_value_t = 1)]
        limit: usize,
    },
}

/// A chat template by its recipe name (the same names `chat = "…"` takes).
fn parse_template(name: &str) -> Result<ChatFormat, String> {
    serde_json::from_value(serde_json::Value::String(name.into()))
        .map_err(|_| format!("unknown template {name:?}: chatml, kimi_k2 or kimi_k3 (kimi)"))
}

#[derive(Subcommand)]
pub enum ShardsCommand {
    /// Rewrite a `teacher score` directory's shards (either schema) into a new directory in the
    /// compact schema v2 (ids lossless, each logprob within --logprob-step nats; the top-k mass
    /// exact), with its manifest: train from it as from the original.
    Convert {
        src: PathBuf,
        dst: PathBuf,
        /// Nats; 0 rewrites as the exact schema v1.
        #[arg(long, default_value_t = k3mini_data::shards::DEFAULT_LOGPROB_STEP)]
        logprob_step: f32,
        #[arg(long)]
        quiet: bool,
    },
}

#[derive(Subcommand)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE tokenizer.json on text files.
    Train {
        /// Number of ids (256 bytes + merges + the end-of-text token).
        #[arg(long, default_value_t = 8192)]
        vocab_size: usize,
        #[arg(long)]
        out: PathBuf,
        /// Extra whole-token specials after `<|endoftext|>`, e.g. `--special '<|im_start|>'
        /// --special '<|im_end|>'` for ChatML.
        #[arg(long = "special")]
        specials: Vec<String>,
        /// UTF-8 text files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Encode text with a tokenizer (`kimi` or a tokenizer.json) and print the ids.
    Encode { tokenizer: String, text: String },
}

pub fn run(cmd: DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Tokenizer {
            command:
                TokenizerCommand::Train {
                    vocab_size,
                    out,
                    specials,
                    files,
                },
        } => {
            for f in &files {
                // Validate up front so a bad file is named (the trainer's own errors do not say which).
                k3mini_data::read_source(f, k3mini_data::SourceFormat::Text, "text")?;
            }
            let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            let specials: Vec<&str> = specials.iter().map(String::as_str).collect();
            train_byte_level_bpe(&names, vocab_size, &specials, &out)?;
            let t = Tokenizer::load(&out.display().to_string())?;
            eprintln!("wrote {} ({} ids)", out.display(), t.vocab_size());
            Ok(())
        }
        DataCommand::Chat {
            file,
            template,
            tokenizer,
            field,
            limit,
        } => {
            let format = template;
            let t = Tokenizer::load(&tokenizer)?;
            check_markers(format, &t)?;
            let loss = LossParts::default();
            for chat in read_chats(&file, &field)?.iter().take(limit) {
                let rendered = render(&chat.messages, &chat.tools, format, false)
                    .map_err(|e| anyhow::anyhow!("{}:{}: {e}", file.display(), chat.index + 1))?;
                let (ids, parts) = rendered.encode(&t)?;
                println!(
                    "# {}:{} — {} tokens",
                    file.display(),
                    chat.index + 1,
                    ids.len()
                );
                for s in &rendered.segments {
                    let mark = if loss.trains(s.part) { "loss" } else { "    " };
                    println!("[{:<8} {mark}] {:?}", format!("{:?}", s.part), s.text);
                }
                let trained = parts.iter().filter(|&&p| loss.trains(p)).count();
                println!(
                    "{trained} of {} tokens are targets (thinking + answer)\n",
                    ids.len()
                );
            }
            Ok(())
        }
        DataCommand::Shards {
            command:
                ShardsCommand::Convert {
                    src,
                    dst,
                    logprob_step,
                    quiet,
                },
        } => {
            let storage = Storage::try_from(logprob_step)
                .map_err(|e| anyhow::anyhow!("--logprob-step {e}"))?;
            let bar = progress_bar(quiet, "shards");
            let before: u64 = dir_bytes(&src);
            let m = convert_shards(&src, &dst, storage, &mut |done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            })?;
            bar.finish();
            let positions = m.positions().max(1) as f64;
            println!(
                "{} shards, {} positions at k = {}: {:.1} → {:.1} bytes/token (schema v{}) -> {}",
                m.shards.len(),
                m.positions(),
                m.job.k,
                before as f64 / positions,
                m.bytes() as f64 / positions,
                m.job.schema_version,
                dst.display()
            );
            Ok(())
        }
        DataCommand::Tokenizer {
            command: TokenizerCommand::Encode { tokenizer, text },
        } => {
            let t = Tokenizer::load(&tokenizer)?;
            println!("{:?}", t.encode(&text)?);
            Ok(())
        }
    }
}
