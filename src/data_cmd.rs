//! `k3mini data`: tokenizer tools.

use anyhow::{Result, bail};
use clap::Subcommand;
use k3mini_data::Tokenizer;
use k3mini_data::tokenizer::train_byte_level_bpe;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Tokenizer tools.
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
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
                    files,
                },
        } => {
            if vocab_size <= 257 {
                bail!("--vocab-size must exceed 257 (256 bytes and the end-of-text token)");
            }
            for f in &files {
                // Validate up front so a bad file is named (the trainer's own errors do not say which).
                k3mini_data::read_source(f, k3mini_data::SourceFormat::Text, "text")?;
            }
            let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
            train_byte_level_bpe(&names, vocab_size, &out)?;
            let t = Tokenizer::load(&out.display().to_string())?;
            eprintln!("wrote {} ({} ids)", out.display(), t.vocab_size());
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
