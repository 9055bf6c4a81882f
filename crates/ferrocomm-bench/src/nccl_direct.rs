//! `nccl_all_reduce`: ferrocomm's NCCL path against calling NCCL directly, same library, same
//! GPU, same buffer and stream, world size 1, in one run. The difference is ferrocomm's
//! per-call overhead (validation, issue order, the watchdog's event).
//!
//! The direct calls use their own few NCCL bindings on purpose: they measure NCCL without any
//! of ferrocomm in the way.

use crate::cli::Args;
use crate::progress::Progress;
use ferrocomm::device::cudarc::driver::{CudaStream, DevicePtr};
use ferrocomm::device::{self, DeviceSliceMut};
use ferrocomm::prelude::*;
use ferrocomm::{Error, Result};
use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Instant;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([u8; 128]);

type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, *mut c_void, *mut c_void) -> c_int;

/// A one-rank NCCL communicator made with plain `ncclCommInitRank`.
pub(crate) struct Direct {
    comm: *mut c_void,
    all_reduce: AllReduce,
    destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    _lib: libloading::Library,
}

fn failed(call: &str, r: c_int) -> Error {
    Error::Backend {
        backend: "nccl (direct)".into(),
        call: call.into(),
        message: format!("ncclResult {r}"),
    }
}

/// ncclDataType_t codes.
pub(crate) const NCCL_FLOAT32: c_int = 7;
pub(crate) const NCCL_BFLOAT16: c_int = 9;

impl Direct {
    /// In-place sum of `count` elements of `dtype` (an ncclDataType_t) at `ptr` on `stream`.
    pub(crate) fn all_reduce(&self, ptr: u64, count: usize, dtype: c_int, stream: &CudaStream) -> Result<()> {
        let p = ptr as *mut c_void;
        // SAFETY: the caller passes a device buffer of `count` elements; sum is op 0.
        let r = unsafe { (self.all_reduce)(p, p, count, dtype, 0, self.comm, stream.cu_stream().cast()) };
        if r == 0 {
            Ok(())
        } else {
            Err(failed("ncclAllReduce", r))
        }
    }

    pub(crate) fn new() -> Result<Direct> {
        let path = device::nccl_library()?.path;
        let sym = |e: libloading::Error| Error::Config(format!("NCCL direct bindings: {e}"));
        // SAFETY: loading NCCL runs no code of consequence; symbols match nccl.h.
        unsafe {
            let lib = libloading::Library::new(&path).map_err(sym)?;
            let get_id: unsafe extern "C" fn(*mut UniqueId) -> c_int = *lib.get(b"ncclGetUniqueId\0").map_err(sym)?;
            let init: unsafe extern "C" fn(*mut *mut c_void, c_int, UniqueId, c_int) -> c_int =
                *lib.get(b"ncclCommInitRank\0").map_err(sym)?;
            let all_reduce: AllReduce = *lib.get(b"ncclAllReduce\0").map_err(sym)?;
            let destroy = *lib.get(b"ncclCommDestroy\0").map_err(sym)?;
            let mut id = UniqueId([0; 128]);
            let r = get_id(&mut id);
            if r != 0 {
                return Err(failed("ncclGetUniqueId", r));
            }
            let mut comm = std::ptr::null_mut();
            let r = init(&mut comm, 1, id, 0);
            if r != 0 {
                return Err(failed("ncclCommInitRank", r));
            }
            Ok(Direct {
                comm,
                all_reduce,
                destroy,
                _lib: lib,
            })
        }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        // SAFETY: our communicator, used by nothing else now.
        unsafe { (self.destroy)(self.comm) };
    }
}

/// Runs `nccl_all_reduce` on GPU 0 and prints its table.
pub fn run(a: &Args) -> Result<()> {
    let stream: Arc<CudaStream> = device::new_stream(0)?;
    let comm = Comm::new_group("nccl", &[Device::Cuda(0)], "bench-nccl", CommOptions::from_env()?)?
        .pop()
        .expect("one rank");
    let direct = Direct::new()?;
    let max = a.max_bytes.max(4);
    let buf = stream
        .alloc_zeros::<f32>(max / 4)
        .map_err(|e| Error::Config(format!("alloc: {e:?}")))?;
    let (ptr, _sync) = buf.device_ptr(&stream);
    let _current = device::use_stream(&stream);
    let sync = || stream.synchronize().map_err(|e| Error::Config(format!("sync: {e:?}")));
    println!(
        "# ferrocomm-bench nccl_all_reduce: f32 sum, world 1, GPU 0, {} iterations; {:?}",
        a.iters,
        device::nccl_library()?
    );
    println!(
        "#{:>11} {:>12} {:>12} {:>13} {:>9}",
        "size(B)", "direct(us)", "ferrocomm(us)", "overhead(us)", "overhead"
    );
    // f32: whole elements.
    let sizes = crate::size::sweep(a.min_bytes.max(4), max, a.factor);
    let progress = Progress::new(&a.op, sizes.len(), true);
    for bytes in sizes {
        progress.start_size(bytes);
        let count = bytes / 4;
        let ours = || -> Result<()> {
            // SAFETY: `buf` holds at least `count` f32 on GPU 0 and outlives the call.
            let view = unsafe { DeviceSliceMut::<f32>::from_raw(0, ptr, count) }?;
            comm.all_reduce(view, ReduceOp::Sum)
        };
        let theirs = || direct.all_reduce(ptr, count, NCCL_FLOAT32, &stream);
        let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
            for _ in 0..a.warmup {
                f()?;
            }
            sync()?;
            let t0 = Instant::now();
            for _ in 0..a.iters {
                f()?;
            }
            sync()?;
            Ok(t0.elapsed().as_secs_f64() * 1e6 / a.iters as f64)
        };
        // Twice each, interleaved, so drift hits both alike; the better of two is reported.
        let (d1, o1, d2, o2) = (time(&theirs)?, time(&ours)?, time(&theirs)?, time(&ours)?);
        let (d, o) = (d1.min(d2), o1.min(o2));
        progress.print_row(&format!(
            "{:>12} {:>12.2} {:>12.2} {:>13.2} {:>8.1}%",
            bytes,
            d,
            o,
            o - d,
            (o - d) / d * 100.0
        ));
    }
    Ok(())
}
