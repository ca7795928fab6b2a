//! `k3mini bench`'s measurements that span crates or processes (the numbers go in the README and
//! `docs/results/`, never in tests): a model shape's forward + backward, a recipe's training steps
//! ([`recipe`]), the data loader as a corpus grows ([`loader`]), teacher scoring and shard sizes
//! ([`teacher`]), GGUF decode speed and state in llama.cpp ([`decode`]).
//!
//! Tables that compare peak memory run each measurement in a child process of the `k3mini` binary,
//! so each peak RSS is its own: the parent sends a [`Child`] as JSON (`k3mini bench child
//! REQUEST`, [`CHILD_COMMAND`]) and reads the measurement back as JSON from the child's stdout
//! ([`answer`] is the child's side).

#[cfg(feature = "llama-cpp")]
pub mod decode;
pub mod loader;
pub mod recipe;
pub mod teacher;

use crate::device::DeviceList;
use crate::error::{Context, Error, Result};
use k3mini_student::bench::{ShapeStep, TrainStepBench, bench_train_step};
use loader::LoaderRun;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The hidden subcommand a child process runs: `k3mini bench child REQUEST`.
pub const CHILD_COMMAND: [&str; 2] = ["bench", "child"];

/// One measurement a benchmark asks of a child process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Child {
    /// A model shape's forward + backward on the CPU: a [`TrainStepBench`].
    Step(ShapeStep),
    /// One loader pass: a [`loader::LoaderBench`].
    Loader(LoaderRun),
}

/// The child's side: runs `request` (a [`Child`] as JSON) and returns its measurement as JSON.
pub fn answer(request: &str) -> Result<String> {
    let request: Child = serde_json::from_str(request).context("reading a benchmark request")?;
    Ok(match request {
        Child::Step(s) => serde_json::to_string(&step(&s, &DeviceList::default())?)?,
        Child::Loader(run) => serde_json::to_string(&loader::bench_loader(&run)?)?,
    })
}

/// Runs `request` in a child process of `exe` (the `k3mini` binary) and reads its measurement.
pub fn in_child<T: DeserializeOwned>(exe: &Path, request: &Child) -> Result<T> {
    let json = serde_json::to_string(request)?;
    let out = std::process::Command::new(exe)
        .args(CHILD_COMMAND)
        .arg(&json)
        .output()
        .with_context(|| format!("running {} {}", exe.display(), CHILD_COMMAND.join(" ")))?;
    if !out.status.success() {
        return Err(Error::Refused(format!(
            "the benchmark child {json} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("reading what the benchmark child {json} printed"))
}

/// `step`'s forward + backward on `device`, in this process.
pub fn step(step: &ShapeStep, device: &DeviceList) -> Result<TrainStepBench> {
    Ok(bench_train_step(&step.spec()?, &device.open_main()?))
}

/// A measured step beside `model info`'s estimate of it ([`TrainStepBench::estimate`]).
#[derive(Clone, Debug, Serialize)]
pub struct MemoryCheck {
    pub measured: TrainStepBench,
    /// Heap bytes the forward kept, as counted (`measured.kept_bytes`, which a check has).
    pub kept: usize,
    /// Heap bytes kept after the forward, by the estimate.
    pub estimated_kept: usize,
    /// The estimate plus the largest transient and the gradients: what the step may peak at.
    pub estimated_bound: usize,
}

impl MemoryCheck {
    /// The estimate's error on what the forward keeps: estimated / measured − 1.
    pub fn kept_error(&self) -> f64 {
        self.estimated_kept as f64 / self.kept.max(1) as f64 - 1.0
    }
}

/// The memory model against measurement ([`k3mini_student::bench::memory_steps`]), each step in
/// a child of `exe`; `each` receives every check as it ends.
pub fn memory(exe: &Path, steps: usize, mut each: impl FnMut(MemoryCheck)) -> Result<()> {
    for s in k3mini_student::bench::memory_steps(steps) {
        let measured: TrainStepBench = in_child(exe, &Child::Step(s))?;
        let Some(kept) = measured.kept_bytes else {
            crate::bail!(
                "{} counts no heap bytes: the memory check needs the k3mini binary, whose allocator \
                 counts them",
                exe.display()
            );
        };
        let (estimated_kept, estimated_bound) = measured.estimate()?;
        each(MemoryCheck {
            measured,
            kept,
            estimated_kept,
            estimated_bound,
        });
    }
    Ok(())
}

/// The training path against its reference, A B A B
/// ([`k3mini_student::bench::training_path_steps`]), each step in a child of `exe`; `each`
/// receives every measurement as it ends.
pub fn training_path(exe: &Path, steps: usize, mut each: impl FnMut(TrainStepBench)) -> Result<()> {
    for s in k3mini_student::bench::training_path_steps(steps) {
        each(in_child(exe, &Child::Step(s))?);
    }
    Ok(())
}
