//! The TCP store: a server that holds the job's rendezvous keys and a client for each rank.
//!
//! Every connection starts with mutual challenge-response on the job token (see auth.rs); a
//! client that cannot prove it knows the token is refused before any request is read. Requests
//! and replies are length-prefixed frames with a cap; a malformed or oversized frame closes the
//! connection of the client that sent it and nothing else.

use super::auth::{self, NONCE_BYTES, PROOF_BYTES};
use super::store::{timeout_err, Table, WaitFail};
use super::wire::{read_frame, write_frame, Dec, Enc, DEFAULT_MAX_FRAME};
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"FCS1";
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_CONNECTIONS: usize = 4096;

mod opcode {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    pub const CAS: u8 = 4;
    pub const DELETE: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GET_MANY: u8 = 7;
}

mod status {
    pub const OK: u8 = 0;
    pub const TIMEOUT: u8 = 1;
    pub const ERROR: u8 = 2;
}

/// A running store server. Dropping it stops accepting and closes every client connection.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Open client connections, so dropping the server can close them.
    conns: Arc<Mutex<HashMap<u64, TcpStream>>>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port) with the job `token`.
    pub fn bind(addr: impl ToSocketAddrs, token: &str) -> Result<TcpStoreServer> {
        Self::bind_with_cap(addr, token, DEFAULT_MAX_FRAME)
    }

    /// As [`bind`](Self::bind), with requests capped at `max_frame` bytes instead of
    /// [`DEFAULT_MAX_FRAME`]: a client that sends a larger frame is disconnected.
    /// `Error::Config` for an empty token, `Error::Io` when the address cannot be bound.
    pub fn bind_with_cap(addr: impl ToSocketAddrs, token: &str, max_frame: u32) -> Result<TcpStoreServer> {
        if token.is_empty() {
            return Err(Error::Config(
                "the TCP store needs a non-empty job token (FERROCOMM_TOKEN)".into(),
            ));
        }
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::io(
                "bind TCP store (is another store on this port? set FERROCOMM_STORE=tcp://host:port)",
                e,
            )
        })?;
        let addr = listener.local_addr().map_err(|e| Error::io("TCP store address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<HashMap<u64, TcpStream>>> = Arc::default();
        let table = Arc::new(Table::default());
        let token: Arc<[u8]> = token.as_bytes().into();
        let (stop2, conns2) = (stop.clone(), conns.clone());
        let live = Arc::new(AtomicUsize::new(0));
        let accept = std::thread::Builder::new()
            .name("ferrocomm-store".into())
            .spawn(move || {
                let mut next_id = 0u64;
                for stream in listener.incoming() {
                    if stop2.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if live.load(Ordering::Acquire) >= MAX_CONNECTIONS {
                        tracing::warn!("store: connection limit reached, refusing a client");
                        continue;
                    }
                    let id = next_id;
                    next_id += 1;
                    if let Ok(c) = stream.try_clone() {
                        conns2.lock().unwrap_or_else(|p| p.into_inner()).insert(id, c);
                    }
                    let (table, token, live, conns) = (table.clone(), token.clone(), live.clone(), conns2.clone());
                    live.fetch_add(1, Ordering::AcqRel);
                    let spawned = std::thread::Builder::new()
                        .name("ferrocomm-store-conn".into())
                        .spawn(move || {
                            if let Err(e) = serve(&stream, &table, &token, max_frame) {
                                tracing::debug!("store: client dropped: {e}");
                            }
                            // The clone kept for `Drop` would hold the socket open: close it here.
                            let _ = stream.shutdown(Shutdown::Both);
                            conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
                            live.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        tracing::warn!("store: cannot spawn a connection thread");
                    }
                }
            })
            .map_err(|e| Error::io("spawn store thread", e))?;
        Ok(TcpStoreServer {
            addr,
            stop,
            conns,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the port the system chose for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn server_handshake(mut s: &TcpStream, token: &[u8]) -> Result<()> {
    let nonce = auth::nonce()?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&nonce);
    s.write_all(&hello).map_err(|e| Error::io("store handshake", e))?;
    let mut reply = [0u8; 4 + PROOF_BYTES + NONCE_BYTES];
    s.read_exact(&mut reply).map_err(|e| Error::io("store handshake", e))?;
    if &reply[..4] != MAGIC {
        return Err(Error::protocol(
            "store handshake",
            "client is not a ferrocomm store client",
        ));
    }
    let (proof, client_nonce) = reply[4..].split_at(PROOF_BYTES);
    if !auth::verify(token, &nonce, b"client", proof) {
        let _ = s.write_all(&[0]);
        return Err(Error::Auth("client did not prove the job token".into()));
    }
    let mut ok = vec![1u8];
    ok.extend_from_slice(&auth::proof(token, client_nonce, b"server"));
    s.write_all(&ok).map_err(|e| Error::io("store handshake", e))
}

fn serve(mut s: &TcpStream, table: &Table, token: &[u8], max_frame: u32) -> Result<()> {
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| Error::io("store socket", e))?;
    server_handshake(s, token)?;
    s.set_read_timeout(None).map_err(|e| Error::io("store socket", e))?;
    s.set_nodelay(true).map_err(|e| Error::io("store socket", e))?;
    while let Some(req) = read_frame(&mut s, max_frame, "store request")? {
        let reply = match handle(table, &req, SERVER_MAX_WAIT) {
            Ok(r) => r,
            Err(e) => {
                // Tell the client why, then drop it: its stream may be out of step.
                let _ = write_frame(
                    &mut s,
                    &Enc::default().u8(status::ERROR).bytes(e.to_string().as_bytes()).0,
                );
                return Err(e);
            }
        };
        write_frame(&mut s, &reply).map_err(|e| Error::io("store reply", e))?;
    }
    Ok(())
}

/// Decodes and answers one request; blocking requests wait at most `max_wait`.
fn handle(table: &Table, req: &[u8], max_wait: Duration) -> Result<Vec<u8>> {
    let mut d = Dec::new(req);
    let ok = || Enc::default().u8(status::OK);
    let timed_out = |key: &str| Enc::default().u8(status::TIMEOUT).bytes(key.as_bytes()).0;
    let op = d.u8()?;
    let reply = match op {
        opcode::SET => {
            let (k, v) = (d.str()?, d.bytes()?);
            d.finish()?;
            table.set(k, v);
            ok().0
        }
        opcode::GET => {
            let (k, ms) = (d.str()?, d.u64()?);
            d.finish()?;
            match table.get(k, deadline_after(ms, max_wait)) {
                Ok(v) => ok().bytes(&v).0,
                Err(WaitFail::Missing(key)) => timed_out(&key),
                Err(WaitFail::Failed(reason)) => Enc::default().u8(status::ERROR).bytes(reason.as_bytes()).0,
            }
        }
        opcode::ADD => {
            let (k, delta) = (d.str()?, d.u64()? as i64);
            d.finish()?;
            match table.add(k, delta) {
                Ok(v) => ok().u64(v as u64).0,
                Err(e) => Enc::default().u8(status::ERROR).bytes(e.to_string().as_bytes()).0,
            }
        }
        opcode::CAS => {
            let (k, exp, des) = (d.str()?, d.bytes()?, d.bytes()?);
            d.finish()?;
            ok().bytes(&table.compare_set(k, exp, des)).0
        }
        opcode::DELETE => {
            let k = d.str()?;
            d.finish()?;
            ok().u8(table.delete(k) as u8).0
        }
        opcode::WAIT | opcode::GET_MANY => {
            let n = d.u64()?;
            // Each key costs at least its 4-byte length, so `n` is bounded by the frame size.
            if n > req.len() as u64 / 4 {
                return Err(Error::protocol(
                    "store frame",
                    format!("wait claims {n} keys in a {}-byte frame", req.len()),
                ));
            }
            let keys = (0..n).map(|_| d.str()).collect::<Result<Vec<_>>>()?;
            let ms = d.u64()?;
            d.finish()?;
            let deadline = deadline_after(ms, max_wait);
            let waited = if op == opcode::WAIT {
                table.wait_keys(&keys, deadline).map(|()| ok().0)
            } else {
                table
                    .get_many(&keys, deadline)
                    .map(|vals| vals.iter().fold(ok(), |e, v| e.bytes(v)).0)
            };
            match waited {
                Ok(reply) => reply,
                Err(WaitFail::Missing(key)) => timed_out(&key),
                Err(WaitFail::Failed(reason)) => Enc::default().u8(status::ERROR).bytes(reason.as_bytes()).0,
            }
        }
        other => return Err(Error::protocol("store frame", format!("unknown opcode {other}"))),
    };
    Ok(reply)
}

/// The server never waits longer than this, whatever a client asks (keeps `Instant` math safe).
const SERVER_MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

fn deadline_after(ms: u64, max_wait: Duration) -> Instant {
    Instant::now() + Duration::from_millis(ms).min(max_wait)
}

/// A client of a [`TcpStoreServer`]. Each call takes an idle authenticated connection (or
/// opens one), so a blocking `get` or `wait` never holds up calls from other threads.
pub struct TcpStore {
    idle: Mutex<Vec<TcpStream>>,
    server: SocketAddr,
    token: String,
    local_ip: Option<IpAddr>,
    max_frame: u32,
}

impl TcpStore {
    /// Connects to the server at `addr`, retrying until `timeout` (the server may start after
    /// us), and authenticates with the job `token`.
    pub fn connect(addr: impl ToSocketAddrs, token: &str, timeout: Duration) -> Result<TcpStore> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::io("resolve store address", e))?
            .collect();
        let server = *addrs
            .first()
            .ok_or_else(|| Error::Config("store address resolves to nothing".into()))?;
        let first = open_connection(server, token, Instant::now() + timeout)?;
        let local_ip = first.local_addr().ok().map(|a| a.ip());
        Ok(TcpStore {
            idle: Mutex::new(vec![first]),
            server,
            token: token.to_owned(),
            local_ip,
            max_frame: DEFAULT_MAX_FRAME,
        })
    }

    fn call(&self, req: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut s = match pooled {
            Some(s) => s,
            None => open_connection(self.server, &self.token, Instant::now() + Duration::from_secs(10))?,
        };
        let lost = |e: std::io::Error| Error::io(format!("store at {}", self.server), e);
        // The server answers a blocking call when it ends; give it that long plus a margin.
        s.set_read_timeout(Some(wait + Duration::from_secs(10))).map_err(lost)?;
        write_frame(&mut s, req).map_err(lost)?;
        let reply = match read_frame(&mut s, self.max_frame, "store reply")? {
            Some(r) => r,
            None => {
                return Err(Error::io(
                    format!("store at {}", self.server),
                    std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the store server closed the connection",
                    ),
                ))
            }
        };
        // Only a connection that finished its exchange cleanly goes back to the pool.
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(s);
        Ok(reply)
    }

    /// Splits a reply into its status and payload; turns server-side errors into ours.
    fn ok(reply: &[u8], wait: Duration) -> Result<Dec<'_>> {
        let mut d = Dec::new(reply);
        match d.u8()? {
            status::OK => Ok(d),
            status::TIMEOUT => Err(timeout_err(d.str()?, wait)),
            status::ERROR => Err(Error::protocol(
                "store server",
                String::from_utf8_lossy(d.bytes()?).into_owned(),
            )),
            s => Err(Error::protocol("store reply", format!("unknown status {s}"))),
        }
    }
}

fn open_connection(server: SocketAddr, token: &str, deadline: Instant) -> Result<TcpStream> {
    let mut stream = loop {
        match TcpStream::connect_timeout(&server, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => return Err(Error::io(format!("connect to store at {server}"), e)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| Error::io("store socket", e))?;
    client_handshake(&mut stream, token.as_bytes())?;
    stream.set_nodelay(true).map_err(|e| Error::io("store socket", e))?;
    Ok(stream)
}

fn client_handshake(s: &mut TcpStream, token: &[u8]) -> Result<()> {
    let io = |e| Error::io("store handshake", e);
    let mut hello = [0u8; 4 + NONCE_BYTES];
    s.read_exact(&mut hello).map_err(io)?;
    if &hello[..4] != MAGIC {
        return Err(Error::protocol("store handshake", "server is not a ferrocomm store"));
    }
    let nonce = auth::nonce()?;
    let mut reply = MAGIC.to_vec();
    reply.extend_from_slice(&auth::proof(token, &hello[4..], b"client"));
    reply.extend_from_slice(&nonce);
    s.write_all(&reply).map_err(io)?;
    let mut verdict = [0u8; 1];
    if s.read_exact(&mut verdict).is_err() || verdict[0] != 1 {
        return Err(Error::Auth(
            "the store server rejected our job token (check FERROCOMM_TOKEN)".into(),
        ));
    }
    let mut proof = [0u8; PROOF_BYTES];
    s.read_exact(&mut proof).map_err(io)?;
    if !auth::verify(token, &nonce, b"server", &proof) {
        return Err(Error::Auth("the store server could not prove the job token".into()));
    }
    Ok(())
}

const QUICK: Duration = Duration::from_secs(0);

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let r = self.call(
            &Enc::default().u8(opcode::SET).bytes(key.as_bytes()).bytes(value).0,
            QUICK,
        )?;
        Self::ok(&r, QUICK)?.finish()
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let req = Enc::default()
            .u8(opcode::GET)
            .bytes(key.as_bytes())
            .u64(timeout.as_millis() as u64)
            .0;
        let r = self.call(&req, timeout)?;
        let mut d = Self::ok(&r, timeout)?;
        let v = d.bytes()?.to_vec();
        d.finish()?;
        Ok(v)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let r = self.call(
            &Enc::default().u8(opcode::ADD).bytes(key.as_bytes()).u64(delta as u64).0,
            QUICK,
        )?;
        let mut d = Self::ok(&r, QUICK)?;
        Ok(d.u64()? as i64)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = Enc::default()
            .u8(opcode::CAS)
            .bytes(key.as_bytes())
            .bytes(expected)
            .bytes(desired)
            .0;
        let r = self.call(&req, QUICK)?;
        Ok(Self::ok(&r, QUICK)?.bytes()?.to_vec())
    }
    fn delete(&self, key: &str) -> Result<bool> {
        let r = self.call(&Enc::default().u8(opcode::DELETE).bytes(key.as_bytes()).0, QUICK)?;
        Ok(Self::ok(&r, QUICK)?.u8()? != 0)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut e = Enc::default().u8(opcode::WAIT).u64(keys.len() as u64);
        for k in keys {
            e = e.bytes(k.as_bytes());
        }
        let r = self.call(&e.u64(timeout.as_millis() as u64).0, timeout)?;
        Self::ok(&r, timeout)?.finish()
    }
    fn get_many(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let mut e = Enc::default().u8(opcode::GET_MANY).u64(keys.len() as u64);
        for k in keys {
            e = e.bytes(k.as_bytes());
        }
        let r = self.call(&e.u64(timeout.as_millis() as u64).0, timeout)?;
        let mut d = Self::ok(&r, timeout)?;
        let vals = keys
            .iter()
            .map(|_| d.bytes().map(<[u8]>::to_vec))
            .collect::<Result<Vec<_>>>()?;
        d.finish()?;
        Ok(vals)
    }
    fn local_addr_hint(&self) -> Option<IpAddr> {
        self.local_ip
    }
}

/// Feeds one request frame to the server's decoder and handler, as the fuzz target does.
#[cfg(feature = "fuzzing")]
pub fn fuzz_one_request(frame: &[u8]) {
    let table = Table::default();
    let _ = handle(&table, frame, Duration::ZERO);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client whose OS generator fails cannot join (no predictable nonce is ever sent), and
    /// the server goes on serving the others.
    #[test]
    fn a_client_without_randomness_cannot_join_and_the_server_goes_on() {
        let token = "t0k3n";
        let server = TcpStoreServer::bind("127.0.0.1:0", token).unwrap();
        let addr = server.addr();
        let e = crate::bootstrap::auth::failing::with(|| TcpStore::connect(addr, token, Duration::from_secs(5)))
            .err()
            .expect("connected without randomness");
        assert!(e.to_string().contains("random generator"), "{e}");
        let good = TcpStore::connect(addr, token, Duration::from_secs(5)).unwrap();
        good.set("k", b"v").unwrap();
        assert_eq!(good.get("k", Duration::from_secs(1)).unwrap(), b"v");
    }

    /// Frames that look like requests: a known opcode, then fields whose length prefixes may
    /// lie about what follows.
    fn plausible(r: &mut u64) -> Vec<u8> {
        let mut next = || {
            *r ^= *r << 13;
            *r ^= *r >> 7;
            *r ^= *r << 17;
            *r
        };
        let mut f = vec![(next() % 9) as u8];
        for _ in 0..next() % 5 {
            match next() % 3 {
                0 => f.extend_from_slice(&next().to_le_bytes()),
                1 => {
                    let claimed = (next() % 70) as u32;
                    f.extend_from_slice(&claimed.to_le_bytes());
                    let actual = next() % 70;
                    f.extend((0..actual).map(|i| (i as u8).wrapping_mul(31)));
                }
                _ => f.extend_from_slice(&(next() as u32).to_le_bytes()),
            }
        }
        f
    }

    #[test]
    fn random_request_frames_never_panic_the_server_side() {
        let table = Table::default();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut executions = 0u64;
        for i in 0..200_000u64 {
            let frame = if i % 2 == 0 {
                plausible(&mut state)
            } else {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                state.to_le_bytes()[..(state % 9) as usize].to_vec()
            };
            // Every frame is answered with a reply or an error; none may panic. Blocking
            // requests may wait zero time here.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(&table, &frame, Duration::ZERO)));
            assert!(r.is_ok(), "frame {frame:?} panicked the handler");
            executions += 1;
        }
        println!("FUZZ store frames: {executions} executions, no panic");
    }
}
