//! One declaration per kernel of kernels/: its name, its parameter list (a tuple type) and its
//! launch shape. The CUDA launcher and the host-device launcher both launch from these, so a
//! wrong argument or shape is wrong on both and the host device's tests catch it.

use crate::contracts::dtype::DType;
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Buf, BufMut, DeviceBytes};
use crate::contracts::window_handle::WindowHandle;
use crate::gpu::host_device;
use std::ffi::c_void;
use std::marker::PhantomData;

/// How many threads run a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// One thread: the verb is one release, acquire or atomic (applying it once per thread
    /// of a larger block would apply it many times).
    Thread,
    /// One block of this many threads (a barrier: every rank's one block meets).
    #[cfg_attr(not(all(test, feature = "host-kernels")), allow(dead_code))]
    Block(u32),
    /// Blocks chosen per launch, of this many threads each.
    Grid(u32),
}

/// A kernel (or, with a name suffix, a family such as `ferrocomm_allreduce_oneshot_{f32_sum}`)
/// taking the arguments `A`.
pub(crate) struct Kernel<A> {
    pub(crate) name: &'static str,
    pub(crate) shape: Shape,
    _args: PhantomData<fn(A)>,
}

impl<A> Kernel<A> {
    const fn new(name: &'static str, shape: Shape) -> Kernel<A> {
        Kernel {
            name,
            shape,
            _args: PhantomData,
        }
    }

    /// (grid, block) of a launch over `blocks` blocks (ignored unless the shape is a grid).
    pub(crate) fn dims(&self, blocks: u32) -> (u32, u32) {
        match self.shape {
            Shape::Thread => (1, 1),
            Shape::Block(t) => (1, t),
            Shape::Grid(t) => (blocks.max(1), t),
        }
    }
}

/// A kernel's parameter list: the values, in order, each of the C type of its parameter.
/// Implemented for tuples (of one to seven values) of plain numbers, `u64` device addresses
/// and `#[repr(C)]` structs such as [`WindowHandle`].
///
/// # Safety
/// Every element must have the layout and calling-convention class of the C parameter it
/// stands for; the tuple implementations are sound for the types named above, and a launch
/// is sound only if the kernel takes exactly those parameters.
pub unsafe trait KernelArgs: Copy + Send + 'static {
    /// The address of each value, as cuLaunchKernel reads them.
    #[doc(hidden)]
    fn param_addresses(&mut self) -> Vec<*mut c_void>;
    /// Calls the host-device function at `f` with the values.
    ///
    /// # Safety
    /// `f` takes exactly these parameters.
    #[doc(hidden)]
    unsafe fn call(&self, f: *const c_void);
}

macro_rules! kernel_args {
    ($($t:ident $i:tt),+) => {
        // SAFETY: the declarations below list exactly the kernels' C parameter types.
        unsafe impl<$($t: Copy + Send + 'static),+> KernelArgs for ($($t,)+) {
            fn param_addresses(&mut self) -> Vec<*mut c_void> {
                vec![$((&mut self.$i as *mut $t).cast()),+]
            }
            unsafe fn call(&self, f: *const c_void) {
                // SAFETY: the caller's contract: `f` takes exactly these parameters.
                let f: unsafe extern "C" fn($($t),+) = unsafe { std::mem::transmute(f) };
                // SAFETY: `f` is that function (above); the values are plain Copy data.
                unsafe { f($(self.$i),+) }
            }
        }
    };
}
kernel_args!(A 0);
kernel_args!(A 0, B 1);
kernel_args!(A 0, B 1, C 2);
kernel_args!(A 0, B 1, C 2, D 3);
kernel_args!(A 0, B 1, C 2, D 3, E 4);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5);
kernel_args!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);

/// kernels/collective.cuh's `Parts`: one device address per rank.
pub(crate) const MAX_RANKS: usize = 16;
/// kernels/collective.cuh's MAX_BLOCKS: the most blocks of a collective kernel's grid.
pub(crate) const MAX_BLOCKS: usize = 16;
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Parts {
    pub(crate) ptr: [u64; MAX_RANKS],
}

/// kernels/alltoall.cu's `AllToAll`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AllToAllArgs {
    pub(crate) send: [u64; MAX_RANKS],
    pub(crate) send_len: [u64; MAX_RANKS],
    pub(crate) recv: [u64; MAX_RANKS],
    pub(crate) recv_len: [u64; MAX_RANKS],
    pub(crate) region: u64,
    pub(crate) slot: u64,
}

const _: () = assert!(std::mem::size_of::<Parts>() == 8 * MAX_RANKS);
const _: () = assert!(std::mem::size_of::<AllToAllArgs>() == 8 * (4 * MAX_RANKS + 2));

/// kernels/moe.cu's `Args`: one layout for the four MoE kernels (unused fields 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MoeArgs {
    pub(crate) tokens: u64,
    pub(crate) scales: u64,
    pub(crate) idx: u64,
    pub(crate) weights: u64,
    pub(crate) out: u64,
    pub(crate) counts: u64,
    pub(crate) src: u64,
    pub(crate) n_tokens: u64,
    pub(crate) hidden: u64,
    pub(crate) topk: u64,
    pub(crate) experts: u64,
    pub(crate) local: u64,
    pub(crate) capacity: u64,
    pub(crate) row_bytes: u64,
    pub(crate) scale_bytes: u64,
    pub(crate) idx64: u64,
    pub(crate) dtype: u64,
    pub(crate) region: u64,
    pub(crate) slot: u64,
    pub(crate) header: u64,
    pub(crate) record: u64,
    pub(crate) rows: u64,
    pub(crate) errors: u64,
    pub(crate) outbox: u64,
    pub(crate) elem: u64,
    pub(crate) refuse: u64,
}

const _: () = assert!(std::mem::size_of::<MoeArgs>() == 8 * 26);

/// Threads per block of the collective kernels (their `__launch_bounds__`).
pub(crate) const COLLECTIVE_THREADS: u32 = 256;

/// The most threads per block the host device gives a grid-shaped kernel: the kernels work
/// with any multiple of the warp (every loop strides by blockDim), and two warps keep
/// intra-block and intra-warp paths covered without thousands of threads per launch. One-
/// thread and one-block shapes run exactly as declared.
pub(crate) const HOST_GRID_THREADS: u32 = 64;

// kernels/rma.cu. Pointers are u64 device addresses.
pub(crate) const SIGNAL: Kernel<(WindowHandle, i32, u32, u32, u64)> = Kernel::new("ferrocomm_signal", Shape::Thread);
pub(crate) const SIGNAL_FROM: Kernel<(WindowHandle, i32, u32, u32, u64)> =
    Kernel::new("ferrocomm_signal_from", Shape::Thread);
/// (handle, id, source, cmp, value, out)
pub(crate) const WAIT_SIGNAL: Kernel<(WindowHandle, u32, i32, u32, u64, u64)> =
    Kernel::new("ferrocomm_wait_signal", Shape::Thread);
// Launched by the host-device tests below; the bench and the GPU tests load them by name.
#[cfg_attr(not(all(test, feature = "host-kernels")), allow(dead_code))]
pub(crate) const BARRIER: Kernel<(WindowHandle,)> = Kernel::new("ferrocomm_barrier", Shape::Block(64));
/// (handle, peer, offset, value, out)
pub(crate) const FETCH_ADD: Kernel<(WindowHandle, i32, u64, u64, u64)> =
    Kernel::new("ferrocomm_fetch_add", Shape::Thread);
/// (handle, peer, offset, expected, desired, out)
pub(crate) const COMPARE_SWAP: Kernel<(WindowHandle, i32, u64, u64, u64, u64)> =
    Kernel::new("ferrocomm_compare_swap", Shape::Thread);
/// (handle, peer, dst_offset, src, bytes)
#[cfg_attr(not(all(test, feature = "host-kernels")), allow(dead_code))]
pub(crate) const PUT_BLOCKS: Kernel<(WindowHandle, i32, u64, u64, u64)> =
    Kernel::new("ferrocomm_put_blocks", Shape::Grid(256));

// kernels/oneshot.cu, twoshot.cu, multimem.cu: (handle, input, output, n, counters, vectors);
// families by the suffix of (dtype, op), e.g. `f32_sum`.
pub(crate) type ShotArgs = (WindowHandle, u64, u64, u64, u64, u32);
pub(crate) const ALL_REDUCE_ONESHOT: Kernel<ShotArgs> =
    Kernel::new("ferrocomm_allreduce_oneshot_", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const ALL_REDUCE_TWOSHOT: Kernel<ShotArgs> =
    Kernel::new("ferrocomm_allreduce_twoshot_", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const ALL_REDUCE_MULTIMEM: Kernel<ShotArgs> =
    Kernel::new("ferrocomm_allreduce_multimem_", Shape::Grid(COLLECTIVE_THREADS));
/// (handle, input, output parts, n bytes, counters, vectors)
pub(crate) const ALL_GATHER: Kernel<(WindowHandle, u64, Parts, u64, u64, u32)> =
    Kernel::new("ferrocomm_allgather_oneshot", Shape::Grid(COLLECTIVE_THREADS));
/// (handle, input parts, output, n, counters, vectors)
pub(crate) const REDUCE_SCATTER: Kernel<(WindowHandle, Parts, u64, u64, u64, u32)> =
    Kernel::new("ferrocomm_reducescatter_oneshot_", Shape::Grid(COLLECTIVE_THREADS));
/// (handle, parts, counters)
pub(crate) const ALL_TO_ALL: Kernel<(WindowHandle, AllToAllArgs, u64)> =
    Kernel::new("ferrocomm_alltoall", Shape::Grid(COLLECTIVE_THREADS));

/// kernels/fused_norm.cu's `NormArgs`: device addresses (`scales` 0 unless `out` is fp8), the
/// rows of one launch and elements per row, `vectors` where 16-byte accesses are allowed, the
/// rows of the whole call and the launch's index in it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormArgs {
    pub(crate) x: u64,
    pub(crate) residual: u64,
    pub(crate) gamma: u64,
    pub(crate) out: u64,
    pub(crate) scales: u64,
    pub(crate) rows: u64,
    pub(crate) hidden: u64,
    pub(crate) eps: f32,
    pub(crate) vectors: u32,
    /// Two u64 of device memory: the count of the blocks that found a mismatched call, then
    /// whether the call's first launch found one.
    pub(crate) mismatches: u64,
    pub(crate) call_rows: u64,
    pub(crate) launch: u64,
    /// Nonzero: this rank's host refused the call, and the launch only tells the peers.
    pub(crate) refused: u64,
}

const _: () = assert!(std::mem::size_of::<NormArgs>() == 96);

/// kernels/fused_norm.cu: (handle, args, counters); families by the suffix of (dtype, fp8
/// out), e.g. `bf16` or `bf16_fp8`.
pub(crate) type NormKernelArgs = (WindowHandle, NormArgs, u64);
pub(crate) const RMSNORM_ONESHOT: Kernel<NormKernelArgs> =
    Kernel::new("ferrocomm_rmsnorm_oneshot_", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const RMSNORM_TWOSHOT: Kernel<NormKernelArgs> =
    Kernel::new("ferrocomm_rmsnorm_twoshot_", Shape::Grid(COLLECTIVE_THREADS));

/// The fused norm's kernel families (kernels/fused_norm.cu's `FERROCOMM_FOR_EACH_NORM`, and
/// kernels/norm_pass.cu's residual + norm kernels): (activation dtype, fp8 out, suffix).
pub(crate) const NORM_SUFFIXES: [(DType, bool, &str); 6] = [
    (DType::F32, false, "f32"),
    (DType::F16, false, "f16"),
    (DType::BF16, false, "bf16"),
    (DType::F32, true, "f32_fp8"),
    (DType::F16, true, "f16_fp8"),
    (DType::BF16, true, "bf16_fp8"),
];

pub(crate) fn norm_suffix(dtype: DType, fp8: bool) -> Option<&'static str> {
    NORM_SUFFIXES.iter().find(|s| s.0 == dtype && s.1 == fp8).map(|s| s.2)
}

/// kernels/norm_pass.cu: (input, f32 output, elements); families by the input's suffix
/// (`f32`, `f16`, `bf16`).
pub(crate) const WIDEN: Kernel<(u64, u64, u64)> = Kernel::new("ferrocomm_widen_", Shape::Grid(COLLECTIVE_THREADS));

/// kernels/norm_pass.cu's `PassArgs`: device addresses (`sum` f32 rows, already all-reduced;
/// `scales` 0 unless `out` is fp8), rows and elements per row, `vectors` where 16-byte
/// accesses are allowed.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PassArgs {
    pub(crate) sum: u64,
    pub(crate) residual: u64,
    pub(crate) gamma: u64,
    pub(crate) out: u64,
    pub(crate) scales: u64,
    pub(crate) rows: u64,
    pub(crate) hidden: u64,
    pub(crate) eps: f32,
    pub(crate) vectors: u32,
}

const _: () = assert!(std::mem::size_of::<PassArgs>() == 64);

/// kernels/norm_pass.cu: (args); families by the fused norm's suffixes (`bf16`, `bf16_fp8`, ..).
pub(crate) const RESIDUAL_RMSNORM: Kernel<(PassArgs,)> =
    Kernel::new("ferrocomm_residual_rmsnorm_", Shape::Grid(COLLECTIVE_THREADS));

// kernels/moe.cu: (handle, args, counters). Sends run one block per destination rank,
// receives a fixed grid (host/backend/device/moe.rs).
pub(crate) const MOE_DISPATCH_SEND: Kernel<(WindowHandle, MoeArgs, u64)> =
    Kernel::new("ferrocomm_moe_dispatch_send", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const MOE_DISPATCH_RECV: Kernel<(WindowHandle, MoeArgs, u64)> =
    Kernel::new("ferrocomm_moe_dispatch_recv", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const MOE_COMBINE_SEND: Kernel<(WindowHandle, MoeArgs, u64)> =
    Kernel::new("ferrocomm_moe_combine_send", Shape::Grid(COLLECTIVE_THREADS));
pub(crate) const MOE_COMBINE_RECV: Kernel<(WindowHandle, MoeArgs, u64)> =
    Kernel::new("ferrocomm_moe_combine_recv", Shape::Grid(COLLECTIVE_THREADS));

/// A loaded kernel: a CUDA function, or a host-device function.
#[derive(Clone)]
pub(crate) enum Function {
    Cuda(cudarc::driver::CudaFunction),
    Host(host_device::Function),
}

/// Where a launch goes: a CUDA stream (raw handle) or a host-device stream.
#[derive(Clone, Copy)]
pub(crate) enum Queue<'a> {
    Cuda(cudarc::driver::sys::CUstream),
    Host(&'a host_device::Stream),
}

impl<A: KernelArgs> Kernel<A> {
    /// Enqueues `f` (this kernel, loaded) with `args` over `blocks` blocks (grid shapes only).
    pub(crate) fn launch(&self, f: &Function, queue: Queue<'_>, blocks: u32, mut args: A) -> Result<()> {
        let (grid, block) = self.dims(blocks);
        match (f, queue) {
            (Function::Cuda(f), Queue::Cuda(stream)) => {
                let mut params = args.param_addresses();
                // SAFETY: `params` points at values of the kernel's parameter types (the
                // declaration), alive across this call, which copies them.
                crate::gpu::cuda::check(&format!("cuLaunchKernel({})", self.name), unsafe {
                    cudarc::driver::sys::cuLaunchKernel(
                        f.cu_function(),
                        grid,
                        1,
                        1,
                        block,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                })
            }
            (Function::Host(f), Queue::Host(stream)) => {
                let block = match self.shape {
                    Shape::Grid(_) => block.min(HOST_GRID_THREADS),
                    _ => block,
                };
                let f = *f;
                stream.enqueue(move || run_on_host(f, grid, block, args));
                Ok(())
            }
            _ => Err(Error::invalid(
                "kernel launch",
                format!("{}: the kernel and the stream belong to different devices", self.name),
            )),
        }
    }
}

/// Runs one launch of `f` to completion on the host device.
pub(crate) fn run_on_host<A: KernelArgs>(f: host_device::Function, grid: u32, block: u32, args: A) -> Result<()> {
    extern "C" fn body<A: KernelArgs>(ctx: *mut c_void) {
        // SAFETY: ctx is the (function, args) pair below, alive until the launch returns.
        let (f, args) = unsafe { &*(ctx as *const (*const c_void, A)) };
        // SAFETY: `f` is the declared kernel, loaded from the host-device module.
        unsafe { args.call(*f) }
    }
    let mut ctx = (f.address, args);
    // SAFETY: `body::<A>` reads ctx only during the launch, which returns after every thread.
    unsafe {
        f.run(
            (grid, 1, 1),
            (block, 1, 1),
            0,
            body::<A>,
            (&mut ctx as *mut (*const c_void, A)).cast(),
        )
    }
}

/// Where the kernels find a buffer: its device memory, or on the host device its host memory
/// (the host device's memory).
pub(crate) fn reach(b: &Buf<'_>, host_device: bool) -> Option<DeviceBytes> {
    match b.device_bytes() {
        Some(d) => Some(d),
        None if host_device => {
            let bytes = b.host_bytes();
            Some(DeviceBytes {
                ordinal: 0,
                ptr: bytes.as_ptr() as u64,
                len: bytes.len(),
            })
        }
        None => None,
    }
}

/// As `reach`, for a buffer the kernels write (the address comes from a unique borrow).
pub(crate) fn reach_mut(b: &mut BufMut<'_>, host_device: bool) -> Option<DeviceBytes> {
    match b.device_bytes() {
        Some(d) => Some(d),
        None if host_device => {
            let bytes = b.host_bytes_mut();
            Some(DeviceBytes {
                ordinal: 0,
                ptr: bytes.as_mut_ptr() as u64,
                len: bytes.len(),
            })
        }
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_verb_kernels_run_on_one_thread() {
        // A signal, an atomic or a wait applied by every thread of a block would be applied
        // once per thread: their declarations are the single source of their launch shape.
        assert_eq!(SIGNAL.dims(7), (1, 1));
        assert_eq!(SIGNAL_FROM.dims(7), (1, 1));
        assert_eq!(WAIT_SIGNAL.dims(7), (1, 1));
        assert_eq!(FETCH_ADD.dims(7), (1, 1));
        assert_eq!(COMPARE_SWAP.dims(7), (1, 1));
        assert_eq!(ALL_REDUCE_ONESHOT.dims(3), (3, COLLECTIVE_THREADS));
    }

    /// Two ranks as threads on the host device, their segments side by side as a window
    /// lays them out (abi.h): the declared launches do what the verbs promise.
    #[cfg(feature = "host-kernels")]
    #[test]
    fn declared_launches_run_the_verbs_once_on_the_host_device() {
        use crate::gpu::host_device::{Segment, SegmentMap};
        use crate::gpu::memory::Pinned;
        let (data, signals, ranks) = (4096u64, 4u64, 2usize);
        let signal_offset = data;
        let barrier_offset = signal_offset + signals * ranks as u64 * 8;
        let bytes = (barrier_offset + (ranks as u64 + 1) * 8) as usize;
        let map = SegmentMap::new((0..ranks).map(|_| Some(Segment::create(bytes).unwrap())).collect()).unwrap();
        let status: Pinned<crate::contracts::window_handle::DeviceStatus> = Pinned::host(ranks);
        let out: Pinned<u64> = Pinned::host(ranks);
        let handle = |rank: usize| WindowHandle {
            base: map.base(),
            stride: map.stride() as u64,
            data_bytes: data,
            signal_offset,
            barrier_offset,
            status: status.device_addr() + (rank * 32) as u64,
            timeout_ns: 10_000_000_000,
            rank: rank as i32,
            size: ranks as i32,
            signals: signals as u32,
            ..Default::default()
        };
        let module = host_device::module().unwrap();
        let f = |k: &'static str| module.function(k).unwrap();
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        std::thread::scope(|s| {
            for rank in 0..ranks {
                let (h, out, src) = (handle(rank), out.device_addr() + 8 * rank as u64, &src);
                let f = &f;
                s.spawn(move || {
                    for _ in 0..3 {
                        let (grid, block) = FETCH_ADD.dims(3);
                        run_on_host(f(FETCH_ADD.name), grid, block, (h, 0i32, 64u64, 1u64, out)).unwrap();
                    }
                    if rank == 0 {
                        let (grid, block) = PUT_BLOCKS.dims(3);
                        let args = (h, 1i32, 128u64, src.as_ptr() as u64, 1000u64);
                        run_on_host(f(PUT_BLOCKS.name), grid, block.min(HOST_GRID_THREADS), args).unwrap();
                    }
                    let (grid, block) = BARRIER.dims(1);
                    run_on_host(f(BARRIER.name), grid, block, (h,)).unwrap();
                });
            }
        });
        for r in 0..ranks {
            assert_eq!(status.read(r).code, 0, "rank {r} recorded {:?}", status.read(r));
        }
        // SAFETY: inside rank 0's and rank 1's mapped segments; every launch has returned.
        unsafe {
            assert_eq!(
                *(map.addr(0, 64) as *const u64),
                6,
                "3 adds from each of 2 ranks, each once"
            );
            let got = std::slice::from_raw_parts(map.addr(1, 128) as *const u8, 1000);
            assert_eq!(got, &src[..], "put_blocks moved the bytes");
        }
    }
}
