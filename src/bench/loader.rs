//! The data loader as the corpus grows (`k3mini bench data`): corpora of this machine's own text
//! written as Parquet, and one pass of the streaming loader over each, against reading every
//! document into memory first, each pass in its own process so each peak RSS is its own.

use super::{Child, in_child};
use crate::bail;
use crate::error::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One pass of the training loader over a corpus: what it cost.
#[derive(Clone, Debug, Serialize, Deserialize)]
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

/// One loader pass: a corpus directory, the builtin tokenizer by name, the packed row length, and
/// whether every document is read into memory first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoaderRun {
    pub dir: PathBuf,
    pub tokenizer: String,
    pub seq_len: usize,
    pub in_memory: bool,
}

/// The loader at each corpus size: corpora of `sizes_mb` MB of text under `out` (built once, then
/// reused: a corpus counts as built when its `.complete` marker is there), each pass in a child of
/// `exe` (the `k3mini` binary); the in-memory reader only up to `memory_up_to_mb`. `each` receives
/// every pass as it ends, with its corpus size.
pub fn data(
    exe: &Path,
    out: &Path,
    sizes_mb: &[u64],
    tokenizer: &str,
    seq_len: usize,
    memory_up_to_mb: u64,
    mut each: impl FnMut(u64, LoaderBench),
) -> Result<()> {
    if seq_len < 2 {
        bail!("--seq-len {seq_len}: a packed row holds at least 2 tokens");
    }
    if let Some(mb) = sizes_mb
        .iter()
        .find(|&&mb| mb == 0 || mb.checked_mul(1 << 20).is_none())
    {
        bail!("--sizes {mb}: a corpus size is a positive number of MB");
    }
    for &mb in sizes_mb {
        let bytes = mb << 20;
        let dir = out.join(format!("corpus-{mb}mb"));
        let done = dir.join(".complete");
        if !done.exists() {
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("clearing {}", dir.display()));
                }
                _ => {}
            }
            let written = build_corpus(&dir, bytes)?;
            k3mini_durable::write(&done, written.to_string().as_bytes())?;
        }
        for in_memory in [false, true] {
            if in_memory && mb > memory_up_to_mb {
                continue;
            }
            let run = LoaderRun {
                dir: dir.clone(),
                tokenizer: tokenizer.into(),
                seq_len,
                in_memory,
            };
            each(mb, in_child(exe, &Child::Loader(run))?);
        }
    }
    Ok(())
}

/// One pass over the Parquet directory `dir` with `tokenizer`: the streaming loader packing rows
/// of `seq_len` until the stream enters its second epoch, or (`in_memory`) every document
/// tokenized into a list first, the way scoring reads a corpus.
pub fn bench_loader(run: &LoaderRun) -> Result<LoaderBench> {
    let LoaderRun {
        dir,
        tokenizer,
        seq_len,
        in_memory,
    } = run;
    let (dir, seq_len, in_memory) = (dir.as_path(), *seq_len, *in_memory);
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
