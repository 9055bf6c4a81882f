//! The backend contract: what a communicator asks of a backend for one rank (`Backend`), what
//! it hands it to join (`BackendInit`) and per operation (`RunOptions`), and how a backend
//! reports the hints it does not take.

use crate::contracts::error::{Error, Result};
use crate::contracts::fence::FenceSlot;
use crate::contracts::ops::Op;
use crate::contracts::options::CommOptions;
use crate::contracts::placement::Device;
use crate::contracts::store::Store;
use crate::contracts::window::{WindowBackend, WindowSpec};
use std::collections::BTreeMap;
use std::sync::Arc;
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
    /// The communicator's hints overridden key by key by the operation's own. A backend
    /// ignores (with a debug event) a key it does not know or a value it cannot honour for
    /// this operation, and refuses a value it does not know for a key it reads with
    /// `Error::InvalidArgument` (see `CommOptions::hints`).
    pub hints: &'a BTreeMap<String, String>,
    /// The issuing thread's current CUDA stream (raw `CUstream`, 0 = the legacy default
    /// stream). A synchronous operation on device buffers is enqueued on it.
    pub stream: u64,
    /// Set for an asynchronous operation: a GPU backend may run it on its own stream and leave
    /// an event here; `Work::wait` then makes the waiter's stream wait for it.
    pub fence: Option<&'a FenceSlot>,
}

impl<'a> RunOptions<'a> {
    /// Options for a synchronous operation on the default stream.
    pub fn new(timeout: Duration, hints: &'a BTreeMap<String, String>) -> Self {
        RunOptions {
            timeout,
            hints,
            stream: 0,
            fence: None,
        }
    }
}

/// Notes that `backend` ignores the hint `key=value` for `op`, and why. A hint a backend does
/// not know, or cannot honour for this operation, never fails the operation (see
/// `CommOptions::hints`): it runs with the backend's own choice, and this debug event says so.
pub(crate) fn hint_ignored(backend: &str, op: &str, key: &str, value: &str, why: &str) {
    tracing::debug!(backend, op, hint = %format_args!("{key}={value}"), reason = why, "hint ignored");
}

/// [`hint_ignored`] for every hint whose key is not in `known`.
pub(crate) fn unknown_hints_ignored(backend: &str, op: &str, hints: &BTreeMap<String, String>, known: &[&str]) {
    for (k, v) in hints.iter().filter(|(k, _)| !known.contains(&k.as_str())) {
        hint_ignored(backend, op, k, v, "not a hint of this backend");
    }
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
    /// Makes the backend of a sub-communicator from this one (as `ncclCommSplit` does), or
    /// `None` to have it built from the registry like any new communicator. Collective over
    /// every rank of this backend: `group` lists this rank's group as parent ranks in new-rank
    /// order (empty for none), and `init` describes the new rank (`None` for none).
    #[allow(clippy::type_complexity)]
    fn split(&self, group: &[usize], init: Option<&BackendInit>) -> Option<Result<Option<Box<dyn Backend>>>> {
        let _ = (group, init);
        None
    }
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
