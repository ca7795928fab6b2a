//! `k3mini model info`.

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use k3mini_student::head::HeadChunks;
use k3mini_student::info::{Footprint, GPUS, ModelInfo, TrainingMemory, USABLE_SHARE, model_info};
use k3mini_student::presets::preset;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum ModelCommand {
    /// Parameters per component, training memory and inference state of a preset or recipe.
    Info(InfoArgs),
}

#[derive(Args)]
pub struct InfoArgs {
    /// A preset name (tiny, smoke-300m, k3-mini-3b, k3-mini-moe).
    #[arg(long, conflicts_with = "recipe")]
    preset: Option<String>,
    /// A recipe TOML whose [model] table names a preset and overrides.
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Sequences per micro-batch for the training-memory estimate (default: the recipe's
    /// train.micro_batch, else 8).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence for the training-memory estimate (default: the recipe's
    /// data.seq_len, else 2048).
    #[arg(long)]
    seq_len: Option<usize>,
    /// The devices the estimate is for, as `train --device` takes them (default: the recipe's
    /// run.device, else one): with several, each device's memory with the optimizer state
    /// sharded across them.
    #[arg(long)]
    device: Option<k3mini::device::DeviceList>,
    /// The ranks a launcher would start across every node (torchrun's nodes × processes per
    /// node), one device each: an estimate of each rank's memory with the optimizer state shared
    /// out by whole parameters across all of them, as training across processes shares it.
    #[arg(long, conflicts_with = "device", value_parser = clap::value_parser!(u32).range(1..=65536))]
    ranks: Option<u32>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: ModelCommand) -> Result<()> {
    match cmd {
        ModelCommand::Info(args) => info(args),
    }
}

fn info(args: InfoArgs) -> Result<()> {
    // A run recipe is resolved whole: its micro-batch, checkpointing and devices set the estimate.
    let default = Footprint::new(8, 2048);
    let (name, config, mut footprint) = match (&args.preset, &args.recipe) {
        (Some(p), None) => (p.clone(), preset(p)?, default),
        (None, Some(path)) => {
            let mut plan = k3mini::recipe::load(path)?;
            if let Some(devices) = args.device.clone() {
                plan = plan.with_devices(devices)?;
            }
            let footprint = plan.footprint();
            (path.display().to_string(), plan.model, footprint)
        }
        _ => bail!("give --preset NAME or --recipe FILE"),
    };
    if let Some(devices) = &args.device {
        footprint.replicas = devices.replicas();
    }
    if let Some(ranks) = args.ranks {
        footprint.replicas = ranks as usize;
    }
    footprint.batch = args.batch.unwrap_or(footprint.batch);
    footprint.seq_len = args.seq_len.unwrap_or(footprint.seq_len);
    let info = model_info(&name, &config, &footprint);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        let holder = if args.ranks.is_some() {
            "rank"
        } else {
            "device"
        };
        print!("{}", render(&info, holder));
    }
    Ok(())
}

/// Human-readable count: 3.52B, 312.4M, 3.5K.
pub fn human(n: usize) -> String {
    let n = n as f64;
    match n {
        x if x >= 1e9 => format!("{:.2}B", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}K", x / 1e3),
        x => format!("{x}"),
    }
}

/// Bytes in binary units.
pub fn bytes(n: usize) -> String {
    k3mini::units::bytes(n as f64)
}

/// `info` as text, its memory that of each `holder` (a device, or a rank on one).
fn render(info: &ModelInfo, holder: &str) -> String {
    use std::fmt::Write;
    let c = &info.config;
    let mut s = String::new();
    let _ = writeln!(s, "model {}", info.name);
    let _ = writeln!(
        s,
        "  d_model {}  layers {}  heads {}  vocab {}  pattern {}",
        c.d_model, c.n_layers, c.n_heads, c.vocab_size, info.layer_pattern
    );
    let _ = writeln!(
        s,
        "  params: total {} ({})  active {} ({})",
        human(info.total_params),
        info.total_params,
        human(info.active_params),
        info.active_params
    );
    let _ = writeln!(s, "\n  component              params        share");
    for (name, n) in info.breakdown.rows() {
        if n > 0 {
            let share = 100.0 * n as f64 / info.total_params as f64;
            let _ = writeln!(s, "  {name:<20} {:>12}   {share:>5.1}%", n);
        }
    }
    let m = &info.training_memory;
    let f = &m.footprint;
    let _ = writeln!(
        s,
        "\n  training memory of {} (f32, AdamW, micro-batch {} x {} tokens{}{})",
        if f.replicas > 1 {
            format!("each {holder}")
        } else {
            "the device".into()
        },
        f.batch,
        f.seq_len,
        if f.activation_checkpointing {
            ", activation checkpointing"
        } else {
            ""
        },
        if f.replicas > 1 {
            format!(
                ", {} {holder}s, optimizer state sharded: the busiest owns {} parameters",
                f.replicas,
                human(m.owned_params)
            )
        } else {
            String::new()
        }
    );
    for (name, v) in [
        ("weights", m.weights),
        ("grads", m.grads),
        ("adamw m+v", m.adamw),
        ("replica grads", m.replica_grads),
        ("activations*", m.activations),
    ] {
        if v > 0 || name != "replica grads" {
            let _ = writeln!(s, "  {name:<14} {:>12}", bytes(v));
        }
    }
    write_activation_parts(&mut s, m, c.vocab_size);
    let _ = writeln!(
        s,
        "  {:<14} {:>12}   (*estimate from the layer formulas, checked by `k3mini bench memory`)",
        "total",
        bytes(info.training_memory_total),
    );
    let _ = writeln!(
        s,
        "\n  fits (at most {:.0}% of a device's memory planned on)",
        100.0 * USABLE_SHARE
    );
    for (gpu, memory) in GPUS {
        let usable = memory as f64 * USABLE_SHARE;
        let need = info.training_memory_total as f64;
        let verdict = if need <= usable {
            format!("yes ({:.0}% of usable)", 100.0 * need / usable)
        } else {
            format!("no (needs {:.1}x)", need / usable)
        };
        let _ = writeln!(s, "  {gpu:<24} {verdict}");
    }
    let _ = writeln!(
        s,
        "\n  inference state per sequence (f32)   hybrid      all-MLA     saving"
    );
    for st in &info.inference_state {
        let _ = writeln!(
            s,
            "  {:>7} tokens                   {:>10}  {:>10}   {:>5.1}%",
            st.context,
            bytes(st.hybrid_bytes),
            bytes(st.all_mla_bytes),
            100.0 * st.saving()
        );
    }
    s
}

/// The activation estimate's parts under `model info`'s memory lines: the trunk's (before
/// checkpointing), what is kept of it, the head and the largest transient.
fn write_activation_parts(s: &mut String, m: &TrainingMemory, vocab: usize) {
    use std::fmt::Write;
    let f = &m.footprint;
    let p = &m.parts;
    let tokens = f.batch * f.seq_len;
    let chunks = HeadChunks::resolve(f.head_chunk, vocab);
    let head = if chunks.cuts(tokens) {
        format!("head, chunks of {} tokens", chunks.tokens_at_once(tokens))
    } else {
        "head, whole".to_string()
    };
    let trunk = if f.activation_checkpointing {
        "trunk, checkpointed"
    } else {
        "trunk"
    };
    // The trunk's parts (before checkpointing), then what is kept of each kind.
    for (indent, name, v) in [
        ("      ", "KDA", p.kda),
        ("      ", "MLA", p.mla),
        ("      ", "FFN", p.ffn),
        ("      ", "residual", p.residual),
        ("    ", trunk, p.trunk_kept),
        ("    ", &*head, p.head),
        ("    ", "largest transient", p.transient),
    ] {
        if v > 0 {
            let _ = writeln!(s, "{indent}{name:<30} {:>12}", bytes(v));
        }
    }
}
