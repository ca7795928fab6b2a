//! `k3mini prune MODEL --keep F --method reap|frequency --calibration RECIPE --out OUT`.

use crate::cli::progress::bar as progress_bar;
use anyhow::Result;
use clap::{Args, ValueEnum};
use k3mini::recipe;
use k3mini::routing::prune::{Method, PruneOptions, PruneReport, prune_checkpoint, prune_gguf};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum MethodArg {
    Reap,
    Frequency,
}

#[derive(Args)]
pub struct PruneArgs {
    /// A MoE run or checkpoint directory (its newest checkpoint), or a MoE GGUF file.
    model: PathBuf,
    /// The share of each MoE layer's experts kept, in (0, 1].
    #[arg(long)]
    keep: f64,
    #[arg(long, value_enum, default_value = "reap")]
    method: MethodArg,
    /// The recipe whose training corpus calibrates the scores (and, for a checkpoint, whose
    /// held-out set measures the loss before and after).
    #[arg(long)]
    calibration: PathBuf,
    /// Calibration tokens.
    #[arg(long, default_value_t = 32768)]
    tokens: usize,
    /// A new run directory (for a checkpoint) or the GGUF file to write.
    #[arg(long)]
    out: PathBuf,
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: PruneArgs) -> Result<()> {
    let calibration = recipe::load(&args.calibration)?;
    let opts = PruneOptions {
        keep: args.keep,
        method: match args.method {
            MethodArg::Reap => Method::Reap,
            MethodArg::Frequency => Method::Frequency,
        },
        tokens: args.tokens,
    };
    let bar = progress_bar(args.quiet, "calibration batches");
    let mut on_batch = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let report = if args.model.is_file() {
        prune_gguf(&args.model, &calibration, &opts, &args.out, &mut on_batch)?
    } else {
        prune_checkpoint(&args.model, &calibration, &opts, &args.out, &mut on_batch)?
    };
    bar.finish();
    print!("{}", summary(&report));
    Ok(())
}

fn summary(r: &PruneReport) -> String {
    let mut s = format!(
        "{:?}: {} of {} experts kept per MoE layer, scored over {} calibration tokens\n",
        r.method, r.experts_after, r.experts_before, r.tokens
    )
    .to_lowercase();
    for l in &r.layers {
        s += &format!("  layer {}: kept {:?}\n", l.layer, l.kept);
    }
    if let (Some(a), Some(b)) = (r.held_out_before, r.held_out_after) {
        s += &format!(
            "held-out loss on {}: {a:.4} before, {b:.4} after\n",
            r.calibration.display()
        );
    }
    s + &format!("-> {}\n", r.out.display())
}
