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
    (0..size).map(|r| store.get(&format!("{key}/{r}"), timeout)).collect()
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
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Set by `fail`: every blocking call ends with this reason.
    failed: Mutex<Option<String>>,
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
    pub(crate) fn set(&self, key: &str, value: &[u8]) {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        m.insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
    }

    /// Waits until every key exists or `deadline` passes; returns the first missing key.
    /// Ends every blocking call, now and later, with `reason`. Lock order: `failed` is never
    /// held while `map` is taken here, so it cannot invert `wait_keys`' map-then-failed.
    pub(crate) fn fail(&self, reason: &str) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_owned());
        let _m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        self.changed.notify_all();
    }

    pub(crate) fn wait_keys(&self, keys: &[&str], deadline: Instant) -> std::result::Result<(), WaitFail> {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let Some(missing) = keys.iter().find(|k| !m.contains_key(**k)) else {
                return Ok(());
            };
            if let Some(reason) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
                return Err(WaitFail::Failed(reason));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitFail::Missing((*missing).to_owned()));
            }
            m = self
                .changed
                .wait_timeout(m, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub(crate) fn get(&self, key: &str, deadline: Instant) -> std::result::Result<Vec<u8>, WaitFail> {
        self.wait_keys(&[key], deadline)?;
        let m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        Ok(m.get(key).cloned().unwrap_or_default())
    }

    pub(crate) fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let v = parse_counter("store add", key, m.get(key))?.wrapping_add(delta);
        m.insert(key.to_owned(), v.to_string().into_bytes());
        self.changed.notify_all();
        Ok(v)
    }

    pub(crate) fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Vec<u8> {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let matches = match m.get(key) {
            None => expected.is_empty(),
            Some(cur) => cur == expected,
        };
        if matches {
            m.insert(key.to_owned(), desired.to_vec());
            self.changed.notify_all();
        }
        m.get(key).cloned().unwrap_or_default()
    }

    pub(crate) fn delete(&self, key: &str) -> bool {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        m.remove(key).is_some()
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
    fn local_addr_hint(&self) -> Option<IpAddr> {
        Some(IpAddr::from([127, 0, 0, 1]))
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
    fn local_addr_hint(&self) -> Option<IpAddr> {
        self.inner.local_addr_hint()
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
