//! `k3mini train RECIPE [--out DIR] [--init CHECKPOINT] [--resume]`.

use anyhow::Result;
use clap::Args;
use k3mini::device::DeviceList;
use k3mini::recipe;
use k3mini::train::trainer::{TrainOptions, handle_ctrl_c, train};
use std::path::PathBuf;

#[derive(Args)]
pub struct TrainArgs {
    /// The recipe TOML.
    recipe: PathBuf,
    /// Output directory (default: the recipe's run.out_dir, else runs/<run.name>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Start from this checkpoint's (or run's newest checkpoint's) weights and model, with a
    /// fresh optimizer at step 0: the recipe's `[model]` becomes `init = CHECKPOINT`.
    #[arg(long)]
    init: Option<PathBuf>,
    /// Continue from the newest checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// With --resume: continue although the recipe's plan differs from the checkpoint's (each
    /// change is printed).
    #[arg(long, requires = "resume")]
    accept_changes: bool,
    /// Stop after this many steps (with a checkpoint); `--resume` continues.
    #[arg(long)]
    stop_after: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Overrides the recipe's run.device: cpu, cuda:N, or a list (cuda:0,1) for data-parallel.
    #[arg(long)]
    device: Option<DeviceList>,
}

pub fn run(args: TrainArgs) -> Result<()> {
    let mut loaded = match &args.init {
        Some(init) => recipe::load_from(&args.recipe, init)?,
        None => recipe::load(&args.recipe)?,
    };
    if let Some(devices) = args.device {
        loaded = loaded.with_devices(devices)?;
    }
    handle_ctrl_c();
    let opts = TrainOptions {
        out_dir: args.out,
        resume: args.resume,
        accept_changes: args.accept_changes,
        stop_after: args.stop_after,
    };
    crate::cli::progress::set_quiet(args.quiet);
    let s = train(&loaded, &opts)?;
    // Across ranks the first reports the run.
    if s.leads {
        print_summary(&s);
    }
    if s.interrupted {
        if s.leads {
            println!(
                "interrupted: continue with `k3mini train {} --resume`",
                args.recipe.display()
            );
        }
        // The shell's convention for a run ended by SIGINT.
        std::process::exit(130);
    }
    Ok(())
}

fn print_summary(s: &k3mini::train::trainer::TrainSummary) {
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.4}"));
    println!(
        "\n| run | steps | tokens | first loss | last loss | held-out loss | wall | tokens/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {}..{} | {} | {} | {} | {} | {:.0}s | {:.0} |",
        s.out_dir.display(),
        s.first_step,
        s.last_step,
        s.tokens,
        fmt(s.first_loss),
        fmt(s.last_loss),
        fmt(s.eval_loss),
        s.wall_s,
        s.tokens as f64 / s.wall_s.max(1e-9)
    );
}
