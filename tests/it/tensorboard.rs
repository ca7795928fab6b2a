//! TensorBoard event files: the bytes TensorBoard's own writer produces for the same scalars, read
//! back as TensorBoard's reader reads them (tests/golden/tensorboard, from
//! scripts/golden/tensorboard_events.py), and a resumed run's curves following on exactly.
use crate::fixture::{Scratch, root};
use k3mini::run_dir::read_metrics;
use k3mini::tensorboard::{self, EventLog, Scalar, What, read_events};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// One event the script wrote: (step, wall time, [(tag, value)]).
type Written = (usize, f64, Vec<(String, f64)>);

#[derive(Deserialize)]
struct Golden {
    start: f64,
    steps: Vec<Written>,
    file_version: f64,
    /// What TensorBoard's EventAccumulator read back: tag → [(step, wall time, value)].
    scalars: BTreeMap<String, Vec<(i64, f64, f64)>>,
}

fn at(seconds: f64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs_f64(seconds)
}

/// tag → [(step, wall time, value)] of an event file, read by k3mini's reader.
fn scalars(bytes: &[u8]) -> BTreeMap<String, Vec<(i64, f64, f32)>> {
    let (events, end) = read_events(bytes).unwrap();
    assert_eq!(end, bytes.len(), "every record whole");
    let mut out: BTreeMap<_, Vec<_>> = BTreeMap::new();
    for e in events {
        if let Some(What::Summary(s)) = e.what {
            for v in s.value {
                let Some(Scalar::SimpleValue(x)) = v.value else {
                    panic!("{}: no simple_value", v.tag)
                };
                out.entry(v.tag).or_default().push((e.step, e.wall_time, x));
            }
        }
    }
    out
}

/// The run's event file, read.
pub(crate) fn run_scalars(run: &Path) -> BTreeMap<String, Vec<(i64, f64, f32)>> {
    let path = tensorboard::find(run)
        .unwrap()
        .expect("the run wrote an event file");
    scalars(&std::fs::read(path).unwrap())
}

/// The event file's losses equal `metrics.jsonl`'s (as f32), step for step, once each.
pub(crate) fn assert_events_match_metrics(run: &Path) {
    let from_events: Vec<(i64, u32)> = run_scalars(run)["train/loss"]
        .iter()
        .map(|&(step, _, x)| (step, x.to_bits()))
        .collect();
    let from_metrics: Vec<(i64, u32)> = read_metrics(run)
        .unwrap()
        .iter()
        .map(|m| (m.step as i64, (m.loss as f32).to_bits()))
        .collect();
    assert_eq!(from_events, from_metrics);
}

#[test]
fn event_files_are_the_bytes_tensorboard_writes_and_read_as_it_reads_them() {
    let dir = root().join("tests/golden/tensorboard");
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(dir.join("scalars.json")).unwrap()).unwrap();
    let expected = std::fs::read(dir.join("events.out.tfevents.1764979200.golden")).unwrap();

    let s = Scratch::new("tensorboard-golden");
    let mut log = EventLog::open(&s.0, 0, at(golden.start), nothing_logged).unwrap();
    assert!(
        log.path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents.1764979200."),
        "named as TensorFlow names event files"
    );
    for (step, wall, values) in &golden.steps {
        let values = values.iter().map(|(t, v)| (t.clone(), *v as f32)).collect();
        log.write(*step, at(*wall), values).unwrap();
    }
    let written = std::fs::read(log.path()).unwrap();
    assert_eq!(
        written, expected,
        "the bytes TensorBoard's RecordWriter wrote"
    );

    assert_eq!(golden.file_version, 2.0);
    let ours = scalars(&expected);
    let theirs: BTreeMap<_, Vec<_>> = golden
        .scalars
        .into_iter()
        .map(|(tag, v)| {
            (
                tag,
                v.into_iter().map(|(s, w, x)| (s, w, x as f32)).collect(),
            )
        })
        .collect();
    assert_eq!(ours, theirs, "TensorBoard's EventAccumulator read the same");
}

#[test]
fn reopening_drops_later_and_torn_records_and_rebuilds_after_a_damaged_one() {
    let s = Scratch::new("tensorboard-reopen");
    let mut log = EventLog::open(&s.0, 0, at(1e9), nothing_logged).unwrap();
    for step in 1..=5 {
        log.write(
            step,
            at(1e9 + step as f64),
            vec![("train/loss".into(), step as f32)],
        )
        .unwrap();
    }
    let path = log.path().to_path_buf();
    drop(log);
    // A kill mid-write: half of a sixth record.
    let mut bytes = std::fs::read(&path).unwrap();
    let whole = bytes.len();
    bytes.extend_from_slice(&tensorboard::record(&tensorboard::Event::default())[..7]);
    std::fs::write(&path, &bytes).unwrap();

    let mut log = EventLog::open(&s.0, 3, at(2e9), nothing_logged).unwrap();
    assert_eq!(log.path(), path, "a resumed run appends to its file");
    log.write(4, at(2e9), vec![("train/loss".into(), 40.0)])
        .unwrap();
    let steps: Vec<(i64, f32)> = run_scalars(&s.0)["train/loss"]
        .iter()
        .map(|&(s, _, x)| (s, x))
        .collect();
    assert_eq!(steps, [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]);
    assert!(std::fs::read(&path).unwrap().len() < whole);

    // A flipped byte inside step 3's record: the records before it are kept, and the steps from
    // it on are rebuilt from metrics.jsonl's lines (here 30 and 40, to tell them apart).
    let mut bytes = std::fs::read(&path).unwrap();
    let (events, _) = read_events(&bytes).unwrap();
    let third: usize = events[..3]
        .iter()
        .map(|e| tensorboard::record(e).len())
        .sum();
    bytes[third + 14] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let logged = || {
        Ok((1..=4)
            .map(|step| {
                serde_json::from_value(serde_json::json!({"step": step, "loss": 10 * step,
                    "lr": 0.0, "grad_norm": 0.0, "tokens_per_s": 0.0, "skipped": false}))
                .unwrap()
            })
            .collect())
    };
    let log = EventLog::open(&s.0, 4, at(3e9), logged).unwrap();
    let repaired = log.repaired.clone().expect("the damage is reported");
    assert!(
        repaired.contains("checksum") && repaired.contains("tfevents"),
        "{repaired}"
    );
    assert!(repaired.contains("rebuilt 2 steps"), "{repaired}");
    drop(log);
    let steps: Vec<(i64, f32)> = run_scalars(&s.0)["train/loss"]
        .iter()
        .map(|&(s, _, x)| (s, x))
        .collect();
    assert_eq!(steps, [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]);
    assert!(read_events(&std::fs::read(&path).unwrap()).is_ok());
    // Reopened whole, nothing is repaired or read from metrics.jsonl.
    let log = EventLog::open(&s.0, 4, at(4e9), nothing_logged).unwrap();
    assert!(log.repaired.is_none());
    drop(log);

    // Damage in the last record, past the step a resume goes back to, is dropped with it.
    let mut bytes = std::fs::read(&path).unwrap();
    let end = bytes.len();
    bytes[end - 6] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let log = EventLog::open(&s.0, 3, at(5e9), nothing_logged).unwrap();
    assert!(log.repaired.is_none());
    drop(log);

    // Damage in the first record: the file keeps its version record first, every step rebuilt.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[14] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let log = EventLog::open(&s.0, 4, at(6e9), logged).unwrap();
    assert!(log.repaired.unwrap().contains("rebuilt 4 steps"));
    let (events, _) = read_events(&std::fs::read(&path).unwrap()).unwrap();
    assert!(matches!(events[0].what, Some(What::FileVersion(_))));
    let steps: Vec<(i64, f32)> = run_scalars(&s.0)["train/loss"]
        .iter()
        .map(|&(s, _, x)| (s, x))
        .collect();
    assert_eq!(steps, [(1, 10.0), (2, 20.0), (3, 30.0), (4, 40.0)]);

    // A file without its version record (as an earlier repair left one) that holds a step past
    // the resumed one: the step goes, the version record comes first, stamped as the first kept.
    let (events, _) = read_events(&std::fs::read(&path).unwrap()).unwrap();
    let bare: Vec<u8> = events[1..].iter().flat_map(tensorboard::record).collect();
    std::fs::write(&path, bare).unwrap();
    drop(EventLog::open(&s.0, 3, at(7e9), nothing_logged).unwrap());
    let (kept, _) = read_events(&std::fs::read(&path).unwrap()).unwrap();
    assert!(matches!(kept[0].what, Some(What::FileVersion(_))));
    assert_eq!(kept[0].wall_time, events[1].wall_time);
    assert_eq!(
        kept[1..].iter().map(|e| e.step).collect::<Vec<_>>(),
        [1, 2, 3]
    );
}

/// For an [`EventLog::open`] that must not need the metrics.
fn nothing_logged() -> k3mini::error::Result<Vec<k3mini::run_dir::StepMetrics>> {
    panic!("an intact event file is not rebuilt")
}

#[test]
fn a_crafted_length_ends_the_stream_instead_of_overflowing() {
    let masked = |b: &[u8]| crc32c::crc32c(b).rotate_right(15).wrapping_add(0xa282_ead8);
    for len in [u64::MAX, u64::MAX - 15, 1 << 40] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(&masked(&len.to_le_bytes()).to_le_bytes());
        bytes.extend_from_slice(&[0; 8]);
        let (events, end) = read_events(&bytes).unwrap();
        assert_eq!((events.len(), end), (0, 0), "length {len}");
    }
}
