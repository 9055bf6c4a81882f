//! Options of communicators and of single operations, with their `FERROCOMM_*` defaults.

use crate::contracts::config::Config;
pub use crate::contracts::config::{AbortOnError, Encrypt, NetTransport};
use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// The default timeout of every blocking operation: `FERROCOMM_TIMEOUT` seconds, else 600 s.
/// Reads the whole environment's settings afresh (every `FERROCOMM_*` variable), so any
/// malformed variable is an `Error::Config` here too.
pub fn default_timeout() -> Result<Duration> {
    Ok(Config::from_env()?.timeout)
}

/// How ranks reach each other (CPU backend).
#[derive(Clone, Debug)]
pub struct TransportOptions {
    /// Bytes of each shared-memory ring between two ranks (power of two, ≥ 4 KiB).
    /// `FERROCOMM_SHM_RING_BYTES`, default 1 MiB.
    pub shm_ring_bytes: usize,
    /// Messages between ranks of one host of at least this many bytes go by reference: the
    /// receiver copies them straight out of the sender's memory (`process_vm_readv`), one copy
    /// instead of two, where the kernel allows it. `FERROCOMM_SHM_PULL_BYTES`; 0: never; else
    /// at least 4096. `None`: never where that copy measures slow on this host (timed once per
    /// process against a plain copy), else 16 KiB, or 64 KiB where the ranks on the host
    /// outnumber its CPUs (a sender waits for its receiver to copy, and there the receiver is
    /// often not running).
    pub shm_pull_bytes: Option<usize>,
    /// Payloads of at least this many bytes that the higher rank of a plain TCP link sends go
    /// on the link's second connection, so that two ranks exchanging large messages each send
    /// on a connection of its own (a TCP socket serializes its two directions). Headers,
    /// small payloads and the lower rank's payloads use the first. `FERROCOMM_TCP_BULK_BYTES`;
    /// 0: never; else at least 4096; `None`: 64 KiB. Sealed links have one connection.
    pub tcp_bulk_bytes: Option<usize>,
    /// Use TCP even between ranks of one host (`FERROCOMM_TRANSPORT=tcp`).
    pub force_tcp: bool,
    /// Window operations toward other hosts (`FERROCOMM_NET=auto|tcp|rdma`, default auto).
    pub net: NetTransport,
    /// Address to bind TCP links on (`FERROCOMM_SOCKET_ADDR`); default: the address this host
    /// uses to reach the store.
    pub bind_addr: Option<IpAddr>,
    /// Which TCP links seal their traffic (`FERROCOMM_ENCRYPT=auto|on|off`, default auto:
    /// those between machines).
    pub encrypt: Encrypt,
}

impl TransportOptions {
    /// The transport settings of a fresh read of the environment (`FERROCOMM_SHM_RING_BYTES`,
    /// `FERROCOMM_SHM_PULL_BYTES`, `FERROCOMM_TCP_BULK_BYTES`, `FERROCOMM_TRANSPORT`, `FERROCOMM_NET`,
    /// `FERROCOMM_SOCKET_ADDR`, `FERROCOMM_ENCRYPT`); `Error::Config` when any `FERROCOMM_*`
    /// variable is malformed.
    pub fn from_env() -> Result<TransportOptions> {
        TransportOptions::from_config(&Config::from_env()?)
    }

    pub(crate) fn from_config(c: &Config) -> Result<TransportOptions> {
        let t = TransportOptions {
            shm_ring_bytes: c.shm_ring_bytes,
            shm_pull_bytes: c.shm_pull_bytes,
            tcp_bulk_bytes: c.tcp_bulk_bytes,
            force_tcp: c.force_tcp,
            net: c.net,
            bind_addr: c.socket_addr,
            encrypt: c.encrypt,
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
        // A reference takes 24 bytes of the stream: a smaller message is never worth one.
        let p = self.shm_pull_bytes.unwrap_or(0);
        if p != 0 && p < 4096 {
            return Err(Error::Config(format!(
                "FERROCOMM_SHM_PULL_BYTES={p}: 0 (never) or at least 4096"
            )));
        }
        // A smaller payload is not worth a second connection's wake-up.
        let b = self.tcp_bulk_bytes.unwrap_or(0);
        if b != 0 && b < 4096 {
            return Err(Error::Config(format!(
                "FERROCOMM_TCP_BULK_BYTES={b}: 0 (never) or at least 4096"
            )));
        }
        Ok(())
    }
}

/// The hints one operation runs with: the communicator's, each overridden by the operation's
/// own value for the same key.
pub(crate) fn merge_hints(comm: &BTreeMap<String, String>, op: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut hints = comm.clone();
    hints.extend(op.iter().map(|(k, v)| (k.clone(), v.clone())));
    hints
}

/// Options of a communicator.
#[derive(Clone)]
pub struct CommOptions {
    /// Default timeout of every operation (`FERROCOMM_TIMEOUT`, default 600 s); `OpOptions`
    /// overrides it per operation. On the CPU engine it runs from the operation's first stall
    /// (a wait in which nothing moved for a few microseconds), not from the call: an operation
    /// that never stalls reads no clock.
    ///
    /// An operation that times out returns `Error::Timeout` (naming the operation and, where
    /// known, the rank it waited for). What the communicator is afterwards depends on the
    /// backend: on the CPU engine (the `cpu` backend, and host buffers of every backend) a
    /// timeout may have left a message half sent, so the communicator is *broken*: later
    /// operations return `Error::Closed` with state `"broken by an earlier failed operation"`,
    /// and peers waiting on this rank get `Error::PeerLost` naming the rank at the root. Only
    /// `finalize` or drop remain; make a new communicator to go on. With
    /// [`AbortOnError::Comm`] the communicator aborts instead (state `"aborted"`), on every
    /// backend, and [`AbortOnError::Process`] ends the process. A timeout of
    /// `Work::wait_timeout` is not an operation's failure: the
    /// operation goes on.
    pub timeout: Duration,
    /// The store to rendezvous through; default: from the environment (see `bootstrap`).
    pub store: Option<Arc<dyn Store>>,
    /// This rank; default: from the launcher's environment variables. Set together with
    /// `store` and `size` ([`with_store`](Self::with_store)).
    pub rank: Option<usize>,
    /// The world size; default: from the launcher's environment variables. Set together with
    /// `store` and `rank`.
    pub size: Option<usize>,
    /// Backend hints (`key = value` strings): the defaults of every operation's hints. An
    /// operation's own hints ([`OpOptions::hints`]) override these key by key.
    ///
    /// A hint is advice, so the rule is the same on every backend:
    /// - a key the backend does not know, or a value it knows but cannot honour for this
    ///   operation, transport or machine (`algorithm=oneshot` for a broadcast, or over TCP), is
    ///   ignored: the operation runs with the backend's own choice, and a `tracing` debug event
    ///   (`FERROCOMM_LOG=debug`) names the hint, the operation and why;
    /// - a value the backend does not know for a key it reads (`algorithm=banana`) is
    ///   `Error::InvalidArgument` naming the operation and listing the accepted values, before
    ///   any byte moves (the communicator stays usable).
    ///
    /// Hints must be the same on every rank: they may pick the algorithm every rank runs.
    /// The README lists each backend's hints.
    pub hints: BTreeMap<String, String>,
    /// How ranks reach each other (shared-memory ring size, TCP, the network path of
    /// windows); from the `FERROCOMM_*` transport variables.
    pub transport: TransportOptions,
    /// Before every operation, check across ranks that all of them are making the same call
    /// with matching sizes, and fail it with `Error::Mismatch` otherwise
    /// (`FERROCOMM_CHECK_CALLS=1`, default off: it costs small exchanges before each call).
    /// For backends that cannot see a mismatch themselves, such as NCCL.
    pub check_calls: bool,
    /// What a failed operation does to the communicator, or to the process
    /// (`FERROCOMM_ABORT_ON_ERROR`, default off). See [`AbortOnError`].
    pub abort_on_error: AbortOnError,
    /// The environment's settings as `from_env` read them: the defaults above came from it,
    /// and the backends take the rest of theirs (store, tuning, device paths) from it.
    pub(crate) config: Arc<Config>,
}

impl CommOptions {
    /// Defaults, read from the environment (afresh on every call: a variable set since the
    /// last call counts).
    pub fn from_env() -> Result<CommOptions> {
        crate::contracts::config::warn_unknown_once();
        let config = Arc::new(Config::from_env()?);
        Ok(CommOptions {
            timeout: config.timeout,
            store: None,
            rank: None,
            size: None,
            hints: BTreeMap::new(),
            transport: TransportOptions::from_config(&config)?,
            check_calls: config.check_calls,
            abort_on_error: config.abort_on_error,
            config,
        })
    }

    /// Sets the default timeout of every operation (see [`CommOptions::timeout`]).
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Rendezvous through `store` as rank `rank` of `size`, instead of the launcher's
    /// environment: every rank passes the same store (shared memory, a directory, a TCP
    /// server) and its own rank.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    /// use ferrocomm::{MemoryStore, Store};
    /// use std::sync::Arc;
    ///
    /// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    /// let totals = std::thread::scope(|s| {
    ///     let ranks: Vec<_> = (0..2)
    ///         .map(|rank| {
    ///             let store = store.clone();
    ///             s.spawn(move || -> ferrocomm::Result<u32> {
    ///                 let opts = CommOptions::from_env()?.with_store(store, rank, 2);
    ///                 let comm = new_comm("cpu", Device::Cpu, "stored", opts)?;
    ///                 let mut x = [rank as u32 + 1];
    ///                 comm.all_reduce(&mut x[..], ReduceOp::Sum)?;
    ///                 Ok(x[0])
    ///             })
    ///         })
    ///         .collect();
    ///     ranks.into_iter().map(|h| h.join().unwrap()).collect::<ferrocomm::Result<Vec<_>>>()
    /// })?;
    /// assert_eq!(totals, [3, 3]);
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn with_store(mut self, store: Arc<dyn Store>, rank: usize, size: usize) -> Self {
        self.store = Some(store);
        self.rank = Some(rank);
        self.size = Some(size);
        self
    }

    /// Sets [`CommOptions::check_calls`]: compare every call across ranks before it runs.
    pub fn with_check_calls(mut self, on: bool) -> Self {
        self.check_calls = on;
        self
    }

    /// Sets a default hint of every operation (see [`CommOptions::hints`]).
    pub fn with_hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }

    /// See [`AbortOnError`].
    pub fn with_abort_on_error(mut self, mode: AbortOnError) -> Self {
        self.abort_on_error = mode;
        self
    }
}

/// Options of one operation.
#[derive(Clone, Debug, Default)]
pub struct OpOptions {
    /// Overrides the communicator's timeout for this operation.
    pub timeout: Option<Duration>,
    /// Backend hints, e.g. `algorithm = direct | ring` on the CPU backend. They override the
    /// communicator's hints ([`CommOptions::hints`], which also says how backends treat hints
    /// they do not know or cannot honour) key by key, for this operation only.
    pub hints: BTreeMap<String, String>,
}

impl OpOptions {
    /// No timeout of its own, no hints: the communicator's.
    pub fn new() -> Self {
        Self::default()
    }

    /// This operation's timeout instead of the communicator's.
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    /// Sets a hint for this operation, over the communicator's hint of the same key (see
    /// [`CommOptions::hints`]).
    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_or_bulk_threshold_below_a_page_is_refused() {
        let base = TransportOptions::from_config(&Config::from_lookup(|_| None).unwrap()).unwrap();
        type Field = fn(&mut TransportOptions) -> &mut Option<usize>;
        let fields: [(&str, Field); 2] = [
            ("FERROCOMM_SHM_PULL_BYTES", |t| &mut t.shm_pull_bytes),
            ("FERROCOMM_TCP_BULK_BYTES", |t| &mut t.tcp_bulk_bytes),
        ];
        for (name, field) in fields {
            for (p, ok) in [(0, true), (100, false), (4095, false), (4096, true), (1 << 20, true)] {
                let mut t = base.clone();
                *field(&mut t) = Some(p);
                match t.validate() {
                    Ok(()) => assert!(ok, "{name}={p} passed"),
                    Err(Error::Config(m)) => assert!(!ok && m.contains(name), "{name}={p}: {m}"),
                    Err(e) => panic!("{name}={p}: {e}"),
                }
            }
        }
    }

    #[test]
    fn operation_hints_override_the_communicators_key_by_key() {
        let comm = BTreeMap::from([("algorithm".to_string(), "ring".to_string()), ("a".into(), "1".into())]);
        let op = BTreeMap::from([
            ("algorithm".to_string(), "direct".to_string()),
            ("b".into(), "2".into()),
        ]);
        let merged = merge_hints(&comm, &op);
        assert_eq!(merged["algorithm"], "direct");
        assert_eq!((merged["a"].as_str(), merged["b"].as_str()), ("1", "2"));
        assert_eq!(merge_hints(&comm, &BTreeMap::new()), comm);
    }

    #[test]
    fn abort_on_error_parses_its_three_modes_and_refuses_others() {
        assert_eq!("off".parse(), Ok(AbortOnError::Off));
        assert_eq!("".parse(), Ok(AbortOnError::Off));
        assert_eq!(" Comm ".parse(), Ok(AbortOnError::Comm));
        assert_eq!("process".parse(), Ok(AbortOnError::Process));
        let e = "always".parse::<AbortOnError>().unwrap_err();
        assert!(e.contains("always") && e.contains("process"), "{e}");
    }

    #[test]
    fn abort_on_error_acts_on_communication_failures_only() {
        let timeout = Error::Timeout {
            op: "barrier",
            peer: Some(1),
            after: Duration::from_secs(1),
        };
        let lost = Error::PeerLost {
            op: "barrier",
            peer: 1,
            reason: "gone".into(),
        };
        let argument = Error::invalid("all_reduce", "hint algorithm=\"banana\"");
        let closed = Error::Closed {
            op: "barrier",
            state: "aborted",
        };
        for mode in [AbortOnError::Comm, AbortOnError::Process] {
            assert!(mode.acts_on(&timeout) && mode.acts_on(&lost));
            assert!(!mode.acts_on(&argument) && !mode.acts_on(&closed));
        }
        assert!(!AbortOnError::Off.acts_on(&timeout));
    }
}
