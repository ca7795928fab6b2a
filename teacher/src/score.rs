//! Scoring a corpus into teacher-signal shards, resumably.
//!
//! Documents are cut into segments of at most `seq_len` ids, numbered in document order; shard `i`
//! holds segments `[i·S, (i+1)·S)` (S = `segments_per_shard`), so a shard's contents depend only on
//! its index and a kill loses at most S segments of work however long the documents are.
//! Each finished shard is written atomically and then recorded, with its SHA-256, in
//! `manifest.json` (itself replaced atomically). A rerun checks the manifest against the job (same
//! teacher, tokenizer, k, layout) and skips every shard whose file still has its recorded checksum:
//! killing the scorer loses at most the shard in flight, never a finished one.

use crate::fetch::sha256_file;
use crate::{Scored, Teacher, TeacherError};
use k3mini_data::shards::{SCHEMA_VERSION, ShardMeta, ShardRow, write_shard};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub const MANIFEST: &str = "manifest.json";

/// What to score and where.
#[derive(Clone, Debug)]
pub struct ScoreJob {
    pub out_dir: PathBuf,
    pub meta: ShardMeta,
    pub seq_len: usize,
    pub segments_per_shard: usize,
    /// Segments in flight at once (for HTTP teachers; a local teacher already uses every core).
    pub concurrency: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub index: usize,
    pub file: String,
    pub sha256: String,
    /// The segment range `[start, end)` it holds.
    pub segments: [usize; 2],
    pub rows: usize,
    /// Positions scored (ids − 1 per segment).
    pub positions: usize,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    pub teacher: String,
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
    pub seq_len: usize,
    pub segments_per_shard: usize,
    pub documents: usize,
    pub segments: usize,
    pub shards: Vec<ShardEntry>,
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

fn io(path: &Path, e: impl std::fmt::Display) -> TeacherError {
    TeacherError::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// The segments of one document: consecutive windows of at most `seq_len` ids (≥ 2 each).
pub fn segments(doc: &[u32], seq_len: usize) -> impl Iterator<Item = &[u32]> {
    doc.chunks(seq_len).filter(|s| s.len() >= 2)
}

/// Scores every sequence with up to `concurrency` requests in flight, results in input order.
/// `done` is called (on this thread) with each finished sequence's positions. The first error
/// stops new requests and is returned.
pub fn score_many(
    teacher: &dyn Teacher,
    inputs: &[&[u32]],
    k: usize,
    concurrency: usize,
    done: &mut dyn FnMut(usize),
) -> Result<Vec<Scored>, TeacherError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let mut slots: Vec<Option<Scored>> = vec![None; inputs.len()];
    let mut first_error = None;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..concurrency.clamp(1, inputs.len().max(1)) {
            let (tx, next, failed) = (tx.clone(), &next, &failed);
            scope.spawn(move || {
                while !failed.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(ids) = inputs.get(i) else { break };
                    let result = teacher.score(ids, k);
                    if result.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    if tx.send((i, result)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for (i, result) in rx {
            match result {
                Ok(s) => {
                    done(s.positions());
                    slots[i] = Some(s);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(slots
        .into_iter()
        .map(|s| s.expect("every input scored"))
        .collect())
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), TeacherError> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_vec_pretty(m).expect("manifest serialises");
    std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))
}

/// Scores `docs` into shards under `job.out_dir`, skipping shards a previous run finished.
pub fn score_corpus(
    teacher: &dyn Teacher,
    docs: &[Vec<u32>],
    job: &ScoreJob,
    on_progress: &mut dyn FnMut(ScoreProgress),
) -> Result<Manifest, TeacherError> {
    let dir = &job.out_dir;
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let all: Vec<(usize, usize, &[u32])> = docs
        .iter()
        .enumerate()
        .flat_map(|(d, doc)| {
            segments(doc, job.seq_len)
                .enumerate()
                .map(move |(s, ids)| (d, s, ids))
        })
        .collect();
    let fresh = Manifest {
        schema_version: SCHEMA_VERSION,
        teacher: job.meta.teacher.clone(),
        tokenizer_sha256: job.meta.tokenizer_sha256.clone(),
        k: job.meta.k,
        temperature: job.meta.temperature,
        seq_len: job.seq_len,
        segments_per_shard: job.segments_per_shard,
        documents: docs.len(),
        segments: all.len(),
        shards: Vec::new(),
    };
    let manifest_path = dir.join(MANIFEST);
    let mut manifest = match std::fs::read(&manifest_path) {
        Ok(bytes) => {
            let old: Manifest = serde_json::from_slice(&bytes)
                .map_err(|e| io(&manifest_path, format!("unreadable manifest: {e}")))?;
            let same = Manifest {
                shards: Vec::new(),
                ..old.clone()
            };
            if same != fresh {
                return Err(io(
                    &manifest_path,
                    "holds shards of a different job (teacher, tokenizer, k, temperature, seq_len, \
                     segments_per_shard or corpus differ): choose another output directory",
                ));
            }
            old
        }
        Err(_) => fresh,
    };
    let per = job.segments_per_shard;
    let total = all.len().div_ceil(per);
    let mut progress = ScoreProgress {
        shards_done: 0,
        shards_total: total,
        segments_done: 0,
        segments_total: all.len(),
        positions: 0,
        skipped: 0,
    };
    for (index, chunk) in all.chunks(per).enumerate() {
        let file = format!("shard-{index:05}.parquet");
        let path = dir.join(&file);
        let finished = manifest
            .shards
            .iter()
            .any(|e| e.index == index && sha256_file(&path).is_ok_and(|sum| sum == e.sha256));
        if finished {
            progress.shards_done += 1;
            progress.segments_done += chunk.len();
            progress.skipped += 1;
            on_progress(progress);
            continue;
        }
        manifest.shards.retain(|e| e.index != index);
        let inputs: Vec<&[u32]> = chunk.iter().map(|c| c.2).collect();
        let scored = score_many(
            teacher,
            &inputs,
            job.meta.k,
            job.concurrency,
            &mut |positions| {
                progress.segments_done += 1;
                progress.positions += positions;
                on_progress(progress);
            },
        )?;
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
        let positions: usize = rows.iter().map(ShardRow::positions).sum();
        let bytes = write_shard(&path, &job.meta, &rows)?;
        manifest.shards.push(ShardEntry {
            index,
            file,
            sha256: sha256_file(&path).map_err(|e| io(&path, e))?,
            segments: [index * per, index * per + chunk.len()],
            rows: rows.len(),
            positions,
            bytes,
        });
        manifest.shards.sort_by_key(|e| e.index);
        write_manifest(dir, &manifest)?;
        progress.shards_done += 1;
        on_progress(progress);
    }
    write_manifest(dir, &manifest)?;
    Ok(manifest)
}
