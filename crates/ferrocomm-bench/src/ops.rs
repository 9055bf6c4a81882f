//! One benchmark row per size: build buffers, warm up, time `iters` iterations (the slowest
//! rank's time), and with `--check` verify one more run against expected values.
//!
//! Sizes follow nccl-tests: `bytes` is the per-rank buffer of all_reduce, broadcast, reduce and
//! send_recv, and the *total* (all ranks' blocks) of all_gather, reduce_scatter and all_to_all.

use crate::aligned::PageBuf;
use crate::report::Row;
use ferrocomm::prelude::*;
use ferrocomm::{bf16, f16, Error, Result, WithOptions, F8E4M3, F8E5M2};
use std::time::Instant;

/// Element types the bench can drive; values 1..=8 are exact in all of them (bool: true).
pub trait BenchElem: Element + PartialEq + Default {
    fn from_f64(v: f64) -> Self;
}

macro_rules! bench_elem {
    ($($t:ty => $conv:expr),*) => {$(
        impl BenchElem for $t {
            fn from_f64(v: f64) -> Self { $conv(v) }
        }
    )*};
}
bench_elem!(f32 => |v| v as f32, f64 => |v| v, f16 => f16::from_f64, bf16 => bf16::from_f64,
    i8 => |v| v as i8, u8 => |v| v as u8, i16 => |v| v as i16, u16 => |v| v as u16, i32 => |v| v as i32,
    i64 => |v| v as i64, u32 => |v| v as u32, u64 => |v| v as u64, bool => |v| v != 0.0,
    F8E4M3 => |v| F8E4M3::from_f32(v as f32), F8E5M2 => |v| F8E5M2::from_f32(v as f32));

/// The input value of rank `r` at element `i`.
fn value(r: usize, i: usize) -> f64 {
    ((r + i) % 8 + 1) as f64
}

/// nccl-tests' bus bandwidth factor: busbw = algbw * factor.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "all_to_all" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// Elements per rank-block for `bytes` of `op`, or `None` if the size does not fit the op.
pub fn count_for(op: &str, bytes: usize, esize: usize, n: usize) -> Option<usize> {
    let total = bytes / esize;
    let c = match op {
        "all_gather" | "reduce_scatter" | "all_to_all" => total / n,
        "signal" => 1,
        _ => total,
    };
    (c > 0).then_some(c)
}

/// Expected reduction of element `i` over ranks (check supports sum, min, max).
fn folded(op: ReduceOp, n: usize, i: usize) -> f64 {
    let vals = (0..n).map(|r| value(r, i));
    match op {
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
        _ => vals.sum(),
    }
}

fn fill<T: BenchElem>(buf: &mut [T], r: usize, offset: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = T::from_f64(value(r, offset + i));
    }
}

fn wrong<T: BenchElem>(got: &[T], want: impl Fn(usize) -> f64) -> u64 {
    got.iter()
        .enumerate()
        .filter(|(i, g)| **g != T::from_f64(want(*i)))
        .count() as u64
}

/// State that lives across sizes: the window of the one-sided ops.
pub struct Bench<'c> {
    pub comm: &'c Comm,
    /// The collectives as timed: `comm` with the `--algo` hint, if any.
    coll: WithOptions<'c, Comm>,
    pub op: String,
    pub redop: ReduceOp,
    pub root: usize,
    pub iters: usize,
    pub warmup: usize,
    pub check: bool,
    window: Option<Window<'static>>,
    /// Signal epochs already consumed, per signal id (window ops).
    epoch: u64,
}

impl<'c> Bench<'c> {
    pub fn new(comm: &'c Comm, a: &crate::cli::Args) -> Result<Bench<'c>> {
        let rop = a.redop.reduce_op();
        if a.check && !matches!(rop, ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max) {
            return Err(Error::Config("--check supports --redop sum, min and max".into()));
        }
        let fp8 = matches!(a.dtype, crate::cli::DType::F8E4M3 | crate::cli::DType::F8E5M2);
        if a.check && fp8 && rop == ReduceOp::Sum {
            // Its sums round once per step, so they need not be the rounded exact sum.
            return Err(Error::Config("--check on fp8 supports --redop min and max".into()));
        }
        if a.root >= comm.size() {
            return Err(Error::InvalidRank {
                op: "bench",
                rank: a.root,
                size: comm.size(),
            });
        }
        let window = match a.op.as_str() {
            "put" | "get" | "signal" => Some(comm.new_window(a.max_bytes.max(8))?),
            // Source in the first half, the left neighbour's puts land in the second.
            "queue_put" => Some(comm.new_window(2 * a.max_bytes.max(8))?),
            _ => None,
        };
        let hints = match &a.algo {
            Some(name) => OpOptions::new().hint("algorithm", name),
            None => OpOptions::new(),
        };
        Ok(Bench {
            comm,
            coll: comm.with_options(hints),
            op: a.op.clone(),
            redop: rop,
            root: a.root,
            iters: a.iters,
            warmup: a.warmup,
            check: a.check,
            window,
            epoch: 0,
        })
    }

    /// Times `step` and returns the slowest rank's seconds per iteration.
    fn time(&mut self, mut step: impl FnMut(&mut Self) -> Result<()>) -> Result<f64> {
        for _ in 0..self.warmup {
            step(self)?;
        }
        self.comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..self.iters {
            step(self)?;
        }
        let mut t = [t0.elapsed().as_secs_f64() / self.iters as f64];
        self.comm.all_reduce(&mut t, ReduceOp::Max)?;
        Ok(t[0])
    }

    pub fn row<T: BenchElem>(&mut self, bytes: usize) -> Result<Option<Row>> {
        let (n, me) = (self.comm.size(), self.comm.rank());
        let Some(count) = count_for(&self.op, bytes, std::mem::size_of::<T>(), n) else {
            return Ok(None);
        };
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let (op, root) = (self.redop, self.root);
        let mut a = PageBuf::<T>::new(
            count
                * if matches!(self.op.as_str(), "reduce_scatter" | "all_to_all") {
                    n
                } else {
                    1
                },
        );
        let mut b = PageBuf::<T>::new(
            count
                * if matches!(self.op.as_str(), "all_gather" | "all_to_all") {
                    n
                } else {
                    1
                },
        );
        fill(&mut a, me, 0);
        let secs = match self.op.as_str() {
            "all_reduce" => self.time(|s| s.coll.all_reduce(&mut a[..], op))?,
            "reduce" => self.time(|s| s.coll.reduce(&mut a[..], op, root))?,
            "broadcast" => self.time(|s| s.coll.broadcast(&mut a[..], root))?,
            "all_gather" => self.time(|s| s.coll.all_gather(&mut b[..], &a[..]))?,
            "reduce_scatter" => self.time(|s| s.coll.reduce_scatter(&mut b[..], &a[..], op))?,
            "all_to_all" => self.time(|s| s.coll.all_to_all(&mut b[..], &a[..]))?,
            "send_recv" => self.time(|s| s.comm.batch().send(&a[..], right).recv(&mut b[..], left).issue())?,
            "put" => self.time(|s| {
                let w = s.window.as_ref().expect("window");
                s.epoch += 1;
                w.put_signal(right, 0, &a[..], 0, SignalOp::Add, 1)?;
                w.wait_signal(0, SignalSource::Rank(left), Cmp::Ge, s.epoch).map(|_| ())
            })?,
            "queue_put" => {
                // The kernel path toward other hosts, driven from the host: descriptors through
                // the window's proxy queue and proxy thread onto the network link.
                let w = self.window.take().expect("window");
                let half = w.bytes() / 2;
                let timed = w.write_local(0, &a[..]).and_then(|_| {
                    let q = w.proxy_queue()?;
                    self.time(|s| {
                        s.epoch += 1;
                        q.put_signal(right, half, 0, bytes, 0, SignalOp::Add, 1)?;
                        w.wait_signal(0, SignalSource::Rank(left), Cmp::Ge, s.epoch).map(|_| ())
                    })
                });
                self.window = Some(w);
                timed?
            }
            "get" => self.time(|s| s.window.as_ref().expect("window").get(right, 0, &mut b[..]))?,
            "signal" => {
                // Ping-pong between ranks 0 and 1; a half round trip is the latency.
                let rt = self.time(|s| {
                    let w = s.window.as_ref().expect("window");
                    s.epoch += 1;
                    match me {
                        0 => {
                            w.signal(1 % n, 1, SignalOp::Add, 1)?;
                            w.wait_signal(2, SignalSource::Rank(1 % n), Cmp::Ge, s.epoch)
                                .map(|_| ())
                        }
                        1 => {
                            w.wait_signal(1, SignalSource::Rank(0), Cmp::Ge, s.epoch)?;
                            w.signal(0, 2, SignalOp::Add, 1)
                        }
                        _ => Ok(()),
                    }
                })?;
                rt / 2.0
            }
            other => return Err(Error::Config(format!("unknown op {other}"))),
        };
        let wrong = if self.check { self.verify::<T>(count)? } else { 0 };
        let algbw = bytes as f64 / secs / 1e9;
        Ok(Some(Row {
            bytes,
            count,
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * bus_factor(&self.op, n),
            wrong,
            ..Row::default()
        }))
    }

    /// Runs the op once on fresh inputs and counts wrong elements over all ranks.
    fn verify<T: BenchElem>(&mut self, count: usize) -> Result<u64> {
        let (n, me) = (self.comm.size(), self.comm.rank());
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let (op, root) = (self.redop, self.root);
        let c = &self.coll;
        let bad = match self.op.as_str() {
            "all_reduce" | "reduce" => {
                let mut a = PageBuf::<T>::new(count);
                fill(&mut a, me, 0);
                if self.op == "all_reduce" {
                    c.all_reduce(&mut a[..], op)?;
                } else {
                    c.reduce(&mut a[..], op, root)?;
                }
                if self.op == "reduce" && me != root {
                    wrong(&a, |i| value(me, i))
                } else {
                    wrong(&a, |i| folded(op, n, i))
                }
            }
            "broadcast" => {
                let mut a = PageBuf::<T>::new(count);
                fill(&mut a, me, 0);
                c.broadcast(&mut a[..], root)?;
                wrong(&a, |i| value(root, i))
            }
            "all_gather" => {
                let (mut a, mut b) = (PageBuf::<T>::new(count), PageBuf::<T>::new(count * n));
                fill(&mut a, me, 0);
                c.all_gather(&mut b[..], &a[..])?;
                wrong(&b, |i| value(i / count, i % count))
            }
            "reduce_scatter" => {
                let (mut a, mut b) = (PageBuf::<T>::new(count * n), PageBuf::<T>::new(count));
                fill(&mut a, me, 0);
                c.reduce_scatter(&mut b[..], &a[..], op)?;
                wrong(&b, |i| folded(op, n, me * count + i))
            }
            "all_to_all" => {
                let (mut a, mut b) = (PageBuf::<T>::new(count * n), PageBuf::<T>::new(count * n));
                fill(&mut a, me, 0);
                c.all_to_all(&mut b[..], &a[..])?;
                wrong(&b, |i| value(i / count, me * count + i % count))
            }
            "send_recv" => {
                let (mut a, mut b) = (PageBuf::<T>::new(count), PageBuf::<T>::new(count));
                fill(&mut a, me, 0);
                c.batch().send(&a[..], right).recv(&mut b[..], left).issue()?;
                wrong(&b, |i| value(left, i))
            }
            "queue_put" => {
                let w = self.window.as_ref().expect("window");
                let half = w.bytes() / 2;
                let mut a = PageBuf::<T>::new(count);
                fill(&mut a, me, 0);
                w.write_local(0, &a[..])?;
                w.barrier()?;
                let q = w.proxy_queue()?;
                q.put(right, half, 0, count * std::mem::size_of::<T>())?;
                q.flush()?;
                w.barrier()?;
                let mut b = PageBuf::<T>::new(count);
                w.read_local(half, &mut b[..])?;
                w.barrier()?;
                wrong(&b, |i| value(left, i))
            }
            "put" | "get" => {
                let w = self.window.as_ref().expect("window");
                let mut a = PageBuf::<T>::new(count);
                fill(&mut a, me, 0);
                w.barrier()?;
                if self.op == "put" {
                    w.put(right, 0, &a[..])?;
                } else {
                    w.write_local(0, &a[..])?;
                }
                w.barrier()?;
                let mut b = PageBuf::<T>::new(count);
                if self.op == "put" {
                    w.read_local(0, &mut b[..])?;
                    w.barrier()?;
                    wrong(&b, |i| value(left, i))
                } else {
                    w.get(right, 0, &mut b[..])?;
                    w.barrier()?;
                    wrong(&b, |i| value(right, i))
                }
            }
            _ => 0,
        };
        let mut total = [bad];
        c.all_reduce(&mut total, ReduceOp::Sum)?;
        Ok(total[0])
    }
}
