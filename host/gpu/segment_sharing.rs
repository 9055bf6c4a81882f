//! How a rank hands a device allocation (its window segment, or rank 0's multicast object) to
//! its peers: it publishes a [`Shared`] record through the store. A peer in the same process
//! takes the very same allocation from this process's registry; a peer in another process
//! fetches a descriptor from the owner's Unix socket (gpu/fd_passing.rs, uid-checked) and
//! imports it. GPU allocations and the host device's segments travel alike.

use crate::contracts::error::{Error, Result};
use crate::gpu::fd_passing::{fetch_fds, FdServer};
use crate::gpu::memory::Physical;
use crate::gpu::target::{Gpu, Segment};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

/// Where an allocation can be found.
#[derive(Serialize, Deserialize)]
pub(crate) struct Shared {
    pub(crate) pid: u32,
    /// The allocation's key (gpu::Segment::key), meaningful inside `pid` only.
    handle: (bool, u64),
    pub(crate) bytes: usize,
    /// The Unix socket that hands out the allocation's descriptor to other processes.
    socket: String,
}

/// A published allocation, held weakly: the registry keeps nothing alive.
enum Held {
    Cuda(Weak<Physical>),
    Host(Weak<crate::gpu::host_device::Segment>),
}

impl Held {
    fn of(s: &Segment) -> Held {
        match s {
            Segment::Cuda(p) => Held::Cuda(Arc::downgrade(p)),
            Segment::Host(h) => Held::Host(Arc::downgrade(h)),
        }
    }

    fn upgrade(&self) -> Option<Segment> {
        match self {
            Held::Cuda(w) => w.upgrade().map(Segment::Cuda),
            Held::Host(w) => w.upgrade().map(Segment::Host),
        }
    }

    fn alive(&self) -> bool {
        match self {
            Held::Cuda(w) => w.strong_count() > 0,
            Held::Host(w) => w.strong_count() > 0,
        }
    }
}

/// Allocations of this process's ranks by key, while their owners publish them.
fn registry() -> &'static Mutex<HashMap<(bool, u64), Held>> {
    static M: OnceLock<Mutex<HashMap<(bool, u64), Held>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

impl Shared {
    /// The record of `p`, served by `server`; in-process peers can take `p` until it is dropped.
    pub(crate) fn publish(p: &Segment, server: &FdServer) -> Shared {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p.key(), Held::of(p));
        Shared {
            pid: std::process::id(),
            handle: p.key(),
            bytes: p.bytes(),
            socket: server.path().to_string_lossy().into_owned(),
        }
    }

    /// The allocation `owner` published: the same handle in this process, else imported.
    pub(crate) fn open(&self, gpu: Gpu, owner: usize, what: &str, deadline: Instant) -> Result<Segment> {
        if self.pid == std::process::id() {
            return registry()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&self.handle)
                .and_then(Held::upgrade)
                .ok_or_else(|| Error::PeerLost {
                    op: "new_window",
                    peer: owner,
                    reason: format!("its {what} was released before we mapped it"),
                });
        }
        let fds = fetch_fds(std::path::Path::new(&self.socket), 1, deadline)?;
        gpu.import(&fds[0], self.bytes)
    }
}

/// Drops the registry's entries of allocations no owner holds any more.
pub(crate) fn forget_released() {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|_, w| w.alive());
}
