//! Is a peer process still running? A pidfd answers without races on pid reuse and sees a
//! process as gone as soon as it exits, even before its parent reaps it.

/// A handle on a peer process, opened while the peer is known to be alive.
pub(crate) struct ProcessWatch {
    pidfd: libc::c_int,
    pid: u32,
}

impl ProcessWatch {
    /// `None` for our own process (threads of one process share its fate).
    pub(crate) fn open(pid: u32) -> Option<ProcessWatch> {
        if pid == std::process::id() {
            return None;
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as libc::c_int;
        Some(ProcessWatch { pidfd: fd, pid })
    }

    pub(crate) fn is_alive(&self) -> bool {
        if self.pidfd < 0 {
            // No pidfd (old kernel): fall back to probing the pid.
            // SAFETY: signal 0 only checks for existence.
            return unsafe { libc::kill(self.pid as libc::pid_t, 0) } == 0;
        }
        let mut p = libc::pollfd {
            fd: self.pidfd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        !(r > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }
}

impl Drop for ProcessWatch {
    fn drop(&mut self) {
        if self.pidfd >= 0 {
            // SAFETY: our own fd.
            unsafe { libc::close(self.pidfd) };
        }
    }
}
