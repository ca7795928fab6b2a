//! `k3mini recipe check` and `k3mini recipe reference`.

use anyhow::Result;
use clap::Subcommand;
use k3mini::recipe;
use k3mini::units::bytes;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum RecipeCommand {
    /// Validate a recipe and print its resolved plan (every default, absolute paths, the full
    /// model config): what `train` would refuse before its first step is refused here (devices,
    /// memory, tokenizer, a corpus without documents).
    Check { file: PathBuf },
    /// Print every recipe key with its type, default and meaning, as Markdown (docs/recipes.md
    /// is this output), from the schema's own doc comments.
    Reference,
}

pub fn run(cmd: RecipeCommand) -> Result<()> {
    match cmd {
        RecipeCommand::Check { file } => {
            let plan = recipe::load(&file)?;
            k3mini::train::trainer::check_run(&plan)?;
            let memory = plan.training_memory().total();
            eprintln!(
                "{}: ok — model {} ({} params, ~{} to train), {} steps x {} tokens ({} micro-batches of {} x {}), output {}",
                file.display(),
                plan.model.layer_pattern,
                k3mini_student::info::param_breakdown(&plan.model).total(),
                bytes(memory as f64),
                plan.train.steps,
                plan.train.batch_tokens,
                plan.accumulation,
                plan.train.micro_batch,
                plan.data.seq_len,
                plan.out_dir.display()
            );
            print!("{}", plan.to_toml());
            Ok(())
        }
        RecipeCommand::Reference => {
            print!(
                "{}",
                recipe::reference::reference().map_err(anyhow::Error::msg)?
            );
            Ok(())
        }
    }
}
