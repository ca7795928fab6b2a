//! A recipe's teacher: a local one (a built-in name, fetched into the cache when missing, or a
//! llama-architecture `.gguf`) or served ones, probed for tokenizer agreement.

use crate::recipe::{GenerateConfig, LoadedRecipe, TeacherConfig};
use anyhow::Result;
use k3mini_data::chat::{Message, Role, check_markers, render};
use k3mini_data::prompts::{read_champ, read_prompts};
use k3mini_data::shards::ShardMeta;
use k3mini_teacher::Teacher;
use k3mini_teacher::client::{Api, ClientOptions, HttpTeacher, piece_map};
use k3mini_teacher::fetch::{self, Kind};
use k3mini_teacher::generate::PromptIds;
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::manifest::Manifest;
use k3mini_teacher::score::{ScoreJob, ScoreManifestJob, ScoreProgress, score_corpus};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A built-in teacher's GGUF (fetched when missing; progress on stderr) or an existing file.
pub fn resolve(teacher: &str) -> Result<PathBuf> {
    if fetch::known(teacher, Kind::Teacher).is_some() {
        return Ok(fetch::fetch(
            teacher,
            Kind::Teacher,
            &fetch::cache_dir(),
            &mut |l| eprintln!("{l}"),
        )?);
    }
    let path = Path::new(teacher);
    anyhow::ensure!(
        path.is_file(),
        "{teacher}: not a built-in teacher (smollm2) and no such file"
    );
    Ok(path.to_path_buf())
}

/// The tokenizer stored in a GGUF teacher's metadata.
pub fn gguf_tokenizer(path: &Path) -> Result<k3mini_data::Tokenizer> {
    let file = k3mini_checkpoints::gguf::GgufFile::open(path)?;
    Ok(k3mini_teacher::gguf::load_tokenizer(&file)?.0)
}

/// The student's tokenizer: the recipe's, or for `data.tokenizer = "teacher"` the local GGUF
/// teacher's.
pub fn student_tokenizer(recipe: &LoadedRecipe) -> Result<k3mini_data::Tokenizer> {
    if recipe.recipe.data.tokenizer != crate::recipe::TEACHER_TOKENIZER {
        return Ok(recipe.tokenizer()?);
    }
    let model = recipe
        .recipe
        .teacher
        .as_ref()
        .and_then(|t| t.model.as_ref())
        .expect("the recipe check requires a local [teacher] for tokenizer = \"teacher\"");
    gguf_tokenizer(&local_teacher_path(recipe, model)?)
}

/// `teacher.model` of a recipe: a built-in name, or a path relative to the recipe.
pub fn local_teacher_path(recipe: &LoadedRecipe, model: &str) -> Result<PathBuf> {
    if fetch::known(model, Kind::Teacher).is_some() {
        resolve(model)
    } else {
        resolve(&recipe.resolve_path(Path::new(model)).display().to_string())
    }
}

/// Text whose tokenization exercises digits, whitespace, punctuation and multi-byte characters:
/// the probe that a served teacher tokenizes as the student does.
const PROBE: &str = "Hello, world! In 2026, 12345 + 678 = 13023.\n\tdef f(x):\n\t\treturn x ** 2  # café naïve 中文 😀";

/// A recipe's teacher (local, or served and probed) and the tokenizer both sides agree on.
pub fn recipe_teacher(
    recipe: &LoadedRecipe,
) -> Result<(
    &TeacherConfig,
    Arc<dyn Teacher + Send + Sync>,
    k3mini_data::Tokenizer,
)> {
    let path = recipe.path.display();
    let Some(tc) = &recipe.recipe.teacher else {
        anyhow::bail!("{path}: no [teacher] table");
    };
    let mismatch = |what: &str| {
        anyhow::anyhow!(
            "{path}: data.tokenizer and the teacher's tokenizer differ ({what}): the teacher's ids \
             would mean other tokens to the student. Use the teacher's tokenizer (cross-tokenizer \
             distillation is not supported yet)."
        )
    };
    Ok(match &tc.model {
        Some(model) => {
            let file = local_teacher_path(recipe, model)?;
            let local = LocalTeacher::from_gguf(&file, &burn::tensor::Device::default())?;
            let tokenizer = if recipe.recipe.data.tokenizer == crate::recipe::TEACHER_TOKENIZER {
                local.tokenizer.clone()
            } else {
                let student = recipe.tokenizer()?;
                if student.fingerprint() != local.tokenizer.fingerprint() {
                    return Err(mismatch(
                        "their id → token tables have different fingerprints",
                    ));
                }
                student
            };
            (tc, Arc::new(local), tokenizer)
        }
        None => {
            let tokenizer = recipe.tokenizer()?;
            // OpenAI-echo servers may name tokens by text: map it back through the tokenizer.
            let pieces = (tc.api == Api::Openai).then(|| {
                Arc::new(piece_map(tokenizer.vocab_size(), |id| {
                    tokenizer.decode(&[id]).ok()
                }))
            });
            let opts = ClientOptions {
                api: tc.api,
                pieces,
                ..Default::default()
            };
            let remote = HttpTeacher::connect(&tc.endpoints, tokenizer.vocab_size(), opts)?;
            if remote.token_ids(PROBE)? != tokenizer.encode(PROBE)? {
                return Err(mismatch("the server tokenizes a probe text differently"));
            }
            (tc, Arc::new(remote), tokenizer)
        }
    })
}

/// The recipe's prompt sets, rendered and tokenized.
pub fn recipe_prompts(
    recipe: &LoadedRecipe,
    g: &GenerateConfig,
    tokenizer: &k3mini_data::Tokenizer,
    limit: Option<usize>,
) -> Result<Vec<PromptIds>> {
    check_markers(g.template, tokenizer).map_err(anyhow::Error::msg)?;
    let mut prompts = Vec::new();
    for source in &g.prompts {
        if limit.is_some_and(|l| prompts.len() >= l) {
            break; // no need to fetch sets past the limit
        }
        let mut set = match (&source.path, &source.dataset) {
            (Some(path), _) => read_prompts(&recipe.resolve_path(path))?,
            (_, Some(name)) => {
                let file = fetch::fetch(name, Kind::Dataset, &fetch::cache_dir(), &mut |l| {
                    eprintln!("{l}")
                })?;
                read_champ(&file)?
            }
            _ => unreachable!("the recipe check requires path or dataset"),
        };
        set.truncate(source.limit.unwrap_or(usize::MAX));
        prompts.extend(set);
    }
    prompts.truncate(limit.unwrap_or(usize::MAX));
    prompts
        .into_iter()
        .map(|p| {
            let mut messages = p.messages;
            if let Some(system) = &g.system
                && messages[0].role != Role::System
            {
                messages.insert(
                    0,
                    Message {
                        role: Role::System,
                        content: system.clone(),
                        thinking: None,
                    },
                );
            }
            let rendered = render(&messages, g.template, true)
                .map_err(|e| anyhow::anyhow!("prompt {}: {e}", p.id))?;
            Ok(PromptIds {
                id: p.id,
                ids: rendered.encode(tokenizer)?.0,
                reference: p.answer,
            })
        })
        .collect()
}

/// Scores the recipe's corpus with its teacher into shards under `out` (default: the recipe's
/// shards directory); a rerun skips finished shards. Returns the manifest and the directory.
pub fn score_recipe(
    recipe: &LoadedRecipe,
    out: Option<PathBuf>,
    on_progress: &mut dyn FnMut(ScoreProgress),
) -> Result<(Manifest<ScoreManifestJob>, PathBuf)> {
    let (tc, teacher, tokenizer) = recipe_teacher(recipe)?;
    anyhow::ensure!(
        tc.temperature == 1.0,
        "teacher.temperature {}: teachers are scored at temperature 1 (tempering from stored \
         logprobs happens in the distillation loss)",
        tc.temperature
    );
    let docs: Vec<Vec<u32>> = crate::train::trainer::tokenized_documents(recipe, &tokenizer)?
        .into_iter()
        .map(|d| d.ids)
        .collect();
    let job = ScoreJob {
        out_dir: out
            .or_else(|| recipe.shards_dir())
            .expect("a [teacher] recipe has a shard dir"),
        meta: ShardMeta {
            teacher: teacher.name().to_string(),
            tokenizer_sha256: tokenizer.fingerprint(),
            k: tc.k,
            temperature: tc.temperature,
        },
        seq_len: recipe.recipe.data.seq_len,
        segments_per_shard: tc.segments_per_shard,
        concurrency: tc.concurrency,
    };
    let manifest = score_corpus(teacher.as_ref(), &docs, &job, on_progress)?;
    Ok((manifest, job.out_dir))
}

/// The progress bar of a teacher job (scoring, generation): `unit`s done of a total set later,
/// a message, elapsed time and ETA; hidden when `quiet`.
pub fn progress_bar(quiet: bool, unit: &str) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{bar:30}} {{pos}}/{{len}} {unit}  {{msg}}  [{{elapsed}} < {{eta}}]"
        ))
        .expect("valid template"),
    )
}
