//! POSIX shared-memory segments: a header page that tells peers who owns the segment and
//! whether the owner is still there, then a payload (a rank's incoming rings, a window's
//! memory and signal pad).

use crate::contracts::error::{Error, Result};
use rustix::fs::Mode;
use rustix::mm::{self, MapFlags, ProtFlags};
use rustix::shm;
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

const MAGIC: u64 = 0x6665_7272_6f63_6f6d; // "ferrocom"
const HEADER_BYTES: usize = 4096;

/// What a segment's owner says about itself; peers read it when they stop making progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OwnerState {
    Live,
    Closed,
    Aborted,
    /// The owner failed because it lost this rank: peers that wait on the owner report the
    /// rank at the root of the failure, not the owner.
    Lost(usize),
}

impl OwnerState {
    fn encode(self) -> u64 {
        match self {
            OwnerState::Live => 0,
            OwnerState::Closed => 1,
            OwnerState::Aborted => 2,
            OwnerState::Lost(r) => 3 + r as u64,
        }
    }

    fn decode(v: u64) -> OwnerState {
        match v {
            0 => OwnerState::Live,
            1 => OwnerState::Closed,
            2 => OwnerState::Aborted,
            r => OwnerState::Lost((r - 3) as usize),
        }
    }
}

#[repr(C)]
struct SegHeader {
    magic: u64,
    payload_len: u64,
    pid: u64,
    state: AtomicU64,
    /// Where the owner mapped the segment, and a random word of it: a peer that reads that word
    /// there through `process_vm_readv` has reached the owner's memory, and may copy messages
    /// straight out of it (pull.rs). Random, so that another process that happens to have the
    /// owner's pid (in another pid namespace) does not pass; 0 (no randomness): none may.
    addr: u64,
    probe: u64,
}

/// A mapping of one segment (ours or a peer's).
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is plain shared memory, owned by this value and unmapped only in Drop;
// concurrent access goes through atomics (header state, ring counters) with the orderings
// documented in ring.rs.
unsafe impl Send for Segment {}
// SAFETY: through `&Segment` the header is only read (fields written before the magic was
// published) or changed atomically (`state`); the payload is handed out as a raw pointer.
unsafe impl Sync for Segment {}

/// `flags` plus O_NOFOLLOW, which glibc's shm_open adds and rustix's does not: a symbolic link
/// planted in /dev/shm under a segment's name is refused, never followed.
fn shm_flags(flags: shm::OFlags) -> shm::OFlags {
    flags | shm::OFlags::from_bits_retain(rustix::fs::OFlags::NOFOLLOW.bits())
}

impl Segment {
    /// Creates and maps a fresh, zeroed segment with `payload_len` bytes of payload, every page
    /// faulted in now (`MAP_POPULATE`).
    pub(crate) fn create(name: &str, payload_len: usize) -> Result<Segment> {
        Self::create_with(name, payload_len, true)
    }

    /// Maps a peer's segment, which must have `payload_len` bytes of payload, every page faulted
    /// in now.
    pub(crate) fn open(name: &str, payload_len: usize) -> Result<Segment> {
        Self::open_with(name, payload_len, true)
    }

    /// As [`create`](Self::create), but only the pages that are used get memory, when they are
    /// first touched or [`populate`](Self::populate)d: the links' segments, which hold a ring
    /// for every sender of which most may never send.
    pub(crate) fn create_sparse(name: &str, payload_len: usize) -> Result<Segment> {
        Self::create_with(name, payload_len, false)
    }

    /// As [`open`](Self::open), without faulting the pages in.
    pub(crate) fn open_sparse(name: &str, payload_len: usize) -> Result<Segment> {
        Self::open_with(name, payload_len, false)
    }

    fn create_with(name: &str, payload_len: usize, populate: bool) -> Result<Segment> {
        let cname = CString::new(name).map_err(|_| Error::Config(format!("bad shm name {name}")))?;
        let len = HEADER_BYTES + payload_len;
        let fd = shm::open(
            cname.as_c_str(),
            shm_flags(shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR),
            Mode::RUSR | Mode::WUSR,
        )
        .map_err(|e| Error::io(format!("shm_open({name}, create)"), e.into()))?;
        if let Err(e) = rustix::fs::ftruncate(&fd, len as u64) {
            // Remove what we created; `fd` closes on return.
            let _ = shm::unlink(cname.as_c_str());
            return Err(Error::io(format!("ftruncate({name}, {len})"), e.into()));
        }
        let seg = Self::map(fd, len, cname, true, populate);
        if let Ok(s) = &seg {
            // SAFETY: the header lies at the start of our fresh, zeroed mapping (at least
            // HEADER_BYTES long, page-aligned) and no peer writes it: peers only read it once
            // they see the magic, which is published last.
            let h = unsafe { &mut *(s.base as *mut SegHeader) };
            h.payload_len = payload_len as u64;
            h.pid = std::process::id() as u64;
            h.addr = s.base as u64;
            let mut word = [0u8; 8];
            h.probe = getrandom::getrandom(&mut word).map_or(0, |()| u64::from_le_bytes(word));
            h.state.store(OwnerState::Live.encode(), Ordering::Relaxed);
            // Release: a peer that sees the magic sees the fields above.
            // SAFETY: `magic` is an aligned u64 inside the mapping, so it may be viewed as an
            // AtomicU64 (same size and alignment); peers read it only atomically.
            unsafe { (*(std::ptr::addr_of!(h.magic) as *const AtomicU64)).store(MAGIC, Ordering::Release) };
        }
        seg
    }

    fn open_with(name: &str, payload_len: usize, populate: bool) -> Result<Segment> {
        let cname = CString::new(name).map_err(|_| Error::Config(format!("bad shm name {name}")))?;
        let fd = shm::open(cname.as_c_str(), shm_flags(shm::OFlags::RDWR), Mode::empty())
            .map_err(|e| Error::io(format!("shm_open({name}, open)"), e.into()))?;
        let len = HEADER_BYTES + payload_len;
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io(format!("fstat({name})"), e.into()))?
            .st_size;
        if size as usize != len {
            return Err(Error::protocol(
                "shm segment",
                format!("{name} has size {size} bytes, expected {len}"),
            ));
        }
        let seg = Self::map(fd, len, cname, false, populate)?;
        // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned, so its first u64
        // (the magic) is a valid AtomicU64; the owner writes it only atomically.
        let magic = unsafe { (*(seg.base as *const AtomicU64)).load(Ordering::Acquire) };
        let h = seg.header();
        if magic != MAGIC || h.payload_len != payload_len as u64 {
            return Err(Error::protocol(
                "shm segment",
                format!("{name} has a foreign or different layout"),
            ));
        }
        Ok(seg)
    }

    /// Maps `len` bytes of the shared-memory object `fd` (closed on return; the mapping keeps
    /// the memory alive).
    fn map(fd: OwnedFd, len: usize, name: CString, owner: bool, populate: bool) -> Result<Segment> {
        // MAP_POPULATE: fault every page in now, at setup, rather than one page at a time in
        // the first operations that touch them (measured: a 128 KiB all_reduce at the start of
        // a bench sweep took 15 us instead of 6). Sparse segments do it per range instead
        // (`populate`), when a range is first used.
        let flags = if populate {
            MapFlags::SHARED | MapFlags::POPULATE
        } else {
            MapFlags::SHARED
        };
        // SAFETY: a null address without MAP_FIXED lets the kernel pick a range that overlaps
        // no existing mapping, so no Rust object is aliased or unmapped; `fd` is an object of
        // `len` bytes (create sized it, open checked its size).
        let p = unsafe {
            mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                flags,
                &fd,
                0,
            )
        };
        drop(fd);
        match p {
            Err(e) => {
                if owner {
                    // Remove the name we just created.
                    let _ = shm::unlink(name.as_c_str());
                }
                Err(Error::io("mmap(shm segment)", e.into()))
            }
            Ok(p) => Ok(Segment {
                base: p.cast(),
                len,
                name,
                owner,
            }),
        }
    }

    fn header(&self) -> &SegHeader {
        // SAFETY: every segment starts with a header page, mapped for as long as `self`; its
        // fields that change after creation (`state`) are atomics, the others are written only
        // before the magic is published.
        unsafe { &*(self.base as *const SegHeader) }
    }

    pub(crate) fn name(&self) -> &str {
        self.name.to_str().unwrap_or("")
    }

    pub(crate) fn owner_pid(&self) -> u32 {
        self.header().pid as u32
    }

    /// Whether this process may copy straight out of the owner's memory (pull.rs): asked once,
    /// by reading the segment's random word where the owner has it.
    pub(crate) fn owner_readable(&self) -> bool {
        let h = self.header();
        let at = h.addr + std::mem::offset_of!(SegHeader, probe) as u64;
        h.probe != 0 && super::pull::probe(self.owner_pid(), at, h.probe)
    }

    pub(crate) fn state(&self) -> OwnerState {
        OwnerState::decode(self.header().state.load(Ordering::Acquire))
    }

    /// Release: everything we wrote into peers' rings before is visible to a peer that reads
    /// the new state.
    pub(crate) fn set_state(&self, s: OwnerState) {
        self.header().state.store(s.encode(), Ordering::Release);
    }

    /// Marks a clean exit, unless the owner already recorded a failure (which peers must keep
    /// seeing: it names the rank at the root).
    pub(crate) fn close(&self) {
        let (live, closed) = (OwnerState::Live.encode(), OwnerState::Closed.encode());
        let _ = self
            .header()
            .state
            .compare_exchange(live, closed, Ordering::Release, Ordering::Relaxed);
    }

    /// Start of the payload (page-aligned).
    pub(crate) fn payload(&self) -> *mut u8 {
        // SAFETY: the mapping is HEADER_BYTES + payload_len long, so the offset stays inside it.
        unsafe { self.base.add(HEADER_BYTES) }
    }

    pub(crate) fn payload_len(&self) -> usize {
        self.len - HEADER_BYTES
    }

    /// Faults in `len` payload bytes from `offset` for writing, all at once (one system call
    /// rather than a fault per page in the operation that first touches them); memory for
    /// pages nobody wrote yet is allocated now. Best effort: where the kernel cannot
    /// (`MADV_POPULATE_WRITE` is Linux 5.14), the pages fault in as they are touched.
    pub(crate) fn populate(&self, offset: usize, len: usize) {
        let page = rustix::param::page_size();
        let start = (HEADER_BYTES + offset) / page * page;
        let end = (HEADER_BYTES + offset + len).min(self.len);
        if end <= start {
            return;
        }
        // SAFETY: [start, end) lies inside our mapping (page-aligned start, end clamped to its
        // length); populating changes no byte of it, only when its pages get memory.
        let _ = unsafe { mm::madvise(self.base.add(start).cast(), end - start, mm::Advice::LinuxPopulateWrite) };
    }

    /// Removes the name; existing mappings stay valid. Called once every peer has mapped us, so
    /// a crash later leaves nothing behind in /dev/shm.
    pub(crate) fn unlink(&self) {
        if self.owner {
            // Our own segment name; a second unlink fails harmlessly (ENOENT).
            let _ = shm::unlink(self.name.as_c_str());
        }
    }
}

/// The sparse segments mapped in this process, by name: ranks that are threads of one process
/// share one mapping of each segment instead of mapping it once each (a thousand ranks would
/// otherwise make a million mappings, past the kernel's limit of 65530 per process).
fn mapped() -> std::sync::MutexGuard<'static, HashMap<CString, Weak<Segment>>> {
    static M: OnceLock<Mutex<HashMap<CString, Weak<Segment>>>> = OnceLock::new();
    M.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

impl Segment {
    /// [`create_sparse`](Self::create_sparse), and known to this process's other ranks by name.
    pub(crate) fn create_shared(name: &str, payload_len: usize) -> Result<Arc<Segment>> {
        let seg = Arc::new(Self::create_sparse(name, payload_len)?);
        mapped().insert(seg.name.clone(), Arc::downgrade(&seg));
        Ok(seg)
    }

    /// The process's mapping of the sparse segment `name` (made by a rank of this process, or
    /// opened by one), else [`open_sparse`](Self::open_sparse).
    pub(crate) fn open_shared(name: &str, payload_len: usize) -> Result<Arc<Segment>> {
        let cname = CString::new(name).map_err(|_| Error::Config(format!("bad shm name {name}")))?;
        if let Some(seg) = mapped().get(&cname).and_then(Weak::upgrade) {
            if seg.payload_len() == payload_len {
                return Ok(seg);
            }
        }
        let seg = Arc::new(Self::open_sparse(name, payload_len)?);
        mapped().insert(cname, Arc::downgrade(&seg));
        Ok(seg)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        {
            let mut m = mapped();
            if m.get(&self.name).is_some_and(|w| w.strong_count() == 0) {
                m.remove(&self.name);
            }
        }
        self.unlink();
        // SAFETY: `base`/`len` are exactly the mapping made in `map`, unmapped only here; the
        // rings and windows that point into it hold the segment (Arc) and are gone by now.
        let _ = unsafe { mm::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments are the CPU backend's inter-process channel: only their owner's uid may map
    /// them. A forked child that drops to another uid must be refused.
    #[test]
    fn a_process_of_another_uid_cannot_open_a_segment() {
        if !rustix::process::geteuid().is_root() {
            println!("SKIPPED a_process_of_another_uid_cannot_open_a_segment: needs root to switch uid");
            return;
        }
        let name = format!("/ferrocomm-uidtest-{}", std::process::id());
        let seg = Segment::create(&name, 4096).unwrap();
        let cname = CString::new(name).unwrap();
        // libc, not rustix, in the child: fork has no safe wrapper, and setuid/setgid must be
        // the process-wide libc calls.
        // SAFETY: after fork the child only makes async-signal-safe calls (setgid, setuid,
        // shm_open, errno, _exit) on data prepared before the fork, and never returns, so
        // forking this multi-threaded test process is sound. The parent only reaps it.
        let pid = unsafe {
            match libc::fork() {
                0 => {
                    let refused = libc::setgid(65534) == 0
                        && libc::setuid(65534) == 0
                        && libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) < 0
                        && *libc::__errno_location() == libc::EACCES;
                    libc::_exit(if refused { 0 } else { 1 });
                }
                pid if pid > 0 => rustix::process::Pid::from_raw(pid).unwrap(),
                _ => panic!("fork failed"),
            }
        };
        let status = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
            .unwrap()
            .unwrap()
            .1;
        drop(seg);
        assert_eq!(status.exit_status(), Some(0), "another uid could open the segment");
    }
}
