//! What the tests share: scratch directories and a recipe builder with defaults a test overrides
//! table by table, instead of copied TOML.
use std::path::{Path, PathBuf};

/// A fresh directory under the system's temp dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("k3mini-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `text` to `name` (creating its directories) and returns the path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Runs the `k3mini` binary with `args` and insists it succeeds (its stderr is the failure
/// message); returns what it printed.
pub fn k3mini_ok<I, S>(args: I) -> std::process::Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The repository's root (recipes, corpus, goldens).
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A recipe: the tables of a small plain run on `corpus.txt` with the Kimi vocabulary, each
/// replaceable, plus extra text after them.
pub struct Recipe {
    tables: Vec<(&'static str, String)>,
    extra: String,
}

impl Default for Recipe {
    fn default() -> Self {
        let tables = [
            ("run", "name = \"t\"\nseed = 7"),
            ("model", "preset = \"tiny\"\nd_model = 64"),
            (
                "data",
                "tokenizer = \"kimi\"\nseq_len = 128\n[[data.sources]]\npath = \"corpus.txt\"",
            ),
            ("optim", "lr = 3e-3"),
            ("schedule", "kind = \"cosine\"\nwarmup_steps = 10"),
            ("train", "steps = 100\nbatch_tokens = 1024\nmicro_batch = 4"),
        ];
        Self {
            tables: tables.map(|(t, body)| (t, body.to_string())).into(),
            extra: String::new(),
        }
    }
}

impl Recipe {
    /// Replaces table `[name]`'s body (or adds the table).
    pub fn with(mut self, name: &'static str, body: &str) -> Self {
        match self.tables.iter_mut().find(|(t, _)| *t == name) {
            Some(t) => t.1 = body.to_string(),
            None => self.tables.push((name, body.to_string())),
        }
        self
    }

    /// Appends raw TOML after the tables.
    pub fn extra(mut self, text: &str) -> Self {
        self.extra.push_str(text);
        self
    }

    pub fn text(&self) -> String {
        let mut out = String::new();
        for (name, body) in &self.tables {
            out.push_str(&format!("[{name}]\n{body}\n\n"));
        }
        out + &self.extra
    }
}
