//! Every blocking wait ends: a rank that never joins gives the others `Error::Timeout` naming the
//! operation within timeout + 1 s; a rank that leaves or aborts gives them an error at once.

mod common;
use common::*;
use ferrocomm::Error;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(1);

/// Ranks 0 and 1 call `op`; rank 2 never does (it waits until the others are done).
fn absent_rank(name: &str, op: impl Fn(&Comm) -> ferrocomm::Result<()> + Sync) -> Vec<(Result<(), Error>, Duration)> {
    let done = std::sync::Barrier::new(3);
    let r = run_group(3, name, options(TIMEOUT), |c| {
        if c.rank() == 2 {
            done.wait();
            return None;
        }
        let t0 = Instant::now();
        let res = op(c);
        let took = t0.elapsed();
        done.wait();
        Some((res, took))
    });
    r.into_iter().flatten().collect()
}

#[test]
fn a_rank_that_never_joins_gives_timeout_naming_the_op() {
    type Call = Box<dyn Fn(&Comm) -> ferrocomm::Result<()> + Sync>;
    let cases: Vec<(&str, Call)> = vec![
        (
            "all_reduce",
            Box::new(|c| c.all_reduce(&mut [1.0f32; 64], ReduceOp::Sum)),
        ),
        ("barrier", Box::new(|c| c.barrier())),
        ("broadcast", Box::new(|c| c.broadcast(&mut vec![0i32; 1 << 18], 2))),
        ("recv", Box::new(|c| c.recv(&mut [0u8; 8], 2))),
        (
            "all_gather",
            Box::new(|c| c.all_gather(&mut vec![0i64; 3 * 100_000], &vec![1i64; 100_000])),
        ),
    ];
    for (op, f) in cases {
        for (res, took) in absent_rank(&format!("absent-{op}"), f) {
            match res {
                Err(Error::Timeout { op: got, .. }) => assert_eq!(got, op),
                other => panic!("{op}: expected Timeout, got {other:?}"),
            }
            assert!(
                took >= TIMEOUT && took <= TIMEOUT + Duration::from_secs(1),
                "{op}: took {took:?}"
            );
        }
    }
}

#[test]
fn per_op_timeout_overrides_the_communicator_default() {
    let done = std::sync::Barrier::new(2);
    let r = run_group(2, "per-op", options(Duration::from_secs(60)), |c| {
        if c.rank() == 1 {
            done.wait();
            return Duration::ZERO;
        }
        let t0 = Instant::now();
        let e = c
            .with_options(OpOptions::new().timeout(Duration::from_millis(300)))
            .barrier();
        assert!(
            matches!(
                e,
                Err(Error::Timeout {
                    op: "barrier",
                    peer: Some(1),
                    ..
                })
            ),
            "{e:?}"
        );
        done.wait();
        t0.elapsed()
    });
    assert!(r[0] < Duration::from_secs(2), "took {:?}", r[0]);
}

#[test]
fn wait_timeout_on_work_returns_while_the_operation_continues() {
    let go = std::sync::Barrier::new(2);
    let r = run_group(2, "work-timeout", options(Duration::from_secs(10)), |c| {
        let mut x = [c.rank() as i32 + 1];
        if c.rank() == 1 {
            go.wait(); // join only after rank 0 has seen its wait_timeout expire
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            return x[0];
        }
        c.scope(|s| {
            let w = s.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(matches!(
                w.wait_timeout(Duration::from_millis(100)),
                Err(Error::Timeout { op: "all_reduce", .. })
            ));
            assert!(!w.is_completed());
            go.wait();
            w.wait().unwrap();
        });
        x[0]
    });
    assert_eq!(r, vec![3, 3]);
}

#[test]
fn a_rank_that_drops_its_communicator_gives_peer_lost_at_once() {
    let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "dropped", options(Duration::from_secs(30))).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    drop(it); // rank 2 leaves
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for c in [&c0, &c1] {
            s.spawn(move || {
                let e = c.all_reduce(&mut [1.0f64; 16], ReduceOp::Sum);
                assert!(
                    matches!(
                        e,
                        Err(Error::PeerLost {
                            op: "all_reduce",
                            peer: 2,
                            ..
                        })
                    ),
                    "{e:?}"
                );
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(2), "took {:?}", t0.elapsed());
}

#[test]
fn abort_from_another_thread_ends_a_waiting_operation_and_peers_see_it() {
    let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "abort", options(Duration::from_secs(30))).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let c0 = &comms[0];
        let waiter = s.spawn(move || c0.recv(&mut [0u8; 4], 1));
        std::thread::sleep(Duration::from_millis(200));
        c0.abort();
        let e = waiter.join().unwrap();
        assert!(matches!(e, Err(Error::Closed { state: "aborted", .. })), "{e:?}");
    });
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(matches!(comms[0].barrier(), Err(Error::Closed { .. })));
    let e = comms[1].recv(&mut [0u8; 4], 0);
    assert!(matches!(e, Err(Error::PeerLost { peer: 0, .. })), "{e:?}");
}

/// CommOptions::timeout documents it: on the CPU engine a timed-out operation leaves the
/// communicator broken (a message may be half sent), and every later call says so at once;
/// argument errors before any byte moves do not break it.
#[test]
fn after_a_failed_transfer_the_communicator_refuses_further_operations() {
    const BROKEN: &str = "broken by an earlier failed operation";
    let done = std::sync::Barrier::new(2);
    run_group(2, "broken", options(Duration::from_millis(300)), |c| {
        if c.rank() == 0 {
            let e = c.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum);
            assert!(
                matches!(
                    e,
                    Err(Error::Timeout {
                        op: "all_reduce",
                        peer: Some(1),
                        ..
                    })
                ),
                "{e:?}"
            );
            let t0 = Instant::now();
            let e = c.barrier();
            assert!(
                matches!(
                    e,
                    Err(Error::Closed {
                        op: "barrier",
                        state: BROKEN
                    })
                ),
                "{e:?}"
            );
            let e = c
                .with_options(OpOptions::new().timeout(Duration::from_secs(30)))
                .send(&[1u8], 1);
            assert!(
                matches!(
                    e,
                    Err(Error::Closed {
                        op: "send",
                        state: BROKEN
                    })
                ),
                "{e:?}"
            );
            let mut buf = [0u8; 4];
            let e = c.scope(|s| s.broadcast(&mut buf, 0).and_then(|w| w.wait()));
            assert!(
                matches!(
                    e,
                    Err(Error::Closed {
                        op: "broadcast",
                        state: BROKEN
                    })
                ),
                "{e:?}"
            );
            assert!(t0.elapsed() < Duration::from_millis(250), "took {:?}", t0.elapsed());
            // Argument errors are still found first, and finalize still works.
            let e = c.all_reduce(&mut [1.0f32; 4], ReduceOp::BXor);
            assert!(matches!(e, Err(Error::UnsupportedReduce { .. })), "{e:?}");
            c.finalize().unwrap();
        }
        done.wait();
    });
}

#[test]
fn a_rank_that_failed_and_then_left_still_points_at_the_root_rank() {
    let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "root-cause", options(Duration::from_secs(30))).unwrap();
    let mut it = comms.into_iter();
    let (c0, c1) = (it.next().unwrap(), it.next().unwrap());
    drop(it); // rank 2 is gone
    std::thread::scope(|s| {
        s.spawn(move || {
            let e = c0.recv(&mut [0u8; 4], 2);
            assert!(matches!(e, Err(Error::PeerLost { peer: 2, .. })), "{e:?}");
            drop(c0); // leaves after failing
        });
        // Rank 1 only ever waits on rank 0, yet must learn that rank 2 is the cause.
        let e = c1.recv(&mut [0u8; 4], 0);
        assert!(matches!(e, Err(Error::PeerLost { peer: 2, .. })), "{e:?}");
    });
}

/// A group of threads whose last collective is a broadcast, its communicators then dropped one
/// after another on one thread (as the `Collectives` example does): the root's close waits
/// for its receivers' calls, which a receiver may hold back (over TCP) until its next call or
/// its own close. The close must not stall on a rank that closes after it.
#[test]
fn ranks_dropped_one_by_one_on_one_thread_after_a_broadcast_close_at_once() {
    for tcp in [true, false] {
        let timeout = Duration::from_secs(5);
        let opts = if tcp { tcp_options(timeout) } else { options(timeout) };
        let name = format!("drop-in-turn-{tcp}");
        let comms = Comm::new_group("cpu", &[Device::Cpu; 4], &name, opts).expect("new_group");
        let comms: Vec<Comm> = std::thread::scope(|s| {
            let hs: Vec<_> = (comms.into_iter())
                .map(|c| {
                    s.spawn(move || {
                        let mut x = [c.rank() as f32; 2];
                        for _ in 0..3 {
                            c.broadcast(&mut x, 0).expect("broadcast");
                        }
                        assert_eq!(x, [0.0; 2]);
                        c
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        let t0 = Instant::now();
        for c in comms {
            drop(c);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "tcp {tcp}: closing took {:?}",
            t0.elapsed()
        );
    }
}
