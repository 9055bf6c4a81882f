//! The host device: kernels/*.cu and the device API compiled for CPU threads (build.rs, feature
//! `host-kernels`), so the device backend runs end to end on a machine without a GPU. It is the
//! device of [`crate::contracts::placement::Device::Host`].
//!
//! What a GPU driver gives the backend, this module gives on the CPU: modules of kernels (the
//! library's own, embedded and loaded once per process, and users', compiled at run time:
//! compile.rs), kernel launches (every block of a launch runs at once, one OS thread per CUDA
//! thread: device-api/host/runtime.cpp), streams (ordered queues with a worker thread each:
//! stream.rs) and memory that ranks in several processes map side by side (memfd segments:
//! memory.rs). Without the feature the library's module is `Error::Unavailable`.
//!
//! May import: the contracts. Part of the GPU wing (crate::gpu).

pub(crate) mod compile;
pub(crate) mod memory;
pub(crate) mod stream;

use crate::contracts::error::{Error, Result};
use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

pub(crate) use memory::{Segment, SegmentMap};
pub(crate) use stream::Stream;

/// The C signature of `ferrocomm_host_launch` (device-api/host/runtime.cpp).
type LaunchFn = unsafe extern "C" fn(u32, u32, u32, u32, u32, u32, u64, extern "C" fn(*mut c_void), *mut c_void) -> i32;

/// A loaded module: a shared library of kernels with its own launcher (its kernels read the
/// thread indices that launcher sets, in the library's own thread-local state). Never
/// unloaded: its launcher's pooled threads stay parked in its code for the life of the process.
pub(crate) struct Module {
    library: std::mem::ManuallyDrop<libloading::Library>,
    launch: LaunchFn,
}

/// A kernel of a module: the address of its `extern "C"` host function, and its module's
/// launcher.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Function {
    pub(crate) name: &'static str,
    pub(crate) address: *const c_void,
    launch: LaunchFn,
}

// SAFETY: code addresses of a library that stays loaded while its module lives; the library
// kernels' module lives for the process, users' modules outlive their launches.
unsafe impl Send for Function {}
// SAFETY: as for Send; the fields are immutable, and calling the code from several threads at
// once is what the launcher does anyway (it runs one kernel on many threads).
unsafe impl Sync for Function {}

fn unavailable(reason: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: "device (host device)".into(),
        reason: reason.into(),
    }
}

/// Ok where the host device can run kernels (a build with the `host-kernels` feature).
pub(crate) fn available() -> Result<()> {
    module().map(drop)
}

/// The library kernels, loaded on first use and kept for the life of the process.
pub(crate) fn module() -> Result<&'static Module> {
    static MODULE: OnceLock<std::result::Result<Module, String>> = OnceLock::new();
    MODULE
        .get_or_init(load)
        .as_ref()
        .map_err(|reason| unavailable(reason.clone()))
}

#[cfg(feature = "host-kernels")]
const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libferrocomm_host_kernels.so"));

#[cfg(not(feature = "host-kernels"))]
fn load() -> std::result::Result<Module, String> {
    Err("this build of ferrocomm has no host-device kernels (build with the cargo feature `host-kernels`)".into())
}

/// The embedded library goes into an anonymous file and is loaded from there: nothing on disk
/// to find or to go stale, wherever the binary is run from.
#[cfg(feature = "host-kernels")]
fn load() -> std::result::Result<Module, String> {
    use rustix::fs::{memfd_create, MemfdFlags};
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let fd = memfd_create("ferrocomm-host-kernels", MemfdFlags::CLOEXEC)
        .map_err(|e| format!("memfd_create: {}", std::io::Error::from(e)))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(IMAGE)
        .map_err(|e| format!("writing the host-device kernels: {e}"))?;
    Module::open(&format!("/proc/self/fd/{}", file.as_raw_fd())).map_err(|e| e.to_string())
}

/// `name` as a `&'static str`, each distinct name leaked once.
fn intern(name: &str) -> &'static str {
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(n) = names.get(name) {
        return n;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(leaked);
    leaked
}

impl Module {
    /// Loads the module at `path`.
    pub(crate) fn open(path: &str) -> Result<Module> {
        // SAFETY: a library of host-device kernels; its initialisers only set up C++ runtime
        // state.
        let library = unsafe { libloading::Library::new(path) }
            .map_err(|e| unavailable(format!("loading the host-device kernels {path}: {e}")))?;
        // SAFETY: the symbol has the signature of LaunchFn (device-api/host/runtime.cpp).
        let launch = unsafe { library.get::<LaunchFn>(b"ferrocomm_host_launch\0") }
            .map(|s| *s)
            .map_err(|e| unavailable(format!("{path} lacks ferrocomm_host_launch: {e}")))?;
        Ok(Module {
            library: std::mem::ManuallyDrop::new(library),
            launch,
        })
    }

    /// The kernel `name` (an `extern "C" __global__` function of the module).
    pub(crate) fn function(&self, name: &str) -> Result<Function> {
        let symbol = format!("{name}\0");
        // SAFETY: only the address is taken; callers call it with the kernel's parameters
        // (crate::gpu::kernels).
        let address = unsafe { self.library.get::<*const c_void>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| {
                Error::invalid(
                    "kernel launch",
                    format!("the host-device module has no kernel {name}: {e}"),
                )
            })?;
        Ok(Function {
            name: intern(name),
            address,
            launch: self.launch,
        })
    }
}

impl Function {
    /// Runs `body(ctx)` on `grid` x `block` threads with CUDA's indices set, through the
    /// function's module, and returns once all have returned.
    ///
    /// # Safety
    /// `body` must be sound to call on any thread with `ctx`, which stays valid until return.
    pub(crate) unsafe fn run(
        &self,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        body: extern "C" fn(*mut c_void),
        ctx: *mut c_void,
    ) -> Result<()> {
        let (g, b, name) = (grid, block, self.name);
        // SAFETY: the caller's contract; `launch` is the module's own launcher.
        let rc = unsafe { (self.launch)(g.0, g.1, g.2, b.0, b.1, b.2, shared_bytes as u64, body, ctx) };
        match rc {
            0 => Ok(()),
            e if e == rustix::io::Errno::INVAL.raw_os_error() => Err(Error::invalid(
                "kernel launch",
                format!(
                    "{name}: grid {grid:?} x block {block:?} is empty or larger than the host device runs \
                     (1024 threads a block, 65536 a launch)"
                ),
            )),
            e => Err(Error::Backend {
                backend: "host device".into(),
                call: format!("launch of {name}"),
                message: std::io::Error::from_raw_os_error(e).to_string(),
            }),
        }
    }
}
