//! Users' kernels on the host device: CUDA C++ that uses the device API, compiled at run time
//! by the system C++ compiler, as NVRTC compiles it for a GPU (crate::device::compile). The
//! device-api headers and the host-device runtime come from the library itself; the compiler
//! is `$CXX`, else `c++`, and must take C++20.

use super::Module;
use crate::contracts::error::{Error, Result};
use std::path::{Path, PathBuf};

/// device-api/host/runtime.cpp: every host-device module carries its own launcher.
const RUNTIME: &str = include_str!("../../../device-api/host/runtime.cpp");

/// Compiles `source` with `options` (extra compiler flags, e.g. `-DTILE=128`) into a module;
/// `headers` are the (include name, text) pairs it may include (the device API).
pub(crate) fn compile(source: &str, options: &[String], headers: &[(&str, &str)]) -> Result<Module> {
    let dir = scratch_dir()?;
    let built = build(&dir, source, options, headers);
    // The loaded library stays mapped after its file is gone.
    let _ = std::fs::remove_dir_all(&dir);
    built
}

/// A fresh folder only this user can enter (as mkdtemp makes it: mode 0700, a name nobody
/// could claim first), so no one else can plant the library we load.
fn scratch_dir() -> Result<PathBuf> {
    crate::gpu::fd_passing::private_dir(&std::env::temp_dir(), "ferrocomm-host-kernels-")
        .map_err(|e| Error::io("host-device compile: a scratch folder", e))
}

fn build(dir: &Path, source: &str, options: &[String], headers: &[(&str, &str)]) -> Result<Module> {
    let write = |name: &str, text: &str| -> Result<()> {
        let path = dir.join("include").join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io("host-device compile: headers", e))?;
        }
        std::fs::write(&path, text).map_err(|e| Error::io("host-device compile: headers", e))
    };
    for (name, text) in headers {
        write(name, text)?;
    }
    let kernel = dir.join("kernel.cpp");
    std::fs::write(&kernel, format!("#define FERROCOMM_HOST_DEVICE 1\n{source}\n"))
        .map_err(|e| Error::io("host-device compile: the source", e))?;
    let runtime = dir.join("runtime.cpp");
    std::fs::write(&runtime, RUNTIME).map_err(|e| Error::io("host-device compile: the runtime", e))?;
    let library = dir.join("libkernels.so");
    let compiler = crate::contracts::config::current()?
        .var("CXX")
        .unwrap_or_else(|| "c++".into());
    let output = std::process::Command::new(&compiler)
        .args([
            "-std=c++20",
            "-O1",
            "-fPIC",
            "-shared",
            "-pthread",
            "-Wno-unknown-pragmas",
        ])
        .args(options)
        .arg("-I")
        .arg(dir.join("include"))
        .arg(&kernel)
        .arg(&runtime)
        .arg("-o")
        .arg(&library)
        .output()
        .map_err(|e| Error::Unavailable {
            backend: "device (host device)".into(),
            reason: format!("cannot run the C++ compiler {compiler:?} for a host-device kernel: {e}"),
        })?;
    if !output.status.success() {
        return Err(Error::Backend {
            backend: "host device".into(),
            call: format!("{compiler} (compiling a kernel for the host device)"),
            message: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Module::open(&library.display().to_string())
}
