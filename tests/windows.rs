//! Windows with the ranks as threads of this process: shared memory, the TCP proxy path, and
//! registered user memory. (Processes: see tests/multiprocess.rs.)

mod common;
use common::*;
use ferrocomm::Error;
use std::time::{Duration, Instant};

fn opts() -> CommOptions {
    options(Duration::from_secs(30))
}

fn tcp_opts() -> CommOptions {
    tcp_options(Duration::from_secs(30))
}

#[test]
fn window_contract_over_shared_memory() {
    let seed = fresh_seed();
    for n in [1, 2, 3, 4] {
        let mapped = run_group(n, &format!("win-shm{n}"), opts(), |c| {
            common::window_suite::run_all(c, seed)
        });
        assert!(mapped.iter().all(|&m| m), "same-host peers should be mapped directly");
    }
}

#[test]
fn window_contract_over_the_tcp_proxy() {
    let seed = fresh_seed();
    let mapped = run_group(3, "win-tcp", tcp_opts(), |c| common::window_suite::run_all(c, seed));
    assert!(mapped.iter().all(|&m| !m), "peers on 'other hosts' must not be mapped");
}

/// The same over window connections that seal every record (`FERROCOMM_ENCRYPT=on`).
#[test]
fn window_contract_over_sealed_tcp() {
    let seed = fresh_seed();
    let mut o = tcp_opts();
    o.transport.encrypt = ferrocomm::Encrypt::On;
    let mapped = run_group(3, "win-sealed", o, |c| common::window_suite::run_all(c, seed));
    assert!(mapped.iter().all(|&m| !m));
}

/// `FERROCOMM_NET=rdma` between "other hosts": where an RDMA device opens (and the library has
/// the `rdma` feature) the contract holds over it; elsewhere every rank gets `Unavailable`
/// saying why, promptly, instead of waiting for peers' endpoints.
#[test]
fn window_over_rdma_runs_the_contract_or_is_unavailable_on_every_rank() {
    let seed = fresh_seed();
    let mut o = tcp_opts().with_timeout(Duration::from_secs(20));
    o.transport.net = ferrocomm::NetTransport::Rdma;
    let t0 = Instant::now();
    let results = run_group(2, "win-rdma", o, |c| match c.new_window(c.size() * 4096) {
        Ok(w) => {
            common::window_suite::run_on(c, &w, seed);
            None
        }
        Err(e) => Some(e),
    });
    match (&results[0], &results[1]) {
        (None, None) => println!("RDMA device present: the window contract ran over RDMA"),
        (Some(a), Some(b)) => {
            for e in [a, b] {
                assert!(matches!(e, Error::Unavailable { .. }), "{e}");
                assert!(e.to_string().contains("RDMA") || e.to_string().contains("rdma"), "{e}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "refused only after {:?}",
                t0.elapsed()
            );
            println!("SKIPPED rdma data path (every rank refused clearly): {a}");
        }
        (a, b) => panic!("ranks disagree: {a:?} / {b:?}"),
    }
}

#[test]
fn window_contract_on_registered_user_memory() {
    let seed = fresh_seed();
    let n = 3;
    let r = run_group(n, "win-reg", opts(), |c| {
        let mut mine = vec![0u64; n * 4096 / 8];
        {
            let w = c.register(&mut mine, WindowOptions::default()).unwrap();
            common::window_suite::run_on(c, &w, seed);
            assert!(w.remote_ptr((c.rank() + 1) % n).is_none());
            // A last put to the right neighbour, then the window goes away.
            w.put((c.rank() + 1) % n, 0, &[c.rank() as u64 + 100]).unwrap();
            w.barrier().unwrap();
        }
        // The buffer is ours again and holds what the window wrote into it.
        (mine[0], (c.rank() + n - 1) % n)
    });
    for (got, left) in r {
        assert_eq!(got, left as u64 + 100);
    }
}

/// A typed view of registered memory: element puts land in the owners' buffers, peers reach
/// them only through their proxies (map_remote refuses them, naming the rank), and a rank's
/// own buffer maps in place.
#[test]
fn typed_view_of_registered_memory_maps_only_its_own_segment() {
    let n = 3;
    let r = run_group(n, "win-reg-typed", opts(), |c| {
        let (me, right) = (c.rank(), (c.rank() + 1) % n);
        let mut mine = vec![-1.0f32; 16];
        {
            let w = c.register(&mut mine, WindowOptions::default()).unwrap();
            let t = w.typed::<f32>().unwrap();
            assert_eq!(t.len(), 16);
            t.put(right, 3, &[me as f32; 2]).unwrap();
            t.barrier().unwrap();
            match t.map_remote(right) {
                Err(Error::InvalidArgument {
                    op: "map_remote",
                    reason,
                }) => {
                    assert!(reason.contains(&format!("rank {right}")), "{reason}")
                }
                other => panic!("map_remote of a registered peer: {other:?}"),
            }
            let own = t.map_remote(me).unwrap().to_vec();
            let left = ((me + n - 1) % n) as f32;
            assert_eq!(own[2..6], [-1.0, left, left, -1.0]);
            t.barrier().unwrap();
        }
        (mine, (c.rank() + n - 1) % n)
    });
    for (buf, left) in r {
        assert_eq!(buf[3..5], [left as f32; 2]);
    }
}

#[test]
fn typed_windows_and_mapped_segments_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ferrocomm::TypedWindow<'static, ferrocomm::bf16>>();
    send_sync::<ferrocomm::MappedSegment<'static, u64>>();
}

/// Peers may write any byte into a segment, and a byte other than 0 or 1 is no bool: bool
/// memory is refused as a segment, on every rank before anything is exchanged, and the
/// communicator goes on (u8 memory of the same bytes registers).
#[test]
fn bool_memory_cannot_be_registered() {
    let r = run_group(2, "win-bool", opts(), |c| {
        let mut flags = vec![false; 4096];
        let refused = c.register(&mut flags, WindowOptions::default()).map(|_| ());
        let mut bytes = vec![0u8; 4096];
        let w = c.register(&mut bytes, WindowOptions::default()).unwrap();
        w.barrier().unwrap();
        refused
    });
    for e in r {
        assert!(
            matches!(&e, Err(Error::InvalidArgument { op: "register", .. })),
            "{e:?}"
        );
    }
}

#[test]
fn windows_of_different_sizes_are_a_mismatch() {
    let r = run_group(2, "win-mm", options(Duration::from_secs(5)), |c| {
        c.new_window(1024 * (c.rank() + 1)).map(|_| ())
    });
    assert!(
        r.iter()
            .all(|x| matches!(x, Err(Error::Mismatch { op: "new_window", .. }))),
        "{r:?}"
    );
}

#[test]
fn a_waiter_whose_peer_drops_its_window_gets_peer_lost() {
    for (name, o) in [("drop-shm", opts()), ("drop-tcp", tcp_opts())] {
        let r = run_group(2, name, o, |c| {
            let w = c.new_window(64).unwrap();
            if c.rank() == 1 {
                drop(w);
                return None;
            }
            let t0 = Instant::now();
            let e = w.wait_signal(0, SignalSource::Rank(1), Cmp::Ge, 1);
            Some((e, t0.elapsed()))
        });
        let (e, took) = r[0].as_ref().unwrap();
        assert!(
            matches!(
                e,
                Err(Error::PeerLost {
                    op: "wait_signal",
                    peer: 1,
                    ..
                })
            ),
            "{name}: {e:?}"
        );
        assert!(*took < Duration::from_secs(3), "{name}: took {took:?}");
    }
}

#[test]
fn abort_ends_a_window_wait() {
    let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "win-abort", opts()).unwrap();
    let wins = windows_on(&comms, 64);
    std::thread::scope(|s| {
        let w0 = &wins[0];
        let waiter = s.spawn(move || w0.wait_signal(0, SignalSource::Rank(1), Cmp::Ge, 1));
        std::thread::sleep(Duration::from_millis(100));
        comms[0].abort();
        assert!(matches!(
            waiter.join().unwrap(),
            Err(Error::Closed { state: "aborted", .. })
        ));
    });
}

#[test]
fn cmp_holds_is_the_comparison_it_names() {
    for (a, b) in [(1u64, 2u64), (2, 2), (3, 2)] {
        assert_eq!(Cmp::Eq.holds(a, b), a == b);
        assert_eq!(Cmp::Ne.holds(a, b), a != b);
        assert_eq!(Cmp::Ge.holds(a, b), a >= b);
        assert_eq!(Cmp::Gt.holds(a, b), a > b);
        assert_eq!(Cmp::Le.holds(a, b), a <= b);
        assert_eq!(Cmp::Lt.holds(a, b), a < b);
    }
}

/// A peer may write any byte into a bool segment, so it is never borrowed in place as bools
/// (a byte other than 0 or 1 would be an invalid `bool`); `get` still works (it normalises).
#[test]
fn a_bool_segment_is_not_mapped_in_place() {
    run_group(2, "win-bool-map", opts(), |c| {
        let t = c.new_typed_window::<bool>(8).unwrap();
        let peer = 1 - c.rank();
        t.window().put(peer, 0, &[2u8, 0, 1, 255]).unwrap();
        t.barrier().unwrap();
        match t.map_remote(c.rank()) {
            Err(Error::InvalidArgument { op: "map_remote", .. }) => {}
            other => panic!("map_remote of bool: {other:?}"),
        }
        let mut got = [false; 4];
        t.get(c.rank(), 0, &mut got).unwrap();
        assert_eq!(got, [true, false, true, true]);
        t.barrier().unwrap();
    });
}
