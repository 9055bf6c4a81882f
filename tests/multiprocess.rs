//! Ranks as separate processes: the whole suite over shared memory (2 and 4 processes) and over
//! TCP (3 processes), two hosts as network namespaces, a rank killed with SIGKILL in the middle
//! of a collective, and the launcher's teardown when a rank fails.
//!
//! The parent tests re-run this test binary as the ranks (`child_entry`, ignored by default).

mod common;
use common::*;
use ferrocomm::{Cmp, Error, SignalSource};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODE: &str = "FERROCOMM_TEST_MODE";

/// The rank side. Does nothing unless started by a parent test below.
#[test]
#[ignore = "run by the multi-process tests as their ranks"]
fn child_entry() {
    let Ok(mode) = std::env::var(MODE) else {
        eprintln!("child_entry: not started by a multi-process test, nothing to do");
        return;
    };
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    match mode.as_str() {
        "suite" => {
            let seed = std::env::var("FERROCOMM_TEST_SEED").unwrap().parse().unwrap();
            let comm = new_comm("cpu", Device::Cpu, "mp-suite", CommOptions::from_env().unwrap()).unwrap();
            let n = common::suite::run_all(&comm, seed);
            comm.finalize().unwrap();
            println!("child ok: {n} checked calls");
        }
        "killed-mid-collective" => {
            let comm = new_comm("cpu", Device::Cpu, "mp-kill", CommOptions::from_env().unwrap()).unwrap();
            let mut x = vec![1.0f32; 1 << 20];
            loop {
                match comm.all_reduce(&mut x, ReduceOp::Sum) {
                    Ok(()) => println!("waiting"),
                    Err(e) => {
                        println!("rank {rank} error: {e}");
                        let code = if matches!(e, Error::PeerLost { op: "all_reduce", .. }) {
                            3
                        } else {
                            4
                        };
                        std::process::exit(code);
                    }
                }
            }
        }
        "windows" => {
            let seed = std::env::var("FERROCOMM_TEST_SEED").unwrap().parse().unwrap();
            let comm = new_comm("cpu", Device::Cpu, "mp-win", CommOptions::from_env().unwrap()).unwrap();
            let mapped = common::window_suite::run_all(&comm, seed);
            println!("child ok: windows (mapped directly: {mapped})");
        }
        "shrink-after-sigkill" => {
            let comm = new_comm("cpu", Device::Cpu, "mp-shrink", CommOptions::from_env().unwrap()).unwrap();
            let mut x = vec![1.0f32; 1 << 16];
            let mut said = false;
            let lost = loop {
                match comm.all_reduce(&mut x, ReduceOp::Sum) {
                    // Once: the parent reads stdout only at the end.
                    Ok(()) if !said => {
                        said = {
                            println!("waiting");
                            true
                        }
                    }
                    Ok(()) => {}
                    Err(Error::PeerLost { peer, .. }) => break peer,
                    Err(e) => panic!("rank {rank}: {e}"),
                }
                x.fill(1.0);
            };
            let (small, members) = comm.shrink(&[lost]).unwrap();
            assert_eq!(members, [0, 1]);
            assert!(matches!(comm.barrier(), Err(Error::Closed { .. })));
            for step in 0..20u64 {
                let mut y = vec![rank as u64 * 100 + step; 1000];
                small.all_reduce(&mut y, ReduceOp::Sum).unwrap();
                assert!(y.iter().all(|&v| v == 100 + 2 * step), "step {step}");
            }
            println!("child ok: rank {lost} lost, shrunk to {} ranks", small.size());
        }
        "shrink-healthy" => {
            let comm = new_comm(
                "cpu",
                Device::Cpu,
                "mp-shrink-healthy",
                CommOptions::from_env().unwrap(),
            )
            .unwrap();
            let n = comm.size();
            let mut x = vec![rank as u64 + 1; 1000];
            comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(x.iter().all(|&v| v as usize == n * (n + 1) / 2));
            if rank == 1 {
                // Leaves without a failure; the others take their links between them over.
                comm.finalize().unwrap();
                println!("child ok: left");
                return;
            }
            let before = (shm_mappings(), sockets());
            let (small, members) = comm.shrink(&[1]).unwrap();
            assert_eq!(members, (0..n).filter(|&r| r != 1).collect::<Vec<_>>());
            let (r, k) = (small.rank(), small.size());
            for step in 0..5u64 {
                let mut y = vec![r as u64 * 100 + step; 50_000];
                small.all_reduce(&mut y, ReduceOp::Sum).unwrap();
                let want = (0..k as u64).map(|q| q * 100 + step).sum::<u64>();
                assert!(y.iter().all(|&v| v == want), "step {step}");
            }
            let (to, from) = ((r + 1) % k, (r + k - 1) % k);
            let mut got = vec![0u32; 30_000];
            small
                .batch()
                .recv(&mut got[..], from)
                .send(&vec![members[r] as u32; 30_000][..], to)
                .issue()
                .unwrap();
            assert!(got.iter().all(|&v| v as usize == members[from]));
            let after = (shm_mappings(), sockets());
            // A communicator built anew would have mapped new segments (shared memory) or
            // opened a listener and new connections (TCP), with the old one still held.
            assert!(
                after.0 <= before.0 && after.1 <= before.1,
                "shared-memory mappings and sockets went from {before:?} to {after:?}"
            );
            println!("child ok: shrunk to {k} ranks over the old links ({before:?} -> {after:?})");
        }
        "window-waiter-loses-peer" => {
            let comm = new_comm("cpu", Device::Cpu, "mp-winkill", CommOptions::from_env().unwrap()).unwrap();
            let w = comm.new_window(64).unwrap();
            w.barrier().unwrap();
            println!("waiting");
            // Rank 2 never signals: it is killed while everyone waits.
            match w.wait_signal(0, SignalSource::Rank(2), Cmp::Ge, 1) {
                Err(Error::PeerLost {
                    op: "wait_signal",
                    peer: 2,
                    ..
                }) => std::process::exit(3),
                other => {
                    println!("rank {rank}: {other:?}");
                    std::process::exit(4)
                }
            }
        }
        "two-hosts" => {
            let seed = std::env::var("FERROCOMM_TEST_SEED").unwrap().parse().unwrap();
            let comm = new_comm("cpu", Device::Cpu, "mp-hosts", CommOptions::from_env().unwrap()).unwrap();
            let mut x = vec![rank as f64 + 1.0; 100_000];
            comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert!(x.iter().all(|&v| v == 3.0));
            let mapped = common::window_suite::run_all(&comm, seed);
            proxy_queue_to_the_other_host(&comm, seed);
            println!("child ok: two hosts (mapped directly: {mapped})");
        }
        "large-rings" => {
            // Ring blocks of 1 MiB and more, which go by reference where the kernel lets a
            // rank read its peer (net/links/pull.rs): exact sums of small integers, so every
            // element is checked exactly.
            let comm = new_comm("cpu", Device::Cpu, "mp-rings", CommOptions::from_env().unwrap()).unwrap();
            let n = comm.size();
            let count = (5 << 20) / 4 + 3;
            let value = |r: usize, i: usize| ((r + 1) * (i % 1000)) as f32;
            let summed = |i: usize| ((n * (n + 1) / 2) * (i % 1000)) as f32;
            for round in 0..3 {
                let mut x: Vec<f32> = (0..count).map(|i| value(rank, i + round)).collect();
                comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                let bad = (0..count).find(|&i| x[i] != summed(i + round));
                assert!(bad.is_none(), "all_reduce round {round}: element {bad:?} wrong");
                let mut m: Vec<f32> = (0..count).map(|i| value(rank, i + round)).collect();
                comm.all_reduce(&mut m, ReduceOp::Max).unwrap();
                assert!((0..count).all(|i| m[i] == value(n - 1, i + round)), "max round {round}");
                let input: Vec<f32> = (0..count * n).map(|i| value(rank, i + round)).collect();
                let mut out = vec![f32::NAN; count];
                comm.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
                let bad = (0..count).find(|&i| out[i] != summed(rank * count + i + round));
                assert!(bad.is_none(), "reduce_scatter round {round}: element {bad:?} wrong");
            }
            comm.finalize().unwrap();
            println!("child ok: large rings");
        }
        "smoke" => {
            let comm = new_comm("cpu", Device::Cpu, "mp-smoke", CommOptions::from_env().unwrap()).unwrap();
            let mut x = [rank as i64 + 1];
            comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            let n = comm.size() as i64;
            assert_eq!(x[0], n * (n + 1) / 2);
            println!("child ok: sum {}", x[0]);
        }
        "expect-config-error" => match new_comm("cpu", Device::Cpu, "mp-cfg", CommOptions::from_env().unwrap()) {
            Err(Error::Config(msg)) => println!("child ok: {msg}"),
            other => panic!("expected a configuration error, got {other:?}"),
        },
        "one-rank-fails" => {
            if rank == 1 {
                println!("rank 1 fails now");
                std::process::exit(7);
            }
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown mode {other}"),
    }
}

/// The kernels' path to another host, driven from the host: a put + signal of random bytes
/// (several descriptors) through the window's proxy queue to the other rank, checked there.
fn proxy_queue_to_the_other_host(comm: &Comm, seed: u64) {
    let (me, peer) = (comm.rank(), 1 - comm.rank());
    let half = 20 << 20; // 20 MiB: three descriptors
    let w = comm.new_window(2 * half).unwrap();
    let words = |r: usize| -> Vec<u64> {
        let mut g = rng(seed, 77 + r as u64);
        (0..half / 8).map(|_| g.gen()).collect()
    };
    w.write_local(0, &words(me)).unwrap();
    let q = w.proxy_queue().unwrap();
    q.put_signal(peer, half, 0, half, 0, SignalOp::Add, 1).unwrap();
    q.flush().unwrap();
    w.wait_signal(0, SignalSource::Rank(peer), Cmp::Ge, 1).unwrap();
    let mut got = vec![0u64; half / 8];
    w.read_local(half, &mut got).unwrap();
    assert!(got == words(peer), "rank {me}: bytes queued by rank {peer} differ");
    w.barrier().unwrap();
}

#[test]
fn children_keep_where_the_libraries_are_but_not_the_job() {
    let names = [
        "RANK",
        "FERROCOMM_TIMEOUT",
        "FERROCOMM_NVRTC_PATH",
        "FERROCOMM_NCCL_PATH",
        "PATH",
        "SLURM_PROCID",
    ];
    let removed = job_variables(names.iter().map(|s| s.to_string()));
    assert_eq!(removed, ["RANK", "FERROCOMM_TIMEOUT", "SLURM_PROCID"]);
}

fn child_command(mode: &str) -> Command {
    let mut c = test_entry_command("child_entry");
    c.env(MODE, mode);
    c
}

/// Waits for `c` at most `limit`, killing it if it runs longer; returns (status, stdout).
fn wait_bounded(c: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let (status, out, _) = wait_child(c, Instant::now() + limit);
    (
        status.unwrap_or_else(|| panic!("child did not finish within {limit:?}:\n{out}")),
        out,
    )
}

fn launch(n: usize, mode: &str, envs: &[(&str, &str)]) -> (std::process::ExitStatus, String, Duration) {
    let child = child_command(mode);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrocomm-run"));
    cmd.arg("-n")
        .arg(n.to_string())
        .arg("--")
        .arg(child.get_program())
        .args(child.get_args())
        .env(MODE, mode);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    let c = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let (s, out) = wait_bounded(c, Duration::from_secs(300));
    (s, out, t0.elapsed())
}

fn suite_across_processes(n: usize, envs: &[(&str, &str)]) {
    let seed = fresh_seed().to_string();
    let mut all = envs.to_vec();
    all.push(("FERROCOMM_TEST_SEED", &seed));
    all.push(("FERROCOMM_TIMEOUT", "60"));
    let (status, out, _) = launch(n, "suite", &all);
    assert!(status.success(), "ranks failed:\n{out}");
    for r in 0..n {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("[{r}]: ")) && l.contains("child ok")),
            "rank {r} did not finish:\n{out}"
        );
    }
}

#[test]
fn every_collective_two_processes_shared_memory() {
    suite_across_processes(2, &[]);
}

#[test]
fn every_collective_four_processes_shared_memory() {
    suite_across_processes(4, &[]);
}

/// Ring steps of large all_reduce and reduce_scatter, by reference where the kernel allows it
/// (`FERROCOMM_SHM_PULL_BYTES` set, so whatever this host's copy out of another process
/// measures), at 2 and 4 processes. Where the kernel refuses (ptrace policy, seccomp), the
/// same steps go through the rings and this checks those.
#[test]
fn large_ring_steps_by_reference_across_processes() {
    for n in [2, 4] {
        let (status, out, _) = launch(
            n,
            "large-rings",
            &[("FERROCOMM_SHM_PULL_BYTES", "16384"), ("FERROCOMM_TIMEOUT", "60")],
        );
        assert!(status.success(), "{n} ranks failed:\n{out}");
        assert_eq!(out.matches("child ok: large rings").count(), n, "{out}");
    }
}

#[test]
fn every_collective_three_processes_over_tcp() {
    suite_across_processes(3, &[("FERROCOMM_TRANSPORT", "tcp")]);
}

#[test]
fn every_collective_three_processes_over_sealed_tcp() {
    suite_across_processes(3, &[("FERROCOMM_TRANSPORT", "tcp"), ("FERROCOMM_ENCRYPT", "on")]);
}

/// Starts `n` ranks directly (no launcher) with the given environment; all must succeed.
fn spawn_ranks(n: usize, mode: &str, envs: &[(&str, String)]) {
    let children: Vec<Child> = (0..n)
        .map(|r| {
            child_command(mode)
                .envs([
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", n.to_string()),
                    ("LOCAL_RANK", r.to_string()),
                ])
                .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let (status, out) = wait_bounded(c, Duration::from_secs(60));
        assert!(status.success() && out.contains("child ok"), "rank {r}:\n{out}");
    }
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

#[test]
fn rank_zero_hosts_the_store_when_no_launcher_does() {
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", free_port()),
        ("FERROCOMM_TOKEN", ferrocomm::random_token().unwrap()),
    ];
    spawn_ranks(3, "smoke", &env);
}

#[test]
fn ranks_can_rendezvous_through_a_file_store() {
    let dir = std::env::temp_dir().join(format!("ferrocomm-mp-{}", ferrocomm::random_token().unwrap()));
    spawn_ranks(3, "smoke", &[("FERROCOMM_STORE", format!("file://{}", dir.display()))]);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_tcp_store_without_a_job_token_is_a_configuration_error() {
    let env = [("MASTER_ADDR", "127.0.0.1".to_string()), ("MASTER_PORT", free_port())];
    spawn_ranks(1, "expect-config-error", &env);
}

/// Starts 3 ranks in `mode` (timeout 60 s), SIGKILLs rank 2 once they are under way, and
/// requires both survivors to exit with the code for the expected error within seconds, not
/// after the timeout. Over shared memory and over TCP.
fn survivors_report_a_sigkilled_rank(mode: &str, expected: &str) {
    for transport in ["auto", "tcp"] {
        let env = [
            (MODE, mode),
            ("FERROCOMM_TIMEOUT", "60"),
            ("FERROCOMM_TRANSPORT", transport),
        ];
        let DirectJob {
            server: _server,
            ranks: mut children,
        } = start_direct("child_entry", 3, &env);
        std::thread::sleep(Duration::from_millis(1500));
        let mut victim = children.pop().unwrap();
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&victim), rustix::process::Signal::KILL);
        let killed_at = Instant::now();
        for (r, c) in children.into_iter().enumerate() {
            let (status, out) = wait_bounded(c, Duration::from_secs(30));
            assert_eq!(
                status.code(),
                Some(3),
                "{transport}: rank {r} should report {expected}:\n{out}"
            );
            assert!(
                out.contains("waiting"),
                "{transport}: rank {r} was not under way yet:\n{out}"
            );
        }
        let took = killed_at.elapsed();
        let _ = victim.wait();
        eprintln!("{transport}: survivors reported the loss {took:?} after SIGKILL");
        assert!(took < Duration::from_secs(10), "{transport}: took {took:?}");
    }
}

/// Rank 2 is SIGKILLed while all ranks loop over large all_reduces.
#[test]
fn sigkill_in_a_collective_gives_every_other_rank_an_error() {
    survivors_report_a_sigkilled_rank("killed-mid-collective", "PeerLost in all_reduce");
}

/// Rank 2 is SIGKILLed while all ranks loop over all_reduces; the survivors shrink to two
/// ranks and go on (over shared memory and over TCP), with the launcher-less store of the test.
#[test]
fn survivors_of_a_sigkill_shrink_and_go_on() {
    for transport in ["auto", "tcp"] {
        let env = [
            (MODE, "shrink-after-sigkill"),
            ("FERROCOMM_TIMEOUT", "30"),
            ("FERROCOMM_TRANSPORT", transport),
        ];
        let DirectJob {
            server: _server,
            ranks: mut children,
        } = start_direct("child_entry", 3, &env);
        std::thread::sleep(Duration::from_millis(1500));
        let mut victim = children.pop().unwrap();
        let _ = rustix::process::kill_process(rustix::process::Pid::from_child(&victim), rustix::process::Signal::KILL);
        for (r, c) in children.into_iter().enumerate() {
            let (status, out) = wait_bounded(c, Duration::from_secs(60));
            assert!(status.success(), "{transport}: rank {r}:\n{out}");
            assert!(
                out.contains("child ok: rank 2 lost, shrunk to 2 ranks"),
                "{transport}: rank {r}:\n{out}"
            );
        }
        let _ = victim.wait();
    }
}

/// Shared-memory mappings of this process (segments of communicators and windows).
fn shm_mappings() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().filter(|l| l.contains("/dev/shm/")).count()
}

/// Open sockets of this process.
fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.to_string_lossy().starts_with("socket:"))
        .count()
}

/// Rank 1 leaves without a failure; the survivors shrink over the links they had (no new
/// segment mapped, no new connection), over shared memory (4 processes) and TCP (3).
#[test]
fn a_healthy_shrink_of_processes_takes_over_their_links() {
    for (n, transport) in [(4, "auto"), (3, "tcp")] {
        let env = [("FERROCOMM_TIMEOUT", "30"), ("FERROCOMM_TRANSPORT", transport)];
        let (status, out, _) = launch(n, "shrink-healthy", &env);
        assert!(status.success(), "{transport}: ranks failed:\n{out}");
        let want = format!("child ok: shrunk to {} ranks over the old links", n - 1);
        assert_eq!(
            out.lines().filter(|l| l.contains(&want)).count(),
            n - 1,
            "{transport}:\n{out}"
        );
    }
}

#[test]
fn window_contract_across_processes_over_shared_memory_and_tcp() {
    for (n, transport, mapped) in [(3, "auto", true), (2, "tcp", false)] {
        let seed = fresh_seed().to_string();
        let env = [
            ("FERROCOMM_TEST_SEED", seed.as_str()),
            ("FERROCOMM_TIMEOUT", "60"),
            ("FERROCOMM_TRANSPORT", transport),
        ];
        let (status, out, _) = launch(n, "windows", &env);
        assert!(status.success(), "{transport}: ranks failed:\n{out}");
        let want = format!("child ok: windows (mapped directly: {mapped})");
        assert_eq!(
            out.lines().filter(|l| l.contains(&want)).count(),
            n,
            "{transport}:\n{out}"
        );
    }
}

/// Rank 2 is SIGKILLed while the others wait for its signal.
#[test]
fn sigkill_gives_window_waiters_peer_lost() {
    survivors_report_a_sigkilled_rank("window-waiter-loses-peer", "PeerLost from wait_signal");
}

/// Two network namespaces joined by a veth pair stand in for two hosts: each rank runs in its
/// own, rank 0 hosts the store on its veth address, and collectives and windows must work over
/// TCP links, and the proxy queue (the kernels' path) must carry puts and signals to the other
/// host. Needs root (`ip netns`); says so and skips otherwise.
#[test]
fn ranks_on_two_hosts_between_network_namespaces() {
    let tag = &ferrocomm::random_token().unwrap()[..6];
    let (a, b) = (format!("fc-a-{tag}"), format!("fc-b-{tag}"));
    let ip = |args: &str| {
        Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !rustix::process::geteuid().is_root() || !ip(&format!("netns add {a}")) {
        println!("SKIPPED ranks_on_two_hosts_between_network_namespaces: needs root and `ip netns`");
        return;
    }
    struct Cleanup(Vec<String>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for ns in &self.0 {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
        }
    }
    let _cleanup = Cleanup(vec![a.clone(), b.clone()]);
    let (va, vb) = (format!("va{tag}"), format!("vb{tag}"));
    for cmd in [
        format!("netns add {b}"),
        format!("link add {va} type veth peer name {vb}"),
        format!("link set {va} netns {a}"),
        format!("link set {vb} netns {b}"),
        format!("-n {a} addr add 10.77.0.1/24 dev {va}"),
        format!("-n {b} addr add 10.77.0.2/24 dev {vb}"),
        format!("-n {a} link set {va} up"),
        format!("-n {b} link set {vb} up"),
        format!("-n {a} link set lo up"),
        format!("-n {b} link set lo up"),
    ] {
        assert!(ip(&cmd), "ip {cmd} failed");
    }
    let seed = fresh_seed().to_string();
    let token = ferrocomm::random_token().unwrap();
    let child = child_command("two-hosts");
    let children: Vec<Child> = [&a, &b]
        .iter()
        .enumerate()
        .map(|(r, ns)| {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns.as_str()])
                .arg(child.get_program())
                .args(child.get_args());
            for (k, v) in child.get_envs() {
                match v {
                    Some(v) => c.env(k, v),
                    None => c.env_remove(k),
                };
            }
            c.envs([
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("LOCAL_RANK", "0".into()),
            ])
            .envs([
                ("MASTER_ADDR", "10.77.0.1"),
                ("MASTER_PORT", "29517"),
                ("FERROCOMM_TOKEN", &token),
            ])
            .envs([("FERROCOMM_TEST_SEED", seed.as_str()), ("FERROCOMM_TIMEOUT", "60")])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let (status, out) = wait_bounded(c, Duration::from_secs(120));
        assert!(
            status.success() && out.contains("child ok: two hosts (mapped directly: false)"),
            "rank {r}:\n{out}"
        );
    }
}

#[test]
fn launcher_stops_every_rank_when_one_fails() {
    let (status, out, took) = launch(3, "one-rank-fails", &[]);
    assert_eq!(
        status.code(),
        Some(7),
        "launcher should exit with the failed rank's code:\n{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("[1]: ") && l.contains("rank 1 fails now")),
        "rank output is prefixed:\n{out}"
    );
    assert!(
        took < Duration::from_secs(20),
        "the sleeping ranks were not torn down ({took:?})"
    );
}
