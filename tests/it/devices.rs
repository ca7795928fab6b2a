//! Devices and precision in a plan: data-parallel replicas equal one device doing every
//! micro-batch, activation checkpointing changes no number, bf16 matmuls track f32, and a device
//! this build cannot drive is refused up front.
use crate::fixture::{Recipe, Scratch};
use crate::train::{
    loss_bits, metrics, moe_table, opts, rank_threads, resume_run, setup, thread_ranks, train_steps,
};
use k3mini::device::DeviceList;
use k3mini::recipe;
use k3mini::run_dir::open_checkpoint;
use k3mini::train::ranks::Attempt;
use k3mini::train::trainer::{TrainOptions, TrainSummary, train};
use k3mini_student::K3Mini;
use k3mini_student::config::KdaKernel;
use k3mini_student::precision::Precision;
use std::path::Path;

/// Every tensor of the newest checkpoint's weights, by name.
pub(crate) fn weights(out: &Path) -> Vec<(String, Vec<f32>)> {
    let ck = open_checkpoint(out).unwrap();
    let bytes = std::fs::read(ck.dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, v)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

pub(crate) fn max_abs_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            va.iter().zip(vb).map(|(x, y)| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// Trains `p` into `a` and `q` into `b`: the weights agree within 1e-6, and so do every step's
/// loss and expert loads.
fn same_training(p: &recipe::RunPlan, a: &Path, q: &recipe::RunPlan, b: &Path, what: &str) {
    train(p, &opts(a)).unwrap();
    train(q, &opts(b)).unwrap();
    let diff = max_abs_diff(&weights(a), &weights(b));
    eprintln!("max |Δ weight| after {what}: {diff:e}");
    assert!(diff <= 1e-6, "{what}: {diff}");
    for (x, y) in metrics(a).iter().zip(&metrics(b)) {
        assert!(
            (x.loss - y.loss).abs() <= 1e-6 * x.loss.abs(),
            "{x:?} vs {y:?}"
        );
        assert_eq!(x.expert_load_max, y.expert_load_max, "the same routing");
    }
}

#[test]
fn two_replicas_equal_one_device_doing_both_halves() {
    // A MoE student (experts one replica's tokens skip must still be reduced), 2 micro-batches a
    // step: one device doing both, against two CPU replicas taking one each. Then the replicated
    // run stops and resumes exactly.
    let (s, path) = setup("replicas", 6, &moe_table(0.05));
    let one = recipe::load(&path).unwrap();
    let two = one
        .clone()
        .with_devices("cpu,cpu".parse().unwrap())
        .unwrap();
    assert_eq!((one.accumulation, two.devices.replicas()), (2, 2));
    let (a, b) = (s.0.join("one"), s.0.join("two"));
    same_training(&one, &a, &two, &b, "6 steps, 1 device vs 2 replicas");
    let split = s.0.join("split");
    train_steps(&two, &split, 4);
    resume_run(&two, &split);
    assert_eq!(loss_bits(&b), loss_bits(&split));
    // More replicas than micro-batches is refused, naming both.
    let err = one
        .with_devices("cpu,cpu,cpu".parse().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("3 devices") && err.contains("2 micro-batch"),
        "{err}"
    );
}

#[test]
fn three_dense_replicas_equal_one_device_and_a_run_moves_between_device_counts() {
    // A dense student, 4 micro-batches a step over three CPU replicas (the first takes two): the
    // workers finish out of order, and the step still sums their gradients in micro-batch order,
    // each parameter's on the device that owns it.
    let (s, path) = setup("replicas-dense", 6, "");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("batch_tokens = 256", "batch_tokens = 512"),
    )
    .unwrap();
    let one = recipe::load(&path).unwrap();
    let three = one
        .clone()
        .with_devices("cpu,cpu,cpu".parse().unwrap())
        .unwrap();
    assert_eq!(one.accumulation, 4);
    let (a, b) = (s.0.join("one"), s.0.join("three"));
    same_training(&one, &a, &three, &b, "6 steps, 1 device vs 3 replicas");
    // CPU replicas do the same arithmetic in the same order: the weights are equal to the bit.
    assert_eq!(max_abs_diff(&weights(&a), &weights(&b)), 0.0);
    // Every step says how long each device worked: all three did.
    for m in metrics(&b) {
        assert_eq!(m.replica_busy_s.len(), 3, "{m:?}");
        assert!(m.replica_busy_s.iter().all(|&t| t > 0.0), "{m:?}");
    }
    assert!(metrics(&a).iter().all(|m| m.replica_busy_s.len() == 1));
    // A checkpoint is one format whatever the device count (the optimizer state of parameters
    // owned by three devices is one record): a run continues exactly on another count.
    let two = one
        .clone()
        .with_devices("cpu,cpu".parse().unwrap())
        .unwrap();
    for (first, then, tag) in [(&two, &one, "2 then 1"), (&one, &three, "1 then 3")] {
        let moved = s.0.join(tag.replace(' ', "-"));
        train_steps(first, &moved, 3);
        resume_run(then, &moved);
        assert_eq!(loss_bits(&a), loss_bits(&moved), "{tag}");
        assert_eq!(max_abs_diff(&weights(&a), &weights(&moved)), 0.0, "{tag}");
    }
}

#[test]
fn activation_checkpointing_changes_no_number() {
    let (s, path) = setup("checkpointing", 4, "");
    let plain = recipe::load(&path).unwrap();
    let mut recomputed = plain.clone();
    recomputed.train.activation_checkpointing = true;
    let (a, b) = (s.0.join("plain"), s.0.join("recomputed"));
    same_training(
        &plain,
        &a,
        &recomputed,
        &b,
        "4 steps with activation checkpointing",
    );
}

#[test]
fn the_fused_kda_op_and_a_chunked_head_train_as_the_composed_forms_do() {
    // The training path (fused KDA, the head in chunks of 40 of a micro-batch's 126 positions,
    // the recompute regions) against the composed kernel with the whole head and composed
    // regions: every step's loss within 1e-5 relative
    // over 4 steps (the backward's rounding differs, so AdamW's weights do not match to the bit).
    let (s, path) = setup("fused", 4, "");
    let mut fused = recipe::load(&path).unwrap();
    fused.train.head_chunk = Some(40);
    assert_eq!(fused.model.kda.kernel, KdaKernel::Chunk, "the default");
    let mut composed = fused.clone();
    composed.model.kda.kernel = KdaKernel::Composed;
    composed.train.head_chunk = Some(0);
    let (a, b) = (s.0.join("fused"), s.0.join("composed"));
    train(&fused, &opts(&a)).unwrap();
    {
        let _composed = k3mini_kernels::recompute::ComposedRegions::new();
        train(&composed, &opts(&b)).unwrap();
    }
    let (x, y) = (metrics(&a), metrics(&b));
    assert_eq!(x.len(), 4);
    for (x, y) in x.iter().zip(&y) {
        let rel = (x.loss - y.loss).abs() / x.loss.abs();
        assert!(
            rel <= 1e-5,
            "step {}: {} vs {} ({rel:e})",
            x.step,
            x.loss,
            y.loss
        );
    }
}

#[test]
fn a_gpu_this_build_or_machine_lacks_is_refused_before_any_work() {
    // Without a GPU backend the refusal names the feature to build with; with one (tch, cuda) an
    // index past the GPUs it sees says how many it sees.
    let expected = if cfg!(any(feature = "tch", feature = "cuda")) {
        "CUDA device(s)"
    } else {
        "--features tch"
    };
    let s = Scratch::new("devices-cuda");
    s.write("corpus.txt", "To be, or not to be, that is the question.\n");
    let path = s.write(
        "recipe.toml",
        &Recipe::default()
            .with("run", "name = \"t\"\ndevice = \"cuda:90\"")
            .text(),
    );
    // `recipe check` accepts it (the plan is valid anywhere); training refuses before any work.
    let plan = recipe::load(&path).unwrap();
    assert_eq!(plan.devices, "cuda:90".parse::<DeviceList>().unwrap());
    for args in [
        vec!["train", path.to_str().unwrap()],
        vec!["train", path.to_str().unwrap(), "--device", "cuda:91"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
            .args(&args)
            .arg("--out")
            .arg(s.path("run"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expected) && err.contains("cuda:9"), "{err}");
        assert!(!s.path("run").exists(), "nothing written");
    }
    // A device that is not one is refused at its key, with the line.
    let bad = s.write(
        "bad.toml",
        &Recipe::default()
            .with("run", "name = \"t\"\ndevice = \"tpu:0\"")
            .text(),
    );
    let err = recipe::load(&bad).unwrap_err().to_string();
    assert!(err.contains("device") && err.contains("tpu:0"), "{err}");
}

#[test]
fn bf16_matmuls_track_the_f32_run_and_resume_exactly() {
    // `[model] precision = "bf16"`: the matrix products in bf16, everything else f32. Over 12
    // steps the loss stays within 1% of the f32 run's (ci-tiny over 24 steps: 0.26%), and a
    // stopped and resumed bf16 run equals the straight one to the bit.
    let (s, path) = setup("bf16", 12, "");
    let f32_plan = recipe::load(&path).unwrap();
    let mut bf16 = f32_plan.clone();
    bf16.model.precision = Precision::Bf16;
    let (a, b) = (s.0.join("f32"), s.0.join("bf16"));
    train(&f32_plan, &opts(&a)).unwrap();
    train(&bf16, &opts(&b)).unwrap();
    let worst = metrics(&a)
        .iter()
        .zip(&metrics(&b))
        .map(|(x, y)| (x.loss - y.loss).abs() / x.loss)
        .fold(0.0, f64::max);
    eprintln!("bf16 against f32 over 12 steps: max relative loss difference {worst:.2e}");
    assert!(
        worst > 0.0,
        "bf16 changed nothing: the casts are not applied"
    );
    assert!(worst < 1e-2, "{worst}");
    let split = s.0.join("split");
    train_steps(&bf16, &split, 5);
    resume_run(&bf16, &split);
    assert_eq!(loss_bits(&b), loss_bits(&split));
    // The checkpoint's plan carries the precision: resuming runs bf16 again.
    assert_eq!(
        open_checkpoint(&split).unwrap().plan.model.precision,
        Precision::Bf16
    );
}

#[test]
fn ranks_as_threads_train_as_one_process_does_and_a_run_moves_between_rank_counts() {
    // The ordered reduction over three ranks, and a run moving from 2 ranks to 3 to one process:
    // one process's bits. The default build's check of training across ranks (the `c10d` build
    // runs the same over processes: tests/it/ranks.rs). The model starts from a checkpoint, so
    // no rank's initialisation draws from the random state the threads share.
    let (s, path) = setup("thread-ranks", 6, "");
    let text = std::fs::read_to_string(&path).unwrap();
    let text = text.replace(
        "batch_tokens = 256",
        "batch_tokens = 768\nreduction = \"ordered\"",
    );
    std::fs::write(&path, text).unwrap();
    let fresh = recipe::load(&path).unwrap();
    let init = s.0.join("init");
    let model = K3Mini::new(&fresh.model, &burn::tensor::Device::flex()).unwrap();
    k3mini::run_dir::write_weights(&fresh.clone().with_out_dir(&init), &model, 0).unwrap();
    let plan = recipe::load_from(&path, &init).unwrap();
    assert_eq!(plan.accumulation, 6);
    let one = s.0.join("one");
    train(&plan, &opts(&one)).unwrap();
    let three = s.0.join("three");
    thread_ranks(&plan, &three, 3, TrainOptions::default());
    assert_eq!(loss_bits(&one), loss_bits(&three));
    assert_eq!(max_abs_diff(&weights(&one), &weights(&three)), 0.0);
    assert!(metrics(&three).iter().all(|m| m.replica_busy_s.len() == 3));
    assert!(metrics(&three).iter().all(|m| m.collective_s.is_some()));
    let moved = s.0.join("moved");
    let stop = |n| TrainOptions {
        stop_after: Some(n),
        ..TrainOptions::default()
    };
    thread_ranks(&plan, &moved, 2, stop(2));
    thread_ranks(
        &plan,
        &moved,
        3,
        TrainOptions {
            resume: true,
            ..stop(2)
        },
    );
    resume_run(&plan, &moved);
    assert_eq!(loss_bits(&one), loss_bits(&moved));
    assert_eq!(max_abs_diff(&weights(&one), &weights(&moved)), 0.0);
    // A rank started otherwise (here: to stop elsewhere) is refused, and so is every other rank,
    // before anything is written.
    let other = s.0.join("other");
    let errors: Vec<String> = rank_threads(&plan, 2, |r| {
        let args = TrainOptions {
            out_dir: Some(other.clone()),
            ..stop(r + 1)
        };
        (args, Attempt::default())
    })
    .into_iter()
    .map(refusal)
    .collect();
    assert!(
        errors[0].contains("rank 1 of 2 failed to resolve the first rank's plan"),
        "{errors:?}"
    );
    assert!(
        errors[1].contains("this rank's plan differs from the first rank's"),
        "{errors:?}"
    );
    assert!(!other.join("metrics.jsonl").exists());
    // A group its launcher restarts resumes by itself only in a directory its own launch started
    // in: `three`'s checkpoints are launch ""'s, so a restart of launch "b" is refused as its
    // first attempt would be (an earlier run's checkpoints take `--resume`), and a restart of ""
    // resumes (from the last step: nothing left to train).
    let restart = |run: &str| {
        let attempt = Attempt {
            run: run.into(),
            restart: 1,
        };
        rank_threads(&plan, 2, |_| (opts(&three), attempt.clone()))
    };
    let refused: Vec<String> = restart("b").into_iter().map(refusal).collect();
    assert!(
        refused[0].contains("already holds checkpoints"),
        "{refused:?}"
    );
    assert!(
        refused[1].contains("rank 0 of 2 failed to start the run"),
        "{refused:?}"
    );
    for outcome in restart("") {
        let s = outcome.unwrap();
        assert_eq!(s.first_step, s.last_step);
    }
}

/// What a rank that had to fail said.
fn refusal(outcome: k3mini::error::Result<TrainSummary>) -> String {
    outcome.unwrap_err().to_string()
}
