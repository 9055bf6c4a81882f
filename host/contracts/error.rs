//! The one error type of ferrocomm. Every variant names what failed and, where known, the
//! operation and the peer, so a log line alone says where to look.

use std::time::Duration;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure ferrocomm reports.
///
/// The message (`Display`) names the failing call and, where known, the operation and the
/// peer rank, so one log line says where to look. Argument errors (`SizeMismatch`,
/// `UnsupportedReduce`, `DTypeMismatch`, `InvalidRank`, `OutOfBounds`, `ElementsOutOfBounds`,
/// `InvalidArgument`, `InvalidSplit`) are found before any byte moves and leave the communicator
/// usable; after a failed transfer (`Timeout`, `PeerLost`, `Mismatch`) a CPU-engine communicator
/// is broken and later calls return [`Error::Closed`]. New variants may be added: match with a `_` arm.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// let comm = Comm::new_group("cpu", &[Device::Cpu], "errors", CommOptions::from_env()?)?.remove(0);
/// // A rank outside 0..size is refused before anything moves; the communicator stays usable.
/// let err = comm.send(&[1u8][..], 5).unwrap_err();
/// assert!(matches!(err, ferrocomm::Error::InvalidRank { rank: 5, size: 1, .. }), "{err}");
/// let mut x = [2u32];
/// comm.all_reduce(&mut x[..], ReduceOp::Sum)?;
/// assert_eq!(x, [2]);
/// # Ok::<(), ferrocomm::Error>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer does not have the size the operation needs.
    #[error("{op}: {what} has {actual} elements, expected {expected}")]
    SizeMismatch {
        /// The operation that checked the buffer (`"all_gather"`, `"window put"`, ...).
        op: &'static str,
        /// Which buffer: `"output"`, `"input"`, `"outputs[2]"`, ...
        what: String,
        /// The number of elements the operation needs there.
        expected: usize,
        /// The number of elements the buffer has.
        actual: usize,
    },
    /// The reduction is not defined for the element type (bitwise ops on floats).
    #[error("{op}: reduce op {reduce} is not supported for dtype {dtype}")]
    UnsupportedReduce {
        /// The operation that was called.
        op: &'static str,
        /// The reduce op, as [`ReduceOp`](crate::ReduceOp) displays it (`band`, `bxor`, ...).
        reduce: String,
        /// The element type's name (`"f32"`, `"bf16"`, ...).
        dtype: &'static str,
    },
    /// Two buffers of one operation have different element types.
    #[error("{op}: dtype mismatch, {expected} vs {actual}")]
    DTypeMismatch {
        /// The operation that was called.
        op: &'static str,
        /// The element type the operation works in (its first buffer's).
        expected: &'static str,
        /// The element type of the buffer that differs.
        actual: &'static str,
    },
    /// A rank argument is outside `0..size`.
    #[error("{op}: rank {rank} is out of range for a communicator of size {size}")]
    InvalidRank {
        /// The operation that was called.
        op: &'static str,
        /// The rank that was passed (a peer, a root, a window target).
        rank: usize,
        /// The communicator's size: valid ranks are `0..size`.
        size: usize,
    },
    /// A window access outside the window.
    #[error("{op}: bytes {offset}..{offset}+{len} of rank {rank} are outside the window of {bytes} bytes")]
    OutOfBounds {
        /// The window operation (`"put"`, `"get"`, `"fetch_add"`, ...).
        op: &'static str,
        /// The rank whose segment was addressed.
        rank: usize,
        /// Start of the access in that segment, bytes.
        offset: usize,
        /// Length of the access, bytes.
        len: usize,
        /// Size of the segment, bytes.
        bytes: usize,
    },
    /// A typed window access outside the window, in elements
    /// ([`TypedWindow`](crate::TypedWindow), [`MappedSegment`](crate::MappedSegment)).
    #[error("{op}: elements {offset}..{offset}+{len} ({dtype}) of rank {rank} are outside the window of {elements} elements")]
    ElementsOutOfBounds {
        /// The window operation (`"put"`, `"get"`, `"fetch_add"`, ...).
        op: &'static str,
        /// The rank whose segment was addressed.
        rank: usize,
        /// Start of the access in that segment, elements.
        offset: usize,
        /// Length of the access, elements.
        len: usize,
        /// Elements of every rank's segment.
        elements: usize,
        /// The element type (`"f32"`, `"u64"`, ...).
        dtype: &'static str,
    },
    /// `split` was called with a rank list that is malformed or inconsistent across ranks.
    #[error("split: {0}")]
    InvalidSplit(String),
    /// Any other argument that cannot be accepted.
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The operation that was called.
        op: &'static str,
        /// What is wrong with the argument and, for an unknown value, the accepted ones.
        reason: String,
    },
    /// More rows were routed to a buffer than its capacity holds (a MoE dispatch: more tokens
    /// for one expert than `MoeShape::capacity`). The rows that fit were delivered and the
    /// counts say how many came; nothing is dropped silently.
    #[error("{op}: {what} received {count} rows, its capacity is {capacity}")]
    CapacityExceeded {
        /// The operation that was called.
        op: &'static str,
        /// Which buffer overflowed (`"local expert 3"`).
        what: String,
        /// The rows routed to it.
        count: usize,
        /// The rows it holds.
        capacity: usize,
    },
    /// Ranks issued different operations (or the same one with different arguments).
    #[error("{op}: mismatched call with rank {peer}: {detail}")]
    Mismatch {
        /// The operation this rank called.
        op: &'static str,
        /// The rank whose call differs.
        peer: usize,
        /// The field that differs and both values (`root: this rank has 0, rank 2 has 1`).
        detail: String,
    },
    /// A blocking wait passed its deadline.
    #[error("{op}: timed out after {after:?}{}", peer_suffix(*.peer))]
    Timeout {
        /// The operation that waited.
        op: &'static str,
        /// The rank it was waiting for, where one is known.
        peer: Option<usize>,
        /// How long it waited (the operation's timeout).
        after: Duration,
    },
    /// A store key did not appear in time (a rank never reached the rendezvous).
    #[error("store: key `{key}` did not appear within {after:?}")]
    StoreTimeout {
        /// The key that was awaited.
        key: String,
        /// How long the store waited for it.
        after: Duration,
    },
    /// The store ended every wait: a rank of an in-process group could not join.
    #[error("store closed: {0}")]
    StoreClosed(
        /// Why the store closed (which rank failed to join and how).
        String,
    ),
    /// A peer process or thread is gone (exited, killed, aborted or dropped its communicator).
    #[error("{op}: lost rank {peer}: {reason}")]
    PeerLost {
        /// The operation that noticed the loss.
        op: &'static str,
        /// The rank at the root of the failure (the recorded cause where there is one,
        /// not necessarily the neighbour this rank was waiting for).
        peer: usize,
        /// What happened to it (`"aborted"`, `"process exited"`, `"... (rank 0 failed after
        /// losing rank 3)"`, ...).
        reason: String,
    },
    /// The survivors of a `Comm::shrink` agreed on a communicator without this rank (it came
    /// after their timeout, or a rank passed it as lost). Its old communicator is closed.
    #[error("{op}: the survivors agreed on ranks {members:?} without rank {rank}")]
    LeftOut {
        /// The operation (`"shrink"`).
        op: &'static str,
        /// This rank, in the old communicator.
        rank: usize,
        /// The old communicator's ranks that the new one has.
        members: Vec<usize>,
    },
    /// This communicator was aborted or finalized.
    #[error("{op}: communicator was {state}")]
    Closed {
        /// The operation that was refused.
        op: &'static str,
        /// Why the communicator or window is closed: `"finalized"`, `"aborted"`,
        /// `"broken by an earlier failed operation"` or `"shut down"`.
        state: &'static str,
    },
    /// A backend cannot run on this machine (library missing, no device, ...).
    #[error("backend `{backend}` is unavailable: {reason}")]
    Unavailable {
        /// The backend (or facility: `"cuda"`, `"nvrtc"`, `"rdma"`) that cannot run.
        backend: String,
        /// What is missing, and where it was looked for.
        reason: String,
    },
    /// No backend is registered under this name.
    #[error("unknown backend `{0}` (registered: {1})")]
    UnknownBackend(
        /// The name that was asked for.
        String,
        /// The registered names, comma-separated.
        String,
    ),
    /// A backend reported an error of its own.
    #[error("backend `{backend}`: {call} failed: {message}")]
    Backend {
        /// The library that failed (`"nccl"`, `"cuda"`, `"nvrtc"`, `"host device"`, `"rdma"`).
        backend: String,
        /// The call that failed (`"ncclAllReduce"`, `"cuMemMap"`, ...).
        call: String,
        /// The library's own message, with its error code.
        message: String,
    },
    /// The store refused us: wrong or missing job token.
    #[error("store authentication failed: {0}")]
    Auth(
        /// Which check failed (no token set, a wrong proof, ...).
        String,
    ),
    /// Store or transport traffic that does not follow the protocol.
    #[error("protocol error ({context}): {reason}")]
    Protocol {
        /// Where the bad traffic was read (`"store frame"`, `"transport setup"`, `"proxy queue"`, ...).
        context: &'static str,
        /// What was wrong with it.
        reason: String,
    },
    /// A frame larger than the configured cap.
    #[error("{context}: frame of {size} bytes exceeds the cap of {max} bytes")]
    FrameTooLarge {
        /// Where the frame was read or written.
        context: &'static str,
        /// The frame's length, bytes.
        size: u64,
        /// The cap, bytes ([`DEFAULT_MAX_FRAME`](crate::DEFAULT_MAX_FRAME) for the store).
        max: u64,
    },
    /// Configuration from the environment or options is missing or malformed.
    #[error("configuration: {0}")]
    Config(
        /// The variable or option, its value, and what was expected.
        String,
    ),
    /// An object could not be (de)serialized.
    #[error("{op}: serialization failed: {reason}")]
    Serialization {
        /// The object operation (`"broadcast_object"`, `"all_gather_object"`, ...).
        op: &'static str,
        /// The serializer's message (or the format-version mismatch).
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// The call and what it was for (`"connect to store 10.0.0.1:29500"`, ...).
        context: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

fn peer_suffix(peer: Option<usize>) -> String {
    match peer {
        Some(p) => format!(" waiting for rank {p}"),
        None => String::new(),
    }
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }

    pub(crate) fn protocol(context: &'static str, reason: impl Into<String>) -> Self {
        Error::Protocol {
            context,
            reason: reason.into(),
        }
    }
}
