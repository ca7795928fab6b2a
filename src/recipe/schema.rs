//! The recipe as written: the TOML schema, with every default spelled out. Every table rejects
//! unknown keys. `plan.rs` turns a parsed recipe into the typed plan a run executes.
//!
//! ```toml
//! [run]       name, out_dir, seed
//! [model]     preset = "tiny" plus any ModelConfig field to override ([model.kda], ...)
//! [data]      tokenizer, seq_len, packing, held_out_fraction, train_on, [[data.sources]]
//!             path/format/field/chat/weight/held_out
//! [optim]     AdamW: lr, betas, eps, weight_decay (not on norms, biases, gates), grad_clip
//! [schedule]  kind = "constant" | "cosine" | "wsd", warmup_steps, min_lr_ratio, decay_fraction
//! [train]     steps, batch_tokens, micro_batch, log/eval/checkpoint intervals, keep_checkpoints, max_bad_steps,
//!             weights_shard_bytes, reduction = "ring" | "ordered", collective_timeout_s
//! [train.qat] format = "q4_0" | "mxfp4", start_step
//! [teacher]   model + engine | endpoints + api + api_key_env + tokenizer, concurrency, k, temperature, segments_per_shard,
//!             logprob_step, shards_dir, routing, routing_shape = {layers, k, experts, moe_layers}
//! [distill]   mode = "offline" | "online" | "sequence" | "on_policy",
//!             objectives = [{kind, weight, beta | alpha | samples | binarization_temperature}], temperature
//! [distill.on_policy]  mix, max_tokens, temperature
//! [teacher.generate]  prompts = [{path | dataset, limit}], template, system, max_tokens,
//!             temperature, top_p, prompts_per_shard, out_dir
//! [smoke]     resume_at, loss_drop, quant, max_gguf_kl, baseline tolerances (`k3mini smoke`)
//! ```

use crate::device::DeviceList;
use k3mini_data::{ChatFormat, LossParts, SourceFormat};
use k3mini_student::distill::Objective;
use k3mini_teacher::client::Api;
use k3mini_teacher::local::Engine;
use k3mini_teacher::routing::RoutingShape;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    pub run: RunConfig,
    /// `preset` plus overrides; resolved into the plan's `model`.
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
    /// What `k3mini smoke` asserts about a run of this recipe (not part of the run's plan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smoke: Option<SmokeConfig>,
}

/// `[smoke]`: `k3mini smoke` trains the recipe's `train.steps`, stops and resumes, exports and
/// evaluates, and checks what a healthy run must show; against `--baseline` (an earlier smoke's
/// smoke.json) it compares the noisy figures as ratios. Every key has a default.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SmokeConfig {
    /// The step the second run stops after and resumes from, its continuation checked bit for
    /// bit against a straight run (default: half of train.steps).
    #[serde(default)]
    pub resume_at: Option<usize>,
    /// The last step's loss must be below the first's by at least this fraction of it.
    #[serde(default = "default_loss_drop")]
    pub loss_drop: f64,
    /// The GGUF file type the checkpoint is exported to and run in llama.cpp.
    #[serde(default = "default_smoke_quant")]
    pub quant: String,
    /// The largest mean KL(k3mini ‖ llama.cpp) over a fixed text that the GGUF may show.
    #[serde(default = "default_max_gguf_kl")]
    pub max_gguf_kl: f64,
    /// Against a baseline: the fewest training tokens/s, as a fraction of the baseline's.
    #[serde(default = "default_min_speed_ratio")]
    pub min_tokens_per_s_ratio: f64,
    /// Against a baseline: the most peak memory, as a multiple of the baseline's.
    #[serde(default = "default_max_memory_ratio")]
    pub max_peak_memory_ratio: f64,
    /// Against a baseline: the highest final training loss, as a multiple of the baseline's.
    #[serde(default = "default_max_loss_ratio")]
    pub max_final_loss_ratio: f64,
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
    /// `mode = "traffic"`: the directory `k3mini agent serve --traffic` wrote.
    #[serde(default)]
    pub traffic: Option<PathBuf>,
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
    /// The requests a deployed student escalated, as the remote scored them (`k3mini agent
    /// serve --traffic DIR`, named by `distill.traffic`): the next student learns what the
    /// current one could not answer.
    Traffic,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObjectiveConfig {
    /// The objective (formulas in `k3mini_student::distill`).
    pub kind: ObjectiveKind,
    /// Its weight in the loss `Σ weight · objective`.
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
    /// `router_kl`: the `routing design` map (`design.json`), relative to the recipe.
    #[serde(default)]
    pub design: Option<PathBuf>,
    /// `alm`: the binarisation temperature `T` chunk log-likelihoods are divided by before they
    /// are read as Bernoulli probabilities (default 100, as tokenkit's ALM).
    #[serde(default)]
    pub binarization_temperature: Option<f64>,
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
    /// Router distillation (MoE students; not a token objective: see `RouterKlPlan`).
    RouterKl,
    /// Cross-vocabulary: approximate likelihood matching over aligned chunks (ALM; not a
    /// per-position objective: see `AlmPlan`).
    Alm,
    /// Cross-vocabulary: forward KL to the teacher's top-k projected onto the student's
    /// vocabulary at each chunk's first position (X-Token style).
    Xtoken,
}

impl ObjectiveKind {
    /// Whether it needs a teacher of the student's vocabulary: the divergences compare the two
    /// distributions id by id, `router_kl` reads routing shards only such a job writes (`ce`
    /// needs no teacher; `alm` and `xtoken` work across vocabularies).
    pub fn needs_one_vocabulary(self) -> bool {
        !matches!(self, Self::Ce | Self::Alm | Self::Xtoken)
    }

    /// Whether it reads a teacher of another vocabulary (a cross-tokenizer job's shards).
    pub fn cross_vocabulary(self) -> bool {
        matches!(self, Self::Alm | Self::Xtoken)
    }
}

impl ObjectiveConfig {
    /// The per-position objective, `None` for `router_kl` and `alm`.
    pub fn objective(&self) -> Option<Objective> {
        Some(match self.kind {
            ObjectiveKind::RouterKl | ObjectiveKind::Alm => return None,
            ObjectiveKind::Xtoken => Objective::Xtoken,
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
        })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TeacherConfig {
    /// A local teacher: a built-in name (`smollm2`, fetched when missing) or a `.gguf`, relative
    /// to the recipe. Give this or `endpoints`.
    #[serde(default)]
    pub model: Option<String>,
    /// The local teacher's engine: `llama-cpp` (any GGUF llama.cpp runs; the default) or `burn`
    /// (llama-architecture GGUFs in pure Rust; the default of `--no-default-features` builds).
    #[serde(default = "default_engine")]
    pub engine: Engine,
    /// A served teacher: `http://host:port` of one or more vLLM / SGLang servers (round-robin).
    #[serde(default)]
    pub endpoints: Vec<String>,
    /// The served teacher's API.
    #[serde(default = "default_api")]
    pub api: Api,
    /// A served teacher's own tokenizer (a `tokenizer.json`, relative to the recipe, or a
    /// built-in vocabulary) when it is not the student's: cross-vocabulary objectives (`alm`,
    /// `xtoken`) retokenize the corpus with it. A local teacher's comes from its GGUF.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// The environment variable holding the served teacher's API key (sent as `Authorization:
    /// Bearer …`); the key itself never goes in a recipe.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Requests in flight (served teachers).
    #[serde(default = "one")]
    pub concurrency: usize,
    /// Top-k logprobs kept per position.
    #[serde(default = "default_k")]
    pub k: usize,
    /// The temperature the teacher's logprobs are scored at: must be 1 (its own distribution);
    /// `distill.temperature` tempers them in the loss.
    #[serde(default = "default_temperature")]
    pub temperature: f32,
    /// Segments (`data.seq_len` windows) per shard: a kill loses at most one shard of work.
    #[serde(default = "default_segments_per_shard")]
    pub segments_per_shard: usize,
    /// Shards store each logprob within this many nats of the teacher's (schema v2, ids
    /// lossless, the top-k mass exact); `0` stores exact f32 logprobs (schema v1, ~4× larger).
    #[serde(default = "default_logprob_step")]
    pub logprob_step: f32,
    /// Where shards go (default `<run out_dir>/shards`).
    #[serde(default)]
    pub shards_dir: Option<PathBuf>,
    /// `teacher score` also harvests the MoE teacher's routing into routing shards beside the
    /// signal shards: a local teacher's through llama.cpp's graph hooks (expert ids, router
    /// weights, expert output norms), a served one's routed experts (ids; the server started with
    /// `--enable-return-routed-experts`, `routing_shape` given).
    #[serde(default)]
    pub routing: bool,
    /// A served teacher's routing, as its configuration says (a local one's comes from its GGUF):
    /// `{ layers = hidden layers, k = experts per token, experts = routed experts per layer,
    /// moe_layers = [the layers with routed experts] }`.
    #[serde(default)]
    pub routing_shape: Option<RoutingShape>,
    /// Reasoning trajectories `k3mini teacher generate` samples from the teacher.
    #[serde(default)]
    pub generate: Option<GenerateConfig>,
}

/// `[teacher.generate]`: prompts to answer and how to sample. Top-k per token is `teacher.k`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GenerateConfig {
    pub prompts: Vec<PromptSource>,
    /// The chat format the prompts are rendered with: `chatml`, `kimi_k2` or `kimi_k3` (`kimi`);
    /// by default the vocabulary's (`kimi_k3` for `data.tokenizer = "kimi"`, `kimi_k2` for
    /// `"kimi_k2"`, `chatml` for every other).
    #[serde(default)]
    pub template: Option<ChatFormat>,
    /// A system turn put before every prompt that has none.
    #[serde(default)]
    pub system: Option<String>,
    /// Tokens the teacher generates per prompt, at most.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Nucleus sampling's p (1 = off).
    #[serde(default = "default_top_p")]
    pub top_p: f32,
    /// Trajectories per shard: a kill loses at most one shard of work.
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
    /// A JSONL file of prompts. Give this or `dataset`.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// A built-in prompt set (`champ`, fetched when missing).
    #[serde(default)]
    pub dataset: Option<String>,
    /// Only the first this many prompts.
    #[serde(default)]
    pub limit: Option<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The run's name: its default output directory and its label in reports.
    pub name: String,
    /// Where checkpoints and metrics go (default `runs/<name>`), relative to the working directory.
    #[serde(default)]
    pub out_dir: Option<PathBuf>,
    /// Seeds initialisation, shuffling and sampling.
    #[serde(default)]
    pub seed: u64,
    /// `cpu` (default), `cuda:N`, or a list (`cuda:0,1,2,3`) training one replica per device;
    /// see `crate::device`. `--device` on a command overrides it.
    #[serde(default)]
    pub device: Option<DeviceList>,
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
    /// The source holds conversations (JSONL in OpenAI's request shape: the messages under
    /// `field`, with `thinking`, `tool_calls` and `tool` results, and the tools declared under
    /// `tools`), rendered in this format: `chatml`, `kimi_k2` or `kimi_k3` (`kimi`, the format of
    /// the `kimi` vocabulary). `data.train_on` picks
    /// which parts carry loss (the assistant's calls are its answer).
    #[serde(default)]
    pub chat: Option<ChatFormat>,
    /// Its share of the training tokens, relative to the other sources' (plain training streams
    /// them in this proportion; default 1).
    #[serde(default = "one_f64")]
    pub weight: f64,
    /// Every document is held out: an evaluation set beside the training sources (a domain's
    /// validation file), never trained on. Plain and online runs only.
    #[serde(default)]
    pub held_out: bool,
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
    /// AdamW's β1, β2.
    #[serde(default = "default_betas")]
    pub betas: [f64; 2],
    /// AdamW's ε.
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
    /// A line of `metrics.jsonl` (and TensorBoard's event file) every this many steps.
    #[serde(default = "one")]
    pub log_every: usize,
    /// Held-out loss every this many steps (and at the end).
    #[serde(default = "default_eval_every")]
    pub eval_every: usize,
    /// Held-out micro-batches per evaluation.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: usize,
    /// A checkpoint every this many steps (and at the last).
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: usize,
    /// Checkpoints kept on disk (oldest removed first).
    #[serde(default = "default_keep")]
    pub keep_checkpoints: usize,
    /// Consecutive non-finite steps (skipped) before the run stops.
    #[serde(default = "default_max_bad")]
    pub max_bad_steps: usize,
    /// Checkpoint (and HF export) weights past this many bytes are split into
    /// `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`, as transformers does.
    #[serde(
        default = "default_shard_bytes",
        skip_serializing_if = "is_default_shard_bytes"
    )]
    pub weights_shard_bytes: u64,
    /// Each sub-layer (a mixer, a dense FFN) keeps only its input and runs again in the backward
    /// pass (`K3Mini::with_checkpointing`): the same gradients, a fraction of the activation
    /// memory, about a third more compute for the trunk.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub activation_checkpointing: bool,
    /// Quantisation-aware training: fake-quantised linear weights from a step on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qat: Option<QatConfig>,
    /// Tokens whose LM-head logits exist at once: the head and the loss run over the micro-batch
    /// in chunks of this many (default: as many as fit 2^26 logits). `0`: the whole micro-batch
    /// under the step's graph, the unchunked reference (for A/B benchmarks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_chunk: Option<usize>,
    /// How ranks a launcher started (torchrun, srun) sum their gradients: `ring`, each rank its
    /// micro-batches then an all-reduce across ranks (one process's numbers up to rounding);
    /// `ordered`, every micro-batch's gradient gathered and summed in micro-batch order (one
    /// process's bits; each rank holds its own micro-batches' gradients and a round's W more on
    /// the host). See docs/gpus.md.
    #[serde(default, skip_serializing_if = "is_default")]
    pub reduction: Reduction,
    /// How long a rank waits for the others (to join, for each transfer of a collective) before
    /// the run stops with an error that says so; longer than a day is held to a day. A rank that
    /// dies is noticed at once (its connections close), this is for one that hangs.
    #[serde(
        default = "default_collective_timeout_s",
        skip_serializing_if = "is_default_collective_timeout_s"
    )]
    pub collective_timeout_s: u64,
}

/// `train.reduction`: the order in which a run across processes sums its ranks' gradients.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reduction {
    /// Each rank sums its own micro-batches, then a reduce-scatter sums the ranks' in the
    /// backend's order (a ring's): equal to one process up to the last bits of each sum.
    #[default]
    Ring,
    /// Every micro-batch's gradient is gathered and summed in micro-batch order: the bits one
    /// process gets, for `world` times the gradients' memory and traffic.
    Ordered,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}
fn default_collective_timeout_s() -> u64 {
    1800
}
fn is_default_collective_timeout_s(s: &u64) -> bool {
    *s == default_collective_timeout_s()
}

/// `[train.qat]`: from `start_step` on, the forward pass sees weights quantised to `format`
/// (blocks of 32 along their input), with a straight-through gradient (see `train::qat`): for
/// q4_0 every linear weight; for mxfp4 a MoE student's routed experts, else every linear weight
/// (`export --quant mxfp4` stores exactly those as trained).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct QatConfig {
    /// The format the weights are fake-quantised to.
    pub format: QatFormat,
    /// The first step that trains quantised.
    #[serde(default)]
    pub start_step: usize,
}

/// The fake-quantisation format of `[train.qat]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QatFormat {
    Q4_0,
    Mxfp4,
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
fn default_shard_bytes() -> u64 {
    k3mini_student::hf::DEFAULT_SHARD_BYTES
}
fn is_default_shard_bytes(b: &u64) -> bool {
    *b == default_shard_bytes()
}
fn default_keep() -> usize {
    3
}
fn default_engine() -> Engine {
    Engine::default()
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
fn one_f64() -> f64 {
    1.0
}
fn default_logprob_step() -> f32 {
    k3mini_data::shards::DEFAULT_LOGPROB_STEP
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
fn default_loss_drop() -> f64 {
    0.02
}
fn default_smoke_quant() -> String {
    "q8_0".into()
}
fn default_max_gguf_kl() -> f64 {
    1e-3
}
fn default_min_speed_ratio() -> f64 {
    0.7
}
fn default_max_memory_ratio() -> f64 {
    1.15
}
fn default_max_loss_ratio() -> f64 {
    1.02
}
fn default_tau() -> f64 {
    1.0
}
fn default_weight() -> f64 {
    1.0
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
