//! The collectives' contract, on ranks that are threads (the reference) and, with the `c10d`
//! feature, on Gloo ranks that are processes: this test binary runs itself once per rank.

use k3mini_dist::threads::{self, ThreadRank};
use k3mini_dist::{Collective, DistError, all_reduce_ordered};
use std::time::{Duration, Instant};

/// Rank `rank`'s buffer of `n`: values of mixed sign and scale, so sums round.
fn buffer(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (i as f32 * 0.37 + rank as f32).sin() * 10f32.powi((i % 7) as i32 - 3))
        .collect()
}

/// What one rank's collectives give, in a fixed order: all-reduce, the ordered all-reduce,
/// reduce-scatter, all-gather, broadcast from the last rank, an f64 all-reduce.
fn script(c: &mut dyn Collective, n: usize) -> Vec<Vec<f64>> {
    let (rank, world) = (c.rank(), c.world());
    let mut out = Vec::new();
    let widen = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let mut a = buffer(rank, n);
    c.all_reduce(&mut a).unwrap();
    out.push(widen(&a));
    let mut o = buffer(rank, n);
    all_reduce_ordered(c, &mut o).unwrap();
    out.push(widen(&o));
    let mut piece = vec![0.0; n];
    c.reduce_scatter(&buffer(rank, n * world), &mut piece)
        .unwrap();
    out.push(widen(&piece));
    let mut all = vec![0.0; n * world];
    c.all_gather(&buffer(rank, n), &mut all).unwrap();
    out.push(widen(&all));
    let mut b = buffer(rank, n);
    c.broadcast(&mut b, world - 1).unwrap();
    out.push(widen(&b));
    let mut f = vec![rank as f64 + 0.1, 1e-17 * rank as f64];
    c.all_reduce_f64(&mut f).unwrap();
    out.push(f);
    c.barrier().unwrap();
    out
}

/// `script` on `world` thread ranks: each rank's results.
fn on_threads(world: usize, n: usize) -> Vec<Vec<Vec<f64>>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = threads::group(world, Duration::from_secs(20))
            .into_iter()
            .map(|mut r| s.spawn(move || script(&mut r, n)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn thread_ranks_sum_in_rank_order_and_agree_bit_for_bit() {
    let (world, n) = (3, 101);
    let results = on_threads(world, n);
    // One process summing the ranks' buffers in rank order.
    let mut sum = buffer(0, n);
    for r in 1..world {
        for (s, x) in sum.iter_mut().zip(buffer(r, n)) {
            *s += x;
        }
    }
    let sum: Vec<f64> = sum.iter().map(|&x| f64::from(x)).collect();
    for (rank, got) in results.iter().enumerate() {
        assert_eq!(got[0], sum, "all_reduce on rank {rank}");
        assert_eq!(got[1], sum, "ordered all_reduce on rank {rank}");
        let whole: Vec<Vec<f32>> = (0..world).map(|r| buffer(r, n * world)).collect();
        let mut piece: Vec<f32> = whole[0][rank * n..(rank + 1) * n].to_vec();
        for w in &whole[1..] {
            for (p, x) in piece.iter_mut().zip(&w[rank * n..(rank + 1) * n]) {
                *p += x;
            }
        }
        assert_eq!(
            got[2],
            piece.iter().map(|&x| f64::from(x)).collect::<Vec<_>>()
        );
        let gathered: Vec<f64> = (0..world)
            .flat_map(|r| buffer(r, n))
            .map(f64::from)
            .collect();
        assert_eq!(got[3], gathered);
        let last: Vec<f64> = buffer(world - 1, n).iter().map(|&x| f64::from(x)).collect();
        assert_eq!(got[4], last);
        assert_eq!(got[5], vec![0.1 + 1.1 + 2.1, 1e-17 + 2e-17]);
    }
}

#[test]
fn thread_ranks_refuse_what_does_not_fit_and_never_hang() {
    // Lengths that are not a rank's pieces, or a root outside the group: refused at once.
    let mut ranks = threads::group(2, Duration::from_secs(20));
    let mut out = vec![0.0; 3];
    let err = ranks[0].reduce_scatter(&[0.0; 5], &mut out).unwrap_err();
    assert!(err.to_string().contains("not 2 pieces of 3"), "{err}");
    let err = ranks[0].broadcast(&mut out, 2).unwrap_err();
    assert!(err.to_string().contains("root rank 2"), "{err}");
    let mut pair = threads::group(2, Duration::from_secs(20));
    let errs = both(&mut pair, |r| {
        let root = r.rank();
        r.broadcast(&mut [0.0; 2], root)
    });
    for e in errs {
        let e = e.unwrap_err().to_string();
        assert!(e.contains("different roots: [0, 1]"), "{e}");
    }

    // Ranks that disagree on a length, or on the operation, are told so.
    let mut pair = threads::group(2, Duration::from_secs(20));
    let errs = both(&mut pair, |r| {
        let mut v = vec![0.0; 3 + r.rank()];
        r.all_reduce(&mut v)
    });
    for e in errs {
        let e = e.unwrap_err().to_string();
        assert!(e.contains("different lengths: [3, 4]"), "{e}");
    }
    let mut pair = threads::group(2, Duration::from_secs(20));
    let errs = both(&mut pair, |r| match r.rank() {
        0 => r.barrier(),
        _ => r.all_reduce(&mut [1.0]),
    });
    for e in errs {
        assert!(e.unwrap_err().to_string().contains("different operations"));
    }

    // A rank that leaves ends the others' wait at once; one that never comes, at the timeout.
    let mut pair = threads::group(2, Duration::from_secs(60));
    let gone = pair.pop().unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(gone);
        });
        let err = pair[0].barrier().unwrap_err();
        assert!(err.to_string().contains("rank 1 left the group"), "{err}");
    });
    assert!(t0.elapsed() < Duration::from_secs(30));
    let mut pair = threads::group(2, Duration::from_millis(200));
    let err = pair[0].barrier().unwrap_err();
    assert!(
        matches!(&err, DistError::Timeout { rank: 0, .. }) && err.to_string().contains("[1]"),
        "{err}"
    );
    // The group is broken from then on, for every rank.
    let err = pair[1].barrier().unwrap_err();
    assert!(err.to_string().contains("broken"), "{err}");
}

/// `f` on both ranks of a pair at once.
fn both<T: Send>(pair: &mut [ThreadRank], f: impl Fn(&mut ThreadRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = pair.iter_mut().map(|r| s.spawn(|| f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(feature = "c10d")]
mod gloo {
    use super::*;
    use k3mini_dist::c10d::{Backend, Group};
    use k3mini_dist::launch::{Device, Rendezvous, Store};
    use std::path::{Path, PathBuf};

    /// Set in a rank this binary started: `TEST RANK WORLD STORE OUT N`.
    const WORKER: &str = "K3MINI_DIST_WORKER";

    struct Scratch(PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            std::fs::remove_dir_all(&self.0).ok();
        }
    }

    fn scratch(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("k3mini-dist-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Rank `rank` of `world` meeting in the file store `store`.
    fn at(
        store: &Path,
        device: Device,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Rendezvous {
        Rendezvous {
            store: Store::File(store.to_path_buf()),
            prefix: "test".into(),
            device,
            rank,
            world,
            timeout,
        }
    }

    /// Joins as rank `rank`, moving whole buffers (`piece_bytes` 0) or pieces of that many bytes.
    fn join(
        rank: usize,
        world: usize,
        store: &Path,
        timeout: Duration,
        piece_bytes: usize,
    ) -> Group {
        Group::join_in_pieces(
            &at(
                &store,
                Device::Host("127.0.0.1".into()),
                rank,
                world,
                timeout,
            ),
            Backend::Gloo,
            piece_bytes,
        )
        .unwrap()
    }

    /// This process's part when the test started it as a rank: Some(its arguments).
    fn as_worker(test: &str) -> Option<Vec<String>> {
        let args: Vec<String> = std::env::var(WORKER)
            .ok()?
            .split('\t')
            .map(String::from)
            .collect();
        (args[0] == test).then_some(args)
    }

    /// Starts `world` ranks of test `test` (this binary, filtered to it), each told its rank.
    fn launch(test: &str, world: usize, dir: &Path, extra: &str) -> Ranks {
        let ranks = (0..world)
            .map(|rank| {
                let args = [
                    test,
                    &rank.to_string(),
                    &world.to_string(),
                    dir.join("store").to_str().unwrap(),
                    dir.join(format!("rank-{rank}")).to_str().unwrap(),
                    extra,
                ]
                .join("\t");
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", &format!("gloo::{test}"), "--nocapture"])
                    .env(WORKER, args)
                    .spawn()
                    .unwrap()
            })
            .collect();
        Ranks(ranks)
    }

    /// The rank processes a test started: killed if the test ends before they do.
    struct Ranks(Vec<std::process::Child>);

    impl Ranks {
        /// Waits for every rank; whether each succeeded.
        fn wait(&mut self) -> Vec<bool> {
            self.0
                .iter_mut()
                .map(|c| c.wait().unwrap().success())
                .collect()
        }
    }

    impl Drop for Ranks {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// A rank's [`script`] results, written to `out` as little-endian f64s.
    fn write_results(g: &mut Group, n: usize, out: &Path) {
        let bytes: Vec<u8> = script(g, n)
            .iter()
            .flat_map(|v| v.iter().flat_map(|x| x.to_le_bytes()))
            .collect();
        std::fs::write(out, bytes).unwrap();
    }

    /// The results each rank wrote in `dir` are the thread ranks': the ring's all-reduce and
    /// reduce-scatter within their rounding, the rest (the ordered sum included) to the bit.
    fn check_against_threads(dir: &Path, world: usize, n: usize) {
        let reference = on_threads(world, n);
        for (rank, want) in reference.iter().enumerate() {
            let bytes = std::fs::read(dir.join(format!("rank-{rank}"))).unwrap();
            let got: Vec<f64> = bytes
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            // What an element of the all-reduce or the reduce-scatter sums: the rounding of a
            // sum in another order is bounded by its summands' magnitude, not by the sum's.
            let magnitude = |len: usize, at: usize| -> f64 {
                (0..world)
                    .map(|r| f64::from(buffer(r, len)[at].abs()))
                    .sum()
            };
            let bound = 2.0 * world as f64 * f64::from(f32::EPSILON);
            let mut at = 0;
            for (i, want) in want.iter().enumerate() {
                let got = &got[at..at + want.len()];
                at += want.len();
                if matches!(i, 0 | 2) {
                    let (len, offset) = if i == 0 {
                        (n, 0)
                    } else {
                        (n * world, n * rank)
                    };
                    for (j, (g, w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (g - w).abs() <= bound * magnitude(len, offset + j),
                            "world {world}, rank {rank}, result {i}[{j}]: {g} vs {w}"
                        );
                    }
                } else {
                    assert_eq!(got, &want[..], "world {world}, rank {rank}, result {i}");
                }
            }
            assert_eq!(at, got.len());
        }
    }

    #[test]
    fn gloo_ranks_in_processes_give_what_thread_ranks_give() {
        const TEST: &str = "gloo_ranks_in_processes_give_what_thread_ranks_give";
        if let Some(a) = as_worker(TEST) {
            let (rank, world, n, pieces): (usize, usize, usize, usize) = (
                a[1].parse().unwrap(),
                a[2].parse().unwrap(),
                a[5].parse().unwrap(),
                a[6].parse().unwrap(),
            );
            let mut g = join(
                rank,
                world,
                Path::new(&a[3]),
                Duration::from_secs(60),
                pieces,
            );
            write_results(&mut g, n, Path::new(&a[4]));
            return;
        }
        // Whole buffers, and pieces of 244 bytes (NCCL's staging, here on the host): 61 f32s of
        // an all-reduce, 15 of each rank's piece of a gather or scatter, lengths that divide none
        // of the buffers, so every operation has a short last piece.
        for (world, pieces) in [(2, 0), (3, 0), (3, 244)] {
            let n = 1000;
            let dir = scratch(&format!("gloo-{world}-{pieces}"));
            let ok = launch(TEST, world, &dir.0, &format!("{n}\t{pieces}")).wait();
            assert!(ok.iter().all(|&ok| ok), "ranks' success: {ok:?}");
            check_against_threads(&dir.0, world, n);
        }
    }

    /// `torchrun --standalone --no-python` starts the ranks: they find each other through its
    /// agent's TCP store from the variables it sets ([`k3mini_dist::launch::from_env`]).
    #[test]
    fn torchrun_ranks_meet_through_its_agents_store() {
        const TEST: &str = "torchrun_ranks_meet_through_its_agents_store";
        let n = 300;
        if let Some(a) = as_worker(TEST) {
            let launched =
                k3mini_dist::launch::from_env(&|k| std::env::var(k).ok(), Duration::from_secs(60))
                    .unwrap()
                    .expect("torchrun's variables");
            assert!(matches!(
                launched.rendezvous.store,
                Store::Tcp { server: false, .. }
            ));
            let mut g = Group::join(&launched.rendezvous, Backend::Gloo).unwrap();
            let out = Path::new(&a[4]).join(format!("rank-{}", launched.rendezvous.rank));
            write_results(&mut g, n, &out);
            return;
        }
        let dir = scratch("torchrun");
        let status = std::process::Command::new("torchrun")
            .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", &format!("gloo::{TEST}"), "--nocapture"])
            .env(WORKER, format!("{TEST}\t-\t-\t-\t{}\t", dir.0.display()))
            .status()
            .expect("torchrun on PATH (PyTorch's, as the c10d feature's build uses)");
        assert!(status.success(), "torchrun: {status}");
        check_against_threads(&dir.0, 2, n);
    }

    #[test]
    fn a_rank_that_never_comes_fails_the_join_at_the_timeout() {
        let dir = scratch("never");
        let t0 = Instant::now();
        let err = Group::join(
            &at(
                &dir.0.join("store"),
                Device::Host("127.0.0.1".into()),
                0,
                2,
                Duration::from_secs(1),
            ),
            Backend::Gloo,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.starts_with("join: "), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(20), "{err}");
        // A rank outside its group is refused before anything is tried.
        let err = Group::join(
            &at(
                &dir.0.join("store"),
                Device::Default,
                2,
                2,
                Duration::from_secs(1),
            ),
            Backend::Gloo,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("rank 2 of a group of 2"), "{err}");
    }

    #[test]
    fn a_rank_that_dies_ends_the_others_wait_with_a_named_error() {
        const TEST: &str = "a_rank_that_dies_ends_the_others_wait_with_a_named_error";
        if let Some(a) = as_worker(TEST) {
            let rank: usize = a[1].parse().unwrap();
            let mut g = join(rank, 2, Path::new(&a[3]), Duration::from_secs(20), 0);
            // Both are in the group before one goes.
            g.barrier().unwrap();
            if rank == 1 {
                // Gone without a word, as a killed process is.
                std::process::exit(3);
            }
            let t0 = Instant::now();
            let err = g.all_reduce(&mut [1.0; 64]).unwrap_err();
            let failed = t0.elapsed().as_secs_f64();
            // The group refuses what follows, and lets go of its peer at once.
            let again = g.barrier().unwrap_err();
            let t1 = Instant::now();
            drop(g);
            let dropped = t1.elapsed().as_secs_f64();
            std::fs::write(&a[4], format!("{failed:.2}\t{dropped:.2}\t{err}\t{again}")).unwrap();
            return;
        }
        let dir = scratch("dies");
        assert_eq!(launch(TEST, 2, &dir.0, "").wait(), [true, false]);
        let report = std::fs::read_to_string(dir.0.join("rank-0")).unwrap();
        let fields: Vec<&str> = report.split('\t').collect();
        let seconds = |i: usize| fields[i].parse::<f64>().unwrap();
        assert!(fields[2].starts_with("all_reduce: "), "{report}");
        assert!(
            fields[3].starts_with("barrier: the group failed earlier: "),
            "{report}"
        );
        // The peer's death is seen, not waited out: well inside the 20 s timeout.
        assert!(seconds(0) < 5.0 && seconds(1) < 5.0, "{report}");
    }

    /// NCCL: a group of one on CUDA device 0 gives what a thread rank gives (every result of a
    /// group of one is exact), its buffers copied through the device; where this process sees no
    /// CUDA device, joining fails saying so, never a crash. (Two and more ranks on GPUs:
    /// scripts/device/gpu-check.sh.)
    #[cfg(feature = "nccl")]
    #[test]
    fn nccl_runs_on_a_cuda_device_or_says_there_is_none() {
        let dir = scratch("nccl");
        let joined = Group::join(
            &at(
                &dir.0.join("store"),
                Device::Default,
                0,
                1,
                Duration::from_secs(60),
            ),
            Backend::Nccl { cuda: 0 },
        );
        let gpu = Path::new("/dev/nvidia0").exists();
        match joined {
            Ok(mut g) => {
                assert!(gpu, "NCCL joined without a GPU");
                assert_eq!(script(&mut g, 257), on_threads(1, 257).remove(0));
            }
            Err(e) => {
                let e = e.to_string();
                assert!(!gpu, "a GPU is here and NCCL failed: {e}");
                assert!(e.starts_with("join: ") && e.contains("CUDA device"), "{e}");
            }
        }
    }
}
