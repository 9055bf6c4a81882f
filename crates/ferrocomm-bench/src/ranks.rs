//! Where a host sweep's ranks come from: a launcher (this process is one rank), threads of this
//! process (`--threads`), or `--world` copies of this program that it starts itself.

use crate::cli::Args;
use crate::sweep;
use crate::Failure;
use ferrocomm::prelude::*;
use ferrocomm::Error;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// Runs the sweep in the ranks the environment and `a` call for.
pub fn run(a: &Args) -> Result<(), Failure> {
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        launched(a)
    } else if a.threads {
        threads(a)
    } else {
        spawn(a)
    }
}

/// The variable through which the bench tells the processes it starts when it spawned them
/// (nanoseconds since the Unix epoch); `init` reads it to time process start-up.
pub const SPAWNED_AT: &str = "FCBENCH_SPAWNED_NS";

/// Now, in nanoseconds since the Unix epoch.
fn spawned_at() -> String {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
        .to_string()
}

/// Started by a launcher: this process is one rank.
fn launched(a: &Args) -> Result<(), Failure> {
    let comm = new_comm(&a.backend, Device::Cpu, "bench", CommOptions::from_env()?)?;
    let rows = sweep::run(&comm, a)?;
    if comm.rank() == 0 {
        sweep::write_outputs(a, comm.size(), rows)?;
    }
    Ok(comm.finalize()?)
}

fn threads(a: &Args) -> Result<(), Failure> {
    let comms = Comm::new_group(
        &a.backend,
        &vec![Device::Cpu; a.world],
        "bench",
        CommOptions::from_env()?,
    )?;
    let rows = std::thread::scope(|s| {
        let hs: Vec<_> = comms.iter().map(|c| s.spawn(move || sweep::run(c, a))).collect();
        let mut out = Vec::new();
        for h in hs {
            out.push(h.join().map_err(|_| Error::Config("a rank thread panicked".into()))??);
        }
        Ok::<_, Error>(out.swap_remove(0))
    })?;
    sweep::write_outputs(a, a.world, rows)
}

/// Starts `--world` copies of this program with this command line as the ranks, hosting their
/// store; rank 0's output is ours. Each learns when it was spawned (`init` reports start-up).
pub fn spawn(a: &Args) -> Result<(), Failure> {
    let token = ferrocomm::random_token()?;
    let server = ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token)?;
    let port = server.addr().port().to_string();
    let exe = std::env::current_exe().map_err(|e| Error::Io {
        context: "find this program (current_exe)".into(),
        source: e,
    })?;
    let cores = match a.bind_to.as_str() {
        "core" => {
            let cores = ferrocomm::cores_for_ranks(a.world)?;
            if cores.is_none() {
                eprintln!(
                    "ferrocomm-bench: --bind-to core: {} ranks outnumber the cores; binding none",
                    a.world
                );
            }
            cores
        }
        _ => None,
    };
    let mut children = Vec::with_capacity(a.world);
    for r in 0..a.world {
        let mut cmd = Command::new(&exe);
        if let Some(core) = cores.as_ref().map(|c| c[r].clone()) {
            // SAFETY: bind_to_core makes one system call and allocates nothing; `core` was
            // allocated before the fork, and the child only reads it.
            unsafe { cmd.pre_exec(move || ferrocomm::bind_to_core(&core)) };
        }
        let c = cmd
            .args(std::env::args_os().skip(1))
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
            .env(SPAWNED_AT, spawned_at())
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
    drop(server);
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("bench ranks {failed:?} failed").into())
    }
}
