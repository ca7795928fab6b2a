//! `k3mini teacher`: fetch the built-in teachers and talk to them.

use super::serve::{ServeArgs, announce, stop_on_ctrl_c};
use crate::cli::progress::bar as progress_bar;
use anyhow::Result;
use clap::Subcommand;
use k3mini::device::DeviceList;
use k3mini::recipe::{DistillPlan, RunPlan};
use k3mini::teachers::{generate_plan, gguf_tokenizer, open_local, resolve, score_plan};
use k3mini_data::ChatFormat;
use k3mini_data::chat::{Message, Role, render};
use k3mini_teacher::local::Engine;
use k3mini_teacher::server::serve;
use k3mini_teacher::{GenerateParams, Teacher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Subcommand)]
pub enum TeacherCommand {
    /// Download a built-in teacher (`smollm2`) into the cache and print its path.
    Fetch { name: String },
    /// Score a recipe's corpus with its [teacher] into Parquet shards (a rerun skips finished shards).
    Score {
        recipe: PathBuf,
        /// Shard directory (default: the recipe's teacher.shards_dir, else <run out_dir>/shards).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        quiet: bool,
        /// Where a local teacher runs (default: the recipe's run.device; its first device).
        #[arg(long)]
        device: Option<DeviceList>,
    },
    /// Sample reasoning trajectories for the recipe's [teacher.generate] prompts into Parquet shards
    /// (a rerun skips finished shards).
    Generate {
        recipe: PathBuf,
        /// Shard directory (default: teacher.generate.out_dir, else <run out_dir>/trajectories).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Only the first N prompts (after each source's own limit).
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        quiet: bool,
        /// Where a local teacher runs (default: the recipe's run.device; its first device).
        #[arg(long)]
        device: Option<DeviceList>,
    },
    /// Serve a local teacher over HTTP with vLLM's OpenAI-compatible surface (until Ctrl-C).
    Serve {
        /// A built-in teacher name (fetched if needed) or a .gguf.
        teacher: String,
        #[command(flatten)]
        serve: ServeArgs,
        /// Where the teacher runs: cpu or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: DeviceList,
        /// The engine that runs it: llama-cpp (any GGUF llama.cpp runs) or burn.
        #[arg(long, default_value_t)]
        engine: Engine,
        /// Return a MoE teacher's routed experts as vLLM and SGLang do (the flag both take):
        /// `choices[0].routed_experts` on every /v1/completions, `meta_info.routed_experts` on
        /// /generate requests that set `return_routed_experts` (llama-cpp engine only).
        #[arg(long)]
        enable_return_routed_experts: bool,
    },
    /// Write a local teacher's tokenizer as tokenizer.json (for recipes that use a served teacher).
    Tokenizer {
        teacher: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Ask a local teacher one chat question (greedy unless --temperature is set).
    Chat {
        /// A built-in teacher name (fetched if needed) or a .gguf.
        teacher: String,
        question: String,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Where the teacher runs: cpu or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: DeviceList,
        /// The engine that runs it: llama-cpp (any GGUF llama.cpp runs) or burn.
        #[arg(long, default_value_t)]
        engine: Engine,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

pub fn run(cmd: TeacherCommand) -> Result<()> {
    match cmd {
        TeacherCommand::Score {
            recipe,
            out,
            quiet,
            device,
        } => score(&recipe, device, out, quiet),
        TeacherCommand::Generate {
            recipe,
            out,
            limit,
            quiet,
            device,
        } => generate(&recipe, device, out, limit, quiet),
        TeacherCommand::Tokenizer { teacher, out } => {
            let tokenizer = gguf_tokenizer(&resolve(&teacher)?)?;
            tokenizer.save(&out)?;
            println!(
                "{} ({} ids, fingerprint {})",
                out.display(),
                tokenizer.vocab_size(),
                tokenizer.fingerprint()
            );
            Ok(())
        }
        TeacherCommand::Serve {
            teacher,
            serve: args,
            device,
            engine,
            enable_return_routed_experts,
        } => {
            let (addr, options) = args.options()?;
            let mut t = open_local(&resolve(&teacher)?, engine, &device)?;
            if enable_return_routed_experts {
                t = t.record_routing()?;
            }
            let stop = stop_on_ctrl_c()?;
            let what = format!("model {}", t.name());
            let limits = options.limits.clone();
            serve(Arc::new(t), &addr, options, stop, |at| {
                announce(&at, &what, &limits)
            })?;
            Ok(())
        }
        TeacherCommand::Fetch { name } => {
            println!("{}", resolve(&name)?.display());
            Ok(())
        }
        TeacherCommand::Chat {
            teacher,
            question,
            max_tokens,
            temperature,
            seed,
            device,
            engine,
        } => {
            let t = open_local(&resolve(&teacher)?, engine, &device)?;
            let messages = [Message::new(Role::User, question)];
            let prompt = render(&messages, &[], ChatFormat::Chatml, true)?;
            let (ids, _) = prompt.encode(&t.tokenizer)?;
            let params = GenerateParams {
                max_tokens,
                temperature,
                seed,
                stop: t.meta.eos.into_iter().collect(),
                ..Default::default()
            };
            let started = std::time::Instant::now();
            let out = t.generate(&ids, &params)?;
            let secs = started.elapsed().as_secs_f64();
            println!(
                "{}",
                t.tokenizer
                    .decode(&out.ids)?
                    .trim_end_matches(k3mini_data::tokenizer::END_OF_TURN)
            );
            eprintln!(
                "{} prompt + {} generated tokens in {secs:.1}s ({:?})",
                ids.len(),
                out.ids.len(),
                out.finish
            );
            Ok(())
        }
    }
}

/// A recipe's plan (on `device` when given) and its distillation part, which names the teacher.
fn distilling(recipe_path: &Path, device: Option<DeviceList>) -> Result<(RunPlan, DistillPlan)> {
    let mut plan = k3mini::recipe::load(recipe_path)?;
    if let Some(d) = device {
        plan = plan.with_devices(d)?;
    }
    let Some(distill) = plan.distill.clone() else {
        anyhow::bail!(
            "{}: no [teacher] and [distill] tables: nothing names a teacher",
            recipe_path.display()
        );
    };
    Ok((plan, distill))
}

fn score(
    recipe_path: &Path,
    device: Option<DeviceList>,
    out: Option<PathBuf>,
    quiet: bool,
) -> Result<()> {
    let (plan, distill) = distilling(recipe_path, device)?;
    let bar = progress_bar(quiet, "segments");
    let started = std::time::Instant::now();
    let (manifest, dir) = score_plan(&plan, &distill, out, &mut |p| {
        if p.counting {
            bar.set_message(format!(
                "reading the corpus: {} documents, {} segments so far",
                p.documents, p.segments_total
            ));
            return;
        }
        bar.set_length(p.segments_total as u64);
        bar.set_position(p.segments_done as u64);
        bar.set_message(format!(
            "shard {}/{}  {:.0} tokens/s  ({} shards skipped)",
            p.shards_done,
            p.shards_total,
            p.positions as f64 / started.elapsed().as_secs_f64().max(1e-9),
            p.skipped
        ));
    })?;
    bar.finish();
    let (positions, bytes) = (manifest.positions(), manifest.bytes());
    println!(
        "{} shards, {} documents, {positions} positions at k = {}: {:.1} MB, {:.1} bytes/token -> {}",
        manifest.shards.len(),
        manifest.job.documents,
        manifest.job.k,
        bytes as f64 / 1e6,
        bytes as f64 / positions.max(1) as f64,
        dir.display()
    );
    let routed: u64 = manifest
        .shards
        .iter()
        .filter_map(|s| s.routing.as_ref().map(|r| r.bytes))
        .sum();
    if manifest.job.routing.is_some() {
        println!(
            "routing shards beside them: {:.1} MB, {:.1} bytes/token (k3mini routing report {})",
            routed as f64 / 1e6,
            routed as f64 / positions.max(1) as f64,
            dir.display()
        );
    }
    Ok(())
}

fn generate(
    recipe_path: &Path,
    device: Option<DeviceList>,
    out: Option<PathBuf>,
    limit: Option<usize>,
    quiet: bool,
) -> Result<()> {
    let (plan, distill) = distilling(recipe_path, device)?;
    let Some(g) = &distill.teacher.generate else {
        anyhow::bail!(
            "{}: no [teacher.generate] table naming prompts",
            recipe_path.display()
        );
    };
    let bar = progress_bar(quiet, "prompts");
    let started = std::time::Instant::now();
    let (manifest, dir) = generate_plan(&plan, &distill, g, out, limit, &mut |p| {
        bar.set_length(p.prompts_total as u64);
        bar.set_position(p.prompts_done as u64);
        bar.set_message(format!(
            "{:.1} tokens/s  {} stopped, {} hit max_tokens  ({} shards skipped)",
            p.tokens as f64 / started.elapsed().as_secs_f64().max(1e-9),
            p.stopped,
            p.truncated,
            p.skipped_shards
        ));
    })?;
    bar.finish();
    println!(
        "{} shards, {} prompts, {} generated tokens with top-{}: {:.2} MB -> {}",
        manifest.shards.len(),
        manifest.job.prompts,
        manifest.positions(),
        manifest.job.k,
        manifest.bytes() as f64 / 1e6,
        dir.display()
    );
    Ok(())
}
