//! The llama.cpp engine on SmolLM2-135M-Instruct's Q4_1 GGUF, against transformers (the same
//! golden file the burn teacher meets) and against the burn teacher itself.
use super::smollm2::{golden, ids, refuses_bad_requests, smollm2_gguf, teacher};
use k3mini_teacher::engine::llama_cpp::Placement;
use k3mini_teacher::local::{EngineSpec, LocalTeacher};
use k3mini_teacher::{GenerateParams, Teacher};
use std::path::Path;
use std::sync::OnceLock;

fn open(path: &Path) -> Result<LocalTeacher, k3mini_teacher::TeacherError> {
    LocalTeacher::open(path, EngineSpec::LlamaCpp(Placement::Cpu { threads: 2 }))
}

fn cpp() -> &'static LocalTeacher {
    static T: OnceLock<LocalTeacher> = OnceLock::new();
    T.get_or_init(|| open(&smollm2_gguf()).unwrap())
}

#[test]
fn llama_cpp_scores_as_transformers_and_the_burn_teacher_do() {
    let t = cpp();
    assert_eq!(t.vocab_size(), teacher().vocab_size());
    assert_eq!(t.tokenizer.fingerprint(), teacher().tokenizer.fingerprint());
    let g = golden();
    let k = g["top"].as_u64().unwrap() as usize;
    // Per position: whether the top-1 id is transformers', and |Δ| of its top-1 logprob
    // against transformers and against the burn teacher.
    let (mut agree, mut n, mut sum, mut worst, mut worst_burn) = (0, 0, 0f64, 0f64, 0f64);
    for case in g["scored"].as_array().unwrap() {
        let seq = ids(&case["ids"]);
        let s = t.score(&seq, k).unwrap();
        let burn = teacher().score(&seq, k).unwrap();
        assert_eq!(s.positions(), seq.len() - 1);
        for pos in 0..s.positions() {
            let want_id = case["top_ids"][pos][0].as_u64().unwrap() as u32;
            let want = case["top_logprobs"][pos][0].as_f64().unwrap();
            agree += (s.top_ids[pos * k] == want_id) as usize;
            n += 1;
            let d = (s.top_logprobs[pos * k] as f64 - want).abs();
            (sum, worst) = (sum + d, worst.max(d));
            let b = (s.top_logprobs[pos * k] - burn.top_logprobs[pos * k]).abs() as f64;
            worst_burn = worst_burn.max(b);
        }
    }
    let mean = sum / n as f64;
    eprintln!(
        "llama.cpp: top-1 {agree}/{n}; |Δ top-1 logprob| vs transformers mean {mean:.3} max \
         {worst:.3}, vs burn max {worst_burn:.3}"
    );
    // llama.cpp multiplies the Q4_1 weights with activations quantised to Q8_1, where
    // transformers and the burn teacher dequantise the weights to f32: they agree to that
    // precision (measured: mean 0.03, max 0.21 nats), not to float rounding.
    assert!(agree as f64 >= 0.95 * n as f64, "top-1 {agree}/{n}");
    assert!(mean < 0.1 && worst < 0.5, "mean {mean} max {worst}");
}

#[test]
fn a_context_lent_again_scores_as_a_fresh_one() {
    // Its own model: the first request makes the context the second is lent (memory cleared),
    // and a parallel test on the shared teacher could otherwise take it in between.
    let t = open(&smollm2_gguf()).unwrap();
    let g = golden();
    let cases = g["scored"].as_array().unwrap();
    let (a, b) = (ids(&cases[0]["ids"]), ids(&cases[1]["ids"]));
    assert_ne!(a.len(), b.len(), "two lengths: two contexts");
    let fresh = t.score(&a, 8).unwrap();
    assert_eq!(
        t.score(&a, 8).unwrap(),
        fresh,
        "the same context, lent again"
    );
    let b_fresh = t.score(&b, 8).unwrap();
    assert_eq!(t.score(&a, 8).unwrap(), fresh, "after another length");
    assert_eq!(t.score(&b, 8).unwrap(), b_fresh);
}

#[test]
fn llama_cpp_generates_what_its_own_scoring_predicts() {
    let t = cpp();
    let prompt = ids(&golden()["greedy"]["prompt_ids"]);
    let params = GenerateParams {
        max_tokens: 12,
        logprobs: 3,
        ..Default::default()
    };
    let out = t.generate(&prompt, &params).unwrap();
    assert_eq!(out.ids.len(), 12);
    // Greedy: each token is its step's top-1, and scoring prompt + completion in one batch gives
    // the same logprobs as decoding one token at a time (to llama.cpp's batch-size rounding).
    let mut all = prompt.clone();
    all.extend(&out.ids);
    let s = t.score(&all, 1).unwrap();
    for (i, (&id, &lp)) in out.ids.iter().zip(&out.logprobs).enumerate() {
        assert_eq!((out.top_ids[i * 3], out.top_logprobs[i * 3]), (id, lp));
        let pos = prompt.len() - 1 + i;
        assert_eq!(s.top_ids[pos], id, "step {i}");
        let d = (s.target_logprobs[pos] - lp).abs();
        assert!(d < 0.05, "step {i}: |Δ logprob| {d}");
    }
}

#[test]
fn llama_cpp_refuses_bad_requests_and_files_by_name() {
    refuses_bad_requests(cpp());
    let dir = std::env::temp_dir().join(format!("k3mini-llama-cpp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cut = dir.join("cut.gguf");
    let whole = std::fs::read(smollm2_gguf()).unwrap();
    std::fs::write(&cut, &whole[..whole.len() / 3]).unwrap();
    let e = open(&cut).err().expect("a cut file is refused").to_string();
    assert!(e.contains("cut.gguf"), "{e}");
    // `whole` with the byte at the end of the first `find` replaced by `to`, written as `name`:
    // llama.cpp's own reason for refusing it.
    let patched = |find: &[u8], to: u8, name: &str| {
        let at = whole
            .windows(find.len())
            .position(|w| w == find)
            .expect("found")
            + find.len();
        let mut bytes = whole.clone();
        bytes[at - 1] = to;
        std::fs::write(dir.join(name), &bytes).unwrap();
        open(&dir.join(name)).err().expect("refused").to_string()
    };
    // A well-formed file of an architecture llama.cpp does not know.
    let key = b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama";
    let e = patched(key, b'b', "llamb.gguf");
    assert!(
        e.contains("llamb.gguf") && e.contains("unknown model architecture"),
        "{e}"
    );
    // A file whose tensors are not the ones its architecture needs.
    let e = patched(b"output_norm.weight", b'x', "missing.gguf");
    assert!(
        e.contains("missing.gguf") && e.contains("output_norm.weight"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
