//! `k3mini recipe check`.

use anyhow::Result;
use clap::Subcommand;
use k3mini::recipe;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum RecipeCommand {
    /// Validate a recipe and print it resolved (every default and the full model config).
    Check { file: PathBuf },
}

pub fn run(cmd: RecipeCommand) -> Result<()> {
    match cmd {
        RecipeCommand::Check { file } => {
            let loaded = recipe::load(&file)?;
            let tokens_per_step = loaded.recipe.train.batch_tokens;
            eprintln!(
                "{}: ok — model {} ({} params), {} steps x {} tokens ({} micro-batches of {} x {}), output {}",
                file.display(),
                loaded.model.layer_pattern,
                k3mini_student::info::param_breakdown(&loaded.model).total(),
                loaded.recipe.train.steps,
                tokens_per_step,
                loaded.accumulation,
                loaded.recipe.train.micro_batch,
                loaded.recipe.data.seq_len,
                loaded.out_dir().display()
            );
            print!("{}", loaded.to_toml());
            Ok(())
        }
    }
}
