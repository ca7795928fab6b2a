//! Reasoning-trajectory shards: what a teacher wrote for each prompt, as Parquet (zstd), schema
//! version 2 (version 1, without `tool_calls`, is read too), `k3mini.kind = "trajectories"`.
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `prompt_id` | utf8 | the prompt's id in its source |
//! | `prompt_ids` | list<int32> | the rendered prompt (chat template + generation header) as sent |
//! | `completion_ids` | list<int32> | the ids the teacher returned, stop token included |
//! | `logprobs` | list<float32> | each completion id's logprob under the teacher's untempered distribution |
//! | `top_ids` | list<fixed_size_list<int32, k>> | the teacher's top-k at each completion position |
//! | `top_logprobs` | list<fixed_size_list<float32, k>> | their logprobs |
//! | `thinking` | utf8, null when none | the reasoning (between `<think>` and `</think>`) |
//! | `answer` | utf8 | the rest of the completion, without the end-of-turn marker |
//! | `finish_reason` | utf8 | `stop` (a stop id ended it) or `length` (max_tokens did) |
//! | `reference` | utf8, null when none | the prompt set's reference answer |
//! | `tool_calls` | utf8, null when none | the calls the completion makes, as OpenAI's `tool_calls` JSON (arguments as JSON strings) |
//!
//! Metadata: `k3mini.schema_version`, `k3mini.kind`, `k3mini.teacher`, `k3mini.tokenizer_sha256`,
//! `k3mini.k`, `k3mini.temperature`, `k3mini.top_p`, `k3mini.max_tokens`, `k3mini.seed`.

use crate::chat::ToolCall;
use crate::error::DataError;
use crate::parquet_io::{
    Col, Opened, column, f32s, file_err, float_lists, int_lists, strings, topk_float_lists,
    topk_int_lists, u32s, write_parquet,
};
use crate::shards::{KIND as SIGNALS, ShardMeta};
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, RecordBatch};
use std::path::Path;

pub const SCHEMA_VERSION: u32 = 2;
/// The versions read: 1 had no `tool_calls`.
const READ_VERSIONS: [u32; 2] = [1, 2];
pub const KIND: &str = "trajectories";
const WHAT: &str = "trajectory shard";

/// How the trajectories were sampled: stored as Parquet file metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct TrajectoryMeta {
    /// Teacher, tokenizer, top-k per completion token (≥ 1) and sampling temperature.
    pub signals: ShardMeta,
    pub top_p: f32,
    pub max_tokens: usize,
    pub seed: u64,
}

/// One prompt's trajectory.
#[derive(Clone, Debug, PartialEq)]
pub struct TrajectoryRow {
    pub prompt_id: String,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// `completion_ids.len() × k`, row-major.
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
    pub thinking: Option<String>,
    pub answer: String,
    pub finish_reason: String,
    pub reference: Option<String>,
    /// The tool calls the completion makes (the answer is the text around them).
    pub tool_calls: Vec<ToolCall>,
}

impl TrajectoryRow {
    /// Every id (prompt, completion, the teacher's top-k) below the teacher's vocabulary.
    fn check_ids(&self, meta: &ShardMeta) -> Result<(), String> {
        let at = format!("prompt {}", self.prompt_id);
        meta.check_ids(&at, "prompt_ids", &self.prompt_ids)?;
        meta.check_ids(&at, "completion_ids", &self.completion_ids)?;
        meta.check_ids(&at, "top_ids", &self.top_ids)
    }

    fn check(&self, k: usize) -> Result<(), String> {
        let n = self.completion_ids.len();
        if self.prompt_ids.is_empty()
            || self.logprobs.len() != n
            || self.top_ids.len() != n * k
            || self.top_logprobs.len() != n * k
        {
            return Err(format!(
                "prompt {}: {} prompt ids and {n} completion ids need {n} logprobs and {n}×{k} top-k \
                 entries, got {}, {} and {}",
                self.prompt_id,
                self.prompt_ids.len(),
                self.logprobs.len(),
                self.top_ids.len(),
                self.top_logprobs.len()
            ));
        }
        let at = format!("prompt {}", self.prompt_id);
        crate::shards::check_logprobs(&at, "logprobs", &self.logprobs)?;
        crate::shards::check_logprobs(&at, "top_logprobs", &self.top_logprobs)?;
        if !matches!(self.finish_reason.as_str(), "stop" | "length") {
            return Err(format!(
                "prompt {}: finish_reason {:?} is not stop or length",
                self.prompt_id, self.finish_reason
            ));
        }
        Ok(())
    }
}

/// Writes a trajectory shard atomically. Returns the bytes written.
pub fn write_trajectories(
    path: &Path,
    meta: &TrajectoryMeta,
    rows: &[TrajectoryRow],
) -> Result<u64, DataError> {
    let k = meta.signals.k;
    if k == 0 {
        return Err(file_err(path, WHAT, "k must be at least 1"));
    }
    for r in rows {
        r.check(k)
            .and_then(|()| r.check_ids(&meta.signals))
            .map_err(|m| file_err(path, WHAT, m))?;
    }
    let calls: Vec<Option<String>> = rows
        .iter()
        .map(|r| {
            (!r.tool_calls.is_empty())
                .then(|| serde_json::to_string(&r.tool_calls).expect("tool calls serialize"))
        })
        .collect();
    // Nullability is declared, not inferred from this shard's rows: every shard has one schema.
    let batch = RecordBatch::try_from_iter_with_nullable([
        (
            "prompt_id",
            strings(rows.iter().map(|r| Some(r.prompt_id.as_str()))),
            false,
        ),
        (
            "prompt_ids",
            int_lists(rows.iter().map(|r| &r.prompt_ids[..])),
            false,
        ),
        (
            "completion_ids",
            int_lists(rows.iter().map(|r| &r.completion_ids[..])),
            false,
        ),
        (
            "logprobs",
            float_lists(rows.iter().map(|r| &r.logprobs[..])),
            false,
        ),
        (
            "top_ids",
            topk_int_lists(rows.iter().map(|r| &r.top_ids[..]), k),
            false,
        ),
        (
            "top_logprobs",
            topk_float_lists(rows.iter().map(|r| &r.top_logprobs[..]), k),
            false,
        ),
        (
            "thinking",
            strings(rows.iter().map(|r| r.thinking.as_deref())),
            true,
        ),
        (
            "answer",
            strings(rows.iter().map(|r| Some(r.answer.as_str()))),
            false,
        ),
        (
            "finish_reason",
            strings(rows.iter().map(|r| Some(r.finish_reason.as_str()))),
            false,
        ),
        (
            "reference",
            strings(rows.iter().map(|r| r.reference.as_deref())),
            true,
        ),
        (
            "tool_calls",
            strings(calls.iter().map(Option::as_deref)),
            true,
        ),
    ] as [(&str, ArrayRef, bool); 11])
    .map_err(|e| file_err(path, WHAT, e))?;
    write_parquet(
        path,
        WHAT,
        &batch,
        &[
            meta.signals.pairs(KIND, SCHEMA_VERSION),
            vec![
                ("top_p", meta.top_p.to_string()),
                ("max_tokens", meta.max_tokens.to_string()),
                ("seed", meta.seed.to_string()),
            ],
        ]
        .concat(),
        &[
            &["top_logprobs", "list", "element", "item"],
            &["logprobs", "list", "element"],
        ],
        &[],
    )
}

/// Reads and validates a trajectory shard.
pub fn read_trajectories(
    path: &Path,
    sha256: Option<&str>,
) -> Result<(TrajectoryMeta, Vec<TrajectoryRow>), DataError> {
    // Files without `kind` are teacher-signal shards from before it: refused as that kind.
    let (opened, version) =
        Opened::open_versioned(path, WHAT, KIND, Some(SIGNALS), &READ_VERSIONS, sha256)?;
    let meta = TrajectoryMeta {
        signals: ShardMeta::read(&opened, path, WHAT)?,
        top_p: opened.parse(path, WHAT, "top_p")?,
        max_tokens: opened.parse(path, WHAT, "max_tokens")?,
        seed: opened.parse(path, WHAT, "seed")?,
    };
    let k = meta.signals.k;
    let mut columns = vec![
        ("prompt_id", Col::Utf8),
        ("prompt_ids", Col::IntList),
        ("completion_ids", Col::IntList),
        ("logprobs", Col::FloatList),
        ("top_ids", Col::TopkInt(k)),
        ("top_logprobs", Col::TopkFloat(k)),
        ("thinking", Col::Utf8),
        ("answer", Col::Utf8),
        ("finish_reason", Col::Utf8),
        ("reference", Col::Utf8),
    ];
    let has_calls = version >= 2;
    if has_calls {
        columns.push(("tool_calls", Col::Utf8));
    }
    opened
        .check_columns(&columns)
        .map_err(|m| file_err(path, WHAT, m))?;
    let mut rows: Vec<TrajectoryRow> = Vec::new();
    for batch in opened.batches(path, WHAT)? {
        let text = |name: &str, i: usize| {
            let a = column(&batch, name).as_string::<i32>();
            a.is_valid(i).then(|| a.value(i).to_string())
        };
        for i in 0..batch.num_rows() {
            let required = |name: &str| {
                text(name, i)
                    .ok_or_else(|| file_err(path, WHAT, format!("row {i}: {name} is null")))
            };
            let row = TrajectoryRow {
                prompt_id: required("prompt_id")?,
                prompt_ids: u32s(column(&batch, "prompt_ids"), i),
                completion_ids: u32s(column(&batch, "completion_ids"), i),
                logprobs: f32s(column(&batch, "logprobs"), i),
                top_ids: u32s(column(&batch, "top_ids"), i),
                top_logprobs: f32s(column(&batch, "top_logprobs"), i),
                thinking: text("thinking", i),
                answer: required("answer")?,
                finish_reason: required("finish_reason")?,
                reference: text("reference", i),
                tool_calls: match has_calls.then(|| text("tool_calls", i)).flatten() {
                    Some(json) => serde_json::from_str(&json)
                        .map_err(|e| file_err(path, WHAT, format!("row {i}: tool_calls: {e}")))?,
                    None => Vec::new(),
                },
            };
            row.check(k)
                .and_then(|()| row.check_ids(&meta.signals))
                .map_err(|m| file_err(path, WHAT, m))?;
            rows.push(row);
        }
    }
    Ok((meta, rows))
}
