//! A plan's teacher: a local one (a built-in name, fetched into the cache when missing, or a
//! `.gguf`, on llama.cpp or burn) or served ones, probed for tokenizer agreement; the student's
//! tokenizer; prompt sets; scoring a plan's corpus.

use crate::device::DeviceList;
use crate::error::{Error, Result};
use crate::recipe::{
    DistillPlan, GeneratePlan, LocalModel, PromptPlan, PromptSet, RoutingPlan, RunPlan,
    TeacherSource, TokenizerSpec, Vocabulary,
};
use k3mini_data::Tokenizer;
use k3mini_data::align::Aligner;
use k3mini_data::chat::{Message, Role, check_markers, render};
use k3mini_data::prompts::{read_champ, read_prompts};
use k3mini_data::shards::{ShardMeta, Storage};
use k3mini_teacher::GenerateParams;
use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher, piece_map};
use k3mini_teacher::fetch::{self, Kind};
use k3mini_teacher::generate::{
    GenerateJob, GenerateManifestJob, GenerateProgress, PromptIds, generate_trajectories,
};
use k3mini_teacher::local::{Engine, EngineSpec, LocalTeacher};
use k3mini_teacher::manifest::Manifest;
use k3mini_teacher::score::{ScoreJob, ScoreManifestJob, ScoreProgress, score_corpus};
use k3mini_teacher::{PROBE, Teacher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A teacher named on a command line (a built-in name or a GGUF file), as a recipe's
/// `teacher.model` names one: its GGUF, a built-in one fetched when missing.
pub fn resolve(teacher: &str) -> Result<PathBuf> {
    let model = LocalModel::parse(teacher, &|p| p.to_path_buf()).map_err(Error::Refused)?;
    local_model_path(&model)
}

/// A local teacher's GGUF file (a built-in one is fetched when missing).
pub fn local_model_path(model: &LocalModel) -> Result<PathBuf> {
    match model {
        LocalModel::Builtin { name } => Ok(fetch::fetch(
            name,
            Kind::Teacher,
            &fetch::cache_dir(),
            &mut |l| crate::progress::observer().note(l),
        )?),
        LocalModel::Gguf { path } => Ok(path.clone()),
    }
}

/// A local teacher's GGUF on `engine`, on the main device of `devices`: burn opens it as a burn
/// device; llama.cpp computes on this machine's cores, or on CUDA device N.
pub fn open_local(path: &Path, engine: Engine, devices: &DeviceList) -> Result<LocalTeacher> {
    let spec = match engine {
        Engine::Burn => EngineSpec::Burn(devices.open_main()?),
        #[cfg(feature = "llama-cpp")]
        Engine::LlamaCpp => {
            use crate::device::DeviceKind;
            use k3mini_teacher::engine::llama_cpp::Placement;
            EngineSpec::LlamaCpp(match devices.kinds()[0] {
                DeviceKind::Cpu => Placement::Cpu {
                    threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
                },
                DeviceKind::Cuda(n) => Placement::Cuda(n),
            })
        }
        #[cfg(not(feature = "llama-cpp"))]
        Engine::LlamaCpp => {
            return Err(crate::refused!(
                "the llama-cpp engine: this k3mini was built without it (--no-default-features); \
                 rebuild with the default features, or use the burn engine"
            ));
        }
    };
    Ok(LocalTeacher::open(path, spec)?)
}

/// The tokenizer stored in a GGUF teacher's metadata.
pub fn gguf_tokenizer(path: &Path) -> Result<Tokenizer> {
    let file = k3mini_gguf::GgufFile::open(path)?;
    Ok(k3mini_teacher::gguf::load_tokenizer(&file)?.0)
}

/// The student's tokenizer: a built-in vocabulary, a tokenizer.json, or the local teacher's own.
pub fn student_tokenizer(spec: &TokenizerSpec) -> Result<Tokenizer> {
    Ok(match spec {
        TokenizerSpec::Builtin { name } => Tokenizer::load(name)?,
        TokenizerSpec::File { path } => Tokenizer::load(&path.display().to_string())?,
        TokenizerSpec::Teacher { model } => gguf_tokenizer(&local_model_path(model)?)?,
    })
}

/// `plan`'s tokenizer, refused unless it is `model`'s (by fingerprint): reading `plan`'s corpus
/// for a model trained in another vocabulary would feed it other tokens.
pub fn same_tokenizer(plan: &RunPlan, model: &Tokenizer) -> Result<Tokenizer> {
    let tokenizer = student_tokenizer(&plan.data.tokenizer)?;
    crate::ensure!(
        tokenizer.fingerprint() == model.fingerprint(),
        "{}: its data.tokenizer is not the model's (the id → token tables differ)",
        plan.recipe.display()
    );
    Ok(tokenizer)
}

/// The plan's teacher, checked to agree with the student's tokenizer: a local teacher's GGUF
/// vocabulary has the student's fingerprint, a served one tokenizes a probe text as the student
/// does (and its ids are read through the student's vocabulary). With `routing`, it returns each
/// scored sequence's routing as the plan's `teacher.routing` says.
pub fn plan_teacher(
    distill: &DistillPlan,
    devices: &DeviceList,
    student: &Tokenizer,
    routing: Option<&RoutingPlan>,
) -> Result<Arc<dyn Teacher + Send + Sync>> {
    let cross = distill.vocabulary == Vocabulary::Cross;
    Ok(match &distill.teacher.source {
        TeacherSource::Local { model, engine } => {
            let file = local_model_path(model)?;
            // A local teacher runs on the stage's main device.
            let mut local = open_local(&file, *engine, devices)?;
            if !cross && student.fingerprint() != local.tokenizer.fingerprint() {
                return Err(crate::refused!(
                    "data.tokenizer and the teacher's tokenizer differ (their id → token tables \
                     have different fingerprints): the teacher's ids would mean other tokens to \
                     the student. Use the teacher's tokenizer, or distil across vocabularies \
                     with the `alm` / `xtoken` objectives."
                ));
            }
            if routing.is_some() {
                local = local.record_routing()?;
            }
            Arc::new(local)
        }
        TeacherSource::Served {
            endpoints,
            api,
            api_key_env,
            ..
        } => {
            let api_key = match api_key_env {
                Some(name) => Some(std::env::var(name).map_err(|_| {
                    crate::refused!(
                        "teacher.api_key_env names {name}, which is not set (or not UTF-8): \
                         export the served teacher's API key in it"
                    )
                })?),
                None => None,
            };
            let opts = ClientOptions {
                api: *api,
                routing: match routing {
                    Some(RoutingPlan::Given { shape }) => Some(shape.clone()),
                    _ => None,
                },
                api_key,
                ..Default::default()
            };
            // Across vocabularies the server must tokenize as the teacher's own tokenizer does.
            let tokenizer = match cross {
                true => &teacher_tokenizer(distill)?,
                false => student,
            };
            Arc::new(connect_served(endpoints, tokenizer, opts)?)
        }
    })
}

/// The teacher's own tokenizer: a local teacher's GGUF's, or the one a served teacher's
/// `teacher.tokenizer` names.
pub fn teacher_tokenizer(distill: &DistillPlan) -> Result<Tokenizer> {
    match &distill.teacher.source {
        TeacherSource::Local { model, .. } => gguf_tokenizer(&local_model_path(model)?),
        TeacherSource::Served {
            tokenizer: Some(spec),
            ..
        } => Ok(Tokenizer::load(spec)?),
        TeacherSource::Served {
            tokenizer: None, ..
        } => Err(crate::refused!(
            "teacher.tokenizer: a served teacher of another vocabulary needs its tokenizer named \
             (a tokenizer.json or a built-in vocabulary)"
        )),
    }
}

/// A served teacher at `endpoints` whose ids mean what they mean to `student` (checked: the
/// server tokenizes a probe text as `student` does). OpenAI-echo servers, which may name tokens
/// by text, get the map back to ids.
pub fn connect_served(
    endpoints: &[String],
    student: &Tokenizer,
    mut opts: ClientOptions,
) -> Result<HttpTeacher> {
    if opts.api == Api::Openai {
        opts.pieces = Some(Arc::new(piece_map(student.vocab_size(), |id| {
            student.decode(&[id]).ok()
        })));
    }
    let remote = HttpTeacher::connect(endpoints, student.vocab_size(), opts)?;
    if remote.token_ids(PROBE)? != student.encode(PROBE)? {
        return Err(crate::refused!(
            "the served model at {} and the student tokenize a probe text differently: their \
             ids would mean other tokens (use its tokenizer, or distil across vocabularies \
             with `alm` / `xtoken` and name its tokenizer in teacher.tokenizer)",
            endpoints.join(", ")
        ));
    }
    Ok(remote)
}

/// The plan's prompt sets (the first `limit` prompts), rendered and tokenized.
pub fn plan_prompts(
    p: &PromptPlan,
    tokenizer: &Tokenizer,
    limit: Option<usize>,
) -> Result<Vec<PromptIds>> {
    check_markers(p.template, tokenizer)?;
    let mut prompts = Vec::new();
    for set in &p.sets {
        if limit.is_some_and(|l| prompts.len() >= l) {
            break; // no need to fetch sets past the limit
        }
        let (mut read, limit) = match set {
            PromptSet::Jsonl { path, limit } => (read_prompts(path)?, limit),
            PromptSet::Builtin { name, limit } => {
                let file = fetch::fetch(name, Kind::Dataset, &fetch::cache_dir(), &mut |l| {
                    crate::progress::observer().note(l)
                })?;
                (read_champ(&file)?, limit)
            }
        };
        read.truncate(limit.unwrap_or(usize::MAX));
        prompts.extend(read);
    }
    prompts.truncate(limit.unwrap_or(usize::MAX));
    prompts
        .into_iter()
        .map(|prompt| {
            let mut messages = prompt.messages;
            if let Some(system) = &p.system
                && messages[0].role != Role::System
            {
                messages.insert(0, Message::new(Role::System, system.clone()));
            }
            let rendered = render(&messages, &prompt.tools, p.template, true)
                .map_err(|e| crate::refused!("prompt {}: {e}", prompt.id))?;
            Ok(PromptIds {
                id: prompt.id,
                ids: rendered.encode(tokenizer)?.0,
                reference: prompt.answer,
            })
        })
        .collect()
}

/// Scores the plan's corpus with its teacher into shards under `out` (default: the plan's
/// shards directory); a rerun skips finished shards. Returns the manifest and the directory.
pub fn score_plan(
    plan: &RunPlan,
    distill: &DistillPlan,
    out: Option<PathBuf>,
    on_progress: &mut dyn FnMut(ScoreProgress),
) -> Result<(Manifest<ScoreManifestJob>, PathBuf)> {
    let tokenizer = student_tokenizer(&plan.data.tokenizer)?;
    let t = &distill.teacher;
    let teacher = plan_teacher(distill, &plan.devices, &tokenizer, t.routing.as_ref())?;
    // Across vocabularies the shards hold the student's ids, aligned once here.
    let cross = match distill.vocabulary {
        Vocabulary::Cross => Some(Arc::new(Aligner::new(
            &tokenizer,
            &teacher_tokenizer(distill)?,
        )?)),
        Vocabulary::Same => None,
    };
    let job = ScoreJob {
        out_dir: out.unwrap_or_else(|| t.shards_dir.clone()),
        meta: ShardMeta {
            teacher: teacher.name().to_string(),
            tokenizer_sha256: tokenizer.fingerprint(),
            k: t.k,
            temperature: t.logprob_temperature,
            vocab: Some(match cross {
                Some(_) => tokenizer.vocab_size(),
                None => teacher.vocab_size(),
            }),
        },
        // Aligned shards have their own schema, exact f32 (the v2 codec is per position).
        storage: match cross {
            Some(_) => Storage::Exact,
            None => t.logprob_step,
        },
        seq_len: plan.data.seq_len,
        segments_per_shard: t.segments_per_shard,
        concurrency: t.concurrency,
        sources_sha256: crate::corpus::sources_sha256(&plan.data)?,
        sources: crate::corpus::source_names(&plan.data),
        cross,
    };
    let open = || {
        crate::corpus::scoring_corpus(&plan.data, &tokenizer)
            .map_err(|e| k3mini_teacher::TeacherError::Request(e.to_string()))
    };
    let manifest = score_corpus(teacher.as_ref(), &open, &job, on_progress)?;
    Ok((manifest, job.out_dir))
}

/// Samples the teacher's answers to the first `limit` of `generate`'s prompts into trajectory
/// shards under `out` (default: the plan's); a rerun skips finished shards.
pub fn generate_plan(
    plan: &RunPlan,
    distill: &DistillPlan,
    generate: &GeneratePlan,
    out: Option<PathBuf>,
    limit: Option<usize>,
    on_progress: &mut dyn FnMut(GenerateProgress),
) -> Result<(Manifest<GenerateManifestJob>, PathBuf)> {
    if distill.vocabulary == Vocabulary::Cross {
        return Err(crate::refused!(
            "{}: its teacher has another vocabulary (alm / xtoken), so its completions would be \
             in the teacher's ids: cross-vocabulary recipes train from `teacher score`'s shards",
            plan.recipe_name()
        ));
    }
    let tokenizer = student_tokenizer(&plan.data.tokenizer)?;
    let teacher = plan_teacher(distill, &plan.devices, &tokenizer, None)?;
    let prompts = plan_prompts(&generate.prompts, &tokenizer, limit)?;
    // The turn ends at the template's end-of-turn marker (one id: check_markers made sure).
    let end_of_turn = tokenizer.encode_with_specials(generate.prompts.template.end_of_turn())?;
    let job = GenerateJob {
        out_dir: out.unwrap_or_else(|| generate.out_dir.clone()),
        params: GenerateParams {
            max_tokens: generate.max_tokens,
            temperature: generate.sampling_temperature,
            top_p: generate.top_p,
            seed: plan.seed,
            logprobs: distill.teacher.k,
            stop: end_of_turn,
        },
        teacher: teacher.name().to_string(),
        tokenizer_sha256: tokenizer.fingerprint(),
        prompts_per_shard: generate.prompts_per_shard,
        concurrency: distill.teacher.concurrency,
        format: generate.prompts.template,
    };
    let decode = |ids: &[u32]| Ok(tokenizer.decode(ids)?);
    let manifest = generate_trajectories(teacher.as_ref(), &prompts, &job, &decode, on_progress)?;
    Ok((manifest, job.out_dir))
}
