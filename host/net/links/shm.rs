//! POSIX shared-memory segments: a header page that tells peers who owns the segment and
//! whether the owner is still there, then a payload (a rank's incoming rings, a window's
//! memory and signal pad).

use crate::contracts::error::{Error, Result};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

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
}

/// A mapping of one segment (ours or a peer's).
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    name: CString,
    owner: bool,
}

// SAFETY: the mapping is plain shared memory; concurrent access goes through atomics (header
// state, ring counters) with the orderings documented in ring.rs.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and maps a fresh, zeroed segment with `payload_len` bytes of payload.
    pub(crate) fn create(name: &str, payload_len: usize) -> Result<Segment> {
        let cname = CString::new(name).map_err(|_| Error::Config(format!("bad shm name {name}")))?;
        let len = HEADER_BYTES + payload_len;
        // SAFETY: plain libc calls with a valid C string; the fd is closed on every path.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600) };
        if fd < 0 {
            return Err(Error::last_os(format!("shm_open({name}, create)")));
        }
        // SAFETY: `fd` is ours.
        let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        if r != 0 {
            let e = Error::last_os(format!("ftruncate({name}, {len})"));
            // SAFETY: cleaning up what we created.
            unsafe {
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
            }
            return Err(e);
        }
        let seg = Self::map(fd, len, cname, true);
        if let Ok(s) = &seg {
            // SAFETY: the header lies at the start of our fresh, zeroed mapping.
            let h = unsafe { &mut *(s.base as *mut SegHeader) };
            h.payload_len = payload_len as u64;
            h.pid = std::process::id() as u64;
            h.state.store(OwnerState::Live.encode(), Ordering::Relaxed);
            // Release: a peer that sees the magic sees the fields above.
            // SAFETY: same header, viewed as an atomic to publish.
            unsafe { (*(std::ptr::addr_of!(h.magic) as *const AtomicU64)).store(MAGIC, Ordering::Release) };
        }
        seg
    }

    /// Maps a peer's segment, which must have `payload_len` bytes of payload.
    pub(crate) fn open(name: &str, payload_len: usize) -> Result<Segment> {
        let cname = CString::new(name).map_err(|_| Error::Config(format!("bad shm name {name}")))?;
        // SAFETY: plain libc call with a valid C string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(Error::last_os(format!("shm_open({name}, open)")));
        }
        let len = HEADER_BYTES + payload_len;
        // SAFETY: fstat into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_size as usize) != len {
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(Error::protocol(
                "shm segment",
                format!("{name} has size {} bytes, expected {len}", st.st_size),
            ));
        }
        let seg = Self::map(fd, len, cname, false)?;
        // SAFETY: the mapping is at least HEADER_BYTES long.
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

    fn map(fd: libc::c_int, len: usize, name: CString, owner: bool) -> Result<Segment> {
        // MAP_POPULATE: fault every page in now, at setup, rather than one page at a time in
        // the first operations that touch them (measured: a 128 KiB all_reduce at the start of
        // a bench sweep took 15 us instead of 6).
        // SAFETY: mapping a shared-memory fd of at least `len` bytes; the fd is closed after.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                0,
            )
        };
        let err = (p == libc::MAP_FAILED).then(|| Error::last_os("mmap(shm segment)"));
        // SAFETY: our fd; the mapping keeps the memory alive.
        unsafe { libc::close(fd) };
        match err {
            Some(e) => {
                if owner {
                    // SAFETY: removing the name we just created.
                    unsafe { libc::shm_unlink(name.as_ptr()) };
                }
                Err(e)
            }
            None => Ok(Segment {
                base: p.cast(),
                len,
                name,
                owner,
            }),
        }
    }

    fn header(&self) -> &SegHeader {
        // SAFETY: every segment starts with a header page.
        unsafe { &*(self.base as *const SegHeader) }
    }

    pub(crate) fn name(&self) -> &str {
        self.name.to_str().unwrap_or("")
    }

    pub(crate) fn owner_pid(&self) -> u32 {
        self.header().pid as u32
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
        // SAFETY: the mapping is HEADER_BYTES + payload_len long.
        unsafe { self.base.add(HEADER_BYTES) }
    }

    pub(crate) fn payload_len(&self) -> usize {
        self.len - HEADER_BYTES
    }

    /// Removes the name; existing mappings stay valid. Called once every peer has mapped us, so
    /// a crash later leaves nothing behind in /dev/shm.
    pub(crate) fn unlink(&self) {
        if self.owner {
            // SAFETY: our own segment name.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: unmapping our own mapping; nothing refers to it after the owner is dropped.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments are the CPU backend's inter-process channel: only their owner's uid may map
    /// them. A forked child that drops to another uid must be refused.
    #[test]
    fn a_process_of_another_uid_cannot_open_a_segment() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIPPED a_process_of_another_uid_cannot_open_a_segment: needs root to switch uid");
            return;
        }
        let name = format!("/ferrocomm-uidtest-{}", std::process::id());
        let seg = Segment::create(&name, 4096).unwrap();
        let cname = CString::new(name).unwrap();
        // After fork the child only makes system calls (no allocation), so forking a
        // multi-threaded test process is safe here.
        // SAFETY: fork/setuid/shm_open/_exit on prepared data; the parent reaps the child.
        let status = unsafe {
            match libc::fork() {
                0 => {
                    let refused = libc::setgid(65534) == 0
                        && libc::setuid(65534) == 0
                        && libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) < 0
                        && *libc::__errno_location() == libc::EACCES;
                    libc::_exit(if refused { 0 } else { 1 });
                }
                pid if pid > 0 => {
                    let mut st = 0;
                    libc::waitpid(pid, &mut st, 0);
                    st
                }
                _ => panic!("fork failed"),
            }
        };
        drop(seg);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "another uid could open the segment"
        );
    }
}
