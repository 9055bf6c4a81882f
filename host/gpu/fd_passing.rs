//! Passing file descriptors between processes of one host: a GPU rank exports its memory as a
//! POSIX file descriptor (cuMemExportToShareableHandle) and peers in other processes receive it
//! here over a Unix socket with SCM_RIGHTS. Both ends check SO_PEERCRED: a process of another
//! user is refused before any descriptor moves. The socket lives in a fresh 0700 directory.

use crate::bootstrap::accept::accept_until;
use crate::contracts::error::{Error, Result};
use std::io::{Read, Write};
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Most descriptors one message carries.
pub(crate) const MAX_FDS: usize = 16;
/// First byte of the server's answer.
const GRANTED: u8 = 1;
const REFUSED: u8 = 0;

/// The uid of the process at the other end of `sock`.
pub(crate) fn peer_uid(sock: &UnixStream) -> Result<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Error::last_os("getsockopt(SO_PEERCRED)"));
    }
    Ok(cred.uid)
}

fn own_uid() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// A Unix socket that hands a fixed set of descriptors to every client of our own uid.
pub(crate) struct FdServer {
    listener: UnixListener,
    dir: PathBuf,
    path: PathBuf,
}

impl FdServer {
    pub(crate) fn bind() -> Result<FdServer> {
        let base = crate::contracts::config::current()?
            .value_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_dir())
            .unwrap_or_else(std::env::temp_dir);
        let template = base.join("ferrocomm-fd-XXXXXX");
        let mut raw = template.into_os_string().into_encoded_bytes();
        raw.push(0);
        // SAFETY: mkdtemp rewrites the X's of a NUL-terminated template in place; it creates
        // the directory with mode 0700.
        if unsafe { libc::mkdtemp(raw.as_mut_ptr().cast()) }.is_null() {
            return Err(Error::last_os("mkdtemp for the descriptor socket"));
        }
        raw.pop();
        // SAFETY: the bytes came from an OsString and mkdtemp only replaced ASCII X's.
        let dir = PathBuf::from(unsafe { std::ffi::OsString::from_encoded_bytes_unchecked(raw) });
        let path = dir.join("sock");
        let listener = UnixListener::bind(&path).map_err(|e| Error::io(format!("bind {}", path.display()), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("set_nonblocking on the descriptor socket", e))?;
        Ok(FdServer { listener, dir, path })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `fds` to `clients` clients of our uid, then returns. Clients of another uid are
    /// refused and do not count. Fails if the clients have not all come by `deadline`.
    pub(crate) fn serve(&self, fds: &[RawFd], clients: usize, deadline: Instant) -> Result<()> {
        if fds.len() > MAX_FDS {
            return Err(Error::invalid(
                "fd passing",
                format!("{} descriptors exceed {MAX_FDS}", fds.len()),
            ));
        }
        let mut served = 0;
        while served < clients {
            let (mut sock, _) = accept_until(
                || self.listener.accept(),
                deadline,
                "fd passing: serve",
                "accept on the descriptor socket",
            )?;
            let _ = sock.set_nonblocking(false);
            let _ = sock.set_write_timeout(Some(Duration::from_secs(5)));
            if peer_uid(&sock)? != own_uid() {
                let _ = sock.write_all(&[REFUSED]);
                continue;
            }
            send_fds(&sock, fds)?;
            served += 1;
        }
        Ok(())
    }
}

impl Drop for FdServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A message header over one byte (`iov`) and a control buffer of `space` bytes.
fn header(iov: &mut libc::iovec, control: &mut [u64], space: usize) -> libc::msghdr {
    // SAFETY: zeroed msghdr is a valid empty header; we fill the fields we use.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    msg
}

fn send_fds(sock: &UnixStream, fds: &[RawFd]) -> Result<()> {
    let mut byte = [GRANTED];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let msg = header(&mut iov, &mut control, space);
    // SAFETY: the control buffer holds one header of CMSG_LEN(payload) bytes (CMSG_SPACE
    // reserved it); CMSG_FIRSTHDR points into it and CMSG_DATA has room for `fds`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
        if libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) != 1 {
            return Err(Error::last_os("sendmsg(SCM_RIGHTS)"));
        }
    }
    Ok(())
}

/// Connects to the server at `path` (retrying until it exists or `deadline`), checks that it
/// runs as our uid, and receives exactly `count` descriptors.
pub(crate) fn fetch_fds(path: &Path, count: usize, deadline: Instant) -> Result<Vec<OwnedFd>> {
    let ctx = || format!("fetch descriptors from {}", path.display());
    if count == 0 || count > MAX_FDS {
        return Err(Error::invalid(
            "fd passing",
            format!("cannot receive {count} descriptors"),
        ));
    }
    let mut sock = loop {
        match UnixStream::connect(path) {
            Ok(s) => break s,
            Err(e)
                if Instant::now() < deadline && matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ECONNREFUSED)) =>
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(Error::io(ctx(), e)),
        }
    };
    if peer_uid(&sock)? != own_uid() {
        return Err(Error::Auth(format!("{}: the server runs as another user", ctx())));
    }
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    sock.set_read_timeout(Some(left)).map_err(|e| Error::io(ctx(), e))?;

    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut msg = header(&mut iov, &mut control, space);
    // SAFETY: the buffers outlive the call; MSG_CMSG_CLOEXEC keeps received fds private.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(Error::last_os(ctx()));
    }
    // Take ownership of whatever arrived first, so nothing leaks on the error paths below.
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote, within msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 || byte[0] == REFUSED {
        // The refusal byte arrives on its own; a read that ends the stream means the same.
        let mut rest = [0u8; 1];
        let _ = sock.read(&mut rest);
        return Err(Error::Auth(format!("{}: the server refused this process", ctx())));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() != count {
        return Err(Error::protocol(
            "fd passing",
            format!("expected {count} descriptors, received {}", fds.len()),
        ));
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::io::Seek;

    fn memfd_with(text: &[u8]) -> File {
        // SAFETY: memfd_create with a static name; the fd is owned by the File.
        let fd = unsafe { libc::memfd_create(c"ferrocomm-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd is a fresh descriptor we own.
        let mut f = unsafe { File::from_raw_fd(fd) };
        f.write_all(text).unwrap();
        f
    }

    #[test]
    fn descriptors_arrive_and_refer_to_the_same_file() {
        let server = FdServer::bind().unwrap();
        let a = memfd_with(b"first");
        let b = memfd_with(b"second");
        let deadline = Instant::now() + Duration::from_secs(5);
        let path = server.path().to_owned();
        let clients = std::thread::spawn(move || (0..2).map(|_| fetch_fds(&path, 2, deadline)).collect::<Vec<_>>());
        server.serve(&[a.as_raw_fd(), b.as_raw_fd()], 2, deadline).unwrap();
        for got in clients.join().unwrap() {
            let got = got.unwrap();
            for (fd, want) in got.into_iter().zip([&b"first"[..], b"second"]) {
                let mut f = File::from(fd);
                f.rewind().unwrap();
                let mut s = Vec::new();
                f.read_to_end(&mut s).unwrap();
                assert_eq!(s, want);
            }
        }
    }

    #[test]
    fn a_missing_server_times_out_with_an_error() {
        let dir = std::env::temp_dir().join(format!("ferrocomm-nosock-{}", std::process::id()));
        let err = fetch_fds(&dir.join("sock"), 1, Instant::now() + Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }

    #[test]
    fn a_server_nobody_visits_times_out() {
        let server = FdServer::bind().unwrap();
        let f = memfd_with(b"x");
        let err = server
            .serve(&[f.as_raw_fd()], 1, Instant::now() + Duration::from_millis(30))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
    }

    /// A process of another uid gets no descriptor (needs root to switch uid; skipped otherwise).
    #[test]
    fn a_client_of_another_uid_is_refused() {
        if own_uid() != 0 {
            eprintln!("SKIPPED: needs root to run a client as another user");
            return;
        }
        let server = FdServer::bind().unwrap();
        // The client (uid 65534) must be able to reach the socket to be refused by the check
        // rather than by file permissions.
        use std::os::unix::fs::PermissionsExt;
        let dir = server.path().parent().unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(server.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let f = memfd_with(b"secret");
        let path = std::ffi::CString::new(server.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: the child only makes async-signal-safe calls (setuid, socket, connect, read,
        // _exit) before it exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe {
                if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    libc::_exit(3);
                }
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as _;
                for (i, b) in path.as_bytes().iter().enumerate() {
                    addr.sun_path[i] = *b as _;
                }
                if libc::connect(
                    s,
                    (&addr as *const libc::sockaddr_un).cast(),
                    size_of::<libc::sockaddr_un>() as _,
                ) != 0
                {
                    libc::_exit(4);
                }
                let mut b = [9u8; 1];
                let n = libc::read(s, b.as_mut_ptr().cast(), 1);
                // Exit 0 only if the server answered with the refusal byte.
                libc::_exit(if n == 1 && b[0] == REFUSED { 0 } else { 5 });
            }
        }
        // The refused client does not count: the server is still waiting for one of ours.
        let err = server
            .serve(&[f.as_raw_fd()], 1, Instant::now() + Duration::from_millis(500))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "client did not exit normally");
        assert_eq!(libc::WEXITSTATUS(status), 0, "client was not refused (exit code)");
    }
}
