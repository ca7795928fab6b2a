//! Distillation end to end with the real SmolLM2 teacher: `k3mini teacher score` writes shards for
//! a small corpus, the student trains from them with every objective, a stopped and resumed run is
//! bit-identical to a straight one, the CE baseline reads the same rows, and incomplete or
//! mismatched shards are refused with the reason.
use k3mini::compare::{summarise, table};
use k3mini::recipe;
use k3mini::run_dir::{StepMetrics, read_metrics};
use k3mini::train::trainer::{TrainOptions, train};
use std::path::{Path, PathBuf};

const LINES: [&str; 3] = [
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer \
     the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day, to the \
     last syllable of recorded time; and all our yesterdays have lighted fools the way to dusty death.",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. \
     The evil that men do lives after them; the good is oft interred with their bones.",
];

/// A recipe over the three files; runs named `seq…` train on `prompts.jsonl`'s trajectories
/// (`mode = "sequence"`), runs named `online…` with the teacher in the loop, runs named
/// `onpolicy…` on their own samples half the time.
fn recipe_text(dir: &Path, name: &str, objectives: &str, steps: usize) -> String {
    let mode = match name {
        n if n.starts_with("seq") => "sequence",
        n if n.starts_with("online") => "online",
        n if n.starts_with("onpolicy") => "on_policy",
        _ => "offline",
    };
    format!(
        r#"[run]
name = "{name}"
seed = 5
out_dir = "{out}"
[model]
preset = "tiny"
vocab_size = 49152
d_model = 64
[data]
tokenizer = "teacher"
seq_len = 16
held_out_fraction = 0.34
[[data.sources]]
path = "a.txt"
[[data.sources]]
path = "b.txt"
[[data.sources]]
path = "c.txt"
[teacher]
model = "smollm2"
k = 4
segments_per_shard = 3
shards_dir = "{shards}"
[distill]
temperature = 2.0
objectives = {objectives}
mode = "{mode}"
[optim]
lr = 3e-3
[schedule]
kind = "constant"
warmup_steps = 0
[train]
steps = {steps}
batch_tokens = 64
micro_batch = 2
eval_every = 2
eval_batches = 1
checkpoint_every = 2
[teacher.generate]
prompts = [{{ path = "prompts.jsonl" }}]
max_tokens = 6
temperature = 0.8
prompts_per_shard = 2
{on_policy}"#,
        out = dir.join("runs").join(name).display(),
        on_policy = if mode == "on_policy" {
            "[distill.on_policy]\nmix = 0.5\nmax_tokens = 4\n"
        } else {
            ""
        },
        shards = dir.join("shards").display(),
    )
}

fn write_recipe(dir: &Path, name: &str, objectives: &str, steps: usize) -> recipe::RunPlan {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, recipe_text(dir, name, objectives, steps)).unwrap();
    recipe::load(&path).unwrap()
}

fn quiet() -> TrainOptions {
    TrainOptions {
        ..Default::default()
    }
}

/// The newest checkpoint's tensors: the safetensors header without its `__metadata__` (burn writes
/// that map in hash order) and the data bytes.
/// Runs `k3mini teacher COMMAND --quiet RECIPE` and insists it succeeds.
fn teacher(command: &str, recipe: &Path) {
    let recipe = recipe.as_os_str();
    crate::fixture::k3mini_ok([
        "teacher".as_ref(),
        command.as_ref(),
        "--quiet".as_ref(),
        recipe,
    ]);
}

/// Trains `recipe` straight, and again stopped after `stop` steps then resumed into `name`: the
/// two end with the same tensors. Returns the straight run's directory.
fn resumes_exactly(recipe: &recipe::RunPlan, dir: &Path, name: &str, stop: usize) -> PathBuf {
    let straight = train(recipe, &quiet()).unwrap();
    let split_dir = dir.join("runs").join(name);
    let split = |resume, stop_after| TrainOptions {
        out_dir: Some(split_dir.clone()),
        resume,
        stop_after,
        ..Default::default()
    };
    train(recipe, &split(false, Some(stop))).unwrap();
    train(recipe, &split(true, None)).unwrap();
    assert_eq!(weights(&straight.out_dir), weights(&split_dir), "{name}");
    straight.out_dir
}

fn weights(out: &Path) -> (serde_json::Value, Vec<u8>) {
    let (_, dir) = k3mini_checkpoints::latest(out).unwrap().unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    (header, bytes[8 + n..].to_vec())
}

fn metrics(out: &Path) -> Vec<StepMetrics> {
    read_metrics(out).unwrap()
}

#[test]
fn students_distil_from_real_teacher_shards_and_resume_exactly() {
    let dir: PathBuf = std::env::temp_dir().join(format!("k3mini-distill-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in ["a.txt", "b.txt", "c.txt"].iter().zip(LINES) {
        std::fs::write(dir.join(name), text).unwrap();
    }
    std::fs::write(
        dir.join("prompts.jsonl"),
        "{\"prompt\": \"Name a colour.\"}\n{\"prompt\": \"Say hello.\"}\n{\"prompt\": \"Count to two.\"}\n",
    )
    .unwrap();
    let kd = r#"[{ kind = "forward_kl", weight = 0.7 }, { kind = "ce", weight = 0.3 }]"#;
    let main = write_recipe(&dir, "kd", kd, 4);
    // Training before scoring says what to run.
    let e = train(&main, &quiet()).unwrap_err().to_string();
    assert!(e.contains("k3mini teacher score"), "{e}");
    teacher("score", &dir.join("kd.toml"));

    // Straight, and stopped after 2 steps then resumed: the same weights and metrics.
    let straight = resumes_exactly(&main, &dir, "split", 2);
    let split_dir = dir.join("runs/split");
    let strip = |ms: Vec<StepMetrics>| -> Vec<(usize, u64, Option<u64>)> {
        ms.into_iter()
            .map(|m| (m.step, m.loss.to_bits(), m.eval_loss.map(f64::to_bits)))
            .collect()
    };
    assert_eq!(strip(metrics(&straight)), strip(metrics(&split_dir)));
    let m = metrics(&straight);
    assert_eq!(m.last().unwrap().step, 4);
    let last = m.last().unwrap();
    assert!(last.loss.is_finite() && last.eval_loss.is_some());
    let (top1, kl) = (last.eval_top1.unwrap(), last.eval_kl.unwrap());
    assert!((0.0..=1.0).contains(&top1) && kl > 0.0, "{top1} {kl}");
    // As two ranks (threads of this process) in the ordered reduction, each skipping the other's
    // rows unassembled: one process's losses, held-out figures and weights, to the bit. Both start
    // from one checkpoint: thread ranks share the random state a fresh model draws from.
    let init = dir.join("runs/kd-init");
    let model = k3mini_student::K3Mini::new(&main.model, &burn::tensor::Device::flex()).unwrap();
    k3mini::run_dir::write_weights(&main.clone().with_out_dir(&init), &model, 0).unwrap();
    let mut ordered = recipe::load_from(&dir.join("kd.toml"), &init).unwrap();
    ordered.train.reduction = recipe::Reduction::Ordered;
    let (one, two) = (dir.join("runs/kd-one"), dir.join("runs/kd-ranks"));
    let into = |out: &Path| TrainOptions {
        out_dir: Some(out.to_path_buf()),
        ..quiet()
    };
    train(&ordered, &into(&one)).unwrap();
    crate::train::thread_ranks(&ordered, &two, 2, quiet());
    assert_eq!(strip(metrics(&one)), strip(metrics(&two)));
    let held = |m: &StepMetrics| (m.eval_top1.map(f64::to_bits), m.eval_kl.map(f64::to_bits));
    let (a, b) = (metrics(&one), metrics(&two));
    assert!(a.iter().map(held).eq(b.iter().map(held)));
    assert!(a.last().unwrap().eval_top1.is_some());
    assert_eq!(weights(&one), weights(&two));

    // Every objective trains (finite loss, a step taken) from the same shards.
    for objective in [
        r#"[{ kind = "ce" }]"#,
        r#"[{ kind = "topk_kl" }]"#,
        r#"[{ kind = "topk_kl_renormalised" }]"#,
        r#"[{ kind = "reverse_kl" }]"#,
        r#"[{ kind = "jsd", beta = 0.3 }]"#,
        r#"[{ kind = "skew_kl", alpha = 0.2 }]"#,
        r#"[{ kind = "skew_reverse_kl" }]"#,
        r#"[{ kind = "sampled", samples = 8 }, { kind = "ce", weight = 0.1 }]"#,
    ] {
        let r = write_recipe(&dir, "each", objective, 1);
        std::fs::remove_dir_all(dir.join("runs/each")).ok();
        let s = train(&r, &quiet()).unwrap();
        assert!(s.last_loss.unwrap().is_finite(), "{objective}");
    }
    // The CE baseline over the same rows, compared side by side.
    let ce = write_recipe(&dir, "ce", r#"[{ kind = "ce" }]"#, 4);
    let ce_run = train(&ce, &quiet()).unwrap();
    let t = table(&[
        summarise(&straight).unwrap(),
        summarise(&ce_run.out_dir).unwrap(),
    ]);
    assert_eq!(t.lines().count(), 4, "{t}");
    assert!(t.contains("| 4 | 256 |"), "{t}");
    // Sequence-level KD on the teacher's own completions (prompt positions masked).
    let seq = write_recipe(&dir, "seq", kd, 2);
    let e = train(&seq, &quiet()).unwrap_err().to_string();
    assert!(e.contains("k3mini teacher generate"), "{e}");
    teacher("generate", &dir.join("seq.toml"));
    let s = train(&seq, &quiet()).unwrap();
    assert!(s.last_loss.unwrap().is_finite() && s.eval_loss.unwrap().is_finite());
    // The teacher in the loop: no shards read, and a resumed run asks for the same batches.
    let online = write_recipe(&dir, "online", kd, 2);
    let straight = resumes_exactly(&online, &dir, "online-split", 1);
    let last = metrics(&straight).pop().unwrap();
    assert!(last.eval_top1.is_some() && last.loss.is_finite());
    // On-policy: the student samples, the teacher scores; resumable like the rest.
    let onp = write_recipe(&dir, "onpolicy", kd, 3);
    let straight = resumes_exactly(&onp, &dir, "onpolicy-split", 1);
    let m = metrics(&straight);
    assert!(
        m.iter().any(|s| s.on_policy_kl.is_some_and(f64::is_finite)),
        "some micro-batch was on-policy"
    );
    // On two CPU replicas, a micro-batch each (the samples drawn from the first device's weights
    // while the second computes): the numbers of one device, to the bit.
    let two_dir = dir.join("runs/onpolicy-two");
    let two = onp
        .clone()
        .with_devices("cpu,cpu".parse().unwrap())
        .unwrap()
        .with_out_dir(&two_dir);
    train(&two, &quiet()).unwrap();
    let bits = |m: &[StepMetrics]| -> Vec<(u64, Option<u64>)> {
        m.iter()
            .map(|s| (s.loss.to_bits(), s.on_policy_kl.map(f64::to_bits)))
            .collect()
    };
    assert_eq!(bits(&m), bits(&metrics(&two_dir)));
    assert!(weights(&straight) == weights(&two_dir), "the same weights");
    // A run whose data.seq_len differs from the shards', and an unfinished scoring job, are refused.
    let other = recipe_text(&dir, "other", kd, 2).replace("seq_len = 16", "seq_len = 32");
    std::fs::write(dir.join("other.toml"), other).unwrap();
    let e = train(&recipe::load(&dir.join("other.toml")).unwrap(), &quiet())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("16-token segments but data.seq_len is 32"),
        "{e}"
    );
    // A shard whose bytes changed after it was written (here one byte of the data pages flipped
    // in each; a zeroed checksum is the same case) is refused by name before any of it trains.
    let shards: Vec<PathBuf> = std::fs::read_dir(dir.join("shards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "parquet"))
        .collect();
    let originals: Vec<Vec<u8>> = shards.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for (path, good) in shards.iter().zip(&originals) {
        let mut bad = good.clone();
        bad[good.len() / 2] ^= 0x40;
        std::fs::write(path, &bad).unwrap();
    }
    let damaged = TrainOptions {
        out_dir: Some(dir.join("runs/damaged")),
        ..Default::default()
    };
    let e = train(&main, &damaged).unwrap_err().to_string();
    assert!(
        e.contains("shards/shard-0") && e.contains("checksum mismatch"),
        "{e}"
    );
    for (path, good) in shards.iter().zip(&originals) {
        std::fs::write(path, good).unwrap();
    }
    // A corpus edited since scoring is caught before training on stale signals.
    let original = std::fs::read(dir.join("b.txt")).unwrap();
    std::fs::write(dir.join("b.txt"), "Tomorrow, and tomorrow, and yesterday.").unwrap();
    let fresh = TrainOptions {
        out_dir: Some(dir.join("runs/changed")),
        ..Default::default()
    };
    let e = train(&main, &fresh).unwrap_err().to_string();
    assert!(e.contains("changed since scoring"), "{e}");
    std::fs::write(dir.join("b.txt"), original).unwrap();
    let manifest = dir.join("shards/manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    // A manifest with more entries than its job has shards is named as inconsistent.
    let mut more = m.clone();
    let extra = more["shards"][0].clone();
    more["shards"].as_array_mut().unwrap().push(extra);
    std::fs::write(&manifest, more.to_string()).unwrap();
    let e = train(&main, &damaged).unwrap_err().to_string();
    assert!(e.contains("it is inconsistent"), "{e}");
    // Shards from before documents were keyed (no corpus fingerprint) are refused by name.
    let mut unkeyed = m.clone();
    unkeyed["job"]
        .as_object_mut()
        .unwrap()
        .remove("sources_sha256");
    std::fs::write(&manifest, unkeyed.to_string()).unwrap();
    let e = train(&main, &damaged).unwrap_err().to_string();
    assert!(e.contains("from before corpora streamed"), "{e}");
    m["shards"].as_array_mut().unwrap().pop();
    std::fs::write(&manifest, m.to_string()).unwrap();
    std::fs::remove_dir_all(dir.join("runs/each")).ok();
    let r = write_recipe(&dir, "each", kd, 1);
    let e = train(&r, &quiet()).unwrap_err().to_string();
    assert!(e.contains("shards are finished"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `recipe_text` for a student on the 4k Shakespeare BPE (not the teacher's vocabulary), its
/// shards in `cross-shards`.
fn cross_recipe(dir: &Path, name: &str, objectives: &str, steps: usize) -> PathBuf {
    for (file, text) in ["a.txt", "b.txt", "c.txt"].iter().zip(LINES) {
        std::fs::write(dir.join(file), text).unwrap();
    }
    std::fs::write(dir.join("prompts.jsonl"), "{\"prompt\": \"Say hello.\"}\n").unwrap();
    let bpe = crate::fixture::root().join("recipes/corpus/shakespeare-bpe4k.json");
    let text = recipe_text(dir, name, objectives, steps)
        .replace(
            "tokenizer = \"teacher\"",
            &format!("tokenizer = \"{}\"", bpe.display()),
        )
        .replace("vocab_size = 49152", "vocab_size = 4096")
        .replace("/shards\"", "/cross-shards\"");
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn students_distil_across_vocabularies_and_resume_exactly() {
    let dir: PathBuf = std::env::temp_dir().join(format!("k3mini-cross-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let all = r#"[{ kind = "ce", weight = 0.5 }, { kind = "alm", weight = 0.5 }, { kind = "xtoken", weight = 0.5 }]"#;
    let path = cross_recipe(&dir, "cross", all, 4);
    // `recipe check` says which objectives need which teacher.
    let out = crate::fixture::k3mini_ok(["recipe".as_ref(), "check".as_ref(), path.as_os_str()]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("its own vocabulary")
            && said.contains("alm (cross-vocabulary")
            && said.contains("xtoken (cross-vocabulary")
            && said.contains("ce (hard labels"),
        "{said}"
    );
    // A same-vocabulary objective beside a cross-vocabulary one is refused by name.
    let mixed = cross_recipe(
        &dir,
        "mixed",
        r#"[{ kind = "forward_kl" }, { kind = "alm" }]"#,
        1,
    );
    let e = recipe::load(&mixed).unwrap_err().to_string();
    assert!(
        e.contains("forward_kl needs a teacher of the student's vocabulary"),
        "{e}"
    );
    // Aligned shards carry no routing: a cross recipe asking for it is refused.
    let routed = cross_recipe(&dir, "routed", all, 1);
    let text = std::fs::read_to_string(&routed).unwrap();
    std::fs::write(&routed, text.replace("k = 4\n", "k = 4\nrouting = true\n")).unwrap();
    let e = recipe::load(&routed).unwrap_err().to_string();
    assert!(e.contains("carry no routing"), "{e}");
    // A same-vocabulary recipe whose teacher has another vocabulary is refused at scoring.
    let same = cross_recipe(&dir, "same", r#"[{ kind = "forward_kl" }]"#, 1);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args([
            "teacher".as_ref(),
            "score".as_ref(),
            "--quiet".as_ref(),
            same.as_os_str(),
        ])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("`alm` / `xtoken`"),
        "{e}"
    );

    teacher("score", &path);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("cross-shards/manifest.json")).unwrap())
            .unwrap();
    assert!(
        manifest["job"]["teacher_tokenizer_sha256"].is_string(),
        "{manifest}"
    );
    // Straight, and stopped after 2 steps then resumed: the same weights.
    let plan = recipe::load(&path).unwrap();
    let straight = resumes_exactly(&plan, &dir, "cross-split", 2);
    let last = metrics(&straight).pop().unwrap();
    assert!(last.loss.is_finite() && last.eval_loss.is_some_and(f64::is_finite));
    let (top1, kl) = (last.eval_top1.unwrap(), last.eval_kl.unwrap());
    assert!(
        (0.0..=1.0).contains(&top1) && kl.is_finite() && kl > 0.0,
        "{top1} {kl}"
    );
    // Each cross objective alone, and the CE baseline, train from the same shards.
    for objective in [
        r#"[{ kind = "alm" }]"#,
        r#"[{ kind = "xtoken" }]"#,
        r#"[{ kind = "ce" }]"#,
    ] {
        let r = recipe::load(&cross_recipe(&dir, "each", objective, 1)).unwrap();
        std::fs::remove_dir_all(dir.join("runs/each")).ok();
        let s = train(&r, &quiet()).unwrap();
        assert!(s.last_loss.unwrap().is_finite(), "{objective}");
    }
    // Same-vocabulary objectives over aligned shards are refused, not trained on projected ids.
    std::fs::remove_dir_all(dir.join("runs/same")).ok();
    let e = train(&recipe::load(&same).unwrap(), &quiet())
        .unwrap_err()
        .to_string();
    assert!(e.contains("cross-tokenizer job's"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The cosine of two gradients.
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn one_tokenizer_through_the_cross_path_is_forward_kl() {
    use burn::tensor::Device;
    use k3mini_data::align::Aligner;
    use k3mini_data::aligned::AlignedRow;
    use k3mini_data::shards::ShardRow;
    use k3mini_data::signals::{SignalRow, assemble};
    use k3mini_student::distill::{Objective, alm_chunk};
    use k3mini_student::head::HeadChunks;
    let dir = std::env::temp_dir().join(format!("k3mini-cross-grad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = recipe::load(&cross_recipe(
        &dir,
        "grad",
        r#"[{ kind = "forward_kl" }]"#,
        1,
    ))
    .unwrap();
    let bpe = k3mini::teachers::student_tokenizer(&plan.data.tokenizer).unwrap();
    let ids = bpe.encode(LINES[1]).unwrap();
    let (n, k) = (ids.len(), 4);
    // A teacher of the student's own vocabulary, made up: the next id and three others.
    let mut seed = 3;
    let mut top_ids = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut targets = Vec::new();
    for t in 0..n - 1 {
        let u = k3mini_data::rng::uniform(&mut seed) as f32;
        let row = [
            ids[t + 1],
            4000 + t as u32 % 50,
            3000 + t as u32,
            2000 + t as u32,
        ];
        let lp = [-0.3 - u, -1.9 - u, -2.5, -3.1 - u];
        top_ids.extend(row);
        top_logprobs.extend(lp);
        targets.push(lp[0]);
    }
    let scored = ShardRow {
        doc_id: 1,
        segment: 0,
        input_ids: ids.clone(),
        parts: None,
        target_logprobs: targets.clone(),
        top_ids: top_ids.clone(),
        top_logprobs: top_logprobs.clone(),
    };
    let aligner = Aligner::new(&bpe, &bpe).unwrap();
    let retok = aligner.retokenize(&ids).unwrap();
    assert_eq!(retok.teacher_ids, ids);
    let aligned = AlignedRow {
        doc_id: 1,
        segment: 0,
        input_ids: ids.clone(),
        parts: None,
        chunks: aligner.chunk_signals(&ids, &retok, &targets, &top_ids, &top_logprobs, k),
    };
    let train_on = Default::default();
    let same = SignalRow::from_scores(scored, k, k, &train_on);
    let cross = SignalRow::from_aligned(aligned, k, &train_on);
    let vocab = plan.model.vocab_size;
    let same_batch = assemble(&[&same], n, k, vocab);
    let cross_batch = assemble(&[&cross], n, k, vocab);
    assert_eq!(
        cross_batch.chunks.len(),
        n - 1,
        "a chunk per predicted token"
    );

    let device = Device::flex().autodiff();
    let model = k3mini_student::K3Mini::new(&plan.model, &device).unwrap();
    let base = plan.distill.clone().unwrap();
    let with = |objectives: Vec<Objective>, alm: bool| recipe::DistillPlan {
        objectives: objectives
            .into_iter()
            .map(|objective| recipe::WeightedObjective {
                weight: 1.0,
                objective,
            })
            .collect(),
        alm: alm.then_some(recipe::AlmPlan {
            weight: 1.0,
            temperature: 1.0,
        }),
        ..base.clone()
    };
    let grad = |batch, d: &recipe::DistillPlan, chunks| {
        let loss = k3mini::train::distill::distill_loss(&model, batch, d, 1.0, chunks, 0).loss;
        let value = loss.clone().into_scalar::<f32>() as f64;
        let g = model.lm_head.weight.grad(&loss.backward()).unwrap();
        (value, g.into_data().iter::<f32>().collect::<Vec<f32>>())
    };
    let whole = HeadChunks::Whole;
    let (kl, g_kl) = grad(&same_batch, &with(vec![Objective::ForwardKl], false), whole);
    let (xt, g_xt) = grad(&cross_batch, &with(vec![Objective::Xtoken], false), whole);
    // The projection of a vocabulary onto itself is the identity: the same loss and gradient, to
    // f32 rounding (the two forwards run apart, and the backend's parallel sums may round
    // differently under load: 1.9e-6 apart at 18.1 once).
    assert!(
        (kl - xt).abs() < 1e-6 * kl.abs() && cosine(&g_kl, &g_xt) > 1.0 - 1e-6,
        "{kl} {xt}"
    );
    // ALM over one-token chunks matches the likelihood of the observed token only, so it agrees
    // with the forward KL in direction, not magnitude (cosine 0.84 here at T = 1).
    let alm = with(Vec::new(), true);
    let (a, g_alm) = grad(&cross_batch, &alm, whole);
    let c = cosine(&g_kl, &g_alm);
    assert!(c > 0.5, "{c}");
    // Its value is the mean over chunks of the binarised divergence of directly computed chunk
    // log-likelihoods; cutting the head into pieces (here 5 positions) changes nothing.
    let logits = model.forward(burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(ids.iter().map(|&i| i as i64).collect(), [1, n]),
        &device,
    ));
    let lq: Vec<f32> = burn::tensor::activation::log_softmax(logits, 2)
        .into_data()
        .iter::<f32>()
        .collect();
    let direct: f64 = cross_batch
        .chunks
        .iter()
        .map(|c| {
            let s: f64 = (c.first..=c.last)
                .map(|p| lq[p * vocab + ids[p + 1] as usize] as f64)
                .sum();
            alm_chunk(c.logprob as f64, s, 1.0).0
        })
        .sum::<f64>()
        / cross_batch.chunks.len() as f64;
    assert!(
        (a - direct).abs() < 1e-4 * direct.abs().max(1.0),
        "{a} {direct}"
    );
    let (cut, g_cut) = grad(&cross_batch, &alm, HeadChunks::Tokens(5));
    assert!(
        (cut - a).abs() < 1e-5 && cosine(&g_cut, &g_alm) > 1.0 - 1e-5,
        "{cut} {a}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
