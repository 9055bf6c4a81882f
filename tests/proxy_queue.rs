//! The proxy queue on the CPU: host producers push the descriptors a kernel would, the window's
//! proxy thread carries them over the TCP links to ranks on "other hosts" (FERROCOMM_TRANSPORT
//! =tcp semantics), and the targets check the bytes. Ranks are threads of this process; the
//! two-host run in network namespaces is tests/netns.rs.

mod common;
use common::*;
use ferrocomm::net::descriptor::MAX_PUT;
use ferrocomm::Error;

fn tcp_opts() -> CommOptions {
    let mut o = options(Duration::from_secs(30));
    o.transport.force_tcp = true;
    o
}

fn random_words(r: &mut StdRng, n: usize) -> Vec<u64> {
    (0..n).map(|_| r.gen()).collect()
}

#[test]
fn queued_put_signal_rings_deliver_every_byte() {
    let seed = fresh_seed();
    for n in [2, 3, 4] {
        run_group(n, &format!("pq-ring{n}"), tcp_opts(), |c| {
            let (me, right, left) = (c.rank(), (c.rank() + 1) % n, (c.rank() + n - 1) % n);
            // Two halves: the source of our puts, and where the left neighbour's land.
            let half = 3 * MAX_PUT / 2 + 40; // a put of the whole half takes two descriptors
            let w = c.new_window(2 * half).unwrap();
            let q = w.proxy_queue().unwrap();
            for round in 1..=4u64 {
                let mut r = rng(seed, (me as u64) << 8 | round);
                // Sizes from 8 bytes to the whole half, at shifting offsets.
                let words = [1, 129, 4096, half / 8][round as usize - 1];
                let at = (round as usize * 8) % 64;
                let words = words.min((half - at) / 8);
                let data = random_words(&mut r, words);
                w.write_local(at, &data).unwrap();
                q.put_signal(right, half + at, at, words * 8, 0, SignalOp::Add, 1)
                    .unwrap();
                w.wait_signal(0, SignalSource::Rank(left), Cmp::Ge, round).unwrap();
                let expect = random_words(&mut rng(seed, (left as u64) << 8 | round), words);
                let mut got = vec![0u64; words];
                w.read_local(half + at, &mut got).unwrap();
                assert_eq!(got, expect, "rank {me}, round {round}: bytes from rank {left}");
                // The left neighbour may now overwrite our source: everyone is past the wait.
                q.flush().unwrap();
                w.barrier().unwrap();
            }
        });
    }
}

#[test]
fn a_queued_put_leaves_its_source_free_on_return() {
    // Rank 0 puts its source, overwrites it at once and puts it again elsewhere: rank 1 must
    // see the first contents in the first place, the second in the second (the proxy copied
    // the source before the first put returned).
    let seed = fresh_seed();
    run_group(2, "pq-reuse", tcp_opts(), |c| {
        let words = (1 << 20) / 8;
        let w = c.new_window(3 * words * 8).unwrap();
        for round in 0..6u64 {
            let first = random_words(&mut rng(seed, 2 * round), words);
            let second = random_words(&mut rng(seed, 2 * round + 1), words);
            if c.rank() == 0 {
                let q = w.proxy_queue().unwrap();
                w.write_local(0, &first).unwrap();
                q.put(1, words * 8, 0, words * 8).unwrap();
                w.write_local(0, &second).unwrap();
                q.put_signal(1, 2 * words * 8, 0, words * 8, 0, SignalOp::Set, round + 1)
                    .unwrap();
                q.flush().unwrap();
            } else {
                w.wait_signal(0, SignalSource::Rank(0), Cmp::Ge, round + 1).unwrap();
                let mut got = vec![0u64; words];
                w.read_local(words * 8, &mut got).unwrap();
                assert!(got == first, "round {round}: the first put carried later source bytes");
                w.read_local(2 * words * 8, &mut got).unwrap();
                assert!(got == second, "round {round}: the second put");
            }
            w.barrier().unwrap();
        }
    });
}

#[test]
fn concurrent_producers_and_back_pressure() {
    // 4 threads per rank queue 1500 one-word puts each (more than the queue holds) to distinct
    // offsets of the peer; after a flush and a barrier every word is there.
    let seed = fresh_seed();
    let (threads, each) = (4usize, 1500usize);
    run_group(2, "pq-many", tcp_opts(), |c| {
        let peer = 1 - c.rank();
        let words = threads * each;
        let w = c.new_window(2 * words * 8).unwrap();
        let mine = random_words(&mut rng(seed, c.rank() as u64), words);
        w.write_local(0, &mine).unwrap();
        std::thread::scope(|s| {
            for t in 0..threads {
                let q = w.proxy_queue().unwrap();
                s.spawn(move || {
                    for i in (t..words).step_by(threads) {
                        q.put(peer, (words + i) * 8, i * 8, 8).unwrap();
                    }
                    q.flush().unwrap();
                });
            }
        });
        w.barrier().unwrap();
        let mut got = vec![0u64; words];
        w.read_local(words * 8, &mut got).unwrap();
        assert_eq!(got, random_words(&mut rng(seed, peer as u64), words));
    });
}

#[test]
fn later_puts_to_the_same_bytes_win() {
    run_group(2, "pq-order", tcp_opts(), |c| {
        let peer = 1 - c.rank();
        let w = c.new_window(4096).unwrap();
        let q = w.proxy_queue().unwrap();
        // 300 values through one source word: each put must leave before the source changes,
        // so flush between; the target sees the last.
        for v in 1..=300u64 {
            w.write_local(0, &[v]).unwrap();
            q.put(peer, 8, 0, 8).unwrap();
            q.flush().unwrap();
        }
        q.signal(peer, 3, SignalOp::Set, 300).unwrap();
        w.wait_signal(3, SignalSource::Rank(peer), Cmp::Eq, 300).unwrap();
        let mut got = [0u64];
        w.read_local(8, &mut got).unwrap();
        assert_eq!(got[0], 300);
        w.barrier().unwrap();
    });
}

#[test]
fn bad_queue_arguments_are_refused_before_queueing() {
    run_group(2, "pq-bad", tcp_opts(), |c| {
        let w = c.new_window(1024).unwrap();
        let q = w.proxy_queue().unwrap();
        let peer = 1 - c.rank();
        let bad = [
            q.put(2, 0, 0, 8),
            q.put(c.rank(), 0, 0, 8),
            q.put(peer, 1020, 0, 8),
            q.put(peer, 0, 1017, 8),
            q.put(peer, usize::MAX - 3, 0, 8),
            q.signal(peer, 64, SignalOp::Set, 1),
        ];
        for (i, e) in bad.into_iter().enumerate() {
            assert!(matches!(e, Err(Error::InvalidArgument { .. })), "case {i}: {e:?}");
        }
        // Nothing bad was queued: a good put still lands.
        w.write_local(0, &[7u64]).unwrap();
        q.put_signal(peer, 16, 0, 8, 1, SignalOp::Set, 1).unwrap();
        w.wait_signal(1, SignalSource::Rank(peer), Cmp::Eq, 1).unwrap();
        let mut got = [0u64];
        w.read_local(16, &mut got).unwrap();
        assert_eq!(got[0], 7);
        w.barrier().unwrap();
    });
}

#[test]
fn a_window_without_network_peers_has_no_queue() {
    let r = run_group(2, "pq-none", options(Duration::from_secs(10)), |c| {
        let w = c.new_window(64).unwrap();
        w.proxy_queue().map(|_| ())
    });
    for e in r {
        assert!(matches!(e, Err(Error::Unavailable { .. })), "{e:?}");
    }
}

#[test]
fn a_lost_target_fails_the_flush_instead_of_hanging() {
    let r = run_group(2, "pq-lost", tcp_opts(), |c| {
        let w = c.new_window(1 << 16).unwrap();
        if c.rank() == 1 {
            drop(w);
            return None;
        }
        let q = w.proxy_queue().unwrap();
        let t0 = std::time::Instant::now();
        // The peer's server closes its end; some push or the flush must say so.
        let mut result = Ok(());
        for _ in 0..2000 {
            result = q.put(1, 0, 0, 1 << 16).and_then(|_| q.flush());
            if result.is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some((result, t0.elapsed()))
    });
    let (e, took) = r[0].as_ref().unwrap();
    assert!(matches!(e, Err(Error::PeerLost { peer: 1, .. })), "{e:?}");
    assert!(*took < Duration::from_secs(10), "took {took:?}");
}
