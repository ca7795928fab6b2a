//! Recipes: one TOML file describes a run. [`schema`] is the file as written (every table rejects
//! unknown keys); [`plan`] resolves and validates it, in one place, into the [`RunPlan`] a run
//! executes. Every error names the file, the line and the key
//! (`recipes/ci-tiny.toml:14: optim.lr: must be positive`).

pub mod plan;
pub mod reference;
pub mod schema;
pub mod smoke;

pub use plan::*;
pub use schema::*;
pub use smoke::{BaselineTolerances, SmokePlan};

use std::path::Path;

pub use crate::error::RecipeError;

/// Recipes are small: a larger "recipe" is not one (and is not read into memory whole).
const MAX_RECIPE_BYTES: u64 = 1 << 20;

/// Reads, parses, validates and resolves a recipe file.
pub fn load(path: &Path) -> Result<RunPlan, RecipeError> {
    load_with(path, |_| {})
}

/// [`load`], with the recipe's `[model]` replaced by `init = checkpoint` (`k3mini train --init`):
/// the run starts from that checkpoint's weights and model.
pub fn load_from(path: &Path, checkpoint: &Path) -> Result<RunPlan, RecipeError> {
    let init = std::path::absolute(checkpoint).unwrap_or_else(|_| checkpoint.to_path_buf());
    load_with(path, |r| {
        r.model = toml::Table::from_iter([(
            "init".to_string(),
            toml::Value::String(init.display().to_string()),
        )])
    })
}

/// A recipe file's run and its `[smoke]` (`k3mini smoke`; its defaults where the recipe has
/// none), resolved as [`load`] resolves the run.
pub fn load_smoke(path: &Path) -> Result<SmokePlan, RecipeError> {
    smoke_of(path, true).map(|s| s.expect("required"))
}

/// The recipe's own `[smoke]` table resolved (`recipe check`), or None when it has none.
pub fn smoke_table(path: &Path) -> Result<Option<SmokePlan>, RecipeError> {
    smoke_of(path, false)
}

fn smoke_of(path: &Path, required: bool) -> Result<Option<SmokePlan>, RecipeError> {
    let text = read(path)?;
    resolve_text(
        path,
        &text,
        |_| {},
        |r| {
            let smoke = r.smoke.clone();
            if smoke.is_none() && !required {
                return Ok(None);
            }
            smoke::resolve_smoke(resolve_plan(path, r)?, smoke).map(Some)
        },
    )
}

fn read(path: &Path) -> Result<String, RecipeError> {
    k3mini_durable::read_small(path, MAX_RECIPE_BYTES).map_err(|e| RecipeError {
        file: path.to_path_buf(),
        line: None,
        key: String::new(),
        message: format!("cannot read a recipe (a TOML file): {e}"),
    })
}

fn load_with(path: &Path, edit: impl FnOnce(&mut Recipe)) -> Result<RunPlan, RecipeError> {
    parse_with(path, &read(path)?, edit)
}

/// Parses, validates and resolves recipe `text` (errors are reported against `path`; relative
/// paths in it are relative to `path`'s directory).
pub fn parse(path: &Path, text: &str) -> Result<RunPlan, RecipeError> {
    parse_with(path, text, |_| {})
}

fn parse_with(
    path: &Path,
    text: &str,
    edit: impl FnOnce(&mut Recipe),
) -> Result<RunPlan, RecipeError> {
    resolve_text(path, text, edit, |r| resolve_plan(path, r))
}

/// Parses `text`, edits the recipe and resolves it; a refusal `(key, message)` is reported at
/// the key's line.
fn resolve_text<T>(
    path: &Path,
    text: &str,
    edit: impl FnOnce(&mut Recipe),
    resolve: impl FnOnce(Recipe) -> Result<T, (String, String)>,
) -> Result<T, RecipeError> {
    let mut recipe: Recipe = toml::from_str(text).map_err(|e| RecipeError {
        file: path.to_path_buf(),
        line: e.span().map(|s| line_of(text, s.start)),
        key: String::new(),
        message: e.message().trim().to_string(),
    })?;
    edit(&mut recipe);
    resolve(recipe).map_err(|(key, message)| RecipeError {
        file: path.to_path_buf(),
        line: key_line(text, &key),
        key,
        message,
    })
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
