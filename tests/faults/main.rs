//! Fault injection (CPU backend, ranks as processes over shared memory and over TCP): a rank
//! SIGKILLed at a random moment of every collective and every window operation; a rank stopped and resumed inside the timeout;
//! the store server going away. Survivors must fail with an error that names the operation and
//! the lost rank within timeout + 1 s, or, for a slow peer, complete with correct data.
//!
//! `FERROCOMM_FAULT_TRIALS` sets the trials per operation (5 by default; 50 for the long mode).

#[path = "../common/mod.rs"]
mod common;

use common::*;
use ferrocomm::Error;
use rustix::process::{kill_process, Pid, Signal};
use std::process::Child;
use std::time::{Duration, Instant};

const MODE: &str = "FERROCOMM_FAULT_MODE";
const TIMEOUT_S: u64 = 5;
const WORLD: usize = 3;
/// Exit codes of a rank: the expected error, another error, no error at all.
const EXPECTED: i32 = 3;
const OTHER: i32 = 4;
const NO_ERROR: i32 = 5;

const COLLECTIVES: [&str; 8] = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "barrier",
];
const WINDOW_OPS: [&str; 4] = ["put_signal", "get", "fetch_add", "signal_wait"];

/// The error names that a loop of `op` may legitimately report.
fn op_names(op: &str) -> &'static [&'static str] {
    match op {
        "send_recv" => &["batch_p2p"],
        "put_signal" => &["put", "signal", "wait_signal"],
        "signal_wait" => &["signal", "wait_signal"],
        "get" => &["get"],
        "fetch_add" => &["fetch_add"],
        "all_reduce" => &["all_reduce"],
        "reduce" => &["reduce"],
        "broadcast" => &["broadcast"],
        "all_gather" => &["all_gather"],
        "reduce_scatter" => &["reduce_scatter"],
        "all_to_all" => &["all_to_all"],
        _ => &["barrier"],
    }
}

/// One iteration of `op` with a size drawn from `r` (identical on every rank).
fn step(c: &Comm, w: Option<&Window>, op: &str, r: &mut StdRng, iter: u64) -> ferrocomm::Result<()> {
    let (n, me) = (c.size(), c.rank());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let count = r.gen_range(1..200_000usize);
    let mut a = vec![1.0f32; count];
    let mut b = vec![0.0f32; count * n];
    match op {
        "all_reduce" => c.all_reduce(&mut a, ReduceOp::Sum),
        "reduce" => c.reduce(&mut a, ReduceOp::Sum, iter as usize % n),
        "broadcast" => c.broadcast(&mut a, iter as usize % n),
        "all_gather" => c.all_gather(&mut b, &a),
        "reduce_scatter" => c.reduce_scatter(&mut a[..count / n], &b[..count / n * n], ReduceOp::Sum),
        "all_to_all" => c.all_to_all(&mut b[..count / n * n], &a[..count / n * n]),
        "send_recv" => c.batch().send(&a, right).recv(&mut b[..count], left).issue(),
        "barrier" => c.barrier(),
        _ => {
            let w = w.expect("window");
            let bytes = (count * 4).min(w.bytes());
            let peer = r.gen_range(0..n);
            match op {
                "put_signal" => {
                    w.put_signal(right, 0, &a[..bytes / 4], 0, SignalOp::Add, 1)?;
                    w.wait_signal(0, SignalSource::Rank(left), Cmp::Ge, iter + 1)
                        .map(|_| ())
                }
                "signal_wait" => {
                    w.signal(right, 1, SignalOp::Add, 1)?;
                    w.wait_signal(1, SignalSource::Rank(left), Cmp::Ge, iter + 1)
                        .map(|_| ())
                }
                "get" => w.get(peer, 0, &mut b[..bytes / 4]),
                _ => w.fetch_add(peer, 0, 1).map(|_| ()),
            }
        }
    }
}

#[test]
#[ignore = "run by the fault tests as their ranks"]
fn fault_rank() {
    let Ok(mode) = std::env::var(MODE) else {
        eprintln!("fault_rank: not started by a fault test, nothing to do");
        return;
    };
    let seed: u64 = std::env::var("FERROCOMM_TEST_SEED").unwrap().parse().unwrap();
    let comm = new_comm("cpu", Device::Cpu, "faults", CommOptions::from_env().unwrap()).unwrap();
    let (kind, op) = mode.split_once(':').unwrap();
    match kind {
        "loop" => {
            let victim: usize = std::env::var("FERROCOMM_TEST_VICTIM").unwrap().parse().unwrap();
            let w = WINDOW_OPS.contains(&op).then(|| comm.new_window(1 << 20).unwrap());
            comm.barrier().unwrap();
            let t0 = Instant::now();
            for iter in 0.. {
                if let Err(e) = step(&comm, w.as_ref(), op, &mut rng(seed, iter), iter) {
                    let ok = matches!(&e, Error::PeerLost { op: o, peer, .. } if op_names(op).contains(o) && *peer == victim);
                    println!("rank {} error: {e}", comm.rank());
                    std::process::exit(if ok { EXPECTED } else { OTHER });
                }
                if iter == 0 {
                    println!("looping");
                }
                if t0.elapsed() > Duration::from_secs(30) {
                    std::process::exit(NO_ERROR);
                }
            }
        }
        "slow-peer" => {
            for iter in 0..400u64 {
                let mut x = vec![comm.rank() as f64 + iter as f64; 50_000];
                comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                let want = 3.0 * iter as f64 + 3.0;
                assert!(x.iter().all(|&v| v == want), "iteration {iter}: {} != {want}", x[0]);
                std::thread::sleep(Duration::from_millis(5));
            }
            println!("child ok");
        }
        "store-gone" => {
            println!("ready");
            // The parent drops the store server after every rank is ready; then anything that
            // needs the store must fail clearly.
            std::thread::sleep(Duration::from_millis(1500));
            match comm.split(&[0, 1, 2], "after-store") {
                Err(Error::Io { context, .. }) if context.contains("store") => std::process::exit(EXPECTED),
                other => {
                    println!("unexpected: {other:?}");
                    std::process::exit(OTHER)
                }
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

fn start(mode: &str, seed: u64, victim: usize) -> DirectJob {
    start_on(mode, seed, victim, "auto")
}

/// `transport`: `auto` (shared memory between these ranks) or `tcp`.
fn start_on(mode: &str, seed: u64, victim: usize, transport: &str) -> DirectJob {
    let (seed, victim, timeout) = (seed.to_string(), victim.to_string(), TIMEOUT_S.to_string());
    let env = [
        (MODE, mode),
        ("FERROCOMM_TEST_SEED", seed.as_str()),
        ("FERROCOMM_TEST_VICTIM", victim.as_str()),
        ("FERROCOMM_TIMEOUT", timeout.as_str()),
        ("FERROCOMM_TRANSPORT", transport),
    ];
    start_direct("fault_rank", WORLD, &env)
}

/// Waits for `c` until `deadline`; returns (exit code, stdout, when it ended).
fn finish(c: Child, deadline: Instant) -> (Option<i32>, String, Instant) {
    let (status, out, ended) = wait_child(c, deadline);
    (status.and_then(|s| s.code()), out, ended)
}

/// Sends `sig` to our child `pid` (already gone: nothing to do).
fn signal(pid: u32, sig: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        let _ = kill_process(pid, sig);
    }
}

fn trials() -> u64 {
    std::env::var("FERROCOMM_FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

/// Kills a random rank at a random moment of `op`; returns the longest kill-to-error time.
fn kill_during(op: &str, trial: u64, seed: u64, transport: &str) -> Duration {
    let mut r = rng(seed, 1_000_000 + trial);
    let victim = r.gen_range(0..WORLD);
    let mut job = start_on(&format!("loop:{op}"), seed ^ trial, victim, transport);
    // Let the ranks enter the loop, then strike at a random moment.
    std::thread::sleep(Duration::from_millis(r.gen_range(300..900)));
    let v = job.ranks.remove(victim);
    signal(v.id(), Signal::KILL);
    let killed = Instant::now();
    let limit = killed + Duration::from_secs(TIMEOUT_S + 1);
    let mut worst = Duration::ZERO;
    for c in job.ranks.drain(..) {
        let (code, out, ended) = finish(c, limit + Duration::from_secs(5));
        assert!(
            out.contains("looping"),
            "{op} trial {trial}: a rank never reached the loop:\n{out}"
        );
        assert_eq!(
            code,
            Some(EXPECTED),
            "{op} trial {trial} (victim {victim}): wanted PeerLost naming {op} and rank {victim}:\n{out}"
        );
        assert!(
            ended <= limit,
            "{op} trial {trial}: error came {:?} after the kill",
            ended - killed
        );
        worst = worst.max(ended - killed);
    }
    let _ = finish(v, Instant::now() + Duration::from_secs(5));
    worst
}

fn kill_each(ops: &[&str], transport: &str) {
    let seed = fresh_seed();
    for op in ops {
        let mut worst = Duration::ZERO;
        for t in 0..trials() {
            worst = worst.max(kill_during(op, t, seed, transport));
        }
        println!(
            "FAULTS {op} ({transport}): {} trials, every survivor named the lost rank; longest kill-to-error {worst:?}",
            trials()
        );
    }
}

#[test]
fn sigkill_at_random_points_of_every_collective() {
    kill_each(&COLLECTIVES, "auto");
}

#[test]
fn sigkill_at_random_points_of_every_window_op() {
    kill_each(&WINDOW_OPS, "auto");
}

/// Over TCP a survivor often sees only a neighbour shut its links; the fault record must still
/// make it name the killed rank.
#[test]
fn sigkill_at_random_points_of_every_collective_over_tcp() {
    kill_each(&COLLECTIVES, "tcp");
}

#[test]
fn sigkill_at_random_points_of_every_window_op_over_tcp() {
    kill_each(&WINDOW_OPS, "tcp");
}

#[test]
fn a_peer_stopped_and_resumed_inside_the_timeout_does_not_fail_anyone() {
    let mut job = start("slow-peer:all_reduce", fresh_seed(), 0);
    std::thread::sleep(Duration::from_millis(500));
    let id = job.ranks[1].id();
    signal(id, Signal::STOP);
    std::thread::sleep(Duration::from_millis(1500));
    signal(id, Signal::CONT);
    for (r, c) in job.ranks.drain(..).enumerate() {
        let (code, out, _) = finish(c, Instant::now() + Duration::from_secs(60));
        assert!(code == Some(0) && out.contains("child ok"), "rank {r}:\n{out}");
    }
}

#[test]
fn a_store_server_that_goes_away_is_a_clear_error_on_every_rank() {
    let mut job = start("store-gone:split", fresh_seed(), 0);
    std::thread::sleep(Duration::from_millis(700));
    drop(job.server);
    for (r, c) in job.ranks.drain(..).enumerate() {
        let (code, out, _) = finish(c, Instant::now() + Duration::from_secs(30));
        assert_eq!(code, Some(EXPECTED), "rank {r}:\n{out}");
    }
}
