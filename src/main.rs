//! `k3mini`: the command line. Thin by design: it parses arguments and calls library functions.

mod bench;
mod data_cmd;
mod eval_cmd;
mod export_cmd;
mod model_cmd;
mod recipe_cmd;
mod teacher_cmd;
mod train_cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Training allocates and frees large activation buffers every step; glibc's malloc hands them back to
/// the OS and page-faults them in again (a quarter of a tiny step's time under perf). mimalloc reuses them.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "k3mini",
    version,
    about = "Distil a KDA/MLA hybrid K3 Mini student from a Kimi-class teacher"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Inspect model shapes: parameters, memory, inference state.
    Model {
        #[command(subcommand)]
        command: model_cmd::ModelCommand,
    },
    /// Train from a recipe: plain next-token training, or distillation with [distill].
    Train(train_cmd::TrainArgs),
    /// Export a trained student for other runtimes (transformers / vLLM / SGLang).
    Export(export_cmd::ExportArgs),
    /// Evaluate checkpoints: held-out perplexity and bits per byte, agreement with the teacher,
    /// passkey retrieval, exact-match reasoning, memory against context, decode speed; a report
    /// with plots.
    Eval(eval_cmd::EvalArgs),
    /// The whole pipeline on a laptop: teacher, shards, distilled student and CE baseline, their
    /// evaluation report, a Q4_K_M GGUF. Re-running skips finished stages.
    Quickstart {
        /// The small variant (under 10 minutes on 2 cores).
        #[arg(long)]
        fast: bool,
        /// Where everything goes (default: quickstart, or quickstart-fast).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Runs side by side: held-out loss and perplexity, agreement with the teacher.
    Compare {
        /// Run directories (each holds metrics.jsonl).
        #[arg(required = true)]
        runs: Vec<std::path::PathBuf>,
    },
    /// Data tools: tokenizers, chat rendering.
    Data {
        #[command(subcommand)]
        command: data_cmd::DataCommand,
    },
    /// Validate recipes.
    Recipe {
        #[command(subcommand)]
        command: recipe_cmd::RecipeCommand,
    },
    /// Teachers: fetch the built-in one, ask it a question.
    Teacher {
        #[command(subcommand)]
        command: teacher_cmd::TeacherCommand,
    },
    /// Benchmarks (throughput, memory) on this machine.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Model { command } => model_cmd::run(command),
        Command::Train(args) => train_cmd::run(args),
        Command::Export(args) => export_cmd::run(args),
        Command::Eval(args) => eval_cmd::run(args),
        Command::Quickstart { fast, out } => {
            let out = out.unwrap_or_else(|| {
                if fast {
                    "quickstart-fast"
                } else {
                    "quickstart"
                }
                .into()
            });
            k3mini::quickstart::quickstart(&out, fast)
                .map(|o| print!("{}", k3mini::quickstart::summary(&o)))
        }
        Command::Compare { runs } => runs
            .iter()
            .map(|r| k3mini::compare::summarise(r))
            .collect::<anyhow::Result<Vec<_>>>()
            .map(|s| print!("{}", k3mini::compare::table(&s))),
        Command::Data { command } => data_cmd::run(command),
        Command::Recipe { command } => recipe_cmd::run(command),
        Command::Teacher { command } => teacher_cmd::run(command),
        Command::Bench { command } => bench::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
