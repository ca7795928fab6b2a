//! Checkpoints: a checkpoint is a directory `step-NNNNNNNN/` holding named files and a
//! `manifest.json` of their SHA-256 sums. It is written to a temporary directory, every file and the
//! directory synced to disk, and renamed into place, and the run directory synced, before the
//! oldest are pruned beyond `keep`: a crash of the process or the machine at any point leaves the
//! old set or the new one, never half a checkpoint or none ([`Stage`]). Opening one verifies every
//! checksum so a corrupt or truncated file is named instead of loaded. Files are written and hashed as streams: a checkpoint of a model
//! larger than memory's spare room never has to be whole in memory.
//!
//! [`moments`] holds the AdamW state, streamed to and from the devices that own it;
//! [`param_ids`] carries burn's parameter ids (which key the optimizer state) alongside the
//! transformers-named safetensors weights, so resumption is exact.

pub mod moments;
pub mod param_ids;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
const PREFIX: &str = "step-";
/// What a checkpoint's directory name is prefixed with while a rewrite of its step replaces it.
const SET_ASIDE: &str = ".old-";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("checkpoint {dir}: {file} is corrupt (checksum mismatch)")]
    Corrupt { dir: PathBuf, file: String },
    #[error("checkpoint {dir}: {message}")]
    Invalid { dir: PathBuf, message: String },
    /// Saved parameter ids that do not cover the model's parameters.
    #[error("no saved id for {0:?}")]
    MissingIds(Vec<String>),
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    step: usize,
    /// File name → SHA-256 (hex).
    files: BTreeMap<String, String>,
}

/// Directory name of the checkpoint at `step`.
pub fn step_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join(format!("{PREFIX}{step:08}"))
}

/// SHA-256 (hex) of a file, read in pieces (a checkpoint's files can be larger than memory).
fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The points a checkpoint write passes, in order. After each one a crash (of the process or of
/// the machine) leaves a run whose newest checkpoint opens and verifies: the previous one until
/// [`Stage::Published`], the new one from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// The files are written into the temporary directory.
    Filled,
    /// Each file, the manifest and the temporary directory are synced to disk.
    Synced,
    /// A checkpoint of the same step being rewritten is renamed aside (`.old-step-N`, which
    /// [`list`] reads as step N until the new one is in place).
    SetAside,
    /// The new directory is renamed into place and the run directory synced.
    Published,
    /// The set-aside copy and the checkpoints beyond `keep` are removed, and that is synced.
    Pruned,
}

/// Writes a checkpoint atomically and durably and prunes all but the newest `keep`: `fill` writes
/// its files into a fresh temporary directory (streaming them, so nothing needs to be whole in
/// memory); each file is then checksummed into the manifest and synced, the directory synced and
/// renamed into place, the run directory synced, and only then are older checkpoints deleted.
/// Returns it.
pub fn write_with<E: From<CheckpointError>>(
    run_dir: &Path,
    step: usize,
    keep: usize,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    write_stages(run_dir, step, keep, fill, Stage::Pruned)
}

/// [`write`], stopped right after `stage` as a crash there would stop it: the fault-injection
/// point of the tests that every stage leaves a checkpoint to resume from.
pub fn write_until(
    run_dir: &Path,
    step: usize,
    files: &[(&str, Vec<u8>)],
    keep: usize,
    stage: Stage,
) -> Result<PathBuf, CheckpointError> {
    write_stages(run_dir, step, keep, |dir| fill_bytes(dir, files), stage)
}

fn write_stages<E: From<CheckpointError>>(
    run_dir: &Path,
    step: usize,
    keep: usize,
    fill: impl FnOnce(&Path) -> Result<(), E>,
    last: Stage,
) -> Result<PathBuf, E> {
    let tmp = fresh_temp(run_dir, step, &std::process::id().to_string())?;
    fill(&tmp)?;
    if last == Stage::Filled {
        return Ok(tmp);
    }
    Ok(publish_stages(run_dir, step, keep, &tmp, last)?)
}

/// The temporary directory a checkpoint of `step` is filled in by `writer` (a process id, or a
/// name the ranks of a group share), without creating it: [`remove_stale_temps`] knows its name.
pub fn temp_dir(run_dir: &Path, step: usize, writer: &str) -> PathBuf {
    run_dir.join(format!(".tmp-{PREFIX}{step:08}-{writer}"))
}

/// [`temp_dir`], emptied and created: the first half of [`write_with`] for writers that fill it
/// together (the ranks of a training run, each its own files) before one of them [`publish`]es it.
pub fn fresh_temp(run_dir: &Path, step: usize, writer: &str) -> Result<PathBuf, CheckpointError> {
    let tmp = temp_dir(run_dir, step, writer);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    Ok(tmp)
}

/// The second half of [`write_with`]: checksums and syncs the filled `tmp`, renames it into place
/// as the checkpoint of `step`, and prunes all but the newest `keep`.
pub fn publish(
    run_dir: &Path,
    step: usize,
    keep: usize,
    tmp: &Path,
) -> Result<PathBuf, CheckpointError> {
    publish_stages(run_dir, step, keep, tmp, Stage::Pruned)
}

fn publish_stages(
    run_dir: &Path,
    step: usize,
    keep: usize,
    tmp: &Path,
    last: Stage,
) -> Result<PathBuf, CheckpointError> {
    let final_dir = step_dir(run_dir, step);
    let mut manifest = Manifest {
        step,
        files: BTreeMap::new(),
    };
    for entry in std::fs::read_dir(tmp).map_err(|e| io(tmp, e))? {
        let path = entry.map_err(|e| io(&tmp, e))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_file() && name != MANIFEST {
            manifest.files.insert(name, sha256_file(&path)?);
            k3mini_durable::sync_file(&path).map_err(|e| io(&path, e))?;
        }
    }
    let json = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
    let manifest_path = tmp.join(MANIFEST);
    k3mini_durable::write(&manifest_path, &json).map_err(|e| io(&manifest_path, e))?;
    k3mini_durable::sync_dir(tmp).map_err(|e| io(tmp, e))?;
    if last == Stage::Synced {
        return Ok(tmp.to_path_buf());
    }
    // A step being rewritten is renamed aside, never deleted first: at every moment one version
    // of it is on disk under a name `list` reads.
    let aside = set_aside_dir(run_dir, step);
    if final_dir.exists() {
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        }
        k3mini_durable::rename(&final_dir, &aside).map_err(|e| io(&final_dir, e))?;
    }
    if last == Stage::SetAside {
        return Ok(aside);
    }
    k3mini_durable::rename(tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
    if last == Stage::Published {
        return Ok(final_dir);
    }
    if aside.exists() {
        std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
    }
    let all = list(run_dir)?;
    for (step, old) in all.iter().rev().skip(keep.max(1)) {
        std::fs::remove_dir_all(old).map_err(|e| io(old, e))?;
        // A set-aside copy of a pruned step would otherwise stand in for it in `list`.
        let aside = set_aside_dir(run_dir, *step);
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| io(&aside, e))?;
        }
    }
    k3mini_durable::sync_dir(run_dir).map_err(|e| io(run_dir, e))?;
    Ok(final_dir)
}

/// Where a checkpoint of `step` waits while a new one of the same step replaces it.
fn set_aside_dir(run_dir: &Path, step: usize) -> PathBuf {
    run_dir.join(format!("{SET_ASIDE}{PREFIX}{step:08}"))
}

fn fill_bytes(dir: &Path, files: &[(&str, Vec<u8>)]) -> Result<(), CheckpointError> {
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// [`write_with`] for files given as bytes.
pub fn write(
    run_dir: &Path,
    step: usize,
    files: &[(&str, Vec<u8>)],
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    write_with(run_dir, step, keep, |dir| fill_bytes(dir, files))
}

/// Every checkpoint under `run_dir`, oldest first, as `(step, dir)`: the `step-N` directories, and
/// a set-aside copy of a step whose rewrite a crash interrupted before the new one was in place.
/// Temporary directories are ignored.
pub fn list(run_dir: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    if !run_dir.exists() {
        return Ok(Vec::new());
    }
    let mut by_step: BTreeMap<usize, PathBuf> = BTreeMap::new();
    let mut aside = Vec::new();
    for e in std::fs::read_dir(run_dir)
        .map_err(|e| io(run_dir, e))?
        .filter_map(|e| e.ok())
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let step = |s: &str| s.strip_prefix(PREFIX).and_then(|s| s.parse::<usize>().ok());
        if let Some(n) = step(&name) {
            by_step.insert(n, e.path());
        } else if let Some(n) = name.strip_prefix(SET_ASIDE).and_then(step) {
            aside.push((n, e.path()));
        }
    }
    for (n, path) in aside {
        by_step.entry(n).or_insert(path);
    }
    Ok(by_step.into_iter().collect())
}

/// Cleans up after a writer that was killed: removes its temporary directories (never a finished
/// checkpoint), and puts a set-aside checkpoint back in place when its replacement never arrived
/// (removing it when it did). Call it only while no other process writes checkpoints into
/// `run_dir`.
pub fn remove_stale_temps(run_dir: &Path) -> Result<(), CheckpointError> {
    if !run_dir.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(run_dir)
        .map_err(|e| io(run_dir, e))?
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(&format!(".tmp-{PREFIX}")) {
            std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
        } else if let Some(step_name) = name.strip_prefix(SET_ASIDE).filter(|s| {
            s.strip_prefix(PREFIX)
                .is_some_and(|n| n.parse::<usize>().is_ok())
        }) {
            let step = run_dir.join(step_name);
            if step.exists() {
                std::fs::remove_dir_all(&path).map_err(|e| io(&path, e))?;
            } else {
                k3mini_durable::rename(&path, &step).map_err(|e| io(&path, e))?;
            }
        }
    }
    k3mini_durable::sync_dir(run_dir).map_err(|e| io(run_dir, e))
}

/// The newest checkpoint, if any.
pub fn latest(run_dir: &Path) -> Result<Option<(usize, PathBuf)>, CheckpointError> {
    Ok(list(run_dir)?.pop())
}

/// A checkpoint directory (named `step-NNNNNNNN`), or a run directory's newest checkpoint: its step
/// and directory.
pub fn locate(path: &Path) -> Result<(usize, PathBuf), CheckpointError> {
    if path.join(MANIFEST).is_file() {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let digits = name.as_deref().and_then(|n| n.rsplit('-').next());
        return Ok((
            digits.and_then(|d| d.parse().ok()).unwrap_or(0),
            path.to_path_buf(),
        ));
    }
    latest(path)?.ok_or_else(|| {
        io(
            path,
            "neither a checkpoint nor a run directory with checkpoints",
        )
    })
}

/// Verifies every file of a checkpoint against its manifest, reading each in pieces: name → path.
/// A missing, truncated or altered file is named.
pub fn verify(dir: &Path) -> Result<BTreeMap<String, PathBuf>, CheckpointError> {
    let invalid = |message: String| CheckpointError::Invalid {
        dir: dir.to_path_buf(),
        message,
    };
    let manifest_path = dir.join(MANIFEST);
    let raw = std::fs::read(&manifest_path).map_err(|e| io(&manifest_path, e))?;
    let manifest: Manifest = serde_json::from_slice(&raw)
        .map_err(|e| invalid(format!("{MANIFEST} does not parse: {e}")))?;
    let mut files = BTreeMap::new();
    for (name, sum) in &manifest.files {
        if name.contains('/') || name.contains('\\') || name == ".." {
            return Err(invalid(format!(
                "{MANIFEST} names {name:?}, not a file of it"
            )));
        }
        let path = dir.join(name);
        if &sha256_file(&path)? != sum {
            return Err(CheckpointError::Corrupt {
                dir: dir.to_path_buf(),
                file: name.clone(),
            });
        }
        files.insert(name.clone(), path);
    }
    Ok(files)
}
