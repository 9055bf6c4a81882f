//! A user kernel that computes a tile, puts it into its right neighbour's window and signals
//! it, all without leaving the kernel: compute and communication fused. Ranks are threads of
//! one process (`FERROCOMM_EXAMPLE_RANKS`, default 2) on GPU 0, or on the host device where
//! there is no GPU (or with `FERROCOMM_EXAMPLE_DEVICE=host`). The kernel is compiled at run
//! time, with ferrocomm's device API headers available to it: by NVRTC for the GPU, by the
//! system C++ compiler for the host device.
//!
//! With neither (no GPU, and a build without the `host-kernels` feature) it prints why and
//! exits successfully.

use ferrocomm::device::cudarc::driver::{LaunchConfig, PushKernelArg};
use ferrocomm::device::{self, CompileOptions, HostModule};
use ferrocomm::prelude::*;
use std::sync::Arc;

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
    // The put's threads copy other elements than each wrote: the whole tile first (at step 0
    // no wait below would sync the block).
    b.sync();
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

/// The kernel, compiled for the device the ranks run on.
enum Kernel {
    Cuda(Arc<ferrocomm::device::cudarc::driver::CudaModule>),
    Host(HostModule),
}

fn main() -> ferrocomm::Result<()> {
    // The library installs no log subscriber: FERROCOMM_LOG=debug shows its events through this one.
    ferrocomm::init_logging()?;
    let n_ranks: usize = std::env::var("FERROCOMM_EXAMPLE_RANKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let want_host = std::env::var("FERROCOMM_EXAMPLE_DEVICE").as_deref() == Ok("host");
    let (device, kernel) = match device::available(0) {
        Ok(()) if !want_host => (
            Device::Cuda(0),
            Kernel::Cuda(device::compile(0, KERNEL, &CompileOptions::default())?),
        ),
        gpu => {
            // The host device needs the library's host kernels as well as a C++ compiler.
            if let Err(e) = Comm::new_group("device", &[Device::Host(0)], "probe", CommOptions::from_env()?) {
                println!("SKIPPED: fused_put_signal needs a CUDA GPU ({gpu:?}) or the host device ({e})");
                return Ok(());
            }
            (
                Device::Host(0),
                Kernel::Host(device::compile_host(KERNEL, &CompileOptions::default())?),
            )
        }
    };
    println!("fused_put_signal: {n_ranks} ranks on {device:?}");
    let comms = Comm::new_group("device", &vec![device; n_ranks], "fused", CommOptions::from_env()?)?;
    std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .map(|c| {
                let kernel = &kernel;
                s.spawn(move || rank(c, kernel))
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

/// One rank: runs the kernel (one block of 256 threads) and checks the checksum of what its
/// left neighbour sent.
fn rank(c: &Comm, kernel: &Kernel) -> ferrocomm::Result<()> {
    let (n, steps) = (1u32 << 16, 20u32);
    let w = c.new_window(n as usize * 4)?;
    let handle = w.device_handle()?;
    let got = match kernel {
        Kernel::Cuda(module) => {
            let stream = w.stream()?;
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
            stream.clone_dtoh(&sum).map_err(cuda)?[0]
        }
        Kernel::Host(module) => {
            let mut tile = vec![0f32; n as usize];
            let mut sum = 0f64;
            let args = (handle, tile.as_mut_ptr() as u64, n, steps, &mut sum as *mut f64 as u64);
            // SAFETY: the arguments match the kernel's parameters in order and type; `tile`
            // and `sum` outlive the launch, which returns when the kernel has.
            unsafe { module.launch("fused_put_signal", 1, 256, args) }?;
            w.synchronize()?;
            sum
        }
    };
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
}
