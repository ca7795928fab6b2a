//! Cross-tokenizer alignment: chunks against a brute-force reference, real tokenizer pairs (digits
//! split differently, characters split inside a token, byte-fallback tokens), the projection's
//! mass, aligned shards read back and refused when damaged.
use k3mini_data::Tokenizer;
use k3mini_data::align::{Aligner, Chunk, ChunkSignals, UNMAPPED, merge_projected, shared_chunks};
use k3mini_data::aligned::{AlignedMeta, AlignedRow, read_aligned_shard, write_aligned_shard};
use k3mini_data::shards::ShardMeta;
use std::collections::BTreeSet;

/// The reference: the offsets both tokenizations end a token at, and between each consecutive
/// pair the tokens of either side that lie there (every token is non-empty).
fn brute_force(student: &[usize], teacher: &[usize]) -> Vec<Chunk> {
    let ends = |lens: &[usize]| -> Vec<usize> {
        lens.iter()
            .scan(0, |a, l| {
                *a += l;
                Some(*a)
            })
            .collect()
    };
    let (se, te) = (ends(student), ends(teacher));
    let shared: BTreeSet<usize> = se.iter().copied().filter(|o| te.contains(o)).collect();
    let mut chunks = Vec::new();
    let (mut from, mut from_s, mut from_t) = (0, 0, 0);
    for o in shared {
        let to_s = se.iter().position(|&e| e == o).unwrap() + 1;
        let to_t = te.iter().position(|&e| e == o).unwrap() + 1;
        assert!(o > from);
        chunks.push(Chunk {
            student: from_s..to_s,
            teacher: from_t..to_t,
        });
        (from, from_s, from_t) = (o, to_s, to_t);
    }
    chunks
}

/// A random cut of `n` bytes into tokens of 1 to `max` bytes (SplitMix64 from `seed`).
fn cut(n: usize, max: usize, seed: &mut u64) -> Vec<usize> {
    let mut lens = Vec::new();
    let mut left = n;
    while left > 0 {
        let l = 1 + (k3mini_data::rng::uniform(seed) * max as f64) as usize;
        let l = l.min(left);
        lens.push(l);
        left -= l;
    }
    lens
}

#[test]
fn chunks_are_the_runs_between_shared_offsets() {
    // Hand-made: " 123" + "45" + "," against single digits.
    assert_eq!(
        shared_chunks(&[4, 2, 1], &[2, 1, 1, 1, 1, 1]).unwrap(),
        vec![
            Chunk {
                student: 0..1,
                teacher: 0..3
            },
            Chunk {
                student: 1..2,
                teacher: 3..5
            },
            Chunk {
                student: 2..3,
                teacher: 5..6
            },
        ]
    );
    // Nothing shared but the end: one chunk of everything.
    assert_eq!(
        shared_chunks(&[3, 3], &[2, 2, 2]).unwrap(),
        vec![Chunk {
            student: 0..2,
            teacher: 0..3
        }]
    );
    // Different totals are no alignment.
    assert_eq!(shared_chunks(&[3], &[2]), None);
    // A zero-length token joins the chunk after it (or the last one).
    assert_eq!(
        shared_chunks(&[2, 0, 2], &[2, 2]).unwrap(),
        vec![
            Chunk {
                student: 0..1,
                teacher: 0..1
            },
            Chunk {
                student: 1..3,
                teacher: 1..2
            },
        ]
    );
    // Random cuts of the same bytes agree with the brute force.
    let mut seed = 11;
    for _ in 0..500 {
        let n = 1 + (k3mini_data::rng::uniform(&mut seed) * 60.0) as usize;
        let (s, t) = (cut(n, 5, &mut seed), cut(n, 3, &mut seed));
        assert_eq!(
            shared_chunks(&s, &t).unwrap(),
            brute_force(&s, &t),
            "{s:?} {t:?}"
        );
    }
}

fn bpe4k() -> Tokenizer {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../recipes/corpus/shakespeare-bpe4k.json"
    );
    Tokenizer::load(path).unwrap()
}

/// Every chunk of `retok` spells the same bytes on both sides, and the chunks cover the text
/// tokens in order.
fn check_chunks(
    student: &Tokenizer,
    teacher: &Tokenizer,
    ids: &[u32],
    retok: &k3mini_data::align::Retokenized,
) {
    let bytes = |t: &Tokenizer, ids: &[u32]| -> Vec<u8> {
        let table = t.token_bytes().unwrap();
        ids.iter()
            .flat_map(|&i| table[i as usize].clone().unwrap_or_default())
            .collect()
    };
    let mut previous = 0;
    for c in &retok.chunks {
        assert!(c.student.start >= previous && !c.student.is_empty() && !c.teacher.is_empty());
        previous = c.student.end;
        assert_eq!(
            bytes(student, &ids[c.student.clone()]),
            bytes(teacher, &retok.teacher_ids[c.teacher.clone()]),
            "{c:?}"
        );
    }
}

#[test]
fn real_tokenizers_align_digits_characters_and_specials() {
    let (kimi, bpe) = (Tokenizer::load("kimi").unwrap(), bpe4k());
    let text = "In 2026, 12345 + 678 = 13023.\n\tdef f(x): return x ** 2  # café naïve 中文 😀";
    let ids = kimi.encode(text).unwrap();
    let aligner = Aligner::new(&kimi, &bpe).unwrap();
    let retok = aligner.retokenize(&ids).unwrap();
    assert_eq!(retok.teacher_ids, bpe.encode(text).unwrap());
    check_chunks(&kimi, &bpe, &ids, &retok);
    // One run of whole characters: exactly the brute force's chunks of the two tokenizations.
    let lens = |t: &Tokenizer, ids: &[u32]| -> Vec<usize> {
        let table = t.token_bytes().unwrap();
        ids.iter()
            .map(|&i| table[i as usize].as_ref().unwrap().len())
            .collect()
    };
    assert_eq!(
        retok.chunks,
        brute_force(&lens(&kimi, &ids), &lens(&bpe, &retok.teacher_ids))
    );
    // Kimi keeps "中" whole where the 4k BPE spells its bytes: a chunk of 1 against several.
    assert!(
        retok
            .chunks
            .iter()
            .any(|c| c.student.len() == 1 && c.teacher.len() >= 3)
    );
    // Kimi's digit runs of up to 3 against the BPE's: chunks join where they disagree.
    assert!(
        retok
            .chunks
            .iter()
            .any(|c| c.student.len() != c.teacher.len())
    );
    // A segment cut inside a character: the partial tokens at either end align nothing.
    let cut = &ids[..ids.len() - 1];
    let r = aligner.retokenize(cut).unwrap();
    check_chunks(&kimi, &bpe, cut, &r);
    // A special token (not text) splits the runs and is in no chunk (the BPE has no special of
    // its name, so the teacher's sequence has nothing in its place).
    let mut with_special = kimi.encode("Hello there.").unwrap();
    with_special.push(kimi.token_id("<|end_of_msg|>").unwrap());
    with_special.extend(kimi.encode(" And again.").unwrap());
    let r = aligner.retokenize(&with_special).unwrap();
    check_chunks(&kimi, &bpe, &with_special, &r);
    let special_at = with_special.len() - kimi.encode(" And again.").unwrap().len() - 1;
    assert!(r.chunks.iter().all(|c| !c.student.contains(&special_at)));
    // The BPE has no special of its name: the first chunk after it (which the teacher would
    // predict without the boundary) is left out, the rest of the run aligns.
    let after: Vec<_> = r
        .chunks
        .iter()
        .filter(|c| c.student.start > special_at)
        .collect();
    assert!(
        !after.is_empty() && after[0].student.start > special_at + 1,
        "{after:?}"
    );
    // The other way round, and a tokenizer with itself: one chunk per token.
    let back = Aligner::new(&bpe, &kimi).unwrap();
    let bpe_ids = bpe.encode(text).unwrap();
    check_chunks(&bpe, &kimi, &bpe_ids, &back.retokenize(&bpe_ids).unwrap());
    let same = Aligner::new(&kimi, &kimi)
        .unwrap()
        .retokenize(&ids)
        .unwrap();
    assert_eq!(same.teacher_ids, ids);
    assert!(
        same.chunks
            .iter()
            .all(|c| c.student == c.teacher && c.student.len() == 1)
    );
}

/// A SentencePiece-style BPE with byte fallback: letters are tokens, anything else its bytes.
fn byte_fallback(dir: &crate::Dir, lowercase: bool) -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(format!("<0x{b:02X}>"), (b as u32).into());
    }
    for (i, t) in ["a", "b", "c", "▁", "ab", "▁a"].iter().enumerate() {
        vocab.insert(t.to_string(), (256 + i as u32).into());
    }
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": if lowercase { "Lowercase" } else { "NFC" }},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "vocab": vocab, "merges": [["a", "b"], ["▁", "a"]],
                  "byte_fallback": true, "unk_token": null, "dropout": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "ignore_merges": false}
    });
    let path = dir.file(
        &format!("byte-fallback-{lowercase}.json"),
        json.to_string().as_bytes(),
    );
    Tokenizer::load(path.to_str().unwrap()).unwrap()
}

#[test]
fn byte_fallback_tokens_are_their_bytes() {
    let dir = crate::Dir::new("align-fallback");
    let (sp, kimi) = (byte_fallback(&dir, false), Tokenizer::load("kimi").unwrap());
    let text = "ab a é中";
    let sp_ids = sp.encode(text).unwrap();
    let table = sp.token_bytes().unwrap();
    let spelled: Vec<u8> = sp_ids
        .iter()
        .flat_map(|&i| table[i as usize].clone().unwrap())
        .collect();
    assert_eq!(spelled, text.as_bytes(), "{sp_ids:?}");
    // "é" and "中" are byte tokens: a character split inside, aligned with Kimi's whole ones.
    let kimi_ids = kimi.encode(text).unwrap();
    let r = Aligner::new(&kimi, &sp)
        .unwrap()
        .retokenize(&kimi_ids)
        .unwrap();
    check_chunks(&kimi, &sp, &kimi_ids, &r);
    assert!(
        r.chunks
            .iter()
            .any(|c| c.teacher.len() >= 3 && c.student.len() == 1)
    );
    // A tokenizer that normalises the text (here to lower case) is refused before any scoring.
    let lower = byte_fallback(&dir, true);
    let e = Aligner::new(&kimi, &lower).unwrap_err().to_string();
    assert!(e.contains("teacher's tokens of a probe text"), "{e}");
}

#[test]
fn projection_keeps_the_teachers_mass() {
    let (kimi, bpe) = (Tokenizer::load("kimi").unwrap(), bpe4k());
    let aligner = Aligner::new(&kimi, &bpe).unwrap();
    let kimi_bytes = kimi.token_bytes().unwrap();
    let bpe_bytes = bpe.token_bytes().unwrap();
    let kimi_set: std::collections::HashSet<&[u8]> =
        kimi_bytes.iter().filter_map(|b| b.as_deref()).collect();
    // Every BPE token maps to the longest Kimi token its bytes start with (all 256 bytes are
    // Kimi tokens, so every text token maps); the BPE's specials map to nothing.
    for (t, b) in bpe_bytes.iter().enumerate() {
        let s = aligner.project(t as u32);
        match b {
            // A special goes to the student's of the same name, or to the tail.
            None => assert!(s == UNMAPPED || kimi_bytes[s as usize].is_none()),
            Some(b) => {
                let sb = kimi_bytes[s as usize].as_ref().unwrap();
                assert!(b.starts_with(sb));
                assert!((sb.len() + 1..=b.len()).all(|n| !kimi_set.contains(&b[..n])));
            }
        }
    }
    // Duplicates merge, unmapped entries stay in the tail: the masses add up to 1.
    let ids = [7, 3, 7, UNMAPPED, 5];
    let logprobs = [-0.5f32, -1.5, -2.0, -2.5, -3.0];
    let merged = merge_projected(&ids, &logprobs);
    assert_eq!(
        merged.iter().map(|m| m.0).collect::<Vec<_>>(),
        vec![7, 3, 5]
    );
    let p = |l: f32| (l as f64).exp();
    let total: f64 = logprobs.iter().map(|&l| p(l)).sum();
    let mapped: f64 = merged.iter().map(|m| p(m.1)).sum();
    assert!((mapped + p(-2.5) - total).abs() < 1e-6);
    assert!((p(merged[0].1) - (p(-0.5) + p(-2.0))).abs() < 1e-6);
}

#[test]
fn aligned_shards_round_trip_and_refuse_damage() {
    let dir = crate::Dir::new("aligned");
    let (kimi, bpe) = (Tokenizer::load("kimi").unwrap(), bpe4k());
    let aligner = Aligner::new(&kimi, &bpe).unwrap();
    let ids = kimi
        .encode("Tomorrow, and tomorrow, and 12345 tomorrow.")
        .unwrap();
    let retok = aligner.retokenize(&ids).unwrap();
    let (k, n) = (3, retok.teacher_ids.len());
    // A made-up teacher scoring: every observed token at −1, a top-3 of its ids.
    let targets = vec![-1.0f32; n - 1];
    let top_ids: Vec<u32> = (0..n - 1)
        .flat_map(|j| [retok.teacher_ids[j + 1], 0, 1])
        .collect();
    let top_logprobs: Vec<f32> = (0..n - 1).flat_map(|_| [-1.0f32, -2.0, -3.0]).collect();
    let chunks = aligner.chunk_signals(&ids, &retok, &targets, &top_ids, &top_logprobs, k);
    assert_eq!(
        chunks.len(),
        retok.chunks.len() - 1,
        "the first chunk is not predicted"
    );
    for (c, r) in chunks.iter().zip(&retok.chunks[1..]) {
        assert_eq!(c.logprob, -(r.teacher.len() as f32));
        assert_eq!(
            (c.start as usize, c.end as usize),
            (r.student.start, r.student.end)
        );
        // The teacher's observed token goes to the student's observed token, even where the two
        // differ in length ("12345": Kimi's " 123" against the BPE's digits).
        assert_eq!(c.top_ids[0], ids[r.student.start]);
    }
    // Among them a chunk whose first student token is longer than the teacher's (Kimi's digit
    // runs against the BPE's): the case the observed mapping is for.
    let (kb, bb) = (kimi.token_bytes().unwrap(), bpe.token_bytes().unwrap());
    let len = |t: &[Option<Vec<u8>>], id: u32| t[id as usize].as_ref().map_or(0, Vec::len);
    assert!(retok.chunks[1..].iter().any(|r| {
        len(&kb, ids[r.student.start]) > len(&bb, retok.teacher_ids[r.teacher.start])
    }));
    let meta = AlignedMeta {
        signals: ShardMeta {
            teacher: "bpe".into(),
            tokenizer_sha256: kimi.fingerprint(),
            k,
            temperature: 1.0,
            vocab: Some(kimi.vocab_size()),
        },
        teacher_tokenizer_sha256: aligner.teacher_sha256().into(),
    };
    let row = AlignedRow {
        doc_id: 9,
        segment: 0,
        input_ids: ids.clone(),
        parts: None,
        chunks,
    };
    let path = dir.0.join("aligned.parquet");
    write_aligned_shard(&path, &meta, std::slice::from_ref(&row)).unwrap();
    let (m, rows) = read_aligned_shard(&path, None).unwrap();
    assert_eq!((m, rows), (meta.clone(), vec![row.clone()]));
    // Overlapping chunks, a chunk at the unpredicted first token, a positive logprob: refused.
    let mut bad = row.clone();
    bad.chunks[1].start = bad.chunks[0].start;
    let mut first = row.clone();
    first.chunks[0] = ChunkSignals {
        start: 0,
        ..first.chunks[0].clone()
    };
    let mut positive = row.clone();
    positive.chunks[0].logprob = 0.5;
    for (what, r) in [
        ("chunk_bounds", bad),
        ("chunk_bounds", first),
        ("chunk_logprobs", positive),
    ] {
        let e = write_aligned_shard(&path, &meta, &[r])
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{e}");
    }
    // A flipped byte is caught by the manifest's checksum.
    let sha = k3mini_data::digest::sha256_hex(&std::fs::read(&path).unwrap());
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let e = read_aligned_shard(&path, Some(&sha))
        .unwrap_err()
        .to_string();
    assert!(e.contains("checksum mismatch"), "{e}");
}
