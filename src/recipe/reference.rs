//! `k3mini recipe reference`: every recipe key, its type, its default and what it does, generated
//! from the schema's own source: `schema.rs` (the recipe's tables) and the student's `config.rs`
//! (`[model]`'s overrides). Their doc comments and serde attributes are the one place a key is
//! documented; `docs/recipes.md` is this module's output, and a test holds the two equal.
//!
//! The parser reads the conventions those two files keep (rustfmt's layout): `///` docs,
//! `#[serde(...)]` attributes, `pub struct` / `pub enum` items with one field or variant per
//! line, and `fn default_x() -> T { EXPR }` for named defaults. What it cannot place is an error,
//! so the reference cannot silently drop a key.

use std::collections::BTreeMap;

const SCHEMA: &str = include_str!("schema.rs");

/// A field of a struct, or of an enum's struct variant.
#[derive(Debug, Default)]
struct Field {
    name: String,
    ty: String,
    doc: String,
    /// `#[serde(default = "f")]` → `Some(Some("f"))`; `#[serde(default)]` → `Some(None)`.
    default: Option<Option<String>>,
}

#[derive(Debug, Default)]
struct Variant {
    name: String,
    doc: String,
    fields: Vec<Field>,
    is_default: bool,
}

#[derive(Debug, Default)]
struct Item {
    doc: String,
    fields: Vec<Field>,
    /// Enums only.
    variants: Option<Vec<Variant>>,
    rename_all: Option<String>,
    /// `#[serde(tag = "kind")]`.
    tag: Option<String>,
}

/// The items and default functions of one source file, and what the defaults it names in other
/// crates are.
#[derive(Default)]
struct Schema {
    items: BTreeMap<String, Item>,
    defaults: BTreeMap<String, String>,
    values: BTreeMap<String, String>,
}

/// A value as TOML writes it inline (a table as `{ key = value, … }`).
fn inline_toml(v: &toml::Value) -> String {
    match v {
        toml::Value::Table(t) => {
            let pairs: Vec<String> = t
                .iter()
                .map(|(k, v)| format!("{k} = {}", inline_toml(v)))
                .collect();
            format!("{{ {} }}", pairs.join(", "))
        }
        v => v.to_string(),
    }
}

/// The defaults schema.rs names in other crates, keyed by the expression it names them with and
/// rendered from the values themselves, so the reference shows what a recipe gets.
/// (`Engine::default()` stays as written: it depends on the build's features, and its key's
/// doc says which.)
fn external_values() -> Result<BTreeMap<String, String>, String> {
    fn value(v: impl serde::Serialize) -> Result<String, String> {
        toml::Value::try_from(v)
            .map(|v| inline_toml(&v))
            .map_err(|e| e.to_string())
    }
    Ok(BTreeMap::from([
        (
            "Precision::default()".into(),
            value(k3mini_student::precision::Precision::default())?,
        ),
        (
            "LossParts::default()".into(),
            value(k3mini_data::chat::LossParts::default())?,
        ),
        (
            "Api::Vllm".into(),
            value(k3mini_teacher::client::Api::Vllm)?,
        ),
        (
            "k3mini_student::hf::DEFAULT_SHARD_BYTES".into(),
            value(k3mini_student::hf::DEFAULT_SHARD_BYTES)?,
        ),
        (
            "k3mini_data::shards::DEFAULT_LOGPROB_STEP".into(),
            value(k3mini_data::shards::DEFAULT_LOGPROB_STEP)?,
        ),
    ]))
}

fn attr_value(attr: &str, key: &str) -> Option<String> {
    let at = attr.find(&format!("{key} = \""))? + key.len() + 4;
    Some(attr[at..at + attr[at..].find('"')?].to_string())
}

fn field_default(attr: &str) -> Option<Option<String>> {
    if let Some(f) = attr_value(attr, "default") {
        return Some(Some(f));
    }
    attr.split(['(', ',', ')'])
        .any(|p| p.trim() == "default")
        .then_some(None)
}

/// An attribute that starts on `first`, joined with the lines it continues on (from `lines[*i]`).
fn attribute(first: &str, lines: &[&str], i: &mut usize) -> String {
    let mut a = first.to_string();
    while !a.ends_with(']') && *i < lines.len() {
        a.push_str(lines[*i].trim());
        *i += 1;
    }
    a
}

/// Gathers `line` into the next item's docs or attributes; false when it is neither.
fn annotation(
    line: &str,
    lines: &[&str],
    i: &mut usize,
    doc: &mut Vec<String>,
    attrs: &mut String,
) -> bool {
    if let Some(d) = line.strip_prefix("///") {
        doc.push(d.trim().to_string());
    } else if line.starts_with("#[") {
        attrs.push_str(&attribute(line, lines, i));
    } else {
        return false;
    }
    true
}

fn parse(src: &str, schema: &mut Schema) -> Result<(), String> {
    let lines: Vec<&str> = src.lines().collect();
    let (mut doc, mut attrs) = (Vec::<String>::new(), String::new());
    let mut i = 0;
    let take = |doc: &mut Vec<String>| std::mem::take(doc).join(" ");
    while i < lines.len() {
        let line = lines[i].trim();
        i += 1;
        if annotation(line, &lines, &mut i, &mut doc, &mut attrs) {
        } else if let Some(rest) = line.strip_prefix("fn ").filter(|r| r.contains("() -> ")) {
            let name = rest[..rest.find('(').unwrap()].to_string();
            let body = lines[i].trim().to_string();
            schema.defaults.insert(name, body);
            doc.clear();
            attrs.clear();
        } else if let Some(rest) = line
            .strip_prefix("pub struct ")
            .or_else(|| line.strip_prefix("pub enum "))
            .filter(|r| r.ends_with('{'))
        {
            let name = rest.trim_end_matches('{').trim().to_string();
            let mut item = Item {
                doc: take(&mut doc),
                rename_all: attr_value(&attrs, "rename_all"),
                tag: attr_value(&attrs, "tag"),
                ..Item::default()
            };
            attrs.clear();
            let is_enum = line.starts_with("pub enum");
            let mut variants = Vec::new();
            // The body, to the closing brace at the item's indentation.
            while i < lines.len() && lines[i] != "}" {
                let l = lines[i].trim();
                i += 1;
                if annotation(l, &lines, &mut i, &mut doc, &mut attrs) {
                } else if is_enum && !lines[i - 1].starts_with("        ") && !l.starts_with('}') {
                    let name = l.trim_end_matches([',', '{', ' ']);
                    let name = name.split(['(', ' ']).next().unwrap_or(name);
                    variants.push(Variant {
                        name: name.to_string(),
                        doc: take(&mut doc),
                        is_default: attrs.contains("#[default]"),
                        fields: Vec::new(),
                    });
                    attrs.clear();
                    // `Variant { a: usize },` on one line.
                    if let (Some(a), Some(b)) = (l.find('{'), l.rfind('}')) {
                        for f in l[a + 1..b].split(',').filter(|f| f.contains(':')) {
                            let (n, t) = f.split_once(':').unwrap();
                            variants.last_mut().unwrap().fields.push(Field {
                                name: n.trim().into(),
                                ty: t.trim().into(),
                                ..Field::default()
                            });
                        }
                    }
                } else if let Some((n, t)) = l.trim_end_matches(',').split_once(": ") {
                    let field = Field {
                        name: n.trim_start_matches("pub ").to_string(),
                        ty: t.to_string(),
                        doc: take(&mut doc),
                        default: field_default(&attrs),
                    };
                    attrs.clear();
                    match variants.last_mut() {
                        Some(v) if is_enum => v.fields.push(field),
                        _ if is_enum => return Err(format!("{name}: a field outside a variant")),
                        _ => item.fields.push(field),
                    }
                } else if !l.is_empty() && !l.starts_with('}') {
                    return Err(format!("{name}: cannot read `{l}`"));
                }
            }
            if is_enum {
                item.variants = Some(variants);
            }
            schema.items.insert(name, item);
        } else if !line.starts_with("//") {
            doc.clear();
            attrs.clear();
        }
    }
    Ok(())
}

/// `Option<T>` → `T`, `Vec<T>` → `T` and whether it was a list.
fn inner(ty: &str) -> (&str, bool, bool) {
    let strip = |p: &str| {
        ty.strip_prefix(p)
            .and_then(|r| r.strip_suffix('>'))
            .map(str::trim)
    };
    match (strip("Option<"), strip("Vec<")) {
        (Some(t), _) => (t, true, false),
        (_, Some(t)) => (t, false, true),
        _ => (ty, false, false),
    }
}

fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_lowercase());
    }
    out
}

fn variant_name(item: &Item, v: &str) -> String {
    match item.rename_all.as_deref() {
        Some("lowercase") => v.to_lowercase(),
        Some("snake_case") => snake(v),
        _ => v.to_string(),
    }
}

impl Schema {
    fn type_text(&self, ty: &str) -> String {
        let (t, _, list) = inner(ty);
        let base = match t {
            "String" | "PathBuf" => "string".to_string(),
            "usize" | "u64" | "u32" => "integer".into(),
            "f64" | "f32" => "float".into(),
            "bool" => "bool".into(),
            "[f64; 2]" => "[float, float]".into(),
            "toml::Table" => "table".into(),
            _ => match self.items.get(t) {
                Some(item) if item.variants.is_some() && item.tag.is_none() => item
                    .variants
                    .as_ref()
                    .unwrap()
                    .iter()
                    .map(|v| format!("\"{}\"", variant_name(item, &v.name)))
                    .collect::<Vec<_>>()
                    .join(" \\| "),
                _ => format!("`{t}`"),
            },
        };
        if list {
            format!("list of {base}")
        } else {
            base
        }
    }

    /// `required`: what a key with no default says (a preset supplies `[model]`'s).
    fn default_text(&self, f: &Field, required: &str) -> String {
        let (t, optional, list) = inner(&f.ty);
        match &f.default {
            Some(Some(func)) => {
                let body = self
                    .defaults
                    .get(func)
                    .map_or(func.as_str(), |b| b.as_str());
                let body = body
                    .strip_prefix("Some(")
                    .and_then(|b| b.strip_suffix(')'))
                    .unwrap_or(body);
                let body = body.strip_suffix(".into()").unwrap_or(body);
                format!("`{}`", self.values.get(body).map_or(body, String::as_str))
            }
            _ if optional => "optional".into(),
            None => required.into(),
            Some(None) if list => "`[]`".into(),
            Some(None) => match t {
                "bool" => "`false`".into(),
                "usize" | "u64" | "u32" => "`0`".into(),
                "f64" | "f32" => "`0.0`".into(),
                _ => match self
                    .items
                    .get(t)
                    .and_then(|i| Some((i, i.variants.as_ref()?)))
                {
                    Some((item, vs)) => vs
                        .iter()
                        .find(|v| v.is_default)
                        .map_or("its default".into(), |v| {
                            format!("`\"{}\"`", variant_name(item, &v.name))
                        }),
                    None => {
                        let expr = format!("{t}::default()");
                        format!("`{}`", self.values.get(&expr).unwrap_or(&expr))
                    }
                },
            },
        }
    }

    /// The table at `path` (struct `ty`) under `header` (none: the caller wrote it), then the
    /// tables beneath it.
    fn table(
        &self,
        out: &mut String,
        path: &str,
        header: Option<&str>,
        ty: &str,
        doc: &str,
        required: &str,
    ) {
        let Some(item) = self.items.get(ty) else {
            return;
        };
        if let Some(header) = header {
            out.push_str(&format!("\n## `{header}`\n\n"));
            for d in [doc, item.doc.as_str()] {
                if !d.is_empty() {
                    out.push_str(&format!("{d}\n\n"));
                }
            }
        }
        if let (Some(tag), Some(variants)) = (&item.tag, &item.variants) {
            out.push_str(&format!(
                "| `{tag}` | keys (default) | meaning |\n|---|---|---|\n"
            ));
            for v in variants {
                let keys: Vec<String> = v
                    .fields
                    .iter()
                    .map(|f| format!("`{}` ({})", f.name, self.default_text(f, required)))
                    .collect();
                out.push_str(&format!(
                    "| `\"{}\"` | {} | {} |\n",
                    variant_name(item, &v.name),
                    keys.join(", "),
                    cell(&v.doc)
                ));
            }
            return;
        }
        let mut below = Vec::new();
        out.push_str("| key | type | default | meaning |\n|---|---|---|---|\n");
        for f in &item.fields {
            let (t, _, list) = inner(&f.ty);
            let nested = self
                .items
                .get(t)
                .is_some_and(|i| i.variants.is_none() || i.tag.is_some());
            if nested {
                let sub = format!("{path}.{}", f.name);
                let header = if list {
                    format!("[[{sub}]]")
                } else {
                    format!("[{sub}]")
                };
                below.push((sub, header, t.to_string(), f.doc.clone()));
                continue;
            }
            out.push_str(&format!(
                "| `{}` | {} | {} | {} |\n",
                f.name,
                self.type_text(&f.ty),
                self.default_text(f, required),
                cell(&f.doc)
            ));
        }
        for (sub, header, t, doc) in below {
            self.table(out, &sub, Some(&header), &t, &doc, required);
        }
    }
}

/// A doc comment as a table cell: rustdoc's intra-doc links (``[`crate::x`]``) as plain code.
fn cell(doc: &str) -> String {
    let mut out = String::new();
    let mut rest = doc;
    while let Some(i) = rest.find("[`") {
        let link = rest[i + 1..]
            .find("`]")
            .map(|j| i + 1 + j + 2)
            .filter(|&end| !rest[end..].starts_with('('));
        let Some(end) = link else {
            out.push_str(&rest[..i + 2]);
            rest = &rest[i + 2..];
            continue;
        };
        out.push_str(&rest[..i]);
        out.push_str(&rest[i + 1..end - 1]);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out.replace('|', "\\|")
}

/// The recipe reference, as Markdown (`docs/recipes.md`).
pub fn reference() -> Result<String, String> {
    let mut recipe = Schema {
        values: external_values()?,
        ..Schema::default()
    };
    parse(SCHEMA, &mut recipe)?;
    let mut model = Schema {
        values: external_values()?,
        ..Schema::default()
    };
    parse(k3mini_student::config::CONFIG_SOURCE, &mut model)?;
    let root = recipe
        .items
        .get("Recipe")
        .ok_or("schema.rs: no Recipe struct")?;
    let mut out = String::from(
        "# Recipe reference\n\n\
         <!-- Generated by `k3mini recipe reference` from src/recipe/schema.rs and \
         student/src/config.rs; edit their doc comments, not this file. -->\n\n\
         One TOML file describes a run. Every table refuses unknown keys, and every error names \
         the file, line and key (`recipes/ci-tiny.toml:14: optim.lr: must be positive`). \
         `k3mini recipe check FILE` prints the plan a recipe resolves to: every default filled \
         in, paths absolute, the model in full. Paths are relative to the recipe file.\n",
    );
    for f in &root.fields {
        let (t, _, _) = inner(&f.ty);
        if t == "toml::Table" {
            model_tables(&mut out, &model, &f.doc)?;
        } else if !recipe.items.contains_key(t) {
            return Err(format!(
                "schema.rs: [{}] is a {t}, which schema.rs does not define",
                f.name
            ));
        } else {
            let header = format!("[{}]", f.name);
            recipe.table(&mut out, &f.name, Some(&header), t, &f.doc, "**required**");
        }
    }
    Ok(out)
}

/// `[model]`: a preset's name and any `ModelConfig` field over it, or `init` alone.
fn model_tables(out: &mut String, model: &Schema, doc: &str) -> Result<(), String> {
    let config = model
        .items
        .get("ModelConfig")
        .ok_or("config.rs: no ModelConfig struct")?;
    out.push_str(&format!(
        "\n## `[model]`\n\n{doc} `preset` names one of `{}`; every other key overrides the \
         preset's value. Or `init = \"CHECKPOINT\"` alone: the model and weights of a checkpoint \
         or run directory (`train --init` sets it).\n\n{}\n\n",
        k3mini_student::presets::PRESETS.join("`, `"),
        config.doc
    ));
    model.table(out, "model", None, "ModelConfig", "", "the preset's");
    Ok(())
}
