//! Routing statistics' capture, end to end on a real MoE model: a k3mini MoE student exported to
//! GGUF and run by llama.cpp. `k3mini teacher serve --enable-return-routed-experts` returns, in
//! vLLM's shape and in SGLang's, exactly the experts k3mini's own router picks, token for token,
//! and k3mini's clients read them back; `teacher score` with `teacher.routing` writes routing
//! shards beside the signal shards that hold the local teacher's routing (ids, weights, norms),
//! resumes over them and redoes one that was damaged.
use crate::export::checkpoint_with;
use crate::fixture::{Scratch, k3mini_ok};
use crate::teacher_server::{raw, serve};
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini::export::export_gguf;
use k3mini::run_dir::open_checkpoint;
use k3mini_data::routing::read_routing_shard;
use k3mini_gguf::GgufFile;
use k3mini_gguf::mix::FileType;
use k3mini_student::K3Mini;
use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher};
use k3mini_teacher::engine::llama_cpp::Placement;
use k3mini_teacher::local::{EngineSpec, LocalTeacher};
use k3mini_teacher::routing::wire::{RoutingShape, from_sglang, from_vllm};
use k3mini_teacher::routing::{Routing, gguf_routing};
use k3mini_teacher::{Teacher, manifest::Manifest, score::ScoreManifestJob};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// A 4-layer MoE student (layers 1–3 routed, 4 experts, 2 per token) on SmolLM2's vocabulary.
pub(crate) const MOE: &str = "preset = \"k3-mini-moe\"\nvocab_size = 49152\nd_model = 64\nn_layers = 4\n\
                   n_heads = 2\nffn_hidden = 128\nmax_seq_len = 512\n[model.kda]\nhead_dim = 32\n\
                   gate_rank = 32\n[model.mla]\nkv_lora_rank = 32\nqk_nope_head_dim = 16\n\
                   qk_rope_head_dim = 8\nv_head_dim = 16\n[model.moe]\nnum_experts = 4\n\
                   top_k = 2\nexpert_hidden = 32";

const TEXT: &str = "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king!";

/// The student, its F32 GGUF, and that file's routing.
pub(crate) fn moe_teacher(dir: &Path) -> (K3Mini, PathBuf, RoutingShape) {
    let model = checkpoint_with(&dir.join("run"), MOE, "teacher");
    let ck = open_checkpoint(&dir.join("run")).unwrap();
    let gguf = dir.join("moe.gguf");
    export_gguf(&ck, FileType::F32, None, &gguf).unwrap();
    let shape = gguf_routing(&GgufFile::open(&gguf).unwrap())
        .unwrap()
        .expect("a MoE model");
    (model, gguf, shape)
}

/// k3mini's router's choices for `ids`: per routed layer, `[tokens, k]`.
pub(crate) fn router_choices(model: &K3Mini, ids: &[u32]) -> Vec<(usize, Vec<u32>)> {
    let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, ids.len()]), &Device::default());
    model
        .forward_with(tokens, None)
        .routing
        .into_iter()
        .map(|r| (r.layer, r.experts))
        .collect()
}

/// `routing`'s first `tokens` tokens' experts, as [`router_choices`] lists them.
pub(crate) fn choices(routing: &Routing, tokens: usize) -> Vec<(usize, Vec<u32>)> {
    routing
        .layers
        .iter()
        .map(|l| (l.layer, l.experts[..tokens * l.k].to_vec()))
        .collect()
}

fn post(url: &str, path: &str, body: &Value) -> (u16, Value) {
    raw(url, "POST", path, &body.to_string())
}

#[test]
fn served_routed_experts_are_the_routers_choices_through_both_apis() {
    let dir = Scratch::new("routing-served");
    let (model, gguf, shape) = moe_teacher(&dir.0);
    assert_eq!(
        shape,
        RoutingShape {
            layers: 4,
            k: 2,
            experts: 4,
            moe_layers: vec![1, 2, 3]
        }
    );
    let server = serve(gguf.to_str().unwrap(), &["--enable-return-routed-experts"]);
    let local =
        LocalTeacher::open(&gguf, EngineSpec::LlamaCpp(Placement::Cpu { threads: 2 })).unwrap();
    let ids = local.tokenizer.encode(TEXT).unwrap();
    let n = ids.len();
    let want = router_choices(&model, &ids);
    assert_eq!(want.len(), 3);

    // The clients: each scored sequence's routing is the router's for its first n − 1 tokens.
    for api in [Api::Vllm, Api::Sglang] {
        let opts = ClientOptions {
            api,
            routing: Some(shape.clone()),
            ..Default::default()
        };
        let remote = HttpTeacher::connect(&[server.url.clone()], 49152, opts).unwrap();
        let scored = remote.score(&ids, 5).unwrap();
        let routing = scored.routing.expect("routing was asked for");
        assert_eq!(routing.tokens(), n - 1, "{api:?}");
        assert!(!routing.white_box(), "{api:?}: servers send ids only");
        let cut: Vec<_> = want
            .iter()
            .map(|(l, e)| (*l, e[..(n - 1) * shape.k].to_vec()))
            .collect();
        assert_eq!(choices(&routing, n - 1), cut, "{api:?}");
    }

    // vLLM's raw shape on a generation: the prompt and every generated token but the last, every
    // hidden layer on the layer axis (the dense layer 0's rows zero).
    let (status, v) = post(
        &server.url,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{v}");
    let generated: Vec<u32> = serde_json::from_value(v["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(generated.len(), 4);
    let r = from_vllm(v["choices"][0]["routed_experts"].as_str().unwrap()).unwrap();
    let all: Vec<u32> = ids.iter().chain(&generated).copied().collect();
    r.check(n + 3, &shape).unwrap();
    assert!((0..r.tokens).all(|t| r.layer(t, 0) == [0, 0]));
    assert_eq!(
        choices(&r.routing(&shape, n + 3), n + 3),
        router_choices(&model, &all[..n + 3])
    );
    // `routed_experts_prompt_start` skips a known prefix.
    let (_, v) = post(
        &server.url,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1, "routed_experts_prompt_start": 5}),
    );
    let r = from_vllm(v["choices"][0]["routed_experts"].as_str().unwrap()).unwrap();
    assert_eq!(r.tokens, n - 5);

    // SGLang's: only when asked, raw int32 for positions [0, seqlen − 1).
    let generate = |extra: Value| {
        let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2,
                              "temperature": 0}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        post(&server.url, "/generate", &body)
    };
    let (_, plain) = generate(json!({}));
    assert!(plain["meta_info"].get("routed_experts").is_none());
    let (_, v) = generate(json!({"return_routed_experts": true}));
    let b64 = v["meta_info"]["routed_experts"].as_str().unwrap();
    let r = from_sglang(b64, shape.layers, shape.k).unwrap();
    assert_eq!(r.tokens, n + 1);
    let out: Vec<u32> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    let all: Vec<u32> = ids.iter().chain(&out).copied().collect();
    assert_eq!(
        choices(&r.routing(&shape, n + 1), n + 1),
        router_choices(&model, &all[..n + 1])
    );
    drop(server);

    // A server not started to return them says so when asked; a dense model cannot be.
    let server = serve(gguf.to_str().unwrap(), &[]);
    let (status, v) = post(
        &server.url,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1},
                "return_routed_experts": true}),
    );
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--enable-return-routed-experts"),
        "{v}"
    );
    let (_, v) = post(
        &server.url,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1}),
    );
    assert!(v["choices"][0].get("routed_experts").is_none());
}

#[test]
fn teacher_score_writes_routing_shards_that_resume_and_redo_a_damaged_one() {
    let dir = Scratch::new("routing-score");
    let (_, gguf, shape) = moe_teacher(&dir.0);
    dir.write("a.txt", TEXT);
    dir.write(
        "b.txt",
        "What, has this thing appear'd again to-night? I have seen nothing.",
    );
    let recipe = dir.write(
        "score.toml",
        &format!(
            "[run]\nname = \"routed\"\n[model]\npreset = \"tiny\"\nvocab_size = 49152\n\
             [data]\ntokenizer = \"teacher\"\nseq_len = 16\nheld_out_fraction = 0.0\n\
             [[data.sources]]\npath = \"a.txt\"\n[[data.sources]]\npath = \"b.txt\"\n\
             [teacher]\nmodel = {:?}\nk = 4\nsegments_per_shard = 2\nrouting = true\n\
             [distill]\nobjectives = [{{ kind = \"ce\" }}]\n\
             [optim]\nlr = 1e-3\n[schedule]\nkind = \"constant\"\nwarmup_steps = 0\n\
             [train]\nsteps = 1\nbatch_tokens = 16\nmicro_batch = 1\n",
            gguf.display().to_string()
        ),
    );
    let shards = dir.path("shards");
    let score = || {
        k3mini_ok([
            "teacher",
            "score",
            recipe.to_str().unwrap(),
            "--quiet",
            "--out",
            shards.to_str().unwrap(),
        ])
    };
    score();
    let read_manifest = || -> Manifest<ScoreManifestJob> {
        serde_json::from_slice(&std::fs::read(shards.join("manifest.json")).unwrap()).unwrap()
    };
    let manifest = read_manifest();
    assert_eq!(manifest.job.routing.as_ref(), Some(&shape));
    assert!(manifest.shards.len() >= 2);
    // As `teacher score` opens it (on every core).
    let threads = std::thread::available_parallelism().unwrap().get();
    let local = LocalTeacher::open(&gguf, EngineSpec::LlamaCpp(Placement::Cpu { threads }))
        .unwrap()
        .record_routing()
        .unwrap();
    let mut sources = Vec::new();
    for entry in &manifest.shards {
        let companion = entry.routing.as_ref().expect("a routing shard per shard");
        let signals =
            k3mini_data::shards::read_shard(&shards.join(&entry.file), Some(&entry.sha256))
                .unwrap();
        let routing =
            read_routing_shard(&shards.join(&companion.file), Some(&companion.sha256)).unwrap();
        assert_eq!(routing.meta.shape, shape);
        assert_eq!(routing.meta.sources, ["a.txt", "b.txt"]);
        assert!(routing.meta.white_box);
        assert_eq!(routing.rows.len(), signals.rows.len());
        for (s, r) in signals.rows.iter().zip(&routing.rows) {
            assert_eq!((s.doc_id, s.segment), (r.doc_id, r.segment));
            sources.push(r.source);
            assert_eq!(r.routing.tokens(), s.positions());
            // What the teacher routes scoring this segment directly, weights and norms included.
            let direct = local.score(&s.input_ids, 4).unwrap();
            assert_eq!(Some(&r.routing), direct.routing.as_ref());
        }
    }
    // Corpus order: a.txt's segments, then b.txt's.
    assert!(
        sources.is_sorted() && sources[0] == 0 && sources.last() == Some(&1),
        "{sources:?}"
    );
    // The report over them: every routed position counted once per layer, per source too.
    let out = k3mini_ok([
        "routing",
        "report",
        shards.to_str().unwrap(),
        "--by",
        "source",
        "--quiet",
    ]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains(&format!(
            "{} tokens per layer over 3 MoE layers",
            manifest.positions()
        )),
        "{printed}"
    );
    let md = std::fs::read_to_string(shards.join("routing-report/report.md")).unwrap();
    assert!(
        md.contains("| a.txt |") && md.contains("| b.txt |") && md.contains("white-box"),
        "{md}"
    );
    // A rerun keeps every shard; a damaged routing shard is redone (and only its shard).
    let first = &manifest.shards[0];
    let companion = first.routing.as_ref().unwrap();
    let path = shards.join(&companion.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let good = bytes.clone();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let e = read_routing_shard(&path, Some(&companion.sha256)).unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
    let before = std::fs::metadata(shards.join(&manifest.shards[1].file))
        .unwrap()
        .modified()
        .unwrap();
    score();
    assert_eq!(std::fs::read(&path).unwrap(), good, "redone as it was");
    assert_eq!(read_manifest(), manifest);
    let after = std::fs::metadata(shards.join(&manifest.shards[1].file))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(before, after, "an intact shard is not rewritten");
}

/// From the harvested routing to a trained student: `routing design` over a scored corpus, then
/// a MoE student of that design trained offline with and without `router_kl`. Both start from the
/// same weights and batch, so their first steps' losses differ by exactly the router term, which
/// is a KL and so positive; a design that does not fit the student is refused before training.
#[test]
fn a_designed_student_trains_with_router_distillation() {
    let dir = Scratch::new("routing-design-train");
    let (_, gguf, _) = moe_teacher(&dir.0);
    dir.write("a.txt", &TEXT.repeat(6));
    dir.write(
        "b.txt",
        &"What, has this thing appear'd again to-night? ".repeat(8),
    );
    let shards = dir.path("shards");
    let recipe = |name: &str, experts: usize, objectives: &str| {
        dir.write(
            &format!("{name}.toml"),
            &format!(
                "[run]\nname = \"{name}\"\nseed = 5\nout_dir = {:?}\n[model]\n{}\n\
                 [data]\ntokenizer = \"teacher\"\nseq_len = 16\nheld_out_fraction = 0.0\n\
                 [[data.sources]]\npath = \"a.txt\"\n[[data.sources]]\npath = \"b.txt\"\n\
                 [teacher]\nmodel = {:?}\nk = 4\nsegments_per_shard = 4\nrouting = true\n\
                 shards_dir = {:?}\n[distill]\nobjectives = [{objectives}]\n\
                 [optim]\nlr = 1e-3\n[schedule]\nkind = \"constant\"\nwarmup_steps = 0\n\
                 [train]\nsteps = 2\nbatch_tokens = 32\nmicro_batch = 2\n",
                dir.path(name).display().to_string(),
                MOE.replace("num_experts = 4", &format!("num_experts = {experts}")),
                gguf.display().to_string(),
                shards.display().to_string(),
            ),
        )
    };
    let kd = recipe("kd", 2, "{ kind = \"forward_kl\" }");
    k3mini_ok(["teacher", "score", kd.to_str().unwrap(), "--quiet"]);
    let out = k3mini_ok([
        "routing",
        "design",
        shards.to_str().unwrap(),
        "--experts",
        "2",
        "--quiet",
    ]);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("of 2 experts, 4 layers (1 dense)"),
        "{printed}"
    );
    let design = shards.join("routing-design/design.json");
    let d = k3mini::routing::design::Design::read(&design).unwrap();
    assert_eq!(d.layers.len(), 3);
    let fragment = std::fs::read_to_string(shards.join("routing-design/moe.toml")).unwrap();
    assert!(fragment.contains("num_experts = 2"), "{fragment}");

    let with_router = |name: &str, experts: usize| {
        recipe(
            name,
            experts,
            &format!(
                "{{ kind = \"forward_kl\" }}, {{ kind = \"router_kl\", weight = 0.5, design = {:?} }}",
                design.display().to_string()
            ),
        )
    };
    let both = with_router("kd-router", 2);
    for r in [&kd, &both] {
        k3mini_ok(["train", r.to_str().unwrap(), "--quiet"]);
    }
    let first_loss = |name: &str| k3mini::run_dir::read_metrics(&dir.path(name)).unwrap()[0].loss;
    let gap = first_loss("kd-router") - first_loss("kd");
    assert!(gap > 1e-4, "router_kl adds a positive term: {gap}");

    // A design for 2 experts does not fit a 4-expert student.
    let misfit = with_router("misfit", 4);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3mini"))
        .args(["recipe", "check", misfit.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("designs 2 experts"),
        "{err}"
    );
}
