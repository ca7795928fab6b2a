//! Scoring a corpus into teacher-signal shards, resumably, in bounded memory.
//!
//! The corpus is read twice, lazily, in the same order (see `k3mini_data::stream::InOrder`): once
//! to count and hash its segments (the job a manifest records, cheap next to the teacher), then
//! to score them. Documents are cut into segments of at most `seq_len` ids, numbered in corpus
//! order; shard `i` holds segments `[i·S, (i+1)·S)` (S = `segments_per_shard`). Each row keeps its
//! document's key, which the held-out split hashes, and a conversation's parts, which training
//! masks with `data.train_on`, so training needs the shards and not the corpus. Shards, the
//! manifest and resuming are [`crate::manifest`]'s: killing the scorer loses at most the shard in
//! flight.

use crate::fetch::sha256_file;
use crate::manifest::{
    IdsDigest, MANIFEST, Manifest, Reporter, ShardEntry, Written, routing_file, run_shards,
    write_manifest,
};
use crate::routing::RoutingShape;
use crate::{Scored, Teacher, TeacherError};
use k3mini_data::DataError;
use k3mini_data::align::Aligner;
use k3mini_data::aligned::{AlignedMeta, AlignedRow, write_aligned_shard};
use k3mini_data::chat::Part;
use k3mini_data::pool::run_many;
use k3mini_data::routing::{RoutingMeta, RoutingRow, read_routing_shard, write_routing_shard};
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, read_shard, write_shard};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// What the corpus's files are (the caller's fingerprint of them): training checks it to tell
    /// whether the recipe still names the corpus that was scored.
    pub sources_sha256: String,
    /// The corpus's sources by name, in order: routing shards say which each segment comes from.
    pub sources: Vec<String>,
    /// A teacher of another vocabulary: each segment is retokenized for it and its signals are
    /// aligned to the student's tokens ([`k3mini_data::aligned`] shards). `meta.vocab` is then
    /// the student's.
    pub cross: Option<Arc<Aligner>>,
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
    /// The corpus's files ([`ScoreJob::sources_sha256`]; empty in manifests written before shards
    /// keyed their documents, which training refuses).
    #[serde(default)]
    pub sources_sha256: String,
    /// The teacher's routing, where routing shards are written beside the signal shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingShape>,
    /// A cross-tokenizer job: the teacher tokenizer's fingerprint (its shards are
    /// `aligned-signals`, in the student's ids); absent when teacher and student share one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_tokenizer_sha256: Option<String>,
}

fn exact() -> Storage {
    Storage::Exact
}

/// Progress after each document of the first reading and each segment of the second (for a
/// progress bar).
#[derive(Clone, Copy, Debug)]
pub struct ScoreProgress {
    /// Still on the first reading, which counts documents and segments (`segments_total` so far).
    pub counting: bool,
    pub documents: usize,
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

/// A corpus document as scoring reads it: its key (`k3mini_data::stream::doc_key`), its ids, and
/// for a conversation what each id is.
#[derive(Clone, Debug, PartialEq)]
pub struct CorpusDoc {
    pub key: u64,
    /// Which of the corpus's sources it comes from (an index into [`ScoreJob::sources`]).
    pub source: usize,
    pub ids: Vec<u32>,
    pub parts: Option<Vec<Part>>,
}

/// A corpus read from its start, one document at a time.
pub type Corpus = Box<dyn Iterator<Item = Result<CorpusDoc, DataError>>>;

/// One segment to score: its document's key and source, its index in the document, its ids and
/// parts.
struct Segment {
    doc: u64,
    source: usize,
    index: u32,
    ids: Vec<u32>,
    parts: Option<Vec<Part>>,
}

/// A corpus's segments in order, hashed as they pass.
struct Segments {
    docs: Corpus,
    seq_len: usize,
    /// The document being cut and its next segment's index.
    doc: Option<(CorpusDoc, usize)>,
    documents: usize,
    taken: usize,
    digest: IdsDigest,
}

impl Segments {
    fn new(docs: Corpus, seq_len: usize) -> Self {
        Self {
            docs,
            seq_len,
            doc: None,
            documents: 0,
            taken: 0,
            digest: IdsDigest::default(),
        }
    }

    fn next(&mut self) -> Result<Option<Segment>, TeacherError> {
        loop {
            if let Some((doc, i)) = &mut self.doc {
                let start = *i * self.seq_len;
                let end = (start + self.seq_len).min(doc.ids.len());
                if end >= start + 2 {
                    let segment = Segment {
                        doc: doc.key,
                        source: doc.source,
                        index: *i as u32,
                        ids: doc.ids[start..end].to_vec(),
                        parts: doc.parts.as_ref().map(|p| p[start..end].to_vec()),
                    };
                    *i += 1;
                    self.taken += 1;
                    self.digest.add(&segment.ids);
                    return Ok(Some(segment));
                }
            }
            match self.docs.next().transpose()? {
                None => return Ok(None),
                Some(doc) => {
                    self.documents += 1;
                    self.doc = Some((doc, 0));
                }
            }
        }
    }

    /// Reads on to segment `n` (nothing when already there).
    fn skip_to(&mut self, n: usize) -> Result<(), TeacherError> {
        while self.taken < n {
            if self.next()?.is_none() {
                return Err(corpus_changed());
            }
        }
        Ok(())
    }
}

fn corpus_changed() -> TeacherError {
    TeacherError::Request(
        "the corpus changed while it was being scored (its second reading differs from its \
         first): score it again once it is stable"
            .into(),
    )
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

/// Scores the corpus `open` reads (from its start, each time it is called) into shards under
/// `job.out_dir`, skipping shards a previous run finished.
pub fn score_corpus(
    teacher: &dyn Teacher,
    open: &dyn Fn() -> Result<Corpus, TeacherError>,
    job: &ScoreJob,
    on_progress: &mut dyn FnMut(ScoreProgress),
) -> Result<Manifest<ScoreManifestJob>, TeacherError> {
    let report = Reporter::new(
        ScoreProgress {
            counting: true,
            documents: 0,
            shards_done: 0,
            shards_total: 0,
            segments_done: 0,
            segments_total: 0,
            positions: 0,
            skipped: 0,
        },
        on_progress,
    );
    // The first reading: how many segments, and their hash.
    let mut count = Segments::new(open()?, job.seq_len);
    while count.next()?.is_some() {
        if count.documents > report.get().documents {
            report.update(|p| {
                p.documents = count.documents;
                p.segments_total = count.taken;
            });
        }
    }
    let total = count.taken;
    let header = ScoreManifestJob {
        schema_version: job.storage.version(),
        teacher: job.meta.teacher.clone(),
        tokenizer_sha256: job.meta.tokenizer_sha256.clone(),
        k: job.meta.k,
        temperature: job.meta.temperature,
        logprob_step: job.storage,
        seq_len: job.seq_len,
        segments_per_shard: job.segments_per_shard,
        documents: count.documents,
        segments: total,
        inputs_sha256: count.digest.finish(),
        sources_sha256: job.sources_sha256.clone(),
        routing: teacher.routing().cloned(),
        teacher_tokenizer_sha256: job.cross.as_ref().map(|a| a.teacher_sha256().to_string()),
    };
    let inputs_sha256 = header.inputs_sha256.clone();
    report.update(|p| {
        p.counting = false;
        p.documents = count.documents;
        p.segments_total = total;
        p.shards_total = total.div_ceil(job.segments_per_shard.max(1));
    });
    // The second reading, shard by shard (finished shards are read past).
    let stream = RefCell::new(Segments::new(open()?, job.seq_len));
    let manifest = run_shards(
        &job.out_dir,
        header,
        total,
        job.segments_per_shard,
        &mut |range| {
            report.update(|p| {
                p.shards_done += 1;
                p.segments_done += range.len();
                p.skipped += 1;
            })
        },
        &mut |index, range, path| {
            let mut stream = stream.borrow_mut();
            stream.skip_to(range.start)?;
            let chunk = range
                .map(|_| stream.next()?.ok_or_else(corpus_changed))
                .collect::<Result<Vec<Segment>, _>>()?;
            if let Some(aligner) = &job.cross {
                let written = score_aligned(teacher, aligner, job, chunk, path, &report)?;
                report.update(|p| p.shards_done += 1);
                return Ok(written);
            }
            let inputs: Vec<&[u32]> = chunk.iter().map(|c| &c.ids[..]).collect();
            let scored = score_many(teacher, &inputs, job.meta.k, job.concurrency, &mut |n| {
                report.update(|p| {
                    p.segments_done += 1;
                    p.positions += n;
                })
            })?;
            let (rows, routing): (Vec<ShardRow>, Vec<Option<RoutingRow>>) = chunk
                .into_iter()
                .zip(scored)
                .map(|(seg, mut s)| {
                    let routing = s.routing.take().map(|routing| RoutingRow {
                        doc_id: seg.doc,
                        segment: seg.index,
                        source: seg.source as u32,
                        routing,
                    });
                    (s.into_row(seg.doc, seg.index, seg.parts), routing)
                })
                .unzip();
            let routed = match teacher.routing() {
                Some(shape) => {
                    let at = path.with_file_name(routing_file(index));
                    write_routing(&at, teacher, job, shape, routing)?;
                    true
                }
                None => false,
            };
            let written = Written {
                rows: rows.len(),
                positions: rows.iter().map(ShardRow::positions).sum(),
                bytes: write_shard(path, &job.meta, job.storage, &rows)?,
                routing: routed,
            };
            report.update(|p| p.shards_done += 1);
            Ok(written)
        },
    )?;
    // Every segment was read again (scored or read past): it must be what was counted.
    let mut stream = stream.into_inner();
    stream.skip_to(total)?;
    if stream.next()?.is_some() || stream.digest.finish() != inputs_sha256 {
        return Err(corpus_changed());
    }
    Ok(manifest)
}

/// Scores one shard's segments with a teacher of another vocabulary: each segment retokenized
/// for it ([`Aligner::retokenize`]), scored, and its chunks' signals written as an aligned shard
/// at `path` in the student's ids. A segment the teacher spells in fewer than two tokens has no
/// chunk to score.
fn score_aligned(
    teacher: &dyn Teacher,
    aligner: &Aligner,
    job: &ScoreJob,
    chunk: Vec<Segment>,
    path: &Path,
    report: &Reporter<'_, ScoreProgress>,
) -> Result<Written, TeacherError> {
    let k = job.meta.k;
    let retokenized = chunk
        .iter()
        .map(|seg| aligner.retokenize(&seg.ids))
        .collect::<Result<Vec<_>, _>>()?;
    let scorable: Vec<usize> = (0..chunk.len())
        .filter(|&i| retokenized[i].teacher_ids.len() >= 2)
        .collect();
    let inputs: Vec<&[u32]> = scorable
        .iter()
        .map(|&i| &retokenized[i].teacher_ids[..])
        .collect();
    // Progress counts the student's positions, as the manifest does (the teacher's differ).
    let scored = score_many(teacher, &inputs, k, job.concurrency, &mut |_| {
        report.update(|p| p.segments_done += 1)
    })?;
    report.update(|p| {
        p.segments_done += chunk.len() - scorable.len();
        p.positions += chunk.iter().map(|s| s.ids.len() - 1).sum::<usize>();
    });
    for (&i, s) in scorable.iter().zip(&scored) {
        let n = retokenized[i].teacher_ids.len();
        if s.target_logprobs.len() != n - 1
            || s.top_ids.len() != (n - 1) * k
            || s.top_logprobs.len() != (n - 1) * k
        {
            return Err(TeacherError::Server(format!(
                "{}: scoring {n} ids gave {} target logprobs and {} top-{k} entries, not {} and {}",
                teacher.name(),
                s.target_logprobs.len(),
                s.top_ids.len(),
                n - 1,
                (n - 1) * k
            )));
        }
    }
    let mut scored = scorable.into_iter().zip(scored).peekable();
    let rows: Vec<AlignedRow> = chunk
        .into_iter()
        .zip(&retokenized)
        .enumerate()
        .map(|(i, (seg, retok))| {
            let chunks = match scored.next_if(|(j, _)| *j == i) {
                Some((_, s)) => aligner.chunk_signals(
                    &seg.ids,
                    retok,
                    &s.target_logprobs,
                    &s.top_ids,
                    &s.top_logprobs,
                    k,
                ),
                None => Vec::new(),
            };
            AlignedRow {
                doc_id: seg.doc,
                segment: seg.index,
                input_ids: seg.ids,
                parts: seg.parts,
                chunks,
            }
        })
        .collect();
    let meta = AlignedMeta {
        signals: job.meta.clone(),
        teacher_tokenizer_sha256: aligner.teacher_sha256().to_string(),
    };
    Ok(Written {
        rows: rows.len(),
        positions: rows.iter().map(|r| r.input_ids.len() - 1).sum(),
        bytes: write_aligned_shard(path, &meta, &rows)?,
        routing: false,
    })
}

/// Writes a shard's routing shard at `path`: every segment's routing (each must have come back
/// with it), stored as `teacher` routed it.
fn write_routing(
    path: &Path,
    teacher: &dyn Teacher,
    job: &ScoreJob,
    shape: &RoutingShape,
    routing: Vec<Option<RoutingRow>>,
) -> Result<(), TeacherError> {
    let rows = routing
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| {
            TeacherError::Server(format!(
                "{}: a scored segment came back without its routing",
                teacher.name()
            ))
        })?;
    let meta = RoutingMeta {
        teacher: job.meta.teacher.clone(),
        sources: job.sources.clone(),
        shape: shape.clone(),
        white_box: rows.first().is_some_and(|r| r.routing.white_box()),
    };
    write_routing_shard(path, &meta, &rows)?;
    Ok(())
}

/// Copies `from` to `to` through a temporary file synced and renamed into place.
fn copy_atomic(from: &Path, to: &Path) -> std::io::Result<()> {
    k3mini_durable::write_with(to, |f| std::io::copy(&mut std::fs::File::open(from)?, f)).map(drop)
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
        // A routing shard is the same whatever the logprobs' storage: copied once verified.
        if let Some(r) = &entry.routing {
            let (from, to) = (src.join(&r.file), dst.join(&r.file));
            read_routing_shard(&from, Some(&r.sha256))?;
            copy_atomic(&from, &to).map_err(|e| err(&to, e.to_string()))?;
        }
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
