//! `k3mini data`: tokenizer tools, and chat rendering with the part of every token.

use anyhow::Result;
use clap::Subcommand;
use k3mini_data::chat::{check_markers, render};
use k3mini_data::tokenizer::train_byte_level_bpe;
use k3mini_data::{ChatFormat, LossParts, Tokenizer, read_chats};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenizer tools.
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
    },
    /// Render the conversations of a chat JSONL and show which tokens carry loss.
    Chat {
        /// JSONL, one conversation (`messages`: [{role, content, thinking?}]) per line.
        file: PathBuf,
        /// `kimi` or `chatml`.
        #[arg(long, default_value = "kimi", value_parser = parse_template)]
        template: ChatFormat,
        /// `kimi_k2` (the Kimi template's markers) or a tokenizer.json.
        #[arg(long, default_value = "kimi_k2")]
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
        .map_err(|_| format!("unknown template {name:?}: kimi or chatml"))
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
                let rendered = render(&chat.messages, format, false)
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
        DataCommand::Tokenizer {
            command: TokenizerCommand::Encode { tokenizer, text },
        } => {
            let t = Tokenizer::load(&tokenizer)?;
            println!("{:?}", t.encode(&text)?);
            Ok(())
        }
    }
}
