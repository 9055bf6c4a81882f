//! Loading every kernel of a module before any of them runs.
//!
//! Under CUDA's lazy loading (the default since CUDA 12.2) the driver loads a kernel when it is
//! first looked up, and loading may synchronize the context. Ranks that share a GPU in one
//! process run kernels that wait for each other: a rank that looks up a kernel for the first
//! time while another rank's kernel waits for it would wait for that kernel, which waits for
//! the rank doing the lookup, until the kernel's deadline. So ferrocomm loads its modules
//! whole, at once, where nothing of theirs runs yet.

use super::{check, err};
use crate::contracts::error::Result;
use cudarc::driver::{sys, CudaModule};
use std::sync::Arc;

/// Loads every function of `module`, found through `anchor`, one function it is known to hold.
/// A driver without the calls to list a module's functions (before CUDA 12.4) leaves them to
/// load on first use.
pub(crate) fn load_whole(module: &Arc<CudaModule>, anchor: &str) -> Result<()> {
    let f = module
        .load_function(anchor)
        .map_err(|e| err(&format!("cuModuleGetFunction({anchor})"), e))?;
    // SAFETY: only looked up, not called; culib() is loaded (we hold a module).
    let lib = unsafe { sys::culib() };
    let listed = ["cuModuleGetFunctionCount", "cuModuleEnumerateFunctions", "cuFuncLoad"]
        .iter()
        // SAFETY: the symbols are only looked up.
        .all(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok());
    if !listed {
        return Ok(());
    }
    let mut raw: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `f` is a live function of `module`; each call below fills what it is given, sized
    // by the count the driver reported.
    unsafe {
        check("cuFuncGetModule", sys::cuFuncGetModule(&mut raw, f.cu_function()))?;
        let mut count = 0u32;
        check(
            "cuModuleGetFunctionCount",
            sys::cuModuleGetFunctionCount(&mut count, raw),
        )?;
        let mut functions: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); count as usize];
        check(
            "cuModuleEnumerateFunctions",
            sys::cuModuleEnumerateFunctions(functions.as_mut_ptr(), count, raw),
        )?;
        for func in functions {
            check("cuFuncLoad", sys::cuFuncLoad(func))?;
        }
    }
    Ok(())
}
