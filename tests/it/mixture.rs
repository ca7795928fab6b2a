//! Mixture weights are shares of trained tokens, with and without packing: sources of long and
//! short documents at 1:1 give as many loss-carrying positions each, though a row without packing
//! keeps only a long document's first `seq_len` tokens.
use crate::fixture::{Recipe, Scratch};
use k3mini::corpus::row_packer;
use k3mini_data::stream::Split;
use std::collections::HashSet;

#[test]
fn mixture_weights_are_shares_of_trained_tokens_in_either_packing_mode() {
    let dir = Scratch::new("mixture");
    let lines = |word: &str, words: usize, docs: usize| {
        let doc = serde_json::json!({ "text": word.repeat(words) }).to_string();
        vec![doc; docs].join("\n")
    };
    dir.write("long.jsonl", &lines(" alpha", 4095, 8));
    dir.write("short.jsonl", &lines(" beta", 255, 40));
    for packing in [false, true] {
        let recipe = Recipe::default()
            .with(
                "data",
                &format!(
                    "tokenizer = \"kimi\"\nseq_len = 512\npacking = {packing}\n\
                     held_out_fraction = 0\n\
                     [[data.sources]]\npath = \"long.jsonl\"\nformat = \"jsonl\"\nweight = 1\n\
                     [[data.sources]]\npath = \"short.jsonl\"\nformat = \"jsonl\"\nweight = 1"
                ),
            )
            .with("train", "steps = 1\nbatch_tokens = 2048\nmicro_batch = 4")
            .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
            .text();
        let plan = k3mini::recipe::load(&dir.write("r.toml", &recipe)).unwrap();
        let tok = k3mini::teachers::student_tokenizer(&plan.data.tokenizer).unwrap();
        let words = |w: &str| -> HashSet<i64> {
            tok.encode(w).unwrap().into_iter().map(i64::from).collect()
        };
        let (long, short) = (words(&" alpha".repeat(3)), words(&" beta".repeat(3)));
        assert!(long.is_disjoint(&short));
        let mut packer = row_packer(&plan.data, &tok, 1, Split::Train, Default::default()).unwrap();
        let mut trained = [0usize; 2];
        for _ in 0..1000 {
            let b = packer.next_batch(1).unwrap();
            for (t, m) in b.tokens.iter().zip(&b.loss_mask) {
                if *m > 0.0 {
                    trained[usize::from(short.contains(t))] +=
                        usize::from(long.contains(t) || short.contains(t));
                }
            }
        }
        let share = trained[0] as f64 / (trained[0] + trained[1]) as f64;
        assert!(
            (share - 0.5).abs() < 0.02,
            "packing = {packing}: the long source's share of trained tokens is {share:.3} \
             ({trained:?})"
        );
    }
}
