//! libnccl, loaded at run time: ferrocomm's own bindings, and why they are not cudarc's.
//!
//! cudarc (already a dependency, for the driver and NVRTC) has dynamic-loading NCCL bindings,
//! and they declare every entry point ferrocomm calls (the table in `api!` below). They are
//! still not used, for two reasons that no choice of cudarc features removes (checked against
//! cudarc 0.19):
//! - its loader opens only names derived from the CUDA version (`libnccl.so`,
//!   `libnccl.so.13`, ...), never `libnccl.so.2`, the one name under which NCCL's wheels
//!   (`nvidia-nccl-cu12`/`-cu13`) and distribution packages (`libnccl2`) install it; nothing
//!   can point it elsewhere, and it panics when it finds nothing;
//! - it resolves each symbol at its first call and panics when the symbol is missing, so an
//!   NCCL older than the bindings would abort the process mid-run.
//!
//! So ferrocomm opens the library itself (a search that also covers `FERROCOMM_NCCL_PATH` and
//! the wheels' lib folder) and resolves its table of entry points up front: a missing or too
//! old NCCL is an `Error::Unavailable` when the communicator is made, never a panic. The table
//! holds only the calls ferrocomm makes, with the types of nccl.h as of 2.18.

use crate::contracts::error::{Error, Result};
use libloading::Library;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// ncclCommSplit and the nonblocking configuration fields used here arrived in NCCL 2.18.
pub(crate) const MIN_VERSION: c_int = 21800;

pub(crate) type CommPtr = *mut c_void;
pub(crate) type Stream = *mut c_void;

/// `ncclUniqueId`: an opaque 128-byte blob that every rank passes to the init call.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId(pub [u8; 128]);

/// `ncclConfig_t` as of NCCL 2.18. Later releases append fields; NCCL reads `size` and
/// `version` to know how much of the struct the caller filled in.
#[repr(C)]
pub(crate) struct Config {
    size: usize,
    magic: u32,
    version: u32,
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    pub split_share: c_int,
}

const UNDEF_INT: c_int = c_int::MIN;

impl Config {
    /// NCCL's `NCCL_CONFIG_INITIALIZER` for the 2.18 layout.
    pub(crate) fn new() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: MIN_VERSION as u32,
            blocking: UNDEF_INT,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        }
    }
}

pub(crate) const SUCCESS: c_int = 0;
pub(crate) const IN_PROGRESS: c_int = 7;
pub(crate) const SPLIT_NOCOLOR: c_int = -1;
/// `ncclScalarHostImmediate`: the premul_sum scalar is read from host memory at the call.
pub(crate) const SCALAR_HOST_IMMEDIATE: c_int = 1;

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The NCCL entry points ferrocomm calls, resolved when the library is opened.
        #[allow(non_snake_case)]
        pub(crate) struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Api {
            /// Resolves every entry point; the name of the first missing one on failure.
            fn resolve(lib: &Library) -> std::result::Result<Api, &'static str> {
                Ok(Api {
                    $($name: {
                        // SAFETY: the symbol's C signature is the one declared (nccl.h, 2.18+).
                        let s = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                        };
                        *s.map_err(|_| stringify!($name))?
                    },)*
                })
            }
        }
    };
}

api! {
    ncclGetUniqueId: fn(*mut UniqueId) -> c_int;
    ncclGetErrorString: fn(c_int) -> *const c_char;
    ncclGetLastError: fn(CommPtr) -> *const c_char;
    ncclCommInitRankConfig: fn(*mut CommPtr, c_int, UniqueId, c_int, *mut Config) -> c_int;
    ncclCommSplit: fn(CommPtr, c_int, c_int, *mut CommPtr, *mut Config) -> c_int;
    ncclCommGetAsyncError: fn(CommPtr, *mut c_int) -> c_int;
    ncclCommFinalize: fn(CommPtr) -> c_int;
    ncclCommDestroy: fn(CommPtr) -> c_int;
    ncclCommAbort: fn(CommPtr) -> c_int;
    ncclGroupStart: fn() -> c_int;
    ncclGroupEnd: fn() -> c_int;
    ncclAllReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclReduce: fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclBroadcast: fn(*const c_void, *mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclAllGather: fn(*const c_void, *mut c_void, usize, c_int, CommPtr, Stream) -> c_int;
    ncclReduceScatter: fn(*const c_void, *mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclSend: fn(*const c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclRecv: fn(*mut c_void, usize, c_int, c_int, CommPtr, Stream) -> c_int;
    ncclRedOpCreatePreMulSum: fn(*mut c_int, *mut c_void, c_int, c_int, CommPtr) -> c_int;
    ncclRedOpDestroy: fn(c_int, CommPtr) -> c_int;
}

/// An opened libnccl.
pub(crate) struct Nccl {
    pub api: Api,
    /// `major * 10000 + minor * 100 + patch`.
    pub version: c_int,
    pub path: PathBuf,
    _lib: Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL {} at {}", version_string(self.version), self.path.display())
    }
}

/// `2.21.5` for 22105 (and the pre-2.9 encoding, `major * 1000 + minor * 100 + patch`).
pub(crate) fn version_string(code: c_int) -> String {
    let (major, rest) = if code >= 10000 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// The process's NCCL, opened once; `Error::Unavailable` says what was searched and why it
/// failed.
pub(crate) fn nccl() -> Result<&'static Nccl> {
    static LIB: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    let config = crate::contracts::config::current()?;
    LIB.get_or_init(|| open(&candidates(config.nccl_path.clone(), |k| config.value_os(k))))
        .as_ref()
        .map_err(|reason| Error::Unavailable {
            backend: "nccl".into(),
            reason: reason.clone(),
        })
}

/// Where to look, in order. An explicit `FERROCOMM_NCCL_PATH` (a file, or a folder holding
/// libnccl) is the only candidate when set: a wrong override must fail, not be bypassed.
/// `explicit`: `FERROCOMM_NCCL_PATH`; `env`: the other variables (CUDA_HOME, Python's).
pub(crate) fn candidates(explicit: Option<PathBuf>, env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Vec<PathBuf> {
    const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];
    if let Some(p) = explicit {
        return if p.is_dir() {
            NAMES.iter().map(|n| p.join(n)).collect()
        } else {
            vec![p]
        };
    }
    // Bare names: the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).
    let mut out: Vec<PathBuf> = NAMES.iter().map(PathBuf::from).collect();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(cuda) = env("CUDA_HOME").or_else(|| env("CUDA_PATH")) {
        let cuda = PathBuf::from(cuda);
        dirs.extend([cuda.join("lib64"), cuda.join("lib")]);
    }
    for site in python_site_dirs(&env) {
        dirs.push(site.join("nvidia/nccl/lib"));
    }
    for d in dirs {
        out.extend(NAMES.iter().map(|n| d.join(n)).filter(|p| p.exists()));
    }
    out
}

/// The site-packages folders where pip puts the NCCL wheels: virtual and conda environments,
/// PYTHONPATH, the user's and the system's.
fn python_site_dirs(env: &impl Fn(&str) -> Option<std::ffi::OsString>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|k| env(k).map(PathBuf::from))
        .collect();
    if let Some(home) = env("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    let mut sites: Vec<PathBuf> = env("PYTHONPATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    sites.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    for prefix in prefixes {
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons {
            sites.extend([py.join("site-packages"), py.join("dist-packages")]);
        }
    }
    sites
}

/// Opens the first candidate that loads and is a recent enough NCCL.
pub(crate) fn open(candidates: &[PathBuf]) -> std::result::Result<Nccl, String> {
    let mut tried = Vec::new();
    for path in candidates {
        match open_one(path) {
            Ok(n) => {
                tracing::debug!(nccl = ?n, "NCCL loaded");
                return Ok(n);
            }
            Err(why) => tried.push(format!("{}: {why}", path.display())),
        }
    }
    Err(format!(
        "libnccl was not found or not usable (tried {}); install NCCL {} or newer (e.g. pip install \
         nvidia-nccl-cu13) or point FERROCOMM_NCCL_PATH at libnccl.so.2",
        tried.join("; "),
        version_string(MIN_VERSION)
    ))
}

fn open_one(path: &Path) -> std::result::Result<Nccl, String> {
    // SAFETY: loading runs the library's initialisers; NCCL's are side-effect free until called.
    let lib = unsafe { Library::new(path) }.map_err(|e| e.to_string())?;
    // ncclGetVersion first: a library without it is not NCCL at all.
    // SAFETY: looking a symbol up calls nothing.
    let get_version = unsafe { lib.get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"ncclGetVersion\0") }
        .map_err(|_| "not an NCCL library (no ncclGetVersion)".to_string())?;
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int.
    let r = unsafe { get_version(&mut version) };
    if r != SUCCESS {
        return Err(format!("ncclGetVersion returned {r}"));
    }
    if version < MIN_VERSION {
        return Err(format!(
            "NCCL {} is too old; ferrocomm needs {} or newer",
            version_string(version),
            version_string(MIN_VERSION)
        ));
    }
    let api = Api::resolve(&lib).map_err(|name| format!("NCCL {} lacks {name}", version_string(version)))?;
    Ok(Nccl {
        api,
        version,
        path: path.to_owned(),
        _lib: lib,
    })
}

impl Nccl {
    /// NCCL's text for a result code, with the communicator's last error message when there is
    /// one.
    pub(crate) fn describe(&self, code: c_int, comm: CommPtr) -> String {
        // SAFETY: both return pointers to static or per-thread NUL-terminated strings.
        let text = unsafe { cstr((self.api.ncclGetErrorString)(code)) };
        // SAFETY: as above; `comm` is null or a live communicator (NCCL accepts both).
        let last = unsafe { cstr((self.api.ncclGetLastError)(comm)) };
        if last.is_empty() {
            format!("{text} (ncclResult {code})")
        } else {
            format!("{text} (ncclResult {code}): {last}")
        }
    }

    /// Converts the result of `call` into ferrocomm's error.
    pub(crate) fn check(&self, call: &str, code: c_int, comm: CommPtr) -> Result<()> {
        if code == SUCCESS {
            return Ok(());
        }
        Err(Error::Backend {
            backend: "nccl".into(),
            call: call.into(),
            message: self.describe(code, comm),
        })
    }

    /// A fresh unique id (rank 0 makes it; it needs no GPU).
    pub(crate) fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId([0; 128]);
        // SAFETY: writes 128 bytes into `id`.
        let r = unsafe { (self.api.ncclGetUniqueId)(&mut id) };
        self.check("ncclGetUniqueId", r, std::ptr::null_mut())?;
        Ok(id)
    }
}

unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> {
        let v: Vec<(String, OsString)> = pairs
            .iter()
            .map(|(k, p)| (k.to_string(), p.as_os_str().into()))
            .collect();
        move |k| v.iter().find(|(n, _)| n == k).map(|(_, p)| p.clone())
    }

    #[test]
    fn versions_print_in_both_encodings() {
        assert_eq!(version_string(23203), "2.32.3");
        assert_eq!(version_string(21800), "2.18.0");
        assert_eq!(version_string(2804), "2.8.4");
    }

    #[test]
    fn an_explicit_path_is_the_only_candidate() {
        let dir = std::env::temp_dir().join(format!("ferrocomm-nccl-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = candidates(Some(dir.clone()), env_of(&[]));
        assert_eq!(c, vec![dir.join("libnccl.so.2"), dir.join("libnccl.so")]);
        let file = dir.join("libnccl.so.2");
        assert_eq!(candidates(Some(file.clone()), env_of(&[])), vec![file]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_wheel_folder_of_a_virtual_environment_is_searched() {
        let venv = std::env::temp_dir().join(format!("ferrocomm-nccl-venv-{}", std::process::id()));
        let lib = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"").unwrap();
        let c = candidates(None, env_of(&[("VIRTUAL_ENV", &venv)]));
        assert_eq!(&c[..2], &[PathBuf::from("libnccl.so.2"), PathBuf::from("libnccl.so")]);
        assert!(c.contains(&lib.join("libnccl.so.2")), "{c:?}");
        std::fs::remove_dir_all(&venv).unwrap();
    }

    #[test]
    fn missing_files_and_other_libraries_are_refused_with_the_reason() {
        let missing = PathBuf::from("/nonexistent/libnccl.so.2");
        let e = open(&[missing]).unwrap_err();
        assert!(
            e.contains("/nonexistent/libnccl.so.2") && e.contains("FERROCOMM_NCCL_PATH"),
            "{e}"
        );
        // A real shared library that is not NCCL.
        let e = open(&[PathBuf::from("libc.so.6")]).unwrap_err();
        assert!(e.contains("not an NCCL library"), "{e}");
    }

    /// Builds a shared library exporting `body` with the C compiler (as the ABI test does).
    fn c_library(name: &str, body: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrocomm-cc-nccl-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, lib) = (dir.join("lib.c"), dir.join("libnccl.so.2"));
        std::fs::write(&src, body).unwrap();
        let cc = crate::contracts::config::current()
            .unwrap()
            .var("CC")
            .unwrap_or_else(|| "cc".into());
        let ok = std::process::Command::new(cc)
            .args(["-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&src)
            .status()
            .unwrap();
        assert!(ok.success(), "cc failed");
        lib
    }

    #[test]
    fn too_old_and_incomplete_libraries_are_refused_by_version_and_symbol() {
        let old = c_library("old", "int ncclGetVersion(int *v) { *v = 21703; return 0; }\n");
        let e = open(std::slice::from_ref(&old)).unwrap_err();
        assert!(e.contains("NCCL 2.17.3 is too old") && e.contains("2.18.0"), "{e}");
        // New enough by its version, but without the rest of the API.
        let partial = c_library("partial", "int ncclGetVersion(int *v) { *v = 22203; return 0; }\n");
        let e = open(std::slice::from_ref(&partial)).unwrap_err();
        assert!(e.contains("NCCL 2.22.3 lacks ncclGetUniqueId"), "{e}");
        let broken = c_library("broken", "int ncclGetVersion(int *v) { return 3; }\n");
        let e = open(std::slice::from_ref(&broken)).unwrap_err();
        assert!(e.contains("ncclGetVersion returned 3"), "{e}");
        for lib in [old, partial, broken] {
            std::fs::remove_dir_all(lib.parent().unwrap()).unwrap();
        }
    }

    /// With the library the test command installs (FERROCOMM_NCCL_PATH), the real entry points:
    /// version, unique ids (no GPU needed), error texts.
    #[test]
    fn the_installed_nccl_loads_and_answers() {
        let config = crate::contracts::config::current().unwrap();
        let Some(path) = config.nccl_path.clone() else {
            assert!(
                config.value_os("FERROCOMM_REQUIRE_NCCL").is_none(),
                "FERROCOMM_NCCL_PATH unset"
            );
            eprintln!("SKIPPED: FERROCOMM_NCCL_PATH is not set");
            return;
        };
        let n = open(&candidates(Some(path), env_of(&[]))).unwrap();
        assert!(n.version >= MIN_VERSION, "{n:?}");
        let (a, b) = (n.unique_id().unwrap(), n.unique_id().unwrap());
        assert_ne!(a.0, b.0, "two unique ids are equal");
        assert_ne!(a.0, [0; 128]);
        let text = n.describe(4, std::ptr::null_mut());
        assert!(
            text.contains("invalid argument") && text.contains("ncclResult 4"),
            "{text}"
        );
        let e = n
            .check("ncclAllReduce", 4, std::ptr::null_mut())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nccl") && e.contains("ncclAllReduce") && e.contains("invalid argument"),
            "{e}"
        );
    }
}

/// The NCCL library ferrocomm found (the search of the `nccl` backend: `FERROCOMM_NCCL_PATH`,
/// the dynamic loader's path, `CUDA_HOME`, the `nvidia-nccl-cu1x` wheels).
#[derive(Clone, Debug)]
pub struct NcclLibrary {
    /// `2.21.5`.
    pub version: String,
    /// The file that was loaded.
    pub path: std::path::PathBuf,
}

/// Loads NCCL (no GPU needed) and says which one; `Error::Unavailable` lists what was tried.
pub fn nccl_library() -> Result<NcclLibrary> {
    let lib = nccl()?;
    Ok(NcclLibrary {
        version: version_string(lib.version),
        path: lib.path.clone(),
    })
}
