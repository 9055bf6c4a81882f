//! `ferrocomm-run -n N [--nnodes M --node-rank R --master-addr HOST --master-port PORT] [--]
//! program [args...]`: starts N ranks of `program` on this node, as torchrun does. It sets the
//! torchrun variables for each rank, prefixes every output line with the rank, and when one
//! rank fails it stops the others and exits non-zero. `--help` says it all; a malformed command
//! line is clap's usage error (status 2).
//!
//! `--tolerate-failures N` (torchrun's elastic mode, for jobs whose survivors shrink their
//! communicator): up to N ranks may fail (exit non-zero or die of a signal) without the launcher
//! stopping the others; each such failure is reported on stderr, the store stays up for the
//! survivors, and the launcher exits 0 when every other rank does. The failure after the Nth
//! stops the job as above. On several nodes the launchers count the job's failures together
//! in node 0's store, and the one that sees a failure past N makes every node stop
//! (job_failures.rs).
//!
//! The job's TCP store: on one node the launcher hosts it with a fresh token (at
//! `--master-addr`, default 127.0.0.1, and `--master-port`, default any free port). With
//! `--nnodes M > 1`, one launcher runs on each node with its own `--node-rank`; node 0's hosts
//! the store at `--master-addr:--master-port`, every node's ranks connect there, and the job
//! token comes from `FERROCOMM_TOKEN`, which every node must share. Node 0 keeps the store up
//! until every node's launcher reports its ranks ended (or `EXIT_WAIT` passes), since ranks on
//! other nodes may still use it.
//!
//! `--bind-to core` puts each rank on a core of its own, where they fit.
//!
//! SIGINT and SIGTERM sent to the launcher are forwarded to every rank; whatever is left after
//! the grace period is SIGKILLed, and the launcher exits with 128 + the signal's number. Ranks
//! never outlive it: it reaps every rank before it exits, and on Linux each rank asks the kernel
//! to SIGKILL it should the launcher die without doing so (itself SIGKILLed).

mod job_failures;

use clap::{CommandFactory, Parser};
use ferrocomm::Store;
use job_failures::{JobFailures, Verdict};
use std::ffi::OsString;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long ranks get between SIGTERM (or a forwarded SIGINT) and SIGKILL, unless `--grace` or
/// `FERROCOMM_RUN_GRACE` says otherwise.
const DEFAULT_GRACE: &str = "5";
/// How often the launcher looks at its ranks while no signal arrives.
const POLL: Duration = Duration::from_millis(10);
/// How long the output of ranks that all exited may still be drained: a process a rank started
/// outside its process group can keep the pipes open for ever.
const DRAIN: Duration = Duration::from_secs(2);
/// How long node 0 keeps the store up for the other nodes' ranks once its own ended (torchrun
/// waits as long at its exit barrier).
const EXIT_WAIT: Duration = Duration::from_secs(300);
/// How long a launcher tries to reach node 0's store to report that its ranks ended.
const REPORT_WAIT: Duration = Duration::from_secs(10);
/// How long node 0 keeps the store up after the job stopped for a failure, beyond the grace
/// period: the other launchers see STOP within a fraction of a second, stop their ranks and
/// report.
const STOP_WAIT: Duration = Duration::from_secs(10);
/// The store key each node's launcher adds 1 to when its ranks have ended.
const NODES_DONE: &str = "ferrocomm-run/nodes-done";

/// What keeps the launcher from running the job.
#[derive(Debug, thiserror::Error)]
enum LaunchError {
    #[error("cannot host the job's store at {addr}: {source}")]
    Store {
        addr: String,
        #[source]
        source: ferrocomm::Error,
    },
    #[error("cannot take over SIGINT and SIGTERM: {0}")]
    Signals(#[source] io::Error),
}

/// Starts the ranks of a program on this node and sets the variables torchrun sets (RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
/// ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), plus NODE_RANK and FERROCOMM_TOKEN; every other
/// variable of this environment passes through. Output lines are prefixed with `[rank]: `.
///
/// One node: `ferrocomm-run -n 4 -- ./prog args`. Several: the same command on every node with
/// `--nnodes`, that node's `--node-rank`, node 0's `--master-addr` and a `--master-port`, and
/// the same secret in FERROCOMM_TOKEN everywhere.
#[derive(Parser, Debug)]
#[command(name = "ferrocomm-run", version)]
struct Cli {
    /// Ranks to start on this node.
    #[arg(short = 'n', long = "nproc-per-node", visible_alias = "nproc", alias = "nproc_per_node", value_name = "N",
          value_parser = at_least_one, required_unless_present = "completions")]
    nproc_per_node: Option<usize>,
    /// Nodes in the job, each running one ferrocomm-run.
    #[arg(long, value_name = "N", default_value = "1", value_parser = at_least_one)]
    nnodes: usize,
    /// This node's place among them, from 0; node 0 hosts the job's store.
    #[arg(long, alias = "node_rank", value_name = "RANK", default_value_t = 0)]
    node_rank: usize,
    /// Node 0's address, where it hosts the store (default 127.0.0.1; needed with --nnodes > 1).
    #[arg(long, alias = "master_addr", value_name = "HOST")]
    master_addr: Option<String>,
    /// The store's port (default: any free one on a single node; needed with --nnodes > 1).
    #[arg(long, alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,
    /// Seconds ranks get between a forwarded SIGTERM or SIGINT and SIGKILL (fractions allowed).
    #[arg(long, value_name = "SECONDS", env = "FERROCOMM_RUN_GRACE", default_value = DEFAULT_GRACE,
          value_parser = parse_grace)]
    grace: Duration,
    /// Ranks of the job that may fail (exit non-zero or die of a signal) while the others go
    /// on; the launcher then exits 0 if every other rank does. One more failure stops the job,
    /// on every node. Below the job's number of ranks; the same on every node.
    #[arg(long, value_name = "N", env = "FERROCOMM_RUN_TOLERATE_FAILURES", default_value = "0",
          allow_negative_numbers = true, value_parser = parse_tolerance)]
    tolerate_failures: usize,
    /// `core`: each rank of this node on a physical core of its own (every CPU of it this
    /// launcher may use; the first N cores), as Open MPI binds two ranks by default; with more
    /// ranks than cores the launcher says so and binds none. Leave it at `none` for ranks that
    /// run threads beside them.
    #[arg(long, value_name = "WHAT", default_value = "none")]
    bind_to: BindTo,
    /// Prints a completion script for SHELL and exits.
    #[arg(long, value_name = "SHELL", hide = true, exclusive = true)]
    completions: Option<clap_complete::Shell>,
    /// The program and its arguments (after `--` where they start with `-`).
    #[arg(
        value_name = "PROGRAM",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required_unless_present = "completions"
    )]
    program: Vec<OsString>,
}

/// What `--bind-to` binds each rank to.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum BindTo {
    None,
    Core,
}

/// What this launcher runs, its command line checked.
struct Job {
    /// Ranks on this node.
    nproc: usize,
    nnodes: usize,
    node_rank: usize,
    master_addr: String,
    /// 0 on a single node without `--master-port`: the store takes any free port.
    master_port: u16,
    /// The job token: fresh on a single node, FERROCOMM_TOKEN's on several.
    token: String,
    grace: Duration,
    /// Ranks of the job that may fail while the others go on (`--tolerate-failures`).
    tolerate: usize,
    /// The CPUs of each local rank's core (`--bind-to core`, where they fit).
    cores: Option<Vec<Vec<usize>>>,
    program: Vec<OsString>,
}

impl Job {
    /// The job the command line describes, or clap's usage error for what clap cannot check
    /// alone (the multi-node flags go together, the token is in the environment).
    fn from_cli(cli: Cli) -> Result<Job, clap::Error> {
        let usage = |msg: String| Cli::command().error(clap::error::ErrorKind::ArgumentConflict, msg);
        let nproc = cli.nproc_per_node.ok_or_else(|| usage("-n N is missing".into()))?;
        if cli.program.is_empty() {
            return Err(usage("the program to run is missing".into()));
        }
        // Far above any node's cores, and far below where ranks' numbers would overflow.
        const MAX_RANKS: usize = 1 << 20;
        if nproc.checked_mul(cli.nnodes).map_or(true, |n| n > MAX_RANKS) {
            return Err(usage(format!(
                "-n {nproc} ranks on each of --nnodes {} nodes: more than {MAX_RANKS} ranks",
                cli.nnodes
            )));
        }
        // The value may come from FERROCOMM_RUN_TOLERATE_FAILURES: the messages name both.
        // The count is the job's (over every node), as the launchers keep it.
        if cli.tolerate_failures >= nproc * cli.nnodes {
            return Err(usage(format!(
                "--tolerate-failures {} (or FERROCOMM_RUN_TOLERATE_FAILURES) must be below the number of ranks (-n {nproc} on \
                 {} node(s)): at least one rank has to finish",
                cli.tolerate_failures, cli.nnodes
            )));
        }
        if cli.node_rank >= cli.nnodes {
            return Err(usage(format!(
                "--node-rank {} is not below --nnodes {}",
                cli.node_rank, cli.nnodes
            )));
        }
        let (master_addr, master_port, token) = if cli.nnodes == 1 {
            let addr = cli.master_addr.unwrap_or_else(|| "127.0.0.1".into());
            // No token without the OS generator: never a predictable one.
            let token = ferrocomm::random_token().map_err(|e| {
                clap::Error::raw(clap::error::ErrorKind::Io, format!("ferrocomm-run: job token: {e}\n"))
            })?;
            (addr, cli.master_port.unwrap_or(0), token)
        } else {
            let (Some(addr), Some(port)) = (cli.master_addr, cli.master_port) else {
                return Err(usage(format!(
                    "--nnodes {} needs --master-addr and --master-port: where node 0 hosts the job's store",
                    cli.nnodes
                )));
            };
            // The one variable the launcher reads itself: every node's launcher must know the
            // same token, and only the user can give it to all of them.
            let token = std::env::var("FERROCOMM_TOKEN").ok().filter(|t| !t.is_empty());
            let Some(token) = token else {
                return Err(Cli::command().error(
                    clap::error::ErrorKind::MissingRequiredArgument,
                    format!(
                        "--nnodes {} needs FERROCOMM_TOKEN: export the same secret on every node (for \
                         instance FERROCOMM_TOKEN=$(openssl rand -hex 16)); the store admits only \
                         ranks that know it",
                        cli.nnodes
                    ),
                ));
            };
            if port == 0 {
                return Err(usage(format!(
                    "--nnodes {} needs a fixed --master-port, not 0: the other nodes must know it",
                    cli.nnodes
                )));
            }
            (addr, port, token)
        };
        let cores = match cli.bind_to {
            BindTo::None => None,
            BindTo::Core => {
                let cores = ferrocomm::cores_for_ranks(nproc).map_err(|e| {
                    clap::Error::raw(
                        clap::error::ErrorKind::Io,
                        format!("ferrocomm-run: --bind-to core: {e}\n"),
                    )
                })?;
                if cores.is_none() {
                    eprintln!("ferrocomm-run: --bind-to core: {nproc} ranks outnumber this node's cores; binding none");
                }
                cores
            }
        };
        Ok(Job {
            cores,
            nproc,
            nnodes: cli.nnodes,
            node_rank: cli.node_rank,
            master_addr,
            master_port,
            token,
            grace: cli.grace,
            tolerate: cli.tolerate_failures,
            program: cli.program,
        })
    }

    /// The job-wide rank of local rank `local`.
    fn rank(&self, local: usize) -> usize {
        self.node_rank * self.nproc + local
    }

    fn world_size(&self) -> usize {
        self.nnodes * self.nproc
    }

    /// Whether this launcher hosts the store: on one node, or as node 0 of several.
    fn hosts_store(&self) -> bool {
        self.node_rank == 0
    }
}

/// A count of at least 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{v:?} is not a whole number of at least 1")),
    }
}

/// Seconds, fractions allowed (`0.5`).
fn parse_grace(v: &str) -> Result<Duration, String> {
    // The value may come from FERROCOMM_RUN_GRACE, which clap's message would not name.
    let bad = |what: &str| format!("{v:?} (from --grace or FERROCOMM_RUN_GRACE) is not {what}");
    let secs: f64 = v.parse().map_err(|_| bad("a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| bad("a non-negative number of seconds"))
}

/// A count of failures, 0 or more.
fn parse_tolerance(v: &str) -> Result<usize, String> {
    // The value may come from FERROCOMM_RUN_TOLERATE_FAILURES, which clap's message would not name.
    v.parse::<usize>().map_err(|_| {
        format!(
            "{v:?} (from --tolerate-failures or FERROCOMM_RUN_TOLERATE_FAILURES) is not a whole number of at least 0"
        )
    })
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
        // rustix makes these as plain system calls: async-signal-safe, no allocation.
        use rustix::process::{getppid, set_parent_process_death_signal, Pid, Signal};
        set_parent_process_death_signal(Some(Signal::KILL))?;
        // The launcher may have died between fork and prctl: then no signal will ever come, and
        // the rank must not start.
        if Pid::as_raw(getppid()) != launcher {
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
    /// Another node's failures went past `--tolerate-failures`.
    Elsewhere,
}

/// The running ranks; a rank's slot empties once it has been reaped.
struct Ranks {
    children: Vec<Option<Child>>,
}

impl Ranks {
    /// Sends `sig` to every rank that has not been reaped yet: to its process group, which also
    /// holds what the rank started without leaving it (a shell wrapper's program).
    fn signal(&self, sig: libc::c_int) {
        use rustix::process::{kill_process, kill_process_group, Pid, Signal};
        let Some(sig) = Signal::from_named_raw(sig) else {
            return;
        };
        for c in self.children.iter().flatten() {
            // The rank is unreaped, so neither its pid nor its group id (the same number) can
            // have been reused.
            let Some(pid) = Pid::from_raw(c.id() as i32) else {
                continue;
            };
            // A rank that moved to another group of its own accord gets the signal itself.
            if kill_process_group(pid, sig).is_err() {
                let _ = kill_process(pid, sig);
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

/// The command that starts local rank `local` of this node.
fn rank_command(job: &Job, local: usize, port: u16, signals: &Signals) -> Command {
    let mut cmd = Command::new(&job.program[0]);
    cmd.args(&job.program[1..])
        .env("RANK", job.rank(local).to_string())
        .env("WORLD_SIZE", job.world_size().to_string())
        .env("LOCAL_RANK", local.to_string())
        .env("LOCAL_WORLD_SIZE", job.nproc.to_string())
        // torchrun's names for the node (its "group") and for the rank within the one role.
        .env("GROUP_RANK", job.node_rank.to_string())
        .env("GROUP_WORLD_SIZE", job.nnodes.to_string())
        .env("ROLE_RANK", job.rank(local).to_string())
        .env("ROLE_WORLD_SIZE", job.world_size().to_string())
        // Not torchrun's, but what other launchers (Lightning, Slurm scripts) call the node.
        .env("NODE_RANK", job.node_rank.to_string())
        .env("MASTER_ADDR", &job.master_addr)
        .env("MASTER_PORT", port.to_string())
        .env("FERROCOMM_TOKEN", &job.token)
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
    // Cloned here, before the fork: the child only reads it.
    let core = job.cores.as_ref().map(|c| c[local].clone());
    // SAFETY: prepare_rank and bind_to_core only make async-signal-safe calls and do not
    // allocate.
    unsafe {
        cmd.pre_exec(move || {
            prepare_rank(&blocked, launcher)?;
            core.as_deref().map_or(Ok(()), ferrocomm::bind_to_core)
        })
    };
    cmd
}

fn run(job: &Job) -> Result<ExitCode, LaunchError> {
    // Before anything starts a thread (the store, the output pumps): they inherit the mask.
    let signals = Signals::block().map_err(LaunchError::Signals)?;
    let server = if job.hosts_store() {
        // Node 0 of several listens on every interface, as torchrun does: its own name may
        // resolve to a loopback address (127.0.1.1 in Debian's /etc/hosts) that other nodes
        // cannot reach. The token, not the interface, keeps strangers out.
        let host = if job.nnodes > 1 {
            "0.0.0.0"
        } else {
            job.master_addr.as_str()
        };
        let addr = (host, job.master_port);
        let server = ferrocomm::TcpStoreServer::bind(addr, &job.token).map_err(|source| LaunchError::Store {
            addr: format!("{}:{}", job.master_addr, job.master_port),
            source,
        })?;
        Some(server)
    } else {
        None
    };
    // On a single node without --master-port the server chose the port.
    let port = server.as_ref().map_or(job.master_port, |s| s.addr().port());

    let mut ranks = Ranks {
        children: Vec::with_capacity(job.nproc),
    };
    let mut pumps = Vec::new();
    let mut stop: Option<Stop> = None;
    // The ranks whose failure was tolerated (`--tolerate-failures`).
    let mut tolerated: Vec<usize> = Vec::new();
    // When the ranks still running get SIGKILL; unset once they did.
    let mut kill_at: Option<Instant> = None;
    // On several nodes the job's failures are counted in node 0's store, and a node that stops
    // the job tells the others there.
    let mut job_failures = (job.nnodes > 1)
        .then(|| JobFailures::start((job.master_addr.clone(), port), &job.token, REPORT_WAIT, job.tolerate));
    for local in 0..job.nproc {
        // Spawned from this thread, which lives as long as the launcher: see prepare_rank.
        match rank_command(job, local, port, &signals).spawn() {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pumps.push(pump(job.rank(local), o, false));
                }
                if let Some(e) = c.stderr.take() {
                    pumps.push(pump(job.rank(local), e, true));
                }
                ranks.children.push(Some(c));
            }
            Err(e) => {
                eprintln!("ferrocomm-run: cannot start {:?}: {e}", job.program[0]);
                stop = Some(Stop::SpawnFailed);
                ranks.signal(libc::SIGKILL);
                break;
            }
        }
        // A signal during the start stops it: the remaining ranks are not started.
        if let Some(sig) = signals.next(Duration::ZERO) {
            forward(&ranks, sig, &mut stop, &mut kill_at, job.grace);
            break;
        }
    }

    while ranks.any_left() {
        for (local, status) in ranks.reap() {
            if status.success() || stop.is_some() {
                continue;
            }
            let verdict = match &mut job_failures {
                Some(j) => j.failed(),
                None if tolerated.len() < job.tolerate => Verdict::Tolerated {
                    count: tolerated.len() as i64 + 1,
                },
                None => Verdict::Stop {
                    count: Some(tolerated.len() as i64 + 1),
                    why: None,
                },
            };
            let of_job = if job.nnodes > 1 { " in the job" } else { "" };
            if let Verdict::Tolerated { count } = verdict {
                tolerated.push(job.rank(local));
                eprintln!(
                    "ferrocomm-run: rank {} failed ({}); tolerated ({count} of --tolerate-failures {}{of_job}), \
                     the other ranks go on",
                    job.rank(local),
                    describe(status),
                    job.tolerate
                );
            } else if let Verdict::Stop { count, why } = verdict {
                let beyond = match (why, count) {
                    (Some(why), _) => format!("; {why}"),
                    (None, Some(n)) if job.tolerate > 0 => {
                        format!(", failure {n}{of_job} with --tolerate-failures {}", job.tolerate)
                    }
                    _ => String::new(),
                };
                eprintln!(
                    "ferrocomm-run: rank {} failed ({}{beyond}); stopping the other ranks",
                    job.rank(local),
                    describe(status)
                );
                stop = Some(Stop::RankFailed(status));
                ranks.signal(libc::SIGTERM);
                kill_at = Some(Instant::now() + job.grace);
            }
        }
        if !ranks.any_left() {
            break;
        }
        if let (None, Some(j)) = (&stop, &mut job_failures) {
            let why = if let Some(why) = j.differs() {
                j.tell_stop();
                Some(why)
            } else if j.stopped_elsewhere() {
                Some(format!(
                    "another node stopped the job (a failure past --tolerate-failures {})",
                    job.tolerate
                ))
            } else {
                None
            };
            if let Some(why) = why {
                eprintln!("ferrocomm-run: {why}; stopping this node's ranks");
                stop = Some(Stop::Elsewhere);
                ranks.signal(libc::SIGTERM);
                kill_at = Some(Instant::now() + job.grace);
            }
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            eprintln!(
                "ferrocomm-run: ranks still running after {:?}; sending SIGKILL",
                job.grace
            );
            ranks.signal(libc::SIGKILL);
            kill_at = None;
        }
        // Waiting for a signal is also the pause between looks at the ranks.
        if let Some(sig) = signals.next(POLL) {
            forward(&ranks, sig, &mut stop, &mut kill_at, job.grace);
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
    if stop.is_none() && !tolerated.is_empty() {
        eprintln!(
            "ferrocomm-run: ranks {tolerated:?} failed within --tolerate-failures {}; every other rank exited 0",
            job.tolerate
        );
    }
    if job.nnodes > 1 {
        // Node 0 holds the store up for the other nodes' ranks while they run; after a failure
        // only while the other launchers learn from it that the job stops (STOP) and stop
        // their ranks; after a signal not at all (their ranks lose this node's anyway).
        let hold = match (&stop, server.is_some()) {
            (_, false) | (Some(Stop::Signal(_) | Stop::SpawnFailed), _) => None,
            (None, true) => Some(EXIT_WAIT),
            (Some(Stop::RankFailed(_) | Stop::Elsewhere), true) => Some(job.grace + STOP_WAIT),
        };
        drop(job_failures);
        exit_barrier(job, port, hold, &signals);
    }
    drop(server);
    Ok(match stop {
        Some(Stop::RankFailed(status)) => ExitCode::from(exit_code(status)),
        // As a shell reports a command a signal ended.
        Some(Stop::Signal(sig)) => ExitCode::from(128u8.saturating_add(sig as u8)),
        Some(Stop::SpawnFailed | Stop::Elsewhere) => ExitCode::from(1),
        None => ExitCode::SUCCESS,
    })
}

/// Several nodes, after this node's ranks ended: reports that to node 0's store, and, for at
/// most `hold` (node 0; see the caller), keeps the store up until every node has reported or a
/// signal arrives, because ranks or launchers of other nodes may still be using it.
/// Failures here are reported and otherwise ignored: the ranks' outcome decides the exit code.
fn exit_barrier(job: &Job, port: u16, hold: Option<Duration>, signals: &Signals) {
    let report = || -> ferrocomm::Result<(ferrocomm::TcpStore, i64)> {
        let store = ferrocomm::TcpStore::connect((job.master_addr.as_str(), port), &job.token, REPORT_WAIT)?;
        let done = store.add(NODES_DONE, 1)?;
        Ok((store, done))
    };
    let (store, done) = match report() {
        Ok(reported) => reported,
        Err(e) => {
            eprintln!("ferrocomm-run: cannot tell node 0 that this node's ranks ended: {e}");
            return;
        }
    };
    let Some(hold) = hold.filter(|_| done < job.nnodes as i64) else {
        return;
    };
    let started = Instant::now();
    let deadline = started + hold;
    // Said only when the wait is long enough to be noticed.
    let mut said = false;
    while Instant::now() < deadline {
        if !said && started.elapsed() >= Duration::from_secs(2) {
            eprintln!(
                "ferrocomm-run: keeping the job's store up until the ranks of the other nodes end (at most {hold:?})"
            );
            said = true;
        }
        // Waiting for a signal is the pause between looks at the count; a signal ends the wait.
        if let Some(sig) = signals.next(Duration::from_millis(100)) {
            eprintln!("ferrocomm-run: got {}; closing the store now", signal_name(sig));
            return;
        }
        match store.add(NODES_DONE, 0) {
            Ok(n) if n >= job.nnodes as i64 => return,
            Ok(_) => {}
            Err(e) => {
                eprintln!("ferrocomm-run: lost the job's store while waiting for the other nodes: {e}");
                return;
            }
        }
    }
    eprintln!("ferrocomm-run: the other nodes' ranks did not end within {hold:?}; closing the store");
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
    // The library installs no subscriber; built with feature log-subscriber, FERROCOMM_LOG shows
    // the events of the store this launcher hosts (without it the ranks still get the variable).
    let cli = Cli::parse();
    #[cfg(feature = "log-subscriber")]
    if let Err(e) = ferrocomm::init_logging() {
        eprintln!("ferrocomm-run: {e}");
        return ExitCode::from(2);
    }
    if let Some(shell) = cli.completions {
        clap_complete::generate(shell, &mut Cli::command(), "ferrocomm-run", &mut io::stdout());
        return ExitCode::SUCCESS;
    }
    let job = Job::from_cli(cli).unwrap_or_else(|e| e.exit());
    match run(&job) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ferrocomm-run: {e}");
            ExitCode::from(1)
        }
    }
}
