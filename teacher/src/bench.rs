//! Teacher benchmarks: scoring throughput in-process versus through `teacher serve` + the vLLM
//! client on loopback (the client's overhead), and the bytes per token of shards at several k.

use crate::client::{ClientOptions, HttpTeacher};
use crate::local::LocalTeacher;
use crate::score::score_many;
use crate::server::serve;
use crate::{Scored, Teacher, TeacherError};
use k3mini_data::shards::{ShardMeta, ShardRow, write_shard};
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
    /// `(k, bytes per scored position)` of a shard holding the segments.
    pub shard_bytes_per_token: Vec<(usize, f64)>,
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

/// Scores the first `segments` windows of `seq_len` of `ids` at the largest of `ks`, in process and
/// through a loopback server, and writes a shard at each k (top-k of the largest k) into `dir`.
pub fn bench_teacher(
    teacher: Arc<LocalTeacher>,
    ids: &[u32],
    seq_len: usize,
    segments: usize,
    ks: &[usize],
    dir: &std::path::Path,
) -> Result<TeacherBench, TeacherError> {
    let inputs: Vec<&[u32]> = ids
        .chunks(seq_len)
        .filter(|c| c.len() == seq_len)
        .take(segments)
        .collect();
    let k = ks.iter().copied().max().unwrap_or(20);
    let (scored, in_process) = timed(teacher.as_ref(), &inputs, k)?;

    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let server = {
        let (teacher, stop) = (teacher.clone(), stop.clone());
        std::thread::spawn(move || {
            serve(teacher, "127.0.0.1:0", 2, None, stop, |addr| {
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
    let remote = client.and_then(|c| timed(&c, &inputs, k));
    stop.store(true, Ordering::SeqCst);
    let _ = server.join();
    let (remote_scored, http) = remote?;
    if remote_scored != scored {
        return Err(TeacherError::Server(
            "HTTP and in-process scores differ".into(),
        ));
    }

    std::fs::create_dir_all(dir).map_err(|e| TeacherError::Load {
        path: dir.into(),
        message: e.to_string(),
    })?;
    let mut sizes = Vec::new();
    for &kk in ks {
        let rows: Vec<ShardRow> = scored
            .iter()
            .enumerate()
            .map(|(i, s)| ShardRow {
                doc_id: 0,
                segment: i as u32,
                input_ids: s.ids.clone(),
                target_logprobs: s.target_logprobs.clone(),
                top_ids: first_of_each(&s.top_ids, k, kk),
                top_logprobs: first_of_each(&s.top_logprobs, k, kk),
            })
            .collect();
        let meta = ShardMeta {
            teacher: teacher.name().into(),
            tokenizer_sha256: teacher.tokenizer.fingerprint(),
            k: kk,
            temperature: 1.0,
            vocab: Some(teacher.vocab_size()),
        };
        let bytes = write_shard(&dir.join(format!("bench-k{kk}.parquet")), &meta, &rows)?;
        let positions: usize = rows.iter().map(ShardRow::positions).sum();
        sizes.push((kk, bytes as f64 / positions as f64));
    }
    Ok(TeacherBench {
        segments: inputs.len(),
        seq_len,
        k,
        in_process_tokens_per_s: in_process,
        http_tokens_per_s: http,
        shard_bytes_per_token: sizes,
    })
}

/// The first `kk` of every row of `k` (the top-kk of a top-k list).
fn first_of_each<T: Copy>(v: &[T], k: usize, kk: usize) -> Vec<T> {
    v.chunks(k)
        .flat_map(|row| row[..kk].iter().copied())
        .collect()
}
