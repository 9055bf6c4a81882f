//! Window benchmark between two processes on this host, in one run:
//! - put bandwidth against plain `memcpy` of the same sizes (goal: put >= 0.9x memcpy);
//! - put + signal -> wait_signal ping-pong: half round trip (8-byte payload).
//!
//! `cargo bench --bench window_rma [-- --transport auto|tcp] [--max-bytes N]` prints a markdown
//! table. It starts its own two ranks (it hosts their store) and prints from rank 0.

use ferrocomm::prelude::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1).cloned())
}

/// Runs `f` repeatedly for at least `budget` (after one warm-up call); returns seconds per call.
fn time_per_call(budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let (mut n, t0) = (0u64, Instant::now());
    while t0.elapsed() < budget {
        f();
        n += 1;
    }
    t0.elapsed().as_secs_f64() / n as f64
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

fn rank_main(max_bytes: usize) -> ferrocomm::Result<()> {
    let comm = new_comm("cpu", Device::Cpu, "bench", CommOptions::from_env()?)?;
    let me = comm.rank();
    let win = comm.new_window(max_bytes)?;
    let budget = Duration::from_millis(300);

    if me == 0 {
        println!("| bytes | memcpy GB/s | put GB/s | put / memcpy |");
        println!("|---:|---:|---:|---:|");
    }
    let mut size = 4096;
    while size <= max_bytes {
        win.barrier()?;
        if me == 0 {
            let src = vec![1u8; size];
            let mut dst = vec![0u8; size];
            let copy = time_per_call(budget, || {
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&mut dst);
            });
            let put = time_per_call(budget, || win.put(1, 0, &src).expect("put"));
            win.flush()?;
            let (c, p) = (gbps(size, copy), gbps(size, put));
            println!("| {size} | {c:.2} | {p:.2} | {:.2} |", p / c);
        }
        size *= 4;
    }
    win.barrier()?;

    // Ping-pong: rank 0 puts 8 bytes + signals rank 1, which answers the same way.
    let iters = 20_000u64;
    let payload = [0u64; 1];
    let t0 = Instant::now();
    for i in 1..=iters {
        if me == 0 {
            win.put_signal(1, 0, &payload, 0, SignalOp::Add, 1)?;
            win.wait_signal(1, SignalSource::Rank(1), Cmp::Ge, i)?;
        } else {
            win.wait_signal(0, SignalSource::Rank(0), Cmp::Ge, i)?;
            win.put_signal(0, 0, &payload, 1, SignalOp::Add, 1)?;
        }
    }
    let half_rtt = t0.elapsed().as_secs_f64() / iters as f64 / 2.0;
    win.barrier()?;
    if me == 0 {
        println!();
        println!(
            "put(8 B) + signal -> wait_signal ping-pong: {:.2} us half round trip ({iters} round trips)",
            half_rtt * 1e6
        );
    }
    Ok(())
}

fn main() -> ferrocomm::Result<()> {
    let max_bytes: usize = arg("--max-bytes").and_then(|v| v.parse().ok()).unwrap_or(64 << 20);
    if std::env::var("RANK").is_ok() {
        return rank_main(max_bytes);
    }
    let transport = arg("--transport").unwrap_or_else(|| "auto".into());
    let token = ferrocomm::random_token().unwrap();
    let server = ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token)?;
    let port = server.addr().port().to_string();
    println!(
        "window_rma: 2 processes, transport {transport}, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let exe = std::env::current_exe().map_err(|e| ferrocomm::Error::Config(e.to_string()))?;
    let children: Vec<_> = (0..2)
        .map(|r| {
            Command::new(&exe)
                .args(std::env::args().skip(1))
                .envs([
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_RANK", r.to_string()),
                ])
                .envs([
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", &port),
                    ("FERROCOMM_TOKEN", &token),
                ])
                .envs([("FERROCOMM_STORE_EXTERNAL", "1"), ("FERROCOMM_TRANSPORT", &transport)])
                .stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() })
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let mut ok = true;
    for mut c in children {
        ok &= c.wait().map(|s| s.success()).unwrap_or(false);
    }
    if !ok {
        return Err(ferrocomm::Error::Config("a benchmark rank failed".into()));
    }
    Ok(())
}
