//! Corpus readers: good sources, and bad ones that fail with the file (and line) named.
use crate::Dir;
use k3mini_data::{DataError, Role, SourceFormat, read_chats, read_source};
use std::path::{Path, PathBuf};

#[test]
fn text_files_and_directories() {
    let d = Dir::new("text");
    let a = d.file("b.txt", b"second document");
    d.file("a.txt", "first document, caf\u{e9}".as_bytes());
    d.file("notes.md", b"ignored: not .txt");
    let docs = read_source(&d.0, SourceFormat::infer(&d.0), "text").unwrap();
    assert_eq!(docs.len(), 2);
    assert_eq!(docs[0].text, "first document, café"); // sorted by name
    assert_eq!(
        read_source(&a, SourceFormat::Text, "text").unwrap()[0].text,
        "second document"
    );
}

#[test]
fn jsonl_documents_come_from_the_field() {
    let d = Dir::new("jsonl");
    let p = d.file(
        "c.jsonl",
        b"{\"text\": \"one\", \"id\": 1}\n\n{\"text\": \"two\"}\n",
    );
    assert_eq!(SourceFormat::infer(&p), SourceFormat::Jsonl);
    let docs = read_source(&p, SourceFormat::Jsonl, "text").unwrap();
    assert_eq!(
        docs.iter().map(|d| d.text.as_str()).collect::<Vec<_>>(),
        ["one", "two"]
    );
}

fn err(path: &Path, format: SourceFormat) -> String {
    read_source(path, format, "text").unwrap_err().to_string()
}

#[test]
fn bad_sources_are_named_with_the_place() {
    let d = Dir::new("bad");
    let latin1 = d.file("latin1.txt", b"caf\xe9 au lait");
    let e = read_source(&latin1, SourceFormat::Text, "text").unwrap_err();
    assert!(matches!(e, DataError::NotUtf8 { offset: 3, .. }), "{e}");
    assert!(err(&d.file("empty.txt", b"  \n"), SourceFormat::Text).contains("empty.txt: empty"));
    assert!(err(&d.0.join("missing.txt"), SourceFormat::Text).contains("missing.txt"));
    let bad_json = d.file("bad.jsonl", b"{\"text\": \"ok\"}\n{\"text\": oops}\n");
    assert!(err(&bad_json, SourceFormat::Jsonl).contains("bad.jsonl:2: invalid JSON"));
    let no_field = d.file("nofield.jsonl", b"{\"body\": \"x\"}\n");
    assert!(err(&no_field, SourceFormat::Jsonl).contains("nofield.jsonl:1: no `text` field"));
    let not_string = d.file("num.jsonl", b"{\"text\": 3}\n");
    assert!(err(&not_string, SourceFormat::Jsonl).contains("`text` is not a string"));
    let empty_dir = Dir::new("emptydir");
    assert!(err(&empty_dir.0, SourceFormat::Text).contains("no .txt files"));
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn parquet_written_by_pyarrow_reads_back_every_row() {
    // scripts/golden/corpus_fixtures.py: snappy with two row groups, and large_string with zstd.
    let snappy = fixture("sonnet_snappy.parquet");
    assert_eq!(SourceFormat::infer(&snappy), SourceFormat::Parquet);
    let a = read_source(&snappy, SourceFormat::Parquet, "text").unwrap();
    let b = read_source(
        &fixture("sonnet_large_zstd.parquet"),
        SourceFormat::Parquet,
        "content",
    )
    .unwrap();
    let texts = |d: &[k3mini_data::Document]| d.iter().map(|d| d.text.clone()).collect::<Vec<_>>();
    assert_eq!(texts(&a), texts(&b));
    assert_eq!(a.len(), 3);
    assert_eq!(a[0].text, "Shall I compare thee to a summer's day?");
    assert!(a[1].text.contains("café, naïve, 中文"));
    assert_eq!(a.iter().map(|d| d.index).collect::<Vec<_>>(), [0, 1, 2]);
}

#[test]
fn bad_parquet_is_named() {
    let snappy = fixture("sonnet_snappy.parquet");
    let e = read_source(&snappy, SourceFormat::Parquet, "body")
        .unwrap_err()
        .to_string();
    assert!(e.contains("no column `body` (columns: id, text)"), "{e}");
    let e = read_source(&snappy, SourceFormat::Parquet, "id")
        .unwrap_err()
        .to_string();
    assert!(e.contains("column `id` is Int64, not a string"), "{e}");
    let e = read_source(&fixture("with_null.parquet"), SourceFormat::Parquet, "text")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("with_null.parquet: row 1: `text` is null"),
        "{e}"
    );
    // Truncated: the footer is gone.
    let d = Dir::new("parquet");
    let bytes = std::fs::read(&snappy).unwrap();
    let cut = d.file("cut.parquet", &bytes[..bytes.len() / 2]);
    let e = read_source(&cut, SourceFormat::Parquet, "text")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cut.parquet: not a readable Parquet file"),
        "{e}"
    );
}

#[test]
fn chat_jsonl_reads_conversations_with_thinking() {
    let d = Dir::new("chat");
    let p = d.file(
        "chats.jsonl",
        br#"{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"}]}
{"messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
"#,
    );
    let chats = read_chats(&p, "messages").unwrap();
    assert_eq!(chats.len(), 2);
    assert_eq!(chats[0].messages[1].role, Role::Assistant);
    assert_eq!(chats[0].messages[1].thinking.as_deref(), Some("add"));
    let bad = d.file(
        "bad.jsonl",
        br#"{"messages": [{"role": "robot", "content": "x"}]}"#,
    );
    let e = read_chats(&bad, "messages").unwrap_err().to_string();
    assert!(
        e.contains("bad.jsonl:1: `messages` is not a list of messages"),
        "{e}"
    );
    let empty = d.file("none.jsonl", br#"{"messages": []}"#);
    assert!(
        read_chats(&empty, "messages")
            .unwrap_err()
            .to_string()
            .contains("holds no messages")
    );
}
