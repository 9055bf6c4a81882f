//! What the ranks of a device communicator agree on about their GPUs when it is made: whether
//! NCCL joins (every rank loads it and has a GPU of its own: NCCL refuses shared GPUs), whether
//! they all share one host (the backend's own collective kernels load and store to every peer)
//! and whether windows get a multicast object (every rank on one host, on a GPU of its own that
//! supports multicast: a multicast object binds one segment per device). Each rank publishes what it knows
//! through the store and derives the answer from the same table as every other rank, so no
//! rank waits in an NCCL init or a multicast bind that a peer skips.

use crate::contracts::backend::BackendInit;
use crate::contracts::error::Result;
use crate::gpu::target::Gpu;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

#[derive(Serialize, Deserialize)]
struct Record {
    /// The GPU's UUID (ordinals differ between processes with different CUDA_VISIBLE_DEVICES),
    /// or why it could not be read.
    gpu: std::result::Result<String, String>,
    /// transport::host_identity: a multicast object spans one host's GPUs only.
    host: String,
    /// With `host`, which ranks run in one process.
    pid: u32,
    nccl: std::result::Result<(), String>,
    multicast: std::result::Result<(), String>,
}

/// The team's answers; an `Err` says why not (for the debug log).
pub(crate) struct Team {
    /// Every rank is on this host: the backend's own collective kernels reach every peer.
    pub(crate) one_host: std::result::Result<(), String>,
    pub(crate) nccl: std::result::Result<(), String>,
    pub(crate) multicast: std::result::Result<(), String>,
    /// Per rank: another rank of its process runs on its GPU. Such ranks need a stream each:
    /// kernels that wait for each other cannot share one.
    pub(crate) gpu_shared_in_process: Vec<bool>,
}

pub(crate) fn agree(init: &BackendInit, gpu: Gpu) -> Result<Team> {
    let Gpu::Cuda(ordinal) = gpu else {
        // The host device: no GPU of its own, so no NCCL and no multicast.
        let mine = Record {
            gpu: Err("the host device".into()),
            host: crate::net::links::host_identity(init.rank, &init.options.transport),
            pid: std::process::id(),
            nccl: Err("the host device has no NCCL".into()),
            multicast: Err("the host device has no multicast objects".into()),
        };
        return gather(init, mine);
    };
    let mine = Record {
        gpu: gpu_identity(ordinal),
        host: crate::net::links::host_identity(init.rank, &init.options.transport),
        pid: std::process::id(),
        nccl: match init.options.config.nccl {
            false => Err("disabled by FERROCOMM_NCCL=0".into()),
            true => crate::gpu::nccl_library::nccl().map(drop).map_err(|e| e.to_string()),
        },
        multicast: match init.options.config.multicast {
            false => Err("disabled by FERROCOMM_MULTICAST=0".into()),
            true => match crate::gpu::memory::multicast_supported(ordinal) {
                Ok(true) => Ok(()),
                Ok(false) => Err(format!("GPU {ordinal} does not support multicast objects")),
                Err(e) => Err(e.to_string()),
            },
        },
    };
    gather(init, mine)
}

fn gather(init: &BackendInit, mine: Record) -> Result<Team> {
    let records = crate::bootstrap::all_gather_records(
        &*init.store,
        "device/team",
        init.rank,
        init.size,
        &mine,
        "device team",
        init.options.timeout,
    )?;
    Ok(decide(&records))
}

fn decide(records: &[Record]) -> Team {
    let own_gpus = own_gpus(records);
    let every = |what: &str, pick: fn(&Record) -> &std::result::Result<(), String>| {
        own_gpus.clone()?;
        records.iter().enumerate().try_for_each(|(r, rec)| {
            pick(rec)
                .clone()
                .map_err(|why| format!("rank {r} has no {what}: {why}"))
        })
    };
    let one_host = match records.iter().position(|r| r.host != records[0].host) {
        Some(r) => Err(format!("rank {r} is on another host than rank 0")),
        None => Ok(()),
    };
    let same_gpu_and_process = |a: &Record, b: &Record| {
        a.host == b.host && a.pid == b.pid && a.gpu.is_ok() && a.gpu.as_ref().ok() == b.gpu.as_ref().ok()
    };
    let gpu_shared_in_process = records
        .iter()
        .enumerate()
        .map(|(r, rec)| {
            records
                .iter()
                .enumerate()
                .any(|(q, other)| q != r && same_gpu_and_process(rec, other))
        })
        .collect();
    Team {
        nccl: every("NCCL", |r| &r.nccl),
        multicast: one_host.clone().and_then(|()| every("multicast", |r| &r.multicast)),
        one_host,
        gpu_shared_in_process,
    }
}

/// Ok when every rank named its GPU and no two ranks share one.
fn own_gpus(records: &[Record]) -> std::result::Result<(), String> {
    let mut seen = HashMap::new();
    for (r, rec) in records.iter().enumerate() {
        let id = rec.gpu.as_ref().map_err(|why| format!("rank {r}: {why}"))?;
        if let Some(q) = seen.insert(id.clone(), r) {
            return Err(format!("ranks {q} and {r} share a GPU"));
        }
    }
    Ok(())
}

fn gpu_identity(ordinal: usize) -> std::result::Result<String, String> {
    let ctx = crate::gpu::cuda::context(ordinal).map_err(|e| e.to_string())?;
    let uuid = ctx.uuid().map_err(crate::gpu::cuda::describe)?;
    Ok(uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(gpu: &str, nccl: bool, multicast: bool) -> Record {
        let yes_or = |ok: bool, why: &str| if ok { Ok(()) } else { Err(why.to_string()) };
        Record {
            gpu: Ok(gpu.into()),
            host: "h".into(),
            pid: 1,
            nccl: yes_or(nccl, "no libnccl"),
            multicast: yes_or(multicast, "unsupported"),
        }
    }

    #[test]
    fn every_rank_needs_its_own_gpu_and_the_feature() {
        let t = decide(&[rec("a", true, true), rec("b", true, true)]);
        assert!(t.nccl.is_ok() && t.multicast.is_ok());

        let t = decide(&[rec("a", true, true), rec("a", true, true)]);
        assert_eq!(t.nccl.unwrap_err(), "ranks 0 and 1 share a GPU");
        assert!(t.multicast.is_err());

        let t = decide(&[rec("a", true, true), rec("b", false, true), rec("c", true, false)]);
        assert_eq!(t.nccl.unwrap_err(), "rank 1 has no NCCL: no libnccl");
        assert_eq!(t.multicast.unwrap_err(), "rank 2 has no multicast: unsupported");

        let mut lost = rec("a", true, true);
        lost.gpu = Err("no context".into());
        assert_eq!(decide(&[lost]).multicast.unwrap_err(), "rank 0: no context");
        // One rank on its own GPU is a team (multicast over one device is allowed).
        assert!(decide(&[rec("a", true, true)]).multicast.is_ok());

        // Multicast objects do not cross hosts; NCCL does.
        let mut far = rec("b", true, true);
        far.host = "other".into();
        let t = decide(&[rec("a", true, true), far]);
        assert!(t.nccl.is_ok());
        assert_eq!(t.multicast.unwrap_err(), "rank 1 is on another host than rank 0");
        assert!(t.one_host.is_err());
    }

    #[test]
    fn ranks_of_one_process_on_one_gpu_are_told_apart_from_other_processes() {
        let other_process = Record {
            pid: 2,
            ..rec("a", true, true)
        };
        let t = decide(&[
            rec("a", true, true),
            rec("a", true, true),
            other_process,
            rec("b", true, true),
        ]);
        assert_eq!(t.gpu_shared_in_process, [true, true, false, false]);
    }
}
