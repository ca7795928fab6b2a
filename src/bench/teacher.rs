//! Teacher benchmarks on a local teacher: scoring in process against through `teacher serve` on
//! loopback (`k3mini bench teacher`), llama.cpp against the burn engine (`k3mini bench engines`),
//! and what shards cost per token in both schemas at several k (`k3mini bench shards`).

use crate::bail;
use crate::device::DeviceList;
use crate::error::{Context, Result};
use crate::scratch::Scratch;
use crate::teachers::{open_local, resolve};
use k3mini_data::shards::{ShardRow, Storage, read_shard};
use k3mini_data::{SourceFormat, Tokenizer, read_source};
use k3mini_teacher::bench::{ShardSize, TeacherBench, bench_teacher, shard_sizes};
use k3mini_teacher::local::Engine;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a teacher benchmark scores: the first `segments` windows of `seq_len` tokens of a text file.
#[derive(Clone, Debug)]
pub struct Windows {
    pub text: PathBuf,
    pub seq_len: usize,
    pub segments: usize,
}

impl Windows {
    /// The windows, tokenized with `tokenizer` (the files of a directory one after another): at
    /// least one, all of `seq_len` tokens.
    pub fn tokenize(&self, tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>> {
        if self.seq_len == 0 || self.segments == 0 {
            bail!(
                "{} windows of {} tokens: a teacher benchmark scores at least one window of at \
                 least one token (--segments, --seq-len)",
                self.segments,
                self.seq_len
            );
        }
        let mut ids = Vec::new();
        for doc in read_source(&self.text, SourceFormat::Text, "text")? {
            if ids.len() >= self.seq_len.saturating_mul(self.segments) {
                break;
            }
            ids.extend(tokenizer.encode(&doc.text)?);
        }
        let windows: Vec<Vec<u32>> = ids
            .chunks(self.seq_len)
            .filter(|c| c.len() == self.seq_len)
            .take(self.segments)
            .map(<[u32]>::to_vec)
            .collect();
        if windows.is_empty() {
            bail!(
                "{}: {} tokens hold no window of {} tokens to score",
                self.text.display(),
                ids.len(),
                self.seq_len
            );
        }
        Ok(windows)
    }
}

/// Scoring `windows` with the local teacher `teacher` (a name or a GGUF path) on `engine` and
/// `device`, in process and through a loopback server, with the shards of the scores at k 20, 50
/// and 64.
pub fn scoring(
    teacher: &str,
    engine: Engine,
    device: &DeviceList,
    windows: &Windows,
) -> Result<TeacherBench> {
    let local = open_local(&resolve(teacher)?, engine, device)?;
    let windows = windows.tokenize(&local.tokenizer)?;
    let inputs: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
    let scratch = Scratch::new("bench-teacher")?;
    Ok(bench_teacher(
        Arc::new(local),
        &inputs,
        &[20, 50, 64],
        scratch.path(),
    )?)
}

/// One round of [`engines`] at one k: each engine's scoring tokens/s, measured back to back.
#[cfg(feature = "llama-cpp")]
#[derive(Clone, Debug, Serialize)]
pub struct EngineRound {
    pub k: usize,
    /// 1-based.
    pub round: usize,
    pub burn_tokens_per_s: f64,
    pub llama_cpp_tokens_per_s: f64,
}

/// Scoring tokens/s of the GGUF teacher `teacher` on llama.cpp (CPU, `threads`) against the burn
/// engine over `windows`, at each of `ks`, `rounds` times each, the engines alternating. Returns
/// the windows scored and the rounds.
#[cfg(feature = "llama-cpp")]
pub fn engines(
    teacher: &str,
    windows: &Windows,
    ks: &[usize],
    rounds: usize,
    threads: usize,
) -> Result<(usize, Vec<EngineRound>)> {
    use k3mini_teacher::engine::llama_cpp::Placement;
    use k3mini_teacher::local::{EngineSpec, LocalTeacher};
    let path = resolve(teacher)?;
    let burn = LocalTeacher::from_gguf(&path, &Default::default())?;
    let cpp = LocalTeacher::open(&path, EngineSpec::LlamaCpp(Placement::Cpu { threads }))?;
    let windows = windows.tokenize(&burn.tokenizer)?;
    let inputs: Vec<&[u32]> = windows.iter().map(Vec::as_slice).collect();
    let mut measured = Vec::new();
    for &k in ks {
        let rounds = k3mini_teacher::bench::engines(&burn, &cpp, &inputs, k, rounds)?;
        measured.extend(
            rounds
                .into_iter()
                .enumerate()
                .map(|(i, (b, c))| EngineRound {
                    k,
                    round: i + 1,
                    burn_tokens_per_s: b,
                    llama_cpp_tokens_per_s: c,
                }),
        );
    }
    Ok((inputs.len(), measured))
}

/// What [`shard_dir`] read and measured.
#[derive(Clone, Debug, Serialize)]
pub struct ShardDirBench {
    pub files: usize,
    pub rows: usize,
    pub positions: usize,
    /// The shards' own k, teacher and vocabulary.
    pub k: usize,
    pub teacher: String,
    pub vocab: usize,
    /// Files the rows were regrouped into for the measurement.
    pub written_files: usize,
    /// The k asked for past the shards' own, not measured.
    pub skipped: Vec<usize>,
    pub sizes: Vec<ShardSize>,
}

/// Shard bytes per token in both schemas at each of `ks` up to the shards' own k (those past it
/// are listed as skipped; none left, or a k of 0, is an error) and what the
/// compact one loses at logprob `step`, measured on every exact (v1) shard in `dir`, the rows
/// regrouped into files of `rows_per_file` (0: one file; `None`: as the shards are).
pub fn shard_dir(
    dir: &Path,
    ks: &[usize],
    step: f32,
    rows_per_file: Option<usize>,
) -> Result<ShardDirBench> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    files.retain(|p| p.extension().is_some_and(|e| e == "parquet"));
    files.sort();
    let (mut meta, mut per_file) = (None, Vec::new());
    for f in &files {
        let shard = read_shard(f, None)?;
        if shard.storage != Storage::Exact {
            bail!(
                "{}: already compact (schema v2); measure from exact shards (teacher.logprob_step = 0)",
                f.display()
            );
        }
        if let Some(m) = &meta
            && *m != shard.meta
        {
            bail!(
                "{}: scored otherwise than {} ({:?} against {m:?}); measure one scoring's shards",
                f.display(),
                files[0].display(),
                shard.meta
            );
        }
        per_file.push(shard.rows);
        meta.get_or_insert(shard.meta);
    }
    let Some(meta) = meta else {
        bail!("{}: no .parquet shards", dir.display());
    };
    if ks.contains(&0) || !ks.iter().any(|&k| k <= meta.k) {
        bail!(
            "--k {ks:?}: the shards in {} hold each position's top {}; measure at 1 to {}",
            dir.display(),
            meta.k,
            meta.k
        );
    }
    let Some(vocab) = meta.vocab else {
        bail!(
            "{}: the shards do not record the teacher's vocabulary (k3mini.vocab), which the \
             compact schema stores; score them again with this k3mini",
            dir.display()
        );
    };
    let (rows, positions) = (
        per_file.iter().map(Vec::len).sum(),
        per_file.iter().flatten().map(ShardRow::positions).sum(),
    );
    if positions == 0 {
        bail!("{}: the shards hold no scored position", dir.display());
    }
    let regrouped: Vec<Vec<ShardRow>> = match rows_per_file {
        None => per_file,
        Some(0) => vec![per_file.concat()],
        Some(n) => per_file.concat().chunks(n).map(<[_]>::to_vec).collect(),
    };
    let scratch = Scratch::new("bench-shards")?;
    let sizes = shard_sizes(&regrouped, &meta, ks, step, scratch.path())?;
    Ok(ShardDirBench {
        files: files.len(),
        rows,
        positions,
        k: meta.k,
        teacher: meta.teacher,
        vocab,
        written_files: regrouped.len(),
        skipped: ks.iter().copied().filter(|&k| k > meta.k).collect(),
        sizes,
    })
}
