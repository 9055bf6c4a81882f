//! `CommOptions::abort_on_error` (`FERROCOMM_ABORT_ON_ERROR`): after an operation fails in
//! communication, `Comm` aborts the communicator before the error is returned, so peers learn
//! at once; `Process` then ends the process with `AbortOnError::EXIT_CODE`. Argument errors
//! trigger neither.
//!
//! The process mode runs in a child: this test binary re-run as its ignored test
//! `abort_on_error_child`.

mod common;
use common::*;
use ferrocomm::{AbortOnError, Error};
use std::sync::Barrier;
use std::time::Instant;

const CHILD: &str = "FERROCOMM_TEST_ABORT_CHILD";

/// Ranks 0 and 1 of three: rank 0's receive from rank 2, which never sends, times out after
/// 300 ms; rank 1 meanwhile waits (with a 30 s timeout) for a message from rank 0, which never
/// comes. With `Comm`, rank 0 aborts: rank 1 learns at once, and rank 0's communicator is
/// aborted, not merely broken.
#[test]
fn comm_mode_aborts_after_a_timeout_and_peers_waiting_on_the_rank_learn_at_once() {
    let done = Barrier::new(3);
    let opts = options(Duration::from_secs(30)).with_abort_on_error(AbortOnError::Comm);
    let t0 = Instant::now();
    run_group(3, "abort-on-timeout", opts, |c| {
        match c.rank() {
            0 => {
                let short = c.with_options(OpOptions::new().timeout(Duration::from_millis(300)));
                let e = short.recv(&mut [0u8; 4], 2);
                assert!(
                    matches!(
                        e,
                        Err(Error::Timeout {
                            op: "recv",
                            peer: Some(2),
                            ..
                        })
                    ),
                    "{e:?}"
                );
                // Aborted, as `Comm::abort` leaves it: refused before the backend runs anything.
                let e = c.barrier();
                assert!(
                    matches!(
                        e,
                        Err(Error::Closed {
                            op: "barrier",
                            state: "aborted"
                        })
                    ),
                    "{e:?}"
                );
            }
            1 => {
                let e = c.recv(&mut [0u8; 4], 0);
                let took = t0.elapsed();
                // Not rank 0, which aborted, but the rank it timed out on: the root cause.
                assert!(
                    matches!(
                        e,
                        Err(Error::PeerLost {
                            op: "recv",
                            peer: 2,
                            ..
                        })
                    ),
                    "{e:?}"
                );
                assert!(took < Duration::from_secs(5), "rank 1 learned after {took:?}");
            }
            _ => {} // rank 2 never calls
        }
        done.wait();
    });
}

/// `check_calls` finds a mismatch before any byte moves, and without abort_on_error the
/// communicator stays usable; with `Comm` every rank (all of them see the mismatch) aborts.
/// An argument error never aborts.
#[test]
fn comm_mode_aborts_on_a_mismatch_but_not_on_an_argument_error() {
    let call = |c: &Comm| {
        let n = 4 + 4 * c.rank();
        c.all_reduce(&mut vec![1.0f32; n], ReduceOp::Sum)
    };
    let checked = || options(Duration::from_secs(10)).with_check_calls(true);
    run_group(2, "mismatch-off", checked(), |c| {
        assert!(matches!(call(c), Err(Error::Mismatch { .. })));
        c.barrier().unwrap();
    });
    run_group(
        2,
        "mismatch-comm",
        checked().with_abort_on_error(AbortOnError::Comm),
        |c| {
            let bad = c.with_options(OpOptions::new().hint("algorithm", "banana"));
            let e = bad.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum);
            assert!(matches!(e, Err(Error::InvalidArgument { .. })), "{e:?}");
            let e = c.all_reduce(&mut [1.0f32; 4], ReduceOp::BXor);
            assert!(matches!(e, Err(Error::UnsupportedReduce { .. })), "{e:?}");
            c.barrier().unwrap();
            assert!(matches!(call(c), Err(Error::Mismatch { .. })));
            let e = c.barrier();
            assert!(matches!(e, Err(Error::Closed { state: "aborted", .. })), "{e:?}");
        },
    );
}

/// An asynchronous operation fails on the communicator's worker thread; the abort happens
/// there, before anyone waits for the `Work`.
#[test]
fn comm_mode_aborts_after_a_failed_asynchronous_operation() {
    let done = Barrier::new(2);
    let opts = options(Duration::from_millis(300)).with_abort_on_error(AbortOnError::Comm);
    run_group(2, "abort-async", opts, |c| {
        if c.rank() == 0 {
            let mut x = [1.0f64; 8];
            let e = c.scope(|s| {
                let w = s.all_reduce(&mut x, ReduceOp::Sum)?;
                // Not waited for until the operation has failed and aborted the communicator.
                while !w.is_completed() {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let state = c.barrier();
                assert!(
                    matches!(state, Err(Error::Closed { state: "aborted", .. })),
                    "{state:?}"
                );
                w.wait()
            });
            assert!(matches!(e, Err(Error::Timeout { op: "all_reduce", .. })), "{e:?}");
        }
        done.wait();
    });
}

#[test]
fn abort_on_error_is_read_from_the_environment() {
    // The default where the variable is unset, as in this test process's job-free children.
    let o = CommOptions::from_env().unwrap();
    if std::env::var("FERROCOMM_ABORT_ON_ERROR").is_err() {
        assert_eq!(o.abort_on_error, AbortOnError::Off);
    }
    let out = test_entry_command("abort_on_error_child")
        .env(CHILD, "parse")
        .env("FERROCOMM_ABORT_ON_ERROR", "sometimes")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `Process`: the rank that timed out ends its process with `EXIT_CODE`, saying why on stderr.
#[test]
fn process_mode_exits_the_process_after_a_timeout() {
    let mut child = test_entry_command("abort_on_error_child")
        .env(CHILD, "process")
        .env("FERROCOMM_ABORT_ON_ERROR", "process")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let (status, stdout, _) = wait_child(child, Instant::now() + Duration::from_secs(60));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut err).unwrap();
    let status = status.expect("the child did not end within 60 s");
    assert_eq!(
        status.code(),
        Some(AbortOnError::EXIT_CODE),
        "stdout:\n{stdout}\nstderr:\n{err}"
    );
    assert!(!stdout.contains("survived"), "{stdout}");
    assert!(
        err.contains("barrier: timed out") && err.contains("FERROCOMM_ABORT_ON_ERROR=process"),
        "{err}"
    );
}

/// The child side. Does nothing unless started by a test above.
#[test]
#[ignore = "run by the abort_on_error tests as their child process"]
fn abort_on_error_child() {
    let Ok(mode) = std::env::var(CHILD) else {
        eprintln!("abort_on_error_child: not started by an abort_on_error test, nothing to do");
        return;
    };
    match mode.as_str() {
        "parse" => {
            let e = CommOptions::from_env()
                .err()
                .expect("a malformed FERROCOMM_ABORT_ON_ERROR is refused");
            assert!(
                matches!(&e, Error::Config(m) if m.contains("FERROCOMM_ABORT_ON_ERROR") && m.contains("sometimes")),
                "{e}"
            );
        }
        "process" => {
            // The mode comes from the environment, as a launched job would set it.
            let opts = CommOptions::from_env()
                .unwrap()
                .with_timeout(Duration::from_millis(300));
            assert_eq!(opts.abort_on_error, AbortOnError::Process);
            let done = Barrier::new(2);
            run_group(2, "abort-process", opts, |c| {
                if c.rank() == 0 {
                    // Rank 1 never arrives: this ends the process.
                    let e = c.barrier();
                    println!("survived: {e:?}");
                }
                done.wait();
            });
        }
        other => panic!("unknown mode {other}"),
    }
}
