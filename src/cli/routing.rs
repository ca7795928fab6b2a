//! `k3mini routing`: what a MoE teacher's harvested routing says.

use crate::cli::progress::bar as progress_bar;
use anyhow::Result;
use clap::Subcommand;
use k3mini::routing::design::{DesignOptions, design};
use k3mini::routing::report::{read_stats, write_report};
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
    /// A MoE student from the same shards: clusters each mapped teacher layer's experts (by
    /// co-selection and domain profile) into N groups, picks the student's top-k from how many
    /// groups a teacher token's experts span, maps depth; writes `moe.toml` (a `[model.moe]`
    /// fragment) and `design.json` (the teacher-group → student-expert map `router_kl` reads).
    Design {
        shards: PathBuf,
        /// Student routed experts per MoE layer.
        #[arg(long)]
        experts: usize,
        /// Design for one corpus source (by name) only.
        #[arg(long)]
        domain: Option<String>,
        /// Student layers (default: the teacher's).
        #[arg(long)]
        layers: Option<usize>,
        /// Student leading dense layers (default: the teacher's).
        #[arg(long)]
        first_dense_layers: Option<usize>,
        /// Where the design goes (default: SHARDS/routing-design).
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
        RoutingCommand::Design {
            shards,
            experts,
            domain,
            layers,
            first_dense_layers,
            out,
            quiet,
        } => {
            let opts = DesignOptions {
                experts,
                domain,
                layers,
                first_dense_layers,
            };
            let bar = progress_bar(quiet, "routing shards (2 passes)");
            let mut passes = 0;
            let d = design(&shards, &opts, &mut |done, total| {
                if done == 1 {
                    passes += 1;
                }
                bar.set_length(2 * total as u64);
                bar.set_position(((passes - 1) * total + done) as u64);
            })?;
            bar.finish();
            let out = out.unwrap_or_else(|| shards.join("routing-design"));
            let (map, fragment) = d.write(&shards, &out)?;
            println!(
                "| student layer | teacher layer | groups (teacher experts) | mass | distinct groups per token |"
            );
            println!("|---|---|---|---|---|");
            for l in &d.layers {
                let groups: Vec<String> = l.groups.iter().map(|g| format!("{g:?}")).collect();
                let mass: Vec<String> = l.mass.iter().map(|m| format!("{m:.2}")).collect();
                println!(
                    "| {} | {} | {} | {} | {:.2} |",
                    l.student_layer,
                    l.teacher_layer,
                    groups.join(" "),
                    mass.join(" "),
                    l.distinct_groups
                );
            }
            println!(
                "top_k = {} of {} experts, {} layers ({} dense) -> {} and {}",
                d.top_k,
                d.num_experts,
                d.n_layers,
                d.first_dense_layers,
                fragment.display(),
                map.display()
            );
            Ok(())
        }
    }
}
