//! `k3mini teacher`: fetch the built-in teachers and talk to them.

use anyhow::Result;
use burn::tensor::Device;
use clap::Subcommand;
use k3mini::train::trainer::tokenized_documents;
use k3mini_data::ChatFormat;
use k3mini_data::chat::{Message, Role, render};
use k3mini_data::shards::ShardMeta;
use k3mini_teacher::client::{ClientOptions, HttpTeacher};
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::score::{ScoreJob, score_corpus};
use k3mini_teacher::server::serve;
use k3mini_teacher::{GenerateParams, Teacher, fetch};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    },
    /// Serve a local teacher over HTTP with vLLM's OpenAI-compatible surface (until Ctrl-C).
    Serve {
        /// A built-in teacher name (fetched if needed) or a llama-architecture .gguf.
        teacher: String,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// 0 picks a free port (printed on the first line).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Threads accepting requests (the model runs one request at a time).
        #[arg(long, default_value_t = 4)]
        threads: usize,
    },
    /// Write a local teacher's tokenizer as tokenizer.json (for recipes that use a served teacher).
    Tokenizer {
        teacher: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Ask a local teacher one chat question (greedy unless --temperature is set).
    Chat {
        /// A built-in teacher name (fetched if needed) or a llama-architecture .gguf.
        teacher: String,
        question: String,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

/// A built-in teacher's GGUF (fetched when missing) or a path.
pub fn resolve(teacher: &str) -> Result<PathBuf> {
    if fetch::known(teacher).is_some() {
        return Ok(fetch::fetch(teacher, &fetch::cache_dir(), &mut |l| {
            eprintln!("{l}")
        })?);
    }
    let path = Path::new(teacher);
    anyhow::ensure!(
        path.is_file(),
        "{teacher}: not a built-in teacher (smollm2) and no such file"
    );
    Ok(path.to_path_buf())
}

pub fn run(cmd: TeacherCommand) -> Result<()> {
    match cmd {
        TeacherCommand::Score { recipe, out, quiet } => score(&recipe, out, quiet),
        TeacherCommand::Tokenizer { teacher, out } => {
            let file = k3mini_checkpoints::gguf::GgufFile::open(&resolve(&teacher)?)?;
            let (tokenizer, _) = k3mini_teacher::gguf::load_tokenizer(&file)?;
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
            host,
            port,
            threads,
        } => {
            let t = LocalTeacher::from_gguf(&resolve(&teacher)?, &Device::default())?;
            let stop = Arc::new(AtomicBool::new(false));
            let on_ctrl_c = stop.clone();
            ctrlc::set_handler(move || on_ctrl_c.store(true, Ordering::SeqCst))?;
            let name = t.name().to_string();
            serve(
                Arc::new(t),
                &format!("{host}:{port}"),
                threads,
                stop,
                |addr| {
                    // The first line says where (scripts and tests read the port from it).
                    println!("listening on http://{addr} (model {name})");
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                },
            )?;
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
        } => {
            let t = LocalTeacher::from_gguf(&resolve(&teacher)?, &Device::default())?;
            let messages = [Message {
                role: Role::User,
                content: question,
                thinking: None,
            }];
            let prompt = render(&messages, ChatFormat::Chatml, true).map_err(anyhow::Error::msg)?;
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
                t.tokenizer.decode(&out.ids)?.trim_end_matches("<|im_end|>")
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

/// Text whose tokenization exercises digits, whitespace, punctuation and multi-byte characters:
/// the probe that a served teacher tokenizes as the student does.
const PROBE: &str = "Hello, world! In 2026, 12345 + 678 = 13023.\n\tdef f(x):\n\t\treturn x ** 2  # café naïve 中文 😀";

fn score(recipe_path: &Path, out: Option<PathBuf>, quiet: bool) -> Result<()> {
    let recipe = k3mini::recipe::load(recipe_path)?;
    let Some(tc) = &recipe.recipe.teacher else {
        anyhow::bail!(
            "{}: no [teacher] table to score with",
            recipe_path.display()
        );
    };
    anyhow::ensure!(
        tc.temperature == 1.0,
        "teacher.temperature {}: teachers are scored at temperature 1 (tempering from stored \
         logprobs happens in the distillation loss)",
        tc.temperature
    );
    let mismatch = |what: &str| {
        anyhow::anyhow!(
            "{}: data.tokenizer and the teacher's tokenizer differ ({what}): the teacher's top-k ids \
             would mean other tokens to the student. Use the teacher's tokenizer (cross-tokenizer \
             distillation is not supported yet).",
            recipe_path.display()
        )
    };
    let (teacher, tokenizer): (Box<dyn Teacher>, k3mini_data::Tokenizer) = match &tc.model {
        Some(model) => {
            let path = if fetch::known(model).is_some() {
                resolve(model)?
            } else {
                resolve(&recipe.resolve_path(Path::new(model)).display().to_string())?
            };
            let local = LocalTeacher::from_gguf(&path, &Device::default())?;
            let tokenizer = if recipe.recipe.data.tokenizer == k3mini::recipe::TEACHER_TOKENIZER {
                local.tokenizer.clone()
            } else {
                let student = recipe.tokenizer()?;
                if student.fingerprint() != local.tokenizer.fingerprint() {
                    return Err(mismatch(
                        "their id → token tables have different fingerprints",
                    ));
                }
                student
            };
            (Box::new(local), tokenizer)
        }
        None => {
            let tokenizer = recipe.tokenizer()?;
            let opts = ClientOptions {
                api: tc.api,
                ..Default::default()
            };
            let remote = HttpTeacher::connect(&tc.endpoints, tokenizer.vocab_size(), opts)?;
            if remote.token_ids(PROBE)? != tokenizer.encode(PROBE)? {
                return Err(mismatch("the server tokenizes a probe text differently"));
            }
            (Box::new(remote), tokenizer)
        }
    };
    let docs: Vec<Vec<u32>> = tokenized_documents(&recipe, &tokenizer)?
        .into_iter()
        .map(|d| d.ids)
        .collect();
    let job = ScoreJob {
        out_dir: out
            .or_else(|| recipe.shards_dir())
            .expect("a [teacher] recipe has a shard dir"),
        meta: ShardMeta {
            teacher: teacher.name().to_string(),
            tokenizer_sha256: tokenizer.fingerprint(),
            k: tc.k,
            temperature: tc.temperature,
        },
        seq_len: recipe.recipe.data.seq_len,
        segments_per_shard: tc.segments_per_shard,
        concurrency: tc.concurrency,
    };
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(0)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} segments  {msg}  [{elapsed} < {eta}]",
        )
        .expect("valid template"),
    );
    let started = std::time::Instant::now();
    let manifest = score_corpus(teacher.as_ref(), &docs, &job, &mut |p| {
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
    let positions: usize = manifest.shards.iter().map(|s| s.positions).sum();
    let bytes: u64 = manifest.shards.iter().map(|s| s.bytes).sum();
    println!(
        "{} shards, {} documents, {positions} positions at k = {}: {:.1} MB, {:.1} bytes/token -> {}",
        manifest.shards.len(),
        manifest.documents,
        manifest.k,
        bytes as f64 / 1e6,
        bytes as f64 / positions.max(1) as f64,
        job.out_dir.display()
    );
    Ok(())
}
