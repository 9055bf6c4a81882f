//! The stores keep one contract (memory, file, TCP, prefix); the TCP store admits only clients
//! that prove the job token and survives malformed and oversized frames.

use ferrocomm::{Error, FileStore, MemoryStore, PrefixStore, Store, TcpStore, TcpStoreServer};
use std::io::Write;
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
