//! Backends execute operations; the registry maps names to factories. Users may register
//! their own backend under a new name.

pub(crate) mod cpu;
mod device;

use crate::bootstrap::Store;
use crate::error::{Error, Result};
use crate::ops::Op;
use crate::options::CommOptions;
use crate::window::{WindowBackend, WindowSpec};
use crate::Device;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

/// Everything a backend needs to join a communicator.
pub struct BackendInit<'a> {
    pub rank: usize,
    pub size: usize,
    /// A store namespace private to this communicator.
    pub store: Arc<dyn Store>,
    pub name: &'a str,
    pub device: Device,
    pub options: &'a CommOptions,
}

/// Per-operation settings, resolved against the communicator's defaults.
pub struct RunOptions<'a> {
    pub timeout: Duration,
    pub hints: &'a BTreeMap<String, String>,
}

/// A communication backend for one rank.
///
/// The communicator calls `run` for one operation at a time, in issue order, after validating
/// the operation's local arguments; `abort` may be called from any thread at any time and must
/// make a running `run` return promptly.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Executes `op` to completion (or fails within `opts.timeout`).
    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()>;
    fn abort(&self);
    fn finalize(&self) -> Result<()>;
    /// Builds this rank's part of a window (collective). Backends without windows say so.
    fn new_window(&self, spec: &WindowSpec) -> Result<Box<dyn WindowBackend>> {
        let _ = spec;
        Err(Error::Unavailable {
            backend: self.name().into(),
            reason: "this backend has no one-sided windows".into(),
        })
    }
}

/// Creates a backend for one rank.
pub type BackendFactory = Arc<dyn Fn(&BackendInit) -> Result<Box<dyn Backend>> + Send + Sync>;

fn registry() -> &'static RwLock<HashMap<String, BackendFactory>> {
    static R: OnceLock<RwLock<HashMap<String, BackendFactory>>> = OnceLock::new();
    R.get_or_init(|| {
        let mut m: HashMap<String, BackendFactory> = HashMap::new();
        m.insert("cpu".into(), Arc::new(cpu::create));
        m.insert("device".into(), Arc::new(device::create));
        // `auto` picks the best backend for the device: host memory means the CPU backend,
        // a CUDA device the device backend.
        m.insert(
            "auto".into(),
            Arc::new(|init: &BackendInit| match init.device {
                Device::Cpu => cpu::create(init),
                Device::Cuda(_) => device::create(init),
            }),
        );
        RwLock::new(m)
    })
}

/// Registers (or replaces) the backend factory called `name`.
pub fn register_backend(name: &str, factory: BackendFactory) {
    registry()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(name.to_owned(), factory);
}

/// Names of the registered backends, sorted.
pub fn backend_names() -> Vec<String> {
    let mut v: Vec<String> = registry()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .keys()
        .cloned()
        .collect();
    v.sort();
    v
}

/// The factory registered as `name` (a user backend may wrap a built-in one).
pub fn backend_factory(name: &str) -> Result<BackendFactory> {
    registry()
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(name)
        .cloned()
        .ok_or_else(|| Error::UnknownBackend(name.to_owned(), backend_names().join(", ")))
}
