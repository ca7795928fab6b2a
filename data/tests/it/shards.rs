//! Teacher-signal shards: a lossless round trip, metadata, and refusal of what is not a shard.
use k3mini_data::shards::{ShardMeta, ShardRow, read_shard, write_shard};

fn rows(k: usize) -> Vec<ShardRow> {
    (0..3u32)
        .map(|d| {
            let n = 5 + d as usize * 7;
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + d) % 49152).collect();
            let mut top_ids = Vec::new();
            let mut top_lp = Vec::new();
            for t in 0..n - 1 {
                for r in 0..k {
                    top_ids.push(((t * 31 + r * 17) % 49152) as u32);
                    // A real distribution's top-k: descending, summing to under 1.
                    top_lp.push(-1.0 - r as f32 * 0.731 - t as f32 * 1e-3);
                }
            }
            ShardRow {
                doc_id: d as u64 * 10,
                segment: d,
                input_ids: ids,
                target_logprobs: (0..n - 1).map(|t| -(t as f32).sqrt()).collect(),
                top_ids,
                top_logprobs: top_lp,
            }
        })
        .collect()
}

#[test]
fn shards_round_trip_losslessly_with_metadata() {
    let dir = std::env::temp_dir().join(format!("k3mini-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let meta = ShardMeta {
        teacher: "SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        tokenizer_sha256: "ab".repeat(32),
        k: 8,
        temperature: 1.0,
        vocab: None,
    };
    let path = dir.join("shard-00000.parquet");
    let written = write_shard(&path, &meta, &rows(8)).unwrap();
    assert!(written > 0 && !dir.join("shard-00000.parquet.tmp").exists());
    let (m, back) = read_shard(&path, None).unwrap();
    assert_eq!(m, meta);
    assert_eq!(back, rows(8));
    // A row whose lengths disagree with k is refused before anything is written.
    let mut bad = rows(8);
    bad[1].top_ids.pop();
    let e = write_shard(&dir.join("bad.parquet"), &meta, &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("document 10 segment 1"), "{e}");
    assert!(!dir.join("bad.parquet").exists());
    // A Parquet file that is not a shard, and a truncated shard, are named.
    let corpus = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sonnet_snappy.parquet"
    );
    let e = read_shard(std::path::Path::new(corpus), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no k3mini.schema_version metadata"), "{e}");
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() - 40]).unwrap();
    let e = read_shard(&cut, None).unwrap_err().to_string();
    assert!(
        e.contains("cut.parquet") && e.contains("not a readable Parquet file"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_file_with_shard_metadata_but_other_columns_is_refused() {
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    use parquet::file::metadata::KeyValue;
    use std::sync::Arc;
    let path =
        std::env::temp_dir().join(format!("k3mini-fake-shard-{}.parquet", std::process::id()));
    let batch = RecordBatch::try_from_iter([(
        "doc_id",
        Arc::new(StringArray::from(vec!["x"])) as ArrayRef,
    )])
    .unwrap();
    let kv = [
        "schema_version",
        "teacher",
        "tokenizer_sha256",
        "k",
        "temperature",
    ]
    .iter()
    .zip(["1", "t", "s", "8", "1"])
    .map(|(k, v)| KeyValue::new(format!("k3mini.{k}"), v.to_string()))
    .collect();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .build();
    let file = std::fs::File::create(&path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let e = read_shard(&path, None).unwrap_err().to_string();
    assert!(e.contains("column doc_id has type Utf8"), "{e}");
    std::fs::remove_file(&path).ok();
}

#[test]
fn values_that_cannot_be_logprobs_are_refused_naming_row_and_column() {
    let dir = std::env::temp_dir().join(format!("k3mini-shard-values-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let meta = ShardMeta {
        teacher: "t".into(),
        tokenizer_sha256: "ab".repeat(32),
        k: 8,
        temperature: 1.0,
        vocab: None,
    };
    let path = dir.join("shard-00000.parquet");
    type Damage = fn(&mut ShardRow);
    let cases: [(Damage, &str); 4] = [
        (
            |r| r.top_logprobs[3] = 50.0,
            "column top_logprobs, entry 3: 50",
        ),
        (
            |r| r.target_logprobs[1] = f32::NAN,
            "column target_logprobs, entry 1: NaN",
        ),
        (
            |r| r.top_logprobs[8] = f32::NEG_INFINITY,
            "column top_logprobs, entry 8: -inf",
        ),
        (
            |r| r.top_logprobs[..8].fill(-0.01),
            "position 0: the top-8 probabilities sum to",
        ),
    ];
    for (damage, says) in cases {
        let mut bad = rows(8);
        damage(&mut bad[1]);
        let e = write_shard(&path, &meta, &bad).unwrap_err().to_string();
        assert!(
            e.contains("document 10 segment 1") && e.contains(says),
            "{e}"
        );
    }
    // Ids are checked against the teacher's vocabulary the shard records (-7 stored as int32
    // reads as a huge id, and is named as -7).
    let meta = ShardMeta {
        vocab: Some(49152),
        ..meta
    };
    write_shard(&path, &meta, &rows(8)).unwrap();
    let (back, _) = read_shard(&path, None).unwrap();
    assert_eq!(back.vocab, Some(49152));
    for (id, says) in [(2_000_000_000u32, "id 2000000000"), (-7i32 as u32, "id -7")] {
        let mut bad = rows(8);
        bad[1].top_ids[2] = id;
        let e = write_shard(&path, &meta, &bad).unwrap_err().to_string();
        assert!(
            e.contains("column top_ids, entry 2")
                && e.contains(says)
                && e.contains("not below the teacher's vocabulary of 49152"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
