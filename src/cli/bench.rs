//! `k3mini bench`: forward+backward throughput, KDA kernels, training-memory peak, teacher
//! scoring and shard sizes, export, GGUF decode in llama.cpp.

use crate::cli::model::bytes;
use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use k3mini::bench::{self, recipe::bench_recipe};
use k3mini::device::DeviceList;
use k3mini::export::bench_export;
use k3mini_gguf::mix::FileType;
use k3mini_kernels::recompute::ComposedRegions;
use k3mini_student::bench::{ShapeStep, TrainStepBench, bench_kda};
use k3mini_student::config::KdaKernel;
use k3mini_student::head::HeadChunks;
use k3mini_student::precision::Precision;
use k3mini_teacher::bench::{ShardSize, packed_id_bits, published_formats};

/// What a teacher benchmark scores: the first `segments` windows of `seq_len` tokens of a text.
#[derive(clap::Args)]
pub struct ScoringInput {
    #[arg(long, default_value = "smollm2")]
    teacher: String,
    /// Text to score (default: Hamlet from the source tree this k3mini was built from, so the
    /// command works from any directory).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/corpus/shakespeare/hamlet.txt"))]
    corpus: std::path::PathBuf,
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    #[arg(long, default_value_t = 8)]
    segments: usize,
}

impl ScoringInput {
    fn windows(&self) -> bench::teacher::Windows {
        bench::teacher::Windows {
            text: self.corpus.clone(),
            seq_len: self.seq_len,
            segments: self.segments,
        }
    }
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Forward+backward tokens/s and peak memory of one model shape.
    Model(ModelArgs),
    /// The KDA op's three forms (naive, composed chunk, fused chunk), forward and forward+backward.
    Kda(KdaArgs),
    /// Real optimizer steps of a recipe (data, forward, backward, AdamW): tokens/s and peak RSS.
    Train {
        recipe: std::path::PathBuf,
        #[arg(long, default_value_t = 4)]
        steps: usize,
        #[arg(long)]
        json: bool,
        /// Overrides the recipe's run.device.
        #[arg(long)]
        device: Option<DeviceList>,
        /// Turns on train.activation_checkpointing (to compare peak memory against the recipe).
        #[arg(long)]
        activation_checkpointing: bool,
        /// Overrides model.precision (f32 or bf16).
        #[arg(long)]
        precision: Option<Precision>,
        /// Overrides train.head_chunk (0: the whole micro-batch's logits at once, the reference).
        #[arg(long)]
        head_chunk: Option<usize>,
        /// Overrides model.kda.kernel (`composed`: the chunk form without its own backward).
        #[arg(long, value_enum)]
        kda_kernel: Option<Kernel>,
        /// Every recompute region composed: the reference.
        #[arg(long)]
        composed_regions: bool,
        /// Overrides train.checkpoint_every (0: only the checkpoint at the end, written after
        /// the last measured step), to measure what checkpoints cost in memory.
        #[arg(long)]
        checkpoint_every: Option<usize>,
    },
    /// Teacher scoring: in-process vs through `teacher serve` on loopback, and shard bytes per token.
    Teacher {
        #[command(flatten)]
        input: ScoringInput,
        /// cpu or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: DeviceList,
        /// llama-cpp or burn.
        #[arg(long, default_value_t)]
        engine: k3mini_teacher::local::Engine,
    },
    /// Scoring tokens/s of a GGUF teacher on llama.cpp against the burn engine, interleaved
    /// (a build with llama.cpp, the default).
    #[cfg(feature = "llama-cpp")]
    Engines {
        #[command(flatten)]
        input: ScoringInput,
        /// Top-k values to score at, each measured `rounds` times, the engines alternating.
        #[arg(long, value_delimiter = ',', default_value = "20,64")]
        k: Vec<usize>,
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        /// CPU threads for llama.cpp.
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// Decode speed and per-sequence state of GGUF files in llama.cpp at several contexts:
    /// prefill that many ids of a text, decode greedily, the files alternating (A B A B).
    #[cfg(feature = "llama-cpp")]
    Decode {
        #[arg(required = true)]
        gguf: Vec<std::path::PathBuf>,
        /// Prompt lengths (ids).
        #[arg(long, value_delimiter = ',', default_value = "2048,8192,32768",
              value_parser = clap::value_parser!(u32).range(1..))]
        contexts: Vec<u32>,
        /// Ids decoded after each prompt.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
        tokens: u32,
        /// Rounds over every context, the files' order reversed in each even one.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        rounds: u32,
        /// CPU threads for llama.cpp.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// llama.cpp's flash attention: auto (its choice), on or off.
        #[arg(long, value_enum, default_value_t = Flash::Auto)]
        flash_attn: Flash,
        /// The prompt text, repeated to each length (default: Hamlet from the source tree this
        /// k3mini was built from).
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/corpus/shakespeare/hamlet.txt"))]
        text: std::path::PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Shard bytes per token in both schemas at several k, and what the compact one loses
    /// (KL, largest logprob error), measured on exact (schema v1) shards, e.g. from
    /// `teacher score` with `teacher.logprob_step = 0`.
    Shards {
        /// A directory of exact shards (all are read).
        dir: std::path::PathBuf,
        /// Comma-separated k (at most the shards' own).
        #[arg(long, default_value = "20,50,64,128", value_delimiter = ',')]
        k: Vec<usize>,
        /// The compact schema's logprob step (nats).
        #[arg(long, default_value_t = k3mini_data::shards::DEFAULT_LOGPROB_STEP)]
        step: f32,
        /// Regroup the rows into files of this many (0: one file); default: as the shards are.
        #[arg(long)]
        rows_per_file: Option<usize>,
    },
    /// The data loader as the corpus grows: peak RSS and tokens/s of one pass of the streaming
    /// loader, and of reading every document into memory first, over corpora of the machine's
    /// own text (Python sources, Rust documentation HTML) written as Parquet, each in its own
    /// process.
    Data {
        /// Where the corpora are written (kept for reruns; not committed).
        #[arg(long, default_value = "bench-data")]
        out: std::path::PathBuf,
        /// Corpus sizes in MB.
        #[arg(long, default_value = "10,100,1000", value_delimiter = ',')]
        sizes: Vec<u64>,
        #[arg(long, default_value = "kimi")]
        tokenizer: String,
        #[arg(long, default_value_t = 2048)]
        seq_len: usize,
        /// Sizes (MB) up to which the in-memory reader runs too.
        #[arg(long, default_value_t = 1000)]
        memory_up_to: u64,
    },
    /// One measurement in a child process of a benchmark (`k3mini::bench::Child` as JSON),
    /// printed as JSON.
    #[command(hide = true)]
    Child { request: String },
    /// `export --format gguf` of a freshly initialised preset: seconds and file size per file type.
    Export {
        #[arg(long, default_value = "smoke-300m")]
        preset: String,
        /// Comma-separated file types.
        #[arg(long, default_value = "f32,q8_0,q4_0,q4_k_m")]
        quant: String,
        /// Where the checkpoint and the GGUF files go (kept, e.g. for scripts/bench/decode.py).
        #[arg(long, default_value = "bench-export")]
        out: std::path::PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// The README's table: tiny and ~50M, the training path against the composed kernel, whole
    /// head and composed regions, A B A B, each in its own process.
    All {
        #[arg(long, default_value_t = 3)]
        steps: usize,
    },
    /// The memory model against measurement: at four sizes (tiny to smoke-300m) and on the 3B
    /// preset's layers at small width, with and without activation checkpointing, the heap bytes
    /// a forward + backward keeps and peaks at against `model info`'s estimate, each in its own
    /// process.
    Memory {
        #[arg(long, default_value_t = 1)]
        steps: usize,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Kernel {
    Chunk,
    Composed,
    Naive,
}

impl From<Kernel> for KdaKernel {
    fn from(k: Kernel) -> Self {
        match k {
            Kernel::Chunk => KdaKernel::Chunk,
            Kernel::Composed => KdaKernel::Composed,
            Kernel::Naive => KdaKernel::Naive,
        }
    }
}

#[derive(Args)]
pub struct ModelArgs {
    /// A preset, or `bench-50m`, `bench-150m`, `bench-k3` (`k3mini_student::bench::bench_shape`).
    #[arg(long, default_value = "tiny")]
    preset: String,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 256)]
    seq_len: usize,
    #[arg(long, default_value_t = 3)]
    steps: usize,
    #[arg(long, value_enum, default_value = "chunk")]
    kernel: Kernel,
    /// Tokens per chunk of the LM head and loss (0: the whole batch at once); default: the
    /// training default for the vocabulary.
    #[arg(long)]
    head_chunk: Option<usize>,
    /// Activation checkpointing (`train.activation_checkpointing`): each sub-layer keeps its input.
    #[arg(long)]
    activation_checkpointing: bool,
    /// Every recompute region composed (norms, gates, the gated FFN product, attention scores
    /// kept as their ops keep them): the reference.
    #[arg(long)]
    composed_regions: bool,
    #[arg(long)]
    json: bool,
    /// cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceList,
}

impl ModelArgs {
    fn step(&self) -> ShapeStep {
        ShapeStep {
            kernel: self.kernel.into(),
            head_chunk: self.head_chunk,
            checkpointing: self.activation_checkpointing,
            composed_regions: self.composed_regions,
            ..ShapeStep::new(&self.preset, self.batch, self.seq_len, self.steps)
        }
    }
}

#[derive(Args)]
pub struct KdaArgs {
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceList,
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Model(a) => {
            let r = bench::step(&a.step(), &a.device)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}\n{}", header(), row(&r));
            }
            Ok(())
        }
        BenchCommand::Kda(a) => kda(&a),
        BenchCommand::Export {
            preset,
            quant,
            out,
            json,
        } => export(&preset, &quant, &out, json),
        BenchCommand::Train {
            recipe,
            steps,
            json,
            device,
            activation_checkpointing,
            precision,
            head_chunk,
            kda_kernel,
            composed_regions,
            checkpoint_every,
        } => {
            let mut plan = k3mini::recipe::load(&recipe)?;
            if let Some(d) = device {
                plan = plan.with_devices(d)?;
            }
            plan.train.activation_checkpointing |= activation_checkpointing;
            if let Some(p) = precision {
                plan.model.precision = p;
            }
            if head_chunk.is_some() {
                plan.train.head_chunk = head_chunk;
            }
            if let Some(k) = kda_kernel {
                plan.model.kda.kernel = k.into();
            }
            if let Some(n) = checkpoint_every {
                plan.train.checkpoint_every = if n == 0 { plan.train.steps + 1 } else { n };
            }
            let _composed = composed_regions.then(ComposedRegions::new);
            train(&plan, steps, json)
        }
        BenchCommand::Teacher {
            input,
            device,
            engine,
        } => teacher_scoring(&input, &device, engine),
        #[cfg(feature = "llama-cpp")]
        BenchCommand::Engines {
            input,
            k,
            rounds,
            threads,
        } => engines(&input, &k, rounds, threads),
        #[cfg(feature = "llama-cpp")]
        BenchCommand::Decode {
            gguf,
            contexts,
            tokens,
            rounds,
            threads,
            flash_attn,
            text,
            json,
        } => {
            let contexts: Vec<usize> = contexts.into_iter().map(|c| c as usize).collect();
            decode(
                &bench::decode::DecodeBench {
                    files: &gguf,
                    text: &text,
                    contexts: &contexts,
                    tokens: tokens as usize,
                    rounds: rounds as usize,
                    threads: threads.max(1),
                    flash: flash_attn.into(),
                },
                json,
            )
        }
        BenchCommand::Shards {
            dir,
            k,
            step,
            rows_per_file,
        } => shards(&dir, &k, step, rows_per_file),
        BenchCommand::All { steps } => {
            println!("{}", header());
            Ok(bench::training_path(&exe()?, steps, |r| {
                println!("{}", row(&r))
            })?)
        }
        BenchCommand::Memory { steps } => memory(steps),
        BenchCommand::Data {
            out,
            sizes,
            tokenizer,
            seq_len,
            memory_up_to,
        } => data(&out, &sizes, &tokenizer, seq_len, memory_up_to),
        BenchCommand::Child { request } => {
            println!("{}", bench::answer(&request)?);
            Ok(())
        }
    }
}

/// This binary: the benchmarks' children run it.
fn exe() -> Result<std::path::PathBuf> {
    std::env::current_exe().context("locating the k3mini binary")
}

fn kda(a: &KdaArgs) -> Result<()> {
    println!("| kernel | T | heads x dim | forward ms | fwd+bwd ms |\n|---|---|---|---|---|");
    for r in bench_kda(
        a.batch,
        a.seq_len,
        a.heads,
        a.head_dim,
        a.reps,
        &a.device.open_main()?,
    ) {
        println!(
            "| {} | {} | {} x {} | {:.1} | {:.1} |",
            r.kernel, r.seq_len, r.heads, r.head_dim, r.forward_ms, r.forward_backward_ms
        );
    }
    Ok(())
}

fn export(preset: &str, quant: &str, out: &std::path::Path, json: bool) -> Result<()> {
    let quants = quant
        .split(',')
        .map(|q| FileType::parse(q.trim()))
        .collect::<Result<Vec<_>, _>>()?;
    let rows = bench_export(preset, &quants, out)?;
    if json {
        println!("{}", serde_json::to_string(&rows)?);
        return Ok(());
    }
    println!(
        "| preset | params | file type | arch | export s | size | file |\n|---|---|---|---|---|---|---|"
    );
    for r in rows {
        println!(
            "| {preset} | {:.1}M | {} | {} | {:.1} | {} | {} |",
            r.params as f64 / 1e6,
            r.quant,
            r.arch,
            r.seconds,
            bytes(r.bytes as usize),
            r.path.display()
        );
    }
    Ok(())
}

fn train(plan: &k3mini::recipe::RunPlan, steps: usize, json: bool) -> Result<()> {
    let r = bench_recipe(plan, steps)?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!(
        "| recipe | params | tokens/step | steps | devices (working at once) | tokens/s (median) | s/step | peak RSS | peak heap | activations (measured) | activations (model info) |\n|---|---|---|---|---|---|---|---|---|---|---|"
    );
    println!(
        "| {} | {:.1}M | {} | {} | {} ({:.2}) | {:.0} | {:.2} | {} | {} | {} | {} |",
        r.recipe,
        r.params as f64 / 1e6,
        r.tokens_per_step,
        r.steps,
        r.devices,
        r.median_concurrency,
        r.median_tokens_per_s,
        r.median_step_s,
        r.peak_rss_bytes.map_or("n/a".into(), bytes),
        r.peak_heap_bytes.map_or("n/a".into(), bytes),
        r.measured_activations().map_or("n/a".into(), bytes),
        bytes(plan.training_memory().activations),
    );
    Ok(())
}

fn teacher_scoring(
    input: &ScoringInput,
    device: &DeviceList,
    engine: k3mini_teacher::local::Engine,
) -> Result<()> {
    let r = bench::teacher::scoring(&input.teacher, engine, device, &input.windows())?;
    println!(
        "| segments x tokens | k | in-process tokens/s | HTTP (loopback) tokens/s | HTTP overhead |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| {} x {} | {} | {:.0} | {:.0} | {:.1}% |",
        r.segments,
        r.seq_len,
        r.k,
        r.in_process_tokens_per_s,
        r.http_tokens_per_s,
        100.0 * (r.in_process_tokens_per_s / r.http_tokens_per_s - 1.0)
    );
    println!();
    print_shard_sizes(&r.shards, r.vocab);
    Ok(())
}

/// llama.cpp's flash-attention setting on the command line.
#[cfg(feature = "llama-cpp")]
#[derive(Clone, Copy, ValueEnum)]
pub enum Flash {
    Auto,
    On,
    Off,
}

#[cfg(feature = "llama-cpp")]
impl From<Flash> for k3mini_teacher::engine::llama_cpp::FlashAttn {
    fn from(f: Flash) -> Self {
        match f {
            Flash::Auto => Self::Auto,
            Flash::On => Self::On,
            Flash::Off => Self::Off,
        }
    }
}

#[cfg(feature = "llama-cpp")]
fn decode(b: &bench::decode::DecodeBench, json: bool) -> Result<()> {
    if !json {
        println!(
            "| file | context | round | prefill tok/s | decode tok/s | sequence state (MiB) |"
        );
        println!("|---|---|---|---|---|---|");
    }
    bench::decode::decode(b, |r| {
        if json {
            println!("{}", serde_json::to_string(r).expect("a row serialises"));
        } else {
            println!(
                "| {} | {} | {} | {:.1} | {:.2} | {:.3} |",
                r.file.display(),
                r.speed.context,
                r.round,
                r.speed.prefill_tokens_per_s,
                r.speed.decode_tokens_per_s,
                r.speed.state_bytes as f64 / (1u64 << 20) as f64
            );
        }
    })?;
    if !json {
        println!(
            "({} ids decoded after each prompt of {}, the state taken after them; llama.cpp on {} \
             threads, flash attention {:?})",
            b.tokens,
            b.text.display(),
            b.threads,
            b.flash
        );
    }
    Ok(())
}

#[cfg(feature = "llama-cpp")]
fn engines(input: &ScoringInput, ks: &[usize], rounds: usize, threads: usize) -> Result<()> {
    let (segments, measured) =
        bench::teacher::engines(&input.teacher, &input.windows(), ks, rounds, threads)?;
    println!("| k | round | burn tokens/s | llama.cpp tokens/s | llama.cpp / burn |");
    println!("|---|---|---|---|---|");
    for r in measured {
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} |",
            r.k,
            r.round,
            r.burn_tokens_per_s,
            r.llama_cpp_tokens_per_s,
            r.llama_cpp_tokens_per_s / r.burn_tokens_per_s
        );
    }
    println!(
        "({segments} segments of {} tokens from {}; llama.cpp on {threads} threads)",
        input.seq_len,
        input.corpus.display()
    );
    Ok(())
}

fn shards(
    dir: &std::path::Path,
    ks: &[usize],
    step: f32,
    rows_per_file: Option<usize>,
) -> Result<()> {
    let r = bench::teacher::shard_dir(dir, ks, step, rows_per_file)?;
    println!(
        "{} shards, {} rows, {} positions, top-{} from {}; written as {} files of ~{} positions\n",
        r.files,
        r.rows,
        r.positions,
        r.k,
        r.teacher,
        r.written_files,
        r.positions / r.written_files.max(1)
    );
    print_shard_sizes(&r.sizes, r.vocab);
    if !r.skipped.is_empty() {
        println!("\n(k {:?} skipped: the shards hold top-{})", r.skipped, r.k);
    }
    Ok(())
}

/// The measured table, then the published formats' arithmetic at the same vocabulary.
fn print_shard_sizes(sizes: &[ShardSize], vocab: usize) {
    println!(
        "| k | v1 exact B/token | v2 B/token | v2 step (nats) | max |Δ logprob| | KL(exact ‖ v2) mean / max per token |"
    );
    println!("|---|---|---|---|---|---|");
    for s in sizes {
        println!(
            "| {} | {:.1} | {:.1} | 1/{:.0} | {:.4} | {:.2e} / {:.2e} |",
            s.k,
            s.exact_bytes_per_token,
            s.compact_bytes_per_token,
            1.0 / s.step,
            s.max_logprob_error,
            s.kl_mean,
            s.kl_max
        );
    }
    println!(
        "\nWhere the v2 bytes go (B/token by column; ids' order-0 entropy within each file):\n"
    );
    if let Some(first) = sizes.first() {
        let names: Vec<&str> = first
            .compact_columns
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        println!(
            "| k | {} | id entropy (bits/id → B/token) |",
            names.join(" | ")
        );
        println!("|---|{}---|", "---|".repeat(names.len()));
    }
    for s in sizes {
        let cols: Vec<String> = s
            .compact_columns
            .iter()
            .map(|(_, b)| format!("{b:.1}"))
            .collect();
        println!(
            "| {} | {} | {:.2} → {:.1} |",
            s.k,
            cols.join(" | "),
            s.id_entropy_bits,
            s.id_entropy_bits * s.k as f64 / 8.0
        );
    }
    println!(
        "\nPublished formats at this vocabulary ({vocab} ids, {}-bit packed ids), by arithmetic \
         (logprobs lossy in all three):\n",
        packed_id_bits(vocab)
    );
    println!("| format | k | B/token |\n|---|---|---|");
    for f in published_formats(vocab) {
        println!("| {} | {} | {:.1} |", f.name, f.k, f.bytes_per_token);
    }
}

fn header() -> &'static str {
    "| shape | params | batch x seq | KDA kernel | LM head | regions | tokens/s (fwd+bwd) | ms/step | model GFLOP/s (of matmul peak) | peak RSS | kept after forward (heap) | step peak (heap) |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
}

fn row(r: &TrainStepBench) -> String {
    let positions = r.batch * (r.seq_len - 1);
    let head = match r.head {
        HeadChunks::Tokens(n) if r.head.cuts(positions) => format!("chunks of {n}"),
        HeadChunks::Tokens(_) => "whole (one chunk)".to_string(),
        HeadChunks::Whole => "whole".to_string(),
    };
    let heap = |b: Option<usize>| b.map_or("n/a".into(), bytes);
    format!(
        "| {} | {:.1}M | {} x {} | {} | {head} | {} | {:.0} | {:.0} | {:.1} ({:.0}% of {:.0}) | {} | {} | {} |",
        r.name,
        r.params as f64 / 1e6,
        r.batch,
        r.seq_len,
        format!("{:?}", r.kernel).to_lowercase(),
        if r.composed_regions {
            "composed"
        } else {
            "recompute"
        },
        r.tokens_per_s,
        r.ms_per_step,
        r.model_gflops,
        100.0 * r.mfu(),
        r.peak_gflops,
        r.peak_rss_bytes.map_or("n/a".into(), bytes),
        heap(r.kept_bytes),
        heap(r.step_peak_bytes),
    )
}

/// The memory model's validation table.
fn memory(steps: usize) -> Result<()> {
    println!(
        "| shape | params | batch x seq | checkpointing | kept after forward (heap) | estimate | error | step peak (heap) | bound: estimate with the largest transient, and the gradients |\n|---|---|---|---|---|---|---|---|---|"
    );
    let heap = |b: Option<usize>| b.map_or("n/a".into(), bytes);
    Ok(bench::memory(&exe()?, steps, |c| {
        let r = &c.measured;
        println!(
            "| {} | {:.1}M | {} x {} | {} | {} | {} | {:+.0}% | {} | {} |",
            r.name,
            r.params as f64 / 1e6,
            r.batch,
            r.seq_len,
            if r.checkpointing { "yes" } else { "no" },
            bytes(c.kept),
            bytes(c.estimated_kept),
            100.0 * c.kept_error(),
            heap(r.step_peak_bytes),
            bytes(c.estimated_bound),
        );
    })?)
}

fn data(
    out: &std::path::Path,
    sizes: &[u64],
    tokenizer: &str,
    seq_len: usize,
    memory_up_to: u64,
) -> Result<()> {
    println!(
        "| corpus | loader | tokens | seconds | tokens/s | peak RSS |\n|---|---|---|---|---|---|"
    );
    Ok(bench::loader::data(
        &exe()?,
        out,
        sizes,
        tokenizer,
        seq_len,
        memory_up_to,
        |mb, r| {
            println!(
                "| {mb} MB of text ({:.1} MB Parquet) | {} | {} | {:.1} | {:.0} | {} |",
                r.corpus_bytes as f64 / 1e6,
                r.mode,
                r.tokens,
                r.seconds,
                r.tokens_per_s,
                r.peak_rss_bytes.map_or("n/a".into(), bytes),
            );
        },
    )?)
}
