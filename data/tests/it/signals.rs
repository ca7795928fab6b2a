//! Batches from teacher shards: a resumed stream continues exactly, held-out documents never train,
//! padding and out-of-vocabulary teacher ids are safe, a larger k is cut to the recipe's.
use k3mini_data::LossParts;
use k3mini_data::chat::{Part, ThinkingEnd};
use k3mini_data::digest::sha256_hex;
use k3mini_data::shards::{ShardMeta, ShardRow, Storage, write_shard};
use k3mini_data::signals::{
    OUT_OF_VOCAB_LOGPROB, ShardFile, SignalCursor, SignalRow, SignalSource, SignalSpec,
    SignalStream, assemble,
};
use k3mini_data::trajectories::TrajectoryRow;
use std::sync::Arc;

const K: usize = 3;

fn row(doc: u64, segment: u32, n: usize) -> ShardRow {
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| doc as u32 * 100 + segment * 10 + i)
        .collect();
    ShardRow {
        doc_id: doc,
        segment,
        target_logprobs: vec![-1.0; n - 1],
        top_ids: (0..(n - 1) * K)
            .map(|j| (j % 7) as u32 + if j % K == 2 { 900 } else { 0 })
            .collect(),
        top_logprobs: (0..(n - 1) * K).map(|j| -0.5 - (j % K) as f32).collect(),
        input_ids: ids,
        parts: None,
    }
}

/// Four shards of three rows, documents 0..6 (two segments each).
fn shards(dir: &std::path::Path) -> Vec<ShardFile> {
    std::fs::create_dir_all(dir).unwrap();
    let meta = ShardMeta {
        teacher: "t".into(),
        tokenizer_sha256: "ab".repeat(32),
        k: K,
        temperature: 1.0,
        vocab: None,
    };
    let all: Vec<ShardRow> = (0..6u64)
        .flat_map(|d| [row(d, 0, 8), row(d, 1, 5)])
        .collect();
    all.chunks(3)
        .enumerate()
        .map(|(i, rows)| {
            let path = dir.join(format!("shard-{i:05}.parquet"));
            write_shard(&path, &meta, Storage::Exact, rows).unwrap();
            ShardFile {
                sha256: sha256_hex(&std::fs::read(&path).unwrap()),
                path,
                first: i as u64 * 3,
                routing: None,
            }
        })
        .collect()
}

fn spec(vocab: usize) -> SignalSpec {
    SignalSpec {
        source: SignalSource::Scores {
            train_on: LossParts::default(),
        },
        seq_len: 8,
        k: K,
        vocab,
        tokens: vocab,
        tokenizer_sha256: "ab".repeat(32),
        routing: None,
    }
}

#[test]
fn a_resumed_stream_continues_exactly_and_never_trains_on_held_out_documents() {
    let dir = std::env::temp_dir().join(format!("k3mini-signals-{}", std::process::id()));
    let files = shards(&dir);
    let keep = Arc::new(|doc: u64| doc != 2 && doc != 5);
    let mut straight = SignalStream::new(
        files.clone(),
        spec(1000),
        keep.clone(),
        3,
        SignalCursor::default(),
    )
    .unwrap();
    // Four epochs' worth (8 training rows per epoch) in batches of 4.
    let batches: Vec<_> = (0..8).map(|_| straight.next_batch(4).unwrap()).collect();
    let mut seen = std::collections::HashMap::new();
    for b in &batches[..4] {
        for r in 0..4 {
            let first = b.tokens[r * 8];
            assert!(
                ![2, 5].contains(&(first / 100)),
                "held-out document trained"
            );
            *seen.entry(first).or_insert(0) += 1;
        }
    }
    assert_eq!(seen.len(), 8, "two epochs visit every training row");
    assert!(seen.values().all(|&c| c == 2));
    assert_ne!(batches[0], batches[2], "epochs are shuffled differently");
    // Stop after three batches; a new stream from the cursor yields the rest identically.
    let mut first = SignalStream::new(
        files.clone(),
        spec(1000),
        keep.clone(),
        3,
        SignalCursor::default(),
    )
    .unwrap();
    for b in &batches[..3] {
        assert_eq!(&first.next_batch(4).unwrap(), b);
    }
    let mut resumed =
        SignalStream::new(files.clone(), spec(1000), keep.clone(), 3, first.cursor()).unwrap();
    for b in &batches[3..] {
        assert_eq!(&resumed.next_batch(4).unwrap(), b);
    }
    // A stream whose documents are all held out is refused, naming the problem.
    let none = SignalStream::new(
        files.clone(),
        spec(1000),
        Arc::new(|_| false),
        3,
        SignalCursor::default(),
    );
    assert!(
        none.err()
            .unwrap()
            .to_string()
            .contains("no shard holds a training row")
    );
    // A shard made with another tokenizer is refused.
    let other = SignalSpec {
        tokenizer_sha256: "cd".repeat(32),
        ..spec(1000)
    };
    let e = SignalStream::new(
        files.clone(),
        other,
        keep.clone(),
        3,
        SignalCursor::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("another tokenizer"), "{e}");
    // A cursor past the shards (rescored with fewer since the checkpoint, or a damaged
    // state.json) is named, not an index out of bounds.
    let past = SignalCursor {
        epoch: 1,
        shard: files.len() + 2,
        row: 0,
    };
    let e = SignalStream::new(files[..1].to_vec(), spec(1000), keep.clone(), 3, past)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("cursor is at shard 6") && e.contains("there are 1 shards"),
        "{e}"
    );
    // A shard whose bytes are not the ones its manifest recorded (a zeroed checksum here) is
    // refused by name when it is opened.
    let mut wrong = files[..1].to_vec();
    wrong[0].sha256 = "0".repeat(64);
    let e = SignalStream::new(wrong, spec(1000), keep, 3, SignalCursor::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("shard-00000.parquet") && e.contains("checksum mismatch"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn padding_and_out_of_vocabulary_ids_are_masked_or_sent_to_the_tail() {
    let r = SignalRow::from_scores(row(1, 1, 5), K, K, &LossParts::default()); // 4 positions, padded to 8
    let b = assemble(&[&r], 8, K, 500);
    assert_eq!(b.loss_mask, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(&b.tokens[..5], &[110, 111, 112, 113, 114]);
    // Rank 2 holds ids ≥ 900: outside a 500-token vocabulary they become id 0 with no mass.
    assert_eq!(b.top_ids[2], 0);
    assert_eq!(b.top_logprobs[2], OUT_OF_VOCAB_LOGPROB);
    assert_eq!(b.top_logprobs[0], -0.5);
    // Padding positions: a uniform top-k, finite.
    let pad = &b.top_logprobs[5 * K..6 * K];
    assert!(pad.iter().all(|&l| (l + (K as f32).ln()).abs() < 1e-6));
}

#[test]
fn a_teacher_vocabulary_beyond_the_tokenizers_padding_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("k3mini-signals-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("shard-00000.parquet");
    // A 1,000-id tokenizer: a teacher padded to 2,048 rows (1,031 rounded up) is explained, one
    // of 2,049 or 4,000,000 is not.
    for (vocab, refused) in [
        (1000, false),
        (2048, false),
        (2049, true),
        (4_000_000, true),
    ] {
        let meta = ShardMeta {
            teacher: "t".into(),
            tokenizer_sha256: "ab".repeat(32),
            k: K,
            temperature: 1.0,
            vocab: Some(vocab),
        };
        let q = Storage::Quantised { step: 1.0 / 32.0 };
        write_shard(&path, &meta, q, &[row(1, 0, 8)]).unwrap();
        let file = ShardFile {
            sha256: sha256_hex(&std::fs::read(&path).unwrap()),
            path: path.clone(),
            first: 0,
            routing: None,
        };
        let spec = SignalSpec {
            tokens: 1000,
            ..spec(1000)
        };
        match spec.read(&file, &|_| true) {
            Ok(rows) => assert!(!refused && rows.len() == 1, "{vocab}"),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    refused && e.contains(&format!("teacher vocabulary of {vocab} ids")),
                    "{vocab}: {e}"
                );
                assert!(e.contains("tokenizer's 1000 padded to 2048"), "{e}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn trajectories_train_on_completion_parts_only() {
    // Prompt [1, 2, 3]; completion [10, 11, 99 (= </think>), 12, 13] with top-4 signals.
    let traj = TrajectoryRow {
        prompt_id: "p".into(),
        prompt_ids: vec![1, 2, 3],
        completion_ids: vec![10, 11, 99, 12, 13],
        logprobs: vec![-0.1; 5],
        top_ids: (0..20).map(|j| 200 + j).collect(),
        top_logprobs: (0..20).map(|j| -(j as f32) * 0.1).collect(),
        thinking: Some("…".into()),
        answer: "…".into(),
        finish_reason: "length".into(),
        reference: None,
        tool_calls: Vec::new(),
    };
    let answer_only = LossParts {
        prompt: false,
        thinking: false,
        answer: true,
    };
    let think = ThinkingEnd {
        ids: vec![99],
        unclosed: Part::Answer,
    };
    let r =
        SignalRow::from_trajectory(traj.clone(), 7, 4, 2, 16, Some(&think), &answer_only).unwrap();
    assert_eq!(r.ids, [1, 2, 3, 10, 11, 99, 12, 13]);
    // Position t predicts id t + 1: positions 0, 1 predict prompt ids; 2..=4 the thinking
    // (10, 11, </think>); 5, 6 the answer.
    assert_eq!(r.targets, [false, false, false, false, false, true, true]);
    // The completion's top-k, cut from 4 to 2, sit at the positions that predict it.
    assert_eq!(&r.top_ids[2 * 2..3 * 2], &[200, 201]);
    assert_eq!(&r.top_ids[6 * 2..7 * 2], &[216, 217]);
    let all = SignalRow::from_trajectory(
        traj.clone(),
        7,
        4,
        4,
        6,
        Some(&think),
        &LossParts::default(),
    )
    .unwrap();
    assert_eq!(all.ids.len(), 6, "cut to seq_len");
    assert_eq!(all.targets, [false, false, true, true, true]);
    // Without the tag as one id, the whole completion is answer.
    let plain = SignalRow::from_trajectory(traj.clone(), 7, 4, 4, 16, None, &answer_only).unwrap();
    assert_eq!(plain.targets.iter().filter(|&&t| t).count(), 5);
    assert!(SignalRow::from_trajectory(traj.clone(), 7, 4, 4, 3, None, &answer_only).is_none());
    // K3's close is several ids (`<|close|>think<|sep|>`), and its prompt opened the section:
    // through the ids is thinking; a completion cut short before them is all thinking.
    let k3 = ThinkingEnd {
        ids: vec![11, 99],
        unclosed: Part::Thinking,
    };
    let r = SignalRow::from_trajectory(traj.clone(), 7, 4, 4, 16, Some(&k3), &answer_only).unwrap();
    assert_eq!(r.targets, [false, false, false, false, false, true, true]);
    let k3_later = ThinkingEnd {
        ids: vec![12, 11],
        unclosed: Part::Thinking,
    };
    let r = SignalRow::from_trajectory(traj, 7, 4, 4, 16, Some(&k3_later), &answer_only).unwrap();
    assert!(!r.targets.contains(&true), "all thinking: {:?}", r.targets);
}

#[test]
fn a_scored_conversation_trains_on_the_parts_train_on_names() {
    // Position t trains when token t + 1 is a part `train_on` names: here the prompt is
    // tokens 0..=2 and the answer 3..=4.
    let mut r = row(1, 1, 5);
    r.parts = Some(vec![
        Part::Markup,
        Part::Prompt,
        Part::Prompt,
        Part::Answer,
        Part::Answer,
    ]);
    let answers = SignalRow::from_scores(r.clone(), K, K, &LossParts::default());
    assert_eq!(answers.targets, [false, false, true, true]);
    let everything = LossParts {
        prompt: true,
        ..LossParts::default()
    };
    let all = SignalRow::from_scores(r, K, K, &everything);
    assert_eq!(all.targets, [true, true, true, true]);
    // Text trains everywhere whatever `train_on` says.
    let none = LossParts {
        prompt: false,
        thinking: false,
        answer: false,
    };
    let text = SignalRow::from_scores(row(1, 1, 5), K, K, &none);
    assert_eq!(text.targets, [true; 4]);
}
