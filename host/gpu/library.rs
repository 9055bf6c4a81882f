//! Kernels as modules: users' kernels compiled with NVRTC (or, for the host device, the system
//! C++ compiler) against the device-api headers, and the library's own kernels (kernels/*.cu),
//! embedded at build time and loaded once per device. Everything here needs the CUDA driver at
//! run time and returns `Error::Unavailable` without it; [`compile_image`] needs only NVRTC.

use crate::contracts::error::Result;
use crate::gpu::cuda::{self, nvrtc};
use cudarc::driver::CudaModule;
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

macro_rules! header {
    ($name:literal) => {
        (
            concat!("ferrocomm/", $name),
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/device-api/include/ferrocomm/",
                $name
            )),
        )
    };
}

/// The device-api headers, by the include name kernels use (`#include "ferrocomm/ferrocomm.cuh"`).
pub const HEADERS: &[(&str, &str)] = &[
    header!("abi.h"),
    header!("device.cuh"),
    header!("atomics.cuh"),
    header!("coop.cuh"),
    header!("window.cuh"),
    header!("multimem.cuh"),
    header!("team.cuh"),
    header!("dtype.cuh"),
    header!("fp8.cuh"),
    header!("reduce_copy.cuh"),
    header!("norm.cuh"),
    header!("ferrocomm.cuh"),
    header!("impl/rma.cuh"),
    header!("impl/signal.cuh"),
    header!("impl/proxy.cuh"),
    header!("impl/barrier.cuh"),
    header!("host/runtime.h"),
];

/// Every file of device-api/include as the build found it (paths relative to it): the
/// headers [`HEADERS`] must serve.
#[doc(hidden)]
pub const DEVICE_API_FILES: &[&str] = include!(concat!(env!("OUT_DIR"), "/device_api_files.rs"));

/// The library's kernel sources and their shared headers, for NVRTC when the build had no nvcc.
const KERNEL_SOURCES: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
const KERNEL_HEADERS: &[(&str, &str)] = include!(concat!(env!("OUT_DIR"), "/kernel_headers.rs"));

/// How to compile a kernel source.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// Program name in compiler messages (default `kernel.cu`).
    pub name: Option<String>,
    /// Target: `sm_90` (a cubin) or `compute_90` (PTX). [`compile`] defaults to the GPU's own.
    pub arch: Option<String>,
    /// More NVRTC options, e.g. `-DTILE=128`, `--use_fast_math`.
    pub options: Vec<String>,
}

/// Compiles `source` with the device-api headers available and returns the image (cubin for
/// an `sm_` target, PTX otherwise; PTX for `compute_90` when no target is given). Needs NVRTC
/// only, not a GPU.
pub fn compile_image(source: &str, options: &CompileOptions) -> Result<Vec<u8>> {
    let arch = options.arch.as_deref().unwrap_or("compute_90");
    let mut opts = vec!["--std=c++17".to_owned(), format!("--gpu-architecture={arch}")];
    opts.extend(options.options.iter().cloned());
    let name = options.name.as_deref().unwrap_or("kernel.cu");
    Ok(match nvrtc::compile(source, name, HEADERS, &opts)? {
        nvrtc::Image::Cubin(b) | nvrtc::Image::Ptx(b) => b,
    })
}

/// A kernel `compile` adds to every user module: one name it knows the module by, to load the
/// module's kernels all at once.
const ANCHOR: &str = "ferrocomm_module_anchor";

/// Compiles `source` for GPU `ordinal` (its own architecture unless `options.arch` says
/// otherwise) and loads it there, every kernel at once: ranks sharing the GPU may launch them
/// while others' kernels wait, which a kernel loaded on first use could deadlock (see
/// `cuda/module.rs`). The module also holds an empty kernel `ferrocomm_module_anchor`.
pub fn compile(ordinal: usize, source: &str, options: &CompileOptions) -> Result<Arc<CudaModule>> {
    let ctx = cuda::context(ordinal)?;
    let mut options = options.clone();
    if options.arch.is_none() {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda::err("cuDeviceGetAttribute", e))?;
        options.arch = Some(format!("sm_{major}{minor}"));
    }
    let source = format!("{source}\nextern \"C\" __global__ void {ANCHOR}() {{}}\n");
    let image = compile_image(&source, &options)?;
    let module = ctx
        .load_module(Ptx::from_binary(image))
        .map_err(|e| cuda::err("cuModuleLoadData", e))?;
    cuda::module::load_whole(&module, ANCHOR)?;
    Ok(module)
}

/// Kernels compiled for the host device ([`compile_host`]): `Device::Host`'s counterpart of a
/// CUDA module, for users' kernels that drive host-device windows.
pub struct HostModule {
    module: HostModuleRef,
}

/// A user's module, or the library's own (loaded once per process).
enum HostModuleRef {
    Owned(crate::gpu::host_device::Module),
    Library(&'static crate::gpu::host_device::Module),
}

impl HostModule {
    /// Runs kernel `name` over `grid` blocks of `block` threads (every block at once, one OS
    /// thread per CUDA thread) with `args`, and returns when every thread has returned. Ranks
    /// that wait for each other's kernels launch from threads of their own.
    ///
    /// # Safety
    /// The kernel must take exactly the parameters `args` holds, and every address among
    /// them must be valid for what the kernel does with it.
    pub unsafe fn launch<A: crate::gpu::kernels::KernelArgs>(
        &self,
        name: &str,
        grid: u32,
        block: u32,
        args: A,
    ) -> Result<()> {
        let f = match &self.module {
            HostModuleRef::Owned(m) => m.function(name)?,
            HostModuleRef::Library(m) => m.function(name)?,
        };
        crate::gpu::kernels::run_on_host(f, grid, block, args)
    }
}

/// The library's own kernels (kernels/*.cu, e.g. `ferrocomm_put_blocks`) on the host device,
/// as [`library_function`] finds them on a GPU. Needs the `host-kernels` feature.
pub fn host_library() -> Result<HostModule> {
    Ok(HostModule {
        module: HostModuleRef::Library(crate::gpu::host_device::module()?),
    })
}

/// Compiles `source` (CUDA C++ that includes `ferrocomm/ferrocomm.cuh`) for the host device
/// with the system C++ compiler (`$CXX`, else `c++`; C++20), as [`compile`] does with NVRTC
/// for a GPU. `options.options` are extra compiler flags (`-DTILE=128`); `arch` is ignored.
pub fn compile_host(source: &str, options: &CompileOptions) -> Result<HostModule> {
    Ok(HostModule {
        module: HostModuleRef::Owned(crate::gpu::host_device::compile::compile(
            source,
            &options.options,
            HEADERS,
        )?),
    })
}

/// A new non-blocking stream on GPU `ordinal`'s primary context, safe to make while other
/// ranks of this process run kernels on the GPU. (`CudaContext::new(..)?.new_stream()`
/// synchronizes the whole GPU the first time each context value makes a stream, and so waits
/// for those kernels, which may be waiting for the rank making the stream.)
pub fn new_stream(ordinal: usize) -> Result<Arc<cudarc::driver::CudaStream>> {
    cuda::context(ordinal)?
        .new_stream()
        .map_err(|e| cuda::err("cuStreamCreate", e))
}

/// Whether GPU `ordinal` can run ferrocomm's device code (driver, device); the error says why not.
pub fn available(ordinal: usize) -> Result<()> {
    cuda::context(ordinal).map(drop)
}

/// Whether GPU `ordinal` supports multicast objects (NVLink SHARP: `multimem` loads and
/// stores), as its driver reports at run time.
pub fn multicast_supported(ordinal: usize) -> Result<bool> {
    crate::gpu::memory::multicast_supported(ordinal)
}

/// The library's kernels on GPU `ordinal`: the embedded fatbin, or NVRTC's build of the same
/// sources when the crate was built without nvcc. Loaded once per GPU.
pub(crate) fn library(ordinal: usize) -> Result<Arc<CudaModule>> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>> = OnceLock::new();
    let ctx = cuda::context(ordinal)?;
    let mut map = MODULES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(m) = map.get(&ordinal) {
        return Ok(m.clone());
    }
    let module = match fatbin() {
        Some(image) => ctx
            .load_module(Ptx::from_binary(image.to_vec()))
            .map_err(|e| cuda::err("cuModuleLoadData(library fatbin)", e))?,
        None => {
            let (major, minor) = ctx
                .compute_capability()
                .map_err(|e| cuda::err("cuDeviceGetAttribute", e))?;
            let image = library_image(&format!("sm_{major}{minor}"))?;
            ctx.load_module(Ptx::from_binary(image))
                .map_err(|e| cuda::err("cuModuleLoadData(library)", e))?
        }
    };
    // Every library module defines the window's signal kernel (kernels/rma.cu).
    cuda::module::load_whole(&module, "ferrocomm_signal")?;
    map.insert(ordinal, module.clone());
    Ok(module)
}

/// The library's kernels compiled by NVRTC for `arch` (`sm_90`, or `compute_90` for PTX), as
/// the fallback without a build-time nvcc does: every kernels/*.cu in one unit, as build.rs
/// joins them for nvcc. Public for the test that checks the fallback; needs NVRTC, not a GPU.
#[doc(hidden)]
pub fn library_image(arch: &str) -> Result<Vec<u8>> {
    let source: String = KERNEL_SOURCES
        .iter()
        .map(|(_, text)| *text)
        .collect::<Vec<_>>()
        .join("\n");
    let headers: Vec<(&str, &str)> = HEADERS.iter().chain(KERNEL_HEADERS).copied().collect();
    let opts = ["--std=c++17".to_owned(), format!("--gpu-architecture={arch}")];
    Ok(
        match nvrtc::compile(&source, "ferrocomm_kernels.cu", &headers, &opts)? {
            nvrtc::Image::Cubin(b) | nvrtc::Image::Ptx(b) => b,
        },
    )
}

#[cfg(ferrocomm_fatbin)]
fn fatbin() -> Option<&'static [u8]> {
    Some(include_bytes!(concat!(env!("OUT_DIR"), "/ferrocomm_kernels.fatbin")))
}

#[cfg(not(ferrocomm_fatbin))]
fn fatbin() -> Option<&'static [u8]> {
    None
}

/// A kernel of the library (kernels/*.cu, e.g. `ferrocomm_put_blocks`) loaded on GPU `ordinal`,
/// for benchmarks and for programs that launch the library's verbs on their own streams.
pub fn library_function(ordinal: usize, name: &str) -> Result<cudarc::driver::CudaFunction> {
    library(ordinal)?
        .load_function(name)
        .map_err(|e| cuda::err(&format!("cuModuleGetFunction({name})"), e))
}
