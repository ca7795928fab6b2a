//! Where a rank finds its group: the variables a launcher sets. torchrun's (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT`, and its agent's store when
//! `TORCHELASTIC_USE_AGENT_STORE` says so), else SLURM's for an `srun` job step of one task per
//! device (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the master the first host of the
//! step's node list unless `MASTER_ADDR` names it, the port from the job id unless `MASTER_PORT`
//! does, so jobs sharing a node do not collide). Neither: one process, no group. Either way,
//! [`STORE_FILE`] makes the ranks meet in a file instead of a TCP store.
//!
//! Under torchrun the keys go under its run id and restart count, which every node's agent
//! counts alike only while the membership is fixed (`--nnodes N`, not a range): an elastic
//! group that changes size is not supported.

use crate::{DistError, Result};
use std::time::Duration;

/// Where the ranks meet to find each other.
#[derive(Clone, Debug, PartialEq)]
pub enum Store {
    /// A file on a file system every rank sees (one machine, or a shared mount).
    File(std::path::PathBuf),
    /// A TCP store at `host:port`; the rank with `server` set serves it (torchrun's agent serves
    /// its own, and then no rank does).
    Tcp {
        host: String,
        port: u16,
        server: bool,
    },
}

/// The address a rank's connections listen on, for the other ranks to reach.
#[derive(Clone, Debug, PartialEq)]
pub enum Device {
    /// This machine's hostname, resolved (loopback if it does not resolve): torch's default.
    Default,
    /// An address or a hostname.
    Host(String),
    /// A network interface's address (`GLOO_SOCKET_IFNAME`, as torch reads it).
    Interface(String),
}

/// What a rank needs to join its group.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendezvous {
    pub store: Store,
    /// Keys go under it: a store that outlives a group (torchrun's, across restarts) must not
    /// hand a new group the old one's addresses.
    pub prefix: String,
    pub device: Device,
    pub rank: usize,
    pub world: usize,
    /// How long joining, a store lookup or an operation waits for the other ranks.
    pub timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Launcher {
    Torchrun,
    Slurm,
    /// Seen, to be refused: its ranks carry no rendezvous k3mini reads.
    Mpi,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
            Launcher::Mpi => "mpirun",
        })
    }
}

/// A rank a launcher started.
#[derive(Clone, Debug, PartialEq)]
pub struct Launched {
    pub rendezvous: Rendezvous,
    /// Its place among the ranks on its machine: the device it takes.
    pub local_rank: usize,
    pub launcher: Launcher,
    pub attempt: Attempt,
}

/// Which start of a group a process belongs to: its launch, and how many times the launcher has
/// restarted the group within it (torchrun's `--max-restarts`, a SLURM job's requeues).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attempt {
    /// The launch's name: torchrun's run id (`--rdzv-id`, a fresh one under `--standalone`,
    /// `none` when neither is given), or the SLURM job and step.
    pub run: String,
    pub restart: u64,
}

/// The port a store listens on when `MASTER_PORT` is not set (torch's default).
pub const DEFAULT_PORT: u16 = 29500;

/// The ports a SLURM job's store takes when `MASTER_PORT` is not set: one per job id, below
/// Linux's ephemeral ports (32768 up), so neither another job's store nor an outgoing connection
/// holds it.
pub const SLURM_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A launcher's rank: which launcher, and its place in the group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ranks {
    pub launcher: Launcher,
    pub rank: u64,
    pub world: u64,
}

/// `name`'s value as a whole number, if set.
fn number(var: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<u64>> {
    var(name)
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| DistError::Launch(format!("{name}={v:?} is not a whole number")))
        })
        .transpose()
}

/// Which launcher started this process as one rank of several, from the group size and rank
/// alone: torchrun (`WORLD_SIZE`, `RANK`), an srun job step (`SLURM_NTASKS`, `SLURM_PROCID`; a
/// batch script's own step sets no `SLURM_STEP_ID`), mpirun (Open MPI's `OMPI_COMM_WORLD_*`,
/// MPICH's and Intel MPI's `PMI_*`). None for one process: no launcher, or a group of one.
pub fn ranks(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Ranks>> {
    let slurm = var("SLURM_STEP_ID").is_some();
    let found = [
        (Launcher::Torchrun, "WORLD_SIZE", "RANK", true),
        (Launcher::Slurm, "SLURM_NTASKS", "SLURM_PROCID", slurm),
        (
            Launcher::Mpi,
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            true,
        ),
        (Launcher::Mpi, "PMI_SIZE", "PMI_RANK", true),
    ]
    .into_iter()
    .filter(|&(.., applies)| applies)
    .find_map(|(launcher, size, rank, _)| {
        number(var, size)
            .transpose()
            .map(|world| world.map(|w| (launcher, rank, w)))
    })
    .transpose()?;
    let Some((launcher, rank_var, world)) = found else {
        return Ok(None);
    };
    if world <= 1 {
        return Ok(None);
    }
    let rank = number(var, rank_var)?.ok_or_else(|| {
        DistError::Launch(format!(
            "{launcher} says the group has {world} ranks but {rank_var} is not set"
        ))
    })?;
    if rank >= world {
        return Err(DistError::Launch(format!(
            "rank {rank} of a group of {world}: {launcher}'s variables disagree"
        )));
    }
    Ok(Some(Ranks {
        launcher,
        rank,
        world,
    }))
}

/// The rank `var` (an environment lookup) describes, waiting `timeout` for the others; None when
/// no launcher started this process as one rank of several ([`ranks`]).
pub fn from_env(
    var: &dyn Fn(&str) -> Option<String>,
    timeout: Duration,
) -> Result<Option<Launched>> {
    let Some(Ranks {
        launcher,
        rank,
        world,
    }) = ranks(var)?
    else {
        return Ok(None);
    };
    let number = |name: &str| number(var, name);
    let (local_rank, restart, run) = match launcher {
        // One process a machine (a pod of a Kubeflow job) sets no LOCAL_RANK.
        Launcher::Torchrun => (
            number("LOCAL_RANK")?.unwrap_or(0),
            number("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0),
            var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
        ),
        Launcher::Slurm => (
            number("SLURM_LOCALID")?.unwrap_or(0),
            number("SLURM_RESTART_COUNT")?.unwrap_or(0),
            format!(
                "slurm-{}-{}",
                var("SLURM_JOB_ID").unwrap_or_default(),
                var("SLURM_STEP_ID").unwrap_or_default()
            ),
        ),
        Launcher::Mpi => {
            return Err(DistError::Launch(format!(
                "mpirun started this process as rank {rank} of {world}: k3mini's ranks meet \
                 through torchrun's or SLURM's variables; launch them with torchrun or srun"
            )));
        }
    };
    let file = var(STORE_FILE).filter(|f| !f.trim().is_empty());
    let store = match file {
        Some(f) => Store::File(f.into()),
        None => tcp_store(var, launcher, rank)?,
    };
    let device = match var("GLOO_SOCKET_IFNAME") {
        Some(i) if !i.is_empty() => Device::Interface(i),
        _ => Device::Default,
    };
    let as_usize = |n: u64| usize::try_from(n).map_err(|_| DistError::Launch(format!("{n} ranks")));
    Ok(Some(Launched {
        rendezvous: Rendezvous {
            store,
            prefix: format!("k3mini/{run}/{restart}"),
            device,
            rank: as_usize(rank)?,
            world: as_usize(world)?,
            timeout,
        },
        local_rank: as_usize(local_rank)?,
        launcher,
        attempt: Attempt { run, restart },
    }))
}

/// The variable naming a file every rank sees (a shared mount, or one machine's disk) where the
/// ranks meet instead of `MASTER_ADDR:MASTER_PORT`: no port to choose, so tests and clusters
/// whose nodes share a file system need none.
pub const STORE_FILE: &str = "K3MINI_STORE_FILE";

/// The TCP store `MASTER_ADDR:MASTER_PORT` (or SLURM's first node and a port from the job id).
fn tcp_store(var: &dyn Fn(&str) -> Option<String>, launcher: Launcher, rank: u64) -> Result<Store> {
    let number = |name: &str| number(var, name);
    let host = match (var("MASTER_ADDR"), launcher) {
        (Some(h), _) if !h.trim().is_empty() => h.trim().to_string(),
        (_, Launcher::Slurm) => var("SLURM_STEP_NODELIST")
            .or_else(|| var("SLURM_JOB_NODELIST"))
            .as_deref()
            .and_then(first_host)
            .ok_or_else(|| {
                DistError::Launch(
                    "neither MASTER_ADDR nor SLURM_STEP_NODELIST names the first node".into(),
                )
            })?,
        (_, _) => {
            return Err(DistError::Launch(format!(
                "RANK is set but neither MASTER_ADDR nor {STORE_FILE} is: start every rank \
                     with torchrun"
            )));
        }
    };
    let port = match number("MASTER_PORT")? {
        None if launcher == Launcher::Slurm => {
            let job = number("SLURM_JOB_ID")?.unwrap_or(0);
            let span = u64::from(SLURM_PORTS.end - SLURM_PORTS.start);
            SLURM_PORTS.start + (job % span) as u16
        }
        None => DEFAULT_PORT,
        Some(p) => u16::try_from(p)
            .map_err(|_| DistError::Launch(format!("MASTER_PORT={p} is not a port")))?,
    };
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
    Ok(Store::Tcp {
        host,
        port,
        server: !agent_store && rank == 0,
    })
}

/// The first host of a SLURM node list: `node07`, `node[03-06,09]` → `node03`,
/// `gpu[1,4]-ib,cpu2` → `gpu1-ib`, `n[1-2]-ib[3-4]` → `n1-ib3`.
pub fn first_host(list: &str) -> Option<String> {
    // The first entry: up to a comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            depth += match c {
                '[' => 1,
                ']' => -1,
                _ => 0,
            };
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    // Each bracketed range becomes its first value.
    let (mut host, mut rest) = (String::new(), list[..end].trim());
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        let first = rest[open + 1..close].split(',').next()?.split('-').next()?;
        if first.is_empty() {
            return None;
        }
        host.push_str(&rest[..open]);
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launched>> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(&|k| env.get(k).cloned(), Duration::from_secs(30))
    }

    #[test]
    fn torchruns_variables_name_the_rank_and_its_agents_store() {
        let l = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RUN_ID", "abc"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(l.launcher, Launcher::Torchrun);
        assert_eq!(
            (l.rendezvous.rank, l.rendezvous.world, l.local_rank),
            (3, 8, 1)
        );
        let store = Store::Tcp {
            host: "node0".into(),
            port: 29400,
            server: false,
        };
        assert_eq!(l.rendezvous.store, store);
        // A restarted group's keys are its own.
        assert_eq!(l.rendezvous.prefix, "k3mini/abc/2");
        let attempt = Attempt {
            run: "abc".into(),
            restart: 2,
        };
        assert_eq!(l.attempt, attempt);
        // Without the agent's store, rank 0 serves one.
        let l = launch(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("GLOO_SOCKET_IFNAME", "eth1"),
        ])
        .unwrap()
        .unwrap();
        assert!(matches!(
            l.rendezvous.store,
            Store::Tcp {
                port: DEFAULT_PORT,
                server: true,
                ..
            }
        ));
        assert_eq!(l.rendezvous.device, Device::Interface("eth1".into()));
    }

    #[test]
    fn srun_tasks_become_ranks_meeting_on_the_first_node() {
        let l = launch(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_JOB_NODELIST", "gpu[011-013]"),
            ("SLURM_STEP_NODELIST", "gpu[012-013]"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(l.launcher, Launcher::Slurm);
        assert_eq!(
            (l.rendezvous.rank, l.rendezvous.world, l.local_rank),
            (5, 16, 5)
        );
        // The step's first node, and a port of the job's own.
        let store = Store::Tcp {
            host: "gpu012".into(),
            port: SLURM_PORTS.start + 77,
            server: false,
        };
        assert_eq!(l.rendezvous.store, store);
        assert_eq!(l.rendezvous.prefix, "k3mini/slurm-77-0/0");
        // torchrun under srun (one task per node): torchrun's variables win.
        let l = launch(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("RANK", "9"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "gpu012"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.launcher, l.rendezvous.rank), (Launcher::Torchrun, 9));
    }

    #[test]
    fn one_process_is_no_group_and_bad_variables_are_named() {
        // No launcher; a group of one (a Kubeflow job of one replica sets no LOCAL_RANK); a stray
        // RANK; a batch script's own step (no SLURM_STEP_ID); `srun -n1`.
        for vars in [
            &[][..],
            &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")][..],
            &[("RANK", "3")][..],
            &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")][..],
            &[
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
            ][..],
        ] {
            assert_eq!(launch(vars).unwrap(), None, "{vars:?}");
        }
        // A Kubeflow replica: no LOCAL_RANK, rank 0 serves the store.
        let l = launch(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])
            .unwrap()
            .unwrap();
        assert_eq!(l.local_rank, 0);
        // A store file stands in for MASTER_ADDR:MASTER_PORT, under any launcher.
        let l = launch(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            (STORE_FILE, "/shared/s"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(l.rendezvous.store, Store::File("/shared/s".into()));
        for (vars, says) in [
            (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "RANK=\"x\""),
            (&[("WORLD_SIZE", "2")][..], "RANK is not set"),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2")][..],
                "rank 2 of a group of 2",
            ),
            (
                &[("RANK", "1"), ("WORLD_SIZE", "2")][..],
                "neither MASTER_ADDR nor K3MINI_STORE_FILE is",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ][..],
                "MASTER_PORT=70000",
            ),
            (
                &[("OMPI_COMM_WORLD_SIZE", "8"), ("OMPI_COMM_WORLD_RANK", "3")][..],
                "mpirun started this process as rank 3 of 8",
            ),
        ] {
            let err = launch(vars).unwrap_err().to_string();
            assert!(err.contains(says), "{vars:?}: {err}");
        }
        // What refuses a launcher's rank reads the group alone: MPI's ranks are seen.
        let seen = ranks(&|k| {
            (k == "PMI_SIZE")
                .then(|| "4".into())
                .or((k == "PMI_RANK").then(|| "1".into()))
        })
        .unwrap()
        .unwrap();
        assert_eq!(
            (seen.launcher, seen.rank, seen.world),
            (Launcher::Mpi, 1, 4)
        );
    }

    #[test]
    fn the_first_host_of_a_node_list() {
        for (list, first) in [
            ("node07", "node07"),
            ("node07,node09", "node07"),
            ("node[03-06,09]", "node03"),
            ("gpu[1,4]-ib,cpu2", "gpu1-ib"),
            ("a1,b[2-3]", "a1"),
            ("n[1-2]-ib[3-4],x", "n1-ib3"),
        ] {
            assert_eq!(first_host(list).as_deref(), Some(first), "{list}");
        }
        for bad in ["", "node[03", "node[]", "node]3"] {
            assert_eq!(first_host(bad), None, "{bad}");
        }
    }
}
