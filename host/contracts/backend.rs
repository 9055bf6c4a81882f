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
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Everything a backend needs to join a communicator.
pub struct BackendInit<'a> {
    /// The rank the backend plays, in `0..size`.
    pub rank: usize,
    /// The number of ranks of the communicator.
    pub size: usize,
    /// A store namespace private to this communicator.
    pub store: Arc<dyn Store>,
    /// The communicator's name (the same on every rank).
    pub name: &'a str,
    /// The device this rank drives.
    pub device: Device,
    /// The communicator's options (timeout, hints, transport settings).
    pub options: &'a CommOptions,
    /// Links that `Comm::shrink` took over from the communicator it replaces, for the first
    /// host engine that wants them (the built-in backends' CPU engine); `None` otherwise. A
    /// backend that wraps a built-in one passes its `BackendInit` on unchanged (or with
    /// `..*init`), and `link_ledger` / `lend_links` through, to keep them.
    pub lent_links: Option<&'a Mutex<Option<LentLinks>>>,
}

impl BackendInit<'_> {
    /// The links lent to this communicator, taken (they go to one engine only).
    pub(crate) fn take_lent_links(&self) -> Option<LentLinks> {
        self.lent_links?.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// What the links of a rank's host engine carried, for `Comm::shrink` to tell whether a
/// smaller communicator can take them over in step ([`Backend::link_ledger`]). Indexed by rank
/// of the communicator being shrunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkLedger {
    /// Framed messages this rank has sent to each rank (complete: it is between operations).
    pub sent: Vec<u64>,
    /// Framed messages this rank has taken in from each rank.
    pub taken: Vec<u64>,
    /// Messages each rank still owes this rank: calls of collectives in which this rank
    /// wrote nothing, whose arrival it did not wait for. They are taken in before the links
    /// are handed over.
    pub owed: Vec<u64>,
    /// The next round of the shared-memory board, where the rank has one (every rank of the
    /// communicator on its host).
    pub board_round: Option<u64>,
    /// Ranks seen done with the board for good (closed, aborted, failed, or their process
    /// gone): a smaller communicator may reuse the board only when every rank it leaves out
    /// is among them, since a rank still reading a board slot would read it torn.
    pub quiet: Vec<bool>,
}

/// A host engine's links handed to the communicator that `Comm::shrink` makes
/// ([`Backend::lend_links`]); only the built-in engine makes and takes them.
pub struct LentLinks(pub(crate) Box<dyn std::any::Any + Send>);

/// Per-operation settings, resolved against the communicator's defaults.
pub struct RunOptions<'a> {
    /// How long the operation may take: the operation's own timeout, else the
    /// communicator's. A backend fails with `Error::Timeout` once it passes.
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
///
/// ```
/// use ferrocomm::prelude::*;
/// use ferrocomm::{backend_factory, register_backend, Backend, BackendInit, Op, RunOptions};
/// use std::sync::{atomic::{AtomicUsize, Ordering}, Arc};
///
/// /// Counts the operations it runs, then hands them to the CPU backend.
/// struct Counting {
///     inner: Box<dyn Backend>,
///     ops: Arc<AtomicUsize>,
/// }
///
/// impl Backend for Counting {
///     fn name(&self) -> &'static str {
///         "counting"
///     }
///     fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> ferrocomm::Result<()> {
///         self.ops.fetch_add(1, Ordering::Relaxed);
///         self.inner.run(op, opts)
///     }
///     fn abort(&self) {
///         self.inner.abort()
///     }
///     fn finalize(&self) -> ferrocomm::Result<()> {
///         self.inner.finalize()
///     }
/// }
///
/// let ops = Arc::new(AtomicUsize::new(0));
/// let (cpu, count) = (backend_factory("cpu")?, ops.clone());
/// register_backend(
///     "counting",
///     Arc::new(move |init: &BackendInit| {
///         Ok(Box::new(Counting { inner: cpu(init)?, ops: count.clone() }) as Box<dyn Backend>)
///     }),
/// );
/// let comm = Comm::new_group("counting", &[Device::Cpu], "counted", CommOptions::from_env()?)?.remove(0);
/// comm.barrier()?;
/// let mut x = [1u8];
/// comm.broadcast(&mut x[..], 0)?;
/// assert_eq!(ops.load(Ordering::Relaxed), 2);
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub trait Backend: Send + Sync {
    /// The backend's name, as logs and errors print it.
    fn name(&self) -> &'static str;
    /// Executes `op` to completion (or fails within `opts.timeout`).
    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()>;
    /// Called in `run`'s place, in issue order, for an operation that failed this rank's own
    /// checks (`reason`) before it could run, where the peers would otherwise wait for this
    /// rank until their timeout (the inference collectives: see `Op::refused_in_band`). A
    /// backend may take part in the operation far enough to tell every peer, which then fails
    /// at once with an error naming this rank. The caller gets its argument error either way.
    /// The default does nothing.
    fn refuse(&self, op: &Op<'_>, reason: &str, opts: &RunOptions) {
        let _ = (op, reason, opts);
    }
    /// Makes a running `run` return promptly with an error, from any thread; the communicator
    /// refuses later operations itself. The built-in backends also tell peers, which get
    /// `Error::PeerLost` naming this rank.
    fn abort(&self);
    /// Completes what is pending and releases the rank's resources ([`Comm::finalize`]);
    /// no operation follows it.
    ///
    /// [`Comm::finalize`]: crate::Comm::finalize
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
    /// For `Comm::shrink`, called while no operation is queued or running: what this rank's
    /// host-memory links carried, or `None` when they cannot be handed to a smaller
    /// communicator (broken by a failure, aborted, busy, or a backend without such links: the
    /// default). A backend that gives a ledger runs no operation on those links afterwards.
    fn link_ledger(&self) -> Option<LinkLedger> {
        None
    }
    /// For `Comm::shrink`, once every member's ledger showed the links between members in
    /// step: hands this rank's links to `members` (ranks of this communicator, in the new
    /// communicator's order) over, after taking in what the members still owe it, and closes
    /// the rest. `keep_board`: the shared-memory board goes too. This backend's operations
    /// fail with `Error::Closed` afterwards. The default has nothing to lend.
    fn lend_links(&self, members: &[usize], keep_board: bool, timeout: Duration) -> Result<LentLinks> {
        let _ = (members, keep_board, timeout);
        Err(Error::Unavailable {
            backend: self.name().into(),
            reason: "this backend has no links to hand to a smaller communicator".into(),
        })
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
