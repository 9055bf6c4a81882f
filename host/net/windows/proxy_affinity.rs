//! Where a device window's proxy thread runs: on the CPUs that Linux lists as local to the GPU
//! (its PCI device's `local_cpulist`), so that its polls of the pinned ring and its copies out
//! of GPU memory do not cross a socket interconnect. `FERROCOMM_PROXY_AFFINITY=0` leaves the
//! thread where the scheduler puts it.

use crate::contracts::error::{Error, Result};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

/// Parses a Linux CPU list such as `0-3,8,10-11` (sysfs `local_cpulist`).
pub(crate) fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// The CPUs local to PCI device `bus_id` (as cuDeviceGetPCIBusId writes it), or `None` when
/// sysfs does not say or the knob turns pinning off (`pin`: the process's
/// `FERROCOMM_PROXY_AFFINITY`).
pub(crate) fn cpus_near_pci_device(bus_id: &str, pin: bool) -> Option<Vec<usize>> {
    if !pin {
        return None;
    }
    let path = format!("/sys/bus/pci/devices/{}/local_cpulist", bus_id.to_ascii_lowercase());
    parse_cpulist(&std::fs::read_to_string(path).ok()?)
}

/// Restricts the calling thread to those of `cpus` it is allowed to run on at all.
pub(crate) fn pin_current_thread(cpus: &[usize]) -> Result<()> {
    let allowed = sched_getaffinity(None).map_err(|e| Error::io("sched_getaffinity", e.into()))?;
    let mut set = CpuSet::new();
    let mut any = false;
    for &c in cpus.iter().filter(|&&c| c < CpuSet::MAX_CPU) {
        if allowed.is_set(c) {
            set.set(c);
            any = true;
        }
    }
    if !any {
        return Err(Error::invalid(
            "proxy affinity",
            format!("none of CPUs {cpus:?} is allowed for this process"),
        ));
    }
    sched_setaffinity(None, &set).map_err(|e| Error::io("sched_setaffinity", e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        for bad in ["", "\n", "3-1", "a", "1-", "1,,x"] {
            assert_eq!(parse_cpulist(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_thread_is_pinned_to_the_allowed_cpus_of_a_list() {
        let cpu_of = || {
            let set = sched_getaffinity(None).unwrap();
            (0..CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect::<Vec<_>>()
        };
        std::thread::spawn(move || {
            let allowed = cpu_of();
            let first = allowed[0];
            // CPUs outside the process's set are ignored; the allowed one is kept.
            pin_current_thread(&[first, 100_000]).unwrap();
            assert_eq!(cpu_of(), vec![first]);
            let e = pin_current_thread(&[100_000]).unwrap_err();
            assert!(e.to_string().contains("is allowed"), "{e}");
            assert_eq!(cpu_of(), vec![first], "a refused list changes nothing");
        })
        .join()
        .unwrap();
    }
}
