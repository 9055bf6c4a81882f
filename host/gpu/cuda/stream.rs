//! The calling thread's current CUDA stream, and events for stream hand-offs and deadlines.
//!
//! Synchronous operations on device buffers are enqueued on the current stream (like a kernel
//! launch) and return; asynchronous ones run on a backend's own stream and hand back an event.
//! Streams travel as raw `CUstream` values (`0` is the legacy default stream) because operations
//! cross threads and cudarc's stream handle is not `Send`.

use super::{check, err};
use crate::contracts::error::{Error, Result};
use cudarc::driver::{sys, CudaStream};
use std::cell::Cell;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// The calling thread's current stream (0: the legacy default stream).
pub(crate) fn current() -> u64 {
    CURRENT.with(Cell::get)
}

/// Makes `stream` the calling thread's current stream until the guard is dropped.
pub(crate) fn set_current(stream: &CudaStream) -> CurrentStream<'_> {
    let prev = CURRENT.with(|c| c.replace(stream.cu_stream() as u64));
    CurrentStream {
        prev,
        _stream: PhantomData,
    }
}

/// Restores the previous current stream when dropped. See [`crate::device::use_stream`].
#[must_use = "the stream is current only while the guard lives"]
pub struct CurrentStream<'s> {
    prev: u64,
    // The guard borrows the stream and stays on its thread.
    _stream: PhantomData<(&'s CudaStream, *const ())>,
}

impl Drop for CurrentStream<'_> {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.prev));
    }
}

pub(crate) fn raw(stream: u64) -> sys::CUstream {
    stream as sys::CUstream
}

/// Whether `stream` is being captured into a CUDA graph (nothing may wait on it then).
pub(crate) fn is_capturing(stream: u64) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one enum value.
    check("cuStreamIsCapturing", unsafe {
        sys::cuStreamIsCapturing(raw(stream), &mut status)
    })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Blocks until everything enqueued on `stream` is done, or `limit` passes (then
/// `Error::Timeout` naming `op`). Spins first: host verbs' work takes microseconds.
pub(crate) fn wait_idle(stream: sys::CUstream, op: &'static str, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut spins = 0u32;
    loop {
        // SAFETY: the caller's stream is live.
        match unsafe { sys::cuStreamQuery(stream) } {
            sys::CUresult::CUDA_SUCCESS => return Ok(()),
            sys::CUresult::CUDA_ERROR_NOT_READY => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        op,
                        peer: None,
                        after: limit,
                    });
                }
                spins += 1;
                if spins < 1000 {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
            other => return check("cuStreamQuery", other),
        }
    }
}

/// A CUDA event without timing, owned.
pub(crate) struct Event(sys::CUevent);

// SAFETY: CUDA events may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as for Send: the driver's event calls are thread-safe, and `&Event` only offers them.
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn new() -> Result<Event> {
        let mut e = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: writes one event handle.
        check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
        Ok(Event(e))
    }

    /// An event recorded on `stream` now.
    pub(crate) fn record_on(stream: u64) -> Result<Event> {
        let e = Event::new()?;
        e.record(stream)?;
        Ok(e)
    }

    /// Records the event (again) behind the work enqueued on `stream` so far.
    pub(crate) fn record(&self, stream: u64) -> Result<()> {
        // SAFETY: both handles are live.
        check("cuEventRecord", unsafe { sys::cuEventRecord(self.0, raw(stream)) })
    }

    pub(crate) fn is_complete(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(self.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(err("cuEventQuery", cudarc::driver::DriverError(e))),
        }
    }

    /// Makes `stream` wait for this event (the host does not block).
    pub(crate) fn make_wait(&self, stream: u64) -> Result<()> {
        // SAFETY: both handles are live.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(raw(stream), self.0, 0)
        })
    }

    /// Blocks until the event completes or `timeout` passes (then `Error::Timeout` naming `op`).
    pub(crate) fn wait(&self, op: &'static str, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(1);
        while !self.is_complete()? {
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    op,
                    peer: None,
                    after: timeout,
                });
            }
            // Spin briefly (a collective often ends within microseconds), then back off.
            if pause > Duration::from_micros(50) {
                std::thread::sleep(pause);
            } else {
                std::hint::spin_loop();
            }
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours; CUDA defers the release until pending work has passed it.
        unsafe { sys::cuEventDestroy_v2(self.0) };
    }
}

/// Makes `stream` the calling thread's current stream while the guard lives: synchronous
/// operations on device buffers are enqueued on it (and may be captured into a CUDA graph
/// there), and `Work::wait` orders it after asynchronous ones. Without a guard the current
/// stream is the legacy default stream.
pub fn use_stream(stream: &cudarc::driver::CudaStream) -> CurrentStream<'_> {
    set_current(stream)
}
