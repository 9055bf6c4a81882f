//! Passing file descriptors between processes of one host: a GPU rank exports its memory as a
//! POSIX file descriptor (cuMemExportToShareableHandle) and peers in other processes receive it
//! here over a Unix socket with SCM_RIGHTS. Both ends check SO_PEERCRED: a process of another
//! user is refused before any descriptor moves. The socket lives in a fresh 0700 directory.

use crate::bootstrap::accept::accept_until;
use crate::contracts::error::{Error, Result};
use rustix::net::sockopt::socket_peercred;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
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
    socket_peercred(sock)
        .map(|cred| cred.uid.as_raw())
        .map_err(|e| Error::io("getsockopt(SO_PEERCRED)", e.into()))
}

fn own_uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// mkdtemp(3) without libc: `base/prefix` plus six random characters, made with mode 0700 by
/// one mkdir, which fails if the name exists, so nobody can have claimed or planted it first.
/// A name taken already is drawn again, as mkdtemp does.
pub(crate) fn private_dir(base: &Path, prefix: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    const LETTERS: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut tries = 0;
    loop {
        let random = crate::bootstrap::nonce().map_err(|e| std::io::Error::other(e.to_string()))?;
        let suffix: String = random[..6]
            .iter()
            .map(|&b| LETTERS[b as usize % LETTERS.len()] as char)
            .collect();
        let dir = base.join(format!("{prefix}{suffix}"));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 100 => tries += 1,
            made => return made.map(|()| dir),
        }
    }
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
        let dir = private_dir(&base, "ferrocomm-fd-").map_err(|e| Error::io("mkdtemp for the descriptor socket", e))?;
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
    pub(crate) fn serve(&self, fds: &[BorrowedFd<'_>], clients: usize, deadline: Instant) -> Result<()> {
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

fn send_fds(sock: &UnixStream, fds: &[BorrowedFd<'_>]) -> Result<()> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    // `serve` checked fds.len() <= MAX_FDS, for which the buffer has room.
    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Error::invalid(
            "fd passing",
            format!("{} descriptors exceed {MAX_FDS}", fds.len()),
        ));
    }
    match sendmsg(sock, &[IoSlice::new(&[GRANTED])], &mut control, SendFlags::NOSIGNAL) {
        Ok(1) => Ok(()),
        Ok(_) => Err(Error::io("sendmsg(SCM_RIGHTS)", std::io::ErrorKind::WriteZero.into())),
        Err(e) => Err(Error::io("sendmsg(SCM_RIGHTS)", e.into())),
    }
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
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) =>
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
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    // MSG_CMSG_CLOEXEC keeps received fds private to this process.
    let msg = recvmsg(
        &sock,
        &mut [IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| Error::io(ctx(), e.into()))?;
    let n = msg.bytes;
    // Take ownership of whatever arrived first, so nothing leaks on the error paths below.
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    if n == 0 || byte[0] == REFUSED {
        // The refusal byte arrives on its own; a read that ends the stream means the same.
        let mut rest = [0u8; 1];
        let _ = sock.read(&mut rest);
        return Err(Error::Auth(format!("{}: the server refused this process", ctx())));
    }
    if msg.flags.contains(ReturnFlags::CTRUNC) || fds.len() != count {
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
    use std::os::fd::AsFd;

    fn memfd_with(text: &[u8]) -> File {
        let fd = rustix::fs::memfd_create("ferrocomm-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = File::from(fd);
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
        server.serve(&[a.as_fd(), b.as_fd()], 2, deadline).unwrap();
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
    fn the_most_descriptors_a_message_carries_all_arrive() {
        let server = FdServer::bind().unwrap();
        let files: Vec<File> = (0..MAX_FDS)
            .map(|i| memfd_with(format!("file {i}").as_bytes()))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let path = server.path().to_owned();
        let client = std::thread::spawn(move || fetch_fds(&path, MAX_FDS, deadline));
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        server.serve(&fds, 1, deadline).unwrap();
        let got = client.join().unwrap().unwrap();
        assert_eq!(got.len(), MAX_FDS);
        for (i, fd) in got.into_iter().enumerate() {
            let mut f = File::from(fd);
            f.rewind().unwrap();
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap();
            assert_eq!(s, format!("file {i}"));
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
            .serve(&[f.as_fd()], 1, Instant::now() + Duration::from_millis(30))
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
        // libc, not rustix, in the child: fork has no safe wrapper, and setuid/setgid must be
        // the process-wide libc calls.
        // SAFETY: after fork the child only makes async-signal-safe calls (setgid, setuid,
        // socket, connect, read, _exit) on data prepared before the fork, and never returns, so
        // forking this multi-threaded test process is sound.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: as above, in the forked child. `addr` is a zeroed sockaddr_un (all-zero is
            // a valid value), filled by bounds-checked indexing, and passed with its own size;
            // read writes at most 1 byte into the 1-byte local buffer.
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
            .serve(&[f.as_fd()], 1, Instant::now() + Duration::from_millis(500))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let pid = rustix::process::Pid::from_raw(pid).unwrap();
        let (_, status) = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
            .unwrap()
            .unwrap();
        assert!(status.exited(), "client did not exit normally");
        assert_eq!(status.exit_status(), Some(0), "client was not refused (exit code)");
    }
}
