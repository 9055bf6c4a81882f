//! Byte streams between pairs of ranks. Every pair has one ordered stream in each direction;
//! the CPU backend's progress engine frames messages on top of them.
//!
//! - same host (threads or processes): an SPSC ring in the receiver's shared-memory segment;
//! - other hosts: a TCP connection;
//! - a rank to itself: an in-memory queue.
//!
//! Large messages between ranks of one host may go by reference instead (pull.rs).
//!
//! Also here: the board (shm_board.rs), how waits pace themselves (crowding.rs), liveness of peer
//! processes, passing descriptors
//! between processes, and the fault record (the first cause of a failure).
//!
//! May import: the contracts and bootstrap.

mod crowding;
mod fault;
mod link;
mod liveness;
mod nonblocking;
mod pull;
mod ring;
mod sealed;
mod setup;
mod shm;
pub(crate) mod shm_board;
mod tcp;

pub(crate) use crowding::SPIN_ROUNDS;
pub(crate) use fault::{Cause, FaultRecord};
pub(crate) use link::{back_off, check_owner, Gone, Link, PeerGone, PeerSegments, ShmLink};
pub(crate) use liveness::ProcessWatch;
pub(crate) use pull::REF_BYTES;
pub(crate) use setup::{bind_listener, connect_all, host_identity, machine, published_addr, Announcer, Transport};
#[cfg(test)]
pub(crate) use setup::{connect_threads_over_tcp, connect_threads_with};
pub(crate) use shm::{OwnerState, Segment};
pub(crate) use tcp::{accept_authenticated, dial, Expect, Handshaken, Lane};
