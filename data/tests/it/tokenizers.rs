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

#[test]
fn every_gguf_pre_tokenizer_name_k3mini_writes_it_reads() {
    use k3mini_data::tokenizer::{GGUF_PRE_TOKENIZERS, PreTokenizer};
    let tokens: Vec<String> = ["a", "b", "ab", "1", "2", "Ġ"].map(String::from).into();
    for (name, pre) in GGUF_PRE_TOKENIZERS {
        assert_eq!(pre.gguf_name(), name);
        assert_eq!(PreTokenizer::from_gguf_name(name), Some(pre));
        let t = Tokenizer::from_byte_level_bpe(name, &tokens, &["a b".into()], &[], pre).unwrap();
        assert_eq!(t.encode("ab").unwrap(), [2]);
        // SmolLM2 splits digits one by one; GPT-2 keeps a run of them together (no merge here).
        assert_eq!(t.encode("12").unwrap(), [3, 4]);
    }
    for other in ["gpt2", "default", "llama3", ""] {
        assert_eq!(PreTokenizer::from_gguf_name(other), None, "{other}");
    }
}

#[test]
fn special_ids_are_found_by_their_names_once() {
    // Kimi's vocabularies: K2 ends turns in <|im_end|>, K3 in <|end_of_msg|> (the same id); its
    // text documents end in nothing. A trained BPE ends text in id 0.
    for name in ["kimi_k2", "kimi_k3"] {
        let kimi = Tokenizer::load(name).unwrap().special_ids();
        assert_eq!(
            (kimi.eos, kimi.end_of_turn),
            (None, Some(163_586)),
            "{name}"
        );
    }
    let dir = scratch("specials");
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "Some text, and some more of it. ".repeat(20)).unwrap();
    train_byte_level_bpe(
        &[corpus.display().to_string()],
        300,
        &["<|im_end|>"],
        &dir.join("t.json"),
    )
    .unwrap();
    let bpe = Tokenizer::load(dir.join("t.json").to_str().unwrap()).unwrap();
    let ids = bpe.special_ids();
    assert_eq!(ids.eos, Some(0));
    assert_eq!(bpe.token_id(BPE_EOS), Some(0));
    assert_eq!(ids.stops(), [ids.end_of_turn.unwrap(), 0]);
    // `</s>` is an end of text too.
    let renamed = std::fs::read_to_string(dir.join("t.json"))
        .unwrap()
        .replace(BPE_EOS, "</s>");
    std::fs::write(dir.join("s.json"), renamed).unwrap();
    let s = Tokenizer::load(dir.join("s.json").to_str().unwrap()).unwrap();
    assert_eq!(s.special_ids().eos, Some(0));
}
