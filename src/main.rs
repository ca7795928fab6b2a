//! `k3mini`: the command line. Thin by design: it parses arguments and calls library functions.

mod bench;
mod model_cmd;

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
    /// Inspect model shapes: parameters, memory, inference state.
    Model {
        #[command(subcommand)]
        command: model_cmd::ModelCommand,
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
