//! Recipes: defaults, resolution, and errors that name file, line and key.
use crate::fixture::Scratch;
use k3mini::recipe::{self, RecipeError, ScheduleConfig};
use k3mini_data::ChatFormat;
use std::path::Path;

/// A scratch directory with a corpus file.
fn scratch(tag: &str) -> Scratch {
    let s = Scratch::new(&format!("recipe-{tag}"));
    s.write("corpus.txt", "It was the best of times.");
    s
}

const GOOD: &str = r#"[run]
name = "t"
seed = 7

[model]
preset = "tiny"
d_model = 64
vocab_size = 163840

[data]
tokenizer = "kimi"
seq_len = 128
[[data.sources]]
path = "corpus.txt"

[optim]
lr = 3e-3

[schedule]
kind = "cosine"
warmup_steps = 10

[train]
steps = 100
batch_tokens = 1024
micro_batch = 4
"#;

fn error(tag: &str, text: &str) -> RecipeError {
    let s = scratch(tag);
    recipe::load(&s.write("recipe.toml", text)).unwrap_err()
}

/// Line (1-based) of the first line of `text` containing `needle`.
fn line_with(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn a_good_recipe_resolves_with_explicit_defaults() {
    let s = scratch("good");
    let r = recipe::load(&s.write("recipe.toml", GOOD)).unwrap();
    assert_eq!(r.model.d_model, 64);
    assert_eq!(r.accumulation, 2); // 1024 / (4 x 128)
    assert_eq!(r.optim.betas, [0.9, 0.95]);
    assert_eq!(r.optim.eps, 1e-8);
    assert_eq!(r.optim.weight_decay, 0.1);
    assert_eq!(
        r.schedule,
        ScheduleConfig::Cosine {
            warmup_steps: 10,
            min_lr_ratio: 0.1
        }
    );
    assert_eq!(r.out_dir, std::path::absolute("runs/t").unwrap());
    assert_eq!(r.data.sources[0].path, s.path("corpus.txt"), "absolute");
    let resolved = r.to_toml();
    assert!(
        resolved.contains("kv_lora_rank") && resolved.contains("weight_decay"),
        "{resolved}"
    );
    // The plan a checkpoint stores reads back as itself.
    assert_eq!(recipe::RunPlan::from_toml(&resolved).unwrap(), r);
}

#[test]
fn a_built_in_teachers_vocabulary_needs_no_teacher_table() {
    // A model trained to become a teacher shares SmolLM2's vocabulary without distilling from it.
    let s = scratch("smollm2-vocab");
    let text = GOOD.replace("tokenizer = \"kimi\"", "tokenizer = \"smollm2\"");
    let r = recipe::load(&s.write("recipe.toml", &text)).unwrap();
    assert_eq!(
        r.data.tokenizer,
        recipe::TokenizerSpec::Teacher {
            model: recipe::LocalModel::Builtin {
                name: "smollm2".into()
            }
        }
    );
    assert!(r.distill.is_none());
    let e = error(
        "no-vocab",
        &GOOD.replace("tokenizer = \"kimi\"", "tokenizer = \"smollm3\""),
    );
    assert!(
        e.message.contains("built-in teacher's name (smollm2)"),
        "{e}"
    );
}

#[test]
fn unknown_keys_are_rejected_with_their_line() {
    let text = GOOD.replace("lr = 3e-3", "lr = 3e-3\nlearning_rate = 1");
    let e = error("unknown", &text);
    assert!(e.message.contains("learning_rate"), "{e}");
    assert_eq!(e.line, Some(line_with(&text, "learning_rate")), "{e}");
}

#[test]
fn syntax_errors_point_at_the_line() {
    let text = GOOD.replace("seq_len = 128", "seq_len = = 128");
    let e = error("syntax", &text);
    assert_eq!(e.line, Some(line_with(&text, "seq_len")), "{e}");
    assert!(e.to_string().contains("recipe.toml:"), "{e}");
}

#[test]
fn bad_values_name_key_and_line() {
    for (from, to, key, needle) in [
        ("lr = 3e-3", "lr = -1.0", "optim.lr", "lr = -1.0"),
        (
            "d_model = 64",
            "d_model = 64\nlayer_pattern = \"KXM\"",
            "model.layer_pattern",
            "layer_pattern",
        ),
        (
            "preset = \"tiny\"",
            "preset = \"huge\"",
            "model.preset",
            "preset =",
        ),
        // A model override of the wrong type, or an unknown one, is named at its own line (not
        // the preset's).
        (
            "d_model = 64",
            "d_model = 64\nn_heads = -2",
            "model.n_heads",
            "n_heads = -2",
        ),
        (
            "d_model = 64",
            "d_model = 64\nn_head = 4",
            "model.n_head",
            "n_head = 4",
        ),
        (
            "batch_tokens = 1024",
            "batch_tokens = 1000",
            "train.batch_tokens",
            "batch_tokens",
        ),
        (
            "warmup_steps = 10",
            "warmup_steps = 100",
            "schedule.warmup_steps",
            "warmup_steps",
        ),
        (
            "path = \"corpus.txt\"",
            "path = \"missing.txt\"",
            "data.sources.0.path",
            "missing.txt",
        ),
        (
            "tokenizer = \"kimi\"",
            "tokenizer = \"nope.json\"",
            "data.tokenizer",
            "nope.json",
        ),
    ] {
        let text = GOOD.replace(from, to);
        let e = error(&key.replace('.', "-"), &text);
        assert_eq!(e.key, key, "{e}");
        assert_eq!(e.line, Some(line_with(&text, needle)), "{e}");
    }
}

#[test]
fn an_unreadable_file_is_named() {
    let e = recipe::load(Path::new("/no/such/recipe.toml")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/no/such/recipe.toml: cannot read"),
        "{e}"
    );
}

#[test]
fn recipe_check_prints_the_resolved_recipe() {
    let s = scratch("cli");
    // One document: nothing can be held out, which `train` (and so `recipe check`) refuses.
    let path = s.write(
        "recipe.toml",
        &GOOD.replace("seq_len = 128", "seq_len = 128\nheld_out_fraction = 0"),
    );
    let out = crate::fixture::k3mini_ok(["recipe".as_ref(), "check".as_ref(), path.as_os_str()]);
    let resolved: toml::Table = String::from_utf8(out.stdout).unwrap().parse().unwrap();
    assert_eq!(resolved["model"]["d_model"].as_integer(), Some(64));
    let bad = s.write(
        "recipe.toml",
        &GOOD.replace("micro_batch = 4", "micro_batch = 0"),
    );
    let out = assert_cmd::Command::cargo_bin("k3mini")
        .unwrap()
        .args(["recipe", "check"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("recipe.toml:") && err.contains("train.micro_batch"),
        "{err}"
    );
}

#[test]
fn generated_prompts_speak_the_vocabularys_chat_format_by_default() {
    let s = scratch("template");
    let generate = "\n[teacher]\nmodel = \"smollm2\"\n[teacher.generate]\nprompts = [{ dataset = \"champ\" }]\n\
                    [distill]\nmode = \"sequence\"\nobjectives = [{ kind = \"ce\" }]\n";
    let template = |text: String| {
        let plan = recipe::load(&s.write("recipe.toml", &text)).unwrap();
        plan.distill
            .unwrap()
            .teacher
            .generate
            .unwrap()
            .prompts
            .template
    };
    assert_eq!(template(format!("{GOOD}{generate}")), ChatFormat::KimiK3);
    let k2 = GOOD.replace("tokenizer = \"kimi\"", "tokenizer = \"kimi_k2\"");
    assert_eq!(template(format!("{k2}{generate}")), ChatFormat::KimiK2);
    let teachers = GOOD
        .replace("tokenizer = \"kimi\"", "tokenizer = \"teacher\"")
        .replace("vocab_size = 163840", "vocab_size = 49152");
    assert_eq!(
        template(format!("{teachers}{generate}")),
        ChatFormat::Chatml
    );
    let chosen =
        format!("{GOOD}{generate}").replace("[distill]", "template = \"kimi_k2\"\n[distill]");
    assert_eq!(template(chosen), ChatFormat::KimiK2);
}

#[test]
fn teacher_and_chat_settings_are_checked() {
    let teacher = "\n[teacher]\nmodel = \"smollm2\"\n";
    let distill = "\n[distill]\nmode = \"online\"\nobjectives = [{ kind = \"ce\" }]\n";
    let served = "\n[teacher]\nendpoints = [\"http://127.0.0.1:8000\"]\n";
    for (text, key, says) in [
        // A teacher nothing learns from is refused when the recipe is checked, not at train time.
        (format!("{GOOD}{teacher}"), "teacher", "without [distill]"),
        (format!("{GOOD}{distill}"), "distill", "needs a [teacher]"),
        // Signals are scored at τ = 1: a recipe claiming otherwise would train on mis-tempered
        // targets (online and sequence runs took this value as the signals' temperature).
        (
            format!("{GOOD}{distill}{teacher}temperature = 2.0\n"),
            "teacher.temperature",
            "scored at temperature 1",
        ),
        (
            GOOD.replace("tokenizer = \"kimi\"", "tokenizer = \"teacher\""),
            "data.tokenizer",
            "needs a [teacher] table",
        ),
        (
            format!("{GOOD}{teacher}endpoints = [\"http://127.0.0.1:8000\"]\n"),
            "teacher",
            "either `model`",
        ),
        (
            format!("{GOOD}{teacher}k = 0\n"),
            "teacher.k",
            "must be positive",
        ),
        // A served teacher's key comes from the environment variable the recipe names.
        (
            format!("{GOOD}{distill}{teacher}api_key_env = \"VLLM_API_KEY\"\n"),
            "teacher.api_key_env",
            "a local teacher takes no API key",
        ),
        (
            format!("{GOOD}{distill}{served}api_key_env = \"sk=1234\"\n"),
            "teacher.api_key_env",
            "not an environment variable's name",
        ),
        // Offline runs draw scored segments alike: a source weight would be silently ignored.
        (
            format!(
                "{}{teacher}",
                GOOD.replace(
                    "path = \"corpus.txt\"",
                    "path = \"corpus.txt\"\nweight = 2.0"
                ) + &distill.replace("online", "offline")
            ),
            "data.sources.0.weight",
            "weights mix plain and online runs only",
        ),
        // Offline runs split the scored shards by hash alone: a source held out whole would train.
        (
            format!(
                "{}{teacher}",
                GOOD.replace(
                    "path = \"corpus.txt\"",
                    "path = \"corpus.txt\"\nheld_out = true"
                ) + &distill.replace("online", "offline")
            ),
            "data.sources.0.held_out",
            "a source held out whole is for plain and online runs",
        ),
        (
            GOOD.replace(
                "path = \"corpus.txt\"",
                "path = \"corpus.txt\"\nchat = \"kimi\"",
            ),
            "data.sources.0.chat",
            "chat sources are JSONL",
        ),
        (
            format!(
                "{GOOD}{teacher}[teacher.generate]\nprompts = [{{path = \"p.jsonl\", dataset = \"champ\"}}]\n"
            ),
            "teacher.generate.prompts.0",
            "either `path`",
        ),
        (
            format!("{GOOD}{teacher}[teacher.generate]\nprompts = [{{dataset = \"gsm9k\"}}]\n"),
            "teacher.generate.prompts.0.dataset",
            "not a built-in prompt set",
        ),
        (
            format!(
                "{GOOD}{teacher}[teacher.generate]\nprompts = [{{path = \"missing.jsonl\"}}]\n"
            ),
            "teacher.generate.prompts.0.path",
            "does not exist",
        ),
        (
            format!(
                "{GOOD}{teacher}[teacher.generate]\nprompts = [{{dataset = \"champ\"}}]\ntop_p = 0\n"
            ),
            "teacher.generate.top_p",
            "(0, 1]",
        ),
        // Routing: from a local teacher's GGUF through llama.cpp, or as a served one's recipe says.
        (
            format!("{GOOD}{distill}{teacher}engine = \"burn\"\nrouting = true\n"),
            "teacher.routing",
            "llama.cpp's graph hooks",
        ),
        (
            format!(
                "{GOOD}{distill}{teacher}routing = true\nrouting_shape = {{layers = 4, k = 2, experts = 8, moe_layers = [1]}}\n"
            ),
            "teacher.routing_shape",
            "comes from its GGUF",
        ),
        (
            format!("{GOOD}{distill}{served}routing = true\n"),
            "teacher.routing",
            "give routing_shape",
        ),
        (
            format!(
                "{GOOD}{distill}{served}routing = true\nrouting_shape = {{layers = 4, k = 9, experts = 8, moe_layers = [1]}}\n"
            ),
            "teacher.routing_shape",
            "k = 9 of 8 experts",
        ),
        (
            format!(
                "{GOOD}{distill}{served}routing = true\nrouting_shape = {{layers = 4, k = 2, experts = 8, moe_layers = [3, 1]}}\n"
            ),
            "teacher.routing_shape",
            "not ascending",
        ),
        (
            format!(
                "{GOOD}{distill}{served}routing_shape = {{layers = 4, k = 2, experts = 8, moe_layers = [1]}}\n"
            ),
            "teacher.routing_shape",
            "routing is false",
        ),
        (
            format!(
                "{GOOD}{distill}{served}api = \"openai\"\nrouting = true\nrouting_shape = {{layers = 4, k = 2, experts = 8, moe_layers = [1]}}\n"
            ),
            "teacher.routing",
            "OpenAI-echo servers",
        ),
        // Router distillation: offline, from routing shards, with a design.
        (
            format!(
                "{GOOD}\n[distill]\nobjectives = [{{ kind = \"router_kl\", design = \"d.json\" }}]\n{teacher}"
            ),
            "distill.objectives.0",
            "teacher.routing = true",
        ),
        (
            format!(
                "{GOOD}\n[distill]\nmode = \"online\"\nobjectives = [{{ kind = \"router_kl\", design = \"d.json\" }}]\n{teacher}routing = true\n"
            ),
            "distill.objectives.0",
            "mode = \"offline\" only",
        ),
        (
            format!(
                "{GOOD}\n[distill]\nobjectives = [{{ kind = \"router_kl\" }}]\n{teacher}routing = true\n"
            ),
            "distill.objectives.0.design",
            "design.json",
        ),
        // Traffic: the directory with its mode, and only with it.
        (
            format!(
                "{GOOD}\n[distill]\nmode = \"traffic\"\nobjectives = [{{ kind = \"ce\" }}]\n{teacher}"
            ),
            "distill.traffic",
            "agent serve --traffic",
        ),
        (
            format!(
                "{GOOD}\n[distill]\ntraffic = \"t\"\nobjectives = [{{ kind = \"ce\" }}]\n{teacher}"
            ),
            "distill.traffic",
            "only then",
        ),
        (
            format!(
                "{GOOD}\n[distill]\nobjectives = [{{ kind = \"router_kl\", design = \"missing.json\" }}]\n{teacher}routing = true\n"
            ),
            "distill.objectives.0.design",
            "missing.json",
        ),
        (
            format!(
                "{GOOD}\n[distill]\nobjectives = [{{ kind = \"ce\", design = \"d.json\" }}]\n{teacher}"
            ),
            "distill.objectives.0.design",
            "applies to `router_kl` only",
        ),
    ] {
        let e = error(&key.replace('.', "-"), &text);
        assert_eq!(e.key, key, "{e}");
        assert!(e.message.contains(says), "{e}");
        assert!(e.line.is_some(), "{e}");
    }
}

#[test]
fn what_cannot_run_is_refused_by_the_plan() {
    for (from, to, key, says) in [
        (
            "vocab_size = 163840",
            "vocab_size = 1000000000000",
            "model",
            "beyond any machine",
        ),
        (
            "batch_tokens = 1024",
            "batch_tokens = 1000000000000000",
            "train.batch_tokens",
            "at most 65536 are accumulated",
        ),
    ] {
        let text = GOOD.replace(from, to);
        let e = error(&format!("big-{}", key.replace('.', "-")), &text);
        assert_eq!(e.key, key, "{e}");
        assert!(e.message.contains(says), "{e}");
    }
}

#[cfg(unix)]
#[test]
fn a_recipe_that_is_not_a_regular_file_is_refused_without_reading_it() {
    let s = scratch("fifo");
    let fifo = s.path("fifo.toml");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    // Reading either would block or never end.
    for path in [fifo.as_path(), Path::new("/dev/zero")] {
        let e = recipe::load(path).unwrap_err();
        assert!(e.message.contains("not a regular file"), "{e}");
    }
}

#[test]
fn recipe_check_refuses_what_train_refuses() {
    let s = scratch("check-train");
    s.write("docs/a.txt", "");
    s.write("docs/b.txt", "x");
    // Nothing held out, so that no case is refused for its held-out split instead.
    let good = GOOD.replace("seq_len = 128", "seq_len = 128\nheld_out_fraction = 0");
    let cases = [
        (
            good.replace("seed = 7", "seed = 7\ndevice = \"cuda:90\""),
            "cuda:90",
        ),
        (
            good.replace("d_model = 64", "d_model = 64\nn_layers = 1000000"),
            "but this machine has",
        ),
        (
            good.replace("d_model = 64", "d_model = 1048576"),
            "but this machine has",
        ),
        (
            good.replace("vocab_size = 163840", "vocab_size = 512"),
            "data.tokenizer has 163840 ids but model.vocab_size is 512",
        ),
        (
            good.replace("path = \"corpus.txt\"", "path = \"docs\""),
            "a.txt: empty",
        ),
        (
            good.clone()
                + "[teacher]\nmodel = \"smollm2\"\nk = 1000000\n[distill]\nobjectives = [{ kind = \"ce\" }]\n",
            "teacher.k: 1000000 is more than model.vocab_size",
        ),
    ];
    // Each is refused by both commands, with the same message, and nothing is written.
    let run = s.path("run");
    let train: [&std::ffi::OsStr; 4] = [
        "train".as_ref(),
        "--quiet".as_ref(),
        "--out".as_ref(),
        run.as_ref(),
    ];
    for (text, says) in cases {
        let path = s.write("recipe.toml", &text);
        for args in [&["recipe".as_ref(), "check".as_ref()][..], &train[..]] {
            let out = assert_cmd::Command::cargo_bin("k3mini")
                .unwrap()
                .args(args)
                .arg(&path)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains(says),
                "{args:?}: {err}"
            );
        }
        assert!(!run.join("metrics.jsonl").exists());
    }
    // A rank torchrun started. More ranks than a step has micro-batches are refused by both
    // commands, in any build.
    let path = s.write("recipe.toml", &good);
    let torchrun = |rank: &'static str, world: &'static str| {
        [
            ("RANK", rank),
            ("WORLD_SIZE", world),
            ("LOCAL_RANK", rank),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]
    };
    let run_with = |args: &[&std::ffi::OsStr], env: [(&str, &str); 5]| {
        let out = assert_cmd::Command::cargo_bin("k3mini")
            .unwrap()
            .args(args)
            .arg(&path)
            .envs(env)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for args in [&["recipe".as_ref(), "check".as_ref()][..], &train[..]] {
        let (ok, err) = run_with(args, torchrun("1", "3"));
        assert!(
            !ok && err.contains("a step has 2 micro-batches")
                && err.contains("torchrun started 3 ranks"),
            "{args:?}: {err}"
        );
    }
    // Two: a build without c10d refuses them by name (rather than each rank training alone into
    // one directory); one with it says in `recipe check` what it sees.
    if cfg!(feature = "c10d") {
        let (ok, err) = run_with(&["recipe".as_ref(), "check".as_ref()], torchrun("1", "2"));
        assert!(
            ok && err.contains(
                "torchrun started this process as rank 1 of 2 (local rank 1, device cpu)"
            ) && err.contains("each rank trains 1 of a step's 2 micro-batches")
                && err.contains("the store at 127.0.0.1:29500"),
            "{err}"
        );
    } else {
        for args in [&["recipe".as_ref(), "check".as_ref()][..], &train[..]] {
            let (ok, err) = run_with(args, torchrun("1", "2"));
            assert!(
                !ok && err.contains("torchrun started this process as rank 1 of 2, but this k3mini was built without PyTorch's c10d"),
                "{args:?}: {err}"
            );
        }
    }
    assert!(!run.join("metrics.jsonl").exists());
    // mpirun's ranks too; a group of one is one process.
    let check = |env: &[(&str, &str)]| {
        let out = assert_cmd::Command::cargo_bin("k3mini")
            .unwrap()
            .args(["recipe", "check"])
            .arg(&path)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = check(&[("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "2")]);
    assert!(
        !ok && err.contains("mpirun started this process as rank 2 of 4"),
        "{err}"
    );
    let (ok, err) = check(&[("RANK", "0"), ("WORLD_SIZE", "1")]);
    assert!(ok, "{err}");
}
