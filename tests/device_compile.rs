//! NVRTC compiles kernels that use the device API: needs libnvrtc, not a GPU. The test command
//! installs NVRTC (scripts/cuda-toolchain.sh) and sets FERROCOMM_REQUIRE_NVRTC=1, so there these
//! tests cannot skip; elsewhere they skip with a printed reason when NVRTC is missing.

use ferrocomm::device::{compile_image, CompileOptions, HEADERS};
use ferrocomm::Error;

const TEST_KERNELS: &str = include_str!("gpu/kernels.cu");

/// Ok(true) when NVRTC can run here; Ok(false) (with the reason printed) when it may be absent.
fn nvrtc_or_skip() -> bool {
    match compile_image("extern \"C\" __global__ void k() {}", &CompileOptions::default()) {
        Ok(_) => true,
        Err(e @ Error::Unavailable { .. }) => {
            assert_ne!(
                std::env::var("FERROCOMM_REQUIRE_NVRTC").as_deref(),
                Ok("1"),
                "FERROCOMM_REQUIRE_NVRTC=1 but {e}"
            );
            eprintln!("SKIPPED: {e}");
            false
        }
        Err(e) => panic!("NVRTC failed on an empty kernel: {e}"),
    }
}

#[test]
fn test_kernels_compile_to_cubins_for_every_target() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let opts = CompileOptions {
            arch: Some(arch.into()),
            name: Some("kernels.cu".into()),
            ..Default::default()
        };
        let image = compile_image(TEST_KERNELS, &opts).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(&image[..4], b"\x7fELF", "{arch}: a cubin is an ELF image");
    }
}

#[test]
fn ptx_names_every_kernel_and_uses_system_scope_orderings() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptx = String::from_utf8(compile_image(TEST_KERNELS, &CompileOptions::default()).unwrap()).unwrap();
    for k in [
        "ring_thread",
        "ring_warp",
        "ring_block",
        "get_block",
        "put_signal_block",
        "one_verb",
        "barrier_rounds",
        "wait_forever",
    ] {
        assert!(ptx.contains(&format!(".entry {k}(")), "kernel {k} missing from the PTX");
    }
    // The contract's mapping (docs/memory-model.md): release signals, acquire waits, timers.
    for insn in [
        "st.release.sys.global.u64",
        "ld.acquire.sys.global.u64",
        "%globaltimer",
        "atom.acq_rel.sys.global.add.u64",
    ] {
        assert!(ptx.contains(insn), "{insn} missing from the PTX");
    }
    assert!(!ptx.contains("trap;"), "device code must never trap");
}

/// For sm_90 the multicast verbs are real instructions, with the alias fence around them.
#[test]
fn multimem_verbs_compile_for_sm_90() {
    if !nvrtc_or_skip() {
        return;
    }
    let opts = CompileOptions {
        arch: Some("compute_90".into()),
        ..Default::default()
    };
    let ptx = String::from_utf8(compile_image(TEST_KERNELS, &opts).unwrap()).unwrap();
    for insn in [
        "multimem.st.relaxed.sys.global.v4.f32",
        "multimem.ld_reduce.relaxed.sys.global.add.v4.f32",
        "fence.proxy.alias",
    ] {
        assert!(ptx.contains(insn), "{insn} missing from the sm_90 PTX");
    }
}

#[test]
fn a_compile_error_carries_nvrtcs_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let bad = "#include \"ferrocomm/ferrocomm.cuh\"\nextern \"C\" __global__ void k() { undefined_thing(); }";
    let err = compile_image(bad, &CompileOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Backend { .. }), "{text}");
    assert!(text.contains("undefined_thing"), "the log names the error: {text}");
}

/// Reads no file at run time: the bundle runs this binary far from the source tree.
#[test]
fn every_header_of_the_device_api_is_served_to_nvrtc() {
    let mut on_disk: Vec<String> = ferrocomm::device::DEVICE_API_FILES
        .iter()
        .filter(|f| f.starts_with("ferrocomm/"))
        .map(|f| f.to_string())
        .collect();
    on_disk.sort();
    assert!(on_disk.len() >= 10, "the build listed the device API: {on_disk:?}");
    let mut served: Vec<String> = HEADERS.iter().map(|h| h.0.to_owned()).collect();
    served.sort();
    assert_eq!(served, on_disk);
}

/// The library's own kernels as the NVRTC fallback compiles them (one unit, as build.rs joins
/// them for nvcc): every entry point the backends load must be in the PTX.
#[test]
fn the_library_kernels_compile_with_nvrtc_as_the_fallback_does() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptx =
        String::from_utf8(ferrocomm::device::library_image("compute_90").unwrap_or_else(|e| panic!("{e}"))).unwrap();
    let mut wanted = vec![
        "ferrocomm_signal".to_string(),
        "ferrocomm_wait_signal".into(),
        "ferrocomm_signal_from".into(),
        "ferrocomm_allgather_oneshot".into(),
        "ferrocomm_alltoall".into(),
    ];
    for d in ["f32", "f16", "bf16", "i16", "u16"] {
        for op in ["sum", "min", "max", "avg"] {
            wanted.push(format!("ferrocomm_allreduce_oneshot_{d}_{op}"));
            wanted.push(format!("ferrocomm_allreduce_twoshot_{d}_{op}"));
            wanted.push(format!("ferrocomm_reducescatter_oneshot_{d}_{op}"));
        }
    }
    // The pairs the switch reduces (kernels/multimem.cu).
    for s in [
        "f32_sum", "f32_avg", "f16_sum", "f16_min", "f16_max", "bf16_sum", "bf16_min", "bf16_max",
    ] {
        wanted.push(format!("ferrocomm_allreduce_multimem_{s}"));
    }
    assert!(
        ptx.contains("multimem.ld_reduce"),
        "the multimem kernels use the switch's load-reduce"
    );
    for k in wanted {
        assert!(ptx.contains(&format!(".entry {k}(")), "kernel {k} missing from the PTX");
    }
}
