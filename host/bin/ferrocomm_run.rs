//! `ferrocomm-run -n N [--] program [args...]`: starts N local ranks of `program` (like
//! `torchrun --standalone`). It hosts the job's TCP store with a fresh token, sets the torchrun
//! variables for each rank, prefixes every output line with the rank, and when one rank fails
//! it stops the others and exits non-zero.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const USAGE: &str = "usage: ferrocomm-run -n N [--] program [args...]";
/// How long the other ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(3);

fn parse(args: &[String]) -> Result<(usize, Vec<String>), String> {
    let mut n = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "-n" | "--nproc" | "--nproc-per-node" => {
                let v = args.get(i + 1).ok_or("-n needs a value")?;
                n = Some(v.parse::<usize>().map_err(|_| format!("-n {v}: not a number"))?);
                i += 2;
            }
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                i += 1;
                break;
            }
            a if a.starts_with('-') => return Err(format!("unknown option {a}")),
            _ => break,
        }
    }
    let n = n.ok_or("missing -n N")?;
    if n == 0 {
        return Err("-n must be at least 1".into());
    }
    let prog = args[i..].to_vec();
    if prog.is_empty() {
        return Err("missing program".into());
    }
    Ok((n, prog))
}

fn pump(rank: usize, src: impl std::io::Read + Send + 'static, to_stderr: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).split(b'\n').map_while(Result::ok) {
            let text = String::from_utf8_lossy(&line);
            // One write per line keeps ranks' lines whole when they interleave.
            let out = format!("[{rank}]: {text}\n");
            let _ = if to_stderr {
                std::io::stderr().lock().write_all(out.as_bytes())
            } else {
                std::io::stdout().lock().write_all(out.as_bytes())
            };
        }
    })
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (_, Some(sig)) => format!("signal {sig}"),
        _ => "unknown status".into(),
    }
}

fn exit_code(s: ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => (c as u8).max(1),
        (_, Some(sig)) => 128u8.saturating_add(sig as u8),
        _ => 1,
    }
}

fn signal_all(children: &mut [Option<Child>], sig: libc::c_int) {
    for c in children.iter().flatten() {
        // SAFETY: sending a signal to our own child.
        unsafe { libc::kill(c.id() as libc::pid_t, sig) };
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (n, prog) = match parse(&args) {
        Ok(x) => x,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("ferrocomm-run: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let token = ferrocomm::random_token();
    let server = match ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ferrocomm-run: cannot start the store: {e}");
            return ExitCode::from(1);
        }
    };
    let port = server.addr().port().to_string();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    let mut pumps = Vec::new();
    for rank in 0..n {
        let spawned = Command::new(&prog[0])
            .args(&prog[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_STORE_EXTERNAL", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        match spawned {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(rank, o, false));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(rank, e, true));
                }
                children.push(Some(c));
            }
            Err(e) => {
                eprintln!("ferrocomm-run: cannot start {:?}: {e}", prog[0]);
                signal_all(&mut children, libc::SIGKILL);
                return ExitCode::from(1);
            }
        }
    }

    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut stop_deadline: Option<Instant> = None;
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            if let Ok(Some(status)) = c.try_wait() {
                *slot = None;
                if !status.success() && failure.is_none() {
                    eprintln!(
                        "ferrocomm-run: rank {rank} failed ({}); stopping the other ranks",
                        describe(status)
                    );
                    failure = Some((rank, status));
                }
            }
        }
        if failure.is_some() && stop_deadline.is_none() {
            signal_all(&mut children, libc::SIGTERM);
            stop_deadline = Some(Instant::now() + GRACE);
        }
        if stop_deadline.is_some_and(|d| Instant::now() >= d) {
            signal_all(&mut children, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in pumps {
        let _ = p.join();
    }
    drop(server);
    match failure {
        Some((_, status)) => ExitCode::from(exit_code(status)),
        None => ExitCode::SUCCESS,
    }
}
