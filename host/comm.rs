//! The communicator: one rank of a group, one device, one backend.

use crate::backend::registry;
use crate::bootstrap::{self, MemoryStore, PrefixStore, TcpStoreServer};
use crate::contracts::backend::{Backend, BackendInit, LentLinks};
use crate::contracts::error::{Error, Result};
use crate::contracts::fence::FenceSlot;
use crate::contracts::ops::{Location, Op};
use crate::contracts::options::{merge_hints, AbortOnError, CommOptions, OpOptions};
use crate::contracts::placement::Device;
use crate::contracts::store::Store;
use crate::contracts::window::{WindowBackend, WindowOptions, WindowSpec};
use crate::executor::{Executor, OpRun, Task};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const LIVE: u8 = 0;
const FINALIZED: u8 = 1;
const ABORTED: u8 = 2;
/// Replaced by a smaller communicator (`Comm::shrink`).
const SHRUNK: u8 = 3;

struct Inner {
    exec: Arc<Executor>,
    backend_name: String,
    name: String,
    rank: usize,
    size: usize,
    device: Device,
    options: CommOptions,
    /// The job store (not prefixed); sub-communicators take namespaces under `prefix`.
    store: Arc<dyn Store>,
    prefix: String,
    splits: AtomicU64,
    shrinks: AtomicU64,
    windows: AtomicU64,
    /// LIVE, FINALIZED or ABORTED; shared with the tasks of `AbortOnError`, which abort from
    /// wherever the operation ran.
    state: Arc<AtomicU8>,
    /// Rank 0 may host the job's store server; it lives as long as this communicator.
    _server: Option<TcpStoreServer>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.exec.shutdown();
    }
}

/// One rank of a communicator. Cheap to clone (clones share the rank); `Send + Sync`:
/// operations from several threads are serialised in the order they are issued.
///
/// Made by [`new_comm`] (one rank per process, under a launcher) or [`Comm::new_group`] (every
/// rank in this process, one thread each). The collectives come from the [`Collectives`]
/// trait, windows from [`Comm::new_window`], asynchronous calls from [`Comm::scope`].
/// Dropping the last clone closes the rank; [`Comm::finalize`] does so explicitly and reports
/// errors.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// // Two ranks of the CPU backend in this process: rank 0 sends, rank 1 receives.
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "pair", CommOptions::from_env()?)?;
/// assert_eq!((comms[1].rank(), comms[1].size()), (1, 2));
/// let (c0, c1) = (&comms[0], &comms[1]);
/// let (sent, got) = std::thread::scope(|s| {
///     let sender = s.spawn(move || c0.send(&[1.5f64, 2.5][..], 1));
///     let receiver = s.spawn(move || {
///         let mut buf = [0f64; 2];
///         c1.recv(&mut buf[..], 0).map(|()| buf)
///     });
///     (sender.join().unwrap(), receiver.join().unwrap())
/// });
/// sent?;
/// assert_eq!(got?, [1.5, 2.5]);
/// for c in &comms {
///     c.finalize()?;
/// }
/// # Ok::<(), ferrocomm::Error>(())
/// ```
///
/// [`Collectives`]: crate::Collectives
#[derive(Clone)]
pub struct Comm {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("name", &self.inner.name)
            .field("backend", &self.inner.backend_name)
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .finish()
    }
}

/// Per-process counter of communicators created under one (name, rank), so that creating a
/// communicator of the same name twice gives two separate namespaces in the store.
fn next_generation(name: &str, rank: usize) -> u64 {
    static G: OnceLock<Mutex<HashMap<(String, usize), u64>>> = OnceLock::new();
    let mut m = G
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let g = m.entry((name.to_owned(), rank)).or_insert(0);
    *g += 1;
    *g
}

/// Creates this process's rank of the communicator `name` on `backend` (`"cpu"`, `"auto"`, or
/// a registered name). Collective: every rank calls it with the same name.
///
/// Rank, world size and store come from `options` when set
/// ([`CommOptions::with_store`]), else from the environment (torchrun, Slurm, Open MPI or
/// PMI variables; `MASTER_ADDR`/`MASTER_PORT` or `FERROCOMM_STORE`; `FERROCOMM_TOKEN`).
///
/// # The launcher's environment contract
///
/// `ferrocomm-run -n N -- prog` (like torchrun) starts `N` processes and gives each:
///
/// | variable | value |
/// |---|---|
/// | `RANK`, `WORLD_SIZE` | this process's rank, the number of ranks |
/// | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | the same among the ranks of this host |
/// | `MASTER_ADDR`, `MASTER_PORT` | where the job's TCP store listens |
/// | `FERROCOMM_TOKEN` | the job secret the store demands (a fresh one per job on one node; on several, the secret the user exported as `FERROCOMM_TOKEN` on every node) |
/// | `FERROCOMM_STORE_EXTERNAL` | `1`: the launcher hosts the store, so rank 0 must not |
///
/// [`discover`](crate::discover) reads the rank variables (also Open MPI's, PMI's and
/// Slurm's), [`store_from_env`](crate::store_from_env) the store's; this function does both.
/// Without a launcher rank 0 hosts the store itself (at `MASTER_ADDR:MASTER_PORT`, or
/// `FERROCOMM_STORE=tcp://host:port | file:///dir`).
///
/// # Errors
///
/// `Error::Config` when no launcher variables are set (and `options` names no store), a
/// variable is malformed, or `FERROCOMM_TOKEN` is missing for a TCP store;
/// `Error::StoreTimeout` when a rank does not arrive within the timeout; `Error::Auth` on a
/// wrong token; `Error::UnknownBackend` / `Error::Unavailable` for the backend.
///
/// # Examples
///
/// A program started under `ferrocomm-run -n 4 -- ./prog` (or torchrun, srun, mpirun):
///
/// ```no_run
/// // no_run: needs the other ranks, started by a launcher.
/// use ferrocomm::prelude::*;
///
/// let comm = new_comm("cpu", Device::Cpu, "world", CommOptions::from_env()?)?;
/// let mut x = [comm.rank() as u64];
/// comm.all_reduce(&mut x[..], ReduceOp::Sum)?;
/// let n = comm.size() as u64;
/// assert_eq!(x[0], n * (n - 1) / 2);
/// comm.finalize()?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
///
/// The same contract, played here by hand for a job of one rank: the "launcher" hosts the
/// store and sets the variables, the "rank" only calls `new_comm`.
///
/// ```
/// use ferrocomm::prelude::*;
/// use ferrocomm::{random_token, TcpStoreServer};
///
/// # std::env::remove_var("FERROCOMM_STORE"); // it would win over MASTER_ADDR/MASTER_PORT
/// // The launcher's part: a store on a free port, a fresh token, the variables.
/// let token = random_token()?;
/// let server = TcpStoreServer::bind(("127.0.0.1", 0), &token)?;
/// for (k, v) in [
///     ("RANK", "0".to_string()),
///     ("WORLD_SIZE", "1".into()),
///     ("LOCAL_RANK", "0".into()),
///     ("LOCAL_WORLD_SIZE", "1".into()),
///     ("MASTER_ADDR", "127.0.0.1".into()),
///     ("MASTER_PORT", server.addr().port().to_string()),
///     ("FERROCOMM_TOKEN", token),
///     ("FERROCOMM_STORE_EXTERNAL", "1".into()),
/// ] {
///     std::env::set_var(k, v);
/// }
///
/// // The rank's part.
/// let comm = new_comm("cpu", Device::Cpu, "world", CommOptions::from_env()?)?;
/// assert_eq!((comm.rank(), comm.size()), (0, 1));
/// let mut x = [7i32, 8];
/// comm.all_reduce(&mut x[..], ReduceOp::Max)?;
/// assert_eq!(x, [7, 8]);
/// comm.finalize()?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn new_comm(backend: &str, device: Device, name: &str, options: CommOptions) -> Result<Comm> {
    let (rank, size, store, server) = match (&options.store, options.rank, options.size) {
        (Some(s), Some(r), Some(n)) => (r, n, s.clone(), None),
        (Some(_), _, _) => {
            return Err(Error::Config(
                "options.store needs options.rank and options.size".into(),
            ))
        }
        (None, _, _) => {
            let info = bootstrap::discover(|k| options.config.var(k))?.ok_or_else(|| {
                Error::Config(
                    "no rank information: run under ferrocomm-run, torchrun, srun or mpirun, or set \
                     CommOptions::with_store, or use Comm::new_group for ranks in one process"
                        .into(),
                )
            })?;
            let (store, server) = bootstrap::store_from_config(&options.config, info.rank, options.timeout)?;
            (info.rank, info.world_size, store, server)
        }
    };
    let prefix = format!("ferrocomm/{name}/{}", next_generation(name, rank));
    Comm::create(
        backend,
        device,
        name,
        rank,
        size,
        store,
        prefix,
        options,
        server,
        Parent::None,
    )
}

/// Where a new communicator's backend may come from besides the registry.
pub(crate) enum Parent<'a> {
    None,
    /// `Comm::split`: the parent's backend, which may split natively, and this rank's group
    /// as parent ranks.
    Split(&'a dyn Backend, &'a [usize]),
    /// `Comm::shrink`: the links the replaced communicator's engine handed over.
    Shrink(&'a Mutex<Option<LentLinks>>),
}

impl Comm {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn create(
        backend: &str,
        device: Device,
        name: &str,
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        prefix: String,
        options: CommOptions,
        server: Option<TcpStoreServer>,
        parent: Parent<'_>,
    ) -> Result<Comm> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidRank {
                op: "new_comm",
                rank,
                size,
            });
        }
        let factory = registry::backend_factory(backend)?;
        let scoped: Arc<dyn Store> = Arc::new(PrefixStore::new(prefix.clone(), store.clone()));
        let init = BackendInit {
            rank,
            size,
            store: scoped,
            name,
            device,
            options: &options,
            lent_links: match parent {
                Parent::Shrink(lent) => Some(lent),
                _ => None,
            },
        };
        let native = match parent {
            Parent::Split(parent, group) => parent.split(group, Some(&init)),
            _ => None,
        };
        let b = match native {
            Some(child) => child?.ok_or_else(|| Error::InvalidSplit("the backend made no sub-communicator".into()))?,
            None => factory(&init)?,
        };
        tracing::debug!(name, backend, rank, size, "communicator ready");
        Ok(Comm {
            inner: Arc::new(Inner {
                exec: Executor::new(b),
                backend_name: backend.to_owned(),
                name: name.to_owned(),
                rank,
                size,
                device,
                options,
                store,
                prefix,
                splits: AtomicU64::new(0),
                shrinks: AtomicU64::new(0),
                windows: AtomicU64::new(0),
                state: Arc::new(AtomicU8::new(LIVE)),
                _server: server,
            }),
        })
    }

    /// Creates `devices.len()` ranks of one communicator in this process, one per device (like
    /// `ncclCommInitAll`). Rank i drives `devices[i]`; give each rank to its own thread.
    ///
    /// The ranks rendezvous through an in-memory store, so no launcher or environment is
    /// needed. `Error::InvalidArgument` for an empty `devices`; if one rank cannot join, the
    /// first real error is returned.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "trio", CommOptions::from_env()?)?;
    /// // Collective calls block until every rank takes part: one thread per rank.
    /// let gathered = std::thread::scope(|s| {
    ///     let handles: Vec<_> = comms
    ///         .iter()
    ///         .map(|c| {
    ///             s.spawn(move || -> ferrocomm::Result<Vec<u32>> {
    ///                 let mut all = vec![0u32; 2 * c.size()];
    ///                 c.all_gather(&mut all[..], &[c.rank() as u32; 2][..])?;
    ///                 Ok(all)
    ///             })
    ///         })
    ///         .collect();
    ///     handles.into_iter().map(|h| h.join().unwrap()).collect::<ferrocomm::Result<Vec<_>>>()
    /// })?;
    /// for all in gathered {
    ///     assert_eq!(all, [0, 0, 1, 1, 2, 2]);
    /// }
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn new_group(backend: &str, devices: &[Device], name: &str, options: CommOptions) -> Result<Vec<Comm>> {
        let n = devices.len();
        if n == 0 {
            return Err(Error::invalid("new_group", "needs at least one device"));
        }
        let memory = MemoryStore::new();
        let store: Arc<dyn Store> = Arc::new(memory.clone());
        let prefix = format!("ferrocomm/{name}/group");
        // The first real failure; the other ranks then fail with StoreClosed instead of waiting
        // out their timeout for a rank that will never arrive.
        let cause: Mutex<Option<Error>> = Mutex::new(None);
        // Joining is collective and blocking, so every rank joins from its own thread.
        let results: Vec<Option<Comm>> = std::thread::scope(|s| {
            let handles: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, &dev)| {
                    let (store, prefix, options, memory, cause) =
                        (store.clone(), prefix.clone(), options.clone(), &memory, &cause);
                    s.spawn(move || {
                        match Comm::create(backend, dev, name, rank, n, store, prefix, options, None, Parent::None) {
                            Ok(c) => Some(c),
                            Err(Error::StoreClosed(_)) => None,
                            Err(e) => {
                                memory.fail(&format!("rank {rank} of group `{name}` could not join: {e}"));
                                cause.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                                None
                            }
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().ok().flatten()).collect()
        });
        if let Some(e) = cause.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        results
            .into_iter()
            .map(|c| c.ok_or_else(|| Error::invalid("new_group", "a rank's setup panicked")))
            .collect()
    }

    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }
    /// The number of ranks of the communicator.
    pub fn size(&self) -> usize {
        self.inner.size
    }
    /// The name every rank gave when creating it (for a sub-communicator, the name passed to
    /// [`Comm::split`]).
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// The device this rank drives.
    pub fn device(&self) -> Device {
        self.inner.device
    }
    /// The backend name it was created with (`"cpu"`, `"device"`, `"nccl"`, `"auto"`, or a
    /// registered one).
    pub fn backend_name(&self) -> &str {
        &self.inner.backend_name
    }
    /// The default timeout of this communicator's operations.
    pub fn timeout(&self) -> Duration {
        self.inner.options.timeout
    }

    /// `Error::Closed` once the communicator is finalized, aborted or shrunk.
    pub(crate) fn check_live(&self, op: &'static str) -> Result<()> {
        match self.inner.state.load(Ordering::Acquire) {
            LIVE => Ok(()),
            FINALIZED => Err(Error::Closed { op, state: "finalized" }),
            SHRUNK => Err(Error::Closed {
                op,
                state: "closed by a shrink",
            }),
            _ => Err(Error::Closed { op, state: "aborted" }),
        }
    }

    /// `Error::Closed` unless a shrink may start from this communicator: live, or aborted
    /// after a failure (not finalized, nor shrunk or left out already).
    pub(crate) fn check_shrinkable(&self) -> Result<()> {
        match self.inner.state.load(Ordering::Acquire) {
            LIVE | ABORTED => Ok(()),
            _ => self.check_live("shrink"),
        }
    }

    /// What `Comm::shrink` needs of the communicator it replaces: the job store (not
    /// prefixed), this communicator's namespace in it, its options, and the number of earlier
    /// shrinks (every rank counts the same, as for `split`).
    pub(crate) fn shrink_parts(&self) -> (Arc<dyn Store>, &str, &CommOptions, u64) {
        let i = &self.inner;
        (
            i.store.clone(),
            &i.prefix,
            &i.options,
            i.shrinks.fetch_add(1, Ordering::Relaxed),
        )
    }

    /// The backend, for `Comm::shrink` to hand its links over: by then its ledger froze the
    /// engine, so no queued operation can use them (see CpuBackend::link_ledger).
    pub(crate) fn backend(&self) -> &dyn Backend {
        self.inner.exec.backend()
    }

    /// `f` on the backend if no operation is queued or running, else `None`.
    pub(crate) fn on_idle_backend<T: Send>(&self, f: impl FnOnce(&dyn Backend) -> T + Send) -> Option<T> {
        let mut out = None;
        let slot = &mut out;
        self.inner
            .exec
            .run_if_idle(Box::new(move |b: &dyn Backend, _| {
                *slot = Some(f(b));
                Ok(())
            }))?
            .ok()?;
        out
    }

    /// Closes this rank's communicator for good once `Comm::shrink` replaced it (or left this
    /// rank out, or failed after the ranks started counting it): later operations, its
    /// windows' included, fail with `Error::Closed`, and no second shrink starts from it.
    pub(crate) fn mark_shrunk(&self) {
        self.inner.state.store(SHRUNK, Ordering::Release);
    }

    /// Checks `op` and makes what it runs with; shared by the synchronous and asynchronous
    /// paths, as is `finish`. An operation that fails its checks and that the peers would wait
    /// for is refused to them here, in issue order.
    // Inlined: see `Engine::begin_call` (a stall on the returned `OpRun` otherwise).
    #[inline(always)]
    fn prepare_run(&self, op: &Op<'_>, opts: &OpOptions) -> Result<OpRun> {
        let options = &self.inner.options;
        let timeout = opts.timeout.unwrap_or(options.timeout);
        // Most calls have no hints: no map is built (or dropped) for them.
        let hints =
            (!options.hints.is_empty() || !opts.hints.is_empty()).then(|| merge_hints(&options.hints, &opts.hints));
        let check = options.check_calls.then_some((self.inner.rank, self.inner.size));
        let run = OpRun::new(timeout, hints, check);
        if let Err(e) = self.validate(op) {
            // The peers of a collective that every rank exchanges with every rank would wait
            // for this rank until their timeout: the backend may tell them, in issue order.
            if op.refused_in_band() && self.inner.size > 1 && !matches!(e, Error::Closed { .. }) {
                let reason = match &e {
                    Error::InvalidArgument { reason, .. } => reason.clone(),
                    other => other.to_string(),
                };
                // Its own failure is the backend's to record; the caller gets `e`.
                let _ = self.inner.exec.run(|b: &dyn Backend, _: Option<&FenceSlot>| {
                    run.refuse(b, op, &reason);
                    Ok(())
                });
            }
            return Err(e);
        }
        Ok(run)
    }

    /// Applies `abort_on_error` to an operation's result: the one place every result of an
    /// operation that ran passes through, on the thread that ran it, so that asynchronous
    /// operations (which fail on the worker thread, long before anyone waits for their Work)
    /// abort as promptly as synchronous ones.
    fn finish(on_error: &OnError, b: &dyn Backend, r: Result<()>) -> Result<()> {
        if let (Err(e), Some((mode, state, rank, name))) = (&r, on_error) {
            if mode.acts_on(e) {
                abort_after_failure(*mode, e, state, b, *rank, name);
            }
        }
        r
    }

    /// What `finish` needs, taken only where `abort_on_error` is on.
    fn on_error(&self) -> OnError {
        let mode = self.inner.options.abort_on_error;
        (mode != AbortOnError::Off).then(|| (mode, self.inner.state.clone(), self.inner.rank, self.inner.name.clone()))
    }

    /// Checks `op` and makes its task, for the asynchronous paths.
    pub(crate) fn prepare<'a>(&self, mut op: Op<'a>, opts: &OpOptions) -> Result<Task<'a>> {
        let run = self.prepare_run(&op, opts)?;
        let on_error = self.on_error();
        Ok(Box::new(move |b: &dyn Backend, fence: Option<&FenceSlot>| {
            Self::finish(&on_error, b, run.run(b, &mut op, fence))
        }))
    }

    fn validate(&self, op: &Op<'_>) -> Result<()> {
        self.check_live(op.name())?;
        op.validate(self.inner.rank, self.inner.size)?;
        if let Some(Location::Cuda(ordinal)) = op.location()? {
            if self.inner.device != Device::Cuda(ordinal) {
                return Err(Error::invalid(
                    op.name(),
                    format!(
                        "a buffer on CUDA device {ordinal} given to a communicator of {:?}",
                        self.inner.device
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Runs `op` synchronously with `opts`: what every [`Collectives`](crate::Collectives)
    /// call of a `Comm` ends in, for callers that build an [`Op`] themselves.
    pub fn run(&self, mut op: Op<'_>, opts: &OpOptions) -> Result<()> {
        let run = self.prepare_run(&op, opts)?;
        let on_error = self.on_error();
        // The operation stays where it is, borrowed: no task to move it into.
        self.inner
            .exec
            .run(|b: &dyn Backend, fence: Option<&FenceSlot>| Self::finish(&on_error, b, run.run(b, &mut op, fence)))
    }

    pub(crate) fn executor(&self) -> &Arc<Executor> {
        &self.inner.exec
    }

    /// Splits off a sub-communicator. Collective over this communicator: every rank calls it,
    /// passing the (same) ordered list of ranks of the group it wants to join, or an empty list
    /// to join none. Ranks of the new communicator follow the list order. Returns `None` for
    /// ranks in no group. The sub-communicator inherits the backend, device and options.
    ///
    /// Lists that are malformed (a rank out of range or twice, a group without the caller) or
    /// that disagree between members are `Error::InvalidSplit` on every rank.
    ///
    /// ```
    /// use ferrocomm::prelude::*;
    ///
    /// let comms = Comm::new_group("cpu", &[Device::Cpu; 4], "world", CommOptions::from_env()?)?;
    /// let rank_main = |c: &Comm| -> ferrocomm::Result<()> {
    ///     // Even ranks form one group, odd ranks another, in reverse order.
    ///     let group: &[usize] = if c.rank() % 2 == 0 { &[0, 2] } else { &[3, 1] };
    ///     let sub = c.split(group, "half")?.expect("every rank is in a group");
    ///     assert_eq!(sub.size(), 2);
    ///     assert_eq!(sub.rank(), group.iter().position(|&r| r == c.rank()).unwrap());
    ///     let mut x = [c.rank() as u64];
    ///     sub.all_reduce(&mut x[..], ReduceOp::Sum)?;
    ///     assert_eq!(x[0], group.iter().sum::<usize>() as u64);
    ///     Ok(())
    /// };
    /// std::thread::scope(|s| {
    ///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
    ///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
    /// })?;
    /// # Ok::<(), ferrocomm::Error>(())
    /// ```
    pub fn split(&self, ranks: &[usize], name: &str) -> Result<Option<Comm>> {
        let (me, size) = (self.inner.rank, self.inner.size);
        let generation = self.inner.splits.fetch_add(1, Ordering::Relaxed);
        // Everyone exchanges its list before anyone judges them, so a malformed or
        // inconsistent request fails on every rank at once instead of leaving peers waiting.
        let all: Vec<Vec<usize>> = self.all_gather_object(&ranks.to_vec())?;
        for (r, list) in all.iter().enumerate() {
            let mut seen = vec![false; size];
            for &q in list {
                if q >= size {
                    return Err(Error::InvalidSplit(format!(
                        "rank {r} lists rank {q}, out of range for size {size}"
                    )));
                }
                if std::mem::replace(&mut seen[q], true) {
                    return Err(Error::InvalidSplit(format!("rank {r} lists rank {q} twice")));
                }
            }
            if !list.is_empty() && !seen[r] {
                return Err(Error::InvalidSplit(format!(
                    "rank {r} passes a group {list:?} that does not contain it"
                )));
            }
            if let Some(&q) = list.iter().find(|&&q| all[q] != *list) {
                return Err(Error::InvalidSplit(format!(
                    "rank {r} asked for {list:?} but rank {q} asked for {:?}",
                    all[q]
                )));
            }
        }
        let parent = self.inner.exec.backend();
        let Some(new_rank) = ranks.iter().position(|&r| r == me) else {
            // A backend that splits natively needs every parent rank in the call.
            return match parent.split(&[], None) {
                Some(Err(e)) => Err(e),
                _ => Ok(None),
            };
        };
        let prefix = format!("{}/split{generation}/{}", self.inner.prefix, ranks[0]);
        let c = Comm::create(
            &self.inner.backend_name,
            self.inner.device,
            name,
            new_rank,
            ranks.len(),
            self.inner.store.clone(),
            prefix,
            self.inner.options.clone(),
            None,
            Parent::Split(parent, ranks),
        )?;
        Ok(Some(c))
    }

    /// This rank's part of a new window (collective), built by the backend; the public
    /// `Window` around it is made in crate::window.
    pub(crate) fn window_backend(
        &self,
        bytes: usize,
        opts: WindowOptions,
        registered: Option<*mut u8>,
    ) -> Result<(Box<dyn WindowBackend>, WindowSpec)> {
        self.check_live("new_window")?;
        if opts.signals == 0 {
            return Err(Error::invalid("new_window", "a window needs at least one signal id"));
        }
        let spec = WindowSpec {
            id: self.inner.windows.fetch_add(1, Ordering::Relaxed),
            bytes,
            signals: opts.signals,
            registered,
            timeout: self.inner.options.timeout,
        };
        let backend = self.inner.exec.backend().new_window(&spec)?;
        Ok((backend, spec))
    }

    /// Completes queued operations and closes this rank. Later operations fail with
    /// `Error::Closed`.
    pub fn finalize(&self) -> Result<()> {
        self.check_live("finalize")?;
        self.inner.exec.drain();
        self.inner.state.store(FINALIZED, Ordering::Release);
        self.inner.exec.backend().finalize()
    }

    /// Fails every running and later operation of this rank at once, from any thread, with
    /// `Error::Closed` (state `"aborted"`); peers waiting on this rank get `Error::PeerLost`
    /// naming it with the reason `"aborted"` (or the earlier cause this rank had recorded, if
    /// it aborts because of another rank's failure).
    pub fn abort(&self) {
        abort_rank(&self.inner.state, self.inner.exec.backend());
    }
}

/// What `Comm::abort` does, for callers that hold the parts rather than the `Comm`.
fn abort_rank(state: &AtomicU8, backend: &dyn crate::contracts::backend::Backend) {
    state.store(ABORTED, Ordering::Release);
    backend.abort();
}

/// `abort_on_error`'s mode, the communicator's state, rank and name (see `Comm::finish`).
type OnError = Option<(AbortOnError, Arc<AtomicU8>, usize, String)>;

/// `AbortOnError::Comm` and `Process` after an operation failed with `e`: the communicator
/// aborts first either way, so peers learn at once even when the process then exits.
fn abort_after_failure(
    mode: AbortOnError,
    e: &Error,
    state: &AtomicU8,
    backend: &dyn crate::contracts::backend::Backend,
    rank: usize,
    name: &str,
) {
    tracing::warn!(comm = name, rank, error = %e, ?mode, "operation failed: aborting the communicator");
    abort_rank(state, backend);
    if mode == AbortOnError::Process {
        tracing::error!(comm = name, rank, error = %e, "operation failed: exiting the process (abort_on_error = process)");
        let code = AbortOnError::EXIT_CODE;
        // Also on stderr: the process may have no tracing subscriber, and its last words
        // should say why it ended.
        eprintln!(
            "ferrocomm: rank {rank} of communicator `{name}`: {e}; exiting with status {code} \
             (FERROCOMM_ABORT_ON_ERROR=process)"
        );
        std::process::exit(code);
    }
}
