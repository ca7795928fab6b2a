//! Packing: lossless, boundary-aware, deterministic and exactly resumable.
use k3mini_data::pack::{epoch_order, split_held_out};
use k3mini_data::{DataError, DocFeed, PackCursor, Packer, TokenDoc};
use std::sync::Arc;

/// The documents in order, round and round; its cursor is the next one's index.
struct Cycle {
    docs: Arc<Vec<TokenDoc>>,
    next: usize,
}

impl DocFeed for Cycle {
    type Cursor = usize;
    fn cursor(&self) -> usize {
        self.next
    }
    fn next_doc(&mut self) -> Result<TokenDoc, DataError> {
        let d = self.docs[self.next % self.docs.len()].clone();
        self.next += 1;
        Ok(d)
    }
}

fn packer(docs: Arc<Vec<TokenDoc>>, seq_len: usize, packing: bool, pad: u32) -> Packer<Cycle> {
    Packer::new(Cycle { docs, next: 0 }, seq_len, packing, pad, 0).unwrap()
}

/// Documents whose ids encode (document, position): doc d has ids d*1000 .. d*1000 + len.
fn docs(lens: &[usize]) -> Arc<Vec<TokenDoc>> {
    Arc::new(
        lens.iter()
            .enumerate()
            .map(|(d, &n)| {
                (0..n as u32)
                    .map(|i| d as u32 * 1000 + i)
                    .collect::<Vec<_>>()
                    .into()
            })
            .collect(),
    )
}

#[test]
fn per_token_targets_mask_the_positions_that_predict_them() {
    // One document whose tokens 0..3 are a prompt and 3..6 the answer: positions 2..5 predict
    // answer tokens and carry loss; nothing predicts across into the next copy of the document.
    let doc = TokenDoc {
        ids: (0..6).collect(),
        targets: Some(vec![false, false, false, true, true, true]),
    };
    let mut p = packer(Arc::new(vec![doc]), 12, true, 0);
    let b = p.next_batch(1).unwrap();
    assert_eq!(b.tokens, [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]);
    assert_eq!(
        b.loss_mask,
        [0., 0., 1., 1., 1., 0., 0., 0., 1., 1., 1., 0.]
    );
}

#[test]
fn every_token_is_emitted_once_in_feed_order() {
    let lens = [5, 17, 3, 40, 9, 1, 12];
    let total: usize = lens.iter().sum(); // 87
    let mut p = packer(docs(&lens), 8, true, 0);
    let mut seen = Vec::new();
    while seen.len() < total {
        seen.extend(p.next_batch(1).unwrap().tokens);
    }
    let expect: Vec<i64> = (0..lens.len())
        .flat_map(|d| (0..lens[d] as i64).map(move |i| d as i64 * 1000 + i))
        .collect();
    assert_eq!(&seen[..total], &expect[..]);
}

#[test]
fn starts_and_loss_mask_follow_document_boundaries() {
    let mut p = packer(docs(&[3, 4, 2]), 16, true, 0);
    let b = p.next_batch(1).unwrap();
    for t in 0..16 {
        let pos = b.tokens[t] % 1000;
        assert_eq!(b.starts[t], if pos == 0 { 1.0 } else { 0.0 }, "t={t}");
        let next_same_doc =
            t + 1 < 16 && b.tokens[t + 1] / 1000 == b.tokens[t] / 1000 && b.starts[t + 1] == 0.0;
        assert_eq!(
            b.loss_mask[t],
            if next_same_doc { 1.0 } else { 0.0 },
            "t={t}: {:?}",
            b.tokens
        );
    }
}

#[test]
fn resuming_from_a_cursor_reproduces_the_stream() {
    let d = docs(&[50, 7, 33, 2, 90, 14]);
    let mut straight = packer(d.clone(), 32, true, 0);
    let all: Vec<_> = (0..12).map(|_| straight.next_batch(3).unwrap()).collect();
    let mut first = packer(d.clone(), 32, true, 0);
    for b in &all[..5] {
        assert_eq!(&first.next_batch(3).unwrap(), b);
    }
    let cursor: PackCursor<usize> =
        serde_json::from_str(&serde_json::to_string(&first.cursor()).unwrap()).unwrap();
    assert!(cursor.offset > 0, "the cursor is inside a document");
    let feed = Cycle {
        docs: d,
        next: cursor.feed,
    };
    let mut resumed = Packer::new(feed, 32, true, 0, cursor.offset).unwrap();
    for b in &all[5..] {
        assert_eq!(&resumed.next_batch(3).unwrap(), b);
    }
    let past = Cycle {
        docs: docs(&[4]),
        next: 0,
    };
    let e = Packer::new(past, 32, true, 0, 9).err().unwrap().to_string();
    assert!(
        e.contains("offset 9 is past its document of 4 tokens"),
        "{e}"
    );
}

#[test]
fn seeds_change_the_order_and_epochs_reshuffle() {
    assert_ne!(epoch_order(50, 1, 0), epoch_order(50, 2, 0));
    assert_ne!(epoch_order(50, 1, 0), epoch_order(50, 1, 1));
    let mut sorted = epoch_order(50, 1, 3);
    sorted.sort();
    assert_eq!(sorted, (0..50).collect::<Vec<_>>());
}

#[test]
fn without_packing_each_row_is_one_padded_document() {
    let mut p = packer(docs(&[3, 20]), 8, false, 7);
    let b = p.next_batch(2).unwrap();
    for row in 0..2 {
        let r = &b.tokens[row * 8..(row + 1) * 8];
        assert_eq!(b.starts[row * 8], 1.0);
        let doc = r[0] / 1000;
        let len = if doc == 0 { 3 } else { 8 };
        assert!(r[..len].iter().all(|&x| x / 1000 == doc));
        assert!(r[len..].iter().all(|&x| x == 7), "padded: {r:?}");
        assert!(
            b.loss_mask[row * 8 + len - 1..(row + 1) * 8]
                .iter()
                .all(|&m| m == 0.0)
        );
    }
}

#[test]
fn held_out_split_is_disjoint_stable_and_never_empty() {
    let (train, held) = split_held_out(100, 0.1, 5);
    assert_eq!(train.len() + held.len(), 100);
    assert!(held.iter().all(|h| !train.contains(h)));
    assert_eq!(split_held_out(100, 0.1, 5), (train, held.clone()));
    assert!((3..=20).contains(&held.len()), "{}", held.len());
    assert_eq!(
        split_held_out(3, 0.01, 1).1.len(),
        1,
        "at least one held-out document"
    );
    assert!(split_held_out(10, 0.0, 1).1.is_empty());
}
