//! `k3mini export --format hf`: a checkpoint becomes safetensors + a Kimi Linear config.json that
//! load back into the same model (transformers' own check is scripts/interop/check_hf.py), and
//! what Kimi Linear cannot express is refused.
use crate::fixture::Recipe;
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini::export::{export_gguf, export_hf};
use k3mini::run_dir::open_checkpoint;
use k3mini_gguf::mix::FileType;
use k3mini_gguf::{GgmlType, GgufFile, Value};
use k3mini_student::K3Mini;
use k3mini_student::hf::{config_from_kimi_linear, load_hf_safetensors};
use std::path::Path;

fn checkpoint(dir: &Path, model_table: &str) -> K3Mini {
    checkpoint_with(dir, model_table, "kimi")
}

/// A checkpoint in `dir` of a freshly initialised model, with the plan of a recipe whose model
/// table is `model_table` and whose tokenizer is `tokenizer` (`teacher`: SmolLM2's).
pub(crate) fn checkpoint_with(dir: &Path, model_table: &str, tokenizer: &str) -> K3Mini {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("corpus.txt"), "Some text.").unwrap();
    let mut recipe = Recipe::default()
        .with("run", &format!("name = \"e\"\nout_dir = {:?}", dir.display().to_string()))
        .with("model", model_table)
        .with(
            "data",
            &format!("tokenizer = \"{tokenizer}\"\nseq_len = 128\n[[data.sources]]\npath = \"corpus.txt\""),
        );
    if tokenizer == "teacher" {
        recipe = recipe
            .extra("[teacher]\nmodel = \"smollm2\"\n[distill]\nobjectives = [{ kind = \"ce\" }]\n");
    }
    std::fs::write(dir.join("recipe.toml"), recipe.text()).unwrap();
    let plan = k3mini::recipe::load(&dir.join("recipe.toml")).unwrap();
    let device = Device::default();
    device.seed(3);
    let model = K3Mini::new(&plan.model, &device).unwrap();
    k3mini::run_dir::write_weights(&plan, &model, 5).unwrap();
    model
}

fn logits(model: &K3Mini) -> Vec<f32> {
    let ids: Vec<i64> = (0..24).map(|i| (i * 37 % 512) as i64).collect();
    let device = Device::default();
    let t = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, 12]), &device);
    model.forward(t).into_data().try_into_vec().unwrap()
}

#[test]
fn hf_export_loads_back_into_the_same_model_and_refuses_kimi_k3_features() {
    let dir = std::env::temp_dir().join(format!("k3mini-export-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let run = dir.join("run");
    let model = checkpoint(&run, "preset = \"tiny\"\nvocab_size = 512\nd_model = 64");
    let ck = open_checkpoint(&run).unwrap();
    assert_eq!(
        logits(&ck.model(&Device::default()).unwrap()),
        logits(&model)
    );
    let out = dir.join("hf");
    let files = export_hf(&ck, None, &out, false).unwrap();
    assert_eq!(files.len(), 2);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let cfg = config_from_kimi_linear(&config).unwrap();
    let mut back = K3Mini::new(&cfg, &Device::default()).unwrap();
    load_hf_safetensors(&mut back, &out.join("model.safetensors")).unwrap();
    assert_eq!(
        logits(&back),
        logits(&model),
        "the export is the same model"
    );
    // AttnRes and the MLA gate are kimi-k3 features: refused with their names.
    let k3 = dir.join("k3");
    checkpoint(
        &k3,
        "preset = \"tiny\"\nvocab_size = 512\nd_model = 64\nattn_res = { block_size = 2 }",
    );
    let e = export_hf(
        &open_checkpoint(&k3).unwrap(),
        None,
        &dir.join("k3-hf"),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("Attention Residuals") && e.contains("no Kimi Linear equivalent"),
        "{e}"
    );
    assert!(
        !dir.join("k3-hf/model.safetensors").exists(),
        "nothing written on refusal"
    );
    let e = open_checkpoint(&dir.join("nothing"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("neither a checkpoint nor a run directory"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gguf_export_maps_the_hybrid_to_kimi_linear_with_the_teachers_tokenizer() {
    // llama.cpp's own check of these files is scripts/interop/check_gguf.py (README: Export).
    let dir = std::env::temp_dir().join(format!("k3mini-gguf-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let run = dir.join("run");
    let teacher = "teacher";
    let model = checkpoint_with(
        &run,
        "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64",
        teacher,
    );
    let ck = open_checkpoint(&run).unwrap();
    let f32_path = dir.join("m-f32.gguf");
    export_gguf(&ck, FileType::F32, None, &f32_path).unwrap();
    let f = GgufFile::open(&f32_path).unwrap();
    assert_eq!(
        f.get("general.architecture").and_then(Value::as_str),
        Some("kimi-linear")
    );
    // Per-layer KV heads: 0 marks KDA, 1 MLA (tiny is KKKM).
    let kv: Vec<u64> = f
        .get("kimi-linear.attention.head_count_kv")
        .and_then(Value::as_array)
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(kv, [0, 0, 0, 1]);
    assert!(f.get("tokenizer.ggml.tokens").is_some() && f.get("tokenizer.ggml.merges").is_some());
    // Weights arrive unchanged where they are copied, transformed where llama.cpp wants it.
    let (embd, ne) = f.dequantize("token_embd.weight").unwrap();
    assert_eq!(ne, [64, 49152]);
    let want = model
        .model
        .embed_tokens
        .weight
        .val()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    assert_eq!(embd, want);
    let (a, ne) = f.dequantize("blk.0.ssm_a").unwrap();
    assert_eq!(ne, [1, 2]);
    assert!(a.iter().all(|&x| x < 0.0), "ssm_a = -exp(A_log)");
    assert_eq!(
        f.tensor("blk.0.ssm_conv1d_q.weight").unwrap().dims,
        [4, 1, 128]
    );
    assert_eq!(f.tensor("blk.3.attn_k_b.weight").unwrap().dims.len(), 3);
    // Q4_K_M follows llama.cpp's mix: the output Q6_K, norms F32, 64-wide rows Q5_0.
    let q_path = dir.join("m-q4km.gguf");
    export_gguf(&ck, FileType::Q4KM, None, &q_path).unwrap();
    let q = GgufFile::open(&q_path).unwrap();
    let ty = |n: &str| q.tensor(n).unwrap().ty;
    assert_eq!(
        ty("output.weight"),
        GgmlType::Q8_0,
        "64-wide rows: Q6_K falls back to Q8_0"
    );
    assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q5_0);
    assert_eq!(q.get("general.file_type"), Some(&Value::U32(15)));
    // The MoE variant: routed experts stacked per layer, the router and its bias, shared experts.
    let moe_run = dir.join("moe");
    let moe_table = "preset = \"k3-mini-moe\"\nvocab_size = 49152\nd_model = 64\nn_layers = 4\n\
                     n_heads = 2\nffn_hidden = 128\n[model.kda]\nhead_dim = 32\ngate_rank = 32\n\
                     [model.mla]\nkv_lora_rank = 32\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\n\
                     v_head_dim = 16\n[model.moe]\nnum_experts = 4\ntop_k = 2\nexpert_hidden = 32";
    checkpoint_with(&moe_run, moe_table, teacher);
    let moe_path = dir.join("moe.gguf");
    export_gguf(
        &open_checkpoint(&moe_run).unwrap(),
        FileType::F32,
        None,
        &moe_path,
    )
    .unwrap();
    let m = GgufFile::open(&moe_path).unwrap();
    assert_eq!(m.get("kimi-linear.expert_count"), Some(&Value::U32(4)));
    assert_eq!(
        m.get("kimi-linear.leading_dense_block_count"),
        Some(&Value::U32(1))
    );
    assert!(
        m.tensor("blk.0.ffn_gate.weight").is_some(),
        "the first layer is dense"
    );
    assert_eq!(
        m.tensor("blk.1.ffn_gate_exps.weight").unwrap().dims,
        [64, 32, 4]
    );
    assert_eq!(
        m.tensor("blk.1.ffn_down_exps.weight").unwrap().dims,
        [32, 64, 4]
    );
    assert_eq!(m.tensor("blk.1.ffn_gate_inp.weight").unwrap().dims, [64, 4]);
    assert_eq!(m.tensor("blk.1.exp_probs_b.bias").unwrap().dims, [4]);
    assert!(m.tensor("blk.1.ffn_up_shexp.weight").is_some());
    // A student with a tokenizer of its own: its tokenizer.json becomes llama.cpp's gpt2 tokenizer.
    let own = dir.join("own");
    checkpoint(&own, "preset = \"tiny\"\nvocab_size = 4096\nd_model = 64");
    let own_ck = open_checkpoint(&own).unwrap();
    let e = export_gguf(&own_ck, FileType::F32, None, &dir.join("own.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pass --tokenizer FILE"), "{e}");
    assert!(!dir.join("own.gguf").exists(), "nothing written on refusal");
    let bpe = k3mini_data::Tokenizer::load(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/corpus/shakespeare-bpe4k.json"
    ))
    .unwrap();
    export_gguf(&own_ck, FileType::F32, Some(&bpe), &dir.join("own.gguf")).unwrap();
    let o = GgufFile::open(&dir.join("own.gguf")).unwrap();
    assert_eq!(
        o.get("tokenizer.ggml.model").and_then(Value::as_str),
        Some("gpt2")
    );
    let tokens = o
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(tokens.len(), 4096);
    assert_eq!(tokens[0].as_str(), Some("<|endoftext|>"));
    assert_eq!(o.get("tokenizer.ggml.eos_token_id"), Some(&Value::U32(0)));
    let merges = o
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(merges[0].as_str(), Some("Ġ t"));
    assert_eq!(
        o.get("tokenizer.ggml.pre").and_then(Value::as_str),
        Some("gpt-2")
    );
    // k3mini reads back the tokenizer it wrote: the same ids for the same text.
    let (back, _) = k3mini_teacher::gguf::load_tokenizer(&o).unwrap();
    let text = "Who's there? 1601, twelve o'clock";
    assert_eq!(back.encode(text).unwrap(), bpe.encode(text).unwrap());
    // A tokenizer whose end of text is `</s>`: training ends documents in it, and the GGUF says so.
    let json = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/corpus/shakespeare-bpe4k.json"
    ))
    .unwrap()
    .replace("<|endoftext|>", "</s>");
    std::fs::write(dir.join("s.json"), json).unwrap();
    let s_bpe = k3mini_data::Tokenizer::load(dir.join("s.json").to_str().unwrap()).unwrap();
    assert_eq!(s_bpe.special_ids().eos, Some(0));
    export_gguf(
        &own_ck,
        FileType::F32,
        Some(&s_bpe),
        &dir.join("own-s.gguf"),
    )
    .unwrap();
    let o = GgufFile::open(&dir.join("own-s.gguf")).unwrap();
    assert_eq!(o.get("tokenizer.ggml.eos_token_id"), Some(&Value::U32(0)));
    // A tokenizer with more ids than the student has rows is refused.
    let small = dir.join("small");
    checkpoint(&small, "preset = \"tiny\"\nvocab_size = 512\nd_model = 64");
    let e = export_gguf(
        &open_checkpoint(&small).unwrap(),
        FileType::F32,
        Some(&bpe),
        &dir.join("s.gguf"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("past the student's 512 ids"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gguf_export_maps_k3_features_to_kimi_k3_and_refuses_full_attn_res() {
    // llama.cpp runs these files in scripts/interop/run.sh (students `k3` and `k3moe`).
    let dir = std::env::temp_dir().join(format!("k3mini-gguf-k3-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let teacher = "teacher";
    let k3 = "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64\n\
              [model.kda]\nhead_dim = 64\ngate_rank = 16\ngate_lower_bound = -5.0\n\
              [model.mla]\nq_lora_rank = 48\nkv_lora_rank = 32\nqk_nope_head_dim = 16\n\
              qk_rope_head_dim = 8\nv_head_dim = 16\noutput_gate = true\n\
              [model.attn_res]\nblock_size = 4";
    let model = checkpoint_with(&dir.join("k3"), k3, teacher);
    let path = dir.join("k3.gguf");
    export_gguf(
        &open_checkpoint(&dir.join("k3")).unwrap(),
        FileType::F32,
        None,
        &path,
    )
    .unwrap();
    let f = GgufFile::open(&path).unwrap();
    let key = |k: &str| f.get(&format!("kimi-k3.{k}")).cloned();
    assert_eq!(
        f.get("general.architecture").and_then(Value::as_str),
        Some("kimi-k3")
    );
    assert_eq!(
        key("attn_res.block_size"),
        Some(Value::U32(2)),
        "4 sub-layers = 2 layers"
    );
    assert_eq!(key("kda.gate_lower_bound"), Some(Value::F32(-5.0)));
    assert_eq!(key("attention.q_lora_rank"), Some(Value::U32(48)));
    assert_eq!(
        key("activation.situ_linear_beta"),
        Some(Value::F32(0.0)),
        "SwiGLU as SiTU"
    );
    for name in [
        "blk.0.attn_res_score.weight",
        "blk.0.ffn_res_score.weight",
        "output_res_score.weight",
        "blk.3.attn_q_a.weight",
        "blk.3.attn_q_a_norm.weight",
        "blk.3.attn_q_b.weight",
        "blk.3.attn_gate.weight",
    ] {
        assert!(f.tensor(name).is_some(), "{name}");
    }
    assert_eq!(
        f.dequantize("blk.0.ssm_a").unwrap().1,
        [2],
        "K3's ssm_a is 1-D"
    );
    // The low-rank output gate becomes kimi-k3's full-rank ssm_g = g_b · g_a.
    let (g, ne) = f.dequantize("blk.0.ssm_g.weight").unwrap();
    assert_eq!(ne, [64, 128]);
    let kda = match &model.model.layers[0].self_attn {
        k3mini_student::model::Mixer::Kda(k) => k,
        _ => unreachable!("tiny starts with KDA"),
    };
    let product = kda
        .g_b_proj
        .weight
        .val()
        .transpose()
        .matmul(kda.g_a_proj.as_ref().unwrap().weight.val().transpose());
    let want: Vec<f32> = product.into_data().try_into_vec().unwrap();
    let err = g
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(err < 1e-6, "ssm_g differs from g_b·g_a by {err}");
    // LatentMoE and SiTU: routed experts in the latent width, SiTU's own caps.
    let moe = "preset = \"k3-mini-moe\"\nvocab_size = 49152\nd_model = 64\nn_layers = 4\n\
               n_heads = 2\nffn_hidden = 128\nactivation = \"situ\"\n[model.kda]\nhead_dim = 32\n\
               gate_rank = 32\n[model.mla]\nkv_lora_rank = 32\nqk_nope_head_dim = 16\n\
               qk_rope_head_dim = 8\nv_head_dim = 16\n[model.moe]\nnum_experts = 4\ntop_k = 2\n\
               expert_hidden = 32\nlatent_dim = 16";
    checkpoint_with(&dir.join("moe"), moe, teacher);
    let path = dir.join("moe.gguf");
    export_gguf(
        &open_checkpoint(&dir.join("moe")).unwrap(),
        FileType::F32,
        None,
        &path,
    )
    .unwrap();
    let m = GgufFile::open(&path).unwrap();
    assert_eq!(m.get("kimi-k3.expert_latent_length"), Some(&Value::U32(16)));
    assert_eq!(
        m.get("kimi-k3.activation.situ_beta"),
        Some(&Value::F32(4.0))
    );
    assert_eq!(
        m.tensor("blk.1.ffn_gate_exps.weight").unwrap().dims,
        [16, 32, 4]
    );
    assert_eq!(
        m.tensor("blk.1.ffn_routed_down.weight").unwrap().dims,
        [64, 16]
    );
    assert_eq!(
        m.tensor("blk.1.ffn_routed_up.weight").unwrap().dims,
        [16, 64]
    );
    assert_eq!(m.tensor("blk.1.ffn_routed_norm.weight").unwrap().dims, [16]);
    // Full AttnRes (every sub-layer its own block) has no llama.cpp graph: refused by name.
    let full =
        "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64\n[model.attn_res]\nblock_size = 1";
    checkpoint_with(&dir.join("full"), full, teacher);
    let e = export_gguf(
        &open_checkpoint(&dir.join("full")).unwrap(),
        FileType::F32,
        None,
        &dir.join("full.gguf"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("attn_res.block_size = 1"), "{e}");
    assert!(!dir.join("full.gguf").exists());
    std::fs::remove_dir_all(&dir).ok();
}
