//! Teacher benchmarks: scoring throughput in-process versus through `teacher serve` + the vLLM
//! client on loopback (the client's overhead), and the bytes per token of shards at several k in
//! both schemas, with what the compact one loses.

use crate::client::{ClientOptions, HttpTeacher};
use crate::local::LocalTeacher;
use crate::score::score_many;
use crate::server::{ServeOptions, serve};
use crate::{Scored, Teacher, TeacherError};
use k3mini_data::shards::{
    DEFAULT_LOGPROB_STEP, ShardMeta, ShardRow, Storage, column_bytes, read_shard, write_shard,
};
use k3mini_data::topk_codec::kl_exact_stored;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct TeacherBench {
    pub segments: usize,
    pub seq_len: usize,
    pub k: usize,
    pub in_process_tokens_per_s: f64,
    pub http_tokens_per_s: f64,
    /// The teacher's vocabulary.
    pub vocab: usize,
    /// Shards holding the segments, at each k.
    pub shards: Vec<ShardSize>,
}

/// What one k costs in each shard schema, measured on real rows.
#[derive(Clone, Debug, Serialize)]
pub struct ShardSize {
    pub k: usize,
    /// Bytes per scored position, schema v1 (exact).
    pub exact_bytes_per_token: f64,
    /// Bytes per scored position, schema v2.
    pub compact_bytes_per_token: f64,
    /// The v2 logprob step (nats).
    pub step: f32,
    /// Mean and largest `KL(exact ‖ stored)` per position over the top-k and the tail bucket.
    pub kl_mean: f64,
    pub kl_max: f64,
    /// Largest `|ℓ' − ℓ|` over every stored logprob.
    pub max_logprob_error: f32,
    /// The v2 files' bytes per position by column (and footer).
    pub compact_columns: Vec<(String, f64)>,
    /// The order-0 entropy of the top-k ids within each file (bits per id, weighted by ids): what
    /// an ideal coder of independent ids would need.
    pub id_entropy_bits: f64,
}

/// `Σ_i −c_i log2(c_i / n)` over the id counts of `ids`: their total order-0 information in bits.
fn id_information_bits(ids: &[u32]) -> f64 {
    let mut counts = std::collections::HashMap::<u32, u64>::new();
    ids.iter().for_each(|&i| *counts.entry(i).or_default() += 1);
    let n = ids.len() as f64;
    counts
        .values()
        .map(|&c| -(c as f64) * (c as f64 / n).log2())
        .sum()
}

/// Writes each file's `rows` (top-`meta.k`) cut to each of `ks` as a v1 and a v2 shard into `dir`,
/// reads the v2 ones back, and measures their size and what they lost.
pub fn shard_sizes(
    files: &[Vec<ShardRow>],
    meta: &ShardMeta,
    ks: &[usize],
    step: f32,
    dir: &std::path::Path,
) -> Result<Vec<ShardSize>, TeacherError> {
    std::fs::create_dir_all(dir).map_err(|e| TeacherError::Load {
        path: dir.into(),
        message: e.to_string(),
    })?;
    let positions: usize = files.iter().flatten().map(ShardRow::positions).sum();
    let mut sizes = Vec::new();
    for &kk in ks.iter().filter(|&&kk| kk <= meta.k) {
        let m = ShardMeta {
            k: kk,
            ..meta.clone()
        };
        let (mut exact_bytes, mut compact_bytes) = (0, 0);
        let (mut kl_sum, mut kl_max, mut err) = (0.0f64, 0.0f64, 0.0f32);
        let (mut columns, mut id_bits, mut id_count) = (Vec::<(String, f64)>::new(), 0.0, 0);
        for rows in files {
            let cut: Vec<ShardRow> = rows
                .iter()
                .map(|r| ShardRow {
                    top_ids: first_of_each(&r.top_ids, meta.k, kk),
                    top_logprobs: first_of_each(&r.top_logprobs, meta.k, kk),
                    ..r.clone()
                })
                .collect();
            let (exact, compact) = (dir.join("bench-v1.parquet"), dir.join("bench-v2.parquet"));
            exact_bytes += write_shard(&exact, &m, Storage::Exact, &cut)?;
            compact_bytes += write_shard(&compact, &m, Storage::Quantised { step }, &cut)?;
            let back = read_shard(&compact, None)?.rows;
            for (name, bytes) in column_bytes(&compact)? {
                match columns.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, b)) => *b += bytes as f64,
                    None => columns.push((name, bytes as f64)),
                }
            }
            let ids: Vec<u32> = cut.iter().flat_map(|r| r.top_ids.iter().copied()).collect();
            id_bits += id_information_bits(&ids);
            id_count += ids.len();
            for (a, b) in cut.iter().zip(&back) {
                for t in 0..a.positions() {
                    let (ai, al) = (&a.top_ids[t * kk..][..kk], &a.top_logprobs[t * kk..][..kk]);
                    let (bi, bl) = (&b.top_ids[t * kk..][..kk], &b.top_logprobs[t * kk..][..kk]);
                    // The writer sorts each top-k best first: compare id by id.
                    let stored: Vec<f32> = ai
                        .iter()
                        .map(|id| bi.iter().position(|x| x == id).map_or(f32::NAN, |j| bl[j]))
                        .collect();
                    let kl = kl_exact_stored(al, &stored);
                    kl_sum += kl;
                    kl_max = kl_max.max(kl);
                    err = al
                        .iter()
                        .zip(&stored)
                        .map(|(x, y)| (x - y).abs())
                        .fold(err, f32::max);
                }
            }
        }
        sizes.push(ShardSize {
            k: kk,
            exact_bytes_per_token: exact_bytes as f64 / positions as f64,
            compact_bytes_per_token: compact_bytes as f64 / positions as f64,
            step,
            kl_mean: kl_sum / positions as f64,
            kl_max,
            max_logprob_error: err,
            compact_columns: columns
                .into_iter()
                .map(|(n, b)| (n, b / positions as f64))
                .collect(),
            id_entropy_bits: id_bits / id_count.max(1) as f64,
        });
    }
    Ok(sizes)
}

/// Bits of a token id packed at `vocab`: ⌈log2 vocab⌉.
pub fn packed_id_bits(vocab: usize) -> u32 {
    usize::BITS - vocab.saturating_sub(1).leading_zeros()
}

/// A published top-k format's bytes per token at some vocabulary, by its own arithmetic (its
/// logprobs are lossy too).
#[derive(Clone, Debug, Serialize)]
pub struct PublishedFormat {
    pub name: &'static str,
    pub k: usize,
    pub bytes_per_token: f64,
}

/// What DistillKit and Megatron-LM store per token at `vocab`, ids packed at
/// [`packed_id_bits`]: DistillKit's exact_k bf16 values and a polynomial over rank in fp32
/// coefficients, Megatron-LM's fp16 top-k before its zstd.
pub fn published_formats(vocab: usize) -> Vec<PublishedFormat> {
    let ids = |k: usize| (k * packed_id_bits(vocab) as usize) as f64 / 8.0;
    let format = |name, k, values: f64| PublishedFormat {
        name,
        k,
        bytes_per_token: ids(k) + values,
    };
    vec![
        format(
            "DistillKit budget (exact_k 1, 3 terms)",
            50,
            2.0 + 3.0 * 4.0,
        ),
        format(
            "DistillKit recommended (exact_k 16, 6 terms)",
            128,
            16.0 * 2.0 + 6.0 * 4.0,
        ),
        format("Megatron-LM fp16 top-k, before its zstd", 128, 128.0 * 2.0),
    ]
}

fn timed(
    teacher: &dyn Teacher,
    inputs: &[&[u32]],
    k: usize,
) -> Result<(Vec<Scored>, f64), TeacherError> {
    let started = Instant::now();
    let scored = score_many(teacher, inputs, k, 1, &mut |_| {})?;
    let positions: usize = scored.iter().map(Scored::positions).sum();
    Ok((scored, positions as f64 / started.elapsed().as_secs_f64()))
}

/// Scoring tokens/s of two teachers on the same windows at top-`k`, interleaved `a b a b …` over
/// `rounds` (these machines are shared: compare within a round): one `(a, b)` per round.
pub fn engines(
    a: &dyn Teacher,
    b: &dyn Teacher,
    inputs: &[&[u32]],
    k: usize,
    rounds: usize,
) -> Result<Vec<(f64, f64)>, TeacherError> {
    (0..rounds)
        .map(|_| Ok((timed(a, inputs, k)?.1, timed(b, inputs, k)?.1)))
        .collect()
}

/// Scores `inputs` (windows of one length) at the largest of `ks`, in process and through a
/// loopback server, and writes a shard at each k (top-k of the largest k) into `dir`.
pub fn bench_teacher(
    teacher: Arc<LocalTeacher>,
    inputs: &[&[u32]],
    ks: &[usize],
    dir: &std::path::Path,
) -> Result<TeacherBench, TeacherError> {
    let seq_len = inputs.first().map_or(0, |w| w.len());
    let k = ks.iter().copied().max().unwrap_or(20);
    let (scored, in_process) = timed(teacher.as_ref(), inputs, k)?;

    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let (teacher, stop) = (teacher.clone(), stop.clone());
        std::thread::spawn(move || {
            let options = ServeOptions {
                max_queued: 2,
                request_timeout: None,
                ..Default::default()
            };
            serve(teacher, "127.0.0.1:0", options, stop, |addr| {
                tx.send(addr).expect("bench waits")
            })
        })
    };
    let addr = rx
        .recv()
        .map_err(|_| TeacherError::Server("the bench server did not start".into()))?;
    let client = HttpTeacher::connect(
        &[format!("http://{addr}")],
        teacher.vocab_size(),
        ClientOptions::default(),
    );
    let remote = client.and_then(|c| timed(&c, inputs, k));
    stop.store(true, Ordering::SeqCst);
    let _ = server.join();
    let (remote_scored, http) = remote?;
    if remote_scored != scored {
        return Err(TeacherError::Server(
            "HTTP and in-process scores differ".into(),
        ));
    }

    let rows: Vec<ShardRow> = scored
        .iter()
        .enumerate()
        .map(|(i, s)| s.clone().into_row(0, i as u32, None))
        .collect();
    let meta = ShardMeta {
        teacher: teacher.name().into(),
        tokenizer_sha256: teacher.tokenizer.fingerprint(),
        k,
        temperature: 1.0,
        vocab: Some(teacher.vocab_size()),
    };
    let sizes = shard_sizes(&[rows], &meta, ks, DEFAULT_LOGPROB_STEP, dir)?;
    Ok(TeacherBench {
        segments: inputs.len(),
        seq_len,
        k,
        in_process_tokens_per_s: in_process,
        http_tokens_per_s: http,
        vocab: teacher.vocab_size(),
        shards: sizes,
    })
}

/// The first `kk` of every row of `k` (the top-kk of a top-k list).
fn first_of_each<T: Copy>(v: &[T], k: usize, kk: usize) -> Vec<T> {
    v.chunks(k)
        .flat_map(|row| row[..kk].iter().copied())
        .collect()
}
