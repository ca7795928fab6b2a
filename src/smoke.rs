//! `k3mini smoke RECIPE`: the nightly check that a recipe still trains. It trains the recipe's
//! `train.steps` straight through; trains them again stopping after `[smoke] resume_at` (with a
//! checkpoint, as Ctrl-C or a time limit stops a run) and resuming; evaluates on the held-out
//! set; exports a GGUF and runs it in the in-process llama.cpp. Then it checks what a healthy run
//! shows and, given an earlier night's report, how far its noisy figures moved:
//!
//! ```text
//! train                 the straight run finished
//! losses_finite         every logged step's loss is finite   grad_norms_finite  every norm too
//! no_skipped_steps      no logged update was skipped
//! loss_decreased        loss_N ≤ (1 − loss_drop) · loss_1
//! held_out              the final checkpoint's held-out loss and bits per byte are finite
//! resume_bit_identical  the resumed run starts at resume_at, and its weights (tensor by tensor),
//!                       training state and every step's losses are the straight run's, bit for
//!                       bit (not the optimizer file: it is keyed by per-process parameter ids)
//! gguf_in_llama_cpp     llama.cpp tokenises a fixed text as k3mini does and its logits are
//!                       within mean KL max_gguf_kl of k3mini's (F32 forward)
//! tokens_per_s          ≥ min_tokens_per_s_ratio · the baseline's (median over steps 2..N)
//! peak_memory           ≤ max_peak_memory_ratio · the baseline's (the process's peak RSS after
//!                       the straight run: training, its evaluations and checkpoint writes)
//! final_loss            ≤ max_final_loss_ratio · the baseline's
//! ```
//!
//! A check that cannot run (an earlier stage failed; no baseline, or one of another run, step
//! count or GGUF type) is skipped, not passed. The report is [`SmokeReport`] (smoke.json, which a
//! later night reads back as its baseline) and JUnit XML.

use crate::error::{Context, Result};
use crate::evaluate::held_out_score;
use crate::recipe::{BaselineTolerances, SmokePlan};
use crate::run_dir::{Checkpoint, StepMetrics, open_checkpoint, read_metrics};
use crate::train::trainer::{TrainOptions, train};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The report's file name in the smoke's directory.
pub const REPORT: &str = "smoke.json";
/// The JUnit XML report's file name.
pub const JUNIT: &str = "smoke.junit.xml";
/// Written before a smoke's first run: the directory is a smoke's, even if it never finished.
const MARKER: &str = ".k3mini-smoke";

/// One check's outcome.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Passed,
    Failed,
    /// Not run: what it needs did not happen (a failed stage, no baseline).
    Skipped,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Check {
    pub name: String,
    pub outcome: Outcome,
    /// What was measured against what, or why it was skipped.
    pub detail: String,
}

/// The figures a later night compares against.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SmokeFigures {
    pub steps: usize,
    pub first_loss: Option<f64>,
    pub final_loss: Option<f64>,
    /// Median training tokens/s over the logged steps after the first (the first warms up).
    pub tokens_per_s: Option<f64>,
    /// The process's peak resident set when the straight run had finished (device memory of a
    /// GPU run is not in it).
    pub peak_rss_bytes: Option<usize>,
    pub held_out_loss: Option<f64>,
    pub held_out_bits_per_byte: Option<f64>,
    /// llama.cpp against k3mini on a fixed text: mean KL and top-1 agreement.
    pub gguf_kl: Option<f64>,
    pub gguf_top1: Option<f64>,
}

/// `smoke.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SmokeReport {
    /// The run's name (`run.name`): a baseline must be of the same run, on the same devices.
    pub run: String,
    pub devices: String,
    pub recipe: PathBuf,
    pub quant: String,
    pub figures: SmokeFigures,
    pub checks: Vec<Check>,
    pub wall_s: f64,
}

impl SmokeReport {
    /// The checks that failed, by name.
    pub fn failed(&self) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|c| c.outcome == Outcome::Failed)
            .map(|c| c.name.as_str())
            .collect()
    }

    /// A report written by an earlier smoke (`--baseline`), verified: it parses and its figures
    /// are finite and positive where present.
    pub fn read_baseline(path: &Path) -> Result<Self> {
        let text = k3mini_durable::read_small(path, 1 << 20)
            .with_context(|| format!("baseline {}", path.display()))?;
        let report: Self = serde_json::from_str(&text).map_err(|e| {
            crate::refused!(
                "baseline {}: not a k3mini smoke report: {e}",
                path.display()
            )
        })?;
        let f = &report.figures;
        for (name, v) in [
            ("tokens_per_s", f.tokens_per_s),
            ("final_loss", f.final_loss),
            ("peak_rss_bytes", f.peak_rss_bytes.map(|b| b as f64)),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                crate::bail!("baseline {}: {name} = {v} is not positive", path.display());
            }
        }
        Ok(report)
    }
}

/// Where the smoke works and what it compares with.
pub struct SmokeOptions {
    /// The smoke's directory: `straight/` and `split/` (replaced on every smoke of the directory),
    /// the GGUF and the reports.
    pub dir: PathBuf,
    pub baseline: Option<SmokeReport>,
}

/// Runs the smoke and writes its reports (smoke.json and smoke.junit.xml in `opts.dir`). An error
/// is one the smoke cannot report as a check (its directory cannot be written, say); a run that
/// fails is a report with failed checks.
pub fn smoke(plan: &SmokePlan, opts: &SmokeOptions) -> Result<SmokeReport> {
    let started = Instant::now();
    let (straight, split) = (opts.dir.join("straight"), opts.dir.join("split"));
    for d in [&straight, &split] {
        if !d.exists() {
            continue;
        }
        // Only a smoke's own runs are replaced.
        if !opts.dir.join(MARKER).is_file() {
            crate::bail!(
                "{} exists and {} holds no {MARKER}: not a smoke's directory (choose another --out)",
                d.display(),
                opts.dir.display()
            );
        }
        std::fs::remove_dir_all(d).with_context(|| format!("clearing {}", d.display()))?;
    }
    std::fs::create_dir_all(&opts.dir)
        .with_context(|| format!("creating {}", opts.dir.display()))?;
    k3mini_durable::write(&opts.dir.join(MARKER), b"k3mini smoke\n")
        .with_context(|| format!("writing {}", opts.dir.join(MARKER).display()))?;
    let mut checks = Vec::new();
    let mut figures = SmokeFigures {
        steps: plan.run.train.steps,
        ..Default::default()
    };
    let observer = crate::progress::observer();
    observer.note("smoke: the straight run");
    let trained = train(&plan.run, &options(&straight, None, false));
    figures.peak_rss_bytes = k3mini_student::bench::peak_rss_bytes();
    let steps = plan.run.train.steps;
    checks.push(match &trained {
        Ok(s) if !s.interrupted && s.last_step == steps => check(
            "train",
            true,
            format!(
                "{} steps, {} tokens, {:.0} s",
                s.last_step, s.tokens, s.wall_s
            ),
        ),
        Ok(s) => check(
            "train",
            false,
            format!(
                "stopped after step {} of {steps} (interrupted)",
                s.last_step
            ),
        ),
        Err(e) => check("train", false, e.to_string()),
    });
    let finished = checks.last().is_some_and(|c| c.outcome == Outcome::Passed);
    let rows = read_metrics(&straight).unwrap_or_default();
    // Every step's loss where the run finished (the metrics hold every log_every-th).
    let losses = trained
        .as_ref()
        .ok()
        .and_then(|s| s.first_loss.zip(s.last_loss));
    checks.extend(health(&rows, losses, plan.loss_drop, &mut figures));
    let stages = ["held_out", "resume_bit_identical", "gguf_in_llama_cpp"];
    // The straight run's checkpoint, verified once for the three stages that read it.
    match finished.then(|| open_checkpoint(&straight)) {
        Some(Ok(ck)) => {
            observer.note("smoke: held-out evaluation");
            checks.push(held_out(&ck, &mut figures));
            observer.note("smoke: stop and resume");
            checks.push(resume(plan, &ck, &straight, &split));
            observer.note("smoke: GGUF in llama.cpp");
            let gguf = opts.dir.join(format!("student.{}.gguf", plan.quant.name()));
            checks.push(gguf_check(plan, &ck, &gguf, &mut figures));
        }
        Some(Err(e)) => checks
            .extend(stages.map(|n| check(n, false, format!("the straight run's checkpoint: {e}")))),
        None => checks.extend(stages.map(|n| skipped(n, "the straight run did not finish"))),
    }
    let mut report = SmokeReport {
        run: plan.run.name.clone(),
        devices: plan.run.devices.to_string(),
        recipe: plan.run.recipe.clone(),
        quant: plan.quant.name().into(),
        figures,
        checks,
        wall_s: 0.0,
    };
    let baseline = match &opts.baseline {
        _ if !finished => Err("the straight run did not finish".to_string()),
        Some(b) => comparable(&report, b).map(|()| &b.figures),
        None => Err("no baseline (--baseline)".to_string()),
    };
    let compared = against_baseline(&report.figures, baseline, &plan.tolerances);
    report.checks.extend(compared);
    report.wall_s = started.elapsed().as_secs_f64();
    write_reports(&report, &opts.dir)?;
    Ok(report)
}

fn options(out: &Path, stop_after: Option<usize>, resume: bool) -> TrainOptions {
    TrainOptions {
        out_dir: Some(out.to_path_buf()),
        resume,
        accept_changes: false,
        stop_after,
    }
}

fn check(name: &str, passed: bool, detail: String) -> Check {
    Check {
        name: name.into(),
        outcome: if passed {
            Outcome::Passed
        } else {
            Outcome::Failed
        },
        detail,
    }
}

fn skipped(name: &str, why: &str) -> Check {
    Check {
        name: name.into(),
        outcome: Outcome::Skipped,
        detail: why.into(),
    }
}

/// A stage that either finished (with what to say) or failed with an error.
fn stage<T: std::fmt::Display, E: std::fmt::Display>(
    name: &str,
    r: std::result::Result<T, E>,
) -> Check {
    match r {
        Ok(v) => check(name, true, v.to_string()),
        Err(e) => check(name, false, e.to_string()),
    }
}

/// The health checks on the straight run's logged metrics, filling the loss and speed figures:
/// the loss drop from `losses` (the run's first and last step) where it finished, else from the
/// first and last logged step.
pub fn health(
    rows: &[StepMetrics],
    losses: Option<(f64, f64)>,
    loss_drop: f64,
    figures: &mut SmokeFigures,
) -> Vec<Check> {
    if rows.is_empty() {
        return [
            "losses_finite",
            "grad_norms_finite",
            "no_skipped_steps",
            "loss_decreased",
        ]
        .into_iter()
        .map(|n| check(n, false, "no step was logged".into()))
        .collect();
    }
    let steps_where = |bad: &dyn Fn(&StepMetrics) -> bool| -> Vec<usize> {
        rows.iter().filter(|r| bad(r)).map(|r| r.step).collect()
    };
    let listed = |what: &str, steps: Vec<usize>| {
        let ok = steps.is_empty();
        let detail = if ok {
            format!("all {} logged steps", rows.len())
        } else {
            format!("{what} at steps {steps:?}")
        };
        (ok, detail)
    };
    let (first, last) = losses.unwrap_or((rows[0].loss, rows[rows.len() - 1].loss));
    figures.first_loss = first.is_finite().then_some(first);
    figures.final_loss = last.is_finite().then_some(last);
    let mut speeds: Vec<f64> = rows
        .iter()
        .filter(|r| r.step > 1)
        .map(|r| r.tokens_per_s)
        .collect();
    speeds.sort_by(f64::total_cmp);
    figures.tokens_per_s = speeds.get(speeds.len() / 2).copied();
    let (ok_loss, d_loss) = listed("non-finite loss", steps_where(&|r| !r.loss.is_finite()));
    let (ok_norm, d_norm) = listed(
        "non-finite gradient norm",
        steps_where(&|r| !r.grad_norm.is_finite()),
    );
    let (ok_skip, d_skip) = listed("skipped updates", steps_where(&|r| r.skipped));
    let bound = (1.0 - loss_drop) * first;
    vec![
        check("losses_finite", ok_loss, d_loss),
        check("grad_norms_finite", ok_norm, d_norm),
        check("no_skipped_steps", ok_skip, d_skip),
        check(
            "loss_decreased",
            last <= bound,
            format!(
                "loss {first:.4} → {last:.4} ({:+.1}%): at most {bound:.4} (a drop of {:.1}%)",
                100.0 * (last / first - 1.0),
                100.0 * loss_drop
            ),
        ),
    ]
}

fn held_out(ck: &Checkpoint, figures: &mut SmokeFigures) -> Check {
    let scored = (|| -> Result<_> {
        let device = ck.plan.devices.open_main()?;
        let model = ck.model(&device)?;
        let tokenizer = crate::teachers::student_tokenizer(&ck.plan.data.tokenizer)?;
        held_out_score(&ck.plan, &tokenizer, &model, ck.plan.train.eval_batches)
    })();
    match scored {
        Ok(h) if h.loss.is_finite() && h.bits_per_byte.is_finite() => {
            figures.held_out_loss = Some(h.loss);
            figures.held_out_bits_per_byte = Some(h.bits_per_byte);
            check(
                "held_out",
                true,
                format!("loss {:.4}, {:.4} bits/byte", h.loss, h.bits_per_byte),
            )
        }
        Ok(h) => check(
            "held_out",
            false,
            format!("loss {}, {} bits/byte: not finite", h.loss, h.bits_per_byte),
        ),
        Err(e) => check("held_out", false, e.to_string()),
    }
}

/// Trains `split` to `resume_at`, resumes it to the end, and compares it with `straight`: every
/// weight tensor (by name: the files' metadata order varies) and the training state by their
/// SHA-256, and every step's losses by their bits. (Optimizer moments are keyed by parameter ids,
/// which differ between processes; equal weights after the last update need equal moments.)
fn resume(plan: &SmokePlan, ck: &Checkpoint, straight: &Path, split: &Path) -> Check {
    let compared = (|| -> Result<String> {
        train(&plan.run, &options(split, Some(plan.resume_at), false))?;
        let resumed = train(&plan.run, &options(split, None, true))?;
        if (resumed.first_step, resumed.last_step) != (plan.resume_at, plan.run.train.steps) {
            crate::bail!(
                "the resumed run trained steps {}..{}, not {}..{}",
                resumed.first_step,
                resumed.last_step,
                plan.resume_at,
                plan.run.train.steps
            );
        }
        let (a, b) = (
            checkpoint_digest(ck)?,
            checkpoint_digest(&open_checkpoint(split)?)?,
        );
        let differ: Vec<&str> = a
            .iter()
            .filter(|(name, sum)| b.get(*name) != Some(sum))
            .map(|(name, _)| name.as_str())
            .chain(b.keys().filter(|n| !a.contains_key(*n)).map(String::as_str))
            .collect();
        if !differ.is_empty() {
            let n = differ.len();
            crate::bail!(
                "the resumed checkpoint differs from the straight run's in {n} of {} entries: {}",
                a.len(),
                differ[..n.min(5)].join(", ")
            );
        }
        let losses = |run: &Path| -> Result<Vec<(usize, u64, Option<u64>)>> {
            Ok(read_metrics(run)?
                .iter()
                .map(|r| (r.step, r.loss.to_bits(), r.eval_loss.map(f64::to_bits)))
                .collect())
        };
        let (la, lb) = (losses(straight)?, losses(split)?);
        if let Some(((step, ..), _)) = la.iter().zip(&lb).find(|(x, y)| x != y) {
            crate::bail!("step {step}'s losses differ after the resume");
        }
        if la.len() != lb.len() {
            crate::bail!("{} steps logged straight, {} split", la.len(), lb.len());
        }
        Ok(format!(
            "stopped after step {}, resumed to {}: {} tensors, the training state and {} steps' \
             losses identical",
            plan.resume_at,
            plan.run.train.steps,
            a.len() - 1,
            la.len()
        ))
    })();
    stage("resume_bit_identical", compared)
}

/// A (verified) checkpoint as SHA-256 digests: each weight tensor's dtype, shape and bytes by
/// name, and its training state as `state.json`.
fn checkpoint_digest(ck: &Checkpoint) -> Result<std::collections::BTreeMap<String, String>> {
    use k3mini_data::digest::{Digest, Sha256, hex};
    use std::io::{Read, Seek, SeekFrom};
    let mut sums = std::collections::BTreeMap::new();
    let state = std::fs::read(ck.dir.join(crate::run_dir::STATE))
        .with_context(|| format!("{}", ck.dir.display()))?;
    let mut h = Sha256::new();
    h.update(&state);
    sums.insert(crate::run_dir::STATE.to_string(), hex(h));
    for path in &ck.weights {
        let (start, header) = k3mini_student::hf::safetensors_header(path)
            .map_err(|e| crate::refused!("{}: {e}", path.display()))?;
        let mut f = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
        for (name, info) in header {
            let entry: TensorEntry = serde_json::from_value(info)
                .map_err(|e| crate::refused!("{}: tensor {name}: {e}", path.display()))?;
            let [from, to] = entry.data_offsets;
            let mut bytes = vec![0u8; to.saturating_sub(from) as usize];
            f.seek(SeekFrom::Start(start + from))
                .and_then(|_| f.read_exact(&mut bytes))
                .with_context(|| format!("{}: tensor {name}", path.display()))?;
            let mut h = Sha256::new();
            h.update(format!("{} {:?}\n", entry.dtype, entry.shape).as_bytes());
            h.update(&bytes);
            sums.insert(name, hex(h));
        }
    }
    Ok(sums)
}

/// One tensor of a safetensors header.
#[derive(Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

#[cfg(feature = "llama-cpp")]
fn gguf_check(plan: &SmokePlan, ck: &Checkpoint, gguf: &Path, figures: &mut SmokeFigures) -> Check {
    use burn::tensor::{Int, Tensor, TensorData};
    use k3mini_student::precision::Precision;
    use k3mini_teacher::engine::llama_cpp::{LlamaCppModel, Placement};
    let measured = (|| -> Result<(f64, f64)> {
        crate::export::export_gguf(ck, plan.quant, None, gguf)?;
        let tokenizer = crate::teachers::student_tokenizer(&ck.plan.data.tokenizer)?;
        let text = crate::export::REFERENCE_TEXT;
        let ids = tokenizer.encode(text)?;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpp = LlamaCppModel::load(gguf, Placement::Cpu { threads })?;
        if cpp.tokenize(text)? != ids {
            crate::bail!("llama.cpp tokenises the reference text otherwise than k3mini");
        }
        let (got, _) = cpp.forward(&ids, false)?;
        let device = ck.plan.devices.open_main()?;
        let model = ck.model(&device)?.with_precision(Precision::F32);
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(ids.iter().map(|&i| i as i64).collect(), [1, ids.len()]),
            &device,
        );
        let want: Vec<f32> = model
            .forward(tokens)
            .into_data()
            .convert::<f32>()
            .try_into_vec()
            .map_err(|e| crate::refused!("{e:?}"))?;
        logit_agreement(&want, &got, ck.plan.model.vocab_size)
    })();
    match measured {
        Ok((kl, top1)) => {
            figures.gguf_kl = Some(kl);
            figures.gguf_top1 = Some(top1);
            check(
                "gguf_in_llama_cpp",
                kl <= plan.max_gguf_kl,
                format!(
                    "{}: mean KL {kl:.2e} (at most {:.0e}), top-1 agreement {:.1}%",
                    plan.quant.name(),
                    plan.max_gguf_kl,
                    100.0 * top1
                ),
            )
        }
        Err(e) => check("gguf_in_llama_cpp", false, e.to_string()),
    }
}

#[cfg(not(feature = "llama-cpp"))]
fn gguf_check(_: &SmokePlan, _: &Checkpoint, _: &Path, _: &mut SmokeFigures) -> Check {
    check(
        "gguf_in_llama_cpp",
        false,
        "this k3mini is built without llama.cpp (feature llama-cpp)".into(),
    )
}

/// Mean `KL(softmax(want) ‖ softmax(got))` over rows of `vocab` logits, and top-1 agreement.
pub fn logit_agreement(want: &[f32], got: &[f32], vocab: usize) -> Result<(f64, f64)> {
    if want.len() != got.len() || want.is_empty() || want.len() % vocab != 0 {
        crate::bail!(
            "llama.cpp returned {} logits where k3mini has {} ({vocab} per position)",
            got.len(),
            want.len()
        );
    }
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let z = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        row.iter().map(|&x| x as f64 - m - z).collect()
    };
    let argmax = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j]));
    let (mut kl, mut agree) = (0.0, 0usize);
    for (w, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
        let (p, q) = (log_softmax(w), log_softmax(g));
        kl += p
            .iter()
            .zip(&q)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        agree += (argmax(w) == argmax(g)) as usize;
    }
    let n = (want.len() / vocab) as f64;
    Ok((kl / n, agree as f64 / n))
}

/// Whether `baseline` is a passing smoke of the same thing as `now`: its run, step count, GGUF
/// type and devices.
fn comparable(now: &SmokeReport, baseline: &SmokeReport) -> std::result::Result<(), String> {
    let failed = baseline.failed();
    if !failed.is_empty() {
        return Err(format!("the baseline failed {}", failed.join(", ")));
    }
    let of = |r: &SmokeReport| {
        format!(
            "run {:?} ({} steps, {}, on {})",
            r.run, r.figures.steps, r.quant, r.devices
        )
    };
    if of(baseline) == of(now) {
        return Ok(());
    }
    Err(format!(
        "the baseline is a smoke of {}, this one of {}",
        of(baseline),
        of(now)
    ))
}

/// The figures against a baseline's (or why there is none to compare with), as ratios within
/// `t`; skipped where either lacks a figure.
pub fn against_baseline(
    now: &SmokeFigures,
    baseline: std::result::Result<&SmokeFigures, String>,
    t: &BaselineTolerances,
) -> Vec<Check> {
    let b = match baseline {
        Ok(b) => b,
        Err(why) => {
            return ["tokens_per_s", "peak_memory", "final_loss"]
                .into_iter()
                .map(|n| skipped(n, &why))
                .collect();
        }
    };
    let ratio = |name: &str, now: Option<f64>, then: Option<f64>, limit: f64, at_least: bool| {
        let (Some(now), Some(then)) = (now, then) else {
            return skipped(name, "the run or the baseline lacks the figure");
        };
        let r = now / then;
        let ok = if at_least { r >= limit } else { r <= limit };
        let rel = if at_least { "at least" } else { "at most" };
        check(
            name,
            ok,
            format!("{now:.4} against the baseline's {then:.4}: ratio {r:.3} ({rel} {limit})"),
        )
    };
    let rss = |f: &SmokeFigures| f.peak_rss_bytes.map(|b| b as f64);
    vec![
        ratio(
            "tokens_per_s",
            now.tokens_per_s,
            b.tokens_per_s,
            t.min_tokens_per_s_ratio,
            true,
        ),
        ratio(
            "peak_memory",
            rss(now),
            rss(b),
            t.max_peak_memory_ratio,
            false,
        ),
        ratio(
            "final_loss",
            now.final_loss,
            b.final_loss,
            t.max_final_loss_ratio,
            false,
        ),
    ]
}

/// smoke.json and smoke.junit.xml in `dir`, each written atomically.
fn write_reports(report: &SmokeReport, dir: &Path) -> Result<()> {
    use quick_junit::{NonSuccessKind, Report, TestCase, TestCaseStatus, TestSuite};
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_vec_pretty(report).map_err(|e| crate::refused!("{e}"))?;
    k3mini_durable::write(&dir.join(REPORT), &json)
        .with_context(|| format!("writing {}", dir.join(REPORT).display()))?;
    let mut suite = TestSuite::new(format!("k3mini smoke {}", report.run));
    for c in &report.checks {
        let mut status = match c.outcome {
            Outcome::Passed => TestCaseStatus::success(),
            Outcome::Failed => TestCaseStatus::non_success(NonSuccessKind::Failure),
            Outcome::Skipped => TestCaseStatus::skipped(),
        };
        if c.outcome != Outcome::Passed {
            status.set_message(c.detail.as_str());
        }
        let mut case = TestCase::new(c.name.as_str(), status);
        case.set_classname(format!("smoke.{}", report.run));
        case.set_system_out(c.detail.as_str());
        suite.add_test_case(case);
    }
    let mut junit = Report::new("k3mini smoke");
    junit.set_time(std::time::Duration::from_secs_f64(report.wall_s));
    junit.add_test_suite(suite);
    let xml = junit.to_string().map_err(|e| crate::refused!("{e}"))?;
    k3mini_durable::write(&dir.join(JUNIT), xml.as_bytes())
        .with_context(|| format!("writing {}", dir.join(JUNIT).display()))
}
