//! Attacks by someone without the job token, on loopback only, each bounded in time: the job
//! must start within its normal time while they go on, and no secret may be stored as a value.
//! docs/results/reliability.md tabulates attack and outcome.

mod common;

use common::tcp_options;
use ferrocomm::{new_comm, Collectives, Comm, Device, Error, MemoryStore, ReduceOp, Store, TcpStore, TcpStoreServer};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Starts `n` ranks as threads, each with its own client of the TCP store at `addr`, over TCP
/// links; each checks an all_reduce. Returns how long the slowest took to join.
fn start_job(addr: SocketAddr, token: &str, n: usize) -> Duration {
    let t = Instant::now();
    let joined: Vec<Duration> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                s.spawn(move || {
                    let store: Arc<dyn Store> =
                        Arc::new(TcpStore::connect(addr, token, Duration::from_secs(30)).unwrap());
                    let o = tcp_options(Duration::from_secs(30)).with_store(store, r, n);
                    let c = new_comm("cpu", Device::Cpu, "attacked", o).unwrap();
                    let joined = t.elapsed();
                    let mut x = [r as u32 + 1; 4];
                    c.all_reduce(&mut x[..], ReduceOp::Sum).unwrap();
                    assert_eq!(x, [(n * (n + 1) / 2) as u32; 4]);
                    joined
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    joined.into_iter().max().unwrap()
}

/// Opens a connection and answers the greeting with `reply` (nothing when empty).
fn connect_and_say(addr: SocketAddr, reply: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    if !reply.is_empty() {
        let _ = s.write_all(reply);
    }
    s
}

#[test]
fn a_job_starts_normally_while_its_store_is_flooded_trickled_and_fed_garbage() {
    let token = "job-token";
    let server = TcpStoreServer::bind("127.0.0.1:0", token).unwrap();
    let addr = server.addr();
    let baseline = start_job(addr, token, 3);

    // 5000 idle connections: past the old cap of 4096, which locked the ranks out.
    let idle: Vec<TcpStream> = (0..5000).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    assert!(idle.len() > 4000, "opened only {}", idle.len());
    // Clients that trickle a byte every 500 ms, garbage, and hellos with a guessed token.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tricklers: Vec<_> = (0..20)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(addr).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) && s.write_all(&[1]).is_ok() {
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        })
        .collect();
    let garbage: Vec<TcpStream> = (0..20).map(|_| connect_and_say(addr, &[0xAB; 300])).collect();
    let forged = TcpStore::connect(addr, "a-guess", Duration::from_secs(5));
    assert!(matches!(forged, Err(Error::Auth(_))), "{:?}", forged.err());

    let attacked = start_job(addr, token, 3);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    println!("ATTACK store flood: job joined in {baseline:?} alone, {attacked:?} under attack");
    assert!(
        attacked < Duration::from_secs(3),
        "joined after {attacked:?} under attack ({baseline:?} alone)"
    );
    drop((idle, garbage));
    for t in tricklers {
        t.join().unwrap();
    }
}

#[test]
fn a_trickling_client_is_dropped_within_the_handshake_deadline() {
    let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 64];
    let closed_after = loop {
        if s.write_all(&[1]).is_err() {
            break t.elapsed();
        }
        match s.read(&mut buf) {
            Ok(0) => break t.elapsed(),
            Err(e) if !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                break t.elapsed()
            }
            _ => {}
        }
        assert!(t.elapsed() < Duration::from_secs(15), "still held after 15 s");
        std::thread::sleep(Duration::from_millis(400));
    };
    println!("ATTACK trickle: dropped after {closed_after:?}");
    assert!(closed_after < Duration::from_secs(7), "{closed_after:?}");
}

/// Every value a store is given, for the test to read back.
struct Recording<S> {
    inner: S,
    values: Mutex<Vec<(String, Vec<u8>)>>,
    derives: bool,
}

impl<S: Store> Store for Recording<S> {
    fn set(&self, key: &str, value: &[u8]) -> ferrocomm::Result<()> {
        self.values.lock().unwrap().push((key.to_owned(), value.to_vec()));
        self.inner.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> ferrocomm::Result<Vec<u8>> {
        self.inner.get(key, timeout)
    }
    fn add(&self, key: &str, delta: i64) -> ferrocomm::Result<i64> {
        self.inner.add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> ferrocomm::Result<Vec<u8>> {
        self.values.lock().unwrap().push((key.to_owned(), desired.to_vec()));
        self.inner.compare_set(key, expected, desired)
    }
    fn delete(&self, key: &str) -> ferrocomm::Result<bool> {
        self.inner.delete(key)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> ferrocomm::Result<()> {
        self.inner.wait(keys, timeout)
    }
    fn derive_secret(&self, label: &str) -> ferrocomm::Result<Option<[u8; 32]>> {
        if self.derives {
            self.inner.derive_secret(label)
        } else {
            Ok(None)
        }
    }
}

/// Runs a job over TCP links with a window reached over the network, on `store`.
fn run_tcp_job_with_window(store: Arc<dyn Store>, n: usize, name: &str) {
    std::thread::scope(|s| {
        for r in 0..n {
            let store = store.clone();
            s.spawn(move || {
                let o = tcp_options(Duration::from_secs(30)).with_store(store, r, n);
                let c: Comm = new_comm("cpu", Device::Cpu, name, o).unwrap();
                let w = c.new_window(64).unwrap();
                w.put((r + 1) % n, 8 * r, &[r as u8 + 1; 8]).unwrap();
                w.flush().unwrap();
                c.barrier().unwrap();
                let mut got = [0u8; 8];
                let from = (r + n - 1) % n;
                w.get(r, 8 * from, &mut got).unwrap();
                assert_eq!(got, [from as u8 + 1; 8]);
            });
        }
    });
}

/// The links' and windows' keys derive from the store's secret: no rank publishes one, so a
/// reader of the store's values learns nothing to forge a hello with. A store that holds no
/// secret (a user's own) still works: rank 0 publishes a random key there.
#[test]
fn no_secret_is_stored_as_a_value() {
    for derives in [true, false] {
        let store = Arc::new(Recording {
            inner: MemoryStore::new(),
            values: Mutex::default(),
            derives,
        });
        run_tcp_job_with_window(store.clone(), 3, &format!("keys-{derives}"));
        let values = store.values.lock().unwrap();
        let published: Vec<&String> = values
            .iter()
            .filter(|(k, v)| {
                k.ends_with("/secret") || (k.contains("/hello/") && !String::from_utf8_lossy(v).ends_with("\n-"))
            })
            .map(|(k, _)| k)
            .collect();
        if derives {
            assert!(published.is_empty(), "secrets stored as values: {published:?}");
        } else {
            // One for the links (in rank 0's record), one for the window.
            assert_eq!(published.len(), 2, "{published:?}");
        }
    }
}

/// The derived keys differ per communicator (its name and generation), per window, and per
/// job token; the same inputs give the same key on every rank.
#[test]
fn derived_keys_differ_per_communicator_window_and_token() {
    let token_a = TcpStoreServer::bind("127.0.0.1:0", "token-a").unwrap();
    let token_b = TcpStoreServer::bind("127.0.0.1:0", "token-b").unwrap();
    let a1 = TcpStore::connect(token_a.addr(), "token-a", Duration::from_secs(5)).unwrap();
    let a2 = TcpStore::connect(token_a.addr(), "token-a", Duration::from_secs(5)).unwrap();
    let b = TcpStore::connect(token_b.addr(), "token-b", Duration::from_secs(5)).unwrap();
    let key = |s: &TcpStore, l: &str| s.derive_secret(l).unwrap().unwrap();
    assert_eq!(key(&a1, "ferrocomm/w/0/links"), key(&a2, "ferrocomm/w/0/links"));
    assert_ne!(key(&a1, "ferrocomm/w/0/links"), key(&a1, "ferrocomm/w/1/links"));
    assert_ne!(key(&a1, "ferrocomm/w/0/links"), key(&b, "ferrocomm/w/0/links"));
    assert_ne!(
        key(&a1, "ferrocomm/w/0/window1/net"),
        key(&a1, "ferrocomm/w/0/window2/net")
    );
    let p = ferrocomm::PrefixStore::new("ferrocomm/w/0", Arc::new(a1));
    assert_eq!(
        p.derive_secret("links").unwrap().unwrap(),
        key(&a2, "ferrocomm/w/0/links")
    );
    // An in-memory store has a key of its own; its clones share it.
    let (m, n) = (MemoryStore::new(), MemoryStore::new());
    assert_eq!(m.derive_secret("x").unwrap(), m.clone().derive_secret("x").unwrap());
    assert_ne!(m.derive_secret("x").unwrap(), n.derive_secret("x").unwrap());
}
