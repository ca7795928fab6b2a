//! Expert pruning (`k3mini prune`, `k3mini::routing::prune`) on a real MoE model: the ranking
//! rules on statistics built to a known answer; a pruned checkpoint holds exactly the survivors'
//! weights, router rows and biases, evaluates, exports and trains from `[model] init`; pruning
//! the model's GGUF (scored by llama.cpp's hooks, not k3mini's forward) keeps the same experts
//! with the same saliency and writes, byte for byte, what exporting the pruned checkpoint writes,
//! and llama.cpp routes it as the pruned model's own router does.
use crate::fixture::{Recipe, Scratch, k3mini_ok, root};
use crate::routing::{MOE, choices, moe_teacher, router_choices};
use k3mini::export::export_gguf;
use k3mini::recipe::{self, RunPlan};
use k3mini::routing::prune::{
    ExpertGroups, Method, PruneOptions, experts_kept, prune_checkpoint, retain_gguf_experts,
    survivors,
};
use k3mini::routing::stats::LayerStats;
use k3mini::run_dir::{open_checkpoint, read_metrics};
use k3mini_data::routing::LayerRouting;
use k3mini_gguf::GgufFile;
use k3mini_gguf::mix::FileType;
use k3mini_student::model::Ffn;
use k3mini_student::moe::Moe;
use k3mini_teacher::engine::llama_cpp::Placement;
use k3mini_teacher::local::{EngineSpec, LocalTeacher};
use std::collections::BTreeMap;
use std::path::Path;

/// A plain recipe over part of Hamlet in SmolLM2's vocabulary: the calibration corpus.
fn calibration(dir: &Scratch) -> RunPlan {
    let hamlet =
        std::fs::read_to_string(root().join("recipes/corpus/shakespeare/hamlet.txt")).unwrap();
    // Documents of 40 lines: packed rows cross document boundaries, which both engines must
    // respect alike.
    let lines: Vec<&str> = hamlet.lines().take(1200).collect();
    let docs: Vec<String> = lines
        .chunks(40)
        .map(|c| serde_json::json!({ "text": c.join("\n") }).to_string())
        .collect();
    dir.write("cal/corpus.jsonl", &docs.join("\n"));
    let text = Recipe::default()
        .with("model", MOE)
        .with(
            "data",
            "tokenizer = \"smollm2\"\nseq_len = 128\nheld_out_fraction = 0.2\n\
             [[data.sources]]\npath = \"corpus.jsonl\"",
        )
        .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
        .with(
            "train",
            "steps = 2\nbatch_tokens = 512\nmicro_batch = 4\neval_batches = 2",
        )
        .text();
    recipe::load(&dir.write("cal/recipe.toml", &text)).unwrap()
}

fn opts(keep: f64, method: Method) -> PruneOptions {
    PruneOptions {
        keep,
        method,
        tokens: 1024,
    }
}

fn moes(model: &k3mini_student::K3Mini) -> Vec<&Moe> {
    model
        .model
        .layers
        .iter()
        .filter_map(|l| match &l.mlp {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        })
        .collect()
}

fn values<const D: usize>(t: burn::tensor::Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

#[test]
fn reap_and_frequency_rank_experts_as_defined() {
    // Expert 0: chosen by every token, small outputs; expert 1: rarely, large outputs; expert 2:
    // never; expert 3: as often as 1, medium outputs and larger weights.
    let mut s = LayerStats::new(1, 4, true, false);
    let mut experts = Vec::new();
    let (mut weights, mut norms) = (Vec::new(), Vec::new());
    for t in 0..10 {
        let other = if t % 2 == 0 { 1 } else { 3 };
        experts.extend([0, other]);
        weights.extend([0.5f32, 0.5]);
        norms.extend([1.0f32, if other == 1 { 8.0 } else { 4.0 }]);
    }
    s.add(&LayerRouting {
        layer: 1,
        k: 2,
        experts,
        weights: Some(weights),
        norms: Some(norms),
    });
    let reap = survivors(&s, 2, Method::Reap, ExpertGroups::NONE).unwrap();
    assert_eq!(reap.scores, vec![0.5, 4.0, 0.0, 2.0]); // mean ḡ·‖f‖ over the tokens routed there
    assert_eq!(reap.kept, vec![1, 3]);
    let freq = survivors(&s, 2, Method::Frequency, ExpertGroups::NONE).unwrap();
    assert_eq!(freq.scores, vec![1.0, 0.5, 0.0, 0.5]);
    assert_eq!(freq.kept, vec![0, 1], "a tie goes to the lower id");
    assert_eq!(
        survivors(&s, 3, Method::Reap, ExpertGroups::NONE)
            .unwrap()
            .kept,
        vec![0, 1, 3]
    );

    // Served routing carries ids only: REAP is refused by name.
    let ids_only = LayerStats::new(1, 4, false, false);
    let e = survivors(&ids_only, 2, Method::Reap, ExpertGroups::NONE)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--method frequency"), "{e}");

    // A grouped router (experts 0-1 and 2-3): each group keeps its best, whatever the others'.
    let two = ExpertGroups { count: 2, used: 1 };
    assert_eq!(
        survivors(&s, 2, Method::Frequency, two).unwrap().kept,
        vec![0, 3]
    );
    assert_eq!(
        survivors(&s, 2, Method::Reap, two).unwrap().kept,
        vec![1, 3]
    );
    // What llama.cpp's group routing needs of the count kept.
    two.check(8, 4, 2).unwrap();
    let four = ExpertGroups { count: 4, used: 2 };
    for (groups, n, why) in [
        (four, 6, "cannot be kept evenly"),
        (two, 2, "keep at least 4"),
    ] {
        let e = groups.check(8, n, 2).unwrap_err().to_string();
        assert!(e.contains(why), "{n}: {e}");
    }
    assert_eq!(experts_kept(8, 2, 0.75).unwrap(), 6);
    assert_eq!(experts_kept(8, 2, 0.5).unwrap(), 4);
    for (keep, why) in [(0.0, "(0, 1]"), (1.5, "(0, 1]"), (0.1, "fewer than the 2")] {
        let e = experts_kept(8, 2, keep).unwrap_err().to_string();
        assert!(e.contains(why), "--keep {keep}: {e}");
    }
}

#[test]
fn a_pruned_checkpoint_keeps_its_survivors_exactly_and_evaluates_exports_and_trains() {
    let dir = Scratch::new("prune-ck");
    let (model, _, _) = moe_teacher(&dir.0);
    let cal = calibration(&dir);
    let out = dir.path("pruned");
    let report = prune_checkpoint(
        &dir.path("run"),
        &cal,
        &opts(0.75, Method::Reap),
        &out,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!((report.experts_before, report.experts_after), (4, 3));
    assert_eq!(report.layers.len(), 3);
    assert!(
        report.tokens >= 1000,
        "{} calibration tokens",
        report.tokens
    );
    let (before, after) = (
        report.held_out_before.unwrap(),
        report.held_out_after.unwrap(),
    );
    assert!(before.is_finite() && after.is_finite(), "{before} {after}");

    // The survivors' tensors, copied exactly, in their old order.
    let ck = open_checkpoint(&out).unwrap();
    assert_eq!(ck.plan.model.moe.as_ref().unwrap().num_experts, 3);
    let pruned = ck.model(&burn::tensor::Device::default()).unwrap();
    for ((old, new), verdict) in moes(&model)
        .into_iter()
        .zip(moes(&pruned))
        .zip(&report.layers)
    {
        let rows = |t: Vec<f32>, e: usize| -> Vec<Vec<f32>> {
            t.chunks_exact(t.len() / e).map(<[f32]>::to_vec).collect()
        };
        let want = |t: Vec<f32>| -> Vec<Vec<f32>> {
            let r = rows(t, 4);
            verdict.kept.iter().map(|&e| r[e].clone()).collect()
        };
        assert_eq!(
            rows(values(new.gate.weight.val()), 3),
            want(values(old.gate.weight.val()))
        );
        assert_eq!(
            values(new.gate.e_score_correction_bias.val()),
            want(values(old.gate.e_score_correction_bias.val())).concat()
        );
        assert_eq!(
            rows(values(new.experts.gate_up_proj.val()), 3),
            want(values(old.experts.gate_up_proj.val()))
        );
        assert_eq!(
            rows(values(new.experts.down_proj.val()), 3),
            want(values(old.experts.down_proj.val()))
        );
    }
    let again = prune_checkpoint(
        &dir.path("run"),
        &cal,
        &opts(0.75, Method::Reap),
        &out,
        &mut |_, _| {},
    );
    assert!(
        again
            .unwrap_err()
            .to_string()
            .contains("already holds checkpoints")
    );

    trains_from_init(&dir, &out, &pruned);

    // It evaluates on another recipe's held-out set, as prune measured it.
    let (eval, _) =
        k3mini::evaluate::evaluate(&out, k3mini::evaluate::Suite::Quick, None, Some(&cal)).unwrap();
    assert!((eval.loss - after).abs() < 1e-4, "{} vs {after}", eval.loss);
}

/// Mean |a − b| over two tensors' values.
fn mean_gap(a: Vec<f32>, b: Vec<f32>) -> f32 {
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

/// The pruned checkpoint `out` trains from `[model] init` (the model is the checkpoint's; other
/// model keys refused) and from `--init`, alike, starting from its weights.
fn trains_from_init(dir: &Scratch, out: &Path, pruned: &k3mini_student::K3Mini) {
    let ck = open_checkpoint(out).unwrap();
    let text = Recipe::default()
        .with("run", "name = \"recover\"\nseed = 7\nout_dir = \"recover\"")
        .with("model", "init = \"../pruned\"")
        .with(
            "data",
            "tokenizer = \"smollm2\"\nseq_len = 128\n[[data.sources]]\npath = \"corpus.jsonl\"",
        )
        .with("schedule", "kind = \"constant\"\nwarmup_steps = 0")
        .with(
            "train",
            "steps = 2\nbatch_tokens = 512\nmicro_batch = 4\neval_every = 2\neval_batches = 1",
        )
        .text();
    let recipe_path = dir.write("cal/recover.toml", &text);
    let plan = recipe::load(&recipe_path).unwrap();
    assert_eq!(plan.model, ck.plan.model);
    assert_eq!(plan.init, Some(std::fs::canonicalize(&ck.dir).unwrap()));
    let bad = dir.write(
        "cal/bad.toml",
        &text.replace("init = \"../pruned\"", "init = \"../pruned\"\nd_model = 32"),
    );
    let e = recipe::load(&bad).unwrap_err().to_string();
    assert!(
        e.contains("model.d_model") && e.contains("checkpoint's"),
        "{e}"
    );
    let run = dir.path("recover");
    k3mini_ok([
        "train".as_ref(),
        recipe_path.as_os_str(),
        "--out".as_ref(),
        run.as_os_str(),
        "--quiet".as_ref(),
    ]);
    let metrics = read_metrics(&run).unwrap();
    assert_eq!(metrics.last().unwrap().step, 2);
    assert_eq!(metrics[0].expert_load_max.len(), 3, "three MoE layers");
    // `--init` in place of the recipe's own: the first step's loss is the pruned model's.
    let other = dir.path("recover-cli");
    let plain = dir.write("cal/plain.toml", &text.replace("init = \"../pruned\"", MOE));
    k3mini_ok([
        "train".as_ref(),
        plain.as_os_str(),
        "--init".as_ref(),
        out.as_os_str(),
        "--out".as_ref(),
        other.as_os_str(),
        "--quiet".as_ref(),
    ]);
    assert_eq!(read_metrics(&other).unwrap()[0].loss, metrics[0].loss);
    // Two AdamW steps at lr 3e-3 move a weight by about 0.006 at most; a fresh initialisation
    // (std 0.02) would be ~0.023 away on average.
    let trained = open_checkpoint(&run)
        .unwrap()
        .model(&burn::tensor::Device::default())
        .unwrap();
    for (a, b) in moes(&trained).into_iter().zip(moes(pruned)) {
        let gap = mean_gap(
            values(a.experts.gate_up_proj.val()),
            values(b.experts.gate_up_proj.val()),
        );
        assert!(
            gap < 0.008,
            "mean |Δ| {gap}: not trained from the pruned weights"
        );
    }
}

/// The tensors and metadata of a GGUF, bytes per tensor.
fn contents(path: &Path) -> (Vec<(String, String)>, BTreeMap<String, (Vec<u64>, Vec<u8>)>) {
    let f = GgufFile::open(path).unwrap();
    let meta = f
        .keys
        .iter()
        .map(|k| (k.clone(), format!("{:?}", f.metadata[k])))
        .collect();
    let tensors = f
        .tensors
        .iter()
        .map(|t| (t.name.clone(), (t.dims.clone(), f.raw(t).unwrap())))
        .collect();
    (meta, tensors)
}

#[test]
fn pruning_the_gguf_is_pruning_the_checkpoint_then_exporting_it() {
    let dir = Scratch::new("prune-gguf");
    let (_, gguf, _) = moe_teacher(&dir.0);
    let cal = calibration(&dir);
    let ck_report = prune_checkpoint(
        &dir.path("run"),
        &cal,
        &opts(0.75, Method::Reap),
        &dir.path("pruned"),
        &mut |_, _| {},
    )
    .unwrap();

    // Through the CLI: llama.cpp's hooks score the experts as k3mini's forward does.
    let out = dir.path("pruned.gguf");
    let printed = k3mini_ok([
        "prune".as_ref(),
        gguf.as_os_str(),
        "--keep".as_ref(),
        "0.75".as_ref(),
        "--calibration".as_ref(),
        cal.recipe.as_os_str(),
        "--tokens".as_ref(),
        "1024".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
        "--quiet".as_ref(),
    ]);
    let printed = String::from_utf8_lossy(&printed.stdout);
    assert!(printed.contains("3 of 4 experts"), "{printed}");
    let report: k3mini::routing::prune::PruneReport =
        serde_json::from_slice(&std::fs::read(dir.path("pruned.prune.json")).unwrap()).unwrap();
    assert_eq!(report.tokens, ck_report.tokens);
    for (g, c) in report.layers.iter().zip(&ck_report.layers) {
        assert_eq!((g.layer, &g.kept), (c.layer, &c.kept));
        for (a, b) in g.scores.iter().zip(&c.scores) {
            assert!(
                (a - b).abs() <= 1e-3 * b.abs().max(1e-3),
                "layer {}: {a} vs {b}",
                g.layer
            );
        }
    }

    // Byte for byte the export of the pruned checkpoint, in F32 and (sliced blocks) Q8_0.
    let pruned_ck = open_checkpoint(&dir.path("pruned")).unwrap();
    let original = open_checkpoint(&dir.path("run")).unwrap();
    let kept: BTreeMap<usize, Vec<usize>> = report
        .layers
        .iter()
        .map(|l| (l.layer, l.kept.clone()))
        .collect();
    for ftype in [FileType::F32, FileType::Q8_0] {
        let (full, sliced, want) = (
            dir.path("full.gguf"),
            dir.path("sliced.gguf"),
            dir.path("want.gguf"),
        );
        export_gguf(&original, ftype, None, &full).unwrap();
        retain_gguf_experts(&GgufFile::open(&full).unwrap(), &kept, &sliced).unwrap();
        export_gguf(&pruned_ck, ftype, None, &want).unwrap();
        assert_eq!(contents(&sliced), contents(&want), "{ftype:?}");
    }
    assert_eq!(contents(&out), {
        export_gguf(&pruned_ck, FileType::F32, None, &dir.path("want.gguf")).unwrap();
        contents(&dir.path("want.gguf"))
    });

    // llama.cpp runs it and routes as the pruned model's router does.
    let local = LocalTeacher::open(&out, EngineSpec::LlamaCpp(Placement::Cpu { threads: 2 }))
        .unwrap()
        .record_routing()
        .unwrap();
    let ids = local
        .tokenizer
        .encode("Who's there? Nay, answer me: stand, and unfold yourself.")
        .unwrap();
    let ran = local.run(&ids, Some(1), None, Default::default()).unwrap();
    let model = pruned_ck.model(&burn::tensor::Device::default()).unwrap();
    let want: Vec<_> = router_choices(&model, &ids)
        .into_iter()
        .map(|(l, e)| (l, e[..(ids.len() - 1) * 2].to_vec()))
        .collect();
    assert_eq!(choices(&ran.routing.unwrap(), ids.len() - 1), want);

    // A GGUF's survivors must name experts it has, the same number at every MoE block.
    let f = GgufFile::open(&gguf).unwrap();
    let bad = |k: BTreeMap<usize, Vec<usize>>| {
        retain_gguf_experts(&f, &k, &dir.path("bad.gguf"))
            .unwrap_err()
            .to_string()
    };
    assert!(
        bad(BTreeMap::from([
            (1, vec![0, 4]),
            (2, vec![0, 1]),
            (3, vec![0, 1])
        ]))
        .contains("of 4")
    );
    assert!(
        bad(BTreeMap::from([
            (1, vec![0, 1, 2]),
            (2, vec![0, 1]),
            (3, vec![0, 1])
        ]))
        .contains("every block")
    );
    assert!(bad(BTreeMap::from([(1, vec![0, 1]), (2, vec![0, 1])])).contains("block 3"));
    assert!(
        bad(BTreeMap::from([
            (0, vec![0, 1]),
            (1, vec![0, 1]),
            (2, vec![0, 1]),
            (3, vec![0, 1])
        ]))
        .contains("block 0 holds no routed experts")
    );
    assert!(bad(BTreeMap::from([(1, vec![0]), (2, vec![0]), (3, vec![0])])).contains("per token"));
}

/// A GGUF that groups 8 experts in 2 (`expert_group_count`; each token routed within the best
/// one): pruned by k3mini to 2 per group, llama.cpp computes the same logits as from the original
/// with the pruned experts made unreachable (their router bias at −10⁴) — the groups kept their
/// members — while the original routes otherwise without its groups (the grouping is live). A
/// keep list that would move an expert into another group is refused by name.
#[test]
fn a_grouped_gguf_pruned_evenly_routes_in_llama_cpp_as_its_masked_original() {
    use k3mini_gguf::{Value, writer::GgufWriter};
    use k3mini_teacher::engine::llama_cpp::LlamaCppModel;
    let dir = Scratch::new("prune-groups");
    let moe8 = MOE.replace("num_experts = 4", "num_experts = 8");
    crate::export::checkpoint_with(&dir.path("run"), &moe8, "teacher");
    let base = dir.path("base.gguf");
    export_gguf(
        &open_checkpoint(&dir.path("run")).unwrap(),
        FileType::F32,
        None,
        &base,
    )
    .unwrap();
    // A copy of `from` with metadata `set` and each tensor's bytes through `edit`.
    let copy =
        |from: &Path, to: &Path, set: &[(&str, Value)], edit: &dyn Fn(&str, Vec<u8>) -> Vec<u8>| {
            let f = GgufFile::open(from).unwrap();
            let mut w = GgufWriter::new();
            for k in &f.keys {
                w.set(k, f.get(k).unwrap().clone());
            }
            for (k, v) in set {
                w.set(k, v.clone());
            }
            for t in &f.tensors {
                w.add_tensor(&t.name, &t.dims, t.ty, edit(&t.name, f.raw(t).unwrap()))
                    .unwrap();
            }
            w.write(to).unwrap();
        };
    let grouped = dir.path("grouped.gguf");
    copy(
        &base,
        &grouped,
        &[
            ("kimi-linear.expert_group_count", Value::U32(2)),
            ("kimi-linear.expert_group_used_count", Value::U32(1)),
        ],
        &|_, b| b,
    );
    let file = GgufFile::open(&grouped).unwrap();
    let blocks: Vec<usize> = file
        .tensors
        .iter()
        .filter_map(|t| {
            t.name
                .strip_prefix("blk.")?
                .strip_suffix(".ffn_gate_inp.weight")?
                .parse()
                .ok()
        })
        .collect();
    assert!(!blocks.is_empty());
    let keep_list = [1usize, 2, 5, 7];
    let keep: BTreeMap<usize, Vec<usize>> =
        blocks.iter().map(|&b| (b, keep_list.to_vec())).collect();
    let pruned = dir.path("pruned.gguf");
    retain_gguf_experts(&file, &keep, &pruned).unwrap();
    let p = GgufFile::open(&pruned).unwrap();
    assert_eq!(
        p.get("kimi-linear.expert_count").and_then(Value::as_u64),
        Some(4)
    );
    assert_eq!(
        p.get("kimi-linear.expert_group_count")
            .and_then(Value::as_u64),
        Some(2)
    );
    // Expert 2 would join group 1 (experts 2 and 4 after 0 and 1): refused.
    let uneven: BTreeMap<usize, Vec<usize>> =
        blocks.iter().map(|&b| (b, vec![0, 1, 2, 4])).collect();
    let e = retain_gguf_experts(&file, &uneven, &dir.path("bad.gguf"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("keeps 3 experts of group 0") && !dir.path("bad.gguf").exists(),
        "{e}"
    );
    let masked = dir.path("masked.gguf");
    copy(&grouped, &masked, &[], &|name, bytes| {
        if !name.ends_with(".exp_probs_b.bias") {
            return bytes;
        }
        let mut v: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (e, x) in v.iter_mut().enumerate() {
            if !keep_list.contains(&e) {
                *x = -1.0e4;
            }
        }
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    });
    let logits = |path: &Path| {
        let m = LlamaCppModel::load(path, Placement::Cpu { threads: 2 }).unwrap();
        let ids = m
            .tokenize("Who's there? Nay, answer me: stand, and unfold yourself.")
            .unwrap();
        m.forward(&ids, false).unwrap().0
    };
    let (got, want) = (logits(&pruned), logits(&masked));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-4, "pruned and masked logits differ by {worst}");
    let ungrouped = logits(&base);
    let moved = ungrouped
        .iter()
        .zip(&logits(&grouped))
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-3,
        "the groups change llama.cpp's routing ({moved})"
    );
}
