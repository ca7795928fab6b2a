//! The training loop end to end on a small real corpus (this repository's own sources and a play):
//! exact resume, the loss falling, non-finite steps, corrupt checkpoints.
use crate::fixture::{Recipe, Scratch};
use k3mini::recipe;
use k3mini::run_dir::{StepMetrics, read_metrics};
use k3mini::train::ranks::{Attempt, Ranks};
use k3mini::train::trainer::{TrainOptions, TrainSummary, train, train_in};
use k3mini_data::tokenizer::train_byte_level_bpe;
use std::path::{Path, PathBuf};

/// A scratch dir with a BPE tokenizer trained on real text and a recipe using it.
pub(crate) fn setup(tag: &str, steps: usize, extra: &str) -> (Scratch, PathBuf) {
    let scratch = Scratch::new(&format!("train-{tag}"));
    let dir = scratch.0.clone();
    let root = crate::fixture::root();
    // doc0, the held-out one, is a fixed 12 KB of a play: every stream fills its shuffle block
    // with BLOCK copies of a document this small corpus repeats, so a large one (the README,
    // 150 KB) made tokenizing, not training, most of each test's time, and moved with each edit.
    let play =
        std::fs::read_to_string(root.join("recipes/corpus/shakespeare/tempest.txt")).unwrap();
    let excerpt = &play[..play[..12_000].rfind('\n').unwrap() + 1];
    let mut corpus = Vec::new();
    for (i, f) in [
        "student/src/kda.rs",
        "student/src/mla.rs",
        "kernels/src/kda/chunk.rs",
    ]
    .iter()
    .enumerate()
    {
        let p = dir.join(format!("doc{}.txt", i + 1));
        std::fs::copy(root.join(f), &p).unwrap();
        corpus.push(p.display().to_string());
    }
    let doc0 = dir.join("doc0.txt");
    std::fs::write(&doc0, excerpt).unwrap();
    corpus.insert(0, doc0.display().to_string());
    train_byte_level_bpe(
        &corpus,
        512,
        &["<|im_start|>", "<|im_end|>"],
        &dir.join("tok.json"),
    )
    .unwrap();
    let sources: String = (0..4)
        .map(|i| format!("[[data.sources]]\npath = \"doc{i}.txt\"\n"))
        .collect();
    let recipe = Recipe::default()
        // Seed 1 holds doc0.txt out: the split hashes each document (doc0's draw is 0.12).
        .with("run", "name = \"t\"\nseed = 1")
        .with("model", "preset = \"tiny\"\nvocab_size = 512\nd_model = 64")
        .with(
            "data",
            &format!("tokenizer = \"tok.json\"\nseq_len = 64\nheld_out_fraction = 0.25\n{sources}"),
        )
        .with("schedule", "kind = \"cosine\"\nwarmup_steps = 2")
        .with(
            "train",
            &format!(
                "steps = {steps}\nbatch_tokens = 256\nmicro_batch = 2\neval_every = 4\n\
                 eval_batches = 2\ncheckpoint_every = 3"
            ),
        )
        .extra(extra)
        .text();
    let path = dir.join("recipe.toml");
    std::fs::write(&path, recipe).unwrap();
    (scratch, path)
}

pub(crate) fn metrics(out: &Path) -> Vec<StepMetrics> {
    read_metrics(out).unwrap()
}

/// Trains `r` into `out` for `steps` steps (with a checkpoint at the last).
pub(crate) fn train_steps(r: &recipe::RunPlan, out: &Path, steps: usize) {
    let stop = TrainOptions {
        stop_after: Some(steps),
        ..opts(out)
    };
    train(r, &stop).unwrap();
}

/// Resumes `r` in `out` from its newest checkpoint to the end.
pub(crate) fn resume_run(r: &recipe::RunPlan, out: &Path) {
    let resume = TrainOptions {
        resume: true,
        ..opts(out)
    };
    train(r, &resume).unwrap();
}

pub(crate) fn opts(out: &Path) -> TrainOptions {
    TrainOptions {
        out_dir: Some(out.to_path_buf()),
        ..Default::default()
    }
}

#[test]
fn stop_and_resume_is_bit_identical_to_a_straight_run() {
    let (s, path) = setup("resume", 8, "");
    let r = recipe::load(&path).unwrap();
    let straight = s.0.join("straight");
    train(&r, &opts(&straight)).unwrap();
    let split = s.0.join("split");
    let first = train(
        &r,
        &TrainOptions {
            stop_after: Some(3),
            ..opts(&split)
        },
    )
    .unwrap();
    assert_eq!(first.last_step, 3);
    assert!(
        train(&r, &opts(&split))
            .unwrap_err()
            .to_string()
            .contains("--resume"),
        "refuses to overwrite"
    );
    let second = train(
        &r,
        &TrainOptions {
            resume: true,
            ..opts(&split)
        },
    )
    .unwrap();
    assert_eq!((second.first_step, second.last_step), (3, 8));
    let (a, b) = (metrics(&straight), metrics(&split));
    assert_eq!(a.len(), 8);
    let bits = |m: &[StepMetrics]| {
        m.iter()
            .map(|x| (x.step, x.loss.to_bits(), x.eval_loss.map(f64::to_bits)))
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&a), bits(&b), "per-step losses identical to the bit");
    assert!(
        a.iter().any(|m| m.eval_loss.is_some()),
        "held-out loss is reported"
    );
}

#[test]
fn ci_tiny_recipe_learns_shakespeare() {
    // The real CI recipe: tiny preset, six plays, 40 steps.
    let r =
        recipe::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/ci-tiny.toml")).unwrap();
    let out = std::env::temp_dir().join(format!("k3mini-ci-tiny-{}", std::process::id()));
    std::fs::remove_dir_all(&out).ok();
    let _cleanup = Scratch(out.clone());
    let summary = train(&r, &opts(&out)).unwrap();
    assert_eq!(summary.last_step, 40);
    let m = metrics(&out);
    let mean = |xs: &[StepMetrics]| xs.iter().map(|x| x.loss).sum::<f64>() / xs.len() as f64;
    let (head, tail) = (mean(&m[..5]), mean(&m[m.len() - 5..]));
    assert!(
        tail < head - 1.0,
        "training loss fell from {head:.3} to {tail:.3}"
    );
    let evals: Vec<f64> = m.iter().filter_map(|x| x.eval_loss).collect();
    assert_eq!(evals.len(), 4);
    assert!(evals[3] < evals[0], "held-out loss fell: {evals:?}");
}

#[test]
fn non_finite_steps_are_skipped_then_the_run_stops_keeping_the_last_checkpoint() {
    let (s, path) = setup("nan", 12, "max_bad_steps = 2\n");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("lr = 3e-3", "lr = 1e30");
    std::fs::write(&path, text).unwrap();
    let r = recipe::load(&path).unwrap();
    let out = s.0.join("run");
    let err = train(&r, &opts(&out)).unwrap_err().to_string();
    assert!(
        err.contains("consecutive steps had a non-finite loss"),
        "{err}"
    );
    let m = metrics(&out);
    assert!(
        m.iter().filter(|x| x.skipped).count() >= 2,
        "skipped steps are logged"
    );
    // Every checkpoint written is readable (none holds non-finite weights from a skipped step).
    for (_, dir) in k3mini_checkpoints::list(&out).unwrap() {
        k3mini::run_dir::open_checkpoint(&dir).unwrap();
    }
}

#[test]
fn a_corrupt_checkpoint_is_named_not_loaded() {
    let (s, path) = setup("corrupt", 6, "");
    let r = recipe::load(&path).unwrap();
    let out = s.0.join("run");
    train_steps(&r, &out, 3);
    let (_, dir) = k3mini_checkpoints::latest(&out).unwrap().unwrap();
    let weights = dir.join("model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    let err = train(
        &r,
        &TrainOptions {
            resume: true,
            ..opts(&out)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("model.safetensors is corrupt"), "{err}");
}

/// Trains `plan` as the `world` ranks of a group of threads of this process (the thread ranks
/// check that every rank makes the same collectives, with the same lengths), rank r with the
/// options (an `out_dir` among them) and the launch attempt `each(r)` gives: each rank's outcome.
pub(crate) fn rank_threads(
    plan: &recipe::RunPlan,
    world: usize,
    each: impl Fn(usize) -> (TrainOptions, Attempt) + Sync,
) -> Vec<k3mini::error::Result<TrainSummary>> {
    let group = k3mini_dist::threads::group(world, std::time::Duration::from_secs(60));
    std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, rank)| {
                let (args, attempt) = each(r);
                scope.spawn(move || {
                    let out = args.out_dir.as_ref().expect("a run directory");
                    let cpu = "cpu".parse().unwrap();
                    let on = plan.clone().with_out_dir(out);
                    let ranks = Ranks::new(&on, Box::new(rank), cpu, attempt)?;
                    train_in(plan, &args, Some(ranks))
                })
            })
            .collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// [`rank_threads`] into `out`, every rank with `args`; each must succeed.
pub(crate) fn thread_ranks(plan: &recipe::RunPlan, out: &Path, world: usize, args: TrainOptions) {
    let args = TrainOptions {
        out_dir: Some(out.to_path_buf()),
        ..args
    };
    let outcomes = rank_threads(plan, world, |_| (args.clone(), Attempt::default()));
    for (r, outcome) in outcomes.into_iter().enumerate() {
        let summary = outcome.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(summary.leads, r == 0);
    }
}

/// Per-step (step, loss bits, held-out loss bits) of a run directory.
pub(crate) fn loss_bits(out: &Path) -> Vec<(usize, u64, Option<u64>)> {
    metrics(out)
        .iter()
        .map(|x| (x.step, x.loss.to_bits(), x.eval_loss.map(f64::to_bits)))
        .collect()
}

/// Starts `k3mini train` on `recipe` into `out` and waits until checkpoint `step` exists.
fn spawn_until_checkpoint(recipe: &Path, out: &Path, step: usize) -> std::process::Child {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(["train", "--quiet", "--out"])
        .arg(out)
        .arg(recipe)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let target = k3mini_checkpoints::step_dir(out, step);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while !target.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before checkpoint {step}"
        );
        assert!(std::time::Instant::now() < deadline, "no checkpoint {step}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child
}

fn resume_to_the_end(recipe: &Path, out: &Path) {
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(["train", "--quiet", "--resume", "--out"])
        .arg(out)
        .arg(recipe)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_killed_process_resumes_bit_identically() {
    // SIGKILL at an arbitrary point after checkpoint 3 (possibly mid-step or mid-checkpoint): the
    // resumed run drops the lost steps' metrics and reproduces the straight run exactly.
    let (s, path) = setup("kill", 30, "");
    let straight = s.0.join("straight");
    train(&recipe::load(&path).unwrap(), &opts(&straight)).unwrap();
    let killed = s.0.join("killed");
    let mut child = spawn_until_checkpoint(&path, &killed, 3);
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success(), "the process was killed");
    resume_to_the_end(&path, &killed);
    assert_eq!(loss_bits(&straight), loss_bits(&killed));
    assert_eq!(metrics(&killed).len(), 30);
    // TensorBoard's curves follow on too: the lost steps' records dropped, each step once.
    crate::tensorboard::assert_events_match_metrics(&killed);
    crate::tensorboard::assert_events_match_metrics(&straight);
}

#[cfg(unix)]
#[test]
fn ctrl_c_checkpoints_then_resume_is_bit_identical() {
    let (s, path) = setup("sigint", 30, "");
    let straight = s.0.join("straight");
    train(&recipe::load(&path).unwrap(), &opts(&straight)).unwrap();
    let out = s.0.join("interrupted");
    let mut child = spawn_until_checkpoint(&path, &out, 3);
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    assert_eq!(
        child.wait().unwrap().code(),
        Some(130),
        "exits as interrupted"
    );
    // The interrupted step was checkpointed: the newest checkpoint is the last step logged.
    let (step, _) = k3mini_checkpoints::latest(&out).unwrap().unwrap();
    assert!(step >= 3 && step < 30, "stopped early, at step {step}");
    assert_eq!(metrics(&out).last().unwrap().step, step);
    resume_to_the_end(&path, &out);
    assert_eq!(loss_bits(&straight), loss_bits(&out));
}

#[test]
fn chat_sources_train_on_the_answer_and_thinking_only() {
    let chats = concat!(
        r#"{"messages": [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "Shakespeare.", "thinking": "The play is Elizabethan."}]}"#,
        "\n",
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a play."}, {"role": "assistant", "content": "Macbeth."}]}"#,
        "\n"
    );
    let extra = "[[data.sources]]\npath = \"chats.jsonl\"\nchat = \"chatml\"\n";
    let (s, path) = setup("chat", 3, extra);
    std::fs::write(s.0.join("chats.jsonl"), chats).unwrap();
    let r = recipe::load(&path).unwrap();
    let tok = k3mini_data::Tokenizer::load(&s.0.join("tok.json").display().to_string()).unwrap();
    let docs = k3mini::corpus::tokenized_documents(&r.data, &tok).unwrap();
    let chat_docs: Vec<_> = docs.iter().filter(|d| d.targets.is_some()).collect();
    assert_eq!(chat_docs.len(), 2);
    for d in chat_docs {
        let targets = d.targets.as_ref().unwrap();
        let first = targets.iter().position(|&t| t).unwrap();
        // The prompt is never a target; the conversation ends on a target (the closing marker).
        let prompt_text = tok.decode(&d.ids[..first]).unwrap();
        assert!(
            prompt_text.ends_with("<|im_start|>assistant\n"),
            "{prompt_text:?}"
        );
        assert!(!targets[..first].iter().any(|&t| t));
        let answer = tok.decode(&d.ids[first..]).unwrap();
        assert!(
            answer.starts_with("<think>") || answer.starts_with("Macbeth"),
            "{answer:?}"
        );
    }
    // Scoring reads the same documents, keeping what each token is rather than the mask, so
    // distillation masks the shards as `data.train_on` says at training time.
    let scored: Vec<_> = k3mini::corpus::scoring_corpus(&r.data, &tok)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(scored.len(), docs.len());
    for (s, d) in scored.iter().zip(&docs) {
        assert_eq!(s.ids, d.ids);
        let masked = s.parts.as_ref().map(|p| {
            p.iter()
                .map(|&p| r.data.train_on.trains(p))
                .collect::<Vec<_>>()
        });
        assert_eq!(masked, d.targets);
    }
    // And the recipe trains.
    let out = s.0.join("run");
    assert_eq!(train(&r, &opts(&out)).unwrap().last_step, 3);
}

#[test]
fn a_k3_vocabulary_student_trains_on_k3_chats_with_tool_calls() {
    // The K3 conversations the format's golden test holds to the reference template: tools
    // declared, calls in parallel, results answering them by id.
    let fixture = crate::fixture::root().join("data/tests/fixtures/chat_templates.json");
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let lines: String = golden["kimi_k3"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            serde_json::json!({"messages": c["messages"], "tools": c.get("tools")}).to_string()
                + "\n"
        })
        .collect();
    let s = Scratch::new("train-k3-chats");
    std::fs::write(s.0.join("chats.jsonl"), lines).unwrap();
    let text = Recipe::default()
        .with(
            "data",
            "tokenizer = \"kimi\"\nseq_len = 64\nheld_out_fraction = 0\n[[data.sources]]\npath = \"chats.jsonl\"\n\
             chat = \"kimi_k3\"",
        )
        .with(
            "model",
            "preset = \"tiny\"\nvocab_size = 163840\nd_model = 64",
        )
        .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
        .with("train", "steps = 2\nbatch_tokens = 128\nmicro_batch = 2")
        .text();
    let path = s.0.join("recipe.toml");
    std::fs::write(&path, text).unwrap();
    let r = recipe::load(&path).unwrap();
    let tok = k3mini_data::Tokenizer::load("kimi").unwrap();
    let docs = k3mini::corpus::tokenized_documents(&r.data, &tok).unwrap();
    assert_eq!(docs.len(), 6);
    // What each conversation trains on, as text.
    let trained: Vec<String> = docs
        .iter()
        .map(|d| {
            let targets = d.targets.as_ref().unwrap();
            let ids: Vec<u32> = d
                .ids
                .iter()
                .zip(targets)
                .filter(|(_, t)| **t)
                .map(|(i, _)| *i)
                .collect();
            tok.decode(&ids).unwrap()
        })
        .collect();
    let calls = trained
        .iter()
        .find(|t| t.contains("<|open|>call tool=\"search\" index=\"2\"<|sep|>"))
        .expect("the assistant's calls are trained");
    assert!(calls.contains(
        "<|open|>argument key=\"filters\" type=\"object\"<|sep|>{\"site\": \"meteo.ch\", \"lang\": [\"de\", \"en\"]}"
    ));
    assert!(calls.contains("Two calls at once.") && calls.ends_with("<|end_of_msg|>"));
    // The tools' results, the declarations and the user are read, not trained.
    assert!(
        !calls.contains("12°C, clear")
            && !calls.contains("# Tools")
            && !calls.contains("Zürich for")
    );
    let summary = train(&r, &opts(&s.0.join("run"))).unwrap();
    assert_eq!(summary.last_step, 2);
    assert!(summary.last_loss.unwrap().is_finite());
}

#[test]
fn qat_engages_at_its_start_step() {
    let (plain, p_path) = setup("qat-off", 3, "");
    let (qat, q_path) = setup(
        "qat-on",
        3,
        "[train.qat]\nformat = \"q4_0\"\nstart_step = 1\n",
    );
    let run = |path: &Path, out: PathBuf| {
        train(&recipe::load(path).unwrap(), &opts(&out)).unwrap();
        loss_bits(&out)
    };
    let (a, b) = (
        run(&p_path, plain.0.join("out")),
        run(&q_path, qat.0.join("out")),
    );
    assert_eq!(
        a[0], b[0],
        "step 1 is before start_step: the same f32 forward"
    );
    assert_ne!(a[1], b[1], "from step 2 the forward sees Q4_0 weights");
    assert!(
        metrics(&qat.0.join("out"))
            .iter()
            .all(|m| m.loss.is_finite())
    );
}

/// Every file under `dir` with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            files.extend(snapshot(&p));
        } else {
            files.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    files.sort();
    files
}

#[test]
fn a_resume_under_another_plan_is_refused_and_a_refused_run_changes_nothing() {
    let (s, path) = setup("replan", 6, "");
    let out = s.0.join("run");
    let r = recipe::load(&path).unwrap();
    train_steps(&r, &out, 3);
    let before = snapshot(&out);
    // Another objective and learning rate: resuming would silently mix two runs.
    let changed = std::fs::read_to_string(&path)
        .unwrap()
        .replace("lr = 3e-3", "lr = 1e-3")
        .replace("steps = 6", "steps = 8");
    let other = s.0.join("other.toml");
    std::fs::write(&other, changed).unwrap();
    let other = recipe::load(&other).unwrap();
    let resume = TrainOptions {
        resume: true,
        ..opts(&out)
    };
    let err = train(&other, &resume).unwrap_err().to_string();
    assert!(
        err.contains("optim.lr: 0.003 → 0.001") && err.contains("train.steps: 6 → 8"),
        "{err}"
    );
    // A fresh run into a directory with checkpoints is refused too; neither touched the run.
    let err = train(&other, &opts(&out)).unwrap_err().to_string();
    assert!(err.contains("already holds checkpoints"), "{err}");
    assert_eq!(snapshot(&out), before, "a refused run changes nothing");
    // Accepted explicitly, the resume continues under the new plan.
    let s2 = train(
        &other,
        &TrainOptions {
            accept_changes: true,
            ..resume
        },
    )
    .unwrap();
    assert_eq!((s2.first_step, s2.last_step), (3, 8));
    // A checkpoint past the plan's last step has nothing to resume: said, not a silent exit 0.
    let past = TrainOptions {
        resume: true,
        accept_changes: true,
        ..opts(&out)
    };
    let err = train(&r, &past).unwrap_err().to_string();
    assert!(
        err.contains("is at step 8 but the plan has train.steps = 6"),
        "{err}"
    );
}

#[test]
fn a_model_this_machine_cannot_hold_is_refused_before_allocating() {
    for model in ["d_model = 1000000\nn_heads = 4", "n_layers = 1000000"] {
        let (s, path) = setup("huge", 4, "");
        let text = std::fs::read_to_string(&path)
            .unwrap()
            .replace("d_model = 64", model);
        std::fs::write(&path, text).unwrap();
        let out = s.0.join("run");
        let err = train(&recipe::load(&path).unwrap(), &opts(&out))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("needs about") && err.contains("this machine has"),
            "{err}"
        );
        assert!(!out.exists(), "nothing was written");
    }
}

/// The spread of the experts' loads over the last 10 steps: the mean over steps and MoE layers
/// of (max − min) / mean load.
fn load_spread(out: &Path, top_k: usize, experts: usize, tokens: usize) -> f64 {
    let lines = metrics(out);
    let last = &lines[lines.len() - 10..];
    let mean = (tokens * top_k) as f64 / experts as f64;
    let spreads: Vec<f64> = last
        .iter()
        .flat_map(|m| {
            assert!(!m.expert_load_max.is_empty(), "loads are logged");
            m.expert_load_max
                .iter()
                .zip(&m.expert_load_min)
                .map(|(&hi, &lo)| (hi - lo) as f64 / mean)
        })
        .collect();
    spreads.iter().sum::<f64>() / spreads.len() as f64
}

/// `[model.moe]`: 8 experts, top-2, every layer routed, bias update rate `rate`.
pub(crate) fn moe_table(rate: f64) -> String {
    format!(
        "[model.moe]\nnum_experts = 8\ntop_k = 2\nnum_shared_experts = 0\nexpert_hidden = 32\n\
         first_dense_layers = 0\nbias_update_rate = {rate}\n"
    )
}

#[test]
fn moe_students_balance_their_experts() {
    // recipes/ci-tiny.toml's student made MoE, with DeepSeek-V3's bias update (γ = 0.02: at this
    // learning rate the router concentrates within a few dozen steps, faster than the default
    // 1e-3 follows) and without (γ = 0). One micro-batch a step and one held-out pass, at the
    // end, halve the recipe's work (the slowest test in CI took ~180 s of a loaded machine): the
    // spread is measured on the training steps' loads, 1.90 against 3.24 here.
    let s = Scratch::new("moe-balance");
    let recipe =
        std::fs::read_to_string(crate::fixture::root().join("recipes/ci-tiny.toml")).unwrap();
    for line in ["batch_tokens = 1024", "eval_every = 10"] {
        assert!(
            recipe.contains(line),
            "recipes/ci-tiny.toml no longer says {line}"
        );
    }
    let text = recipe
        .replace(
            "\"corpus/",
            &format!("\"{}/recipes/corpus/", crate::fixture::root().display()),
        )
        .replace("batch_tokens = 1024", "batch_tokens = 512")
        .replace("eval_every = 10", "eval_every = 40");
    let run = |rate: f64| {
        let path = s.write(
            &format!("moe-{rate}.toml"),
            &format!("{text}\n{}", moe_table(rate)),
        );
        let out = s.path(&format!("run-{rate}"));
        train(&recipe::load(&path).unwrap(), &opts(&out)).unwrap();
        load_spread(&out, 2, 8, 512)
    };
    let (balanced, unbalanced) = (run(0.02), run(0.0));
    eprintln!("load spread: {balanced:.3} with the bias update, {unbalanced:.3} without");
    assert!(
        balanced < 0.7 * unbalanced,
        "spread with the bias update {balanced:.3} vs without {unbalanced:.3}"
    );
}

#[test]
fn moe_router_biases_resume_exactly() {
    // The biases live in the checkpoint: stop and resume reproduces the straight run.
    let (s, path) = setup("moe-resume", 12, &moe_table(0.05));
    let r = recipe::load(&path).unwrap();
    let straight = s.0.join("straight");
    train(&r, &opts(&straight)).unwrap();
    let split = s.0.join("split");
    train_steps(&r, &split, 5);
    resume_run(&r, &split);
    assert_eq!(loss_bits(&straight), loss_bits(&split));
    let loads = |out: &Path| -> Vec<_> {
        metrics(out)
            .into_iter()
            .map(|m| (m.expert_load_max, m.expert_load_min))
            .collect()
    };
    assert_eq!(loads(&straight), loads(&split), "the same routing");
}

#[test]
fn a_garbage_optimizer_state_or_non_finite_weights_are_refused_by_name() {
    let (s, path) = setup("garbage", 4, "");
    let r = recipe::load(&path).unwrap();
    let out = s.0.join("run");
    train_steps(&r, &out, 3);
    let (step, dir) = k3mini_checkpoints::latest(&out).unwrap().unwrap();
    let files: std::collections::BTreeMap<String, Vec<u8>> = k3mini_checkpoints::verify(&dir)
        .unwrap()
        .into_iter()
        .map(|(name, path)| (name, std::fs::read(path).unwrap()))
        .collect();
    // The checkpoint rewritten, manifest and all, with one file replaced: its checksums hold.
    let rewrite = |name: &str, bytes: Vec<u8>| {
        let mut replaced = files.clone();
        replaced.insert(name.into(), bytes);
        std::fs::remove_dir_all(&dir).unwrap();
        let list: Vec<(&str, Vec<u8>)> = replaced
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        k3mini_checkpoints::write(&out, step, &list, 3).unwrap();
    };
    rewrite("optimizer.bpk", b"not an optimizer".to_vec());
    let resume = TrainOptions {
        resume: true,
        ..opts(&out)
    };
    let e = train(&r, &resume).unwrap_err().to_string();
    assert!(
        e.contains("optimizer.bpk: is not an optimizer state k3mini wrote")
            && e.contains("magic number")
            && !e.contains("Io("),
        "{e}"
    );
    let mut weights = files["model.safetensors"].clone();
    let n = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    weights[8 + n..8 + n + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    rewrite("model.safetensors", weights);
    let e = k3mini::run_dir::open_checkpoint(&out)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("holds NaN or infinite values"), "{e}");
}

#[test]
fn sharded_weights_resume_bit_identically_and_export_as_transformers_reads_them() {
    let (s, path) = setup("sharded", 8, "");
    let text = std::fs::read_to_string(&path).unwrap().replace(
        "checkpoint_every = 3",
        "checkpoint_every = 3\nweights_shard_bytes = 100000",
    );
    std::fs::write(&path, text).unwrap();
    let r = recipe::load(&path).unwrap();
    let straight = s.0.join("straight");
    train(&r, &opts(&straight)).unwrap();
    let split = s.0.join("split");
    train_steps(&r, &split, 3);
    resume_run(&r, &split);
    assert_eq!(loss_bits(&straight), loss_bits(&split));

    // The checkpoint holds transformers' sharded layout: shards of at most the limit (a tensor
    // larger than it alone), and an index naming every tensor's file.
    let (_, dir) = k3mini_checkpoints::latest(&split).unwrap().unwrap();
    assert!(!dir.join("model.safetensors").exists());
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let files = k3mini_student::hf::hf_weight_files(&dir).unwrap();
    let n = files.len();
    assert!(n > 2, "{n} shards");
    let mut total = 0;
    for (i, f) in files.iter().enumerate() {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert_eq!(name, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        let (_, header) = k3mini_student::hf::safetensors_header(f).unwrap();
        let bytes: u64 = header
            .values()
            .map(|v| {
                v["data_offsets"][1].as_u64().unwrap() - v["data_offsets"][0].as_u64().unwrap()
            })
            .sum();
        assert!(
            bytes <= 100_000 || header.len() == 1,
            "{name}: {bytes} bytes"
        );
        for tensor in header.keys() {
            assert_eq!(index["weight_map"][tensor], name, "{tensor}");
        }
        total += bytes;
    }
    assert_eq!(index["metadata"]["total_size"], total);

    // `export --format hf` copies that layout, and it loads back as the same model.
    let ck = k3mini::run_dir::open_checkpoint(&dir).unwrap();
    let device = burn::tensor::Device::default();
    let out = s.0.join("hf");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model.safetensors"), b"an earlier export").unwrap();
    k3mini::export::export_hf(&ck, None, &out, false).unwrap();
    assert!(
        !out.join("model.safetensors").exists(),
        "the stale file is gone"
    );
    let mut back = k3mini_student::K3Mini::new(&ck.plan.model, &device).unwrap();
    let exported = k3mini_student::hf::hf_weight_files(&out).unwrap();
    assert_eq!(exported.len(), n);
    k3mini_student::hf::load_hf_files(&mut back, &exported).unwrap();
    let ids = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new((0..16i64).collect::<Vec<_>>(), [1, 16]),
        &device,
    );
    let logits = |m: &k3mini_student::K3Mini| -> Vec<f32> {
        m.forward(ids.clone()).into_data().try_into_vec().unwrap()
    };
    assert_eq!(logits(&back), logits(&ck.model(&device).unwrap()));

    // A damaged shard is named; a shard missing from the set too.
    let second = files[1].clone();
    let bytes = std::fs::read(&second).unwrap();
    std::fs::write(&second, &bytes[..bytes.len() / 2]).unwrap();
    let e = k3mini::run_dir::open_checkpoint(&dir)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!("model-00002-of-{n:05}.safetensors is corrupt")),
        "{e}"
    );
    std::fs::remove_file(exported[1].clone()).unwrap();
    let e = k3mini_student::hf::hf_weight_files(&out)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("listed in model.safetensors.index.json but missing"),
        "{e}"
    );
}

#[test]
fn a_bad_record_mid_stream_stops_the_run_by_name_keeping_the_steps_before_it() {
    // One JSONL source of short lines, the 1501st cut off: reached some 20 steps in, 8
    // micro-batches a step.
    let (s, path) = setup(
        "bad-record",
        60,
        "[[data.sources]]\npath = \"lines.jsonl\"\n",
    );
    let lines: String = (0..3000)
        .map(|i| match i {
            1500 => "{\"text\": \"cut off\n".to_string(),
            _ => format!(
                "{}\n",
                serde_json::json!({ "text": format!("line {i} of the corpus") })
            ),
        })
        .collect();
    std::fs::write(s.0.join("lines.jsonl"), lines).unwrap();
    let mut text = std::fs::read_to_string(&path).unwrap();
    for i in 0..4 {
        text = text.replace(&format!("[[data.sources]]\npath = \"doc{i}.txt\"\n"), "");
    }
    let text = text
        .replace("batch_tokens = 256", "batch_tokens = 1024")
        .replace("checkpoint_every = 3", "checkpoint_every = 7");
    std::fs::write(&path, text).unwrap();
    // On three CPU replicas: the record fails to load while the other devices are mid-step, and
    // the step ends with its error, nothing of it applied, no worker left waiting.
    let r = recipe::load(&path)
        .unwrap()
        .with_devices("cpu,cpu,cpu".parse().unwrap())
        .unwrap();
    let out = s.0.join("run");
    let e = train(&r, &opts(&out)).unwrap_err().to_string();
    assert!(e.contains("lines.jsonl:1501: invalid JSON"), "{e}");
    let done = metrics(&out).last().unwrap().step;
    assert!(
        done > 7 && done % 7 != 0,
        "failed mid-run, between checkpoints: {done}"
    );
    assert!(
        e.contains(&format!("checkpoint at step {done} written")),
        "{e}"
    );
    let (step, _) = k3mini_checkpoints::latest(&out).unwrap().unwrap();
    assert_eq!(step, done, "every finished step is kept");
}
