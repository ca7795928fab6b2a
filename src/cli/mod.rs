//! The command line: argument parsing and printing only; every command calls library functions.

mod agent;
mod bench;
mod data;
mod eval;
mod export;
mod model;
mod progress;
mod prune;
mod recipe;
mod routing;
mod serve;
mod smoke;
mod teacher;
mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

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
    /// Model shapes: `info` gives a preset's or recipe's parameters per component, training memory
    /// and inference state.
    Model {
        #[command(subcommand)]
        command: model::ModelCommand,
    },
    /// Train a recipe: plain next-token training, or distillation ([distill]) from `teacher score`
    /// shards, trajectories or a teacher in the loop; `--resume` continues a run.
    Train(train::TrainArgs),
    /// Export a trained student: a GGUF for llama.cpp (F32 to Q4_K_M, MXFP4) or safetensors with
    /// config.json for transformers / vLLM / SGLang.
    Export(export::ExportArgs),
    /// The nightly check of a recipe: train, stop and resume bit-identically, evaluate, run the
    /// GGUF in llama.cpp, assert a healthy run and compare with a --baseline; JSON and JUnit XML.
    Smoke(smoke::SmokeArgs),
    /// Evaluate checkpoints: held-out perplexity and bits per byte, agreement with the teacher,
    /// passkey retrieval, exact-match reasoning, memory against context, decode speed; a report
    /// with plots.
    Eval(eval::EvalArgs),
    /// The whole pipeline on a laptop: teacher, shards, distilled student and CE baseline, their
    /// evaluation report, a Q4_K_M GGUF. Re-running skips finished stages.
    Quickstart {
        /// The small variant (under 10 minutes on 2 cores).
        #[arg(long)]
        fast: bool,
        /// Where everything goes (default: quickstart, or quickstart-fast).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// The teacher's engine: llama-cpp or burn (compare engines in separate --out directories).
        #[arg(long, default_value_t)]
        engine: k3mini_teacher::local::Engine,
    },
    /// Runs side by side: held-out loss and perplexity, agreement with the teacher.
    Compare {
        /// Run directories (each holds metrics.jsonl).
        #[arg(required = true)]
        runs: Vec<std::path::PathBuf>,
    },
    /// Data tools: `tokenizer` (train a BPE, encode), `shards` (inspect and convert teacher
    /// shards), `chat` (render conversations and show which tokens carry loss).
    Data {
        #[command(subcommand)]
        command: data::DataCommand,
    },
    /// Remove a MoE model's least salient experts (REAP, or by frequency), from a checkpoint or
    /// a GGUF, scored on a recipe's corpus.
    Prune(prune::PruneArgs),
    /// Recipes: `check` validates one and prints its resolved plan, `reference` prints every key.
    Recipe {
        #[command(subcommand)]
        command: recipe::RecipeCommand,
    },
    /// A MoE teacher's routing, harvested by `teacher score`: `report` (statistics, heatmaps),
    /// `design` (a MoE student and the map `router_kl` distils through).
    Routing {
        #[command(subcommand)]
        command: routing::RoutingCommand,
    },
    /// Teachers: `fetch` the built-in one, `score` a corpus into shards, `generate` reasoning
    /// trajectories, `serve` one over HTTP, write its `tokenizer`, `chat` with it.
    Teacher {
        #[command(subcommand)]
        command: teacher::TeacherCommand,
    },
    /// The student as a local agent with the remote (K3) on call: `serve` the gateway that
    /// escalates, `bench` its policies on tasks, `calibrate` the confidence threshold.
    Agent {
        #[command(subcommand)]
        command: agent::AgentCommand,
    },
    /// Benchmarks on this machine (throughput, memory): `model`, `kda`, `train`, `teacher`,
    /// `engines`, `decode` (GGUFs in llama.cpp), `shards`, `data`, `export`, `memory`, and `all`
    /// for the README's table.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
}

/// Parses the command line, runs the command, and reports an error on stderr.
pub fn main() -> ExitCode {
    // A reader that closes stdout early (`| head`) ends the process, as it does `cat`, instead of
    // a panic in print!.
    #[cfg(unix)]
    // SAFETY: called once at start-up, before any thread exists; SIG_DFL is a valid disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    progress::install();
    let result = match cli.command {
        Command::Model { command } => model::run(command),
        Command::Train(args) => train::run(args),
        Command::Export(args) => export::run(args),
        Command::Eval(args) => eval::run(args),
        Command::Smoke(args) => smoke::run(args),
        Command::Quickstart { fast, out, engine } => {
            let out = out.unwrap_or_else(|| {
                if fast {
                    "quickstart-fast"
                } else {
                    "quickstart"
                }
                .into()
            });
            k3mini::quickstart::quickstart(&out, fast, engine)
                .map(|o| print!("{}", k3mini::quickstart::summary(&o)))
                .map_err(Into::into)
        }
        Command::Compare { runs } => runs
            .iter()
            .map(|r| k3mini::compare::summarise(r))
            .collect::<Result<Vec<_>, _>>()
            .map(|s| print!("{}", k3mini::compare::table(&s)))
            .map_err(Into::into),
        Command::Data { command } => data::run(command),
        Command::Prune(args) => prune::run(args),
        Command::Recipe { command } => recipe::run(command),
        Command::Routing { command } => routing::run(command),
        Command::Teacher { command } => teacher::run(command),
        Command::Agent { command } => agent::run(command),
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
