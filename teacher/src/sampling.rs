//! What a sampler draws from, in one place: the teacher engines, on-policy training and the agent
//! (whose speculative-sampling rule divides by the probability a token was drawn with) all use it.

/// How tokens are drawn: greedy at temperature 0, else from [`sampling_dist`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    /// Nucleus mass (1 = off).
    pub top_p: f32,
}

impl Sampling {
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

impl From<&crate::GenerateParams> for Sampling {
    fn from(p: &crate::GenerateParams) -> Self {
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
        }
    }
}

/// A sparse distribution, by descending probability (ties by ascending id).
pub type Dist = Vec<(u32, f64)>;

/// The probability `dist` gives `id` (0 outside its support).
pub fn prob(dist: &Dist, id: u32) -> f64 {
    dist.iter()
        .find(|&&(i, _)| i == id)
        .map_or(0.0, |&(_, p)| p)
}

/// What a sampler at `s` draws from, given each candidate's logit (or logprob: the same up to a
/// shift): `softmax(logit / T)` over the candidates in f64, cut to the smallest set of top ids
/// holding `top_p` of the mass, renormalised.
pub fn sampling_dist(candidates: impl IntoIterator<Item = (u32, f32)>, s: Sampling) -> Dist {
    // In f64 and floored, so a tiny temperature sharpens rather than overflows to NaN.
    let t = (s.temperature as f64).max(1e-30);
    let mut d: Dist = candidates
        .into_iter()
        .map(|(id, l)| (id, l as f64 / t))
        .collect();
    d.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let max = d.first().map_or(0.0, |x| x.1);
    let z: f64 = d.iter().map(|x| (x.1 - max).exp()).sum();
    for x in &mut d {
        x.1 = (x.1 - max).exp() / z;
    }
    let mut kept = 0.0;
    let mut n = 0;
    for x in &d {
        kept += x.1;
        n += 1;
        if kept >= s.top_p as f64 {
            break;
        }
    }
    d.truncate(n);
    for x in &mut d {
        x.1 /= kept;
    }
    d
}

/// One draw from `dist` with `u` uniform in `[0, 1)`.
pub fn draw(dist: &Dist, u: f64) -> u32 {
    let mut acc = 0.0;
    for &(id, p) in dist {
        acc += p;
        if u < acc {
            return id;
        }
    }
    dist.last().expect("a distribution has support").0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_dist_tempers_and_cuts_to_top_p() {
        let lps = [(0, (0.5f32).ln()), (1, (0.3f32).ln()), (2, (0.2f32).ln())];
        let at = |temperature, top_p| sampling_dist(lps, Sampling { temperature, top_p });
        let d = at(1.0, 1.0);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!((d[1].1 - 0.3).abs() < 1e-6);
        // top_p 0.7: {0, 1} hold 0.8 ≥ 0.7, renormalised.
        let d = at(1.0, 0.7);
        assert_eq!(d.len(), 2);
        assert!((d[0].1 - 0.5 / 0.8).abs() < 1e-6);
        // T = 0.5 squares the odds: 0.25 : 0.09 : 0.04.
        let d = at(0.5, 1.0);
        assert!((d[0].1 - 0.25 / 0.38).abs() < 1e-6);
        assert_eq!(draw(&d, 0.0), 0);
        assert_eq!(draw(&d, 0.999_999), 2);
        assert_eq!(prob(&d, 7), 0.0);
        // A temperature that would overflow f32 division picks the top id, not NaN.
        assert_eq!(at(1e-40, 1.0)[0], (0, 1.0));
    }
}
