//! The key-value store ranks rendezvous through, and the two stores that need no server:
//! an in-memory one (in-process groups) and a prefix view (one namespace per communicator).

use crate::contracts::error::{Error, Result};
use crate::contracts::record;
use crate::contracts::store::Store;
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Publishes `value` as `{key}/{rank}` and returns every rank's value, in rank order (ours
/// included): the store's all-gather for set-up data.
pub(crate) fn all_gather(
    store: &dyn Store,
    key: &str,
    rank: usize,
    size: usize,
    value: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    store.set(&format!("{key}/{rank}"), value)?;
    let keys: Vec<String> = (0..size).map(|r| format!("{key}/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.get_many(&refs, timeout)
}

/// [`all_gather`] of a serde record (contracts/record.rs): every rank's, in rank order. A record that does
/// not decode is a protocol error of `context` naming its rank.
pub(crate) fn all_gather_records<T: serde::Serialize + serde::de::DeserializeOwned>(
    store: &dyn Store,
    key: &str,
    rank: usize,
    size: usize,
    mine: &T,
    context: &'static str,
    timeout: Duration,
) -> Result<Vec<T>> {
    let encoded = record::encode(mine).map_err(|e| Error::protocol(context, e))?;
    all_gather(store, key, rank, size, &encoded, timeout)?
        .iter()
        .enumerate()
        .map(|(r, raw)| record::decode(raw).map_err(|e| Error::protocol(context, format!("rank {r}'s record: {e}"))))
        .collect()
}

fn parse_counter(op: &'static str, key: &str, v: Option<&Vec<u8>>) -> Result<i64> {
    match v {
        None => Ok(0),
        Some(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::invalid(op, format!("value at `{key}` is not an integer"))),
    }
}

/// The shared state of a store, usable by any front end (memory store, TCP store server).
#[derive(Default)]
pub(crate) struct Table {
    state: Mutex<State>,
    /// Set by `fail`: every blocking call ends with this reason.
    failed: Mutex<Option<String>>,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// The waiters of each absent key. A waiter counts its absent keys and is woken only when
    /// the last one arrives, so a thousand ranks waiting for a thousand keys cost a million
    /// decrements rather than a million wake-ups (one condition variable for all would wake
    /// every waiter at every key, and each would scan its keys again).
    interest: HashMap<String, Vec<Arc<Waiter>>>,
}

struct Waiter {
    /// Keys of this wait still absent; changed only under the state lock.
    missing: std::sync::atomic::AtomicUsize,
    woken: Condvar,
}

impl State {
    /// After `key` was written: counts it off for its waiters, waking those it completes.
    fn arrived(&mut self, key: &str) {
        let Some(waiters) = self.interest.remove(key) else {
            return;
        };
        for w in waiters {
            if w.missing.fetch_sub(1, std::sync::atomic::Ordering::Relaxed) == 1 {
                w.woken.notify_one();
            }
        }
    }

    /// Removes `w` from the waiters of `keys` (it gave up).
    fn forget(&mut self, keys: &[&str], w: &Arc<Waiter>) {
        for k in keys {
            if let Some(v) = self.interest.get_mut(*k) {
                v.retain(|x| !Arc::ptr_eq(x, w));
                if v.is_empty() {
                    self.interest.remove(*k);
                }
            }
        }
    }
}

/// Why a blocking store call ended without its keys.
pub(crate) enum WaitFail {
    Missing(String),
    Failed(String),
}

impl WaitFail {
    pub(crate) fn into_error(self, after: Duration) -> Error {
        match self {
            WaitFail::Missing(key) => timeout_err(&key, after),
            WaitFail::Failed(reason) => Error::StoreClosed(reason),
        }
    }
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set(&self, key: &str, value: &[u8]) {
        let mut st = self.lock();
        st.map.insert(key.to_owned(), value.to_vec());
        st.arrived(key);
    }

    /// Ends every blocking call, now and later, with `reason`. Lock order: `failed` is never
    /// held while the state is taken here, so it cannot invert `wait_keys`' state-then-failed.
    pub(crate) fn fail(&self, reason: &str) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_owned());
        let st = self.lock();
        for w in st.interest.values().flatten() {
            w.woken.notify_one();
        }
    }

    /// Waits until every key exists or `deadline` passes; returns the first missing key.
    pub(crate) fn wait_keys(&self, keys: &[&str], deadline: Instant) -> std::result::Result<(), WaitFail> {
        let st = self.lock();
        self.wait_locked(st, keys, deadline).map(drop)
    }

    /// `wait_keys`, returning the state lock still held once every key exists.
    fn wait_locked<'t>(
        &'t self,
        mut st: std::sync::MutexGuard<'t, State>,
        keys: &[&str],
        deadline: Instant,
    ) -> std::result::Result<std::sync::MutexGuard<'t, State>, WaitFail> {
        let absent: Vec<&str> = keys.iter().copied().filter(|k| !st.map.contains_key(*k)).collect();
        if absent.is_empty() {
            return Ok(st);
        }
        let w = Arc::new(Waiter {
            missing: absent.len().into(),
            woken: Condvar::new(),
        });
        for k in &absent {
            st.interest.entry((*k).to_owned()).or_default().push(w.clone());
        }
        loop {
            if w.missing.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                return Ok(st);
            }
            if let Some(reason) = self.failure() {
                st.forget(&absent, &w);
                return Err(WaitFail::Failed(reason));
            }
            let now = Instant::now();
            if now >= deadline {
                st.forget(&absent, &w);
                let missing = absent.iter().find(|k| !st.map.contains_key(**k)).unwrap_or(&absent[0]);
                return Err(WaitFail::Missing((*missing).to_owned()));
            }
            st = w
                .woken
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub(crate) fn get(&self, key: &str, deadline: Instant) -> std::result::Result<Vec<u8>, WaitFail> {
        let st = self.wait_locked(self.lock(), &[key], deadline)?;
        Ok(st.map.get(key).cloned().unwrap_or_default())
    }

    /// Every key's value, in order, once all exist.
    pub(crate) fn get_many(&self, keys: &[&str], deadline: Instant) -> std::result::Result<Vec<Vec<u8>>, WaitFail> {
        let st = self.wait_locked(self.lock(), keys, deadline)?;
        Ok(keys
            .iter()
            .map(|k| st.map.get(*k).cloned().unwrap_or_default())
            .collect())
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut st = self.lock();
        let v = parse_counter("store add", key, st.map.get(key))?.wrapping_add(delta);
        st.map.insert(key.to_owned(), v.to_string().into_bytes());
        st.arrived(key);
        Ok(v)
    }

    pub(crate) fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Vec<u8> {
        let mut st = self.lock();
        let matches = match st.map.get(key) {
            None => expected.is_empty(),
            Some(cur) => cur == expected,
        };
        if matches {
            st.map.insert(key.to_owned(), desired.to_vec());
            st.arrived(key);
        }
        st.map.get(key).cloned().unwrap_or_default()
    }

    pub(crate) fn delete(&self, key: &str) -> bool {
        self.lock().map.remove(key).is_some()
    }
}

pub(crate) fn timeout_err(key: &str, after: Duration) -> Error {
    Error::StoreTimeout {
        key: key.to_owned(),
        after,
    }
}

/// A store in this process's memory, for in-process groups and tests.
#[derive(Default, Clone)]
pub struct MemoryStore {
    table: Arc<Table>,
    /// The random key its secrets derive from, made when first needed; shared by clones.
    root: Arc<Mutex<Option<[u8; 32]>>>,
}

impl MemoryStore {
    /// An empty store; clones share its contents.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Ends every current and later blocking call with `Error::StoreClosed(reason)`: how an
    /// in-process group tells its other ranks that one rank cannot join.
    pub fn fail(&self, reason: &str) {
        self.table.fail(reason);
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.table.set(key, value);
        Ok(())
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.table
            .get(key, Instant::now() + timeout)
            .map_err(|f| f.into_error(timeout))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.table.add(key, delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        Ok(self.table.compare_set(key, expected, desired))
    }
    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.table.delete(key))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.table
            .wait_keys(keys, Instant::now() + timeout)
            .map_err(|f| f.into_error(timeout))
    }
    fn get_many(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.table
            .get_many(keys, Instant::now() + timeout)
            .map_err(|f| f.into_error(timeout))
    }
    fn local_addr_hint(&self) -> Option<IpAddr> {
        Some(IpAddr::from([127, 0, 0, 1]))
    }
    fn derive_secret(&self, label: &str) -> Result<Option<[u8; 32]>> {
        let mut root = self.root.lock().unwrap_or_else(|p| p.into_inner());
        let root = match *root {
            Some(r) => r,
            None => *root.insert(super::auth::nonce()?),
        };
        Ok(Some(super::auth::derive(&root, label.as_bytes())))
    }
}

/// A view of another store with every key under `prefix/`.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Views `inner` with every key `k` stored as `prefix/k`: how communicators and their
    /// sub-communicators share one job store without their keys meeting.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn key(&self, k: &str) -> String {
        format!("{}/{}", self.prefix, k)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
    fn get_many(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.get_many(&refs, timeout)
    }
    fn local_addr_hint(&self) -> Option<IpAddr> {
        self.inner.local_addr_hint()
    }
    fn derive_secret(&self, label: &str) -> Result<Option<[u8; 32]>> {
        self.inner.derive_secret(&self.key(label))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_decode_in_rank_order_and_a_bad_one_names_its_rank() {
        let store = MemoryStore::new();
        let t = Duration::from_secs(1);
        store
            .set("k/1", &record::encode(&(7u32, "b".to_string())).unwrap())
            .unwrap();
        let all = all_gather_records(&store, "k", 0, 2, &(3u32, "a".to_string()), "test", t).unwrap();
        assert_eq!(all, vec![(3, "a".to_string()), (7, "b".to_string())]);

        store.set("bad/1", &[0xff]).unwrap();
        let err = all_gather_records(&store, "bad", 0, 2, &(3u32, "a".to_string()), "test", t).unwrap_err();
        assert!(
            matches!(err, Error::Protocol { context: "test", ref reason } if reason.starts_with("rank 1's record")),
            "{err}"
        );
    }
}
