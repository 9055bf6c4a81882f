//! Asynchronous operations that own their buffers: [`Work`] holds the buffers while the
//! operations run and hands them back on [`Work::wait`], so it can be stored, moved to another
//! thread and waited for anywhere (a gradient all_reduce started in a backward hook and waited
//! for at the optimizer step). [`Comm::start`] is the general form: any calls of the
//! [`Collectives`] vocabulary on buffers the work owns; `owned.rs` has one method per call.
//!
//! Why it is sound: the buffers move into a heap allocation of their own before any operation
//! borrows them, and that allocation is freed only after every operation has ended (on the
//! device too, or never). The issuing closure gets a [`Starter`] that is invariant in its
//! lifetime and an `&'b mut B` for every `'b` (`for<'b>`), so an operation can borrow nothing
//! but the owned buffers and `'static` data.

use crate::buffer::{owned_in, owned_out, InputBuffer, OutputBuffer, OwnedBuffer};
use crate::collectives::Collectives;
use crate::comm::Comm;
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Location, Op};
use crate::contracts::options::OpOptions;
use crate::executor::Completion;
use crate::gpu::cuda::stream;
use std::cell::RefCell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Operations in flight that own their buffers `B`; made by [`Comm::start`] and the calls of
/// [`Comm::owned`]. `Send` (and `Sync`) when `B` is `Send`.
///
/// [`wait`](Work::wait) returns the buffers once every operation has ended. Dropping a `Work`
/// that was not waited for **waits** for its operations (each ends within its timeout) and
/// then frees the buffers; a device operation that has still not finished by the
/// communicator's timeout after that leaks the buffers rather than free memory the GPU may
/// still write (a `tracing` warning says so).
///
/// ```
/// use ferrocomm::prelude::*;
///
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "owned-doc", CommOptions::from_env()?)?;
/// let works: Vec<Work<Vec<f32>>> = comms
///     .iter()
///     .map(|c| c.owned().all_reduce(vec![c.rank() as f32 + 1.0; 8], ReduceOp::Sum))
///     .collect::<ferrocomm::Result<_>>()?;
/// // The works outlive the statement that started them; wait for each on another thread.
/// std::thread::scope(|s| {
///     for w in works {
///         s.spawn(move || assert_eq!(w.wait().unwrap(), vec![3.0; 8]));
///     }
/// });
/// # Ok::<(), ferrocomm::Error>(())
/// ```
#[must_use = "dropping a Work waits for it and loses its result and buffers"]
pub struct Work<B: Send + 'static> {
    /// The buffers, boxed and leaked until every operation has ended; `None` once handed back.
    buffers: Option<NonNull<B>>,
    pending: Vec<(Arc<Completion>, &'static str)>,
    /// The owned device buffers' own streams, which `wait` orders after the operations too.
    streams: Vec<u64>,
    /// How long a device fence may keep the buffers after the host part ended (see Drop).
    timeout: Duration,
}

// SAFETY: `Work` owns the boxed `B` (it is never shared: the operations' borrows of it end
// before `Work` touches it again), so sending the `Work` sends the `B`.
unsafe impl<B: Send + 'static> Send for Work<B> {}
// SAFETY: `&Work` gives no access to the buffers at all (only to the completions, which are
// Sync), so sharing it is sound whatever `B` is.
unsafe impl<B: Send + 'static> Sync for Work<B> {}

impl<B: Send + 'static> std::fmt::Debug for Work<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("ops", &self.pending.iter().map(|p| p.1).collect::<Vec<_>>())
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<B: Send + 'static> Work<B> {
    /// Whether every operation has ended, on the device too (a failed device query counts as
    /// ended: `wait` reports it).
    pub fn is_completed(&self) -> bool {
        self.pending
            .iter()
            .all(|(c, _)| c.is_done() && c.fence.is_complete().unwrap_or(true))
    }

    /// Blocks at most `limit` for the operations to end: `Ok(())` once they have (failed or
    /// not: [`wait`](Self::wait) reports how), `Error::Timeout` if they are still running
    /// then (they go on; wait again later). Device work left on a stream does not count here;
    /// `wait` orders the current stream after it.
    pub fn wait_timeout(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        for (c, op) in &self.pending {
            let left = deadline.saturating_duration_since(Instant::now());
            if !c.is_done() && !c.wait_done(left) {
                return Err(Error::Timeout {
                    op,
                    peer: None,
                    after: limit,
                });
            }
        }
        Ok(())
    }

    /// Blocks until every operation has ended and hands the buffers back, or returns the first
    /// operation's error (the buffers are then dropped as an unwaited `Work` drops them).
    /// Device operations left running on a stream are ordered before later work on the
    /// calling thread's current stream and on each owned device buffer's own stream
    /// ([`OwnedBuffer::device_stream`](crate::OwnedBuffer::device_stream)); the host does not
    /// wait for the GPU.
    pub fn wait(mut self) -> Result<B> {
        let mut first = Ok(());
        for (c, _) in &self.pending {
            let r = c.wait(None).unwrap_or(Ok(())).and_then(|()| {
                std::iter::once(stream::current())
                    .chain(self.streams.iter().copied())
                    .try_for_each(|s| c.fence.stream_wait(s))
            });
            if first.is_ok() {
                first = r;
            }
        }
        // On failure the device may still be at work: Drop waits for it (or leaks).
        first?;
        let Some(ptr) = self.buffers.take() else {
            return Err(Error::Closed {
                op: "Work::wait",
                state: "its buffers were already handed back",
            });
        };
        // SAFETY: `ptr` came from `Box::leak` in `Comm::start`; every operation that borrowed
        // it has ended (above), and its device work is ordered before every stream that may
        // touch the buffers next.
        Ok(*unsafe { Box::from_raw(ptr.as_ptr()) })
    }
}

impl<B: Send + 'static> Drop for Work<B> {
    fn drop(&mut self) {
        let Some(ptr) = self.buffers.take() else { return };
        for (c, _) in &self.pending {
            let _ = c.wait(None);
        }
        // The buffers are freed right here, not on a stream: wait (bounded) for device work.
        // A fence that cannot be asked counts as running: leaking beats freeing under a kernel.
        let deadline = Instant::now() + self.timeout;
        while !self.pending.iter().all(|(c, _)| c.fence.is_complete().unwrap_or(false)) {
            if Instant::now() >= deadline {
                tracing::warn!(
                    ops = ?self.pending.iter().map(|p| p.1).collect::<Vec<_>>(),
                    "a dropped Work's device operations are still running (or cannot be asked) after \
                     the timeout: its buffers are leaked, not freed under them"
                );
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // SAFETY: as in `wait`; every operation has ended, on the device too.
        drop(unsafe { Box::from_raw(ptr.as_ptr()) });
    }
}

/// Issues the operations of [`Comm::start`]: every call of [`Collectives`] on buffers borrowed
/// from the work's own (`'b`). Each call returns `()` once queued.
///
/// An operation cannot borrow anything else: the work may outlive it.
///
/// ```compile_fail
/// use ferrocomm::prelude::*;
/// let comm = Comm::new_group("cpu", &[Device::Cpu], "cf", CommOptions::from_env()?)?.remove(0);
/// let local = vec![1f32; 4];
/// // error: `local` does not live long enough for the work.
/// let work = comm.start(vec![0f32; 4], |s, out| s.all_gather(out, &local[..]))?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub struct Starter<'b> {
    comm: Comm,
    opts: OpOptions,
    pending: RefCell<Vec<(Arc<Completion>, &'static str)>>,
    streams: RefCell<Vec<u64>>,
    /// Invariant in 'b: a starter cannot be taken for one of a shorter borrow (which would let
    /// an operation borrow a local of the closure).
    _borrow: PhantomData<&'b mut &'b ()>,
}

impl<'b> Collectives<'b> for Starter<'b> {
    type Output = ();
    fn comm(&self) -> &Comm {
        &self.comm
    }
    fn issue(&self, op: Op<'b>, opts: &OpOptions) -> Result<()> {
        let name = op.name();
        // A captured graph replays the operation after its Work handed the buffers back.
        if matches!(op.location()?, Some(Location::Cuda(_))) && stream::is_capturing(stream::current())? {
            return Err(Error::invalid(
                name,
                "an owned operation cannot be captured into a CUDA graph (its replays would \
                 outlive the Work's buffers): capture the borrowed call instead",
            ));
        }
        let task = self.comm.prepare(op, opts)?;
        // SAFETY: the task borrows for 'b, that is, the buffers `Comm::start` boxed (or
        // 'static data); they are freed only after this completion and its fence (Work).
        let done = unsafe { self.comm.executor().submit(task, name) }?;
        self.pending.borrow_mut().push((done, name));
        Ok(())
    }
    fn op_options(&self) -> OpOptions {
        self.opts.clone()
    }
}

impl<'b> Starter<'b> {
    /// `buf` as the input of a call on this starter; its device stream, if any, is ordered
    /// after the work by [`Work::wait`].
    pub fn input<O: OwnedBuffer>(&self, buf: &'b O) -> Result<impl InputBuffer<'b, Elem = O::Elem>> {
        self.note_stream(buf);
        owned_in(buf)
    }

    /// `buf` as the output (or in-place buffer) of a call on this starter; see
    /// [`input`](Self::input).
    pub fn output<O: OwnedBuffer>(&self, buf: &'b mut O) -> Result<impl OutputBuffer<'b, Elem = O::Elem>> {
        self.note_stream(buf);
        owned_out(buf)
    }

    fn note_stream<O: OwnedBuffer>(&self, buf: &O) {
        if let Some(s) = buf.device_stream() {
            let mut streams = self.streams.borrow_mut();
            if !streams.contains(&s) {
                streams.push(s);
            }
        }
    }
}

/// Asynchronous operations on owned buffers.
impl Comm {
    /// Moves `buffers` into a [`Work`] and runs `issue` with a [`Starter`] and the buffers:
    /// every call it makes on the starter (any of [`Collectives`]) is queued in issue order and
    /// may borrow only from the buffers. Returns at once; [`Work::wait`] hands the buffers back.
    /// If `issue` fails, the calls it already queued are waited for and its error returned.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "start-doc", CommOptions::from_env()?)?;
    /// std::thread::scope(|s| {
    ///     for c in &comms {
    ///         s.spawn(move || {
    ///             // An all_gather and a broadcast in one Work, on buffers it owns.
    ///             let bufs = (vec![0u32; 2], [c.rank() as u32 + 7], vec![c.rank() as u8; 3]);
    ///             let work = c
    ///                 .start(bufs, |s, (all, mine, b)| {
    ///                     s.all_gather(all, &*mine)?;
    ///                     s.broadcast(b, 1)
    ///                 })
    ///                 .unwrap();
    ///             let (all, _, b) = work.wait().unwrap();
    ///             assert_eq!((all, b), (vec![7, 8], vec![1, 1, 1]));
    ///         });
    ///     }
    /// });
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn start<B, F>(&self, buffers: B, issue: F) -> Result<Work<B>>
    where
        B: Send + 'static,
        F: for<'b> FnOnce(&Starter<'b>, &'b mut B) -> Result<()>,
    {
        self.start_with(&OpOptions::default(), buffers, issue)
    }

    /// [`start`](Self::start) with a per-operation timeout or hints for every call.
    pub fn start_with<B, F>(&self, opts: &OpOptions, buffers: B, issue: F) -> Result<Work<B>>
    where
        B: Send + 'static,
        F: for<'b> FnOnce(&Starter<'b>, &'b mut B) -> Result<()>,
    {
        let ptr = NonNull::from(Box::leak(Box::new(buffers)));
        let starter = Starter {
            comm: self.clone(),
            opts: opts.clone(),
            pending: RefCell::default(),
            streams: RefCell::default(),
            _borrow: PhantomData,
        };
        // SAFETY: the leaked box is reached only through this borrow until the Work (which
        // takes `ptr` below) has seen every operation end.
        let r = issue(&starter, unsafe { &mut *ptr.as_ptr() });
        let work = Work {
            buffers: Some(ptr),
            pending: starter.pending.into_inner(),
            streams: starter.streams.into_inner(),
            timeout: opts.timeout.unwrap_or(self.timeout()),
        };
        // On failure, dropping the work waits for what was queued before the buffers go.
        r.map(|()| work)
    }
}
