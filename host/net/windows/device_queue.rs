//! A device window's proxy queue (abi.h `ferrocomm_proxy_queue`): the ring kernels push
//! descriptors into, toward ranks on other hosts, and the proxy thread that drains it onto the
//! window's links. The ring, its tail and done counters, the per-rank `remote` flags and the
//! queue record itself are host-pinned and mapped into the GPU; only `head`, which producers
//! take tickets from with device atomics, lives in device memory.

use crate::contracts::error::{Error, Result};
use crate::contracts::window_handle::ProxyQueue;
use crate::gpu::cuda;
use crate::gpu::memory::Pinned;
use crate::gpu::target::{Gpu, Place, Stream};
use crate::net::windows::descriptor::Limits;
use crate::net::windows::fifo::Ring;
use crate::net::windows::link::SharedLink;
use crate::net::windows::proxy::{LocalData, Plan, Proxy};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Slots of a device queue: as many as a host window's.
const SLOTS: usize = 1024;
/// Words per 64-byte line: tail and done each get a line of their own, then the slots.
const LINE: usize = 8;

pub(crate) struct DeviceQueue {
    // Field order: the proxy (which reads the ring) stops before the memory is freed.
    proxy: Proxy,
    /// tail (line 0), done (line 1), then `2 * SLOTS` slot words.
    words: Pinned<u64>,
    _remote: Pinned<u8>,
    record: Pinned<ProxyQueue>,
    head: Head,
}

/// The ticket counter producers take from with device atomics: device memory on a GPU, host
/// memory on the host device. Kernels use it by address; the host reads it only to drain.
enum Head {
    #[allow(dead_code)]
    Cuda(CudaSlice<u64>),
    Host(Pinned<u64>),
}

impl DeviceQueue {
    /// `links[r]` is the link to rank `r` where it is reached over the network.
    pub(crate) fn start(
        gpu: Gpu,
        stream: &Stream,
        links: Vec<Option<Arc<SharedLink>>>,
        data: Box<dyn LocalData>,
        limits: Limits,
    ) -> Result<DeviceQueue> {
        let words = gpu.records::<u64>(2 * LINE + 2 * SLOTS)?;
        let remote = gpu.records::<u8>(links.len())?;
        for (r, l) in links.iter().enumerate() {
            remote.write(r, u8::from(l.is_some()));
        }
        let (head, head_addr) = match stream {
            Stream::Cuda(s) => {
                let head = s.alloc_zeros::<u64>(1).map_err(|e| cuda::err("cuMemAlloc", e))?;
                s.synchronize().map_err(|e| cuda::err("cuStreamSynchronize", e))?;
                let addr = head.device_ptr(s).0;
                (Head::Cuda(head), addr)
            }
            Stream::Host(_) => {
                let head = gpu.records::<u64>(1)?;
                let addr = head.device_addr();
                (Head::Host(head), addr)
            }
        };
        let word = |i: usize| words.device_addr() + (i * 8) as u64;
        let record = gpu.records::<ProxyQueue>(1)?;
        record.write(
            0,
            ProxyQueue {
                slots: word(2 * LINE),
                head: head_addr,
                tail: word(0),
                done: word(LINE),
                remote: remote.device_addr(),
                capacity: SLOTS as u32,
                flags: 0,
            },
        );
        let host = words.host_ptr() as *const AtomicU64;
        // SAFETY: all offsets lie inside `words`, which outlives the proxy (field order).
        let ring = unsafe {
            Ring {
                slots: host.add(2 * LINE),
                tail: host,
                done: host.add(LINE),
                capacity: SLOTS as u64,
            }
        };
        let pin = crate::contracts::config::current()?.proxy_affinity;
        let proxy = Proxy::start(Plan {
            ring,
            links,
            data,
            limits,
            cpus: match gpu {
                Gpu::Cuda(ordinal) => cuda::pci_bus_id(ordinal)
                    .ok()
                    .and_then(|bus| crate::net::windows::proxy_affinity::cpus_near_pci_device(&bus, pin)),
                Gpu::Host => None,
            },
        })?;
        Ok(DeviceQueue {
            proxy,
            words,
            _remote: remote,
            record,
            head,
        })
    }

    /// The device address kernels find in `WindowHandle::fifo`.
    pub(crate) fn device_addr(&self) -> u64 {
        self.record.device_addr()
    }

    /// The first error the proxy met since the last call (a lost link, a bad descriptor).
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.proxy.take_error()
    }

    /// Waits until every descriptor producers have taken a ticket for is complete at its
    /// target (`done` reached `head`). The kernels that push must have ended; `stream` reads a
    /// device `head`. For tearing a window down: what is still queued reaches the peers'
    /// servers while they run.
    pub(crate) fn drain(&self, stream: &Stream, timeout: Duration) -> Result<()> {
        const OP: &str = "proxy queue drain";
        let head = match &self.head {
            Head::Host(h) => h.read(0),
            Head::Cuda(_) => {
                let mut v = 0u64;
                // SAFETY: `v` outlives the wait below; the record holds the counter's address.
                unsafe {
                    stream.copy(
                        Place::Host(&mut v as *mut u64 as usize),
                        Place::Device(self.record.read(0).head),
                        8,
                    )
                }?;
                stream.wait_idle(OP, timeout)?;
                v
            }
        };
        // SAFETY: line 1 of `words` is the done counter, which the proxy stores atomically.
        let done = unsafe { &*(self.words.host_ptr().add(LINE) as *const AtomicU64) };
        let deadline = Instant::now() + timeout;
        while done.load(Ordering::Acquire) < head {
            if let Some(e) = self.proxy.take_error() {
                return Err(e);
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout {
                    op: OP,
                    peer: None,
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}
