//! How a rank hands a GPU allocation (its window segment, or rank 0's multicast object) to its
//! peers: it publishes a [`Shared`] record through the store. A peer in the same process takes
//! the very same handle from this process's registry; a peer in another process fetches a
//! descriptor from the owner's Unix socket (transport::fd_passing, uid-checked) and imports it.

use crate::error::{Error, Result};
use crate::memory::Physical;
use crate::transport::fd_passing::{fetch_fds, FdServer};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

/// Where an allocation can be found.
#[derive(Serialize, Deserialize)]
pub(super) struct Shared {
    pub(super) pid: u32,
    /// The handle's value, meaningful inside `pid` only.
    handle: u64,
    pub(super) bytes: usize,
    /// The Unix socket that hands out the allocation's descriptor to other processes.
    socket: String,
}

/// Allocations of this process's ranks by handle value, while their owners publish them.
fn registry() -> &'static Mutex<HashMap<u64, Weak<Physical>>> {
    static M: OnceLock<Mutex<HashMap<u64, Weak<Physical>>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

impl Shared {
    /// The record of `p`, served by `server`; in-process peers can take `p` until it is dropped.
    pub(super) fn publish(p: &Arc<Physical>, server: &FdServer) -> Shared {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(p.raw_handle(), Arc::downgrade(p));
        Shared {
            pid: std::process::id(),
            handle: p.raw_handle(),
            bytes: p.bytes(),
            socket: server.path().to_string_lossy().into_owned(),
        }
    }

    /// The allocation `owner` published: the same handle in this process, else imported.
    pub(super) fn open(&self, owner: usize, what: &str, deadline: Instant) -> Result<Arc<Physical>> {
        if self.pid == std::process::id() {
            return registry()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&self.handle)
                .and_then(Weak::upgrade)
                .ok_or_else(|| Error::PeerLost {
                    op: "new_window",
                    peer: owner,
                    reason: format!("its {what} was released before we mapped it"),
                });
        }
        let fds = fetch_fds(std::path::Path::new(&self.socket), 1, deadline)?;
        Physical::import(&fds[0], self.bytes)
    }
}

/// Drops the registry's entries of allocations no owner holds any more.
pub(super) fn forget_released() {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|_, w| w.strong_count() > 0);
}
