//! What every in-process teacher engine shares: scoring a sequence and generating after it from
//! the logits an engine's [`Session`] returns, one prefill for both. The engines: [`llama_cpp`]
//! (any GGUF llama.cpp runs; the default) and [`burn`] (llama-architecture GGUFs in pure Rust).

pub mod burn;
#[cfg(feature = "llama-cpp")]
pub mod llama_cpp;

use crate::routing::Routing;
use crate::{
    FinishReason, GenerateParams, Generation, Interrupt, Scored, TeacherError, log_sum_exp, sample,
    top_k,
};

/// One sequence's state in an engine (a KV cache, a llama.cpp context).
pub trait Session {
    /// Appends `ids` and returns their logits, `[ids.len(), vocab]` row-major.
    fn feed(&mut self, ids: &[u32]) -> Result<Vec<f32>, TeacherError>;

    /// The MoE routing of every id fed so far, where the session was opened to record it and the
    /// model routes (None otherwise).
    fn routing(&mut self) -> Result<Option<Routing>, TeacherError> {
        Ok(None)
    }
}

/// A loaded model: what it takes, and fresh sequences through it.
pub trait Model: Send + Sync {
    fn limits(&self) -> Limits;
    /// A new sequence with room for `len` ids (prompt and completion), recording the MoE routing
    /// when `routing` (an engine that cannot records nothing).
    fn session(&self, len: usize, routing: bool) -> Result<Box<dyn Session + '_>, TeacherError>;
}

/// What an engine can take.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub vocab: usize,
    /// The longest sequence (prompt and completion).
    pub context: usize,
    /// Ids fed at once when scoring or prefilling.
    pub chunk: usize,
}

/// Appends the top-`k` ids of one position's logits `row` and their logprobs; returns `id`'s
/// logprob. Logprobs are formed only where kept: the top-k of the logits is that of their logprobs.
fn keep_top(
    row: &[f32],
    k: usize,
    id: u32,
    top_ids: &mut Vec<u32>,
    top_logprobs: &mut Vec<f32>,
) -> f32 {
    let lse = log_sum_exp(row);
    let logprob = |x: f32| (x as f64 - lse) as f32;
    for (top, x) in top_k(row, k) {
        top_ids.push(top);
        top_logprobs.push(logprob(x));
    }
    logprob(row[id as usize])
}

/// [`keep_top`] of every row of `rows` (`[targets.len(), vocab]`), each with its target, into
/// `out`: the rows split across the machine's threads, since the engine waits on them and on a
/// small teacher they cost a real share of its forward (7% for SmolLM2-135M on llama.cpp).
fn keep_top_rows(rows: &[f32], targets: &[u32], out: &mut Scored) {
    let (n, k) = (targets.len(), out.k);
    if n == 0 {
        return;
    }
    let vocab = rows.len() / n;
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = n.div_ceil(threads.min(n));
    let parts: Vec<(Vec<u32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let work = rows.chunks(per * vocab).zip(targets.chunks(per));
        let handles: Vec<_> = work
            .map(|(rows, targets)| {
                s.spawn(move || {
                    let mut ids = Vec::with_capacity(targets.len() * k);
                    let mut lps = Vec::with_capacity(targets.len() * k);
                    let target_lps = rows
                        .chunks_exact(vocab)
                        .zip(targets)
                        .map(|(row, &id)| keep_top(row, k, id, &mut ids, &mut lps))
                        .collect();
                    (ids, lps, target_lps)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a scoring thread panicked"))
            .collect()
    });
    for (ids, lps, target_lps) in parts {
        out.top_ids.extend(ids);
        out.top_logprobs.extend(lps);
        out.target_logprobs.extend(target_lps);
    }
}

/// Scores `ids` at top-`k` and/or generates after them, with one prefill for both (a vLLM
/// request with `prompt_logprobs` and `max_tokens ≥ 1` needs both), until `interrupt` says stop
/// (checked between prefill chunks and generated tokens).
pub fn run(
    session: &mut dyn Session,
    limits: Limits,
    ids: &[u32],
    k: Option<usize>,
    params: Option<&GenerateParams>,
    interrupt: Interrupt,
) -> Result<(Option<Scored>, Option<Generation>), TeacherError> {
    let check = || interrupt.check();
    let Limits {
        vocab,
        context,
        chunk,
    } = limits;
    if let Some((i, &bad)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab)
    {
        return Err(TeacherError::Request(format!(
            "token {bad} at position {i} is outside the teacher's vocabulary of {vocab}"
        )));
    }
    if let Some(k) = k {
        if ids.len() < 2 || ids.len() > context {
            return Err(TeacherError::Request(format!(
                "scoring needs 2 to {context} tokens, got {}",
                ids.len()
            )));
        }
        if k == 0 || k > vocab {
            return Err(TeacherError::Request(format!(
                "k = {k} must be in 1..={vocab}"
            )));
        }
    }
    if params.is_some() && (ids.is_empty() || ids.len() >= context) {
        return Err(TeacherError::Request(format!(
            "the prompt needs 1 to {} tokens, got {}",
            context - 1,
            ids.len()
        )));
    }
    let mut scored = k.map(|k| Scored::empty(ids, k));
    // Scoring alone never needs the last id's distribution (it is only a target).
    let fed = if params.is_some() {
        ids
    } else {
        &ids[..ids.len() - 1]
    };
    let mut last = Vec::new();
    let mut t = 0;
    for piece in fed.chunks(chunk) {
        check()?;
        last = session.feed(piece)?;
        if let Some(out) = scored.as_mut() {
            // Each position's target is the next id; the prompt's last has none.
            let targets = &ids[t + 1..(t + 1 + piece.len()).min(ids.len())];
            keep_top_rows(&last[..targets.len() * vocab], targets, out);
        }
        t += piece.len();
    }
    let Some(params) = params else {
        return Ok((scored, None));
    };
    let mut rng = params.seed;
    let k = params.logprobs;
    let mut g = Generation {
        ids: Vec::new(),
        logprobs: Vec::new(),
        k,
        top_ids: Vec::new(),
        top_logprobs: Vec::new(),
        finish: FinishReason::Length,
    };
    let budget = params.max_tokens.min(context - ids.len());
    for _ in 0..budget {
        check()?;
        let row = &last[last.len() - vocab..];
        let id = if params.temperature <= 0.0 {
            top_k(row, 1)[0].0
        } else {
            sample(row, params.temperature, params.top_p, &mut rng)
        };
        g.ids.push(id);
        let lp = keep_top(row, k, id, &mut g.top_ids, &mut g.top_logprobs);
        g.logprobs.push(lp);
        if params.stop.contains(&id) {
            g.finish = FinishReason::Stop;
            break;
        }
        // The last id is never fed: nothing comes after it (so a session's routing covers the
        // prompt and every generated id but the last, as vLLM's does).
        if g.ids.len() < budget {
            last = session.feed(&[id])?;
        }
    }
    Ok((scored, Some(g)))
}
