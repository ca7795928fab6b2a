//! Token alignment across tokenizers: the same text cut by the student's tokenizer and by a
//! teacher's with another vocabulary, and the teacher's signals carried over to the student.
//!
//! **Chunks** (ALM, Minixhofer et al. 2025). Two tokenizations of one byte string each cut it at
//! their tokens' byte offsets; the offsets both share cut it into chunks, each spelled by a whole
//! run of student tokens and a whole run of teacher tokens:
//!
//! ```text
//! bytes     "  1 2 3 4 5 ,"      student  [" 123"]["45"][","]   offsets 4 6 7
//!                                teacher  [" 1"]["2"]["3"]["4"]["5"][","]   offsets 2 3 4 5 6 7
//! shared offsets 4, 6, 7  →  chunks  " 123" (1 student, 3 teacher), "45" (1, 2), "," (1, 1)
//! ```
//!
//! A chunk's log-likelihood under either model is the sum of its tokens' log-probabilities: the
//! two are estimates of the same event (these bytes come next), which is what ALM's loss compares.
//!
//! **Projection** (X-Token style). At a chunk's first position both models predict what starts at
//! the same byte. The token the teacher actually saw there goes to the token the student actually
//! saw (both start the chunk's bytes, so one is a prefix of the other: a Kimi ` 123` for a
//! teacher's ` 1`), so the projected target agrees with cross-entropy on the observed path. Every
//! other teacher token `v` goes to the student token whose bytes are the longest prefix of `v`'s;
//! a teacher special goes to the student's special of the same name. A teacher token with none
//! maps to nothing: its mass joins the tail bucket, so the projected distribution keeps the
//! teacher's whole mass.
//!
//! Both tokenizers must spell text back byte for byte ([`PROBE`] is checked when an [`Aligner`]
//! is made, and every run the teacher tokenizes is checked again).

use crate::error::DataError;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;
use std::ops::Range;

/// One aligned chunk: student tokens `student` and teacher tokens `teacher` spell the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub student: Range<usize>,
    pub teacher: Range<usize>,
}

/// The chunks of two tokenizations of the same bytes, given each token's byte length: one per
/// pair of consecutive offsets both share (starting at 0), each holding at least one token of
/// either side (a zero-length token joins the chunk after it). `None` when the two do not spell
/// the same number of bytes.
pub fn shared_chunks(student: &[usize], teacher: &[usize]) -> Option<Vec<Chunk>> {
    if student.iter().sum::<usize>() != teacher.iter().sum::<usize>() {
        return None;
    }
    let mut chunks = Vec::new();
    let (mut from_s, mut from_t) = (0, 0); // where the open chunk starts
    let (mut s_end, mut t_end, mut j) = (0, 0, 0); // teacher tokens [..j] end at byte t_end
    for (i, &len) in student.iter().enumerate() {
        s_end += len;
        // Teacher tokens that end by s_end (a zero-length one at s_end waits for the next chunk).
        while j < teacher.len()
            && t_end + teacher[j] <= s_end
            && !(teacher[j] == 0 && t_end == s_end)
        {
            t_end += teacher[j];
            j += 1;
        }
        if t_end == s_end && i + 1 > from_s && j > from_t {
            chunks.push(Chunk {
                student: from_s..i + 1,
                teacher: from_t..j,
            });
            (from_s, from_t) = (i + 1, j);
        }
    }
    // Trailing zero-length tokens belong to the last chunk.
    if let Some(last) = chunks.last_mut() {
        last.student.end = student.len();
        last.teacher.end = teacher.len();
    }
    Some(chunks)
}

/// A teacher's tokenization of a student's segment, and the chunks the two share (indices into
/// the student's ids and into `teacher_ids`).
#[derive(Clone, Debug, PartialEq)]
pub struct Retokenized {
    pub teacher_ids: Vec<u32>,
    pub chunks: Vec<Chunk>,
}

/// A student's and a teacher's tokenizers, read once into what alignment and projection need.
pub struct Aligner {
    teacher: Tokenizer,
    student_bytes: Vec<Option<Vec<u8>>>,
    teacher_bytes: Vec<Option<Vec<u8>>>,
    /// Each student special token's text, and the teacher id of the same special where it has one.
    specials: HashMap<u32, Option<u32>>,
    /// Teacher id → student id ([`Self::project`]), `u32::MAX` for none.
    projection: Vec<u32>,
    teacher_sha256: String,
}

impl std::fmt::Debug for Aligner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Aligner(teacher {})", self.teacher.name())
    }
}

/// What [`Aligner::project`] maps a teacher token with no student prefix to.
pub const UNMAPPED: u32 = u32::MAX;

/// Text both tokenizers of a cross-tokenizer pair must spell back byte for byte: a leading space,
/// digit runs, tabs and newlines, accented, compatibility (`ﬁ`, `²`), CJK and emoji characters.
pub const PROBE: &str =
    " In 2026, 12345 + 678 = 13023.\n\tdef f(x):  return x ** 2  # café naïve ﬁle x² 中文 😀";

/// The bytes `ids` spell through a [`Tokenizer::token_bytes`] table, and each id's length (ids
/// past the table and specials spell nothing).
fn spell(table: &[Option<Vec<u8>>], ids: &[u32]) -> (Vec<u8>, Vec<usize>) {
    let mut bytes = Vec::new();
    let lens = ids
        .iter()
        .map(|&i| {
            let b = table
                .get(i as usize)
                .and_then(Option::as_deref)
                .unwrap_or_default();
            bytes.extend_from_slice(b);
            b.len()
        })
        .collect();
    (bytes, lens)
}

/// Refuses a tokenizer whose tokens of [`PROBE`] do not spell it back.
fn check_spelling(t: &Tokenizer, table: &[Option<Vec<u8>>], side: &str) -> Result<(), DataError> {
    let (spelled, _) = spell(table, &t.encode(PROBE)?);
    match spelled == PROBE.as_bytes() {
        true => Ok(()),
        false => Err(DataError::Tokenizer {
            source_name: t.name().to_string(),
            message: format!(
                "the {side}'s tokens of a probe text spell {:?} back, not the text (it \
                 normalises it, adds a prefix space, or its tokens do not say their bytes): \
                 cross-tokenizer alignment needs tokenizers that keep text byte for byte",
                String::from_utf8_lossy(&spelled)
            ),
        }),
    }
}

impl Aligner {
    pub fn new(student: &Tokenizer, teacher: &Tokenizer) -> Result<Self, DataError> {
        let student_bytes = student.token_bytes()?;
        let teacher_bytes = teacher.token_bytes()?;
        check_spelling(student, &student_bytes, "student")?;
        check_spelling(teacher, &teacher_bytes, "teacher")?;
        // The first (lowest) id of each byte string: a vocabulary may spell one string twice.
        let mut by_bytes: HashMap<&[u8], u32> = HashMap::with_capacity(student_bytes.len());
        for (id, b) in student_bytes.iter().enumerate() {
            if let Some(b) = b.as_deref().filter(|b| !b.is_empty()) {
                by_bytes.entry(b).or_insert(id as u32);
            }
        }
        let specials: HashMap<u32, Option<u32>> = student_bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| b.is_none())
            .map(|(id, _)| {
                let id = id as u32;
                let text = student.decode(&[id]).unwrap_or_default();
                let theirs = teacher
                    .token_id(&text)
                    .filter(|&t| teacher_bytes.get(t as usize).is_some_and(Option::is_none));
                (id, theirs)
            })
            .collect();
        let special_of: HashMap<u32, u32> = specials
            .iter()
            .filter_map(|(&ours, theirs)| Some(((*theirs)?, ours)))
            .collect();
        let projection = teacher_bytes
            .iter()
            .enumerate()
            .map(|(t, b)| match b {
                None => special_of.get(&(t as u32)).copied().unwrap_or(UNMAPPED),
                Some(b) => (1..=b.len())
                    .rev()
                    .find_map(|n| by_bytes.get(&b[..n]).copied())
                    .unwrap_or(UNMAPPED),
            })
            .collect();
        Ok(Self {
            teacher: teacher.clone(),
            student_bytes,
            teacher_bytes,
            specials,
            projection,
            teacher_sha256: teacher.fingerprint(),
        })
    }

    /// The teacher tokenizer's fingerprint (what a cross-tokenizer job records).
    pub fn teacher_sha256(&self) -> &str {
        &self.teacher_sha256
    }

    /// The student token a teacher token's probability goes to ([`UNMAPPED`]: the tail).
    pub fn project(&self, teacher_id: u32) -> u32 {
        self.projection
            .get(teacher_id as usize)
            .copied()
            .unwrap_or(UNMAPPED)
    }

    /// The teacher's tokenization of the student's `ids` and their shared chunks. The ids are cut
    /// at special tokens (which spell no text); each run between them is spelled out, trimmed to
    /// whole UTF-8 characters (a segment may start or end inside one), and tokenized by the
    /// teacher; a student special becomes the teacher's special of the same name where it has
    /// one. Chunks never hold a special or a trimmed token. After a special the teacher lacks,
    /// the run's first chunk is left out: the teacher would predict it without the boundary the
    /// student sees.
    pub fn retokenize(&self, ids: &[u32]) -> Result<Retokenized, DataError> {
        let err = |message: String| DataError::Tokenizer {
            source_name: self.teacher.name().to_string(),
            message,
        };
        let bytes_of = |id: u32| -> Result<Option<&[u8]>, DataError> {
            match self.student_bytes.get(id as usize) {
                Some(b) => Ok(b.as_deref()),
                None => Err(err(format!(
                    "student id {id} is past the student's vocabulary of {}",
                    self.student_bytes.len()
                ))),
            }
        };
        let mut out = Retokenized {
            teacher_ids: Vec::new(),
            chunks: Vec::new(),
        };
        let (mut start, mut unmatched) = (0, false);
        while start < ids.len() {
            if bytes_of(ids[start])?.is_none() {
                match self.specials.get(&ids[start]) {
                    Some(Some(t)) => out.teacher_ids.push(*t),
                    _ => unmatched = true,
                }
                start += 1;
                continue;
            }
            let mut end = start;
            while end < ids.len() && bytes_of(ids[end])?.is_some() {
                end += 1;
            }
            let first = out.chunks.len();
            self.align_run(ids, start..end, &mut out)?;
            if unmatched && out.chunks.len() > first {
                out.chunks.remove(first);
            }
            (start, unmatched) = (end, false);
        }
        Ok(out)
    }

    /// Appends the teacher's tokens of the text run `ids[run]` and their chunks to `out`.
    fn align_run(
        &self,
        ids: &[u32],
        run: Range<usize>,
        out: &mut Retokenized,
    ) -> Result<(), DataError> {
        let (bytes, lens) = spell(&self.student_bytes, &ids[run.clone()]);
        // Whole characters only: drop leading tokens that start inside one, trailing tokens
        // that end inside one.
        let mut offsets = vec![0];
        offsets.extend(lens.iter().scan(0, |at, l| {
            *at += l;
            Some(*at)
        }));
        let is_char_start = |o: usize| o >= bytes.len() || (bytes[o] & 0xC0) != 0x80;
        let (mut a, mut b) = (0, lens.len());
        while a < b && !is_char_start(offsets[a]) {
            a += 1;
        }
        let text = loop {
            if a >= b {
                return Ok(());
            }
            match std::str::from_utf8(&bytes[offsets[a]..offsets[b]]) {
                Ok(text) => break text,
                // Cut inside a character at the end: drop the token holding its start.
                Err(e) if e.error_len().is_none() => b -= 1,
                // Invalid inside (not text a corpus yields): this run aligns nothing.
                Err(_) => return Ok(()),
            }
        };
        let teacher_ids = self.teacher.encode(text)?;
        let (spelled, teacher_lens) = spell(&self.teacher_bytes, &teacher_ids);
        if spelled != text.as_bytes() {
            return Err(DataError::Tokenizer {
                source_name: self.teacher.name().to_string(),
                message: format!(
                    "its tokens of {:?} spell other bytes back (it normalises the text or adds \
                     a prefix space): cross-tokenizer alignment needs a tokenizer that keeps the \
                     text byte for byte",
                    text.chars().take(40).collect::<String>()
                ),
            });
        }
        let chunks =
            shared_chunks(&lens[a..b], &teacher_lens).expect("both spell `text`: checked above");
        let (s0, t0) = (run.start + a, out.teacher_ids.len());
        out.chunks.extend(chunks.into_iter().map(|c| Chunk {
            student: c.student.start + s0..c.student.end + s0,
            teacher: c.teacher.start + t0..c.teacher.end + t0,
        }));
        out.teacher_ids.extend(teacher_ids);
        Ok(())
    }
}

/// What a cross-tokenizer shard keeps of one chunk: where it is among the student's ids, the
/// teacher's log-likelihood of its bytes, and the teacher's top-k at its first position with each
/// id projected onto the student's vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkSignals {
    /// Student tokens `[start, end)`; `start ≥ 1` (the first token is never predicted).
    pub start: u32,
    pub end: u32,
    /// `Σ log p(teacher token)` over the chunk's teacher tokens.
    pub logprob: f32,
    /// `k` student ids ([`UNMAPPED`] for a teacher token no student token prefixes), in the
    /// teacher's top-k order.
    pub top_ids: Vec<u32>,
    /// The teacher's top-k logprobs at the chunk's first teacher position.
    pub top_logprobs: Vec<f32>,
}

impl Aligner {
    /// The chunks of `retok` (the teacher's tokenization of the student's `ids`) the teacher's
    /// signals cover, from its scoring of `retok.teacher_ids`: `target_logprobs[j]` =
    /// `log p(teacher_ids[j+1])`, `top_*` its `k`-wide top-k per position (lengths checked by the
    /// caller). Chunks starting at either side's first token (nothing predicts it) are left out;
    /// the observed teacher token's entry goes to the observed student token (see the module doc).
    pub fn chunk_signals(
        &self,
        ids: &[u32],
        retok: &Retokenized,
        target_logprobs: &[f32],
        top_ids: &[u32],
        top_logprobs: &[f32],
        k: usize,
    ) -> Vec<ChunkSignals> {
        retok
            .chunks
            .iter()
            .filter(|c| c.student.start > 0 && c.teacher.start > 0)
            .map(|c| {
                let first = c.teacher.start - 1; // the position predicting the chunk's first token
                let logprob: f64 = target_logprobs[first..c.teacher.end - 1]
                    .iter()
                    .map(|&l| l as f64)
                    .sum();
                let (seen, ours) = (retok.teacher_ids[c.teacher.start], ids[c.student.start]);
                ChunkSignals {
                    start: c.student.start as u32,
                    end: c.student.end as u32,
                    logprob: logprob as f32,
                    top_ids: top_ids[first * k..(first + 1) * k]
                        .iter()
                        .map(|&t| if t == seen { ours } else { self.project(t) })
                        .collect(),
                    top_logprobs: top_logprobs[first * k..(first + 1) * k].to_vec(),
                }
            })
            .collect()
    }
}

/// A chunk's projected top-k as a distribution over distinct student ids: entries mapped to one
/// id summed (`log Σ exp`), unmapped entries left out (their mass stays in the tail `1 − P`),
/// by descending logprob. The mass over the result equals the mass of the mapped entries.
pub fn merge_projected(ids: &[u32], logprobs: &[f32]) -> Vec<(u32, f32)> {
    let mut merged: Vec<(u32, f64)> = Vec::with_capacity(ids.len());
    for (&id, &l) in ids.iter().zip(logprobs) {
        if id == UNMAPPED {
            continue;
        }
        match merged.iter_mut().find(|(m, _)| *m == id) {
            Some((_, p)) => *p += (l as f64).exp(),
            None => merged.push((id, (l as f64).exp())),
        }
    }
    let mut out: Vec<(u32, f32)> = merged
        .into_iter()
        .map(|(id, p)| (id, p.ln() as f32))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}
