//! TensorBoard event files: every `train` writes `RUN/events.out.tfevents.SECS.HOST` beside
//! `metrics.jsonl`, the same steps and figures, so `tensorboard --logdir runs` shows a run while
//! it trains and `wandb sync` can upload it.
//!
//! An event file is a TFRecord stream of `tensorboard.Event` protobufs
//! (`tensorboard/compat/proto/event.proto`, `summary.proto`):
//!
//! ```text
//! record           = len: u64 LE · masked_crc(len) · data[len] · masked_crc(data)
//! masked_crc(x)    = rotr15(crc32c(x)) + 0xa282ead8   (u32, wrapping)
//! first record     = Event { wall_time, file_version: "brain.Event:2" }
//! one logged step  = Event { wall_time, step, summary: [Value { tag, simple_value }, …] }
//! ```
//!
//! The messages are prost-derived structs (the three fields of each we write) and the checksum is
//! the `crc32c` crate's; the framing, twenty lines, is written here because neither TensorBoard
//! crate fits: `tboard` compiles TensorBoard's `.proto` files with prost-build, which needs
//! `protoc` on every build machine, and pins prost 0.12; `tensorboard-rs` pulls protobuf 2 and
//! image 0.23 to write scalars.
//!
//! A run resumed after a kill would log the steps after its checkpoint twice: opening the log
//! drops those records first (and a half-written last one), as `metrics.jsonl` does, so the
//! curves follow on exactly. The log is appended as it goes, not synced: like `metrics.jsonl`, it
//! is a view of the run; the checkpoints are what a crash must not lose.

use crate::error::{Context, Result};
use crate::refused;
use crate::run_dir::StepMetrics;
use prost::Message;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// What names an event file (TensorBoard and W&B look for it in the file name).
const MARK: &str = "tfevents";
const FILE_VERSION: &str = "brain.Event:2";
const CRC_MASK_DELTA: u32 = 0xa282_ead8;

/// `tensorboard.Event`, the fields k3mini writes.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorboard.Summary`: scalars only.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorboard.Summary.Value` with a `simple_value`.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub tag: String,
    /// A member of the `value` oneof, so written even when it is 0 (a plain proto3 float would be
    /// left out, and TensorBoard would see no value).
    #[prost(oneof = "Scalar", tags = "2")]
    pub value: Option<Scalar>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Scalar {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
        .rotate_right(15)
        .wrapping_add(CRC_MASK_DELTA)
}

/// One TFRecord holding `event`.
pub fn record(event: &Event) -> Vec<u8> {
    let data = event.encode_to_vec();
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&masked_crc(&data).to_le_bytes());
    out
}

/// The events of a TFRecord stream, each record's checksums verified, and the bytes they span: a
/// record cut short at the end (a process killed mid-write) ends the stream there. A checksum
/// that fails or a record that does not decode is an error naming its offset.
pub fn read_events(bytes: &[u8]) -> Result<(Vec<Event>, usize)> {
    match read_prefix(bytes) {
        (_, _, Some(damage)) => Err(damage),
        (events, end, None) => Ok((events, end)),
    }
}

/// [`read_events`]' events up to the first damaged record, the bytes they span, and the damage.
fn read_prefix(bytes: &[u8]) -> (Vec<Event>, usize, Option<crate::error::Error>) {
    let mut events = Vec::new();
    let mut at = 0;
    while bytes.len() - at >= 12 {
        let header = &bytes[at..at + 12];
        let (len, crc) = header.split_at(8);
        if masked_crc(len) != u32::from_le_bytes(crc.try_into().unwrap()) {
            let damage = refused!("record at byte {at}: its length fails its checksum");
            return (events, at, Some(damage));
        }
        let len = u64::from_le_bytes(len.try_into().unwrap());
        let end = match usize::try_from(len)
            .ok()
            .and_then(|l| (at + 12).checked_add(l))
        {
            // Checked: a crafted length cannot overflow past the end of the buffer.
            Some(end) if end.checked_add(4).is_some_and(|e| e <= bytes.len()) => end,
            _ => break,
        };
        let data = &bytes[at + 12..end];
        if masked_crc(data) != u32::from_le_bytes(bytes[end..end + 4].try_into().unwrap()) {
            let damage = refused!("record at byte {at}: its data fails its checksum");
            return (events, at, Some(damage));
        }
        match Event::decode(data) {
            Ok(event) => events.push(event),
            Err(e) => return (events, at, Some(refused!("record at byte {at}: {e}"))),
        }
        at = end + 4;
    }
    (events, at, None)
}

/// The figures of one logged step, as TensorBoard tags. Loss and held-out figures, learning rate,
/// gradient norm, throughput, and per MoE layer the most and fewest tokens one expert took.
pub fn scalars(m: &StepMetrics) -> Vec<(String, f32)> {
    let mut out = vec![
        ("train/loss".to_string(), m.loss as f32),
        ("train/lr".to_string(), m.lr as f32),
        ("train/grad_norm".to_string(), m.grad_norm as f32),
        ("train/tokens_per_s".to_string(), m.tokens_per_s as f32),
    ];
    let optional = [
        ("eval/loss", m.eval_loss),
        ("eval/top1", m.eval_top1),
        ("eval/kl", m.eval_kl),
        ("train/on_policy_kl", m.on_policy_kl),
        ("train/balance_loss", m.balance_loss),
        ("train/collective_s", m.collective_s),
    ];
    out.extend(
        optional
            .into_iter()
            .filter_map(|(tag, v)| Some((tag.to_string(), v? as f32))),
    );
    // Numbered among the MoE layers (after `first_dense_layers`), as metrics.jsonl lists them.
    for (n, (max, min)) in m.expert_load_max.iter().zip(&m.expert_load_min).enumerate() {
        out.push((format!("experts/moe{n}/load_max"), *max as f32));
        out.push((format!("experts/moe{n}/load_min"), *min as f32));
    }
    out
}

fn seconds(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A run's event file, open for appending.
pub struct EventLog {
    file: std::fs::File,
    path: PathBuf,
    /// What [`EventLog::open`] found damaged and rebuilt, to tell the user.
    pub repaired: Option<String>,
}

/// The record every event file starts with: its format's version, stamped `wall_time`.
fn file_version(wall_time: f64) -> Event {
    Event {
        wall_time,
        step: 0,
        what: Some(What::FileVersion(FILE_VERSION.into())),
    }
}

/// `values` at `step`, stamped `now`.
fn summary(step: usize, now: SystemTime, values: Vec<(String, f32)>) -> Event {
    Event {
        wall_time: seconds(now),
        step: step as i64,
        what: Some(What::Summary(Summary {
            value: values
                .into_iter()
                .map(|(tag, v)| Value {
                    tag,
                    value: Some(Scalar::SimpleValue(v)),
                })
                .collect(),
        })),
    }
}

impl EventLog {
    /// The run's event file, opened for appending after `step`: its records of later steps
    /// (written by a run killed after its last checkpoint) and a half-written last record are
    /// dropped first. A damaged record (a failed checksum) ends what is kept of the file; the
    /// steps after it up to `step` are rebuilt from `logged` (the run's `metrics.jsonl`, the
    /// record of truth), stamped `now`, and [`EventLog::repaired`] says so. A run without a file
    /// starts `events.out.tfevents.SECS.HOST` at `now`.
    pub fn open(
        run: &Path,
        step: usize,
        now: SystemTime,
        logged: impl FnOnce() -> Result<Vec<StepMetrics>>,
    ) -> Result<Self> {
        let mut repaired = None;
        let path = match find(run)? {
            Some(path) => {
                let bytes =
                    std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
                let (mut events, end, damage) = read_prefix(&bytes);
                let mut changed = end != bytes.len();
                // Steps only grow along the file: damage after a record of `step` or later lies
                // in what a resume drops anyway.
                let reached = events.iter().map(|e| e.step).max().unwrap_or(0);
                let read = events.len();
                events.retain(|e| e.step <= step as i64);
                changed |= events.len() != read;
                if !events
                    .first()
                    .is_some_and(|e| matches!(e.what, Some(What::FileVersion(_))))
                {
                    let wall = events.first().map_or(seconds(now), |e| e.wall_time);
                    events.insert(0, file_version(wall));
                    changed = true;
                }
                if let Some(damage) = damage.filter(|_| reached < step as i64) {
                    let last = events
                        .iter()
                        .filter(|e| matches!(e.what, Some(What::Summary(_))))
                        .map(|e| e.step)
                        .max()
                        .unwrap_or(0);
                    let rebuilt: Vec<Event> = logged()?
                        .iter()
                        .filter(|m| m.step as i64 > last && m.step <= step)
                        .map(|m| summary(m.step, now, scalars(m)))
                        .collect();
                    repaired = Some(format!(
                        "{}: {damage}; kept the steps up to {last} and rebuilt {} steps after it \
                         from {}",
                        path.display(),
                        rebuilt.len(),
                        crate::run_dir::METRICS
                    ));
                    events.extend(rebuilt);
                }
                if changed {
                    let kept: Vec<u8> = events.iter().flat_map(record).collect();
                    k3mini_durable::write(&path, &kept)
                        .with_context(|| format!("rewriting {}", path.display()))?;
                }
                path
            }
            None => {
                let path = run.join(format!(
                    "events.out.{MARK}.{}.{}",
                    seconds(now) as u64,
                    host()
                ));
                k3mini_durable::write(&path, &record(&file_version(seconds(now))))
                    .with_context(|| format!("writing {}", path.display()))?;
                path
            }
        };
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self {
            file,
            path,
            repaired,
        })
    }

    /// Appends one event: `values` at `step`, stamped `now`.
    pub fn write(
        &mut self,
        step: usize,
        now: SystemTime,
        values: Vec<(String, f32)>,
    ) -> Result<()> {
        let event = summary(step, now, values);
        // One write of the whole record: a kill leaves at most one record cut short.
        self.file
            .write_all(&record(&event))
            .with_context(|| format!("writing {}", self.path.display()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The run's event file, if it has one; two are refused (the curves would be read twice).
pub fn find(run: &Path) -> Result<Option<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(run) else {
        return Ok(None);
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                    n.starts_with("events.out.") && n.contains(MARK) && !n.ends_with(".tmp")
                })
        })
        .collect();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(refused!(
            "{} holds {} TensorBoard event files; a run writes one: remove the others",
            run.display(),
            found.len()
        )),
    }
}

/// This machine's name for the file name, as TensorFlow's writers put it there.
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().replace(['/', '.'], "_"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
