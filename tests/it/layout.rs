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
    let check = || {
        std::process::Command::new("python3")
            .arg(root().join("scripts/check/module_cycles.py"))
            .arg(&s.0)
            .output()
            .expect("python3 runs")
    };
    s.write("src/c.rs", tests);
    let out = check();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    s.write(
        "src/c.rs",
        &format!("{tests}fn h() -> crate::a::x::X {{ todo!() }}\n"),
    );
    let out = check();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{printed}");
    assert!(printed.contains("cycle among a, b, c"), "{printed}");
    for edge in ["a -> b", "b -> c", "c -> a"] {
        assert!(printed.contains(edge), "{edge}: {printed}");
    }
}
