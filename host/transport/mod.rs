//! Byte streams between pairs of ranks. Every pair has one ordered stream in each direction;
//! the CPU backend's progress engine frames messages on top of them.
//!
//! - same host (threads or processes): an SPSC ring in the receiver's shared-memory segment;
//! - other hosts: a TCP connection;
//! - a rank to itself: an in-memory queue.

mod liveness;
mod ring;
mod setup;
mod shm;
mod tcp;

pub(crate) use liveness::ProcessWatch;
pub(crate) use setup::{connect_all, host_identity, Announcer, Transport};
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

    /// Called only when no progress is being made: is the peer still there to make it?
    /// TCP links report loss through read/write errors instead.
    pub(crate) fn check_peer(&self) -> Result<(), Gone> {
        let Link::Shm(l) = self else { return Ok(()) };
        match l.peer_seg.state() {
            OwnerState::Aborted => return Err("peer aborted its communicator".into()),
            OwnerState::Closed => return Err("peer closed its communicator".into()),
            OwnerState::Live => {}
        }
        match &l.watch {
            Some(w) if !w.is_alive() => Err(format!("process {} exited", w.pid())),
            _ => Ok(()),
        }
    }
}
