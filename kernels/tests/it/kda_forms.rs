//! The chunkwise form and the decode step must agree with the naive recurrence.

use crate::common::{max_abs_diff, random_inputs};
use burn::tensor::{Distribution, Tensor};
use k3mini_kernels::kda::default_scale;
use k3mini_kernels::{chunk_kda, kda_step, naive_recurrent_kda};

#[test]
fn chunk_matches_naive_at_several_lengths() {
    // T below, at, and not a multiple of the chunk; two heads, dk != dv.
    for (t, chunk) in [(1, 64), (37, 64), (64, 64), (130, 64), (50, 16)] {
        let x = random_inputs(2, t, 2, 16, 8, t as u64);
        let scale = default_scale(16);
        let naive = naive_recurrent_kda(&x, scale, None);
        let fast = chunk_kda(&x, scale, None, chunk);
        let d_o = max_abs_diff(naive.o, fast.o);
        let d_s = max_abs_diff(naive.state, fast.state);
        assert!(
            d_o < 1e-5 && d_s < 1e-5,
            "T={t} C={chunk}: |Δo|={d_o:e} |ΔS|={d_s:e}"
        );
    }
}

#[test]
fn chunk_carries_an_initial_state() {
    let x = random_inputs(1, 70, 2, 8, 8, 7);
    let s0 = Tensor::<4>::random(
        [1, 2, 8, 8],
        Distribution::Normal(0.0, 1.0),
        &crate::common::device(),
    );
    let naive = naive_recurrent_kda(&x, 0.5, Some(s0.clone()));
    let fast = chunk_kda(&x, 0.5, Some(s0), 32);
    assert!(max_abs_diff(naive.o, fast.o) < 1e-5);
    assert!(max_abs_diff(naive.state, fast.state) < 1e-5);
}

#[test]
fn splitting_a_sequence_and_carrying_the_state_is_exact() {
    // Prefill 45 tokens with the chunk form, then decode 5 steps: equals one pass over 50.
    let x = random_inputs(1, 50, 3, 8, 4, 3);
    let scale = default_scale(8);
    let full = naive_recurrent_kda(&x, scale, None);
    let head = |t: &Tensor<4>| t.clone().narrow(1, 0, 45);
    let prefix = k3mini_kernels::KdaInputs {
        q: head(&x.q),
        k: head(&x.k),
        v: head(&x.v),
        g: head(&x.g),
        beta: x.beta.clone().narrow(1, 0, 45),
        starts: None,
    };
    let mut state = chunk_kda(&prefix, scale, None, 16).state;
    for i in 45..50 {
        let at = |t: &Tensor<4>| t.clone().narrow(1, i, 1).squeeze_dim::<3>(1);
        let beta = x.beta.clone().narrow(1, i, 1).squeeze_dim::<2>(1);
        let (o, s) = kda_step(state, at(&x.q), at(&x.k), at(&x.v), at(&x.g), beta, scale);
        state = s;
        let want = full.o.clone().narrow(1, i, 1).squeeze_dim::<3>(1);
        assert!(max_abs_diff(o, want) < 1e-5, "decode step {i}");
    }
    assert!(max_abs_diff(state, full.state) < 1e-5);
}

#[test]
fn strong_decay_does_not_overflow() {
    // Γ reaches -5 * 64 = -320 inside a chunk: exp(+320) would overflow if the decay were factored.
    let mut x = random_inputs(1, 64, 1, 8, 8, 11);
    x.g = Tensor::<4>::ones([1, 64, 1, 8], &crate::common::device()) * -5.0;
    let fast = chunk_kda(&x, 1.0, None, 64);
    let naive = naive_recurrent_kda(&x, 1.0, None);
    assert!(max_abs_diff(fast.o, naive.o) < 1e-5);
}
