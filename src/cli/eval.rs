//! `k3mini eval RUN_OR_RECIPE... [--suite quick|full] [--held-out RECIPE] [--json] [--out DIR]`.

use anyhow::Result;
use clap::{Args, ValueEnum};
use k3mini::device::DeviceList;
use k3mini::evaluate::{Suite, evaluate};
use k3mini::recipe;
use k3mini_eval::report::{summary_table, write_report};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum SuiteArg {
    Quick,
    Full,
}

#[derive(Args)]
pub struct EvalArgs {
    /// Run directories, checkpoint directories or recipe files (their runs); several make one
    /// side-by-side report.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    #[arg(long, value_enum, default_value = "quick")]
    suite: SuiteArg,
    /// Print eval.json's content to stdout instead of the summary table.
    #[arg(long)]
    json: bool,
    /// Where eval.json, report.md and the plots go.
    #[arg(long, default_value = "eval-report")]
    out: PathBuf,
    /// Evaluate on this device instead of the run's own (run.device).
    #[arg(long)]
    device: Option<DeviceList>,
    /// Held-out figures on this recipe's held-out set instead of each run's own (the same
    /// vocabulary): runs trained on different plans measured on the same tokens.
    #[arg(long)]
    held_out: Option<PathBuf>,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let suite = match args.suite {
        SuiteArg::Quick => Suite::Quick,
        SuiteArg::Full => Suite::Full,
    };
    let held_out = args.held_out.as_deref().map(recipe::load).transpose()?;
    let (reports, curves): (Vec<_>, Vec<_>) = args
        .runs
        .iter()
        .map(|r| evaluate(r, suite, args.device.as_ref(), held_out.as_ref()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .unzip();
    let report = write_report(&args.out, &reports, &curves)?;
    if args.json {
        // One run: its object (with a top-level `ppl`); several: the array.
        match reports.as_slice() {
            [one] => println!("{}", serde_json::to_string_pretty(one)?),
            all => println!("{}", serde_json::to_string_pretty(all)?),
        }
    } else {
        print!("{}", summary_table(&reports));
        println!("report: {}", report.display());
    }
    Ok(())
}
