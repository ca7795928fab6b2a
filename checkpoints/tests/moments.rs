//! AdamW moments in a checkpoint: written and read a tensor at a time (the heap's peak while
//! writing or reading 32 moments of 1 MiB stays near one moment, not the file), and a file that
//! does not fit the model is refused by name.
use burn::tensor::{Device, Distribution, Tensor};
use k3mini_checkpoints::moments::{Moments, read, write};
use k3mini_checkpoints::param_ids::ParamEntry;
use k3mini_student::bench::{CountingAlloc, heap_live_bytes, heap_peak_bytes, reset_heap_peak};
use std::collections::HashMap;
use std::path::PathBuf;

// nextest runs each test in its own process, so the counter sees this test alone.
#[global_allocator]
static ALLOC: CountingAlloc<std::alloc::System> = CountingAlloc(std::alloc::System);

const MIB: usize = 1 << 20;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("k3mini-moments-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// `n` parameters of `[rows, 256]` f32 (1 MiB at 1024 rows) with random moments.
fn state(n: usize, rows: usize) -> (Vec<ParamEntry>, HashMap<u64, Moments>) {
    let device = Device::flex();
    let params: Vec<ParamEntry> = (0..n)
        .map(|i| ParamEntry {
            path: format!("layers.{i}.weight"),
            id: 1000 + i as u64,
            shape: vec![rows, 256],
        })
        .collect();
    let moments = params
        .iter()
        .map(|p| {
            let m = Tensor::<1>::random([rows * 256], Distribution::Normal(0.0, 1.0), &device);
            let v = m.clone().square();
            (p.id, Moments { steps: 3, m, v })
        })
        .collect();
    (params, moments)
}

fn values(t: &Tensor<1>) -> Vec<f32> {
    t.to_data().try_to_vec::<f32>().unwrap()
}

#[test]
fn moments_stream_to_disk_and_back_a_tensor_at_a_time() {
    let dir = Dir::new("stream");
    let path = dir.0.join("optimizer.bpk");
    let (params, moments) = state(16, 1024);
    let before = heap_live_bytes().unwrap();
    reset_heap_peak();
    write(&path, &params, &moments).unwrap();
    let peak = heap_peak_bytes().unwrap() - before;
    let size = std::fs::metadata(&path).unwrap().len() as usize;
    assert!(size > 32 * MIB);
    eprintln!("write: heap peak {peak} bytes for a {size}-byte file");
    // One moment and the writer's buffers; burn's to_record held all 32 MiB.
    assert!(
        peak < 3 * MIB,
        "write: peak {peak} bytes for a {size}-byte file"
    );

    let before = heap_live_bytes().unwrap();
    reset_heap_peak();
    let back = read(&path, &params, 3, |_| Some(Device::flex())).unwrap();
    let peak = heap_peak_bytes().unwrap();
    let kept = heap_live_bytes().unwrap() - before;
    eprintln!("read: heap peak {} bytes, {kept} kept", peak - before);
    // What is read stays (32 MiB); on the way, at most a moment more at a time.
    assert!(
        peak - before < kept + 3 * MIB,
        "read: peak {} bytes to keep {kept}",
        peak - before
    );
    for p in &params {
        let (a, b) = (&moments[&p.id], &back[&p.id]);
        assert_eq!(b.steps, 3);
        assert_eq!(values(&a.m), values(&b.m), "{}", p.path);
        assert_eq!(values(&a.v), values(&b.v), "{}", p.path);
    }
    // A rank reads the parameters it owns, and only those (the others' stay on disk).
    let mine = |id: u64| id % 2 == 0;
    let before = heap_live_bytes().unwrap();
    let part = read(&path, &params, 3, |id| mine(id).then(Device::flex)).unwrap();
    let kept = heap_live_bytes().unwrap() - before;
    let ids: Vec<u64> = params.iter().map(|p| p.id).filter(|&id| mine(id)).collect();
    assert_eq!(part.len(), ids.len());
    assert!(ids.iter().all(|id| part.contains_key(id)));
    assert!(kept < 17 * MIB, "{kept} bytes kept for half of 32 MiB");
}

#[test]
fn a_file_that_does_not_fit_the_model_is_refused_by_name() {
    let dir = Dir::new("refuse");
    let path = dir.0.join("optimizer.bpk");
    let (params, mut moments) = state(3, 4);
    write(&path, &params, &moments).unwrap();
    let refused = |params: &[ParamEntry]| {
        read(&path, params, 3, |_| Some(Device::flex()))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };

    // Another shape.
    let mut other = params.clone();
    other[1].shape = vec![2, 512];
    let e = refused(&other);
    assert!(
        e.contains("layers.1.weight") && e.contains("[4, 256]") && e.contains("[2, 512]"),
        "{e}"
    );

    // Moments of a parameter the model does not have.
    let e = refused(&params[..2]);
    assert!(
        e.contains("belong to no parameter") && e.contains("1002."),
        "{e}"
    );

    // A non-finite first moment, a negative second moment.
    let device = Device::flex();
    let bad = |x: f32| Tensor::<1>::from_floats([x].repeat(4 * 256).as_slice(), &device);
    moments.get_mut(&1000).unwrap().m = bad(f32::NAN);
    write(&path, &params, &moments).unwrap();
    let e = refused(&params);
    assert!(e.contains("layers.0.weight") && e.contains("NaN"), "{e}");
    let (_, mut moments) = state(3, 4);
    moments.get_mut(&1002).unwrap().v = bad(-1.0);
    write(&path, &params, &moments).unwrap();
    let e = refused(&params);
    assert!(e.contains("layers.2.weight") && e.contains("-1"), "{e}");

    // A step count past the checkpoint's own step.
    let e = read(&path, &params, 2, |_| Some(Device::flex()))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layers.0.weight") && e.contains("step count"),
        "{e}"
    );

    // Half a state: a first moment without its second or its step count.
    let t = burn_pack::Tensor::new(
        "1000.momentum.moment_1".into(),
        burn_pack::DType::F32,
        vec![4, 256],
        Some(1000),
        burn_pack::Bytes::from_bytes_vec(vec![0u8; 4 * 4 * 256]),
    );
    burn_pack::Writer::new(vec![t])
        .overwrite(true)
        .write_to_file(&path)
        .unwrap();
    let e = refused(&params);
    assert!(
        e.contains("layers.0.weight") && e.contains("part of a state"),
        "{e}"
    );

    // A file cut short.
    let (_, moments) = state(3, 4);
    write(&path, &params, &moments).unwrap();
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let e = refused(&params);
    assert!(e.contains("is not an optimizer state k3mini wrote"), "{e}");

    // Not a burn-pack file at all.
    std::fs::write(&path, b"not an optimizer").unwrap();
    let e = refused(&params);
    assert!(
        e.contains("optimizer.bpk") && e.contains("is not an optimizer state k3mini wrote"),
        "{e}"
    );
}
