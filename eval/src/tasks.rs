//! Generation tasks with greedy decoding: passkey retrieval at several context lengths and depths,
//! exact-match answers to reasoning problems, and decode speed.

use k3mini_data::Tokenizer;
use k3mini_data::rng::splitmix64;
use k3mini_student::K3Mini;
use k3mini_student::generate::{argmax, decode};
use serde::{Deserialize, Serialize};

/// The passkey test's filler (Mohtashami & Jaggi, 2023): repeated until the context is full.
const FILLER: &str =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const QUESTION: &str = " What is the pass key? The pass key is";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PasskeyCase {
    /// Prompt length in tokens.
    pub context: usize,
    /// Where the key sits, as a fraction of the filler.
    pub depth: f64,
    pub key: String,
    /// The student's greedy continuation.
    pub answer: String,
    pub found: bool,
}

/// One prompt per (context, depth): filler with `The pass key is K. Remember it. K is the pass
/// key.` at `depth`, then the question; found when the greedy continuation contains K. Keys are
/// 5-digit numbers drawn from `seed`.
pub fn passkey(
    model: &K3Mini,
    tokenizer: &Tokenizer,
    contexts: &[usize],
    depths: &[f64],
    seed: u64,
) -> Result<Vec<PasskeyCase>, k3mini_data::DataError> {
    let filler = tokenizer.encode(FILLER)?;
    let question = tokenizer.encode(QUESTION)?;
    let mut rng = seed;
    let mut cases = Vec::new();
    for &context in contexts {
        for &depth in depths {
            let key = format!("{}", 10_000 + splitmix64(&mut rng) % 90_000);
            let needle = tokenizer.encode(&format!(
                " The pass key is {key}. Remember it. {key} is the pass key."
            ))?;
            let room = context.saturating_sub(needle.len() + question.len());
            let hay: Vec<u32> = filler.iter().copied().cycle().take(room).collect();
            let at = (room as f64 * depth) as usize;
            let prompt: Vec<u32> = [&hay[..at], &needle, &hay[at..], &question].concat();
            let ids = decode(model, &prompt, 8, &[], argmax);
            let answer = tokenizer.decode(&ids)?;
            cases.push(PasskeyCase {
                context: prompt.len(),
                depth,
                found: answer.contains(&key),
                key,
                answer,
            });
        }
    }
    Ok(cases)
}

/// A reasoning problem: the rendered prompt and its reference answer.
pub struct Problem {
    pub id: String,
    pub prompt: Vec<u32>,
    pub answer: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExactMatchCase {
    pub id: String,
    pub reference: String,
    /// The last number in the student's greedy output, if any.
    pub extracted: Option<String>,
    pub correct: bool,
}

/// Greedy answers to `problems` (up to `max_tokens` each, stopping at `stop`), scored by exact
/// match of the last number in the output with the reference's last number.
pub fn exact_match(
    model: &K3Mini,
    tokenizer: &Tokenizer,
    problems: &[Problem],
    max_tokens: usize,
    stop: &[u32],
) -> Result<Vec<ExactMatchCase>, k3mini_data::DataError> {
    problems
        .iter()
        .map(|p| {
            let ids = decode(model, &p.prompt, max_tokens, stop, argmax);
            let extracted = last_number(&tokenizer.decode(&ids)?);
            let reference = last_number(&p.answer);
            Ok(ExactMatchCase {
                id: p.id.clone(),
                correct: extracted.is_some() && extracted == reference,
                reference: p.answer.clone(),
                extracted,
            })
        })
        .collect()
}

/// The last number in `text` (digits with an optional sign, decimal point and thousands
/// commas), normalised: commas and a trailing `.0…` dropped.
pub fn last_number(text: &str) -> Option<String> {
    let mut last = None;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if chars[i].is_ascii_digit() {
            let start = if i > 0 && chars[i - 1] == '-' {
                i - 1
            } else {
                i
            };
            let mut j = i;
            while j < chars.len()
                && (chars[j].is_ascii_digit()
                    || ((chars[j] == '.' || chars[j] == ',')
                        && chars.get(j + 1).is_some_and(char::is_ascii_digit)))
            {
                j += 1;
            }
            let s: String = chars[start..j].iter().filter(|&&c| c != ',').collect();
            let s = match s.split_once('.') {
                Some((int, frac)) if frac.chars().all(|c| c == '0') => int.to_string(),
                _ => s,
            };
            last = Some(s);
            i = j;
        } else {
            i += 1;
        }
    }
    last
}

/// Greedy decode speed after a `prompt_len`-token prefill: the time of `1 + tokens` generated
/// tokens minus that of 1 (which the prefill dominates) gives the per-token decode step.
pub fn decode_tokens_per_s(model: &K3Mini, prompt_len: usize, tokens: usize) -> f64 {
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 7919) % vocab).collect();
    let time = |n: usize| {
        let t0 = std::time::Instant::now();
        decode(model, &prompt, n, &[], argmax);
        t0.elapsed().as_secs_f64()
    };
    let prefill = time(1);
    tokens as f64 / (time(1 + tokens) - prefill).max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::last_number;

    #[test]
    fn last_number_finds_the_final_answer() {
        assert_eq!(last_number("so 3 + 4 = 7."), Some("7".into()));
        assert_eq!(
            last_number("total: 1,234.50 dollars"),
            Some("1234.50".into())
        );
        assert_eq!(last_number("it is -12.0"), Some("-12".into()));
        assert_eq!(last_number("x-3"), Some("-3".into()));
        assert_eq!(last_number("no digits"), None);
    }
}
