//! Data for k3mini: tokenizers (any `tokenizer.json`, the Kimi tiktoken vocabulary, byte-level BPE
//! training), corpus readers and resumable sequence packing. Chat templates, Parquet and the
//! teacher-shard schema join them as the trainer and teacher issues land.

pub mod corpus;
pub mod error;
pub mod pack;
pub mod tokenizer;

pub use corpus::{Document, SourceFormat, read_source};
pub use error::DataError;
pub use pack::{Cursor, PackedBatch, Packer};
pub use tokenizer::Tokenizer;
