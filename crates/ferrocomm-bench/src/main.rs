//! ferrocomm-bench: nccl-tests-style sweeps of every collective, of window put / get / signal
//! latency and of the device rows, and `plot`, which draws their JSON (and the peers').
//! `ferrocomm-bench --help` lists the ops; `ferrocomm-bench OP --help` the flags.

mod aligned;
mod cli;
mod device_coll;
mod device_norm;
mod gpu;
mod host_device;
mod inference;
mod init;
mod nccl_direct;
mod ops;
mod plot;
mod progress;
mod queue;
mod ranks;
mod report;
mod settle;
mod size;
mod sweep;

use clap::CommandFactory;
use cli::{Args, DeviceKind, Invocation};
use ferrocomm::Error;
use std::process::ExitCode;

/// Any failure of a run: the library's errors and the bench's own, reported as one line.
pub type Failure = Box<dyn std::error::Error>;

/// Runs one op's sweep where it belongs: the device rows on GPU 0 or the host device, the
/// single-process rows in this process, the rest in ranks.
fn sweep(a: &Args) -> Result<(), Failure> {
    let device_row = a.op.starts_with("device_");
    if a.graph {
        return Err(Error::Unavailable {
            backend: a.backend.clone(),
            reason: "--graph captures CUDA graphs and needs a GPU backend".into(),
        }
        .into());
    }
    match a.op.as_str() {
        _ if device_row && a.device == DeviceKind::Host => host_device::run(a)?,
        "device_all_reduce" => device_coll::run(a)?,
        "device_rmsnorm" => device_norm::run(a)?,
        _ if device_row => gpu::run(a)?,
        "queue_pickup" => queue::run(a)?,
        "nccl_all_reduce" => nccl_direct::run(a)?,
        "init" => init::run(a)?,
        _ => ranks::run(a)?,
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = match cli::parse() {
        Invocation::Sweep(a) => ferrocomm::init_logging().map_err(Failure::from).and_then(|_| sweep(&a)),
        Invocation::Plot(p) => plot::run(&p),
        Invocation::Completions(shell) => {
            clap_complete::generate(
                shell,
                &mut cli::Cli::command(),
                "ferrocomm-bench",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrocomm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
