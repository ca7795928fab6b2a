//! `k3mini eval` on a real (briefly trained) run: the held-out numbers are the trainer's own, the
//! memory rows are measured states with the hybrid's growth a quarter of the all-MLA twin's, and
//! the report's files are written.
use crate::fixture::Recipe;
use k3mini::evaluate::{Suite, evaluate};
use k3mini::recipe;
use k3mini::train::trainer::{TrainOptions, train};
use k3mini_eval::report::write_report;
use k3mini_gguf::mix::FileType;
use std::path::Path;

#[test]
fn eval_measures_a_run_and_writes_its_report() {
    let dir = std::env::temp_dir().join(format!("k3mini-eval-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/corpus");
    for play in ["hamlet", "macbeth"] {
        let text = std::fs::read_to_string(root.join(format!("shakespeare/{play}.txt"))).unwrap();
        std::fs::write(dir.join(format!("{play}.txt")), &text[..20_000]).unwrap();
    }
    let recipe_text = Recipe::default()
        .with("run", "name = \"e\"\nseed = 5")
        .with(
            "model",
            "preset = \"tiny\"\nvocab_size = 4096\nd_model = 64",
        )
        .with(
            "data",
            "tokenizer = \"tok/bpe.json\"\nseq_len = 128\nheld_out_fraction = 0.3\n\
             [[data.sources]]\npath = \"hamlet.txt\"\n[[data.sources]]\npath = \"macbeth.txt\"",
        )
        .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
        .with(
            "train",
            "steps = 4\nbatch_tokens = 512\nmicro_batch = 4\neval_every = 4\neval_batches = 2",
        )
        .text();
    // A tokenizer named relative to the recipe (as recipes/ci-tiny.toml names its own).
    std::fs::create_dir_all(dir.join("tok")).unwrap();
    std::fs::copy(
        root.join("shakespeare-bpe4k.json"),
        dir.join("tok/bpe.json"),
    )
    .unwrap();
    let path = dir.join("recipe.toml");
    std::fs::write(&path, recipe_text).unwrap();
    let run = dir.join("run");
    let opts = TrainOptions {
        out_dir: Some(run.clone()),
        ..Default::default()
    };
    train(&recipe::load(&path).unwrap(), &opts).unwrap();

    let (report, curves) = evaluate(&run, Suite::Quick, None, None).unwrap();
    let report_loss = report.loss;
    // The quick suite evaluates the batches training evaluated: the same loss.
    let logged = k3mini::run_dir::read_metrics(&run)
        .unwrap()
        .iter()
        .rev()
        .find_map(|m| m.eval_loss)
        .unwrap();
    assert!(
        (report.loss - logged).abs() < 1e-4,
        "{} vs {logged}",
        report.loss
    );
    assert!((report.ppl - report.loss.exp()).abs() < 1e-9 * report.ppl);
    assert!(
        report.bits_per_byte > 0.0 && report.bits_per_byte < report.loss / std::f64::consts::LN_2
    );
    assert_eq!(report.step, 4);
    assert!(report.teacher_top1.is_none(), "a plain run has no teacher");
    assert_eq!(report.passkey.len(), 6, "2 lengths x 3 depths");
    assert!(
        report
            .passkey
            .iter()
            .all(|c| c.context <= 1024 && c.key.len() == 5)
    );
    assert!(
        report.exact_match.is_empty(),
        "no [teacher.generate] prompts"
    );
    // tiny is KKKM: one MLA layer in four, so the hybrid's state grows a quarter as fast.
    let (a, b) = (&report.memory[0], &report.memory[2]);
    assert_eq!((a.context, b.context), (512, 8192));
    assert!(b.all_mla_bytes > b.hybrid_bytes);
    assert_eq!(
        4 * (b.hybrid_bytes - a.hybrid_bytes),
        b.all_mla_bytes - a.all_mla_bytes
    );
    assert!(report.decode_tokens_per_s > 0.0);
    assert_eq!(curves.train_loss.len(), 4);

    let out = dir.join("report");
    let md = write_report(&out, &[report], &[curves]).unwrap();
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("eval.json")).unwrap()).unwrap();
    assert!(json[0]["ppl"].as_f64().unwrap() > 1.0);
    let md = std::fs::read_to_string(md).unwrap();
    assert!(
        md.contains("| run | step | held-out ppl")
            && md.contains("![memory against context](memory.svg)")
    );
    for svg in ["loss.svg", "memory.svg"] {
        let text = std::fs::read_to_string(out.join(svg)).unwrap();
        assert!(text.starts_with("<svg"), "{svg}");
    }
    // The checkpoint carries its resolved plan: with the recipe file gone (or edited, or the
    // presets changed), eval and export rebuild exactly the run that trained, from any working
    // directory, with the tokenizer the recipe named relative to itself.
    std::fs::remove_file(&path).unwrap();
    let (again, _) = evaluate(&run, Suite::Quick, None, None).unwrap();
    assert_eq!(
        again.loss.to_bits(),
        logged_bits(&run),
        "the same held-out loss"
    );
    held_out_source_is_another_recipes_evaluation_set(&dir, &run, report_loss);
    let gguf = dir.join("student.gguf");
    let ck = k3mini::run_dir::open_checkpoint(&run).unwrap();
    k3mini::export::export_gguf(&ck, FileType::F32, None, &gguf).unwrap();
    let file = k3mini_gguf::GgufFile::open(&gguf).unwrap();
    assert!(file.keys.iter().any(|k| k == "tokenizer.ggml.tokens"));
    // Trained with its own BPE, exported, served, scored.
    #[cfg(feature = "llama-cpp")]
    crate::export_llama_cpp::served_student_scores_as_k3mini(
        &gguf,
        &ck.model(&burn::tensor::Device::default()).unwrap(),
        &k3mini::teachers::student_tokenizer(&ck.plan.data.tokenizer).unwrap(),
    );
    // A directory without checkpoints is named.
    let e = evaluate(&dir, Suite::Quick, None, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("neither a checkpoint nor a run directory"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Another recipe's evaluation set: Macbeth held out whole, nothing hashed out. Its held-out rows
/// are Macbeth's tokens from the start, and `run` (which holds Macbeth out, its own held-out loss
/// `own_loss`) is measured on them.
fn held_out_source_is_another_recipes_evaluation_set(dir: &Path, run: &Path, own_loss: f64) {
    let macbeth_only = |held_out: bool| {
        let text = Recipe::default()
            .with("run", "name = \"m\"\nseed = 5")
            .with(
                "model",
                "preset = \"tiny\"\nvocab_size = 4096\nd_model = 64",
            )
            .with(
                "data",
                &format!(
                    "tokenizer = \"tok/bpe.json\"\nseq_len = 128\nheld_out_fraction = 0\n\
                     [[data.sources]]\npath = \"macbeth.txt\"\nheld_out = {held_out}"
                ),
            )
            .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
            .with(
                "train",
                "steps = 1\nbatch_tokens = 512\nmicro_batch = 4\neval_batches = 2",
            )
            .text();
        std::fs::write(dir.join("eval.toml"), text).unwrap();
        recipe::load(&dir.join("eval.toml")).unwrap()
    };
    let eval_plan = macbeth_only(true);
    let tokenizer = k3mini::teachers::student_tokenizer(&eval_plan.data.tokenizer).unwrap();
    let k3mini::train::held_out::HeldOut::Documents { batches } =
        k3mini::train::modes::held_out(&eval_plan, &tokenizer, 2).unwrap()
    else {
        panic!("a plain recipe's held-out set is documents");
    };
    let macbeth = std::fs::read_to_string(dir.join("macbeth.txt")).unwrap();
    let ids: Vec<i64> = tokenizer
        .encode(&macbeth)
        .unwrap()
        .iter()
        .map(|&i| i as i64)
        .collect();
    let rows: Vec<i64> = batches.iter().flat_map(|b| b.tokens.clone()).collect();
    assert_eq!(rows.len(), 2 * 4 * 128);
    assert_eq!(
        rows[..],
        ids[..rows.len()],
        "Macbeth's tokens from its start"
    );
    // Seed 5 at 0.3 holds Macbeth out of the run (and Hamlet in): the evaluation set's rows are
    // the run's own held-out rows, so another recipe's set measures the run's own loss.
    let (on_macbeth, _) = evaluate(run, Suite::Quick, None, Some(&eval_plan)).unwrap();
    assert!(on_macbeth.loss.is_finite());
    assert_eq!(on_macbeth.loss.to_bits(), own_loss.to_bits());
    // The same source not held out, and no fraction: nothing to evaluate, said so.
    let e = evaluate(run, Suite::Quick, None, Some(&macbeth_only(false)))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nothing is held out"), "{e}");
}

/// The last logged held-out loss of a run, as bits.
fn logged_bits(run: &Path) -> u64 {
    k3mini::run_dir::read_metrics(run)
        .unwrap()
        .iter()
        .rev()
        .find_map(|m| m.eval_loss)
        .unwrap()
        .to_bits()
}
