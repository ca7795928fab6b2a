//! Teacher-signal shards: exact (v1) and compact (v2) round trips, metadata, and refusal of what
//! is not a shard.
use k3mini_data::chat::Part;
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, read_shard, write_shard};

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
            // The middle row is a conversation: what each id is round-trips too.
            let parts = (d == 1).then(|| {
                (0..n)
                    .map(|i| [Part::Markup, Part::Prompt, Part::Thinking, Part::Answer][i % 4])
                    .collect()
            });
            ShardRow {
                doc_id: d as u64 * 10,
                segment: d,
                input_ids: ids,
                parts,
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
    let written = write_shard(&path, &meta, Storage::Exact, &rows(8)).unwrap();
    assert!(written > 0 && !dir.join("shard-00000.parquet.tmp").exists());
    let back = read_shard(&path, None).unwrap();
    assert_eq!((back.meta, back.storage), (meta.clone(), Storage::Exact));
    assert_eq!(back.rows, rows(8));
    // A row whose lengths disagree with k is refused before anything is written.
    let mut bad = rows(8);
    bad[1].top_ids.pop();
    let e = write_shard(&dir.join("bad.parquet"), &meta, Storage::Exact, &bad)
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

const COMPACT: Storage = Storage::Quantised { step: 1.0 / 32.0 };

/// A compact shard's metadata: top-`k` of a SmolLM2-sized vocabulary.
fn compact_meta(k: usize) -> ShardMeta {
    ShardMeta {
        teacher: "t".into(),
        tokenizer_sha256: "ab".repeat(32),
        k,
        temperature: 1.0,
        vocab: Some(49152),
    }
}

#[test]
fn compact_shards_keep_ids_exactly_and_logprobs_within_a_step() {
    let dir = std::env::temp_dir().join(format!("k3mini-shards-v2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let k = 8;
    let meta = compact_meta(k);
    let mut exact = rows(k);
    // Make the next id the top-k's third entry at every even position (its target logprob is
    // then that entry's), and shuffle one top-k out of order (the writer sorts it).
    for r in &mut exact {
        for t in (0..r.positions()).step_by(2) {
            r.top_ids[t * k + 2] = r.input_ids[t + 1];
            r.target_logprobs[t] = r.top_logprobs[t * k + 2];
        }
    }
    exact[0].top_ids[..k].reverse();
    exact[0].top_logprobs[..k].reverse();
    for step in [1.0f32 / 8.0, 1.0 / 32.0, 1.0 / 1024.0] {
        let path = dir.join("shard-00000.parquet");
        let storage = Storage::Quantised { step };
        write_shard(&path, &meta, storage, &exact).unwrap();
        let back = read_shard(&path, None).unwrap();
        assert_eq!((&back.meta, back.storage), (&meta, storage));
        for (a, b) in exact.iter().zip(&back.rows) {
            assert_eq!(
                (a.doc_id, a.segment, &a.input_ids),
                (b.doc_id, b.segment, &b.input_ids)
            );
            for t in 0..a.positions() {
                let (ai, al) = (&a.top_ids[t * k..][..k], &a.top_logprobs[t * k..][..k]);
                let (bi, bl) = (&b.top_ids[t * k..][..k], &b.top_logprobs[t * k..][..k]);
                assert!(bl.windows(2).all(|w| w[0] >= w[1]), "sorted best first");
                for (id, lp) in ai.iter().zip(al) {
                    let j = bi.iter().position(|x| x == id).expect("every id kept");
                    assert!((bl[j] - lp).abs() <= step + 1e-5, "{} vs {lp}", bl[j]);
                }
                let mass = |l: &[f32]| l.iter().map(|&x| (x as f64).exp()).sum::<f64>();
                assert!(
                    (mass(al) - mass(bl)).abs() < 1e-6,
                    "the top-k mass is exact"
                );
                let target = b.target_logprobs[t];
                match bi.iter().position(|&x| x == a.input_ids[t + 1]) {
                    Some(j) => assert_eq!(target, bl[j]),
                    None => assert_eq!(target, a.target_logprobs[t]),
                }
            }
        }
    }
    // Exact shards are ~4× larger on real teachers (see the README); on these rows, larger.
    let v1 = write_shard(&dir.join("v1.parquet"), &meta, Storage::Exact, &exact).unwrap();
    let v2 = write_shard(&dir.join("v2.parquet"), &meta, COMPACT, &exact).unwrap();
    assert!(v2 < v1, "{v2} vs {v1}");
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
    // The file with `k3mini.KEY = value` metadata.
    let write = |pairs: &[(&str, &str)]| {
        let kv = pairs
            .iter()
            .map(|(k, v)| KeyValue::new(format!("k3mini.{k}"), v.to_string()))
            .collect();
        let props = parquet::file::properties::WriterProperties::builder()
            .set_key_value_metadata(Some(kv))
            .build();
        let file = std::fs::File::create(&path).unwrap();
        let mut w =
            parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    };
    let meta = [
        ("teacher", "t"),
        ("tokenizer_sha256", "s"),
        ("temperature", "1"),
    ];
    write(&[&meta[..], &[("schema_version", "1"), ("k", "8")]].concat());
    let e = read_shard(&path, None).unwrap_err().to_string();
    assert!(e.contains("column doc_id has type Utf8"), "{e}");
    // A schema version this k3mini does not know is named as such.
    write(&[
        ("kind", "teacher-signals"),
        ("schema_version", "3"),
        ("teacher", "t"),
    ]);
    let e = read_shard(&path, None).unwrap_err().to_string();
    assert!(
        e.contains("schema version 3; this k3mini reads version 1 and 2"),
        "{e}"
    );
    // A top-k of nothing is refused, not divided by.
    let zero = [
        ("kind", "teacher-signals"),
        ("schema_version", "2"),
        ("k", "0"),
    ];
    write(&[&meta[..], &zero[..]].concat());
    let e = read_shard(&path, None).unwrap_err().to_string();
    assert!(e.contains("k3mini.k is 0"), "{e}");
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
        let e = write_shard(&path, &meta, Storage::Exact, &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("document 10 segment 1") && e.contains(says),
            "{e}"
        );
    }
    let zero = ShardMeta {
        k: 0,
        ..meta.clone()
    };
    let e = write_shard(&path, &zero, COMPACT, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("k is 0"), "{e}");
    // Ids are checked against the teacher's vocabulary the shard records (-7 stored as int32
    // reads as a huge id, and is named as the unsigned number it is).
    let meta = ShardMeta {
        vocab: Some(49152),
        ..meta
    };
    write_shard(&path, &meta, COMPACT, &rows(8)).unwrap();
    assert_eq!(read_shard(&path, None).unwrap().meta.vocab, Some(49152));
    for (id, says) in [
        (2_000_000_000u32, "id 2000000000"),
        (-7i32 as u32, "id 4294967289"),
    ] {
        let mut bad = rows(8);
        bad[1].top_ids[2] = id;
        let e = write_shard(&path, &meta, COMPACT, &bad)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("column top_ids, entry 2")
                && e.contains(says)
                && e.contains("not below the teacher's vocabulary of 49152"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Rewrites a compact shard's file as damage would leave it: its `k3mini.vocab` set to `vocab`
/// (removed for `None`), and every top id but the next token's recoded as `to` (so the target
/// logprobs no longer match the ids). Its checksum is whatever the new bytes hash to.
fn damage(path: &std::path::Path, vocab: Option<&str>, to: Option<u32>, k: usize) {
    use arrow_array::cast::AsArray;
    use arrow_array::{ArrayRef, BinaryArray, RecordBatch};
    use base64::Engine;
    use k3mini_data::topk_codec::{IdTable, get_counted, get_varints, put_varint};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::file::metadata::KeyValue;
    use std::sync::Arc;
    let file = std::fs::File::open(path).unwrap();
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).unwrap();
    let mut kv: Vec<KeyValue> = builder
        .metadata()
        .file_metadata()
        .key_value_metadata()
        .unwrap()
        .clone();
    let table_b64 = kv.iter().find(|p| p.key == "k3mini.id_table").unwrap();
    let table = IdTable::from_ids(
        get_counted(
            &base64::engine::general_purpose::STANDARD
                .decode(table_b64.value.as_ref().unwrap())
                .unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    kv.retain(|p| p.key != "k3mini.vocab");
    if let Some(v) = vocab {
        kv.push(KeyValue::new("k3mini.vocab".into(), v.to_string()));
    }
    let schema = builder.schema().clone();
    let batches: Vec<RecordBatch> = builder.build().unwrap().map(Result::unwrap).collect();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_key_value_metadata(Some(kv))
        .build();
    let tmp = path.with_extension("damaged");
    let mut w = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&tmp).unwrap(),
        schema.clone(),
        Some(props),
    )
    .unwrap();
    for b in batches {
        let ids = b.column_by_name("input_ids").unwrap().as_list::<i32>();
        let codes = b.column_by_name("top_ids").unwrap().as_binary::<i32>();
        let recoded: Vec<Vec<u8>> = (0..b.num_rows())
            .map(|i| {
                let input = ids.value(i);
                let input = input.as_primitive::<arrow_array::types::Int32Type>();
                let p = input.len() - 1;
                let mut out = Vec::new();
                for (j, code) in get_varints(codes.value(i), p * k)
                    .unwrap()
                    .into_iter()
                    .enumerate()
                {
                    let target = input.value(j / k + 1) as u32;
                    let code = match to {
                        Some(to) if table.id(code) != target => table.code(to).unwrap(),
                        _ => code,
                    };
                    put_varint(&mut out, code);
                }
                out
            })
            .collect();
        let column: ArrayRef = Arc::new(BinaryArray::from_iter_values(recoded.iter()));
        let columns: Vec<ArrayRef> = b
            .schema()
            .fields()
            .iter()
            .zip(b.columns())
            .map(|(f, c)| {
                if f.name() == "top_ids" {
                    column.clone()
                } else {
                    c.clone()
                }
            })
            .collect();
        w.write(&RecordBatch::try_new(schema.clone(), columns).unwrap())
            .unwrap();
    }
    w.close().unwrap();
    std::fs::rename(tmp, path).unwrap();
}

#[test]
fn a_compact_shard_with_no_vocabulary_an_impossible_one_or_damaged_ids_is_refused() {
    let dir = std::env::temp_dir().join(format!("k3mini-shard-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let k = 8;
    let meta = compact_meta(k);
    let path = dir.join("shard-00000.parquet");
    // The compact schema always records the vocabulary.
    let e = write_shard(
        &path,
        &ShardMeta {
            vocab: None,
            ..meta.clone()
        },
        COMPACT,
        &rows(k),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("must record the teacher's vocabulary"), "{e}");
    let cases: [(Option<&str>, Option<u32>, &str); 5] = [
        (None, None, "has no k3mini.vocab"),
        (None, Some(2_000_000_000), "has no k3mini.vocab"),
        (
            Some("4000000000"),
            Some(2_000_000_000),
            "k3mini.vocab 4000000000 is no tokenizer's vocabulary",
        ),
        (
            Some("49152"),
            Some(2_000_000_000),
            "id 2000000000 is not below the teacher's vocabulary of 49152",
        ),
        // Within the vocabulary, the rewritten ids repeat within a position: damaged, and said so
        // (not "target_logprobs has too few values").
        (Some("49152"), Some(7), "appears twice in the top-8"),
    ];
    for (vocab, to, says) in cases {
        write_shard(&path, &meta, COMPACT, &rows(k)).unwrap();
        read_shard(&path, None).unwrap();
        damage(&path, vocab, to, k);
        let e = read_shard(&path, None).unwrap_err().to_string();
        assert!(
            e.contains(says) && e.contains("shard-00000.parquet"),
            "{vocab:?} {to:?}: {e}"
        );
    }
    // Untouched but for the rewrite: the shard reads back as written.
    write_shard(&path, &meta, COMPACT, &rows(k)).unwrap();
    damage(&path, Some("49152"), None, k);
    assert_eq!(read_shard(&path, None).unwrap().meta.vocab, Some(49152));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_long_row_cuts_into_segments_that_train_every_position_once_with_context() {
    let k = 3;
    let mut long = rows(k).pop().unwrap(); // 19 ids, 18 positions
    long.parts = Some(
        (0..19)
            .map(|i| [Part::Prompt, Part::Answer][i % 2])
            .collect(),
    );
    assert_eq!(long.input_ids.len(), 19);
    for len in [2, 3, 4, 6, 7, 18] {
        let windows = long.clone().windows(len, k);
        assert!(windows.len() > 1);
        let mut trained = Vec::new();
        for (s, (w, context)) in windows.iter().enumerate() {
            assert!(
                w.input_ids.len() <= len && w.input_ids.len() >= 2,
                "len {len}"
            );
            assert_eq!((w.segment, w.doc_id), (s as u32, long.doc_id));
            // Context: (len − 1) / 2 ids before the first trained position, after the first.
            assert_eq!(
                *context,
                if s == 0 { 0 } else { (len - 1) / 2 },
                "len {len}"
            );
            for t in *context..w.positions() {
                trained.push((
                    w.input_ids[t + 1],
                    w.target_logprobs[t],
                    w.top_logprobs[t * k..(t + 1) * k].to_vec(),
                    w.parts.as_ref().unwrap()[t + 1],
                ));
            }
        }
        // Every position of the row, once, in order, with its target, top-k and part.
        let want: Vec<_> = (0..long.positions())
            .map(|t| {
                (
                    long.input_ids[t + 1],
                    long.target_logprobs[t],
                    long.top_logprobs[t * k..(t + 1) * k].to_vec(),
                    long.parts.as_ref().unwrap()[t + 1],
                )
            })
            .collect();
        assert_eq!(trained, want, "len {len}");
    }
    assert_eq!(long.clone().windows(19, k), vec![(long, 0)]);
}
