//! The stores keep one contract (memory, file, TCP, prefix); the TCP store admits only clients
//! that prove the job token and survives malformed and oversized frames.

use ferrocomm::{Error, FileStore, MemoryStore, PrefixStore, Store, TcpStore, TcpStoreServer};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHORT: Duration = Duration::from_millis(200);

fn contract(s: Arc<dyn Store>) {
    s.set("a", b"1").unwrap();
    assert_eq!(s.get("a", SHORT).unwrap(), b"1");
    s.set("a", b"two").unwrap();
    assert_eq!(s.get("a", SHORT).unwrap(), b"two");
    assert_eq!(s.add("n", 5).unwrap(), 5);
    assert_eq!(s.add("n", -2).unwrap(), 3);
    assert!(s.add("a", 1).is_err(), "add on a non-integer value fails");
    // compare_set: absent key matches empty `expected`; otherwise the current value must match.
    assert_eq!(s.compare_set("c", b"", b"x").unwrap(), b"x");
    assert_eq!(s.compare_set("c", b"nope", b"y").unwrap(), b"x");
    assert_eq!(s.compare_set("c", b"x", b"y").unwrap(), b"y");
    assert!(s.delete("c").unwrap());
    assert!(!s.delete("c").unwrap());
    let t0 = Instant::now();
    assert!(matches!(s.get("missing", SHORT), Err(Error::StoreTimeout { ref key, .. }) if key.ends_with("missing")));
    assert!(t0.elapsed() >= SHORT && t0.elapsed() < SHORT + Duration::from_secs(2));
    assert!(matches!(
        s.wait(&["a", "missing"], SHORT),
        Err(Error::StoreTimeout { .. })
    ));
    s.wait(&["a", "n"], SHORT).unwrap();
    // A blocking get is answered by a later set from another thread.
    let s2 = s.clone();
    let h = std::thread::spawn(move || s2.get("late", Duration::from_secs(10)).unwrap());
    std::thread::sleep(Duration::from_millis(50));
    s.set("late", b"here").unwrap();
    assert_eq!(h.join().unwrap(), b"here");
    s.set("empty", b"").unwrap();
    assert_eq!(s.get("empty", SHORT).unwrap(), b"");
    // get_many: every value in the order asked, once the last key arrives; a timeout names a
    // missing key.
    assert_eq!(
        s.get_many(&["n", "a", "empty", "a"], SHORT).unwrap(),
        [&b"3"[..], b"two", b"", b"two"]
    );
    assert!(matches!(
        s.get_many(&["a", "never"], SHORT),
        Err(Error::StoreTimeout { ref key, .. }) if key.ends_with("never")
    ));
    let s2 = s.clone();
    let h = std::thread::spawn(move || {
        s2.get_many(&["a", "later1", "later2"], Duration::from_secs(10))
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(50));
    s.set("later2", b"y").unwrap();
    s.set("later1", b"x").unwrap();
    assert_eq!(h.join().unwrap(), [&b"two"[..], b"x", b"y"]);
}

/// Many ranks waiting for many keys (a communicator's set-up round): every waiter sees every
/// key, whichever order they arrive in, and a failed store ends the waits that remain.
#[test]
fn a_thousand_waiters_on_a_thousand_keys_all_complete() {
    let s = MemoryStore::new();
    let n = 1000;
    let keys: Vec<String> = (0..n).map(|r| format!("k/{r}")).collect();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (s, keys) = (&s, &keys);
                sc.spawn(move || {
                    s.set(&keys[n - 1 - r], r.to_string().as_bytes()).unwrap();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    s.get_many(&refs, Duration::from_secs(60)).unwrap()
                })
            })
            .collect();
        for h in hs {
            let vals = h.join().unwrap();
            assert!(vals
                .iter()
                .enumerate()
                .all(|(i, v)| *v == (n - 1 - i).to_string().as_bytes()));
        }
    });
    let waiter = {
        let s = s.clone();
        std::thread::spawn(move || s.wait(&["k/0", "absent"], Duration::from_secs(60)))
    };
    std::thread::sleep(Duration::from_millis(50));
    s.fail("rank 3 could not join");
    assert!(matches!(waiter.join().unwrap(), Err(Error::StoreClosed(ref r)) if r.contains("rank 3")));
}

#[test]
fn memory_store_keeps_the_contract() {
    contract(Arc::new(MemoryStore::new()));
}

#[test]
fn prefix_store_keeps_the_contract_and_isolates_namespaces() {
    let base: Arc<dyn Store> = Arc::new(MemoryStore::new());
    contract(Arc::new(PrefixStore::new("p1", base.clone())));
    let other = PrefixStore::new("p2", base.clone());
    assert!(other.get("a", SHORT).is_err());
    assert_eq!(base.get("p1/a", SHORT).unwrap(), b"two");
}

#[test]
fn file_store_keeps_the_contract() {
    let dir = std::env::temp_dir().join(format!("ferrocomm-filestore-{}", ferrocomm::random_token().unwrap()));
    contract(Arc::new(FileStore::new(&dir).unwrap()));
    // A second handle on the same directory sees the same keys (another process would too).
    assert_eq!(FileStore::new(&dir).unwrap().get("a", SHORT).unwrap(), b"two");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn tcp_store_keeps_the_contract() {
    let server = TcpStoreServer::bind("127.0.0.1:0", "secret").unwrap();
    contract(Arc::new(
        TcpStore::connect(server.addr(), "secret", Duration::from_secs(5)).unwrap(),
    ));
}

#[test]
fn tcp_store_rejects_a_wrong_token_and_needs_one() {
    let server = TcpStoreServer::bind("127.0.0.1:0", "right").unwrap();
    let e = TcpStore::connect(server.addr(), "wrong", Duration::from_secs(5));
    assert!(matches!(e, Err(Error::Auth(_))), "{:?}", e.err());
    assert!(matches!(TcpStoreServer::bind("127.0.0.1:0", ""), Err(Error::Config(_))));
    // A client that talks to something that is not our server learns it, too.
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n0123456789abcdef0123");
        std::thread::sleep(Duration::from_millis(500));
    });
    assert!(matches!(
        TcpStore::connect(addr, "right", Duration::from_secs(5)),
        Err(Error::Protocol { .. })
    ));
}

/// Performs the client side of the handshake by hand, so the test can then send raw frames.
fn raw_client(addr: std::net::SocketAddr, token: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; 36];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[..4], b"FCS2");
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token.as_bytes()).unwrap();
    mac.update(&hello[4..]);
    mac.update(b"client");
    let mut reply = b"FCS2".to_vec();
    reply.extend_from_slice(&mac.finalize().into_bytes());
    reply.extend_from_slice(&[7u8; 32]);
    s.write_all(&reply).unwrap();
    let mut verdict = [0u8; 33];
    s.read_exact(&mut verdict).unwrap();
    assert_eq!(verdict[0], 1, "handshake accepted");
    s
}

/// The server closes (or resets) this connection; a read that merely times out is not that.
fn closed(mut s: TcpStream) -> bool {
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
fn malformed_and_oversized_frames_close_only_that_connection() {
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
    // Unauthenticated garbage is refused before any request is read.
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(&[0xAB; 200]).unwrap();
    assert!(closed(s));
    // A value over the cap fails for its sender only.
    let big = TcpStore::connect(server.addr(), "tok", Duration::from_secs(5)).unwrap();
    assert!(big.set("big", &vec![0u8; 2 << 20]).is_err());
    assert_eq!(good.get("k", SHORT).unwrap(), b"v");
    good.set("k2", b"still serving").unwrap();
    assert_eq!(good.get("k2", SHORT).unwrap(), b"still serving");
}

#[test]
fn a_store_server_that_goes_away_is_an_error_not_a_hang() {
    let server = TcpStoreServer::bind("127.0.0.1:0", "tok").unwrap();
    let c = TcpStore::connect(server.addr(), "tok", Duration::from_secs(5)).unwrap();
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        (c.get("never", Duration::from_secs(30)), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    drop(server);
    let (r, took) = waiter.join().unwrap();
    assert!(matches!(r, Err(Error::Io { .. })), "{r:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}
