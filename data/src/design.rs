//! `design.json`: a MoE student's map onto its teacher's experts, and the recipe fragment beside
//! it. `k3mini routing design` makes one from the teacher's harvested routing; `router_kl` reads
//! it back. Here, below both, so a recipe's plan can read one without depending on the command.

use crate::error::DataError;
use crate::routing::{LayerRouting, RoutingShape};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The design: written as `design.json` (read back by `router_kl`) and as a recipe fragment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Design {
    pub teacher: String,
    pub teacher_shape: RoutingShape,
    pub domain: Option<String>,
    /// Tokens per teacher layer the statistics came from.
    pub tokens: u64,
    pub n_layers: usize,
    pub first_dense_layers: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// One per student MoE layer, in order.
    pub layers: Vec<LayerMap>,
}

/// One student MoE layer's teacher layer and groups.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerMap {
    pub student_layer: usize,
    pub teacher_layer: usize,
    /// Per student expert, the teacher experts it stands for, ascending.
    pub groups: Vec<Vec<usize>>,
    /// Per student expert, its groups' share of the teacher layer's routing (`Σ` = 1).
    pub mass: Vec<f64>,
    /// Mean distinct groups per token.
    pub distinct_groups: f64,
}

impl Design {
    /// The recipe fragment: `[model]`'s depth and `[model.moe]`'s routing choices.
    pub fn fragment(&self, shards: &Path) -> String {
        let s = &self.teacher_shape;
        format!(
            "# k3mini routing design {} --experts {}{}\n\
             # from {}'s routing over {} tokens per layer: {} MoE layers of {} experts, top-{}.\n\
             # Teacher-group -> student-expert map: design.json beside this file.\n\
             [model]\n\
             n_layers = {}\n\n\
             [model.moe]\n\
             num_experts = {}\n\
             top_k = {}\n\
             first_dense_layers = {}\n\
             # The student's width is yours to set: num_shared_experts, expert_hidden.\n",
            shards.display(),
            self.num_experts,
            self.domain
                .as_ref()
                .map_or(String::new(), |d| format!(" --domain {d}")),
            self.teacher,
            self.tokens,
            s.moe_layers.len(),
            s.experts,
            s.k,
            self.n_layers,
            self.num_experts,
            self.top_k,
            self.first_dense_layers,
        )
    }

    /// Writes `design.json` and `moe.toml` into `out` (atomically); returns their paths.
    pub fn write(&self, shards: &Path, out: &Path) -> Result<(PathBuf, PathBuf), DataError> {
        std::fs::create_dir_all(out).map_err(|e| DataError::io(out, e))?;
        let json = serde_json::to_string_pretty(self).expect("a design serialises");
        let (map, toml) = (out.join("design.json"), out.join("moe.toml"));
        for (path, bytes) in [(&map, json), (&toml, self.fragment(shards))] {
            k3mini_durable::write(path, bytes.as_bytes()).map_err(|e| DataError::io(path, e))?;
        }
        Ok((map, toml))
    }

    /// Reads a `design.json` back, refusing one whose groups are not a partition of some of the
    /// teacher's experts into `num_experts` groups per layer.
    pub fn read(path: &Path) -> Result<Self, DataError> {
        let text = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        let d: Design = serde_json::from_slice(&text)
            .map_err(|e| DataError::io(path, format!("not a routing design: {e}")))?;
        let e = d.teacher_shape.experts;
        for l in &d.layers {
            let mut seen = vec![false; e];
            let bad = l.groups.len() != d.num_experts
                || !d.teacher_shape.moe_layers.contains(&l.teacher_layer)
                || l.groups.iter().any(|g| {
                    g.is_empty()
                        || g.iter()
                            .any(|&j| j >= e || std::mem::replace(&mut seen[j], true))
                });
            if bad {
                return Err(DataError::io(
                    path,
                    format!(
                        "student layer {}'s groups are not {} disjoint sets of teacher layer {}'s {e} experts",
                        l.student_layer, d.num_experts, l.teacher_layer
                    ),
                ));
            }
        }
        Ok(d)
    }
}

impl LayerMap {
    /// Per teacher expert, its student expert (None: left out).
    pub fn expert_of(&self, teacher_experts: usize) -> Vec<Option<usize>> {
        let mut of = vec![None; teacher_experts];
        for (g, members) in self.groups.iter().enumerate() {
            for &j in members {
                of[j] = Some(g);
            }
        }
        of
    }

    /// The teacher's routing mass on the student's experts for one sequence's tokens: each chosen
    /// teacher expert's weight renormalised over the top-k (white-box teachers) or `1/k` (ids
    /// only), summed into its student expert and renormalised over the experts the map keeps.
    /// Fills `target [tokens, N]` and sets `mask [tokens]` to 1 where some mass was kept;
    /// `expert_of` is [`Self::expert_of`].
    pub fn target(
        &self,
        teacher: &LayerRouting,
        expert_of: &[Option<usize>],
        target: &mut [f32],
        mask: &mut [f32],
    ) {
        let (k, n) = (teacher.k, self.groups.len());
        for (t, chosen) in teacher.experts.chunks_exact(k).enumerate() {
            let w = |i: usize| match &teacher.weights {
                Some(w) => {
                    let row = &w[t * k..(t + 1) * k];
                    row[i] as f64 / row.iter().map(|&x| x as f64).sum::<f64>()
                }
                None => 1.0 / k as f64,
            };
            let mut mass = vec![0f64; n];
            for (i, &j) in chosen.iter().enumerate() {
                if let Some(g) = expert_of[j as usize] {
                    mass[g] += w(i);
                }
            }
            let kept: f64 = mass.iter().sum();
            if kept > 0.0 {
                for (g, m) in mass.iter().enumerate() {
                    target[t * n + g] = (m / kept) as f32;
                }
                mask[t] = 1.0;
            }
        }
    }
}
