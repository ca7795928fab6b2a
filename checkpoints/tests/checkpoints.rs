//! Checkpoint directories: atomic, pruned, verified; parameter ids survive a round trip.
use burn::tensor::Device;
use k3mini_checkpoints::param_ids::{param_ids, restore_param_ids};
use k3mini_checkpoints::{CheckpointError, latest, list, step_dir, verify, write, write_with};
use k3mini_student::{K3Mini, presets};
use std::path::PathBuf;

struct Run(PathBuf);

impl Run {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("k3mini-ckpt-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        Self(d)
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn files(step: usize) -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("state.json", format!("{{\"step\": {step}}}").into_bytes()),
        ("blob.bin", vec![step as u8; 1000]),
    ]
}

#[test]
fn write_read_and_keep_the_newest() {
    let run = Run::new("keep");
    for step in [10, 20, 30, 40] {
        write(&run.0, step, &files(step), 2).unwrap();
    }
    let steps: Vec<usize> = list(&run.0).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, vec![30, 40]);
    let (step, dir) = latest(&run.0).unwrap().unwrap();
    assert_eq!(step, 40);
    let got = verify(&dir).unwrap();
    assert_eq!(std::fs::read(&got["blob.bin"]).unwrap(), vec![40u8; 1000]);
    // A leftover temporary directory from a crash is not a checkpoint.
    std::fs::create_dir_all(run.0.join(".tmp-step-00000050-1")).unwrap();
    assert_eq!(latest(&run.0).unwrap().unwrap().0, 40);
}

#[test]
fn files_written_in_place_are_checksummed_and_a_failed_fill_leaves_no_checkpoint() {
    let run = Run::new("fill");
    let dir = write_with(&run.0, 3, 2, |tmp| -> Result<(), CheckpointError> {
        std::fs::write(tmp.join("a.bin"), vec![1u8; 3 << 20]).unwrap();
        std::fs::write(tmp.join("b.json"), "{}").unwrap();
        Ok(())
    })
    .unwrap();
    let got = verify(&dir).unwrap();
    assert_eq!(got.keys().collect::<Vec<_>>(), ["a.bin", "b.json"]);
    let e = write_with(&run.0, 4, 2, |tmp| {
        std::fs::write(tmp.join("a.bin"), [2u8; 10]).unwrap();
        Err(CheckpointError::Invalid {
            dir: tmp.to_path_buf(),
            message: "the disk filled".into(),
        })
    })
    .unwrap_err();
    assert!(e.to_string().contains("the disk filled"), "{e}");
    assert_eq!(
        latest(&run.0).unwrap().unwrap().0,
        3,
        "step 4 was never published"
    );
}

#[test]
fn corrupt_and_truncated_files_are_named() {
    let run = Run::new("corrupt");
    let dir = write(&run.0, 7, &files(7), 3).unwrap();
    let blob = dir.join("blob.bin");
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[500] ^= 1;
    std::fs::write(&blob, &bytes).unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(
        matches!(&err, CheckpointError::Corrupt { file, .. } if file == "blob.bin"),
        "{err}"
    );
    std::fs::write(&blob, &bytes[..100]).unwrap();
    assert!(
        verify(&dir)
            .unwrap_err()
            .to_string()
            .contains("blob.bin is corrupt")
    );
    std::fs::write(&blob, vec![7u8; 1000]).unwrap(); // repaired
    std::fs::remove_file(dir.join("state.json")).unwrap();
    assert!(verify(&dir).unwrap_err().to_string().contains("state.json"));
    std::fs::write(dir.join("manifest.json"), "{not json").unwrap();
    assert!(
        verify(&dir)
            .unwrap_err()
            .to_string()
            .contains("manifest.json does not parse")
    );
    assert_eq!(step_dir(&run.0, 7), dir);
}

#[test]
fn parameter_ids_round_trip_by_path() {
    let device = Device::flex();
    let a = K3Mini::new(&presets::tiny(), &device).unwrap();
    let b = K3Mini::new(&presets::tiny(), &device).unwrap();
    let ids = param_ids(&a);
    let unique: std::collections::BTreeSet<u64> = ids.values().copied().collect();
    assert_eq!(
        unique.len(),
        ids.len(),
        "one distinct id per parameter tensor"
    );
    assert!(
        ids.contains_key("model.layers.3.self_attn.kv_b_proj.weight"),
        "{:?}",
        ids.keys().take(5).collect::<Vec<_>>()
    );
    assert_ne!(param_ids(&b), ids);
    let b = restore_param_ids(b, &ids).unwrap();
    assert_eq!(param_ids(&b), ids);
    let mut partial = ids.clone();
    partial.remove("lm_head.weight");
    let err =
        restore_param_ids(K3Mini::new(&presets::tiny(), &device).unwrap(), &partial).unwrap_err();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

/// The newest checkpoint `list` finds, verified, as `(step, state.json)`.
fn newest(run: &std::path::Path) -> (usize, Vec<u8>) {
    let (step, dir) = latest(run).unwrap().expect("a checkpoint");
    let files = verify(&dir).unwrap();
    (step, std::fs::read(&files["state.json"]).unwrap())
}

#[test]
fn a_write_stopped_at_any_stage_leaves_the_old_or_the_new_checkpoint() {
    use k3mini_checkpoints::{Stage, remove_stale_temps, write_until};
    let stages = [
        Stage::Filled,
        Stage::Synced,
        Stage::SetAside,
        Stage::Published,
        Stage::Pruned,
    ];
    for stage in stages {
        // A new step after an old one, keeping one: until it is published the old one opens, and
        // from then on the new one, whole.
        let run = Run::new(&format!("fault-{stage:?}"));
        write(&run.0, 10, &files(10), 1).unwrap();
        write_until(&run.0, 20, &files(20), 1, stage).unwrap();
        let want = if stage >= Stage::Published { 20 } else { 10 };
        assert_eq!(
            newest(&run.0),
            (want, files(want)[0].1.clone()),
            "{stage:?}"
        );
        // The next run cleans up and writes on as usual.
        remove_stale_temps(&run.0).unwrap();
        assert_eq!(newest(&run.0).0, want, "{stage:?}, cleaned up");
        write(&run.0, 30, &files(30), 1).unwrap();
        let steps: Vec<usize> = list(&run.0).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [30], "{stage:?}");

        // The same step rewritten (a resumed run that reaches it again): one version of it is on
        // disk under a name `list` reads at every stage.
        let mut rewritten = files(30);
        rewritten[0].1 = b"{\"step\": 30, \"again\": true}".to_vec();
        write_until(&run.0, 30, &rewritten, 1, stage).unwrap();
        let (step, state) = newest(&run.0);
        assert_eq!(step, 30, "{stage:?}");
        let want = if stage >= Stage::Published {
            &rewritten
        } else {
            &files(30)
        };
        assert_eq!(state, want[0].1, "{stage:?}");
        remove_stale_temps(&run.0).unwrap();
        assert_eq!(newest(&run.0).1, want[0].1, "{stage:?}, cleaned up");
        let names: Vec<String> = std::fs::read_dir(&run.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["step-00000030"], "{stage:?}: nothing left over");
    }
}
