//! The sandbox that code from outside runs in (a request's `k3mini_tests`, a bench task's tests):
//! bubblewrap (`bwrap`, the sandbox Flatpak is built on; Debian package `bubblewrap`), not
//! hand-rolled checks. One Python program a run, its text and inputs on stdin, its verdict on a
//! pipe of its own ([`Run::result`]).
//!
//! What it contains:
//! - **Namespaces** (`--unshare-all`): a new user, PID, network, IPC, UTS and cgroup namespace.
//!   The program sees only its own processes (no other `/proc/PID`, so not the gateway's
//!   environment or command line), has no network at all (no loopback either), and every process
//!   it starts ends with the sandbox: Python is the namespace's first process (`--as-pid-1`, so
//!   no bwrap process sits in it free of the limits), and a PID namespace ends when its first
//!   process does, `setsid` or not. `--die-with-parent` ends it with the gateway, `--new-session`
//!   keeps it off the gateway's terminal.
//! - **Files**: the system's `/usr` (with the `/bin`, `/lib*` links into it) read-only, a fresh
//!   `/proc`, a read-only `/dev` of the usual devices, a read-only `/`, and two tmpfs of fixed
//!   size: `/tmp` ([`Limits::tmp_bytes`], its working directory) and `/dev/shm` (1 MiB). Nothing
//!   else of the host: no home directories, no `/etc`, no `/run`, no `/var`. No descriptor of
//!   the gateway's but its stdin, the verdict pipe and stderr (all others close at exec).
//! - **Environment**: none but `PATH` and `HOME`.
//! - **Resources** (setrlimit): address space, file size, CPU seconds, open files and no core
//!   files, set before bwrap starts so every process in the sandbox inherits them; the process
//!   count set by the program's first lines, inside the user namespace, so it counts the
//!   sandbox's own processes (on kernels since 5.14; before, all of the user's). Python as the
//!   first process reaps no orphans, so a descendant whose parent died stays counted until the
//!   run ends. The wall-clock limit, the request's deadline and its cancellation kill the
//!   sandbox whole.
//! - **Root**: run as root, the gateway starts bwrap as `nobody` (uid 65534): root's processes are
//!   exempt from the process limit, and a mistake in the binds then exposes only what anyone may
//!   read.
//!
//! What it does not contain: the kernel is shared (a kernel exploit escapes every namespace
//! sandbox); CPU time up to the limit, and memory up to the address-space cap of each of its
//! processes and the two tmpfs, are the machine's (a cgroup would bound them together; none is
//! made, since an unprivileged gateway has no cgroup of its own to divide); and the program runs
//! in the same interpreter as the runner that judges it, so code written to cheat the verdict
//! from inside Python (finding the nonce in the interpreter's memory) is not stopped: the
//! sandbox protects the machine, not a score from a program written against the harness.
//!
//! Where no sandbox can be made (no bwrap, user namespaces disabled, no Python in `/usr`), every
//! run is refused with [`SandboxError::Unavailable`] saying what is missing: code is never run
//! unsandboxed.

use k3mini_teacher::{Interrupt, TeacherError};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// What one run may take besides its time.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Address space of each process, bytes (so at most `processes` times this in all).
    pub memory: u64,
    /// Processes (and threads) in the sandbox.
    pub processes: u64,
    /// The largest file it may write, bytes.
    pub file_bytes: u64,
    /// Its `/tmp`, all files together, bytes.
    pub tmp_bytes: u64,
    pub open_files: u64,
}

/// Enough for a HumanEval-style program (tens of MB) with room, far below any machine's.
pub const LIMITS: Limits = Limits {
    memory: 1 << 30,
    processes: 8,
    file_bytes: 16 << 20,
    tmp_bytes: 64 << 20,
    open_files: 256,
};

/// The most of its verdict pipe, or of its stderr, a run may fill (a verdict is a line).
const PIPE_BYTES: u64 = 4096;
/// Its `/dev/shm` (Python's multiprocessing would use it; a test has no need).
const SHM_BYTES: u64 = 1 << 20;
/// The uid a root gateway runs the sandbox as: `nobody`.
const NOBODY: u32 = 65534;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "no sandbox to run tests in: {0}. Tests are never run unsandboxed: install bubblewrap \
         (Debian/Ubuntu: apt-get install bubblewrap) on a kernel that allows user namespaces"
    )]
    Unavailable(String),
    /// The request's deadline passed or it was cancelled while its program ran.
    #[error(transparent)]
    Interrupted(TeacherError),
    #[error("the sandbox failed: {0}")]
    Failed(String),
}

/// How a run ended.
#[derive(Debug)]
pub struct Run {
    /// The program exited by itself with status 0 within its time.
    pub exited_ok: bool,
    /// What it wrote on its verdict pipe (descriptor 3), at most [`PIPE_BYTES`].
    pub result: Vec<u8>,
    /// What it (or bwrap) wrote on stderr, at most [`PIPE_BYTES`].
    pub stderr: Vec<u8>,
}

/// The sandbox as found on this machine: bwrap, the Python it runs, what is bound.
pub struct Sandbox {
    bwrap: PathBuf,
    python: PathBuf,
    /// The bwrap arguments that build the file system.
    binds: Vec<String>,
    /// Whether to start bwrap as `nobody` (the gateway runs as root).
    drop_root: bool,
}

/// The machine's sandbox, found and tried once (a sandboxed `print` must work) per process.
pub fn sandbox() -> Result<&'static Sandbox, SandboxError> {
    static FOUND: OnceLock<Result<Sandbox, String>> = OnceLock::new();
    FOUND
        .get_or_init(Sandbox::find)
        .as_ref()
        .map_err(|why| SandboxError::Unavailable(why.clone()))
}

/// `name` on `PATH`, or in `/usr/bin`.
fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

impl Sandbox {
    fn find() -> Result<Self, String> {
        let bwrap = on_path("bwrap").ok_or("bwrap is not installed")?;
        // The system's Python, wherever its links lead: the sandbox binds /usr only (a Python
        // under a home directory, pyenv's say, is neither visible in it nor readable by
        // `nobody`; an alternatives link through /etc would dangle in it).
        let python = ["/usr/bin/python3", "/usr/local/bin/python3"]
            .iter()
            .filter_map(|p| std::fs::canonicalize(p).ok())
            .find(|p| p.starts_with("/usr") && p.is_file())
            .ok_or("no python3 under /usr (the sandbox binds /usr only)")?;
        let mut binds: Vec<String> = vec!["--ro-bind".into(), "/usr".into(), "/usr".into()];
        for top in ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"] {
            let path = Path::new(top);
            if let Ok(target) = std::fs::read_link(path) {
                binds.extend(["--symlink".into(), target.display().to_string(), top.into()]);
            } else if path.is_dir() {
                binds.extend(["--ro-bind".into(), top.into(), top.into()]);
            }
        }
        // SAFETY: geteuid has no preconditions.
        let drop_root = unsafe { libc::geteuid() } == 0;
        let sandbox = Self {
            bwrap,
            python,
            binds,
            drop_root,
        };
        let probe = sandbox
            .python(
                "import os; os.write(3, b'ok')",
                Vec::new(),
                &LIMITS,
                Duration::from_secs(10),
                Interrupt::default(),
            )
            .map_err(|e| e.to_string())?;
        if probe.exited_ok && probe.result == b"ok" {
            return Ok(sandbox);
        }
        Err(format!(
            "{} could not run a program: {}",
            sandbox.bwrap.display(),
            String::from_utf8_lossy(&probe.stderr).trim()
        ))
    }

    /// bwrap running `python3 -I -c script`: its own namespaces, Python as its first process (so
    /// no process of bwrap's own, free of the limits, is in it), `/` and `/dev` read-only, a
    /// sized `/tmp` and `/dev/shm`; the process limit set by the script's first lines (inside the
    /// user namespace, where it counts the sandbox's own processes).
    fn command(&self, limits: &Limits, script: &str) -> Command {
        let prelude = format!(
            "import resource as _r\n\
             _r.setrlimit(_r.RLIMIT_NPROC, ({0}, {0}))\n\
             del _r\n",
            limits.processes
        );
        let tmp = limits.tmp_bytes.to_string();
        let mut cmd = Command::new(&self.bwrap);
        cmd.args([
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
        ])
        .args(&self.binds)
        .args(["--proc", "/proc", "--dev", "/dev"])
        .args(["--size", &tmp, "--tmpfs", "/tmp"])
        .args(["--size", &SHM_BYTES.to_string(), "--tmpfs", "/dev/shm"])
        .args(["--remount-ro", "/dev", "--remount-ro", "/"])
        .args(["--chdir", "/tmp", "--hostname", "sandbox", "--clearenv"])
        .args(["--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"])
        .args(["--setenv", "HOME", "/tmp", "--"])
        .arg(&self.python)
        .args(["-I", "-c"])
        .arg(format!("{prelude}{script}"))
        .env_clear()
        .current_dir("/");
        cmd
    }

    /// What the child does between fork and exec: `fd` becomes its descriptor 3 and every other
    /// above 2 closes at exec (a descriptor the gateway inherited must not reach the program);
    /// the limits but the process count are set, so bwrap and all it starts inherit them; and
    /// under root it becomes `nobody`.
    fn pre_exec(&self, cmd: &mut Command, fd: &OwnedFd, limits: &Limits, time: Duration) {
        use std::os::unix::process::CommandExt;
        let (fd, drop_root) = (fd.as_raw_fd(), self.drop_root);
        let set = [
            (libc::RLIMIT_AS, limits.memory),
            (libc::RLIMIT_FSIZE, limits.file_bytes),
            (libc::RLIMIT_CPU, time.as_secs() + 1),
            (libc::RLIMIT_NOFILE, limits.open_files),
            (libc::RLIMIT_CORE, 0),
        ];
        // SAFETY: between fork and exec only thin system calls (dup2, fcntl, close_range,
        // getrlimit, setrlimit, setgroups, setgid, setuid), on values copied in.
        unsafe {
            cmd.pre_exec(move || {
                let failed = || Err(std::io::Error::last_os_error());
                if fd == 3 {
                    // dup2 onto itself keeps close-on-exec: clear it instead.
                    if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                        return failed();
                    }
                } else if libc::dup2(fd, 3) < 0 {
                    return failed();
                }
                // Marked close-on-exec rather than closed: std's own pipe reports a failed exec.
                let marked = libc::syscall(
                    libc::SYS_close_range,
                    4u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
                let mut limit = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if marked < 0 {
                    // Kernels before 5.11: one descriptor at a time, up to the most there can be.
                    libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
                    for other in 4..limit.rlim_cur.clamp(4, 1 << 20) as i32 {
                        libc::fcntl(other, libc::F_SETFD, libc::FD_CLOEXEC);
                    }
                }
                for (which, value) in set {
                    // Never above a hard limit the gateway already has (only root may raise one).
                    if libc::getrlimit(which, &mut limit) < 0 {
                        return failed();
                    }
                    let value = value.min(limit.rlim_max);
                    limit = libc::rlimit {
                        rlim_cur: value,
                        rlim_max: value,
                    };
                    if libc::setrlimit(which, &limit) < 0 {
                        return failed();
                    }
                }
                if drop_root
                    && (libc::setgroups(0, std::ptr::null()) < 0
                        || libc::setgid(NOBODY) < 0
                        || libc::setuid(NOBODY) < 0)
                {
                    return failed();
                }
                Ok(())
            });
        }
    }

    /// Runs `script` (Python, `-I`) in the sandbox, `stdin` its input, until it exits, `limit`
    /// passes (then [`Run::exited_ok`] is false) or `interrupt` fires (an error). The sandbox is
    /// killed whole afterwards, whatever it started.
    pub fn python(
        &self,
        script: &str,
        stdin: Vec<u8>,
        limits: &Limits,
        limit: Duration,
        interrupt: Interrupt,
    ) -> Result<Run, SandboxError> {
        let failed = |what: &str, e: std::io::Error| SandboxError::Failed(format!("{what}: {e}"));
        let (read, write) = pipe().map_err(|e| failed("a pipe", e))?;
        let mut cmd = self.command(limits, script);
        self.pre_exec(&mut cmd, &write, limits, limit);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| failed(&self.bwrap.display().to_string(), e))?;
        drop(write);
        // Fed and read beside the wait: a program that reads no input or fills no pipe cannot
        // stall the gateway, and one whose descendants hold a pipe open is not waited for.
        let mut input = child.stdin.take().expect("piped");
        std::thread::spawn(move || {
            // A sandbox that ends before reading its input must not end the gateway: the CLI
            // restores SIGPIPE's default action, so block it here, where the write would raise it
            // (the write then fails with EPIPE).
            // SAFETY: sigset calls on a local set; pthread_sigmask on this thread only.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            }
            let _ = input.write_all(&stdin);
        });
        let result = drain(std::fs::File::from(read));
        let stderr = drain(child.stderr.take().expect("piped"));
        let t0 = Instant::now();
        let ended = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(Some(status)),
                Ok(None) if t0.elapsed() > limit => break Ok(None),
                Ok(None) => match interrupt.check() {
                    Ok(()) => std::thread::sleep(Duration::from_millis(10)),
                    Err(e) => break Err(SandboxError::Interrupted(e)),
                },
                Err(e) => break Err(failed("waiting for the sandbox", e)),
            }
        };
        // Killing bwrap ends its PID namespace (--die-with-parent), so every process in it.
        let _ = child.kill();
        let _ = child.wait();
        let status = ended?;
        // The pipes' last writers died with the namespace; a moment's grace for the kernel.
        let grace = Duration::from_secs(2);
        Ok(Run {
            exited_ok: status.is_some_and(|s| s.success()),
            result: result.recv_timeout(grace).unwrap_or_default(),
            stderr: stderr.recv_timeout(grace).unwrap_or_default(),
        })
    }
}

/// The first [`PIPE_BYTES`] of `from`, read on a thread of its own, sent once read; the rest is
/// read and dropped, so a program that writes more never meets a closed pipe.
fn drain(mut from: impl Read + Send + 'static) -> std::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = (&mut from).take(PIPE_BYTES).read_to_end(&mut got);
        let _ = tx.send(got);
        let _ = std::io::copy(&mut from, &mut std::io::sink());
    });
    rx
}

/// A pipe, both ends close-on-exec.
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
