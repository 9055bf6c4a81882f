//! The CUDA driver, loaded at run time through cudarc. cudarc panics when it cannot find
//! libcuda or a symbol, so every entry point of ferrocomm that touches CUDA first calls
//! [`driver`], which turns an absent driver, an old one or a machine without a GPU into
//! `Error::Unavailable`.
//!
//! May import: the contracts. Part of the GPU wing (crate::gpu).

pub(crate) mod copy;
pub(crate) mod module;
pub(crate) mod nvrtc;
pub(crate) mod queues;
pub(crate) mod stream;

use crate::contracts::error::{Error, Result};
use cudarc::driver::{sys, CudaContext, DriverError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Driver entry points ferrocomm needs beyond the basics (virtual memory management, FD
/// handles); a driver without them is too old (they arrived in CUDA 10.2 / 11).
const REQUIRED: &[&str] = &[
    "cuDriverGetVersion",
    "cuInit",
    "cuDeviceGetCount",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemAddressReserve",
    "cuMemGetAllocationGranularity",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemHostAlloc",
    "cuModuleLoadData",
];

/// The oldest driver ferrocomm runs on, in `cuDriverGetVersion`'s units (1000 × major + 10 ×
/// minor): CUDA 13.0, driver branch R580. The library's kernels are built by the CUDA 13.0
/// toolkit (SASS from its ptxas, PTX ISA 9.0), and NVRTC 13 emits the same PTX: a 12.x driver
/// can load neither, so it is refused when a communicator is made rather than failing at the
/// first kernel. cudarc is built for the same driver API (its `cuda-13000` feature), so every
/// driver entry point it resolves exists in such a driver.
pub(crate) const MIN_DRIVER_VERSION: i32 = 13000;

/// `version` as CUDA writes it: 12080 is "12.8".
fn cuda_version(version: i32) -> String {
    format!("{}.{}", version / 1000, version % 1000 / 10)
}

/// Whether a driver that reports `version` can run ferrocomm; the error names both versions.
fn check_driver_version(version: i32) -> std::result::Result<(), String> {
    if version >= MIN_DRIVER_VERSION {
        return Ok(());
    }
    Err(format!(
        "the CUDA driver supports CUDA {} (cuDriverGetVersion {version}); ferrocomm needs CUDA {} \
         or later (driver R580+), the version its kernels are built with: update the driver or \
         install CUDA's forward-compatibility package",
        cuda_version(version),
        cuda_version(MIN_DRIVER_VERSION)
    ))
}

/// Ok once libcuda is loaded, initialised and sees at least one device.
pub(crate) fn driver() -> Result<()> {
    static STATE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    STATE.get_or_init(probe).clone().map_err(|reason| Error::Unavailable {
        backend: "device".into(),
        reason,
    })
}

fn probe() -> std::result::Result<(), String> {
    // Before cuInit: CUDA reads it when a context is made.
    let queues_set_by_user = queues::request().map_err(|e| e.to_string())?;
    // SAFETY: only dlopen attempts; nothing is called yet.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "the CUDA driver (libcuda.so) is not installed; searched {:?}",
            cudarc::get_lib_name_candidates("cuda")
        ));
    }
    // SAFETY: culib() succeeds now that is_culib_present did; `get` only looks symbols up.
    let lib = unsafe { sys::culib() };
    for name in REQUIRED {
        // SAFETY: the symbol is not called, only looked up.
        if unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err() {
            return Err(format!("the CUDA driver is too old: it lacks {name}"));
        }
    }
    let mut version = 0;
    // SAFETY: cuDriverGetVersion exists (checked above) and writes one int; it needs no cuInit.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| format!("cuDriverGetVersion failed: {}", describe(e)))?;
    check_driver_version(version)?;
    // SAFETY: cuInit and cuDeviceGetCount exist (checked above) and take plain values.
    unsafe {
        sys::cuInit(0)
            .result()
            .map_err(|e| format!("cuInit failed: {}", describe(e)))?;
        let mut n = 0;
        sys::cuDeviceGetCount(&mut n)
            .result()
            .map_err(|e| format!("cuDeviceGetCount failed: {}", describe(e)))?;
        if n == 0 {
            return Err("the CUDA driver sees no GPU".into());
        }
        queues::record(queues_set_by_user.as_deref(), primary_context_made(n));
    }
    Ok(())
}

/// Whether some GPU's primary context (the one ferrocomm uses) was already made, before
/// ferrocomm's first use of CUDA: by another library of this process.
///
/// # Safety
/// cuInit succeeded and the driver sees `devices` GPUs.
unsafe fn primary_context_made(devices: i32) -> bool {
    (0..devices).any(|ordinal| {
        let (mut dev, mut flags, mut active) = (0, 0, 0);
        // SAFETY: the caller's contract (the driver is initialised, `ordinal` < its device
        // count); the out-parameters are locals that outlive the calls.
        let known = unsafe {
            sys::cuDeviceGet(&mut dev, ordinal).result().is_ok()
                && sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active)
                    .result()
                    .is_ok()
        };
        known && active != 0
    })
}

/// The driver's name and description of an error code.
pub(crate) fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    }
}

/// Converts a driver error of `call` into ferrocomm's error.
pub(crate) fn err(call: &str, e: DriverError) -> Error {
    Error::Backend {
        backend: "cuda".into(),
        call: call.into(),
        message: describe(e),
    }
}

/// Checks the result of a raw driver call.
pub(crate) fn check(call: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| err(call, e))
}

/// The primary context of GPU `ordinal`, shared by every rank of this process on that GPU.
///
/// cudarc synchronizes the whole context when one of its `CudaContext` values makes a stream
/// while it has none: with ranks of one process sharing the GPU that waits for the other
/// ranks' kernels, which may be waiting for this rank. So the shared value keeps one stream
/// for as long as the process lives, made here, before any rank's work, and later streams
/// never synchronize.
pub(crate) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    driver()?;
    type Kept = (Arc<CudaContext>, Arc<cudarc::driver::CudaStream>);
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Kept>>> = OnceLock::new();
    let mut map = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some((ctx, _)) = map.get(&ordinal) {
        ctx.bind_to_thread().map_err(|e| err("cuCtxSetCurrent", e))?;
        return Ok(ctx.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_INVALID_DEVICE => Error::Unavailable {
            backend: "device".into(),
            reason: format!("there is no CUDA device {ordinal}"),
        },
        _ => err("cuDevicePrimaryCtxRetain", e),
    })?;
    let keeper = ctx.new_stream().map_err(|e| err("cuStreamCreate", e))?;
    map.insert(ordinal, (ctx.clone(), keeper));
    Ok(ctx)
}

/// The PCI address of GPU `ordinal` (`0000:3b:00.0`), where the driver loads.
pub(crate) fn pci_bus_id(ordinal: usize) -> Result<String> {
    driver()?;
    let mut dev = 0;
    // SAFETY: writes one device handle.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) })?;
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev)
    })?;
    // SAFETY: NUL-terminated within the buffer (the driver's contract, and the last byte is 0).
    Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drivers_older_than_cuda_13_are_refused_naming_both_versions() {
        for old in [11080, 12000, 12040, 12090] {
            let e = check_driver_version(old).unwrap_err();
            assert!(e.contains(&format!("supports CUDA {}", cuda_version(old))), "{e}");
            assert!(
                e.contains(&format!("({old})")) || e.contains(&format!("GetVersion {old}")),
                "{e}"
            );
            assert!(e.contains("needs CUDA 13.0"), "{e}");
        }
        assert_eq!(cuda_version(12080), "12.8");
        for ok in [13000, 13010, 14000] {
            assert_eq!(check_driver_version(ok), Ok(()), "{ok}");
        }
    }
}
