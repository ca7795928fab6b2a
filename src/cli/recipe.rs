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
            let launched = k3mini::train::trainer::check_run(&plan)?;
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
            if let Some(d) = &plan.distill {
                eprintln!(
                    "distillation: the teacher has {}",
                    match d.vocabulary {
                        recipe::Vocabulary::Same => "the student's vocabulary",
                        recipe::Vocabulary::Cross =>
                            "its own vocabulary (`teacher score` aligns it to the student's by bytes)",
                    }
                );
                for line in d.objective_lines() {
                    eprintln!("  {line}");
                }
            }
            if let Some(s) = recipe::smoke_table(&file)? {
                eprintln!(
                    "smoke: stop after step {} and resume, the loss to drop {:.0}%, a {} GGUF \
                     within KL {:.0e} of k3mini; against a baseline tokens/s ≥ {}x, peak memory \
                     ≤ {}x, final loss ≤ {}x",
                    s.resume_at,
                    100.0 * s.loss_drop,
                    s.quant.name(),
                    s.max_gguf_kl,
                    s.tolerances.min_tokens_per_s_ratio,
                    s.tolerances.max_peak_memory_ratio,
                    s.tolerances.max_final_loss_ratio
                );
            }
            if let Some(l) = launched {
                let r = &l.rendezvous;
                eprintln!(
                    "{} started this process as rank {} of {} (local rank {}, device {}): each \
                     rank trains {} of a step's {} micro-batches, gradients summed {}, meeting \
                     through {}",
                    l.launcher,
                    r.rank,
                    r.world,
                    l.local_rank,
                    k3mini::train::ranks::device_of(&plan, &l)?,
                    (plan.accumulation - r.rank).div_ceil(r.world),
                    plan.accumulation,
                    match plan.train.reduction {
                        recipe::Reduction::Ring => "by all-reduce (ring)",
                        recipe::Reduction::Ordered => "in micro-batch order (ordered)",
                    },
                    match &r.store {
                        k3mini_dist::launch::Store::File(f) => format!("the file {}", f.display()),
                        k3mini_dist::launch::Store::Tcp { host, port, .. } =>
                            format!("the store at {host}:{port}"),
                    }
                );
            }
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
