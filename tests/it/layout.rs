//! The house's rules that rustc does not keep.
use crate::fixture::root;

/// No crate's files or directories depend on each other in a cycle (rustc allows it; the layout
/// says dependencies point one way). The check is scripts/check/module_cycles.py.
#[test]
fn no_module_depends_on_itself_through_others() {
    let out = std::process::Command::new("python3")
        .arg(root().join("scripts/check/module_cycles.py"))
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The check finds a cycle however its paths are written: a nested use-tree with a rename,
/// `super::super::`, and code after a `#[cfg(test)]` module (whose own body is not counted).
#[test]
fn the_cycle_check_reads_every_form_of_path() {
    let s = crate::fixture::Scratch::new("cycles");
    s.write("src/lib.rs", "mod a;\nmod b;\nmod c;\n");
    s.write("src/a/mod.rs", "pub mod x;\n");
    s.write(
        "src/a/x.rs",
        "use crate::{b::{y::{Y, Z as W}}, c};\npub struct X;\n",
    );
    s.write("src/b/mod.rs", "pub mod y;\n");
    s.write(
        "src/b/y.rs",
        "pub struct Y;\npub struct Z;\nfn f() { super::super::c::g(); }\n",
    );
    let tests = "#[cfg(test)]\nmod tests {\n    use crate::a::x::X;\n}\npub fn g() {}\n";
    s.write("src/c.rs", tests);
    let (clean, printed) = cycles(&s.0);
    assert!(clean, "{printed}");
    s.write(
        "src/c.rs",
        &format!("{tests}fn h() -> crate::a::x::X {{ todo!() }}\n"),
    );
    let (clean, printed) = cycles(&s.0);
    assert!(!clean, "{printed}");
    assert!(printed.contains("cycle among a, b, c"), "{printed}");
    for edge in ["a -> b", "b -> c", "c -> a"] {
        assert!(printed.contains(edge), "{edge}: {printed}");
    }

    // Through a re-export under another name, declared by its crate path: x names its parent's
    // `Alias` (a child naming its parent is not counted), which is y's `Item`, so x depends on y.
    // Test modules are not read: one behind a second attribute, one in its own file, each naming
    // b, which names a/x (counted, they would make a cycle of a and b).
    let s = crate::fixture::Scratch::new("cycles-reexport");
    s.write("src/lib.rs", "mod a;\nmod b;\n");
    s.write(
        "src/a/mod.rs",
        "mod x;\nmod y;\npub use crate::a::y::{Item as Alias};\n#[cfg(test)]\n#[allow(unused)]\n\
         mod tests {\n    use crate::b::B;\n}\n#[cfg(test)]\nmod t;\n",
    );
    s.write(
        "src/a/x.rs",
        "pub struct X;\nfn f() -> super::Alias { todo!() }\n",
    );
    s.write("src/a/y.rs", "pub struct Item;\n");
    s.write("src/a/t.rs", "use crate::b::B;\n");
    s.write(
        "src/b.rs",
        "pub struct B;\nfn h() -> crate::a::x::X { todo!() }\n",
    );
    let (clean, printed) = cycles(&s.0);
    assert!(clean, "{printed}");
    s.write(
        "src/a/y.rs",
        "pub struct Item;\nfn g() -> super::x::X { todo!() }\n",
    );
    let (clean, printed) = cycles(&s.0);
    assert!(!clean, "{printed}");
    assert!(printed.contains("cycle among a/x, a/y"), "{printed}");
}

/// The cycle check on the crate at `dir`: whether it found none, and what it printed.
fn cycles(dir: &std::path::Path) -> (bool, String) {
    let out = std::process::Command::new("python3")
        .arg(root().join("scripts/check/module_cycles.py"))
        .arg(dir)
        .output()
        .expect("python3 runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}
