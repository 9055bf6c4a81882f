//! One rank's ordered byte streams with one peer (a shared-memory ring pair, a TCP
//! connection, or a loop to itself), and how a peer is found gone.

use super::liveness::ProcessWatch;
use super::ring::RingEnd;
use super::shm::{OwnerState, Segment};
use super::tcp::TcpLink;
use std::collections::VecDeque;
use std::sync::Arc;

/// One rank's view of its stream pair with one peer.
pub(crate) enum Link {
    Shm(ShmLink),
    Tcp(TcpLink),
    SelfLoop(VecDeque<u8>),
}

pub(crate) struct ShmLink {
    pub(crate) tx: RingEnd,
    pub(crate) rx: RingEnd,
    /// The peer's segment (holds `tx`) and ours (holds `rx`): kept mapped while the ends live.
    pub(crate) peer_seg: Arc<Segment>,
    pub(crate) _own_seg: Arc<Segment>,
    pub(crate) watch: Option<ProcessWatch>,
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
