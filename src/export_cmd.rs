//! `k3mini export RUN_OR_CHECKPOINT --format hf --out DIR`.

use anyhow::Result;
use clap::{Args, ValueEnum};
use k3mini::export::{check_out, export_hf, open_checkpoint, recipe_tokenizer};
use k3mini_data::Tokenizer;
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    /// safetensors + config.json (+ tokenizer.json) for transformers' KimiLinearForCausalLM.
    Hf,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint) or a checkpoint directory.
    checkpoint: PathBuf,
    #[arg(long, value_enum)]
    format: Format,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// The tokenizer to ship (default: the recipe's, where it can be found from here).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Also write k3mini's logits for fixed inputs (scripts/interop/check_hf.py compares them).
    #[arg(long)]
    with_reference: bool,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let ck = open_checkpoint(&args.checkpoint)?;
    check_out(&ck, &args.out)?;
    let tokenizer = match &args.tokenizer {
        Some(spec) => Some(Tokenizer::load(spec)?),
        None => recipe_tokenizer(&ck.recipe),
    };
    if tokenizer.is_none() {
        eprintln!(
            "note: the recipe's tokenizer was not found from here; pass --tokenizer to ship one"
        );
    }
    match args.format {
        Format::Hf => {
            for f in export_hf(&ck, tokenizer.as_ref(), &args.out, args.with_reference)? {
                println!("{}", f.display());
            }
        }
    }
    Ok(())
}
