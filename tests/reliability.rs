//! The reliability matrix: every fault and every mismatched call, in the three modes a CPU job
//! runs in (4 ranks as threads, as processes over shared memory, as processes over TCP), with
//! the exact error each rank must report. A lost rank is named by every survivor, including
//! ranks that only saw a neighbour fail because of it; an aborting rank sees `Closed`, the
//! others `PeerLost` naming it, "aborted"; a mismatched call is `Error::Mismatch` naming the
//! field on every rank, leaves every buffer untouched, and closes the communicator (a rank that
//! writes nothing in the collective, such as a broadcast's root, or a broadcast's receiver whose
//! root agrees with it, may complete it and get the mismatch from its next call; such a
//! receiver may also fail with part of its root's data, where the chain breaks elsewhere).
//!
//! `FERROCOMM_RELIABILITY_TABLE=1` prints each row with its detection times (the source of
//! docs/results/reliability.md).

mod common;
use common::*;
use ferrocomm::Error;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

const WORLD: usize = 4;
const VICTIM: usize = 3;
const SCENARIO: &str = "FERROCOMM_TEST_SCENARIO";
const TIMEOUT: Duration = Duration::from_secs(10);

/// Every row of the matrix.
const SCENARIOS: [&str; 18] = [
    "exit_in_all_reduce",
    "exit_in_chain",
    "exit_in_window_wait",
    "abort",
    "broadcast_root:small",
    "broadcast_root:large",
    "op_kind:small",
    "op_kind:large",
    "reduce_op:small",
    "reduce_op:large",
    "dtype:small",
    "dtype:large",
    "length:small",
    "length:large",
    "all_gather_length:small",
    "all_gather_length:large",
    "gather_root:small",
    "gather_root:large",
];

fn now_us() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros()
}

/// When the fault of the running row happened (threads mode; processes print it).
static FAULT_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Notes the moment of the fault: the first rank to note it sets it.
fn mark_fault() {
    let at = now_us();
    println!("FAULT_AT {at}");
    let _ = FAULT_AT.compare_exchange(
        0,
        at as u64,
        std::sync::atomic::Ordering::Relaxed,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// What a rank saw, in one line: `<kind> peer=<p> op=<op> at=<µs> :: <message>`.
fn outcome(r: &ferrocomm::Result<()>) -> String {
    let at = now_us();
    match r {
        Ok(()) => format!("ok at={at}"),
        Err(e @ Error::PeerLost { op, peer, .. }) => format!("PeerLost peer={peer} op={op} at={at} :: {e}"),
        Err(e @ Error::Mismatch { op, peer, .. }) => format!("Mismatch peer={peer} op={op} at={at} :: {e}"),
        Err(e @ Error::Closed { op, .. }) => format!("Closed op={op} at={at} :: {e}"),
        Err(e) => format!("Other at={at} :: {e} ({e:?})"),
    }
}

/// The mismatched call of a row: ranks below VICTIM make the first call, the victim the second.
/// Returns the call's result and whether the rank's buffer is as it must be (as it was, but
/// for `broadcast_root`'s rank 1).
fn mismatched_call(c: &Comm, row: &str, large: bool) -> (ferrocomm::Result<()>, bool) {
    let n = if large { 1 << 20 } else { 2 };
    let odd = c.rank() == VICTIM;
    let fill = |r: usize| (0..n).map(|i| (r * 1000 + i % 97) as f32).collect::<Vec<f32>>();
    let mut a = fill(c.rank());
    let before = a.clone();
    let r = match row {
        "all_gather_length" => {
            // The victim contributes one element fewer; every output stays as poisoned.
            let m = if odd { n - 1 } else { n };
            let mut out = vec![-1.0f32; m * WORLD];
            let r = c.all_gather(&mut out, &a[..m]);
            return (r, out.iter().all(|&x| x == -1.0));
        }
        "gather_root" => {
            // Ranks 0 and 1 gather at rank 0, ranks 2 and 3 at rank 1.
            let root = usize::from(c.rank() >= 2);
            let mut out = vec![-1.0f32; n * WORLD];
            let r = c.gather((c.rank() == root).then_some(&mut out[..]), &a, root);
            return (r, out.iter().all(|&x| x == -1.0));
        }
        "broadcast_root" => {
            // Ranks 0 and 1 say the root is 0, ranks 2 and 3 say 1. Rank 1 checks first only
            // the call of its root, which agrees with it: it may complete the call, its buffer
            // then holding rank 0's, as they both asked; or, where the chain breaks at rank 2
            // while it forwards, fail holding part of it. Never anything else.
            let root = usize::from(c.rank() >= 2);
            let r = c.broadcast(&mut a, root);
            let sent = fill(root);
            let as_asked = match r {
                Ok(()) => a == sent,
                Err(_) if c.rank() == 1 => (a.iter().zip(&before).zip(&sent)).all(|((x, b), s)| x == b || x == s),
                Err(_) => a == before,
            };
            return (r, as_asked);
        }
        "op_kind" if odd => c.broadcast(&mut a, 0),
        "reduce_op" if odd => c.all_reduce(&mut a, ReduceOp::Max),
        // The others scale their contribution first: that too must not touch their buffers.
        "reduce_op" => c.all_reduce(&mut a, ReduceOp::PremulSum(0.5)),
        "dtype" if odd => {
            let mut b: Vec<i32> = a.iter().map(|&x| x as i32).collect();
            let keep = b.clone();
            let r = c.all_reduce(&mut b, ReduceOp::Sum);
            return (r, b == keep);
        }
        "length" if odd => c.all_reduce(&mut a[..n - 1], ReduceOp::Sum),
        _ => c.all_reduce(&mut a, ReduceOp::Sum),
    };
    (r, a == before)
}

/// One rank's part of `scenario`; `leave` ends the victim (drops its communicator as a thread,
/// exits as a process). Returns the outcome line(s) to check.
fn rank_body(scenario: &str, comm: Comm, leave: &dyn Fn(Comm)) -> Vec<String> {
    let me = comm.rank();
    comm.barrier().expect("warm-up barrier");
    let (row, size) = scenario.split_once(':').unwrap_or((scenario, ""));
    match row {
        "exit_in_all_reduce" => {
            for iter in 0..1000 {
                if me == VICTIM && iter == 3 {
                    mark_fault();
                    leave(comm);
                    return vec![];
                }
                let mut x = vec![1.0f32; 1 << 18];
                let r = comm.all_reduce(&mut x, ReduceOp::Sum);
                if r.is_err() {
                    return vec![outcome(&r)];
                }
            }
            vec!["no error".into()]
        }
        "exit_in_chain" => {
            // Rank 0 waits on the victim, rank 1 on rank 0, rank 2 on rank 1: only rank 0 sees
            // the victim go; ranks 1 and 2 see a neighbour fail because of it.
            if me == VICTIM {
                std::thread::sleep(Duration::from_millis(300));
                mark_fault();
                leave(comm);
                return vec![];
            }
            let from = if me == 0 { VICTIM } else { me - 1 };
            let r = comm.recv(&mut [0u8; 8], from);
            vec![outcome(&r)]
        }
        "exit_in_window_wait" => {
            // The chain again, through a window: each rank waits for a signal that never comes.
            let w = comm.new_window(4096).expect("window");
            comm.barrier().expect("barrier after the window");
            if me == VICTIM {
                std::thread::sleep(Duration::from_millis(300));
                mark_fault();
                drop(w);
                leave(comm);
                return vec![];
            }
            let from = if me == 0 { VICTIM } else { me - 1 };
            let r = w.wait_signal(0, SignalSource::Rank(from), Cmp::Ge, 1).map(|_| ());
            vec![outcome(&r)]
        }
        "abort" => {
            // Nobody sends: every rank waits until the victim aborts.
            let r = std::thread::scope(|s| {
                if me == VICTIM {
                    s.spawn(|| {
                        std::thread::sleep(Duration::from_millis(300));
                        mark_fault();
                        comm.abort();
                    });
                }
                let from = if me == VICTIM { 0 } else { VICTIM };
                comm.recv(&mut [0u8; 8], from)
            });
            let mut seen = vec![outcome(&r)];
            if me == VICTIM {
                seen.push(outcome(&comm.barrier()));
            }
            seen
        }
        _ => {
            mark_fault();
            let (r, untouched) = mismatched_call(&comm, row, size == "large");
            let mut seen = vec![outcome(&r)];
            if !untouched {
                seen.push("buffer changed".into());
            }
            seen.push(outcome(&comm.barrier()));
            seen
        }
    }
}

/// Checks one rank's lines against the row; returns the detection time in µs after the fault.
fn check(mode: &str, scenario: &str, rank: usize, seen: &[String], fault_at: u128) -> u128 {
    let ctx = format!("{mode} / {scenario} / rank {rank}: {seen:?}");
    let row = scenario.split_once(':').map_or(scenario, |(r, _)| r);
    let first = seen.first().unwrap_or_else(|| panic!("{ctx}: no outcome"));
    let want = |prefix: &str, parts: &[&str]| {
        assert!(first.starts_with(prefix), "{ctx}: wanted {prefix}");
        for p in parts {
            assert!(first.contains(p), "{ctx}: wanted `{p}` in it");
        }
    };
    match row {
        "exit_in_all_reduce" => want("PeerLost peer=3 op=all_reduce", &[]),
        "exit_in_window_wait" => want(
            "PeerLost peer=3 op=wait_signal",
            if rank == 0 {
                &[]
            } else {
                &["failed after losing rank 3"]
            },
        ),
        "exit_in_chain" => want(
            "PeerLost peer=3 op=recv",
            if rank == 0 {
                &[]
            } else {
                &["failed after losing rank 3"]
            },
        ),
        "abort" if rank == VICTIM => {
            want("Closed op=recv", &["aborted"]);
            assert!(
                seen[1].starts_with("Closed op=barrier"),
                "{ctx}: later calls are Closed"
            );
        }
        "abort" => want("PeerLost peer=3 op=recv", &["aborted"]),
        _ => {
            let field = match row {
                "broadcast_root" => "root",
                "op_kind" => "operation",
                "reduce_op" => "reduce op",
                "dtype" => "dtype",
                "gather_root" => "root",
                _ => "element count",
            };
            // On shared memory a small call may meet the other side's round on the board,
            // where the check knows that the calls differ but names no field unless the
            // operations differ (so op_kind:large, whose broadcast goes on the board where
            // ranks outnumber the CPUs, still names it).
            let board = !mode.contains("tcp") && scenario.ends_with(":small") && !row.ends_with("_root");
            let fields = [field];
            let fields: &[&str] = if board { &[] } else { &fields };
            // A rank that writes nothing in the collective (a broadcast's root, gather's other
            // ranks, in their own view) does not wait for the others' calls, nor does a
            // broadcast's receiver wait for any but its root's (rank 1, whose root 0 agrees with
            // it): it may complete the call and meet the mismatch at its next one, which fails
            // with it.
            let sender_only = match row {
                "broadcast_root" => rank <= 1,
                "gather_root" => rank != 0,
                _ => false,
            };
            if sender_only && first.starts_with("ok") {
                assert_eq!(seen.len(), 2, "{ctx}");
                assert!(
                    seen[1].starts_with("Mismatch peer="),
                    "{ctx}: the next call reports the mismatch"
                );
                assert!(fields.iter().all(|f| seen[1].contains(f)), "{ctx}: wanted {fields:?}");
                return time_of(&seen[1], &ctx).saturating_sub(fault_at);
            }
            want("Mismatch", fields);
            assert_eq!(seen.len(), 2, "{ctx}: a mismatch must leave every buffer as it must be");
            assert!(
                seen[1].starts_with("Closed op=barrier"),
                "{ctx}: the communicator is closed after a mismatch"
            );
        }
    }
    time_of(first, &ctx).saturating_sub(fault_at)
}

/// The `at=` time of an outcome line.
fn time_of(line: &str, ctx: &str) -> u128 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("at="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{ctx}: no time"))
}

fn report(mode: &str, scenario: &str, times: &[u128]) {
    if std::env::var("FERROCOMM_RELIABILITY_TABLE").is_ok() {
        let worst = times.iter().max().copied().unwrap_or(0);
        println!(
            "TABLE | {scenario} | {mode} | true cause on every rank | {:.1} ms |",
            worst as f64 / 1000.0
        );
    }
}

fn run_threads(scenario: &str, tcp: bool) {
    let opts = if tcp { tcp_options(TIMEOUT) } else { options(TIMEOUT) };
    let name = format!("rel-{scenario}-{tcp}");
    let comms = Comm::new_group("cpu", &[Device::Cpu; WORLD], &name, opts).expect("new_group");
    // One row at a time in this process: FAULT_AT is shared by the thread-mode tests.
    static ONE_ROW: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _row = ONE_ROW.lock().unwrap_or_else(|p| p.into_inner());
    FAULT_AT.store(0, std::sync::atomic::Ordering::Relaxed);
    let lines: Vec<Vec<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| s.spawn(move || rank_body(scenario, c, &drop)))
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    });
    let start = FAULT_AT.load(std::sync::atomic::Ordering::Relaxed) as u128;
    assert!(start > 0, "{scenario}: no fault time");
    let mode = if tcp { "threads-tcp" } else { "threads" };
    let times: Vec<u128> = (lines.iter().enumerate())
        .filter(|(r, l)| !(l.is_empty() && *r == VICTIM))
        .map(|(r, l)| check(mode, scenario, r, l, start))
        .collect();
    report(mode, scenario, &times);
}

#[test]
#[ignore = "run by the reliability tests as their ranks"]
fn reliability_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        eprintln!("reliability_rank: not started by a reliability test, nothing to do");
        return;
    };
    let comm = new_comm("cpu", Device::Cpu, "reliability", CommOptions::from_env().unwrap()).unwrap();
    let rank = comm.rank();
    for line in rank_body(&scenario, comm, &|_| std::process::exit(17)) {
        println!("OUTCOME {rank} {line}");
    }
}

fn run_processes(scenario: &str, tcp: bool) {
    let timeout = TIMEOUT.as_secs().to_string();
    let mut env = vec![(SCENARIO, scenario), ("FERROCOMM_TIMEOUT", timeout.as_str())];
    if tcp {
        env.push(("FERROCOMM_TRANSPORT", "tcp"));
    }
    let job = start_direct("reliability_rank", WORLD, &env);
    let deadline = Instant::now() + TIMEOUT + Duration::from_secs(20);
    let outs: Vec<String> = job.ranks.into_iter().map(|c| wait_child(c, deadline).1).collect();
    let mode = if tcp { "tcp" } else { "shm" };
    let fault_at = outs
        .iter()
        .flat_map(|o| o.lines())
        .find_map(|l| l.split("FAULT_AT ").nth(1).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("{mode} / {scenario}: no fault time:\n{outs:#?}"));
    let mut times = vec![];
    for (r, out) in outs.iter().enumerate() {
        let lines: Vec<String> = (out.lines())
            .filter_map(|l| l.split(&format!("OUTCOME {r} ")).nth(1).map(str::to_owned))
            .collect();
        if r == VICTIM && lines.is_empty() && !scenario.contains(':') && scenario != "abort" {
            continue; // the rank that left
        }
        times.push(check(mode, scenario, r, &lines, fault_at));
    }
    report(mode, scenario, &times);
}

#[test]
fn every_fault_and_mismatch_as_threads() {
    for s in SCENARIOS {
        run_threads(s, false);
    }
}

#[test]
fn every_fault_and_mismatch_as_threads_over_tcp() {
    for s in SCENARIOS {
        run_threads(s, true);
    }
}

#[test]
fn every_fault_and_mismatch_as_processes_over_shared_memory() {
    for s in SCENARIOS {
        run_processes(s, false);
    }
}

#[test]
fn every_fault_and_mismatch_as_processes_over_tcp() {
    for s in SCENARIOS {
        run_processes(s, true);
    }
}

/// A rank that writes nothing in a collective (a broadcast's root, gather's other ranks) does
/// not wait for the peers' calls, but it takes them in before its links close: a late rank's
/// call must neither reset a closed TCP connection (losing the root's data) nor make the
/// others think the closed rank is lost while its data sits in their streams.
fn closing_right_after_sending(tcp: bool) {
    let opts = if tcp { tcp_options(TIMEOUT) } else { options(TIMEOUT) };
    for (op, n) in [
        ("broadcast", 2usize),
        ("broadcast", 1 << 18),
        ("gather", 2),
        ("gather", 1 << 18),
    ] {
        let name = format!("close-after-{op}-{n}-{tcp}");
        let comms = Comm::new_group("cpu", &[Device::Cpu; 3], &name, opts.clone()).expect("new_group");
        let got: Vec<ferrocomm::Result<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let me = c.rank();
                        if me == 2 {
                            std::thread::sleep(Duration::from_millis(500)); // the late rank
                        }
                        let mine: Vec<f32> = (0..n).map(|i| (me * n + i) as f32).collect();
                        let r = if op == "broadcast" {
                            let mut buf = if me == 0 { mine } else { vec![-1.0; n] };
                            c.broadcast(&mut buf, 0).map(|_| buf)
                        } else {
                            // Rank 1 is the root; ranks 0 and 2 only send.
                            let mut all = vec![-1.0f32; 3 * n];
                            let out = (me == 1).then_some(&mut all[..]);
                            c.gather(out, &mine, 1).map(|_| all)
                        };
                        // The sender leaves at once (drop: links close).
                        drop(c);
                        r
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
        });
        for (r, g) in got.iter().enumerate() {
            let v = g
                .as_ref()
                .unwrap_or_else(|e| panic!("{op} {n} over tcp={tcp}: rank {r}: {e}"));
            if op == "broadcast" {
                assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32), "{op} {n}: rank {r}");
            } else if r == 1 {
                assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32), "{op} {n}: root");
            }
        }
    }
}

#[test]
fn a_sender_that_closes_at_once_still_serves_a_late_rank_over_shared_memory() {
    closing_right_after_sending(false);
}

#[test]
fn a_sender_that_closes_at_once_still_serves_a_late_rank_over_tcp() {
    closing_right_after_sending(true);
}

/// Rank 2 never calls. Rank 0 broadcasts (streamed: it does not wait for the others' calls),
/// then waits for rank 2; rank 1 waits for rank 2, then broadcasts. The timeout must name rank
/// 2, the rank awaited, not the rank whose call to the broadcast has not arrived yet. (A small
/// broadcast on one host is a shared-memory round, whose root waits for every rank: the hint
/// keeps it streamed.)
#[test]
fn a_timeout_names_the_rank_that_was_awaited() {
    let done = std::sync::Barrier::new(3);
    let r = run_group(3, "timeout-names", options(Duration::from_millis(700)), |c| {
        let streamed = c.with_options(OpOptions::new().hint("algorithm", "direct"));
        let r = match c.rank() {
            0 => streamed
                .broadcast(&mut [1.0f32; 4], 0)
                .and_then(|_| c.recv(&mut [0u8; 4], 2)),
            1 => c
                .recv(&mut [0u8; 4], 2)
                .and_then(|_| streamed.broadcast(&mut [0.0f32; 4], 0)),
            _ => Ok(()),
        };
        done.wait();
        r
    });
    for (rank, e) in r.iter().enumerate().take(2) {
        assert!(
            matches!(
                e,
                Err(Error::Timeout {
                    op: "recv",
                    peer: Some(2),
                    ..
                }) | Err(Error::PeerLost {
                    op: "recv",
                    peer: 2,
                    ..
                })
            ),
            "rank {rank}: {e:?}"
        );
    }
}
