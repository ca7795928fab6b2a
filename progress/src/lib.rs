//! What long work reports as it goes, through one observer the binary installs (as the `log`
//! crate's logger is installed): the library never prints or draws. The CLI's observer draws
//! bars on the terminal (`cli::progress`, indicatif); without one, as in tests and in programs
//! that use the library, nothing is reported.

use std::sync::OnceLock;

/// Receives what long work reports.
pub trait Progress: Send + Sync {
    /// A bar for work of `total` `unit`s (0 while the total is unknown), `done` of them done.
    fn bar(&self, unit: &str, total: u64, done: u64) -> Box<dyn Bar>;
    /// A line of news between bars: a stage starting, a file being fetched.
    fn note(&self, line: &str);
}

/// One piece of work's progress.
pub trait Bar: Send + Sync {
    fn set_total(&self, total: u64);
    fn set(&self, done: u64);
    fn inc(&self, n: u64);
    /// The current item or figures, beside the bar.
    fn message(&self, text: String);
    /// A line printed above the bar.
    fn note(&self, line: String);
    /// The work ended: the bar stays drawn, or with `clear` goes.
    fn finish(&self, clear: bool);
}

struct Silent;

impl Progress for Silent {
    fn bar(&self, _: &str, _: u64, _: u64) -> Box<dyn Bar> {
        Box::new(Silent)
    }
    fn note(&self, _: &str) {}
}

impl Bar for Silent {
    fn set_total(&self, _: u64) {}
    fn set(&self, _: u64) {}
    fn inc(&self, _: u64) {}
    fn message(&self, _: String) {}
    fn note(&self, _: String) {}
    fn finish(&self, _: bool) {}
}

static OBSERVER: OnceLock<Box<dyn Progress>> = OnceLock::new();

/// Installs the process's observer; only the first call takes effect (it returns false after).
pub fn install(observer: Box<dyn Progress>) -> bool {
    OBSERVER.set(observer).is_ok()
}

/// An observer that reports nothing: for work whose progress another process reports (a rank
/// of a training run other than the first).
pub fn silent() -> &'static dyn Progress {
    &Silent
}

/// The installed observer, or one that reports nothing.
pub fn observer() -> &'static dyn Progress {
    OBSERVER.get().map_or(silent(), |o| o.as_ref())
}
