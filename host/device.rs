//! The GPU side, as users see it: compile kernels that use the device API, load the library's
//! own kernels, the ABI structs kernels receive, device-buffer views and the current stream.
//! Everything here needs the CUDA driver at run time and returns `Error::Unavailable` without
//! it; [`compile_image`] needs only NVRTC (no GPU). The code lives in the GPU wing
//! (crate::gpu); this module only names what is public.
//!
//! Kernels are launched with cudarc (re-exported as [`cudarc`]), so ferrocomm's streams and
//! modules are cudarc's and mix with any cudarc program.

/// The ABI structs shared with device code (device-api/include/ferrocomm/abi.h).
pub mod abi {
    pub use crate::contracts::window_handle::*;
}

pub use crate::contracts::window_handle::{DeviceStatus, ProxyQueue, WindowHandle};
pub use crate::gpu::cuda::stream::{use_stream, CurrentStream};
pub use crate::gpu::kernels::KernelArgs;
pub use crate::gpu::library::{
    available, compile, compile_host, compile_image, host_library, library_function, library_image,
    multicast_supported, new_stream, CompileOptions, HostModule, DEVICE_API_FILES, HEADERS,
};
pub use crate::gpu::nccl_library::{nccl_library, NcclLibrary};
pub use crate::gpu::slice::{DeviceSlice, DeviceSliceMut};
pub use cudarc;
