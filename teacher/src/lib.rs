//! Teachers: what the student learns from. A [`Teacher`] scores fixed token sequences (top-k
//! logprobs at every position and the logprob of the actual next token) and generates completions
//! with per-token logprobs. [`local::LocalTeacher`] runs a GGUF in-process on llama.cpp or burn
//! ([`engine`]; the SmolLM2-135M-Instruct teacher CI and the quickstart use is fetched by
//! [`fetch`]).

pub mod bench;
pub mod client;
pub mod engine;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod llama;
pub mod local;
pub mod manifest;
pub mod routing;
pub mod sampling;
pub mod score;
pub mod server;
pub mod stop;
pub mod wire;

use k3mini_data::rng::uniform;
use std::path::PathBuf;

/// Text whose tokenization exercises digits, whitespace, punctuation and multi-byte characters:
/// the probe that two tokenizers of one vocabulary (a served teacher's and the student's,
/// llama.cpp's and k3mini's reading of a GGUF) split text alike.
pub const PROBE: &str = "Hello, world! In 2026, 12345 + 678 = 13023.\n\tdef f(x):\n\t\treturn x ** 2  # café naïve 中文 😀";

#[derive(Debug, thiserror::Error)]
pub enum TeacherError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error(transparent)]
    Gguf(#[from] k3mini_gguf::GgufError),
    #[error(transparent)]
    Data(#[from] k3mini_data::DataError),
    /// A request the teacher cannot serve (bad ids, too long, k too large).
    #[error("{0}")]
    Request(String),
    /// Work stopped at its time limit.
    #[error("stopped after {0:?}: the request's time limit")]
    TimedOut(std::time::Duration),
    /// Work stopped because nobody wants it any more (the reason says who left).
    #[error("stopped: {0}")]
    Cancelled(&'static str),
    /// Too many requests are running or waiting already: worth a retry shortly.
    #[error("{0}")]
    Busy(String),
    /// A teacher server that failed, gave up, or answered something malformed.
    #[error("teacher server: {0}")]
    Server(String),
    #[error("fetch {name}: {message}")]
    Fetch { name: String, message: String },
}

/// When a request's work stops early: past its deadline (the instant, and the limit it came from),
/// or once `cancelled` gives a reason (the client disconnected, the server is stopping). Checked
/// between prefill chunks and generated tokens.
#[derive(Clone, Copy, Default)]
pub struct Interrupt<'a> {
    pub deadline: Option<(std::time::Instant, std::time::Duration)>,
    pub cancelled: Option<&'a dyn Fn() -> Option<&'static str>>,
}

/// The deadline `limit` from now (when there is one), as [`Interrupt::deadline`] holds it.
pub fn deadline_in(
    limit: Option<std::time::Duration>,
) -> Option<(std::time::Instant, std::time::Duration)> {
    limit.map(|limit| (std::time::Instant::now() + limit, limit))
}

impl<'a> Interrupt<'a> {
    /// Work that must end within `limit` of now (when there is one), or once `cancelled` gives
    /// a reason.
    pub fn from_now(
        limit: Option<std::time::Duration>,
        cancelled: &'a dyn Fn() -> Option<&'static str>,
    ) -> Self {
        Self {
            deadline: deadline_in(limit),
            cancelled: Some(cancelled),
        }
    }

    pub fn check(&self) -> Result<(), TeacherError> {
        if let Some((at, limit)) = self.deadline
            && std::time::Instant::now() > at
        {
            return Err(TeacherError::TimedOut(limit));
        }
        match self.cancelled.and_then(|why| why()) {
            Some(reason) => Err(TeacherError::Cancelled(reason)),
            None => Ok(()),
        }
    }
}

/// Teacher signals for one sequence of `n` ids: `n − 1` positions, position `t` being the
/// distribution of token `t + 1` given tokens `..=t` (aligned with the student's logits at `t`).
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub ids: Vec<u32>,
    pub k: usize,
    /// `log p(ids[t+1] | ids[..=t])`, `n − 1` values.
    pub target_logprobs: Vec<f32>,
    /// `(n − 1) × k`, each row by descending logprob (ties by id).
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
    /// The MoE routing of the `n − 1` tokens scored (`ids[..n − 1]`, position `t`'s token
    /// `ids[t]`), from a teacher asked to return it ([`Teacher::routing`]).
    pub routing: Option<routing::Routing>,
}

impl Scored {
    /// An empty result for `ids`, to be filled position by position.
    pub fn empty(ids: &[u32], k: usize) -> Self {
        let n = ids.len().saturating_sub(1);
        Self {
            ids: ids.to_vec(),
            k,
            target_logprobs: Vec::with_capacity(n),
            top_ids: Vec::with_capacity(n * k),
            top_logprobs: Vec::with_capacity(n * k),
            routing: None,
        }
    }

    pub fn positions(&self) -> usize {
        self.target_logprobs.len()
    }

    /// As a shard row: segment `segment` of document `doc_id`, with the conversation's parts.
    pub fn into_row(
        self,
        doc_id: u64,
        segment: u32,
        parts: Option<Vec<k3mini_data::chat::Part>>,
    ) -> k3mini_data::shards::ShardRow {
        k3mini_data::shards::ShardRow {
            doc_id,
            segment,
            input_ids: self.ids,
            parts,
            target_logprobs: self.target_logprobs,
            top_ids: self.top_ids,
            top_logprobs: self.top_logprobs,
        }
    }
}

/// The temperature of every logprob a [`Teacher`] returns, scored or generated: its own
/// distribution. A sampling temperature shapes only which tokens are drawn (as vLLM's default
/// `raw_logprobs`); distillation tempers the signals itself.
pub const LOGPROB_TEMPERATURE: f64 = 1.0;

/// Sampling settings for [`Teacher::generate`].
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    pub top_p: f32,
    pub seed: u64,
    /// Top-k logprobs recorded per generated token (0 = none).
    pub logprobs: usize,
    /// Generation stops after any of these ids (the end-of-turn token, typically).
    pub stop: Vec<u32>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            logprobs: 0,
            stop: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop id was generated (it is the last id).
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
}

/// A completion: the ids, each one's logprob under the teacher's (untempered) distribution, and the
/// top-k at each step.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub k: usize,
    pub top_ids: Vec<u32>,
    pub top_logprobs: Vec<f32>,
    pub finish: FinishReason,
}

impl Generation {
    /// Its first `n` tokens, ended by a stop (a stop string their text holds).
    pub fn stop_after(&mut self, n: usize) {
        self.ids.truncate(n);
        self.logprobs.truncate(n);
        self.top_ids.truncate(n * self.k);
        self.top_logprobs.truncate(n * self.k);
        self.finish = FinishReason::Stop;
    }
}

/// A source of teacher signals. `Sync`: a scorer keeps several requests in flight.
pub trait Teacher: Sync {
    /// Identifies the teacher in shard metadata (model name or file, and quantisation).
    fn name(&self) -> &str;
    fn vocab_size(&self) -> usize;
    /// Top-k logprobs of every position of `ids`, and its routing where [`Teacher::routing`]
    /// says the teacher returns it.
    fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError>;
    fn generate(&self, prompt: &[u32], params: &GenerateParams)
    -> Result<Generation, TeacherError>;
    /// The routing [`Teacher::score`] returns with every sequence, as the teacher's layers and
    /// experts are (None: it returns none).
    fn routing(&self) -> Option<&routing::wire::RoutingShape> {
        None
    }
    /// The HTTP requests a served teacher's client has sent (or tried) since it connected, and
    /// how many of them were answered: what a remote may bill. None where the teacher keeps no
    /// count (a teacher on this machine).
    fn requests(&self) -> Option<Requests> {
        None
    }
}

/// [`Teacher::requests`]: retries and scoring windows each count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requests {
    pub sent: u64,
    pub answered: u64,
}

/// The `k` largest of `row` as `(id, value)`, by descending value, ties by ascending id: one pass
/// with the best `k` kept sorted, so most values cost one comparison (a teacher runs this on
/// every position of a vocabulary-wide row).
pub fn top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(row.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (i, &x) in row.iter().enumerate() {
        // An equal value comes with a larger id, so it ranks after the one kept.
        if best.len() == k && x.total_cmp(&best[k - 1].1).is_le() {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b.total_cmp(&x).is_ge());
        best.insert(at, (i as u32, x));
        best.truncate(k);
    }
    best
}

/// `log Σ exp(row)`: f32 exponentials of `row − max` (each at most 1), summed in f64.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max as f64
        + row
            .iter()
            .map(|&x| (x - max).exp() as f64)
            .sum::<f64>()
            .ln()
}

/// `log softmax(row)`.
pub fn log_softmax(row: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(row);
    row.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// Draws from `softmax(logits / temperature)` restricted to the smallest set of top ids holding
/// `top_p` of the mass ([`sampling::sampling_dist`]); `rng` is a SplitMix64 state.
pub fn sample(logits: &[f32], temperature: f32, top_p: f32, rng: &mut u64) -> u32 {
    let candidates = logits.iter().enumerate().map(|(i, &l)| (i as u32, l));
    let dist = sampling::sampling_dist(candidates, sampling::Sampling { temperature, top_p });
    sampling::draw(&dist, uniform(rng))
}
