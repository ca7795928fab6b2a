//! The CLI end to end: `k3mini model info` on presets, recipes and bad input.
use assert_cmd::Command;

fn k3mini() -> Command {
    Command::cargo_bin("k3mini").unwrap()
}

#[test]
fn model_info_json_for_every_preset() {
    for preset in ["tiny", "smoke-300m", "k3-mini-3b", "k3-mini-moe"] {
        let out = k3mini()
            .args(["model", "info", "--preset", preset, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{preset}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["total_params"].as_u64().unwrap() >= v["active_params"].as_u64().unwrap());
    }
}

#[test]
fn model_info_text_shows_the_state_comparison() {
    let out = k3mini()
        .args(["model", "info", "--preset", "tiny"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("all-MLA") && text.contains("131072 tokens"),
        "{text}"
    );
}

#[test]
fn unknown_preset_is_a_clear_error() {
    let out = k3mini()
        .args(["model", "info", "--preset", "k3-giant"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("`preset`") && err.contains("k3-mini-3b"),
        "{err}"
    );
}

#[test]
fn bad_recipe_names_file_and_field() {
    let s = crate::fixture::Scratch::new("cli-bad-recipe");
    s.write("corpus.txt", "To be, or not to be.\n");
    let text = crate::fixture::Recipe::default()
        .with("model", "preset = \"tiny\"\nlayer_pattern = \"KKQM\"")
        .text();
    let recipe = s.write("bad.toml", &text);
    let out = k3mini()
        .args(["model", "info", "--recipe"])
        .arg(&recipe)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("bad.toml") && err.contains("layer_pattern") && err.contains("'Q'"),
        "{err}"
    );
}

/// Recipes that read what another recipe's commands make (README, "Routing statistics"): each
/// with the files it may be missing until those have been run.
const MADE_BY_OTHER_RECIPES: &[(&str, &[&str])] = &[
    ("moe-routing.toml", &["runs/moe-teacher/moe-teacher.gguf"]),
    (
        "moe-routing-router-kl.toml",
        &[
            "runs/moe-teacher/moe-teacher.gguf",
            "runs/moe-routing/shards/routing-design/design.json",
        ],
    ),
    ("moe-prune-recover.toml", &["runs/moe-teacher-reap-0.5"]),
];

#[test]
fn every_recipe_resolves() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = k3mini()
                .args(["model", "info", "--json", "--recipe"])
                .arg(&path)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            // Until then the only complaint may be one of those files' absence.
            let awaiting = MADE_BY_OTHER_RECIPES.iter().any(|(recipe, files)| {
                let absent = [
                    "no file at",
                    "No such file",
                    "neither a checkpoint nor a run",
                ]
                .iter()
                .any(|m| stderr.contains(m));
                path.ends_with(recipe) && absent && files.iter().any(|f| stderr.contains(f))
            });
            assert!(
                out.status.success() || awaiting,
                "{}: {stderr}",
                path.display(),
            );
            n += 1;
        }
    }
    assert!(n > 0, "no recipes found");
}

#[test]
fn tokenizer_train_then_encode() {
    let dir = std::env::temp_dir().join(format!("k3mini-cli-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("c.txt");
    std::fs::write(
        &corpus,
        "state space models and linear attention, again and again.\n".repeat(50),
    )
    .unwrap();
    let out = dir.join("tokenizer.json");
    let args = ["data", "tokenizer", "train", "--vocab-size", "300", "--out"];
    let args = args.iter().map(std::ffi::OsStr::new);
    crate::fixture::k3mini_ok(args.chain([out.as_os_str(), corpus.as_os_str()]));
    let enc = k3mini()
        .args(["data", "tokenizer", "encode"])
        .arg(&out)
        .arg("linear attention")
        .output()
        .unwrap();
    let ids = String::from_utf8(enc.stdout).unwrap();
    assert!(
        ids.starts_with('[') && ids.matches(',').count() < 8,
        "merged ids: {ids}"
    );
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, b"caf\xe9").unwrap();
    let run = k3mini()
        .args(["data", "tokenizer", "train", "--out"])
        .arg(dir.join("x.json"))
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("bad.txt: not valid UTF-8 at byte 3"));
    // A vocabulary no trainer should allocate is refused, not an out-of-memory abort.
    let run = k3mini()
        .args([
            "data",
            "tokenizer",
            "train",
            "--vocab-size",
            "1000000000000",
            "--out",
        ])
        .arg(dir.join("y.json"))
        .arg(&corpus)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(err.contains("at most 16777216"), "{err}");
    // So is an empty special token.
    let run = k3mini()
        .args(["data", "tokenizer", "train", "--special", "", "--out"])
        .arg(dir.join("z.json"))
        .arg(&corpus)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("special token \"\""), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    // `k3mini data chat many.jsonl --limit 5000 | head -c 100`: the reader goes away early.
    let dir = std::env::temp_dir().join(format!("k3mini-cli-pipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let line = r#"{"messages": [{"role": "user", "content": "Tomorrow, and tomorrow?"}, {"role": "assistant", "content": "And tomorrow."}]}"#;
    let file = dir.join("many.jsonl");
    std::fs::write(&file, format!("{line}\n").repeat(5000)).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(["data", "chat", "--limit", "5000"])
        .arg(&file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut head = [0u8; 100];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut head).unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--ranks N` is the estimate for N ranks of one device each (eight a node, say), the optimizer
/// state sharded across all of them: the same as N devices in one process, and less each the
/// more ranks share it.
#[test]
fn model_info_per_rank_memory_shards_the_optimizer_across_every_rank() {
    let recipe = crate::fixture::root().join("recipes/k3-mini-3b.toml");
    let info = |args: &[&str]| {
        let out = crate::fixture::k3mini_ok(
            [
                "model".as_ref(),
                "info".as_ref(),
                "--recipe".as_ref(),
                recipe.as_os_str(),
            ]
            .into_iter()
            .chain(args.iter().map(std::ffi::OsStr::new)),
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let total = |args: &[&str]| {
        let json = info(&[args, &["--json"]].concat());
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["training_memory_total"].as_u64().unwrap()
    };
    let one_node = total(&["--ranks", "8"]);
    assert_eq!(one_node, total(&["--device", "cuda:0,1,2,3,4,5,6,7"]));
    assert!(total(&["--ranks", "16"]) < one_node);
    assert!(one_node < total(&["--ranks", "1"]));
    let text = info(&["--ranks", "8"]);
    assert!(
        text.contains("training memory of each rank")
            && text.contains("8 ranks, optimizer state sharded"),
        "{text}"
    );
}

/// A help text's commands, `(name, about)`, without `help`.
fn commands(args: &[&str]) -> Vec<(String, String)> {
    let out = k3mini().args(args).arg("--help").output().unwrap();
    assert!(out.status.success(), "{args:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip_while(|l| *l != "Commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .filter_map(|l| {
            let (name, about) = l.trim().split_once(' ')?;
            Some((name.to_string(), about.trim().to_string()))
        })
        .filter(|(name, _)| name != "help")
        .collect()
}

#[test]
fn every_subcommand_is_named_in_its_parents_line() {
    // Down the tree from `k3mini --help`: a command with subcommands names each in its own line,
    // so a newcomer reading one level knows what the next holds.
    let mut todo: Vec<Vec<String>> = vec![Vec::new()];
    let mut seen = 0;
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        for (name, about) in commands(&args) {
            let mut child = path.clone();
            child.push(name.clone());
            let words: Vec<&str> = about
                .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '-'))
                .collect();
            let args: Vec<&str> = child.iter().map(String::as_str).collect();
            for (grandchild, _) in commands(&args) {
                assert!(
                    words.contains(&grandchild.as_str()),
                    "`k3mini {}`'s line does not name its subcommand `{grandchild}`: {about}",
                    child.join(" ")
                );
                seen += 1;
            }
            todo.push(child);
        }
    }
    assert!(seen > 20, "{seen} subcommands checked");
}
