//! Hints as torchcomms has them: the communicator's hints are every operation's defaults, an
//! operation's own override them key by key; a hint the backend does not know or cannot honour
//! is ignored (a debug event says so) and the operation runs with the backend's own choice; an
//! unknown value of a hint the backend reads is `InvalidArgument` on every rank, and the
//! communicator stays usable.
//!
//! What the CPU engine chose is observed through its `tracing` events, captured per rank
//! thread (synchronous calls run on the calling thread).

mod common;
use common::*;
use ferrocomm::Error;
use std::sync::{Arc, Mutex};

/// The events of one thread, each as `message field=value ...`.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<String>>>);

impl Events {
    /// Captures this thread's events until the guard is dropped.
    fn capture() -> (Events, tracing::subscriber::DefaultGuard) {
        let events = Events::default();
        let guard = tracing::subscriber::set_default(events.clone());
        (events, guard)
    }

    /// Events whose text contains every one of `parts`.
    fn matching(&self, parts: &[&str]) -> Vec<String> {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|e| parts.iter().all(|p| e.contains(p)))
            .cloned()
            .collect()
    }

    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
}

struct Text<'a>(&'a mut String);

impl tracing::field::Visit for Text<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push_str(&format!(" {}={value}", field.name()));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.0.insert_str(0, &format!("{value:?}")),
            name => self.0.push_str(&format!(" {name}={value:?}")),
        }
    }
}

impl tracing::Subscriber for Events {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = String::new();
        event.record(&mut Text(&mut text));
        self.0.lock().unwrap().push(text);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

const TIMEOUT: Duration = Duration::from_secs(20);

/// Every rank's all_reduce of `n` random f64 against the host reference.
fn check_all_reduce<C: for<'a> Collectives<'a>>(c: &C, seed: u64, n: usize) -> ferrocomm::Result<()> {
    let (rank, size) = (Collectives::comm(c).rank(), Collectives::comm(c).size());
    let inputs: Vec<Vec<f64>> = (0..size)
        .map(|r| random_vec(&mut rng(seed, r as u64), n, None))
        .collect();
    let mut buf = inputs[rank].clone();
    c.all_reduce(&mut buf, ReduceOp::Sum)?;
    for (i, got) in buf.iter().enumerate() {
        let vals: Vec<f64> = inputs.iter().map(|v| v[i]).collect();
        f64::check_reduced(&vals, ReduceOp::Sum, *got).unwrap();
    }
    Ok(())
}

/// Rank `root`'s random bytes broadcast to every rank's poisoned buffer.
fn check_broadcast<C: for<'a> Collectives<'a>>(c: &C, seed: u64, n: usize, root: usize) -> ferrocomm::Result<()> {
    let want: Vec<u8> = random_vec(&mut rng(seed ^ 0xb, root as u64), n, None);
    let mut buf = if Collectives::comm(c).rank() == root {
        want.clone()
    } else {
        vec![u8::poison(); n]
    };
    c.broadcast(&mut buf, root)?;
    assert_eq!(buf, want);
    Ok(())
}

#[test]
fn a_communicator_hint_is_the_default_of_every_operation_and_an_operation_hint_overrides_it() {
    let seed = fresh_seed();
    let ring = options(TIMEOUT).with_hint("algorithm", "ring");
    run_group(3, "hint-default", ring, |c| {
        let (events, _guard) = Events::capture();
        // 64 elements: far below the direct threshold, where the size rule picks direct.
        check_all_reduce(c, seed, 64).unwrap();
        assert_eq!(
            events.matching(&["cpu algorithm", "op=all_reduce", "algo=Ring"]).len(),
            1,
            "{:?}",
            events.0
        );
        events.clear();
        c.reduce(&mut [c.rank() as i32; 16], ReduceOp::Sum, 0).unwrap();
        assert_eq!(events.matching(&["op=reduce", "algo=Ring"]).len(), 1, "{:?}", events.0);
        events.clear();
        let direct = c.with_options(OpOptions::new().hint("algorithm", "direct"));
        check_all_reduce(&direct, seed ^ 1, 64).unwrap();
        assert_eq!(
            events.matching(&["op=all_reduce", "algo=Direct"]).len(),
            1,
            "{:?}",
            events.0
        );
    });
    // The same call without the communicator's hint: the size rule's choice.
    run_group(3, "hint-none", options(TIMEOUT), |c| {
        let (events, _guard) = Events::capture();
        c.reduce(&mut [c.rank() as i32; 16], ReduceOp::Sum, 0).unwrap();
        assert_eq!(
            events.matching(&["op=reduce", "algo=Direct"]).len(),
            1,
            "{:?}",
            events.0
        );
    });
}

#[test]
fn a_hint_that_cannot_be_honoured_is_ignored_with_a_debug_event() {
    let seed = fresh_seed();
    run_group(
        3,
        "hint-oneshot",
        options(TIMEOUT).with_hint("algorithm", "oneshot"),
        |c| {
            let (events, _guard) = Events::capture();
            // Reduce has no shared-memory rounds.
            let mut x = [c.rank() as f64 + 1.0; 4];
            c.reduce(&mut x[..], ReduceOp::Sum, 1).unwrap();
            if c.rank() == 1 {
                assert_eq!(x, [6.0; 4]);
            }
            let ignored = events.matching(&["hint ignored", "op=reduce", "hint=algorithm=oneshot"]);
            assert_eq!(ignored.len(), 1, "{:?}", events.0);
            assert!(ignored[0].contains("reason="), "{ignored:?}");
            // Broadcast has: a round, whose data every rank checks.
            events.clear();
            check_broadcast(c, seed, 1000, 1).unwrap();
            assert!(events.matching(&["hint ignored"]).is_empty(), "{:?}", events.0);
            assert_eq!(events.matching(&["cpu algorithm: oneshot"]).len(), 1, "{:?}", events.0);
            // Too large for a shared-memory round: the size rule (ring) instead.
            events.clear();
            check_all_reduce(c, seed, 100_000).unwrap();
            assert_eq!(
                events.matching(&["hint ignored", "op=all_reduce"]).len(),
                1,
                "{:?}",
                events.0
            );
            assert_eq!(
                events.matching(&["op=all_reduce", "algo=Ring"]).len(),
                1,
                "{:?}",
                events.0
            );
            // Where it can run, it does, and nothing is ignored.
            events.clear();
            check_all_reduce(c, seed, 16).unwrap();
            assert!(events.matching(&["hint ignored"]).is_empty(), "{:?}", events.0);
            assert_eq!(events.matching(&["cpu algorithm: oneshot"]).len(), 1, "{:?}", events.0);
        },
    );
}

/// `oneshot` takes a broadcast of any size on one host: past a slot it runs in pieces, a round
/// each, and nothing is ignored. Two ranks keep a small piece in the round's control line,
/// more ranks in the slot's data: both are here, with last pieces of 1 byte and of many.
#[test]
fn the_oneshot_hint_takes_a_broadcast_larger_than_a_slot() {
    let seed = fresh_seed();
    let mut o = options(TIMEOUT).with_hint("algorithm", "oneshot");
    o.transport.force_tcp = false;
    for world in [2, 3] {
        run_group(world, "hint-pieces", o.clone(), |c| {
            let (events, _guard) = Events::capture();
            let lens = [(64 << 10) + 1, 5 * (64 << 10) + 4100, 1 << 20];
            for (i, n) in lens.into_iter().enumerate() {
                check_broadcast(c, seed ^ i as u64, n, i % c.size()).unwrap();
            }
            assert!(events.matching(&["hint ignored"]).is_empty(), "{:?}", events.0);
            assert_eq!(
                events.matching(&["cpu algorithm: oneshot", "op=broadcast"]).len(),
                lens.len(),
                "{:?}",
                events.0
            );
        });
    }
}

/// Unhinted, a broadcast of 128-512 KiB between the 2 ranks of one host goes direct and by
/// reference (or, where the ranks outnumber the CPUs, as shared-memory rounds), not by the
/// chain its size alone would pick.
#[test]
fn a_broadcast_between_two_ranks_of_one_host_at_256_kib_is_direct_by_reference() {
    let seed = fresh_seed();
    let mut o = options(TIMEOUT);
    o.transport.force_tcp = false;
    run_group(2, "bcast-256k", o, |c| {
        let (events, _guard) = Events::capture();
        check_broadcast(c, seed, 256 << 10, 1).unwrap();
        let direct = events.matching(&["cpu algorithm: direct by reference", "op=broadcast"]);
        let rounds = events.matching(&["cpu algorithm: oneshot", "op=broadcast"]);
        assert_eq!(direct.len() + rounds.len(), 1, "{:?}", events.0);
    });
}

#[test]
fn the_oneshot_hint_over_tcp_runs_with_the_default_choice() {
    let seed = fresh_seed();
    run_group(
        3,
        "hint-tcp",
        tcp_options(TIMEOUT).with_hint("algorithm", "oneshot"),
        |c| {
            let (events, _guard) = Events::capture();
            check_all_reduce(c, seed, 64).unwrap();
            let ignored = events.matching(&["hint ignored", "op=all_reduce", "hint=algorithm=oneshot"]);
            assert_eq!(ignored.len(), 1, "{:?}", events.0);
            assert!(ignored[0].contains("this host"), "{ignored:?}");
            assert_eq!(
                events.matching(&["op=all_reduce", "algo=Direct"]).len(),
                1,
                "{:?}",
                events.0
            );
            // The per-operation form too, on an operation of its own.
            let one = c.with_options(OpOptions::new().hint("algorithm", "oneshot"));
            let mut out = vec![u32::poison(); 3 * 5];
            one.all_gather(&mut out, &[c.rank() as u32; 5]).unwrap();
            assert_eq!(out, (0..3u32).flat_map(|r| [r; 5]).collect::<Vec<_>>());
            // reduce_scatter has shared-memory rounds too: one event, naming the host.
            events.clear();
            let mut block = [u32::poison(); 2];
            one.reduce_scatter(&mut block, &[c.rank() as u32 + 1; 6], ReduceOp::Sum)
                .unwrap();
            assert_eq!(block, [6, 6]);
            let ignored = events.matching(&["hint ignored", "op=reduce_scatter", "hint=algorithm=oneshot"]);
            assert_eq!(ignored.len(), 1, "{:?}", events.0);
            assert!(ignored[0].contains("this host"), "{ignored:?}");
        },
    );
}

#[test]
fn an_unknown_algorithm_is_invalid_argument_on_every_rank_and_the_communicator_stays_usable() {
    let seed = fresh_seed();
    let r = run_group(3, "hint-banana", options(TIMEOUT), |c| {
        let banana = c.with_options(OpOptions::new().hint("algorithm", "banana"));
        let errors = [
            banana.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum),
            banana.broadcast(&mut [0u8; 8], 0),
            banana.reduce_scatter(&mut [0i64; 2], &[1i64; 6], ReduceOp::Sum),
            banana.all_to_all(&mut [0u8; 3], &[1u8; 3]),
        ];
        check_all_reduce(c, seed, 1000).unwrap();
        errors
    });
    for errors in r {
        for (e, op) in errors
            .into_iter()
            .zip(["all_reduce", "broadcast", "reduce_scatter", "all_to_all"])
        {
            let Err(Error::InvalidArgument { op: got, reason }) = &e else {
                panic!("{op}: expected InvalidArgument, got {e:?}")
            };
            assert_eq!(*got, op);
            for word in ["banana", "oneshot", "direct", "ring"] {
                assert!(reason.contains(word), "{op}: {reason}");
            }
        }
    }
    // As a communicator hint, every operation refuses it; an operation's own hint overrides it.
    run_group(
        2,
        "hint-banana-comm",
        options(TIMEOUT).with_hint("algorithm", "banana"),
        |c| {
            let e = c.all_reduce(&mut [1.0f32; 8], ReduceOp::Sum);
            assert!(
                matches!(e, Err(Error::InvalidArgument { op: "all_reduce", .. })),
                "{e:?}"
            );
            check_all_reduce(&c.with_options(OpOptions::new().hint("algorithm", "ring")), seed, 100).unwrap();
        },
    );
}

#[test]
fn an_unknown_hint_key_is_ignored() {
    let seed = fresh_seed();
    run_group(3, "hint-foo", options(TIMEOUT).with_hint("foo", "bar"), |c| {
        let (events, _guard) = Events::capture();
        check_all_reduce(c, seed, 64).unwrap();
        check_broadcast(c, seed, 100_000, 2).unwrap();
        assert!(
            !events.matching(&["hint ignored", "hint=foo=bar"]).is_empty(),
            "{:?}",
            events.0
        );
        let per_op = c.with_options(OpOptions::new().hint("route", "nccl"));
        check_all_reduce(&per_op, seed ^ 2, 300).unwrap();
    });
}
