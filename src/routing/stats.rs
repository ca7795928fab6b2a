//! Routing statistics: what a MoE teacher's routers did over a scored corpus, per MoE layer and
//! expert, overall and per corpus source (domain). Pure accumulation over routing rows
//! (`k3mini_data::routing`); [`super::report`] writes them out.
//!
//! Over the `T` tokens a layer routed, each choosing the set `S_t` of `k` experts with router
//! weights `w_{t,j}` and expert outputs `f_j(x_t)`:
//!
//! - frequency `F_j = |{t : j ∈ S_t}| / T` (sums to `k` over experts);
//! - co-selection `C_{ij} = |{t : i, j ∈ S_t}|` (the diagonal is the count of `j`);
//! - experts in use `exp H(F / k)`: the perplexity of the layer's usage (`E` when uniform);
//! - white-box teachers only, with `ḡ_{t,j} = w_{t,j} / Σ_{i ∈ S_t} w_{t,i}` (the weights
//!   renormalised over the top-k, as REAP takes them; this drops a routed scaling factor): mean
//!   output norm `N_j = mean_{t : j ∈ S_t} ‖f_j(x_t)‖₂`, REAP saliency
//!   `S_j = mean_{t : j ∈ S_t} ḡ_{t,j} ‖f_j(x_t)‖₂`, and the effective experts per token
//!   `mean_t 1 / Σ_j ḡ_{t,j}²` (`k` when the weights are equal, 1 when one expert takes all);
//! - per source `s` with usage `F^s`, its specialisation `KL(F^s/k ‖ F/k)` in nats, and each
//!   expert's profile `F^s_j` across sources.

use k3mini_data::routing::{LayerRouting, RoutingRow, RoutingShape};

/// One MoE layer's sums over the tokens it routed.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    pub layer: usize,
    /// Tokens routed.
    pub tokens: u64,
    /// `[E]`: times each expert was chosen.
    pub counts: Vec<u64>,
    /// `[E × E]` row-major: tokens that chose both (the diagonal is `counts`); kept overall only
    /// (it is `E²` per layer: 6 MiB at K3's 896 experts).
    pub co_selected: Option<Vec<u64>>,
    /// White-box sums, per expert over the tokens that chose it: `Σ ‖f_j‖₂` and `Σ ḡ_j ‖f_j‖₂`.
    pub white: Option<WhiteSums>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WhiteSums {
    pub norm: Vec<f64>,
    pub saliency: Vec<f64>,
    /// `Σ_t 1 / Σ_j ḡ_{t,j}²`.
    pub effective_k: f64,
}

impl LayerStats {
    pub fn new(layer: usize, experts: usize, white: bool, co_selection: bool) -> Self {
        Self {
            layer,
            tokens: 0,
            counts: vec![0; experts],
            co_selected: co_selection.then(|| vec![0; experts * experts]),
            white: white.then(|| WhiteSums {
                norm: vec![0.0; experts],
                saliency: vec![0.0; experts],
                effective_k: 0.0,
            }),
        }
    }

    fn experts(&self) -> usize {
        self.counts.len()
    }

    /// Adds one sequence's routing of this layer (checked against the teacher's routing when it
    /// was read).
    pub fn add(&mut self, l: &LayerRouting) {
        let (e, k) = (self.experts(), l.k);
        for (t, chosen) in l.experts.chunks_exact(k).enumerate() {
            self.tokens += 1;
            for &i in chosen {
                self.counts[i as usize] += 1;
                if let Some(co) = &mut self.co_selected {
                    for &j in chosen {
                        co[i as usize * e + j as usize] += 1;
                    }
                }
            }
            if let (Some(w), Some(weights), Some(norms)) = (&mut self.white, &l.weights, &l.norms) {
                let g = &weights[t * k..(t + 1) * k];
                let total: f64 = g.iter().map(|&x| x as f64).sum();
                let mut squares = 0.0;
                for ((&j, &gj), &nj) in chosen.iter().zip(g).zip(&norms[t * k..(t + 1) * k]) {
                    let g = gj as f64 / total;
                    squares += g * g;
                    w.norm[j as usize] += nj as f64;
                    w.saliency[j as usize] += g * nj as f64;
                }
                w.effective_k += 1.0 / squares;
            }
        }
    }

    /// `F_j`: each expert's share of the tokens (0 for a layer that routed none).
    pub fn frequency(&self) -> Vec<f64> {
        let t = self.tokens.max(1) as f64;
        self.counts.iter().map(|&c| c as f64 / t).collect()
    }

    /// `exp H(F / k)`: how many experts the layer effectively uses.
    pub fn experts_in_use(&self) -> f64 {
        let total: u64 = self.counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let h: f64 = self
            .counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / total as f64;
                -p * p.ln()
            })
            .sum();
        h.exp()
    }

    /// Per expert, a white-box sum's mean over the tokens that chose it (None where it was never
    /// chosen).
    fn mean_per_choice(&self, sums: &[f64]) -> Vec<Option<f64>> {
        sums.iter()
            .zip(&self.counts)
            .map(|(&s, &c)| (c > 0).then(|| s / c as f64))
            .collect()
    }

    /// `N_j`, white-box only.
    pub fn mean_norm(&self) -> Option<Vec<Option<f64>>> {
        self.white.as_ref().map(|w| self.mean_per_choice(&w.norm))
    }

    /// REAP's `S_j`, white-box only.
    pub fn saliency(&self) -> Option<Vec<Option<f64>>> {
        self.white
            .as_ref()
            .map(|w| self.mean_per_choice(&w.saliency))
    }

    /// `mean_t 1 / Σ_j ḡ²`, white-box only.
    pub fn effective_k(&self) -> Option<f64> {
        let w = self.white.as_ref()?;
        (self.tokens > 0).then(|| w.effective_k / self.tokens as f64)
    }
}

/// `KL(p ‖ q)` of two usage vectors (normalised here), in nats; experts `q` never saw count where
/// `p` has mass only as far as a floor of half a count lets them (so one unseen expert does not
/// make it infinite).
pub fn usage_kl(p: &[u64], q: &[u64]) -> f64 {
    let (sp, sq) = (p.iter().sum::<u64>() as f64, q.iter().sum::<u64>() as f64);
    if sp == 0.0 || sq == 0.0 {
        return 0.0;
    }
    p.iter()
        .zip(q)
        .filter(|(a, _)| **a > 0)
        .map(|(&a, &b)| {
            let pa = a as f64 / sp;
            let qb = (b as f64).max(0.5) / sq;
            pa * (pa / qb).ln()
        })
        .sum()
}

/// Statistics of a set of routing shards: overall and per source.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingStats {
    pub shape: RoutingShape,
    pub white_box: bool,
    /// Per MoE layer, over every token.
    pub layers: Vec<LayerStats>,
    /// Per source (by index), per MoE layer.
    pub sources: Vec<Vec<LayerStats>>,
}

impl RoutingStats {
    pub fn new(shape: &RoutingShape, white_box: bool, sources: usize) -> Self {
        let layers = |co: bool| {
            shape
                .moe_layers
                .iter()
                .map(|&l| LayerStats::new(l, shape.experts, white_box, co))
                .collect::<Vec<_>>()
        };
        Self {
            shape: shape.clone(),
            white_box,
            layers: layers(true),
            sources: (0..sources).map(|_| layers(false)).collect(),
        }
    }

    /// Adds a row of source `source` (checked against `shape` when its shard was read).
    pub fn add(&mut self, row: &RoutingRow) {
        let by_source = &mut self.sources[row.source as usize];
        for ((all, mine), l) in self
            .layers
            .iter_mut()
            .zip(by_source)
            .zip(&row.routing.layers)
        {
            all.add(l);
            mine.add(l);
        }
    }

    /// Per source, per MoE layer: `KL(F^s/k ‖ F/k)`.
    pub fn specialisation(&self) -> Vec<Vec<f64>> {
        self.sources
            .iter()
            .map(|layers| {
                layers
                    .iter()
                    .zip(&self.layers)
                    .map(|(s, all)| usage_kl(&s.counts, &all.counts))
                    .collect()
            })
            .collect()
    }
}
