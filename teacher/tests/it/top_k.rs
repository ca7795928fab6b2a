//! The one-pass top-k against its naive twin (sort everything), and log-sum-exp against f64.
use k3mini_data::rng::splitmix64;
use k3mini_teacher::{log_sum_exp, top_k};

fn naive_top_k(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, x))
        .collect();
    all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    all.truncate(k);
    all
}

#[test]
fn top_k_is_the_naive_sort_ties_and_all() {
    let mut state = 7u64;
    for case in 0..200 {
        let n = 1 + (splitmix64(&mut state) % 3000) as usize;
        // Few distinct values in some rows, so ties are common; infinities in others.
        let levels = if case % 3 == 0 { 5 } else { 1 << 20 };
        let mut row: Vec<f32> = (0..n)
            .map(|_| (splitmix64(&mut state) % levels) as f32 / 7.0 - 3.0)
            .collect();
        if case % 5 == 0 {
            row[n / 2] = f32::INFINITY;
            row[n - 1] = f32::NEG_INFINITY;
        }
        if case % 7 == 0 {
            row.sort_by(f32::total_cmp); // ascending: every value enters the kept set
        }
        for k in [1, 2, 20, 64, n, n + 3] {
            assert_eq!(top_k(&row, k), naive_top_k(&row, k), "case {case}, k {k}");
        }
    }
}

#[test]
fn log_sum_exp_matches_f64() {
    let mut state = 3u64;
    let row: Vec<f32> = (0..49152)
        .map(|_| (splitmix64(&mut state) % 20_000) as f32 / 1000.0 - 10.0)
        .collect();
    let max = row.iter().copied().fold(f32::MIN, f32::max) as f64;
    let want = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let got = log_sum_exp(&row);
    assert!((got - want).abs() < 1e-6, "{got} vs {want}");
}
