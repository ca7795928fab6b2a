//! The run plan: a recipe resolved once — paths made absolute, the model expanded from its preset,
//! the tokenizer, teacher, prompts and objective typed — and validated here, in one place. Each
//! stage takes its part of the plan and re-checks nothing the plan guarantees.
//!
//! Every checkpoint stores the plan it was trained with (`plan.toml`), so export, eval and resume
//! rebuild exactly that run whatever the presets, the recipe file or the working directory are
//! later.

use super::schema::*;
use crate::device::DeviceList;
use k3mini_data::shards::{DEFAULT_LOGPROB_STEP, Storage};
use k3mini_data::{ChatFormat, LossParts, SourceFormat, Tokenizer};
use k3mini_student::ModelConfig;
use k3mini_student::distill::Objective;
use k3mini_student::head::HeadChunks;
use k3mini_student::info::{Footprint, TrainingMemory, training_memory};
use k3mini_student::presets::{PRESETS, resolve};
use k3mini_teacher::client::Api;
use k3mini_teacher::fetch::{self, Kind};
use k3mini_teacher::local::Engine;
use k3mini_teacher::manifest::{read_traffic, shards_digest};
use k3mini_teacher::routing::RoutingShape;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// `data.tokenizer = "teacher"`: use the teacher's own tokenizer (so the ids agree by construction).
pub const TEACHER_TOKENIZER: &str = "teacher";

/// Micro-batches one optimizer step may accumulate. A step that needs more would not finish in any
/// useful time (at 1M tokens per step, K3 Mini's 3B recipe accumulates 256 at micro-batch 1).
pub const MAX_ACCUMULATION: usize = 1 << 16;

/// Training memory (weights, gradients, AdamW moments) beyond which no machine can hold a model:
/// refused when the recipe is checked. Smaller models are checked against the machine at `train`.
pub const MAX_TRAINING_BYTES: f64 = (1u64 << 50) as f64;

/// A recipe, resolved and validated.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunPlan {
    /// The recipe file this plan was resolved from (absolute); named in messages and commands.
    pub recipe: PathBuf,
    pub name: String,
    /// Where checkpoints and metrics go (absolute).
    pub out_dir: PathBuf,
    /// Seeds initialisation, shuffling and sampling.
    pub seed: u64,
    /// Micro-batches accumulated per optimizer step: `train.batch_tokens / (micro_batch · seq_len)`.
    pub accumulation: usize,
    /// Where it computes; several devices share each step's micro-batches (at most one replica
    /// per micro-batch). Checkpoints written before devices were planned read as `cpu`.
    #[serde(default)]
    pub devices: DeviceList,
    pub model: ModelConfig,
    /// `[model] init`: the checkpoint directory whose weights a fresh run starts from (its model
    /// is `model`; the optimizer starts fresh at step 0). Verified when the recipe resolves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<PathBuf>,
    pub data: DataPlan,
    pub optim: OptimConfig,
    pub schedule: ScheduleConfig,
    pub train: TrainConfig,
    /// The teacher and what the student learns from it; `None` trains on the data alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillPlan>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DataPlan {
    pub tokenizer: TokenizerSpec,
    /// Tokens per training sequence.
    pub seq_len: usize,
    pub packing: bool,
    pub held_out_fraction: f64,
    /// Which parts of chat documents carry loss.
    pub train_on: LossParts,
    pub sources: Vec<SourcePlan>,
}

impl DataPlan {
    /// Whether any document is held out: by the hashed fraction, or a source held out whole.
    pub fn holds_out(&self) -> bool {
        self.held_out_fraction > 0.0 || self.sources.iter().any(|s| s.held_out)
    }

    /// The chat format the student is trained to speak: the one its chat sources are rendered
    /// in, where they name one (None for plain text, or for sources in several).
    pub fn chat_format(&self) -> Option<ChatFormat> {
        let mut formats = self.sources.iter().filter_map(|s| s.chat);
        let first = formats.next()?;
        formats.all(|f| f == first).then_some(first)
    }
}

/// A corpus source: an absolute path, its format and the field holding documents.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SourcePlan {
    pub path: PathBuf,
    pub format: SourceFormat,
    pub field: String,
    /// Conversations rendered with this template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat: Option<ChatFormat>,
    /// Its share of the training tokens (positive, finite).
    #[serde(default = "unit_weight", skip_serializing_if = "is_unit_weight")]
    pub weight: f64,
    /// Held out whole: evaluated, never trained on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held_out: bool,
}

fn unit_weight() -> f64 {
    1.0
}
fn is_unit_weight(w: &f64) -> bool {
    *w == 1.0
}

/// Where the student's tokenizer comes from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TokenizerSpec {
    /// A built-in vocabulary (`kimi`, `kimi_k2`).
    Builtin { name: String },
    /// A tokenizer.json.
    File { path: PathBuf },
    /// A GGUF teacher's own: the local teacher's (`data.tokenizer = "teacher"`) or a built-in
    /// one's by name (`"smollm2"`).
    Teacher { model: LocalModel },
}

/// A local teacher's GGUF: a built-in one (fetched into the cache when missing) or a file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LocalModel {
    Builtin { name: String },
    Gguf { path: PathBuf },
}

fn default_storage() -> Storage {
    Storage::Quantised {
        step: DEFAULT_LOGPROB_STEP,
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TeacherPlan {
    pub source: TeacherSource,
    /// Requests in flight.
    pub concurrency: usize,
    /// Top-k logprobs kept per position.
    pub k: usize,
    /// The temperature the teacher's logprobs are scored at: always 1 (its own distribution);
    /// tempering happens in the loss, at [`DistillPlan::tau`].
    pub logprob_temperature: f32,
    /// Scored segments per shard.
    pub segments_per_shard: usize,
    /// How shards store logprobs (plans from before it existed: the default).
    #[serde(default = "default_storage")]
    pub logprob_step: Storage,
    /// Where `teacher score` writes its shards (absolute).
    pub shards_dir: PathBuf,
    /// Whether `teacher score` harvests routing, and where the teacher's routing comes from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<RoutingPlan>,
    /// Trajectories `teacher generate` samples (and eval's exact-match problems).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate: Option<GeneratePlan>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TeacherSource {
    Local {
        model: LocalModel,
        /// Plans from before engines were a choice ran on burn.
        #[serde(default = "burn")]
        engine: Engine,
    },
    /// vLLM / SGLang / OpenAI-echo servers, round-robin; their API key, where they want one, is
    /// read from the environment variable `api_key_env` names when they are connected to.
    Served {
        endpoints: Vec<String>,
        api: Api,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        api_key_env: Option<String>,
        /// Its own tokenizer (a built-in name or an absolute `tokenizer.json` path), for
        /// cross-vocabulary distillation.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String>,
    },
}

/// Where a teacher's routing is known from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "from", rename_all = "snake_case", deny_unknown_fields)]
pub enum RoutingPlan {
    /// A local teacher's GGUF.
    Model,
    /// The recipe's `teacher.routing_shape` (a served teacher).
    Given { shape: RoutingShape },
}

/// Prompt sets and how they are rendered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PromptPlan {
    pub sets: Vec<PromptSet>,
    pub template: ChatFormat,
    /// A system turn put before every prompt that has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PromptSet {
    /// A JSONL file (absolute path).
    Jsonl {
        path: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
    /// A built-in set (`champ`), fetched when missing.
    Builtin {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        limit: Option<usize>,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GeneratePlan {
    pub max_tokens: usize,
    /// The teacher's sampling temperature (0 = greedy). Its logprobs stay untempered.
    pub sampling_temperature: f32,
    pub top_p: f32,
    pub prompts_per_shard: usize,
    /// Where trajectory shards go (absolute).
    pub out_dir: PathBuf,
    pub prompts: PromptPlan,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DistillPlan {
    /// The distillation temperature τ: student and teacher tempered, divergences scaled by τ².
    pub tau: f64,
    pub mode: ModePlan,
    /// `Σ weight · objective`; only objectives with a positive weight are kept.
    pub objectives: Vec<WeightedObjective>,
    /// `router_kl`, when weighted: added to the token objectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_kl: Option<RouterKlPlan>,
    /// `alm`, when weighted: added to the token objectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alm: Option<AlmPlan>,
    /// Whether the objectives read a teacher of the student's vocabulary or of its own.
    #[serde(default)]
    pub vocabulary: Vocabulary,
    pub teacher: TeacherPlan,
}

/// Which vocabulary a distillation's teacher has, as its objectives need it.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Vocabulary {
    /// The student's: the teacher's ids are the student's (top-k divergences, id by id).
    #[default]
    Same,
    /// Its own (`alm`, `xtoken`): the corpus is retokenized for the teacher and its signals
    /// aligned to the student's tokens by byte offsets; `teacher score` writes aligned shards.
    Cross,
}

/// Approximate likelihood matching (`k3mini_student::distill::alm_chunk`): `weight` times the
/// mean over a micro-batch's aligned chunks of the binarised chunk divergence at `temperature`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AlmPlan {
    pub weight: f64,
    pub temperature: f64,
}

/// Router distillation: at each student MoE layer the design maps, `weight · KL(r ‖ π)` between the
/// teacher's routing mass gathered onto the student's experts and the student router's normalised
/// scores, averaged over positions and layers (`student/src/distill.rs`'s `router_kl`). The design
/// matches the student's experts and layers and, for a served teacher, its routing shape; the
/// routing shards are checked against its teacher shape as they are read.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouterKlPlan {
    pub weight: f64,
    /// Where the design was read from.
    pub path: PathBuf,
    pub design: k3mini_data::design::Design,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WeightedObjective {
    pub weight: f64,
    pub objective: Objective,
}

/// Where a distillation run's signals come from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModePlan {
    /// `teacher score` shards of the corpus.
    Offline,
    /// The teacher scores each micro-batch in the loop.
    Online,
    /// The teacher's own completions (`teacher generate` shards in `trajectories`).
    Sequence { trajectories: PathBuf },
    /// A gateway's escalations, as the remote scored them (`agent serve --traffic`): the first
    /// `shards` of `dir`'s manifest, pinned by their checksums' digest when the plan was made
    /// (requests escalated later belong to a later run).
    Traffic {
        dir: PathBuf,
        shards: usize,
        digest: String,
    },
    /// The student samples continuations of prompts for a share of micro-batches (the rest are
    /// offline) and the teacher scores its tokens.
    OnPolicy(OnPolicyPlan),
}

/// `ModePlan::OnPolicy`'s settings: what the on-policy objective is opened with.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OnPolicyPlan {
    /// The share of micro-batches the student samples.
    pub mix: f64,
    pub max_tokens: usize,
    /// The student's sampling temperature (0 = greedy).
    pub sampling_temperature: f32,
    pub prompts: PromptPlan,
}

impl RunPlan {
    /// The recipe in a command line or message.
    pub fn recipe_name(&self) -> String {
        self.recipe.display().to_string()
    }

    /// The chat format the student is trained to speak: its chat sources' where they name one,
    /// else the template `teacher generate`'s trajectories are rendered in (a sequence or
    /// on-policy run trains on those); None where neither says (the vocabulary decides).
    pub fn chat_format(&self) -> Option<ChatFormat> {
        self.data.chat_format().or_else(|| {
            let generate = self.distill.as_ref()?.teacher.generate.as_ref()?;
            Some(generate.prompts.template)
        })
    }

    /// The plan as TOML (what `recipe check` prints and checkpoints store).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a plan serialises to TOML")
    }

    /// A plan read back from [`RunPlan::to_toml`].
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// The same plan writing to `out_dir` (made absolute).
    pub fn with_out_dir(mut self, out_dir: &Path) -> Self {
        self.out_dir = absolute(out_dir);
        self
    }

    /// Where the teacher's signals are: the shards of `teacher score`.
    pub fn shards_dir(&self) -> Option<&Path> {
        Some(&self.distill.as_ref()?.teacher.shards_dir)
    }

    /// The prompt sets with reference answers (eval's exact match), when the recipe has any.
    pub fn prompts(&self) -> Option<&PromptPlan> {
        let d = self.distill.as_ref()?;
        match &d.mode {
            ModePlan::OnPolicy(o) => Some(&o.prompts),
            _ => d.teacher.generate.as_ref().map(|g| &g.prompts),
        }
    }

    /// The dotted keys whose values differ between `self` and `other` (`train.steps: 40 → 80`),
    /// for refusing a resume under another plan.
    pub fn changes_from(&self, other: &RunPlan) -> Vec<String> {
        let (a, b) = (
            toml::Value::try_from(other).expect("a plan serialises"),
            toml::Value::try_from(self).expect("a plan serialises"),
        );
        let mut changes = Vec::new();
        diff("", &a, &b, &mut changes);
        // Moving a run to other hardware changes no number it computes beyond summation order.
        changes.retain(|c| !c.starts_with("devices:"));
        changes
    }

    /// How many tokens' logits the LM head and loss hold at once (`train.head_chunk`).
    pub fn head_chunks(&self) -> HeadChunks {
        HeadChunks::resolve(self.train.head_chunk, self.model.vocab_size)
    }

    /// How a training step of this plan lays out on its devices.
    pub fn footprint(&self) -> Footprint {
        Footprint {
            batch: self.train.micro_batch,
            seq_len: self.data.seq_len,
            activation_checkpointing: self.train.activation_checkpointing,
            replicas: self.devices.replicas(),
            micro_batches: self.accumulation,
            head_chunk: self.train.head_chunk,
        }
    }

    /// The training memory of this plan's busiest device.
    pub fn training_memory(&self) -> TrainingMemory {
        training_memory(&self.model, &self.footprint())
    }

    /// The plan on other devices (`--device`), checked as the recipe's own `run.device` is.
    pub fn with_devices(mut self, devices: DeviceList) -> Result<Self, crate::error::Error> {
        check_replicas(self.accumulation, &devices).map_err(|(key, message)| {
            crate::error::Error::Refused(format!("--device: {message} ({key})"))
        })?;
        self.devices = devices;
        Ok(self)
    }
}

fn diff(key: &str, old: &toml::Value, new: &toml::Value, out: &mut Vec<String>) {
    use toml::Value::Table;
    let join = |k: &str| {
        if key.is_empty() {
            k.to_string()
        } else {
            format!("{key}.{k}")
        }
    };
    match (old, new) {
        (Table(a), Table(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => diff(&join(k), x, y, out),
                    (x, y) => out.push(format!("{}: {} → {}", join(k), shown(x), shown(y))),
                }
            }
        }
        _ if old != new => out.push(format!("{key}: {old} → {new}")),
        _ => {}
    }
}

fn shown(v: Option<&toml::Value>) -> String {
    v.map_or("(absent)".into(), |v| v.to_string())
}

/// `p` against the working directory (a path `absolute` cannot make absolute is empty: kept as is).
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// What went wrong, as `(dotted key, message)`; the caller locates the key in the file.
type Refusal = (String, String);

fn refuse<T>(key: &str, message: impl Into<String>) -> Result<T, Refusal> {
    Err((key.to_string(), message.into()))
}

/// Resolves and validates a parsed recipe read from `path`.
pub fn resolve_plan(path: &Path, r: Recipe) -> Result<RunPlan, Refusal> {
    let recipe = absolute(path);
    let dir = recipe.parent().unwrap_or(Path::new("/")).to_path_buf();
    let at = |p: &Path| dir.join(p);
    let (model, init) = match r.model.get("init") {
        Some(_) => init_model(&r.model, &at)?,
        None => (model_config(&r.model)?, None),
    };
    check_model_size(&model)?;
    check_loop(&r, &model)?;
    // Run and shard directories are relative to the working directory, sources to the recipe.
    let out_dir = absolute(
        r.run
            .out_dir
            .as_deref()
            .unwrap_or(&PathBuf::from("runs").join(&r.run.name)),
    );
    let teacher = match &r.teacher {
        Some(t) => Some(teacher_plan(t, &r.data.tokenizer, &out_dir, &at)?),
        None => None,
    };
    // Ids past the student's vocabulary go to the tail bucket: a top-k wider than it is not a
    // top-k of anything the student can learn (and the teacher refuses it once scoring starts).
    if let Some(t) = r.teacher.as_ref().filter(|t| t.k > model.vocab_size) {
        return refuse(
            "teacher.k",
            format!(
                "{} is more than model.vocab_size ({}): a top-k holds at most every id",
                t.k, model.vocab_size
            ),
        );
    }
    let distill = match (&r.distill, teacher) {
        (None, None) => None,
        (None, Some(_)) => {
            return refuse(
                "teacher",
                "a [teacher] without [distill] trains nothing from it: add [distill] objectives \
                 to learn from the teacher, or drop [teacher] for plain training",
            );
        }
        (Some(_), None) => {
            return refuse(
                "distill",
                "needs a [teacher] table: the signals it trains from are the teacher's",
            );
        }
        (Some(d), Some(teacher)) => Some(distill_plan(d, teacher, &model, &at)?),
    };
    let data = data_plan(&r.data, distill.as_ref(), &at)?;
    let per_micro = r.train.micro_batch * r.data.seq_len;
    let devices = r.run.device.clone().unwrap_or_default();
    check_replicas(r.train.batch_tokens / per_micro, &devices)?;
    Ok(RunPlan {
        recipe,
        name: r.run.name.clone(),
        out_dir,
        seed: r.run.seed,
        accumulation: r.train.batch_tokens / per_micro,
        devices,
        model,
        init,
        data,
        optim: r.optim,
        schedule: r.schedule,
        train: r.train,
        distill,
    })
}

/// Each replica needs a micro-batch of every step.
fn check_replicas(accumulation: usize, devices: &DeviceList) -> Result<(), Refusal> {
    if devices.replicas() > accumulation {
        return refuse(
            "run.device",
            format!(
                "{} devices but {accumulation} micro-batch(es) per step: raise train.batch_tokens \
                 to at least {} micro-batches, or use fewer devices",
                devices.replicas(),
                devices.replicas()
            ),
        );
    }
    Ok(())
}

/// The file in each checkpoint that holds the plan it was trained with.
pub const PLAN: &str = "plan.toml";

/// The plan a checkpoint was trained with, from its verified `files`.
pub fn checkpoint_plan(
    files: &std::collections::BTreeMap<String, PathBuf>,
) -> Result<RunPlan, String> {
    let path = files.get(PLAN).ok_or_else(|| {
        format!(
            "no {PLAN} (written by a k3mini before runs stored their resolved plan; train it \
             again with this version)"
        )
    })?;
    let text = std::fs::read_to_string(path).map_err(|e| format!("{PLAN}: {e}"))?;
    RunPlan::from_toml(&text).map_err(|_| format!("{PLAN} is not a run plan"))
}

/// `[model] init = "checkpoint"` (a checkpoint or run directory, relative to the recipe): the
/// model is the checkpoint's, so no other model key may say otherwise.
fn init_model(
    table: &toml::Table,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<(ModelConfig, Option<PathBuf>), Refusal> {
    if let Some(other) = table.keys().find(|k| *k != "init") {
        return refuse(
            &format!("model.{other}"),
            "with model.init the model is the checkpoint's: drop the other [model] keys",
        );
    }
    let Some(toml::Value::String(path)) = table.get("init") else {
        return refuse("model.init", "must be a checkpoint or run directory");
    };
    // The checkpoint's files are verified here and again, with its weights, when `train` loads it.
    let refusal = |e: String| ("model.init".to_string(), e);
    let (_, dir) =
        k3mini_checkpoints::locate(&at(Path::new(path))).map_err(|e| refusal(e.to_string()))?;
    let files = k3mini_checkpoints::verify(&dir).map_err(|e| refusal(e.to_string()))?;
    let plan = checkpoint_plan(&files)
        .map_err(|e| refusal(format!("checkpoint {}: {e}", dir.display())))?;
    // Named in the plan as it is on disk (`../` resolved), so the plan does not change with the
    // recipe's spelling of it.
    let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
    Ok((plan.model, Some(dir)))
}

fn model_config(table: &toml::Table) -> Result<ModelConfig, Refusal> {
    let mut overrides = table.clone();
    let preset = match overrides.remove("preset") {
        Some(toml::Value::String(s)) => s,
        _ => {
            return refuse(
                "model.preset",
                format!("must name a preset: {}", PRESETS.join(", ")),
            );
        }
    };
    resolve(&preset, &overrides).map_err(|e| {
        let key = if e.field == "preset" || e.field == "model" {
            "model.preset".into()
        } else {
            format!("model.{}", e.field)
        };
        (key, e.message)
    })
}

/// Refuses a model no machine could train; the exact estimate against this machine is `train`'s.
fn check_model_size(m: &ModelConfig) -> Result<(), Refusal> {
    let bytes = coarse_training_bytes(m);
    if bytes > MAX_TRAINING_BYTES {
        return refuse(
            "model",
            format!(
                "training this model needs about {} for weights, gradients and AdamW moments \
                 alone (vocab_size {}, d_model {}, n_layers {}): beyond any machine",
                crate::units::bytes(bytes),
                m.vocab_size,
                m.d_model,
                m.n_layers
            ),
        );
    }
    Ok(())
}

/// A coarse f64 bound on training bytes (16 per parameter), so that absurd sizes cannot overflow
/// the exact usize accounting of `k3mini_student::info`, which is asked only once this is sane.
fn coarse_training_bytes(m: &ModelConfig) -> f64 {
    let f = |x: usize| x as f64;
    let d = f(m.d_model);
    let head = [
        m.kda.head_dim,
        m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim,
        m.mla.v_head_dim,
        m.mla.kv_lora_rank,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let inner = f(m.n_heads) * f(head);
    let ffn = match &m.moe {
        Some(e) => f(e.num_experts + e.num_shared_experts) * f(e.expert_hidden),
        None => f(m.ffn_hidden),
    };
    let per_layer = d * (8.0 * inner + 3.0 * ffn) + f(m.mla.kv_lora_rank) * 2.0 * inner;
    16.0 * (2.0 * f(m.vocab_size) * d + f(m.n_layers) * per_layer)
}

fn data_plan(
    d: &DataConfig,
    distill: Option<&DistillPlan>,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<DataPlan, Refusal> {
    let mut sources = Vec::new();
    for (i, source) in d.sources.iter().enumerate() {
        let path = at(&source.path);
        if !path.exists() {
            return refuse(
                &format!("data.sources.{i}.path"),
                format!("{} does not exist", path.display()),
            );
        }
        let format = source.format.unwrap_or_else(|| SourceFormat::infer(&path));
        if source.chat.is_some() && format != SourceFormat::Jsonl {
            return refuse(
                &format!("data.sources.{i}.chat"),
                "chat sources are JSONL (one conversation per line)",
            );
        }
        if !(source.weight > 0.0 && source.weight.is_finite()) {
            return refuse(
                &format!("data.sources.{i}.weight"),
                format!("{}: a share must be positive", source.weight),
            );
        }
        let from_shards = distill.is_some_and(|d| {
            matches!(
                d.mode,
                ModePlan::Offline | ModePlan::OnPolicy(_) | ModePlan::Traffic { .. }
            )
        });
        if from_shards && source.weight != 1.0 {
            return refuse(
                &format!("data.sources.{i}.weight"),
                "training from scored shards draws every scored segment alike, so a source's \
                 weight would be ignored: weights mix plain and online runs only",
            );
        }
        if source.held_out && distill.is_some_and(|d| d.mode != ModePlan::Online) {
            return refuse(
                &format!("data.sources.{i}.held_out"),
                "this mode trains from the teacher's shards, split by data.held_out_fraction \
                 alone: a source held out whole is for plain and online runs",
            );
        }
        sources.push(SourcePlan {
            field: source.field().to_string(),
            path,
            format,
            chat: source.chat,
            weight: source.weight,
            held_out: source.held_out,
        });
    }
    let tokenizer = if d.tokenizer == TEACHER_TOKENIZER {
        match distill.map(|d| &d.teacher.source) {
            Some(TeacherSource::Local { model, .. }) => TokenizerSpec::Teacher {
                model: model.clone(),
            },
            Some(TeacherSource::Served { .. }) => {
                return refuse(
                    "data.tokenizer",
                    "a served teacher's tokenizer is not available here: name the tokenizer.json \
                     (or built-in vocabulary) the teacher uses; k3mini checks the server agrees",
                );
            }
            None => {
                return refuse(
                    "data.tokenizer",
                    "`teacher` needs a [teacher] table naming the teacher",
                );
            }
        }
    } else if fetch::known(&d.tokenizer, Kind::Teacher).is_some() {
        // A built-in teacher's vocabulary, for runs that have no teacher of their own (one that
        // becomes a teacher, whose students must share it).
        TokenizerSpec::Teacher {
            model: LocalModel::Builtin {
                name: d.tokenizer.clone(),
            },
        }
    } else if Tokenizer::builtin(&d.tokenizer).is_some() {
        TokenizerSpec::Builtin {
            name: d.tokenizer.clone(),
        }
    } else {
        let path = at(Path::new(&d.tokenizer));
        if !path.is_file() {
            return refuse(
                "data.tokenizer",
                format!(
                    "not `kimi`, `teacher` or a built-in teacher's name (smollm2), and no file \
                     at {}",
                    path.display()
                ),
            );
        }
        TokenizerSpec::File { path }
    };
    Ok(DataPlan {
        tokenizer,
        seq_len: d.seq_len,
        packing: d.packing,
        held_out_fraction: d.held_out_fraction,
        train_on: d.train_on.clone(),
        sources,
    })
}

fn burn() -> Engine {
    Engine::Burn
}

fn local_model(name: &str, at: &dyn Fn(&Path) -> PathBuf) -> Result<LocalModel, Refusal> {
    LocalModel::parse(name, at).map_err(|e| ("teacher.model".to_string(), e))
}

impl LocalModel {
    /// A local teacher's name: a built-in one, or a GGUF file (`at` makes a path absolute).
    pub fn parse(name: &str, at: &dyn Fn(&Path) -> PathBuf) -> Result<Self, String> {
        if fetch::known(name, Kind::Teacher).is_some() {
            return Ok(Self::Builtin { name: name.into() });
        }
        let path = at(Path::new(name));
        if path.is_dir() {
            return Err(format!(
                "{} is a directory, not a GGUF file",
                path.display()
            ));
        }
        if !path.is_file() {
            return Err(format!(
                "{name}: not a built-in teacher (smollm2) and no file at {}",
                path.display()
            ));
        }
        Ok(Self::Gguf { path })
    }
}

fn teacher_plan(
    t: &TeacherConfig,
    tokenizer: &str,
    out_dir: &Path,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<TeacherPlan, Refusal> {
    let source = match (&t.model, t.endpoints.is_empty()) {
        (Some(model), true) => {
            if !t.engine.built() {
                return refuse(
                    "teacher.engine",
                    format!(
                        "{}: this k3mini was built without it (--no-default-features); rebuild \
                         with the default features, or set engine = \"burn\"",
                        t.engine
                    ),
                );
            }
            TeacherSource::Local {
                model: local_model(model, at)?,
                engine: t.engine,
            }
        }
        (None, false) => TeacherSource::Served {
            endpoints: t.endpoints.clone(),
            api: t.api,
            api_key_env: t.api_key_env.clone(),
            tokenizer: match &t.tokenizer {
                Some(name) if Tokenizer::builtin(name).is_some() => Some(name.clone()),
                Some(path) => Some(at(Path::new(path)).display().to_string()),
                None => None,
            },
        },
        _ => {
            return refuse(
                "teacher",
                "give either `model` (a local teacher) or `endpoints` (served ones)",
            );
        }
    };
    if t.tokenizer.is_some() && t.model.is_some() {
        return refuse(
            "teacher.tokenizer",
            "a local teacher's tokenizer is the one in its GGUF (this is for served `endpoints`)",
        );
    }
    if let Some(name) = &t.api_key_env {
        if t.model.is_some() {
            return refuse(
                "teacher.api_key_env",
                "a local teacher takes no API key (it is for served `endpoints`)",
            );
        }
        if name.is_empty() || name.contains(['=', '\0']) {
            return refuse(
                "teacher.api_key_env",
                format!(
                    "{name:?} is not an environment variable's name (it names the variable holding the key, not the key)"
                ),
            );
        }
    }
    if t.concurrency == 0 {
        return refuse("teacher.concurrency", "must be positive");
    }
    if t.k == 0 {
        return refuse("teacher.k", "must be positive");
    }
    if t.temperature != 1.0 {
        return refuse(
            "teacher.temperature",
            format!(
                "{}: teachers are scored at temperature 1 (their own distribution); temper the \
                 signals with distill.temperature instead",
                t.temperature
            ),
        );
    }
    if t.segments_per_shard == 0 {
        return refuse("teacher.segments_per_shard", "must be positive");
    }
    let Some(logprob_step) = Storage::from_step(t.logprob_step) else {
        return refuse(
            "teacher.logprob_step",
            format!(
                "{}: 0 (exact f32 logprobs, schema v1 shards) or a positive step in nats",
                t.logprob_step
            ),
        );
    };
    let generate = match &t.generate {
        Some(g) => Some(generate_plan(g, tokenizer, out_dir, at)?),
        None => None,
    };
    let routing = routing_plan(t, &source)?;
    Ok(TeacherPlan {
        source,
        concurrency: t.concurrency,
        k: t.k,
        logprob_temperature: t.temperature,
        segments_per_shard: t.segments_per_shard,
        logprob_step,
        shards_dir: t
            .shards_dir
            .as_deref()
            .map_or_else(|| out_dir.join("shards"), absolute),
        routing,
        generate,
    })
}

/// Whether `teacher score` harvests routing, and where the teacher's routing comes from.
fn routing_plan(t: &TeacherConfig, source: &TeacherSource) -> Result<Option<RoutingPlan>, Refusal> {
    Ok(match (t.routing, &t.routing_shape, source) {
        (false, None, _) => None,
        (false, Some(_), _) => {
            return refuse(
                "teacher.routing_shape",
                "is given but teacher.routing is false: set routing = true to harvest routing",
            );
        }
        (true, None, TeacherSource::Local { engine, .. }) => {
            if *engine != Engine::LlamaCpp {
                return refuse(
                    "teacher.routing",
                    "a local teacher's routing is read through llama.cpp's graph hooks: set \
                     engine = \"llama-cpp\"",
                );
            }
            Some(RoutingPlan::Model)
        }
        (true, Some(_), TeacherSource::Local { .. }) => {
            return refuse(
                "teacher.routing_shape",
                "a local teacher's routing comes from its GGUF: remove routing_shape",
            );
        }
        (true, None, TeacherSource::Served { .. }) => {
            return refuse(
                "teacher.routing",
                "a served teacher's routed experts are checked against its routing: give \
                 routing_shape = { layers, k, experts, moe_layers } from its configuration",
            );
        }
        (true, Some(shape), TeacherSource::Served { api, .. }) => {
            if *api == Api::Openai {
                return refuse(
                    "teacher.routing",
                    "OpenAI-echo servers return no routed experts: use api = \"vllm\" or \
                     \"sglang\"",
                );
            }
            if let Some(why) = shape.invalid() {
                return refuse("teacher.routing_shape", why);
            }
            Some(RoutingPlan::Given {
                shape: shape.clone(),
            })
        }
    })
}

/// `tokenizer` is `data.tokenizer`: its vocabulary's chat format is the default template.
fn generate_plan(
    g: &GenerateConfig,
    tokenizer: &str,
    out_dir: &Path,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<GeneratePlan, Refusal> {
    if g.prompts.is_empty() {
        return refuse("teacher.generate.prompts", "names no prompt set");
    }
    let mut sets = Vec::new();
    for (i, p) in g.prompts.iter().enumerate() {
        let key = format!("teacher.generate.prompts.{i}");
        if p.limit == Some(0) {
            return refuse(&format!("{key}.limit"), "must be positive");
        }
        sets.push(match (&p.path, &p.dataset) {
            (Some(path), None) => {
                let path = at(path);
                if !path.is_file() {
                    return refuse(
                        &format!("{key}.path"),
                        format!("{} does not exist", path.display()),
                    );
                }
                PromptSet::Jsonl {
                    path,
                    limit: p.limit,
                }
            }
            (None, Some(name)) => {
                if fetch::known(name, Kind::Dataset).is_none() {
                    return refuse(
                        &format!("{key}.dataset"),
                        format!("{name:?} is not a built-in prompt set (champ)"),
                    );
                }
                PromptSet::Builtin {
                    name: name.clone(),
                    limit: p.limit,
                }
            }
            _ => {
                return refuse(
                    &key,
                    "give either `path` (a JSONL file) or `dataset` (a built-in set: champ)",
                );
            }
        });
    }
    if g.max_tokens == 0 || g.prompts_per_shard == 0 {
        return refuse(
            "teacher.generate",
            "max_tokens and prompts_per_shard must be positive",
        );
    }
    if !(g.temperature >= 0.0 && g.temperature.is_finite()) {
        return refuse(
            "teacher.generate.temperature",
            format!("must be 0 (greedy) or positive, got {}", g.temperature),
        );
    }
    if !(g.top_p > 0.0 && g.top_p <= 1.0) {
        return refuse(
            "teacher.generate.top_p",
            format!("must be in (0, 1], got {}", g.top_p),
        );
    }
    Ok(GeneratePlan {
        max_tokens: g.max_tokens,
        sampling_temperature: g.temperature,
        top_p: g.top_p,
        prompts_per_shard: g.prompts_per_shard,
        out_dir: g
            .out_dir
            .as_deref()
            .map_or_else(|| out_dir.join("trajectories"), absolute),
        prompts: PromptPlan {
            sets,
            template: g
                .template
                .unwrap_or_else(|| ChatFormat::of_vocabulary(Tokenizer::builtin(tokenizer))),
            system: g.system.clone(),
        },
    })
}

fn distill_plan(
    d: &DistillConfig,
    teacher: TeacherPlan,
    model: &ModelConfig,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<DistillPlan, Refusal> {
    if d.objectives.is_empty() {
        return refuse("distill.objectives", "names no objective");
    }
    if d.on_policy.is_some() && d.mode != DistillMode::OnPolicy {
        return refuse("distill.on_policy", "applies to mode = \"on_policy\" only");
    }
    if d.traffic.is_some() != (d.mode == DistillMode::Traffic) {
        return refuse(
            "distill.traffic",
            "names the directory `k3mini agent serve --traffic` wrote: give it with mode = \
             \"traffic\", and only then",
        );
    }
    if !(d.temperature > 0.0 && d.temperature.is_finite()) {
        return refuse(
            "distill.temperature",
            format!("must be positive, got {}", d.temperature),
        );
    }
    let mut objectives = Vec::new();
    let (mut router_kl, mut alm) = (None, None);
    for (i, o) in d.objectives.iter().enumerate() {
        check_objective(i, o)?;
        if o.weight == 0.0 {
            continue;
        }
        match (o.kind, o.objective()) {
            (_, Some(objective)) => objectives.push(WeightedObjective {
                weight: o.weight,
                objective,
            }),
            (ObjectiveKind::Alm, None) => {
                alm = Some(AlmPlan {
                    weight: o.weight,
                    temperature: o
                        .binarization_temperature
                        .unwrap_or(DEFAULT_ALM_TEMPERATURE),
                })
            }
            (_, None) => router_kl = Some(router_kl_plan(i, o, d.mode, &teacher, model, at)?),
        }
    }
    if objectives.is_empty() && router_kl.is_none() && alm.is_none() {
        return refuse("distill.objectives", "every weight is 0");
    }
    let vocabulary = cross_vocabulary(d, &teacher)?;
    let needs_prompts = || {
        teacher.generate.as_ref().ok_or((
            "distill.mode".to_string(),
            "`sequence` and `on_policy` need prompts: add [teacher.generate]".to_string(),
        ))
    };
    let mode = match d.mode {
        DistillMode::Offline => ModePlan::Offline,
        DistillMode::Online => ModePlan::Online,
        DistillMode::Sequence => ModePlan::Sequence {
            trajectories: needs_prompts()?.out_dir.clone(),
        },
        DistillMode::Traffic => {
            let dir = d.traffic.as_deref().map(absolute).expect("checked above");
            match read_traffic(&dir) {
                Ok(Some(m)) if !m.shards.is_empty() => ModePlan::Traffic {
                    shards: m.shards.len(),
                    digest: shards_digest(&m.shards),
                    dir,
                },
                Ok(Some(_)) => {
                    return refuse(
                        "distill.traffic",
                        format!(
                            "{}: no request has been escalated into it yet",
                            dir.display()
                        ),
                    );
                }
                Ok(None) => {
                    return refuse(
                        "distill.traffic",
                        format!(
                            "{}: no traffic manifest; `k3mini agent serve --traffic {}` writes one",
                            dir.display(),
                            dir.display()
                        ),
                    );
                }
                Err(e) => return refuse("distill.traffic", e.to_string()),
            }
        }
        DistillMode::OnPolicy => {
            let prompts = needs_prompts()?.prompts.clone();
            let o = d.on_policy.clone().unwrap_or_default();
            if !(o.mix > 0.0 && o.mix <= 1.0) {
                return refuse(
                    "distill.on_policy.mix",
                    format!("must be in (0, 1], got {}", o.mix),
                );
            }
            if o.max_tokens == 0 {
                return refuse("distill.on_policy.max_tokens", "must be positive");
            }
            if !(o.temperature >= 0.0 && o.temperature.is_finite()) {
                return refuse(
                    "distill.on_policy.temperature",
                    format!("must be 0 (greedy) or positive, got {}", o.temperature),
                );
            }
            ModePlan::OnPolicy(OnPolicyPlan {
                mix: o.mix,
                max_tokens: o.max_tokens,
                sampling_temperature: o.temperature,
                prompts,
            })
        }
    };
    Ok(DistillPlan {
        tau: d.temperature,
        mode,
        objectives,
        router_kl,
        alm,
        vocabulary,
        teacher,
    })
}

impl DistillPlan {
    /// Each weighted objective and what its teacher must be, one line each (`recipe check`).
    pub fn objective_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .objectives
            .iter()
            .map(|o| {
                let needs = match o.objective {
                    Objective::CrossEntropy => "hard labels: any teacher",
                    Objective::Xtoken => {
                        "cross-vocabulary: the teacher's top-k projected onto the student's ids"
                    }
                    _ => "same vocabulary: compares the teacher's ids with the student's",
                };
                format!("{} × {} ({needs})", o.weight, o.objective.name())
            })
            .collect();
        if let Some(a) = &self.alm {
            lines.push(format!(
                "{} × alm (cross-vocabulary: aligned chunks' likelihoods, binarised at T = {})",
                a.weight, a.temperature
            ));
        }
        if let Some(rk) = &self.router_kl {
            lines.push(format!(
                "{} × router_kl (the teacher's MoE routing)",
                rk.weight
            ));
        }
        lines
    }
}

/// tokenkit's default binarisation temperature for ALM's chunk divergence.
const DEFAULT_ALM_TEMPERATURE: f64 = 100.0;

/// The vocabulary the objectives need the teacher in: its own where `alm` or `xtoken` is
/// weighted, which only `ce` may join (the other objectives compare distributions id by id),
/// from `teacher score` shards (mode `offline`), without routing, and with a served teacher's
/// tokenizer named.
fn cross_vocabulary(d: &DistillConfig, teacher: &TeacherPlan) -> Result<Vocabulary, Refusal> {
    let weighted = || {
        d.objectives
            .iter()
            .enumerate()
            .filter(|(_, o)| o.weight > 0.0)
    };
    let Some((_, cross)) = weighted().find(|(_, o)| o.kind.cross_vocabulary()) else {
        return Ok(Vocabulary::Same);
    };
    if let Some((i, o)) = weighted().find(|(_, o)| o.kind.needs_one_vocabulary()) {
        return refuse(
            &format!("distill.objectives.{i}.kind"),
            format!(
                "{} needs a teacher of the student's vocabulary (it compares the two \
                 distributions id by id), but {} reads a teacher of its own: a cross-vocabulary \
                 recipe weights `ce`, `alm` and `xtoken` only",
                kind_name(o.kind),
                kind_name(cross.kind)
            ),
        );
    }
    if d.mode != DistillMode::Offline {
        return refuse(
            "distill.mode",
            format!(
                "{} (cross-vocabulary) trains from `teacher score`'s aligned shards: mode = \
                 \"offline\"",
                kind_name(cross.kind)
            ),
        );
    }
    if teacher.routing.is_some() {
        return refuse(
            "teacher.routing",
            "aligned shards (alm / xtoken) carry no routing: router distillation needs a teacher \
             of the student's vocabulary",
        );
    }
    if let TeacherSource::Served {
        tokenizer: None, ..
    } = teacher.source
    {
        return refuse(
            "teacher.tokenizer",
            "a served teacher distilled across vocabularies (alm / xtoken) needs its own \
             tokenizer named: a tokenizer.json or a built-in vocabulary",
        );
    }
    Ok(Vocabulary::Cross)
}

/// An objective as a recipe spells it.
fn kind_name(kind: ObjectiveKind) -> String {
    toml::Value::try_from(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{kind:?}"))
}

/// `router_kl`'s design, read and matched against the student and the teacher.
fn router_kl_plan(
    i: usize,
    o: &ObjectiveConfig,
    mode: DistillMode,
    teacher: &TeacherPlan,
    model: &ModelConfig,
    at: &dyn Fn(&Path) -> PathBuf,
) -> Result<RouterKlPlan, Refusal> {
    let key = format!("distill.objectives.{i}");
    if mode != DistillMode::Offline {
        return refuse(
            &key,
            "router_kl reads the routing shards `teacher score` writes beside the signal shards: \
             mode = \"offline\" only",
        );
    }
    if teacher.routing.is_none() {
        return refuse(
            &key,
            "router_kl needs the teacher's routing: set teacher.routing = true and score",
        );
    }
    let Some(rel) = &o.design else {
        return refuse(
            &format!("{key}.design"),
            "router_kl needs the design.json `k3mini routing design` wrote",
        );
    };
    let path = at(rel);
    let design = k3mini_data::design::Design::read(&path)
        .map_err(|e| (format!("{key}.design"), e.to_string()))?;
    let Some(moe) = &model.moe else {
        return refuse(
            &key,
            "router_kl distils routers: the student has no [model.moe]",
        );
    };
    let want = (
        design.num_experts,
        design.n_layers,
        design.first_dense_layers,
    );
    let have = (moe.num_experts, model.n_layers, moe.first_dense_layers);
    if want != have {
        return refuse(
            &key,
            format!(
                "{} designs {} experts over {} layers ({} dense); the student has {} over {} ({} dense)",
                path.display(),
                want.0,
                want.1,
                want.2,
                have.0,
                have.1,
                have.2
            ),
        );
    }
    if let Some(RoutingPlan::Given { shape }) = &teacher.routing
        && *shape != design.teacher_shape
    {
        return refuse(
            &key,
            format!(
                "{} was designed from routing {:?}; teacher.routing_shape is {:?}",
                path.display(),
                design.teacher_shape,
                shape
            ),
        );
    }
    Ok(RouterKlPlan {
        weight: o.weight,
        path,
        design,
    })
}

fn check_objective(i: usize, o: &ObjectiveConfig) -> Result<(), Refusal> {
    let key = |field: &str| format!("distill.objectives.{i}.{field}");
    if !(o.weight >= 0.0 && o.weight.is_finite()) {
        return refuse(&key("weight"), format!("must be ≥ 0, got {}", o.weight));
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
                return refuse(&key(name), format!("does not apply to {:?}", o.kind));
            }
            Some(v) if !(v > 0.0 && v < 1.0) => {
                return refuse(&key(name), format!("must be in (0, 1), got {v}"));
            }
            _ => {}
        }
    }
    match o.binarization_temperature {
        Some(_) if o.kind != ObjectiveKind::Alm => {
            return refuse(&key("binarization_temperature"), "applies to `alm` only");
        }
        Some(t) if !(t > 0.0 && t.is_finite()) => {
            return refuse(
                &key("binarization_temperature"),
                format!("must be positive, got {t}"),
            );
        }
        _ => {}
    }
    if o.design.is_some() && o.kind != ObjectiveKind::RouterKl {
        return refuse(&key("design"), "applies to `router_kl` only");
    }
    match o.samples {
        Some(_) if o.kind != ObjectiveKind::Sampled => {
            refuse(&key("samples"), "applies to `sampled` only")
        }
        Some(0) => refuse(&key("samples"), "must be positive"),
        _ => Ok(()),
    }
}

/// The loop, the optimizer, the schedule and the data shapes.
fn check_loop(r: &Recipe, model: &ModelConfig) -> Result<(), Refusal> {
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
        (
            "train.collective_timeout_s",
            r.train.collective_timeout_s.min(usize::MAX as u64) as usize,
        ),
    ];
    for (key, v) in positive {
        if v == 0 {
            return refuse(key, "must be positive");
        }
    }
    if r.train.weights_shard_bytes == 0 {
        return refuse("train.weights_shard_bytes", "must be positive");
    }
    if r.data.sources.is_empty() {
        return refuse("data.sources", "needs at least one source");
    }
    if !(0.0..1.0).contains(&r.data.held_out_fraction) {
        return refuse(
            "data.held_out_fraction",
            format!("must be in [0, 1), got {}", r.data.held_out_fraction),
        );
    }
    if r.data.seq_len < 2 {
        return refuse(
            "data.seq_len",
            "must be at least 2 (inputs and next-token targets)",
        );
    }
    if r.data.seq_len > model.max_seq_len {
        return refuse(
            "data.seq_len",
            format!("exceeds the model's max_seq_len {}", model.max_seq_len),
        );
    }
    let o = &r.optim;
    if !(o.lr > 0.0 && o.lr.is_finite()) {
        return refuse("optim.lr", format!("must be positive, got {}", o.lr));
    }
    if o.betas.iter().any(|b| !(0.0..1.0).contains(b)) {
        return refuse(
            "optim.betas",
            format!("each must be in [0, 1), got {:?}", o.betas),
        );
    }
    if !(o.eps > 0.0) {
        return refuse("optim.eps", "must be positive");
    }
    if !(o.weight_decay >= 0.0) {
        return refuse("optim.weight_decay", "must be non-negative");
    }
    if o.grad_clip.is_some_and(|c| !(c > 0.0)) {
        return refuse(
            "optim.grad_clip",
            "must be positive (omit it to disable clipping)",
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
                return refuse("schedule.min_lr_ratio", "must be in [0, 1]");
            }
            *warmup_steps
        }
    };
    if warmup >= r.train.steps {
        return refuse(
            "schedule.warmup_steps",
            format!("must be below train.steps ({})", r.train.steps),
        );
    }
    if let ScheduleConfig::Wsd { decay_fraction, .. } = &r.schedule
        && !(*decay_fraction > 0.0 && *decay_fraction <= 1.0)
    {
        return refuse("schedule.decay_fraction", "must be in (0, 1]");
    }
    let per_micro = r.train.micro_batch.saturating_mul(r.data.seq_len);
    if r.train.batch_tokens % per_micro != 0 {
        return refuse(
            "train.batch_tokens",
            format!(
                "{} is not a multiple of micro_batch x seq_len = {per_micro}",
                r.train.batch_tokens
            ),
        );
    }
    if r.train.batch_tokens / per_micro > MAX_ACCUMULATION {
        return refuse(
            "train.batch_tokens",
            format!(
                "{} tokens per step is {} micro-batches of {per_micro} tokens: at most \
                 {MAX_ACCUMULATION} are accumulated per step (raise micro_batch, or lower \
                 batch_tokens)",
                r.train.batch_tokens,
                r.train.batch_tokens / per_micro
            ),
        );
    }
    Ok(())
}
