//! Options of communicators and of single operations, with their `FERROCOMM_*` defaults.

use crate::bootstrap::Store;
use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// Reads `FERROCOMM_<name>`; a set but malformed value is an error, never silently ignored.
pub(crate) fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::Config(format!("{name}={v:?} cannot be parsed"))),
        Err(_) => Ok(None),
    }
}

/// Reads an on/off `FERROCOMM_<name>`: `1`/`0` (or `true`/`false`); unset is off.
pub(crate) fn env_flag(name: &str) -> Result<bool> {
    match std::env::var(name).as_deref().map(str::trim) {
        Err(_) | Ok("") | Ok("0") | Ok("false") => Ok(false),
        Ok("1") | Ok("true") => Ok(true),
        Ok(other) => Err(Error::Config(format!("{name}={other:?}: expected 1 or 0"))),
    }
}

/// The default timeout of every blocking operation: `FERROCOMM_TIMEOUT` seconds, else 600 s.
pub fn default_timeout() -> Result<Duration> {
    let secs: f64 = env_parse("FERROCOMM_TIMEOUT")?.unwrap_or(600.0);
    if !(secs > 0.0 && secs.is_finite()) {
        return Err(Error::Config(format!(
            "FERROCOMM_TIMEOUT={secs} must be a positive number of seconds"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// What carries window operations to ranks on other hosts (`FERROCOMM_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetTransport {
    /// RDMA where the library has the `rdma` feature and a device with an active port opens,
    /// else TCP (the default).
    Auto,
    Tcp,
    /// RDMA verbs or an error saying why not.
    Rdma,
}

/// How ranks reach each other (CPU backend).
#[derive(Clone, Debug)]
pub struct TransportOptions {
    /// Bytes of each shared-memory ring between two ranks (power of two, ≥ 4 KiB).
    /// `FERROCOMM_SHM_RING_BYTES`, default 1 MiB.
    pub shm_ring_bytes: usize,
    /// Use TCP even between ranks of one host (`FERROCOMM_TRANSPORT=tcp`).
    pub force_tcp: bool,
    /// Window operations toward other hosts (`FERROCOMM_NET=auto|tcp|rdma`, default auto).
    pub net: NetTransport,
    /// Address to bind TCP links on (`FERROCOMM_SOCKET_ADDR`); default: the address this host
    /// uses to reach the store.
    pub bind_addr: Option<IpAddr>,
}

impl TransportOptions {
    pub fn from_env() -> Result<TransportOptions> {
        let shm_ring_bytes = env_parse("FERROCOMM_SHM_RING_BYTES")?.unwrap_or(1 << 20);
        let force_tcp = match std::env::var("FERROCOMM_TRANSPORT").as_deref() {
            Ok("tcp") => true,
            Ok("auto") | Ok("") | Err(_) => false,
            Ok(other) => {
                return Err(Error::Config(format!(
                    "FERROCOMM_TRANSPORT={other:?}: expected `auto` or `tcp`"
                )))
            }
        };
        let net = match std::env::var("FERROCOMM_NET").as_deref() {
            Ok("auto") | Ok("") | Err(_) => NetTransport::Auto,
            Ok("tcp") => NetTransport::Tcp,
            Ok("rdma") => NetTransport::Rdma,
            Ok(other) => {
                return Err(Error::Config(format!(
                    "FERROCOMM_NET={other:?}: expected `auto`, `tcp` or `rdma`"
                )))
            }
        };
        let t = TransportOptions {
            shm_ring_bytes,
            force_tcp,
            net,
            bind_addr: env_parse("FERROCOMM_SOCKET_ADDR")?,
        };
        t.validate()?;
        Ok(t)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let r = self.shm_ring_bytes;
        if !r.is_power_of_two() || r < 4096 {
            return Err(Error::Config(format!(
                "shm ring size {r} must be a power of two of at least 4096"
            )));
        }
        Ok(())
    }
}

/// Options of a communicator.
#[derive(Clone)]
pub struct CommOptions {
    /// Default timeout of every operation (`FERROCOMM_TIMEOUT`, default 600 s).
    pub timeout: Duration,
    /// The store to rendezvous through; default: from the environment (see `bootstrap`).
    pub store: Option<Arc<dyn Store>>,
    /// This rank and the world size; default: from the launcher's environment variables.
    pub rank: Option<usize>,
    pub size: Option<usize>,
    /// Backend-specific settings, as strings.
    pub hints: BTreeMap<String, String>,
    pub transport: TransportOptions,
    /// Before every operation, check across ranks that all of them are making the same call
    /// with matching sizes, and fail it with `Error::Mismatch` otherwise
    /// (`FERROCOMM_CHECK_CALLS=1`, default off: it costs small exchanges before each call).
    /// For backends that cannot see a mismatch themselves, such as NCCL.
    pub check_calls: bool,
}

impl CommOptions {
    /// Defaults, read from the environment.
    pub fn from_env() -> Result<CommOptions> {
        Ok(CommOptions {
            timeout: default_timeout()?,
            store: None,
            rank: None,
            size: None,
            hints: BTreeMap::new(),
            transport: TransportOptions::from_env()?,
            check_calls: env_flag("FERROCOMM_CHECK_CALLS")?,
        })
    }

    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn with_store(mut self, store: Arc<dyn Store>, rank: usize, size: usize) -> Self {
        self.store = Some(store);
        self.rank = Some(rank);
        self.size = Some(size);
        self
    }

    pub fn with_check_calls(mut self, on: bool) -> Self {
        self.check_calls = on;
        self
    }

    pub fn with_hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
}

/// Options of one operation.
#[derive(Clone, Debug, Default)]
pub struct OpOptions {
    /// Overrides the communicator's timeout for this operation.
    pub timeout: Option<Duration>,
    /// Backend hints, e.g. `algorithm = direct | ring` on the CPU backend.
    pub hints: BTreeMap<String, String>,
}

impl OpOptions {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
}
