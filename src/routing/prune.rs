//! `k3mini prune`: expert pruning of a MoE model, a k3mini checkpoint or any MoE GGUF, by REAP
//! (Cerebras, arXiv 2510.13999) or by frequency alone.
//!
//! Over calibration tokens (the first `tokens` of a recipe's training split, packed), each MoE
//! layer's experts are scored by the router's own choices ([`super::stats::LayerStats`]):
//!
//! ```text
//! REAP       S_j = mean_{x routed to j} ḡ_j(x) · ‖f_j(x)‖₂     ḡ: router weights renormalised over the top-k
//! frequency  F_j = |{x : j ∈ top-k(x)}| / T
//! ```
//!
//! and the `round(keep · E)` highest-scoring experts of every layer survive (ties to the lower id;
//! an expert no calibration token chose scores 0). A survivor keeps its weights, its router row
//! and its correction bias exactly; experts are renumbered in their old order. A checkpoint is
//! scored by its own forward ([`calibrate_model`]); a GGUF through llama.cpp's graph hooks
//! ([`calibrate_gguf`]), and its expert tensors are sliced byte for byte ([`retain_gguf_experts`]),
//! whatever their quantisation: ggml stores the expert dimension outermost.

use super::stats::LayerStats;
use crate::error::{Context, Result};
use crate::recipe::RunPlan;
use crate::run_dir::{open_checkpoint, write_weights};
use crate::teachers::{open_local, same_tokenizer, student_tokenizer};
use crate::train::batch::packed_tensors;
use crate::train::held_out::HeldOutEval;
use crate::train::modes::held_out;
use k3mini_data::routing::{LayerRouting, Routing};
use k3mini_data::stream::{Split, StreamCursor};
use k3mini_data::{PackedBatch, Packer, Tokenizer};
use k3mini_gguf::writer::GgufWriter;
use k3mini_gguf::{GgufFile, Value};
use k3mini_student::K3Mini;
use k3mini_student::moe::Route;
use k3mini_teacher::local::{Engine, LocalTeacher};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How experts are ranked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// REAP's saliency (needs the router weights and expert output norms: a white-box model).
    Reap,
    /// How often the router chose each expert.
    Frequency,
}

#[derive(Clone, Debug)]
pub struct PruneOptions {
    /// The share of each layer's experts kept, in (0, 1].
    pub keep: f64,
    pub method: Method,
    /// Calibration tokens.
    pub tokens: usize,
}

/// One MoE layer's verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerPrune {
    /// The block's index in the model.
    pub layer: usize,
    /// Every expert's score (REAP saliency or frequency), by old id.
    pub scores: Vec<f64>,
    /// Survivors by old id, ascending: new expert `i` is old expert `kept[i]`.
    pub kept: Vec<usize>,
}

/// What `prune.json` records.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PruneReport {
    /// The checkpoint directory or GGUF file pruned.
    pub source: PathBuf,
    pub method: Method,
    pub keep: f64,
    pub experts_before: usize,
    pub experts_after: usize,
    /// The calibration recipe and the tokens scored.
    pub calibration: PathBuf,
    pub tokens: u64,
    pub layers: Vec<LayerPrune>,
    /// Checkpoints: held-out loss of the calibration recipe's held-out set, before and after.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub held_out_before: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub held_out_after: Option<f64>,
    /// The checkpoint or GGUF written.
    pub out: PathBuf,
}

/// `round(keep · experts)`, refused unless it leaves at least `top_k` experts.
pub fn experts_kept(experts: usize, top_k: usize, keep: f64) -> Result<usize> {
    crate::ensure!(
        keep > 0.0 && keep <= 1.0,
        "--keep {keep}: the share of experts kept must be in (0, 1]"
    );
    let n = (keep * experts as f64).round() as usize;
    crate::ensure!(
        n >= top_k,
        "--keep {keep} leaves {n} of {experts} experts, fewer than the {top_k} each token is \
         routed to: keep at least {:.3}",
        top_k as f64 / experts as f64
    );
    Ok(n)
}

/// How a GGUF's router groups its experts (`{arch}.expert_group_count` groups of consecutive
/// experts, the tokens routed within the `expert_group_used_count` best): llama.cpp reshapes the
/// expert axis into the groups, so a pruned file keeps as many experts in every group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    pub count: usize,
    pub used: usize,
}

impl ExpertGroups {
    /// Ungrouped routing (every checkpoint, and a GGUF without the keys): one group.
    pub const NONE: Self = Self { count: 1, used: 1 };

    /// The groups a GGUF of architecture `arch` declares (one group when it declares none).
    pub fn of_gguf(file: &GgufFile, arch: &str) -> Self {
        let get = |key: &str| {
            file.get(&format!("{arch}.{key}"))
                .and_then(Value::as_u64)
                .map(|v| v as usize)
        };
        match get("expert_group_count").filter(|&g| g > 1) {
            Some(count) => Self {
                count,
                used: get("expert_group_used_count").unwrap_or(0),
            },
            None => Self::NONE,
        }
    }

    /// Refuses keeping `n` of `experts` unless every group keeps as many, llama.cpp's group score
    /// (each group's two best) still has two to take, and the used groups hold the `top_k` each
    /// token is routed to.
    pub fn check(&self, experts: usize, n: usize, top_k: usize) -> Result<()> {
        if self.count == 1 {
            return Ok(());
        }
        let (g, per) = (self.count, n / self.count);
        crate::ensure!(
            experts % g == 0 && n % g == 0,
            "{n} of {experts} experts cannot be kept evenly in the model's {g} expert groups \
             (expert_group_count): keep a multiple of {g}"
        );
        crate::ensure!(
            per >= 2 && self.used * per >= top_k,
            "{n} experts are {per} in each of {g} groups: llama.cpp scores a group by its two best \
             and routes {top_k} per token within {} groups, so keep at least {} experts",
            self.used,
            g * 2.max(top_k.div_ceil(self.used.max(1)))
        );
        Ok(())
    }
}

/// The `n` best experts of one layer by `method`, ascending (pure): the best `n / groups.count`
/// of each group, so a grouped router's groups keep their members.
pub fn survivors(
    stats: &LayerStats,
    n: usize,
    method: Method,
    groups: ExpertGroups,
) -> Result<LayerPrune> {
    let scores: Vec<f64> = match method {
        Method::Frequency => stats.frequency(),
        Method::Reap => stats
            .saliency()
            .with_context(|| {
                "REAP needs each expert's router weights and output norms, which this model's \
                 calibration did not record (use --method frequency)"
                    .to_string()
            })?
            .into_iter()
            .map(|s| s.unwrap_or(0.0))
            .collect(),
    };
    let per_group = scores.len() / groups.count;
    let mut kept = Vec::with_capacity(n);
    for g in 0..groups.count {
        let mut order: Vec<usize> = (g * per_group..(g + 1) * per_group).collect();
        // Stable: equal scores keep the lower id first.
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
        kept.extend_from_slice(&order[..(n / groups.count).min(order.len())]);
    }
    kept.sort_unstable();
    Ok(LayerPrune {
        layer: stats.layer,
        scores,
        kept,
    })
}

/// The calibration tokens: the first `tokens` of `plan`'s training split, packed into rows of
/// `data.seq_len` (whatever the recipe's packing), `train.micro_batch` rows per batch.
pub fn calibration_batches(
    plan: &RunPlan,
    tokenizer: &Tokenizer,
    tokens: usize,
) -> Result<Vec<PackedBatch>> {
    let data = &plan.data;
    let stream = crate::corpus::document_stream(
        data,
        tokenizer,
        plan.seed,
        Split::Train,
        StreamCursor::default(),
    )?;
    let mut packer = Packer::new(stream, data.seq_len, true, 0, 0)?;
    let rows = tokens.div_ceil(data.seq_len).max(1);
    let per_batch = plan.train.micro_batch;
    (0..rows.div_ceil(per_batch))
        .map(|i| Ok(packer.next_batch(per_batch.min(rows - i * per_batch))?))
        .collect()
}

/// The positions of a packed row that calibration counts: each document's tokens but its last
/// (and the row's last), the ones a scoring pass feeds: `t + 1 < T` and `t + 1` not a start.
fn counted(starts: &[f32]) -> impl Iterator<Item = usize> + '_ {
    (0..starts.len().saturating_sub(1)).filter(|&t| starts[t + 1] == 0.0)
}

/// One forward's routes as layer routings, over the positions `keep` lists (flat `[B·T]` indices).
fn routed(route: &Route, keep: &[usize]) -> LayerRouting {
    let k = route.k;
    let values = |t: &burn::tensor::Tensor<2>| -> Vec<f32> {
        let all = t
            .to_data()
            .try_into_vec::<f32>()
            .expect("f32 routing values");
        keep.iter()
            .flat_map(|&p| all[p * k..(p + 1) * k].to_vec())
            .collect()
    };
    LayerRouting {
        layer: route.layer,
        k,
        experts: keep
            .iter()
            .flat_map(|&p| route.experts[p * k..(p + 1) * k].to_vec())
            .collect(),
        weights: Some(values(&route.weights)),
        norms: Some(values(&route.norms)),
    }
}

/// Per MoE layer, the statistics of `model`'s own routing over `batches` (REAP's white-box sums
/// included); `on_batch(done, total)` after each.
pub fn calibrate_model(
    model: &K3Mini,
    batches: &[PackedBatch],
    on_batch: &mut dyn FnMut(usize, usize),
) -> Vec<LayerStats> {
    let inference = burn::module::Module::valid(model);
    let device = model.lm_head.weight.device().without_autodiff();
    let mut stats: Vec<LayerStats> = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        let (tokens, starts, _) = packed_tensors(b, &device);
        let out = inference.forward_packed(tokens, starts);
        let keep: Vec<usize> = b
            .starts
            .chunks_exact(b.seq_len)
            .enumerate()
            .flat_map(|(r, row)| counted(row).map(move |t| r * b.seq_len + t))
            .collect();
        for (j, route) in out.routing.iter().enumerate() {
            let experts = route.scores.dims()[1];
            if stats.len() == j {
                stats.push(LayerStats::new(route.layer, experts, true, false));
            }
            stats[j].add(&routed(route, &keep));
        }
        on_batch(i + 1, batches.len());
    }
    stats
}

/// Per MoE layer, the statistics of a llama.cpp teacher's routing (recording: see
/// [`LocalTeacher::record_routing`]) over `batches`, each packed row split into its documents.
pub fn calibrate_gguf(
    teacher: &LocalTeacher,
    batches: &[PackedBatch],
    on_batch: &mut dyn FnMut(usize, usize),
) -> Result<Vec<LayerStats>> {
    let shape = teacher
        .routing_shape()
        .context("a dense model has no experts to prune")?
        .clone();
    let mut stats: Vec<LayerStats> = shape
        .moe_layers
        .iter()
        .map(|&l| LayerStats::new(l, shape.experts, true, false))
        .collect();
    for (i, b) in batches.iter().enumerate() {
        for (tokens, starts) in b
            .tokens
            .chunks_exact(b.seq_len)
            .zip(b.starts.chunks_exact(b.seq_len))
        {
            let mut begin = 0;
            for end in (1..=tokens.len()).filter(|&t| t == tokens.len() || starts[t] == 1.0) {
                let ids: Vec<u32> = tokens[begin..end].iter().map(|&t| t as u32).collect();
                begin = end;
                if ids.len() < 2 {
                    continue;
                }
                let ran = teacher.run(&ids, Some(1), None, Default::default())?;
                let routing: Routing = ran
                    .routing
                    .context("the teacher was not recording its routing")?;
                for (s, l) in stats.iter_mut().zip(&routing.layers) {
                    s.add(l);
                }
            }
        }
        on_batch(i + 1, batches.len());
    }
    Ok(stats)
}

fn verdicts(
    stats: &[LayerStats],
    n: usize,
    method: Method,
    groups: ExpertGroups,
) -> Result<Vec<LayerPrune>> {
    stats
        .iter()
        .map(|s| survivors(s, n, method, groups))
        .collect()
}

fn write_report(report: &PruneReport, path: &Path) -> Result<()> {
    let json = serde_json::to_vec_pretty(report)?;
    k3mini_durable::write(path, &json).with_context(|| path.display().to_string())
}

/// Prunes a checkpoint (or a run's newest) into a new run directory `out` holding one checkpoint
/// of the same step (weights and plan; the plan named for `out`, its `moe.num_experts` changed: it
/// evaluates, exports, and trains through `[model] init`) and `prune.json`. Held-out loss is
/// measured on the calibration recipe's held-out set before and after.
pub fn prune_checkpoint(
    path: &Path,
    calibration: &RunPlan,
    opts: &PruneOptions,
    out: &Path,
    on_batch: &mut dyn FnMut(usize, usize),
) -> Result<PruneReport> {
    let ck = open_checkpoint(path)?;
    let moe = ck.plan.model.moe.as_ref().with_context(|| {
        format!(
            "{}: a dense model has no experts to prune",
            ck.dir.display()
        )
    })?;
    let n = experts_kept(moe.num_experts, moe.top_k, opts.keep)?;
    crate::ensure!(
        k3mini_checkpoints::latest(out)?.is_none(),
        "{} already holds checkpoints: choose another --out",
        out.display()
    );
    let device = ck.plan.devices.open_main()?;
    let model = ck.model(&device)?;
    let tokenizer = same_tokenizer(calibration, &student_tokenizer(&ck.plan.data.tokenizer)?)?;
    let batches = calibration_batches(calibration, &tokenizer, opts.tokens)?;
    // Read first: a held-out set that cannot be read (shards not scored yet) stops it early.
    let held = held_out(calibration, &tokenizer, calibration.train.eval_batches)?;
    let stats = calibrate_model(&model, &batches, on_batch);
    let layers = verdicts(&stats, n, opts.method, ExpertGroups::NONE)?;
    let kept: Vec<Vec<usize>> = layers.iter().map(|l| l.kept.clone()).collect();
    let pruned = model
        .retain_experts(&kept)
        .map_err(|e| crate::refused!("{}: {e}", ck.dir.display()))?;
    let loss = |m: &K3Mini| held.evaluate(m).map(|h: HeldOutEval| h.loss);
    let mut plan = ck.plan.clone();
    plan.model = pruned.config.clone();
    plan.out_dir = std::path::absolute(out).with_context(|| out.display().to_string())?;
    if let Some(name) = plan.out_dir.file_name() {
        plan.name = name.to_string_lossy().into_owned();
    }
    let written = write_weights(&plan, &pruned, ck.step)?;
    let report = PruneReport {
        source: ck.dir.clone(),
        method: opts.method,
        keep: opts.keep,
        experts_before: moe.num_experts,
        experts_after: n,
        calibration: calibration.recipe.clone(),
        tokens: stats.first().map_or(0, |s| s.tokens),
        layers,
        held_out_before: loss(&model),
        held_out_after: loss(&pruned),
        out: written,
    };
    write_report(&report, &out.join("prune.json"))?;
    Ok(report)
}

/// Prunes a MoE GGUF into `out` (and `out` with extension `prune.json`), scored by llama.cpp on
/// `devices`' main device through its graph hooks.
pub fn prune_gguf(
    path: &Path,
    calibration: &RunPlan,
    opts: &PruneOptions,
    out: &Path,
    on_batch: &mut dyn FnMut(usize, usize),
) -> Result<PruneReport> {
    let teacher = open_local(path, Engine::LlamaCpp, &calibration.devices)?;
    let shape = teacher
        .routing_shape()
        .with_context(|| format!("{}: a dense model has no experts to prune", path.display()))?
        .clone();
    let n = experts_kept(shape.experts, shape.k, opts.keep)?;
    let file = GgufFile::open(path)?;
    let arch = architecture(&file)?;
    let groups = ExpertGroups::of_gguf(&file, &arch);
    groups.check(shape.experts, n, shape.k)?;
    let tokenizer = same_tokenizer(calibration, &teacher.tokenizer)?;
    let batches = calibration_batches(calibration, &tokenizer, opts.tokens)?;
    let teacher = teacher.record_routing()?;
    let stats = calibrate_gguf(&teacher, &batches, on_batch)?;
    drop(teacher);
    let layers = verdicts(&stats, n, opts.method, groups)?;
    let kept: BTreeMap<usize, Vec<usize>> =
        layers.iter().map(|l| (l.layer, l.kept.clone())).collect();
    retain_gguf_experts(&file, &kept, out)?;
    let report = PruneReport {
        source: path.to_path_buf(),
        method: opts.method,
        keep: opts.keep,
        experts_before: shape.experts,
        experts_after: n,
        calibration: calibration.recipe.clone(),
        tokens: stats.first().map_or(0, |s| s.tokens),
        layers,
        held_out_before: None,
        held_out_after: None,
        out: out.to_path_buf(),
    };
    write_report(&report, &out.with_extension("prune.json"))?;
    Ok(report)
}

/// A GGUF's `general.architecture`, the prefix of its model keys.
fn architecture(file: &GgufFile) -> Result<String> {
    file.get("general.architecture")
        .and_then(Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("{}: no general.architecture", file.path.display()))
}

/// Whether a GGUF tensor of block `blk.N.` holds one slice per routed expert, outermost: the
/// experts' weights (`ffn_{gate,up,down,gate_up}_exps` and their biases), the router
/// (`ffn_gate_inp`) and its correction bias (`exp_probs_b`). Shared experts (`_shexp`) do not.
fn per_expert(tensor: &str) -> bool {
    tensor.contains("_exps.")
        || tensor.starts_with("ffn_gate_inp.")
        || tensor.starts_with("exp_probs_b.")
}

/// Writes `file` with, at each block `layer` of `keep`, only the experts `keep[layer]`
/// (ascending): each per-expert tensor's survivors' bytes copied in order, every other tensor and
/// metadata value as it was but `{arch}.expert_count`, read from `file` as the writer reaches
/// each tensor (one at a time in memory). Returns the bytes written.
pub fn retain_gguf_experts(
    file: &GgufFile,
    keep: &BTreeMap<usize, Vec<usize>>,
    out: &Path,
) -> Result<u64> {
    let name = file.path.display().to_string();
    let arch = architecture(file)?;
    let count_key = format!("{arch}.expert_count");
    let experts =
        file.get(&count_key)
            .and_then(Value::as_u64)
            .with_context(|| format!("{name}: no {count_key}: not a MoE model"))? as usize;
    let n = keep.values().next().map_or(0, Vec::len);
    for (layer, k) in keep {
        crate::ensure!(
            k.len() == n && k.windows(2).all(|w| w[0] < w[1]) && k.iter().all(|&e| e < experts),
            "block {layer}: keep {n} distinct ascending experts of {experts} at every block, not {k:?}"
        );
    }
    let used = file
        .get(&format!("{arch}.expert_used_count"))
        .and_then(Value::as_u64)
        .unwrap_or(1) as usize;
    crate::ensure!(
        n >= used,
        "{n} experts cannot serve {used} per token ({arch}.expert_used_count)"
    );
    // The group keys are copied unchanged: every group keeps its members, as many in each.
    let groups = ExpertGroups::of_gguf(file, &arch);
    groups.check(experts, n, used)?;
    let per_group = experts / groups.count;
    for (layer, k) in keep {
        for g in 0..groups.count {
            let members = k.iter().filter(|&&e| e / per_group == g).count();
            crate::ensure!(
                members == n / groups.count,
                "block {layer}: keeps {members} experts of group {g} (experts {}..{}); each of the \
                 {} groups must keep {}",
                g * per_group,
                (g + 1) * per_group,
                groups.count,
                n / groups.count
            );
        }
    }
    let mut w = GgufWriter::new();
    for key in &file.keys {
        w.set(key, file.metadata[key].clone());
    }
    w.set(&count_key, Value::U32(n as u32));
    let mut sliced = std::collections::BTreeSet::new();
    // Every tensor is read when the writer reaches it, the survivors' slices alone: pruning holds
    // one tensor at a time, so a GGUF larger than memory prunes.
    for info in &file.tensors {
        let block = info
            .name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(i, t)| Some((i.parse::<usize>().ok()?, t)));
        match block {
            Some((layer, tensor)) if per_expert(tensor) => {
                let k = keep.get(&layer).with_context(|| {
                    format!(
                        "{name}: {} is per expert but block {layer} has no survivors listed",
                        info.name
                    )
                })?;
                crate::ensure!(
                    info.dims.last() == Some(&(experts as u64)),
                    "{name}: {} has dims {:?}, not one slice per each of {experts} experts outermost",
                    info.name,
                    info.dims
                );
                let slice = info.bytes() / experts as u64;
                let mut ne = info.dims.clone();
                *ne.last_mut().expect("dims") = n as u64;
                sliced.insert(layer);
                w.add_tensor_with(&info.name, &ne, info.ty, move || {
                    let mut data = Vec::with_capacity((slice * k.len() as u64) as usize);
                    for &e in k {
                        data.extend(file.raw_range(info, e as u64 * slice, slice)?);
                    }
                    Ok(data)
                })?;
            }
            _ => w.add_tensor_with(&info.name, &info.dims, info.ty, || file.raw(info))?,
        }
    }
    if let Some(layer) = keep.keys().find(|l| !sliced.contains(l)) {
        crate::bail!("{name}: block {layer} holds no routed experts");
    }
    Ok(w.write(out)?)
}
