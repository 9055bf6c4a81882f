//! Compiles kernels/*.cu (with the device-api headers) into one fatbin embedded in the library:
//! SASS for sm_80, sm_90 and sm_100 and PTX for compute_90, so newer GPUs JIT the PTX. nvcc is
//! looked up in CUDA_HOME, on PATH, then in the project's wheel cache
//! (scripts/cuda-toolchain.sh). Without nvcc the crate still builds, and the library compiles
//! the same sources with NVRTC at run time (`cfg(ferrocomm_fatbin)` tells which).
//!
//! ptxas's resource report goes to $OUT_DIR/ptxas-report.txt. A kernel that fails to compile or
//! spills registers fails the build. FERROCOMM_REQUIRE_NVCC=1 makes a missing nvcc an error
//! (the test command sets it so CI cannot pass without compiling the kernels).
use std::path::{Path, PathBuf};
use std::process::Command;

const GENCODE: &[&str] = &[
    "arch=compute_80,code=sm_80",
    "arch=compute_90,code=sm_90",
    "arch=compute_100,code=sm_100",
    "arch=compute_90,code=compute_90",
];

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-changed=device-api");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=FERROCOMM_REQUIRE_NVCC");
    println!("cargo:rustc-check-cfg=cfg(ferrocomm_fatbin)");

    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    #[cfg(feature = "rdma")]
    verbs_bindings(&out);
    let sources = kernel_sources(&root.join("kernels"));
    let unity = out.join("ferrocomm_kernels.cu");
    let body: String = sources
        .iter()
        .map(|s| format!("#include \"{}\"\n", s.display()))
        .collect();
    std::fs::write(&unity, body).expect("write the unity kernel source");
    // The same sources as text, for NVRTC at run time when there is no fatbin.
    let listing: String = sources
        .iter()
        .map(|s| {
            let name = s.file_name().expect("a file").to_string_lossy();
            format!("(\"{name}\", include_str!({:?})),\n", s.display().to_string())
        })
        .collect();
    std::fs::write(out.join("kernel_sources.rs"), format!("&[\n{listing}]\n")).expect("write kernel_sources.rs");
    // Their shared headers (kernels/*.cuh), by the name they are included with.
    let headers: String = kernel_files(&root.join("kernels"), "cuh")
        .iter()
        .map(|s| {
            let name = s.file_name().expect("a file").to_string_lossy();
            format!("(\"{name}\", include_str!({:?})),\n", s.display().to_string())
        })
        .collect();
    std::fs::write(out.join("kernel_headers.rs"), format!("&[\n{headers}]\n")).expect("write kernel_headers.rs");
    // Every file of the device API as it is on disk now, for the test that HEADERS serves them
    // all (a test binary may run far from the source tree).
    let api = root.join("device-api/include");
    let mut files = Vec::new();
    list_files(&api, &api, &mut files);
    files.sort();
    let listing: String = files.iter().map(|f| format!("{f:?},\n")).collect();
    std::fs::write(out.join("device_api_files.rs"), format!("&[\n{listing}]\n")).expect("write device_api_files.rs");
    #[cfg(feature = "host-kernels")]
    host_kernels(&root, &out, &unity);

    let Some(nvcc) = find_nvcc(&root) else {
        if std::env::var("FERROCOMM_REQUIRE_NVCC").as_deref() == Ok("1") {
            panic!("FERROCOMM_REQUIRE_NVCC=1 but no nvcc: set CUDA_HOME or run scripts/cuda-toolchain.sh");
        }
        println!("cargo:warning=no nvcc found: kernels will be compiled with NVRTC at run time");
        return;
    };
    let fatbin = out.join("ferrocomm_kernels.fatbin");
    let mut cmd = Command::new(&nvcc);
    cmd.arg("-fatbin")
        .arg("-std=c++17")
        .arg("-O3")
        .arg("-Xptxas")
        .arg("-v")
        .arg("-I")
        .arg(root.join("device-api/include"))
        .arg("-I")
        .arg(root.join("kernels"))
        .arg("-o")
        .arg(&fatbin)
        .arg(&unity);
    for g in GENCODE {
        cmd.arg("-gencode").arg(g);
    }
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
    let log = String::from_utf8_lossy(&output.stderr).into_owned() + &String::from_utf8_lossy(&output.stdout);
    std::fs::write(out.join("ptxas-report.txt"), &log).expect("write the ptxas report");
    if !output.status.success() {
        panic!("nvcc failed to compile the kernels:\n{log}");
    }
    let spills: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads"))
        .collect();
    if !spills.is_empty() {
        panic!(
            "kernels spill registers (see {}):\n{}",
            out.join("ptxas-report.txt").display(),
            spills.join("\n")
        );
    }
    println!("cargo:rustc-cfg=ferrocomm_fatbin");
}

// The host device's module: the same kernel sources, with the host-device runtime
// (device-api/host/runtime.cpp), built by the system C++ compiler into a shared library that
// the crate embeds and loads at run time, as the fatbin is on a GPU.
#[cfg(feature = "host-kernels")]
fn host_kernels(root: &Path, out: &Path, unity: &Path) {
    println!("cargo:rerun-if-env-changed=CXX");
    let library = out.join("libferrocomm_host_kernels.so");
    let mut cmd = cc::Build::new().cpp(true).get_compiler().to_command();
    cmd.args([
        "-std=c++20",
        "-O2",
        "-g0",
        "-fPIC",
        "-shared",
        "-pthread",
        "-DFERROCOMM_HOST_DEVICE",
    ])
    .args(["-Wall", "-Wno-unknown-pragmas", "-Wno-unused-parameter", "-Werror"])
    .arg("-I")
    .arg(root.join("device-api/include"))
    .arg("-I")
    .arg(root.join("kernels"))
    .args(["-x", "c++"])
    .arg(unity)
    .arg(root.join("device-api/host/runtime.cpp"))
    .arg("-o")
    .arg(&library);
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler for the host device: {e}"));
    if !output.status.success() {
        panic!(
            "the C++ compiler failed on the host-device kernels:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Paths of the files under `dir`, relative to `base`, with `/` separators.
fn list_files(base: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            list_files(base, &p, out);
        } else if let Ok(rel) = p.strip_prefix(base) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

fn kernel_sources(dir: &Path) -> Vec<PathBuf> {
    kernel_files(dir, "cu")
}

fn kernel_files(dir: &Path, extension: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().is_some_and(|e| e == extension));
    v.sort();
    v
}

fn find_nvcc(root: &Path) -> Option<PathBuf> {
    let exe = |dir: PathBuf| Some(dir.join("bin/nvcc")).filter(|p| p.is_file());
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        return exe(PathBuf::from(home));
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(p) = std::env::split_paths(&path)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
        {
            return Some(p);
        }
    }
    exe(root.join(".toolchain-cache/cuda-13.0/nvidia/cu13"))
}

// Bindings to rdma-core's libibverbs for host/net/windows/rdma.rs. Most of the data path of verbs.h
// (ibv_post_send, ibv_poll_cq, ibv_query_port, ...) is static inline; bindgen writes a C
// wrapper for each, compiled here, so Rust calls them like the exported ones.
#[cfg(feature = "rdma")]
fn verbs_bindings(out: &Path) {
    let header = out.join("ferrocomm_verbs.h");
    // ibv_query_port is a macro over an inline function; this wrapper gives it one name.
    let text = "#include <infiniband/verbs.h>\n\
        static inline int ferrocomm_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a) {\n\
          return ibv_query_port(c, port, a);\n\
        }\n";
    std::fs::write(&header, text).expect("write the verbs header");
    let wrappers = out.join("ferrocomm_verbs_wrappers");
    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .allowlist_function("ibv_.*|ferrocomm_query_port")
        .allowlist_type("ibv_.*")
        .allowlist_var("IBV_.*")
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .derive_default(true)
        .generate()
        .unwrap_or_else(|e| panic!("feature rdma: cannot read <infiniband/verbs.h> (install libibverbs-dev): {e}"));
    bindings
        .write_to_file(out.join("verbs.rs"))
        .expect("write the verbs bindings");
    cc::Build::new()
        .file(wrappers.with_extension("c"))
        .include(out)
        .compile("ferrocomm_verbs_wrappers");
    println!("cargo:rustc-link-lib=ibverbs");
}
