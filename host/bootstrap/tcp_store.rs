//! The TCP store: a server that holds the job's rendezvous keys and a client for each rank.
//!
//! Every connection starts with mutual challenge-response on the job token (see auth.rs); a
//! client that cannot prove it knows the token is refused before any request is read, and the
//! handshakes of all connections run at once on the accepting thread (gate.rs). After it, every
//! byte either way is sealed (AES-256-GCM, keys derived from the token and both nonces,
//! seal.rs): the store's traffic cannot be read or altered on the way. Requests and replies are
//! length-prefixed frames with a cap; a malformed or oversized frame closes the connection of
//! the client that sent it and nothing else.

use super::auth::{self, NONCE_BYTES, PROOF_BYTES};
use super::gate::{read_exact_by, Gate, Judgement, Limits, Reply};
use super::seal::{session_keys, SealedStream, SessionKeys};
use super::store::{timeout_err, Table, WaitFail};
use super::wire::{read_frame, write_frame, Dec, Enc, DEFAULT_MAX_FRAME};
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"FCS3";
/// The whole handshake, greeting to verdict, on either side: a deadline, not a per-read timeout,
/// so a peer sending a byte at a time cannot stretch it.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Open client connections (each served by its own thread), so dropping the server can
    /// close them.
    conns: Conns,
    accept: Option<std::thread::JoinHandle<()>>,
}

type Conns = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl TcpStoreServer {
    /// Listens on `addr` (port 0 picks a free port) with the job `token`.
    pub fn bind(addr: impl ToSocketAddrs, token: &str) -> Result<TcpStoreServer> {
        Self::bind_with_cap(addr, token, DEFAULT_MAX_FRAME)
    }

    /// As [`bind`](Self::bind), with requests capped at `max_frame` bytes instead of
    /// [`DEFAULT_MAX_FRAME`]: a client that sends a larger frame is disconnected.
    /// `Error::Config` for an empty token, `Error::Io` when the address cannot be bound.
    pub fn bind_with_cap(addr: impl ToSocketAddrs, token: &str, max_frame: u32) -> Result<TcpStoreServer> {
        Self::bind_with(addr, token, max_frame, UNPROVEN)
    }

    fn bind_with(addr: impl ToSocketAddrs, token: &str, max_frame: u32, limits: Limits) -> Result<TcpStoreServer> {
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
        let mut gate = Gate::new(listener, *MAGIC, REPLY_BYTES, limits)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Conns = Arc::default();
        let table = Arc::new(Table::default());
        let token: Arc<[u8]> = token.as_bytes().into();
        let (stop2, conns2) = (stop.clone(), conns.clone());
        let accept = std::thread::Builder::new()
            .name("ferrocomm-store".into())
            .spawn(move || {
                let mut next_id = 0u64;
                let stopped = || stop2.load(Ordering::Acquire);
                while !stopped() {
                    let admitted = gate.next(Instant::now() + Duration::from_secs(1), &stopped, &mut |r| {
                        judge_client(&token, r)
                    });
                    match admitted {
                        Ok(Some((stream, (answer, keys)))) => {
                            next_id += 1;
                            admit(stream, answer, keys, next_id, &table, &conns2, max_frame);
                        }
                        Ok(None) => {}
                        Err(e) => {
                            // Fail closed: no client is greeted until the generator works.
                            tracing::error!("store: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
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

    /// Clients being served now.
    #[cfg(test)]
    fn connections(&self) -> usize {
        self.conns.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// How many clients may be proving the token at once (and from one address), and for how
/// long. Real ranks answer within a round trip; these bound what idle or trickling
/// connections can hold (a descriptor each, no thread).
const UNPROVEN: Limits = Limits {
    handshake: HANDSHAKE_TIMEOUT,
    pending: 512,
    per_source: 256,
};

/// The client's answer to the greeting: magic, its proof, its own nonce.
const REPLY_BYTES: usize = 4 + PROOF_BYTES + NONCE_BYTES;

mod verdict {
    pub const REFUSED: u8 = 0;
    pub const ADMITTED: u8 = 1;
    /// The server could not take the connection now (no thread): the client retries.
    pub const BUSY: u8 = 2;
}

/// Admits a client that proved the token; the answer carries our proof of it in turn, and the
/// keys seal everything after it.
fn judge_client(token: &[u8], r: &Reply<'_>) -> Judgement<(Vec<u8>, SessionKeys)> {
    let (magic, rest) = r.bytes.split_at(4);
    let (proof, client_nonce) = rest.split_at(PROOF_BYTES);
    if magic != MAGIC || !auth::verify(token, r.nonce, b"client", proof) {
        return Judgement::Refuse(vec![verdict::REFUSED]);
    }
    let mut answer = vec![verdict::ADMITTED];
    answer.extend_from_slice(&auth::proof(token, client_nonce, b"server"));
    Judgement::Admit((answer, session_keys(token, r.nonce, client_nonce, false)))
}

/// Serves an admitted client on a thread of its own. The connection is listed while, and only
/// while, its thread runs: where no thread can be made, it is told the server is busy and
/// closed, and the list is as before.
fn admit(
    stream: TcpStream,
    answer: Vec<u8>,
    keys: SessionKeys,
    id: u64,
    table: &Arc<Table>,
    conns: &Conns,
    max_frame: u32,
) {
    let Ok(kept) = stream.try_clone() else {
        let _ = (&stream).write_all(&[verdict::BUSY]);
        return;
    };
    conns.lock().unwrap_or_else(|p| p.into_inner()).insert(id, kept);
    let (table, list) = (table.clone(), conns.clone());
    let serving = spawn_handler(move || {
        let served = (&stream)
            .write_all(&answer)
            .map_err(|e| Error::io("store handshake", e))
            .and_then(|()| serve(&mut SealedStream::sealed(&stream, &keys), &table, max_frame));
        if let Err(e) = served {
            tracing::debug!("store: client dropped: {e}");
        }
        // The clone kept for `Drop` would hold the socket open: close it here.
        let _ = stream.shutdown(Shutdown::Both);
        list.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    });
    if let Err(e) = serving {
        tracing::warn!("store: cannot start a thread for a client ({e}); telling it to retry");
        if let Some(s) = conns.lock().unwrap_or_else(|p| p.into_inner()).remove(&id) {
            let _ = (&s).write_all(&[verdict::BUSY]);
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn spawn_handler(f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    #[cfg(test)]
    if tests::FAIL_SPAWNS
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
    {
        return Err(std::io::Error::from(std::io::ErrorKind::OutOfMemory));
    }
    std::thread::Builder::new()
        .name("ferrocomm-store-conn".into())
        .spawn(f)
        .map(drop)
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The accepting thread first (it looks at `stop` every 20 ms), so no client is admitted
        // after the connections are closed.
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for (_, c) in self.conns.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn serve(s: &mut SealedStream<&TcpStream>, table: &Table, max_frame: u32) -> Result<()> {
    s.get_ref()
        .set_nodelay(true)
        .map_err(|e| Error::io("store socket", e))?;
    while let Some(req) = read_frame(s, max_frame, "store request")? {
        let reply = match handle(table, &req, SERVER_MAX_WAIT) {
            Ok(r) => r,
            Err(e) => {
                // Tell the client why, then drop it: its stream may be out of step.
                let _ = write_frame(s, &Enc::default().u8(status::ERROR).bytes(e.to_string().as_bytes()).0);
                return Err(e);
            }
        };
        write_frame(s, &reply).map_err(|e| Error::io("store reply", e))?;
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
    idle: Mutex<Vec<SealedStream<TcpStream>>>,
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
        let local_ip = first.get_ref().local_addr().ok().map(|a| a.ip());
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
        s.get_ref()
            .set_read_timeout(Some(wait + Duration::from_secs(10)))
            .map_err(lost)?;
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

/// Opens an authenticated connection by `deadline`. A server that drops us during the
/// handshake (busy, or shedding a flood of unauthenticated connections) is tried again until
/// then; one that refuses our token is not.
fn open_connection(server: SocketAddr, token: &str, deadline: Instant) -> Result<SealedStream<TcpStream>> {
    let mut attempts = 0u32;
    loop {
        // Made before connecting: a failing generator ends the attempts at once.
        let nonce = auth::nonce()?;
        let last = match TcpStream::connect_timeout(&server, Duration::from_secs(1)) {
            Ok(s) => {
                attempts += 1;
                let by = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
                match client_handshake(&s, token.as_bytes(), &nonce, by) {
                    Ok(keys) => {
                        s.set_nodelay(true).map_err(|e| Error::io("store socket", e))?;
                        return Ok(SealedStream::sealed(s, &keys));
                    }
                    Err(e @ Error::Auth(_)) => return Err(e),
                    Err(e) => e,
                }
            }
            Err(e) => Error::io(format!("connect to store at {server}"), e),
        };
        if Instant::now() >= deadline {
            if attempts == 0 {
                return Err(last);
            }
            return Err(Error::protocol(
                "store handshake",
                format!(
                    "the store at {server} did not admit us in {attempts} attempt(s) before the deadline \
                     (it drops clients it cannot serve now, and slow handshakes; is it flooded?): {last}"
                ),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The client's half of the handshake; returns the keys that seal the connection after it.
fn client_handshake(s: &TcpStream, token: &[u8], nonce: &[u8; NONCE_BYTES], deadline: Instant) -> Result<SessionKeys> {
    let dropped = |e: std::io::Error| Error::io("store handshake", e);
    let mut hello = [0u8; 4 + NONCE_BYTES];
    read_exact_by(s, &mut hello, deadline).map_err(dropped)?;
    if &hello[..4] != MAGIC {
        return Err(Error::protocol("store handshake", "server is not a ferrocomm store"));
    }
    let mut reply = MAGIC.to_vec();
    reply.extend_from_slice(&auth::proof(token, &hello[4..], b"client"));
    reply.extend_from_slice(nonce);
    (&*s).write_all(&reply).map_err(dropped)?;
    let mut answer = [0u8; 1];
    read_exact_by(s, &mut answer, deadline).map_err(dropped)?;
    match answer[0] {
        verdict::ADMITTED => {}
        verdict::REFUSED => {
            return Err(Error::Auth(
                "the store server rejected our job token (check FERROCOMM_TOKEN)".into(),
            ))
        }
        verdict::BUSY => {
            return Err(Error::io(
                "store handshake",
                std::io::Error::other("the store server is busy (it could not start a thread for us)"),
            ))
        }
        v => return Err(Error::protocol("store handshake", format!("unknown verdict {v}"))),
    }
    let mut proof = [0u8; PROOF_BYTES];
    read_exact_by(s, &mut proof, deadline).map_err(dropped)?;
    if !auth::verify(token, nonce, b"server", &proof) {
        return Err(Error::Auth("the store server could not prove the job token".into()));
    }
    Ok(session_keys(token, &hello[4..], nonce, true))
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
    fn derive_secret(&self, label: &str) -> Result<Option<[u8; 32]>> {
        Ok(Some(auth::derive(self.token.as_bytes(), label.as_bytes())))
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
    use std::io::Read;
    use std::sync::atomic::AtomicUsize;

    /// Handler threads that fail to start, as when the process is out of threads or memory.
    pub(super) static FAIL_SPAWNS: AtomicUsize = AtomicUsize::new(0);

    fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
        let t = Instant::now();
        while !ok() {
            assert!(t.elapsed() < Duration::from_secs(10), "{what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A client that passed the handshake, as a raw sealed stream, so a test can send frames
    /// of its own making.
    fn raw_client(addr: SocketAddr, token: &str) -> SealedStream<TcpStream> {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let nonce = auth::nonce().unwrap();
        let keys = client_handshake(&s, token.as_bytes(), &nonce, Instant::now() + Duration::from_secs(5)).unwrap();
        SealedStream::sealed(s, &keys)
    }

    /// The server closes (or resets) this connection; a read that merely times out is not that.
    fn closed(mut s: impl Read) -> bool {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Err(e) => return !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                Ok(_) => continue, // an error frame may come first
            }
        }
    }

    #[test]
    fn malformed_oversized_and_unsealed_frames_close_only_that_connection() {
        let server = TcpStoreServer::bind_with_cap("127.0.0.1:0", "tok", 1 << 20).unwrap();
        let good = TcpStore::connect(server.addr(), "tok", Duration::from_secs(5)).unwrap();
        good.set("k", b"v").unwrap();
        let frames: Vec<Vec<u8>> = vec![
            u32::MAX.to_le_bytes().to_vec(),                              // length far over the cap
            [5u32.to_le_bytes().to_vec(), vec![99, 0, 0, 0, 0]].concat(), // unknown opcode
            [3u32.to_le_bytes().to_vec(), vec![1, 200, 0]].concat(),      // SET with a truncated key
            [9u32.to_le_bytes().to_vec(), vec![6], u64::MAX.to_le_bytes().to_vec()].concat(), // WAIT, absurd count
            [6u32.to_le_bytes().to_vec(), vec![5, 1, 0, 0, 0, 0xff]].concat(), // key not UTF-8
        ];
        for f in frames {
            let mut s = raw_client(server.addr(), "tok");
            s.write_all(&f).unwrap();
            assert!(closed(s), "frame {f:?} should close the connection");
        }
        // After the handshake, a frame that is not sealed (or was altered on the way) ends
        // the connection before it is read as a request.
        let s = raw_client(server.addr(), "tok");
        let mut raw = s.get_ref().try_clone().unwrap();
        raw.write_all(&[5, 0, 0, 0, 1, 1, 0, 0, 0]).unwrap();
        assert!(closed(s));
        // Unauthenticated garbage is refused before any request is read.
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        s.write_all(&[0xAB; 200]).unwrap();
        assert!(closed(s));
        // A value over the cap fails for its sender only.
        let big = TcpStore::connect(server.addr(), "tok", Duration::from_secs(5)).unwrap();
        assert!(big.set("big", &vec![0u8; 2 << 20]).is_err());
        assert_eq!(good.get("k", Duration::from_secs(1)).unwrap(), b"v");
        good.set("k2", b"still serving").unwrap();
        assert_eq!(good.get("k2", Duration::from_secs(1)).unwrap(), b"still serving");
    }

    /// A client that sends a byte at a time is dropped when the whole handshake's deadline
    /// passes, not kept alive by each byte.
    #[test]
    fn a_trickling_client_is_dropped_at_the_handshake_deadline() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let mut s = TcpStream::connect(server.addr()).unwrap();
        let mut hello = [0u8; 4 + NONCE_BYTES];
        s.read_exact(&mut hello).unwrap();
        let t = Instant::now();
        let mut sent = 0;
        while sent < REPLY_BYTES - 1 && s.write_all(&[7]).is_ok() {
            sent += 1;
            std::thread::sleep(Duration::from_millis(250));
            s.set_nonblocking(true).unwrap();
            let closed = matches!(s.read(&mut [0u8; 8]), Ok(0));
            s.set_nonblocking(false).unwrap();
            if closed {
                break;
            }
        }
        let held = t.elapsed();
        assert!(
            held >= HANDSHAKE_TIMEOUT - Duration::from_millis(300) && held < HANDSHAKE_TIMEOUT + Duration::from_secs(2),
            "held for {held:?} after {sent} bytes"
        );
    }

    /// 5000 idle connections, far past the cap on unproven ones, and a rank still joins at
    /// once: the oldest idle ones make way.
    #[test]
    fn an_idle_flood_past_the_cap_does_not_keep_a_rank_out() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let flood: Vec<TcpStream> = (0..5000)
            .filter_map(|_| TcpStream::connect(server.addr()).ok())
            .collect();
        assert!(flood.len() > 4000, "only {} connections opened", flood.len());
        let t = Instant::now();
        let rank = TcpStore::connect(server.addr(), "tok", Duration::from_secs(10)).unwrap();
        rank.set("k", b"v").unwrap();
        assert_eq!(rank.get("k", Duration::from_secs(1)).unwrap(), b"v");
        assert!(t.elapsed() < Duration::from_secs(2), "joined after {:?}", t.elapsed());
    }

    /// A handler thread that cannot start undoes its connection's entry and tells the client,
    /// which retries; after churn, every one of 100 simultaneous clients is served and the
    /// count of connections is that of the clients still open.
    #[test]
    fn a_failed_spawn_leaves_no_trace_and_clients_retry() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        FAIL_SPAWNS.store(3, Ordering::Release);
        let first = TcpStore::connect(server.addr(), "tok", Duration::from_secs(10)).unwrap();
        first.set("a", b"1").unwrap();
        assert_eq!(FAIL_SPAWNS.load(Ordering::Acquire), 0);
        wait_for("one connection", || server.connections() == 1);
        for _ in 0..100 {
            drop(TcpStore::connect(server.addr(), "tok", Duration::from_secs(10)).unwrap());
        }
        wait_for("churn leaves nothing behind", || server.connections() == 1);
        let addr = server.addr();
        let clients: Vec<TcpStore> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..100)
                .map(|i| {
                    s.spawn(move || {
                        let c = TcpStore::connect(addr, "tok", Duration::from_secs(20)).unwrap();
                        c.set(&format!("c{i}"), b"x").unwrap();
                        c
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(server.connections(), 101);
        drop(clients);
        wait_for("closed clients leave", || server.connections() == 1);
    }

    /// Out of descriptors, the accept loop sleeps instead of spinning, and takes the waiting
    /// connection once descriptors free up. Runs in a child process: it lowers the limit on
    /// open files.
    #[test]
    fn accept_errors_back_off_instead_of_spinning() {
        const CHILD: &str = "FERROCOMM_TEST_EMFILE_CHILD";
        if std::env::var_os(CHILD).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "bootstrap::tcp_store::tests::accept_errors_back_off_instead_of_spinning",
                ])
                .args(["--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success() && text.contains("EMFILE-OK"), "{text}");
            return;
        }
        let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
        let limit = rustix::process::Rlimit {
            current: Some(64),
            maximum: rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum,
        };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
        // Fill the table, then free one descriptor for the client's socket: the server's
        // accept has none left. Another thread of this process may take the freed one first
        // (seen: the client's connect failing with EMFILE in 2 of 4 runs): then free another.
        let mut filler: Vec<std::fs::File> = std::iter::from_fn(|| std::fs::File::open("/dev/null").ok()).collect();
        let mut client = loop {
            filler.pop();
            match TcpStream::connect(server.addr()) {
                Ok(c) => break c,
                Err(e) if e.raw_os_error() == Some(libc::EMFILE) && filler.len() > 8 => continue,
                Err(e) => panic!("connecting with a descriptor free: {e}"),
            }
        };
        let cpu = || {
            let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
            // SAFETY: getrusage fills the struct it is given.
            unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
            // SAFETY: filled above (or left zeroed).
            let u = unsafe { u.assume_init() };
            Duration::from_secs((u.ru_utime.tv_sec + u.ru_stime.tv_sec) as u64)
                + Duration::from_micros((u.ru_utime.tv_usec + u.ru_stime.tv_usec) as u64)
        };
        let before = cpu();
        std::thread::sleep(Duration::from_secs(1));
        let spent = cpu() - before;
        assert!(
            spent < Duration::from_millis(200),
            "accept loop used {spent:?} of CPU in 1 s"
        );
        filler.truncate(filler.len().saturating_sub(8));
        client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut hello = [0u8; 4 + NONCE_BYTES];
        client
            .read_exact(&mut hello)
            .expect("greeted once descriptors are free");
        assert_eq!(&hello[..4], MAGIC);
        println!("EMFILE-OK: {spent:?} of CPU while out of descriptors");
    }

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
