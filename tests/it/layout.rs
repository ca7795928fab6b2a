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
