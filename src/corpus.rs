//! A plan's corpus as token documents: read, rendered (chat) and tokenized one way for every
//! consumer. Plain training streams it ([`document_stream`]: lazily, weighted, held-out documents
//! chosen by a seeded hash); teacher scoring, offline and online distillation and their
//! evaluation take the whole document list ([`tokenized_documents`]), which they split by a
//! seeded draw over its indices (`k3mini_data::pack::split_held_out`).

use crate::bail;
use crate::error::Result;
use crate::recipe::DataPlan;
use k3mini_data::chat::{ChatFormat, LossParts, check_markers, render};
use k3mini_data::stream::{
    DocPlace, DocStream, RawDoc, Split, StreamCursor, StreamSource, Tokenize,
};
use k3mini_data::tokenizer::BPE_EOS;
use k3mini_data::{DataError, TokenDoc, Tokenizer, read_chats, read_source};
use std::sync::Arc;

/// The tokenizer's end-of-document id, when it has one.
fn end_of_text(tokenizer: &Tokenizer) -> Option<u32> {
    [BPE_EOS, "</s>", "<|end_of_text|>"]
        .iter()
        .find_map(|t| tokenizer.token_id(t))
}

/// One document as ids: text ends in the end-of-text id and trains on every token; a chat is
/// rendered with its template and trains on the parts `train_on` names. `None` when it has fewer
/// than two tokens.
fn token_doc(
    raw: RawDoc,
    template: Option<ChatFormat>,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    train_on: &LossParts,
    place: &DocPlace,
) -> std::result::Result<Option<TokenDoc>, DataError> {
    let doc = match (raw, template) {
        (RawDoc::Chat(messages), Some(template)) => {
            let rendered = render(&messages, template, false).map_err(|e| DataError::Record {
                path: place.path.clone(),
                line: place.item as usize + 1,
                message: e.to_string(),
            })?;
            let (ids, parts) = rendered.encode(tokenizer)?;
            let targets = parts.iter().map(|&p| train_on.trains(p)).collect();
            TokenDoc {
                ids,
                targets: Some(targets),
            }
        }
        (RawDoc::Text(text), _) => {
            let mut ids = tokenizer.encode(&text)?;
            ids.extend(eos);
            ids.into()
        }
        (RawDoc::Chat(_), None) => unreachable!("only chat sources yield conversations"),
    };
    Ok((doc.ids.len() >= 2).then_some(doc))
}

/// The plan's sources as a stream reads them.
fn stream_sources(data: &DataPlan) -> Vec<StreamSource> {
    data.sources
        .iter()
        .map(|s| StreamSource {
            path: s.path.clone(),
            format: s.format,
            field: s.field.clone(),
            chat: s.chat.is_some(),
            weight: s.weight,
        })
        .collect()
}

/// The plan's `split` documents as a stream from `cursor` (see `k3mini_data::stream`).
pub fn document_stream(
    data: &DataPlan,
    tokenizer: &Tokenizer,
    seed: u64,
    split: Split,
    cursor: StreamCursor,
) -> Result<DocStream> {
    for s in &data.sources {
        if let Some(template) = s.chat {
            check_markers(template, tokenizer)
                .map_err(|e| crate::refused!("{}: {e}", s.path.display()))?;
        }
    }
    let templates: Vec<Option<ChatFormat>> = data.sources.iter().map(|s| s.chat).collect();
    let (tokenizer, eos, train_on) = (
        tokenizer.clone(),
        end_of_text(tokenizer),
        data.train_on.clone(),
    );
    let tokenize: Tokenize = Arc::new(move |i, raw, place| {
        token_doc(raw, templates[i], &tokenizer, eos, &train_on, place)
    });
    Ok(DocStream::open(
        &stream_sources(data),
        tokenize,
        seed,
        split,
        data.held_out_fraction,
        cursor,
    )?)
}

/// Every document of a plan, tokenized, in source and file order.
pub fn tokenized_documents(data: &DataPlan, tokenizer: &Tokenizer) -> Result<Vec<TokenDoc>> {
    let eos = end_of_text(tokenizer);
    let mut docs = Vec::new();
    for source in &data.sources {
        let path = &source.path;
        if let Some(template) = source.chat {
            check_markers(template, tokenizer)
                .map_err(|e| crate::refused!("{}: {e}", path.display()))?;
            for chat in read_chats(path, &source.field)? {
                let place = DocPlace {
                    path: chat.source,
                    item: chat.index as u64,
                };
                let raw = RawDoc::Chat(chat.messages);
                docs.extend(token_doc(
                    raw,
                    Some(template),
                    tokenizer,
                    eos,
                    &data.train_on,
                    &place,
                )?);
            }
            continue;
        }
        for doc in read_source(path, source.format, &source.field)? {
            let place = DocPlace {
                path: doc.source,
                item: doc.index as u64,
            };
            docs.extend(token_doc(
                RawDoc::Text(doc.text),
                None,
                tokenizer,
                eos,
                &data.train_on,
                &place,
            )?);
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
