//! Streaming corpora: documents read lazily from sources of any size, tokenized on background
//! threads, mixed by weight, shuffled in bounded blocks, in bounded memory, from a cursor that
//! resumes the stream exactly.
//!
//! - **Sources.** A file, or a directory of the format's files (`.txt`: one document per file;
//!   `.jsonl`: one per line; `.parquet`: one per row of the string column, read a batch of rows
//!   at a time). Each epoch visits a source's files in a seeded order.
//! - **Held-out split.** A document is held out when a seeded hash of its key ([`doc_key`]: its
//!   file's path inside the source and its line or row) falls under `held_out_fraction`. It
//!   depends on nothing else, so it is stable as sources grow or reorder, a held-out document never
//!   trains, and teacher shards, which keep the key, split the same way. A source marked
//!   [`StreamSource::held_out`] is held out whole: an evaluation set beside the training sources.
//! - **In order.** [`InOrder`] reads every document once, unshuffled and unsplit, with its key:
//!   how teacher scoring walks a corpus.
//! - **Background tokenization.** Each source has a thread that reads, filters and tokenizes
//!   ahead into a bounded queue ([`QUEUE`] documents).
//! - **Mixture.** Each document comes from the source furthest below its share of the trained
//!   tokens emitted so far (`tokens_i / w_i` smallest, ties to the first; a document counts the
//!   tokens it trains as targets, at least one), so the proportions of trained tokens follow the
//!   weights to within one document at every point of a run, with no randomness to replay. (A
//!   stream feeding rows without packing is given documents already cut to a row, so it counts
//!   what the rows keep.) A
//!   source with no document of the split (a one-file source held out whole, or a source marked
//!   held out) leaves the mixture.
//! - **Shuffle.** Documents are taken [`BLOCK`] at a time and emitted in a seeded permutation of
//!   the block: a shuffle buffer whose state is where the block began.
//! - **Cursor.** [`StreamCursor`]: each source's position and token count at the start of the
//!   block, the block's index, and how far into it the stream is. Resuming re-reads that block
//!   from those positions and shuffles it the same way (a Parquet file is entered at its row, a
//!   JSONL file re-read up to its line).

use crate::chat::Chat;
use crate::error::DataError;
use crate::pack::{DocFeed, TokenDoc, epoch_order};
use crate::rng::splitmix64;
use arrow_array::Array;
use arrow_array::cast::AsArray;
use serde::{Deserialize, Serialize};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// Documents per shuffled block.
pub const BLOCK: usize = 256;
/// Documents each source's thread tokenizes ahead.
pub const QUEUE: usize = 64;
/// Parquet rows decoded at a time.
const PARQUET_BATCH: usize = 256;

/// Corpus file formats.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceFormat {
    /// Plain UTF-8 text: one document per file. A directory of any format means every file of that
    /// format's extension in it (`.txt`, `.jsonl`, `.parquet`), sorted by name.
    Text,
    /// One JSON object per line; the document is the string at `field`.
    Jsonl,
    /// A Parquet file; the document is the string column `field`.
    Parquet,
}

impl SourceFormat {
    /// `.jsonl` → JSONL, `.parquet` → Parquet, anything else (files or directories) → text.
    pub fn infer(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl") => Self::Jsonl,
            Some("parquet") => Self::Parquet,
            _ => Self::Text,
        }
    }
}

/// One corpus source of a stream.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamSource {
    pub path: PathBuf,
    pub format: SourceFormat,
    /// The JSON field or Parquet column holding each document.
    pub field: String,
    /// Conversations (`field` holds messages) rather than text.
    pub chat: bool,
    /// Its share of the tokens (relative to the other sources').
    pub weight: f64,
    /// Every document is held out: an evaluation set that never trains.
    pub held_out: bool,
}

/// What a source holds at one place, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum RawDoc {
    Text(String),
    Chat(Chat),
}

/// Where a document is, for errors: its file and line or row.
#[derive(Clone, Debug, PartialEq)]
pub struct DocPlace {
    pub path: PathBuf,
    /// Line (JSONL, 0-based) or row (Parquet); 0 for a text file.
    pub item: u64,
}

/// Turns a raw document of source `i` into ids (`None` drops it, e.g. shorter than two tokens):
/// a [`TokenDoc`] for training, or whatever else a reader of the corpus needs.
pub type Tokenize<T = TokenDoc> =
    Arc<dyn Fn(usize, RawDoc, &DocPlace) -> Result<Option<T>, DataError> + Send + Sync>;

/// Which documents a stream yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    HeldOut,
}

/// A document's key: a 64-bit hash of its file's path inside its source and its line or row. It
/// names the document wherever the corpus is used (the `doc_id` of teacher-signal shards) and is
/// what the held-out draw hashes, so every stage splits a corpus the same way.
pub fn doc_key(file_key: &str, item: u64) -> u64 {
    // FNV-1a over the file's key, mixed with the item.
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in file_key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    h.rotate_left(17) ^ item.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The held-out draw of the document with key `key` (see [`doc_key`]): SplitMix64 of
/// `seed ⊕ key`, as a uniform in [0, 1), under `fraction`.
pub fn is_held_out(seed: u64, key: u64, fraction: f64) -> bool {
    let mut state = seed ^ key;
    let u = (splitmix64(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
    u < fraction
}

/// A source's files in name order: the file itself, or its directory's files of the format.
pub fn source_files(path: &Path, format: SourceFormat) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return match path.is_file() {
            true => Ok(vec![path.to_path_buf()]),
            false => Err(DataError::io(path, "no such file or directory")),
        };
    }
    let ext = match format {
        SourceFormat::Text => "txt",
        SourceFormat::Jsonl => "jsonl",
        SourceFormat::Parquet => "parquet",
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| DataError::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::io(
            path,
            format!("directory holds no .{ext} files"),
        ));
    }
    Ok(files)
}

/// The items of one file, lazily, from item `from` on.
enum Items {
    Text(Option<String>),
    Jsonl {
        lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
        line: u64,
    },
    Parquet {
        reader: parquet::arrow::arrow_reader::ParquetRecordBatchReader,
        batch: Option<arrow_array::ArrayRef>,
        in_batch: usize,
        row: u64,
    },
}

/// Reads a whole file as UTF-8 text, refusing a blank one.
pub(crate) fn read_text(path: &Path) -> Result<String, DataError> {
    let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

impl Items {
    fn open(path: &Path, format: SourceFormat, field: &str, from: u64) -> Result<Self, DataError> {
        Ok(match format {
            SourceFormat::Text => Self::Text((from == 0).then(|| read_text(path)).transpose()?),
            SourceFormat::Jsonl => {
                let f = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
                let mut lines = std::io::BufReader::new(f).lines();
                for line in 0..from {
                    lines
                        .next()
                        .transpose()
                        .map_err(|e| DataError::io(path, e))?
                        .ok_or_else(|| {
                            DataError::io(
                                path,
                                format!(
                                    "ends at line {} but the stream's cursor is at line {from}: \
                                     the file shrank since the checkpoint",
                                    line + 1
                                ),
                            )
                        })?;
                }
                Self::Jsonl { lines, line: from }
            }
            SourceFormat::Parquet => {
                use parquet::arrow::ProjectionMask;
                use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
                let f = std::fs::File::open(path).map_err(|e| DataError::io(path, e))?;
                let bad = |e: &dyn std::fmt::Display| {
                    DataError::io(path, format!("not a readable Parquet file: {e}"))
                };
                let builder = ParquetRecordBatchReaderBuilder::try_new(f).map_err(|e| bad(&e))?;
                let schema = builder.schema().clone();
                let Some((column, _)) = schema.column_with_name(field) else {
                    let names: Vec<&str> =
                        schema.fields().iter().map(|f| f.name().as_str()).collect();
                    return Err(DataError::io(
                        path,
                        format!("no column `{field}` (columns: {})", names.join(", ")),
                    ));
                };
                let rows = builder.metadata().file_metadata().num_rows().max(0) as u64;
                if from > rows {
                    return Err(DataError::io(
                        path,
                        format!(
                            "holds {rows} rows but the stream's cursor is at row {from}: the file \
                             shrank since the checkpoint"
                        ),
                    ));
                }
                let mask = ProjectionMask::roots(builder.parquet_schema(), [column]);
                let reader = builder
                    .with_projection(mask)
                    .with_batch_size(PARQUET_BATCH)
                    .with_offset(from as usize)
                    .build()
                    .map_err(|e| bad(&e))?;
                Self::Parquet {
                    reader,
                    batch: None,
                    in_batch: 0,
                    row: from,
                }
            }
        })
    }

    /// The next item and its index, or `None` at the end of the file.
    fn next(&mut self, path: &Path, field: &str) -> Result<Option<(u64, String)>, DataError> {
        match self {
            Self::Text(text) => Ok(text.take().map(|t| (0, t))),
            Self::Jsonl { lines, line } => loop {
                let Some(text) = lines
                    .next()
                    .transpose()
                    .map_err(|e| DataError::io(path, e))?
                else {
                    return Ok(None);
                };
                *line += 1;
                if !text.trim().is_empty() {
                    return Ok(Some((*line - 1, text)));
                }
            },
            Self::Parquet {
                reader,
                batch,
                in_batch,
                row,
            } => loop {
                if let Some(array) = batch.as_ref().filter(|a| *in_batch < a.len()) {
                    let i = *in_batch;
                    *in_batch += 1;
                    *row += 1;
                    let error = |message: &str| DataError::Row {
                        path: path.to_path_buf(),
                        row: (*row - 1) as usize,
                        message: format!("`{field}` {message}"),
                    };
                    let text = if array.is_null(i) {
                        return Err(error("is null"));
                    } else if let Some(a) = array.as_string_opt::<i32>() {
                        a.value(i)
                    } else if let Some(a) = array.as_string_opt::<i64>() {
                        a.value(i)
                    } else if let Some(a) = array.as_string_view_opt() {
                        a.value(i)
                    } else {
                        return Err(DataError::io(
                            path,
                            format!("column `{field}` is {}, not a string", array.data_type()),
                        ));
                    };
                    return Ok(Some((*row - 1, text.to_owned())));
                }
                match reader.next() {
                    None => return Ok(None),
                    Some(b) => {
                        let b = b.map_err(|e| {
                            DataError::io(
                                path,
                                format!("not a readable Parquet file (after row {row}): {e}"),
                            )
                        })?;
                        *batch = Some(b.column(0).clone());
                        *in_batch = 0;
                    }
                }
            },
        }
    }
}

/// Where a source is: `file` indexes the epoch's seeded file order, `item` the next line or row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourcePos {
    pub epoch: u64,
    pub file: usize,
    pub item: u64,
}

/// One source, read and tokenized on its own thread into a bounded queue of
/// `(position after the document, document)`.
struct Feed {
    rx: Receiver<FeedItem>,
    /// Set when the stream is dropped, so the thread stops at its next document.
    stop: Arc<AtomicBool>,
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A source and its files.
struct SourceFiles {
    source: StreamSource,
    files: Vec<PathBuf>,
    /// Each file's key for the held-out hash: its path inside the source.
    keys: Vec<String>,
}

impl SourceFiles {
    fn open(source: &StreamSource) -> Result<Self, DataError> {
        let files = source_files(&source.path, source.format)?;
        let keys = files
            .iter()
            .map(|f| match source.path.is_dir() {
                true => f
                    .strip_prefix(&source.path)
                    .unwrap_or(f)
                    .display()
                    .to_string(),
                false => f
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            })
            .collect();
        Ok(Self {
            source: source.clone(),
            files,
            keys,
        })
    }
}

/// What a source's thread needs.
struct FeedJob {
    /// The source's index in the stream.
    index: usize,
    files: Arc<SourceFiles>,
    seed: u64,
    split: Split,
    fraction: f64,
    tokenize: Tokenize,
}

/// A document and the source's position after it; `None` once the source turns out to hold no
/// document of the split (a whole epoch without one).
type FeedItem = Result<Option<(SourcePos, TokenDoc)>, DataError>;

impl FeedJob {
    /// Reads, filters and tokenizes from `at` into `tx` until the stream stops or a document
    /// fails (the error is sent, then the thread ends).
    fn run(self, mut at: SourcePos, tx: SyncSender<FeedItem>, stop: Arc<AtomicBool>) {
        if let Err(e) = self.feed(&mut at, &tx, &stop) {
            let _ = tx.send(Err(e));
        }
    }

    fn feed(
        &self,
        at: &mut SourcePos,
        tx: &SyncSender<FeedItem>,
        stop: &AtomicBool,
    ) -> Result<(), DataError> {
        let SourceFiles {
            source,
            files,
            keys,
        } = self.files.as_ref();
        if source.held_out && self.split == Split::Train {
            // An evaluation source: no training document, without reading it.
            let _ = tx.send(Ok(None));
            return Ok(());
        }
        let n = files.len();
        let order_seed = self.seed ^ 0x5151_F00D;
        // This epoch's file order (recomputed when the epoch changes).
        let mut order = (at.epoch, epoch_order(n, order_seed, at.epoch));
        // A whole epoch without a document: the split leaves this source none.
        let mut yielded = at.file > 0 || at.item > 0;
        let mut empty_epochs = 0;
        let mut items: Option<Items> = None;
        loop {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if at.file == n {
                empty_epochs = if yielded { 0 } else { empty_epochs + 1 };
                if empty_epochs == 2 {
                    let _ = tx.send(Ok(None));
                    return Ok(());
                }
                yielded = false;
                *at = SourcePos {
                    epoch: at.epoch + 1,
                    file: 0,
                    item: 0,
                };
            }
            if order.0 != at.epoch {
                order = (at.epoch, epoch_order(n, order_seed, at.epoch));
            }
            let file = order.1[at.file];
            let path = &files[file];
            if items.is_none() {
                items = Some(Items::open(path, source.format, &source.field, at.item)?);
            }
            let Some((item, text)) = items.as_mut().expect("opened").next(path, &source.field)?
            else {
                items = None;
                at.file += 1;
                at.item = 0;
                continue;
            };
            at.item = item + 1;
            let held = source.held_out
                || is_held_out(self.seed, doc_key(&keys[file], item), self.fraction);
            if held != (self.split == Split::HeldOut) {
                continue;
            }
            let place = DocPlace {
                path: path.clone(),
                item,
            };
            let raw = parse_item(source.format, &source.field, source.chat, text, &place)?;
            if let Some(doc) = (self.tokenize)(self.index, raw, &place)? {
                yielded = true;
                if tx.send(Ok(Some((*at, doc)))).is_err() {
                    return Ok(());
                }
            }
        }
    }
}

/// Every document of a corpus once, in order — source by source, each source's files in name
/// order, each file's items in order — with its [`doc_key`], read and tokenized lazily: how
/// teacher scoring walks a corpus, in the memory of one document.
pub struct InOrder<T> {
    sources: Vec<SourceFiles>,
    tokenize: Tokenize<T>,
    source: usize,
    file: usize,
    items: Option<Items>,
}

impl<T> InOrder<T> {
    pub fn open(sources: &[StreamSource], tokenize: Tokenize<T>) -> Result<Self, DataError> {
        Ok(Self {
            sources: sources
                .iter()
                .map(SourceFiles::open)
                .collect::<Result<_, _>>()?,
            tokenize,
            source: 0,
            file: 0,
            items: None,
        })
    }

    fn step(&mut self) -> Result<Option<(u64, T)>, DataError> {
        loop {
            let Some(src) = self.sources.get(self.source) else {
                return Ok(None);
            };
            let Some(path) = src.files.get(self.file) else {
                (self.source, self.file) = (self.source + 1, 0);
                continue;
            };
            let (format, field) = (src.source.format, &src.source.field);
            if self.items.is_none() {
                self.items = Some(Items::open(path, format, field, 0)?);
            }
            let Some((item, text)) = self.items.as_mut().expect("opened").next(path, field)? else {
                (self.items, self.file) = (None, self.file + 1);
                continue;
            };
            let place = DocPlace {
                path: path.clone(),
                item,
            };
            let raw = parse_item(format, field, src.source.chat, text, &place)?;
            if let Some(doc) = (self.tokenize)(self.source, raw, &place)? {
                return Ok(Some((doc_key(&src.keys[self.file], item), doc)));
            }
        }
    }
}

impl<T> Iterator for InOrder<T> {
    type Item = Result<(u64, T), DataError>;

    /// The next document and its key; after an error, nothing more.
    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(doc) => doc.map(Ok),
            Err(e) => {
                self.source = self.sources.len();
                Some(Err(e))
            }
        }
    }
}

/// Each source's files as `(key inside the source, byte length)`, in name order: what a corpus
/// holds, cheaply, for telling whether it changed since a stage read it.
pub fn source_listing(sources: &[StreamSource]) -> Result<Vec<Vec<(String, u64)>>, DataError> {
    sources
        .iter()
        .map(|s| {
            let files = SourceFiles::open(s)?;
            files
                .files
                .iter()
                .zip(files.keys)
                .map(|(f, key)| {
                    let len = std::fs::metadata(f).map_err(|e| DataError::io(f, e))?.len();
                    Ok((key, len))
                })
                .collect()
        })
        .collect()
}

/// An item as a raw document: a text file's or Parquet row's text, or a JSONL line's `field`
/// (text, or messages when `chat`). Errors name the file and line or row.
fn parse_item(
    format: SourceFormat,
    field: &str,
    chat: bool,
    text: String,
    place: &DocPlace,
) -> Result<RawDoc, DataError> {
    let record = |message: String| DataError::Record {
        path: place.path.clone(),
        line: place.item as usize + 1,
        message,
    };
    match format {
        SourceFormat::Jsonl if chat => Chat::from_record(&text, field)
            .map(RawDoc::Chat)
            .map_err(record),
        SourceFormat::Jsonl => {
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| record(format!("invalid JSON: {e}")))?;
            let value = value
                .get(field)
                .ok_or_else(|| record(format!("no `{field}` field")))?;
            match value {
                serde_json::Value::String(s) if !s.trim().is_empty() => Ok(RawDoc::Text(s.clone())),
                serde_json::Value::String(_) => Err(record(format!("`{field}` is empty"))),
                _ => Err(record(format!("`{field}` is not a string"))),
            }
        }
        SourceFormat::Parquet if text.trim().is_empty() => Err(DataError::Row {
            path: place.path.clone(),
            row: place.item as usize,
            message: format!("`{field}` is empty"),
        }),
        _ => Ok(RawDoc::Text(text)),
    }
}

/// Every item of one file as a raw document with its line or row, in order; a file without one
/// is an error naming it.
pub(crate) fn file_items(
    path: &Path,
    format: SourceFormat,
    field: &str,
    chat: bool,
) -> Result<Vec<(u64, RawDoc)>, DataError> {
    let mut items = Items::open(path, format, field, 0)?;
    let mut out = Vec::new();
    while let Some((item, text)) = items.next(path, field)? {
        let place = DocPlace {
            path: path.to_path_buf(),
            item,
        };
        out.push((item, parse_item(format, field, chat, text, &place)?));
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// What a stream's mixture counts per document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixtureCount {
    /// The tokens it trains as targets (at least one).
    Trained,
    /// Every token: what a cursor written before mixtures counted trained tokens counted, so
    /// such a run resumes exactly as it began.
    AllTokens,
}

impl MixtureCount {
    fn of_legacy_cursor() -> Self {
        Self::AllTokens
    }

    fn tokens(self, doc: &TokenDoc) -> u64 {
        match self {
            Self::Trained => doc.trained_tokens().max(1) as u64,
            Self::AllTokens => doc.ids.len() as u64,
        }
    }
}

/// Where a [`DocStream`] is (see the module doc); saved in checkpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    /// Blocks started so far (the current one's index + 1; 0 before the first).
    pub block: u64,
    /// Each source's position where the current block began.
    pub sources: Vec<SourcePos>,
    /// Trained tokens each source had given when the current block began.
    pub tokens: Vec<u64>,
    /// Documents of the current block already consumed.
    pub taken: usize,
    /// What the mixture counts (absent from cursors written before it was recorded).
    #[serde(default = "MixtureCount::of_legacy_cursor")]
    pub count: MixtureCount,
}

impl Default for StreamCursor {
    /// The start of a stream.
    fn default() -> Self {
        Self {
            block: 0,
            sources: Vec::new(),
            tokens: Vec::new(),
            taken: 0,
            count: MixtureCount::Trained,
        }
    }
}

/// An endless stream of tokenized documents over weighted sources (see the module doc).
pub struct DocStream {
    sources: Vec<Arc<SourceFiles>>,
    feeds: Vec<Feed>,
    weights: Vec<f64>,
    seed: u64,
    split: Split,
    /// Sources found to hold no document of the split.
    empty: Vec<bool>,
    /// Consumed positions and token counts (of documents pulled into blocks).
    pos: Vec<SourcePos>,
    tokens: Vec<u64>,
    cursor: StreamCursor,
    block: Vec<TokenDoc>,
}

impl DocStream {
    /// A stream of `split`'s documents of `sources` from `cursor` (the default cursor: the start).
    pub fn open(
        sources: &[StreamSource],
        tokenize: Tokenize,
        seed: u64,
        split: Split,
        held_out_fraction: f64,
        cursor: StreamCursor,
    ) -> Result<Self, DataError> {
        let files = sources
            .iter()
            .map(|s| SourceFiles::open(s).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let n = sources.len();
        let mut cursor = cursor;
        if cursor.block == 0 {
            cursor.sources = vec![SourcePos::default(); n];
            cursor.tokens = vec![0; n];
        }
        if cursor.sources.len() != n || cursor.tokens.len() != n {
            return Err(DataError::io(
                &sources[0].path,
                format!(
                    "the run's data cursor has {} sources but the recipe has {n}: resume with the \
                     sources it trained on",
                    cursor.sources.len()
                ),
            ));
        }
        let mut stream = Self {
            feeds: Vec::new(),
            weights: sources.iter().map(|s| s.weight).collect(),
            seed,
            split,
            empty: vec![false; n],
            pos: cursor.sources.clone(),
            tokens: cursor.tokens.clone(),
            cursor: cursor.clone(),
            block: Vec::new(),
            sources: files,
        };
        stream.feeds = (0..n)
            .map(|i| stream.spawn(i, held_out_fraction, tokenize.clone()))
            .collect();
        if cursor.block > 0 {
            // Rebuild the block the cursor is in, then skip what it had consumed.
            stream.fill_block(cursor.block - 1)?;
            stream.cursor = cursor;
        }
        Ok(stream)
    }

    fn spawn(&self, i: usize, fraction: f64, tokenize: Tokenize) -> Feed {
        let job = FeedJob {
            index: i,
            files: self.sources[i].clone(),
            seed: self.seed,
            split: self.split,
            fraction,
            tokenize,
        };
        let (tx, rx) = sync_channel(QUEUE);
        let stop = Arc::new(AtomicBool::new(false));
        let (at, flag) = (self.pos[i], stop.clone());
        std::thread::spawn(move || job.run(at, tx, flag));
        Feed { rx, stop }
    }

    fn split_name(&self) -> &'static str {
        match self.split {
            Split::Train => "training",
            Split::HeldOut => "held-out",
        }
    }

    /// Trained tokens each source has given so far (counting the whole current block).
    pub fn tokens_by_source(&self) -> &[u64] {
        &self.tokens
    }

    /// The source furthest below its share: smallest `tokens / weight`, ties to the first; among
    /// the sources that have documents of the split.
    fn pick(&self) -> Option<usize> {
        (0..self.weights.len())
            .filter(|&i| !self.empty[i])
            .min_by(|&a, &b| {
                let (x, y) = (
                    self.tokens[a] as f64 / self.weights[a],
                    self.tokens[b] as f64 / self.weights[b],
                );
                x.total_cmp(&y).then(a.cmp(&b))
            })
    }

    /// Pulls block `index`'s documents from the feeds and shuffles them.
    fn fill_block(&mut self, index: u64) -> Result<(), DataError> {
        self.cursor = StreamCursor {
            block: index + 1,
            sources: self.pos.clone(),
            tokens: self.tokens.clone(),
            taken: 0,
            count: self.cursor.count,
        };
        let mut docs = Vec::with_capacity(BLOCK);
        while docs.len() < BLOCK {
            let Some(i) = self.pick() else {
                let names: Vec<String> = self
                    .sources
                    .iter()
                    .map(|s| s.source.path.display().to_string())
                    .collect();
                return Err(DataError::io(
                    &self.sources[0].source.path,
                    format!(
                        "no {} document of two or more tokens in any source ({}){}",
                        self.split_name(),
                        names.join(", "),
                        match self.split {
                            Split::HeldOut =>
                                ": the split hashes each document, so a corpus of \
                                few documents may hold none out; raise data.held_out_fraction, \
                                add a source with held_out = true, or set the fraction to 0",
                            Split::Train => ": every one is held out",
                        }
                    ),
                ));
            };
            let path = &self.sources[i].source.path;
            let item = self.feeds[i]
                .rx
                .recv()
                .map_err(|_| DataError::io(path, "its reader stopped unexpectedly"))??;
            // A source without a document of the split (a one-file source held out whole, say)
            // leaves the mixture; the others share its place.
            let Some((pos, doc)) = item else {
                self.empty[i] = true;
                continue;
            };
            self.pos[i] = pos;
            // At least one, so a source whose documents train nothing cannot take every pick.
            self.tokens[i] += self.cursor.count.tokens(&doc);
            docs.push(doc);
        }
        let order = epoch_order(BLOCK, self.seed ^ 0xB10C, index);
        let mut slots: Vec<Option<TokenDoc>> = docs.into_iter().map(Some).collect();
        self.block = order
            .into_iter()
            .map(|j| slots[j].take().expect("a permutation"))
            .collect();
        Ok(())
    }
}

impl DocFeed for DocStream {
    type Cursor = StreamCursor;

    fn cursor(&self) -> StreamCursor {
        self.cursor.clone()
    }

    fn next_doc(&mut self) -> Result<TokenDoc, DataError> {
        if self.cursor.block == 0 || self.cursor.taken == BLOCK {
            self.fill_block(self.cursor.block)?;
        }
        let doc = std::mem::take(&mut self.block[self.cursor.taken]);
        self.cursor.taken += 1;
        Ok(doc)
    }
}
