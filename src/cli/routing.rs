//! `k3mini routing`: what a MoE teacher's harvested routing says.

use anyhow::Result;
use clap::Subcommand;
use k3mini::routing::report::{read_stats, write_report};
use k3mini::teachers::progress_bar;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum RoutingCommand {
    /// Routing statistics of a `teacher score` directory scored with `teacher.routing = true`:
    /// per layer × expert frequency, co-selection, experts in use, effective experts per token,
    /// REAP saliency (white-box teachers); `routing.parquet`, `report.md` and heatmaps.
    Report {
        /// The shards directory (its manifest.json lists the routing shards).
        shards: PathBuf,
        /// Also per corpus source (domain): usage profiles and specialisation.
        #[arg(long, value_parser = ["source"])]
        by: Option<String>,
        /// Where the report goes (default: SHARDS/routing-report).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        quiet: bool,
    },
}

pub fn run(cmd: RoutingCommand) -> Result<()> {
    match cmd {
        RoutingCommand::Report {
            shards,
            by,
            out,
            quiet,
        } => {
            let bar = progress_bar(quiet, "routing shards");
            let (stats, meta) = read_stats(&shards, &mut |done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
            })?;
            bar.finish();
            let out = out.unwrap_or_else(|| shards.join("routing-report"));
            let path = write_report(&stats, &meta, by.is_some(), &out)?;
            println!(
                "{} tokens per layer over {} MoE layers -> {}",
                stats.layers.first().map_or(0, |l| l.tokens),
                stats.layers.len(),
                path.display()
            );
            Ok(())
        }
    }
}
