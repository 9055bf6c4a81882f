//! Helpers shared by the integration tests: running N ranks, random data, host references.
#![allow(dead_code)]

pub mod gpu;
pub mod inference_suite;
pub mod owned_suite;
pub mod suite;
pub mod typed_window_suite;
pub mod window_suite;

pub use ferrocomm::prelude::*;
pub use ferrocomm::Observed;
use ferrocomm::{bf16, f16, F8E4M3, F8E5M2};
pub use rand::rngs::StdRng;
pub use rand::{Rng, SeedableRng};
use std::fmt::Debug;
pub use std::time::Duration;

/// Whether GPU 0 is usable; prints why a test skips when it is not. FERROCOMM_REQUIRE_GPU=1
/// turns the skip into a failure.
pub fn gpu_or_skip() -> bool {
    match ferrocomm::device::available(0) {
        Ok(()) => true,
        Err(e) => {
            assert_ne!(
                std::env::var("FERROCOMM_REQUIRE_GPU").as_deref(),
                Ok("1"),
                "FERROCOMM_REQUIRE_GPU=1 but {e}"
            );
            eprintln!("SKIPPED: no usable GPU: {e}");
            false
        }
    }
}

/// Runs `f(comm)` on each rank of an in-process group of `n`, one thread per rank; returns the
/// per-rank results in rank order. A panicking rank fails the test.
pub fn run_group<R: Send>(n: usize, name: &str, options: CommOptions, f: impl Fn(&Comm) -> R + Sync) -> Vec<R> {
    run_group_with("cpu", n, name, options, f)
}

/// `run_group` on a named backend with a 10 s timeout.
pub fn run_group_on<R: Send>(backend: &str, n: usize, name: &str, f: impl Fn(&Comm) -> R + Sync) -> Vec<R> {
    run_group_with(backend, n, name, options(Duration::from_secs(10)), f)
}

fn run_group_with<R: Send>(
    backend: &str,
    n: usize,
    name: &str,
    options: CommOptions,
    f: impl Fn(&Comm) -> R + Sync,
) -> Vec<R> {
    run_group_on_device(backend, Device::Cpu, n, name, options, f)
}

/// `run_group` on a named backend with every rank on `device`.
pub fn run_group_on_device<R: Send>(
    backend: &str,
    device: Device,
    n: usize,
    name: &str,
    options: CommOptions,
    f: impl Fn(&Comm) -> R + Sync,
) -> Vec<R> {
    let comms = Comm::new_group(backend, &vec![device; n], name, options).expect("new_group");
    std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter().map(|h| h.join().expect("rank panicked")).collect()
    })
}

pub fn options(timeout: Duration) -> CommOptions {
    CommOptions::from_env().expect("options").with_timeout(timeout)
}

/// `options(timeout)` with every rank on a "host" of its own: the TCP transport, and windows
/// reached through links, window servers and proxy queues.
pub fn tcp_options(timeout: Duration) -> CommOptions {
    let mut o = options(timeout);
    o.transport.force_tcp = true;
    o
}

/// A fresh seed for this run, printed so a failure can be replayed with FERROCOMM_TEST_SEED.
pub fn fresh_seed() -> u64 {
    let seed = std::env::var("FERROCOMM_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("seed = {seed} (replay with FERROCOMM_TEST_SEED={seed})");
    seed
}

pub fn rng(seed: u64, stream: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// An element type as the tests see it: random values, a poison value, and the reference
/// reduction (exact for integers, in f64 with a tolerance for floats).
pub trait TestElem: Element + PartialEq + Debug + Default {
    fn random(r: &mut StdRng, op: Option<ReduceOp>) -> Self;
    fn poison() -> Self;
    /// Checks `got` against the reduction of `vals` (one per rank) under `op`.
    fn check_reduced(vals: &[Self], op: ReduceOp, got: Self) -> Result<(), String>;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn random(r: &mut StdRng, _: Option<ReduceOp>) -> Self { r.gen() }
            fn poison() -> Self { <$t>::MAX.wrapping_sub(0x11) }
            fn check_reduced(vals: &[Self], op: ReduceOp, got: Self) -> Result<(), String> {
                let n = vals.len();
                let sum = |it: &mut dyn Iterator<Item = $t>| it.fold(0 as $t, |a, b| a.wrapping_add(b));
                let want: $t = match op {
                    ReduceOp::Sum => sum(&mut vals.iter().copied()),
                    ReduceOp::Prod => vals.iter().fold(1 as $t, |a, b| a.wrapping_mul(*b)),
                    ReduceOp::Min => *vals.iter().min().unwrap(),
                    ReduceOp::Max => *vals.iter().max().unwrap(),
                    ReduceOp::Avg => sum(&mut vals.iter().copied()).wrapping_div(n as $t),
                    ReduceOp::BAnd => vals.iter().fold(!0, |a, b| a & b),
                    ReduceOp::BOr => vals.iter().fold(0, |a, b| a | b),
                    ReduceOp::BXor => vals.iter().fold(0, |a, b| a ^ b),
                    ReduceOp::PremulSum(s) => sum(&mut vals.iter().map(|v| v.wrapping_mul(s as $t))),
                    _ => unreachable!(),
                };
                if got == want { Ok(()) } else { Err(format!("got {got}, want {want} (inputs {vals:?}, {op})")) }
            }
        }
    )*};
}
int_elem!(i8, u8, i16, u16, i32, i64, u32, u64);

impl TestElem for bool {
    fn random(r: &mut StdRng, _: Option<ReduceOp>) -> Self {
        r.gen()
    }
    /// Only two values: an output left unwritten shows up half the time.
    fn poison() -> Self {
        true
    }
    /// Logical, as torch reduces bool tensors: sum / max / bor are or, prod / min / band and.
    fn check_reduced(vals: &[Self], op: ReduceOp, got: Self) -> Result<(), String> {
        let want = match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => vals.iter().any(|&v| v),
            ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => vals.iter().all(|&v| v),
            ReduceOp::BXor => vals.iter().filter(|&&v| v).count() % 2 == 1,
            _ => unreachable!("{op} is not defined on bool"),
        };
        if got == want {
            Ok(())
        } else {
            Err(format!("got {got}, want {want} (inputs {vals:?}, {op})"))
        }
    }
}

macro_rules! float_elem {
    ($t:ty, $eps:expr, $to:expr, $from:expr) => {
        float_elem!($t, $eps, 1e-30, $to, $from);
    };
    // `$tiny`: the absolute error of one rounding near zero (half the smallest subnormal), for
    // types whose subnormals are coarse.
    ($t:ty, $eps:expr, $tiny:expr, $to:expr, $from:expr) => {
        impl TestElem for $t {
            fn random(r: &mut StdRng, op: Option<ReduceOp>) -> Self {
                // Products stay near 1 so eight ranks neither overflow nor underflow.
                let x: f64 = match op {
                    Some(ReduceOp::Prod) => r.gen_range(0.5..1.5),
                    _ => r.gen_range(-1.0..1.0),
                };
                $from(x)
            }
            fn poison() -> Self {
                $from(-12345.0)
            }
            fn check_reduced(vals: &[Self], op: ReduceOp, got: Self) -> Result<(), String> {
                let v: Vec<f64> = vals.iter().map(|x| $to(*x)).collect();
                let n = v.len() as f64;
                let (want, scale) = match op {
                    ReduceOp::Sum => (v.iter().sum::<f64>(), v.iter().map(|x| x.abs()).sum::<f64>()),
                    ReduceOp::Avg => (
                        v.iter().sum::<f64>() / n,
                        v.iter().map(|x| x.abs()).sum::<f64>() / n,
                    ),
                    ReduceOp::Prod => {
                        let p = v.iter().product::<f64>();
                        (p, p.abs())
                    }
                    ReduceOp::Min => (v.iter().cloned().fold(f64::INFINITY, f64::min), 0.0),
                    ReduceOp::Max => (v.iter().cloned().fold(f64::NEG_INFINITY, f64::max), 0.0),
                    ReduceOp::PremulSum(s) => (
                        v.iter().map(|x| x * s).sum::<f64>(),
                        v.iter().map(|x| (x * s).abs()).sum::<f64>(),
                    ),
                    _ => unreachable!(),
                };
                // Documented tolerance: each of the n-1 combining steps (and the final scale)
                // rounds once to the element type: |error| <= eps * (n + 2) * sum|x|.
                let tol = ($eps * scale + $tiny) * (n + 2.0);
                let g = $to(got);
                if (g - want).abs() <= tol {
                    Ok(())
                } else {
                    Err(format!("got {g}, want {want} ± {tol} (inputs {v:?}, {op})"))
                }
            }
        }
    };
}
float_elem!(f32, f32::EPSILON as f64, |x: f32| x as f64, |x: f64| x as f32);
float_elem!(f64, f64::EPSILON, |x: f64| x, |x: f64| x);
float_elem!(f16, 0.000977, |x: f16| x.to_f64(), f16::from_f64);
float_elem!(bf16, 0.0078125, |x: bf16| x.to_f64(), bf16::from_f64);
// fp8: 4 and 3 significant bits; subnormals in steps of 2^-9 and 2^-16.
float_elem!(F8E4M3, 0.0625, 1.0 / 1024.0, |x: F8E4M3| x.to_f32() as f64, |x: f64| {
    F8E4M3::from_f32(x as f32)
});
float_elem!(
    F8E5M2,
    0.125,
    1.0 / 131072.0,
    |x: F8E5M2| x.to_f32() as f64,
    |x: f64| F8E5M2::from_f32(x as f32)
);

pub const INT_OPS: [ReduceOp; 9] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
    ReduceOp::PremulSum(3.0),
];

pub const FLOAT_OPS: [ReduceOp; 6] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
    ReduceOp::PremulSum(0.5),
];

/// INT_OPS but for avg and premul_sum, which bool does not have.
pub const BOOL_OPS: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::BAnd,
    ReduceOp::BOr,
    ReduceOp::BXor,
];

pub fn ops_for<T: Element>() -> &'static [ReduceOp] {
    if T::DTYPE.is_float() {
        &FLOAT_OPS
    } else if T::DTYPE == DType::Bool {
        &BOOL_OPS
    } else {
        &INT_OPS
    }
}

pub fn random_vec<T: TestElem>(r: &mut StdRng, n: usize, op: Option<ReduceOp>) -> Vec<T> {
    (0..n).map(|_| T::random(r, op)).collect()
}

/// This test binary running only its ignored test `entry`, with none of the caller's job
/// variables: each test sets the job environment it means to test.
pub fn test_entry_command(entry: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().expect("test binary"));
    c.args(["--ignored", "--exact", entry, "--nocapture", "--test-threads=1"]);
    for k in job_variables(std::env::vars().map(|(k, _)| k)) {
        c.env_remove(k);
    }
    c
}

/// The variables of `names` that describe a job (rank, store, launcher, ferrocomm settings).
/// Where libraries are (FERROCOMM_NVRTC_PATH, FERROCOMM_NCCL_PATH) is not a job setting: a
/// child that lost them would not find NVRTC or NCCL where the machine keeps them elsewhere.
pub fn job_variables(names: impl Iterator<Item = String>) -> Vec<String> {
    const JOB_VARS: [&str; 6] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ];
    const JOB_PREFIXES: [&str; 5] = ["FERROCOMM_", "OMPI_COMM_WORLD_", "PMI_", "SLURM_", "MPI_LOCALRANKID"];
    const LIBRARY_VARS: [&str; 2] = ["FERROCOMM_NVRTC_PATH", "FERROCOMM_NCCL_PATH"];
    names
        .filter(|k| JOB_VARS.contains(&k.as_str()) || JOB_PREFIXES.iter().any(|p| k.starts_with(p)))
        .filter(|k| !LIBRARY_VARS.contains(&k.as_str()))
        .collect()
}

/// `n` ranks started straight from this test binary (no launcher), with a store server of
/// their own.
pub struct DirectJob {
    pub server: ferrocomm::TcpStoreServer,
    pub ranks: Vec<std::process::Child>,
}

/// Starts `n` ranks of the ignored test `entry` with the launcher variables set and `envs`.
pub fn start_direct(entry: &str, n: usize, envs: &[(&str, &str)]) -> DirectJob {
    let token = ferrocomm::random_token().unwrap();
    let server = ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token).expect("store server");
    let port = server.addr().port().to_string();
    let ranks = (0..n)
        .map(|r| {
            let (r, n) = (r.to_string(), n.to_string());
            test_entry_command(entry)
                .envs([
                    ("RANK", r.as_str()),
                    ("WORLD_SIZE", n.as_str()),
                    ("LOCAL_RANK", r.as_str()),
                ])
                .envs([
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", port.as_str()),
                    ("FERROCOMM_TOKEN", token.as_str()),
                ])
                .env("FERROCOMM_STORE_EXTERNAL", "1")
                .envs(envs.iter().copied())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    DirectJob { server, ranks }
}

/// Waits for `c` until `deadline` (killing it then); returns its exit status (`None` if it had
/// to be killed), its stdout, and when it ended.
pub fn wait_child(
    mut c: std::process::Child,
    deadline: std::time::Instant,
) -> (Option<std::process::ExitStatus>, String, std::time::Instant) {
    use std::io::Read;
    let status = loop {
        if let Some(s) = c.try_wait().expect("try_wait") {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let ended = std::time::Instant::now();
    let mut out = String::new();
    if let Some(mut o) = c.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    (status, out, ended)
}

/// Every rank's window of `bytes`, made at once (window creation is collective).
pub fn windows_on(comms: &[Comm], bytes: usize) -> Vec<ferrocomm::Window<'_>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| s.spawn(move || c.new_window(bytes).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `rounds` random all_to_all_v plans for `world` ranks: `[round][from][to]` element counts,
/// a quarter each empty, small, medium and drawn from `large`.
pub fn random_all_to_all_counts(
    seed: u64,
    world: usize,
    rounds: u64,
    large: std::ops::Range<usize>,
) -> Vec<Vec<Vec<usize>>> {
    (0..rounds)
        .map(|k| {
            let mut g = rng(seed ^ 0xa2a, k);
            (0..world)
                .map(|_| {
                    (0..world)
                        .map(|_| match g.gen_range(0..4) {
                            0 => 0,
                            1 => g.gen_range(1..64),
                            2 => g.gen_range(64..20_000),
                            _ => g.gen_range(large.clone()),
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// (send, receive) element counts of a two-rank all_to_all_v whose parts do not pair up:
/// rank 1 expects 12 elements from rank 0, which sends 10.
pub fn mismatched_all_to_all_v_counts(rank: usize) -> ([usize; 2], [usize; 2]) {
    if rank == 0 {
        ([4, 10], [4, 4])
    } else {
        ([4, 4], [12, 4])
    }
}
