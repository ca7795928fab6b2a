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

/// Shard `index`'s file name, in every sharded job's directory.
pub fn shard_file(index: usize) -> String {
    format!("shard-{index:05}.parquet")
}

/// The index of the shard a file `name` is ([`shard_file`]'s spelling only), if it is one.
pub fn shard_index(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("shard-")?.strip_suffix(".parquet")?;
    let index = digits.parse().ok()?;
    (shard_file(index) == name).then_some(index)
}

/// The shard files in `dir` that `m` does not list, by index: a traffic shard whose journal line
/// was not yet written when its writer died.
pub fn unlisted_shards<J>(dir: &Path, m: &Manifest<J>) -> Result<Vec<usize>, TeacherError> {
    let listed: std::collections::HashSet<usize> = m.shards.iter().map(|s| s.index).collect();
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let e = e.map_err(|e| io(dir, e))?;
        if let Some(index) = e.file_name().to_str().and_then(shard_index)
            && !listed.contains(&index)
        {
            found.push(index);
        }
    }
    found.sort_unstable();
    Ok(found)
}

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

/// A traffic directory's manifest, a journal: the job on its first line (`{"job": …}`), then one
/// [`ShardEntry`] a line, each appended and synced once the answer naming its shard is sent, so an
/// escalation costs the same at the 50,000th shard as at the first (rewriting `manifest.json`
/// whole did not). A line cut short by a crash is the last one, and is dropped; a shard whose line
/// never came ([`unlisted_shards`]) is listed when its directory is next opened for writing.
/// Readers see the journal's lines only, in its order. Directories written before it hold
/// `manifest.json`, which [`read_traffic`] reads too.
pub const TRAFFIC_MANIFEST: &str = "manifest.jsonl";

/// The first line of a [`TRAFFIC_MANIFEST`].
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrafficHeader {
    pub job: TrafficJob,
}

/// A traffic directory's manifest, from its journal (or an older directory's `manifest.json`);
/// None when it has neither. Every complete line must parse; a cut last line is dropped.
pub fn read_traffic(dir: &Path) -> Result<Option<Manifest<TrafficJob>>, TeacherError> {
    let path = dir.join(TRAFFIC_MANIFEST);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let legacy = dir.join(MANIFEST);
            return match std::fs::read(&legacy) {
                Ok(bytes) => serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|e| io(&legacy, format!("not a traffic manifest: {e}"))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io(&legacy, e)),
            };
        }
        Err(e) => return Err(io(&path, e)),
    };
    // Complete lines only: whatever follows the last newline was cut short.
    let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let mut lines = text[..whole]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty());
    let at = |n: usize, e: serde_json::Error| io(&path, format!("line {n}: {e}"));
    let Some(first) = lines.next() else {
        return Ok(None);
    };
    let header: TrafficHeader = serde_json::from_slice(first).map_err(|e| at(1, e))?;
    let shards = lines
        .enumerate()
        .map(|(i, l)| serde_json::from_slice(l).map_err(|e| at(i + 2, e)))
        .collect::<Result<Vec<ShardEntry>, _>>()?;
    let mut seen = std::collections::HashSet::new();
    if let Some(i) = shards.iter().position(|s| !seen.insert(s.index)) {
        return Err(io(
            &path,
            format!(
                "line {}: lists shard {} a second time",
                i + 2,
                shards[i].index
            ),
        ));
    }
    Ok(Some(Manifest {
        job: header.job,
        shards,
    }))
}

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

/// A traffic directory's journal ([`TRAFFIC_MANIFEST`]), open for appending.
pub struct TrafficJournal {
    file: std::fs::File,
    path: std::path::PathBuf,
    /// Its length in whole lines.
    len: u64,
}

impl TrafficJournal {
    /// Opens `dir`'s journal for `m`, the manifest [`read_traffic`] read there (or a new one):
    /// a cut last line is cut off; a directory without a journal (new, or holding an older
    /// `manifest.json`) gets one written whole, atomically, and the older file goes.
    pub fn open(dir: &Path, m: &Manifest<TrafficJob>) -> Result<Self, TeacherError> {
        let path = dir.join(TRAFFIC_MANIFEST);
        if !path.exists() {
            let mut text = serde_json::to_vec(&TrafficHeader { job: m.job.clone() })
                .expect("a traffic header serialises");
            text.push(b'\n');
            for e in &m.shards {
                text.extend(serde_json::to_vec(e).expect("a shard entry serialises"));
                text.push(b'\n');
            }
            k3mini_durable::write(&path, &text).map_err(|e| io(&path, e))?;
            let legacy = dir.join(MANIFEST);
            if legacy.exists() {
                std::fs::remove_file(&legacy).map_err(|e| io(&legacy, e))?;
            }
        }
        let text = std::fs::read(&path).map_err(|e| io(&path, e))?;
        let whole = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        if whole < text.len() {
            file.set_len(whole as u64).map_err(|e| io(&path, e))?;
        }
        Ok(Self {
            file,
            path,
            len: whole as u64,
        })
    }

    /// The journal's bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `entry` as one line and syncs it: what it costs does not grow with the journal.
    pub fn append(&mut self, entry: &ShardEntry) -> Result<(), TeacherError> {
        use std::io::Write;
        let mut line = serde_json::to_vec(entry).expect("a shard entry serialises");
        line.push(b'\n');
        match self
            .file
            .write_all(&line)
            .and_then(|()| self.file.sync_data())
        {
            Ok(()) => {
                self.len += line.len() as u64;
                Ok(())
            }
            Err(e) => {
                // A line cut short mid-journal would hide every line after it: cut it off. One
                // that cannot be cut off is whole (only its sync failed): it stands, since
                // appending it again would list its shard twice; should a crash take it, the
                // shard is listed again as unlisted ([`unlisted_shards`]).
                match self.file.set_len(self.len) {
                    Ok(()) => Err(io(&self.path, e)),
                    Err(_) => {
                        self.len += line.len() as u64;
                        Ok(())
                    }
                }
            }
        }
    }
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
        let file = shard_file(index);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> TrafficJob {
        TrafficJob {
            kind: KIND_TRAFFIC.into(),
            teacher: "t".into(),
            tokenizer_sha256: "ab".into(),
            k: 4,
            temperature: 1.0,
            logprob_step: Storage::Exact,
        }
    }

    fn entry(index: usize) -> ShardEntry {
        ShardEntry {
            index,
            file: shard_file(index),
            sha256: "00".repeat(32),
            items: [index, index + 1],
            rows: 1,
            positions: 10,
            bytes: 1000,
            routing: None,
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("k3mini-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn an_append_writes_one_line_however_long_the_journal() {
        use std::os::unix::fs::MetadataExt;
        let mut medians = Vec::new();
        for n in [1, 1000] {
            let dir = scratch(&format!("journal-{n}"));
            let m = Manifest {
                job: job(),
                shards: (0..n).map(entry).collect(),
            };
            let mut journal = TrafficJournal::open(&dir, &m).unwrap();
            let path = dir.join(TRAFFIC_MANIFEST);
            let (before, inode) = (
                std::fs::read(&path).unwrap(),
                std::fs::metadata(&path).unwrap().ino(),
            );
            let mut times = Vec::new();
            for i in 0..21 {
                let t0 = std::time::Instant::now();
                journal.append(&entry(n + i)).unwrap();
                times.push(t0.elapsed());
            }
            // The file is appended to, never rewritten: the same inode, the old bytes unchanged,
            // each append one line.
            let after = std::fs::read(&path).unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode);
            assert_eq!(&after[..before.len()], &before[..]);
            let line = serde_json::to_vec(&entry(n)).unwrap().len() + 1;
            assert!((after.len() - before.len()).abs_diff(21 * line) <= 21 * 2);
            assert_eq!(journal.len(), after.len() as u64);
            let read = read_traffic(&dir).unwrap().unwrap();
            assert_eq!(read.shards.len(), n + 21);
            times.sort();
            medians.push(times[10]);
            std::fs::remove_dir_all(&dir).ok();
        }
        // Measured, loosely (a sync's time is the disk's): the long journal's append is not the
        // rewrite of 1,000 entries.
        eprintln!(
            "median append: 1 entry {:?}, 1000 entries {:?}",
            medians[0], medians[1]
        );
        assert!(
            medians[1] < medians[0] * 5 + std::time::Duration::from_millis(5),
            "{medians:?}"
        );
    }

    #[test]
    fn a_cut_last_line_is_dropped_and_an_older_manifest_is_taken_over() {
        let dir = scratch("journal-cut");
        let m = Manifest {
            job: job(),
            shards: vec![entry(0), entry(1)],
        };
        // An older directory's manifest.json is read, then replaced by the journal.
        write_manifest(&dir, &m).unwrap();
        assert_eq!(read_traffic(&dir).unwrap().unwrap(), m);
        let mut journal = TrafficJournal::open(&dir, &m).unwrap();
        assert!(!dir.join(MANIFEST).exists());
        journal.append(&entry(2)).unwrap();
        drop(journal);
        // A crash mid-append leaves half a line: read without it, cut off on reopening.
        let path = dir.join(TRAFFIC_MANIFEST);
        let mut text = std::fs::read(&path).unwrap();
        let whole = text.len();
        text.extend_from_slice(b"{\"index\": 3, \"fi");
        std::fs::write(&path, &text).unwrap();
        let read = read_traffic(&dir).unwrap().unwrap();
        assert_eq!(read.shards.len(), 3);
        let mut journal = TrafficJournal::open(&dir, &read).unwrap();
        assert_eq!(journal.len(), whole as u64);
        journal.append(&entry(3)).unwrap();
        assert_eq!(read_traffic(&dir).unwrap().unwrap().shards.len(), 4);
        // A damaged line before the last is an error naming it.
        let mut text = std::fs::read(&path).unwrap();
        let second = text.iter().position(|&b| b == b'\n').unwrap() + 1;
        text[second] = b'#';
        std::fs::write(&path, &text).unwrap();
        let err = read_traffic(&dir).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        // So is a shard listed twice.
        text[second] = b'{';
        text.extend(serde_json::to_vec(&entry(1)).unwrap());
        text.push(b'\n');
        std::fs::write(&path, &text).unwrap();
        let err = read_traffic(&dir).unwrap_err().to_string();
        assert!(err.contains("line 6: lists shard 1 a second time"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn shard_files_not_in_the_manifest_are_found_by_their_index() {
        assert_eq!(shard_index(&shard_file(7)), Some(7));
        assert_eq!(shard_index(&shard_file(123_456)), Some(123_456));
        for other in [
            "shard-7.parquet",
            "shard-+0007.parquet",
            "shard-00007.parquet.tmp",
            "xshard-00007.parquet",
            "shard-.parquet",
        ] {
            assert_eq!(shard_index(other), None, "{other}");
        }
        let dir = scratch("unlisted");
        let m = Manifest {
            job: job(),
            shards: vec![entry(0), entry(2)],
        };
        for name in [
            shard_file(0),
            shard_file(3),
            shard_file(1),
            "shard-4.parquet".into(),
        ] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        assert_eq!(unlisted_shards(&dir, &m).unwrap(), vec![1, 3]);
        std::fs::remove_dir_all(&dir).ok();
    }
}
