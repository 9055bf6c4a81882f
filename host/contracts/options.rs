//! Options of communicators and of single operations, with their `FERROCOMM_*` defaults.

use crate::contracts::error::{Error, Result};
use crate::contracts::store::Store;
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

/// What a communicator does when one of its operations fails in communication: `Timeout`,
/// `PeerLost`, `Mismatch`, `Protocol`, `Backend` or `Io` (`FERROCOMM_ABORT_ON_ERROR`, default
/// `off`). Argument errors (`InvalidArgument`, `SizeMismatch`, ...) never trigger it: they are
/// found before any byte moves and leave the communicator usable. Like torchcomms' abort on
/// timeout or error, it makes a job fail fast instead of leaving its peers to wait out their
/// own timeouts.
///
/// It applies to every collective and point-to-point call (synchronous or asynchronous: an
/// asynchronous one aborts on the worker thread as soon as it fails, before its `Work` is
/// waited for), on every backend; not to window operations. A failure that a GPU backend
/// learns of later (a kernel that gave up is reported by the next call) acts at that call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AbortOnError {
    /// Only the operation fails. What the communicator is afterwards is the backend's rule
    /// (the CPU engine refuses later operations; see [`CommOptions::timeout`]).
    #[default]
    Off,
    /// The communicator aborts before the error is returned, as `Comm::abort`
    /// does: peers waiting on this rank get `Error::PeerLost` at once, and this rank's later
    /// operations fail with `Error::Closed` (state `"aborted"`).
    Comm,
    /// As `Comm`, then the error is logged (`tracing::error!` and one line on stderr) and the
    /// process exits with status 70 ([`AbortOnError::EXIT_CODE`], `EX_SOFTWARE`) through
    /// `std::process::exit`: no unwinding, other threads stop where they are. For jobs whose
    /// launcher should see a failed rank at once.
    Process,
}

impl std::str::FromStr for AbortOnError {
    type Err = String;
    /// `off`, `comm` or `process` (case-insensitive); `0` and `1` mean `off` and `comm`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "off" | "0" | "false" => Ok(AbortOnError::Off),
            "comm" | "1" | "true" => Ok(AbortOnError::Comm),
            "process" => Ok(AbortOnError::Process),
            other => Err(format!("{other:?}: expected `off`, `comm` or `process`")),
        }
    }
}

impl AbortOnError {
    /// The exit status of [`AbortOnError::Process`]: `EX_SOFTWARE` of sysexits.h.
    pub const EXIT_CODE: i32 = 70;

    /// `FERROCOMM_ABORT_ON_ERROR`, `off` when unset.
    pub fn from_env() -> Result<AbortOnError> {
        match std::env::var("FERROCOMM_ABORT_ON_ERROR") {
            Err(_) => Ok(AbortOnError::Off),
            Ok(v) => v
                .parse()
                .map_err(|why| Error::Config(format!("FERROCOMM_ABORT_ON_ERROR={why}"))),
        }
    }

    /// Whether `e`, returned by an operation, is a failure of communication that this mode
    /// acts on (rather than an argument error or an already closed communicator).
    pub(crate) fn acts_on(self, e: &Error) -> bool {
        self != AbortOnError::Off
            && matches!(
                e,
                Error::Timeout { .. }
                    | Error::PeerLost { .. }
                    | Error::Mismatch { .. }
                    | Error::Protocol { .. }
                    | Error::Backend { .. }
                    | Error::Io { .. }
            )
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
    /// overrides it per operation.
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
    /// This rank and the world size; default: from the launcher's environment variables.
    pub rank: Option<usize>,
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
    pub transport: TransportOptions,
    /// Before every operation, check across ranks that all of them are making the same call
    /// with matching sizes, and fail it with `Error::Mismatch` otherwise
    /// (`FERROCOMM_CHECK_CALLS=1`, default off: it costs small exchanges before each call).
    /// For backends that cannot see a mismatch themselves, such as NCCL.
    pub check_calls: bool,
    /// What a failed operation does to the communicator, or to the process
    /// (`FERROCOMM_ABORT_ON_ERROR`, default off). See [`AbortOnError`].
    pub abort_on_error: AbortOnError,
}

impl CommOptions {
    /// Defaults, read from the environment.
    pub fn from_env() -> Result<CommOptions> {
        crate::contracts::config::warn_unknown_once();
        Ok(CommOptions {
            timeout: default_timeout()?,
            store: None,
            rank: None,
            size: None,
            hints: BTreeMap::new(),
            transport: TransportOptions::from_env()?,
            check_calls: env_flag("FERROCOMM_CHECK_CALLS")?,
            abort_on_error: AbortOnError::from_env()?,
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
