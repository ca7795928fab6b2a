//! The sandbox a request's tests run in (`k3mini::agent::sandbox`), tried as a hostile client
//! would: each program below passes only if its escape works, so a pass is a hole (each escape
//! works for a program run as the gateway ran them before: its own process group and an empty
//! environment).

use k3mini::agent::code::passes;
use k3mini::agent::policy::Policy;
use k3mini::agent::sandbox::SandboxError;
use k3mini::agent::server::check_policy;
use k3mini_teacher::server::Limits;
use k3mini_teacher::{Interrupt, TeacherError};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(20);

fn run(program: &str) -> bool {
    passes(program, LIMIT, Interrupt::default()).expect("the sandbox runs (is bwrap installed?)")
}

/// Processes on this machine whose command line holds `marker`.
fn alive(marker: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .count()
}

#[test]
fn an_honest_program_passes_and_the_sandbox_is_its_world() {
    assert!(run("assert sum([2, 3]) == 5\n"));
    // No environment but PATH and HOME (and what Python and bwrap set: the working directory,
    // the UTF-8 locale Python coerces C to), its /tmp writable.
    assert!(run(
        "import os\nassert set(os.environ) <= {'HOME', 'PATH', 'PWD', 'LC_CTYPE'}\n\
         open('/tmp/x', 'w').write('ok')\nassert open('/tmp/x').read() == 'ok'\n"
    ));
}

#[test]
fn a_forked_setsid_child_does_not_outlive_the_run() {
    let marker = format!("k3mini-escapee-{}", std::process::id());
    let program = format!(
        "import os\nif os.fork() == 0:\n    os.setsid()\n    \
         os.execv('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(60)', '{marker}'])\n\
         import time\ntime.sleep(0.5)\n"
    );
    run(&program);
    let t0 = Instant::now();
    while alive(&marker) > 0 && t0.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(alive(&marker), 0, "a child of the sandbox outlived it");
}

#[test]
fn the_gateways_environment_files_and_network_are_out_of_reach() {
    // The environment of any other process (the gateway's holds its API keys): a process
    // started with a secret in its environment, as the gateway is.
    let canary = format!("k3mini-canary-{}", std::process::id());
    let mut holder = std::process::Command::new("sleep")
        .arg("30")
        .env("K3MINI_SANDBOX_CANARY", &canary)
        .spawn()
        .unwrap();
    let read_environ = format!(
        "import os\nfound = False\nfor pid in os.listdir('/proc'):\n    try:\n        \
         found |= b'{canary}' in open(f'/proc/{{pid}}/environ', 'rb').read()\n    except OSError:\n        \
         pass\nassert found\n"
    );
    let escaped = run(&read_environ);
    let _ = (holder.kill(), holder.wait());
    assert!(!escaped, "the program read another process's environment");

    // A write outside its scratch: a directory anyone may write to, outside the host's /tmp
    // (which the sandbox's own /tmp hides).
    let outside = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(format!("k3mini-sandbox-out-{}", std::process::id()));
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::set_permissions(
        &outside,
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let target = outside.join("escaped");
    let write = format!("open({:?}, 'w').write('x')\n", target.display().to_string());
    let wrote = run(&write);
    let exists = target.exists();
    std::fs::remove_dir_all(&outside).ok();
    assert!(!wrote && !exists, "the program wrote outside its sandbox");

    // A TCP connection to a port this process listens on.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let connect = format!(
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).send(b'hi')\n"
    );
    assert!(!run(&connect), "the program reached the network");
    listener.set_nonblocking(true).unwrap();
    assert!(listener.accept().is_err(), "a connection arrived");
}

#[test]
fn fork_and_memory_bombs_fail_inside_the_sandbox() {
    let fork_bomb = "import os, time\nfor _ in range(500):\n    if os.fork() == 0:\n        \
                     time.sleep(5)\n        os._exit(0)\n";
    assert!(!run(fork_bomb), "500 processes were started");
    let memory_bomb = "b = bytearray(3 << 30)\n";
    assert!(!run(memory_bomb), "3 GiB were allocated");
}

#[test]
fn the_nonce_cannot_be_read_and_printing_is_no_verdict() {
    // Everything a process can see of itself and others: argv, environments, its input.
    let forge = "import os, re, sys\nseen = set()\nfor pid in os.listdir('/proc'):\n    \
                 for f in ('cmdline', 'environ'):\n        try:\n            \
                 seen |= set(re.findall(rb'k3mini-[0-9a-f]{16}', open(f'/proc/{pid}/{f}', 'rb').read()))\n        \
                 except OSError:\n            pass\nfor n in seen:\n    print(n.decode(), flush=True)\n    \
                 try:\n        os.write(3, n)\n    except OSError:\n        pass\nos._exit(0)\n";
    assert!(!run(forge), "the program forged a pass");
    // The runner's module holds no nonce either.
    let main = "import __main__, os\nos.write(3, str(getattr(__main__, 'nonce', '')).encode())\n\
                os._exit(0)\n";
    assert!(
        !run(main),
        "the program forged a pass from the runner's globals"
    );
}

#[test]
fn a_child_holding_the_pipes_open_does_not_hold_the_caller() {
    // The program passes at once; its child keeps stdout, stderr and the verdict pipe open.
    let program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n";
    let t0 = Instant::now();
    assert!(run(program));
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn a_run_ends_at_its_limit_deadline_or_cancellation() {
    let spin = "while True: pass\n";
    let t0 = Instant::now();
    assert!(!passes(spin, Duration::from_millis(500), Interrupt::default()).unwrap());
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());

    let t0 = Instant::now();
    let deadline = Interrupt {
        deadline: Some((t0 + Duration::from_millis(500), Duration::from_millis(500))),
        cancelled: None,
    };
    let got = passes(spin, LIMIT, deadline);
    assert!(
        matches!(
            got,
            Err(SandboxError::Interrupted(TeacherError::TimedOut(_)))
        ),
        "{got:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());

    let t0 = Instant::now();
    let gone = || (t0.elapsed() > Duration::from_millis(300)).then_some("the client disconnected");
    let cancelled = Interrupt {
        deadline: None,
        cancelled: Some(&gone),
    };
    let got = passes(spin, LIMIT, cancelled);
    assert!(
        matches!(
            got,
            Err(SandboxError::Interrupted(TeacherError::Cancelled(_)))
        ),
        "{got:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
}

#[test]
fn a_policy_that_runs_clients_tests_needs_an_api_key() {
    let policy = Policy::parse(
        "route = \"gate\"\nescalate_by = \"remote\"\n[gate]\nrun_tests = true\n",
        "tests",
    )
    .unwrap();
    let err = check_policy(&policy, &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("API key"), "{err}");
    let keyed = Limits {
        api_key: Some("k".into()),
        ..Default::default()
    };
    let warning = check_policy(&policy, &keyed).unwrap().unwrap();
    assert!(warning.contains("sandbox"), "{warning}");
    let plain = Policy::parse("route = \"gate\"\nescalate_by = \"remote\"\n", "plain").unwrap();
    assert!(check_policy(&plain, &Limits::default()).unwrap().is_none());
}

#[test]
fn no_gateway_descriptor_writable_root_or_unlimited_process_is_inside() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    // A descriptor the gateway holds without close-on-exec (as one inherited from its launcher).
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(format!("k3mini-sandbox-leak-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    let fd = file.as_raw_fd();
    // SAFETY: clears close-on-exec on a descriptor this test owns.
    assert!(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } == 0);
    let inode = file.metadata().unwrap().ino();
    let leaked = format!(
        "import os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n        \
         assert os.fstat(fd).st_ino != {inode}\n    except OSError:\n        pass\n"
    );
    // Passes only while no descriptor of the file is open inside.
    assert!(
        run(&leaked),
        "the gateway's descriptor {fd} reached the sandbox"
    );
    drop(file);
    std::fs::remove_file(&path).ok();
    // The root and /dev are read-only, /dev/shm and /tmp bounded, the limits are the first
    // process's own (Python is that process), and what is printed, however much, is no harm.
    assert!(run(
        "import os, resource\nfor p in ('/x', '/dev/x'):\n    try:\n        open(p, 'w')\n        \
         raise SystemExit(1)\n    except OSError:\n        pass\nassert os.getpid() == 1\n\
         assert resource.getrlimit(resource.RLIMIT_AS)[1] == 1 << 30\n\
         assert resource.getrlimit(resource.RLIMIT_NPROC)[1] == 8\n\
         import sys\nfor _ in range(1000):\n    print('x' * 100)\n    print('y' * 100, file=sys.stderr)\n"
    ));
    assert!(!run("open('/dev/shm/big', 'wb').write(b'0' * (2 << 20))\n"));
    assert!(!run("open('/tmp/big', 'wb').write(b'0' * (65 << 20))\n"));
}
