//! A user kernel that computes a tile, puts it into its right neighbour's window and signals
//! it, all without leaving the kernel: compute and communication fused. Ranks are streams of
//! one process on GPU 0 (`FERROCOMM_EXAMPLE_RANKS`, default 2). The kernel is compiled at run
//! time with NVRTC, with ferrocomm's device API headers available to it.
//!
//! Without a GPU it prints why and exits successfully. It is GPU-only: the host device has no
//! run-time compiler for users' kernels. The verbs it uses (put_signal, wait_signal, signal at
//! block scope) run on the host device in tests/host-device/kernel_driver.cpp's ring kernels.

use ferrocomm::device::cudarc::driver::{LaunchConfig, PushKernelArg};
use ferrocomm::device::{self, CompileOptions};
use ferrocomm::prelude::*;

const KERNEL: &str = r#"
#include "ferrocomm/ferrocomm.cuh"
using namespace ferrocomm;

// Step s: fill `tile` with this rank's values, wait until the right neighbour consumed step
// s - 1 (signal 1), put the tile there and release signal 0 = s + 1 in one call; then wait for
// the left neighbour's tile, fold it into `checksum`, and tell the left it may send again.
extern "C" __global__ void fused_put_signal(ferrocomm_window_handle h, float* tile, unsigned n,
                                            unsigned steps, double* checksum) {
  Window w(h);
  CoopBlock b = coop_block();
  const int right = (w.rank() + 1) % w.size(), left = (w.rank() + w.size() - 1) % w.size();
  for (unsigned s = 0; s < steps; ++s) {
    for (unsigned i = b.thread_rank(); i < n; i += b.size()) tile[i] = (w.rank() + 1) * (i % 97 + s);
    if (s > 0 && !w.wait_signal(b, 1, right, Cmp::Ge, s).ok) return;
    w.put_signal(b, right, 0, tile, n * sizeof(float), 0, SignalOp::Set, s + 1);
    if (!w.wait_signal(b, 0, left, Cmp::Ge, s + 1).ok) return;
    const float* in = w.local_ptr<float>(0);
    double part = 0;
    for (unsigned i = b.thread_rank(); i < n; i += b.size()) part += in[i];
    atomicAdd(checksum, part);
    w.signal(b, left, 1, SignalOp::Set, s + 1);
  }
}
"#;

fn main() -> ferrocomm::Result<()> {
    if let Err(e) = device::available(0) {
        println!("SKIPPED: fused_put_signal needs a CUDA GPU: {e}");
        return Ok(());
    }
    let n_ranks: usize = std::env::var("FERROCOMM_EXAMPLE_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let (n, steps) = (1u32 << 16, 20u32);
    let module = device::compile(0, KERNEL, &CompileOptions::default())?;
    let comms = Comm::new_group(
        "device",
        &vec![Device::Cuda(0); n_ranks],
        "fused",
        CommOptions::from_env()?,
    )?;
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|c| {
                let module = module.clone();
                s.spawn(move || -> ferrocomm::Result<()> {
                    let w = c.new_window(n as usize * 4)?;
                    let stream = w.stream()?;
                    let handle = w.device_handle()?;
                    let cuda = |e: ferrocomm::device::cudarc::driver::DriverError| ferrocomm::Error::Backend {
                        backend: "cuda".into(),
                        call: "example".into(),
                        message: format!("{e:?}"),
                    };
                    let f = module.load_function("fused_put_signal").map_err(cuda)?;
                    let tile = stream.alloc_zeros::<f32>(n as usize).map_err(cuda)?;
                    let sum = stream.alloc_zeros::<f64>(1).map_err(cuda)?;
                    let mut launch = stream.launch_builder(&f);
                    launch.arg(&handle).arg(&tile).arg(&n).arg(&steps).arg(&sum);
                    let cfg = LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: the arguments match the kernel's parameters in order and type.
                    unsafe { launch.launch(cfg) }.map_err(cuda)?;
                    w.synchronize()?;
                    let got = stream.clone_dtoh(&sum).map_err(cuda)?[0];
                    // Every value is an integer below 2^24, so the float sums are exact.
                    let left = (c.rank() + c.size() - 1) % c.size();
                    let want: f64 = (0..steps)
                        .map(|s| (0..n).map(|i| ((left + 1) as f64) * ((i % 97 + s) as f64)).sum::<f64>())
                        .sum();
                    println!(
                        "rank {}: checksum of rank {left}'s tiles {got} (expected {want})",
                        c.rank()
                    );
                    assert_eq!(got, want, "rank {}: wrong data from rank {left}", c.rank());
                    w.barrier()
                })
            })
            .collect();
        ranks.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| {
                Err(ferrocomm::Error::InvalidArgument {
                    op: "example",
                    reason: "a rank panicked".into(),
                })
            })
        })
    })
}
