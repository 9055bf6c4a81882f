//! Byte streams between pairs of ranks. Every pair has one ordered stream in each direction;
//! the CPU backend's progress engine frames messages on top of them.
//!
//! - same host (threads or processes): an SPSC ring in the receiver's shared-memory segment;
//! - other hosts: a TCP connection;
//! - a rank to itself: an in-memory queue.
//!
//! Also here: the board (shm_board.rs), liveness of peer processes, passing descriptors
//! between processes, and the fault record (the first cause of a failure).
//!
//! May import: the contracts and bootstrap.

mod accept;
mod fault;
pub(crate) mod fd_passing;
mod liveness;
mod ring;
mod setup;
mod shm;
pub(crate) mod shm_board;
mod tcp;

pub(crate) use fault::{Cause, FaultRecord};
pub(crate) use liveness::ProcessWatch;
pub(crate) use setup::{bind_listener, connect_all, host_identity, published_addr, Announcer, Transport};
pub(crate) use shm::{OwnerState, Segment};
pub(crate) use tcp::{accept_authenticated, dial};

use ring::RingEnd;
use std::collections::VecDeque;
use std::sync::Arc;
use tcp::TcpLink;

/// One rank's view of its stream pair with one peer.
pub(crate) enum Link {
    Shm(ShmLink),
    Tcp(TcpLink),
    SelfLoop(VecDeque<u8>),
}

pub(crate) struct ShmLink {
    tx: RingEnd,
    rx: RingEnd,
    /// The peer's segment (holds `tx`) and ours (holds `rx`): kept mapped while the ends live.
    peer_seg: Arc<Segment>,
    _own_seg: Arc<Segment>,
    watch: Option<ProcessWatch>,
}

/// Why a link cannot make progress any more.
pub(crate) type Gone = String;

/// A peer that can no longer take part: `rank` is the rank at the root of the failure (the
/// peer itself, or a rank the peer reports it lost).
pub(crate) struct PeerGone {
    pub rank: usize,
    pub reason: String,
}

impl Link {
    /// Writes as much of `src` as the stream takes now.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<usize, Gone> {
        match self {
            Link::Shm(l) => Ok(l.tx.write(src)),
            Link::Tcp(l) => l.write(src),
            Link::SelfLoop(q) => {
                q.extend(src);
                Ok(src.len())
            }
        }
    }

    /// Reads what is available now, up to `dst.len()`.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> Result<usize, Gone> {
        match self {
            Link::Shm(l) => Ok(l.rx.read(dst)),
            Link::Tcp(l) => l.read(dst),
            Link::SelfLoop(q) => {
                let n = dst.len().min(q.len());
                for (d, s) in dst.iter_mut().zip(q.drain(..n)) {
                    *d = s;
                }
                Ok(n)
            }
        }
    }

    /// Has the peer sent bytes we have not read? Only shared-memory links can tell without
    /// reading; the others say no.
    pub(crate) fn has_unread(&self) -> bool {
        matches!(self, Link::Shm(l) if l.rx.unread() > 0)
    }

    /// Called only when no progress is being made: is `peer` still there to make it?
    /// TCP links report loss through read/write errors instead.
    pub(crate) fn check_peer(&self, peer: usize) -> Result<(), PeerGone> {
        let Link::Shm(l) = self else { return Ok(()) };
        check_owner(peer, &l.peer_seg, l.watch.as_ref())
    }
}

/// The state of a peer's segment and process, as an error naming the root rank.
pub(crate) fn check_owner(peer: usize, seg: &Segment, watch: Option<&ProcessWatch>) -> Result<(), PeerGone> {
    let gone = |rank, reason: String| Err(PeerGone { rank, reason });
    match seg.state() {
        OwnerState::Aborted => return gone(peer, "peer aborted".into()),
        OwnerState::Closed => return gone(peer, "peer closed its communicator or window".into()),
        OwnerState::Lost(r) => return gone(r, format!("rank {peer} failed after losing rank {r}")),
        OwnerState::Live => {}
    }
    match watch {
        Some(w) if !w.is_alive() => gone(peer, format!("process {} exited", w.pid())),
        _ => Ok(()),
    }
}

/// How a host thread waits for a peer: spin briefly, then yield, then sleep, because ranks often
/// outnumber cores (tests, one GPU shared). `idle` counts the rounds waited so far.
pub(crate) fn back_off(idle: u32) {
    if idle < 32 {
        std::hint::spin_loop();
    } else if idle < 2048 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}
