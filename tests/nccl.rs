//! The `nccl` backend and the device backend's use of it, as far as a machine without a GPU
//! can check: NCCL itself loads (the test command installs it), and every way in without a
//! GPU ends in a clear error. The GPU half is tests/gpu_nccl.rs.

mod common;

use common::*;
use ferrocomm::device::{self, DeviceSliceMut};
use ferrocomm::Error;

#[test]
fn nccl_is_found_and_new_enough() {
    match device::nccl_library() {
        Ok(lib) => {
            let parts: Vec<u32> = lib.version.split('.').map(|p| p.parse().unwrap()).collect();
            assert!(parts[0] > 2 || (parts[0] == 2 && parts[1] >= 18), "{lib:?}");
            assert!(lib.path.exists() || lib.path.components().count() == 1, "{lib:?}");
        }
        Err(e) => {
            assert!(
                std::env::var_os("FERROCOMM_REQUIRE_NCCL").is_none(),
                "NCCL required: {e}"
            );
            assert!(matches!(e, Error::Unavailable { .. }), "{e}");
            eprintln!("SKIPPED: {e}");
        }
    }
}

#[test]
fn without_a_gpu_the_nccl_backend_is_unavailable() {
    if device::available(0).is_ok() {
        eprintln!("SKIPPED: a GPU is present (tests/gpu_nccl.rs runs the backend)");
        return;
    }
    let err = Comm::new_group(
        "nccl",
        &[Device::Cuda(0)],
        "nccl-nogpu",
        options(Duration::from_secs(5)),
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::Unavailable { ref backend, .. } if backend == "nccl"),
        "{err}"
    );
    let err = Comm::new_group("nccl", &[Device::Cpu], "nccl-cpu", options(Duration::from_secs(5))).unwrap_err();
    assert!(err.to_string().contains("CUDA devices"), "{err}");
}

#[test]
fn a_device_buffer_on_a_host_communicator_is_refused() {
    let comms = Comm::new_group(
        "cpu",
        &[Device::Cpu; 2],
        "devbuf-on-cpu",
        options(Duration::from_secs(5)),
    )
    .unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                // SAFETY: the address is not device memory, but it is never dereferenced: the call
                // is refused before any backend touches it.
                let buf = unsafe { DeviceSliceMut::<f32>::from_raw(0, 0x10_0000, 16) }.unwrap();
                let err = c.all_reduce(buf, ReduceOp::Sum).unwrap_err();
                assert!(err.to_string().contains("CUDA device 0"), "{err}");
                // The communicator is still usable.
                let mut x = [c.rank() as f32; 4];
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
                assert_eq!(x, [1.0; 4]);
            });
        }
    });
}

#[test]
fn malformed_device_views_are_refused() {
    // The three views below are refused by from_raw's checks: no view exists and nothing is
    // ever dereferenced.
    // SAFETY: refused (null), as above.
    let e = unsafe { DeviceSliceMut::<f32>::from_raw(0, 0, 4) }.unwrap_err();
    assert!(e.to_string().contains("null"), "{e}");
    // SAFETY: refused (misaligned), as above.
    let e = unsafe { DeviceSliceMut::<u64>::from_raw(0, 0x1004, 4) }.unwrap_err();
    assert!(e.to_string().contains("aligned"), "{e}");
    // SAFETY: refused (the length overflows), as above.
    let e = unsafe { DeviceSliceMut::<u64>::from_raw(0, 0x1000, usize::MAX / 4) }.unwrap_err();
    assert!(e.to_string().contains("overflow"), "{e}");
}
