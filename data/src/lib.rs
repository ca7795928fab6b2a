//! Data for k3mini: tokenizers (any `tokenizer.json`, the Kimi tiktoken vocabulary, byte-level BPE
//! training), corpus readers (text, JSONL, Parquet, chat conversations) and the streaming loader
//! over them (weighted mixtures, a hashed held-out split, an exact cursor), chat templates with
//! per-token parts for loss masks, resumable sequence packing, and the teacher-signal shard
//! schemas with their compact top-k codec.

pub mod align;
pub mod aligned;
pub mod chat;
pub mod corpus;
pub mod design;
pub mod digest;
pub mod error;
pub mod pack;
mod parquet_io;
pub mod pool;
pub mod prompts;
pub mod rng;
pub mod routing;
pub mod shards;
pub mod signals;
pub mod stream;
pub mod tokenizer;
pub mod topk_codec;
pub mod trajectories;

pub use chat::{Chat, ChatFormat, LossParts, Message, Part, Role, Tool};
pub use corpus::{ChatDocument, Document, read_chats, read_source};
pub use error::DataError;
pub use pack::{DocFeed, PackCursor, PackedBatch, Packer, TokenDoc};
pub use stream::SourceFormat;
pub use tokenizer::Tokenizer;
