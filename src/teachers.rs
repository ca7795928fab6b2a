//! Finding a recipe's local teacher: a built-in name (fetched into the cache when missing) or a
//! llama-architecture `.gguf` path.

use crate::recipe::LoadedRecipe;
use anyhow::Result;
use k3mini_teacher::fetch::{self, Kind};
use std::path::{Path, PathBuf};

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

/// `teacher.model` of a recipe: a built-in name, or a path relative to the recipe.
pub fn local_teacher_path(recipe: &LoadedRecipe, model: &str) -> Result<PathBuf> {
    if fetch::known(model, Kind::Teacher).is_some() {
        resolve(model)
    } else {
        resolve(&recipe.resolve_path(Path::new(model)).display().to_string())
    }
}
