//! A MoE teacher's routing, token by token, and the routing shards `teacher score` writes beside
//! its teacher-signal shards. This is the one description of their schema.
//!
//! **Routing shards** (`routing-NNNNN.parquet`, kind `teacher-routing`, schema version 1): one row
//! per scored segment, in the order of the signal shard of the same number, the routing of the
//! segment's first `n − 1` ids (position `t`'s token `ids[t]`, the one its distribution
//! conditions on last):
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `doc_id` | int64 | the signal shard row's `doc_id` |
//! | `segment` | int32 | the signal shard row's `segment` |
//! | `source` | int32 | which corpus source (domain) the document comes from: an index into `k3mini.sources` |
//! | `tokens` | int32 | tokens routed (`n − 1`) |
//! | `experts` | list<int32> | `[moe layers, tokens, k]`: each MoE layer's chosen experts, best first (Parquet's dictionary pages bit-pack them to `⌈log2 experts⌉` bits) |
//! | `weights` | list<float32>, white-box only | `[moe layers, tokens, k]`: the weight each chosen expert's output was mixed with |
//! | `norms` | list<float32>, white-box only | `[moe layers, tokens, k]`: the L2 norm of each chosen expert's output |
//!
//! File metadata: `k3mini.kind`, `k3mini.schema_version`, `k3mini.teacher`, `k3mini.sources` (the
//! corpus's sources by name, a JSON list), and the teacher's
//! routing: `k3mini.layers` (hidden layers), `k3mini.k`, `k3mini.experts`, `k3mini.moe_layers`
//! (comma-separated), `k3mini.white_box` (`true` when weights and norms are stored).
//!
//! Reading verifies the file's SHA-256 when the caller has the manifest's, kind and version, column
//! types, and every row against the metadata's routing ([`Routing::check`]).

use crate::error::DataError;
use crate::parquet_io::{
    Col, Opened, column, f32s, file_err, float_lists, int_lists, segment_columns, u32s,
    write_parquet,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{ArrayRef, Int32Array, Int64Array, RecordBatch};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

/// What a teacher's configuration says its routing is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingShape {
    /// Hidden layers: the length of a served payload's layer axis.
    pub layers: usize,
    /// Experts per token.
    pub k: usize,
    /// Routed experts per MoE layer.
    pub experts: usize,
    /// The MoE layers, ascending: the rows that mean something.
    pub moe_layers: Vec<usize>,
}

impl RoutingShape {
    /// Why it cannot be a model's routing, if it cannot.
    pub fn invalid(&self) -> Option<String> {
        if self.experts == 0 || self.k == 0 || self.k > self.experts {
            return Some(format!("k = {} of {} experts", self.k, self.experts));
        }
        if self.moe_layers.is_empty() {
            return Some("no MoE layers".into());
        }
        if !self.moe_layers.windows(2).all(|w| w[0] < w[1]) {
            return Some(format!(
                "MoE layers {:?} are not ascending",
                self.moe_layers
            ));
        }
        match self.moe_layers.last() {
            Some(&l) if l >= self.layers => Some(format!(
                "MoE layer {l} of a model with {} layers",
                self.layers
            )),
            _ => None,
        }
    }
}

/// One sequence's routing.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// The routed layers, by layer index.
    pub layers: Vec<LayerRouting>,
}

/// One layer's routing of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRouting {
    /// The block's index in the model.
    pub layer: usize,
    /// Experts per token.
    pub k: usize,
    /// `[tokens, k]` row-major: the chosen experts, in the router's order (best first).
    pub experts: Vec<u32>,
    /// `[tokens, k]`: the weight each chosen expert's output is multiplied by (white-box teachers
    /// only: servers return ids).
    pub weights: Option<Vec<f32>>,
    /// `[tokens, k]`: the L2 norm of each chosen expert's output before its weight (REAP's
    /// ‖f_j(x)‖₂; where a graph weights the experts' inputs instead, as Llama 4's does, the
    /// output of the weighted input). White-box teachers only.
    pub norms: Option<Vec<f32>>,
}

impl LayerRouting {
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.k.max(1)
    }
}

impl Routing {
    /// Tokens routed (those of the first layer: [`Routing::check`] makes every layer agree).
    pub fn tokens(&self) -> usize {
        self.layers.first().map_or(0, LayerRouting::tokens)
    }

    /// Whether it carries weights and output norms (a white-box teacher's).
    pub fn white_box(&self) -> bool {
        self.layers.iter().all(|l| l.weights.is_some())
    }

    /// Its tokens from `start` on.
    pub fn from_token(&self, start: usize) -> Self {
        self.tokens_in(start..usize::MAX)
    }

    /// Its first `end` tokens.
    pub fn until_token(&self, end: usize) -> Self {
        self.tokens_in(0..end)
    }

    /// Its tokens in `range` (cut to those it has).
    fn tokens_in(&self, range: std::ops::Range<usize>) -> Self {
        let cut = |v: &[f32], k: usize| {
            let end = range.end.saturating_mul(k).min(v.len());
            v[range.start.saturating_mul(k).min(end)..end].to_vec()
        };
        Self {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    let end = range.end.saturating_mul(l.k).min(l.experts.len());
                    LayerRouting {
                        layer: l.layer,
                        k: l.k,
                        experts: l.experts[range.start.saturating_mul(l.k).min(end)..end].to_vec(),
                        weights: l.weights.as_deref().map(|w| cut(w, l.k)),
                        norms: l.norms.as_deref().map(|n| cut(n, l.k)),
                    }
                })
                .collect(),
        }
    }

    /// Appends `next`'s tokens (a later window of the same sequence, routed alike).
    pub fn extend(&mut self, next: Routing) {
        debug_assert_eq!(self.layers.len(), next.layers.len());
        for (l, n) in self.layers.iter_mut().zip(next.layers) {
            l.experts.extend(n.experts);
            if let (Some(w), Some(nw)) = (&mut l.weights, n.weights) {
                w.extend(nw);
            }
            if let (Some(o), Some(no)) = (&mut l.norms, n.norms) {
                o.extend(no);
            }
        }
    }

    /// Checks it against the teacher's `shape` for `tokens` tokens: exactly its MoE layers, each
    /// of `k` experts per token out of its experts, weights and norms (where present) finite and
    /// one per choice, norms non-negative.
    pub fn check(&self, tokens: usize, shape: &RoutingShape) -> Result<(), String> {
        let layers: Vec<usize> = self.layers.iter().map(|l| l.layer).collect();
        if layers != shape.moe_layers {
            return Err(format!(
                "routing of layers {layers:?} where the teacher's MoE layers are {:?}",
                shape.moe_layers
            ));
        }
        let white = self.layers.first().is_some_and(|l| l.weights.is_some());
        for l in &self.layers {
            let n = tokens * shape.k;
            if l.k != shape.k || l.experts.len() != n {
                return Err(format!(
                    "layer {}: {} experts at k = {} for {tokens} tokens at the teacher's k = {}",
                    l.layer,
                    l.experts.len(),
                    l.k,
                    shape.k
                ));
            }
            if let Some((i, &e)) = l
                .experts
                .iter()
                .enumerate()
                .find(|&(_, &e)| e as usize >= shape.experts)
            {
                return Err(format!(
                    "layer {}, token {}: expert {e} of a teacher with {} experts",
                    l.layer,
                    i / shape.k,
                    shape.experts
                ));
            }
            for (what, v, min) in [
                ("weights", &l.weights, f32::NEG_INFINITY),
                ("output norms", &l.norms, 0.0),
            ] {
                match v {
                    Some(v) if v.len() != n => {
                        return Err(format!(
                            "layer {}: {} {what} for {n} choices",
                            l.layer,
                            v.len()
                        ));
                    }
                    Some(v) if v.iter().any(|x| !x.is_finite() || *x < min) => {
                        return Err(format!("layer {}: {what} not finite or negative", l.layer));
                    }
                    Some(_) if !white => {
                        return Err(format!(
                            "layer {}: {what} where layer {} has none",
                            l.layer, layers[0]
                        ));
                    }
                    None if white => {
                        return Err(format!(
                            "layer {}: no {what} where layer {} has them",
                            l.layer, layers[0]
                        ));
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// What `k3mini.kind` says of a routing shard.
pub const KIND: &str = "teacher-routing";
pub const SCHEMA_VERSION: u32 = 1;
const WHAT: &str = "routing shard";

/// Whose routing a shard holds, and what it is.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingMeta {
    pub teacher: String,
    /// The scored corpus's sources by name, in its order (what `source` indexes).
    pub sources: Vec<String>,
    pub shape: RoutingShape,
    /// Router weights and expert output norms are stored (a white-box teacher's).
    pub white_box: bool,
}

/// One scored segment's routing.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingRow {
    pub doc_id: u64,
    pub segment: u32,
    /// Its document's source, an index into [`RoutingMeta::sources`].
    pub source: u32,
    pub routing: Routing,
}

/// A routing shard as read.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingShard {
    pub meta: RoutingMeta,
    pub rows: Vec<RoutingRow>,
}

/// Each row's layers' values of one kind, concatenated layer after layer.
fn layer_major<T: Copy>(r: &Routing, values: impl Fn(&LayerRouting) -> &[T]) -> Vec<T> {
    r.layers
        .iter()
        .flat_map(|l| values(l).iter().copied())
        .collect()
}

/// Writes `rows` atomically to `path` (each checked against `meta` first: a row that does not
/// fit is an error and nothing is written). Returns the bytes written.
pub fn write_routing_shard(
    path: &Path,
    meta: &RoutingMeta,
    rows: &[RoutingRow],
) -> Result<u64, DataError> {
    for (i, row) in rows.iter().enumerate() {
        if row.source as usize >= meta.sources.len() {
            return Err(file_err(
                path,
                WHAT,
                format!(
                    "row {i}: source {} of {} sources",
                    row.source,
                    meta.sources.len()
                ),
            ));
        }
        row.routing
            .check(row.routing.tokens(), &meta.shape)
            .and_then(|()| match row.routing.white_box() == meta.white_box {
                true => Ok(()),
                false => Err(format!(
                    "white-box routing {} in a shard of white_box = {}",
                    !meta.white_box, meta.white_box
                )),
            })
            .map_err(|m| file_err(path, WHAT, format!("row {i}: {m}")))?;
    }
    let lists = |f: &dyn Fn(&LayerRouting) -> &[f32]| {
        let v: Vec<Vec<f32>> = rows.iter().map(|r| layer_major(&r.routing, f)).collect();
        float_lists(v.iter().map(Vec::as_slice))
    };
    let experts: Vec<Vec<u32>> = rows
        .iter()
        .map(|r| layer_major(&r.routing, |l| &l.experts))
        .collect();
    let mut columns: Vec<(&str, ArrayRef)> =
        segment_columns(rows.iter().map(|r| (r.doc_id, r.segment))).into();
    let int32 = |v: Vec<i32>| -> ArrayRef { Arc::new(Int32Array::from(v)) };
    columns.extend([
        (
            "source",
            int32(rows.iter().map(|r| r.source as i32).collect()),
        ),
        (
            "tokens",
            int32(rows.iter().map(|r| r.routing.tokens() as i32).collect()),
        ),
        ("experts", int_lists(experts.iter().map(Vec::as_slice))),
    ]);
    if meta.white_box {
        columns.push((
            "weights",
            lists(&|l| l.weights.as_deref().unwrap_or_default()),
        ));
        columns.push(("norms", lists(&|l| l.norms.as_deref().unwrap_or_default())));
    }
    let batch = RecordBatch::try_from_iter(columns).map_err(|e| file_err(path, WHAT, e))?;
    let s = &meta.shape;
    let layers: Vec<String> = s.moe_layers.iter().map(usize::to_string).collect();
    let pairs = [
        ("kind", KIND.to_string()),
        ("schema_version", SCHEMA_VERSION.to_string()),
        ("teacher", meta.teacher.clone()),
        (
            "sources",
            serde_json::to_string(&meta.sources).expect("strings serialise"),
        ),
        ("layers", s.layers.to_string()),
        ("k", s.k.to_string()),
        ("experts", s.experts.to_string()),
        ("moe_layers", layers.join(",")),
        ("white_box", meta.white_box.to_string()),
    ];
    write_parquet(
        path,
        WHAT,
        &batch,
        &pairs,
        &[
            &["weights", "list", "element"],
            &["norms", "list", "element"],
        ],
        &[],
    )
}

/// Reads and verifies a routing shard: its checksum when `sha256` is given (the manifest's),
/// kind, version, metadata, column types, and every row against the routing its metadata states.
pub fn read_routing_shard(path: &Path, sha256: Option<&str>) -> Result<RoutingShard, DataError> {
    let (opened, _) = Opened::open_versioned(path, WHAT, KIND, None, &[SCHEMA_VERSION], sha256)?;
    let moe_layers = opened
        .get(path, WHAT, "moe_layers")?
        .split(',')
        .map(|l| l.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, WHAT, format!("k3mini.moe_layers: {e}")))?;
    let shape = RoutingShape {
        layers: opened.parse(path, WHAT, "layers")?,
        k: opened.parse(path, WHAT, "k")?,
        experts: opened.parse(path, WHAT, "experts")?,
        moe_layers,
    };
    if let Some(why) = shape.invalid() {
        return Err(file_err(
            path,
            WHAT,
            format!("its metadata's routing: {why}"),
        ));
    }
    let sources: Vec<String> = serde_json::from_str(opened.get(path, WHAT, "sources")?)
        .map_err(|e| file_err(path, WHAT, format!("k3mini.sources: {e}")))?;
    let meta = RoutingMeta {
        teacher: opened.get(path, WHAT, "teacher")?.into(),
        sources,
        white_box: opened.parse(path, WHAT, "white_box")?,
        shape,
    };
    let mut columns = vec![
        ("doc_id", Col::Int64),
        ("segment", Col::Int32),
        ("source", Col::Int32),
        ("tokens", Col::Int32),
        ("experts", Col::IntList),
    ];
    if meta.white_box {
        columns.extend([("weights", Col::FloatList), ("norms", Col::FloatList)]);
    }
    opened
        .check_columns(&columns)
        .map_err(|m| file_err(path, WHAT, m))?;
    let (k, n_layers) = (meta.shape.k, meta.shape.moe_layers.len());
    let mut rows = Vec::new();
    for batch in opened.batches(path, WHAT)? {
        let doc = column(&batch, "doc_id").as_primitive::<Int64Type>();
        let seg = column(&batch, "segment").as_primitive::<Int32Type>();
        let tokens = column(&batch, "tokens").as_primitive::<Int32Type>();
        let source = column(&batch, "source").as_primitive::<Int32Type>();
        for i in 0..batch.num_rows() {
            let row = rows.len();
            let bad = |message: String| DataError::Row {
                path: path.to_path_buf(),
                row,
                message,
            };
            let t = usize::try_from(tokens.value(i))
                .map_err(|_| bad(format!("tokens {} is negative", tokens.value(i))))?;
            let per_layer = t * k;
            let split = |what: &str, n: usize| {
                if n != per_layer * n_layers {
                    return Err(bad(format!(
                        "column {what}: {n} values for {t} tokens × {n_layers} MoE layers × k = {k}"
                    )));
                }
                Ok(())
            };
            let experts = u32s(column(&batch, "experts"), i);
            split("experts", experts.len())?;
            let (weights, norms) = match meta.white_box {
                true => {
                    let (w, n) = (
                        f32s(column(&batch, "weights"), i),
                        f32s(column(&batch, "norms"), i),
                    );
                    split("weights", w.len())?;
                    split("norms", n.len())?;
                    (Some(w), Some(n))
                }
                false => (None, None),
            };
            let at = |l: usize| l * per_layer..(l + 1) * per_layer;
            let layers = meta
                .shape
                .moe_layers
                .iter()
                .enumerate()
                .map(|(l, &layer)| LayerRouting {
                    layer,
                    k,
                    experts: experts[at(l)].to_vec(),
                    weights: weights.as_ref().map(|w| w[at(l)].to_vec()),
                    norms: norms.as_ref().map(|n| n[at(l)].to_vec()),
                })
                .collect();
            let routing = Routing { layers };
            routing.check(t, &meta.shape).map_err(bad)?;
            let src = u32::try_from(source.value(i))
                .ok()
                .filter(|&s| (s as usize) < meta.sources.len())
                .ok_or_else(|| {
                    bad(format!(
                        "source {} of {} sources",
                        source.value(i),
                        meta.sources.len()
                    ))
                })?;
            rows.push(RoutingRow {
                doc_id: doc.value(i) as u64,
                segment: seg.value(i) as u32,
                source: src,
                routing,
            });
        }
    }
    Ok(RoutingShard { meta, rows })
}

/// What `k3mini.kind` says of a routing report's table.
pub const TABLE_KIND: &str = "routing-report";

/// One row of a routing report's table (`routing.parquet`, kind `routing-report`, schema version
/// 1): one expert of one MoE layer, over every token (`source` null) or one source's.
///
/// | column | type | meaning |
/// |---|---|---|
/// | `source` | utf8, null = all | the corpus source the row counts |
/// | `layer`, `expert` | int32 | which expert |
/// | `tokens` | int64 | tokens the layer routed (in that source) |
/// | `count` | int64 | times the expert was chosen |
/// | `frequency` | float64 | `count / tokens` |
/// | `mean_norm` | float64, null unless white-box | its output's mean L2 norm where chosen |
/// | `saliency` | float64, null unless white-box | REAP's mean `ḡ · ‖f‖₂` where chosen |
/// | `co_selected` | list<int64>, overall rows only | tokens that chose it and each expert |
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertRow {
    pub source: Option<String>,
    pub layer: u32,
    pub expert: u32,
    pub tokens: u64,
    pub count: u64,
    pub frequency: f64,
    pub mean_norm: Option<f64>,
    pub saliency: Option<f64>,
    pub co_selected: Option<Vec<u64>>,
}

/// Writes a routing report's table atomically; `teacher` goes into its metadata.
pub fn write_report_table(
    path: &Path,
    teacher: &str,
    rows: &[ExpertRow],
) -> Result<u64, DataError> {
    use arrow_array::types::Int64Type;
    use arrow_array::{Float64Array, ListArray};
    let what = "routing report table";
    let int32 = |f: &dyn Fn(&ExpertRow) -> u32| -> ArrayRef {
        Arc::new(Int32Array::from_iter_values(
            rows.iter().map(|r| f(r) as i32),
        ))
    };
    let int64 = |f: &dyn Fn(&ExpertRow) -> u64| -> ArrayRef {
        Arc::new(Int64Array::from_iter_values(
            rows.iter().map(|r| f(r) as i64),
        ))
    };
    let float = |f: &dyn Fn(&ExpertRow) -> Option<f64>| -> ArrayRef {
        Arc::new(Float64Array::from_iter(rows.iter().map(f)))
    };
    let co = ListArray::from_iter_primitive::<Int64Type, _, _>(rows.iter().map(|r| {
        r.co_selected
            .as_ref()
            .map(|c| c.iter().map(|&x| Some(x as i64)).collect::<Vec<_>>())
    }));
    let batch = RecordBatch::try_from_iter([
        (
            "source",
            crate::parquet_io::strings(rows.iter().map(|r| r.source.as_deref())),
        ),
        ("layer", int32(&|r| r.layer)),
        ("expert", int32(&|r| r.expert)),
        ("tokens", int64(&|r| r.tokens)),
        ("count", int64(&|r| r.count)),
        ("frequency", float(&|r| Some(r.frequency))),
        ("mean_norm", float(&|r| r.mean_norm)),
        ("saliency", float(&|r| r.saliency)),
        ("co_selected", Arc::new(co) as ArrayRef),
    ])
    .map_err(|e| file_err(path, what, e))?;
    write_parquet(
        path,
        what,
        &batch,
        &[
            ("kind", TABLE_KIND.into()),
            ("schema_version", "1".into()),
            ("teacher", teacher.into()),
        ],
        &[],
        &[],
    )
}
