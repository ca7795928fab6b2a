//! The terminal's progress: indicatif bars on stderr, the library's observer
//! (`k3mini::progress`) and the CLI's own loops alike. `--quiet` hides the bars; notes (a stage
//! starting, a download) are printed either way.

use k3mini::progress::{Bar, Progress};
use std::sync::atomic::{AtomicBool, Ordering};

static QUIET: AtomicBool = AtomicBool::new(false);

/// Installs the terminal as the library's observer.
pub fn install() {
    k3mini::progress::install(Box::new(Terminal));
}

/// Hides (or shows) the bars from here on: a command's `--quiet`.
pub fn set_quiet(quiet: bool) {
    QUIET.store(quiet, Ordering::SeqCst);
}

/// A bar of `unit`s done of a total set later, a message, elapsed time and ETA; hidden when
/// `quiet`.
pub fn bar(quiet: bool, unit: &str) -> indicatif::ProgressBar {
    if quiet {
        return indicatif::ProgressBar::hidden();
    }
    indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{{bar:30}} {{pos}}/{{len}} {unit}  {{msg}}  [{{elapsed}} < {{eta}}]"
        ))
        .expect("valid template"),
    )
}

struct Terminal;

impl Progress for Terminal {
    fn bar(&self, unit: &str, total: u64, done: u64) -> Box<dyn Bar> {
        let b = bar(QUIET.load(Ordering::SeqCst), unit);
        b.set_length(total);
        b.set_position(done);
        Box::new(Drawn(b))
    }

    fn note(&self, line: &str) {
        eprintln!("{line}");
    }
}

struct Drawn(indicatif::ProgressBar);

impl Bar for Drawn {
    fn set_total(&self, total: u64) {
        self.0.set_length(total);
    }
    fn set(&self, done: u64) {
        self.0.set_position(done);
    }
    fn inc(&self, n: u64) {
        self.0.inc(n);
    }
    fn message(&self, text: String) {
        self.0.set_message(text);
    }
    fn note(&self, line: String) {
        // A hidden bar (--quiet, or stderr not a terminal) prints nothing: the note still goes.
        if self.0.is_hidden() {
            eprintln!("{line}");
        } else {
            self.0.println(line);
        }
    }
    fn finish(&self, clear: bool) {
        if clear {
            self.0.finish_and_clear();
        } else {
            self.0.finish();
        }
    }
}
