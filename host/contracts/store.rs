//! The rendezvous store contract: the key-value store every rank of a job meets through. Its
//! implementations (memory, prefix, file, TCP with a job token) live in crate::bootstrap.

use crate::contracts::error::Result;
use std::net::IpAddr;
use std::time::Duration;

/// A rendezvous store, shared by every rank of a job. Blocking calls take a timeout and end in
/// `Error::Timeout` naming the key they waited for.
pub trait Store: Send + Sync {
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
    /// An address of this host that other ranks can reach (used to bind TCP links).
    fn local_addr_hint(&self) -> Option<IpAddr> {
        None
    }
}
