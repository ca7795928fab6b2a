//! The compact encoding of teacher top-k lists in schema-v2 shards (the layout is documented with
//! the schema in [`crate::shards`]): pure functions, each the inverse of another.
//!
//! Logprobs, per position, sorted best first (`ℓ_0 ≥ ℓ_1 ≥ …`), with `P = 1 − tail` exact:
//!
//! ```text
//! c_j  = round((ℓ_0 − ℓ_j) / s)            integer offsets below the best, c_0 = 0, non-decreasing
//! L    = ln P − ln Σ_j e^{−s c_j}          the best logprob, chosen so that Σ_j e^{ℓ'_j} = P
//! ℓ'_j = L − s c_j                         what a reader gets
//! ```
//!
//! `|c_j s − (ℓ_0 − ℓ_j)| ≤ s/2` and therefore `|L − ℓ_0| ≤ s/2` (every term of the sum moves by
//! at most `e^{±s/2}`), so `|ℓ'_j − ℓ_j| ≤ s`, while the top-k mass — and the tail bucket every
//! tail objective reads — is exactly the teacher's. The increments `c_j − c_{j−1}` are small
//! non-negative integers, stored as LEB128 varints that zstd then entropy-codes.
//!
//! Ids are lossless: each is written as its index in the file's [`IdTable`] (its most frequent
//! ids, most frequent first) or past the table as itself, so frequent ids get short varints and
//! zstd sees a skewed alphabet.

use std::collections::HashMap;

/// Appends `v` as an unsigned LEB128 varint (7 bits per byte, high bit = more follows).
pub fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Decodes exactly `n` varints from `bytes`, refusing truncated, overlong or trailing input.
pub fn get_varints(bytes: &[u8], n: usize) -> Result<Vec<u32>, String> {
    let mut at = 0;
    let out = take_varints(bytes, &mut at, n)?;
    if at != bytes.len() {
        return Err(format!(
            "{} bytes left over after {n} values",
            bytes.len() - at
        ));
    }
    Ok(out)
}

/// A varint count followed by that many varints (how the id table is stored).
pub fn put_counted(values: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    put_varint(&mut out, values.len() as u32);
    values.iter().for_each(|&v| put_varint(&mut out, v));
    out
}

/// The inverse of [`put_counted`].
pub fn get_counted(bytes: &[u8]) -> Result<Vec<u32>, String> {
    let mut at = 0;
    let n = take_varints(bytes, &mut at, 1)?[0] as usize;
    if n > bytes.len() {
        return Err(format!("claims {n} values in {} bytes", bytes.len()));
    }
    get_varints(&bytes[at..], n)
}

/// `n` varints from `bytes[*at..]`, advancing `at` past them.
fn take_varints(bytes: &[u8], at: &mut usize, n: usize) -> Result<Vec<u32>, String> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let mut v: u64 = 0;
        let mut shift = 0;
        loop {
            let Some(&b) = bytes.get(*at) else {
                return Err(format!(
                    "ends after {} of {n} values (truncated or damaged)",
                    out.len()
                ));
            };
            *at += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 28 {
                return Err(format!("value {} is longer than 32 bits", out.len()));
            }
        }
        out.push(u32::try_from(v).map_err(|_| format!("value {} overflows 32 bits", out.len()))?);
    }
    Ok(out)
}

/// The most ids an id table holds: measured on SmolLM2 shards of 2k-8k positions at k = 20-128,
/// a table of the 2048 most frequent ids codes smaller than no table (+12%) or every id (+3-7%,
/// the table itself travelling uncompressed in the file's metadata).
pub const ID_TABLE_MAX: usize = 2048;

/// A file's id table: its most frequent ids (most frequent first, ties by id). An id is coded as
/// its index in the table, or as `table length + id` when the table lacks it.
#[derive(Clone, Debug, PartialEq)]
pub struct IdTable {
    ids: Vec<u32>,
    index: HashMap<u32, u32>,
}

impl IdTable {
    /// The table of at most `max` ids for a set of top-k lists.
    pub fn build<'a>(lists: impl Iterator<Item = &'a [u32]>, max: usize) -> Self {
        let mut counts: HashMap<u32, u64> = HashMap::new();
        for l in lists {
            for &id in l {
                *counts.entry(id).or_default() += 1;
            }
        }
        let mut by_count: Vec<(u32, u64)> = counts.into_iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        by_count.truncate(max);
        Self::from_ids(by_count.into_iter().map(|(id, _)| id).collect())
            .expect("counted ids are distinct")
    }

    /// A table as stored; refuses repeated ids (a code would be ambiguous).
    pub fn from_ids(ids: Vec<u32>) -> Result<Self, String> {
        let index: HashMap<u32, u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i as u32))
            .collect();
        if index.len() != ids.len() {
            return Err("repeats an id".into());
        }
        Ok(Self { ids, index })
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// `None` for an id so large its code would not fit 32 bits (no vocabulary is that large).
    pub fn code(&self, id: u32) -> Option<u32> {
        match self.index.get(&id) {
            Some(&i) => Some(i),
            None => id.checked_add(self.ids.len() as u32),
        }
    }

    /// The id a code stands for.
    pub fn id(&self, code: u32) -> u32 {
        match self.ids.get(code as usize) {
            Some(&id) => id,
            None => code - self.ids.len() as u32,
        }
    }
}

/// One position's top-k `(ids, logprobs)` sorted best first (stable: equal logprobs keep their
/// order), so the codec's offsets are non-negative.
pub fn sort_best_first(ids: &mut [u32], logprobs: &mut [f32]) {
    if logprobs.windows(2).all(|w| w[0] >= w[1]) {
        return;
    }
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by(|&a, &b| logprobs[b].total_cmp(&logprobs[a]));
    let (i0, l0) = (ids.to_vec(), logprobs.to_vec());
    for (dst, src) in order.into_iter().enumerate() {
        ids[dst] = i0[src];
        logprobs[dst] = l0[src];
    }
}

/// Appends one sorted position's `k − 1` offset increments at step `s` (see the module doc).
pub fn put_logprobs(out: &mut Vec<u8>, sorted: &[f32], step: f32) {
    let best = sorted[0] as f64;
    let mut prev = 0u32;
    for &l in &sorted[1..] {
        let c = (((best - l as f64) / step as f64).round().max(0.0) as u32).max(prev);
        put_varint(out, c - prev);
        prev = c;
    }
}

/// One position's logprobs from its `k − 1` increments and the exact top-k mass `P`.
pub fn logprobs_from(increments: &[u32], mass: f64, step: f32) -> Vec<f32> {
    let mut c = Vec::with_capacity(increments.len() + 1);
    c.push(0u64);
    for &d in increments {
        c.push(c[c.len() - 1] + d as u64);
    }
    let s = step as f64;
    let lse = c.iter().map(|&c| (-(c as f64) * s).exp()).sum::<f64>().ln();
    let best = mass.ln() - lse;
    c.iter().map(|&c| (best - c as f64 * s) as f32).collect()
}

/// `KL(p̂ ‖ p̂')` over the top-k and the tail bucket between exact logprobs and stored ones for one
/// position: what storing them cost.
pub fn kl_exact_stored(exact: &[f32], stored: &[f32]) -> f64 {
    let tail = |l: &[f32]| (1.0 - l.iter().map(|&x| (x as f64).exp()).sum::<f64>()).max(0.0);
    let kl: f64 = exact
        .iter()
        .zip(stored)
        .map(|(&a, &b)| (a as f64).exp() * (a as f64 - b as f64))
        .sum();
    let (t, t2) = (tail(exact), tail(stored));
    kl + if t > 0.0 {
        t * (t / t2.max(1e-300)).ln()
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_refuse_damage() {
        let values = [0, 1, 127, 128, 300, 16_383, 16_384, u32::MAX];
        let mut b = Vec::new();
        values.iter().for_each(|&v| put_varint(&mut b, v));
        assert_eq!(get_varints(&b, values.len()).unwrap(), values);
        assert!(get_varints(&b[..b.len() - 1], values.len()).is_err());
        assert!(get_varints(&b, values.len() - 1).is_err());
        assert!(get_varints(&[0xff; 6], 1).is_err());
        assert_eq!(get_counted(&put_counted(&values)).unwrap(), values);
        assert!(get_counted(&[200, 1]).is_err());
    }

    #[test]
    fn ids_code_through_the_table_or_past_it() {
        let lists: [&[u32]; 3] = [&[5, 9, 7], &[9, 5, 40_000], &[9, 1, 2]];
        let t = IdTable::build(lists.into_iter(), 2);
        assert_eq!(t.ids(), [9, 5]);
        for id in [9, 5, 7, 40_000, 0] {
            assert_eq!(t.id(t.code(id).unwrap()), id);
        }
        assert_eq!(t.code(7), Some(9));
        assert_eq!(t.code(u32::MAX), None);
        assert!(IdTable::from_ids(vec![3, 4, 3]).is_err());
    }

    #[test]
    fn stored_logprobs_are_within_one_step_and_keep_the_mass() {
        let exact: Vec<f32> = (0..50)
            .map(|j| -0.3 - j as f32 * 0.137 - (j as f32).sqrt())
            .collect();
        let mass: f64 = exact.iter().map(|&l| (l as f64).exp()).sum();
        for step in [1.0 / 8.0, 1.0 / 32.0, 1.0 / 256.0] {
            let mut b = Vec::new();
            put_logprobs(&mut b, &exact, step);
            let back = logprobs_from(&get_varints(&b, 49).unwrap(), mass, step);
            let err = exact
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err <= step + 1e-5, "step {step}: error {err}");
            assert!(err > 0.0);
            let mass2: f64 = back.iter().map(|&l| (l as f64).exp()).sum();
            assert!((mass - mass2).abs() < 1e-6, "{mass} vs {mass2}");
            assert!(kl_exact_stored(&exact, &back) < (step * step) as f64);
        }
    }
}
