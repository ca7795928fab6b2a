//! The one deterministic generator k3mini draws from (shuffles, held-out splits, sampling, test
//! data): SplitMix64, whose whole state is one `u64`, so every draw is a function of a seed.

/// SplitMix64: a small, well-mixed deterministic generator (seeding and shuffles only).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `[0, 1)`: the top 53 bits of the next [`splitmix64`] output.
pub fn uniform(state: &mut u64) -> f64 {
    (splitmix64(state) >> 11) as f64 / (1u64 << 53) as f64
}
