//! Checkpoints: a checkpoint is a directory `step-NNNNNNNN/` holding named files and a
//! `manifest.json` of their SHA-256 sums. It is written to a temporary directory and renamed into
//! place (a crash leaves either the old set or the new one, never half a checkpoint), the oldest
//! are pruned beyond `keep`, and opening one verifies every checksum so a corrupt or truncated file
//! is named instead of loaded. Files are written and hashed as streams: a checkpoint of a model
//! larger than memory's spare room never has to be whole in memory.
//!
//! [`param_ids`] carries burn's parameter ids (which key the optimizer state) alongside the
//! transformers-named safetensors weights, so resumption is exact.

pub mod param_ids;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
const PREFIX: &str = "step-";

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

/// Writes `bytes` to `path` through a temporary file beside it and a rename, so that a reader
/// sees the old file or the new one, never part of either.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
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

/// Writes a checkpoint atomically and prunes all but the newest `keep`: `fill` writes its files
/// into a fresh temporary directory (streaming them, so nothing needs to be whole in memory); each
/// file is then checksummed into the manifest and the directory renamed into place. Returns it.
pub fn write_with<E: From<CheckpointError>>(
    run_dir: &Path,
    step: usize,
    keep: usize,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<PathBuf, E> {
    let final_dir = step_dir(run_dir, step);
    let tmp = run_dir.join(format!(".tmp-{PREFIX}{step:08}-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    fill(&tmp)?;
    let mut manifest = Manifest {
        step,
        files: BTreeMap::new(),
    };
    for entry in std::fs::read_dir(&tmp).map_err(|e| io(&tmp, e))? {
        let path = entry.map_err(|e| io(&tmp, e))?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_file() && name != MANIFEST {
            manifest.files.insert(name, sha256_file(&path)?);
        }
    }
    let manifest_path = tmp.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
    std::fs::write(&manifest_path, json).map_err(|e| io(&manifest_path, e))?;
    // fsync the files' directory entries before the rename makes them visible.
    if let Ok(d) = std::fs::File::open(&tmp) {
        let _ = d.sync_all();
    }
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(|e| io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| io(&final_dir, e))?;
    let all = list(run_dir)?;
    for (_, old) in all.iter().rev().skip(keep.max(1)) {
        std::fs::remove_dir_all(old).map_err(|e| io(old, e))?;
    }
    Ok(final_dir)
}

/// [`write_with`] for files given as bytes.
pub fn write(
    run_dir: &Path,
    step: usize,
    files: &[(&str, Vec<u8>)],
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    write_with(run_dir, step, keep, |dir| {
        for (name, bytes) in files {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|e| io(&path, e))?;
        }
        Ok(())
    })
}

/// Every checkpoint under `run_dir`, oldest first, as `(step, dir)`. Temporary directories are ignored.
pub fn list(run_dir: &Path) -> Result<Vec<(usize, PathBuf)>, CheckpointError> {
    if !run_dir.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(usize, PathBuf)> = std::fs::read_dir(run_dir)
        .map_err(|e| io(run_dir, e))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix(PREFIX)
                .and_then(|s| s.parse::<usize>().ok())
                .map(|step| (step, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Removes the temporary directories a killed writer left behind (never a finished checkpoint).
/// Call it only while no other process writes checkpoints into `run_dir`.
pub fn remove_stale_temps(run_dir: &Path) -> Result<(), CheckpointError> {
    if !run_dir.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(run_dir)
        .map_err(|e| io(run_dir, e))?
        .flatten()
    {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(&format!(".tmp-{PREFIX}"))
        {
            std::fs::remove_dir_all(entry.path()).map_err(|e| io(&entry.path(), e))?;
        }
    }
    Ok(())
}

/// The newest checkpoint, if any.
pub fn latest(run_dir: &Path) -> Result<Option<(usize, PathBuf)>, CheckpointError> {
    Ok(list(run_dir)?.pop())
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
