//! Corpus readers: good sources, and bad ones that fail with the file (and line) named.
use k3mini_data::{DataError, SourceFormat, read_source};
use std::path::{Path, PathBuf};

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("k3mini-corpus-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

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
