//! Windows: symmetric memory that any rank can put to, get from, signal and update atomically
//! without the owner taking part. The contract is docs/memory-model.md; `Window` checks every
//! rank, offset, length and signal id, then hands the call to its backend
//! (crate::contracts::window::WindowBackend).

use crate::collectives::Collectives;
use crate::comm::Comm;
use crate::contracts::dtype::{as_bytes, as_bytes_mut, normalise, DType, Element};
use crate::contracts::error::{Error, Result};
use crate::contracts::window::{Cmp, Observed, SignalOp, SignalSource, WindowBackend, WindowOptions, WindowSpec};
use crate::contracts::window_handle::WindowHandle;
use crate::net::windows::{HostQueue, QueueProducer};
use crate::work::{Scope, ScopedWork};
use cudarc::driver::CudaStream;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// Window creation on the communicator.
impl Comm {
    /// Creates a window of `bytes` per rank with the default options. Collective: every rank
    /// calls it with the same size.
    pub fn new_window(&self, bytes: usize) -> Result<Window<'static>> {
        self.new_window_with(bytes, WindowOptions::default())
    }

    /// Creates a window of `bytes` per rank with `opts` (its number of signal ids).
    /// Collective: every rank calls it with the same size and options. `Error::Unavailable`
    /// on a backend without windows; `Error::InvalidArgument` for zero signal ids.
    pub fn new_window_with(&self, bytes: usize, opts: WindowOptions) -> Result<Window<'static>> {
        self.window(bytes, opts, None)
    }

    /// Exposes `buf` as this rank's segment of a new window (collective; every rank registers
    /// the same number of bytes). The buffer stays borrowed until the window is dropped; peers
    /// reach it through this rank's proxy, never by pointer.
    ///
    /// `bool` memory cannot be registered (`Error::InvalidArgument`): peers may write any byte
    /// into a segment, and a byte other than 0 or 1 is not a `bool`. Register it as `u8`.
    pub fn register<'b, T: Element>(&self, buf: &'b mut [T], opts: WindowOptions) -> Result<Window<'b>> {
        if T::DTYPE == DType::Bool {
            return Err(Error::invalid(
                "register",
                "bool memory cannot be a segment: peers may write any byte into it; register it as u8",
            ));
        }
        let bytes = std::mem::size_of_val(buf);
        self.window(bytes, opts, Some(buf.as_mut_ptr().cast()))
    }

    fn window<'b>(&self, bytes: usize, opts: WindowOptions, registered: Option<*mut u8>) -> Result<Window<'b>> {
        let (backend, spec) = self.window_backend(bytes, opts, registered)?;
        Ok(Window::new(backend, self.clone(), &spec))
    }
}

/// One rank's handle on a window. `'buf` is the lifetime of registered user memory
/// (`'static` for memory the window allocated). Dropping it frees this rank's part; peers that
/// still wait on this rank then get `Error::PeerLost`.
///
/// Every rank owns a segment of [`bytes`](Window::bytes) bytes and a pad of signal slots; any
/// rank puts to, gets from, signals and atomically updates any other's without the owner
/// taking part. The ordering contract (put then signal is release, `wait_signal` is acquire)
/// is docs/memory-model.md. Offsets are bytes; every rank, range and signal id is checked
/// (`Error::InvalidRank`, `Error::OutOfBounds`, `Error::InvalidArgument`). For elements
/// instead of bytes, see [`TypedWindow`](crate::TypedWindow) ([`Window::typed`]).
///
/// ```
/// use ferrocomm::prelude::*;
///
/// const READY: usize = 0; // a signal id
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "ring", CommOptions::from_env()?)?;
/// let rank_main = |c: &Comm| -> ferrocomm::Result<()> {
///     let (rank, n) = (c.rank(), c.size());
///     let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
///     let win = c.new_window(1024)?; // collective: 1 KiB per rank
///     if rank == 0 {
///         win.write_local(512, &[0u64])?; // the counter below; the barriers publish it
///     }
///     for step in 1..=3u64 {
///         // Put a tile into the right neighbour's segment, then release-signal it.
///         let tile = [rank as u32 * 100 + step as u32; 16];
///         win.put(right, 0, &tile)?;
///         win.signal(right, READY, SignalOp::Add, 1)?;
///         // Acquire: once the left neighbour's signal reaches `step`, its tile is here.
///         let seen = win.wait_signal(READY, SignalSource::Rank(left), Cmp::Ge, step)?;
///         assert_eq!(seen.source, Some(left));
///         let mut got = [0u32; 16];
///         win.read_local(0, &mut got)?;
///         assert_eq!(got, [left as u32 * 100 + step as u32; 16]);
///         // Nobody overwrites a tile before its reader is done with it.
///         win.barrier()?;
///     }
///     // An atomic counter on rank 0: every rank takes one ticket.
///     let ticket = win.fetch_add(0, 512, 1)?;
///     assert!(ticket < n as u64);
///     win.barrier()?;
///     let mut count = [0u64];
///     win.get(0, 512, &mut count)?;
///     assert_eq!(count[0], n as u64);
///     // Rank 0 must not drop its segment while others still read it.
///     win.barrier()
/// };
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
/// })?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub struct Window<'buf> {
    backend: Box<dyn WindowBackend>,
    comm: Comm,
    bytes: usize,
    signals: usize,
    timeout: Duration,
    _buf: PhantomData<&'buf mut [u8]>,
}

impl<'buf> Window<'buf> {
    pub(crate) fn new(backend: Box<dyn WindowBackend>, comm: Comm, spec: &WindowSpec) -> Self {
        let timeout = comm.timeout();
        Window {
            backend,
            comm,
            bytes: spec.bytes,
            signals: spec.signals,
            timeout,
            _buf: PhantomData,
        }
    }

    /// This rank (its communicator's rank).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
    /// The number of ranks, each with a segment.
    pub fn size(&self) -> usize {
        self.comm.size()
    }
    /// Bytes of every rank's segment.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Signal ids per source.
    pub fn signals(&self) -> usize {
        self.signals
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        // A window lives no longer than its communicator (finalized, aborted or shrunk).
        self.comm.check_live(op)?;
        if rank < self.size() {
            Ok(())
        } else {
            Err(Error::InvalidRank {
                op,
                rank,
                size: self.size(),
            })
        }
    }

    fn check_range(&self, op: &'static str, rank: usize, offset: usize, len: usize) -> Result<()> {
        self.check_rank(op, rank)?;
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::OutOfBounds {
                op,
                rank,
                offset,
                len,
                bytes: self.bytes,
            }),
        }
    }

    fn check_word(&self, op: &'static str, rank: usize, offset: usize) -> Result<()> {
        self.check_range(op, rank, offset, 8)?;
        if offset % 8 != 0 {
            return Err(Error::invalid(
                op,
                format!("offset {offset} of a u64 atomic is not 8-byte aligned"),
            ));
        }
        Ok(())
    }

    fn check_signal(&self, op: &'static str, id: usize) -> Result<()> {
        self.comm.check_live(op)?;
        if id < self.signals {
            Ok(())
        } else {
            Err(Error::invalid(
                op,
                format!("signal id {id} is not below {}", self.signals),
            ))
        }
    }

    /// Copies `src` to `dst`'s segment at byte `offset`. Complete at the target by the next
    /// signal to it, `flush` or `barrier`.
    pub fn put<T: Element>(&self, dst: usize, offset: usize, src: &[T]) -> Result<()> {
        let src = as_bytes(src);
        self.check_range("put", dst, offset, src.len())?;
        self.backend.put(dst, offset, src)
    }

    /// Copies `src`'s segment at byte `offset` into `dst` (a `bool` byte other than 0 or 1
    /// arrives as `true`).
    pub fn get<T: Element>(&self, src: usize, offset: usize, dst: &mut [T]) -> Result<()> {
        let dst = as_bytes_mut(dst);
        self.check_range("get", src, offset, dst.len())?;
        let r = self.backend.get(src, offset, dst);
        normalise(T::DTYPE, dst);
        r
    }

    /// Release-writes our slot of signal `id` on `dst`: earlier puts to `dst` are visible
    /// there before the new value is.
    pub fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()> {
        self.check_rank("signal", dst)?;
        self.check_signal("signal", id)?;
        self.backend.signal(dst, id, op, value)
    }

    /// `put` then `signal` to the same rank.
    pub fn put_signal<T: Element>(
        &self,
        dst: usize,
        offset: usize,
        src: &[T],
        id: usize,
        op: SignalOp,
        value: u64,
    ) -> Result<()> {
        self.check_signal("put_signal", id)?;
        self.put(dst, offset, src)?;
        self.signal(dst, id, op, value)
    }

    /// Waits (acquire) until signal `id` from `from` satisfies `cmp value`, within the
    /// communicator's timeout.
    pub fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64) -> Result<Observed> {
        self.wait_signal_timeout(id, from, cmp, value, self.timeout)
    }

    /// [`wait_signal`](Self::wait_signal) with its own bound: `Error::Timeout` once `timeout`
    /// passes without the condition holding (the window stays usable).
    pub fn wait_signal_timeout(
        &self,
        id: usize,
        from: SignalSource,
        cmp: Cmp,
        value: u64,
        timeout: Duration,
    ) -> Result<Observed> {
        self.check_signal("wait_signal", id)?;
        if let SignalSource::Rank(r) = from {
            self.check_rank("wait_signal", r)?;
        }
        self.backend.wait_signal(id, from, cmp, value, timeout)
    }

    /// Atomically adds `value` to the u64 at `dst`:`offset` (8-aligned); returns the old value.
    pub fn fetch_add(&self, dst: usize, offset: usize, value: u64) -> Result<u64> {
        self.check_word("fetch_add", dst, offset)?;
        self.backend.fetch_add(dst, offset, value)
    }

    /// Atomically replaces the u64 at `dst`:`offset` by `desired` if it equals `expected`;
    /// returns the old value.
    pub fn compare_swap(&self, dst: usize, offset: usize, expected: u64, desired: u64) -> Result<u64> {
        self.check_word("compare_swap", dst, offset)?;
        self.backend.compare_swap(dst, offset, expected, desired)
    }

    /// Orders our earlier puts to each rank before our later ones.
    pub fn fence(&self) -> Result<()> {
        self.comm.check_live("fence")?;
        self.backend.fence()
    }

    /// Waits until every earlier operation of ours is complete at its target.
    pub fn flush(&self) -> Result<()> {
        self.comm.check_live("flush")?;
        self.backend.flush()
    }

    /// The host end of this window's proxy queue: the path kernels take to ranks on other hosts
    /// (16-byte descriptors drained by a proxy thread onto the network links), driven from the
    /// host. Puts name a source offset in this rank's window data. `Error::Unavailable` when no
    /// rank of the window is reached over the network, or the backend has no such queue.
    pub fn proxy_queue(&self) -> Result<QueueProducer<'_>> {
        let queue = self
            .backend
            .proxy_queue()?
            .downcast::<HostQueue>()
            .map_err(|_| Error::Unavailable {
                backend: "window".into(),
                reason: "this backend's proxy queue is not the window network's host queue".into(),
            })?;
        Ok(QueueProducer::new(queue))
    }

    /// `flush`, then a barrier over the communicator.
    pub fn barrier(&self) -> Result<()> {
        self.flush()?;
        self.comm.barrier()
    }

    /// Copies from this rank's own segment. Bytes that a peer is writing concurrently (without
    /// a signal or barrier in between) may be old or new.
    /// (A `bool` byte other than 0 or 1 arrives as `true`.)
    pub fn read_local<T: Element>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let dst = as_bytes_mut(dst);
        self.check_range("read_local", self.rank(), offset, dst.len())?;
        if self.backend.device().is_some() {
            let r = self.backend.get(self.rank(), offset, dst);
            normalise(T::DTYPE, dst);
            return r;
        }
        // SAFETY: in bounds of our segment, which lives as long as `self`; copies through raw
        // pointers because peers may write the segment concurrently.
        unsafe { std::ptr::copy_nonoverlapping(self.backend.local_base().add(offset), dst.as_mut_ptr(), dst.len()) };
        normalise(T::DTYPE, dst);
        Ok(())
    }

    /// Copies into this rank's own segment.
    pub fn write_local<T: Element>(&self, offset: usize, src: &[T]) -> Result<()> {
        let src = as_bytes(src);
        self.check_range("write_local", self.rank(), offset, src.len())?;
        if self.backend.device().is_some() {
            return self.backend.put(self.rank(), offset, src);
        }
        // SAFETY: as in `read_local`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.backend.local_base().add(offset), src.len()) };
        Ok(())
    }

    /// This rank's segment (`bytes()` long), valid while the window lives. Peers may write it
    /// at any time: access it with raw-pointer copies or atomics, never as a Rust slice held
    /// across a signal wait. For a window in GPU memory this is a device address.
    pub fn local_ptr(&self) -> *mut u8 {
        self.backend.local_base()
    }

    /// `rank`'s segment mapped into this process (same-host ranks of allocated windows), like
    /// torchcomms' `map_remote_tensor`; `None` where it is reachable only through a proxy.
    /// Same access rules as `local_ptr`. Typed and borrowed:
    /// [`TypedWindow::map_remote`](crate::TypedWindow::map_remote).
    pub fn remote_ptr(&self, rank: usize) -> Option<*mut u8> {
        if rank >= self.size() {
            return None;
        }
        self.backend.remote_base(rank)
    }

    /// Whether the segments live in GPU memory (the `device` backend).
    pub fn is_device_memory(&self) -> bool {
        self.backend.device().is_some()
    }

    /// The handle a kernel takes by value (`ferrocomm_window_handle`, device-api's `Window`).
    /// Valid while this window lives: drop the window only after kernels using it finished
    /// ([`Window::synchronize`]). Fails for windows in host memory.
    pub fn device_handle(&self) -> Result<WindowHandle> {
        self.backend.handle().ok_or_else(|| {
            Error::invalid(
                "device_handle",
                "this window is in host memory (use the device backend)",
            )
        })
    }

    /// The rank's stream: launch kernels that use the window on it, so they are ordered with
    /// the window's host verbs.
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        self.backend
            .device()
            .map(|d| d.1)
            .ok_or_else(|| Error::invalid("stream", "this window is in host memory (use the device backend)"))
    }

    /// Waits for the rank's stream and reports the first error a kernel recorded through the
    /// handle (`Error::Timeout` naming the awaited rank, or `Error::Closed` after an abort),
    /// then clears it: the window stays usable. A no-op for host windows.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.synchronize(self.timeout)
    }

    /// `put` as a [`ScopedWork`] of `scope`, run in issue order with the communicator's other work.
    pub fn put_async<'s, T: Element>(
        &'s self,
        scope: &'s Scope<'s, '_>,
        dst: usize,
        offset: usize,
        src: &'s [T],
    ) -> Result<ScopedWork<'s>> {
        self.check_range("put", dst, offset, std::mem::size_of_val(src))?;
        scope.spawn(Box::new(move |_, _| self.put(dst, offset, src)), "put")
    }

    /// `get` as a [`ScopedWork`] of `scope`.
    pub fn get_async<'s, T: Element>(
        &'s self,
        scope: &'s Scope<'s, '_>,
        src: usize,
        offset: usize,
        dst: &'s mut [T],
    ) -> Result<ScopedWork<'s>> {
        self.check_range("get", src, offset, std::mem::size_of_val(dst))?;
        scope.spawn(Box::new(move |_, _| self.get(src, offset, dst)), "get")
    }

    /// `signal` as a [`ScopedWork`] of `scope` (after the scope's earlier puts).
    pub fn signal_async<'s>(
        &'s self,
        scope: &'s Scope<'s, '_>,
        dst: usize,
        id: usize,
        op: SignalOp,
        value: u64,
    ) -> Result<ScopedWork<'s>> {
        self.check_rank("signal", dst)?;
        self.check_signal("signal", id)?;
        scope.spawn(Box::new(move |_, _| self.signal(dst, id, op, value)), "signal")
    }
}
