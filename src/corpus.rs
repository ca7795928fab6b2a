//! A plan's corpus as token documents: read, rendered (chat) and tokenized one way for every
//! consumer, lazily. Training streams it ([`document_stream`]: weighted, shuffled, held-out
//! documents chosen by a seeded hash of their key); teacher scoring reads it once in order
//! ([`scoring_corpus`]), keeping each document's key and a conversation's parts in the shards, so
//! distillation splits and masks the shards as training splits and masks the corpus.

use crate::bail;
use crate::error::Result;
use crate::recipe::DataPlan;
use k3mini_data::chat::{ChatFormat, LossParts, check_markers, render};
use k3mini_data::stream::{
    DocPlace, DocStream, InOrder, MixtureCount, RawDoc, Split, StreamCursor, StreamSource,
    Tokenize, source_listing,
};
use k3mini_data::{DataError, PackCursor, Packer, TokenDoc, Tokenizer};
use k3mini_teacher::score::{Corpus, CorpusDoc};
use std::sync::Arc;

/// One document as ids and, for a chat rendered with its template, what each id is; text ends
/// in the end-of-text id. `None` when it has fewer than two tokens.
fn parted_doc(
    raw: RawDoc,
    template: Option<ChatFormat>,
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    place: &DocPlace,
) -> std::result::Result<Option<CorpusDoc>, DataError> {
    let (ids, parts) = match (raw, template) {
        (RawDoc::Chat(chat), Some(template)) => {
            let rendered = render(&chat.messages, &chat.tools, template, false).map_err(|e| {
                DataError::Record {
                    path: place.path.clone(),
                    line: place.item as usize + 1,
                    message: e.to_string(),
                }
            })?;
            let (ids, parts) = rendered.encode(tokenizer)?;
            (ids, Some(parts))
        }
        (RawDoc::Text(text), _) => {
            let mut ids = tokenizer.encode(&text)?;
            ids.extend(eos);
            (ids, None)
        }
        (RawDoc::Chat(_), None) => unreachable!("only chat sources yield conversations"),
    };
    // The key and source are the reader's to set.
    Ok((ids.len() >= 2).then_some(CorpusDoc {
        key: 0,
        source: 0,
        ids,
        parts,
    }))
}

/// A document as training reads it: a chat trains on the parts `train_on` names.
fn token_doc(doc: CorpusDoc, train_on: &LossParts) -> TokenDoc {
    TokenDoc {
        targets: doc
            .parts
            .map(|parts| parts.iter().map(|&p| train_on.trains(p)).collect()),
        ids: doc.ids,
    }
}

/// How the plan's documents are tokenized (chat templates' markers checked first).
fn tokenize<T: 'static>(
    data: &DataPlan,
    tokenizer: &Tokenizer,
    finish: impl Fn(CorpusDoc) -> T + Send + Sync + 'static,
) -> Result<Tokenize<T>> {
    for s in &data.sources {
        if let Some(template) = s.chat {
            check_markers(template, tokenizer)
                .map_err(|e| crate::refused!("{}: {e}", s.path.display()))?;
        }
    }
    let templates: Vec<Option<ChatFormat>> = data.sources.iter().map(|s| s.chat).collect();
    let (tokenizer, eos) = (tokenizer.clone(), tokenizer.special_ids().eos);
    Ok(Arc::new(move |i, raw, place| {
        let doc = parted_doc(raw, templates[i], &tokenizer, eos, place)?;
        Ok(doc.map(|d| finish(CorpusDoc { source: i, ..d })))
    }))
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
            held_out: s.held_out,
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
    open_stream(data, tokenizer, seed, split, cursor, usize::MAX)
}

/// The plan's `split` documents packed into rows of `seq_len` as `data.packing` says, from
/// `cursor`: what plain training and its held-out evaluation read. Without packing a row keeps
/// only a document's first `seq_len` tokens, so the stream is given them cut there and its mixture
/// weighs what the rows keep (not for a cursor from before mixtures counted trained tokens: that
/// run resumes as it began).
pub fn row_packer(
    data: &DataPlan,
    tokenizer: &Tokenizer,
    seed: u64,
    split: Split,
    cursor: PackCursor<StreamCursor>,
) -> Result<Packer<DocStream>> {
    let keep = match data.packing || cursor.feed.count == MixtureCount::AllTokens {
        true => usize::MAX,
        false => data.seq_len,
    };
    let stream = open_stream(data, tokenizer, seed, split, cursor.feed, keep)?;
    Ok(Packer::new(
        stream,
        data.seq_len,
        data.packing,
        0,
        cursor.offset,
    )?)
}

/// [`document_stream`] with each document cut to its first `keep` tokens.
fn open_stream(
    data: &DataPlan,
    tokenizer: &Tokenizer,
    seed: u64,
    split: Split,
    cursor: StreamCursor,
    keep: usize,
) -> Result<DocStream> {
    let train_on = data.train_on.clone();
    Ok(DocStream::open(
        &stream_sources(data),
        tokenize(data, tokenizer, move |d| {
            let mut doc = token_doc(d, &train_on);
            doc.truncate(keep);
            doc
        })?,
        seed,
        split,
        data.held_out_fraction,
        cursor,
    )?)
}

/// Every document of the plan once, in corpus order, with its key and parts: what
/// `k3mini teacher score` reads (each call starts again from the beginning).
pub fn scoring_corpus(data: &DataPlan, tokenizer: &Tokenizer) -> Result<Corpus> {
    let docs = InOrder::open(&stream_sources(data), tokenize(data, tokenizer, |d| d)?)?;
    Ok(Box::new(
        docs.map(|d| d.map(|(key, doc)| CorpusDoc { key, ..doc })),
    ))
}

/// Every document of the plan, tokenized, in corpus order, in memory: the loader benchmark's
/// in-memory side, which the streaming loader is measured against.
pub fn tokenized_documents(data: &DataPlan, tokenizer: &Tokenizer) -> Result<Vec<TokenDoc>> {
    let train_on = data.train_on.clone();
    let read = tokenize(data, tokenizer, move |d| token_doc(d, &train_on))?;
    let docs = InOrder::open(&stream_sources(data), read)?
        .map(|d| d.map(|(_, doc)| doc))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if docs.is_empty() {
        let names: Vec<String> = data
            .sources
            .iter()
            .map(|s| s.path.display().to_string())
            .collect();
        bail!(
            "the data sources ({}) hold no document of two or more tokens",
            names.join(", ")
        );
    }
    Ok(docs)
}

/// The plan's sources by name, in order: each one's file or directory name (its path where that
/// is empty). Reports group a corpus's documents by them.
pub fn source_names(data: &DataPlan) -> Vec<String> {
    data.sources
        .iter()
        .map(|s| {
            s.path.file_name().map_or_else(
                || s.path.display().to_string(),
                |n| n.to_string_lossy().into(),
            )
        })
        .collect()
}

/// SHA-256 of what the plan's corpus is, cheaply: each source's settings and its files' names and
/// sizes (not their contents). Teacher shards record it, so training can tell that a recipe still
/// names the corpus that was scored without reading it.
pub fn sources_sha256(data: &DataPlan) -> Result<String> {
    use k3mini_data::digest::{Digest, Sha256, hex};
    let mut h = Sha256::new();
    let listing = source_listing(&stream_sources(data))?;
    for (source, files) in data.sources.iter().zip(listing) {
        let settings = format!(
            "{:?} {:?} {:?} {}\n",
            source.format,
            source.field,
            source.chat,
            files.len()
        );
        h.update(settings.as_bytes());
        for (key, bytes) in files {
            h.update(format!("{key}\t{bytes}\n").as_bytes());
        }
    }
    Ok(hex(h))
}
