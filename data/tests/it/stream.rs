//! Streaming corpora: weighted mixtures, exact resume across blocks and files, a held-out split
//! that is disjoint and stable as sources grow, and bad files named mid-stream.
use crate::Dir;
use k3mini_data::stream::{
    BLOCK, DocStream, RawDoc, Split, StreamCursor, StreamSource, Tokenize, doc_key, is_held_out,
};
use k3mini_data::{DocFeed, PackCursor, Packer, SourceFormat, TokenDoc};
use std::path::Path;
use std::sync::Arc;

/// Bytes as ids, then 0 as the end of the document.
fn bytes() -> Tokenize {
    Arc::new(|_, raw, _| {
        let RawDoc::Text(t) = raw else {
            panic!("text sources only")
        };
        let mut ids: Vec<u32> = t.bytes().map(u32::from).collect();
        ids.push(0);
        Ok(Some(TokenDoc { ids, targets: None }))
    })
}

/// `n` documents `"{tag} {i} "` + `i % 7` words, one per line.
fn jsonl(path: &Path, tag: &str, n: usize) {
    let lines: String = (0..n)
        .map(|i| {
            let text = format!("{tag} {i} {}", "word ".repeat(i % 7));
            format!("{}\n", serde_json::json!({ "text": text }))
        })
        .collect();
    std::fs::write(path, lines).unwrap();
}

fn parquet(path: &Path, texts: &[String]) {
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    let batch = RecordBatch::try_from_iter([(
        "text",
        Arc::new(StringArray::from_iter_values(texts)) as ArrayRef,
    )])
    .unwrap();
    let file = std::fs::File::create(path).unwrap();
    let props = parquet::file::properties::WriterProperties::builder()
        .set_max_row_group_row_count(Some(50))
        .build();
    let mut w = parquet::arrow::ArrowWriter::try_new(file, batch.schema(), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn source(path: &Path, format: SourceFormat, weight: f64) -> StreamSource {
    StreamSource {
        path: path.to_path_buf(),
        format,
        field: "text".into(),
        chat: false,
        weight,
        held_out: false,
    }
}

fn text(doc: &TokenDoc) -> String {
    let bytes: Vec<u8> = doc
        .ids
        .iter()
        .take_while(|&&i| i != 0)
        .map(|&i| i as u8)
        .collect();
    String::from_utf8(bytes).unwrap()
}

fn open(sources: &[StreamSource], split: Split, cursor: StreamCursor) -> DocStream {
    DocStream::open(sources, bytes(), 7, split, 0.2, cursor).unwrap()
}

#[test]
fn a_mixture_follows_its_weights_token_for_token() {
    let d = Dir::new("stream-mix");
    jsonl(&d.0.join("a.jsonl"), "a", 300);
    jsonl(&d.0.join("b.jsonl"), "b", 40); // small: wraps into new epochs
    let sources = [
        source(&d.0.join("a.jsonl"), SourceFormat::Jsonl, 3.0),
        source(&d.0.join("b.jsonl"), SourceFormat::Jsonl, 1.0),
    ];
    let mut s = open(&sources, Split::Train, StreamCursor::default());
    let mut emitted = [0u64; 2];
    for _ in 0..3 * BLOCK {
        let doc = s.next_doc().unwrap();
        emitted[usize::from(text(&doc).starts_with('b'))] += doc.trained_tokens() as u64;
    }
    // Every pulled block is emitted whole, so the counts match the stream's own.
    assert_eq!(emitted.as_slice(), s.tokens_by_source());
    let share = emitted[0] as f64 / (emitted[0] + emitted[1]) as f64;
    let longest = 60.0 / (emitted[0] + emitted[1]) as f64;
    assert!((share - 0.75).abs() <= longest, "share of a: {share}");
}

#[test]
fn packing_a_stream_resumes_exactly_across_blocks_files_and_epochs() {
    let d = Dir::new("stream-resume");
    let dir = d.0.join("pq");
    std::fs::create_dir_all(&dir).unwrap();
    for f in 0..3 {
        let texts: Vec<String> = (0..180)
            .map(|i| format!("file {f} row {i} {}", "x".repeat(i % 11)))
            .collect();
        parquet(&dir.join(format!("part-{f}.parquet")), &texts);
    }
    jsonl(&d.0.join("b.jsonl"), "b", 90);
    let sources = [
        source(&dir, SourceFormat::Parquet, 2.0),
        source(&d.0.join("b.jsonl"), SourceFormat::Jsonl, 1.0),
    ];
    let packer = |cursor: PackCursor<StreamCursor>| {
        Packer::new(
            open(&sources, Split::Train, cursor.feed),
            64,
            true,
            0,
            cursor.offset,
        )
        .unwrap()
    };
    let mut straight = packer(PackCursor::default());
    let all: Vec<_> = (0..60).map(|_| straight.next_batch(4).unwrap()).collect();
    let mut first = packer(PackCursor::default());
    for (i, b) in all.iter().enumerate() {
        assert_eq!(&first.next_batch(4).unwrap(), b);
        if [7, 23, 41].contains(&i) {
            // A checkpoint here: the cursor through JSON, and a fresh stream from it.
            let c: PackCursor<StreamCursor> =
                serde_json::from_str(&serde_json::to_string(&first.cursor()).unwrap()).unwrap();
            first = packer(c);
        }
    }
    let end = straight.cursor().feed;
    assert!(end.block >= 3, "crossed blocks: {end:?}");
    assert!(
        end.sources[1].epoch >= 1,
        "the small source wrapped: {end:?}"
    );
}

#[test]
fn the_held_out_split_is_disjoint_and_stable_as_the_corpus_grows() {
    let d = Dir::new("stream-split");
    let dir = d.0.join("docs");
    std::fs::create_dir_all(&dir).unwrap();
    for f in 0..4 {
        jsonl(&dir.join(format!("{f}.jsonl")), &format!("f{f}"), 120);
    }
    let sources = [source(&dir, SourceFormat::Jsonl, 1.0)];
    let take = |split, n| -> Vec<String> {
        let mut s = open(&sources, split, StreamCursor::default());
        (0..n).map(|_| text(&s.next_doc().unwrap())).collect()
    };
    // Whole blocks, each more than an epoch of its split: every document of it is seen.
    let train: std::collections::BTreeSet<String> =
        take(Split::Train, 2 * BLOCK).into_iter().collect();
    let held: std::collections::BTreeSet<String> =
        take(Split::HeldOut, BLOCK).into_iter().collect();
    assert!(train.is_disjoint(&held));
    assert_eq!(
        train.len() + held.len(),
        480,
        "each document is on one side"
    );
    let fraction = held.len() as f64 / 480.0;
    assert!((fraction - 0.2).abs() < 0.06, "{fraction}");
    // A new file changes no existing document's side.
    jsonl(&dir.join("9.jsonl"), "f9", 120);
    let grown: std::collections::BTreeSet<String> =
        take(Split::HeldOut, BLOCK).into_iter().collect();
    assert!(held.is_subset(&grown));
    assert!(
        grown
            .iter()
            .all(|t| t.starts_with("f9") || held.contains(t))
    );
    assert_eq!(
        is_held_out(7, doc_key("2.jsonl", 5), 0.2),
        is_held_out(7, doc_key("2.jsonl", 5), 0.2)
    );
}

#[test]
fn a_source_held_out_whole_never_trains_and_is_evaluated_in_full() {
    let d = Dir::new("stream-held-source");
    jsonl(&d.0.join("train.jsonl"), "t", 200);
    jsonl(&d.0.join("eval.jsonl"), "e", 30);
    let mut eval = source(&d.0.join("eval.jsonl"), SourceFormat::Jsonl, 1.0);
    eval.held_out = true;
    let sources = [
        source(&d.0.join("train.jsonl"), SourceFormat::Jsonl, 1.0),
        eval,
    ];
    let take = |split, n| -> Vec<String> {
        let mut s = open(&sources, split, StreamCursor::default());
        (0..n).map(|_| text(&s.next_doc().unwrap())).collect()
    };
    // More than an epoch of each split: every document of it is seen.
    let train: std::collections::BTreeSet<String> = take(Split::Train, BLOCK).into_iter().collect();
    let held: std::collections::BTreeSet<String> =
        take(Split::HeldOut, BLOCK).into_iter().collect();
    assert!(train.iter().all(|t| t.starts_with('t')), "{train:?}");
    let from_eval = held.iter().filter(|t| t.starts_with('e')).count();
    assert_eq!(from_eval, 30, "the whole source is held out");
    // The other source keeps its hashed split beside it.
    let hashed = held.len() - from_eval;
    assert!(
        hashed > 0 && train.len() + hashed == 200,
        "{hashed} + {}",
        train.len()
    );
    // A corpus held out entirely has nothing to train on, and says so.
    let only = [sources[1].clone()];
    let e = DocStream::open(
        &only,
        bytes(),
        7,
        Split::Train,
        0.2,
        StreamCursor::default(),
    )
    .unwrap()
    .next_doc()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no training document") && e.contains("held out"),
        "{e}"
    );
}

#[test]
fn a_corrupt_file_halfway_through_a_stream_is_named() {
    let d = Dir::new("stream-corrupt");
    let dir = d.0.join("pq");
    std::fs::create_dir_all(&dir).unwrap();
    let texts: Vec<String> = (0..40).map(|i| format!("row {i}")).collect();
    parquet(&dir.join("a.parquet"), &texts);
    parquet(&dir.join("b.parquet"), &texts);
    let good = std::fs::read(dir.join("b.parquet")).unwrap();
    std::fs::write(dir.join("b.parquet"), &good[..good.len() / 2]).unwrap();
    let sources = [source(&dir, SourceFormat::Parquet, 1.0)];
    let mut s = open(&sources, Split::Train, StreamCursor::default());
    let e = (0..1000)
        .find_map(|_| s.next_doc().err())
        .expect("the damaged file is reached")
        .to_string();
    assert!(
        e.contains("b.parquet") && e.contains("not a readable Parquet file"),
        "{e}"
    );
}

#[test]
fn the_split_hash_is_pinned_where_recipes_rely_on_it() {
    // recipes/ci-tiny.toml (seed 1234, 0.12) and smoke-300m (seed 7, 0.15) hold one play of six
    // out; changing the hash would silently move those splits.
    let plays = [
        "hamlet.txt",
        "julius_caesar.txt",
        "macbeth.txt",
        "midsummer_nights_dream.txt",
        "romeo_and_juliet.txt",
        "tempest.txt",
    ];
    let held = |seed, fraction| -> Vec<&str> {
        plays
            .iter()
            .copied()
            .filter(|p| is_held_out(seed, doc_key(p, 0), fraction))
            .collect()
    };
    assert_eq!(held(1234, 0.12), ["macbeth.txt"]);
    assert_eq!(held(7, 0.15), ["hamlet.txt"]);
    assert_eq!(held(3, 0.05), ["romeo_and_juliet.txt"]);
}
