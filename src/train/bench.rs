//! Benchmarks for the README: a recipe's real training steps (packing, forward, backward,
//! clipping, AdamW; `k3mini bench train RECIPE`), and the data loader's memory and throughput as a
//! corpus grows (`k3mini bench data`).

use crate::bail;
use crate::error::{Context, Result};
use crate::recipe::RunPlan;
use crate::run_dir::read_metrics;
use crate::train::trainer::{TrainOptions, train};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize)]
pub struct RecipeBench {
    pub recipe: String,
    pub params: usize,
    pub tokens_per_step: usize,
    pub steps: usize,
    /// Median over the steps after the first (which pays one-off allocation and warm-up).
    pub median_tokens_per_s: f64,
    pub median_step_s: f64,
    /// Peak resident memory of the process over the run.
    pub peak_rss_bytes: Option<usize>,
    /// Resident memory before the run began (the binary, its libraries, the allocator's pools).
    pub baseline_rss_bytes: Option<usize>,
    /// The most heap bytes live at once during a step (checkpoints written between steps
    /// excluded), and those live before the run, where the binary counts them
    /// (`k3mini_student::bench::CountingAlloc`): unlike resident memory, not inflated by what the
    /// allocator keeps after a free.
    pub peak_heap_bytes: Option<usize>,
    pub baseline_heap_bytes: Option<usize>,
    /// Model FLOPs of one training token (`k3mini_student::info::train_flops_per_token`).
    pub flops_per_token: f64,
    /// Devices the step runs on, and how many of them worked at once: the median over the steps
    /// after the first of Σ (each device's forward and backward seconds) / the step's seconds.
    /// Near the device count when the replicas overlap, at most 1 when they take turns.
    pub devices: usize,
    pub median_concurrency: f64,
}

impl RecipeBench {
    /// Activation memory as the issue tracker measures it: the peak less what was live before and
    /// the f32 weights, gradients and AdamW moments (16 bytes a parameter); from the heap where it
    /// is counted, else from resident memory.
    pub fn measured_activations(&self) -> Option<usize> {
        let (peak, base) = match (self.peak_heap_bytes, self.baseline_heap_bytes) {
            (Some(p), Some(b)) => (p, b),
            _ => (self.peak_rss_bytes?, self.baseline_rss_bytes?),
        };
        Some(peak.saturating_sub(base + 16 * self.params))
    }
}

/// Runs `steps` optimizer steps of `recipe` in a scratch directory (removed afterwards).
pub fn bench_recipe(plan: &RunPlan, steps: usize) -> Result<RecipeBench> {
    if steps < 2 {
        bail!("bench train needs at least 2 steps (the first is warm-up)");
    }
    let out = std::env::temp_dir().join(format!("k3mini-bench-{}", std::process::id()));
    std::fs::remove_dir_all(&out).ok();
    let baseline_rss_bytes = k3mini_student::bench::rss_bytes();
    let main = plan.devices.open()?.into_iter().next();
    let counted = main.is_some_and(|d| k3mini_student::bench::counts_heap(&d));
    let baseline_heap_bytes = k3mini_student::bench::heap_live_bytes().filter(|_| counted);
    let opts = TrainOptions {
        out_dir: Some(out.clone()),
        stop_after: Some(steps),
        ..Default::default()
    };
    let result =
        train(plan, &opts).and_then(|_| read_metrics(&out).context("reading the bench metrics"));
    std::fs::remove_dir_all(&out).ok();
    let lines = result?;
    if lines.len() < steps {
        bail!(
            "the recipe logs every {} steps: bench needs log_every = 1",
            plan.train.log_every
        );
    }
    let tokens = plan.train.batch_tokens;
    let median = |f: &dyn Fn(&crate::run_dir::StepMetrics) -> f64| {
        let mut v: Vec<f64> = lines[1..].iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let concurrency =
        median(&|m| m.replica_busy_s.iter().sum::<f64>() * m.tokens_per_s / tokens as f64);
    let median = median(&|m| m.tokens_per_s);
    Ok(RecipeBench {
        recipe: plan.recipe_name(),
        params: k3mini_student::info::param_breakdown(&plan.model).total(),
        tokens_per_step: tokens,
        steps,
        median_tokens_per_s: median,
        median_step_s: tokens as f64 / median,
        peak_rss_bytes: lines.iter().filter_map(|m| m.peak_rss_bytes).max(),
        baseline_rss_bytes,
        peak_heap_bytes: lines
            .iter()
            .filter_map(|m| m.step_peak_heap_bytes)
            .max()
            .filter(|_| counted),
        baseline_heap_bytes,
        flops_per_token: k3mini_student::info::train_flops_per_token(
            &plan.model,
            plan.data.seq_len,
        ),
        devices: plan.devices.replicas(),
        median_concurrency: concurrency,
    })
}

/// One pass of the training loader over a corpus: what it cost.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct LoaderBench {
    /// `stream` (the training loader) or `memory` (every document tokenized into memory first,
    /// as teacher scoring reads a corpus).
    pub mode: String,
    pub corpus_bytes: u64,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub peak_rss_bytes: Option<usize>,
}

/// Text this machine has, as Parquet files of about 32 MB of text under `dir` until `bytes` of it:
/// the Python standard library's sources, then the Rust documentation's HTML, each in path order
/// (the same corpus on every run), one document per file of at most 256 KB. Returns the bytes of
/// text written.
pub fn build_corpus(dir: &Path, bytes: u64) -> Result<u64> {
    let mut roots: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    if let Some(home) = std::env::var_os("HOME") {
        let toolchains = Path::new(&home).join(".rustup/toolchains");
        for e in std::fs::read_dir(toolchains)
            .into_iter()
            .flatten()
            .flatten()
        {
            roots.push(e.path().join("share/doc"));
        }
    }
    roots.sort();
    let mut files = Vec::new();
    for r in &roots {
        let mut under = Vec::new();
        walk(r, &mut under);
        under.sort();
        files.extend(under);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (mut written, mut part, mut texts, mut pending) = (0u64, 0usize, Vec::new(), 0u64);
    let flush = |texts: &mut Vec<String>, part: &mut usize| -> Result<()> {
        let path = dir.join(format!("part-{:05}.parquet", *part));
        k3mini_data::corpus::write_text_parquet(&path, "text", texts)?;
        texts.clear();
        *part += 1;
        Ok(())
    };
    for f in files {
        if written >= bytes {
            break;
        }
        // Files past MAX_DOCUMENT (the largest generated HTML pages, a few MB on one line) are
        // not documents a corpus holds; nor is what is not UTF-8.
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        if text.trim().is_empty() || text.len() > MAX_DOCUMENT {
            continue;
        }
        written += text.len() as u64;
        pending += text.len() as u64;
        texts.push(text);
        if pending >= 32 << 20 {
            flush(&mut texts, &mut part)?;
            pending = 0;
        }
    }
    if !texts.is_empty() {
        flush(&mut texts, &mut part)?;
    }
    if written < bytes {
        bail!(
            "this machine has only {} MB of text in {roots:?}",
            written >> 20
        );
    }
    Ok(written)
}

/// The largest file `build_corpus` takes as a document.
const MAX_DOCUMENT: usize = 256 << 10;

/// `.py` and `.html` files under `dir`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&p, out),
            Ok(t) if t.is_file() && p.extension().is_some_and(|x| x == "py" || x == "html") => {
                out.push(p)
            }
            _ => {}
        }
    }
}

/// One pass over the Parquet directory `dir` with `tokenizer`: the streaming loader packing rows
/// of `seq_len` until the stream enters its second epoch, or (`in_memory`) every document
/// tokenized into a list first, the way scoring reads a corpus.
pub fn bench_loader(
    dir: &Path,
    tokenizer: &str,
    seq_len: usize,
    in_memory: bool,
) -> Result<LoaderBench> {
    use k3mini_data::stream::{DocStream, Split, StreamCursor};
    use k3mini_data::{DocFeed, Packer, SourceFormat, Tokenizer};
    let tok = Tokenizer::load(tokenizer)?;
    let data = crate::recipe::DataPlan {
        tokenizer: crate::recipe::TokenizerSpec::Builtin {
            name: tokenizer.into(),
        },
        seq_len,
        packing: true,
        held_out_fraction: 0.0,
        train_on: Default::default(),
        sources: vec![crate::recipe::SourcePlan {
            path: dir.to_path_buf(),
            format: SourceFormat::Parquet,
            field: "text".into(),
            chat: None,
            weight: 1.0,
            held_out: false,
        }],
    };
    let corpus_bytes = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    let started = std::time::Instant::now();
    let tokens = if in_memory {
        let docs = crate::corpus::tokenized_documents(&data, &tok)?;
        docs.iter().map(|d| d.ids.len() as u64).sum()
    } else {
        let stream: DocStream =
            crate::corpus::document_stream(&data, &tok, 0, Split::Train, StreamCursor::default())?;
        let mut packer = Packer::new(stream, seq_len, true, 0, 0)?;
        let mut tokens = 0u64;
        while packer.feed().cursor().sources[0].epoch == 0 {
            tokens += packer.next_batch(8)?.tokens.len() as u64;
        }
        tokens
    };
    let seconds = started.elapsed().as_secs_f64();
    Ok(LoaderBench {
        mode: if in_memory { "memory" } else { "stream" }.into(),
        corpus_bytes,
        tokens,
        seconds,
        tokens_per_s: tokens as f64 / seconds,
        peak_rss_bytes: k3mini_student::bench::peak_rss_bytes(),
    })
}
