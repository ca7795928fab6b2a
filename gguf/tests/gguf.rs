//! The GGUF reader and ggml dequantisers against files and values made by gguf-py (the `gguf` PyPI
//! package, llama.cpp's own Python library): scripts/golden/gguf_quants.py.
use k3mini_gguf::quants::dequantize;
use k3mini_gguf::{GgmlType, GgufError, GgufFile, Value};
use std::path::{Path, PathBuf};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/golden")
        .join(name)
}

#[test]
fn dequantisation_matches_gguf_py_for_every_block_format() {
    let bytes = std::fs::read(golden("gguf_quants.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (name, ty) in [
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q5_0", GgmlType::Q5_0),
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_K", GgmlType::Q4K),
        ("Q6_K", GgmlType::Q6K),
    ] {
        let raw = st.tensor(&format!("{name}.bytes")).unwrap();
        let want: Vec<f32> = st
            .tensor(&format!("{name}.values"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = dequantize(ty, raw.data(), want.len()).unwrap();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0f32, f32::max);
        assert!(worst < 1e-6, "{name}: worst relative error {worst}");
    }
}

#[test]
fn dequantise_refuses_a_wrong_length() {
    let e = dequantize(GgmlType::Q4_0, &[0u8; 17], 32).unwrap_err();
    assert!(matches!(e, GgufError::Blocks { block: 32, .. }), "{e}");
    assert!(
        e.to_string()
            .contains("Q4_0 holds blocks of 32 values: 17 bytes do not hold 32 values"),
        "{e}"
    );
}

#[test]
fn reads_metadata_and_tensors_written_by_gguf_py() {
    let f = GgufFile::open(&golden("tiny.gguf")).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(
        f.get("general.architecture").and_then(Value::as_str),
        Some("llama")
    );
    assert_eq!(f.get("test.u32"), Some(&Value::U32(7)));
    assert_eq!(f.get("test.i32"), Some(&Value::I32(-3)));
    assert_eq!(f.get("test.f32"), Some(&Value::F32(0.5)));
    assert_eq!(f.get("test.bool"), Some(&Value::Bool(true)));
    assert_eq!(f.get("test.string").and_then(Value::as_str), Some("café"));
    assert_eq!(f.get("test.u64").and_then(Value::as_u64), Some(1 << 40));
    assert_eq!(f.get("test.f64").and_then(Value::as_f64), Some(2.25));
    let strings: Vec<&str> = f
        .require("test.strings", Value::as_array)
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(strings, ["<s>", "</s>", "hello"]);
    assert!(
        f.require("test.missing", Value::as_u64)
            .unwrap_err()
            .to_string()
            .contains("metadata test.missing is missing")
    );

    let (values, dims) = f.dequantize("f32").unwrap();
    assert_eq!(dims, [32, 2]);
    assert_eq!(values, (0..64).map(|i| i as f32).collect::<Vec<_>>());
    let (values, _) = f.dequantize("f16").unwrap();
    assert_eq!(values, (0..32).map(|i| i as f32 / 8.0).collect::<Vec<_>>());
    // Quantised tensors dequantise exactly as the loose blocks do.
    let bytes = std::fs::read(golden("gguf_quants.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for (tensor, key, ty) in [
        ("q8_0", "Q8_0", GgmlType::Q8_0),
        ("q4_k", "Q4_K", GgmlType::Q4K),
    ] {
        let info = f.tensor(tensor).unwrap();
        assert_eq!((info.ty, info.dims.as_slice()), (ty, &[256u64, 4][..]));
        let raw = st.tensor(&format!("{key}.bytes")).unwrap();
        assert_eq!(f.raw(info).unwrap(), raw.data());
    }
}

#[test]
fn corrupt_files_are_named() {
    let dir = std::env::temp_dir().join(format!("k3mini-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(golden("tiny.gguf")).unwrap();
    let check = |name: &str, bytes: &[u8], want: &str| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = GgufFile::open(&p).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains(want), "{e}");
    };
    check("cut.gguf", &good[..good.len() - 100], "truncated");
    check("header.gguf", &good[..40], "truncated header");
    // A big model's file cut to 100 bytes: its 272 tensors cannot fit, which is a truncation.
    let mut short = b"GGUF\x03\x00\x00\x00".to_vec();
    short.extend(272u64.to_le_bytes());
    short.resize(100, 0);
    check(
        "short.gguf",
        &short,
        "tensor count 272 is more than a file of 100 bytes can hold: the file is truncated",
    );
    let as_dir = dir.join("dir.gguf");
    std::fs::create_dir_all(&as_dir).unwrap();
    let e = GgufFile::open(&as_dir).unwrap_err().to_string();
    assert!(e.contains("dir.gguf: is a directory"), "{e}");
    check("magic.gguf", b"GGML\x03\x00\x00\x00", "bad magic");
    let mut v9 = good.clone();
    v9[4] = 9;
    check("version.gguf", &v9, "version 9");
    std::fs::remove_dir_all(&dir).ok();
}

fn floats(st: &safetensors::SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `quantize` reproduces every `<name>.bytes` of a golden file from its `<name>.source`.
fn assert_byte_identical(file: &str, cases: &[(&str, GgmlType)]) {
    use k3mini_gguf::quantize::quantize;
    let bytes = std::fs::read(golden(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for &(name, ty) in cases {
        let source = floats(&st, &format!("{name}.source"));
        let want = st.tensor(&format!("{name}.bytes")).unwrap().data().to_vec();
        let got = quantize(ty, &source).unwrap();
        assert_eq!(got.len(), want.len(), "{file} {name}");
        let diff = got.iter().zip(&want).position(|(a, b)| a != b);
        assert_eq!(
            diff,
            None,
            "{file} {name}: first differing byte (block {})",
            diff.unwrap_or(0) / ty.block_bytes()
        );
    }
}

#[test]
fn quantisers_are_byte_identical_to_gguf_py() {
    assert_byte_identical(
        "gguf_quants.safetensors",
        &[
            ("Q4_0", GgmlType::Q4_0),
            ("Q4_1", GgmlType::Q4_1),
            ("Q5_0", GgmlType::Q5_0),
            ("Q8_0", GgmlType::Q8_0),
        ],
    );
    let e = k3mini_gguf::quantize::quantize(GgmlType::Q4K, &[0.0; 100]).unwrap_err();
    assert!(matches!(e, GgufError::Blocks { block: 256, .. }), "{e}");
}

#[test]
fn every_quantiser_round_trips_within_its_format_error() {
    use k3mini_gguf::quantize::quantize;
    // A deterministic spread of magnitudes, an all-zero block and an outlier.
    let mut x: Vec<f32> = (0..1024)
        .map(|i| ((i as f32 * 0.37).sin() * (1.0 + (i % 7) as f32)) * 0.05)
        .collect();
    x[256..512].fill(0.0);
    x[700] = 3.0;
    // Worst |error| relative to the block's largest |x| that each format may make.
    for (ty, bound) in [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 1e-3),
        (GgmlType::BF16, 8e-3),
        (GgmlType::Q8_0, 1e-2),
        (GgmlType::Q6K, 4e-2),
        (GgmlType::Q5_0, 7e-2),
        (GgmlType::Q4_0, 0.15),
        (GgmlType::Q4_1, 0.15),
        (GgmlType::Q4K, 0.15),
        // Values in (6, 8)·2^k saturate at 6·2^k: a quarter of the block's amax.
        (GgmlType::MXFP4, 0.25),
    ] {
        let q = quantize(ty, &x).unwrap();
        assert_eq!(q.len() as u64, ty.row_bytes(x.len() as u64), "{ty:?}");
        let back = dequantize(ty, &q, x.len()).unwrap();
        for (block, got) in x.chunks(256).zip(back.chunks(256)) {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = block
                .iter()
                .zip(got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst <= bound * amax, "{ty:?}: {worst} > {bound} × {amax}");
        }
    }
}

#[test]
fn the_writer_reproduces_a_gguf_py_file_byte_for_byte() {
    use k3mini_gguf::writer::GgufWriter;
    let original = golden("tiny.gguf");
    let f = GgufFile::open(&original).unwrap();
    let mut w = GgufWriter::new();
    for k in &f.keys {
        w.set(k, f.get(k).unwrap().clone());
    }
    for t in &f.tensors {
        w.add_tensor(&t.name, &t.dims, t.ty, f.raw(t).unwrap())
            .unwrap();
    }
    let out = std::env::temp_dir().join(format!("k3mini-rewrite-{}.gguf", std::process::id()));
    let size = w.write(&out).unwrap();
    let (a, b) = (
        std::fs::read(&original).unwrap(),
        std::fs::read(&out).unwrap(),
    );
    assert_eq!(size as usize, b.len());
    assert_eq!(a.len(), b.len());
    assert_eq!(a.iter().zip(&b).position(|(x, y)| x != y), None);
    // What the writer refuses: a wrong byte count, a long name, a duplicate, partial blocks.
    let mut w = GgufWriter::new();
    w.add_tensor(&f.tensors[0].name, &[1], GgmlType::F32, vec![0; 4])
        .unwrap();
    let e = w
        .add_tensor("x", &[32], GgmlType::Q8_0, vec![0; 33])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("tensor x: 33 bytes for 32 Q8_0 values (expected 34)"),
        "{e}"
    );
    assert!(
        w.add_tensor(&"n".repeat(64), &[1], GgmlType::F32, vec![0; 4])
            .is_err()
    );
    let first = f.tensors[0].name.clone();
    assert!(
        w.add_tensor(&first, &[1], GgmlType::F32, vec![0; 4])
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
    assert!(
        w.add_tensor("y", &[16, 2], GgmlType::Q8_0, vec![0; 34])
            .is_err()
    );
    std::fs::remove_file(&out).ok();
}

#[test]
fn quantisers_are_byte_identical_to_ggml_including_k_quants() {
    // scripts/golden/ggml_quants.py: ggml's quantize_row_*_ref from llama-cpp-python 0.3.36.
    assert_byte_identical(
        "ggml_quants.safetensors",
        &[
            ("q4_0", GgmlType::Q4_0),
            ("q4_1", GgmlType::Q4_1),
            ("q5_0", GgmlType::Q5_0),
            ("q8_0", GgmlType::Q8_0),
            ("q4_K", GgmlType::Q4K),
            ("q6_K", GgmlType::Q6K),
        ],
    );
}
