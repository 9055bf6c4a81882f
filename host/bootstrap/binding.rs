//! Binding ranks to cores, for launchers. When a host's ranks are no more than its cores, each
//! rank on a core of its own keeps the scheduler from stacking two ranks on one core, where
//! every wait for the other costs a context switch: measured, 8-byte send/recv over TCP between
//! two processes took 3.4-4.0 us bound and 3.5-11.9 us unbound, varying from run to run
//! (docs/results/cpu.md). Open MPI binds so by default at two ranks. A rank with threads of its
//! own that should run beside it (many threads of a host-device kernel, a compute pool) should
//! not be bound: launchers bind only when asked.

use crate::contracts::error::{Error, Result};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// The core of each of `local_ranks` ranks, from the cores this process may run on, in order;
/// `None` when the ranks outnumber them (then binding would stack ranks, which is what it is
/// meant to prevent).
pub fn cores_for_ranks(local_ranks: usize) -> Result<Option<Vec<usize>>> {
    let allowed = sched_getaffinity(None).map_err(|e| Error::io("sched_getaffinity", e.into()))?;
    let cores: Vec<usize> = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).collect();
    Ok((local_ranks <= cores.len()).then(|| cores[..local_ranks].to_vec()))
}

/// Binds the calling process (its calling thread, and what it starts or execs afterwards) to
/// `core`. A plain system call that allocates nothing: a launcher may call it between fork and
/// exec (`CommandExt::pre_exec`).
pub fn bind_to_core(core: usize) -> std::io::Result<()> {
    if core >= CpuSet::MAX_CPU {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let mut set = CpuSet::new();
    set.set(core);
    sched_setaffinity(None, &set).map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_distinct_allowed_cores_only_while_they_fit() {
        let allowed = sched_getaffinity(None).unwrap();
        let n = (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).count();
        let cores = cores_for_ranks(n).unwrap().expect("as many ranks as cores fit");
        assert_eq!(cores.len(), n);
        assert!(cores.iter().all(|&c| allowed.is_set(c)));
        assert!(cores.windows(2).all(|w| w[0] < w[1]), "distinct: {cores:?}");
        assert_eq!(cores_for_ranks(n + 1).unwrap(), None);
        assert!(bind_to_core(CpuSet::MAX_CPU).is_err());
    }
}
