//! NVRTC, loaded at run time: compiles CUDA C++ (the library's kernels when the build had no
//! nvcc, and users' kernels) with the device-api headers served from memory.
//!
//! cudarc finds libnvrtc by soname only. To honour `FERROCOMM_NVRTC_PATH` and a toolkit under
//! `CUDA_HOME` (the PyPI wheels included) the library is first opened here by full path with
//! RTLD_GLOBAL; the dynamic loader then resolves cudarc's soname lookup to that same copy.
//! NVRTC itself opens libnvrtc-builtins by soname as well, so that one is preloaded from the
//! same folder.

use crate::contracts::config::{self, Config};
use crate::contracts::error::{Error, Result};
use cudarc::nvrtc::sys;
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

/// The sonames of the NVRTC we are built for (CUDA 13), newest first.
const SONAMES: &[&str] = &["libnvrtc.so.13"];
/// The builtins library NVRTC 13.0 opens by soname.
const BUILTINS: &str = "libnvrtc-builtins.so.13.0";

/// dlopen by full path, kept for the life of the process on purpose: NVRTC is never unloaded
/// under cudarc.
fn preload(path: &std::path::Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading runs the library's initialisers; the paths are NVIDIA's NVRTC libraries
    // (named by the user's FERROCOMM_NVRTC_PATH or CUDA_HOME), whose initialisers have no
    // preconditions on us. No symbol is taken here.
    match unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(library) => {
            // Never closed: cudarc's handle resolves to this very copy.
            std::mem::forget(library);
            true
        }
        Err(_) => false,
    }
}

fn candidates(config: &Config) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = config.nvrtc_path.clone() {
        if p.is_dir() {
            v.extend(SONAMES.iter().map(|s| p.join(s)));
        } else {
            v.push(p);
        }
    }
    if let Some(home) = config.value_os("CUDA_HOME") {
        for lib in ["lib64", "lib"] {
            v.extend(SONAMES.iter().map(|s| PathBuf::from(&home).join(lib).join(s)));
        }
    }
    v
}

/// Ok once NVRTC can be called; else `Unavailable` listing where we looked.
pub(crate) fn load() -> Result<()> {
    static STATE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    let config = config::current()?;
    STATE
        .get_or_init(|| {
            let tried = candidates(config);
            if let Some(path) = tried.iter().find(|p| p.is_file() && preload(p)) {
                if let Some(dir) = path.parent() {
                    preload(&dir.join(BUILTINS));
                }
            }
            // SAFETY: only dlopen attempts by cudarc's candidate names.
            if unsafe { sys::is_culib_present() } {
                Ok(())
            } else {
                Err(format!(
                    "NVRTC (libnvrtc.so.13) not found: tried {tried:?} and the loader's search path; \
                     set FERROCOMM_NVRTC_PATH or CUDA_HOME, or run scripts/cuda-toolchain.sh"
                ))
            }
        })
        .clone()
        .map_err(|reason| Error::Unavailable {
            backend: "nvrtc".into(),
            reason,
        })
}

/// What NVRTC produced.
pub(crate) enum Image {
    /// SASS for one architecture (`--gpu-architecture=sm_XX`).
    Cubin(Vec<u8>),
    /// PTX (`compute_XX`), JIT-compiled by the driver when loaded.
    Ptx(Vec<u8>),
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed once.
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn nvrtc_err(call: &str, r: sys::nvrtcResult, log: String) -> Error {
    // SAFETY: nvrtcGetErrorString returns a static string for every code.
    let text = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) }
        .to_string_lossy()
        .into_owned();
    Error::Backend {
        backend: "nvrtc".into(),
        call: call.into(),
        message: if log.is_empty() { text } else { format!("{text}\n{log}") },
    }
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("compile", format!("{what} contains a NUL byte")))
}

/// Compiles `source` (named `name` in messages) with in-memory `headers` (include name,
/// text) and NVRTC `options`. The image is a cubin when the options name an `sm_` target,
/// PTX otherwise.
pub(crate) fn compile(source: &str, name: &str, headers: &[(&str, &str)], options: &[String]) -> Result<Image> {
    load()?;
    let src = cstring("the source", source)?;
    let cname = cstring("the program name", name)?;
    let header_texts: Vec<CString> = headers.iter().map(|h| cstring(h.0, h.1)).collect::<Result<_>>()?;
    let header_names: Vec<CString> = headers
        .iter()
        .map(|h| cstring("a header name", h.0))
        .collect::<Result<_>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let opts: Vec<CString> = options.iter().map(|o| cstring("an option", o)).collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();

    let mut prog = Program(std::ptr::null_mut());
    // SAFETY: every pointer refers to a NUL-terminated string alive for this call; the
    // arrays have the lengths passed.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog.0,
            src.as_ptr(),
            cname.as_ptr(),
            headers.len() as c_int,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err("nvrtcCreateProgram", r, String::new()));
    }
    // SAFETY: prog is valid; the options outlive the call.
    let r = unsafe { sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let log = program_log(&prog);
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(nvrtc_err(&format!("nvrtcCompileProgram({name})"), r, log));
    }
    let cubin = options.iter().any(|o| o.contains("=sm_") || o.starts_with("-arch=sm_"));
    let mut size = 0usize;
    // SAFETY: prog compiled successfully; the buffer has the size NVRTC reported.
    unsafe {
        let r = if cubin {
            sys::nvrtcGetCUBINSize(prog.0, &mut size)
        } else {
            sys::nvrtcGetPTXSize(prog.0, &mut size)
        };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_err("nvrtcGetCUBINSize/PTXSize", r, String::new()));
        }
        let mut image = vec![0u8; size];
        let r = if cubin {
            sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast())
        } else {
            sys::nvrtcGetPTX(prog.0, image.as_mut_ptr().cast())
        };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(nvrtc_err("nvrtcGetCUBIN/PTX", r, String::new()));
        }
        Ok(if cubin { Image::Cubin(image) } else { Image::Ptx(image) })
    }
}

fn program_log(prog: &Program) -> String {
    let mut size = 0usize;
    // SAFETY: prog is valid; the buffer has the size NVRTC reported.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog.0, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS || size <= 1 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        if sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast()) != sys::nvrtcResult::NVRTC_SUCCESS {
            return String::new();
        }
        buf.pop();
        String::from_utf8_lossy(&buf).trim_end().to_owned()
    }
}
