//! ferrocomm-bench runs every op with --check and reports no wrong element; its JSON and CSV
//! carry one row per size; nccl-tests' flags are accepted; bad arguments are clap's usage
//! errors.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrocomm-bench"))
        .args(args)
        .output()
        .expect("run ferrocomm-bench")
}

/// The device rows of the bench on the host device: every size of one- and two-shot checked
/// bit for bit on every rank, at 1, 2, 3, 4 and 8 ranks; the SM put checked; the ping-pong.
#[cfg(feature = "host-kernels")]
#[test]
fn device_all_reduce_on_the_host_device_passes_its_check() {
    for world in ["1", "2", "3", "4", "8"] {
        let out = bench(&[
            "device_all_reduce",
            "--device",
            "host",
            "--world",
            world,
            "-b",
            "2",
            "-e",
            "128K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "1",
            "--check",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "world {world}: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("checked bit for bit"), "{text}");
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 6, "{text}");
    }
    // The other device rows: an SM put into the peer's window (checked) and the kernels'
    // ping-pong (both must finish).
    for args in [
        &[
            "device_put",
            "--device",
            "host",
            "-b",
            "1K",
            "-e",
            "1M",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "1",
            "--check",
        ][..],
        &["device_pingpong", "--device", "host", "-n", "100"][..],
    ] {
        let out = bench(args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("host device"), "{text}");
    }
}

#[test]
fn every_op_passes_its_check_across_processes() {
    let ops = [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "send_recv",
        "put",
        "get",
        "signal",
    ];
    for op in ops {
        let out = bench(&[
            op, "-b", "8", "-e", "256K", "-f", "8", "-n", "3", "-w", "1", "--world", "3", "--check",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{op}: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rows: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert!(!rows.is_empty(), "{op}: no rows\n{text}");
        for r in rows {
            assert_eq!(
                r.split_whitespace().last(),
                Some("0"),
                "{op}: wrong elements in row {r:?}"
            );
        }
    }
}

#[test]
fn threads_mode_writes_json_and_csv_rows() {
    let dir = std::env::temp_dir().join(format!("fc-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, csv) = (dir.join("r.json"), dir.join("r.csv"));
    let out = bench(&[
        "all_gather",
        "-b",
        "64",
        "-e",
        "64K",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "--check",
        "--dtype",
        "bf16",
        "--json",
        json.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = std::fs::read_to_string(&json).unwrap();
    assert!(
        j.starts_with("{\"tool\":\"ferrocomm\"")
            && j.contains("\"op\":\"all_gather\"")
            && j.contains("\"dtype\":\"bf16\"")
    );
    assert_eq!(j.matches("\"bytes\":").count(), 6, "{j}");
    let c = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(c.lines().count(), 1 + 6, "{c}");
    assert!(c.lines().skip(1).all(|l| l.ends_with(",0")), "{c}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn nccl_tests_flags_run_a_checked_sweep() {
    let out = bench(&[
        "all_reduce",
        "-b",
        "1K",
        "-e",
        "4K",
        "-f",
        "2",
        "-n",
        "2",
        "-w",
        "1",
        "-c",
        "1",
        "-d",
        "int32",
        "-o",
        "max",
        "--world",
        "2",
        "--threads",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}\n{text}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(rows.len(), 3, "{text}");
    for r in rows {
        let cols: Vec<&str> = r.split_whitespace().collect();
        assert_eq!((cols[2], cols[3], cols[8]), ("i32", "max", "0"), "{r}");
    }
}

#[test]
fn bad_arguments_are_usage_errors_and_graph_needs_a_gpu() {
    let usage = |args: &[&str]| {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(usage(&[]).contains("Usage: ferrocomm-bench"));
    assert!(usage(&["no_such_op"]).contains("no_such_op"));
    assert!(usage(&["all_reduce", "-b", "1x"]).contains("1x"));
    assert!(usage(&["all_reduce", "-b", "64", "-e", "8"]).contains("minbytes <= maxbytes"));
    assert!(usage(&["all_reduce", "--dtype", "f8"]).contains("f8"));
    assert!(usage(&["all_reduce", "-c", "2"]).contains("0 or 1"));
    let g = bench(&["all_reduce", "--graph", "--world", "1"]);
    assert_eq!(g.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&g.stderr).contains("GPU"));
}

#[test]
fn help_is_clap_and_lists_every_op() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for op in [
        "all_reduce",
        "device_all_reduce",
        "nccl_all_reduce",
        "queue_pickup",
        "plot",
    ] {
        assert!(text.contains(op), "{op} missing from --help:\n{text}");
    }
    let op_help = String::from_utf8_lossy(&bench(&["all_reduce", "--help"]).stdout).into_owned();
    for flag in [
        "--minbytes",
        "--maxbytes",
        "--stepfactor",
        "--iters",
        "--warmup_iters",
        "--check",
        "--datatype",
        "--redop",
    ] {
        assert!(op_help.contains(flag), "{flag} missing:\n{op_help}");
    }
}
