//! Bad input gets a specific error, never a panic; the communicator stays usable after a
//! locally detected error; ranks that call different operations get `Error::Mismatch`.

mod common;
use common::*;
use ferrocomm::Error;
use std::time::Duration;

fn group(n: usize, name: &str) -> Vec<Comm> {
    Comm::new_group("cpu", &vec![Device::Cpu; n], name, options(Duration::from_secs(5))).unwrap()
}

#[test]
fn mismatched_buffer_sizes_are_size_mismatch_errors() {
    let comms = group(1, "sizes1");
    let c = &comms[0];
    let comms2 = group(2, "sizes2");
    let c2 = &comms2[0];
    let mut out = vec![0f32; 3];
    assert!(matches!(
        c2.all_gather(&mut out, &[1.0f32]),
        Err(Error::SizeMismatch { op: "all_gather", .. })
    ));
    assert!(matches!(
        c2.reduce_scatter(&mut [0f32; 1], &[1.0f32; 3], ReduceOp::Sum),
        Err(Error::SizeMismatch { .. })
    ));
    assert!(matches!(
        c.all_gather_v(&mut [0i32; 4], &[1], &[2]),
        Err(Error::SizeMismatch { op: "all_gather_v", .. })
    ));
    assert!(matches!(
        c.reduce_scatter_v(&mut [0i32; 2], &[1, 2, 3], &[3], ReduceOp::Sum),
        Err(Error::SizeMismatch { .. })
    ));
    // The own slot of a list form must match this rank's input.
    let mut slot = [0i64; 2];
    assert!(matches!(
        c.all_gather_list(vec![&mut slot[..]], &[1i64]),
        Err(Error::SizeMismatch { op: "all_gather", .. })
    ));
    // Wrong number of per-rank parts.
    let (mut a, mut b) = ([0u8; 1], [0u8; 1]);
    assert!(matches!(
        c.all_gather_list(vec![&mut a[..], &mut b[..]], &[1u8]),
        Err(Error::SizeMismatch { .. })
    ));
    assert!(matches!(
        c.all_to_all_v(&mut [0u8; 2], &[1u8; 2], &[2], &[1]),
        Err(Error::SizeMismatch { .. })
    ));
    // Still usable: nothing was sent.
    let mut x = [5i32];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [5]);
}

/// Per-rank lists are checked where they lie: how many parts, of which dtype, and this rank's
/// own part; a buffer split into one part per rank must divide.
#[test]
fn per_rank_parts_are_checked_for_count_dtype_and_own_slot() {
    use ferrocomm::{Buf, BufMut, Op, OpOptions};
    let comms = group(2, "perrank");
    let c = &comms[0];
    // 3 elements do not split into 2 equal blocks.
    for r in [
        c.all_to_all(&mut [0u16; 4], &[1u16; 3]),
        c.all_to_all(&mut [0u16; 3], &[1u16; 4]),
    ] {
        assert!(
            matches!(&r, Err(Error::SizeMismatch { op: "all_to_all", what, .. }) if what.contains("2 equal parts")),
            "{r:?}"
        );
    }
    // Our own output slot must hold what our own input block sends to ourselves.
    let (mut o0, mut o1) = ([0u8; 2], [0u8; 1]);
    let r = c.all_to_all_list(vec![&mut o0[..], &mut o1[..]], vec![&[1u8][..], &[2u8][..]]);
    assert!(
        matches!(&r, Err(Error::SizeMismatch { what, expected: 1, actual: 2, .. }) if what == "outputs[0] (own slot)"),
        "{r:?}"
    );
    let (a, b) = ([1u8; 4], [2i32; 1]);
    let (mut x, mut y) = ([0u8; 4], [0u8; 4]);
    // Checked by hand for a rank outside the world: there is no own part to look up.
    let op = Op::AllToAll {
        inputs: vec![Buf::new(&a[..]), Buf::new(&a[..])],
        outputs: vec![BufMut::new(&mut x[..]), BufMut::new(&mut y[..])],
    };
    let r = op.validate(2, 2);
    assert!(matches!(&r, Err(Error::InvalidRank { rank: 2, size: 2, .. })), "{r:?}");
    // Parts of another dtype, and the wrong number of parts.
    let op = Op::AllToAll {
        inputs: vec![Buf::new(&a[..]), Buf::new(&b[..])],
        outputs: vec![BufMut::new(&mut x[..]), BufMut::new(&mut y[..])],
    };
    let r = c.run(op, &OpOptions::default());
    assert!(
        matches!(
            &r,
            Err(Error::DTypeMismatch {
                expected: "u8",
                actual: "i32",
                ..
            })
        ),
        "{r:?}"
    );
    let mut out = [0f32; 1];
    let op = Op::ReduceScatter {
        inputs: vec![Buf::new(&[1f32][..])],
        output: BufMut::new(&mut out[..]),
        op: ReduceOp::Sum,
    };
    let r = c.run(op, &OpOptions::default());
    assert!(
        matches!(&r, Err(Error::SizeMismatch { what, expected: 2, actual: 1, .. }) if what == "number of inputs"),
        "{r:?}"
    );
}

#[test]
fn bitwise_ops_on_floats_and_bad_scalars_are_rejected() {
    let comms = group(1, "dtype");
    let c = &comms[0];
    for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
        assert!(matches!(
            c.all_reduce(&mut [1.0f32], op),
            Err(Error::UnsupportedReduce { dtype: "f32", .. })
        ));
        assert!(matches!(
            c.all_reduce(&mut [ferrocomm::bf16::ONE], op),
            Err(Error::UnsupportedReduce { dtype: "bf16", .. })
        ));
        assert!(matches!(
            c.reduce(&mut [1.0f64], op, 0),
            Err(Error::UnsupportedReduce { dtype: "f64", .. })
        ));
    }
    assert!(matches!(
        c.all_reduce(&mut [1.0f32], ReduceOp::PremulSum(f64::NAN)),
        Err(Error::InvalidArgument { .. })
    ));
    let mut x = [6u8];
    c.all_reduce(&mut x, ReduceOp::BAnd).unwrap();
    assert_eq!(x, [6]);
}

#[test]
fn ranks_out_of_range_are_invalid_rank_errors() {
    let comms = group(2, "ranks");
    let c = &comms[0];
    assert!(matches!(
        c.reduce(&mut [1i32], ReduceOp::Sum, 2),
        Err(Error::InvalidRank {
            op: "reduce",
            rank: 2,
            size: 2
        })
    ));
    assert!(matches!(c.broadcast(&mut [1i32], 9), Err(Error::InvalidRank { .. })));
    assert!(matches!(c.send(&[1i32], 2), Err(Error::InvalidRank { op: "send", .. })));
    assert!(matches!(
        c.recv(&mut [1i32], 5),
        Err(Error::InvalidRank { op: "recv", .. })
    ));
    assert!(matches!(
        c.scatter(&mut [0i32], Some(&[1, 2][..]), 3),
        Err(Error::InvalidRank { .. })
    ));
    assert!(matches!(
        c.gather(None::<&mut [i32]>, &[1i32], 3),
        Err(Error::InvalidRank { .. })
    ));
}

#[test]
fn malformed_splits_are_invalid_split_errors_on_every_rank() {
    // One rank's bad list fails the split everywhere, at once.
    for (case, bad) in [("dup", vec![0, 0]), ("range", vec![0, 3]), ("not-me", vec![1, 2])] {
        let t0 = std::time::Instant::now();
        let r = run_group(3, &format!("badsplit-{case}"), options(Duration::from_secs(30)), |c| {
            let mine = if c.rank() == 0 { bad.clone() } else { vec![] };
            c.split(&mine, case).map(|o| o.is_some())
        });
        assert!(
            r.iter().all(|x| matches!(x, Err(Error::InvalidSplit(_)))),
            "{case}: {r:?}"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{case}: took {:?}", t0.elapsed());
    }
}

#[test]
fn splits_that_disagree_across_ranks_fail_on_every_rank() {
    let lists = [vec![0, 1], vec![1, 2], vec![2]];
    let r = run_group(3, "disagree", options(Duration::from_secs(5)), |c| {
        c.split(&lists[c.rank()], "x").map(|o| o.is_some())
    });
    for (rank, res) in r.iter().enumerate() {
        assert!(matches!(res, Err(Error::InvalidSplit(_))), "rank {rank}: {res:?}");
    }
}

#[test]
fn split_makes_working_sub_communicators_in_list_order() {
    // Ranks 0 and 2 form one group (ordered [2, 0]), 1 and 3 another; rank 4 joins none.
    let lists = [vec![2, 0], vec![1, 3], vec![2, 0], vec![1, 3], vec![]];
    let r = run_group(5, "split", options(Duration::from_secs(10)), |c| {
        let sub = c.split(&lists[c.rank()], "half").unwrap();
        sub.map(|s| {
            let mut x = [c.rank() as i32];
            s.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            let mut who = vec![0i32; s.size()];
            s.all_gather(&mut who, &[c.rank() as i32]).unwrap();
            (s.rank(), s.size(), x[0], who)
        })
    });
    assert_eq!(r[0], Some((1, 2, 2, vec![2, 0])));
    assert_eq!(r[2], Some((0, 2, 2, vec![2, 0])));
    assert_eq!(r[1], Some((0, 2, 4, vec![1, 3])));
    assert_eq!(r[3], Some((1, 2, 4, vec![1, 3])));
    assert_eq!(r[4], None);
}

#[test]
fn different_sizes_across_ranks_are_a_mismatch() {
    let r = run_group(2, "mm-size", options(Duration::from_secs(3)), |c| {
        let mut x = vec![1.0f32; 10 + 2 * c.rank()];
        c.all_reduce(&mut x, ReduceOp::Sum)
    });
    assert!(r.iter().all(|x| x.is_err()), "{r:?}");
    assert!(
        r.iter()
            .any(|x| matches!(x, Err(Error::Mismatch { op: "all_reduce", .. }))),
        "{r:?}"
    );
}

#[test]
fn different_operations_or_dtypes_across_ranks_are_a_mismatch() {
    let r = run_group(2, "mm-op", options(Duration::from_secs(3)), |c| {
        let mut x = vec![1.0f32; 4];
        if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum)
        } else {
            c.broadcast(&mut x, 1)
        }
    });
    assert!(r.iter().any(|x| matches!(x, Err(Error::Mismatch { .. }))), "{r:?}");
    let r = run_group(2, "mm-dtype", options(Duration::from_secs(3)), |c| {
        if c.rank() == 0 {
            c.all_reduce(&mut [1.0f32; 4], ReduceOp::Max)
        } else {
            c.all_reduce(&mut [1i32; 4], ReduceOp::Max)
        }
    });
    assert!(
        r.iter()
            .all(|x| matches!(x, Err(Error::Mismatch { op: "all_reduce", .. }))),
        "{r:?}"
    );
}

/// reduce_scatter_v and all_gather_v whose ranks split the same total into different blocks:
/// the ring moves a step's block in pieces, and the first piece of each side has the same
/// length, so only the call itself can tell before anything lands. Every rank fails with
/// `Mismatch` naming the block lengths, its output untouched.
#[test]
fn blocks_that_differ_under_the_same_total_are_a_mismatch_before_any_byte_lands() {
    // 620 KB in all, above the direct algorithm's limit: the ring, 256 KiB pieces.
    let split = |rank: usize| {
        if rank == 0 {
            [75_000usize, 80_000]
        } else {
            [80_000, 75_000]
        }
    };
    let r = run_group(2, "mm-blocks", options(Duration::from_secs(10)), |c| {
        let counts = split(c.rank());
        let input = vec![1.0f32; counts.iter().sum()];
        let mut out = vec![-1.0f32; counts[c.rank()]];
        let rs = c.reduce_scatter_v(&mut out, &input, &counts, ReduceOp::Sum);
        (rs, out.iter().all(|&x| x == -1.0))
    });
    every_rank_names_the_block_lengths("reduce_scatter_v", r);
    let r = run_group(2, "mm-blocks-ag", options(Duration::from_secs(10)), |c| {
        let counts = split(c.rank());
        let input = vec![1.0f32; counts[c.rank()]];
        let mut out = vec![-1.0f32; counts.iter().sum()];
        let ag = c.all_gather_v(&mut out, &input, &counts);
        (ag, out.iter().all(|&x| x == -1.0))
    });
    every_rank_names_the_block_lengths("all_gather_v", r);
}

/// Each rank's (result, output untouched) of `op`: `Mismatch` naming the block lengths, and
/// nothing written.
fn every_rank_names_the_block_lengths(op: &str, results: Vec<(Result<(), Error>, bool)>) {
    for (rank, (r, untouched)) in results.into_iter().enumerate() {
        assert!(
            matches!(&r, Err(Error::Mismatch { detail, .. }) if detail.contains("block lengths")),
            "rank {rank}, {op}: {r:?}"
        );
        assert!(untouched, "rank {rank}: {op} wrote its output before the mismatch");
    }
}

/// Small all_reduce, all_gather and barrier between ranks of one host go through shared-memory
/// rounds (the board), not framed messages: calls that differ there must still be mismatches,
/// found at once rather than at the timeout.
#[test]
fn different_operations_in_shared_memory_rounds_are_a_mismatch_without_waiting_for_the_timeout() {
    let timeout = Duration::from_secs(20);
    let start = std::time::Instant::now();
    let r = run_group(2, "mm-board", options(timeout), |c| {
        let mut x = vec![1.0f32; 8];
        if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum)
        } else {
            let mut out = vec![0.0f32; 16];
            c.all_gather(&mut out, &x)
        }
    });
    assert!(r.iter().all(|x| matches!(x, Err(Error::Mismatch { .. }))), "{r:?}");
    // One rank in a round, the other sending framed messages (a small broadcast from rank 1,
    // kept off the board by its hint).
    let direct = OpOptions::new().hint("algorithm", "direct");
    let r = run_group(2, "mm-board-msg", options(timeout), |c| {
        let mut x = vec![1.0f32; 8];
        if c.rank() == 0 {
            c.all_reduce(&mut x, ReduceOp::Sum)
        } else {
            c.with_options(direct.clone())
                .broadcast(&mut x, 1)
                .and_then(|_| c.all_reduce(&mut x, ReduceOp::Sum))
        }
    });
    assert!(
        matches!(
            r[0],
            Err(Error::Mismatch {
                op: "all_reduce",
                peer: 1,
                ..
            })
        ),
        "{r:?}"
    );
    // And the other way round: a rank waiting for a message sees its peer enter a round.
    let r = run_group(2, "mm-msg-board", options(timeout), |c| {
        let mut x = vec![1.0f32; 8];
        if c.rank() == 0 {
            c.with_options(direct.clone()).broadcast(&mut x, 1)
        } else {
            c.barrier()
        }
    });
    assert!(
        matches!(
            r[0],
            Err(Error::Mismatch {
                op: "broadcast",
                peer: 1,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(start.elapsed() < timeout / 2, "mismatches took {:?}", start.elapsed());
}

/// A hint is advice: where `oneshot` cannot run (too large a contribution, an operation without
/// shared-memory rounds) the operation runs with the default choice (tests/hints.rs has more);
/// a value the backend does not know is refused before any byte moves.
#[test]
fn the_oneshot_hint_is_ignored_where_it_cannot_run_and_a_bad_value_is_refused() {
    let r = run_group(2, "oneshot-hint", options(Duration::from_secs(5)), |c| {
        let one = c.with_options(OpOptions::new().hint("algorithm", "oneshot"));
        let mut small = vec![1.0f32; 4];
        let ok = one.all_reduce(&mut small, ReduceOp::Sum).map(|_| small[0]);
        let mut big = vec![1.0f32; 32 << 10];
        let too_big = one
            .all_reduce(&mut big, ReduceOp::Sum)
            .map(|_| big.iter().all(|&x| x == 2.0));
        // Reduce has no rounds: 5 and 6 at root 0, the other's buffer as it was.
        let mut root = vec![c.rank() as f32 + 5.0; 4];
        let other_op = one.reduce(&mut root, ReduceOp::Max, 0).map(|_| root[3]);
        let bad = c
            .with_options(OpOptions::new().hint("algorithm", "banana"))
            .all_reduce(&mut small, ReduceOp::Sum);
        (ok, too_big, other_op, bad)
    });
    for (ok, too_big, other_op, bad) in r {
        assert_eq!(ok.unwrap(), 2.0);
        assert!(too_big.unwrap());
        assert_eq!(other_op.unwrap(), 6.0);
        assert!(
            matches!(bad, Err(Error::InvalidArgument { op: "all_reduce", .. })),
            "{bad:?}"
        );
    }
}

#[test]
fn unknown_backends_and_devices_are_clear_errors() {
    let o = options(Duration::from_secs(1));
    assert!(matches!(
        Comm::new_group("nope", &[Device::Cpu], "x", o.clone()),
        Err(Error::UnknownBackend(..))
    ));
    assert!(matches!(
        Comm::new_group("cpu", &[Device::Cuda(0)], "x", o.clone()),
        Err(Error::Unavailable { .. })
    ));
    assert!(matches!(
        Comm::new_group("auto", &[Device::Cuda(0)], "x", o),
        Err(Error::Unavailable { .. })
    ));
}

#[test]
fn a_finalized_communicator_refuses_operations() {
    let comms = group(1, "fin");
    comms[0].finalize().unwrap();
    assert!(matches!(
        comms[0].all_reduce(&mut [1i32], ReduceOp::Sum),
        Err(Error::Closed { state: "finalized", .. })
    ));
}

#[test]
fn object_collectives_round_trip_any_serde_type() {
    let r = run_group(3, "objects", options(Duration::from_secs(10)), |c| {
        let me = (c.rank(), format!("rank-{}", c.rank()), vec![c.rank() as f64; c.rank()]);
        let all = c.all_gather_object(&me).unwrap();
        let b: String = c
            .broadcast_object((c.rank() == 1).then(|| "from one".to_string()).as_ref(), 1)
            .unwrap();
        let g = c.gather_object(&me.1, 2).unwrap();
        let items: Vec<u32> = vec![10, 20, 30];
        let s: u32 = c.scatter_object((c.rank() == 0).then_some(&items[..]), 0).unwrap();
        (all, b, g, s)
    });
    for (rank, (all, b, g, s)) in r.iter().enumerate() {
        assert_eq!(all.len(), 3);
        assert_eq!(all[2], (2, "rank-2".to_string(), vec![2.0, 2.0]));
        assert_eq!(b, "from one");
        assert_eq!(g.is_some(), rank == 2);
        assert_eq!(*s, [10, 20, 30][rank]);
    }
    assert_eq!(
        r[2].2.as_ref().unwrap(),
        &vec!["rank-0".to_string(), "rank-1".into(), "rank-2".into()]
    );
}

#[test]
fn async_work_completes_in_issue_order_with_sync_calls() {
    let r = run_group(3, "async", options(Duration::from_secs(10)), |c| {
        let mut a = vec![c.rank() as i64; 1000];
        let mut b = vec![1i64; 7];
        let mut after = [c.rank() as i64];
        c.scope(|s| {
            let wa = s.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let wb = s
                .with_options(OpOptions::new().timeout(Duration::from_secs(5)))
                .all_reduce(&mut b, ReduceOp::Prod)
                .unwrap();
            // A synchronous call queues behind the asynchronous ones.
            c.all_reduce(&mut after, ReduceOp::Max).unwrap();
            assert!(wa.is_completed() && wb.is_completed());
            wb.wait().unwrap();
            wa.wait_timeout(Duration::from_secs(1)).unwrap();
        });
        (a, b, after)
    });
    for (a, b, after) in r {
        assert_eq!(a, vec![3; 1000]);
        assert_eq!(b, vec![1; 7]);
        assert_eq!(after, [2]);
    }
}

#[test]
fn users_can_register_their_own_backend() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    // A user backend that counts operations and delegates the work to the CPU backend.
    struct Counting(Box<dyn ferrocomm::Backend>, Arc<AtomicUsize>);
    impl ferrocomm::Backend for Counting {
        fn name(&self) -> &'static str {
            "counting"
        }
        fn run(&self, op: &mut ferrocomm::Op<'_>, o: &ferrocomm::RunOptions) -> ferrocomm::Result<()> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.run(op, o)
        }
        fn abort(&self) {
            self.0.abort()
        }
        fn finalize(&self) -> ferrocomm::Result<()> {
            self.0.finalize()
        }
    }
    let count = Arc::new(AtomicUsize::new(0));
    let c2 = count.clone();
    let cpu = ferrocomm::backend_factory("cpu").unwrap();
    ferrocomm::register_backend(
        "counting",
        Arc::new(move |init: &ferrocomm::BackendInit| {
            Ok(Box::new(Counting(cpu(init)?, c2.clone())) as Box<dyn ferrocomm::Backend>)
        }),
    );
    assert!(ferrocomm::backend_names().contains(&"counting".to_string()));
    let r = run_group_on("counting", 2, "mine", |c| {
        let mut x = [c.rank() as i32 + 1];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        (x[0], c.backend_name().to_string())
    });
    assert_eq!(r, vec![(3, "counting".to_string()); 2]);
    assert_eq!(count.load(Ordering::Relaxed), 4);
}

#[test]
fn a_rank_that_cannot_join_fails_the_whole_group_at_once() {
    let t0 = std::time::Instant::now();
    let devices = [Device::Cpu, Device::Cuda(0), Device::Cpu];
    let r = Comm::new_group("cpu", &devices, "half-joined", options(Duration::from_secs(60)));
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{:?}", r.err());
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the other ranks waited {:?}",
        t0.elapsed()
    );
}

/// bool has no average or scaled sum, fp8 no bitwise ops: refused before anything moves, on
/// every reducing collective, and the communicator stays usable.
#[test]
fn reductions_a_new_element_type_lacks_are_unsupported_reduce() {
    let comms = group(1, "new-dtypes");
    let c = &comms[0];
    for op in [ReduceOp::Avg, ReduceOp::PremulSum(2.0)] {
        assert!(matches!(
            c.all_reduce(&mut [true], op),
            Err(Error::UnsupportedReduce { dtype: "bool", .. })
        ));
        assert!(matches!(
            c.reduce(&mut [false], op, 0),
            Err(Error::UnsupportedReduce { dtype: "bool", .. })
        ));
        assert!(matches!(
            c.reduce_scatter(&mut [false], &[true], op),
            Err(Error::UnsupportedReduce { dtype: "bool", .. })
        ));
    }
    for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
        assert!(matches!(
            c.all_reduce(&mut [ferrocomm::F8E5M2::from_f32(1.0)], op),
            Err(Error::UnsupportedReduce { dtype: "f8e5m2", .. })
        ));
        assert!(matches!(
            c.all_reduce(&mut [ferrocomm::F8E4M3::from_f32(1.0)], op),
            Err(Error::UnsupportedReduce { dtype: "f8e4m3", .. })
        ));
    }
    // What bool and the 16-bit integers do have.
    let mut b = [true, false];
    c.all_reduce(&mut b, ReduceOp::BXor).unwrap();
    assert_eq!(b, [true, false]);
    let mut x = [i16::MAX, -3];
    c.all_reduce(&mut x, ReduceOp::BAnd).unwrap();
    assert_eq!(x, [i16::MAX, -3]);
    assert!(ReduceOp::Sum.is_defined_for(DType::Bool) && !ReduceOp::Avg.is_defined_for(DType::Bool));
    assert!(ReduceOp::BXor.is_defined_for(DType::U16) && !ReduceOp::BXor.is_defined_for(DType::F8E5M2));
}

/// Whatever bytes a backend (or a peer outside safe Rust, through it) leaves in a bool output,
/// the caller reads bools: 0 stays false, any other byte is true, stored as 1.
#[test]
fn bytes_that_are_no_bool_in_an_output_arrive_as_true() {
    use std::sync::Arc;
    // A user backend that runs the CPU backend, then scribbles over every true in the outputs.
    struct Scribbling(Box<dyn ferrocomm::Backend>);
    impl ferrocomm::Backend for Scribbling {
        fn name(&self) -> &'static str {
            "scribbling"
        }
        fn run(&self, op: &mut ferrocomm::Op<'_>, o: &ferrocomm::RunOptions) -> ferrocomm::Result<()> {
            self.0.run(op, o)?;
            let scribble = |b: &mut ferrocomm::BufMut<'_>| {
                for (i, x) in b.host_bytes_mut().iter_mut().enumerate() {
                    if *x != 0 {
                        *x = 2 + (i % 254) as u8;
                    }
                }
            };
            match op {
                ferrocomm::Op::AllReduce { buf, .. } => scribble(buf),
                ferrocomm::Op::AllGather { outputs, .. } => outputs.iter_mut().for_each(scribble),
                _ => {}
            }
            Ok(())
        }
        fn abort(&self) {
            self.0.abort()
        }
        fn finalize(&self) -> ferrocomm::Result<()> {
            self.0.finalize()
        }
    }
    let cpu = ferrocomm::backend_factory("cpu").unwrap();
    ferrocomm::register_backend(
        "scribbling",
        Arc::new(move |init: &ferrocomm::BackendInit| {
            Ok(Box::new(Scribbling(cpu(init)?)) as Box<dyn ferrocomm::Backend>)
        }),
    );
    let bytes_of = |v: &[bool]| -> Vec<u8> {
        // SAFETY: a bool is one byte; reads the bytes of initialised bools.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len()) }.to_vec()
    };
    let r = run_group_on("scribbling", 2, "scribbled", |c| {
        let mine: Vec<bool> = (0..300).map(|i| (i + c.rank()) % 3 == 0).collect();
        let mut or = mine.clone();
        c.all_reduce(&mut or, ReduceOp::BOr).unwrap();
        let mut all = vec![false; 600];
        c.all_gather(&mut all, &mine).unwrap();
        (mine, or, all)
    });
    for (mine, or, all) in &r {
        let want_or: Vec<bool> = (0..300).map(|i| r[0].0[i] | r[1].0[i]).collect();
        assert_eq!(or, &want_or);
        assert_eq!(all[..300], r[0].0[..]);
        assert_eq!(all[300..], r[1].0[..]);
        assert!(mine.iter().any(|&b| b));
        assert!(
            bytes_of(or).iter().chain(&bytes_of(all)).all(|&b| b <= 1),
            "a byte that is no bool"
        );
    }
}

/// A backend that panics in an operation queued behind others: the worker records the panic
/// as that operation's error (its Work must not wait forever, even when dropped unwaited), and
/// the communicator goes on.
#[test]
fn a_backend_panic_in_queued_work_is_that_works_error() {
    use std::sync::Arc;
    struct Panicky(Box<dyn ferrocomm::Backend>);
    impl ferrocomm::Backend for Panicky {
        fn name(&self) -> &'static str {
            "panicky"
        }
        fn run(&self, op: &mut ferrocomm::Op<'_>, o: &ferrocomm::RunOptions) -> ferrocomm::Result<()> {
            if matches!(op, ferrocomm::Op::Broadcast { .. }) {
                panic!("this backend cannot broadcast");
            }
            self.0.run(op, o)
        }
        fn abort(&self) {
            self.0.abort()
        }
        fn finalize(&self) -> ferrocomm::Result<()> {
            self.0.finalize()
        }
    }
    let cpu = ferrocomm::backend_factory("cpu").unwrap();
    ferrocomm::register_backend(
        "panicky",
        Arc::new(move |init: &ferrocomm::BackendInit| Ok(Box::new(Panicky(cpu(init)?)) as Box<dyn ferrocomm::Backend>)),
    );
    let c = Comm::new_group("panicky", &[Device::Cpu], "panicky", options(Duration::from_secs(10)))
        .unwrap()
        .remove(0);
    let first = c.owned().all_reduce(vec![1u8; 4], ReduceOp::Sum).unwrap();
    let panics = c.owned().broadcast(vec![2u8; 4], 0).unwrap();
    drop(c.owned().broadcast(vec![3u8; 4], 0).unwrap()); // dropped unwaited: must return
    assert_eq!(first.wait().unwrap(), vec![1; 4]);
    match panics.wait() {
        Err(Error::Backend { backend, message, .. }) => {
            assert_eq!(backend, "panicky");
            assert!(message.contains("panicked"), "{message}");
        }
        other => panic!("a panicking backend: {other:?}"),
    }
    let mut x = [5u8];
    c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    assert_eq!(x, [5]);
}

/// Options that put a broadcast on the board whatever the environment says (transport, call
/// checks, round sizes).
fn pinned_to_the_board() -> CommOptions {
    let mut o = options(Duration::from_secs(5))
        .with_check_calls(false)
        .with_hint("algorithm", "oneshot");
    o.transport.force_tcp = false;
    o
}

/// A broadcast larger than a slot goes through the board in pieces, and its first round
/// carries every rank's whole length: a receiver with another length, whether it needs fewer
/// pieces or fits one, is a mismatch on every rank before any piece lands.
#[test]
fn a_pieced_board_broadcast_receiver_with_another_length_is_a_mismatch_before_any_piece_lands() {
    let o = pinned_to_the_board();
    for short in [50_000usize, 1000] {
        let r = run_group(3, "mm-bcast-pieces", o.clone(), |c| {
            let count = if c.rank() == 2 { short } else { 65_536 };
            let mut x = vec![c.rank() as f32 + 1.0; count];
            let before = x.clone();
            let r = c.broadcast(&mut x, 0);
            (r, x == before)
        });
        let either = [
            format!("bytes: this rank has {}, rank 0 has 262144", 4 * short),
            format!("bytes: this rank has 262144, rank 2 has {}", 4 * short),
        ];
        for (rank, (r, untouched)) in r.iter().enumerate() {
            assert!(untouched, "rank {rank}: its buffer changed: {r:?}");
            assert!(
                matches!(r, Err(Error::Mismatch { op: "broadcast", detail, .. })
                    if either.iter().any(|w| detail.ends_with(w.as_str()))),
                "rank {rank}, {short} elements at rank 2: {r:?}"
            );
        }
    }
}

/// A small broadcast on one host is a shared-memory round in which every rank gives its
/// buffer's length: a receiver with another length is a mismatch on every rank, named by
/// field and both lengths, the root's and the other receiver's included, and no receiver's
/// buffer changes.
#[test]
fn a_board_broadcast_receiver_with_another_length_is_a_mismatch_everywhere() {
    let r = run_group(3, "mm-bcast-len", pinned_to_the_board(), |c| {
        let count = if c.rank() == 2 { 3 } else { 4 };
        let mut x = vec![c.rank() as f32 + 1.0; count];
        let before = x.clone();
        let r = c.broadcast(&mut x, 0);
        (r, x == before)
    });
    // A rank may report the mismatch as the first rank to see it recorded it (README
    // "Errors": the true cause, on every rank), so only the field and the lengths are fixed.
    let either = [
        "bytes: this rank has 12, rank 0 has 16",
        "bytes: this rank has 16, rank 2 has 12",
    ];
    for (rank, (r, untouched)) in r.iter().enumerate() {
        assert!(untouched, "rank {rank}: its buffer changed: {r:?}");
        assert!(
            matches!(r, Err(Error::Mismatch { op: "broadcast", detail, .. })
                if either.iter().any(|w| detail.ends_with(w))),
            "rank {rank}: {r:?}"
        );
    }
}

/// The CPU backend, driven directly through the public backend interface (no communicator to
/// check first), refuses a buffer in device memory with an argument error naming the device,
/// alone and beside host buffers, and never reads it.
#[test]
fn the_cpu_backend_refuses_device_buffers_given_to_it_directly() {
    use ferrocomm::{backend_factory, BackendInit, Buf, BufMut, MemoryStore, Op, OutputBuffer, P2p, RunOptions};
    use std::collections::BTreeMap;
    use std::sync::Arc;
    let options = CommOptions::from_env().unwrap();
    let init = BackendInit {
        rank: 0,
        size: 1,
        store: Arc::new(MemoryStore::new()),
        name: "direct",
        device: Device::Cpu,
        options: &options,
        lent_links: None,
    };
    let backend = backend_factory("cpu").unwrap()(&init).unwrap();
    let hints = BTreeMap::new();
    let opts = RunOptions {
        timeout: Duration::from_secs(5),
        hints: &hints,
        stream: 0,
        fence: None,
    };
    let device_view = || {
        // SAFETY: never dereferenced: the backend refuses it before it touches any byte.
        unsafe { ferrocomm::device::DeviceSliceMut::<f32>::from_raw(0, 0x10_0000, 4) }.unwrap()
    };
    let mut alone = Op::AllReduce {
        buf: device_view().into_buf_mut(),
        op: ReduceOp::Sum,
    };
    let host = [1f32; 4];
    let mut beside_host = Op::Batch(vec![
        P2p::Send {
            buf: Buf::new(&host[..]),
            peer: 0,
        },
        P2p::Recv {
            buf: device_view().into_buf_mut(),
            peer: 0,
        },
    ]);
    for op in [&mut alone, &mut beside_host] {
        let err = backend.run(op, &opts).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }) && err.to_string().contains("CUDA device 0"),
            "{err}"
        );
    }
    // Still usable afterwards: an argument error moves nothing.
    let mut x = [2f32; 4];
    let mut ok = Op::AllReduce {
        buf: BufMut::new(&mut x[..]),
        op: ReduceOp::Sum,
    };
    backend.run(&mut ok, &opts).unwrap();
    drop(ok);
    assert_eq!(x, [2.0; 4]);
}
