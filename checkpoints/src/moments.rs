//! AdamW moments in a checkpoint (`optimizer.bpk`), written from the devices that hold them and
//! read back onto the devices that will use them, a tensor at a time: the state of a 3B model is
//! ~24 GB, and neither a save nor a resume may need it whole in host memory (burn's
//! `ModuleOptimizer::to_record` copies all of it to the host at once, and its `load_record` builds
//! it all on the default device).
//!
//! The file keeps the layout of burn's optimizer record (burn-pack), so checkpoints written before
//! k3mini kept its own optimizer resume, and burn's `OptimizerRecord::load` reads ours:
//!
//! ```text
//! tensor   {id}.momentum.moment_1   f32, the parameter's shape   m (first moment)
//! tensor   {id}.momentum.moment_2   f32, the parameter's shape   v (second moment)
//! scalar   {id}.momentum.time       steps the parameter has taken (t of the bias correction)
//! scalar   {id}.__rank              the parameter's rank
//! metadata {id}                     the parameter's module path
//! ```
//!
//! A parameter that has never had a gradient has no entry. `{id}` is burn's parameter id, which
//! `param_ids.json` gives back to the resumed model.

use crate::CheckpointError;
use crate::param_ids::ParamEntry;
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::{Bytes, DType, Reader, Scalar, Writer};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// One parameter's AdamW state: its moments flattened to `[n]` whatever the parameter's rank (the
/// update is element-wise), on the device that owns the parameter.
#[derive(Clone, Debug)]
pub struct Moments {
    /// Updates taken: the `t` of the bias correction.
    pub steps: usize,
    /// First moment `m`, `[n]`.
    pub m: Tensor<1>,
    /// Second moment `v`, `[n]`.
    pub v: Tensor<1>,
}

const M: &str = "momentum.moment_1";
const V: &str = "momentum.moment_2";
const STEPS: &str = "momentum.time";
const RANK: &str = "__rank";
/// AMSGrad's running maximum of `v`, which burn writes under this name and k3mini never uses.
const MAX_V: &str = "momentum.max_moment_2";

fn key(id: u64, leaf: &str) -> String {
    format!("{id}.{leaf}")
}

fn invalid(path: &Path, message: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        message: format!(
            "is not an optimizer state k3mini wrote (AdamW moments as a burn-pack record): {message}"
        ),
    }
}

/// Writes the moments of `params` (those with state) to `path`. Each moment is copied from its
/// device when the writer reaches it and dropped before the next is fetched, so the host holds
/// one tensor at a time.
pub fn write(
    path: &Path,
    params: &[ParamEntry],
    state: &HashMap<u64, Moments>,
) -> Result<(), CheckpointError> {
    let mut tensors = Vec::new();
    let mut scalars = Vec::new();
    let mut paths = Vec::new();
    for p in params {
        let Some(s) = state.get(&p.id) else { continue };
        let n: usize = p.shape.iter().product();
        for (leaf, moment) in [(M, &s.m), (V, &s.v)] {
            let moment = moment.clone();
            let fetch = move || -> Result<Bytes, burn_pack::Error> {
                let data = moment.to_data().convert::<f32>();
                Ok(data.into_bytes())
            };
            tensors.push(burn_pack::Tensor::deferred(
                key(p.id, leaf),
                DType::F32,
                p.shape.clone(),
                Some(p.id),
                n * 4,
                fetch,
            ));
        }
        scalars.push((key(p.id, STEPS), Scalar::from(s.steps)));
        scalars.push((key(p.id, RANK), Scalar::from(p.shape.len())));
        paths.push((p.id.to_string(), p.path.clone()));
    }
    let mut writer = Writer::new(tensors).auto_extension(false);
    for (k, v) in &scalars {
        writer = writer.with_scalar(k, *v);
    }
    for (k, v) in &paths {
        writer = writer.with_metadata(k, v);
    }
    writer
        .write_to_file_in_place(path)
        .map_err(|e| crate::io(path, e))
}

/// Reads the moments of `params` from `path`, each one straight onto `device(id)` (its owner), a
/// tensor at a time. A parameter whose `device` is None (another rank's) is skipped once its
/// entries are found whole; its owner reads and checks its values. Every tensor must be f32 of its parameter's shape, finite (and `v ≥ 0`), and
/// belong to one of `params`; a parameter has both moments and a step count, or none of them, and
/// its step count is from 1 to `max_steps` (the checkpoint's own step).
pub fn read(
    path: &Path,
    params: &[ParamEntry],
    max_steps: usize,
    device: impl Fn(u64) -> Option<Device>,
) -> Result<HashMap<u64, Moments>, CheckpointError> {
    let reader = Reader::from_file_exact(path).map_err(|e| invalid(path, e))?;
    let scalars = reader.scalars().clone();
    // File-backed: a tensor's bytes are read when taken, not here.
    let mut tensors: BTreeMap<String, burn_pack::Tensor> = reader
        .into_tensors()
        .map_err(|e| invalid(path, e))?
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let mut state = HashMap::new();
    for p in params {
        let steps = scalars.get(&key(p.id, STEPS));
        let (m, v) = (tensors.remove(&key(p.id, M)), tensors.remove(&key(p.id, V)));
        let what = |message: String| invalid(path, format!("{} (id {}): {message}", p.path, p.id));
        let (steps, m, v) = match (steps, m, v) {
            (None, None, None) => continue,
            (Some(steps), Some(m), Some(v)) => (steps, m, v),
            _ => {
                return Err(what(
                    "has part of a state (moments and step count go together)".into(),
                ));
            }
        };
        // The bias correction raises β to it as an i32, as burn does.
        let steps = usize::try_from(*steps)
            .ok()
            .filter(|&s| (1..=max_steps.min(i32::MAX as usize)).contains(&s))
            .ok_or_else(|| {
                what(format!(
                    "step count {steps:?} is not from 1 to the checkpoint's step {max_steps}"
                ))
            })?;
        if tensors.contains_key(&key(p.id, MAX_V)) {
            return Err(what(
                "holds AMSGrad's max_moment_2, which k3mini's AdamW never writes".into(),
            ));
        }
        let Some(device) = device(p.id) else {
            continue;
        };
        let load =
            |t: burn_pack::Tensor, non_negative: bool| -> Result<Tensor<1>, CheckpointError> {
                if t.dtype != DType::F32 || t.shape.as_slice() != p.shape.as_slice() {
                    return Err(what(format!(
                        "{} is {:?} {:?}, the parameter is F32 {:?}",
                        t.name,
                        t.dtype,
                        t.shape.as_slice(),
                        p.shape
                    )));
                }
                let name = t.name.clone();
                let bytes = t.into_bytes().map_err(|e| what(format!("{name}: {e}")))?;
                // Read from the file here, fallibly: dereferencing file-backed bytes panics when the
                // read fails (a file cut short since it was verified).
                let raw = bytes
                    .read(burn_std::Reader::new())
                    .map_err(|e| what(format!("{name} cannot be read: {e:?}")))?;
                let n: usize = p.shape.iter().product();
                if raw.len() != n * 4 {
                    return Err(what(format!(
                        "{name} holds {} bytes, not {}",
                        raw.len(),
                        n * 4
                    )));
                }
                let bad = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .find(|x| !x.is_finite() || (non_negative && *x < 0.0));
                if let Some(x) = bad {
                    return Err(what(format!("{name} holds {x}")));
                }
                Ok(Tensor::from_data(
                    TensorData::from_bytes(bytes, [n], DType::F32),
                    &device,
                ))
            };
        let m = load(m, false)?;
        let v = load(v, true)?;
        state.insert(p.id, Moments { steps, m, v });
    }
    if let Some(name) = tensors.keys().next() {
        return Err(invalid(
            path,
            format!(
                "{} tensors belong to no parameter of the model (the first: {name}); \
                 param_ids.json and optimizer.bpk are of different runs",
                tensors.len()
            ),
        ));
    }
    Ok(state)
}
