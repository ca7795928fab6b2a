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
