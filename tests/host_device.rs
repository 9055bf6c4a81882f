//! The device backend on the host device (`Device::Host`): ferrocomm's kernels on CPU threads,
//! driven by the backend's own host code, checked against the same contracts as the CPU
//! backend. Needs the `host-kernels` feature; without it, `Device::Host` is `Unavailable`,
//! which the last test checks.

mod common;
use common::*;

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
        common::suite::run_all(&c, seed);
        println!("rank {} ok", c.rank());
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
