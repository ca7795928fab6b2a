//! Tokenizers: the Kimi vocabulary, a trained byte-level BPE, and bad tokenizer files.
use k3mini_data::tokenizer::{BPE_EOS, train_byte_level_bpe};
use k3mini_data::{DataError, Tokenizer};

fn scratch(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("k3mini-data-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn kimi_vocabulary_round_trips() {
    let t = Tokenizer::load("kimi").unwrap();
    assert_eq!(t.vocab_size(), 163_840);
    let text = "Kimi Delta Attention keeps a fixed-size state. 你好，世界！ x = 42;";
    let ids = t.encode(text).unwrap();
    assert!(
        ids.len() < text.len() / 2,
        "BPE compresses: {} ids",
        ids.len()
    );
    assert_eq!(t.decode(&ids).unwrap(), text);
    assert_eq!(
        Tokenizer::load("kimi_k2").unwrap().token_id("<|im_end|>"),
        Some(163_586)
    );
}

#[test]
fn trained_byte_level_bpe_round_trips_any_text() {
    let dir = scratch("bpe");
    let corpus = dir.join("corpus.txt");
    let line = "the quick brown fox jumps over the lazy dog; the dog sleeps while the fox runs.\n";
    std::fs::write(&corpus, line.repeat(200)).unwrap();
    let out = dir.join("tokenizer.json");
    train_byte_level_bpe(&[corpus.display().to_string()], 300, &[], &out).unwrap();
    let t = Tokenizer::load(out.to_str().unwrap()).unwrap();
    assert!(
        t.vocab_size() <= 300 && t.vocab_size() > 256,
        "{}",
        t.vocab_size()
    );
    assert_eq!(t.token_id(BPE_EOS), Some(0));
    // Byte-level: text the corpus never saw (accents, CJK, emoji) still round-trips.
    for text in [
        "the lazy dog",
        "naïve café — 東京 🚀",
        "  leading spaces\tand tabs\n",
    ] {
        let ids = t.encode(text).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), text);
    }
    assert!(
        t.encode("the quick brown fox").unwrap().len() < "the quick brown fox".len() / 2,
        "merges learned"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tokenizer_file_that_does_not_parse_is_named() {
    let dir = scratch("badtok");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, "{\"model\": 42}").unwrap();
    let err = Tokenizer::load(path.to_str().unwrap()).unwrap_err();
    assert!(matches!(err, DataError::Tokenizer { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("tokenizer.json") && msg.contains("does not parse"),
        "{msg}"
    );
    // JSON that is not a tokenizer, and a file that is not JSON, are told apart.
    std::fs::write(&path, "{\"a\": 1}").unwrap();
    let msg = Tokenizer::load(path.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("is JSON but not a tokenizer.json"), "{msg}");
    std::fs::write(&path, "not json").unwrap();
    let msg = Tokenizer::load(path.to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("is not JSON"), "{msg}");
    let missing = Tokenizer::load("/no/such/tokenizer.json")
        .unwrap_err()
        .to_string();
    assert!(missing.contains("/no/such/tokenizer.json"), "{missing}");
    std::fs::remove_dir_all(&dir).ok();
}
