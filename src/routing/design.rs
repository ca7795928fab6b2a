//! `k3mini routing design`: a MoE student's `[model.moe]` and its map onto the teacher's experts,
//! from the teacher's harvested routing ([`super::report::for_each_row`]).
//!
//! - **Depth.** The student's MoE layers `0..M_S` map to the teacher's MoE layers `0..M_T` by
//!   relative depth: `j ↦ round(j (M_T − 1) / (M_S − 1))`.
//! - **Groups.** Each mapped teacher layer's experts are clustered bottom-up into the student's `N`
//!   experts (average linkage) by the affinity
//!   ```text
//!   a_ij = ½ C_ij / sqrt(C_ii C_jj)  +  ½ cos(π_i, π_j)
//!   ```
//!   `C` the co-selection counts (the first term is 1 when `i` and `j` always fire together, so a
//!   token's teacher experts tend to land in one student expert) and `π_j` expert `j`'s frequency
//!   in each corpus source (its domain profile; constant with one source). A merge is taken only
//!   while the group's routing mass stays within `1.5 · total / N` (or the largest single
//!   expert's), so no student expert inherits most of the layer; when no pair fits, the two
//!   lightest groups merge.
//! - **Domain.** With `domain`, the counts are that source's and the teacher's experts it never
//!   routes to are left out of every group.
//! - **Top-k.** The mean number of distinct groups a token's `k` teacher experts fall in, over the
//!   mapped layers, rounded (at least 1): the picks the student needs to follow the teacher's routing.

use super::report::for_each_row;
use super::stats::RoutingStats;
use crate::error::Result;
pub use k3mini_data::design::{Design, LayerMap};
use k3mini_data::routing::{RoutingMeta, RoutingRow, RoutingShape};
use std::path::Path;

/// What the design may choose and what it is told.
#[derive(Clone, Debug)]
pub struct DesignOptions {
    /// Student routed experts per MoE layer.
    pub experts: usize,
    /// Design for this source (a name in the shards' corpus) only.
    pub domain: Option<String>,
    /// Student layers (default: the teacher's).
    pub layers: Option<usize>,
    /// Student leading dense layers (default: the teacher's, at most `layers − 1`).
    pub first_dense_layers: Option<usize>,
}

/// Designs a student from the routing shards in `dir`; `on_shard(done, total)` per shard read
/// (twice: the statistics, then the distinct-groups count).
pub fn design(
    dir: &Path,
    opts: &DesignOptions,
    on_shard: &mut dyn FnMut(usize, usize),
) -> Result<Design> {
    let (stats, meta) = super::report::read_stats(dir, on_shard)?;
    design_from(&stats, &meta, opts, &mut |on_row| {
        for_each_row(dir, &mut |_, row| on_row(row), on_shard).map(|_| ())
    })
}

/// Every row of the routing once more, to `on_row`.
pub type Rows<'a> = dyn FnMut(&mut dyn FnMut(&RoutingRow)) -> Result<()> + 'a;

/// [`design`] from statistics already summed and a second pass over their rows.
pub fn design_from(
    stats: &RoutingStats,
    meta: &RoutingMeta,
    opts: &DesignOptions,
    rows: &mut Rows,
) -> Result<Design> {
    let source = domain_index(meta, opts.domain.as_deref())?;
    let shape = &meta.shape;
    let (n_layers, first_dense) = student_depth(shape, opts)?;
    let student_moe: Vec<usize> = (first_dense..n_layers).collect();
    let teacher_of = depth_map(student_moe.len(), shape.moe_layers.len());
    let mut layers = Vec::new();
    for (&student_layer, &t) in student_moe.iter().zip(&teacher_of) {
        let (groups, mass) = cluster(stats, t, source, opts.experts)?;
        layers.push(LayerMap {
            student_layer,
            teacher_layer: shape.moe_layers[t],
            groups,
            mass,
            distinct_groups: 0.0,
        });
    }
    count_distinct_groups(rows, shape.experts, source, &teacher_of, &mut layers)?;
    let mean = layers.iter().map(|l| l.distinct_groups).sum::<f64>() / layers.len() as f64;
    let tokens = match source {
        Some(s) => stats.sources[s][0].tokens,
        None => stats.layers[0].tokens,
    };
    Ok(Design {
        teacher: meta.teacher.clone(),
        teacher_shape: shape.clone(),
        domain: opts.domain.clone(),
        tokens,
        n_layers,
        first_dense_layers: first_dense,
        num_experts: opts.experts,
        top_k: (mean.round() as usize).clamp(1, opts.experts),
        layers,
    })
}

fn domain_index(meta: &RoutingMeta, domain: Option<&str>) -> Result<Option<usize>> {
    let Some(name) = domain else { return Ok(None) };
    meta.sources
        .iter()
        .position(|s| s == name)
        .map(Some)
        .ok_or_else(|| {
            crate::refused!(
                "--domain {name}: the scored corpus's sources are {:?}",
                meta.sources
            )
        })
}

/// The student's layers and leading dense layers.
fn student_depth(shape: &RoutingShape, opts: &DesignOptions) -> Result<(usize, usize)> {
    let n = opts.layers.unwrap_or(shape.layers);
    let teacher_dense = shape.moe_layers.first().copied().unwrap_or(0);
    let dense = opts
        .first_dense_layers
        .unwrap_or(teacher_dense.min(n.saturating_sub(1)));
    if n == 0 || dense >= n {
        return Err(crate::refused!(
            "a student of {n} layers with {dense} dense ones has no MoE layer"
        ));
    }
    if shape.moe_layers.is_empty() {
        return Err(crate::refused!("the teacher's routing has no MoE layer"));
    }
    Ok((n, dense))
}

/// Student MoE layer `j` of `m_s` → teacher MoE layer index, by relative depth.
pub fn depth_map(m_s: usize, m_t: usize) -> Vec<usize> {
    (0..m_s)
        .map(|j| match m_s {
            1 => (m_t - 1) / 2,
            _ => ((j * (m_t - 1)) as f64 / (m_s - 1) as f64).round() as usize,
        })
        .collect()
}

/// Teacher MoE layer `t`'s experts in `n` groups (see the module's doc) and their mass.
fn cluster(
    stats: &RoutingStats,
    t: usize,
    source: Option<usize>,
    n: usize,
) -> Result<(Vec<Vec<usize>>, Vec<f64>)> {
    let all = &stats.layers[t];
    let e = all.counts.len();
    let counts = match source {
        Some(s) => &stats.sources[s][t].counts,
        None => &all.counts,
    };
    let co = all
        .co_selected
        .as_ref()
        .expect("overall statistics keep co-selection");
    let live: Vec<usize> = (0..e).filter(|&j| counts[j] > 0).collect();
    if live.len() < n {
        return Err(crate::refused!(
            "teacher layer {}: only {} of its {e} experts are routed to{}, fewer than --experts {n}",
            all.layer,
            live.len(),
            source.map_or(String::new(), |_| " on this domain".into())
        ));
    }
    let profile = |j: usize| -> Vec<f64> {
        stats
            .sources
            .iter()
            .map(|s| s[t].counts[j] as f64 / s[t].tokens.max(1) as f64)
            .collect()
    };
    let profiles: Vec<Vec<f64>> = (0..e).map(profile).collect();
    let affinity = |i: usize, j: usize| {
        let ochiai =
            co[i * e + j] as f64 / ((co[i * e + i] * co[j * e + j]) as f64).sqrt().max(1.0);
        0.5 * ochiai + 0.5 * cosine(&profiles[i], &profiles[j])
    };
    let total: f64 = live.iter().map(|&j| counts[j] as f64).sum();
    let heaviest = live.iter().map(|&j| counts[j] as f64).fold(0.0, f64::max);
    let cap = (1.5 * total / n as f64).max(heaviest);
    let mut groups: Vec<Vec<usize>> = live.iter().map(|&j| vec![j]).collect();
    let mass = |g: &[usize]| g.iter().map(|&j| counts[j] as f64).sum::<f64>();
    while groups.len() > n {
        let mut best: Option<(f64, usize, usize)> = None;
        let mut lightest: Option<(f64, usize, usize)> = None;
        for a in 0..groups.len() {
            for b in a + 1..groups.len() {
                let joint = mass(&groups[a]) + mass(&groups[b]);
                if lightest.is_none_or(|(m, _, _)| joint < m) {
                    lightest = Some((joint, a, b));
                }
                if joint > cap {
                    continue;
                }
                let link = groups[a]
                    .iter()
                    .flat_map(|&i| groups[b].iter().map(move |&j| (i, j)))
                    .map(|(i, j)| affinity(i, j))
                    .sum::<f64>()
                    / (groups[a].len() * groups[b].len()) as f64;
                if best.is_none_or(|(l, _, _)| link > l) {
                    best = Some((link, a, b));
                }
            }
        }
        let (_, a, b) = best
            .or(lightest)
            .expect("more than n ≥ 1 groups have a pair");
        let merged = groups.remove(b);
        groups[a].extend(merged);
        groups[a].sort_unstable();
    }
    groups.sort_by_key(|g| g[0]);
    let masses = groups.iter().map(|g| mass(g) / total).collect();
    Ok((groups, masses))
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let d = norm(a) * norm(b);
    if d == 0.0 { 0.0 } else { dot / d }
}

/// Second pass: each layer's mean distinct groups per token (over `source`'s rows if given).
fn count_distinct_groups(
    rows: &mut Rows,
    e: usize,
    source: Option<usize>,
    teacher_of: &[usize],
    layers: &mut [LayerMap],
) -> Result<()> {
    let maps: Vec<Vec<Option<usize>>> = layers.iter().map(|l| l.expert_of(e)).collect();
    let (mut sums, mut tokens) = (vec![0u64; layers.len()], vec![0u64; layers.len()]);
    rows(&mut |row| {
        if source.is_some_and(|s| s != row.source as usize) {
            return;
        }
        for (i, (&t, map)) in teacher_of.iter().zip(&maps).enumerate() {
            let l = &row.routing.layers[t];
            for chosen in l.experts.chunks_exact(l.k) {
                let mut seen: Vec<usize> = chosen.iter().filter_map(|&j| map[j as usize]).collect();
                seen.sort_unstable();
                seen.dedup();
                sums[i] += seen.len() as u64;
                tokens[i] += 1;
            }
        }
    })?;
    for ((l, s), t) in layers.iter_mut().zip(sums).zip(tokens) {
        l.distinct_groups = s as f64 / t.max(1) as f64;
    }
    Ok(())
}
