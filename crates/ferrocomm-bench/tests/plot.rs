//! `ferrocomm-bench plot` draws the bench's JSON and a peer's side by side as PNG and SVG;
//! a sweep's `--plot` draws its own rows; files it cannot use are errors that name them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrocomm-bench"))
        .args(args)
        .output()
        .expect("run ferrocomm-bench")
}

/// A fresh directory of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fc-plot-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A report of `tool` in the bench's schema: all_reduce at 2 ranks, 8 B to 1 MiB.
fn report(dir: &Path, tool: &str, backend: &str, slowdown: f64) -> String {
    let rows: Vec<String> = (3..=20)
        .map(|p| {
            let bytes = 1u64 << p;
            let time_us = slowdown * (2.0 + bytes as f64 / 5e3);
            let algbw = bytes as f64 / time_us / 1e3;
            format!(
                "{{\"bytes\":{bytes},\"count\":{},\"time_us\":{time_us:.3},\"algbw\":{algbw:.4},\"busbw\":{algbw:.4},\"wrong\":0}}",
                bytes / 4
            )
        })
        .collect();
    let path = dir.join(format!("{tool}.json"));
    std::fs::write(
        &path,
        format!(
            "{{\"tool\":\"{tool}\",\"backend\":\"{backend}\",\"op\":\"all_reduce\",\"world\":2,\"dtype\":\"f32\",\"redop\":\"sum\",\"rows\":[{}]}}\n",
            rows.join(",")
        ),
    )
    .unwrap();
    path.display().to_string()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(bytes.len() > 1000, "{} is only {} bytes", path.display(), bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{} is not a PNG", path.display());
}

#[test]
fn ferrocomm_and_a_peer_are_drawn_side_by_side_as_png_and_svg() {
    let dir = scratch("both");
    let ours = report(&dir, "ferrocomm", "cpu", 1.0);
    let theirs = report(&dir, "mpich", "mpi", 1.5);
    let png = dir.join("out.png");
    assert_ok(&bench(&["plot", "-o", png.to_str().unwrap(), &ours, &theirs]));
    assert_png(&png);

    let svg = dir.join("out.svg");
    assert_ok(&bench(&["plot", "--output", svg.to_str().unwrap(), &ours, &theirs]));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg"), "not an SVG:\n{text}");
    for label in [
        "all_reduce: latency",
        "all_reduce: bus bandwidth",
        "ferrocomm n=2",
        "mpich n=2",
        "message size (bytes)",
        "time (us)",
        "busbw (GB/s)",
    ] {
        assert!(text.contains(label), "the SVG lacks {label:?}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_sweep_plots_its_own_rows() {
    let dir = scratch("sweep");
    let png = dir.join("sweep.png");
    let out = bench(&[
        "broadcast",
        "-b",
        "8",
        "-e",
        "4K",
        "-n",
        "2",
        "-w",
        "1",
        "--world",
        "2",
        "--threads",
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert_ok(&out);
    assert_png(&png);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn unusable_inputs_and_outputs_are_errors_that_name_them() {
    let dir = scratch("bad");
    let ours = report(&dir, "ferrocomm", "cpu", 1.0);
    let failure = |args: &[&str]| {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(1), "{args:?} did not fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let jpg = dir.join("out.jpg");
    assert!(failure(&["plot", "-o", jpg.to_str().unwrap(), &ours]).contains(".png or .svg"));
    let missing = dir.join("missing.json");
    let png = dir.join("out.png");
    assert!(failure(&["plot", "-o", png.to_str().unwrap(), missing.to_str().unwrap()]).contains("missing.json"));
    let other = dir.join("pickup.json");
    std::fs::write(
        &other,
        "{\"tool\":\"ferrocomm\",\"op\":\"queue_pickup\",\"rows\":[{\"gap_us\":0}]}",
    )
    .unwrap();
    assert!(failure(&["plot", "-o", png.to_str().unwrap(), other.to_str().unwrap()]).contains("pickup.json"));
    assert!(!png.exists(), "a failed plot left a file");
    // No input at all is clap's usage error.
    assert_eq!(bench(&["plot", "-o", png.to_str().unwrap()]).status.code(), Some(2));
    std::fs::remove_dir_all(dir).unwrap();
}
