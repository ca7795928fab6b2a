//! `k3mini teacher`: fetch the built-in teachers and talk to them.

use anyhow::Result;
use burn::tensor::Device;
use clap::Subcommand;
use k3mini_data::ChatFormat;
use k3mini_data::chat::{Message, Role, render};
use k3mini_teacher::local::LocalTeacher;
use k3mini_teacher::{GenerateParams, Teacher, fetch};
use std::path::{Path, PathBuf};

#[derive(Subcommand)]
pub enum TeacherCommand {
    /// Download a built-in teacher (`smollm2`) into the cache and print its path.
    Fetch { name: String },
    /// Ask a local teacher one chat question (greedy unless --temperature is set).
    Chat {
        /// A built-in teacher name (fetched if needed) or a llama-architecture .gguf.
        teacher: String,
        question: String,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

/// A built-in teacher's GGUF (fetched when missing) or a path.
pub fn resolve(teacher: &str) -> Result<PathBuf> {
    if fetch::known(teacher).is_some() {
        return Ok(fetch::fetch(teacher, &fetch::cache_dir(), &mut |l| eprintln!("{l}"))?);
    }
    let path = Path::new(teacher);
    anyhow::ensure!(
        path.is_file(),
        "{teacher}: not a built-in teacher (smollm2) and no such file"
    );
    Ok(path.to_path_buf())
}

pub fn run(cmd: TeacherCommand) -> Result<()> {
    match cmd {
        TeacherCommand::Fetch { name } => {
            println!("{}", resolve(&name)?.display());
            Ok(())
        }
        TeacherCommand::Chat {
            teacher,
            question,
            max_tokens,
            temperature,
            seed,
        } => {
            let t = LocalTeacher::from_gguf(&resolve(&teacher)?, &Device::default())?;
            let messages = [Message {
                role: Role::User,
                content: question,
                thinking: None,
            }];
            let prompt = render(&messages, ChatFormat::Chatml, true).map_err(anyhow::Error::msg)?;
            let (ids, _) = prompt.encode(&t.tokenizer)?;
            let params = GenerateParams {
                max_tokens,
                temperature,
                seed,
                stop: t.meta.eos.into_iter().collect(),
                ..Default::default()
            };
            let started = std::time::Instant::now();
            let out = t.generate(&ids, &params)?;
            let secs = started.elapsed().as_secs_f64();
            println!("{}", t.tokenizer.decode(&out.ids)?.trim_end_matches("<|im_end|>"));
            eprintln!(
                "{} prompt + {} generated tokens in {secs:.1}s ({:?})",
                ids.len(),
                out.ids.len(),
                out.finish
            );
            Ok(())
        }
    }
}
