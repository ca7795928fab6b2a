//! `k3mini smoke RECIPE [--out DIR] [--baseline FILE] [--device D]`.

use anyhow::{Result, bail};
use clap::Args;
use k3mini::device::DeviceList;
use k3mini::smoke::{JUNIT, Outcome, REPORT, SmokeOptions, SmokeReport, smoke};
use std::path::PathBuf;

#[derive(Args)]
pub struct SmokeArgs {
    /// The recipe TOML (its `[smoke]` table sets the thresholds; every key has a default).
    recipe: PathBuf,
    /// The smoke's directory: its runs, the GGUF, smoke.json and smoke.junit.xml (default: the
    /// run's output directory with `-smoke` appended).
    #[arg(long)]
    out: Option<PathBuf>,
    /// An earlier smoke's smoke.json: tokens/s, peak memory and final loss are compared with it.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Overrides the recipe's run.device.
    #[arg(long)]
    device: Option<DeviceList>,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: SmokeArgs) -> Result<()> {
    let mut plan = k3mini::recipe::load_smoke(&args.recipe)?;
    if let Some(devices) = args.device {
        plan.run = plan.run.with_devices(devices)?;
    }
    let dir = args.out.unwrap_or_else(|| {
        let mut d = plan.run.out_dir.clone().into_os_string();
        d.push("-smoke");
        d.into()
    });
    let baseline = args
        .baseline
        .as_deref()
        .map(SmokeReport::read_baseline)
        .transpose()?;
    crate::cli::progress::set_quiet(args.quiet);
    // Ctrl-C stops the training at its next step (the smoke then fails its `train` check).
    k3mini::train::trainer::handle_ctrl_c();
    let report = smoke(
        &plan,
        &SmokeOptions {
            dir: dir.clone(),
            baseline,
        },
    )?;
    println!("\n| check | result | detail |\n|---|---|---|");
    for c in &report.checks {
        let result = match c.outcome {
            Outcome::Passed => "pass",
            Outcome::Failed => "FAIL",
            Outcome::Skipped => "skip",
        };
        println!(
            "| {} | {result} | {} |",
            c.name,
            c.detail.replace('|', "\\|")
        );
    }
    println!(
        "\n{} and {} in {} ({:.0} s)",
        REPORT,
        JUNIT,
        dir.display(),
        report.wall_s
    );
    let failed = report.failed();
    if !failed.is_empty() {
        bail!("smoke failed: {}", failed.join(", "));
    }
    Ok(())
}
