//! The rendezvous store contract: the key-value store every rank of a job meets through. Its
//! implementations (memory, prefix, file, TCP with a job token) live in crate::bootstrap.

use crate::contracts::error::Result;
use std::net::IpAddr;
use std::time::Duration;

/// A rendezvous store, shared by every rank of a job. Blocking calls take a timeout and end in
/// `Error::StoreTimeout` naming the key they waited for.
///
/// ```
/// use ferrocomm::{MemoryStore, PrefixStore, Store};
/// use std::{sync::Arc, time::Duration};
///
/// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
/// let job = PrefixStore::new("job7", store.clone());
/// job.set("addr", b"10.0.0.1:4000")?;
/// assert_eq!(store.get("job7/addr", Duration::from_secs(1))?, b"10.0.0.1:4000");
/// assert_eq!(job.add("arrived", 1)?, 1);
/// assert_eq!(job.add("arrived", 1)?, 2);
/// let err = job.get("never", Duration::from_millis(10)).unwrap_err();
/// assert!(matches!(err, ferrocomm::Error::StoreTimeout { .. }), "{err}");
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any earlier value, and wakes its waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` exists, then returns its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Adds `delta` to the integer stored at `key` (0 when absent) and returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Sets `key` to `desired` if its value is `expected` (an absent key matches an empty
    /// `expected`); returns the value after the call.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Removes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;
    /// Waits until every key exists.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Waits until every key exists, then returns their values in the order of `keys`: one
    /// round trip to a store server where `get` per key would take one each (how ranks read
    /// every peer's set-up data at once). The default waits, then gets each key.
    fn get_many(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait(keys, timeout)?;
        keys.iter().map(|k| self.get(k, timeout)).collect()
    }
    /// An address of this host that other ranks can reach (used to bind TCP links).
    fn local_addr_hint(&self) -> Option<IpAddr> {
        None
    }
    /// A 32-byte key for `label` (a [`PrefixStore`](crate::PrefixStore) puts its prefix in
    /// front), derived (HKDF-SHA256) from a secret that only this job's ranks hold: the job token
    /// of a TCP store, or of a file store given one, the private random key of an in-memory
    /// store. Communicators key their links and windows with it, so no secret ever travels or is
    /// stored as a value. `None` where the store holds no secret (the default): then rank 0
    /// makes a random key and publishes it as a store value, which is only as private as the
    /// store's contents. `Err` when the OS generator fails.
    fn derive_secret(&self, label: &str) -> Result<Option<[u8; 32]>> {
        let _ = label;
        Ok(None)
    }
}
