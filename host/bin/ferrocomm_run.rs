//! `ferrocomm-run -n N [--grace SECONDS] [--] program [args...]`: starts N local ranks of
//! `program` (like `torchrun --standalone`). It hosts the job's TCP store with a fresh token, sets
//! the torchrun variables for each rank, prefixes every output line with the rank, and when one
//! rank fails it stops the others and exits non-zero.
//!
//! SIGINT and SIGTERM sent to the launcher are forwarded to every rank; whatever is left after
//! the grace period is SIGKILLed, and the launcher exits with 128 + the signal's number. Ranks
//! never outlive it: it reaps every rank before it exits, and on Linux each rank asks the kernel
//! to SIGKILL it should the launcher die without doing so (itself SIGKILLed).

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: ferrocomm-run -n N [--grace SECONDS] [--] program [args...]";
/// How long ranks get between SIGTERM (or a forwarded SIGINT) and SIGKILL, unless `--grace` or
/// `FERROCOMM_RUN_GRACE` says otherwise.
const DEFAULT_GRACE: Duration = Duration::from_secs(5);
const GRACE_VAR: &str = "FERROCOMM_RUN_GRACE";
/// How often the launcher looks at its ranks while no signal arrives.
const POLL: Duration = Duration::from_millis(10);
/// How long the output of ranks that all exited may still be drained: a process a rank started
/// outside its process group can keep the pipes open for ever.
const DRAIN: Duration = Duration::from_secs(2);

/// What keeps the launcher from running the job.
#[derive(Debug, thiserror::Error)]
enum LaunchError {
    /// A malformed command line or setting; empty for `--help`.
    #[error("{0}")]
    Usage(String),
    #[error("cannot start the store: {0}")]
    Store(#[from] ferrocomm::Error),
    #[error("cannot take over SIGINT and SIGTERM: {0}")]
    Signals(#[source] io::Error),
}

/// The parsed command line.
struct Options {
    n: usize,
    grace: Duration,
    prog: Vec<String>,
}

/// Parses the arguments; `grace_var` is the value of `FERROCOMM_RUN_GRACE`, which `--grace`
/// overrides.
fn parse(args: &[String], grace_var: Option<String>) -> Result<Options, String> {
    let mut n = None;
    let mut grace = match grace_var {
        Some(v) => parse_grace(&v).map_err(|e| format!("{GRACE_VAR}={v}: {e}"))?,
        None => DEFAULT_GRACE,
    };
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "-n" | "--nproc" | "--nproc-per-node" => {
                let v = args.get(i + 1).ok_or("-n needs a value")?;
                n = Some(v.parse::<usize>().map_err(|_| format!("-n {v}: not a number"))?);
                i += 2;
            }
            "--grace" => {
                let v = args.get(i + 1).ok_or("--grace needs a value")?;
                grace = parse_grace(v).map_err(|e| format!("--grace {v}: {e}"))?;
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
    Ok(Options { n, grace, prog })
}

/// Seconds, fractions allowed (`0.5`).
fn parse_grace(v: &str) -> Result<Duration, String> {
    let secs: f64 = v.parse().map_err(|_| "not a number of seconds".to_string())?;
    Duration::try_from_secs_f64(secs).map_err(|_| "not a non-negative number of seconds".to_string())
}

/// The termination signals the launcher forwards. They are blocked in every thread of the
/// launcher and taken synchronously with `sigtimedwait`, so no handler runs at an arbitrary point.
struct Signals {
    set: libc::sigset_t,
}

impl Signals {
    /// Blocks SIGINT and SIGTERM in the calling thread, and so in every thread it starts later:
    /// call it before any thread exists. A signal ignored when the launcher started (a background
    /// job of a script ignores SIGINT) stays ignored, for the launcher and its ranks.
    fn block() -> io::Result<Self> {
        // SAFETY: sigset_t is plain data, initialised by sigemptyset before any other use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t.
        unsafe { libc::sigemptyset(&mut set) };
        for sig in [libc::SIGINT, libc::SIGTERM] {
            if !ignored(sig)? {
                // SAFETY: `set` is a valid sigset_t and `sig` a valid signal number.
                unsafe { libc::sigaddset(&mut set, sig) };
            }
        }
        // SAFETY: `set` is initialised; the old mask is not asked for.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(Self { set })
    }

    /// Waits up to `wait` for one of the signals and returns its number.
    fn next(&self, wait: Duration) -> Option<libc::c_int> {
        let timeout = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `set` and `timeout` are valid for the call; a null info pointer is allowed.
        let sig = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &timeout) };
        // -1 is the timeout (EAGAIN) or an interruption (EINTR): no signal of ours either way.
        (sig > 0).then_some(sig)
    }
}

/// Whether `sig` is ignored (SIG_IGN) in this process.
fn ignored(sig: libc::c_int) -> io::Result<bool> {
    // SAFETY: sigaction is plain data; the call only writes the current action into `old`.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a null new action only queries; `old` is valid for writes.
    if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(old.sa_sigaction == libc::SIG_IGN)
}

/// Runs in a rank's process between fork and exec, so it may only make async-signal-safe calls
/// and must not allocate (another launcher thread may have held the allocator's lock at fork).
fn prepare_rank(blocked: &libc::sigset_t, launcher: libc::pid_t) -> io::Result<()> {
    // The signal mask survives exec: the rank must see the signals the launcher blocked.
    // SAFETY: `blocked` is an initialised sigset_t; sigprocmask is async-signal-safe.
    if unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, blocked, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[cfg(target_os = "linux")]
    {
        // The kernel sends the signal when the thread that forked the rank ends: the launcher's
        // main thread, which ends only with the launcher. So a SIGKILLed launcher takes its
        // ranks along.
        // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number and touches no memory.
        if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // The launcher may have died between fork and prctl: then no signal will ever come, and
        // the rank must not start.
        // SAFETY: getppid cannot fail and touches no memory.
        if unsafe { libc::getppid() } != launcher {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = launcher;
    Ok(())
}

fn pump(rank: usize, src: impl io::Read + Send + 'static, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).split(b'\n').map_while(Result::ok) {
            let text = String::from_utf8_lossy(&line);
            // One write per line keeps ranks' lines whole when they interleave.
            let out = format!("[{rank}]: {text}\n");
            let _ = if to_stderr {
                io::stderr().lock().write_all(out.as_bytes())
            } else {
                io::stdout().lock().write_all(out.as_bytes())
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

fn signal_name(sig: libc::c_int) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        _ => format!("signal {sig}"),
    }
}

fn exit_code(s: ExitStatus) -> u8 {
    match (s.code(), s.signal()) {
        (Some(c), _) => (c as u8).max(1),
        (_, Some(sig)) => 128u8.saturating_add(sig as u8),
        _ => 1,
    }
}

/// Why the launcher is stopping the job; the first reason decides its exit code.
enum Stop {
    /// A rank exited unsuccessfully.
    RankFailed(ExitStatus),
    /// The launcher received this signal.
    Signal(libc::c_int),
    /// A rank could not be started.
    SpawnFailed,
}

/// The running ranks; a rank's slot empties once it has been reaped.
struct Ranks {
    children: Vec<Option<Child>>,
}

impl Ranks {
    /// Sends `sig` to every rank that has not been reaped yet: to its process group, which also
    /// holds what the rank started without leaving it (a shell wrapper's program).
    fn signal(&self, sig: libc::c_int) {
        for c in self.children.iter().flatten() {
            let pid = c.id() as libc::pid_t;
            // SAFETY: kill touches no memory. The rank is unreaped, so neither its pid nor its
            // group id (the same number) can have been reused.
            // A rank that moved to another group of its own accord gets the signal itself.
            if unsafe { libc::kill(-pid, sig) } != 0 {
                // SAFETY: as above.
                unsafe { libc::kill(pid, sig) };
            }
        }
    }

    /// Reaps the ranks that exited; returns each one's rank and status.
    fn reap(&mut self) -> Vec<(usize, ExitStatus)> {
        let mut ended = Vec::new();
        for (rank, slot) in self.children.iter_mut().enumerate() {
            if let Some(status) = slot.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                *slot = None;
                ended.push((rank, status));
            }
        }
        ended
    }

    fn any_left(&self) -> bool {
        self.children.iter().any(Option::is_some)
    }
}

/// The command that starts rank `rank` of `opts.n`.
fn rank_command(opts: &Options, rank: usize, port: &str, token: &str, signals: &Signals) -> Command {
    let mut cmd = Command::new(&opts.prog[0]);
    cmd.args(&opts.prog[1..])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", opts.n.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", opts.n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("FERROCOMM_TOKEN", token)
        .env("FERROCOMM_STORE_EXTERNAL", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A group of its own: a forwarded signal reaches what the rank started in it, and a
        // terminal's Ctrl-C reaches the rank once, through the launcher, rather than twice.
        // spawn() returns after the exec, so the group exists before it is ever signalled.
        .process_group(0);
    let blocked = signals.set;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: prepare_rank only makes async-signal-safe calls and does not allocate.
    unsafe { cmd.pre_exec(move || prepare_rank(&blocked, launcher)) };
    cmd
}

fn run(args: &[String]) -> Result<ExitCode, LaunchError> {
    // Before anything starts a thread (the store, the output pumps): they inherit the mask.
    let signals = Signals::block().map_err(LaunchError::Signals)?;
    let opts = parse(args, std::env::var(GRACE_VAR).ok()).map_err(LaunchError::Usage)?;
    let token = ferrocomm::random_token();
    let server = ferrocomm::TcpStoreServer::bind("127.0.0.1:0", &token)?;
    let port = server.addr().port().to_string();

    let mut ranks = Ranks {
        children: Vec::with_capacity(opts.n),
    };
    let mut pumps = Vec::new();
    let mut stop: Option<Stop> = None;
    // When the ranks still running get SIGKILL; unset once they did.
    let mut kill_at: Option<Instant> = None;
    for rank in 0..opts.n {
        // Spawned from this thread, which lives as long as the launcher: see prepare_rank.
        match rank_command(&opts, rank, &port, &token, &signals).spawn() {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(rank, o, false));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(rank, e, true));
                }
                ranks.children.push(Some(c));
            }
            Err(e) => {
                eprintln!("ferrocomm-run: cannot start {:?}: {e}", opts.prog[0]);
                stop = Some(Stop::SpawnFailed);
                ranks.signal(libc::SIGKILL);
                break;
            }
        }
        // A signal during the start stops it: the remaining ranks are not started.
        if let Some(sig) = signals.next(Duration::ZERO) {
            forward(&ranks, sig, &mut stop, &mut kill_at, opts.grace);
            break;
        }
    }

    while ranks.any_left() {
        for (rank, status) in ranks.reap() {
            if !status.success() && stop.is_none() {
                eprintln!(
                    "ferrocomm-run: rank {rank} failed ({}); stopping the other ranks",
                    describe(status)
                );
                stop = Some(Stop::RankFailed(status));
                ranks.signal(libc::SIGTERM);
                kill_at = Some(Instant::now() + opts.grace);
            }
        }
        if !ranks.any_left() {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            eprintln!(
                "ferrocomm-run: ranks still running after {:?}; sending SIGKILL",
                opts.grace
            );
            ranks.signal(libc::SIGKILL);
            kill_at = None;
        }
        // Waiting for a signal is also the pause between looks at the ranks.
        if let Some(sig) = signals.next(POLL) {
            forward(&ranks, sig, &mut stop, &mut kill_at, opts.grace);
        }
    }

    let drain_until = Instant::now() + DRAIN;
    for p in pumps {
        while !p.is_finished() && Instant::now() < drain_until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if p.is_finished() {
            let _ = p.join();
        }
    }
    drop(server);
    Ok(match stop {
        Some(Stop::RankFailed(status)) => ExitCode::from(exit_code(status)),
        // As a shell reports a command a signal ended.
        Some(Stop::Signal(sig)) => ExitCode::from(128u8.saturating_add(sig as u8)),
        Some(Stop::SpawnFailed) => ExitCode::from(1),
        None => ExitCode::SUCCESS,
    })
}

/// Handles a signal the launcher received: the first one since the job started stopping is
/// forwarded to every rank, which then gets the grace period; a later one means the sender will
/// not wait, and every rank is SIGKILLed at once.
fn forward(ranks: &Ranks, sig: libc::c_int, stop: &mut Option<Stop>, kill_at: &mut Option<Instant>, grace: Duration) {
    if stop.is_none() {
        eprintln!(
            "ferrocomm-run: got {}; forwarding it to every rank (SIGKILL in {grace:?})",
            signal_name(sig)
        );
        *stop = Some(Stop::Signal(sig));
        ranks.signal(sig);
        *kill_at = Some(Instant::now() + grace);
    } else {
        eprintln!(
            "ferrocomm-run: got {} while stopping; sending SIGKILL",
            signal_name(sig)
        );
        ranks.signal(libc::SIGKILL);
        *kill_at = None;
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(LaunchError::Usage(e)) => {
            if !e.is_empty() {
                eprintln!("ferrocomm-run: {e}");
            }
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("ferrocomm-run: {e}");
            ExitCode::from(1)
        }
    }
}
