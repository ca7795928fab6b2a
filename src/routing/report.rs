//! `k3mini routing report`: the statistics ([`super::stats`]) of a scored directory's routing
//! shards as `routing.parquet` (one row per layer × expert, overall and per source), `report.md`
//! and SVG heatmaps beside it: usage per layer, co-selection, and per source the domain profiles.

use super::stats::{LayerStats, RoutingStats};
use crate::error::{Context, Result};
use k3mini_data::routing::{
    ExpertRow, RoutingMeta, RoutingRow, read_routing_shard, write_report_table,
};
use k3mini_eval::plots::heatmap;
use k3mini_teacher::manifest::{MANIFEST, Manifest};
use k3mini_teacher::score::ScoreManifestJob;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Calls `on_row` on every row of every routing shard `teacher score` recorded in `dir` (each
/// verified against the manifest's SHA-256 and against the first one's metadata) and returns that
/// metadata; `on_shard(done, total)` after each shard.
pub fn for_each_row(
    dir: &Path,
    on_row: &mut dyn FnMut(&RoutingMeta, &RoutingRow),
    on_shard: &mut dyn FnMut(usize, usize),
) -> Result<RoutingMeta> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read(&path).with_context(|| path.display().to_string())?;
    let manifest: Manifest<ScoreManifestJob> = serde_json::from_slice(&text)
        .map_err(|e| crate::refused!("{}: not a `teacher score` manifest: {e}", path.display()))?;
    if manifest.job.routing.is_none() {
        return Err(crate::refused!(
            "{}: these shards hold no routing: score with teacher.routing = true",
            dir.display()
        ));
    }
    let total = manifest.shards.len();
    let mut first: Option<RoutingMeta> = None;
    for (i, entry) in manifest.shards.iter().enumerate() {
        let companion = entry.routing.as_ref().ok_or_else(|| {
            crate::refused!(
                "{}: shard {} has no routing shard recorded (rescore it)",
                dir.display(),
                entry.file
            )
        })?;
        let shard = read_routing_shard(&dir.join(&companion.file), Some(&companion.sha256))?;
        let meta = first.get_or_insert_with(|| shard.meta.clone());
        if shard.meta != *meta {
            return Err(crate::refused!(
                "{}: its routing ({:?}) is not the first routing shard's ({:?})",
                companion.file,
                shard.meta,
                meta
            ));
        }
        shard.rows.iter().for_each(|row| on_row(meta, row));
        on_shard(i + 1, total);
    }
    first.ok_or_else(|| crate::refused!("{}: the manifest lists no shards", dir.display()))
}

/// The statistics of every routing shard in `dir` ([`for_each_row`]) and their metadata.
pub fn read_stats(
    dir: &Path,
    on_shard: &mut dyn FnMut(usize, usize),
) -> Result<(RoutingStats, RoutingMeta)> {
    let mut stats: Option<RoutingStats> = None;
    let meta = for_each_row(
        dir,
        &mut |m, row| {
            stats
                .get_or_insert_with(|| RoutingStats::new(&m.shape, m.white_box, m.sources.len()))
                .add(row)
        },
        on_shard,
    )?;
    let stats =
        stats.unwrap_or_else(|| RoutingStats::new(&meta.shape, meta.white_box, meta.sources.len()));
    Ok((stats, meta))
}

/// The table's rows: every layer × expert overall, then per source when `by_source`.
pub fn table(stats: &RoutingStats, meta: &RoutingMeta, by_source: bool) -> Vec<ExpertRow> {
    let rows = |source: Option<&str>, layers: &[LayerStats]| {
        layers
            .iter()
            .flat_map(|l| {
                let (freq, norm, sal) = (l.frequency(), l.mean_norm(), l.saliency());
                let e = l.counts.len();
                (0..e).map(move |j| ExpertRow {
                    source: source.map(str::to_string),
                    layer: l.layer as u32,
                    expert: j as u32,
                    tokens: l.tokens,
                    count: l.counts[j],
                    frequency: freq[j],
                    mean_norm: norm.as_ref().and_then(|n| n[j]),
                    saliency: sal.as_ref().and_then(|s| s[j]),
                    co_selected: l
                        .co_selected
                        .as_ref()
                        .map(|c| c[j * e..(j + 1) * e].to_vec()),
                })
            })
            .collect::<Vec<_>>()
    };
    let mut out = rows(None, &stats.layers);
    if by_source {
        for (name, layers) in meta.sources.iter().zip(&stats.sources) {
            out.extend(rows(Some(name), layers));
        }
    }
    out
}

/// Heatmaps drawn at most: co-selection and profile plots of this many MoE layers (evenly spaced)
/// and of at most this many experts (past that a table of the top pairs stands in).
const PLOTTED_LAYERS: usize = 4;
const PLOTTED_EXPERTS: usize = 128;

/// Up to [`PLOTTED_LAYERS`] of `n` indices, evenly spaced, first and last included.
fn spaced(n: usize) -> Vec<usize> {
    if n <= PLOTTED_LAYERS {
        return (0..n).collect();
    }
    let mut picks: Vec<usize> = (0..PLOTTED_LAYERS)
        .map(|i| i * (n - 1) / (PLOTTED_LAYERS - 1))
        .collect();
    picks.dedup();
    picks
}

/// Writes `routing.parquet`, `report.md` and its SVGs into `out`; returns the report's path.
pub fn write_report(
    stats: &RoutingStats,
    meta: &RoutingMeta,
    by_source: bool,
    out: &Path,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).with_context(|| out.display().to_string())?;
    write_report_table(
        &out.join("routing.parquet"),
        &meta.teacher,
        &table(stats, meta, by_source),
    )?;
    let mut md = String::new();
    summary(stats, meta, &mut md);
    usage(stats, out, &mut md)?;
    if stats.white_box {
        saliency(stats, &mut md);
    }
    co_selection(stats, out, &mut md)?;
    if by_source && !meta.sources.is_empty() {
        sources(stats, meta, out, &mut md)?;
    }
    let path = out.join("report.md");
    k3mini_durable::write(&path, md.as_bytes()).with_context(|| path.display().to_string())?;
    Ok(path)
}

fn plot_err(what: &str, e: Box<dyn std::error::Error>) -> crate::error::Error {
    crate::refused!("plotting {what}: {e}")
}

/// `layer N` for each MoE layer: the heatmaps' and tables' row names.
fn layer_names(stats: &RoutingStats) -> Vec<String> {
    stats
        .layers
        .iter()
        .map(|l| format!("layer {}", l.layer))
        .collect()
}

/// The header and the per-layer table.
fn summary(stats: &RoutingStats, meta: &RoutingMeta, md: &mut String) {
    let (shape, e) = (&stats.shape, stats.shape.experts);
    let tokens = stats.layers.first().map_or(0, |l| l.tokens);
    let _ = writeln!(
        md,
        "# Routing report\n\nTeacher `{}`: {} MoE layers of {} hidden layers, {e} experts, k = {} \
         per token; {tokens} tokens routed per layer, from {} source(s){}.\n",
        meta.teacher,
        shape.moe_layers.len(),
        shape.layers,
        shape.k,
        meta.sources.len(),
        if stats.white_box {
            " (white-box: router weights and expert output norms recorded)"
        } else {
            " (expert ids only, as served engines return them)"
        }
    );
    md.push_str(
        "Experts in use: exp of the entropy of the layer's usage (all experts used evenly: \
         the expert count). Effective experts per token: mean of 1 / Σ ḡ², ḡ the router weights \
         renormalised over the top-k (equal weights: k). Load: the most-used expert's frequency \
         over the least-used one's.\n\n",
    );
    md.push_str(
        "| layer | experts in use | effective experts per token | load max / min | most used (frequency) |\n|---|---|---|---|---|\n",
    );
    for l in &stats.layers {
        let freq = l.frequency();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| freq[b].total_cmp(&freq[a]).then(a.cmp(&b)));
        let top: Vec<String> = order
            .iter()
            .take(3)
            .map(|&j| format!("{j} ({:.3})", freq[j]))
            .collect();
        let (max, min) = (freq[order[0]], freq[order[e - 1]]);
        let _ = writeln!(
            md,
            "| {} | {:.2} of {e} | {} | {} | {} |",
            l.layer,
            l.experts_in_use(),
            l.effective_k()
                .map_or_else(|| "—".into(), |k| format!("{k:.2} of {}", shape.k)),
            if min > 0.0 {
                format!("{:.2}", max / min)
            } else {
                "∞ (an expert never chosen)".into()
            },
            top.join(", ")
        );
    }
}

/// Expert frequency per layer (usage.svg).
fn usage(stats: &RoutingStats, out: &Path, md: &mut String) -> Result<()> {
    let e = stats.shape.experts;
    let usage: Vec<f64> = stats.layers.iter().flat_map(|l| l.frequency()).collect();
    heatmap(
        &out.join("usage.svg"),
        "Expert frequency per layer",
        "expert",
        &layer_names(stats),
        e,
        &usage,
    )
    .map_err(|err| plot_err("usage", err))?;
    md.push_str("\n## Usage\n\n![expert frequency per layer](usage.svg)\n");
    Ok(())
}

/// The lowest-saliency experts per layer (white-box teachers).
fn saliency(stats: &RoutingStats, md: &mut String) {
    md.push_str(
        "\n## REAP saliency\n\nMean over the tokens routed to each expert of ḡ · ‖f(x)‖₂ \
         (`saliency` in routing.parquet): what REAP pruning ranks experts by. \
         Lowest per layer:\n\n| layer | lowest saliency (expert: value) |\n|---|---|\n",
    );
    for l in &stats.layers {
        let sal = l.saliency().expect("white-box");
        let mut order: Vec<(usize, f64)> = sal
            .iter()
            .enumerate()
            .map(|(j, s)| (j, s.unwrap_or(0.0)))
            .collect();
        order.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        let low: Vec<String> = order
            .iter()
            .take(3)
            .map(|(j, s)| format!("{j}: {s:.4}"))
            .collect();
        let _ = writeln!(md, "| {} | {} |", l.layer, low.join(", "));
    }
}

/// Co-selection heatmaps and the pairs chosen together most often, for up to
/// [`PLOTTED_LAYERS`] layers.
fn co_selection(stats: &RoutingStats, out: &Path, md: &mut String) -> Result<()> {
    let e = stats.shape.experts;
    md.push_str("\n## Co-selection\n\nTokens that chose both experts, over the tokens routed.\n");
    for i in spaced(stats.layers.len()) {
        let l = &stats.layers[i];
        let co = l.co_selected.as_ref().expect("kept overall");
        let t = l.tokens.max(1) as f64;
        if e <= PLOTTED_EXPERTS {
            let names: Vec<String> = (0..e).map(|j| format!("expert {j}")).collect();
            let values: Vec<f64> = co.iter().map(|&c| c as f64 / t).collect();
            let file = format!("co-selection-{}.svg", l.layer);
            heatmap(
                &out.join(&file),
                &format!("Co-selection, layer {}", l.layer),
                "expert",
                &names,
                e,
                &values,
            )
            .map_err(|err| plot_err("co-selection", err))?;
            let _ = writeln!(md, "\n![co-selection, layer {}]({file})", l.layer);
        }
        // The pairs chosen together most often against independence: lift = C_ij T / (n_i n_j).
        let mut pairs: Vec<(usize, usize, f64)> = Vec::new();
        for a in 0..e {
            for b in a + 1..e {
                let (na, nb) = (l.counts[a] as f64, l.counts[b] as f64);
                if co[a * e + b] > 0 && na > 0.0 && nb > 0.0 {
                    pairs.push((a, b, co[a * e + b] as f64 * t / (na * nb)));
                }
            }
        }
        pairs.sort_by(|x, y| y.2.total_cmp(&x.2).then((x.0, x.1).cmp(&(y.0, y.1))));
        let top: Vec<String> = pairs
            .iter()
            .take(5)
            .map(|(a, b, lift)| format!("{a}+{b} ({lift:.2}×)"))
            .collect();
        let _ = writeln!(
            md,
            "\nLayer {}: pairs most often chosen together against chance: {}",
            l.layer,
            if top.is_empty() {
                "none".into()
            } else {
                top.join(", ")
            }
        );
    }
    Ok(())
}

/// Per-source specialisation and domain profiles.
fn sources(stats: &RoutingStats, meta: &RoutingMeta, out: &Path, md: &mut String) -> Result<()> {
    let e = stats.shape.experts;
    let names = layer_names(stats);
    md.push_str(
        "\n## Sources\n\nSpecialisation: KL(the source's expert usage ‖ the corpus's), in nats, \
         per layer (0: the source routes like the corpus).\n\n",
    );
    let _ = writeln!(
        md,
        "| source | tokens | {} |\n|---|---|{}",
        names.join(" | "),
        "---|".repeat(names.len())
    );
    for ((name, layers), kl) in meta
        .sources
        .iter()
        .zip(&stats.sources)
        .zip(stats.specialisation())
    {
        let cells: Vec<String> = kl.iter().map(|k| format!("{k:.3}")).collect();
        let _ = writeln!(
            md,
            "| {name} | {} | {} |",
            layers.first().map_or(0, |l| l.tokens),
            cells.join(" | ")
        );
    }
    if e <= PLOTTED_EXPERTS {
        for i in spaced(stats.layers.len()) {
            let layer = stats.layers[i].layer;
            let values: Vec<f64> = stats
                .sources
                .iter()
                .flat_map(|s| s[i].frequency())
                .collect();
            let file = format!("profiles-{layer}.svg");
            heatmap(
                &out.join(&file),
                &format!("Expert frequency per source, layer {layer}"),
                "expert",
                &meta.sources,
                e,
                &values,
            )
            .map_err(|err| plot_err("profiles", err))?;
            let _ = writeln!(md, "\n![domain profiles, layer {layer}]({file})");
        }
    }
    Ok(())
}
