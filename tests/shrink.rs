//! `Comm::shrink` with the ranks as threads: survivors of a rank that left mid-loop agree on a
//! smaller communicator and go on with every result checked; the old communicator and its
//! windows are closed; a rank that never comes is left out after the timeout, one that comes
//! late is told it was left out, one that dies during the shrink is left out by a retry; bad
//! arguments. Processes over shared memory and TCP: tests/multiprocess.rs; the device backend
//! on the host device: tests/host_device.rs.

mod common;
use common::*;
use ferrocomm::{Error, MemoryStore, Store};
use std::sync::Arc;
use std::time::Instant;

/// The loop of examples/elastic.rs in miniature: rank `leaver` aborts its communicator at
/// step 3; the others see `PeerLost` naming it, shrink, and finish the steps with checked sums.
fn survivors_finish(backend: &str, device: Device, n: usize, leaver: usize) {
    let opts = options(Duration::from_secs(20));
    let out = run_group_on_device(backend, device, n, &format!("shrink-{backend}-{n}"), opts, |c| {
        let w = c.new_window(64).unwrap();
        let mut comm = c.clone();
        let mut shrunk_at = None;
        for step in 0..8u64 {
            if c.rank() == leaver && step == 3 {
                // Leaves as a process that exits would: peers waiting on it get PeerLost.
                c.abort();
                drop((w, comm));
                return None;
            }
            let mut x = [c.rank() as u64 + step];
            match comm.all_reduce(&mut x, ReduceOp::Sum) {
                Ok(()) => {}
                Err(Error::PeerLost { peer, .. }) => {
                    assert_eq!(peer, leaver, "PeerLost names the rank that left");
                    comm = comm.shrink(&[peer]).expect("shrink").0;
                    shrunk_at = Some(step);
                    x = [c.rank() as u64 + step];
                    comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                }
                Err(e) => panic!("rank {} step {step}: {e}", c.rank()),
            }
            let ranks: Vec<u64> = match shrunk_at {
                Some(_) => (0..n as u64).filter(|&r| r != leaver as u64).collect(),
                None => (0..n as u64).collect(),
            };
            assert_eq!(x[0], ranks.iter().map(|r| r + step).sum::<u64>(), "step {step}");
        }
        assert_eq!(comm.size(), n - 1);
        assert_eq!(comm.rank(), c.rank() - usize::from(c.rank() > leaver));
        // The old communicator and its window are closed; the new one works.
        assert!(
            matches!(c.barrier(), Err(Error::Closed { .. })),
            "old comm after shrink"
        );
        assert!(matches!(w.put(0, 0, &[1u8]), Err(Error::Closed { .. })), "old window");
        assert!(matches!(w.fence(), Err(Error::Closed { .. })), "old window fence");
        let w2 = comm.new_window(8).unwrap();
        w2.put((comm.rank() + 1) % comm.size(), 0, &[comm.rank() as u64])
            .unwrap();
        w2.barrier().unwrap();
        let mut got = [0u64];
        w2.read_local(0, &mut got).unwrap();
        assert_eq!(got[0] as usize, (comm.rank() + comm.size() - 1) % comm.size());
        w2.barrier().unwrap();
        shrunk_at
    });
    for (r, s) in out.iter().enumerate() {
        if r != leaver {
            assert!(s.is_some(), "rank {r} never shrank");
        }
    }
}

#[test]
fn survivors_of_a_rank_that_left_shrink_and_finish() {
    survivors_finish("cpu", Device::Cpu, 4, 3);
    survivors_finish("cpu", Device::Cpu, 3, 0);
}

#[test]
fn survivors_shrink_over_tcp_links() {
    let mut o = tcp_options(Duration::from_secs(20));
    o.transport.force_tcp = true;
    let out = run_group(3, "shrink-tcp", o, |c| {
        if c.rank() == 1 {
            c.abort();
            return 0;
        }
        let mut x = [1u32];
        let e = c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err();
        let Error::PeerLost { peer: 1, .. } = e else {
            panic!("{e}")
        };
        let (s, members) = c.shrink(&[1]).unwrap();
        assert_eq!(members, [0, 2]);
        let mut x = [c.rank() as u32 + 1];
        s.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        x[0]
    });
    assert_eq!(out, [4, 0, 4]);
}

/// What a healthy communicator of `n` ranks does before and after a shrink that leaves out
/// rank 1 (`Comm::shrink` takes the links over then: shrink_links.rs), every value checked.
/// Before: traffic on every path, including a broadcast whose root does not wait for the
/// peers' calls (owed messages, taken in before the hand-over) and a point-to-point pair.
/// Rank 1 leaves without a failure: it finalizes first (`closes`), so the shared-memory board
/// can go along, or it stays alive and quiet meanwhile, so the board cannot. After: every
/// collective, point-to-point between new ranks over links never used before, and a second
/// shrink of the smaller communicator that keeps everyone.
fn a_healthy_shrink(backend: &str, device: Device, o: CommOptions, n: usize, closes: bool) -> Vec<usize> {
    let leaver = 1;
    let ready = std::sync::Barrier::new(n);
    let name = format!("shrink-healthy-{backend}-{n}-{closes}-{}", o.transport.force_tcp);
    run_group_on_device(backend, device, n, &name, o, |c| {
        let me = c.rank();
        let mut x = [me as u64 + 1];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x[0], (n * (n + 1) / 2) as u64);
        let mut b = [if me == 0 { 7u32 } else { 0 }; 300];
        c.broadcast(&mut b[..], 0).unwrap();
        assert!(b.iter().all(|&v| v == 7));
        if me == 0 {
            c.send(&[1.5f32; 10], n - 1).unwrap();
        } else if me == n - 1 {
            let mut r = [0f32; 10];
            c.recv(&mut r, 0).unwrap();
            assert_eq!(r, [1.5; 10]);
        }
        if me == leaver {
            if closes {
                c.finalize().unwrap();
                ready.wait();
            } else {
                ready.wait();
                std::thread::sleep(Duration::from_millis(500));
            }
            return 0;
        }
        ready.wait();
        let (s, members) = c.shrink(&[leaver]).unwrap();
        assert_eq!(members, (0..n).filter(|&r| r != leaver).collect::<Vec<_>>());
        assert!(matches!(c.barrier(), Err(Error::Closed { .. })), "old comm");
        let (r, k) = (s.rank(), s.size());
        let mut x = vec![r as u32 + 1; 70_000];
        s.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert!(x.iter().all(|&v| v as usize == k * (k + 1) / 2));
        let mut small = [me as u16];
        s.all_reduce(&mut small, ReduceOp::Max).unwrap();
        assert_eq!(small[0] as usize, n - 1);
        let mut all = vec![0u64; k];
        s.all_gather(&mut all[..], &[me as u64][..]).unwrap();
        assert_eq!(all, members.iter().map(|&m| m as u64).collect::<Vec<_>>());
        let mut b = vec![if r == 1 { 9u8 } else { 0 }; 100_000];
        s.broadcast(&mut b[..], 1).unwrap();
        assert!(b.iter().all(|&v| v == 9));
        // Every new pair, in both directions, 100 KiB: past the part of a ring made ready
        // when its link is first used.
        let (to, from) = ((r + 1) % k, (r + k - 1) % k);
        let out = vec![r as u8; 100_000];
        let mut got = vec![0u8; 100_000];
        s.batch().recv(&mut got[..], from).send(&out[..], to).issue().unwrap();
        assert!(got.iter().all(|&v| v as usize == from));
        let (t, again) = s.shrink(&[]).unwrap();
        assert_eq!(again, (0..k).collect::<Vec<_>>());
        let mut y = [t.rank() as i64];
        t.all_reduce(&mut y, ReduceOp::Sum).unwrap();
        assert_eq!(y[0] as usize, k * (k - 1) / 2);
        t.barrier().unwrap();
        k
    })
}

#[test]
fn a_healthy_shrink_goes_on_over_the_same_links() {
    for closes in [true, false] {
        let out = a_healthy_shrink("cpu", Device::Cpu, options(Duration::from_secs(20)), 4, closes);
        assert_eq!(out, [3, 0, 3, 3], "closes {closes}");
        let out = a_healthy_shrink("cpu", Device::Cpu, tcp_options(Duration::from_secs(20)), 3, closes);
        assert_eq!(out, [2, 0, 2], "tcp, closes {closes}");
    }
}

/// A rank that neither calls shrink nor is named lost is waited for until the timeout, then
/// left out; when it calls shrink later, it is told so.
#[test]
fn a_silent_rank_is_left_out_after_the_timeout_and_told_when_it_comes() {
    let timeout = Duration::from_millis(1500);
    let out = run_group(3, "shrink-silent", options(timeout), |c| {
        if c.rank() == 2 {
            std::thread::sleep(timeout * 4);
            return match c.shrink(&[]) {
                Err(Error::LeftOut {
                    op: "shrink",
                    rank: 2,
                    members,
                }) => {
                    assert_eq!(members, [0, 1]);
                    // Its old communicator is closed: no second shrink of its own.
                    assert!(matches!(c.shrink(&[]), Err(Error::Closed { .. })));
                    0
                }
                other => panic!("late rank: {other:?}"),
            };
        }
        let t0 = Instant::now();
        let (s, members) = c.shrink(&[]).unwrap();
        assert_eq!(members, [0, 1]);
        assert!(t0.elapsed() >= timeout, "left rank 2 out before the timeout");
        assert!(
            matches!(c.shrink(&[]), Err(Error::Closed { .. })),
            "a second shrink of the old comm"
        );
        let mut x = [10u32];
        s.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        x[0]
    });
    assert_eq!(out, [20, 20, 0]);
}

/// A rank named lost that is alive and calls shrink in time is kept: `lost` only spares the
/// wait. And a shrink without any loss keeps everyone.
#[test]
fn lost_is_a_hint_and_a_shrink_without_loss_keeps_everyone() {
    let out = run_group(4, "shrink-hint", options(Duration::from_secs(20)), |c| {
        let lost: &[usize] = if c.rank() == 0 { &[3] } else { &[] };
        if c.rank() == 3 {
            // It comes, a little after the others have started.
            std::thread::sleep(Duration::from_millis(50));
        }
        let s = match c.shrink(lost) {
            Ok((s, _)) => s,
            Err(Error::LeftOut { op: "shrink", .. }) if c.rank() == 3 => return (0, 0, 0),
            Err(e) => panic!("rank {}: {e}", c.rank()),
        };
        let (t, _) = s.shrink(&[]).unwrap();
        let mut x = [1u8];
        t.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        (s.size(), t.size(), x[0])
    });
    // Rank 0 may decide before rank 3 arrives (then 3 is out), or after (then 3 is in): the
    // store keeps one answer, and every member must hold the same.
    let kept: Vec<_> = out.iter().filter(|o| o.0 > 0).collect();
    assert!(
        kept.len() >= 3 && kept.iter().all(|o| **o == (kept.len(), kept.len(), kept.len() as u8)),
        "{out:?}"
    );
}

/// A store that fails every call of one rank once it has announced itself in a shrink: that
/// rank "dies" between the agreement on members and the new communicator.
struct DiesDuringShrink {
    inner: Arc<dyn Store>,
    dead: std::sync::atomic::AtomicBool,
}

impl DiesDuringShrink {
    fn check(&self, key: &str) -> ferrocomm::Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.dead.load(SeqCst) {
            return Err(Error::StoreClosed("this rank died".into()));
        }
        if key.contains("/members") {
            self.dead.store(true, SeqCst);
        }
        Ok(())
    }
}

impl Store for DiesDuringShrink {
    fn set(&self, key: &str, value: &[u8]) -> ferrocomm::Result<()> {
        self.check(key)?;
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> ferrocomm::Result<Vec<u8>> {
        self.check(key)?;
        self.inner.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> ferrocomm::Result<i64> {
        self.check(key)?;
        self.inner.add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> ferrocomm::Result<Vec<u8>> {
        let r = self.inner.compare_set(key, expected, desired);
        self.check(key)?;
        r
    }
    fn delete(&self, key: &str) -> ferrocomm::Result<bool> {
        self.check(key)?;
        self.inner.delete(key)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> ferrocomm::Result<()> {
        self.check(keys.first().copied().unwrap_or(""))?;
        self.inner.wait(keys, timeout)
    }
}

#[test]
fn a_rank_that_dies_during_the_shrink_is_left_out_by_a_retry() {
    let (n, timeout) = (4, Duration::from_secs(2));
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let out: Vec<Result<(usize, u32), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let store = store.clone();
                s.spawn(move || {
                    let mine: Arc<dyn Store> = if r == 1 {
                        Arc::new(DiesDuringShrink {
                            inner: store,
                            dead: Default::default(),
                        })
                    } else {
                        store
                    };
                    let o = options(timeout).with_store(mine, r, n);
                    let c = new_comm("cpu", Device::Cpu, "shrink-dies", o).unwrap();
                    c.barrier().unwrap();
                    if r == 3 {
                        return Ok((0, 0)); // leaves; rank 1 then dies in the shrink
                    }
                    let (t, members) = c.shrink(&[3]).map_err(|e| e.to_string())?;
                    assert_eq!(members, [0, 2]);
                    let mut x = [r as u32];
                    t.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                    Ok((t.size(), x[0]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(out[1].is_err(), "rank 1 died: {out:?}");
    assert_eq!(out[0], Ok((2, 2)), "{out:?}");
    assert_eq!(out[2], Ok((2, 2)), "{out:?}");
}

#[test]
fn bad_shrink_arguments_are_refused_on_the_spot() {
    run_group(2, "shrink-args", options(Duration::from_secs(10)), |c| {
        let me = c.rank();
        assert!(matches!(
            c.shrink(&[me]),
            Err(Error::InvalidArgument { op: "shrink", .. })
        ));
        assert!(matches!(c.shrink(&[7]), Err(Error::InvalidRank { rank: 7, .. })));
        // Still usable: nothing was agreed.
        let mut x = [1u8];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        assert_eq!(x, [2]);
    });
}

/// The device backend (its kernels on the host device): survivors shrink and finish.
#[cfg(feature = "host-kernels")]
#[test]
fn the_device_backend_shrinks_on_the_host_device() {
    survivors_finish("device", Device::Host(0), 3, 1);
    // Healthy: the host engine's links go over; the device side is made anew.
    let out = a_healthy_shrink("device", Device::Host(0), options(Duration::from_secs(20)), 3, true);
    assert_eq!(out, [2, 0, 2]);
}
