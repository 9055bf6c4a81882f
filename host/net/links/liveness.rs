//! Is a peer process still running? A pidfd answers without races on pid reuse and sees a
//! process as gone as soon as it exits, even before its parent reaps it.

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, test_kill_process, Pid, PidfdFlags};
use std::os::fd::OwnedFd;

/// A handle on a peer process, opened while the peer is known to be alive.
pub(crate) struct ProcessWatch {
    pidfd: Option<OwnedFd>,
    pid: u32,
}

/// `pid` as the kernel's pid type; `None` for values no process can have.
fn as_pid(pid: u32) -> Option<Pid> {
    i32::try_from(pid).ok().and_then(Pid::from_raw)
}

impl ProcessWatch {
    /// `None` for our own process (threads of one process share its fate).
    pub(crate) fn open(pid: u32) -> Option<ProcessWatch> {
        if pid == std::process::id() {
            return None;
        }
        let pidfd = as_pid(pid).and_then(|p| pidfd_open(p, PidfdFlags::empty()).ok());
        Some(ProcessWatch { pidfd, pid })
    }

    pub(crate) fn is_alive(&self) -> bool {
        let Some(pidfd) = &self.pidfd else {
            // No pidfd (old kernel): fall back to probing the pid with signal 0.
            return as_pid(self.pid).map_or(true, |p| test_kill_process(p).is_ok());
        };
        let mut p = [PollFd::new(pidfd, PollFlags::IN)];
        // Zero timeout: a check, not a wait. A failed poll counts as alive.
        let r = poll(&mut p, Some(&Timespec { tv_sec: 0, tv_nsec: 0 }));
        !(matches!(r, Ok(n) if n > 0)
            && p[0]
                .revents()
                .intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}
