//! Every setting ferrocomm takes from the environment, read in one place: the table of its
//! `FERROCOMM_*` variables, the typed [`Config`] parsed from them (with the other variables
//! ferrocomm looks at, such as `CUDA_HOME` and the launchers' rank variables), and the warning
//! for a `FERROCOMM_*` variable that is none of them (most often a typo, which would otherwise
//! be ignored in silence). The README's table lists the same names; a unit test holds the two
//! together, and another checks that no other file of the library reads the environment.
//!
//! Where each setting goes: per-communicator ones travel in `CommOptions` (built by
//! `CommOptions::from_env`, which reads a fresh `Config`) down to the backends; process-wide
//! ones (library paths, CUDA's queue count, the window proxies' polling) come from
//! [`current`], read once, when first needed.

use crate::contracts::error::{Error, Result};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Every `FERROCOMM_*` variable the library, its binaries and its build read. The library's
/// own are fields of [`Config`]; `FERROCOMM_RUN_GRACE` and `FERROCOMM_RUN_TOLERATE_FAILURES`
/// belong to the launcher, `FERROCOMM_REQUIRE_*` to the build and the tests.
pub(crate) const VARIABLES: [&str; 31] = [
    "FERROCOMM_TIMEOUT",
    "FERROCOMM_ABORT_ON_ERROR",
    "FERROCOMM_CHECK_CALLS",
    "FERROCOMM_TOKEN",
    "FERROCOMM_STORE",
    "FERROCOMM_STORE_EXTERNAL",
    "FERROCOMM_RUN_GRACE",
    "FERROCOMM_RUN_TOLERATE_FAILURES",
    "FERROCOMM_TRANSPORT",
    "FERROCOMM_SHM_RING_BYTES",
    "FERROCOMM_SHM_PULL_BYTES",
    "FERROCOMM_TCP_BULK_BYTES",
    "FERROCOMM_SOCKET_ADDR",
    "FERROCOMM_NET",
    "FERROCOMM_ENCRYPT",
    "FERROCOMM_MULTICAST",
    "FERROCOMM_PROXY_AFFINITY",
    "FERROCOMM_PROXY_POLL_US",
    "FERROCOMM_CPU_DIRECT_MAX",
    "FERROCOMM_CPU_CHUNK",
    "FERROCOMM_LOG",
    "FERROCOMM_NVRTC_PATH",
    "FERROCOMM_NCCL_PATH",
    "FERROCOMM_NCCL",
    "FERROCOMM_NCCL_THRESHOLD",
    "FERROCOMM_DEVICE_ONESHOT_MAX",
    "FERROCOMM_DEVICE_TWOSHOT_MIN",
    "FERROCOMM_REQUIRE_NVCC",
    "FERROCOMM_REQUIRE_NVRTC",
    "FERROCOMM_REQUIRE_NCCL",
    "FERROCOMM_REQUIRE_GPU",
];

/// Variables the project's own tests set for their child processes (README, "Tests").
const TEST_PREFIXES: [&str; 5] = [
    "FERROCOMM_TEST_",
    "FERROCOMM_FAULT_",
    "FERROCOMM_INTEGRITY_",
    "FERROCOMM_RELIABILITY_",
    "FERROCOMM_EXAMPLE_",
];

/// The other variables ferrocomm reads, so that those reads go through [`Config`] too: the
/// CUDA toolkit and its hardware queues, the NCCL search (Python environments), the host
/// device's C++ compiler, the descriptor socket's folder, and the launchers' rank variables
/// (bootstrap's rank discovery; a unit test there checks this list holds all of them).
pub(crate) const OTHER_VARIABLES: [&str; 25] = [
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PYTHONPATH",
    "HOME",
    "CC",
    "CXX",
    "XDG_RUNTIME_DIR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
];

/// The settings of the environment, typed: one field per `FERROCOMM_*` variable the library
/// reads, with its default where unset, and the raw values of every variable in
/// [`VARIABLES`] and [`OTHER_VARIABLES`] as they were when it was read.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// `FERROCOMM_TIMEOUT`: seconds, positive (600).
    pub timeout: Duration,
    /// `FERROCOMM_ABORT_ON_ERROR` (off).
    pub abort_on_error: AbortOnError,
    /// `FERROCOMM_CHECK_CALLS=1` (off).
    pub check_calls: bool,
    /// `FERROCOMM_TOKEN`: the TCP store's job secret (empty counts as unset). The store's
    /// address (`FERROCOMM_STORE`, else `MASTER_ADDR`/`MASTER_PORT`) is parsed by bootstrap
    /// from [`Config::var`].
    pub token: Option<String>,
    /// `FERROCOMM_STORE_EXTERNAL=1`: a launcher hosts the store.
    pub store_external: bool,
    /// `FERROCOMM_TRANSPORT=tcp` (auto).
    pub force_tcp: bool,
    /// `FERROCOMM_SHM_RING_BYTES` (1 MiB; `TransportOptions` checks it is a power of two).
    pub shm_ring_bytes: usize,
    /// `FERROCOMM_SHM_PULL_BYTES` (0: never); unset: never where the copy by reference measures
    /// slow on the host, else 16 KiB, 64 KiB where a host's ranks outnumber its CPUs.
    pub shm_pull_bytes: Option<usize>,
    /// `FERROCOMM_TCP_BULK_BYTES` (0: never); unset: 64 KiB.
    pub tcp_bulk_bytes: Option<usize>,
    /// `FERROCOMM_SOCKET_ADDR`.
    pub socket_addr: Option<IpAddr>,
    /// `FERROCOMM_NET` (auto).
    pub net: NetTransport,
    /// `FERROCOMM_ENCRYPT` (auto).
    pub encrypt: Encrypt,
    /// `FERROCOMM_MULTICAST=0` turns multicast objects off.
    pub multicast: bool,
    /// `FERROCOMM_PROXY_AFFINITY=0` turns the proxy threads' pinning off.
    pub proxy_affinity: bool,
    /// `FERROCOMM_PROXY_POLL_US`: µs; unset, the proxy decides by the host's cores.
    pub proxy_poll_us: Option<u64>,
    /// `FERROCOMM_CPU_DIRECT_MAX`: bytes (64 KiB).
    pub cpu_direct_max: usize,
    /// `FERROCOMM_CPU_CHUNK`: bytes, positive (256 KiB).
    pub cpu_chunk: usize,
    /// `FERROCOMM_LOG`: a `tracing` filter, for `init_logging` (feature log-subscriber).
    #[cfg_attr(not(feature = "log-subscriber"), allow(dead_code))]
    pub log: Option<String>,
    /// `FERROCOMM_NVRTC_PATH`: libnvrtc or its folder.
    pub nvrtc_path: Option<PathBuf>,
    /// `FERROCOMM_NCCL_PATH`: libnccl or its folder.
    pub nccl_path: Option<PathBuf>,
    /// `FERROCOMM_NCCL=0` keeps the device backend off NCCL.
    pub nccl: bool,
    /// `FERROCOMM_NCCL_THRESHOLD`: bytes (256 KiB).
    pub nccl_threshold: usize,
    /// `FERROCOMM_DEVICE_ONESHOT_MAX`: bytes (1 MiB).
    pub device_oneshot_max: usize,
    /// `FERROCOMM_DEVICE_TWOSHOT_MIN`: bytes (128 KiB).
    pub device_twoshot_min: usize,
    /// The variables of both tables that were set.
    vars: BTreeMap<&'static str, OsString>,
}

impl Config {
    /// Reads the process environment: the only place in the library that does. A variable
    /// that is set but malformed is an `Error::Config` naming it.
    pub(crate) fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var_os(k))
    }

    /// Builds the settings from `lookup` (the environment, or a test's table).
    pub(crate) fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Config> {
        let vars: BTreeMap<&'static str, OsString> = VARIABLES
            .iter()
            .chain(OTHER_VARIABLES.iter())
            .filter_map(|&k| lookup(k).map(|v| (k, v)))
            .collect();
        let raw = Raw(&vars);
        let secs: f64 = raw.parse("FERROCOMM_TIMEOUT")?.unwrap_or(600.0);
        if !(secs > 0.0 && secs.is_finite()) {
            return Err(Error::Config(format!(
                "FERROCOMM_TIMEOUT={secs} must be a positive number of seconds"
            )));
        }
        let abort_on_error = match raw.get("FERROCOMM_ABORT_ON_ERROR") {
            None => AbortOnError::Off,
            Some(v) => v
                .parse()
                .map_err(|why| Error::Config(format!("FERROCOMM_ABORT_ON_ERROR={why}")))?,
        };
        let force_tcp = match raw.get("FERROCOMM_TRANSPORT") {
            Some("tcp") => true,
            Some("auto") | Some("") | None => false,
            Some(other) => {
                return Err(Error::Config(format!(
                    "FERROCOMM_TRANSPORT={other:?}: expected `auto` or `tcp`"
                )))
            }
        };
        let net = match raw.get("FERROCOMM_NET") {
            Some("auto") | Some("") | None => NetTransport::Auto,
            Some("tcp") => NetTransport::Tcp,
            Some("rdma") => NetTransport::Rdma,
            Some(other) => {
                return Err(Error::Config(format!(
                    "FERROCOMM_NET={other:?}: expected `auto`, `tcp` or `rdma`"
                )))
            }
        };
        let encrypt = match raw.get("FERROCOMM_ENCRYPT") {
            Some("auto") | Some("") | None => Encrypt::Auto,
            Some("1") | Some("on") => Encrypt::On,
            Some("0") | Some("off") => Encrypt::Off,
            Some(other) => {
                return Err(Error::Config(format!(
                    "FERROCOMM_ENCRYPT={other:?}: expected `auto`, `on` (1) or `off` (0)"
                )))
            }
        };
        let proxy_poll_us = match raw.get("FERROCOMM_PROXY_POLL_US") {
            None => None,
            Some(v) => Some(v.parse::<u64>().map_err(|_| {
                Error::Config(format!(
                    "FERROCOMM_PROXY_POLL_US={v:?}: expected microseconds (an integer)"
                ))
            })?),
        };
        let cpu_chunk = raw.parse("FERROCOMM_CPU_CHUNK")?.unwrap_or(256 << 10);
        if cpu_chunk == 0 {
            return Err(Error::Config("FERROCOMM_CPU_CHUNK must be positive".into()));
        }
        let path = |k: &str| vars.get(k).map(PathBuf::from);
        Ok(Config {
            timeout: Duration::from_secs_f64(secs),
            abort_on_error,
            check_calls: raw.flag("FERROCOMM_CHECK_CALLS")?,
            token: raw.get("FERROCOMM_TOKEN").filter(|t| !t.is_empty()).map(str::to_owned),
            store_external: raw.get("FERROCOMM_STORE_EXTERNAL") == Some("1"),
            force_tcp,
            shm_ring_bytes: raw.parse("FERROCOMM_SHM_RING_BYTES")?.unwrap_or(1 << 20),
            shm_pull_bytes: raw.parse("FERROCOMM_SHM_PULL_BYTES")?,
            tcp_bulk_bytes: raw.parse("FERROCOMM_TCP_BULK_BYTES")?,
            socket_addr: raw.parse("FERROCOMM_SOCKET_ADDR")?,
            net,
            encrypt,
            multicast: raw.get("FERROCOMM_MULTICAST") != Some("0"),
            proxy_affinity: raw.get("FERROCOMM_PROXY_AFFINITY") != Some("0"),
            proxy_poll_us,
            cpu_direct_max: raw.parse("FERROCOMM_CPU_DIRECT_MAX")?.unwrap_or(64 << 10),
            cpu_chunk,
            log: raw.get("FERROCOMM_LOG").map(str::to_owned),
            nvrtc_path: path("FERROCOMM_NVRTC_PATH"),
            nccl_path: path("FERROCOMM_NCCL_PATH"),
            nccl: raw.get("FERROCOMM_NCCL") != Some("0"),
            nccl_threshold: raw.bytes("FERROCOMM_NCCL_THRESHOLD", 256 << 10, "65536 or 64K")?,
            device_oneshot_max: raw.bytes("FERROCOMM_DEVICE_ONESHOT_MAX", 1 << 20, "1M")?,
            device_twoshot_min: raw.bytes("FERROCOMM_DEVICE_TWOSHOT_MIN", 128 << 10, "1M")?,
            vars,
        })
    }

    /// The value a variable of either table had, as `std::env::var(name).ok()` would have
    /// given it then (unset or not UTF-8: `None`). For code that takes a lookup, such as rank
    /// discovery.
    pub(crate) fn var(&self, name: &str) -> Option<String> {
        self.value_os(name)?.into_string().ok()
    }

    /// As [`Config::var`], any bytes (paths).
    pub(crate) fn value_os(&self, name: &str) -> Option<OsString> {
        // A name outside both tables would always read as unset: a bug, not a setting.
        debug_assert!(
            VARIABLES.contains(&name) || OTHER_VARIABLES.contains(&name),
            "{name} is in neither of config.rs's tables"
        );
        self.vars.get(name).cloned()
    }
}

/// The process's settings, read from the environment when first needed and kept for the
/// life of the process: for code that has no communicator at hand (loading NVRTC and NCCL,
/// CUDA's queue count, the window proxies). A malformed variable is the same error each time.
pub(crate) fn current() -> Result<&'static Config> {
    static CURRENT: OnceLock<std::result::Result<Config, String>> = OnceLock::new();
    CURRENT
        .get_or_init(|| {
            Config::from_env().map_err(|e| match e {
                Error::Config(m) => m,
                other => other.to_string(),
            })
        })
        .as_ref()
        .map_err(|m| Error::Config(m.clone()))
}

/// The UTF-8 values of a snapshot, with the parsers every variable shares.
struct Raw<'a>(&'a BTreeMap<&'static str, OsString>);

impl Raw<'_> {
    /// As `std::env::var(name).ok()`: unset and non-UTF-8 values are `None`.
    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name)?.to_str()
    }

    /// A set but malformed value is an error, never silently ignored.
    fn parse<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>> {
        match self.get(name) {
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| Error::Config(format!("{name}={v:?} cannot be parsed"))),
            None => Ok(None),
        }
    }

    /// On/off: `1`/`0` (or `true`/`false`); unset is off.
    fn flag(&self, name: &str) -> Result<bool> {
        match self.get(name).map(str::trim) {
            None | Some("") | Some("0") | Some("false") => Ok(false),
            Some("1") | Some("true") => Ok(true),
            Some(other) => Err(Error::Config(format!("{name}={other:?}: expected 1 or 0"))),
        }
    }

    /// A byte count such as `64K` ([`parse_bytes`]), `default` when unset.
    fn bytes(&self, name: &str, default: usize, example: &str) -> Result<usize> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                parse_bytes(v).ok_or_else(|| Error::Config(format!("{name}={v:?}: expected bytes such as {example}")))
            }
        }
    }
}

/// A byte count as ferrocomm's settings and programs write it: `1024`, `64K`, `4M`, `1G`
/// (powers of 1024; also `KB`/`KiB` forms, any case). `None` for anything else, and for a
/// count that does not fit in `usize`.
///
/// ```
/// assert_eq!(ferrocomm::parse_bytes("64K"), Some(65536));
/// assert_eq!(ferrocomm::parse_bytes("1gib"), Some(1 << 30));
/// assert_eq!(ferrocomm::parse_bytes("1.5M"), None);
/// ```
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let scale: usize = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return None,
    };
    digits.parse::<usize>().ok()?.checked_mul(scale)
}

/// What carries window operations to ranks on other hosts (`FERROCOMM_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetTransport {
    /// RDMA where the library has the `rdma` feature and a device with an active port opens,
    /// else TCP (the default).
    Auto,
    /// TCP links only, even where RDMA would work.
    Tcp,
    /// RDMA verbs or an error saying why not.
    Rdma,
}

/// Whether TCP links seal their traffic (AES-256-GCM records keyed from each link's handshake;
/// `FERROCOMM_ENCRYPT`). Every rank must choose the same: a link whose two ends differ fails
/// at set-up with `Error::Config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encrypt {
    /// Seal links between ranks on different machines, where traffic crosses a network; not
    /// links within one machine (`FERROCOMM_TRANSPORT=tcp` on one host). The default.
    Auto,
    /// Seal every TCP link.
    On,
    /// Seal none: for networks the user trusts, at no cost.
    Off,
}

impl Encrypt {
    /// Whether a link between two ranks is sealed, given whether they share a machine.
    pub(crate) fn seals(self, same_machine: bool) -> bool {
        match self {
            Encrypt::Auto => !same_machine,
            Encrypt::On => true,
            Encrypt::Off => false,
        }
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
    /// (the CPU engine refuses later operations; see [`CommOptions::timeout`](crate::contracts::options::CommOptions::timeout)).
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

    /// `FERROCOMM_ABORT_ON_ERROR`, `off` when unset (a fresh read of the environment).
    pub fn from_env() -> Result<AbortOnError> {
        Ok(Config::from_env()?.abort_on_error)
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

/// The `FERROCOMM_*` names among `names` that nothing reads, each with the known name it most
/// resembles (when one is close).
pub(crate) fn unknown(names: impl Iterator<Item = String>) -> Vec<(String, Option<&'static str>)> {
    names
        .filter(|n| n.starts_with("FERROCOMM_") && !VARIABLES.contains(&n.as_str()))
        .filter(|n| !TEST_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| {
            let near = VARIABLES
                .iter()
                .map(|k| (edit_distance(&n, k), *k))
                .min()
                .filter(|(d, _)| *d <= 3)
                .map(|(_, k)| k);
            (n, near)
        })
        .collect()
}

/// Warns once per process about unknown `FERROCOMM_*` variables.
pub(crate) fn warn_unknown_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let names = std::env::vars_os().filter_map(|(k, _)| k.into_string().ok());
        for (name, near) in unknown(names) {
            match near {
                Some(k) => tracing::warn!(variable = %name, "unknown ferrocomm variable, ignored: did you mean {k}?"),
                None => tracing::warn!(variable = %name, "unknown ferrocomm variable, ignored (README lists them all)"),
            }
        }
    });
}

/// Levenshtein distance, for the "did you mean" of a misspelt name.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = (up + 1).min(row[j] + 1).min(diag + usize::from(ca != *cb));
            diag = up;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelt_variable_is_named_with_the_one_it_resembles() {
        let names = [
            "FERROCOMM_TIMOUT",
            "FERROCOMM_TIMEOUT",
            "FERROCOMM_WHATEVER_ELSE",
            "PATH",
            "FERROCOMM_TEST_SEED",
        ];
        let got = unknown(names.iter().map(|s| s.to_string()));
        assert_eq!(
            got,
            vec![
                ("FERROCOMM_TIMOUT".to_string(), Some("FERROCOMM_TIMEOUT")),
                ("FERROCOMM_WHATEVER_ELSE".to_string(), None)
            ]
        );
    }

    fn config(pairs: &[(&str, &str)]) -> Result<Config> {
        Config::from_lookup(|k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).into()))
    }

    #[test]
    fn unset_variables_take_their_defaults() {
        let c = config(&[]).unwrap();
        assert_eq!(c.timeout, Duration::from_secs(600));
        assert_eq!((c.abort_on_error, c.net), (AbortOnError::Off, NetTransport::Auto));
        assert!(!c.check_calls && !c.force_tcp && !c.store_external);
        assert!(c.multicast && c.proxy_affinity && c.nccl);
        assert_eq!(
            (c.shm_ring_bytes, c.shm_pull_bytes, c.cpu_direct_max, c.cpu_chunk),
            (1 << 20, None, 64 << 10, 256 << 10)
        );
        assert_eq!(
            (c.nccl_threshold, c.device_oneshot_max, c.device_twoshot_min),
            (256 << 10, 1 << 20, 128 << 10)
        );
        assert!(c.token.is_none() && c.log.is_none() && c.nccl_path.is_none() && c.proxy_poll_us.is_none());
    }

    #[test]
    fn set_variables_are_parsed() {
        let c = config(&[
            ("FERROCOMM_TIMEOUT", " 2.5 "),
            ("FERROCOMM_ABORT_ON_ERROR", "process"),
            ("FERROCOMM_CHECK_CALLS", "true"),
            ("FERROCOMM_TOKEN", ""),
            ("FERROCOMM_TRANSPORT", "tcp"),
            ("FERROCOMM_NET", "rdma"),
            ("FERROCOMM_SOCKET_ADDR", "10.0.0.7"),
            ("FERROCOMM_NCCL_THRESHOLD", "64K"),
            ("FERROCOMM_PROXY_POLL_US", "0"),
            ("FERROCOMM_NCCL", "0"),
            ("FERROCOMM_NCCL_PATH", "/opt/nccl"),
            ("CUDA_HOME", "/opt/cuda"),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!((c.abort_on_error, c.net), (AbortOnError::Process, NetTransport::Rdma));
        assert!(c.check_calls && c.force_tcp && !c.nccl);
        assert_eq!(c.token, None, "an empty token counts as unset");
        assert_eq!(c.socket_addr, Some("10.0.0.7".parse().unwrap()));
        assert_eq!((c.nccl_threshold, c.proxy_poll_us), (64 << 10, Some(0)));
        assert_eq!(c.nccl_path, Some(PathBuf::from("/opt/nccl")));
        assert_eq!(c.var("CUDA_HOME").as_deref(), Some("/opt/cuda"));
        assert_eq!(c.var("MASTER_ADDR"), None);
    }

    #[test]
    fn a_malformed_value_is_an_error_naming_its_variable() {
        for (name, value) in [
            ("FERROCOMM_TIMEOUT", "soon"),
            ("FERROCOMM_TIMEOUT", "-1"),
            ("FERROCOMM_ABORT_ON_ERROR", "sometimes"),
            ("FERROCOMM_CHECK_CALLS", "yes"),
            ("FERROCOMM_TRANSPORT", "carrier-pigeon"),
            ("FERROCOMM_NET", "ib"),
            ("FERROCOMM_SHM_RING_BYTES", "1M"),
            ("FERROCOMM_SHM_PULL_BYTES", "64K"),
            ("FERROCOMM_SOCKET_ADDR", "here"),
            ("FERROCOMM_PROXY_POLL_US", "2ms"),
            ("FERROCOMM_CPU_CHUNK", "0"),
            ("FERROCOMM_CPU_DIRECT_MAX", "-5"),
            ("FERROCOMM_NCCL_THRESHOLD", "lots"),
            ("FERROCOMM_DEVICE_ONESHOT_MAX", "12Q"),
            ("FERROCOMM_DEVICE_TWOSHOT_MIN", "big"),
        ] {
            match config(&[(name, value)]) {
                Err(Error::Config(m)) => assert!(m.contains(name), "{name}={value}: {m}"),
                other => panic!("{name}={value}: {other:?}"),
            }
        }
    }

    #[test]
    fn byte_counts_take_units() {
        assert_eq!(parse_bytes("65536"), Some(65536));
        assert_eq!(parse_bytes("64K"), Some(65536));
        assert_eq!(parse_bytes("4MiB"), Some(4 << 20));
        assert_eq!(parse_bytes("1g"), Some(1 << 30));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("12Q"), None);
    }

    #[test]
    fn the_readme_lists_exactly_these_variables() {
        let readme = include_str!("../../README.md");
        let table = readme
            .split("## Environment variables")
            .nth(1)
            .and_then(|t| t.split("\n## ").next())
            .expect("README has an environment table");
        let mut listed: Vec<&str> = table
            .split('`')
            .filter(|w| w.starts_with("FERROCOMM_") && w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            .collect();
        listed.sort_unstable();
        listed.dedup();
        let mut known = VARIABLES.to_vec();
        known.sort_unstable();
        assert_eq!(listed, known, "README's environment table and config::VARIABLES differ");
    }
}
