//! KDA ops against flash-linear-attention's `naive_recurrent_kda` / `naive_chunk_kda`
//! (tests/golden/kda_ops.safetensors, made by scripts/golden/generate.py).

use crate::common::{golden, max_abs_diff};
use burn::tensor::Tensor;
use k3mini_kernels::{KdaInputs, chunk_kda, naive_recurrent_kda};

const FILE: &str = "kda_ops.safetensors";

fn inputs(len: usize) -> (KdaInputs, Tensor<4>, f64) {
    let cut = |t: Tensor<4>| t.narrow(1, 0, len);
    let x = KdaInputs {
        q: cut(golden(FILE, "q")),
        k: cut(golden(FILE, "k")),
        v: cut(golden(FILE, "v")),
        g: cut(golden(FILE, "g")),
        beta: golden::<3>(FILE, "beta").narrow(1, 0, len),
        starts: None,
    };
    let scale: f32 = golden::<1>(FILE, "scale").into_scalar::<f32>();
    (x, golden(FILE, "initial_state"), scale as f64)
}

#[test]
fn both_forms_match_fla_over_the_full_sequence() {
    let (x, s0, scale) = inputs(128);
    for (name, out) in [
        ("naive", naive_recurrent_kda(&x, scale, Some(s0.clone()))),
        ("chunk", chunk_kda(&x, scale, Some(s0.clone()), 64)),
    ] {
        let d_rec = max_abs_diff(out.o.clone(), golden(FILE, "o_recurrent"));
        let d_chk = max_abs_diff(out.o, golden(FILE, "o_chunk"));
        let d_s = max_abs_diff(out.state, golden(FILE, "state_recurrent"));
        assert!(
            d_rec < 1e-5 && d_chk < 1e-5 && d_s < 1e-5,
            "{name}: {d_rec:e} {d_chk:e} {d_s:e}"
        );
    }
}

#[test]
fn chunk_form_matches_fla_on_a_ragged_prefix() {
    // 100 tokens: one full chunk and a padded one. Outputs are causal, so fla's first 100 apply.
    let (x, s0, scale) = inputs(100);
    let out = chunk_kda(&x, scale, Some(s0), 64);
    let want = golden::<4>(FILE, "o_recurrent").narrow(1, 0, 100);
    let d = max_abs_diff(out.o, want);
    assert!(d < 1e-5, "|Δo| = {d:e}");
}
