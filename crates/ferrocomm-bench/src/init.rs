//! `init`: how long communicator creation takes. Each repetition creates a communicator of
//! `--world` ranks (processes: `new_comm` on every rank; `--threads`: `Comm::new_group` of that
//! many `Device::Cpu` ranks), times it until every rank holds it ("ready"), then until a first
//! 8-byte all_reduce has completed on every rank ("first op"), then until a first exchange
//! with both ring neighbours has ("first p2p": 8 bytes sent right and received from the left;
//! links made lazily are paid there, where the all_reduce of ranks of one host goes through
//! shared-memory rounds and needs none), then until every rank holds the communicator that a
//! `shrink(&[])` of the healthy one makes and has run a first 8-byte all_reduce on it
//! ("shrink": the links are handed over, see the library's shrink_links.rs), and then the
//! finalize and drop of both ("teardown").
//!
//! Processes: before each repetition the ranks meet in a barrier on a control communicator;
//! each rank times its own calls and the slowest rank counts (an all_reduce(max) on the control
//! communicator). "ready after last" is the time from the last rank's call to `new_comm` to the
//! last rank's return, on the host's wall clock (every rank is on this host). The control
//! communicator is the first of each process: its creation is reported apart ("cold": the
//! store connection and first use of everything), measured from the last rank's call, since the
//! processes start at different times; and so is process start-up (spawn to the bench's entry,
//! slowest rank) when the bench started the processes itself.
//!
//! Threads: one clock; the first op spawns a thread per rank, which is counted.

use crate::cli::Args;
use crate::ranks::SPAWNED_AT;
use crate::Failure;
use ferrocomm::prelude::*;
use ferrocomm::Error;
use serde::Serialize;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One repetition, as the slowest rank saw it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct InitRow {
    pub rep: usize,
    /// Creation until this rank holds the communicator (slowest rank), ms.
    pub ready_ms: f64,
    /// Processes: from the last rank's call to the last rank's return, ms (threads: `ready_ms`).
    pub ready_after_last_ms: f64,
    /// Creation until the first all_reduce has returned (slowest rank), ms.
    pub first_op_ms: f64,
    /// Creation until the first exchange with both ring neighbours has returned (slowest
    /// rank), ms.
    pub first_p2p_ms: f64,
    /// `shrink(&[])` until its first all_reduce has returned (slowest rank), ms.
    pub shrink_ms: f64,
    /// finalize + drop (slowest rank), ms.
    pub teardown_ms: f64,
    /// Ranks whose rank, size or first all_reduce result was wrong (`--check`).
    pub wrong: u64,
}

#[derive(Serialize)]
struct Stats {
    min: f64,
    median: f64,
    max: f64,
}

impl Stats {
    fn of(v: impl Iterator<Item = f64>) -> Stats {
        let mut v: Vec<f64> = v.collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return Stats {
                min: f64::NAN,
                median: f64::NAN,
                max: f64::NAN,
            };
        }
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Stats {
            min: v[0],
            median,
            max: v[n - 1],
        }
    }
}

#[derive(Serialize)]
struct InitReport<'a> {
    tool: &'static str,
    backend: &'a str,
    op: &'static str,
    world: usize,
    mode: &'static str,
    transport: &'static str,
    /// Spawn to the bench's entry, slowest rank (processes the bench started), ms.
    process_start_ms: Option<f64>,
    /// The first communicator of each process (processes only).
    cold: Option<InitRow>,
    rows: &'a [InitRow],
    ready_ms: Stats,
    first_op_ms: Stats,
    first_p2p_ms: Stats,
    shrink_ms: Stats,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn options(a: &Args) -> ferrocomm::Result<CommOptions> {
    let mut o = CommOptions::from_env()?;
    if a.transport_tcp {
        o.transport.force_tcp = true;
    }
    Ok(o)
}

fn transport_name(a: &Args, o: &CommOptions) -> &'static str {
    if a.transport_tcp || o.transport.force_tcp {
        "tcp"
    } else {
        "auto"
    }
}

/// Runs `init` in the ranks the environment and `a` call for (as `ranks::run` does for the
/// sweeps).
pub fn run(a: &Args) -> Result<(), Failure> {
    if a.backend != "cpu" && a.backend != "auto" {
        return Err(Error::Unavailable {
            backend: a.backend.clone(),
            reason: "init measures host ranks (Device::Cpu): use --backend cpu or auto".into(),
        }
        .into());
    }
    if a.plot.is_some() {
        return Err(Error::Config("init writes --json and --csv; it has no plot".into()).into());
    }
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        launched(a)
    } else if a.threads {
        threads(a)
    } else {
        crate::ranks::spawn(a)
    }
}

/// The first all_reduce: every rank adds rank + 1; returns 1 if anything was wrong.
fn first_op(c: &Comm, world: usize) -> ferrocomm::Result<u64> {
    let mut x = [c.rank() as u64 + 1];
    c.all_reduce(&mut x[..], ReduceOp::Sum)?;
    let want = (world * (world + 1) / 2) as u64;
    Ok(u64::from(x[0] != want || c.size() != world))
}

/// The first point-to-point exchange: 8 bytes to the right neighbour, 8 from the left; returns
/// 1 if what arrived is wrong.
fn first_p2p(c: &Comm) -> ferrocomm::Result<u64> {
    let (n, me) = (c.size(), c.rank());
    let send = [me as u64];
    let mut recv = [u64::MAX];
    let left = (me + n - 1) % n;
    c.batch()
        .send(&send[..], (me + 1) % n)
        .recv(&mut recv[..], left)
        .issue()?;
    Ok(u64::from(recv[0] != left as u64))
}

/// `c.shrink(&[])` of a healthy communicator of `world` ranks, and a first all_reduce on the
/// result (counted in `wrong` if its result or size is wrong): the smaller communicator and
/// how long both took.
fn shrink_and_use(c: &Comm, world: usize, wrong: &mut u64) -> ferrocomm::Result<(Comm, Duration)> {
    let t = Instant::now();
    let (small, _) = c.shrink(&[])?;
    *wrong += first_op(&small, world)?;
    Ok((small, t.elapsed()))
}

/// This process is one rank (started by the bench itself or by a launcher).
fn launched(a: &Args) -> Result<(), Failure> {
    let entered = wall_ns();
    let spawned: Option<u64> = std::env::var(SPAWNED_AT).ok().and_then(|v| v.parse().ok());
    let opts = options(a)?;
    // The control communicator, the process's first: its creation is the cold figure.
    let (t0, w0) = (Instant::now(), wall_ns());
    let control = new_comm(&a.backend, Device::Cpu, "init-control", opts.clone())?;
    let (ready, wr) = (t0.elapsed(), wall_ns());
    let world = control.size();
    let wrong = first_op(&control, world)?;
    let first = t0.elapsed();
    let wrong = wrong + first_p2p(&control)?;
    let p2p = t0.elapsed();
    let lead = control.rank() == 0;
    let mut m = [
        ready.as_nanos() as u64,
        first.as_nanos() as u64,
        w0,
        wr,
        spawned.map_or(0, |s| entered.saturating_sub(s)),
        p2p.as_nanos() as u64,
    ];
    control.all_reduce(&mut m[..], ReduceOp::Max)?;
    let mut w = [wrong];
    control.all_reduce(&mut w[..], ReduceOp::Sum)?;
    let cold = InitRow {
        rep: 0,
        ready_ms: m[0] as f64 / 1e6,
        ready_after_last_ms: m[3].saturating_sub(m[2]) as f64 / 1e6,
        first_op_ms: m[1] as f64 / 1e6,
        first_p2p_ms: m[5] as f64 / 1e6,
        shrink_ms: f64::NAN,
        teardown_ms: f64::NAN,
        wrong: w[0],
    };
    let process_start = spawned.map(|_| m[4] as f64 / 1e6);
    let header = Header {
        a,
        world,
        mode: "processes",
        transport: transport_name(a, &opts),
        process_start,
        cold: Some(&cold),
    };
    if lead {
        header.print();
    }
    let mut rows = Vec::new();
    for rep in 0..a.warmup + a.iters {
        control.barrier()?;
        let (t0, w0) = (Instant::now(), wall_ns());
        let comm = new_comm(&a.backend, Device::Cpu, "init", opts.clone())?;
        let (ready, wr) = (t0.elapsed(), wall_ns());
        let mut wrong = first_op(&comm, world)?;
        let first = t0.elapsed();
        wrong += first_p2p(&comm)?;
        let p2p = t0.elapsed();
        wrong += u64::from(comm.rank() != control.rank());
        let (small, shrink) = shrink_and_use(&comm, world, &mut wrong)?;
        let t1 = Instant::now();
        small.finalize()?;
        drop((small, comm));
        let teardown = t1.elapsed();
        let mut m = [
            ready.as_nanos() as u64,
            first.as_nanos() as u64,
            teardown.as_nanos() as u64,
            w0,
            wr,
            p2p.as_nanos() as u64,
            shrink.as_nanos() as u64,
        ];
        control.all_reduce(&mut m[..], ReduceOp::Max)?;
        let mut w = [wrong];
        control.all_reduce(&mut w[..], ReduceOp::Sum)?;
        let row = InitRow {
            rep,
            ready_ms: m[0] as f64 / 1e6,
            ready_after_last_ms: m[4].saturating_sub(m[3]) as f64 / 1e6,
            first_op_ms: m[1] as f64 / 1e6,
            first_p2p_ms: m[5] as f64 / 1e6,
            shrink_ms: m[6] as f64 / 1e6,
            teardown_ms: m[2] as f64 / 1e6,
            wrong: w[0],
        };
        if lead {
            print_row(&row, rep < a.warmup);
        }
        if rep >= a.warmup {
            rows.push(row);
        }
    }
    if lead {
        header.finish(&rows)?;
    }
    Ok(control.finalize()?)
}

/// Every rank a thread of this process, made by `Comm::new_group`.
fn threads(a: &Args) -> Result<(), Failure> {
    let opts = options(a)?;
    let n = a.world;
    let header = Header {
        a,
        world: n,
        mode: "threads",
        transport: transport_name(a, &opts),
        process_start: None,
        cold: None,
    };
    header.print();
    let mut rows = Vec::new();
    for rep in 0..a.warmup + a.iters {
        let t0 = Instant::now();
        let comms = Comm::new_group(&a.backend, &vec![Device::Cpu; n], "init", opts.clone())?;
        let ready = t0.elapsed();
        type Done = (Instant, Instant, u64, Comm, Duration);
        let done: Vec<ferrocomm::Result<Done>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    s.spawn(move || {
                        let wrong = first_op(c, n)? + u64::from(c.rank() != r);
                        let first = Instant::now();
                        let mut wrong = wrong + first_p2p(c)?;
                        let p2p = Instant::now();
                        let (small, shrink) = shrink_and_use(c, n, &mut wrong)?;
                        Ok((first, p2p, wrong, small, shrink))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Config("a rank thread panicked".into())))
                })
                .collect()
        });
        let (mut end, mut end_p2p, mut shrink) = (t0, t0, Duration::ZERO);
        let mut wrong = 0;
        let mut smaller = Vec::new();
        for d in done {
            let (e, e2, w, small, took) = d?;
            end = end.max(e);
            end_p2p = end_p2p.max(e2);
            shrink = shrink.max(took);
            wrong += w;
            smaller.push(small);
        }
        let first = end - t0;
        let t1 = Instant::now();
        for c in &smaller {
            c.finalize()?;
        }
        drop((smaller, comms));
        let teardown = t1.elapsed();
        let row = InitRow {
            rep,
            ready_ms: ms(ready),
            ready_after_last_ms: ms(ready),
            first_op_ms: ms(first),
            first_p2p_ms: ms(end_p2p - t0),
            shrink_ms: ms(shrink),
            teardown_ms: ms(teardown),
            wrong,
        };
        print_row(&row, rep < a.warmup);
        if rep >= a.warmup {
            rows.push(row);
        }
    }
    header.finish(&rows)
}

struct Header<'a> {
    a: &'a Args,
    world: usize,
    mode: &'static str,
    transport: &'static str,
    process_start: Option<f64>,
    cold: Option<&'a InitRow>,
}

impl Header<'_> {
    fn print(&self) {
        println!(
            "# ferrocomm-bench init on backend {}, {} ranks as {}, transport {}, {} repetitions after {} warm-up",
            self.a.backend, self.world, self.mode, self.transport, self.a.iters, self.a.warmup
        );
        if let Some(p) = self.process_start {
            println!("# process start (spawn to the bench's entry, slowest rank): {p:.2} ms");
        }
        if let Some(c) = self.cold {
            println!(
                "# cold (each process's first communicator, from the last rank's call): ready {:.2} ms \
                 (slowest rank's own {:.2} ms), first op {:.2} ms, first p2p {:.2} ms, #wrong {}",
                c.ready_after_last_ms, c.ready_ms, c.first_op_ms, c.first_p2p_ms, c.wrong
            );
        }
        println!(
            "#   rep   ready (ms)   ready after last (ms)   first op (ms)  first p2p (ms)     shrink (ms)   teardown (ms)  #wrong"
        );
    }

    /// Prints the summary and writes `--json` and `--csv`.
    fn finish(&self, rows: &[InitRow]) -> Result<(), Failure> {
        let ready = Stats::of(rows.iter().map(|r| r.ready_ms));
        let first = Stats::of(rows.iter().map(|r| r.first_op_ms));
        let p2p = Stats::of(rows.iter().map(|r| r.first_p2p_ms));
        let shrink = Stats::of(rows.iter().map(|r| r.shrink_ms));
        println!(
            "# ready (ms): min {:.2} median {:.2} max {:.2}; first op (ms): min {:.2} median {:.2} max {:.2}; \
             first p2p (ms): min {:.2} median {:.2} max {:.2}; shrink (ms): min {:.2} median {:.2} max {:.2}",
            ready.min,
            ready.median,
            ready.max,
            first.min,
            first.median,
            first.max,
            p2p.min,
            p2p.median,
            p2p.max,
            shrink.min,
            shrink.median,
            shrink.max
        );
        let report = InitReport {
            tool: "ferrocomm",
            backend: &self.a.backend,
            op: "init",
            world: self.world,
            mode: self.mode,
            transport: self.transport,
            process_start_ms: self.process_start,
            cold: self.cold.cloned(),
            rows,
            ready_ms: ready,
            first_op_ms: first,
            first_p2p_ms: p2p,
            shrink_ms: shrink,
        };
        let io = |p: &std::path::Path, e| Error::Io {
            context: format!("write {}", p.display()),
            source: e,
        };
        if let Some(p) = &self.a.json {
            let text = serde_json::to_string(&report).map_err(|e| Error::Config(format!("JSON: {e}")))?;
            std::fs::write(p, text + "\n").map_err(|e| io(p, e))?;
        }
        if let Some(p) = &self.a.csv {
            let mut s = String::from(
                "tool,backend,op,world,mode,transport,rep,ready_ms,ready_after_last_ms,first_op_ms,first_p2p_ms,shrink_ms,teardown_ms,wrong\n",
            );
            for r in rows {
                s += &format!(
                    "ferrocomm,{},init,{},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{}\n",
                    self.a.backend,
                    self.world,
                    self.mode,
                    self.transport,
                    r.rep,
                    r.ready_ms,
                    r.ready_after_last_ms,
                    r.first_op_ms,
                    r.first_p2p_ms,
                    r.shrink_ms,
                    r.teardown_ms,
                    r.wrong
                );
            }
            std::fs::write(p, s).map_err(|e| io(p, e))?;
        }
        Ok(())
    }
}

/// A repetition's line; warm-up ones are comments.
fn print_row(r: &InitRow, warmup: bool) {
    println!(
        "{}{:>6} {:>12.3} {:>23.3} {:>15.3} {:>15.3} {:>15.3} {:>15.3} {:>7}",
        if warmup { "#" } else { " " },
        r.rep,
        r.ready_ms,
        r.ready_after_last_ms,
        r.first_op_ms,
        r.first_p2p_ms,
        r.shrink_ms,
        r.teardown_ms,
        r.wrong
    );
}
