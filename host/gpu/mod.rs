//! Layer 3, the GPU wing: everything that talks to a CUDA driver, to device memory or to the
//! host device that stands in for one. Driver loading, streams and modules (`cuda/`), NVRTC
//! and the library's kernel image (`library.rs`), symmetric, multicast and pinned memory
//! (`memory/`), the host device (`host_device/`), the one device a backend drives whichever
//! it is (`target.rs`), handing segments to other processes (`segment_sharing.rs`), the typed
//! launch of every own kernel (`kernels.rs`), device-buffer views (`slice.rs`) and libnccl
//! (`nccl_library.rs`).
//!
//! May import: the contracts (layer 1), bootstrap and links (layer 2). Nothing outside this
//! folder calls a driver.

pub(crate) mod cuda;
pub(crate) mod fd_passing;
pub(crate) mod host_device;
pub(crate) mod kernels;
pub(crate) mod library;
pub(crate) mod memory;
pub(crate) mod nccl_library;
pub(crate) mod segment_sharing;
pub(crate) mod slice;
pub(crate) mod target;
