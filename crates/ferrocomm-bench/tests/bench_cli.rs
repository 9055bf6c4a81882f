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

/// `init` creates communicators as processes (shared memory and TCP) and as threads, checks
/// every rank's first all_reduce, and writes its JSON and CSV.
#[test]
fn init_creates_checked_communicators_in_every_mode() {
    let dir = std::env::temp_dir().join(format!("fc-bench-init-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, csv) = (dir.join("i.json"), dir.join("i.csv"));
    for (world, extra) in [
        ("3", &[][..]),
        ("2", &["--transport", "tcp"][..]),
        (
            "8",
            &[
                "--threads",
                "--json",
                json.to_str().unwrap(),
                "--csv",
                csv.to_str().unwrap(),
            ][..],
        ),
    ] {
        let mut args = vec!["init", "--world", world, "-n", "3", "-w", "1", "--check"];
        args.extend_from_slice(extra);
        let rows = checked(&args);
        assert_eq!(rows.len(), 3, "{args:?}: {rows:?}");
        for r in &rows {
            let ready: f64 = r[1].parse().unwrap();
            let first: f64 = r[3].parse().unwrap();
            let p2p: f64 = r[4].parse().unwrap();
            assert!(ready > 0.0 && first >= ready && p2p >= first, "{args:?}: {r:?}");
        }
    }
    let j = std::fs::read_to_string(&json).unwrap();
    assert!(
        j.starts_with("{\"tool\":\"ferrocomm\"") && j.contains("\"op\":\"init\"") && j.contains("\"mode\":\"threads\""),
        "{j}"
    );
    assert_eq!(j.matches("\"first_op_ms\":").count(), 3 + 1, "{j}");
    let c = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(c.lines().count(), 1 + 3, "{c}");
    assert!(c.lines().skip(1).all(|l| l.ends_with(",0")), "{c}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The data rows of a table (the lines that are not comments).
fn rows(text: &str) -> Vec<&str> {
    text.lines().filter(|l| !l.starts_with('#')).collect()
}

/// Runs `args`, expects success and rows whose last column (#wrong) is 0; returns the rows'
/// columns.
fn checked(args: &[&str]) -> Vec<Vec<String>> {
    let out = bench(args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{args:?}: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&text);
    assert!(!rows.is_empty(), "{args:?}: no rows\n{text}");
    for r in &rows {
        assert_eq!(
            r.split_whitespace().last(),
            Some("0"),
            "{args:?}: wrong elements in {r:?}"
        );
    }
    rows.iter()
        .map(|r| r.split_whitespace().map(str::to_owned).collect())
        .collect()
}

#[test]
fn rmsnorm_fused_and_unfused_pass_their_check_across_processes() {
    for dtype in ["f32", "bf16", "f16"] {
        for fp8 in [false, true] {
            let mut args = vec![
                "rmsnorm", "--tokens", "1,3,16", "--hidden", "256", "-n", "3", "-w", "1", "--world", "2", "-d", dtype,
                "--check",
            ];
            if fp8 {
                args.push("--fp8");
            }
            let rows = checked(&args);
            let tokens: Vec<&str> = rows.iter().map(|r| r[0].as_str()).collect();
            assert_eq!(tokens, ["1", "3", "16"], "{args:?}");
            // Both times and their ratio are there.
            for r in &rows {
                let (fused, unfused, ratio): (f64, f64, f64) =
                    (r[2].parse().unwrap(), r[3].parse().unwrap(), r[4].parse().unwrap());
                assert!(fused > 0.0 && unfused > 0.0, "{r:?}");
                assert!((ratio - unfused / fused).abs() < 0.01 * ratio + 0.002, "{r:?}");
            }
        }
    }
    // Three ranks, both algorithms of the fused call.
    for algo in ["oneshot", "twoshot"] {
        checked(&[
            "rmsnorm", "--tokens", "2,7", "--hidden", "128", "-n", "2", "-w", "1", "--world", "3", "-d", "bf16",
            "--algo", algo, "--check",
        ]);
    }
}

#[test]
fn rmsnorm_sizes_are_whole_token_rows_of_the_byte_sweep() {
    // Rows of 256 f32 = 1 KiB: 512 B holds none, 1K..8K hold 1, 2, 4, 8.
    let rows = checked(&[
        "rmsnorm",
        "-b",
        "512",
        "-e",
        "8K",
        "--hidden",
        "256",
        "-n",
        "2",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "--check",
    ]);
    let got: Vec<(&str, &str)> = rows.iter().map(|r| (r[0].as_str(), r[1].as_str())).collect();
    assert_eq!(got, [("1", "1024"), ("2", "2048"), ("4", "4096"), ("8", "8192")]);
}

#[test]
fn moe_dispatch_and_combine_pass_their_check() {
    for (dtype, fp8, world, threads) in [
        ("bf16", false, "2", false),
        ("f32", false, "2", true),
        ("bf16", true, "2", false),
        ("f16", true, "3", true),
    ] {
        let mut args = vec![
            "moe",
            "--tokens",
            "1,8,32",
            "--hidden",
            "256",
            "--topk",
            "4",
            "--experts",
            "12",
            "-n",
            "3",
            "-w",
            "1",
            "--world",
            world,
            "-d",
            dtype,
            "--check",
        ];
        if fp8 {
            args.push("--fp8");
        }
        if threads {
            args.push("--threads");
        }
        let rows = checked(&args);
        assert_eq!(rows.len(), 3, "{args:?}");
        for r in &rows {
            let (d, c, total): (f64, f64, f64) = (r[2].parse().unwrap(), r[3].parse().unwrap(), r[4].parse().unwrap());
            assert!(d > 0.0 && c > 0.0 && total > 0.0, "{r:?}");
        }
    }
    // A capacity below what the routing sends is the library's error, not a wrong count.
    let out = bench(&[
        "moe",
        "--tokens",
        "16",
        "--hidden",
        "128",
        "--topk",
        "2",
        "--experts",
        "2",
        "--capacity",
        "1",
        "-n",
        "1",
        "-w",
        "0",
        "--world",
        "2",
        "--threads",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("capacity"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn inference_ops_refuse_what_they_cannot_run() {
    for args in [
        &[
            "rmsnorm",
            "--tokens",
            "1",
            "--hidden",
            "64",
            "-d",
            "i32",
            "--world",
            "2",
            "--threads",
        ][..],
        &[
            "moe",
            "--tokens",
            "1",
            "--hidden",
            "128",
            "--experts",
            "7",
            "--world",
            "2",
            "--threads",
        ],
        &[
            "moe",
            "--tokens",
            "1",
            "--hidden",
            "128",
            "--topk",
            "9",
            "--experts",
            "8",
            "--world",
            "2",
            "--threads",
        ],
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}");
    }
    let out = bench(&["moe", "--tokens", "0"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn inference_rows_extend_the_json_and_csv_and_plot_draws_them() {
    let dir = std::env::temp_dir().join(format!("fc-bench-inf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let out = bench(&[
        "rmsnorm",
        "--tokens",
        "1,4",
        "--hidden",
        "128",
        "-n",
        "2",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "-d",
        "bf16",
        "--fp8",
        "--json",
        &path("n.json"),
        "--csv",
        &path("n.csv"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = std::fs::read_to_string(dir.join("n.json")).unwrap();
    assert!(
        j.starts_with("{\"tool\":\"ferrocomm\",\"backend\":\"cpu\",\"op\":\"rmsnorm\",\"world\":2,\"dtype\":\"bf16\"")
            && j.contains("\"tokens\":4,\"unfused_us\":")
            && j.contains("\"ratio\":")
            && j.contains("\"params\":{\"hidden\":128,\"fp8\":true,\"eps\":"),
        "{j}"
    );
    let c = std::fs::read_to_string(dir.join("n.csv")).unwrap();
    let mut lines = c.lines();
    assert_eq!(
        lines.next(),
        Some("tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong,tokens,hidden,fp8,unfused_us,ratio")
    );
    assert!(lines.all(|l| l.contains(",0,") && l.split(',').count() == 17), "{c}");

    let out = bench(&[
        "moe",
        "--tokens",
        "2,4",
        "--hidden",
        "128",
        "--topk",
        "2",
        "--experts",
        "4",
        "-n",
        "2",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "--json",
        &path("m.json"),
        "--csv",
        &path("m.csv"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = std::fs::read_to_string(dir.join("m.json")).unwrap();
    assert!(
        j.contains("\"op\":\"moe\"")
            && j.contains("\"tokens\":2,\"dispatch_us\":")
            && j.contains("\"combine_us\":")
            && j.contains("\"params\":{\"hidden\":128,\"fp8\":false,\"topk\":2,\"experts\":4,\"capacity\":8}"),
        "{j}"
    );
    let c = std::fs::read_to_string(dir.join("m.csv")).unwrap();
    assert!(
        c.starts_with(
            "tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong,tokens,hidden,topk,experts,\
             capacity,fp8,dispatch_us,combine_us\n"
        ) && c.lines().count() == 3,
        "{c}"
    );

    // The other ops' files keep their columns, and plot takes all of them together.
    let out = bench(&[
        "all_reduce",
        "-b",
        "8",
        "-e",
        "64",
        "-n",
        "2",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "--json",
        &path("a.json"),
        "--csv",
        &path("a.csv"),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let a = std::fs::read_to_string(dir.join("a.json")).unwrap();
    assert!(!a.contains("params") && !a.contains("tokens"), "{a}");
    let c = std::fs::read_to_string(dir.join("a.csv")).unwrap();
    assert!(
        c.starts_with("tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong\n"),
        "{c}"
    );
    let png = path("p.svg");
    let out = bench(&["plot", "-o", &png, &path("a.json"), &path("n.json"), &path("m.json")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let svg = std::fs::read_to_string(&png).unwrap();
    for caption in ["all_reduce: latency", "rmsnorm: latency", "moe: latency"] {
        assert!(svg.contains(caption), "{caption} missing");
    }
    std::fs::remove_dir_all(dir).unwrap();
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
        "init",
        "rmsnorm",
        "moe",
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

/// `--settle-ms` runs small all_reduces for that long on every rank before the first size,
/// and the sizes then run as without it.
#[test]
fn settling_takes_its_time_before_the_first_size_on_every_rank() {
    let args = [
        "all_reduce",
        "--world",
        "3",
        "-b",
        "8",
        "-e",
        "64",
        "-n",
        "5",
        "-w",
        "1",
        "--check",
    ];
    let started = std::time::Instant::now();
    let settled = checked(&[&args[..], &["--settle-ms", "400"]].concat());
    assert!(started.elapsed() >= std::time::Duration::from_millis(400));
    assert_eq!(settled.len(), 4);
}
