//! Where a rank finds its group: the variables a launcher sets. torchrun's (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT`, and its agent's store when
//! `TORCHELASTIC_USE_AGENT_STORE` says so), else SLURM's for an `srun` job step of one task per
//! device (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the master the first host of the
//! step's node list unless `MASTER_ADDR` names it, the port from the job id unless `MASTER_PORT`
//! does, so jobs sharing a node do not collide). Neither: one process, no group.
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
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
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
    /// How many times the launcher has restarted the group (torchrun's `--max-restarts`).
    pub restart: u64,
}

/// The port a store listens on when `MASTER_PORT` is not set (torch's default).
pub const DEFAULT_PORT: u16 = 29500;

/// The rank `var` (an environment lookup) describes, waiting `timeout` for the others; None when
/// no launcher started this process as one rank of several.
pub fn from_env(
    var: &dyn Fn(&str) -> Option<String>,
    timeout: Duration,
) -> Result<Option<Launched>> {
    let number = |name: &str| -> Result<Option<u64>> {
        var(name)
            .map(|v| {
                v.trim()
                    .parse::<u64>()
                    .map_err(|_| DistError::Launch(format!("{name}={v:?} is not a whole number")))
            })
            .transpose()
    };
    let required = |name: &str| -> Result<u64> {
        number(name)?.ok_or_else(|| {
            DistError::Launch(format!(
                "RANK is set but {name} is not: start every rank with torchrun (or set RANK, \
                 WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together)"
            ))
        })
    };
    let (launcher, rank, world, local_rank, restart, run) = if var("RANK").is_some() {
        (
            Launcher::Torchrun,
            required("RANK")?,
            required("WORLD_SIZE")?,
            required("LOCAL_RANK")?,
            number("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0),
            var("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "none".into()),
        )
    } else if var("SLURM_STEP_ID").is_some()
        && let (Some(rank), Some(world)) = (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
    {
        (
            Launcher::Slurm,
            rank,
            world,
            number("SLURM_LOCALID")?.unwrap_or(0),
            number("SLURM_RESTART_COUNT")?.unwrap_or(0),
            format!(
                "slurm-{}-{}",
                var("SLURM_JOB_ID").unwrap_or_default(),
                var("SLURM_STEP_ID").unwrap_or_default()
            ),
        )
    } else {
        return Ok(None);
    };
    if world <= 1 && rank == 0 {
        return Ok(None);
    }
    if rank >= world {
        return Err(DistError::Launch(format!(
            "rank {rank} of a group of {world}: the launcher's variables disagree"
        )));
    }
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
        (_, Launcher::Torchrun) => {
            return Err(DistError::Launch(
                "RANK is set but MASTER_ADDR is not: start every rank with torchrun".into(),
            ));
        }
    };
    let port = match number("MASTER_PORT")? {
        None if launcher == Launcher::Slurm => {
            let job = number("SLURM_JOB_ID")?.unwrap_or(0);
            DEFAULT_PORT + (job % 20_000) as u16
        }
        None => DEFAULT_PORT,
        Some(p) => u16::try_from(p)
            .map_err(|_| DistError::Launch(format!("MASTER_PORT={p} is not a port")))?,
    };
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
    let device = match var("GLOO_SOCKET_IFNAME") {
        Some(i) if !i.is_empty() => Device::Interface(i),
        _ => Device::Default,
    };
    let as_usize = |n: u64| usize::try_from(n).map_err(|_| DistError::Launch(format!("{n} ranks")));
    Ok(Some(Launched {
        rendezvous: Rendezvous {
            store: Store::Tcp {
                host,
                port,
                server: !agent_store && rank == 0,
            },
            prefix: format!("k3mini/{run}/{restart}"),
            device,
            rank: as_usize(rank)?,
            world: as_usize(world)?,
            timeout,
        },
        local_rank: as_usize(local_rank)?,
        launcher,
        restart,
    }))
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
            port: DEFAULT_PORT + 77,
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
        assert_eq!(launch(&[]).unwrap(), None);
        assert_eq!(
            launch(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap(),
            None
        );
        let one = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
        assert_eq!(launch(&one).unwrap(), None);
        for (vars, says) in [
            (
                &[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")][..],
                "RANK=\"x\"",
            ),
            (
                &[("RANK", "1"), ("LOCAL_RANK", "0")][..],
                "WORLD_SIZE is not",
            ),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")][..],
                "rank 2 of a group of 2",
            ),
            (
                &[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")][..],
                "MASTER_ADDR is not",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "70000"),
                ][..],
                "MASTER_PORT=70000",
            ),
        ] {
            let err = launch(vars).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
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
