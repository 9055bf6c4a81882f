//! Single-copy messages between ranks of one host. A large message over a shared-memory link
//! would otherwise be copied twice, into the ring and out of it; instead its sender writes
//! only a reference (the address and length of its buffer) into the ring and waits, and the
//! receiver copies the bytes straight out of the sender's memory with `process_vm_readv`, then
//! consumes the reference, which tells the sender its buffer is free again.
//!
//! Whether a receiver may read a sender's memory is the kernel's call (same user, ptrace
//! policy, seccomp): each rank asks once per peer process at set-up (`probe`), by reading a
//! word whose value it knows. Only a receiver whose probe succeeded tells its senders to send
//! references (`RingEnd::offer_pulls`); everywhere else messages go through the rings as
//! before. The system call is used between threads of one process too: it copies through the
//! kernel, so an address that is no longer mapped is an error, never a fault.
//!
//! A sender whose operation fails (timeout, abort, a lost peer, a mismatch) stops waiting, and
//! its caller may free the buffer: before it returns, it takes back every reference not yet
//! copied (`RingEnd::withdraw`, a count in the ring). A reference carries the count of when it
//! was written, and the receiver compares after each copy: a copy that may have met a freed
//! buffer is an error, never data. A sender process that is gone altogether is an error of
//! the copy itself, or of the liveness check after it (pidfd, so a reused pid cannot pass).

/// Bytes of a reference in the ring: the sender's address, the message's length, and the
/// sender's withdrawal count when it wrote the reference (`RingEnd::withdraw`).
pub(crate) const REF_BYTES: usize = 24;

/// A message's place in its sender's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reference {
    pub addr: u64,
    pub len: u64,
    pub withdrawals: u64,
}

impl Reference {
    /// The reference to `data`, written at withdrawal count `withdrawals`.
    pub(crate) fn to(data: &[u8], withdrawals: u64) -> Reference {
        Reference {
            addr: data.as_ptr() as u64,
            len: data.len() as u64,
            withdrawals,
        }
    }

    pub(crate) fn encode(&self) -> [u8; REF_BYTES] {
        let mut r = [0u8; REF_BYTES];
        r[..8].copy_from_slice(&self.addr.to_le_bytes());
        r[8..16].copy_from_slice(&self.len.to_le_bytes());
        r[16..].copy_from_slice(&self.withdrawals.to_le_bytes());
        r
    }

    pub(crate) fn decode(raw: &[u8; REF_BYTES]) -> Reference {
        let word = |i: usize| u64::from_le_bytes(raw[i..i + 8].try_into().unwrap_or_default());
        Reference {
            addr: word(0),
            len: word(8),
            withdrawals: word(16),
        }
    }
}

/// Copies the message `r` names from process `pid` into `dst`, whose length it must name.
/// Errors say why, for the caller to name the peer.
pub(crate) fn copy_in(pid: u32, r: &Reference, dst: &mut [u8]) -> Result<(), String> {
    if r.len != dst.len() as u64 {
        return Err(format!(
            "its message by reference names {} bytes where {} were announced",
            r.len,
            dst.len()
        ));
    }
    let mut done = 0usize;
    while done < dst.len() {
        let n = read_process(pid, r.addr + done as u64, &mut dst[done..])
            .map_err(|e| format!("reading its message of {} bytes from process {pid}: {e}", dst.len()))?;
        if n == 0 {
            return Err(format!("process {pid} gave no bytes of its message"));
        }
        done += n;
    }
    Ok(())
}

/// Whether this process may read process `pid`'s memory: the 8 bytes at `addr` there must
/// read as `expect`.
pub(crate) fn probe(pid: u32, addr: u64, expect: u64) -> bool {
    let mut word = [0u8; 8];
    matches!(read_process(pid, addr, &mut word), Ok(8)) && u64::from_le_bytes(word) == expect
}

/// Whether copying a message straight out of another process pays on this host, measured once
/// per process: `process_vm_readv` against a plain copy, both of `PROBE_BYTES` of our own
/// memory, the best of a few tries each (`pays_at`).
pub(crate) fn pays() -> bool {
    static PAYS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAYS.get_or_init(|| {
        let (pull, copy) = time_pull_and_copy();
        let pays = pays_at(pull, copy);
        tracing::debug!(?pull, ?copy, pays, "shared memory: copies by reference measured");
        pays
    })
}

/// Whether a kernel copy out of another process taking `pull` pays where a plain copy of the
/// same bytes takes `copy`: where it takes less than `PAYS_BELOW` plain copies.
///
/// What it replaces is not two plain copies but two copies through the rings, the second of
/// them reading lines another core wrote, which costs more than a copy within one cache, and
/// more again where a line between the cores is slow. What hosts measured (docs/results/cpu.md,
/// parts 9, 19 and 26; the kernel's copy in plain copies, then by reference against the rings):
/// - an AMD EPYC KVM guest: 7.9 (14.5 us against 1.8 at 256 KiB); every size by reference
///   1.2-5x slower than through the rings;
/// - an Intel Xeon Firecracker guest, in one phase: 1.8-2.0 (12.8 us against 6.4); from 64 KiB
///   to 16 MiB by reference took 0.42-0.85 of the time through the rings;
/// - an AMD EPYC guest under a Firecracker kernel (6.18.44-fc), later: 3.5-4.3 (24-31 us against
///   6.3-8.5). The rings' time swung with the cost of a line between the cores, which changes
///   every few seconds there: send_recv between 2 processes, 256 KiB-4 MiB, took 0.5-0.9 of the
///   time by reference in one phase and 2.0-2.7 times it in the other; by reference held steady.
///
/// A limit of 2, the two copies, fell between the Intel guest's tries of the probe, so each
/// process chose by chance and a run could mix the two ways; a limit of 3 fell below every try
/// on the later AMD guest, so every process chose the rings and their swings.
fn pays_at(pull: std::time::Duration, copy: std::time::Duration) -> bool {
    pull.as_secs_f64() < PAYS_BELOW * copy.as_secs_f64()
}

/// Plain copies a kernel copy out of another process must take less time than to pay
/// (`pays_at`): between the 4.3 of a guest where it paid and the 7.9 of one where it did not,
/// with room for the probe's spread on each (its tries on one host spread by up to 1.25x).
const PAYS_BELOW: f64 = 5.5;

/// Bytes of each copy `pays` times: large enough that the system call's fixed cost does not
/// decide, small enough to stay in cache and take tens of microseconds at worst.
const PROBE_BYTES: usize = 256 << 10;

/// The best of a few times of `process_vm_readv` and of a plain copy of `PROBE_BYTES` from our
/// own memory. A failing system call counts as never paying.
fn time_pull_and_copy() -> (std::time::Duration, std::time::Duration) {
    use std::time::{Duration, Instant};
    let src = vec![1u8; PROBE_BYTES];
    let mut dst = vec![0u8; PROBE_BYTES];
    let (pid, from) = (std::process::id(), Reference::to(&src, 0));
    let (mut pull, mut copy) = (Duration::MAX, Duration::MAX);
    // The first try of each also faults the pages in; the best time leaves it out. Eight tries
    // would do, but one try in ten then still read 3.2 where the rest read 1.8-2.1; sixteen (about
    // 0.35 ms, once per process) kept every one of 14 runs within 1.75-2.2.
    for _ in 0..16 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copy = copy.min(t.elapsed());
        let t = Instant::now();
        if copy_in(pid, &from, &mut dst).is_err() {
            return (Duration::MAX, copy);
        }
        pull = pull.min(t.elapsed());
    }
    (pull, copy)
}

/// One `process_vm_readv` call: the bytes it copied.
fn read_process(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<usize> {
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: the kernel writes at most `dst.len()` bytes into `dst`, which we borrow mutably;
    // the remote range is only read, in the other address space, by the kernel, which reports
    // an unmapped or forbidden range as an error.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_is_copied_in_and_its_length_checked() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let me = std::process::id();
        let r = Reference::to(&src, 7);
        assert_eq!(Reference::decode(&r.encode()), r);
        let mut dst = vec![0u8; src.len()];
        match copy_in(me, &r, &mut dst) {
            Ok(()) => assert_eq!(dst, src),
            // A sandbox that forbids the call (seccomp): the probe says no there too.
            Err(e) => {
                assert!(!probe(me, src.as_ptr() as u64, 0), "{e}");
                println!("SKIPPED: process_vm_readv is not allowed here: {e}");
                return;
            }
        }
        let mut short = vec![0u8; 10];
        let e = copy_in(me, &r, &mut short).unwrap_err();
        assert!(e.contains("names 100000 bytes where 10 were announced"), "{e}");
        // An address nothing is mapped at is an error, not a fault.
        let nowhere = Reference {
            addr: 0,
            len: 1,
            withdrawals: 0,
        };
        assert!(copy_in(me, &nowhere, &mut [0u8; 1]).is_err());
    }

    #[test]
    fn the_copy_by_reference_is_timed_against_a_plain_copy_once_per_process() {
        let (pull, copy) = time_pull_and_copy();
        assert!(
            copy > std::time::Duration::ZERO && copy < std::time::Duration::from_secs(1),
            "{copy:?}"
        );
        let me = std::process::id();
        let word = 0x5eed_u64;
        if !probe(me, &word as *const u64 as u64, word) {
            // Forbidden here: never pays.
            assert_eq!(pull, std::time::Duration::MAX);
            assert!(!pays());
            return;
        }
        assert!(pull < std::time::Duration::from_secs(1), "{pull:?}");
        // Decided once: every transport of this process makes the same choice.
        assert_eq!(pays(), pays());
    }

    #[test]
    fn the_kernel_copy_pays_below_five_and_a_half_plain_copies() {
        let us = std::time::Duration::from_secs_f64;
        // The Intel Xeon guest, where by reference was faster from 64 KiB: 12.8 us against 6.4.
        assert!(pays_at(us(12.8e-6), us(6.4e-6)));
        // The later AMD EPYC guest, where the rings took up to 2.7 times the time by reference:
        // 29.9 us against 7.0 (4.3 plain copies; a limit of 3 chose the rings).
        assert!(pays_at(us(29.9e-6), us(6.98e-6)));
        // The first AMD EPYC guest, where it was slower at every size: 14.5 us against 1.8.
        assert!(!pays_at(us(14.5e-6), us(1.8e-6)));
        // A forbidden call never pays.
        assert!(!pays_at(std::time::Duration::MAX, us(1e-6)));
    }
}
