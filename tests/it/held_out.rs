//! Held-out figures against an independent computation: every document scored alone, the bytes
//! counted from its text. Rows carry padding (id 0, `<|endoftext|>`, 13 bytes if decoded), the
//! end-of-text token and each document's unscored first token, and the batches carry unequal
//! numbers of scored positions, so a per-batch mean or a count of every token would show.
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini::train::held_out::HeldOut;
use k3mini_data::signals::SignalBatch;
use k3mini_data::{DataError, DocFeed, Packer, TokenDoc, Tokenizer};
use k3mini_eval::metrics::bits_per_byte;
use k3mini_student::K3Mini;

const TEXTS: [&str; 4] = [
    "The king is dead, and the queen weeps.",
    "Then go we in, to know his embassy.",
    "To be, or not to be.",
    "Thou art the ruins of the noblest man.",
];
const T: usize = 16;

/// The documents in order, then nothing.
struct Docs(Vec<TokenDoc>, usize);

impl DocFeed for Docs {
    type Cursor = usize;
    fn cursor(&self) -> usize {
        self.1
    }
    fn next_doc(&mut self) -> Result<TokenDoc, DataError> {
        self.1 += 1;
        self.0.get(self.1 - 1).cloned().ok_or(DataError::Io {
            path: "docs".into(),
            message: "end".into(),
        })
    }
}

/// Each text's ids ending in `<|endoftext|>` (id 0), cut to at most `T` tokens.
fn documents(tok: &Tokenizer) -> Vec<Vec<u32>> {
    TEXTS
        .iter()
        .map(|text| {
            let mut ids = tok.encode(text).unwrap();
            ids.push(0);
            ids.truncate(T);
            ids
        })
        .collect()
}

/// −Σ ln q(ids[j+1] | ids[..=j]) over a document run alone through the model, in nats.
fn alone_nll(model: &K3Mini, ids: &[u32]) -> f64 {
    let device = Device::default();
    let n = ids.len();
    let tokens = Tensor::<2, Int>::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect(), [1, n]),
        &device,
    );
    let lp = log_softmax(model.forward(tokens), 2)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let v = lp.len() / n;
    (0..n - 1)
        .map(|j| -(lp[j * v + ids[j + 1] as usize] as f64))
        .sum()
}

/// The bytes a document's scored positions predict: its text after the first token, the
/// end-of-text token spelling nothing (the first tokens here are whole ASCII words).
fn predicted_bytes(tok: &Tokenizer, text: &str, ids: &[u32]) -> usize {
    let first = tok.decode(&ids[..1]).unwrap();
    assert!(text.starts_with(&first) && first.is_ascii(), "{first:?}");
    text.len() - first.len()
}

#[test]
fn held_out_loss_and_bits_per_byte_count_scored_positions_and_their_text() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tok = Tokenizer::load(
        root.join("recipes/corpus/shakespeare-bpe4k.json")
            .to_str()
            .unwrap(),
    )
    .unwrap();
    let docs = documents(&tok);
    assert!(
        docs.iter().all(|d| d.len() < T),
        "each document fits in a row whole"
    );
    let device = Device::default();
    device.seed(11);
    let mut config = k3mini_student::presets::tiny();
    config.vocab_size = 4096;
    let model = K3Mini::new(&config, &device).unwrap();

    // Batch 1: one row, packed (documents back to back, the row's tail the next document's
    // head). Batch 2: two rows without packing, each one document and padding.
    let feed = |d: &[Vec<u32>]| Docs(d.iter().cloned().map(TokenDoc::from).collect(), 0);
    // The packed row holds all of document 0 and a head of document 1: its scored positions are
    // document 0's and those of the head that predict a token inside it.
    let head = docs[1].len() - 3;
    let packed = Packer::new(feed(&docs[..2]), docs[0].len() + head, true, 0, 0)
        .unwrap()
        .next_batch(1)
        .unwrap();
    // (The feed holds one document more: a row without packing moves on to the next.)
    let padded = Packer::new(feed(&[&docs[2..], &docs[..1]].concat()), T, false, 0, 0)
        .unwrap()
        .next_batch(2)
        .unwrap();
    assert!(
        padded.tokens.iter().filter(|&&t| t == 0).count() > 2,
        "padding is there"
    );

    let nll = alone_nll(&model, &docs[0])
        + alone_nll(&model, &docs[1][..head])
        + alone_nll(&model, &docs[2])
        + alone_nll(&model, &docs[3]);
    let positions = docs[0].len() - 1 + head - 1 + docs[2].len() - 1 + docs[3].len() - 1;
    let head_text = tok.decode(&docs[1][..head]).unwrap();
    assert!(TEXTS[1].starts_with(&head_text));
    let bytes = predicted_bytes(&tok, TEXTS[0], &docs[0])
        + predicted_bytes(&tok, &head_text, &docs[1][..head])
        + predicted_bytes(&tok, TEXTS[2], &docs[2])
        + predicted_bytes(&tok, TEXTS[3], &docs[3]);

    let held = HeldOut::Documents {
        batches: vec![packed, padded],
    };
    let h = held.evaluate(&model).unwrap();
    assert_eq!(h.positions, positions);
    let mean = nll / positions as f64;
    assert!((h.loss - mean).abs() < 1e-4 * mean, "{} vs {mean}", h.loss);
    assert_eq!(held.predicted_bytes(&tok).unwrap(), bytes);
    let bpb = bits_per_byte(h.loss, h.positions, bytes);
    let want = nll / (bytes as f64 * std::f64::consts::LN_2);
    assert!((bpb - want).abs() < 1e-4 * want, "{bpb} vs {want}");

    // The same documents as teacher-signal rows (one document a row, padded, the positions whose
    // next token is the document's scored): the same loss, positions and bytes.
    let rows: Vec<&Vec<u32>> = vec![&docs[0], &docs[2], &docs[3]];
    let signal = |rows: &[&Vec<u32>]| {
        let (mut tokens, mut loss_mask) = (Vec::new(), Vec::new());
        for d in rows {
            for j in 0..T {
                tokens.push(d.get(j).map_or(0, |&i| i as i64));
                loss_mask.push(if j + 1 < d.len() { 1.0 } else { 0.0 });
            }
        }
        let n = rows.len() * T;
        SignalBatch {
            rows: rows.len(),
            seq_len: T,
            k: 1,
            top_ids: tokens[1..].iter().copied().chain([0]).collect(),
            top_logprobs: vec![0.0; n],
            tokens,
            loss_mask,
            routing: vec![None; rows.len()],
            teacher_mask: None,
            chunks: Vec::new(),
        }
    };
    let held = HeldOut::Signals {
        batches: vec![signal(&rows[..1]), signal(&rows[1..])],
        temperature: 1.0,
    };
    let h = held.evaluate(&model).unwrap();
    let nll: f64 = rows.iter().map(|d| alone_nll(&model, d)).sum();
    let positions: usize = rows.iter().map(|d| d.len() - 1).sum();
    let bytes = predicted_bytes(&tok, TEXTS[0], &docs[0])
        + predicted_bytes(&tok, TEXTS[2], &docs[2])
        + predicted_bytes(&tok, TEXTS[3], &docs[3]);
    assert_eq!(h.positions, positions);
    let mean = nll / positions as f64;
    assert!((h.loss - mean).abs() < 1e-4 * mean, "{} vs {mean}", h.loss);
    assert_eq!(held.predicted_bytes(&tok).unwrap(), bytes);
    // The teacher's top-1 is each target here: agreement is the student's argmax accuracy.
    assert!((0.0..=1.0).contains(&h.top1));
}
