//! Window memory of the host device, shared the way cuMem allocations are on a GPU: each
//! rank's segment is an anonymous shared file (memfd); ranks of one process share the very
//! segment, ranks in other processes receive its descriptor (gpu/fd_passing.rs) and map it;
//! every rank maps the segments of its host side by side, segment r at `base + r * stride`.

use crate::contracts::error::{Error, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

fn os_error(call: &str) -> Error {
    Error::Backend {
        backend: "host device".into(),
        call: call.into(),
        message: std::io::Error::last_os_error().to_string(),
    }
}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(4096)
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
        // SAFETY: a static NUL-terminated name; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"ferrocomm-window".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor; the length fits off_t for any allocation we could map.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
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
        // SAFETY: fstat fills the struct for a valid descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat"));
        }
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

// SAFETY: the mapping is plain shared memory owned by this value; accesses are by address.
unsafe impl Send for SegmentMap {}
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
        // SAFETY: a fresh anonymous reservation, no access.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_error("mmap (reserve)"));
        }
        let mut map = SegmentMap {
            base: base.cast(),
            stride,
            ranks,
            mapped: segments.iter().map(Option::is_some).collect(),
            _segments: Vec::new(),
        };
        for (r, seg) in segments.iter().enumerate() {
            let Some(seg) = seg else { continue };
            // SAFETY: the slot lies inside our reservation; MAP_FIXED replaces only it.
            let at = unsafe {
                libc::mmap(
                    map.base.add(r * stride).cast(),
                    seg.bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    seg.fd.as_raw_fd(),
                    0,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(os_error("mmap (segment)"));
            }
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
        // SAFETY: our reservation, whole; no kernel uses it once the window is dropped.
        unsafe { libc::munmap(self.base.cast(), self.stride * self.ranks.max(1)) };
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
