//! Where am I in the job? Rank discovery from the variables the common launchers set, and the
//! store address from `FERROCOMM_STORE` or torchrun's `MASTER_ADDR`/`MASTER_PORT`.

use crate::contracts::error::{Error, Result};

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// This process's rank in the job, in `0..world_size`.
    pub rank: usize,
    /// The number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among those of its host (`rank` where the launcher sets none): the
    /// usual choice of GPU, `Device::Cuda(local_rank)`.
    pub local_rank: usize,
    /// Which launcher's variables were used: "torchrun", "slurm", "openmpi" or "pmi".
    pub source: &'static str,
}

/// (source, rank var, size var, local-rank vars in order of preference)
const LAUNCHERS: &[(&str, &str, &str, &[&str])] = &[
    ("torchrun", "RANK", "WORLD_SIZE", &["LOCAL_RANK"]),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        &["OMPI_COMM_WORLD_LOCAL_RANK"],
    ),
    ("pmi", "PMI_RANK", "PMI_SIZE", &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"]),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", &["SLURM_LOCALID"]),
];

fn parse(var: &str, v: &str) -> Result<usize> {
    v.trim()
        .parse()
        .map_err(|_| Error::Config(format!("{var}={v:?} is not a non-negative integer")))
}

/// Reads rank, world size and local rank through `lookup` (ferrocomm passes its settings' copy
/// of the environment, `Config::var`).
/// `Ok(None)` when no launcher variables are set at all.
///
/// The variables, in order of preference: torchrun's and ferrocomm-run's `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`; Open MPI's `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`; PMI's `PMI_RANK`,
/// `PMI_SIZE`, `MPI_LOCALRANKID` or `PMI_LOCAL_RANK`; Slurm's `SLURM_PROCID`, `SLURM_NTASKS`,
/// `SLURM_LOCALID`. `Error::Config` when a value is not a number or the rank is not below the
/// size.
///
/// ```
/// use ferrocomm::discover;
///
/// // What `ferrocomm-run -n 4` gives its third process.
/// let env = |k: &str| match k {
///     "RANK" | "LOCAL_RANK" => Some("2".to_string()),
///     "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => Some("4".to_string()),
///     _ => None,
/// };
/// let me = discover(env)?.expect("launcher variables are set");
/// assert_eq!((me.rank, me.world_size, me.local_rank, me.source), (2, 4, 2, "torchrun"));
///
/// // The process's own environment, as `new_comm` reads it.
/// let _here = discover(|k| std::env::var(k).ok())?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn discover(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<RankInfo>> {
    for (source, rank_var, size_var, local_vars) in LAUNCHERS {
        let (Some(r), Some(s)) = (lookup(rank_var), lookup(size_var)) else {
            continue;
        };
        let (rank, world_size) = (parse(rank_var, &r)?, parse(size_var, &s)?);
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!(
                "{rank_var}={rank} is not below {size_var}={world_size}"
            )));
        }
        let local_rank = match local_vars.iter().find_map(|v| lookup(v).map(|x| (v, x))) {
            Some((v, x)) => parse(v, &x)?,
            None => rank,
        };
        return Ok(Some(RankInfo {
            rank,
            world_size,
            local_rank,
            source,
        }));
    }
    Ok(None)
}

/// Where the job's store lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAddr {
    /// A TCP store server (hosted by rank 0 or the launcher).
    Tcp {
        /// Host name or IP address (IPv6 without brackets).
        host: String,
        /// TCP port.
        port: u16,
    },
    /// A [`FileStore`](crate::FileStore) in this directory.
    File(std::path::PathBuf),
}

/// `FERROCOMM_STORE=tcp://host:port | file:///dir`, else `MASTER_ADDR` + `MASTER_PORT`.
/// `Error::Config` when neither is set or a value is malformed.
///
/// ```
/// use ferrocomm::{store_addr, StoreAddr};
///
/// let torchrun = |k: &str| match k {
///     "MASTER_ADDR" => Some("10.0.0.1".to_string()),
///     "MASTER_PORT" => Some("29500".to_string()),
///     _ => None,
/// };
/// assert_eq!(store_addr(torchrun)?, StoreAddr::Tcp { host: "10.0.0.1".into(), port: 29500 });
/// let shared = |k: &str| (k == "FERROCOMM_STORE").then(|| "file:///shared/job7".to_string());
/// assert_eq!(store_addr(shared)?, StoreAddr::File("/shared/job7".into()));
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn store_addr(lookup: impl Fn(&str) -> Option<String>) -> Result<StoreAddr> {
    if let Some(s) = lookup("FERROCOMM_STORE") {
        if let Some(path) = s.strip_prefix("file://") {
            return Ok(StoreAddr::File(path.into()));
        }
        let hp = s.strip_prefix("tcp://").unwrap_or(&s);
        let (host, port) = hp.rsplit_once(':').ok_or_else(|| {
            Error::Config(format!(
                "FERROCOMM_STORE={s:?}: expected tcp://host:port or file:///dir"
            ))
        })?;
        let port = port
            .parse()
            .map_err(|_| Error::Config(format!("FERROCOMM_STORE={s:?}: bad port")))?;
        return Ok(StoreAddr::Tcp {
            host: host.trim_matches(['[', ']']).to_owned(),
            port,
        });
    }
    match (lookup("MASTER_ADDR"), lookup("MASTER_PORT")) {
        (Some(host), Some(port)) => Ok(StoreAddr::Tcp {
            host,
            port: port
                .parse()
                .map_err(|_| Error::Config(format!("MASTER_PORT={port:?} is not a port number")))?,
        }),
        _ => Err(Error::Config(
            "no store address: set MASTER_ADDR and MASTER_PORT (or FERROCOMM_STORE=tcp://host:port | file:///dir)"
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_variables_are_read() {
        let r = discover(env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank, r.source), (3, 8, 1, "torchrun"));
    }

    #[test]
    fn slurm_openmpi_and_pmi_variables_are_read() {
        let s = discover(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank, s.source), (5, 6, 2, "slurm"));
        let o = discover(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((o.rank, o.world_size, o.local_rank, o.source), (1, 2, 1, "openmpi"));
        let p = discover(env(&[("PMI_RANK", "0"), ("PMI_SIZE", "4"), ("MPI_LOCALRANKID", "0")]))
            .unwrap()
            .unwrap();
        assert_eq!((p.rank, p.world_size, p.source), (0, 4, "pmi"));
    }

    #[test]
    fn torchrun_wins_over_slurm_when_both_are_set() {
        let r = discover(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(r.source, "torchrun");
    }

    #[test]
    fn malformed_or_inconsistent_variables_are_config_errors() {
        assert!(matches!(
            discover(env(&[("RANK", "x"), ("WORLD_SIZE", "2")])),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            discover(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            discover(env(&[("RANK", "0"), ("WORLD_SIZE", "0")])),
            Err(Error::Config(_))
        ));
        assert_eq!(discover(env(&[])).unwrap(), None);
    }

    #[test]
    fn the_settings_keep_every_launcher_variable() {
        let config = crate::contracts::config::OTHER_VARIABLES;
        for (_, rank, size, locals) in LAUNCHERS {
            for v in [rank, size].into_iter().chain(locals.iter()) {
                assert!(config.contains(v), "{v} is missing from config::OTHER_VARIABLES");
            }
        }
        for v in ["MASTER_ADDR", "MASTER_PORT"] {
            assert!(config.contains(&v), "{v}");
        }
    }

    #[test]
    fn store_address_comes_from_ferrocomm_store_or_master_vars() {
        assert_eq!(
            store_addr(env(&[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")])).unwrap(),
            StoreAddr::Tcp {
                host: "10.0.0.1".into(),
                port: 29500
            }
        );
        assert_eq!(
            store_addr(env(&[
                ("FERROCOMM_STORE", "file:///tmp/x"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1")
            ]))
            .unwrap(),
            StoreAddr::File("/tmp/x".into())
        );
        assert_eq!(
            store_addr(env(&[("FERROCOMM_STORE", "tcp://[::1]:7")])).unwrap(),
            StoreAddr::Tcp {
                host: "::1".into(),
                port: 7
            }
        );
        assert!(matches!(
            store_addr(env(&[("MASTER_ADDR", "h")])),
            Err(Error::Config(_))
        ));
    }
}
