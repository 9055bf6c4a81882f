//! A device window's proxy queue (abi.h `ferrocomm_proxy_queue`): the ring kernels push
//! descriptors into, toward ranks on other hosts, and the proxy thread that drains it onto the
//! window's links. The ring, its tail and done counters, the per-rank `remote` flags and the
//! queue record itself are host-pinned and mapped into the GPU; only `head`, which producers
//! take tickets from with device atomics, lives in device memory.

use crate::cuda;
use crate::device::abi::ProxyQueue;
use crate::error::Result;
use crate::memory::Pinned;
use crate::net::descriptor::Limits;
use crate::net::fifo::Ring;
use crate::net::link::SharedLink;
use crate::net::proxy::{LocalData, Plan, Proxy};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Slots of a device queue: as many as a host window's.
const SLOTS: usize = 1024;
/// Words per 64-byte line: tail and done each get a line of their own, then the slots.
const LINE: usize = 8;

pub(super) struct DeviceQueue {
    // Field order: the proxy (which reads the ring) stops before the memory is freed.
    proxy: Proxy,
    /// tail (line 0), done (line 1), then `2 * SLOTS` slot words.
    _words: Pinned<u64>,
    _remote: Pinned<u8>,
    record: Pinned<ProxyQueue>,
    _head: CudaSlice<u64>,
}

impl DeviceQueue {
    /// `links[r]` is the link to rank `r` where it is reached over the network.
    pub(super) fn start(
        stream: &Arc<CudaStream>,
        links: Vec<Option<Arc<SharedLink>>>,
        data: Box<dyn LocalData>,
        limits: Limits,
        ordinal: usize,
    ) -> Result<DeviceQueue> {
        let words = Pinned::<u64>::zeroed(2 * LINE + 2 * SLOTS)?;
        let remote = Pinned::<u8>::zeroed(links.len())?;
        for (r, l) in links.iter().enumerate() {
            remote.write(r, u8::from(l.is_some()));
        }
        let head = stream.alloc_zeros::<u64>(1).map_err(|e| cuda::err("cuMemAlloc", e))?;
        stream.synchronize().map_err(|e| cuda::err("cuStreamSynchronize", e))?;
        let word = |i: usize| words.device_addr() + (i * 8) as u64;
        let record = Pinned::<ProxyQueue>::zeroed(1)?;
        let (head_addr, head_in_use) = head.device_ptr(stream);
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
        let proxy = Proxy::start(Plan {
            ring,
            links,
            data,
            limits,
            cpus: cuda::pci_bus_id(ordinal)
                .ok()
                .and_then(|bus| crate::net::affinity::cpus_near_pci_device(&bus)),
        })?;
        drop(head_in_use);
        Ok(DeviceQueue {
            proxy,
            _words: words,
            _remote: remote,
            record,
            _head: head,
        })
    }

    /// The device address kernels find in `WindowHandle::fifo`.
    pub(super) fn device_addr(&self) -> u64 {
        self.record.device_addr()
    }

    /// The first error the proxy met since the last call (a lost link, a bad descriptor).
    pub(super) fn take_error(&self) -> Option<crate::error::Error> {
        self.proxy.take_error()
    }
}
