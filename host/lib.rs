//! # ferrocomm
//!
//! Device-centric communication for Rust: every collective behind one communicator API, a CPU
//! backend with the same semantics as the GPU ones, and the bootstrap (store, rank discovery,
//! launcher) to run N ranks as threads, processes or hosts.
//!
//! ## Quick start
//!
//! ```
//! use ferrocomm::prelude::*;
//!
//! // Four ranks in this process (one thread each), on the CPU backend.
//! let comms = Comm::new_group("cpu", &[Device::Cpu; 4], "quick", CommOptions::from_env()?)?;
//! std::thread::scope(|s| {
//!     let ranks: Vec<_> = comms
//!         .iter()
//!         .map(|c| {
//!             s.spawn(move || -> ferrocomm::Result<()> {
//!                 let mut x = vec![c.rank() as f32 + 1.0; 8];
//!                 c.all_reduce(&mut x, ReduceOp::Sum)?;
//!                 assert_eq!(x, vec![10.0; 8]);
//!                 Ok(())
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().try_for_each(|h| h.join().unwrap())
//! })?;
//! # Ok::<(), ferrocomm::Error>(())
//! ```
//!
//! Across processes, start the program with `ferrocomm-run -n 4 -- prog` (or torchrun, srun,
//! mpirun) and call [`new_comm`]`("cpu", Device::Cpu, "world", CommOptions::from_env()?)`;
//! [`new_comm`] lists the variables the launcher sets. The [`Collectives`] trait has every
//! collective and point-to-point call, [`Comm::split`] makes sub-communicators.
//!
//! ## Cargo features
//!
//! | feature | what it adds | needs |
//! |---|---|---|
//! | `log-subscriber` | `ferrocomm::init_logging()`: a stderr `tracing` subscriber filtered by `FERROCOMM_LOG`, for applications without one of their own (the library never installs one) | — |
//! | `host-kernels` | the host device, `Device::Host(i)`: the `device` backend and its kernels on CPU threads, no GPU needed | a C++20 compiler at build time |
//! | `rdma` | RDMA verbs for window operations toward other hosts (`FERROCOMM_NET`) | rdma-core's libibverbs and libclang at build time |
//! | `fuzzing` | `fuzzing::store_request`, the store protocol's entry point for `fuzz/` | — |
//!
//! Without a feature the library needs no system library at build time; the CUDA driver,
//! NVRTC and NCCL are loaded at run time where a backend needs them.
//!
//! ## Windows
//!
//! [`Comm::new_window`] creates symmetric memory with one-sided [`Window::put`],
//! [`Window::get`], [`Window::signal`] / [`Window::wait_signal`] and atomics; the ordering
//! contract is `docs/memory-model.md`. [`Comm::new_typed_window`] (or [`Window::typed`]) gives a
//! [`TypedWindow`] of elements, with element offsets, atomics on `u64`/`i64` elements and
//! [`TypedWindow::map_remote`], a peer's segment borrowed in place where it is mapped here.
//!
//! ## GPU windows
//!
//! The `device` backend ([`Device::Cuda`]) allocates windows in GPU memory; kernels take
//! [`Window::device_handle`] by value and use the device API of `device-api/`. See [`device`]
//! for compiling kernels with NVRTC. Without a CUDA driver or GPU it returns
//! `Error::Unavailable`.
//!
//! ## Device buffers and NCCL
//!
//! Collectives take host slices or [`device::DeviceSlice`] / [`device::DeviceSliceMut`] views
//! of GPU memory. On device buffers a synchronous call is enqueued on the thread's current
//! stream ([`device::use_stream`]); the `nccl` backend runs them through libnccl, loaded at
//! run time, and the `device` backend hands them to NCCL where it can.
//!
//! ## Asynchronous operations
//!
//! [`Comm::owned`] has every call in a form that takes its buffers by value ([`OwnedBuffer`]:
//! `Vec<T>`, `Box<[T]>`, cudarc device memory) and returns a [`Work`]: store it, move it to
//! another thread, poll it, and get the buffers back from [`Work::wait`]; [`Comm::start`] runs
//! any calls on owned buffers as one `Work`. [`Comm::scope`] hands out a scope whose calls
//! borrow their buffers and return a [`ScopedWork`]; the scope waits for every operation
//! before it returns, so the compiler proves the buffers outlive the work.
//!
//! ## Environment variables
//!
//! | variable | meaning |
//! |---|---|
//! | `FERROCOMM_TIMEOUT` | default timeout of every operation, seconds (600) |
//! | `FERROCOMM_TOKEN` | job secret the TCP store demands (ferrocomm-run sets it) |
//! | `FERROCOMM_STORE` | `tcp://host:port` or `file:///dir`; else `MASTER_ADDR`/`MASTER_PORT` |
//! | `FERROCOMM_STORE_EXTERNAL` | `1`: a launcher hosts the store, rank 0 must not |
//! | `FERROCOMM_TRANSPORT` | `auto` (shared memory on one host, TCP between hosts) or `tcp` |
//! | `FERROCOMM_SHM_RING_BYTES` | bytes of each shared-memory ring (1 MiB) |
//! | `FERROCOMM_SOCKET_ADDR` | address to bind TCP links on |
//! | `FERROCOMM_NET` | window operations toward other hosts: `auto` (RDMA between ranks that both open a device, where built with the `rdma` feature; else TCP), `tcp` or `rdma` (an error where a rank cannot) |
//! | `FERROCOMM_PROXY_POLL_US` | how long a window's proxy thread spins after its last queued descriptor before it sleeps, µs (2000 on hosts of 4+ cores, else 0) |
//! | `FERROCOMM_CPU_DIRECT_MAX` | largest per-rank message sent directly, bytes (64 KiB) |
//! | `FERROCOMM_CPU_CHUNK` | broadcast pipelining chunk, bytes (256 KiB) |
//! | `FERROCOMM_LOG` | log filter, e.g. `debug`, for the subscriber `init_logging` installs (feature `log-subscriber`); the library installs none |
//! | `FERROCOMM_NVRTC_PATH` | libnvrtc.so.13 (or its folder) for run-time kernel compilation |
//! | `CUDA_HOME` | CUDA root: nvcc at build time, NVRTC at run time |
//! | `CUDA_DEVICE_MAX_CONNECTIONS` | CUDA's hardware queues per context; ferrocomm sets 32 before it initialises CUDA unless set (ranks sharing a GPU in one process need their streams on separate queues) |
//! | `FERROCOMM_NCCL_PATH` | libnccl.so.2 (or its folder); when set, the only place searched |
//! | `FERROCOMM_NCCL` | `0`: the device backend does not use NCCL |
//! | `FERROCOMM_NCCL_THRESHOLD` | smallest message the device backend sends to NCCL when it has its own kernel, bytes (256K) |
//! | `FERROCOMM_DEVICE_ONESHOT_MAX` | largest per-rank message of the device backend's one- and two-shot kernels, bytes (1M) |
//! | `FERROCOMM_DEVICE_TWOSHOT_MIN` | smallest all_reduce message of the device backend's two-shot kernel, bytes (128K) |
//! | `FERROCOMM_MULTICAST` | `0`: device windows make no multicast object (multimem off) |
//! | `FERROCOMM_PROXY_AFFINITY` | `0`: a device window's proxy thread runs on any CPU (default: the CPUs local to its GPU) |
//! | `FERROCOMM_CHECK_CALLS` | `1`: the ranks compare their whole calls before every operation (v-form counts included) |
//! | `FERROCOMM_ABORT_ON_ERROR` | `off`, `comm` or `process`: what an operation failing with a timeout, a lost peer or a mismatch does beyond returning its error |
//! | `FERROCOMM_RUN_GRACE` | seconds `ferrocomm-run` gives ranks between a forwarded SIGTERM/SIGINT and SIGKILL (5) |
//! | `FERROCOMM_RUN_TOLERATE_FAILURES` | ranks that may fail while `ferrocomm-run` lets the others go on; `--tolerate-failures` overrides it (0) |
//! | `FERROCOMM_REQUIRE_NVCC`, `FERROCOMM_REQUIRE_NVRTC`, `FERROCOMM_REQUIRE_NCCL`, `FERROCOMM_REQUIRE_GPU` | `1`: fail instead of skipping where nvcc, NVRTC, NCCL or a GPU is missing |
//!
//! ## Threads and clean-up
//!
//! A [`Comm`] is `Send + Sync`; calls from several threads run one at a time in issue order.
//! Dropping the last clone closes the rank (peers still waiting on it get `Error::PeerLost`);
//! [`Comm::finalize`] closes it explicitly, [`Comm::abort`] fails its running operation at once.

// On docs.rs (nightly rustdoc, `--cfg docsrs`): items behind a cargo feature say which.
#![cfg_attr(docsrs, feature(doc_cfg))]

// The README's code blocks are compiled and run as doctests of this empty module (only under
// `cfg(doctest)`, so it never exists in a build or in the rendered docs). The README is not the
// crate documentation itself (`#![doc = include_str!("../README.md")]`): it is the project's
// page (status, tests, benchmarks, layout), with links relative to the repository that would
// break on docs.rs, while the crate docs above stay an overview of the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme_doctests {}

// Layers, bottom up (docs/architecture.md; tests/layering.rs checks them): contracts;
// bootstrap and net::links; gpu; net::windows; backend; the public face (the files below
// `mod backend;`), which reaches the backends only through backend::registry.
mod contracts;
// Layer 1: host arithmetic of the inference collectives.
mod compute;

mod bootstrap;

mod gpu;
pub mod net;

mod backend;

mod buffer;
mod call_check;
mod collectives;
mod comm;
pub mod device;
mod executor;
mod inference;
#[cfg(feature = "log-subscriber")]
mod logging;
mod mapped_segment;
mod objects;
mod owned;
mod owned_work;
mod shrink;
mod shrink_links;
mod typed_window;
mod window;
mod work;

pub use backend::registry::{backend_factory, backend_names, register_backend};
pub use bootstrap::{
    bind_to_core, cores_for_ranks, discover, random_token, store_addr, store_from_env, FileStore, MemoryStore,
    PrefixStore, RankInfo, StoreAddr, TcpStore, TcpStoreServer, DEFAULT_MAX_FRAME,
};
pub use collectives::{Batch, Collectives, WithOptions};
pub use contracts::backend::{Backend, BackendFactory, BackendInit, LentLinks, LinkLedger, RunOptions};
pub use contracts::store::Store;

/// Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`).
#[cfg(feature = "fuzzing")]
pub mod fuzzing {
    pub use crate::bootstrap::fuzz_one_request as store_request;
}
pub use buffer::{InputBuffer, OutputBuffer, OwnedBuffer};
pub use comm::{new_comm, Comm};
pub use contracts::config::parse_bytes;
pub use contracts::dtype::{DType, Element, ReduceOp};
pub use contracts::error::{Error, Result};
pub use contracts::fence::{Fence, FenceSlot};
pub use contracts::inference::{
    CombineRecv, CombineSend, DispatchRecv, DispatchSend, MoeCombine, MoeDispatch, MoeShape, RmsNormFusion, FP8_BLOCK,
};
pub use contracts::ops::{Buf, BufMut, DeviceBytes, Location, Op, P2p};
pub use contracts::options::{
    default_timeout, AbortOnError, CommOptions, Encrypt, NetTransport, OpOptions, TransportOptions,
};
pub use contracts::placement::Device;
pub use contracts::window::{Cmp, Observed, SignalOp, SignalSource, WindowBackend, WindowOptions, WindowSpec};
pub use inference::{Combine, Dispatch};
#[cfg(feature = "log-subscriber")]
pub use logging::init_logging;
pub use mapped_segment::MappedSegment;
pub use owned::{Owned, OwnedBatch};
pub use owned_work::{Starter, Work};
pub use typed_window::{AtomicElement, TypedWindow};
pub use window::Window;
pub use work::{Scope, ScopedWork};

pub use contracts::fp8::{F8E4M3, F8E5M2};
pub use half::{bf16, f16};

/// The names most programs need.
pub mod prelude {
    pub use crate::{
        new_comm, Cmp, Collectives, Comm, CommOptions, DType, Device, Element, OpOptions, OwnedBuffer, ReduceOp,
        SignalOp, SignalSource, TypedWindow, Window, WindowOptions, Work,
    };
}
