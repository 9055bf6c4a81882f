//! ferrocomm-bench: nccl-tests-style sweeps of every collective and of window put / get /
//! signal latency. Without launcher variables it starts `--world` ranks itself (processes, or
//! threads with `--threads`); rank 0 prints the table and writes `--json` / `--csv`.

mod args;
mod device_coll;
mod gpu;
mod host_device;
mod nccl_direct;
mod ops;
mod queue;

use args::Args;
use ferrocomm::prelude::*;
use ferrocomm::{Error, Result};
use ops::{Bench, Row};
use std::io::{IsTerminal, Write};
use std::process::{Command, Stdio};

const HEADER: &str = "#       size         count      type   redop    root     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)";

fn sizes(a: &Args) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = a.min_bytes;
    while s <= a.max_bytes {
        v.push(s);
        s = s.saturating_mul(a.factor);
    }
    v
}

fn format_row(a: &Args, r: &Row) -> String {
    let root = if matches!(a.op.as_str(), "reduce" | "broadcast") {
        a.root as i64
    } else {
        -1
    };
    let redop = if matches!(a.op.as_str(), "all_reduce" | "reduce" | "reduce_scatter") {
        a.redop.as_str()
    } else {
        "none"
    };
    format!(
        "{:>12} {:>13} {:>9} {:>7} {:>7} {:>8.2} {:>7.2} {:>7.2} {:>7}",
        r.bytes, r.count, a.dtype, redop, root, r.time_us, r.algbw, r.busbw, r.wrong
    )
}

/// Runs the sweep on this rank; rank 0 prints and returns the rows.
fn sweep<T: ops::BenchElem>(comm: &Comm, a: &Args) -> Result<Vec<Row>> {
    let mut bench = Bench::new(comm, a)?;
    let all = sizes(a);
    let lead = comm.rank() == 0;
    let progress = lead && std::io::stderr().is_terminal();
    if lead {
        println!(
            "# ferrocomm-bench {} on backend {}, {} ranks, {}",
            a.op,
            comm.backend_name(),
            comm.size(),
            a.dtype
        );
        println!("{HEADER}");
    }
    let mut rows = Vec::new();
    for (k, &bytes) in all.iter().enumerate() {
        if progress {
            eprint!("\r[{:>3}/{}] {} {} B ", k + 1, all.len(), a.op, bytes);
        }
        let Some(row) = bench.row::<T>(bytes)? else { continue };
        if lead {
            if progress {
                eprint!("\r\x1b[K");
            }
            println!("{}", format_row(a, &row));
            let _ = std::io::stdout().flush();
        }
        rows.push(row);
        if a.op == "signal" {
            break; // one latency figure, independent of size
        }
    }
    Ok(rows)
}

fn dispatch(comm: &Comm, a: &Args) -> Result<Vec<Row>> {
    match a.dtype.as_str() {
        "f32" | "float" => sweep::<f32>(comm, a),
        "f64" | "double" => sweep::<f64>(comm, a),
        "f16" | "half" => sweep::<ferrocomm::f16>(comm, a),
        "bf16" => sweep::<ferrocomm::bf16>(comm, a),
        "i8" | "int8" => sweep::<i8>(comm, a),
        "u8" | "uint8" => sweep::<u8>(comm, a),
        "i32" | "int32" => sweep::<i32>(comm, a),
        "i64" | "int64" => sweep::<i64>(comm, a),
        "u32" | "uint32" => sweep::<u32>(comm, a),
        "u64" | "uint64" => sweep::<u64>(comm, a),
        other => Err(Error::Config(format!("--dtype {other}: unknown"))),
    }
}

fn write_outputs(a: &Args, world: usize, rows: &[Row]) -> Result<()> {
    let io = |e| Error::Io {
        context: "write benchmark output".into(),
        source: e,
    };
    if let Some(p) = &a.json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"bytes\":{},\"count\":{},\"time_us\":{:.3},\"algbw\":{:.4},\"busbw\":{:.4},\"wrong\":{}}}",
                    r.bytes, r.count, r.time_us, r.algbw, r.busbw, r.wrong
                )
            })
            .collect();
        let doc = format!(
            "{{\"tool\":\"ferrocomm\",\"backend\":\"{}\",\"op\":\"{}\",\"world\":{world},\"dtype\":\"{}\",\"redop\":\"{}\",\"rows\":[{}]}}\n",
            a.backend,
            a.op,
            a.dtype,
            a.redop,
            items.join(",")
        );
        std::fs::write(p, doc).map_err(io)?;
    }
    if let Some(p) = &a.csv {
        let mut s = String::from("tool,backend,op,world,dtype,redop,bytes,count,time_us,algbw,busbw,wrong\n");
        for r in rows {
            s += &format!(
                "ferrocomm,{},{},{world},{},{},{},{},{:.3},{:.4},{:.4},{}\n",
                a.backend, a.op, a.dtype, a.redop, r.bytes, r.count, r.time_us, r.algbw, r.busbw, r.wrong
            );
        }
        std::fs::write(p, s).map_err(io)?;
    }
    if let Some(png) = &a.plot {
        let json = a
            .json
            .clone()
            .ok_or_else(|| Error::Config("--plot needs --json (the plot reads it)".into()))?;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/plot_bench.py");
        // FERROCOMM_PYTHON picks an interpreter that has matplotlib (scripts/cpu_compare.sh
        // makes one in .toolchain-cache/gloo-venv).
        let python = std::env::var("FERROCOMM_PYTHON").unwrap_or_else(|_| "python3".into());
        let ok = Command::new(&python)
            .arg(script)
            .arg("-o")
            .arg(png)
            .arg(&json)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let why = format!("plotting failed: {python} {script} needs matplotlib (set FERROCOMM_PYTHON)");
            return Err(Error::Config(why));
        }
    }
    Ok(())
}

fn rank_main(a: &Args) -> Result<()> {
    let comm = new_comm(&a.backend, Device::Cpu, "bench", CommOptions::from_env()?)?;
    let rows = dispatch(&comm, a)?;
    if comm.rank() == 0 {
        write_outputs(a, comm.size(), &rows)?;
    }
    comm.finalize()
}

fn threads_main(a: &Args) -> Result<()> {
    let comms = Comm::new_group(
        &a.backend,
        &vec![Device::Cpu; a.world],
        "bench",
        CommOptions::from_env()?,
    )?;
    let rows = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || dispatch(c, a))).collect();
        let mut out = Vec::new();
        for h in hs {
            out.push(h.join().map_err(|_| Error::Config("a rank thread panicked".into()))??);
        }
        Ok::<_, Error>(out.swap_remove(0))
    })?;
    write_outputs(a, a.world, &rows)
}

fn processes_main(a: &Args) -> Result<()> {
    let token = ferrocomm::random_token();
    let server = ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token)?;
    let port = server.addr().port().to_string();
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        context: "current_exe".into(),
        source: e,
    })?;
    let mut argv = args::to_argv(a);
    for (flag, v) in [("--json", &a.json), ("--csv", &a.csv), ("--plot", &a.plot)] {
        if let Some(p) = v {
            argv.push(flag.into());
            argv.push(p.display().to_string());
        }
    }
    let mut children = Vec::with_capacity(a.world);
    for r in 0..a.world {
        let c = Command::new(&exe)
            .args(&argv)
            .envs([
                ("RANK", r.to_string()),
                ("WORLD_SIZE", a.world.to_string()),
                ("LOCAL_RANK", r.to_string()),
            ])
            .envs([
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
                ("FERROCOMM_TOKEN", &token),
            ])
            .env("FERROCOMM_STORE_EXTERNAL", "1")
            .stdout(if r == 0 { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .map_err(|e| Error::Io {
                context: "spawn a bench rank".into(),
                source: e,
            })?;
        children.push(c);
    }
    let mut failed = Vec::new();
    for (r, mut c) in children.into_iter().enumerate() {
        if !c.wait().is_ok_and(|s| s.success()) {
            failed.push(r);
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::Config(format!("bench ranks {failed:?} failed")))
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let a = match args::parse(&argv) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ferrocomm-bench: {e}");
            }
            eprintln!("{}", args::USAGE);
            std::process::exit(2);
        }
    };
    let r = if a.graph {
        Err(Error::Unavailable {
            backend: a.backend.clone(),
            reason: "--graph captures CUDA graphs and needs a GPU backend".into(),
        })
    } else if a.op.starts_with("device_") && a.device == "host" {
        host_device::run(&a)
    } else if a.op.starts_with("device_") && a.device != "cuda" {
        Err(Error::Config(format!("--device {}: expected cuda or host", a.device)))
    } else if a.op == "device_all_reduce" {
        device_coll::run(&a)
    } else if a.op.starts_with("device_") {
        gpu::run(&a)
    } else if a.op == "queue_pickup" {
        queue::run(&a)
    } else if a.op == "nccl_all_reduce" {
        nccl_direct::run(&a)
    } else if ferrocomm::discover(|k| std::env::var(k).ok()).ok().flatten().is_some() {
        rank_main(&a)
    } else if a.threads {
        threads_main(&a)
    } else {
        processes_main(&a)
    };
    if let Err(e) = r {
        eprintln!("ferrocomm-bench: {e}");
        std::process::exit(1);
    }
}
