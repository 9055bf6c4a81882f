//! The device backend on the host device (`Device::Host`): ferrocomm's kernels on CPU threads,
//! driven by the backend's own host code, checked against the same contracts as the CPU
//! backend. Needs the `host-kernels` feature; without it, `Device::Host` is `Unavailable`,
//! which the last test checks.

mod common;
use common::*;
#[cfg(feature = "host-kernels")]
use ferrocomm::{bf16, f16, Error, F8E4M3, F8E5M2};

fn opts() -> CommOptions {
    options(Duration::from_secs(30))
}

#[cfg(feature = "host-kernels")]
mod with_kernels {
    use super::*;

    #[test]
    fn window_contract_on_the_host_device() {
        let seed = fresh_seed();
        for n in [1, 2, 3, 4, 8] {
            let mapped = run_group_on_device("device", Device::Host(0), n, &format!("hd-win{n}"), opts(), |c| {
                common::window_suite::run_all(c, seed)
            });
            assert!(
                mapped.iter().all(|&m| m),
                "ranks of one process map each other's segments"
            );
        }
    }

    /// Ranks in three processes: each maps the others' segments (descriptors passed over a
    /// Unix socket), and the window contract and the collectives hold as in one process.
    #[test]
    fn window_contract_and_collectives_across_processes() {
        let seed = fresh_seed().to_string();
        let n = 3;
        let job = start_direct(
            "with_kernels::host_device_process_rank",
            n,
            &[("HD_TEST_SEED", seed.as_str())],
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(240);
        for (r, child) in job.ranks.into_iter().enumerate() {
            let (status, out, _) = wait_child(child, deadline);
            assert!(status.is_some_and(|s| s.success()), "rank {r} failed: {out}");
            assert!(out.contains(&format!("rank {r} ok")), "rank {r}: {out}");
        }
    }

    /// Entry of window_contract_and_collectives_across_processes.
    #[test]
    #[ignore]
    fn host_device_process_rank() {
        let c = new_comm("device", Device::Host(0), "hd-procs", opts()).unwrap();
        let seed: u64 = std::env::var("HD_TEST_SEED").unwrap().parse().unwrap();
        let mapped = common::window_suite::run_all(&c, seed);
        assert!(mapped, "ranks of one host map each other's segments across processes");
        // Users' kernels on segments mapped from other processes.
        for (scope, threads) in [("thread", 1), ("warp", 32), ("block", 64)] {
            ring(&c, scope, threads, 1024, 20, seed);
        }
        common::suite::run_all(&c, seed);
        println!("rank {} ok", c.rank());
    }

    /// `f(comm)` on `world` host-device ranks as threads.
    fn on_ranks<R: Send>(world: usize, name: &str, f: impl Fn(&Comm) -> R + Sync) -> Vec<R> {
        run_group_on_device("device", Device::Host(0), world, name, opts(), f)
    }

    /// Owned works on the device backend (kept, moved, polled, dropped, every owned call).
    #[test]
    fn owned_work_on_the_host_device() {
        let seed = fresh_seed();
        for world in [1, 2, 3] {
            let checks = on_ranks(world, &format!("hd-owned{world}"), |c| {
                common::owned_suite::on_comm(c, seed)
            });
            assert!(checks.iter().all(|&k| k == checks[0] && k > 0), "{checks:?}");
        }
    }

    /// The all_reduce sweep of tests/gpu_collectives.rs: sizes from one element to past the
    /// window's 1 MiB region (chunked launches), every op, one- and two-shot; every rank's
    /// result bitwise equal, equal between the algorithms, and within the reference's bound.
    fn sweep<T: TestElem>(world: usize, seed: u64, sizes: &[usize]) {
        const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg];
        let input = |k: usize, r: usize, n: usize, op: ReduceOp| -> Vec<T> {
            random_vec(&mut rng(seed ^ (k as u64) << 4, r as u64), n, Some(op))
        };
        let results = on_ranks(world, &format!("hd-sweep-{world}-{:?}", T::DTYPE), |c| {
            let mut out = Vec::new();
            for (k, &n) in sizes.iter().enumerate() {
                for op in OPS {
                    for algo in ["oneshot", "twoshot"] {
                        let mut buf = input(k, c.rank(), n, op);
                        c.with_options(OpOptions::new().hint("algorithm", algo))
                            .all_reduce(&mut buf, op)
                            .unwrap();
                        out.push(buf);
                    }
                }
            }
            out
        });
        let mut i = 0;
        for (k, &n) in sizes.iter().enumerate() {
            for op in OPS {
                for algo in ["oneshot", "twoshot"] {
                    for r in 1..world {
                        assert!(
                            results[r][i] == results[0][i],
                            "{algo} n={n} {op}: rank {r} differs from rank 0"
                        );
                    }
                    if algo == "twoshot" {
                        assert!(
                            results[0][i] == results[0][i - 1],
                            "n={n} {op}: two-shot bits differ from one-shot"
                        );
                    }
                    let inputs: Vec<Vec<T>> = (0..world).map(|r| input(k, r, n, op)).collect();
                    for e in 0..n {
                        let vals: Vec<T> = inputs.iter().map(|v| v[e]).collect();
                        if let Err(why) = T::check_reduced(&vals, op, results[0][i][e]) {
                            panic!("world {world} {:?} {algo} n={n} {op} element {e}: {why}", T::DTYPE);
                        }
                    }
                    i += 1;
                }
            }
        }
    }

    #[test]
    fn one_and_two_shot_all_reduce_match_the_reference_and_each_other() {
        let seed = fresh_seed();
        for world in [2, 3, 8] {
            sweep::<f32>(world, seed, &[1, 7, 8, 1000, 4099, 65_539]);
        }
        sweep::<f16>(4, seed, &[1, 33, 4099]);
        sweep::<bf16>(3, seed, &[5, 1000, 70_001]);
        // 1.2 MiB of f32: past the window's region, so several launches per call.
        sweep::<f32>(2, seed, &[300_001]);
    }

    /// The 16-bit integers' kernels (NCCL has no type for them): sums wrap, averages divide the
    /// wrapped sum, min and max exact, as the CPU engine computes them, bit for bit.
    #[test]
    fn sixteen_bit_integer_all_reduce_kernels_match_the_cpu_engine() {
        let seed = fresh_seed();
        sweep::<i16>(3, seed, &[1, 7, 8, 1000, 4099]);
        sweep::<u16>(8, seed, &[5, 33, 700]);
        sweep::<i16>(2, seed, &[600_001]);
    }

    /// all_gather, all_to_all, reduce_scatter and reduce_scatter_list through the kernels.
    #[test]
    fn gather_scatter_and_all_to_all_match_the_reference() {
        let seed = fresh_seed();
        for world in [2, 3, 4] {
            on_ranks(world, &format!("hd-ags-{world}"), |c| {
                let me = c.rank();
                let input = |k: u64, r: usize, len: usize, op: Option<ReduceOp>| -> Vec<f32> {
                    random_vec(&mut rng(seed ^ k << 8, r as u64), len, op)
                };
                for n in [1usize, 13, 4096, 20_001] {
                    let k = n as u64;
                    let mut out = vec![f32::poison(); n * world];
                    c.all_gather(&mut out, &input(k, me, n, None)).unwrap();
                    let want: Vec<f32> = (0..world).flat_map(|r| input(k, r, n, None)).collect();
                    assert!(out == want, "rank {me}: all_gather of {n} differs");

                    let mut out = vec![f32::poison(); n * world];
                    c.all_to_all(&mut out, &input(k + 1, me, n * world, None)).unwrap();
                    let want: Vec<f32> = (0..world)
                        .flat_map(|r| input(k + 1, r, n * world, None)[me * n..(me + 1) * n].to_vec())
                        .collect();
                    assert!(out == want, "rank {me}: all_to_all of {n} per peer differs");

                    for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg] {
                        let mut out = vec![f32::poison(); n];
                        c.reduce_scatter(&mut out, &input(k + 2, me, n * world, Some(op)), op)
                            .unwrap();
                        let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(k + 2, r, n * world, Some(op))).collect();
                        for e in 0..n {
                            let vals: Vec<f32> = inputs.iter().map(|v| v[me * n + e]).collect();
                            if let Err(why) = f32::check_reduced(&vals, op, out[e]) {
                                panic!("rank {me} reduce_scatter n={n} {op} element {e}: {why}");
                            }
                        }
                    }
                    // Blocks in separate allocations: the kernel takes one pointer per block.
                    let all = input(k + 3, me, n * world, Some(ReduceOp::Sum));
                    let blocks: Vec<&[f32]> = all.chunks(n).collect();
                    let mut out = vec![f32::poison(); n];
                    c.reduce_scatter_list(&mut out, blocks, ReduceOp::Sum).unwrap();
                    let inputs: Vec<Vec<f32>> = (0..world)
                        .map(|r| input(k + 3, r, n * world, Some(ReduceOp::Sum)))
                        .collect();
                    for e in 0..n {
                        let vals: Vec<f32> = inputs.iter().map(|v| v[me * n + e]).collect();
                        if let Err(why) = f32::check_reduced(&vals, ReduceOp::Sum, out[e]) {
                            panic!("rank {me} reduce_scatter_list n={n} element {e}: {why}");
                        }
                    }
                }
            });
        }
    }

    /// all_to_all_v with empty, small, medium and slot-spanning parts between every pair.
    #[test]
    fn all_to_all_v_with_any_sizes_matches_the_reference() {
        let seed = fresh_seed();
        for world in [2, 3, 8] {
            let counts = random_all_to_all_counts(seed, world, 4, 40_000..120_000);
            let input = |k: usize, p: usize| -> Vec<f32> {
                random_vec(
                    &mut rng(seed ^ (k as u64) << 12, p as u64),
                    counts[k][p].iter().sum(),
                    None,
                )
            };
            on_ranks(world, &format!("hd-a2av-{world}"), |c| {
                let me = c.rank();
                for (k, round) in counts.iter().enumerate() {
                    let send = &round[me];
                    let recv: Vec<usize> = (0..world).map(|p| round[p][me]).collect();
                    let mut out = vec![f32::poison(); recv.iter().sum::<usize>()];
                    c.all_to_all_v(&mut out, &input(k, me), &recv, send).unwrap();
                    let mut at = 0;
                    for p in 0..world {
                        let from: usize = round[p][..me].iter().sum();
                        let want = &input(k, p)[from..from + recv[p]];
                        assert!(
                            out[at..at + recv[p]] == *want,
                            "world {world} round {k}: rank {me}'s part from rank {p} differs"
                        );
                        at += recv[p];
                    }
                }
            });
        }
    }

    /// The all_to_all_v of `mismatched_all_to_all_v_counts` on host buffers.
    fn mismatched_all_to_all_v(c: &Comm) -> ferrocomm::Result<()> {
        let (send, recv) = mismatched_all_to_all_v_counts(c.rank());
        let input = vec![1f32; send.iter().sum()];
        let mut out = vec![0f32; recv.iter().sum()];
        c.all_to_all_v(&mut out, &input, &recv, &send)
    }

    /// Parts that do not pair up: the receiving kernel records the mismatch instead of
    /// copying, and its rank gets `Error::Mismatch` naming the sender and both sizes.
    #[test]
    fn a_mismatched_all_to_all_v_is_reported_by_the_receiver() {
        let errors = on_ranks(2, "hd-a2av-mismatch", |c| mismatched_all_to_all_v(c).err());
        match &errors[1] {
            Some(Error::Mismatch { peer: 0, detail, .. }) => assert!(detail.contains("40 bytes"), "{detail}"),
            other => panic!("rank 1 should report rank 0's mismatched part, got {other:?}"),
        }
    }

    /// The same mismatch with `check_calls` on: both ranks get `Error::Mismatch` from the call
    /// itself, before a kernel runs, and the communicator goes on working.
    #[test]
    fn mismatched_calls_are_refused_up_front_with_the_check_on() {
        let checked = opts().with_check_calls(true);
        let results = run_group_on_device("device", Device::Host(0), 2, "hd-checked", checked, |c| {
            let e = mismatched_all_to_all_v(c).expect_err("the mismatched all_to_all_v was issued");
            let mut one = [c.rank() as f32 + 1.0];
            c.all_reduce(&mut one, ReduceOp::Sum).unwrap();
            (e, one[0])
        });
        for (rank, (e, sum)) in results.iter().enumerate() {
            assert!(
                matches!(e, Error::Mismatch { op: "all_to_all", peer, .. } if *peer == 1 - rank),
                "rank {rank}: {e}"
            );
            assert_eq!(*sum, 3.0, "rank {rank}: the all_reduce after the refused call");
        }
    }

    /// A device wait nobody satisfies ends by its deadline as `Error::Timeout` naming the
    /// awaited rank; `abort` ends one at once as `Error::Closed`.
    #[test]
    fn device_waits_end_by_their_deadline_or_an_abort() {
        on_ranks(2, "hd-waits", |c| {
            let w = c.new_window(4096).unwrap();
            let t0 = std::time::Instant::now();
            let peer = 1 - c.rank();
            match w.wait_signal_timeout(0, SignalSource::Rank(peer), Cmp::Ge, 1, Duration::from_millis(200)) {
                Err(Error::Timeout { peer: Some(p), .. }) => assert_eq!(p, peer),
                other => panic!("expected a timeout naming rank {peer}, got {other:?}"),
            }
            assert!(t0.elapsed() < Duration::from_secs(5));
            w.barrier().unwrap();
        });
        let comms = Comm::new_group("device", &[Device::Host(0); 2], "hd-abort", opts()).unwrap();
        let wins = windows_on(&comms, 64);
        std::thread::scope(|s| {
            let w0 = &wins[0];
            let t0 = std::time::Instant::now();
            let waiter = s.spawn(move || w0.wait_signal(0, SignalSource::Rank(1), Cmp::Ge, 1));
            std::thread::sleep(Duration::from_millis(100));
            comms[0].abort();
            let r = waiter.join().unwrap();
            assert!(matches!(r, Err(Error::Closed { state: "aborted", .. })), "{r:?}");
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the abort ended the kernel's wait"
            );
        });
    }

    fn tcp_opts() -> CommOptions {
        tcp_options(Duration::from_secs(30))
    }

    /// Every rank on a host of its own (the TCP transport): host verbs ride the window's links
    /// and the window server applies them to the host device's segments.
    #[test]
    fn window_contract_over_the_tcp_proxy_on_the_host_device() {
        let seed = fresh_seed();
        let mapped = run_group_on_device("device", Device::Host(0), 3, "hd-win-tcp", tcp_opts(), |c| {
            common::window_suite::run_all(c, seed)
        });
        assert!(mapped.iter().all(|&m| !m), "peers on 'other hosts' must not be mapped");
    }

    /// tests/gpu/kernels.cu compiled for the host device, once per test binary.
    fn test_kernels() -> &'static ferrocomm::device::HostModule {
        static M: std::sync::OnceLock<ferrocomm::device::HostModule> = std::sync::OnceLock::new();
        M.get_or_init(|| {
            ferrocomm::device::compile_host(include_str!("gpu/kernels.cu"), &Default::default())
                .expect("compile tests/gpu/kernels.cu for the host device")
        })
    }

    /// The ring of tests/gpu/kernels.cu at `scope` (`threads` a block): each rank's kernel puts
    /// a tile of `words` into its right neighbour's window with a signal, `iters` times, and
    /// checks its left neighbour's tile word by word inside the kernel. The tile lies in the
    /// window's second half, where the proxy queue can read it for peers on other hosts.
    fn ring(c: &Comm, scope: &str, threads: u32, words: u64, iters: u32, seed: u64) {
        let w = c.new_window(2 * words as usize * 8).unwrap();
        let h = w.device_handle().unwrap();
        let tile = w.local_ptr() as u64 + words * 8;
        let wrong = std::sync::atomic::AtomicU64::new(0);
        // ring_* takes (handle, u64* tile, u64 words, u32 iters, u64 seed, unsigned long long*
        // wrong); the tile lies in the window.
        launch(
            &format!("ring_{scope}"),
            1,
            threads,
            (h, tile, words, iters, seed, wrong.as_ptr() as u64),
        );
        w.synchronize()
            .unwrap_or_else(|e| panic!("ring_{scope} rank {}: {e}", c.rank()));
        assert_eq!(wrong.into_inner(), 0, "ring_{scope} rank {}: words differed", c.rank());
        w.barrier().unwrap();
    }

    /// The kernels of the GPU window tests, through users' kernels compiled for the host device:
    /// in one process on mapped segments, and with every rank on a host of its own, where the
    /// kernels' puts and signals go through the proxy queue (device-api impl/proxy.cuh) and the
    /// peers' window servers.
    #[test]
    fn user_kernels_drive_windows_at_every_scope_directly_and_through_the_proxy() {
        let seed = fresh_seed();
        for n in [2, 3, 4] {
            run_group_on_device("device", Device::Host(0), n, &format!("hd-ring{n}"), opts(), |c| {
                for (scope, threads) in [("thread", 1), ("warp", 32), ("block", 64)] {
                    ring(c, scope, threads, 1024, 50, seed);
                }
            });
        }
        run_group_on_device("device", Device::Host(0), 3, "hd-ring-tcp", tcp_opts(), |c| {
            for (scope, threads) in [("thread", 1), ("warp", 32), ("block", 64)] {
                ring(c, scope, threads, 1024, 20, seed);
            }
            // A kernel's flush waits for the proxy to complete what it queued; then a wait by
            // ANY sees the left neighbour's signal (sent by its host verb over the link).
            let w = c.new_window(4096).unwrap();
            let (right, left) = ((c.rank() + 1) % c.size(), (c.rank() + c.size() - 1) % c.size());
            w.signal(right, 2, SignalOp::Set, 5).unwrap();
            let mut out = [0u64; 3];
            // wait_any_warp takes (handle, u32 id, u64 value, u64* out).
            let args = (w.device_handle().unwrap(), 2u32, 5u64, out.as_mut_ptr() as u64);
            launch("wait_any_warp", 1, 64, args);
            w.synchronize().unwrap();
            assert_eq!(out, [1, left as u64, 5], "rank {}: wait by ANY after a flush", c.rank());
            w.barrier().unwrap();
        });
    }

    /// Runs test kernel `name` once; the caller's arguments match its parameters.
    fn launch<A: ferrocomm::device::KernelArgs>(name: &str, grid: u32, block: u32, args: A) {
        // SAFETY: every caller passes the kernel's parameters (tests/gpu/kernels.cu) with
        // addresses that outlive the launch, which returns when the kernel has.
        unsafe { test_kernels().launch(name, grid, block, args) }.unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    /// A kernel's put_signal whose put the proxy refuses (its source is not window data, or
    /// its destination leaves the window) sends no signal: the peer would take the bytes
    /// already in its window for the new ones. The block leaves the call all the same, and the
    /// host reports the refusal.
    #[test]
    fn a_put_signal_the_proxy_refuses_sends_no_signal() {
        run_group_on_device("device", Device::Host(0), 2, "hd-refused-put", tcp_opts(), |c| {
            let w = c.new_window(4096).unwrap();
            let h = w.device_handle().unwrap();
            let (right, left) = ((c.rank() + 1) % c.size(), (c.rank() + c.size() - 1) % c.size());
            let (outside, inside) = ([7u64; 8], w.local_ptr() as u64 + 2048);
            // put_signal_block takes (handle, i32 peer, u64 dst, u64* src, u64 bytes, u32 id,
            // u64 value).
            let refused = [
                ((0u64, outside.as_ptr() as u64), "named a source (address"),
                ((4096 - 32, inside), "of 64 bytes at byte offset 0xfe0"),
            ];
            for ((dst, src), says) in refused {
                launch(
                    "put_signal_block",
                    1,
                    64,
                    (h, right as i32, dst, src, 64u64, 0u32, 1u64),
                );
                let e = w.synchronize().unwrap_err();
                assert!(e.to_string().contains(says), "rank {}: {e}", c.rank());
            }
            // A put from the window with signal 1: the proxy carries one rank's descriptors to
            // a peer in order, so once signal 1 has landed, whatever the refused calls sent has.
            launch(
                "put_signal_block",
                1,
                64,
                (h, right as i32, 0u64, inside, 64u64, 1u32, 1u64),
            );
            w.synchronize().unwrap();
            w.wait_signal(1, SignalSource::Rank(left), Cmp::Ge, 1).unwrap();
            let seen = w.wait_signal(0, SignalSource::Sum, Cmp::Ge, 0).unwrap();
            assert_eq!(seen.value, 0, "rank {}: the refused put's signal landed", c.rank());
            w.barrier().unwrap();
        });
    }

    /// Every device verb checks its rank, offsets and signal id as the host API does, before
    /// it touches memory: a put of 64 bytes 32 bytes before the end of the data would write
    /// the peer's signal pad, a rank past the window another allocation. The host names what
    /// was refused; nothing moved, and the window works afterwards.
    #[test]
    fn device_verbs_refuse_ranks_offsets_and_signal_ids_outside_the_window() {
        let seed = fresh_seed();
        // Load/store peers, then peers behind the proxy queue (TCP), whose verbs check first too.
        for (name, o) in [("hd-bad-args", opts()), ("hd-bad-args-tcp", tcp_opts())] {
            refuse_bad_arguments(name, o, seed);
        }
    }

    fn refuse_bad_arguments(name: &str, o: CommOptions, seed: u64) {
        run_group_on_device("device", Device::Host(0), 2, name, o, |c| {
            let w = c.new_window(4096).unwrap();
            let h = w.device_handle().unwrap();
            let (n, ids) = (h.data_bytes, h.signals);
            let (right, left) = ((c.rank() + 1) % c.size(), (c.rank() + c.size() - 1) % c.size());
            let word = |r: usize, i: u64| (seed ^ ((r as u64) << 40) ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            // The window's data, n bytes of this rank's: a copy of it, taken where no kernel or
            // peer writes it (after a barrier or the wait for the write).
            let (words, len) = (w.local_ptr() as *mut u64, n as usize / 8);
            // SAFETY: as above; no reference to the data outlives the statement.
            let data = || unsafe { std::slice::from_raw_parts(words, len) }.to_vec();
            // SAFETY: nothing runs on this window yet (no kernel, peers wait in the barrier).
            let mine = unsafe { std::slice::from_raw_parts_mut(words, len) };
            for (i, x) in mine.iter_mut().enumerate() {
                *x = word(c.rank(), i as u64);
            }
            w.barrier().unwrap();
            let r = right as i32;
            // (verb of one_verb, peer, offset, bytes, signal id, what the error says)
            let cases: Vec<(u32, i32, u64, u64, u32, String)> = vec![
                (
                    0,
                    r,
                    n - 32,
                    64,
                    0,
                    format!("of 64 bytes at byte offset {:#x} of rank {r} leaves", n - 32),
                ),
                (
                    0,
                    r,
                    u64::MAX - 7,
                    16,
                    0,
                    "of 16 bytes at byte offset 0xfffffffffffffff8".into(),
                ),
                (0, 2, 0, 8, 0, "named rank 2, but the window has ranks 0..2".into()),
                (0, -1, 0, 8, 0, "named rank -1,".into()),
                (1, r, n, 8, 0, format!("of 8 bytes at byte offset {n:#x} of rank {r}")),
                (
                    2,
                    r,
                    0,
                    0,
                    ids,
                    format!("named signal id {ids}, but the window has ids 0..{ids}"),
                ),
                (3, r, n - 4, 8, 0, format!("of 8 bytes at byte offset {:#x}", n - 4)),
                (3, r, 0, 8, ids, format!("named signal id {ids}")),
                (
                    4,
                    c.rank() as i32,
                    0,
                    0,
                    ids + 5,
                    format!("named signal id {}", ids + 5),
                ),
                (4, 7, 0, 0, 0, "named rank 7".into()),
                (4, -1, 0, 0, ids, format!("named signal id {ids}")),
                (4, -2, 0, 0, ids + 1, format!("named signal id {}", ids + 1)),
                (4, -3, 0, 0, 0, "named rank -3".into()),
                (5, r, n - 4, 8, 0, "leaves".into()),
                (
                    5,
                    r,
                    4,
                    8,
                    0,
                    format!("atomic at byte offset 0x4 of rank {r} is not 8-byte aligned"),
                ),
                (6, 3, 0, 8, 0, "named rank 3".into()),
                (7, -2, 0, 0, 0, "named rank -2".into()),
            ];
            let mut scratch = [u64::MAX; 8];
            for (verb, peer, offset, bytes, id, says) in &cases {
                let args = (h, *verb, *peer, *offset, *bytes, *id, scratch.as_mut_ptr() as u64);
                launch("one_verb", 1, 64, args);
                let e = w.synchronize().unwrap_err();
                assert!(
                    e.to_string().contains(says.as_str()),
                    "rank {}, verb {verb}: {e}",
                    c.rank()
                );
                // A refused get writes nothing (read_signal, verb 7, stores its 0 in word 0).
                let want = if *verb == 7 {
                    [0, u64::MAX, u64::MAX, u64::MAX]
                } else {
                    [u64::MAX; 4]
                };
                assert_eq!(scratch[..4], want, "rank {}, verb {verb}: the scratch", c.rank());
            }
            w.barrier().unwrap();
            for (i, x) in data().iter().enumerate() {
                assert_eq!(*x, word(c.rank(), i as u64), "rank {}: word {i} changed", c.rank());
            }
            for id in 0..ids as usize {
                let seen = w.wait_signal(id, SignalSource::Sum, Cmp::Ge, 0).unwrap();
                assert_eq!(seen.value, 0, "rank {}: signal {id} moved", c.rank());
            }
            w.barrier().unwrap();
            // The window still works: a good put_signal of words 256..264 to the right's 8..16
            // (from window data, which the proxy requires).
            let src = w.local_ptr() as u64 + 256 * 8;
            launch("one_verb", 1, 64, (h, 3u32, r, 64u64, 64u64, 1u32, src));
            w.synchronize().unwrap();
            w.wait_signal(1, SignalSource::Rank(left), Cmp::Ge, 1).unwrap();
            let sent: Vec<u64> = (256..264).map(|i| word(left, i)).collect();
            assert_eq!(&data()[8..16], &sent[..], "rank {}: the good put", c.rank());
            w.barrier().unwrap();
        });
    }

    /// The window kernels of tests/gpu_windows.rs on the host device: get at every scope from
    /// every peer, the device barrier over rounds, atomics from every thread, a device wait
    /// that times out (and the window still usable after it).
    #[test]
    fn the_gpu_window_tests_kernels_run_on_the_host_device() {
        let seed = fresh_seed();
        let pattern = |r: usize, i: u64| (seed ^ ((r as u64) << 48) ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        run_group_on_device("device", Device::Host(0), 4, "hd-get", opts(), |c| {
            let words = 4099usize;
            let w = c.new_window(words * 8).unwrap();
            let mine: Vec<u64> = (0..words as u64).map(|i| pattern(c.rank(), i)).collect();
            w.write_local(0, &mine).unwrap();
            w.barrier().unwrap();
            let h = w.device_handle().unwrap();
            for (scope, threads) in [("thread", 1), ("warp", 32), ("block", 256)] {
                for peer in 0..c.size() {
                    let mut dst = vec![0u64; words];
                    launch(
                        &format!("get_{scope}"),
                        1,
                        threads,
                        (h, peer as i32, dst.as_mut_ptr() as u64, words as u64),
                    );
                    w.synchronize().unwrap();
                    for (i, g) in dst.iter().enumerate() {
                        assert_eq!(*g, pattern(peer, i as u64), "get_{scope} from {peer}: word {i}");
                    }
                }
            }
            w.barrier().unwrap();
        });
        for n in [2, 5, 8] {
            run_group_on_device("device", Device::Host(0), n, &format!("hd-barrier{n}"), opts(), |c| {
                let w = c.new_window(64 * 8).unwrap();
                let wrong = std::sync::atomic::AtomicU64::new(0);
                launch(
                    "barrier_rounds",
                    1,
                    64,
                    (w.device_handle().unwrap(), 50u32, wrong.as_ptr() as u64),
                );
                w.synchronize().unwrap();
                assert_eq!(wrong.into_inner(), 0, "a rank read a word before the barrier");
            });
        }
        let n = 4;
        let totals = run_group_on_device("device", Device::Host(0), n, "hd-atomics", opts(), |c| {
            let w = c.new_window(64).unwrap();
            launch("fetch_add_storm", 4, 32, (w.device_handle().unwrap(), 20u32));
            w.synchronize().unwrap();
            w.barrier().unwrap();
            let mut word = [0u64];
            w.get(0, 0, &mut word).unwrap();
            w.barrier().unwrap();
            word[0]
        });
        assert!(totals.iter().all(|&t| t == (n * 4 * 32 * 20) as u64), "{totals:?}");
        run_group_on_device("device", Device::Host(0), 2, "hd-timeout", opts(), |c| {
            let w = c.new_window(4096).unwrap();
            let mut h = w.device_handle().unwrap();
            h.timeout_ns = 50_000_000;
            let mut out = [7u64];
            let t0 = std::time::Instant::now();
            launch("wait_forever", 1, 128, (h, out.as_mut_ptr() as u64));
            let err = w.synchronize().unwrap_err();
            assert!(matches!(err, Error::Timeout { op: "synchronize", .. }), "{err}");
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the device wait overran its deadline"
            );
            assert_eq!(out[0], 0, "the wait reported success");
            // Still usable: a signal round trip works afterwards.
            c.barrier().unwrap();
            let peer = 1 - c.rank();
            w.signal(peer, 5, SignalOp::Add, 1).unwrap();
            assert_eq!(w.wait_signal(5, SignalSource::Rank(peer), Cmp::Ge, 1).unwrap().value, 1);
            w.barrier().unwrap();
        });
    }

    /// A user's fused kernel made of the collectives' primitives (device-api reduce_copy.cuh,
    /// dtype.cuh; tests/gpu/kernels.cu `fused_reduce_*`): the sum of one window's segments
    /// plus the max of another's, and a copy of the right neighbour's segment, over a grid of
    /// three blocks. Checked bit for bit against the same arithmetic on the host: each
    /// reduction in rank order in f32, rounded to T, then the two added in f32 and rounded.
    fn fused_reduce<T: TestElem + Copy>(
        world: usize,
        n: usize,
        seed: u64,
        kernel: &str,
        f32_of: fn(T) -> f32,
        of_f32: fn(f32) -> T,
    ) {
        let input = |win: u64, r: usize| -> Vec<T> {
            random_vec(
                &mut rng(seed ^ (win << 40) ^ n as u64, r as u64),
                n,
                Some(ReduceOp::Sum),
            )
        };
        on_ranks(world, &format!("hd-fused-{kernel}-{world}-{n}"), |c| {
            let me = c.rank();
            let bytes = n * std::mem::size_of::<T>();
            let (a, b) = (c.new_window(bytes).unwrap(), c.new_window(bytes).unwrap());
            a.write_local(0, &input(0, me)).unwrap();
            b.write_local(0, &input(1, me)).unwrap();
            // Every segment is filled before any rank's kernel reads it.
            a.barrier().unwrap();
            b.barrier().unwrap();
            let mut out = vec![T::poison(); n];
            let mut copy = vec![T::poison(); n];
            let (ha, hb) = (a.device_handle().unwrap(), b.device_handle().unwrap());
            let args = (ha, hb, n as u64, out.as_mut_ptr() as u64, copy.as_mut_ptr() as u64);
            launch(kernel, 3, 64, args);
            a.synchronize().unwrap();
            b.synchronize().unwrap();
            let (ins_a, ins_b): (Vec<Vec<T>>, Vec<Vec<T>>) = (0..world).map(|r| (input(0, r), input(1, r))).unzip();
            for i in 0..n {
                let sum = of_f32(ins_a.iter().map(|v| f32_of(v[i])).reduce(|x, y| x + y).unwrap());
                let most = of_f32(ins_b.iter().map(|v| f32_of(v[i])).reduce(f32::max).unwrap());
                let want = of_f32(f32_of(sum) + f32_of(most));
                assert!(
                    out[i] == want,
                    "{kernel} world {world} n={n} rank {me} element {i}: {:?}, want {want:?}",
                    out[i]
                );
            }
            assert!(
                copy == input(0, (me + 1) % world),
                "{kernel} rank {me}: the copied segment differs"
            );
            // Nobody frees a window a peer's kernel may still read.
            a.barrier().unwrap();
            b.barrier().unwrap();
        });
    }

    #[test]
    fn a_users_fused_kernel_reduces_and_copies_with_the_collectives_primitives() {
        let seed = fresh_seed();
        for (world, n) in [(1, 9), (2, 1), (3, 1001), (4, 4099)] {
            fused_reduce::<f32>(world, n, seed, "fused_reduce_f32", |x| x, |x| x);
        }
        for (world, n) in [(2, 15), (3, 1001)] {
            fused_reduce::<bf16>(world, n, seed, "fused_reduce_bf16", bf16::to_f32, bf16::from_f32);
            fused_reduce::<f16>(world, n, seed, "fused_reduce_f16", f16::to_f32, f16::from_f32);
        }
    }

    /// team.cuh seen by one thread of `c`'s rank: `team_info`'s output (tests/gpu/kernels.cu).
    fn team_info(c: &Comm) -> Vec<i32> {
        let w = c.new_window(64).unwrap();
        let mut out = vec![i32::MIN; 2 * c.size() + 7];
        launch("team_info", 1, 1, (w.device_handle().unwrap(), out.as_mut_ptr() as u64));
        w.synchronize().unwrap();
        w.barrier().unwrap();
        out
    }

    /// What team_info must say when `local(p)` tells which ranks are load/store reachable.
    fn expected_team(rank: usize, size: usize, local: impl Fn(usize) -> bool) -> Vec<i32> {
        let locals: Vec<i32> = (0..size).filter(|&p| local(p)).map(|p| p as i32).collect();
        let mut v = vec![rank as i32, size as i32, locals.len() as i32];
        v.push(locals.iter().position(|&p| p == rank as i32).unwrap() as i32);
        v.push(0); // rank -1
        v.extend((0..size).map(|p| i32::from(local(p))));
        v.push(0); // rank `size`
        v.extend((0..=size).map(|k| locals.get(k).copied().unwrap_or(-1)));
        v
    }

    /// The team header on ranks that map each other's segments (every peer local) and on
    /// ranks each on a host of its own (only the caller local; the rest behind the proxy).
    #[test]
    fn the_team_header_names_rank_size_and_the_load_store_peers() {
        for n in [1, 3, 4] {
            let got = on_ranks(n, &format!("hd-team{n}"), team_info);
            for (r, g) in got.iter().enumerate() {
                assert_eq!(*g, expected_team(r, n, |_| true), "rank {r} of {n}, all mapped");
            }
        }
        let got = run_group_on_device("device", Device::Host(0), 3, "hd-team-tcp", tcp_opts(), team_info);
        for (r, g) in got.iter().enumerate() {
            assert_eq!(*g, expected_team(r, 3, |p| p == r), "rank {r} of 3, one per host");
        }
    }

    /// `relaxed_counters_*`: relaxed Adds and Sets at every scope, observed by device waits (sum
    /// and per source) and then exactly by the host, directly and through the proxy queue.
    fn relaxed_counters(c: &Comm) {
        let w = c.new_window(4096).unwrap();
        let adds = 40u32;
        let total = u64::from(adds) * (c.size() as u64 - 1);
        for (k, (scope, threads)) in [("thread", 1), ("warp", 32), ("block", 64)].into_iter().enumerate() {
            let id = 2 * k as u32;
            let mut out = [0u64; 2];
            let args = (w.device_handle().unwrap(), id, adds, out.as_mut_ptr() as u64);
            launch(&format!("relaxed_counters_{scope}"), 1, threads, args);
            w.synchronize()
                .unwrap_or_else(|e| panic!("relaxed_counters_{scope} rank {}: {e}", c.rank()));
            assert_eq!(out, [1, total], "relaxed_counters_{scope} rank {}: [ok, sum]", c.rank());
            // Every add landed once: the sum is exact, not just reached.
            let seen = w.wait_signal(id as usize, SignalSource::Sum, Cmp::Eq, total).unwrap();
            assert_eq!(seen.value, total);
            for p in (0..c.size()).filter(|&p| p != c.rank()) {
                w.wait_signal(id as usize + 1, SignalSource::Rank(p), Cmp::Eq, 1000 + p as u64)
                    .unwrap();
            }
        }
        w.barrier().unwrap();
    }

    #[test]
    fn relaxed_signals_are_seen_by_waits_directly_and_through_the_proxy() {
        for n in [2, 3, 4] {
            on_ranks(n, &format!("hd-relaxed{n}"), relaxed_counters);
        }
        run_group_on_device(
            "device",
            Device::Host(0),
            3,
            "hd-relaxed-tcp",
            tcp_opts(),
            relaxed_counters,
        );
    }

    /// A handle whose abi_version is not the one the kernels were compiled with (here what a
    /// host of ABI version 1 passed: 0 in that slot, or any other number) makes every device
    /// verb, and the library's own collective kernels, record the ABI error and do nothing
    /// else: no byte or signal lands, no wait runs to its deadline, and the host reports both
    /// versions. The window works normally afterwards.
    #[test]
    fn a_handle_of_another_abi_version_is_refused_with_an_error_not_data() {
        use ferrocomm::device::abi::ABI_VERSION;
        on_ranks(2, "hd-abi", |c| {
            let (me, peer) = (c.rank(), 1 - c.rank());
            let words = 256usize;
            let w = c.new_window(2 * words * 8).unwrap();
            let filler: Vec<u64> = (0..2 * words as u64).map(|i| 0xa5a5_0000 + i).collect();
            w.write_local(0, &filler).unwrap();
            w.barrier().unwrap();
            let good = w.device_handle().unwrap();
            assert_eq!(good.abi_version, ABI_VERSION, "the host fills the handle's version");
            let expect_refusal = |what: &str, version: u32| {
                let err = w.synchronize().expect_err(what);
                let text = format!("window handle ABI version {version}, kernel compiled for {ABI_VERSION}");
                assert!(
                    matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains(&text)),
                    "rank {me} {what}: {err}"
                );
            };
            // ring_block on `h` (put + signal to the right, then a wait that only a peer's
            // signal ends); returns the words it found wrong.
            let ring_block = |h: ferrocomm::device::WindowHandle| {
                let wrong = std::sync::atomic::AtomicU64::new(0);
                let mut tile = vec![0u64; words];
                let args = (
                    h,
                    tile.as_mut_ptr() as u64,
                    words as u64,
                    3u32,
                    7u64,
                    wrong.as_ptr() as u64,
                );
                launch("ring_block", 1, 64, args);
                wrong.into_inner()
            };
            for version in [0, ABI_VERSION + 1] {
                let bad = ferrocomm::device::WindowHandle {
                    abi_version: version,
                    ..good
                };
                let t0 = std::time::Instant::now();
                ring_block(bad);
                expect_refusal("ring_block", version);
                launch("fetch_add_storm", 1, 32, (bad, 5u32));
                expect_refusal("fetch_add_storm", version);
                let mut dst = vec![0u64; words];
                launch(
                    "get_warp",
                    1,
                    32,
                    (bad, peer as i32, dst.as_mut_ptr() as u64, words as u64),
                );
                expect_refusal("get_warp", version);
                assert!(dst.iter().all(|&x| x == 0), "rank {me}: get_warp copied data");
                let mut out = [7u64];
                launch("wait_forever", 1, 64, (bad, out.as_mut_ptr() as u64));
                expect_refusal("wait_forever", version);
                assert_eq!(out[0], 0, "the refused wait reported success");
                // The library's one-shot all_reduce, given the bad handle directly.
                let input = vec![1f32; 64];
                let mut output = vec![f32::poison(); 64];
                let mut counters = [0u64; 16];
                let lib = ferrocomm::device::host_library().unwrap();
                let args = (
                    bad,
                    input.as_ptr() as u64,
                    output.as_mut_ptr() as u64,
                    64u64,
                    counters.as_mut_ptr() as u64,
                    1u32,
                );
                // SAFETY: the one-shot kernels take (handle, in, out, n, counters, vectors);
                // every buffer outlives the launch, which returns when the kernel has.
                unsafe { lib.launch("ferrocomm_allreduce_oneshot_f32_sum", 1, 64, args) }.unwrap();
                expect_refusal("the one-shot all_reduce", version);
                assert!(
                    output.iter().all(|&x| x == f32::poison()),
                    "rank {me}: the all_reduce wrote output"
                );
                assert!(
                    counters.iter().all(|&x| x == 0),
                    "rank {me}: the all_reduce took an epoch"
                );
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "a refused kernel waited (the handle's timeout is 30 s)"
                );
            }
            // Nothing landed anywhere: both segments and every signal as before.
            w.barrier().unwrap();
            let mut seg = vec![0u64; 2 * words];
            w.read_local(0, &mut seg).unwrap();
            assert!(seg == filler, "rank {me}: a refused kernel wrote into the window");
            for id in [0, 1] {
                let seen = w.wait_signal(id, SignalSource::Sum, Cmp::Eq, 0).unwrap();
                assert_eq!(seen.value, 0, "rank {me}: signal {id} moved");
            }
            // Every rank has checked its signals before any rank's good ring signals its
            // neighbour: without this barrier a fast rank's put_signal lands in a slow rank's
            // signal 0 before that rank read it as 0, and the check waits out its deadline.
            w.barrier().unwrap();
            // The errors were reported and cleared: the right handle works.
            let wrong = ring_block(good);
            w.synchronize().unwrap();
            assert_eq!(wrong, 0);
            w.barrier().unwrap();
        });
    }

    /// An activation type of the fused norm, with the tolerance of its results relative to
    /// the values they approximate (its rounding, plus the f32 sums').
    trait Act: TestElem + Copy + Send + Sync {
        const REL: f64;
        fn of(x: f64) -> Self;
        fn val(self) -> f64;
    }
    impl Act for f32 {
        const REL: f64 = 1e-5;
        fn of(x: f64) -> Self {
            x as f32
        }
        fn val(self) -> f64 {
            self as f64
        }
    }
    impl Act for f16 {
        const REL: f64 = 2e-3;
        fn of(x: f64) -> Self {
            f16::from_f64(x)
        }
        fn val(self) -> f64 {
            self.to_f64()
        }
    }
    impl Act for bf16 {
        const REL: f64 = 1.6e-2;
        fn of(x: f64) -> Self {
            bf16::from_f64(x)
        }
        fn val(self) -> f64 {
            self.to_f64()
        }
    }

    const NORM_EPS: f32 = 1e-5;

    #[derive(Clone, Copy, Debug)]
    struct NormCase {
        dtype: DType,
        fp8: bool,
        hidden: usize,
        tokens: usize,
    }

    /// What a rank got, every value as f64 (exactly): residual, out (fp8 decoded), scales.
    #[derive(Debug)]
    struct NormGot {
        residual: Vec<f64>,
        out: Vec<f64>,
        scales: Vec<f64>,
    }

    impl NormGot {
        fn bits(&self) -> Vec<u64> {
            let all = self.residual.iter().chain(&self.out).chain(&self.scales);
            all.map(|v| v.to_bits()).collect()
        }
    }

    /// Rank `rank`'s x and the shared residual and gamma of a case, as values of its dtype.
    fn norm_inputs<T: Act>(seed: u64, case: NormCase, rank: usize) -> (Vec<T>, Vec<T>, Vec<T>) {
        let n = case.hidden * case.tokens;
        let stream = (case.hidden * 1000 + case.tokens) as u64 * 16;
        let draw = |r: &mut StdRng, n: usize, range: f64| -> Vec<T> {
            (0..n).map(|_| T::of(r.gen_range(-range..range))).collect()
        };
        let x = draw(&mut rng(seed, stream + rank as u64), n, 1.0);
        let mut shared = rng(seed, stream + 15);
        (x, draw(&mut shared, n, 1.0), draw(&mut shared, case.hidden, 1.5))
    }

    /// One call of the fused norm on this rank, outputs poisoned first.
    fn run_norm<T: Act>(c: &Comm, seed: u64, case: NormCase, algo: &str) -> ferrocomm::Result<NormGot> {
        let (x, mut residual, gamma) = norm_inputs::<T>(seed, case, c.rank());
        let comm = c.with_options(OpOptions::new().hint("algorithm", algo));
        let (out, scales) = if case.fp8 {
            let mut out = vec![F8E4M3::from_bits(0x7f); x.len()];
            let mut scales = vec![-12345.0f32; case.tokens];
            comm.all_reduce_residual_rmsnorm_fp8(
                &x[..],
                &mut residual[..],
                &gamma[..],
                &mut out[..],
                &mut scales[..],
                NORM_EPS,
            )?;
            let out = out.iter().map(|v| v.to_f32() as f64).collect();
            (out, scales.iter().map(|&s| s as f64).collect())
        } else {
            let mut out = vec![T::poison(); x.len()];
            comm.all_reduce_residual_rmsnorm(&x[..], &mut residual[..], &gamma[..], &mut out[..], NORM_EPS)?;
            (out.iter().map(|v| v.val()).collect(), Vec::new())
        };
        Ok(NormGot {
            residual: residual.iter().map(|v| v.val()).collect(),
            out,
            scales,
        })
    }

    fn run_norm_any(c: &Comm, seed: u64, case: NormCase, algo: &str) -> ferrocomm::Result<NormGot> {
        match case.dtype {
            DType::F32 => run_norm::<f32>(c, seed, case, algo),
            DType::F16 => run_norm::<f16>(c, seed, case, algo),
            DType::BF16 => run_norm::<bf16>(c, seed, case, algo),
            other => unreachable!("no fused norm case of {other:?}"),
        }
    }

    /// Checks rank 0's result against the definition in f64 (host/contracts/inference.rs).
    fn check_norm<T: Act>(seed: u64, case: NormCase, world: usize, got: &NormGot) -> Result<(), String> {
        let h = case.hidden;
        let inputs: Vec<_> = (0..world).map(|r| norm_inputs::<T>(seed, case, r)).collect();
        let (residual, gamma) = (&inputs[0].1, &inputs[0].2);
        for t in 0..case.tokens {
            let row = t * h..(t + 1) * h;
            let s: Vec<f64> = row
                .clone()
                .map(|i| inputs.iter().map(|(x, _, _)| x[i].val()).sum::<f64>() + residual[i].val())
                .collect();
            let terms: Vec<f64> = row
                .clone()
                .map(|i| inputs.iter().map(|(x, _, _)| x[i].val().abs()).sum::<f64>() + residual[i].val().abs())
                .collect();
            let mean_square = s.iter().map(|v| v * v).sum::<f64>() / h as f64 + NORM_EPS as f64;
            let inv = 1.0 / mean_square.sqrt();
            let y: Vec<f64> = (0..h).map(|j| s[j] * inv * gamma[j].val()).collect();
            let y_max = y.iter().fold(0f64, |m, v| m.max(v.abs()));
            // The error of the f32 sums of world + 1 terms, and what the norm makes of it: each
            // s[j]'s own, times inv, and every s[k]'s through the mean square. Where the terms
            // cancel to a sum near sqrt(eps) the out is far more sensitive than its rounding.
            let sum_error: Vec<f64> = terms.iter().map(|t| 1.2e-7 * (world + 2) as f64 * t).collect();
            let coupled = s.iter().zip(&sum_error).map(|(v, e)| v.abs() * e).sum::<f64>() / h as f64 / mean_square;
            let carried: Vec<f64> = (0..h)
                .map(|j| inv * gamma[j].val().abs() * sum_error[j] + y[j].abs() * coupled)
                .collect();
            for j in 0..h {
                let i = t * h + j;
                // The rounded sum: its dtype's rounding plus the f32 sums'.
                let tol = T::REL * s[j].abs() + sum_error[j] + 1e-30;
                if (got.residual[i] - s[j]).abs() > tol {
                    return Err(format!(
                        "token {t} residual[{j}] = {}, want {} ± {tol}",
                        got.residual[i], s[j]
                    ));
                }
                let (value, tol) = if case.fp8 {
                    // 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals are steps
                    // of the row's max / 448 / 512.
                    (
                        got.out[i] * got.scales[t],
                        y[j].abs() / 16.0 + 1e-3 * y_max + carried[j],
                    )
                } else {
                    (got.out[i], T::REL * y[j].abs() + 1e-5 * y_max + carried[j])
                };
                if (value - y[j]).abs() > tol || value.is_nan() {
                    return Err(format!("token {t} out[{j}] = {value}, want {} ± {tol}", y[j]));
                }
            }
            if case.fp8 {
                let want = if y_max > 0.0 { y_max / 448.0 } else { 1.0 };
                let tol = 1e-5 * want + carried.iter().fold(0f64, |m, &c| m.max(c)) / 448.0;
                if (got.scales[t] - want).abs() > tol {
                    return Err(format!("token {t} scale = {}, want {want}", got.scales[t]));
                }
            }
        }
        Ok(())
    }

    fn check_norm_any(seed: u64, case: NormCase, world: usize, got: &NormGot) -> Result<(), String> {
        match case.dtype {
            DType::F32 => check_norm::<f32>(seed, case, world, got),
            DType::F16 => check_norm::<f16>(seed, case, world, got),
            _ => check_norm::<bf16>(seed, case, world, got),
        }
    }

    /// Every case with both fused algorithms and the steps apart (the norm pass around the
    /// own all_reduce), twice each, on `world` host-device ranks: within the definition's
    /// tolerance, the same bits on every rank, in both runs and by every algorithm (each row is
    /// computed by the same code in the same order either way).
    fn norm_sweep(world: usize, seed: u64, cases: &[NormCase]) {
        const ALGOS: [&str; 3] = ["oneshot", "twoshot", "unfused"];
        let results = on_ranks(world, &format!("hd-norm-{world}"), |c| {
            let mut got = Vec::new();
            for &case in cases {
                for algo in ALGOS {
                    for _ in 0..2 {
                        got.push(run_norm_any(c, seed, case, algo).unwrap_or_else(|e| panic!("{case:?} {algo}: {e}")));
                    }
                }
            }
            got
        });
        for (k, &case) in cases.iter().enumerate() {
            let first = &results[0][2 * ALGOS.len() * k];
            for (a, algo) in ALGOS.iter().enumerate() {
                for run in 0..2 {
                    let i = 2 * ALGOS.len() * k + 2 * a + run;
                    for (r, rank) in results.iter().enumerate() {
                        assert!(
                            rank[i].bits() == first.bits(),
                            "world {world} {case:?} {algo} run {run}: rank {r}'s bits differ from rank 0's first one-shot"
                        );
                    }
                }
            }
            if let Err(why) = check_norm_any(seed, case, world, first) {
                panic!("world {world} {case:?}: {why}");
            }
        }
    }

    #[test]
    fn fused_rmsnorm_kernels_match_the_definition_on_every_rank() {
        let seed = fresh_seed();
        let families = [
            (DType::F32, false),
            (DType::F16, false),
            (DType::BF16, false),
            (DType::F32, true),
            (DType::F16, true),
            (DType::BF16, true),
        ];
        for world in [1, 2, 3, 4] {
            let mut cases = Vec::new();
            // Every shape in f32 and in one more family, which rotates with the shape and world.
            for (i, (hidden, tokens)) in [1, 7, 129, 1000]
                .into_iter()
                .flat_map(|h| [1, 5, 64].map(|t| (h, t)))
                .enumerate()
            {
                for (dtype, fp8) in [families[0], families[1 + (i + world) % 5]] {
                    cases.push(NormCase {
                        dtype,
                        fp8,
                        hidden,
                        tokens,
                    });
                }
            }
            norm_sweep(world, seed, &cases);
        }
    }

    /// device-api's fp8 e4m3 conversion (norm.cuh) gives the host reference's bits
    /// (`F8E4M3::from_f32`: round to nearest even, saturation, NaN) over a dense sweep of both
    /// signs, the special values and random bit patterns, and decodes every code as it does.
    #[test]
    fn device_e4m3_conversion_matches_the_host_reference() {
        let mut xs: Vec<f32> = Vec::new();
        let mut x = 1e-5f64;
        while x < 1000.0 {
            xs.extend([x as f32, -x as f32]);
            x *= 1.0003;
        }
        // Every code's value and the midpoints between neighbours (the ties).
        for c in 0..=255u8 {
            let v = F8E4M3::from_bits(c).to_f32();
            let next = F8E4M3::from_bits(c.wrapping_add(1)).to_f32();
            xs.extend([v, (v + next) / 2.0]);
        }
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            448.0,
            464.0,
            480.0,
            f32::MIN_POSITIVE,
        ]);
        let mut r = rng(fresh_seed(), 7);
        xs.extend((0..20_000).map(|_| f32::from_bits(r.gen())));
        let mut out = vec![0u8; xs.len()];
        let mut decoded = vec![0f32; 256];
        let args = (
            xs.as_ptr() as u64,
            out.as_mut_ptr() as u64,
            xs.len() as u64,
            decoded.as_mut_ptr() as u64,
        );
        launch("e4m3_convert", 4, 64, args);
        for (x, got) in xs.iter().zip(&out) {
            let want = F8E4M3::from_f32(*x);
            // NaN: any NaN code of the input's sign.
            let same = *got == want.to_bits() || (want.is_nan() && F8E4M3::from_bits(*got).is_nan());
            assert!(same, "e4m3({x:e}) = {got:#04x}, the host gives {:#04x}", want.to_bits());
        }
        for (c, got) in decoded.iter().enumerate() {
            let want = F8E4M3::from_bits(c as u8).to_f32();
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "code {c:#04x}: {got} vs {want}"
            );
        }
    }

    /// device-api's fp8 e5m2 conversion (fp8.cuh) gives the host reference's bits
    /// (`F8E5M2::from_f32`: round to nearest even, once; saturation, infinities too; NaN) over
    /// a dense sweep of both signs, every midpoint and its neighbours, the special values and
    /// random bit patterns, and decodes every code (infinities and NaNs included) as it does.
    #[test]
    fn device_e5m2_conversion_matches_the_host_reference() {
        let mut xs: Vec<f32> = Vec::new();
        let mut x = 1e-7f64;
        while x < 1e5 {
            xs.extend([x as f32, -x as f32]);
            x *= 1.0003;
        }
        for c in 0..=255u8 {
            let v = F8E5M2::from_bits(c).to_f32();
            let next = F8E5M2::from_bits(c.wrapping_add(1)).to_f32();
            let mid = (v + next) / 2.0;
            xs.extend([v, mid]);
            if mid.is_finite() && mid != 0.0 {
                xs.extend([f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1)]);
            }
        }
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            57344.0,
            61440.0,
            65536.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
        ]);
        let mut r = rng(fresh_seed(), 8);
        xs.extend((0..20_000).map(|_| f32::from_bits(r.gen())));
        let mut out = vec![0u8; xs.len()];
        let mut decoded = vec![0f32; 256];
        let args = (
            xs.as_ptr() as u64,
            out.as_mut_ptr() as u64,
            xs.len() as u64,
            decoded.as_mut_ptr() as u64,
        );
        launch("e5m2_convert", 4, 64, args);
        for (x, got) in xs.iter().zip(&out) {
            let want = F8E5M2::from_f32(*x);
            let same = *got == want.to_bits() || (want.is_nan() && F8E5M2::from_bits(*got).is_nan());
            assert!(same, "e5m2({x:e}) = {got:#04x}, the host gives {:#04x}", want.to_bits());
        }
        for (c, got) in decoded.iter().enumerate() {
            let want = F8E5M2::from_bits(c as u8).to_f32();
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "code {c:#04x}: {got} vs {want}"
            );
        }
    }

    /// 4096 tokens of 64 f32: 1 MiB per rank, past the window's region, so several launches
    /// of whole rows per call.
    #[test]
    fn fused_rmsnorm_of_many_tokens_runs_in_several_launches() {
        let seed = fresh_seed();
        for (dtype, fp8) in [(DType::F32, false), (DType::BF16, true)] {
            norm_sweep(
                2,
                seed,
                &[NormCase {
                    dtype,
                    fp8,
                    hidden: 64,
                    tokens: 4096,
                }],
            );
        }
    }

    /// Every rank on a host of its own (the TCP transport), where the fused kernels cannot
    /// run: the steps apart (hint `unfused`: widen and norm kernels around the CPU engine's
    /// all_reduce, which sums in rank order, as the fused kernels do) give the fused kernels'
    /// bits on ranks of one host, as they would around NCCL's all_reduce on GPUs of several
    /// hosts (whose sum NCCL orders as it likes: there the same bits on every rank only).
    #[test]
    fn the_unfused_rmsnorm_on_ranks_of_several_hosts_gives_the_fused_kernels_bits() {
        let seed = fresh_seed();
        let cases: Vec<NormCase> = [
            (DType::BF16, false, 33, 5),
            (DType::F16, true, 64, 9),
            (DType::F32, false, 7, 1),
        ]
        .into_iter()
        .map(|(dtype, fp8, hidden, tokens)| NormCase {
            dtype,
            fp8,
            hidden,
            tokens,
        })
        .collect();
        let run = |c: &Comm, algo: &str| -> Vec<NormGot> {
            let each = |&case| run_norm_any(c, seed, case, algo).unwrap_or_else(|e| panic!("{case:?} {algo}: {e}"));
            cases.iter().map(each).collect()
        };
        let apart = run_group_on_device("device", Device::Host(0), 3, "hd-norm-tcp", tcp_opts(), |c| {
            run(c, "unfused")
        });
        let fused = on_ranks(3, "hd-norm-fused", |c| run(c, "oneshot"));
        for (k, &case) in cases.iter().enumerate() {
            for (r, rank) in apart.iter().enumerate() {
                assert!(
                    rank[k].bits() == fused[0][k].bits(),
                    "{case:?}: rank {r}'s unfused result differs from the fused kernels'"
                );
            }
            check_norm_any(seed, case, 3, &apart[0][k]).unwrap_or_else(|why| panic!("{case:?}: {why}"));
        }
    }

    /// Ranks that disagree on the row length: the kernels compare the calls' headers and every
    /// rank gets `Error::Mismatch` (nothing computed), and the next matched call works.
    #[test]
    fn a_fused_rmsnorm_with_another_hidden_size_is_a_mismatch_on_every_rank() {
        let seed = fresh_seed();
        on_ranks(2, "hd-norm-mismatch", |c| {
            let case = NormCase {
                dtype: DType::F32,
                fp8: false,
                hidden: 8 >> c.rank(),
                tokens: 4,
            };
            for algo in ["oneshot", "twoshot"] {
                match run_norm_any(c, seed, case, algo) {
                    Err(Error::Mismatch { peer, .. }) => assert_eq!(peer, 1 - c.rank()),
                    other => panic!("rank {}: expected a mismatch, got {other:?}", c.rank()),
                }
            }
            let case = NormCase { hidden: 8, ..case };
            let got = run_norm_any(c, seed, case, "oneshot").unwrap();
            check_norm_any(seed, case, 2, &got).unwrap();
        });
    }

    /// Ranks whose calls are cut into other launches (another row count or row length, so
    /// other launch counts or grids) get `Error::Mismatch` on every rank, long before the
    /// timeout, and the next matched call works. In the window's default 1 MiB region a launch
    /// of 64 f32 per row takes 4078 rows one-shot and 2007 two-shot between 2 ranks
    /// (collectives/norm.rs `segment_bytes`), so the first case's first launches are alike.
    #[test]
    fn a_fused_rmsnorm_cut_into_other_launches_is_a_prompt_mismatch_on_every_rank() {
        let seed = fresh_seed();
        let timeout = Duration::from_secs(10);
        let opts = options(timeout);
        run_group_on_device("device", Device::Host(0), 2, "hd-norm-launches", opts, |c| {
            let (me, peer) = (c.rank(), 1 - c.rank());
            for (algo, per_launch) in [("oneshot", 4078), ("twoshot", 2007)] {
                // (hidden, tokens) of rank 0 and of rank 1.
                let shapes = [
                    // The same first launch, then one more on rank 0 only.
                    [(64, 2 * per_launch), (64, per_launch)],
                    // Another row length: two launches on rank 0, one on rank 1.
                    [(64, per_launch + 5), (32, per_launch + 5)],
                    // One launch each, of 3 and 5 rows.
                    [(8, 3), (8, 5)],
                ];
                for shape in shapes {
                    let (hidden, tokens) = shape[me];
                    let case = NormCase {
                        dtype: DType::F32,
                        fp8: false,
                        hidden,
                        tokens,
                    };
                    let t0 = std::time::Instant::now();
                    match run_norm_any(c, seed, case, algo) {
                        Err(Error::Mismatch { peer: p, detail, .. }) => {
                            assert_eq!(p, peer);
                            // Both calls' bytes of x.
                            let bytes = |(hidden, tokens): (usize, usize)| 4 * hidden * tokens;
                            let (theirs, mine) = (bytes(shape[peer]), bytes(shape[me]));
                            let want = format!("it sent {theirs} bytes where this rank expected {mine}");
                            assert!(detail.contains(&want), "rank {me} {algo} {shape:?}: {detail}");
                        }
                        Err(e) => panic!("rank {me} {algo} {shape:?}: expected a mismatch, got {e}"),
                        Ok(_) => panic!("rank {me} {algo} {shape:?}: expected a mismatch, the call computed"),
                    }
                    assert!(
                        t0.elapsed() < timeout / 3,
                        "rank {me} {algo} {shape:?}: the mismatch took {:?} (timeout {timeout:?})",
                        t0.elapsed()
                    );
                    // The window's protocol is in step again: a matched call computes.
                    let case = NormCase {
                        hidden: 64,
                        tokens: 9,
                        ..case
                    };
                    let got = run_norm_any(c, seed, case, algo)
                        .unwrap_or_else(|e| panic!("rank {me} {algo} after {shape:?}: {e}"));
                    check_norm_any(seed, case, 2, &got).unwrap_or_else(|e| panic!("rank {me} {algo}: {e}"));
                }
            }
        });
    }

    /// One rank refuses its fused norm on the kernels (an output of the wrong length, found by
    /// its host's checks): it gets its argument error, every other rank an
    /// `Error::InvalidArgument` naming it, long before the timeout (the refusing rank launches
    /// a kernel whose headers say so); whatever the algorithm and however many launches the
    /// peers' calls take, and the next call computes on every rank.
    #[test]
    fn a_fused_rmsnorm_refused_on_one_rank_fails_every_rank_at_once_naming_it() {
        let seed = fresh_seed();
        let timeout = Duration::from_secs(10);
        for world in [2, 3] {
            let culprit = world - 1;
            let name = format!("hd-norm-refused{world}");
            run_group_on_device("device", Device::Host(0), world, &name, options(timeout), |c| {
                let me = c.rank();
                // 64 f32 per row: 4096 rows take two launches one-shot and three two-shot.
                for (algo, tokens) in [("oneshot", 5), ("twoshot", 7), ("oneshot", 4096), ("twoshot", 4096)] {
                    let case = NormCase {
                        dtype: DType::F32,
                        fp8: false,
                        hidden: 64,
                        tokens,
                    };
                    let (x, mut residual, gamma) = norm_inputs::<f32>(seed, case, me);
                    let short = if me == culprit { 64 } else { 0 };
                    let mut out = vec![f32::NAN; x.len() - short];
                    let comm = c.with_options(OpOptions::new().hint("algorithm", algo));
                    let t0 = std::time::Instant::now();
                    let r =
                        comm.all_reduce_residual_rmsnorm(&x[..], &mut residual[..], &gamma[..], &mut out[..], NORM_EPS);
                    let took = t0.elapsed();
                    match r {
                        Err(e @ Error::SizeMismatch { .. }) if me == culprit => {
                            assert!(e.to_string().contains("out"), "the culprit, {algo} {tokens}: {e}")
                        }
                        Err(Error::InvalidArgument { reason, .. }) => assert!(
                            reason.contains(&format!("rank {culprit} refused its call")),
                            "rank {me}, {algo} {tokens}: {reason}"
                        ),
                        other => panic!("rank {me}, {algo} {tokens}: {other:?}"),
                    }
                    assert!(
                        out.iter().all(|v| v.is_nan()),
                        "rank {me}, {algo} {tokens}: a refused call wrote"
                    );
                    assert!(took < timeout / 3, "rank {me}, {algo} {tokens}: took {took:?}");
                    let case = NormCase { tokens: 9, ..case };
                    let got = run_norm_any(c, seed, case, algo)
                        .unwrap_or_else(|e| panic!("rank {me} {algo}, the call after: {e}"));
                    check_norm_any(seed, case, world, &got).unwrap_or_else(|e| panic!("rank {me} {algo}: {e}"));
                }
            });
        }
    }

    #[test]
    fn collectives_on_the_host_device_match_the_reference() {
        let seed = fresh_seed();
        for n in [1, 2, 3, 4] {
            run_group_on_device("device", Device::Host(0), n, &format!("hd-coll{n}"), opts(), |c| {
                common::suite::run_all(c, seed)
            });
        }
    }
}

#[cfg(not(feature = "host-kernels"))]
#[test]
fn the_host_device_says_it_needs_the_feature() {
    match Comm::new_group("device", &[Device::Host(0); 2], "hd-none", opts()) {
        Err(ferrocomm::Error::Unavailable { reason, .. }) => assert!(reason.contains("host-kernels"), "{reason}"),
        Err(e) => panic!("expected Unavailable, got {e}"),
        Ok(_) => panic!("a build without host-kernels made a host-device communicator"),
    }
}
