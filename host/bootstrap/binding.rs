//! Binding ranks to cores, for launchers. When a host's ranks are no more than its cores, each
//! rank on a core of its own keeps the scheduler from stacking two ranks on one core, where
//! every wait for the other costs a context switch: measured, 8-byte send/recv over TCP between
//! two processes took 3.3-4.0 us bound and 3.3-11.9 us unbound, varying from run to run
//! (docs/results/cpu.md). A core is a physical one: a rank gets every CPU of its core that this
//! process may use (its hyperthreads), as Open MPI's `--bind-to core` does. A rank with
//! threads of its own that should run beside it (many threads of a host-device kernel, a
//! compute pool) should not be bound: launchers bind only when asked.

use crate::contracts::error::{Error, Result};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// The CPUs of each of `local_ranks` ranks: one physical core each, from the cores this
/// process may run on, in the order of their first CPU; `None` when the ranks outnumber the
/// cores (then binding would stack ranks, which is what it is meant to prevent).
pub fn cores_for_ranks(local_ranks: usize) -> Result<Option<Vec<Vec<usize>>>> {
    let allowed = sched_getaffinity(None).map_err(|e| Error::io("sched_getaffinity", e.into()))?;
    let mut cores: Vec<((u64, u64), Vec<usize>)> = Vec::new();
    for cpu in (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)) {
        let key = core_of(cpu);
        match cores.iter_mut().find(|(k, _)| *k == key) {
            Some((_, cpus)) => cpus.push(cpu),
            None => cores.push((key, vec![cpu])),
        }
    }
    Ok((local_ranks <= cores.len()).then(|| cores.into_iter().take(local_ranks).map(|(_, c)| c).collect()))
}

/// The (package, core) a CPU belongs to, as the kernel's topology says; a CPU whose topology
/// cannot be read counts as a core of its own.
fn core_of(cpu: usize) -> (u64, u64) {
    let read = |what: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{cpu}/topology/{what}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    match (read("physical_package_id"), read("core_id")) {
        (Some(p), Some(c)) => (p, c),
        _ => (u64::MAX, cpu as u64),
    }
}

/// Binds the calling process (its calling thread, and what it starts or execs afterwards) to
/// `cpus`. Plain system calls on the stack, no allocation: a launcher may call it between fork
/// and exec (`CommandExt::pre_exec`).
pub fn bind_to_core(cpus: &[usize]) -> std::io::Result<()> {
    let mut set = CpuSet::new();
    for &cpu in cpus {
        if cpu >= CpuSet::MAX_CPU {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        set.set(cpu);
    }
    if cpus.is_empty() {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    sched_setaffinity(None, &set).map_err(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_get_distinct_allowed_cores_only_while_they_fit() {
        let allowed = sched_getaffinity(None).unwrap();
        let mut n = 0;
        while cores_for_ranks(n + 1).unwrap().is_some() {
            n += 1;
        }
        assert!(n >= 1);
        let cores = cores_for_ranks(n).unwrap().unwrap();
        let cpus: Vec<usize> = cores.iter().flatten().copied().collect();
        assert!(cpus.iter().all(|&c| allowed.is_set(c)));
        let mut distinct = cpus.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), cpus.len(), "no CPU in two cores: {cores:?}");
        assert_eq!(
            cpus.len(),
            (0..CpuSet::MAX_CPU).filter(|&c| allowed.is_set(c)).count(),
            "every allowed CPU is in some core"
        );
        assert!(bind_to_core(&[CpuSet::MAX_CPU]).is_err());
        assert!(bind_to_core(&[]).is_err());
    }
}
