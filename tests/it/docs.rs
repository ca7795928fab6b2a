//! The documentation keeps itself honest: the recipe reference is what `k3mini recipe reference`
//! prints, and every relative link and anchor in the README and `docs/` resolves inside the
//! repository.
use crate::fixture::root;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

#[test]
fn the_recipe_reference_is_what_the_schema_says() {
    let generated = k3mini::recipe::reference::reference().unwrap();
    let committed = std::fs::read_to_string(root().join("docs/recipes.md")).unwrap();
    assert!(
        generated == committed,
        "docs/recipes.md differs from the schema's doc comments: run \
         `cargo run -- recipe reference > docs/recipes.md`"
    );
    // Every key the recipes in the repository use is in it.
    for key in [
        "held_out_fraction",
        "activation_checkpointing",
        "routing_shape",
        "layer_pattern",
    ] {
        assert!(generated.contains(&format!("| `{key}` |")), "{key}");
    }
    // Defaults are values a recipe can write, not the Rust that computes them (the engine's
    // depends on the build, and its key says so).
    for row in generated.lines().filter(|l| l.starts_with("| `")) {
        // `| key | type | default | meaning |`, or a tagged table's `| kind | keys (default) | meaning |`.
        let cells: Vec<&str> = row.split(" | ").collect();
        let defaults = match cells.len() {
            4 => cells[2],
            3 => cells[1],
            _ => panic!("a row of {} cells: {row}", cells.len()),
        };
        assert!(
            !defaults.replace("`Engine::default()`", "").contains("::"),
            "{row}"
        );
    }
    assert!(!generated.contains("[`"), "rustdoc links left as written");
}

/// The Markdown files: README.md and everything under docs/.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut out);
    out
}

/// A page's text outside fenced code blocks and inline code spans.
fn prose(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            // Drop `code spans` (a link inside one is text).
            let mut kept = String::new();
            for (i, part) in line.split('`').enumerate() {
                if i % 2 == 0 {
                    kept.push_str(part);
                }
            }
            out.push(kept);
        }
    }
    out
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens; repeats
/// get `-1`, `-2`.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let Some(heading) = (!fenced)
            .then(|| line.trim_start_matches('#'))
            .filter(|h| line.starts_with('#') && h.starts_with(' '))
        else {
            continue;
        };
        let slug: String = heading
            .trim()
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// The targets of `[text](target)` links in a line.
fn links(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_string());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves_inside_the_repository() {
    let repo = root().canonicalize().unwrap();
    let mut broken = Vec::new();
    let pages = pages();
    assert!(pages.len() > 15, "README and the docs pages");
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        for line in prose(&text) {
            for target in links(&line) {
                if target.starts_with("http://") || target.starts_with("https://") {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                let file = if path.is_empty() {
                    page.clone()
                } else {
                    page.parent().unwrap().join(path)
                };
                let Ok(file) = file.canonicalize() else {
                    broken.push(format!("{}: {target}: no such file", page.display()));
                    continue;
                };
                if !file.starts_with(&repo) {
                    broken.push(format!(
                        "{}: {target}: outside the repository",
                        page.display()
                    ));
                } else if !anchor.is_empty() {
                    let here = std::fs::read_to_string(&file).unwrap_or_default();
                    if !anchors(&here).contains(anchor) {
                        broken.push(format!("{}: {target}: no such heading", page.display()));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_are_githubs() {
    let a = anchors(
        "# Engines: llama.cpp, and burn\n## Set-up: two commands\n## `[run]`\n## Set-up: two commands\n",
    );
    let want = [
        "engines-llamacpp-and-burn",
        "set-up-two-commands",
        "run",
        "set-up-two-commands-1",
    ];
    assert_eq!(a, want.iter().map(|s| s.to_string()).collect());
}
