//! The Rust mirrors in ferrocomm::device::abi have the layout of device-api's abi.h as a C
//! compiler lays it out: every size and field offset is compared.

use ferrocomm::device::{DeviceStatus, ProxyQueue, WindowHandle};
use std::mem::{offset_of, size_of};
use std::process::Command;

macro_rules! fields {
    ($ty:ty, $c:literal: $($f:ident),+) => {
        vec![
            (format!("sizeof({})", $c), size_of::<$ty>()),
            $((format!("offsetof({}, {})", $c, stringify!($f)), offset_of!($ty, $f)),)+
        ]
    };
}

#[test]
fn rust_mirrors_match_the_c_header() {
    let mut rust = fields!(WindowHandle, "ferrocomm_window_handle": base, stride, data_bytes, signal_offset,
        barrier_offset, multicast, status, abort_flag, fifo, timeout_ns, rank, size, signals, abi_version);
    rust.extend(fields!(DeviceStatus, "ferrocomm_status": code, op, peer, signal_id, expected, observed));
    rust.extend(fields!(ProxyQueue, "ferrocomm_proxy_queue": slots, head, tail, done, remote, capacity, flags));
    // The descriptor format: host/net/windows/descriptor.rs decodes what device-api's producer encodes.
    use ferrocomm::device::abi as a;
    use ferrocomm::net::descriptor as d;
    for (name, value) in [
        ("FERROCOMM_PROXY_PUT", d::PUT as usize),
        ("FERROCOMM_PROXY_SIGNAL", d::SIGNAL as usize),
        ("FERROCOMM_PROXY_PARITY_BIT", d::PARITY_BIT as usize),
        ("FERROCOMM_PROXY_OP_SHIFT", d::OP_SHIFT as usize),
        ("FERROCOMM_PROXY_PEER_SHIFT", d::PEER_SHIFT as usize),
        ("FERROCOMM_PROXY_BYTES_SHIFT", d::BYTES_SHIFT as usize),
        ("FERROCOMM_PROXY_OFFSET_MASK", d::OFFSET_MASK as usize),
        ("FERROCOMM_PROXY_MAX_PUT", d::MAX_PUT),
        ("FERROCOMM_PROXY_MAX_PEER", d::MAX_PEER),
        ("FERROCOMM_SIGNAL_ADD", 1),
        ("FERROCOMM_ABI_VERSION", a::ABI_VERSION as usize),
        ("FERROCOMM_STATUS_ABI_MISMATCH", a::STATUS_ABI_MISMATCH as usize),
        ("FERROCOMM_STATUS_REFUSED", a::STATUS_REFUSED as usize),
        // The verbs a status names: the host's messages read them.
        ("FERROCOMM_STATUS_INVALID", a::STATUS_INVALID as usize),
        ("FERROCOMM_OP_WAIT_SIGNAL", a::OP_WAIT_SIGNAL as usize),
        ("FERROCOMM_OP_BARRIER", a::OP_BARRIER as usize),
        ("FERROCOMM_OP_FLUSH", a::OP_FLUSH as usize),
        ("FERROCOMM_OP_COLLECTIVE", a::OP_COLLECTIVE as usize),
        ("FERROCOMM_OP_PROXY", a::OP_PROXY as usize),
        ("FERROCOMM_OP_OUT_OF_WINDOW", a::OP_OUT_OF_WINDOW as usize),
        ("FERROCOMM_OP_NOT_VIA_PROXY", a::OP_NOT_VIA_PROXY as usize),
        ("FERROCOMM_OP_BAD_RANK", a::OP_BAD_RANK as usize),
        ("FERROCOMM_OP_BAD_SIGNAL", a::OP_BAD_SIGNAL as usize),
        ("FERROCOMM_OP_MISALIGNED", a::OP_MISALIGNED as usize),
    ] {
        rust.push((name.to_string(), value));
    }

    let dir = std::env::temp_dir().join(format!("ferrocomm-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c =
        String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"ferrocomm/abi.h\"\nint main(void) {\n");
    for (expr, _) in &rust {
        c += &format!("  printf(\"%zu\\n\", (size_t){expr});\n");
    }
    c += "  return 0;\n}\n";
    std::fs::write(dir.join("abi.c"), c).unwrap();
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/device-api/include");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I", include, "-o"])
        .arg(dir.join("abi"))
        .arg(dir.join("abi.c"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
    assert!(status.success(), "abi.h does not compile as C11");
    let out = Command::new(dir.join("abi")).output().unwrap();
    let c_values: Vec<usize> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(c_values.len(), rust.len());
    for ((expr, r), c) in rust.iter().zip(c_values) {
        assert_eq!(*r, c, "{expr}: Rust says {r}, C says {c}");
    }
}
