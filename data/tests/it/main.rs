//! The data crate's integration tests, one binary (one link) with a module per area.
mod align;
mod chat;
mod corpus;
mod packing;
mod routing;
mod shards;
mod signals;
mod stream;
mod tokenizers;
mod trajectories;

use std::path::PathBuf;

/// A scratch directory, removed when dropped.
pub(crate) struct Dir(PathBuf);

impl Dir {
    pub(crate) fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("k3mini-data-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
    pub(crate) fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}
