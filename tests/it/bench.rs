//! `k3mini bench`'s orchestration: a measurement in a child process and back, what a failing or
//! garbled child is called, the benchmark tables' plans, and shard sizes from a directory.

use crate::fixture::Scratch;
use k3mini::bench::teacher::shard_dir;
use k3mini::bench::{Child, in_child};
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, write_shard};
use k3mini_student::bench::{ShapeStep, TrainStepBench, memory_steps, training_path_steps};
use k3mini_student::config::KdaKernel;
use std::path::Path;

#[test]
fn a_child_process_measures_a_step_and_reports_it_back() {
    let step = ShapeStep::new("tiny", 1, 16, 1);
    let r: TrainStepBench =
        in_child(Path::new(env!("CARGO_BIN_EXE_k3mini")), &Child::Step(step)).unwrap();
    assert_eq!(
        (r.name.as_str(), r.batch, r.seq_len, r.steps),
        ("tiny", 1, 16, 1)
    );
    assert_eq!(r.kernel, KdaKernel::Chunk);
    // The binary's allocator counts the heap, so the memory model has a measurement to meet.
    let kept = r.kept_bytes.expect("the k3mini binary counts heap bytes");
    assert!(kept > 0 && r.step_peak_bytes.unwrap() >= kept);
    let (estimate, bound) = r.estimate().unwrap();
    assert!(estimate > 0 && bound > estimate);
}

#[test]
fn a_failing_or_garbled_child_is_named() {
    let step = Child::Step(ShapeStep::new("tiny", 1, 16, 1));
    let failed = in_child::<TrainStepBench>(Path::new("/bin/false"), &step).unwrap_err();
    assert!(
        failed.to_string().contains("the benchmark child"),
        "{failed}"
    );
    // echo prints its arguments, which are no measurement.
    let garbled = in_child::<TrainStepBench>(Path::new("/bin/echo"), &step).unwrap_err();
    assert!(
        garbled
            .to_string()
            .contains("reading what the benchmark child"),
        "{garbled}"
    );
    let refused = k3mini::bench::answer(r#"{"Step":{"shape":"tiny"}}"#).unwrap_err();
    assert!(
        refused.to_string().contains("benchmark request"),
        "{refused}"
    );
    let short = Child::Step(ShapeStep::new("tiny", 1, 1, 1));
    let short = k3mini::bench::answer(&serde_json::to_string(&short).unwrap()).unwrap_err();
    assert!(short.to_string().contains("seq_len 1"), "{short}");
}

#[test]
fn the_tables_interleave_their_sides_and_cover_each_shape_both_ways() {
    let path = training_path_steps(3);
    assert_eq!(path.len(), 8);
    for pair in path.chunks(2) {
        assert_eq!(pair[0].kernel, KdaKernel::Chunk);
        assert_eq!(pair[1], pair[0].clone().reference());
    }
    assert_eq!(path[0], path[2], "A B A B");
    let memory = memory_steps(1);
    assert_eq!(memory.len(), 10);
    for pair in memory.chunks(2) {
        assert_eq!(
            (pair[0].checkpointing, pair[1].checkpointing),
            (false, true)
        );
        assert!(pair[0].spec().is_ok(), "{} resolves", pair[0].shape);
    }
}

/// Two positions of top-3 per row, the best first, over a vocabulary of 50.
fn row(doc: u64) -> ShardRow {
    ShardRow {
        doc_id: doc,
        segment: 0,
        input_ids: vec![1, 2, 3],
        parts: None,
        target_logprobs: vec![-0.7, -0.4],
        top_ids: vec![2, 7, 9, 3, 4, 40],
        top_logprobs: vec![-0.7, -1.5, -2.5, -0.4, -2.0, -3.0],
    }
}

#[test]
fn shard_sizes_come_from_exact_shards_that_record_their_vocabulary() {
    let s = Scratch::new("bench-shards");
    let meta = |vocab| ShardMeta {
        teacher: "t".into(),
        tokenizer_sha256: "0".repeat(64),
        k: 3,
        temperature: 1.0,
        vocab,
    };
    let dir = s.path("exact");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..2 {
        let path = dir.join(format!("shard-{i}.parquet"));
        write_shard(
            &path,
            &meta(Some(50)),
            Storage::Exact,
            &[row(i), row(i + 10)],
        )
        .unwrap();
    }
    let r = shard_dir(&dir, &[2, 3, 5], 1.0 / 64.0, Some(0)).unwrap();
    assert_eq!((r.files, r.rows, r.positions, r.vocab), (2, 4, 8, 50));
    assert_eq!(r.written_files, 1);
    assert_eq!(r.sizes.iter().map(|s| s.k).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(r.skipped, [5], "k 5 > 3 is skipped, and says so");

    let old = s.path("no-vocabulary");
    std::fs::create_dir_all(&old).unwrap();
    write_shard(
        &old.join("a.parquet"),
        &meta(None),
        Storage::Exact,
        &[row(0)],
    )
    .unwrap();
    let refused = shard_dir(&old, &[2], 1.0 / 64.0, None).unwrap_err();
    assert!(refused.to_string().contains("k3mini.vocab"), "{refused}");

    let compact = s.path("compact");
    std::fs::create_dir_all(&compact).unwrap();
    let step = Storage::Quantised { step: 1.0 / 64.0 };
    write_shard(&compact.join("a.parquet"), &meta(Some(50)), step, &[row(0)]).unwrap();
    let refused = shard_dir(&compact, &[2], 1.0 / 64.0, None).unwrap_err();
    assert!(refused.to_string().contains("already compact"), "{refused}");

    for ks in [&[4, 5][..], &[0, 2]] {
        let refused = shard_dir(&dir, ks, 1.0 / 64.0, None).unwrap_err();
        assert!(refused.to_string().contains("top 3"), "{refused}");
    }

    // Shards of another scoring (here another k) are not measured as one.
    write_shard(
        &dir.join("shard-9.parquet"),
        &ShardMeta {
            k: 2,
            ..meta(Some(50))
        },
        Storage::Exact,
        &[ShardRow {
            top_ids: vec![2, 7, 3, 4],
            top_logprobs: vec![-0.7, -1.5, -0.4, -2.0],
            ..row(5)
        }],
    )
    .unwrap();
    let refused = shard_dir(&dir, &[2], 1.0 / 64.0, None).unwrap_err();
    assert!(
        refused.to_string().contains("scored otherwise"),
        "{refused}"
    );

    let none = s.path("none");
    std::fs::create_dir_all(&none).unwrap();
    let empty = shard_dir(&none, &[2], 1.0 / 64.0, None).unwrap_err();
    assert!(empty.to_string().contains("no .parquet shards"), "{empty}");
}

#[test]
fn published_formats_pack_ids_at_the_vocabulary() {
    use k3mini_teacher::bench::{packed_id_bits, published_formats};
    assert_eq!(packed_id_bits(49_152), 16);
    assert_eq!(packed_id_bits(163_840), 18);
    assert_eq!(packed_id_bits(65_536), 16);
    assert_eq!(packed_id_bits(65_537), 17);
    // docs/results/teacher-throughput.md's row at SmolLM2's vocabulary.
    assert_eq!(published_formats(49_152)[0].bytes_per_token, 114.0);
}
