//! A plan's corpus as token documents: read, rendered (chat), tokenized, and split into training
//! and held-out documents by a seeded draw. Training, teacher scoring, online distillation and
//! evaluation all take their documents from here, so they agree on ids, targets and the split.

use crate::bail;
use crate::error::Result;
use crate::recipe::DataPlan;
use k3mini_data::chat::{check_markers, render};
use k3mini_data::pack::split_held_out;
use k3mini_data::tokenizer::BPE_EOS;
use k3mini_data::{TokenDoc, Tokenizer, read_chats, read_source};
use std::sync::Arc;

/// The documents of a plan, tokenized. Text documents end in the end-of-text id when the
/// tokenizer has one and train on every token; chat documents are rendered with their template
/// and train on the parts `data.train_on` names.
pub fn tokenized_documents(data: &DataPlan, tokenizer: &Tokenizer) -> Result<Vec<TokenDoc>> {
    let eos = [BPE_EOS, "</s>", "<|end_of_text|>"]
        .iter()
        .find_map(|t| tokenizer.token_id(t));
    let mut docs = Vec::new();
    for source in &data.sources {
        let path = &source.path;
        if let Some(template) = source.chat {
            check_markers(template, tokenizer)
                .map_err(|e| crate::refused!("{}: {e}", path.display()))?;
            for chat in read_chats(path, &source.field)? {
                let rendered = render(&chat.messages, template, false)
                    .map_err(|e| crate::refused!("{}:{}: {e}", path.display(), chat.index + 1))?;
                let (ids, parts) = rendered.encode(tokenizer)?;
                let targets = parts.iter().map(|&p| data.train_on.trains(p)).collect();
                if ids.len() >= 2 {
                    docs.push(TokenDoc {
                        ids,
                        targets: Some(targets),
                    });
                }
            }
            continue;
        }
        for doc in read_source(path, source.format, &source.field)? {
            let mut ids = tokenizer.encode(&doc.text)?;
            ids.extend(eos);
            if ids.len() >= 2 {
                docs.push(ids.into());
            }
        }
    }
    if docs.is_empty() {
        let names: Vec<_> = data.sources.iter().map(|s| s.path.display()).collect();
        bail!(
            "the data sources ({}) hold no document of two or more tokens",
            names
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(docs)
}

/// Training and held-out documents (`data.held_out_fraction`, drawn with `seed`).
pub fn split_documents(
    docs: &[TokenDoc],
    held_out_fraction: f64,
    seed: u64,
) -> (Arc<Vec<TokenDoc>>, Arc<Vec<TokenDoc>>) {
    let (train_idx, held_idx) = split_held_out(docs.len(), held_out_fraction, seed);
    let pick = |idx: &[usize]| Arc::new(idx.iter().map(|&i| docs[i].clone()).collect::<Vec<_>>());
    (pick(&train_idx), pick(&held_idx))
}
