//! Window memory of the host device, shared the way cuMem allocations are on a GPU: each
//! rank's segment is an anonymous shared file (memfd); ranks of one process share the very
//! segment, ranks in other processes receive its descriptor (gpu/fd_passing.rs) and map it;
//! every rank maps the segments of its host side by side, segment r at `base + r * stride`.

use crate::contracts::error::{Error, Result};
use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags};
use rustix::mm::{self, MapFlags, ProtFlags};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

fn os_error(call: &str, e: rustix::io::Errno) -> Error {
    Error::Backend {
        backend: "host device".into(),
        call: call.into(),
        message: std::io::Error::from(e).to_string(),
    }
}

fn page() -> usize {
    rustix::param::page_size().max(4096)
}

/// One rank's segment: `bytes` of zeroed shared memory.
pub(crate) struct Segment {
    fd: OwnedFd,
    bytes: usize,
    /// A value naming the segment inside this process (the registry of in-process peers).
    id: u64,
}

impl Segment {
    pub(crate) fn create(bytes: usize) -> Result<Arc<Segment>> {
        let bytes = bytes.max(1).next_multiple_of(page());
        let fd = memfd_create("ferrocomm-window", MemfdFlags::CLOEXEC).map_err(|e| os_error("memfd_create", e))?;
        ftruncate(&fd, bytes as u64).map_err(|e| os_error("ftruncate", e))?;
        Ok(Self::adopt(fd, bytes))
    }

    fn adopt(fd: OwnedFd, bytes: usize) -> Arc<Segment> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Segment {
            fd,
            bytes,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// A descriptor for another process.
    pub(crate) fn export(&self) -> Result<OwnedFd> {
        self.fd.try_clone().map_err(|e| Error::Backend {
            backend: "host device".into(),
            call: "dup".into(),
            message: e.to_string(),
        })
    }

    /// A peer's segment received as a descriptor; it must hold at least `bytes`.
    pub(crate) fn import(fd: OwnedFd, bytes: usize) -> Result<Arc<Segment>> {
        let st = fstat(&fd).map_err(|e| os_error("fstat", e))?;
        if (st.st_size as u64) < bytes as u64 {
            return Err(Error::invalid(
                "new_window",
                format!("a peer's segment has {} bytes, its record says {bytes}", st.st_size),
            ));
        }
        Ok(Self::adopt(fd, bytes))
    }
}

/// The segments of this host's ranks mapped side by side; ranks elsewhere leave their slot
/// unmapped (inaccessible).
pub(crate) struct SegmentMap {
    base: *mut u8,
    stride: usize,
    ranks: usize,
    mapped: Vec<bool>,
    _segments: Vec<Option<Arc<Segment>>>,
}

// SAFETY: the mapping is plain shared memory owned by this value (unmapped only in Drop); the
// value itself hands out addresses, never references, and kernels access them by address.
unsafe impl Send for SegmentMap {}
// SAFETY: `&SegmentMap` only reads the immutable fields (base, stride, mapped), so sharing it
// between threads races on nothing.
unsafe impl Sync for SegmentMap {}

impl SegmentMap {
    pub(crate) fn new(segments: Vec<Option<Arc<Segment>>>) -> Result<SegmentMap> {
        let ranks = segments.len();
        let stride = segments
            .iter()
            .flatten()
            .map(|s| s.bytes)
            .max()
            .unwrap_or(0)
            .max(page());
        let total = stride
            .checked_mul(ranks.max(1))
            .ok_or_else(|| Error::invalid("new_window", "segments too large to map side by side"))?;
        // One reservation, then each segment over its slot: the layout the handle promises.
        // SAFETY: a null address without MAP_FIXED: the kernel picks a fresh range that
        // overlaps no existing mapping; PROT_NONE, so nothing can touch it yet.
        let base = unsafe {
            mm::mmap_anonymous(
                std::ptr::null_mut(),
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| os_error("mmap (reserve)", e))?;
        let mut map = SegmentMap {
            base: base.cast(),
            stride,
            ranks,
            mapped: segments.iter().map(Option::is_some).collect(),
            _segments: Vec::new(),
        };
        for (r, seg) in segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            // SAFETY: slot r, [base + r * stride, + seg.bytes), lies inside our reservation
            // (seg.bytes <= stride, r < ranks), which only this value owns and nothing has
            // accessed yet, so MAP_FIXED replaces only reserved, unused pages. The pointer
            // arithmetic stays inside the reservation.
            unsafe {
                mm::mmap(
                    map.base.add(r * stride).cast(),
                    seg.bytes,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::SHARED | MapFlags::FIXED,
                    &seg.fd,
                    0,
                )
            }
            .map_err(|e| os_error("mmap (segment)", e))?;
        }
        map._segments = segments;
        Ok(map)
    }

    pub(crate) fn base(&self) -> u64 {
        self.base as u64
    }

    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    pub(crate) fn is_mapped(&self, rank: usize) -> bool {
        self.mapped.get(rank).copied().unwrap_or(false)
    }

    /// Byte `offset` of `rank`'s segment.
    pub(crate) fn addr(&self, rank: usize, offset: usize) -> u64 {
        self.base() + (rank * self.stride + offset) as u64
    }
}

impl Drop for SegmentMap {
    fn drop(&mut self) {
        // SAFETY: exactly our reservation (its base and `total` length from `new`), unmapped
        // only here; no kernel uses it once the window is dropped.
        let _ = unsafe { mm::munmap(self.base.cast(), self.stride * self.ranks.max(1)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_appear_side_by_side_and_share_their_bytes() {
        let a = Segment::create(5000).unwrap();
        let b = Segment::create(5000).unwrap();
        let m1 = SegmentMap::new(vec![Some(a.clone()), Some(b.clone())]).unwrap();
        // A second mapping of b alone (as another process would through an exported descriptor).
        let b2 = Segment::import(b.export().unwrap(), b.bytes()).unwrap();
        let m2 = SegmentMap::new(vec![None, Some(b2)]).unwrap();
        assert!(m1.is_mapped(0) && m1.is_mapped(1) && !m2.is_mapped(0));
        assert_eq!(m1.addr(1, 0) - m1.base(), m1.stride() as u64);
        // SAFETY: both addresses are inside mapped segments.
        unsafe {
            *(m1.addr(1, 4096) as *mut u64) = 0xfeed;
            assert_eq!(*(m2.addr(1, 4096) as *const u64), 0xfeed);
            assert_eq!(*(m1.addr(0, 4096) as *const u64), 0, "fresh segments read zero");
        }
    }

    #[test]
    fn a_descriptor_smaller_than_its_record_is_refused() {
        let a = Segment::create(4096).unwrap();
        assert!(Segment::import(a.export().unwrap(), 1 << 20).is_err());
    }
}
