//! Packed documents: with `starts`, nothing crosses a document boundary, in either form.

use crate::common::{device, max_abs_diff, random_inputs};
use burn::tensor::{Tensor, TensorData};
use k3mini_kernels::{KdaInputs, chunk_kda, naive_recurrent_kda};

/// `[B, T]` starts with documents beginning at the given positions in every row.
fn starts(b: usize, t: usize, at: &[usize]) -> Tensor<2> {
    let mut v = vec![0.0f32; b * t];
    for row in 0..b {
        for &p in at {
            v[row * t + p] = 1.0;
        }
    }
    Tensor::from_data(TensorData::new(v, [b, t]), &device())
}

fn slice(x: &KdaInputs, from: usize, len: usize) -> KdaInputs {
    let cut = |t: &Tensor<4>| t.clone().narrow(1, from, len);
    KdaInputs {
        q: cut(&x.q),
        k: cut(&x.k),
        v: cut(&x.v),
        g: cut(&x.g),
        beta: x.beta.clone().narrow(1, from, len),
        starts: None,
    }
}

#[test]
fn packed_equals_each_document_alone() {
    // Boundaries inside a chunk, at a chunk edge, and in a later chunk; chunk 16 over T = 70.
    let bounds = [0, 5, 16, 40, 70];
    let mut x = random_inputs(2, 70, 2, 8, 8, 21);
    x.starts = Some(starts(2, 70, &bounds[1..4]));
    for out in [
        chunk_kda(&x, 0.5, None, 16),
        naive_recurrent_kda(&x, 0.5, None),
    ] {
        for w in bounds.windows(2) {
            let alone = naive_recurrent_kda(&slice(&x, w[0], w[1] - w[0]), 0.5, None);
            let d = max_abs_diff(out.o.clone().narrow(1, w[0], w[1] - w[0]), alone.o.clone());
            assert!(d < 1e-5, "document {w:?}: |Δo| = {d:e}");
        }
        let last = naive_recurrent_kda(&slice(&x, 40, 30), 0.5, None);
        assert!(
            max_abs_diff(out.state, last.state) < 1e-5,
            "the final state is the last document's"
        );
    }
}

#[test]
fn a_start_at_position_zero_discards_the_initial_state() {
    let mut x = random_inputs(1, 20, 2, 8, 8, 4);
    let s0 = Tensor::<4>::ones([1, 2, 8, 8], &device());
    let fresh = chunk_kda(&x, 0.5, None, 8);
    x.starts = Some(starts(1, 20, &[0]));
    for out in [
        chunk_kda(&x, 0.5, Some(s0.clone()), 8),
        naive_recurrent_kda(&x, 0.5, Some(s0)),
    ] {
        assert!(max_abs_diff(out.o, fresh.o.clone()) < 1e-5);
    }
}

#[test]
fn chunk_matches_naive_with_random_boundaries() {
    for (t, chunk, seed) in [(37, 64, 1u64), (130, 64, 2), (50, 16, 3)] {
        let mut x = random_inputs(2, t, 2, 16, 8, seed);
        let at: Vec<usize> = (1..t)
            .filter(|p| (p * 7 + seed as usize) % 11 == 0)
            .collect();
        x.starts = Some(starts(2, t, &at));
        let fast = chunk_kda(&x, 0.25, None, chunk);
        let naive = naive_recurrent_kda(&x, 0.25, None);
        assert!(max_abs_diff(fast.o, naive.o) < 1e-5, "T={t}");
        assert!(max_abs_diff(fast.state, naive.state) < 1e-5, "T={t}");
    }
}
