//! `k3mini smoke`: a healthy run (the training tests' small corpus, 8 steps) passes every health
//! check and fails exactly the baseline checks it falls behind on; the CI recipe (ci-tiny,
//! shortened) with an absurd learning rate fails, naming its checks, with a non-zero exit;
//! `[smoke]` is validated.
use crate::fixture::{Scratch, root};
use k3mini::smoke::{Outcome, SmokeOptions, SmokeReport, against_baseline, smoke};
use std::path::PathBuf;

/// ci-tiny as a recipe in `dir`: its corpus and tokenizer by absolute path, 8 steps, with `edit`
/// applied to the text.
fn ci_tiny(dir: &std::path::Path, edit: impl Fn(String) -> String) -> PathBuf {
    let corpus = root().join("recipes/corpus");
    let text = std::fs::read_to_string(root().join("recipes/ci-tiny.toml"))
        .unwrap()
        .replace("\"corpus/", &format!("\"{}/", corpus.display()))
        .replace("steps = 40", "steps = 8")
        .replace("eval_every = 10", "eval_every = 4")
        .replace("checkpoint_every = 20", "checkpoint_every = 4");
    let path = dir.join("ci-tiny.toml");
    std::fs::write(&path, edit(text)).unwrap();
    path
}

#[test]
fn a_healthy_run_passes_its_checks_and_fails_a_baseline_it_falls_behind() {
    let (s, recipe) = crate::train::setup("smoke-healthy", 8, "");
    let plan = k3mini::recipe::load_smoke(&recipe).unwrap();
    assert_eq!(plan.resume_at, 4, "half the steps by default");
    // A night that trained 1000 times faster to a tenth of the loss.
    let mut baseline: SmokeReport = serde_json::from_value(serde_json::json!({
        "run": "t", "devices": "cpu", "recipe": "recipe.toml", "quant": "q8_0", "wall_s": 1.0,
        "checks": [],
        "figures": {"steps": 8, "tokens_per_s": 1e9, "final_loss": 0.5},
    }))
    .unwrap();
    let dir = s.0.join("smoke");
    let opts = SmokeOptions {
        dir: dir.clone(),
        baseline: Some(baseline.clone()),
    };
    let report = smoke(&plan, &opts).unwrap();
    for c in &report.checks {
        eprintln!("{:?} {}: {}", c.outcome, c.name, c.detail);
    }
    assert_eq!(report.failed(), ["tokens_per_s", "final_loss"]);
    let outcome = |name: &str| {
        &report
            .checks
            .iter()
            .find(|c| c.name == name)
            .unwrap()
            .outcome
    };
    for name in [
        "train",
        "losses_finite",
        "grad_norms_finite",
        "no_skipped_steps",
        "loss_decreased",
        "held_out",
        "resume_bit_identical",
        "gguf_in_llama_cpp",
    ] {
        assert_eq!(outcome(name), &Outcome::Passed, "{name}");
    }
    assert_eq!(
        outcome("peak_memory"),
        &Outcome::Skipped,
        "the baseline has none"
    );
    // The report reads back as the next night's baseline, and against itself every ratio holds.
    let written = SmokeReport::read_baseline(&dir.join(k3mini::smoke::REPORT)).unwrap();
    assert_eq!(written, report);
    // JUnit: one case per check, the failures with their details.
    let xml = std::fs::read_to_string(dir.join(k3mini::smoke::JUNIT)).unwrap();
    assert_eq!(xml.matches("<testcase ").count(), report.checks.len());
    assert_eq!(xml.matches("<failure").count(), 2, "{xml}");
    assert!(xml.contains("name=\"tokens_per_s\""), "{xml}");
    let f = &report.figures;
    assert!(f.held_out_bits_per_byte.is_some() && f.gguf_kl.is_some() && f.tokens_per_s.is_some());
    assert!(f.peak_rss_bytes.is_some_and(|b| b > 0));
    let same = against_baseline(f, Ok(f), &plan.tolerances);
    assert!(
        same.iter().all(|c| c.outcome == Outcome::Passed),
        "{same:?}"
    );
    // A baseline of another run (here: a renamed one) is no yardstick: skipped, not failed.
    let mut renamed = written.clone();
    renamed.run = "other".into();
    // (A baseline that failed a check is no yardstick either: this one passes them all.)
    renamed.checks.retain(|c| c.outcome != Outcome::Failed);
    let report = smoke(
        &plan,
        &SmokeOptions {
            dir: dir.clone(),
            baseline: Some(renamed),
        },
    )
    .unwrap();
    assert_eq!(report.failed(), Vec::<&str>::new());
    let skipped = report
        .checks
        .iter()
        .filter(|c| c.outcome == Outcome::Skipped);
    assert!(skipped.clone().all(|c| c.detail.contains("run \"other\"")));
    assert_eq!(skipped.count(), 3);
    // Runs in a directory that is not a smoke's are never replaced.
    let other = s.0.join("mine");
    std::fs::create_dir_all(other.join("straight")).unwrap();
    let opts = SmokeOptions {
        dir: other.clone(),
        baseline: None,
    };
    let e = smoke(&plan, &opts).unwrap_err().to_string();
    assert!(e.contains("not a smoke's directory"), "{e}");
    // A smoke marks its directory before its first run, so one killed before its report reruns.
    assert!(dir.join(".k3mini-smoke").is_file());
    assert!(other.join("straight").is_dir());
    // A baseline that is not a report, or whose figures are not positive, is refused by name.
    let bad = s.0.join("bad.json");
    std::fs::write(&bad, "{\"run\": 1}").unwrap();
    let e = SmokeReport::read_baseline(&bad).unwrap_err().to_string();
    assert!(e.contains("not a k3mini smoke report"), "{e}");
    baseline.figures.tokens_per_s = Some(-1.0);
    std::fs::write(&bad, serde_json::to_string(&baseline).unwrap()).unwrap();
    let e = SmokeReport::read_baseline(&bad).unwrap_err().to_string();
    assert!(e.contains("tokens_per_s = -1 is not positive"), "{e}");
}

#[test]
fn a_diverging_run_fails_naming_its_checks() {
    let s = Scratch::new("smoke-diverge");
    let recipe = ci_tiny(&s.0, |t| t.replace("lr = 3e-3", "lr = 1e4"));
    let out = assert_cmd::Command::cargo_bin("k3mini")
        .unwrap()
        .args(["smoke", "--quiet", "--out"])
        .arg(s.0.join("smoke"))
        .arg(&recipe)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let failed = stderr
        .lines()
        .find_map(|l| l.strip_prefix("error: smoke failed: "))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(failed.contains("loss_decreased"), "{failed}");
    assert!(failed.contains("losses_finite"), "{failed}");
    let report = SmokeReport::read_baseline(&s.0.join("smoke").join(k3mini::smoke::REPORT));
    assert_eq!(report.unwrap().failed().join(", "), failed);
}

#[test]
fn the_smoke_table_is_validated_by_key() {
    let s = Scratch::new("smoke-table");
    for (table, key, says) in [
        ("resume_at = 8", "smoke.resume_at", "1 to 7"),
        ("loss_drop = 1.5", "smoke.loss_drop", "[0, 1)"),
        ("quant = \"q5_k\"", "smoke.quant", "q4_k_m"),
        (
            "max_peak_memory_ratio = 0",
            "smoke.max_peak_memory_ratio",
            "positive",
        ),
    ] {
        let path = ci_tiny(&s.0, |t| format!("{t}\n[smoke]\n{table}\n"));
        let e = k3mini::recipe::load_smoke(&path).unwrap_err();
        assert_eq!(e.key, key);
        assert!(e.to_string().contains(says), "{e}");
        assert!(e.line.is_some(), "{e}");
        // A run does not need its smoke to be right.
        k3mini::recipe::load(&path).unwrap();
    }
}
