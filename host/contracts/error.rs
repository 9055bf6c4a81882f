//! The one error type of ferrocomm. Every variant names what failed and, where known, the
//! operation and the peer, so a log line alone says where to look.

use std::time::Duration;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A buffer does not have the size the operation needs.
    #[error("{op}: {what} has {actual} elements, expected {expected}")]
    SizeMismatch {
        op: &'static str,
        what: String,
        expected: usize,
        actual: usize,
    },
    /// The reduction is not defined for the element type (bitwise ops on floats).
    #[error("{op}: reduce op {reduce} is not supported for dtype {dtype}")]
    UnsupportedReduce {
        op: &'static str,
        reduce: String,
        dtype: &'static str,
    },
    /// Two buffers of one operation have different element types.
    #[error("{op}: dtype mismatch, {expected} vs {actual}")]
    DTypeMismatch {
        op: &'static str,
        expected: &'static str,
        actual: &'static str,
    },
    /// A rank argument is outside `0..size`.
    #[error("{op}: rank {rank} is out of range for a communicator of size {size}")]
    InvalidRank { op: &'static str, rank: usize, size: usize },
    /// A window access outside the window.
    #[error("{op}: bytes {offset}..{offset}+{len} of rank {rank} are outside the window of {bytes} bytes")]
    OutOfBounds {
        op: &'static str,
        rank: usize,
        offset: usize,
        len: usize,
        bytes: usize,
    },
    /// `split` was called with a rank list that is malformed or inconsistent across ranks.
    #[error("split: {0}")]
    InvalidSplit(String),
    /// Any other argument that cannot be accepted.
    #[error("{op}: {reason}")]
    InvalidArgument { op: &'static str, reason: String },
    /// Ranks issued different operations (or the same one with different arguments).
    #[error("{op}: mismatched call with rank {peer}: {detail}")]
    Mismatch {
        op: &'static str,
        peer: usize,
        detail: String,
    },
    /// A blocking wait passed its deadline.
    #[error("{op}: timed out after {after:?}{}", peer_suffix(*.peer))]
    Timeout {
        op: &'static str,
        peer: Option<usize>,
        after: Duration,
    },
    /// A store key did not appear in time (a rank never reached the rendezvous).
    #[error("store: key `{key}` did not appear within {after:?}")]
    StoreTimeout { key: String, after: Duration },
    /// The store ended every wait: a rank of an in-process group could not join.
    #[error("store closed: {0}")]
    StoreClosed(String),
    /// A peer process or thread is gone (exited, killed, aborted or dropped its communicator).
    #[error("{op}: lost rank {peer}: {reason}")]
    PeerLost {
        op: &'static str,
        peer: usize,
        reason: String,
    },
    /// This communicator was aborted or finalized.
    #[error("{op}: communicator was {state}")]
    Closed { op: &'static str, state: &'static str },
    /// A backend cannot run on this machine (library missing, no device, ...).
    #[error("backend `{backend}` is unavailable: {reason}")]
    Unavailable { backend: String, reason: String },
    /// No backend is registered under this name.
    #[error("unknown backend `{0}` (registered: {1})")]
    UnknownBackend(String, String),
    /// A backend reported an error of its own.
    #[error("backend `{backend}`: {call} failed: {message}")]
    Backend {
        backend: String,
        call: String,
        message: String,
    },
    /// The store refused us: wrong or missing job token.
    #[error("store authentication failed: {0}")]
    Auth(String),
    /// Store or transport traffic that does not follow the protocol.
    #[error("protocol error ({context}): {reason}")]
    Protocol { context: &'static str, reason: String },
    /// A frame larger than the configured cap.
    #[error("{context}: frame of {size} bytes exceeds the cap of {max} bytes")]
    FrameTooLarge { context: &'static str, size: u64, max: u64 },
    /// Configuration from the environment or options is missing or malformed.
    #[error("configuration: {0}")]
    Config(String),
    /// An object could not be (de)serialized.
    #[error("{op}: serialization failed: {reason}")]
    Serialization { op: &'static str, reason: String },
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
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
