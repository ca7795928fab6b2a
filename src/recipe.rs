//! Training recipes: one TOML file describes a run. Every table rejects unknown keys, and every error
//! names the file, the line and the key (`recipes/ci-tiny.toml:14: optim.lr: must be positive`).
//!
//! ```toml
//! [run]       name, out_dir, seed
//! [model]     preset = "tiny" plus any ModelConfig field to override ([model.kda], ...)
//! [data]      tokenizer, seq_len, packing, held_out_fraction, train_on, [[data.sources]]
//!             path/format/field/chat
//! [optim]     AdamW: lr, betas, eps, weight_decay (not on norms, biases, gates), grad_clip
//! [schedule]  kind = "constant" | "cosine" | "wsd", warmup_steps, min_lr_ratio, decay_fraction
//! [train]     steps, batch_tokens, micro_batch, log/eval/checkpoint intervals, keep_checkpoints, max_bad_steps
//! [train.qat] format = "q4_0" | "mxfp4", start_step
//! [teacher]   model | endpoints + api, concurrency, k, temperature, segments_per_shard, shards_dir
//! [distill]   mode = "offline" | "online" | "sequence" | "on_policy",
//!             objectives = [{kind, weight, beta | alpha | samples}], temperature
//! [distill.on_policy]  mix, max_tokens, temperature
//! [teacher.generate]  prompts = [{path | dataset, limit}], template, system, max_tokens,
//!             temperature, top_p, prompts_per_shard, out_dir
//! ```

use k3mini_data::{ChatFormat, LossParts, SourceFormat, Tokenizer};
use k3mini_student::ModelConfig;
use k3mini_student::distill::Objective;
use k3mini_student::presets::{PRESETS, resolve};
use k3mini_teacher::client::Api;
use k3mini_teacher::fetch::{self, Kind};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub run: RunConfig,
    /// `preset` plus overrides; resolved into [`LoadedRecipe::model`].
    pub model: toml::Table,
    pub data: DataConfig,
    pub optim: OptimConfig,
    pub schedule: ScheduleConfig,
    pub train: TrainConfig,
    /// The teacher whose signals `k3mini teacher score` writes into shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<TeacherConfig>,
    /// Train from the teacher's shards with these objectives (needs `[teacher]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillConfig>,
}

/// `[distill]`: what the student learns from the teacher's signals. The loss is
/// `Σ weight · objective`; see `k3mini_student::distill` for each objective's formula.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistillConfig {
    /// Where the teacher's signals come from.
    #[serde(default)]
    pub mode: DistillMode,
    pub objectives: Vec<ObjectiveConfig>,
    /// The distillation temperature τ (divergences are scaled by τ²).
    #[serde(default = "default_tau")]
    pub temperature: f64,
    /// `mode = "on_policy"`: how the student samples and how often.
    #[serde(default)]
    pub on_policy: Option<OnPolicyConfig>,
}

/// `[distill.on_policy]`: the student samples continuations of `[teacher.generate]`'s prompts and
/// learns from the teacher's logprob of each sampled token; the other micro-batches are offline.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OnPolicyConfig {
    /// Fraction of micro-batches that are on-policy (the rest train on the shards with `objectives`).
    #[serde(default = "default_mix")]
    pub mix: f64,
    /// Tokens the student samples per prompt (capped by `data.seq_len`).
    #[serde(default = "default_on_policy_tokens")]
    pub max_tokens: usize,
    /// The student's sampling temperature (0 = greedy).
    #[serde(default = "default_sampling_temperature")]
    pub temperature: f32,
}

impl Default for OnPolicyConfig {
    fn default() -> Self {
        Self {
            mix: default_mix(),
            max_tokens: default_on_policy_tokens(),
            temperature: default_sampling_temperature(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DistillMode {
    /// The teacher's top-k over the recipe's corpus, from `k3mini teacher score` shards.
    #[default]
    Offline,
    /// The student samples, the teacher scores its tokens (reverse-KL advantage), mixed with
    /// offline micro-batches (`[distill.on_policy]`).
    OnPolicy,
    /// The teacher in the loop (local or served): each micro-batch of corpus segments is scored
    /// while the student trains on the previous one; nothing is stored.
    Online,
    /// Sequence-level KD: the teacher's own completions (`k3mini teacher generate` shards), trained
    /// on their completion tokens, with their top-k for the divergence objectives.
    Sequence,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveConfig {
    pub kind: ObjectiveKind,
    #[serde(default = "default_weight")]
    pub weight: f64,
    /// `jsd`: the teacher's share β of the mixture (default 0.5).
    #[serde(default)]
    pub beta: Option<f64>,
    /// `skew_kl`, `skew_reverse_kl`: the skew α (default 0.1).
    #[serde(default)]
    pub alpha: Option<f64>,
    /// `sampled`: draws per position (default 12).
    #[serde(default)]
    pub samples: Option<usize>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ObjectiveKind {
    Ce,
    ForwardKl,
    TopkKl,
    TopkKlRenormalised,
    ReverseKl,
    Jsd,
    SkewKl,
    SkewReverseKl,
    Sampled,
}

impl ObjectiveConfig {
    pub fn objective(&self) -> Objective {
        match self.kind {
            ObjectiveKind::Ce => Objective::CrossEntropy,
            ObjectiveKind::ForwardKl => Objective::ForwardKl,
            ObjectiveKind::TopkKl => Objective::TopkKl,
            ObjectiveKind::TopkKlRenormalised => Objective::TopkKlRenormalised,
            ObjectiveKind::ReverseKl => Objective::ReverseKl,
            ObjectiveKind::Jsd => Objective::Jsd {
                beta: self.beta.unwrap_or(0.5),
            },
            ObjectiveKind::SkewKl => Objective::SkewKl {
                alpha: self.alpha.unwrap_or(0.1),
            },
            ObjectiveKind::SkewReverseKl => Objective::SkewReverseKl {
                alpha: self.alpha.unwrap_or(0.1),
            },
            ObjectiveKind::Sampled => Objective::Sampled {
                samples: self.samples.unwrap_or(12),
            },
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TeacherConfig {
    /// A local teacher: a built-in name (`smollm2`, fetched when missing) or a llama-architecture
    /// `.gguf`, relative to the recipe. Give this or `endpoints`.
    #[serde(default)]
    pub model: Option<String>,
    /// A served teacher: `http://host:port` of one or more vLLM / SGLang servers (round-robin).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The served teacher's API.
    #[serde(default = "default_api")]
    pub api: Api,
    /// Requests in flight (served teachers).
    #[serde(default = "one")]
    pub concurrency: usize,
    /// Top-k logprobs kept per position.
    #[serde(default = "default_k")]
    pub k: usize,
    /// The temperature the signals describe (1 = the teacher's own distribution).
    #[serde(default = "default_temperature")]
    pub temperature: f32,
    /// Segments (`data.seq_len` windows) per shard: a kill loses at most one shard of work.
    #[serde(default = "default_segments_per_shard")]
    pub segments_per_shard: usize,
    /// Where shards go (default `<run out_dir>/shards`).
    #[serde(default)]
    pub shards_dir: Option<PathBuf>,
    /// Reasoning trajectories `k3mini teacher generate` samples from the teacher.
    #[serde(default)]
    pub generate: Option<GenerateConfig>,
}

/// `[teacher.generate]`: prompts to answer and how to sample. Top-k per token is `teacher.k`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GenerateConfig {
    pub prompts: Vec<PromptSource>,
    /// The chat template the prompts are rendered with.
    #[serde(default = "default_template")]
    pub template: ChatFormat,
    /// A system turn put before every prompt that has none.
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[serde(default)]
    pub temperature: f32,
    #[serde(default = "default_top_p")]
    pub top_p: f32,
    #[serde(default = "default_prompts_per_shard")]
    pub prompts_per_shard: usize,
    /// Where trajectory shards go (default `<run out_dir>/trajectories`).
    #[serde(default)]
    pub out_dir: Option<PathBuf>,
}

/// A prompt set: a JSONL file (relative to the recipe) or a built-in one (`champ`), optionally
/// cut to its first `limit` prompts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PromptSource {
    #[serde(default)]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub dataset: Option<String>,
    #[serde(default)]
    pub limit: Option<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub name: String,
    /// Where checkpoints and metrics go (default `runs/<name>`), relative to the working directory.
    #[serde(default)]
    pub out_dir: Option<PathBuf>,
    /// Seeds initialisation, shuffling and sampling.
    #[serde(default)]
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// File or directory, relative to the recipe file.
    pub path: PathBuf,
    /// Inferred from the extension when omitted (`.jsonl`, `.parquet`, anything else is text).
    #[serde(default)]
    pub format: Option<SourceFormat>,
    /// JSONL key / Parquet column holding the document: `text` by default, `messages` for chat.
    #[serde(default)]
    pub field: Option<String>,
    /// The source holds conversations (JSONL, a list of `{role, content, thinking?}` per record),
    /// rendered with this template; `data.train_on` picks which parts carry loss.
    #[serde(default)]
    pub chat: Option<ChatFormat>,
}

impl SourceConfig {
    pub fn field(&self) -> &str {
        match (&self.field, self.chat) {
            (Some(f), _) => f,
            (None, Some(_)) => "messages",
            (None, None) => "text",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `kimi` (the Kimi K3 tiktoken vocabulary; `kimi_k2` for K2's specials) or a path to a
    /// `tokenizer.json`, relative to the recipe.
    pub tokenizer: String,
    pub sources: Vec<SourceConfig>,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Pack documents back to back (their states and attention never mix) instead of one per row.
    #[serde(default = "yes")]
    pub packing: bool,
    /// Fraction of documents held out for evaluation.
    #[serde(default = "default_held_out")]
    pub held_out_fraction: f64,
    /// Which parts of chat documents are trained as targets (default: thinking and answer, not the
    /// prompt). Plain-text documents train on every token.
    #[serde(default)]
    pub train_on: LossParts,
}

/// AdamW. Every default is written out (burn's own defaults differ from PyTorch's).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    #[serde(default = "default_adam_eps")]
    pub eps: f64,
    /// Decoupled weight decay on matrices; norms, biases and gate/decay parameters get none.
    #[serde(default = "default_weight_decay")]
    pub weight_decay: f64,
    /// Clip the global gradient norm (all parameters together) to this value; omit to disable.
    #[serde(default = "default_clip")]
    pub grad_clip: Option<f64>,
}

/// Learning-rate schedule.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ScheduleConfig {
    /// Linear warmup, then constant.
    Constant { warmup_steps: usize },
    /// Linear warmup, then cosine decay to `min_lr_ratio · lr` at the last step.
    Cosine {
        warmup_steps: usize,
        #[serde(default = "default_min_lr_ratio")]
        min_lr_ratio: f64,
    },
    /// Warmup-stable-decay: linear warmup, constant, then linear decay over the last `decay_fraction`.
    Wsd {
        warmup_steps: usize,
        #[serde(default = "default_decay_fraction")]
        decay_fraction: f64,
        #[serde(default)]
        min_lr_ratio: f64,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Tokens per optimizer step; a multiple of `micro_batch · seq_len` (the rest is accumulation).
    pub batch_tokens: usize,
    /// Sequences per forward/backward.
    pub micro_batch: usize,
    #[serde(default = "one")]
    pub log_every: usize,
    /// Held-out loss every this many steps (and at the end).
    #[serde(default = "default_eval_every")]
    pub eval_every: usize,
    /// Held-out micro-batches per evaluation.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: usize,
    /// Checkpoints kept on disk (oldest removed first).
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// Consecutive non-finite steps (skipped) before the run stops.
    #[serde(default = "default_max_bad")]
    pub max_bad_steps: usize,
    /// Quantisation-aware training: fake-quantised linear weights from a step on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qat: Option<QatConfig>,
}

/// `[train.qat]`: from `start_step` on, the forward pass sees every linear weight quantised to
/// `format` (blocks of 32), with a straight-through gradient (see `train::qat`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QatConfig {
    pub format: crate::train::qat::QatFormat,
    #[serde(default)]
    pub start_step: usize,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn default_held_out() -> f64 {
    0.02
}
fn default_betas() -> [f64; 2] {
    [0.9, 0.95]
}
fn default_adam_eps() -> f64 {
    1e-8
}
fn default_weight_decay() -> f64 {
    0.1
}
fn default_clip() -> Option<f64> {
    Some(1.0)
}
fn default_min_lr_ratio() -> f64 {
    0.1
}
fn default_decay_fraction() -> f64 {
    0.2
}
fn default_eval_every() -> usize {
    50
}
fn default_eval_batches() -> usize {
    4
}
fn default_checkpoint_every() -> usize {
    100
}
fn default_keep() -> usize {
    3
}
fn default_api() -> Api {
    Api::Vllm
}
fn default_k() -> usize {
    20
}
fn default_temperature() -> f32 {
    1.0
}
fn default_segments_per_shard() -> usize {
    32
}
fn default_mix() -> f64 {
    0.5
}
fn default_on_policy_tokens() -> usize {
    32
}
fn default_sampling_temperature() -> f32 {
    1.0
}
fn default_tau() -> f64 {
    1.0
}
fn default_weight() -> f64 {
    1.0
}
fn default_template() -> ChatFormat {
    ChatFormat::Chatml
}
fn default_max_tokens() -> usize {
    256
}
fn default_top_p() -> f32 {
    1.0
}
fn default_prompts_per_shard() -> usize {
    8
}
fn default_max_bad() -> usize {
    5
}

/// A recipe problem, located in its file.
#[derive(Debug, Clone, PartialEq)]
pub struct RecipeError {
    pub file: PathBuf,
    /// 1-based line of the offending key (or of its table), when it is in the file.
    pub line: Option<usize>,
    /// Dotted key, e.g. `optim.lr`; empty for syntax errors.
    pub key: String,
    pub message: String,
}

impl fmt::Display for RecipeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if !self.key.is_empty() {
            write!(f, ": {}", self.key)?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for RecipeError {}

/// A validated recipe with its model resolved.
#[derive(Clone, Debug)]
pub struct LoadedRecipe {
    pub path: PathBuf,
    pub recipe: Recipe,
    pub model: ModelConfig,
    /// Micro-batches accumulated per optimizer step.
    pub accumulation: usize,
}

impl LoadedRecipe {
    /// The recipe's tokenizer: a built-in vocabulary or a tokenizer.json (not `teacher`, which the
    /// teacher supplies).
    pub fn tokenizer(&self) -> Result<Tokenizer, k3mini_data::DataError> {
        let spec = &self.recipe.data.tokenizer;
        match Tokenizer::builtin(spec) {
            Some(_) => Tokenizer::load(spec),
            None => Tokenizer::load(&self.resolve_path(Path::new(spec)).display().to_string()),
        }
    }

    /// Where `k3mini teacher score` writes this recipe's shards.
    pub fn shards_dir(&self) -> Option<PathBuf> {
        let t = self.recipe.teacher.as_ref()?;
        Some(
            t.shards_dir
                .clone()
                .unwrap_or_else(|| self.out_dir().join("shards")),
        )
    }

    /// Where `k3mini teacher generate` writes this recipe's trajectories.
    pub fn trajectories_dir(&self) -> Option<PathBuf> {
        let g = self.recipe.teacher.as_ref()?.generate.as_ref()?;
        Some(
            g.out_dir
                .clone()
                .unwrap_or_else(|| self.out_dir().join("trajectories")),
        )
    }

    /// Output directory of the run.
    pub fn out_dir(&self) -> PathBuf {
        self.recipe
            .run
            .out_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from("runs").join(&self.recipe.run.name))
    }

    /// A source or tokenizer path as given in the recipe, made relative to the recipe's directory.
    pub fn resolve_path(&self, p: &Path) -> PathBuf {
        self.path.parent().unwrap_or(Path::new(".")).join(p)
    }

    /// The resolved recipe as TOML: the model table expanded to every field.
    pub fn to_toml(&self) -> String {
        let mut value = toml::Table::try_from(&self.recipe).expect("a recipe serialises");
        value.insert(
            "model".into(),
            toml::Value::try_from(&self.model).expect("a model config serialises"),
        );
        toml::to_string_pretty(&value).expect("TOML output")
    }
}

/// Reads, parses and validates a recipe file.
pub fn load(path: &Path) -> Result<LoadedRecipe, RecipeError> {
    let text = std::fs::read_to_string(path).map_err(|e| RecipeError {
        file: path.to_path_buf(),
        line: None,
        key: String::new(),
        message: format!("cannot read: {e}"),
    })?;
    parse(path, &text)
}

/// Parses and validates recipe `text` (errors are reported against `path`).
pub fn parse(path: &Path, text: &str) -> Result<LoadedRecipe, RecipeError> {
    let err = |key: &str, message: String| RecipeError {
        file: path.to_path_buf(),
        line: key_line(text, key),
        key: key.into(),
        message,
    };
    let recipe: Recipe = toml::from_str(text).map_err(|e| RecipeError {
        file: path.to_path_buf(),
        line: e.span().map(|s| line_of(text, s.start)),
        key: String::new(),
        message: e.message().trim().to_string(),
    })?;
    let mut overrides = recipe.model.clone();
    let preset = match overrides.remove("preset") {
        Some(toml::Value::String(s)) => s,
        _ => {
            return Err(err(
                "model.preset",
                format!("must name a preset: {}", PRESETS.join(", ")),
            ));
        }
    };
    let model = resolve(&preset, &overrides).map_err(|e| {
        let key = if e.field == "preset" || e.field == "model" {
            "model.preset".into()
        } else {
            format!("model.{}", e.field)
        };
        err(&key, e.message)
    })?;
    let accumulation = validate(&recipe, &model).map_err(|(key, message)| err(&key, message))?;
    let loaded = LoadedRecipe {
        path: path.to_path_buf(),
        recipe,
        model,
        accumulation,
    };
    for (i, source) in loaded.recipe.data.sources.iter().enumerate() {
        let p = loaded.resolve_path(&source.path);
        if !p.exists() {
            return Err(err(
                &format!("data.sources.{i}.path"),
                format!("{} does not exist", p.display()),
            ));
        }
        let format = source.format.unwrap_or_else(|| SourceFormat::infer(&p));
        if source.chat.is_some() && format != SourceFormat::Jsonl {
            return Err(err(
                &format!("data.sources.{i}.chat"),
                "chat sources are JSONL (one conversation per line)".into(),
            ));
        }
    }
    let prompts = loaded
        .recipe
        .teacher
        .iter()
        .flat_map(|t| t.generate.iter().flat_map(|g| g.prompts.iter()));
    for (i, p) in prompts.enumerate() {
        let key = format!("teacher.generate.prompts.{i}");
        if let Some(path) = &p.path
            && !loaded.resolve_path(path).is_file()
        {
            let shown = loaded.resolve_path(path).display().to_string();
            return Err(err(
                &format!("{key}.path"),
                format!("{shown} does not exist"),
            ));
        }
        if let Some(name) = &p.dataset
            && fetch::known(name, Kind::Dataset).is_none()
        {
            return Err(err(
                &format!("{key}.dataset"),
                format!("{name:?} is not a built-in prompt set (champ)"),
            ));
        }
    }
    let tokenizer = &loaded.recipe.data.tokenizer;
    if tokenizer == TEACHER_TOKENIZER {
        if loaded.recipe.teacher.is_none() {
            return Err(err(
                "data.tokenizer",
                "`teacher` needs a [teacher] table naming the teacher".into(),
            ));
        }
    } else if Tokenizer::builtin(tokenizer).is_none()
        && !loaded.resolve_path(Path::new(tokenizer)).is_file()
    {
        return Err(err(
            "data.tokenizer",
            format!(
                "not `kimi` and no file at {}",
                loaded.resolve_path(Path::new(tokenizer)).display()
            ),
        ));
    }
    Ok(loaded)
}

/// `data.tokenizer = "teacher"`: use the teacher's own tokenizer (so the ids agree by construction).
pub const TEACHER_TOKENIZER: &str = "teacher";

/// Cross-field checks. Returns the accumulation factor, or `(key, message)`.
fn validate(r: &Recipe, model: &ModelConfig) -> Result<usize, (String, String)> {
    let bad = |key: &str, message: String| Err((key.to_string(), message));
    if let Some(t) = &r.teacher {
        if t.model.is_some() == !t.endpoints.is_empty() {
            return bad(
                "teacher",
                "give either `model` (a local teacher) or `endpoints` (served ones)".into(),
            );
        }
        if t.concurrency == 0 {
            return bad("teacher.concurrency", "must be positive".into());
        }
        if !t.endpoints.is_empty() && r.data.tokenizer == TEACHER_TOKENIZER {
            return bad(
                "data.tokenizer",
                "a served teacher's tokenizer is not available here: name the tokenizer.json (or \
                 built-in vocabulary) the teacher uses; k3mini checks the server agrees"
                    .into(),
            );
        }
        if t.k == 0 {
            return bad("teacher.k", "must be positive".into());
        }
        if !(t.temperature > 0.0 && t.temperature.is_finite()) {
            return bad(
                "teacher.temperature",
                format!("must be positive, got {}", t.temperature),
            );
        }
        if t.segments_per_shard == 0 {
            return bad("teacher.segments_per_shard", "must be positive".into());
        }
        if let Some(g) = &t.generate {
            if g.prompts.is_empty() {
                return bad("teacher.generate.prompts", "names no prompt set".into());
            }
            for (i, p) in g.prompts.iter().enumerate() {
                if p.path.is_some() == p.dataset.is_some() {
                    return bad(
                        &format!("teacher.generate.prompts.{i}"),
                        "give either `path` (a JSONL file) or `dataset` (a built-in set: champ)"
                            .into(),
                    );
                }
                if p.limit == Some(0) {
                    return bad(
                        &format!("teacher.generate.prompts.{i}.limit"),
                        "must be positive".into(),
                    );
                }
            }
            if g.max_tokens == 0 || g.prompts_per_shard == 0 {
                return bad(
                    "teacher.generate",
                    "max_tokens and prompts_per_shard must be positive".into(),
                );
            }
            if !(g.temperature >= 0.0 && g.temperature.is_finite()) {
                return bad(
                    "teacher.generate.temperature",
                    format!("must be 0 (greedy) or positive, got {}", g.temperature),
                );
            }
            if !(g.top_p > 0.0 && g.top_p <= 1.0) {
                return bad(
                    "teacher.generate.top_p",
                    format!("must be in (0, 1], got {}", g.top_p),
                );
            }
        }
    }
    if let Some(d) = &r.distill {
        if r.teacher.is_none() {
            return bad(
                "distill",
                "needs a [teacher] table: the shards it trains from are the teacher's".into(),
            );
        }
        if d.objectives.is_empty() {
            return bad("distill.objectives", "names no objective".into());
        }
        let generates = r.teacher.as_ref().is_some_and(|t| t.generate.is_some());
        if matches!(d.mode, DistillMode::Sequence | DistillMode::OnPolicy) && !generates {
            return bad(
                "distill.mode",
                "`sequence` and `on_policy` need prompts: add [teacher.generate]".into(),
            );
        }
        if d.on_policy.is_some() && d.mode != DistillMode::OnPolicy {
            return bad(
                "distill.on_policy",
                "applies to mode = \"on_policy\" only".into(),
            );
        }
        if let Some(o) = &d.on_policy {
            if !(o.mix > 0.0 && o.mix <= 1.0) {
                return bad(
                    "distill.on_policy.mix",
                    format!("must be in (0, 1], got {}", o.mix),
                );
            }
            if o.max_tokens == 0 {
                return bad("distill.on_policy.max_tokens", "must be positive".into());
            }
            if !(o.temperature >= 0.0 && o.temperature.is_finite()) {
                return bad(
                    "distill.on_policy.temperature",
                    format!("must be 0 (greedy) or positive, got {}", o.temperature),
                );
            }
        }
        if !(d.temperature > 0.0 && d.temperature.is_finite()) {
            return bad(
                "distill.temperature",
                format!("must be positive, got {}", d.temperature),
            );
        }
        for (i, o) in d.objectives.iter().enumerate() {
            let key = |field: &str| format!("distill.objectives.{i}.{field}");
            if !(o.weight >= 0.0 && o.weight.is_finite()) {
                return bad(&key("weight"), format!("must be ≥ 0, got {}", o.weight));
            }
            let params = [
                ("beta", o.beta, o.kind == ObjectiveKind::Jsd),
                (
                    "alpha",
                    o.alpha,
                    matches!(o.kind, ObjectiveKind::SkewKl | ObjectiveKind::SkewReverseKl),
                ),
            ];
            for (name, value, applies) in params {
                match value {
                    Some(_) if !applies => {
                        return bad(&key(name), format!("does not apply to {:?}", o.kind));
                    }
                    Some(v) if !(v > 0.0 && v < 1.0) => {
                        return bad(&key(name), format!("must be in (0, 1), got {v}"));
                    }
                    _ => {}
                }
            }
            match o.samples {
                Some(_) if o.kind != ObjectiveKind::Sampled => {
                    return bad(&key("samples"), "applies to `sampled` only".into());
                }
                Some(0) => return bad(&key("samples"), "must be positive".into()),
                _ => {}
            }
        }
        if d.objectives.iter().all(|o| o.weight == 0.0) {
            return bad("distill.objectives", "every weight is 0".into());
        }
    }
    let positive = [
        ("data.seq_len", r.data.seq_len),
        ("train.steps", r.train.steps),
        ("train.batch_tokens", r.train.batch_tokens),
        ("train.micro_batch", r.train.micro_batch),
        ("train.log_every", r.train.log_every),
        ("train.eval_every", r.train.eval_every),
        ("train.checkpoint_every", r.train.checkpoint_every),
        ("train.keep_checkpoints", r.train.keep_checkpoints),
        ("train.max_bad_steps", r.train.max_bad_steps),
    ];
    for (key, v) in positive {
        if v == 0 {
            return bad(key, "must be positive".into());
        }
    }
    if r.data.sources.is_empty() {
        return bad("data.sources", "needs at least one source".into());
    }
    if !(0.0..1.0).contains(&r.data.held_out_fraction) {
        return bad(
            "data.held_out_fraction",
            format!("must be in [0, 1), got {}", r.data.held_out_fraction),
        );
    }
    if r.data.seq_len < 2 {
        return bad(
            "data.seq_len",
            "must be at least 2 (inputs and next-token targets)".into(),
        );
    }
    if r.data.seq_len > model.max_seq_len {
        return bad(
            "data.seq_len",
            format!("exceeds the model's max_seq_len {}", model.max_seq_len),
        );
    }
    let o = &r.optim;
    if !(o.lr > 0.0 && o.lr.is_finite()) {
        return bad("optim.lr", format!("must be positive, got {}", o.lr));
    }
    if o.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
        return bad(
            "optim.betas",
            format!("each must be in [0, 1), got {:?}", o.betas),
        );
    }
    if !(o.eps > 0.0) {
        return bad("optim.eps", "must be positive".into());
    }
    if !(o.weight_decay >= 0.0) {
        return bad("optim.weight_decay", "must be non-negative".into());
    }
    if o.grad_clip.is_some_and(|c| !(c > 0.0)) {
        return bad(
            "optim.grad_clip",
            "must be positive (omit it to disable clipping)".into(),
        );
    }
    let warmup = match &r.schedule {
        ScheduleConfig::Constant { warmup_steps } => *warmup_steps,
        ScheduleConfig::Cosine {
            warmup_steps,
            min_lr_ratio,
        }
        | ScheduleConfig::Wsd {
            warmup_steps,
            min_lr_ratio,
            ..
        } => {
            if !(0.0..=1.0).contains(min_lr_ratio) {
                return bad("schedule.min_lr_ratio", "must be in [0, 1]".into());
            }
            *warmup_steps
        }
    };
    if warmup >= r.train.steps {
        return bad(
            "schedule.warmup_steps",
            format!("must be below train.steps ({})", r.train.steps),
        );
    }
    if let ScheduleConfig::Wsd { decay_fraction, .. } = &r.schedule
        && !(*decay_fraction > 0.0 && *decay_fraction <= 1.0)
    {
        return bad("schedule.decay_fraction", "must be in (0, 1]".into());
    }
    let per_micro = r.train.micro_batch * r.data.seq_len;
    if r.train.batch_tokens % per_micro != 0 {
        return bad(
            "train.batch_tokens",
            format!(
                "{} is not a multiple of micro_batch x seq_len = {per_micro}",
                r.train.batch_tokens
            ),
        );
    }
    Ok(r.train.batch_tokens / per_micro)
}

/// 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// Line of a dotted key (`optim.lr`, `data.sources.0.path`), or of the deepest table on its path that
/// the file does contain.
pub fn key_line(text: &str, dotted: &str) -> Option<usize> {
    use toml::de::{DeTable, DeValue};
    let root = DeTable::parse(text).ok()?;
    let mut table = root.get_ref();
    let mut found = None;
    let mut parts = dotted.split('.').peekable();
    while let Some(part) = parts.next() {
        let Some((key, value)) = table.iter().find(|(k, _)| k.get_ref().as_ref() == part) else {
            break;
        };
        found = Some(line_of(text, key.span().start));
        match value.get_ref() {
            DeValue::Table(t) => table = t,
            DeValue::Array(items) => {
                // `sources.0.path`: step into the array element.
                let Some(index) = parts.peek().and_then(|p| p.parse::<usize>().ok()) else {
                    break;
                };
                parts.next();
                match items.get(index).map(|v| v.get_ref()) {
                    Some(DeValue::Table(t)) => {
                        found = Some(line_of(text, items[index].span().start));
                        table = t;
                    }
                    _ => break,
                }
            }
            _ => break,
        }
    }
    found
}
