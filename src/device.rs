//! Where a stage computes: `[run] device` in a recipe or `--device` on a command, resolved into the
//! plan's [`DeviceList`] and opened as burn devices when the stage starts.
//!
//! | written | means | backend |
//! |---|---|---|
//! | `cpu` (default) | this machine's cores | flex; libtorch's CPU device in a `--features tch` build |
//! | `cuda:N`, `cuda` (= `cuda:0`) | GPU N | burn-cuda (`--features cuda`), else libtorch (`--features tch`) |
//! | `cuda:0,1,2,3` | four GPUs, one replica each (data-parallel) | as above |
//! | `cpu,cpu` | two CPU replicas (tests the data-parallel path on one machine) | as `cpu` |
//!
//! Opening refuses, before any work, a device this build cannot drive (naming the feature to
//! build with) or a GPU index the backend does not see.

use crate::error::{Error, Result};
use burn::tensor::Device;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// One device a stage runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda(usize),
}

/// The devices of a stage, in order: the first is the main device (evaluation, sampling, local
/// teachers); more than one trains one replica on each. Never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceList(Vec<DeviceKind>);

impl Default for DeviceList {
    fn default() -> Self {
        Self(vec![DeviceKind::Cpu])
    }
}

impl DeviceList {
    pub fn kinds(&self) -> &[DeviceKind] {
        &self.0
    }

    /// Replicas a training step is spread over.
    pub fn replicas(&self) -> usize {
        self.0.len()
    }

    /// The main device only (evaluation, export and teachers run on one device).
    pub fn main(&self) -> Self {
        Self(self.0[..1].to_vec())
    }

    /// The device of the rank that is `local` on its machine, when a launcher starts one process
    /// per device: entry `local` of a list (`cuda:0,1,2,3`), or, of one entry, `cpu`, or
    /// `cuda:(N + local)` (`cuda` on every rank spreads them over the machine's GPUs) taken modulo
    /// the `visible` GPUs when fewer are (`srun --gpus-per-task 1` shows each task its own GPU
    /// alone, as `cuda:0`).
    pub fn for_local_rank(&self, local: usize, visible: Option<usize>) -> Result<Self> {
        let kind = match self.0.as_slice() {
            [DeviceKind::Cuda(n)] => {
                let at = n.checked_add(local).ok_or_else(|| {
                    Error::Refused(format!("local rank {local} is not a device index"))
                })?;
                DeviceKind::Cuda(match visible {
                    Some(v) if v > 0 && at >= v => at % v,
                    _ => at,
                })
            }
            [DeviceKind::Cpu] => DeviceKind::Cpu,
            list => *list.get(local).ok_or_else(|| {
                Error::Refused(format!(
                    "this process is local rank {local} but run.device ({self}) lists {} \
                     devices: list one per process the launcher starts on a machine",
                    list.len()
                ))
            })?,
        };
        Ok(Self(vec![kind]))
    }

    /// Opens every device, or says why this build or machine cannot.
    pub fn open(&self) -> Result<Vec<Device>> {
        self.0.iter().map(|&k| open(k)).collect()
    }

    /// Opens the main device.
    pub fn open_main(&self) -> Result<Device> {
        open(self.0[0])
    }
}

impl std::str::FromStr for DeviceList {
    type Err = String;

    /// `cpu`, `cuda`, `cuda:N`, and comma-separated lists of them; a bare index continues the
    /// previous CUDA entry (`cuda:0,1`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut kinds = Vec::new();
        for part in s.split(',').map(str::trim) {
            let cuda_index = |i: &str| {
                i.parse::<usize>()
                    .map_err(|_| format!("{part:?}: a CUDA device index is a number, as in cuda:0"))
            };
            let kind = match part {
                "cpu" => DeviceKind::Cpu,
                "cuda" | "gpu" => DeviceKind::Cuda(0),
                _ if part.starts_with("cuda:") => DeviceKind::Cuda(cuda_index(&part[5..])?),
                _ if matches!(kinds.last(), Some(DeviceKind::Cuda(_))) => {
                    DeviceKind::Cuda(cuda_index(part)?)
                }
                _ => {
                    return Err(format!(
                        "{part:?} is not a device: write cpu, cuda:N or a list such as cuda:0,1"
                    ));
                }
            };
            if let DeviceKind::Cuda(_) = kind
                && kinds.contains(&kind)
            {
                return Err(format!("{s:?} names {part} twice"));
            }
            kinds.push(kind);
        }
        let cpus = kinds.iter().filter(|k| **k == DeviceKind::Cpu).count();
        if cpus > 0 && cpus < kinds.len() {
            return Err(format!(
                "{s:?} mixes CPU and GPU replicas: they would run at the slowest one's pace"
            ));
        }
        Ok(Self(kinds))
    }
}

impl fmt::Display for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|k| match k {
                DeviceKind::Cpu => "cpu".to_string(),
                DeviceKind::Cuda(i) => format!("cuda:{i}"),
            })
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl Serialize for DeviceList {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for DeviceList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// A CPU device: libtorch's when the build has it (several times flex's matmul speed here), else
/// flex.
fn cpu() -> Device {
    #[cfg(feature = "tch")]
    #[allow(deprecated)]
    // burn-tch is deprecated upstream but is the GPU path that builds offline
    return Device::libtorch();
    #[cfg(not(feature = "tch"))]
    Device::flex()
}

fn open(kind: DeviceKind) -> Result<Device> {
    match kind {
        DeviceKind::Cpu => Ok(cpu()),
        DeviceKind::Cuda(i) => cuda(i),
    }
}

#[cfg(feature = "cuda")]
fn cuda(i: usize) -> Result<Device> {
    let seen = Device::enumerate(burn::tensor::DeviceType::Cuda).len();
    if i >= seen {
        return Err(absent(i, seen, "burn-cuda"));
    }
    Ok(Device::cuda(i))
}

#[cfg(all(feature = "tch", not(feature = "cuda")))]
fn cuda(i: usize) -> Result<Device> {
    let seen = Device::enumerate(burn::tensor::DeviceType::LibTorch).len();
    if i >= seen {
        return Err(absent(i, seen, "libtorch"));
    }
    #[allow(deprecated)] // as in `cpu`
    Ok(Device::libtorch_cuda(i))
}

#[cfg(not(any(feature = "tch", feature = "cuda")))]
fn cuda(i: usize) -> Result<Device> {
    Err(Error::Refused(format!(
        "device cuda:{i}: this k3mini was built without a GPU backend. Build with \
         `cargo build --release --features tch` (libtorch, CPU and CUDA; see the README's \
         \"Training on GPUs\") or `--features cuda` (burn-cuda)"
    )))
}

#[cfg(any(feature = "tch", feature = "cuda"))]
fn absent(i: usize, seen: usize, backend: &str) -> Error {
    Error::Refused(format!(
        "device cuda:{i}: {backend} sees {seen} CUDA device(s) on this machine. Check \
         nvidia-smi and CUDA_VISIBLE_DEVICES{}",
        if backend == "libtorch" {
            ", and that LD_LIBRARY_PATH points at a CUDA build of PyTorch's torch/lib"
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_lists_parse_and_print() {
        for (text, shown, replicas) in [
            ("cpu", "cpu", 1),
            ("cuda", "cuda:0", 1),
            ("cuda:3", "cuda:3", 1),
            ("cuda:0,1,2,3", "cuda:0,cuda:1,cuda:2,cuda:3", 4),
            ("cuda:0, cuda:2", "cuda:0,cuda:2", 2),
            ("cpu,cpu", "cpu,cpu", 2),
        ] {
            let d: DeviceList = text.parse().unwrap();
            assert_eq!((d.to_string().as_str(), d.replicas()), (shown, replicas));
            assert_eq!(d.to_string().parse::<DeviceList>().unwrap(), d);
        }
        for bad in [
            "",
            "tpu",
            "cuda:x",
            "cuda:0,0",
            "cpu,cuda:0",
            "1",
            "cuda:-1",
        ] {
            assert!(bad.parse::<DeviceList>().is_err(), "{bad:?} was accepted");
        }
    }
}
