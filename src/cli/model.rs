//! `k3mini model info`.

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use k3mini_student::info::{ModelInfo, model_info};
use k3mini_student::presets::{from_recipe_toml, preset};
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
    /// Sequences per step for the training-memory estimate.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence for the training-memory estimate.
    #[arg(long, default_value_t = 2048)]
    seq_len: usize,
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
    let (name, config) = match (&args.preset, &args.recipe) {
        (Some(p), None) => (p.clone(), preset(p)?),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let config =
                from_recipe_toml(&text).with_context(|| format!("in recipe {}", path.display()))?;
            (path.display().to_string(), config)
        }
        _ => bail!("give --preset NAME or --recipe FILE"),
    };
    let info = model_info(&name, &config, args.batch, args.seq_len);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
    } else {
        print!("{}", render(&info));
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

fn render(info: &ModelInfo) -> String {
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
    let _ = writeln!(
        s,
        "\n  training memory (f32, AdamW, batch {} x {} tokens)",
        m.batch, m.seq_len
    );
    for (name, v) in [
        ("weights", m.weights),
        ("grads", m.grads),
        ("adamw m+v", m.adamw),
        ("activations*", m.activations),
    ] {
        let _ = writeln!(s, "  {name:<14} {:>12}", bytes(v));
    }
    let _ = writeln!(
        s,
        "  {:<14} {:>12}   (*estimate from the layer formulas)",
        "total",
        bytes(info.training_memory_total)
    );
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
