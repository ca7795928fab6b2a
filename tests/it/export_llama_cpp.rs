//! Every GGUF export, run in the llama.cpp k3mini embeds: F32, Q8_0 and Q4_K_M files of dense and
//! MoE Kimi Linear students, of students with K3 features (llama.cpp's `kimi-k3`), of students
//! without KDA layers (`deepseek2`), and of one with its own tokenizer. llama.cpp must tokenise
//! text as k3mini does, compute k3mini's logits (F32 to float rounding; quantised files to the
//! quantisation's error), and route every token of a MoE student to the experts k3mini's router
//! picks, with its weights and output norms.
//! (scripts/interop/check_gguf.py makes the same checks in llama-cpp-python, for the record.)
use crate::export::checkpoint_with;
use burn::tensor::{Device, Int, Tensor, TensorData};
use k3mini::export::export_gguf;
use k3mini::run_dir::open_checkpoint;
use k3mini_gguf::mix::FileType;
use k3mini_teacher::engine::llama_cpp::{LlamaCppModel, Placement};

const TEXT: &str = "Who's there? Nay, answer me: stand, and unfold yourself. 1601, \
                    twelve o'clock — 'tis bitter cold, and I am sick at heart.";

/// Tiny Kimi Linear shapes (those of scripts/interop/run.sh).
const DENSE: &str = "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64";
const MOE: &str = "preset = \"k3-mini-moe\"\nvocab_size = 49152\nd_model = 64\nn_layers = 4\n\
                   n_heads = 2\nffn_hidden = 128\nmax_seq_len = 512\n[model.kda]\nhead_dim = 32\n\
                   gate_rank = 32\n[model.mla]\nkv_lora_rank = 32\nqk_nope_head_dim = 16\n\
                   qk_rope_head_dim = 8\nv_head_dim = 16\n[model.moe]\nnum_experts = 4\n\
                   top_k = 2\nexpert_hidden = 32";
/// K3 features: block AttnRes, a full-rank safe KDA gate, q-LoRA, the MLA output gate.
const K3: &str = "preset = \"tiny\"\nvocab_size = 49152\nd_model = 64\n[model.kda]\n\
                  head_dim = 64\ngate_lower_bound = -5.0\n[model.mla]\nq_lora_rank = 48\n\
                  kv_lora_rank = 32\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\n\
                  v_head_dim = 16\noutput_gate = true\n[model.attn_res]\nblock_size = 4";
/// SiTU, LatentMoE and block AttnRes on the MoE shape.
const K3_MOE: &str = "preset = \"k3-mini-moe\"\nvocab_size = 49152\nd_model = 64\nn_layers = 4\n\
                      n_heads = 2\nffn_hidden = 128\nmax_seq_len = 512\nactivation = \"situ\"\n\
                      [model.kda]\nhead_dim = 32\ngate_rank = 32\n[model.mla]\n\
                      kv_lora_rank = 32\nqk_nope_head_dim = 16\nqk_rope_head_dim = 8\n\
                      v_head_dim = 16\n[model.moe]\nnum_experts = 4\ntop_k = 2\n\
                      expert_hidden = 32\nlatent_dim = 32\n[model.attn_res]\nblock_size = 2";

/// log-softmax of one row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - m - z).collect()
}

/// How far llama.cpp's logits are from k3mini's: max |Δ|, mean KL(k3mini ‖ llama.cpp), top-1
/// agreement (the last two as `k3mini smoke` measures them).
fn compare(want: &[f32], got: &[f32], vocab: usize) -> (f32, f64, f64) {
    let max = want
        .iter()
        .zip(got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let (kl, top1) = k3mini::smoke::logit_agreement(want, got, vocab).unwrap();
    (max, kl, top1)
}

/// Exports a freshly initialised student of `model_table` (tokenizer `tokenizer`: "teacher" for
/// SmolLM2's, or a tokenizer.json) in each file type and checks each file in llama.cpp, the F32
/// one within 5e-4 of k3mini's logits (as scripts/interop/check_gguf.py's default --tol).
fn check(tag: &str, model_table: &str, tokenizer: &str) {
    check_within(tag, model_table, tokenizer, 5e-4)
}

/// [`check`] with the F32 file's logits within `f32_max` of k3mini's.
fn check_within(tag: &str, model_table: &str, tokenizer: &str, f32_max: f32) {
    let dir = std::env::temp_dir().join(format!("k3mini-llama-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let model = checkpoint_with(&dir.join("run"), model_table, tokenizer);
    let ck = open_checkpoint(&dir.join("run")).unwrap();
    let vocab = ck.plan.model.vocab_size;
    let ids = k3mini::teachers::student_tokenizer(&ck.plan.data.tokenizer)
        .unwrap()
        .encode(TEXT)
        .unwrap();
    let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, ids.len()]), &Device::default());
    let out = model.forward_with(tokens, None);
    let want: Vec<f32> = out.logits.into_data().try_into_vec().unwrap();
    // Measured on these students: F32 max |Δ| ≤ 3.1e-4 and KL ≤ 1e-9 (the all-MLA twin 6.5e-4,
    // 5.6e-9); Q8_0 KL ≤ 1.2e-5,
    // Q4_K_M ≤ 4.8e-4 (random weights give flat logits, so top-1 is no gate for quantised files).
    for (ftype, max_kl) in [
        (FileType::F32, 1e-8),
        (FileType::Q8_0, 1e-4),
        (FileType::Q4KM, 5e-3),
    ] {
        let path = dir.join(format!("{ftype:?}.gguf"));
        export_gguf(&ck, ftype, None, &path).unwrap();
        // The student's chat format rides along as its template (ChatML's, or K3's own).
        let student = k3mini::teachers::student_tokenizer(&ck.plan.data.tokenizer).unwrap();
        if let Some(template) =
            k3mini_data::ChatFormat::of_tokenizer(&student).map(k3mini_data::ChatFormat::jinja)
        {
            let file = k3mini_gguf::GgufFile::open(&path).unwrap();
            assert_eq!(
                file.get("tokenizer.chat_template"),
                Some(&k3mini_gguf::Value::String(template.into())),
                "{tag}"
            );
        }
        let cpp = LlamaCppModel::load(&path, Placement::Cpu { threads: 2 }).unwrap();
        assert_eq!(
            cpp.tokenize(TEXT).unwrap(),
            ids,
            "{tag} {ftype:?}: tokenisation"
        );
        let (got, routing) = cpp.forward(&ids, true).unwrap();
        let (max, kl, top1) = compare(&want, &got, vocab);
        eprintln!("{tag} {ftype:?}: max |Δ logit| {max:.2e}, KL {kl:.2e}, top-1 {top1:.3}");
        assert!(kl < max_kl, "{tag} {ftype:?}: KL {kl}");
        if ftype == FileType::F32 {
            // llama.cpp's F32 arithmetic, with its F16 KV cache and flash attention's F16 Q·K.
            assert!(max < f32_max, "{tag} F32: max |Δ logit| {max}");
            assert_eq!(top1, 1.0, "{tag} F32: top-1");
            check_routing(tag, &out.routing, routing);
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// llama.cpp's routing of every token (read through its graph hooks) against k3mini's router:
/// the same experts, best first, the same weights, and the same norms of the experts' outputs.
fn check_routing(
    tag: &str,
    want: &[k3mini_student::moe::Route],
    got: Option<k3mini_teacher::routing::Routing>,
) {
    let Some(got) = got else {
        assert!(want.is_empty(), "{tag}: llama.cpp routed nothing");
        return;
    };
    let layers: Vec<usize> = got.layers.iter().map(|l| l.layer).collect();
    assert_eq!(
        layers,
        want.iter().map(|r| r.layer).collect::<Vec<_>>(),
        "{tag}: routed layers"
    );
    let (mut worst, mut worst_norm) = (0f32, 0f32);
    for (g, w) in got.layers.iter().zip(want) {
        assert_eq!(g.k, w.k, "{tag} layer {}: k", w.layer);
        assert_eq!(g.experts, w.experts, "{tag} layer {}: experts", w.layer);
        let weights: Vec<f32> = w.weights.clone().into_data().try_into_vec().unwrap();
        let (g_weights, g_norms) = (g.weights.as_ref().unwrap(), g.norms.as_ref().unwrap());
        assert_eq!(
            g_weights.len(),
            weights.len(),
            "{tag} layer {}: weights",
            w.layer
        );
        for (a, b) in g_weights.iter().zip(&weights) {
            worst = worst.max((a - b).abs());
        }
        let norms: Vec<f32> = w.norms.clone().into_data().try_into_vec().unwrap();
        assert_eq!(g_norms.len(), norms.len(), "{tag} layer {}: norms", w.layer);
        for (a, b) in g_norms.iter().zip(&norms) {
            assert!(*b > 0.0, "{tag} layer {}: an expert's output is 0", w.layer);
            worst_norm = worst_norm.max((a - b).abs() / b);
        }
    }
    eprintln!(
        "{tag}: routing matches over {} layers, max |Δ weight| {worst:.2e}, max relative |Δ \
         output norm| {worst_norm:.2e}",
        got.layers.len()
    );
    // The router's inputs carry llama.cpp's F32 rounding (above), scaled by γ = 2.446; the
    // experts' inputs the same, so their outputs' norms differ by a few 1e-4 relative throughout
    // (measured: at most 4.0e-4 and 6.3e-4), where reading the wrong tensor (the weighted
    // outputs, another layer's) is off by tens of percent.
    assert!(worst < 2e-4, "{tag}: routing weights differ by {worst}");
    assert!(
        worst_norm < 2e-3,
        "{tag}: experts' output norms differ by {worst_norm} (relative)"
    );
}

#[test]
fn llama_cpp_runs_the_dense_kimi_linear_export() {
    check("dense", DENSE, "teacher");
}

#[test]
fn llama_cpp_runs_the_moe_kimi_linear_export_and_routes_as_k3mini() {
    check("moe", MOE, "teacher");
}

#[test]
fn llama_cpp_runs_the_kimi_k3_export() {
    check("k3", K3, "teacher");
}

#[test]
fn llama_cpp_runs_the_kimi_k3_latent_moe_export_and_routes_as_k3mini() {
    check("k3moe", K3_MOE, "teacher");
}

#[test]
fn llama_cpp_runs_the_transformer_twin_as_deepseek2() {
    // Every layer MLA (`tiny-transformer`): the Kimi graphs abort without a recurrent layer, so
    // the twin goes out as deepseek2 with its RoPE scaled away. Its four MLA layers read
    // llama.cpp's F16 KV cache through flash attention's F16 Q·K where the Kimi shapes have one:
    // max |Δ| 6.5e-4 (1.6e-4 with an F32 cache and flash attention off), hence 1e-3 here.
    // With deepseek2's RoPE left on (the file without `nope_as_rope`'s keys) the same check
    // measured KL 2.6e-7 and max |Δ| 5.1e-3 on these flat random-weight logits: 25× the gate.
    check_within(
        "twin",
        "preset = \"tiny-transformer\"\nvocab_size = 49152\nd_model = 64",
        "teacher",
        1e-3,
    );
}

#[test]
fn llama_cpp_runs_an_all_mla_moe_student_with_q_lora_as_deepseek2() {
    let table = format!(
        "layer_pattern = \"M\"\n{}",
        MOE.replace("[model.mla]\n", "[model.mla]\nq_lora_rank = 24\n")
    );
    check("moe-twin", &table, "teacher");
}

#[test]
fn a_twin_of_a_k3_featured_student_is_refused_by_name() {
    // deepseek2 has no AttnRes, SiTU, MLA output gate or LatentMoE: such a student without KDA
    // layers has no llama.cpp graph, and the export says which feature, writing nothing.
    let dir = std::env::temp_dir().join(format!("k3mini-llama-k3twin-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    checkpoint_with(
        &dir.join("run"),
        &format!("layer_pattern = \"M\"\n{K3}"),
        "teacher",
    );
    let ck = open_checkpoint(&dir.join("run")).unwrap();
    let e = export_gguf(&ck, FileType::F32, None, &dir.join("twin.gguf")).unwrap_err();
    assert!(
        e.to_string().contains("deepseek2") && e.to_string().contains("(attn_res)"),
        "{e}"
    );
    assert!(!dir.join("twin.gguf").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn llama_cpp_runs_an_export_with_its_own_tokenizer() {
    let bpe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/corpus/shakespeare-bpe4k.json"
    );
    check(
        "own",
        "preset = \"tiny\"\nvocab_size = 4096\nd_model = 64",
        bpe,
    );
}

/// A k3mini-exported GGUF of a student with its own byte-level BPE, served by `k3mini teacher
/// serve`: it loads (its tokenizer read back under the pre-tokenizer name the export wrote), and
/// its vLLM-shaped `prompt_logprobs`, for ids and for text, are the student's own
/// log-probabilities to llama.cpp's F32 rounding.
pub(crate) fn served_student_scores_as_k3mini(
    gguf: &std::path::Path,
    model: &k3mini_student::K3Mini,
    tokenizer: &k3mini_data::Tokenizer,
) {
    use k3mini_teacher::Teacher;
    use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher};
    let server = crate::teacher_server::serve(gguf.to_str().unwrap(), &[]);
    let ids = tokenizer.encode(TEXT).unwrap();
    let vocab = model.lm_head.weight.dims()[1]; // [d_model, V]
    let opts = ClientOptions {
        api: Api::Vllm,
        ..Default::default()
    };
    let served = HttpTeacher::connect(&[server.url.clone()], vocab, opts)
        .unwrap()
        .score(&ids, 5)
        .unwrap();
    let tokens: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let tokens =
        Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, ids.len()]), &Device::default());
    let logits: Vec<f32> = model.forward(tokens).into_data().try_into_vec().unwrap();
    let mut worst = 0f64;
    for (t, row) in logits.chunks_exact(vocab).take(ids.len() - 1).enumerate() {
        let want = log_softmax(row);
        worst = worst.max((want[ids[t + 1] as usize] - served.target_logprobs[t] as f64).abs());
        for j in 0..5 {
            let (id, lp) = (served.top_ids[t * 5 + j], served.top_logprobs[t * 5 + j]);
            worst = worst.max((want[id as usize] - lp as f64).abs());
        }
    }
    assert_eq!(served.positions(), ids.len() - 1);
    assert!(
        worst < 1e-3,
        "served logprobs differ from the student's by {worst}"
    );
    // Text, tokenized by the server with the tokenizer it read from the GGUF.
    let body = serde_json::json!({
        "model": "m", "prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 1,
    });
    let (status, v) =
        crate::teacher_server::raw(&server.url, "POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{v}");
    let prompt = v["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(
        prompt.len(),
        ids.len(),
        "one entry per prompt token, the first null"
    );
    assert!(prompt[0].is_null());
    for (t, entry) in prompt.iter().enumerate().skip(1) {
        assert!(
            entry.get(ids[t].to_string()).is_some(),
            "position {t}: {entry}"
        );
    }
}

/// A student whose BPE takes a chat format's markers as specials is exported with that format's
/// template (K3's and K2's are the reference templates, which llama.cpp recognises by their text),
/// and llama.cpp reads each marker as the one id k3mini trained it as. A vocabulary holding two
/// formats' markers takes the format its chat sources were rendered in.
#[test]
fn an_export_carries_its_formats_template_and_llama_cpp_reads_its_markers() {
    use k3mini_data::ChatFormat;
    use k3mini_data::chat::markers;
    let dir = std::env::temp_dir().join(format!("k3mini-llama-formats-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, TEXT.repeat(20)).unwrap();
    let both: Vec<&str> = [ChatFormat::Chatml, ChatFormat::KimiK3]
        .into_iter()
        .flat_map(|f| markers(f).iter().copied())
        .collect();
    // (the vocabulary's specials, the format its chat sources name, the template expected)
    for (name, specials, sources, want) in [
        (
            "chatml",
            markers(ChatFormat::Chatml),
            None,
            ChatFormat::Chatml,
        ),
        (
            "kimi_k3",
            markers(ChatFormat::KimiK3),
            None,
            ChatFormat::KimiK3,
        ),
        (
            "kimi_k2",
            markers(ChatFormat::KimiK2),
            None,
            ChatFormat::KimiK2,
        ),
        ("both", &both[..], None, ChatFormat::KimiK3),
        (
            "both-chatml",
            &both[..],
            Some(ChatFormat::Chatml),
            ChatFormat::Chatml,
        ),
    ] {
        let (bpe, run) = (dir.join(format!("{name}.json")), dir.join(name));
        k3mini_data::tokenizer::train_byte_level_bpe(
            &[corpus.display().to_string()],
            300,
            specials,
            &bpe,
        )
        .unwrap();
        let tok = k3mini_data::tokenizer::Tokenizer::load(bpe.to_str().unwrap()).unwrap();
        checkpoint_with(
            &run,
            "preset = \"tiny\"\nvocab_size = 300\nd_model = 64",
            bpe.to_str().unwrap(),
        );
        let mut ck = open_checkpoint(&run).unwrap();
        ck.plan.data.sources[0].chat = sources;
        let path = dir.join(format!("{name}.gguf"));
        export_gguf(&ck, FileType::F32, None, &path).unwrap();
        let file = k3mini_gguf::GgufFile::open(&path).unwrap();
        assert_eq!(
            file.get("tokenizer.chat_template"),
            Some(&k3mini_gguf::Value::String(want.jinja().into())),
            "{name}"
        );
        let cpp = LlamaCppModel::load(&path, Placement::Cpu { threads: 2 }).unwrap();
        for m in specials {
            assert_eq!(
                cpp.tokenize(m).unwrap(),
                [tok.token_id(m).unwrap()],
                "{name}: {m}"
            );
        }
        // The agent reads the format back, and stops at that format's end of turn.
        let spec = k3mini_teacher::local::EngineSpec::LlamaCpp(Placement::Cpu { threads: 2 });
        let student = k3mini::agent::student::Student::new(
            k3mini_teacher::local::LocalTeacher::open(&path, spec).unwrap(),
        );
        assert_eq!(student.format(), want, "{name}");
        let end = tok.token_id(want.end_of_turn()).unwrap();
        assert_eq!(student.stops()[0], end, "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

unsafe extern "C" {
    // ggml's own MXFP4 quantiser and dequantiser (ggml-quants.h), in the llama.cpp k3mini links.
    fn quantize_row_mxfp4_ref(x: *const f32, y: *mut u8, k: i64);
    fn dequantize_row_mxfp4(x: *const u8, y: *mut f32, k: i64);
}

#[test]
fn mxfp4_is_byte_identical_to_ggml_s_own_quantiser() {
    use k3mini_gguf::GgmlType;
    use k3mini_gguf::quantize::quantize;
    use k3mini_gguf::quants::dequantize;
    // Blocks of scales from 2^−100 to 2^100 (a splitmix-style hash of the index), then the edges:
    // zeros, every tie of the E2M1 grid at scale 1 (amax 6), amax just under and at powers of two
    // (the saturating range), and negative maxima.
    let hash = |i: u64| {
        let mut z = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((z ^ (z >> 27)) >> 11) as f32 / (1u64 << 53) as f32 * 2.0 - 1.0
    };
    let mut x: Vec<f32> = (0..64 * 32)
        .map(|i| hash(i as u64) * 2f32.powi((i / 32) as i32 * 200 / 64 - 100))
        .collect();
    x.extend([0.0f32; 32]);
    let ties = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0];
    x.extend((0..32).map(|i| ties[i % 8] * if i % 16 < 8 { 1.0 } else { -1.0 }));
    for amax in [7.999_999f32, 8.0, 3.999_999_8, 0.5, -6.5, -1e-30] {
        x.extend((0..32).map(|i| {
            if i == 5 {
                amax
            } else {
                hash(i + 7) * amax.abs()
            }
        }));
    }
    let mut want = vec![0u8; x.len() / 32 * 17];
    // SAFETY: `x` holds whole 32-blocks and `want` 17 bytes for each.
    unsafe { quantize_row_mxfp4_ref(x.as_ptr(), want.as_mut_ptr(), x.len() as i64) };
    let got = quantize(GgmlType::MXFP4, &x).unwrap();
    let first = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(
        first,
        None,
        "first differing byte (block {:?})",
        first.map(|i| i / 17)
    );
    let mut back = vec![0f32; x.len()];
    // SAFETY: `want` holds whole blocks of `back.len()` values.
    unsafe { dequantize_row_mxfp4(want.as_ptr(), back.as_mut_ptr(), x.len() as i64) };
    let ours = dequantize(GgmlType::MXFP4, &got, x.len()).unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&ours), bits(&back));
}

/// A QAT-MXFP4 student of `model_table` exported `--quant mxfp4`: the file holds the weights the
/// QAT forward computes with, bit for bit (`weight`, a ggml tensor, against `trained`, its
/// fake-quantised values in ggml order; a dense student's attn_k_b on kv_b's MXFP4 grid), and
/// llama.cpp's logits are the QAT forward's to the arithmetic of its kernels. Returns KL of
/// llama.cpp's logits from the QAT forward's and from the f32 student's.
fn check_mxfp4_qat(
    tag: &str,
    model_table: &str,
    weight: &str,
    trained: impl Fn(&k3mini_student::K3Mini) -> Vec<f32>,
) -> (f64, f64) {
    use k3mini::train::qat::{FakeQuantizer, QatFormat};
    use k3mini_gguf::GgmlType;
    use k3mini_gguf::quantize::fake_quantize;
    let is_moe = tag == "moe";
    let dir = std::env::temp_dir().join(format!("k3mini-mxfp4-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let model = checkpoint_with(&dir.join("run"), model_table, "teacher");
    let ck = open_checkpoint(&dir.join("run")).unwrap();
    let vocab = ck.plan.model.vocab_size;
    let ids = k3mini::teachers::student_tokenizer(&ck.plan.data.tokenizer)
        .unwrap()
        .encode(TEXT)
        .unwrap();
    let tokens = Tensor::<2, Int>::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect(), [1, ids.len()]),
        &Device::default(),
    );
    let qat = FakeQuantizer::new(QatFormat::Mxfp4).apply(&model);
    let logits = |m: &k3mini_student::K3Mini| -> Vec<f32> {
        let out = m.forward_with(tokens.clone(), None).logits;
        out.into_data().try_into_vec().unwrap()
    };
    let path = dir.join("mxfp4.gguf");
    export_gguf(&ck, FileType::Mxfp4, None, &path).unwrap();
    let file = k3mini_gguf::GgufFile::open(&path).unwrap();
    assert_eq!(file.tensor(weight).unwrap().ty, GgmlType::MXFP4);
    let stored = file.dequantize(weight).unwrap().0;
    assert!(
        stored == trained(&qat),
        "{tag}: {weight} is not the trained weight"
    );
    assert!(
        stored != trained(&model),
        "{tag}: {weight} is not quantised"
    );
    // attn_k_b holds kv_b's MXFP4 values transposed (BF16): along its columns (kv_b's rows) it
    // is on the MXFP4 grid.
    for info in file
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("attn_k_b.weight"))
    {
        let (values, ne) = file.dequantize(&info.name).unwrap();
        let (cols, rows) = (ne[0] as usize, ne[1] as usize);
        let column = |c: usize| -> Vec<f32> { (0..rows).map(|r| values[r * cols + c]).collect() };
        let on_grid = |v: &[f32]| fake_quantize(GgmlType::MXFP4, v).unwrap() == v;
        let expected = info.ty == GgmlType::BF16 && rows % 32 == 0;
        assert_eq!(expected, !is_moe, "{tag}: {} is {:?}", info.name, info.ty);
        assert_eq!(
            (0..cols).all(|c| on_grid(&column(c))),
            !is_moe,
            "{tag}: {}",
            info.name
        );
    }
    let cpp = LlamaCppModel::load(&path, Placement::Cpu { threads: 2 }).unwrap();
    let (got, _) = cpp.forward(&ids, false).unwrap();
    let (max, kl, top1) = compare(&logits(&qat), &got, vocab);
    let (max_p, kl_p, _) = compare(&logits(&model), &got, vocab);
    eprintln!(
        "{tag} MXFP4 vs the QAT forward: max |Δ logit| {max:.2e}, KL {kl:.2e}, top-1 {top1:.3}; \
         vs the f32 student: max |Δ| {max_p:.2e}, KL {kl_p:.2e}"
    );
    std::fs::remove_dir_all(&dir).ok();
    (kl, kl_p)
}

/// The head's weight in ggml's order: burn's `[in, out]` transposed to rows of `d` per token.
fn head_rows(m: &k3mini_student::K3Mini) -> Vec<f32> {
    let w = m.lm_head.weight.val().transpose();
    w.into_data().try_into_vec().unwrap()
}

#[test]
fn a_qat_mxfp4_dense_student_runs_in_llama_cpp_as_trained() {
    let (kl, kl_plain) = check_mxfp4_qat("dense", DENSE, "output.weight", head_rows);
    // Measured: KL 5.7e-6 against the QAT forward (llama.cpp's MXFP4 kernels multiply against
    // activations rounded to Q8_0; an F32 embedding moves it to 5.5e-6), 2.3e-3 against the f32
    // student's: the file is the trained model, not a re-quantised one.
    assert!(kl < 2e-5 && kl * 100.0 < kl_plain, "{kl} vs {kl_plain}");
}

#[test]
fn a_qat_mxfp4_kimi_k3_student_runs_in_llama_cpp_as_trained() {
    // q-LoRA, the MLA and KDA output gates (ssm_g = g_b·g_a), block AttnRes.
    let (kl, kl_plain) = check_mxfp4_qat("k3", K3, "output.weight", head_rows);
    assert!(kl < 2e-5 && kl * 100.0 < kl_plain, "{kl} vs {kl_plain}");
}

#[test]
fn a_qat_mxfp4_moe_student_runs_in_llama_cpp_as_trained() {
    let (kl, kl_plain) = check_mxfp4_qat("moe", MOE, "blk.1.ffn_down_exps.weight", |m| {
        let k3mini_student::model::Ffn::Moe(moe) = &m.model.layers[1].mlp else {
            panic!("layer 1 is a MoE layer")
        };
        moe.experts
            .down_proj
            .val()
            .into_data()
            .try_into_vec()
            .unwrap()
    });
    // Measured: KL 1.07e-5 against the QAT forward, 1.36e-5 against the f32 student's: the other
    // weights are Q8_0 (re-quantised, as llama.cpp's MXFP4_MOE does), and a fresh student's
    // experts move its logits little; the bit-exact experts above are the check that counts.
    assert!(kl < 1e-4 && kl < kl_plain, "{kl} vs {kl_plain}");
}

#[test]
fn the_decode_bench_counts_the_state_each_architecture_keeps() {
    // The hybrid (KKKM) caches one MLA layer per position and keeps three KDA states whatever
    // the length; its twin caches four MLA layers. Between two prompt lengths the twin's state
    // must grow by three more MLA latent rows per position than the hybrid's.
    let dir = std::env::temp_dir().join(format!("k3mini-llama-decode-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    let mut files = Vec::new();
    for (name, preset) in [("hybrid", "tiny"), ("twin", "tiny-transformer")] {
        let run = dir.join(name);
        checkpoint_with(
            &run,
            &format!("preset = \"{preset}\"\nvocab_size = 49152\nd_model = 64"),
            "teacher",
        );
        let path = dir.join(format!("{name}.gguf"));
        export_gguf(&open_checkpoint(&run).unwrap(), FileType::F32, None, &path).unwrap();
        files.push(path);
    }
    let text = dir.join("text.txt");
    std::fs::write(&text, TEXT).unwrap();
    let mut rows = Vec::new();
    k3mini::bench::decode::decode(
        &k3mini::bench::decode::DecodeBench {
            files: &files,
            text: &text,
            contexts: &[64, 192],
            tokens: 4,
            rounds: 1,
            threads: 2,
            flash: Default::default(),
        },
        |r| rows.push(r.clone()),
    )
    .unwrap();
    // Rows alternate the files within each context: hybrid 64, twin 64, hybrid 192, twin 192.
    let state: Vec<usize> = rows.iter().map(|r| r.speed.state_bytes).collect();
    assert_eq!(
        rows.iter().map(|r| r.speed.context).collect::<Vec<_>>(),
        [64, 64, 192, 192]
    );
    let (hybrid, twin) = (state[2] - state[0], state[3] - state[1]);
    // tiny's MLA caches kv_lora 64 + rope 16 values per position in F16; the saved state adds
    // a few bytes of bookkeeping per position (its position and sequence ids) once.
    let row = (64 + 16) * 2;
    assert_eq!(twin - hybrid, 128 * 3 * row, "{state:?}");
    assert!((128 * row..128 * (row + 32)).contains(&hybrid), "{state:?}");
    // What does not grow: the hybrid's three KDA layers keep 2 heads × 64 × 64 f32 of state and
    // a 3-step conv window over q, k and v (3 × 128 channels) each; the twin keeps nothing.
    let fixed = |at_68: usize, growth: usize| at_68 - 68 * (growth / 128);
    let kda = 3 * (2 * 64 * 64 * 4 + 3 * 3 * 128 * 4);
    assert!(
        (kda..kda + 1024).contains(&fixed(state[0], hybrid)),
        "{state:?}"
    );
    assert!(fixed(state[1], twin) < 1024, "{state:?}");
    for r in &rows {
        assert!(r.speed.prefill_tokens_per_s.is_finite() && r.speed.prefill_tokens_per_s > 0.0);
        assert!(r.speed.decode_tokens_per_s.is_finite() && r.speed.decode_tokens_per_s > 0.0);
    }
    std::fs::remove_dir_all(&dir).ok();
}
