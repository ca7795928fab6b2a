//! Resumable sharded jobs (scoring a corpus, generating trajectories).
//!
//! A job's items (segments, prompts) are numbered; shard `i` holds items `[i·S, (i+1)·S)`, so a
//! shard's contents depend only on its index and a kill loses at most S items of work. Each
//! finished shard is written atomically and then recorded, with its SHA-256, in `manifest.json`
//! (itself replaced atomically). A rerun checks the manifest's job description against its own and
//! skips every shard whose file still has its recorded checksum: killing the job loses at most the
//! shard in flight, never a finished one, and a shard damaged since is redone.

use crate::TeacherError;
use crate::fetch::sha256_file;
use k3mini_data::digest::{Digest, Sha256, hex};
use k3mini_data::shards::Storage;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;

pub const MANIFEST: &str = "manifest.json";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub index: usize,
    pub file: String,
    pub sha256: String,
    /// The item range `[start, end)` it holds.
    pub items: [usize; 2],
    pub rows: usize,
    /// Token positions it holds (scored positions, or generated tokens).
    pub positions: usize,
    pub bytes: u64,
    /// Its routing shard ([`routing_file`]), where the job records routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Companion>,
}

/// What a traffic directory holds (its manifest's `job`): the escalations `k3mini agent serve
/// --traffic` wrote, each a one-row teacher-signal shard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficJob {
    /// Always `"traffic"`: what tells this manifest from `teacher score`'s.
    pub kind: String,
    pub teacher: String,
    pub tokenizer_sha256: String,
    pub k: usize,
    pub temperature: f32,
    pub logprob_step: Storage,
}

/// [`TrafficJob::kind`].
pub const KIND_TRAFFIC: &str = "traffic";

/// What a run trains on from a growing directory: the SHA-256 of its first shards' checksums,
/// in order (a run pins the shards it started with; more may arrive while it trains).
pub fn shards_digest(shards: &[ShardEntry]) -> String {
    let mut d = Sha256::new();
    for s in shards {
        d.update(s.sha256.as_bytes());
        d.update(b"\n");
    }
    hex(d)
}

/// A file written beside a shard, holding more about the same rows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Companion {
    pub file: String,
    pub sha256: String,
    pub bytes: u64,
}

/// The routing shard beside shard `index`.
pub fn routing_file(index: usize) -> String {
    format!("routing-{index:05}.parquet")
}

/// `job` describes what was asked (a rerun must ask the same); `shards` what is finished.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest<J> {
    pub job: J,
    pub shards: Vec<ShardEntry>,
}

impl<J> Manifest<J> {
    pub fn positions(&self) -> usize {
        self.shards.iter().map(|s| s.positions).sum()
    }

    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }
}

/// A job's progress, updated from its callbacks and passed on to the caller's after each update.
pub struct Reporter<'a, P> {
    state: std::cell::RefCell<P>,
    sink: std::cell::RefCell<&'a mut dyn FnMut(P)>,
}

impl<'a, P: Copy> Reporter<'a, P> {
    pub fn new(initial: P, sink: &'a mut dyn FnMut(P)) -> Self {
        Self {
            state: std::cell::RefCell::new(initial),
            sink: std::cell::RefCell::new(sink),
        }
    }

    /// The progress so far.
    pub fn get(&self) -> P {
        *self.state.borrow()
    }

    pub fn update(&self, f: impl FnOnce(&mut P)) {
        let mut p = self.state.borrow_mut();
        f(&mut p);
        (self.sink.borrow_mut())(*p);
    }
}

/// What writing one shard produced.
pub struct Written {
    pub rows: usize,
    pub positions: usize,
    pub bytes: u64,
    /// Whether its routing shard was written too (at [`routing_file`], beside it).
    pub routing: bool,
}

fn io(path: &Path, e: impl std::fmt::Display) -> TeacherError {
    TeacherError::Load {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

/// SHA-256 of a job's token ids, fed one sequence at a time: the inputs a manifest's shards were
/// made from.
#[derive(Clone, Default)]
pub struct IdsDigest(Sha256);

impl IdsDigest {
    pub fn add(&mut self, ids: &[u32]) {
        self.0.update((ids.len() as u64).to_le_bytes());
        for id in ids {
            self.0.update(id.to_le_bytes());
        }
    }

    /// The hex digest of what was added so far.
    pub fn finish(&self) -> String {
        hex(self.0.clone())
    }
}

/// [`IdsDigest`] of `sequences`.
pub fn ids_sha256<'a>(sequences: impl Iterator<Item = &'a [u32]>) -> String {
    let mut d = IdsDigest::default();
    sequences.for_each(|s| d.add(s));
    d.finish()
}

/// Replaces `dir`'s manifest with `m`, atomically.
pub fn write_manifest<J: Serialize>(dir: &Path, m: &Manifest<J>) -> Result<(), TeacherError> {
    let path = dir.join(MANIFEST);
    let text = serde_json::to_vec_pretty(m).expect("manifest serialises");
    k3mini_durable::write(&path, &text).map_err(|e| io(&path, e))
}

/// Runs `items` in shards of `per_shard` under `dir`. Finished shards of an earlier run of the same
/// `job` are skipped (`skipped(range)` is told); for each other shard `write(index, range, path)`
/// must write the file atomically (and its routing shard beside it, when it says so).
pub fn run_shards<J>(
    dir: &Path,
    job: J,
    items: usize,
    per_shard: usize,
    skipped: &mut dyn FnMut(Range<usize>),
    write: &mut dyn FnMut(usize, Range<usize>, &Path) -> Result<Written, TeacherError>,
) -> Result<Manifest<J>, TeacherError>
where
    J: Serialize + DeserializeOwned + PartialEq,
{
    if per_shard == 0 {
        return Err(TeacherError::Request(
            "items per shard must be at least 1".into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let manifest_path = dir.join(MANIFEST);
    let mut manifest = match std::fs::read(&manifest_path) {
        Ok(bytes) => {
            let old: Manifest<J> = serde_json::from_slice(&bytes).map_err(|e| {
                io(
                    &manifest_path,
                    format!("not a manifest of this kind of job: {e}"),
                )
            })?;
            if old.job != job {
                return Err(io(
                    &manifest_path,
                    "holds shards of a different job (teacher, tokenizer, settings or inputs \
                     differ; shards scored before schema v2 were stored with logprob_step = 0): \
                     choose another output directory",
                ));
            }
            old
        }
        Err(_) => Manifest {
            job,
            shards: Vec::new(),
        },
    };
    for index in 0..items.div_ceil(per_shard) {
        let range = index * per_shard..((index + 1) * per_shard).min(items);
        let file = format!("shard-{index:05}.parquet");
        let path = dir.join(&file);
        let intact =
            |file: &str, sha256: &str| sha256_file(&dir.join(file)).is_ok_and(|sum| sum == sha256);
        let finished = manifest.shards.iter().any(|e| {
            e.index == index
                && intact(&file, &e.sha256)
                && e.routing
                    .as_ref()
                    .is_none_or(|r| intact(&r.file, &r.sha256))
        });
        if finished {
            skipped(range);
            continue;
        }
        manifest.shards.retain(|e| e.index != index);
        let w = write(index, range.clone(), &path)?;
        let routing = match w.routing {
            true => {
                let file = routing_file(index);
                let path = dir.join(&file);
                Some(Companion {
                    sha256: sha256_file(&path).map_err(|e| io(&path, e))?,
                    bytes: std::fs::metadata(&path).map_err(|e| io(&path, e))?.len(),
                    file,
                })
            }
            false => None,
        };
        manifest.shards.push(ShardEntry {
            index,
            file,
            sha256: sha256_file(&path).map_err(|e| io(&path, e))?,
            items: [range.start, range.end],
            rows: w.rows,
            positions: w.positions,
            bytes: w.bytes,
            routing,
        });
        manifest.shards.sort_by_key(|e| e.index);
        write_manifest(dir, &manifest)?;
    }
    write_manifest(dir, &manifest)?;
    Ok(manifest)
}
