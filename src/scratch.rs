//! A fresh directory of this process's own under the temporary directory, removed when dropped:
//! where a benchmark writes its runs and shards, and where a generated program is run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Scratch(PathBuf);

impl Scratch {
    /// `k3mini-WHAT-PID-N`, created new: never one another caller (or a killed earlier process
    /// of the same id) holds.
    pub fn new(what: &str) -> std::io::Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let dir =
                std::env::temp_dir().join(format!("k3mini-{what}-{}-{n}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!("{}: {e}", dir.display()),
                    ));
                }
                Ok(()) => return Ok(Self(dir)),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}
