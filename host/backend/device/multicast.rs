//! A window's multicast object (where the team agreed it can have one, team.rs): rank 0
//! creates it; every rank imports it (in rank 0's process the handle itself, elsewhere a
//! descriptor over a Unix socket), adds its GPU, then binds its segment and maps the object.
//! Multicast only speeds things up, so a failure anywhere leaves every rank without it and
//! the window works on by unicast; the ranks agree on each step's outcome through the store,
//! so none blocks in a bind that waits for a GPU its peer never added.

use super::rank::DeviceRank;
use crate::bootstrap::PrefixStore;
use crate::contracts::error::{Error, Result};
use crate::contracts::record;
use crate::contracts::store::Store;
use crate::gpu::fd_passing::FdServer;
use crate::gpu::memory::{multicast, MulticastMap, Physical};
use crate::gpu::segment_sharing::Shared;
use crate::gpu::target::{Gpu, Segment};
use serde::{Deserialize, Serialize};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Outcome = std::result::Result<(), String>;

/// Where rank 0's multicast object can be found, or why there is none.
#[derive(Serialize, Deserialize)]
struct Published {
    object: std::result::Result<Shared, String>,
}

/// Binds `own` into a multicast object shared by the window's ranks (`pids[r]`: rank r's
/// process) and maps it; `None` when some rank could not (logged at debug level). `g` is the
/// multicast granularity `own`'s size is a multiple of.
pub(super) fn join(
    b: &DeviceRank,
    window_id: u64,
    own: &Arc<Physical>,
    pids: &[u32],
    g: usize,
    timeout: Duration,
) -> Result<Option<MulticastMap>> {
    let store = PrefixStore::new(format!("dwindow{window_id}/multicast"), b.store.clone());
    let deadline = Instant::now() + timeout;
    let mc: std::result::Result<Arc<Physical>, String> = if b.rank == 0 {
        // Without an object every rank reads why in the record and stops here, as we do.
        match create(&store, b.size, own, pids, deadline)? {
            Some(mc) => Ok(mc),
            None => return Ok(None),
        }
    } else {
        let raw = store.get("object", timeout)?;
        let record: Published =
            record::decode(&raw).map_err(|e| Error::protocol("new_window", format!("multicast record: {e}")))?;
        match record.object {
            // Rank 0 keeps its object alive until every rank agreed it was added.
            Ok(object) => object
                .open(Gpu::Cuda(b.ordinal), 0, "multicast object", deadline)
                .and_then(|s| {
                    s.physical()
                        .cloned()
                        .ok_or_else(|| Error::invalid("new_window", "a multicast object that is not a GPU allocation"))
                })
                .map_err(|e| e.to_string()),
            Err(why) => {
                tracing::debug!(reason = %why, "window without multicast: rank 0 could not create it");
                return Ok(None);
            }
        }
    };
    let added = mc
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|mc| multicast::add_device(mc, b.ordinal).map_err(|e| e.to_string()));
    if let Err(why) = agree(&store, "added", b, added, timeout)? {
        tracing::debug!(reason = %why, "window without multicast");
        return Ok(None);
    }
    // Our own failure would have failed the agreement.
    let Ok(mc) = mc else { return Ok(None) };
    let map = MulticastMap::new(b.ordinal, mc, own.clone(), g);
    let bound = map.as_ref().map(drop).map_err(|e| e.to_string());
    if let Err(why) = agree(&store, "bound", b, bound, timeout)? {
        tracing::debug!(reason = %why, "window without multicast");
        return Ok(None);
    }
    Ok(map.ok())
}

/// Rank 0 makes the object and publishes where to find it (or why there is none: then `None`),
/// then hands its descriptor to the ranks of other processes.
fn create(
    store: &dyn Store,
    devices: usize,
    own: &Physical,
    pids: &[u32],
    deadline: Instant,
) -> Result<Option<Arc<Physical>>> {
    let me = std::process::id();
    let server = FdServer::bind()?;
    let clients = pids.iter().filter(|&&p| p != me).count();
    let made = multicast::create(devices, own.bytes()).and_then(|mc| {
        let fd = if clients > 0 { Some(mc.export()?) } else { None };
        Ok((mc, fd))
    });
    let object = match &made {
        Ok((mc, _)) => Ok(Shared::publish(&Segment::Cuda(mc.clone()), &server)),
        Err(e) => Err(e.to_string()),
    };
    store.set("object", &encode(&Published { object })?)?;
    let Ok((mc, fd)) = made else { return Ok(None) };
    if let Some(fd) = fd {
        // A client that never fetches reports so in the next agreement (or is gone, which
        // that agreement's timeout reports): here it only ends the serving.
        if let Err(e) = server.serve(&[fd.as_fd()], clients, deadline) {
            tracing::debug!("handing out a multicast object: {e}");
        }
    }
    Ok(Some(mc))
}

/// Every rank's outcome of one step: Ok when all succeeded, else the first rank's reason.
fn agree(store: &dyn Store, step: &str, b: &DeviceRank, mine: Outcome, timeout: Duration) -> Result<Outcome> {
    let all = crate::bootstrap::all_gather_records(store, step, b.rank, b.size, &mine, "new_window", timeout)?;
    Ok(
        match all
            .into_iter()
            .enumerate()
            .find_map(|(r, o)| o.err().map(|why| (r, why)))
        {
            Some((r, why)) => Err(format!("rank {r}: {why}")),
            None => Ok(()),
        },
    )
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    record::encode(v).map_err(|e| Error::protocol("new_window", e))
}
