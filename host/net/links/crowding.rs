//! Whether a communicator's ranks outnumber the CPUs they run on, and so how its waits pace
//! themselves (`back_off`).
//!
//! A rank that waits for a peer spins a few rounds before it yields, which pays where every
//! rank has a CPU of its own: the peer's message usually comes within the spin. Where ranks
//! outnumber CPUs, the peer waited for is usually not running, and every round spun is taken
//! from a rank that has work. Measured on a 2-core machine, 4 processes, shared memory
//! (docs/results/cpu.md): 8-byte send/recv 2.5 us spinning 32 rounds, 1.6 us yielding at once;
//! 8-byte broadcast 21 us and 5 us; over TCP, 8-byte all_reduce 40 us and 19 us.
//!
//! The ranks counted are those on one kernel (the boot id in the host identity: ranks in other
//! network or mount namespaces of the machine share its CPUs too), the CPUs the union of their
//! affinity masks, which each rank publishes at set-up: ranks bound one to a core each are not
//! crowded, though each of them may run on one CPU only.

use crate::contracts::error::{Error, Result};
use rustix::thread::{sched_getaffinity, CpuSet};
use std::collections::BTreeSet;

/// Rounds a waiter spins before it yields where every rank has a CPU.
pub(crate) const SPIN_ROUNDS: u32 = 32;

/// The CPUs this thread may run on, as its set-up record carries them: indices separated by
/// commas ("-" if the kernel does not say, which counts as no CPU).
pub(crate) fn own_cpus() -> String {
    let Ok(set) = sched_getaffinity(None) else {
        return "-".into();
    };
    let cpus: Vec<String> = (0..CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .map(|c| c.to_string())
        .collect();
    if cpus.is_empty() {
        "-".into()
    } else {
        cpus.join(",")
    }
}

/// Whether the ranks of `ranks` (each its kernel, as `setup::kernel` reads it from its host
/// identity, and its CPU list) that share our kernel `mine` outnumber the CPUs they may run on
/// together. `Err`: a CPU list that is not one.
pub(crate) fn crowded<'a>(mine: &str, ranks: impl Iterator<Item = (&'a str, &'a str)>) -> Result<bool> {
    let (mut count, mut cpus) = (0usize, BTreeSet::new());
    for (_, list) in ranks.filter(|(kernel, _)| *kernel == mine) {
        count += 1;
        if list == "-" {
            continue;
        }
        for cpu in list.split(',') {
            let cpu: usize = cpu
                .parse()
                .map_err(|_| Error::protocol("transport setup", format!("malformed CPU list {list:?}")))?;
            cpus.insert(cpu);
        }
    }
    Ok(count > cpus.len().max(1))
}

/// Spin rounds for a waiter among ranks that are `crowded` or not.
pub(crate) fn spin_rounds(crowded: bool) -> u32 {
    if crowded {
        0
    } else {
        SPIN_ROUNDS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "boot-a";
    const B: &str = "boot-b";

    #[test]
    fn ranks_bound_one_to_a_cpu_are_not_crowded_but_four_on_two_cpus_are() {
        let bound = [(A, "0"), (A, "1")];
        assert!(!crowded(A, bound.into_iter()).unwrap());
        let four = [(A, "0,1"), (A, "0,1"), (A, "0,1"), (A, "0,1")];
        assert!(crowded(A, four.into_iter()).unwrap());
        // Ranks of another kernel run on CPUs of their own.
        let two_hosts = [(A, "0,1"), (A, "0,1"), (B, "0,1"), (B, "0,1")];
        assert!(!crowded(A, two_hosts.into_iter()).unwrap());
    }

    #[test]
    fn a_list_that_is_not_one_is_refused_and_an_unknown_one_counts_no_cpu() {
        assert!(crowded(A, [(A, "0,x")].into_iter()).is_err());
        assert!(crowded(A, [(A, "-"), (A, "-")].into_iter()).unwrap());
        assert!(!crowded(A, [(A, "-")].into_iter()).unwrap());
    }

    #[test]
    fn this_thread_has_a_cpu_list() {
        let own = own_cpus();
        assert!(
            own != "-" && own.split(',').all(|c| c.parse::<usize>().is_ok()),
            "{own}"
        );
    }
}
