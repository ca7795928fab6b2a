//! Scoring a corpus into teacher-signal shards, resumably.
//!
//! Documents are cut into segments of at most `seq_len` ids, numbered in document order; shard `i`
//! holds segments `[i·S, (i+1)·S)` (S = `segments_per_shard`). Shards, the manifest and resuming are
//! [`crate::manifest`]'s: killing the scorer loses at most the shard in flight.

use crate::fetch::sha256_file;
use crate::manifest::{
    MANIFEST, Manifest, Reporter, ShardEntry, Written, ids_sha256, run_shards, write_manifest,
};
use crate::{Scored, Teacher, TeacherError};
use k3mini_data::pool::run_many;
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, read_shard, write_shard};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What to score and where.
#[derive(Clone, Debug)]
pub struct ScoreJob {
    pub out_dir: PathBuf,
    pub meta: ShardMeta,
    pub storage: Storage,
    pub seq_len: usize,
    pub segments_per_shard: usize,
    /// Segments in flight at once (for HTTP teachers; a local teacher already uses every core).
    pub concurrency: usize,
}

/// A scoring job as its manifest records it: a rerun must match it to reuse the shards.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoreManifestJob {
    pub schema_version: u32,
    pub teacher: String,
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
    /// How logprobs are stored (schema v1 shards and their manifests: exact).
    #[serde(default = "exact")]
    pub logprob_step: Storage,
    pub seq_len: usize,
    pub segments_per_shard: usize,
    pub documents: usize,
    pub segments: usize,
    /// SHA-256 of the segments' ids.
    pub inputs_sha256: String,
}

fn exact() -> Storage {
    Storage::Exact
}

/// Progress after each segment (for a progress bar).
#[derive(Clone, Copy, Debug)]
pub struct ScoreProgress {
    pub shards_done: usize,
    pub shards_total: usize,
    /// Segments finished, skipped ones included.
    pub segments_done: usize,
    pub segments_total: usize,
    /// Positions scored by this run (not counting skipped shards).
    pub positions: usize,
    pub skipped: usize,
}

/// The segments of one document: consecutive windows of at most `seq_len` ids (≥ 2 each).
pub fn segments(doc: &[u32], seq_len: usize) -> impl Iterator<Item = &[u32]> {
    doc.chunks(seq_len).filter(|s| s.len() >= 2)
}

/// Scores every sequence with up to `concurrency` requests in flight, results in input order;
/// `done` gets each finished sequence's positions.
pub fn score_many(
    teacher: &dyn Teacher,
    inputs: &[&[u32]],
    k: usize,
    concurrency: usize,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<Scored>, TeacherError> {
    run_many(
        inputs.len(),
        concurrency,
        &|i| teacher.score(inputs[i], k),
        &mut |s: &Scored| done(s.positions()),
    )
}

/// Scores `docs` into shards under `job.out_dir`, skipping shards a previous run finished.
pub fn score_corpus(
    teacher: &dyn Teacher,
    docs: &[Vec<u32>],
    job: &ScoreJob,
    on_progress: &mut dyn FnMut(ScoreProgress),
) -> Result<Manifest<ScoreManifestJob>, TeacherError> {
    let all: Vec<(usize, usize, &[u32])> = docs
        .iter()
        .enumerate()
        .flat_map(|(d, doc)| {
            segments(doc, job.seq_len)
                .enumerate()
                .map(move |(s, ids)| (d, s, ids))
        })
        .collect();
    let header = ScoreManifestJob {
        schema_version: job.storage.version(),
        teacher: job.meta.teacher.clone(),
        tokenizer_sha256: job.meta.tokenizer_sha256.clone(),
        k: job.meta.k,
        temperature: job.meta.temperature,
        logprob_step: job.storage,
        seq_len: job.seq_len,
        segments_per_shard: job.segments_per_shard,
        documents: docs.len(),
        segments: all.len(),
        inputs_sha256: ids_sha256(all.iter().map(|s| s.2)),
    };
    let report = Reporter::new(
        ScoreProgress {
            shards_done: 0,
            shards_total: all.len().div_ceil(job.segments_per_shard.max(1)),
            segments_done: 0,
            segments_total: all.len(),
            positions: 0,
            skipped: 0,
        },
        on_progress,
    );
    run_shards(
        &job.out_dir,
        header,
        all.len(),
        job.segments_per_shard,
        &mut |range| {
            report.update(|p| {
                p.shards_done += 1;
                p.segments_done += range.len();
                p.skipped += 1;
            })
        },
        &mut |_, range, path| {
            let chunk = &all[range];
            let inputs: Vec<&[u32]> = chunk.iter().map(|c| c.2).collect();
            let scored = score_many(teacher, &inputs, job.meta.k, job.concurrency, &mut |n| {
                report.update(|p| {
                    p.segments_done += 1;
                    p.positions += n;
                })
            })?;
            let rows: Vec<ShardRow> = chunk
                .iter()
                .zip(scored)
                .map(|(&(doc_id, segment, _), s)| ShardRow {
                    doc_id: doc_id as u64,
                    segment: segment as u32,
                    input_ids: s.ids,
                    target_logprobs: s.target_logprobs,
                    top_ids: s.top_ids,
                    top_logprobs: s.top_logprobs,
                })
                .collect();
            let written = Written {
                rows: rows.len(),
                positions: rows.iter().map(ShardRow::positions).sum(),
                bytes: write_shard(path, &job.meta, job.storage, &rows)?,
            };
            report.update(|p| p.shards_done += 1);
            Ok(written)
        },
    )
}

/// Rewrites the teacher-signal shards of `src` (either schema; each verified against its
/// manifest) into the empty or new directory `dst` stored as `storage`, with a manifest of the
/// same job. `on_shard(done, total)` after each. `src` is never modified.
pub fn convert_shards(
    src: &Path,
    dst: &Path,
    storage: Storage,
    on_shard: &mut dyn FnMut(usize, usize),
) -> Result<Manifest<ScoreManifestJob>, TeacherError> {
    let err = |path: &Path, message: String| TeacherError::Load {
        path: path.to_path_buf(),
        message,
    };
    let manifest_path = src.join(MANIFEST);
    let text = std::fs::read(&manifest_path).map_err(|e| err(&manifest_path, e.to_string()))?;
    let old: Manifest<ScoreManifestJob> = serde_json::from_slice(&text).map_err(|e| {
        err(
            &manifest_path,
            format!("not a `teacher score` manifest: {e}"),
        )
    })?;
    if dst.join(MANIFEST).exists() {
        return Err(err(
            dst,
            "already holds shards: convert into a new or empty directory".into(),
        ));
    }
    std::fs::create_dir_all(dst).map_err(|e| err(dst, e.to_string()))?;
    let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
    if same(src, dst) {
        return Err(err(dst, "is the source directory".into()));
    }
    let mut shards = Vec::with_capacity(old.shards.len());
    for (i, entry) in old.shards.iter().enumerate() {
        let shard = read_shard(&src.join(&entry.file), Some(&entry.sha256))?;
        let path = dst.join(&entry.file);
        let bytes = write_shard(&path, &shard.meta, storage, &shard.rows)?;
        shards.push(ShardEntry {
            sha256: sha256_file(&path).map_err(|e| err(&path, e.to_string()))?,
            bytes,
            ..entry.clone()
        });
        on_shard(i + 1, old.shards.len());
    }
    let manifest = Manifest {
        job: ScoreManifestJob {
            schema_version: storage.version(),
            logprob_step: storage,
            ..old.job
        },
        shards,
    };
    write_manifest(dst, &manifest)?;
    Ok(manifest)
}
