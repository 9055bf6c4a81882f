//! `FERROCOMM_CHECK_CALLS`: with the check on, ranks that make different calls get
//! `Error::Mismatch` on every rank before any byte moves, and the communicator stays usable;
//! matching calls still give correct results. Run on the CPU backend, whose engine would also
//! notice, but later and by closing the communicator: these tests tell the two apart.

mod common;
use common::*;
use ferrocomm::Error;

fn checked() -> CommOptions {
    options(Duration::from_secs(10)).with_check_calls(true)
}

/// A correct all_reduce after a refused call: the communicator is still in step.
fn still_usable(c: &Comm) {
    let mut x = [c.rank() as i64 + 1];
    c.all_reduce(&mut x[..], ReduceOp::Sum)
        .expect("all_reduce after the mismatch");
    let n = c.size() as i64;
    assert_eq!(x[0], n * (n + 1) / 2);
}

#[test]
fn every_collective_gives_correct_results_with_the_check_on() {
    let seed = fresh_seed();
    let checks = run_group(3, "checked-suite", checked(), |c| common::suite::run_all(c, seed));
    assert!(checks.iter().all(|&k| k == checks[0] && k > 0));
}

#[test]
fn a_rank_with_another_size_fails_the_call_on_every_rank() {
    let r = run_group(3, "check-size", checked(), |c| {
        let mut x = vec![1.0f32; if c.rank() == 2 { 7 } else { 5 }];
        let e = c
            .all_reduce(&mut x[..], ReduceOp::Sum)
            .expect_err("mismatched all_reduce ran");
        assert_eq!(x, vec![1.0; x.len()], "rank {}: the buffer was touched", c.rank());
        still_usable(c);
        e
    });
    for (rank, e) in r.iter().enumerate() {
        let Error::Mismatch {
            op: "all_reduce",
            peer,
            detail,
        } = e
        else {
            panic!("rank {rank}: {e:?}")
        };
        // Ranks 0 and 1 name rank 2; rank 2 names its first partner.
        assert_eq!(*peer, if rank == 2 { 0 } else { 2 }, "rank {rank}: {e}");
        assert!(detail.contains("28 bytes") && detail.contains("20 bytes"), "{e}");
    }
}

#[test]
fn ranks_in_different_operations_fail_alike() {
    let r = run_group(2, "check-op", checked(), |c| {
        let mut x = [0u32; 4];
        let e = if c.rank() == 0 {
            c.all_reduce(&mut x[..], ReduceOp::Max)
        } else {
            c.broadcast(&mut x[..], 0)
        };
        still_usable(c);
        e
    });
    for e in &r {
        let Err(Error::Mismatch { detail, .. }) = e else {
            panic!("{e:?}")
        };
        assert!(
            detail.contains("all_reduce of u32 (max)") && detail.contains("broadcast of u32 with root 0"),
            "{detail}"
        );
    }
}

#[test]
fn all_to_all_v_whose_counts_do_not_pair_up_is_refused_everywhere() {
    // Rank 0 sends 2 elements to rank 1, which expects 3 from it; rank 2's pairs agree, but it
    // must not go ahead alone either.
    let r = run_group(3, "check-a2a", checked(), |c| {
        let (send, recv): (&[usize], &[usize]) = match c.rank() {
            0 => (&[1, 2, 1], &[1, 1, 1]),
            1 => (&[1, 1, 1], &[3, 1, 1]),
            _ => (&[1, 1, 1], &[1, 1, 1]),
        };
        let input = vec![c.rank() as u32; send.iter().sum()];
        let mut output = vec![0u32; recv.iter().sum()];
        let e = c.all_to_all_v(&mut output[..], &input[..], recv, send);
        still_usable(c);
        e
    });
    let peers: Vec<_> = r
        .iter()
        .map(|e| match e {
            Err(Error::Mismatch {
                op: "all_to_all",
                peer,
                detail,
            }) => (*peer, detail.clone()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!((peers[0].0, peers[1].0, peers[2].0), (1, 0, 0), "{peers:?}");
    assert!(peers[1].1.contains("sending 8 bytes to this rank"), "{}", peers[1].1);
    assert!(peers[2].1.contains("ranks 0 and 1"), "{}", peers[2].1);
}

#[test]
fn a_send_and_recv_of_different_sizes_fail_both_partners() {
    let r = run_group(2, "check-p2p", checked(), |c| {
        let e = if c.rank() == 0 {
            c.send(&[1u8; 16][..], 1)
        } else {
            c.recv(&mut [0u8; 8][..], 0)
        };
        // A matching pair still goes through, data intact.
        let mut got = [0u8; 3];
        if c.rank() == 0 {
            c.send(&[7u8, 8, 9][..], 1).unwrap();
        } else {
            c.recv(&mut got[..], 0).unwrap();
            assert_eq!(got, [7, 8, 9]);
        }
        e
    });
    assert!(
        matches!(
            &r[0],
            Err(Error::Mismatch {
                op: "send",
                peer: 1,
                ..
            })
        ),
        "{:?}",
        r[0]
    );
    assert!(
        matches!(
            &r[1],
            Err(Error::Mismatch {
                op: "recv",
                peer: 0,
                ..
            })
        ),
        "{:?}",
        r[1]
    );
}

#[test]
fn the_environment_switches_the_check_on() {
    // Read in a child so this test's environment stays its own.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "print_check_calls_from_env", "--nocapture", "--ignored"])
        .env("FERROCOMM_CHECK_CALLS", "1")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("check_calls=true"),
        "{out:?}"
    );
    let bad = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "print_check_calls_from_env", "--nocapture", "--ignored"])
        .env("FERROCOMM_CHECK_CALLS", "yes")
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&bad.stdout).contains("FERROCOMM_CHECK_CALLS"),
        "{bad:?}"
    );
}

#[test]
#[ignore = "run by the_environment_switches_the_check_on"]
fn print_check_calls_from_env() {
    match CommOptions::from_env() {
        Ok(o) => println!("check_calls={}", o.check_calls),
        Err(e) => println!("{e}"),
    }
}

#[test]
fn a_batch_with_only_itself_needs_no_partner() {
    let r = run_group(2, "check-self", checked(), |c| {
        let me = c.rank();
        let mut got = [0u8; 2];
        c.batch()
            .send(&[me as u8, 9][..], me)
            .recv(&mut got[..], me)
            .issue()
            .map(|()| got)
    });
    assert_eq!(r[0].as_ref().ok(), Some(&[0, 9]), "{r:?}");
    assert_eq!(r[1].as_ref().ok(), Some(&[1, 9]), "{r:?}");
}
