//! The progress engine: framed messages over the links, all pending transfers of one step
//! advanced together so that no order of sends and receives can deadlock.
//!
//! Every message starts with a header (header.rs); the first message of a collective between
//! two ranks carries the whole call, and every rank checks the call of every peer whose bytes
//! may land in a user buffer of its before they do (in most collectives every peer; `Lands`),
//! and the others' as they come, so a mismatched call is `Error::Mismatch` on every rank and
//! never corrupted data.

use super::header::{self, Call, Header, Tag, HEADER_BYTES};
use super::held_calls::{self, HeldCalls};
use super::late_calls::LateCalls;
use crate::contracts::backend::LinkLedger;
use crate::contracts::error::{Error, Result};
use crate::net::links::{self, back_off, Link, Transport, REF_BYTES};
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How often a stalled engine looks at deadlines, abort flags and peer liveness.
const CHECK_EVERY: Duration = Duration::from_millis(5);

/// How long a rank whose shared-memory link failed under a message waits for the peer to say
/// whether it lost another rank first (`Engine::lost_at_root`); a peer announces that as soon
/// as its own operation has failed.
const ROOT_CAUSE_WAIT: Duration = Duration::from_millis(200);
/// Late calls per peer that a rank may leave unread before it waits for the oldest
/// (`LateCalls::bound`). Where ranks outnumber CPUs, the farther a root may run ahead, the
/// longer each rank runs before it yields its CPU: 4 processes on 2 cores, 8 B-2 KiB
/// broadcasts, 0.69-1.20 us at 256 against 0.74-1.31 at 64 and 0.93-1.42 at 16 (three
/// interleaved rounds; context switches per broadcast 0.12 at 256, 0.17 at 64, 0.37 at 16).
/// Kept per peer (late_calls.rs), a longer list costs no sweep more.
const LATER_MAX: usize = 256;

// A rank that must wait for a peer's oldest late call finds it sent: peers hold fewer.
const _: () = assert!(held_calls::HOLD_MAX_TCP < LATER_MAX && held_calls::HOLD_MAX_SHM < LATER_MAX);

/// The messages of one exchange: on the stack up to 8, so that most exchanges allocate nothing
/// (a list per call was a `malloc` and a `free` of a broadcast's root per broadcast).
pub(crate) type Xfers<'b> = smallvec::SmallVec<[Xfer<'b>; 8]>;

/// One pending message.
pub(crate) enum Xfer<'b> {
    Send {
        peer: usize,
        hdr: [u8; HEADER_BYTES],
        hpos: usize,
        data: &'b [u8],
        pos: usize,
        /// Carries its collective's call (the first message to this peer).
        call: bool,
        /// Sent by reference (net/links/pull.rs): `pos` stays 0 until the receiver has copied
        /// the payload.
        reference: Option<SentByReference>,
        /// Never by reference: the payload goes through the stream (a refusal's reason, which
        /// the peer reads from there; a broadcast's messages, which stream ahead, but at the
        /// sizes of algorithms.rs, `BROADCAST_BY_REFERENCE`; the ring
        /// steps of all_reduce and reduce_scatter on blocks below 1 MiB, which reduce between
        /// pieces: algorithms.rs, `RING_BY_REFERENCE`).
        in_stream: bool,
    },
    Recv {
        peer: usize,
        expect: Header,
        hdr: [u8; HEADER_BYTES],
        hpos: usize,
        data: &'b mut [u8],
        pos: usize,
        /// Must carry the collective's call.
        call: bool,
        /// Part of a collective's first exchange: no byte lands in `data` before every call
        /// of that exchange has been checked.
        gated: bool,
        /// A late call (late_calls.rs): checked when it arrives, in this exchange or a later
        /// one, and no gate waits for it.
        later: bool,
        /// Made by an earlier collective (named in a mismatch).
        earlier: bool,
    },
}

/// A message sent by reference: the reference, how much of it is in the stream, and the
/// stream position after it once it is all there (the receiver has copied the payload when it
/// has read that far).
pub(crate) struct SentByReference {
    raw: [u8; REF_BYTES],
    rpos: usize,
    end: Option<u64>,
}

impl Xfer<'_> {
    fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
        }
    }

    fn done(&self) -> bool {
        match self {
            Xfer::Send { hpos, data, pos, .. } => *hpos == HEADER_BYTES && *pos == data.len(),
            Xfer::Recv { hpos, data, pos, .. } => *hpos == HEADER_BYTES && *pos == data.len(),
        }
    }

    fn is_call(&self) -> bool {
        match self {
            Xfer::Send { call, .. } | Xfer::Recv { call, .. } => *call,
        }
    }

    /// A call receive whose header has not arrived (and been checked) yet, and which the gate of
    /// its exchange waits for (a later one does not hold bytes from other peers back: engine.rs,
    /// `Lands`).
    fn call_pending(&self) -> bool {
        matches!(self, Xfer::Recv { call: true, later: false, hpos, .. } if *hpos < HEADER_BYTES)
    }

    /// A receive whose header has been checked and whose payload waits for the gate.
    fn held_by_gate(&self) -> bool {
        matches!(self, Xfer::Recv { gated: true, hpos, pos, data, .. } if *hpos == HEADER_BYTES && *pos < data.len())
    }

    /// A message by reference all in the stream, waiting for its receiver to copy it.
    fn awaits_copy(&self) -> bool {
        matches!(self, Xfer::Send { reference: Some(SentByReference { end: Some(_), .. }), .. } if !self.done())
    }

    /// A later call receive that has not arrived, kept for the next exchange (its buffer is
    /// empty, so it outlives the exchange's borrows); `None` for anything else.
    fn detach(self) -> Option<Xfer<'static>> {
        match self {
            Xfer::Recv {
                peer,
                expect,
                hdr,
                hpos,
                data: [],
                pos,
                call,
                gated,
                later: true,
                earlier,
            } => Some(Xfer::Recv {
                peer,
                expect,
                hdr,
                hpos,
                data: Default::default(),
                pos,
                call,
                gated,
                later: true,
                earlier,
            }),
            _ => None,
        }
    }
}

/// The collective being run, until its first exchange has checked every peer's call.
struct OpenCall {
    tag: Tag,
    call: Call,
    /// The algorithm's first exchange is symmetric (a rank sends to p in it exactly when p
    /// receives from that rank in its own): its messages carry the call, and header-only call
    /// messages cover the pairs it does not reach. Otherwise header-only call messages to and
    /// from every peer come first.
    symmetric: bool,
    /// Whose calls this rank checks before a byte lands in its buffer.
    lands: Lands,
    /// A broadcast's: no peer waits for our header-only call but `feeds`, so the others may be
    /// held (held_calls.rs).
    hold_calls: bool,
    /// The peer our data lands at, which checks our call before it does (the chain's next rank;
    /// in the direct broadcast the root's data carries its call).
    feeds: Option<usize>,
    /// Peers whose first message from us in this collective comes after its first exchange
    /// and carries the call (a tree's children: broadcast_tree.rs); taken off as it goes.
    carries_later: SmallVec<[usize; 4]>,
    first_pending: bool,
    /// Header-only call messages, sent with the first exchange.
    preamble: Vec<Xfer<'static>>,
}

/// Whose bytes land in a rank's buffers in a collective: it checks their calls before they do,
/// and the other peers' calls as they come (engine.rs, `begin_call`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Lands {
    /// Any peer's (its data, or a reduction that includes it).
    FromAll,
    /// Only this peer's, which checked the call of whoever its data came from in turn (a
    /// broadcast's receiver: the root's in the direct broadcast, the previous rank's in the
    /// chain).
    From(usize),
    /// None: this rank writes no user buffer (a broadcast's root, gather's and reduce's other
    /// ranks).
    Nothing,
}

/// Paces a host wait: backs off while nothing happens, and says when a stalled wait should
/// look at deadlines, abort flags and peers.
pub(crate) struct Pacer {
    idle: u32,
    /// Rounds to spin before yielding (`back_off`).
    spin: u32,
    /// When the next stall check is due; set when the wait first stalls, so that a wait that
    /// never does (most small messages) reads no clock.
    next_check: Option<Instant>,
}

impl Pacer {
    /// A pacer for a wait on `transport`'s peers.
    pub(crate) fn new(transport: &Transport) -> Pacer {
        Pacer {
            idle: 0,
            spin: transport.spin_rounds(),
            next_check: None,
        }
    }

    pub(crate) fn progressed(&mut self) {
        self.idle = 0;
    }

    /// Backs off once; returns the time when a stall check is due. The first clock read of
    /// a stall starts `ctx`'s deadline.
    pub(crate) fn stalled(&mut self, ctx: &OpCtx<'_>) -> Option<Instant> {
        self.idle = self.idle.saturating_add(1);
        back_off(self.idle, self.spin);
        if self.idle < 64 {
            return None;
        }
        let now = Instant::now();
        match self.next_check {
            Some(due) if now < due => None,
            Some(_) => {
                self.next_check = Some(now + CHECK_EVERY);
                Some(now)
            }
            None => {
                ctx.stalled_at(now);
                self.next_check = Some(now + CHECK_EVERY);
                None
            }
        }
    }
}

/// The deadline and abort flag of the operation being run.
///
/// The deadline runs from the operation's first stall, not from its start: most small
/// operations never stall, and a clock read per operation was 15% of a world-1 broadcast's
/// 0.13 us (docs/results/cpu.md, "Calls with nothing queued"). An operation that stalls waits
/// at most its timeout (and one `CHECK_EVERY`) from then on; one that never stalls is moving.
pub(crate) struct OpCtx<'a> {
    pub op: &'static str,
    pub timeout: Duration,
    pub abort: &'a AtomicBool,
    deadline: Cell<Option<Instant>>,
}

impl<'a> OpCtx<'a> {
    pub(crate) fn new(op: &'static str, timeout: Duration, abort: &'a AtomicBool) -> OpCtx<'a> {
        OpCtx {
            op,
            timeout,
            abort,
            deadline: Cell::new(None),
        }
    }

    /// The operation has stalled at `now`: its deadline starts here, unless it already has.
    pub(crate) fn stalled_at(&self, now: Instant) -> Instant {
        match self.deadline.get() {
            Some(d) => d,
            None => {
                // A timeout too long to add is no deadline at all.
                let d = now
                    .checked_add(self.timeout)
                    .unwrap_or(now + Duration::from_secs(1 << 40));
                self.deadline.set(Some(d));
                d
            }
        }
    }

    /// Fails if the operation was aborted or ran out of time; `peer` is the one still awaited.
    pub(crate) fn check(&self, now: Instant, peer: impl FnOnce() -> Option<usize>) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Closed {
                op: self.op,
                state: "aborted",
            });
        }
        if now >= self.stalled_at(now) {
            return Err(Error::Timeout {
                op: self.op,
                peer: peer(),
                after: self.timeout,
            });
        }
        Ok(())
    }
}

pub(crate) struct Engine {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) transport: Transport,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    /// Per-peer "already advanced a message this sweep" stamps: messages to one peer must go
    /// out (and come in) in the order they were queued.
    tx_stamp: Vec<u64>,
    rx_stamp: Vec<u64>,
    sweep: u64,
    /// Collectives started on this communicator (shared-memory rounds included).
    calls: u64,
    open: Option<OpenCall>,
    /// Peers' calls checked as they come, not yet arrived (late_calls.rs).
    late: LateCalls<Xfer<'static>>,
    /// The exchange being run reads the late calls (`poll_due`).
    poll_late: bool,
    /// Late calls left after the last look at them (lowered as they are read otherwise), and
    /// how many more may gather before the next look (`poll_due`).
    late_after_poll: usize,
    late_poll_step: usize,
    /// Exchanges that looked at the late calls (tests count them).
    late_looks: u64,
    /// Our header-only calls that no peer waits for, not yet sent (held_calls.rs).
    held: HeldCalls,
    /// Kept between collectives, so that finding the pairs a first exchange leaves out
    /// allocates nothing.
    unreached: Unreached,
    /// Kept between sweeps: the peers whose held calls are due.
    due_scratch: Vec<usize>,
    /// Kept between collectives: the list of header-only call messages, empty.
    spare_preamble: Vec<Xfer<'static>>,
}

/// The peers a symmetric first exchange sends nothing to (`to`) and receives nothing from
/// (`from`): header-only call messages cover those pairs.
#[derive(Default)]
struct Unreached {
    /// Per rank: `SENT` and `RECEIVED` where the exchange does either.
    reach: Vec<u8>,
    to: Vec<usize>,
    from: Vec<usize>,
}

const SENT: u8 = 1;
const RECEIVED: u8 = 2;

impl Unreached {
    fn find(&mut self, rank: usize, size: usize, xfers: &[Xfer<'_>]) {
        self.reach.clear();
        self.reach.resize(size, 0);
        self.reach[rank] = SENT | RECEIVED;
        for x in xfers {
            match x {
                Xfer::Send { peer, .. } => self.reach[*peer] |= SENT,
                Xfer::Recv { peer, .. } => self.reach[*peer] |= RECEIVED,
            }
        }
        self.to.clear();
        self.from.clear();
        for (p, &r) in self.reach.iter().enumerate() {
            if r & SENT == 0 {
                self.to.push(p);
            }
            if r & RECEIVED == 0 {
                self.from.push(p);
            }
        }
    }
}

impl Engine {
    pub(crate) fn new(rank: usize, size: usize, transport: Transport) -> Engine {
        Engine {
            rank,
            size,
            send_seq: vec![0; size],
            recv_seq: vec![0; size],
            tx_stamp: vec![0; size],
            rx_stamp: vec![0; size],
            sweep: 0,
            calls: 0,
            open: None,
            late: LateCalls::default(),
            poll_late: false,
            late_after_poll: 0,
            late_poll_step: held_calls::hold_max_sum(&transport.links, rank),
            late_looks: 0,
            held: HeldCalls::default(),
            unreached: Unreached::default(),
            due_scratch: Vec::new(),
            spare_preamble: Vec::new(),
            transport,
        }
    }

    /// Publishes our contribution to the next shared-memory round (see net/links/shm_board.rs),
    /// with the count of framed messages sent to each peer so far (all complete between
    /// operations). The caller has waited for the slot to be free.
    pub(crate) fn publish_round(&mut self, label: u64, parts: &[&[u8]]) -> u64 {
        let board = self.transport.board.as_mut().expect("callers check for a board");
        board.publish(label, parts, &self.send_seq)
    }

    /// As `publish_round`, with no data and `nbytes` as the round's byte count
    /// (`Board::publish_count`).
    pub(crate) fn publish_round_count(&mut self, label: u64, nbytes: u64) -> u64 {
        let board = self.transport.board.as_mut().expect("callers check for a board");
        board.publish_count(label, nbytes, &self.send_seq)
    }

    /// As `publish_round` of one part, with `nbytes` as the round's byte count
    /// (`Board::publish_first_piece`).
    pub(crate) fn publish_round_first_piece(&mut self, label: u64, data: &[u8], nbytes: u64) -> u64 {
        let board = self.transport.board.as_mut().expect("callers check for a board");
        board.publish_first_piece(label, data, nbytes, &self.send_seq)
    }

    /// What our links carried, for `Comm::shrink` (see `LinkLedger`); `None` in the middle
    /// of a collective.
    pub(crate) fn ledger(&self) -> Option<LinkLedger> {
        if self.open.is_some() {
            return None;
        }
        let owed: Vec<u64> = (0..self.size).map(|p| self.late.owed_by(p) as u64).collect();
        // A late call's receive was counted when it was posted.
        let taken = (0..self.size).map(|p| self.recv_seq[p] - owed[p]).collect();
        let quiet = (0..self.size)
            .map(|p| p != self.rank && self.transport.check_peer(p).is_err())
            .collect();
        Some(LinkLedger {
            sent: self.send_seq.clone(),
            taken,
            owed,
            board_round: self.transport.board.as_ref().map(|b| b.next_round()),
            quiet,
        })
    }

    /// Takes in what `members` still owe us (`LinkLedger::owed`: they sent it before their
    /// shrink), sends them the calls we hold, and hands the links to them on
    /// (`Transport::hand_over`); the rest are dropped, with what the others owed and what we
    /// held for them (a lost rank's link may no longer take a byte). This engine is left
    /// without links.
    pub(crate) fn hand_over(&mut self, ctx: &OpCtx<'_>, members: &[usize], keep_board: bool) -> Result<Transport> {
        self.late.keep_only(members);
        self.held.keep_only(members);
        self.settle_deferred(ctx)?;
        Ok(self.transport.hand_over(members, keep_board))
    }

    /// Collectives begun so far (a quiet rank's count stays put: idle_senders.rs).
    pub(crate) fn ops_begun(&self) -> u64 {
        self.calls
    }

    /// Whether calls to any peer are held (held_calls.rs).
    pub(crate) fn holds_calls(&self) -> bool {
        self.held.any()
    }

    /// Writes every held call the links take now, for a rank that runs nothing (idle_senders.rs);
    /// returns whether some are left for a later try on a link that has not failed. A link that
    /// fails keeps its calls (the rank's own next use of it reports the failure); the others'
    /// still go.
    pub(crate) fn send_held_calls(&mut self) -> bool {
        self.held.make_due();
        let peers: SmallVec<[usize; 8]> = self.held.peers().collect();
        let mut failed = 0;
        for p in peers {
            failed += usize::from(self.held.pump(p, self.transport.link(p)).is_err());
        }
        self.held.peers().count() > failed
    }

    /// Framed messages received from `peer` so far.
    pub(crate) fn received_from(&self, peer: usize) -> u64 {
        self.recv_seq[peer]
    }

    /// Starts a collective whose algorithm follows at once. Every rank sends each peer its
    /// call in the first message of the collective, and no byte lands in a user buffer before
    /// every peer's call has been checked, so a mismatched call is found on every rank before
    /// it writes anything. `symmetric`: see `OpenCall`. `writes`: this rank writes a user
    /// buffer in this collective; a rank that only sends (a broadcast's root, gather's and
    /// reduce's other ranks) does not wait for the peers' calls but checks them when they
    /// arrive, in this collective or a later one, so that it can run ahead as its sends allow.
    // Inlined, as are `Comm::prepare_run` and `OpRun::new`: built in a frame of their own, the
    // call's structs were read back whole right after their fields were stored, a stall
    // (store forwarding) on every call; inlined, small calls on a world of one took 0.88-0.98
    // of the time (docs/results/cpu.md, part 16).
    #[inline(always)]
    pub(crate) fn begin_call(&mut self, tag: Tag, call: Call, symmetric: bool, writes: bool) {
        let lands = if writes { Lands::FromAll } else { Lands::Nothing };
        self.open_call(tag, call, symmetric, lands, None);
    }

    /// As `begin_call`, for a broadcast: a receiver checks before a byte lands only the call of
    /// the rank its bytes come from (`lands`: the root in the direct broadcast, the previous
    /// rank in the chain), which checked the call of the rank before it in turn, so the bytes
    /// that land were sent under the very call this rank made. The other peers' calls it checks
    /// as they come, as the root does, and reports a mismatch with them at the latest when it
    /// next waits for them: so receivers do not wait for each other, and a root and its
    /// receivers stream ahead as their messages allow. Our header-only calls, which no peer
    /// waits for but `feeds` (the rank our data lands at, which checks our call first), are
    /// held and sent several at a time (held_calls.rs); a rank that goes quiet holding some has
    /// them sent for it (idle_senders.rs), as a peer's close waits for them.
    #[inline(always)]
    pub(crate) fn begin_broadcast_call(
        &mut self,
        tag: Tag,
        call: Call,
        symmetric: bool,
        lands: Lands,
        feeds: Option<usize>,
    ) {
        self.open_call(tag, call, symmetric, lands, Some(feeds));
    }

    /// As `begin_broadcast_call` with a symmetric first exchange, for an algorithm whose rank
    /// first sends to `carries_later` after it: its first message to each of them carries the
    /// call, as a first exchange's would (a tree's inner rank, which receives from its parent
    /// before it sends to its children: broadcast_tree.rs). No peer waits for our other calls.
    pub(crate) fn begin_broadcast_call_carried(&mut self, tag: Tag, call: Call, lands: Lands, carries_later: &[usize]) {
        self.open_call(tag, call, true, lands, Some(None));
        if let Some(o) = &mut self.open {
            o.carries_later.extend_from_slice(carries_later);
        }
    }

    #[inline(always)]
    /// `broadcast_feeds`: a broadcast's, with the peer our data lands at (`begin_broadcast_call`).
    fn open_call(
        &mut self,
        tag: Tag,
        call: Call,
        symmetric: bool,
        lands: Lands,
        broadcast_feeds: Option<Option<usize>>,
    ) {
        self.calls += 1;
        let call = Call {
            seq: self.calls,
            ..call
        };
        let mut open = OpenCall {
            tag,
            call,
            symmetric,
            lands,
            hold_calls: broadcast_feeds.is_some(),
            feeds: broadcast_feeds.flatten(),
            first_pending: true,
            preamble: Vec::new(),
            carries_later: SmallVec::new(),
        };
        if !symmetric {
            // Created before any message of the algorithm, so first on every stream.
            let peers: Vec<usize> = (0..self.size).filter(|&p| p != self.rank).collect();
            open.preamble = self.call_messages(&open, &peers, &peers);
        }
        self.open = Some(open);
    }

    /// Header-only call messages to `to` and from `from`; the receives from peers whose bytes
    /// do not land here go to the late calls (`late`) instead of the returned list, and a
    /// message no peer waits for may be held (`held`).
    fn call_messages(&mut self, open: &OpenCall, to: &[usize], from: &[usize]) -> Vec<Xfer<'static>> {
        let tag = Tag { nbytes: 0, ..open.tag };
        // The list of the last collective, given back empty (`exchange_all`): most collectives
        // allocate none.
        let mut out = std::mem::take(&mut self.spare_preamble);
        for &p in to {
            let x = self.xfer_send(p, tag, &[], Some(open.call));
            if let Xfer::Send { hdr, .. } = &x {
                // Over TCP a message is a system call, on one host a ring's line that the
                // peer's core reads (held_calls.rs).
                let waited_for = open.feeds == Some(p);
                if open.hold_calls && !waited_for {
                    // A pending link is to a peer on this host (made at first use, not here).
                    let max = held_calls::hold_max(&self.transport.links[p]);
                    self.held.hold(p, hdr, max);
                    continue;
                }
            }
            out.push(x);
        }
        for &p in from {
            let mut recv = self.xfer_recv(p, tag, Default::default(), Some(open.call), true);
            let first = match open.lands {
                Lands::FromAll => true,
                Lands::From(q) => q == p,
                Lands::Nothing => false,
            };
            if first {
                out.push(recv);
            } else {
                if let Xfer::Recv { later, earlier, .. } = &mut recv {
                    (*later, *earlier) = (true, true);
                }
                self.late.push(p, recv);
            }
        }
        out
    }

    /// A collective that runs as a shared-memory round, outside the framed messages.
    pub(crate) fn count_call(&mut self) {
        self.calls += 1;
    }

    /// Ends the collective started by `begin_call`.
    pub(crate) fn end_call(&mut self) {
        self.open = None;
    }

    /// The call a message created now carries, and whether a receive created now is gated.
    fn first_exchange(&self) -> (Option<Call>, bool) {
        match &self.open {
            Some(o) if o.first_pending => (o.symmetric.then_some(o.call), true),
            _ => (None, false),
        }
    }

    fn xfer_send<'b>(&mut self, peer: usize, tag: Tag, data: &'b [u8], call: Option<Call>) -> Xfer<'b> {
        let h = next_header(&mut self.send_seq, peer, tag, data.len(), call);
        Xfer::Send {
            peer,
            hdr: header::encode(&h),
            hpos: 0,
            data,
            pos: 0,
            call: call.is_some(),
            reference: None,
            in_stream: false,
        }
    }

    fn xfer_recv<'b>(
        &mut self,
        peer: usize,
        tag: Tag,
        data: &'b mut [u8],
        call: Option<Call>,
        gated: bool,
    ) -> Xfer<'b> {
        let expect = next_header(&mut self.recv_seq, peer, tag, data.len(), call);
        Xfer::Recv {
            peer,
            expect,
            hdr: [0; HEADER_BYTES],
            hpos: 0,
            data,
            pos: 0,
            call: call.is_some(),
            gated,
            later: false,
            earlier: false,
        }
    }

    /// Queues a message to `peer`. Messages to one peer arrive in the order they are created.
    pub(crate) fn send<'b>(&mut self, peer: usize, tag: Tag, data: &'b [u8]) -> Xfer<'b> {
        let (call, _) = self.first_exchange();
        let call = call.or_else(|| self.carried_later(peer));
        self.xfer_send(peer, tag, data, call)
    }

    /// The call, if our first message to `peer` in this collective carries it past the first
    /// exchange (`begin_broadcast_call_carried`); once.
    fn carried_later(&mut self, peer: usize) -> Option<Call> {
        let o = self.open.as_mut().filter(|o| !o.carries_later.is_empty())?;
        let i = o.carries_later.iter().position(|&p| p == peer)?;
        o.carries_later.swap_remove(i);
        Some(o.call)
    }

    /// As `send`, but the payload always goes through the stream, never by reference
    /// (net/links/pull.rs): for a sender that should not wait for its receiver to copy, such
    /// as a chain that streams chunks ahead.
    pub(crate) fn send_in_stream<'b>(&mut self, peer: usize, tag: Tag, data: &'b [u8]) -> Xfer<'b> {
        let mut x = self.send(peer, tag, data);
        if let Xfer::Send { in_stream, .. } = &mut x {
            *in_stream = true;
        }
        x
    }

    /// Expects a message from `peer` of exactly `data.len()` bytes.
    pub(crate) fn recv<'b>(&mut self, peer: usize, tag: Tag, data: &'b mut [u8]) -> Xfer<'b> {
        let (call, gated) = self.first_exchange();
        self.xfer_recv(peer, tag, data, call, gated)
    }

    /// Advances one message as far as its link allows; returns whether anything moved.
    /// `calls_pending`: call receives whose header has not been checked yet; payloads of gated
    /// receives are read only once it is 0 (this step may bring it there).
    fn step(link: &mut Link, x: &mut Xfer<'_>, op: &'static str, calls_pending: &mut usize) -> Result<bool> {
        let lost = |peer: usize, reason: String| Error::PeerLost { op, peer, reason };
        match x {
            Xfer::Send {
                peer,
                hdr,
                hpos,
                data,
                pos,
                reference,
                in_stream,
                ..
            } => {
                // Decided before the header leaves.
                if *hpos == 0 && !*in_stream && reference.is_none() && link.sends_by_reference(data.len()) {
                    header::mark_by_reference(hdr);
                    *reference = Some(SentByReference {
                        raw: link.reference_to(data),
                        rpos: 0,
                        end: None,
                    });
                }
                if let Some(r) = reference {
                    let mut copied = false;
                    let moved = Self::step_reference(link, hdr, hpos, r, &mut copied).map_err(|g| lost(*peer, g))?;
                    if copied {
                        *pos = data.len();
                    }
                    return Ok(moved);
                }
                if *hpos == 0 && link.sends_in_bulk(data.len()) {
                    header::mark_bulk(hdr);
                }
                let mut moved = false;
                if header::in_bulk(hdr) {
                    // The header on the link's stream, the payload on its second connection:
                    // each in its own order, so both may move in one step.
                    if *hpos < HEADER_BYTES {
                        let n = link.write(&hdr[*hpos..]).map_err(|r| lost(*peer, r))?;
                        *hpos += n;
                        moved |= n > 0;
                    }
                    if *pos < data.len() {
                        let n = link.write_bulk(&data[*pos..]).map_err(|r| lost(*peer, r))?;
                        *pos += n;
                        moved |= n > 0;
                    }
                    return Ok(moved);
                }
                if *hpos < HEADER_BYTES {
                    // The header and the payload together: one write where the link can.
                    let n = link
                        .write_pair(&hdr[*hpos..], &data[*pos..])
                        .map_err(|r| lost(*peer, r))?;
                    let of_header = n.min(HEADER_BYTES - *hpos);
                    *hpos += of_header;
                    *pos += n - of_header;
                    return Ok(n > 0 || link.take_progress());
                }
                if *pos < data.len() {
                    let n = link.write(&data[*pos..]).map_err(|r| lost(*peer, r))?;
                    *pos += n;
                    moved |= n > 0;
                }
                Ok(moved | link.take_progress())
            }
            Xfer::Recv {
                peer,
                expect,
                hdr,
                hpos,
                data,
                pos,
                gated,
                earlier,
                call,
                later,
            } => {
                let mut moved = false;
                if *hpos < HEADER_BYTES {
                    let n = link.read(&mut hdr[*hpos..]).map_err(|r| lost(*peer, r))?;
                    *hpos += n;
                    moved |= n > 0;
                    if *hpos < HEADER_BYTES {
                        return Ok(moved | link.take_progress());
                    }
                    // A header-only message ends here, whatever the check finds: a drain after a
                    // mismatch or a refusal goes on from the next message. (Where the check
                    // passes, the header says what we expect: decoding it again would cost
                    // every message.)
                    let checked = header::check(op, *peer, hdr, expect);
                    let header_only = match checked {
                        Ok(()) => data.is_empty(),
                        Err(_) => header::stream_len(hdr) == Some(0),
                    };
                    if header_only {
                        link.end_message();
                    }
                    checked.map_err(|e| match e {
                        Error::Mismatch { op, peer, detail } if *earlier => Error::Mismatch {
                            op,
                            peer,
                            detail: format!(
                                "in an earlier {} (collective {}): {detail}",
                                header::op_name(expect.tag.op),
                                expect.call.map_or(0, |c| c.seq)
                            ),
                        },
                        other => other,
                    })?;
                    if *call && !*later {
                        *calls_pending -= 1;
                    }
                }
                if *pos < data.len() && (*calls_pending == 0 || !*gated) {
                    if header::by_reference(hdr) {
                        if link.pull(&mut data[*pos..]).map_err(|r| lost(*peer, r))? {
                            *pos = data.len();
                            moved = true;
                        }
                    } else if header::in_bulk(hdr) {
                        let n = link.read_bulk(&mut data[*pos..]).map_err(|r| lost(*peer, r))?;
                        *pos += n;
                        moved |= n > 0;
                    } else {
                        let n = link.read(&mut data[*pos..]).map_err(|r| lost(*peer, r))?;
                        *pos += n;
                        moved |= n > 0;
                    }
                    if *pos == data.len() {
                        link.end_message();
                    }
                }
                Ok(moved | link.take_progress())
            }
        }
    }

    /// Advances a message sent by reference: its header and reference into the stream, then
    /// the wait until the receiver has read past them, which it does once it has copied the
    /// payload. Returns whether anything moved; `*copied` once the receiver has the payload.
    fn step_reference(
        link: &mut Link,
        hdr: &[u8; HEADER_BYTES],
        hpos: &mut usize,
        r: &mut SentByReference,
        copied: &mut bool,
    ) -> std::result::Result<bool, links::Gone> {
        match r.end {
            None => {
                let n = link.write_pair(&hdr[*hpos..], &r.raw[r.rpos..])?;
                let of_header = n.min(HEADER_BYTES - *hpos);
                *hpos += of_header;
                r.rpos += n - of_header;
                if *hpos == HEADER_BYTES && r.rpos == REF_BYTES {
                    r.end = Some(link.written());
                }
                Ok(n > 0)
            }
            Some(end) => {
                *copied = link.taken(end);
                Ok(*copied)
            }
        }
    }

    /// One pass over the pending messages, `pre` before `xfers`; returns (all done, anything
    /// moved).
    fn sweep<'b>(&mut self, ctx: &OpCtx<'_>, pre: &mut [Xfer<'b>], xfers: &mut [Xfer<'b>]) -> Result<(bool, bool)> {
        self.sweep += 1;
        let mut calls_pending = pre.iter().chain(xfers.iter()).filter(|x| x.call_pending()).count();
        let (mut all_done, mut moved) = (true, false);
        if self.held.any_due() {
            // First on their stream: no later message to that peer moves until they are out.
            let mut due = std::mem::take(&mut self.due_scratch);
            due.clear();
            due.extend(self.held.due_peers());
            for &to in &due {
                moved |= match self.held.pump(to, self.transport.link(to)) {
                    Ok(m) => m,
                    Err(reason) => return Err(self.lost_at_root(ctx.op, to, reason)),
                };
                if self.held.holds_for(to) {
                    all_done = false;
                    self.tx_stamp[to] = self.sweep;
                }
            }
            self.due_scratch = due;
        }
        if self.poll_late {
            // First on their streams: no later message from that peer moves until they are in.
            for peer in 0..self.size {
                if self.late.owed_by(peer) == 0 {
                    continue;
                }
                let link = self.transport.link(peer);
                // Late calls count against no gate (`Xfer::call_pending`).
                let step = |x: &mut Xfer<'static>| Ok((Self::step(link, x, ctx.op, &mut 0)?, x.done()));
                moved |= match self.late.pump(peer, step) {
                    Ok(m) => m,
                    Err(Error::PeerLost { op, peer, reason }) => return Err(self.lost_at_root(op, peer, reason)),
                    Err(e) => return Err(e),
                };
                if self.late.owed_by(peer) > 0 {
                    self.rx_stamp[peer] = self.sweep;
                    all_done &= !self.late.needs(peer);
                }
            }
        }
        // A message counts against `all_done` only if it is still pending after its step: one
        // that this sweep finishes needs no second sweep to be seen done.
        for x in pre.iter_mut().chain(xfers.iter_mut()) {
            if x.done() {
                continue;
            }
            let peer = x.peer();
            let stamp = match x {
                Xfer::Send { .. } => &mut self.tx_stamp[peer],
                Xfer::Recv { .. } => &mut self.rx_stamp[peer],
            };
            if *stamp == self.sweep {
                // An earlier message to/from this peer is still in flight.
                all_done = false;
                continue;
            }
            *stamp = self.sweep;
            moved |= match Self::step(self.transport.link(peer), x, ctx.op, &mut calls_pending) {
                Ok(m) => m,
                Err(Error::PeerLost { op, peer, reason }) => return Err(self.lost_at_root(op, peer, reason)),
                Err(e) => return Err(e),
            };
            if !x.done() {
                all_done = false;
                continue;
            }
            // A finished message frees its peer for the next one in this same sweep.
            match x {
                Xfer::Send { .. } => self.tx_stamp[peer] = 0,
                Xfer::Recv { .. } => self.rx_stamp[peer] = 0,
            }
        }
        Ok((all_done, moved))
    }

    /// The error for a link to `peer` that failed under a message: over shared memory, a peer
    /// that gave up its own operation because it lost another rank (and so withdrew the
    /// message we were copying, pull.rs) says so in its segment right after, and then that rank
    /// is the one named, as every survivor names it. Waits up to `ROOT_CAUSE_WAIT` for the
    /// peer's word while the peer still looks alive.
    fn lost_at_root(&mut self, op: &'static str, peer: usize, reason: String) -> Error {
        if !matches!(self.transport.link(peer), Link::Shm(_)) {
            return Error::PeerLost { op, peer, reason };
        }
        let until = Instant::now() + ROOT_CAUSE_WAIT;
        loop {
            match self.transport.check_peer(peer) {
                Err(g) if g.rank != peer => {
                    return Error::PeerLost {
                        op,
                        peer: g.rank,
                        reason: g.reason,
                    }
                }
                Ok(()) if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
                _ => return Error::PeerLost { op, peer, reason },
            }
        }
    }

    /// Runs every message to completion, or fails with the reason and the peer.
    pub(crate) fn exchange<'b>(&mut self, ctx: &OpCtx<'_>, xfers: &mut [Xfer<'b>]) -> Result<()> {
        let r = self.exchange_all(ctx, xfers);
        if r.is_err() {
            self.withdraw_references(xfers);
        }
        r
    }

    /// On the way out of a failed exchange, whose buffers its caller may free next: takes back
    /// every reference a receiver has not copied yet (net/links/pull.rs), so that a late copy
    /// is an error on the receiver rather than data.
    fn withdraw_references(&mut self, xfers: &[Xfer<'_>]) {
        for x in xfers {
            if let Xfer::Send {
                peer,
                reference: Some(_),
                ..
            } = x
            {
                if !x.done() {
                    self.transport.link(*peer).withdraw();
                }
            }
        }
    }

    fn exchange_all<'b>(&mut self, ctx: &OpCtx<'_>, xfers: &mut [Xfer<'b>]) -> Result<()> {
        let preamble = match self.open.take() {
            Some(mut o) if o.first_pending => {
                o.first_pending = false;
                if o.symmetric {
                    // Call messages for the pairs this first exchange does not reach. Nothing of
                    // this collective travels on those pairs yet, so they come first there.
                    let mut u = std::mem::take(&mut self.unreached);
                    u.find(self.rank, self.size, xfers);
                    // Reached later, by a message that carries the call.
                    u.to.retain(|p| !o.carries_later.contains(p));
                    o.preamble = self.call_messages(&o, &u.to, &u.from);
                    self.unreached = u;
                }
                let pre = std::mem::take(&mut o.preamble);
                self.open = Some(o);
                pre
            }
            other => {
                self.open = other;
                Vec::new()
            }
        };
        // Held calls go out before any later message to their peer.
        if self.held.any() {
            for x in preamble.iter().chain(xfers.iter()) {
                if let Xfer::Send { peer, .. } = x {
                    self.held.make_due_for(*peer);
                }
            }
        }
        // Most exchanges have no late call to look at.
        if !self.late.is_empty() {
            self.late.bound(LATER_MAX);
            self.poll_late = self.poll_due(&preamble, xfers);
        }
        let mut pre: Vec<Xfer<'b>> = preamble;
        let r = self.run(ctx, &mut pre, xfers);
        if std::mem::take(&mut self.poll_late) {
            self.late_after_poll = self.late.len();
            self.late_looks += 1;
        }
        if matches!(r, Err(Error::Mismatch { .. } | Error::InvalidArgument { .. })) {
            // Peers' late calls come in too, first on their streams: each rank finds the
            // mismatch itself.
            let mut all: Vec<Xfer<'b>> = self.late.take_all();
            all.append(&mut pre);
            pre = all;
            // The peers our call was still to reach on a later message get it now.
            if let Some(o) = &mut self.open {
                let (tag, call, later) = (Tag { nbytes: 0, ..o.tag }, o.call, std::mem::take(&mut o.carries_later));
                for p in later {
                    pre.push(self.xfer_send(p, tag, &[], Some(call)));
                }
            }
        }
        match r {
            Err(e @ Error::Mismatch { .. }) => {
                self.drain_calls(ctx, &mut pre, xfers);
                return Err(e);
            }
            // A peer refused its call (header.rs): take in every call, and name the first rank
            // that refused, with its reason (every rank names the same one).
            Err(e @ Error::InvalidArgument { .. }) => {
                let refusals = self.drain_calls(ctx, &mut pre, xfers);
                return Err(match refusals.into_iter().next() {
                    Some((peer, code, why)) => header::refusal(ctx.op, peer, code, &why),
                    None => e,
                });
            }
            _ => {}
        }
        if pre.capacity() > 0 {
            // Kept for the next collective's call messages (`call_messages`). The list is typed
            // with this exchange's borrows; emptied, std collects it into the `'static` list in
            // place, in its own buffer, so nothing is allocated (gdb on `malloc`: cpu.md, part 31).
            pre.clear();
            self.spare_preamble = pre.into_iter().filter_map(Xfer::detach).collect();
        }
        r
    }

    /// Whether the late calls are read in an exchange of `preamble` and `xfers`: where it
    /// receives from one of their peers (they come first on that stream), where one must be
    /// waited for (`LateCalls::bound`, `settle_deferred`), and once as many more have gathered
    /// since the last look as the peers hold back at a time, all together (held_calls.rs,
    /// `hold_max_sum`); a stalled exchange reads them too (`run`). Not on every exchange: a
    /// root that is ahead would otherwise try every receiver's stream on every call, and not on
    /// every exchange once that many are owed either: over TCP each try is a system call, and a
    /// root that looked on every broadcast until the receiver's held calls came spent one
    /// `recvfrom` that found nothing for nearly every `writev`.
    fn poll_due(&mut self, preamble: &[Xfer<'_>], xfers: &[Xfer<'_>]) -> bool {
        self.late_after_poll = self.late_after_poll.min(self.late.len());
        self.late.len() >= self.late_after_poll + self.late_poll_step
            || self.late.any_needed()
            || (preamble.iter().chain(xfers.iter()))
                .any(|x| matches!(x, Xfer::Recv { peer, .. } if self.late.owed_by(*peer) > 0))
    }

    /// Sends our held calls and waits for every late call (before a shared-memory round,
    /// which reads peers' state outside the streams: a call still in a stream would look like
    /// another operation's, and compares message counts; and before links close or change
    /// hands).
    pub(crate) fn settle_deferred(&mut self, ctx: &OpCtx<'_>) -> Result<()> {
        // Our held calls go out first: the peers may be settling theirs, waiting for them.
        self.held.make_due();
        if self.late.is_empty() && !self.held.any_due() {
            return Ok(());
        }
        self.late.need_all();
        self.exchange(ctx, &mut [])
    }

    fn run<'b>(&mut self, ctx: &OpCtx<'_>, pre: &mut [Xfer<'b>], xfers: &mut [Xfer<'b>]) -> Result<()> {
        let mut pace = Pacer::new(&self.transport);
        loop {
            let (done, moved) = self.sweep(ctx, pre, xfers)?;
            if done {
                return Ok(());
            }
            if moved {
                pace.progressed();
            } else if let Some(now) = pace.stalled(ctx) {
                // A peer may wait for a call we hold (one that names another root waits for
                // us as its root): they go out whenever we wait. And a peer's may wait for
                // room in its ring to us, filled with calls we have not looked at yet: a
                // stalled exchange reads them.
                self.held.make_due();
                self.poll_late |= !self.late.is_empty();
                self.check_stalled(ctx, pre, xfers, now)?;
            }
        }
    }

    /// After a mismatch in a collective's first exchange: sends our call to every peer and
    /// takes in every peer's, payload discarded, so that every rank reads every call, finds the
    /// mismatch itself and blocks on no send to us. The algorithm's other messages are dropped:
    /// a communicator is closed after a mismatch. Ends at the operation's deadline, on a broken
    /// link or on our abort: the mismatch is the error either way.
    ///
    /// Also after a peer refused its call, and when this rank refuses its own (`refuse`): then
    /// the first exchange has one call message each way on every pair, so draining them leaves
    /// every stream in step. Returns the peers that refused, in rank order, with the operation
    /// code and the reason they sent.
    fn drain_calls<'b>(
        &mut self,
        ctx: &OpCtx<'_>,
        pre: &mut [Xfer<'b>],
        xfers: &mut [Xfer<'b>],
    ) -> Vec<(usize, u8, Vec<u8>)> {
        let mut sink = [0u8; 4096];
        let mut pace = Pacer::new(&self.transport);
        let mut refusals: Vec<Option<(u8, Vec<u8>)>> = vec![None; self.size];
        // Peers that sent no call to wait for: gone, or in a shared-memory round instead.
        let mut moved_on = vec![false; self.size];
        loop {
            let mut pending = false;
            let mut moved = false;
            // Streams with an unfinished message in this pass: a later message on the same
            // stream must not start in the middle of it.
            let (mut tx_busy, mut rx_busy) = (vec![false; self.size], vec![false; self.size]);
            // Our held calls, first on their streams: every peer reads every call.
            let held: Vec<usize> = self.held.peers().filter(|&to| !moved_on[to]).collect();
            for to in held {
                match self.held.pump(to, self.transport.link(to)) {
                    Ok(m) => moved |= m,
                    Err(_) => moved_on[to] = true,
                }
                if self.held.holds_for(to) && !moved_on[to] {
                    (pending, tx_busy[to]) = (true, true);
                }
            }
            // A send already done has nothing left to move: stepping it again would report
            // progress (a copied reference says so every time), and a drain that always sees
            // progress never reaches its deadline. (A receive goes on past its buffer to the
            // end of the message the peer sent, which `drain_one` knows.)
            let sent = |x: &Xfer<'_>| matches!(x, Xfer::Send { .. }) && x.done();
            for x in (pre.iter_mut().chain(xfers.iter_mut())).filter(|x| x.is_call() && !sent(x)) {
                let peer = x.peer();
                if moved_on[peer] {
                    continue;
                }
                let busy = match x {
                    Xfer::Send { .. } => tx_busy[peer],
                    Xfer::Recv { .. } => rx_busy[peer],
                };
                if busy {
                    pending = true;
                    continue;
                }
                let link = self.transport.link(peer);
                let r = match x {
                    Xfer::Send { .. } => Self::step(link, x, ctx.op, &mut 0).map_err(drop),
                    Xfer::Recv { hdr, hpos, pos, .. } => {
                        let before = (*hpos == HEADER_BYTES).then_some(*pos);
                        let r = drain_one(link, hdr, hpos, pos, &mut sink).map_err(drop);
                        if *hpos == HEADER_BYTES && header::is_refusal(hdr) {
                            let why = &mut refusals[peer].get_or_insert_with(|| (hdr[4], Vec::new())).1;
                            // The payload bytes this call read are at the start of the sink.
                            why.extend_from_slice(&sink[..*pos - before.unwrap_or(0)]);
                        }
                        r
                    }
                };
                match r {
                    Ok(m) => moved |= m,
                    // That peer has gone (or shut its links after finding the mismatch itself):
                    // the others still need our call.
                    Err(()) => {
                        moved_on[peer] = true;
                        continue;
                    }
                }
                let unfinished = match x {
                    Xfer::Send { .. } => !x.done(),
                    Xfer::Recv { hdr, hpos, pos, .. } => {
                        *hpos < HEADER_BYTES || header::stream_len(hdr).is_some_and(|n| (*pos as u64) < n)
                    }
                };
                if unfinished {
                    match x {
                        Xfer::Send { .. } => tx_busy[peer] = true,
                        Xfer::Recv { .. } => rx_busy[peer] = true,
                    }
                }
                pending |= unfinished;
            }
            if !pending {
                break;
            }
            if moved {
                pace.progressed();
            } else if let Some(now) = pace.stalled(ctx) {
                if ctx.check(now, || None).is_err() {
                    break;
                }
                for (p, m) in moved_on.iter_mut().enumerate().filter(|(p, _)| *p != self.rank) {
                    let ahead = (self.transport.board.as_ref()).is_some_and(|b| b.peer_latest(p) >= b.next_round());
                    *m |= ahead || self.transport.check_peer(p).is_err();
                }
            }
        }
        (refusals.into_iter().enumerate())
            .filter_map(|(p, r)| r.map(|(code, why)| (p, code, why)))
            .collect()
    }

    /// Takes part in a collective that this rank refuses, `reason` saying why (an argument
    /// that failed its own checks), so that its peers do not wait for it: the collective's
    /// first message to every peer, flagged refused and carrying the reason, and every peer's
    /// first message taken in and dropped. Each peer then fails with an error naming this rank
    /// (header.rs) and takes in every call in turn. Nothing else of the collective moves, so
    /// the streams stay in step and the communicator usable. For collectives whose first
    /// exchange carries one call message each way on every pair (every collective of framed
    /// messages whose `begin_call` is symmetric). Fails if a peer's message is not this
    /// collective's call (the ranks are out of step), or at the deadline.
    pub(crate) fn refuse(&mut self, ctx: &OpCtx<'_>, tag: Tag, reason: &[u8]) -> Result<()> {
        // Calls owed by earlier collectives are first on their streams.
        self.settle_deferred(ctx)?;
        self.calls += 1;
        let call = Call {
            count: 0,
            root: 0,
            algo: 0,
            seq: self.calls,
        };
        let mut xfers: Vec<Xfer<'_>> = Vec::with_capacity(2 * self.size);
        let me = self.rank;
        for p in (0..self.size).filter(|&p| p != me) {
            let mut h = next_header(&mut self.send_seq, p, tag, reason.len(), Some(call));
            h.refused = true;
            xfers.push(Xfer::Send {
                peer: p,
                hdr: header::encode(&h),
                hpos: 0,
                data: reason,
                pos: 0,
                call: true,
                reference: None,
                in_stream: true,
            });
            xfers.push(self.xfer_recv(p, tag, Default::default(), Some(call), true));
        }
        self.drain_calls(ctx, &mut [], &mut xfers);
        for x in &xfers {
            let peer = x.peer();
            let complete = match x {
                Xfer::Send { .. } => x.done(),
                Xfer::Recv { hdr, hpos, pos, .. } => {
                    *hpos == HEADER_BYTES && header::stream_len(hdr) == Some(*pos as u64)
                }
            };
            if !complete {
                ctx.check(Instant::now(), || Some(peer))?;
                if let Err(g) = self.transport.check_peer(peer) {
                    return Err(Error::PeerLost {
                        op: ctx.op,
                        peer: g.rank,
                        reason: g.reason,
                    });
                }
                return Err(Error::Mismatch {
                    op: ctx.op,
                    peer,
                    detail: "it ran another operation while this rank refused its call".into(),
                });
            }
            if let Xfer::Recv { hdr, .. } = x {
                let theirs = header::decode(hdr).and_then(|h| h.call.map(|c| (h.tag.op, c.seq)));
                if theirs != Some((tag.op, self.calls)) {
                    return Err(Error::Mismatch {
                        op: ctx.op,
                        peer,
                        detail: format!(
                            "this rank refused its call of {} (collective {}); rank {peer} sent {}",
                            header::op_name(tag.op),
                            self.calls,
                            theirs.map_or("no call".into(), |(op, seq)| format!(
                                "the start of {} (collective {seq})",
                                header::op_name(op)
                            ))
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Sweeps until nothing moves: a message already in its stream may take more than one
    /// sweep (its header is checked in one, and a gated payload is read in the next).
    fn sweep_while_moving<'b>(&mut self, ctx: &OpCtx<'_>, pre: &mut [Xfer<'b>], xfers: &mut [Xfer<'b>]) -> Result<()> {
        loop {
            let (done, moved) = self.sweep(ctx, pre, xfers)?;
            if done || !moved {
                return Ok(());
            }
        }
    }

    fn check_stalled<'b>(
        &mut self,
        ctx: &OpCtx<'_>,
        pre: &mut [Xfer<'b>],
        xfers: &mut [Xfer<'b>],
        now: Instant,
    ) -> Result<()> {
        // The peers this exchange still needs something from. A receive whose header has been
        // checked and whose payload only waits for the gate (another peer's call) does not
        // count: its bytes are in the stream already, and the peer may well have gone since.
        // A message by reference that only waits to be copied comes last: its receiver may be
        // held by its own gate, waiting for the same late peer as we are. Late calls waited
        // for come first, as on their streams.
        let waiting = |late: &LateCalls<Xfer<'static>>, pre: &[Xfer<'_>], xfers: &[Xfer<'_>]| -> Vec<usize> {
            let gate_closed = pre.iter().chain(xfers.iter()).any(Xfer::call_pending);
            let mut peers: Vec<(bool, usize)> = late.needed_peers().map(|p| (false, p)).collect();
            peers.extend(
                (pre.iter().chain(xfers.iter()))
                    .filter(|x| !(x.done() || gate_closed && x.held_by_gate()))
                    .map(|x| (x.awaits_copy(), x.peer())),
            );
            peers.sort_by_key(|&(copy, _)| copy);
            peers.into_iter().map(|(_, p)| p).collect()
        };
        let mut pending = waiting(&self.late, pre, xfers);
        // Held calls still going out wait on their peer too (a root that is gone never takes
        // them: its loss, not the deadline, is the error).
        let held: Vec<usize> = self.held.due_peers().filter(|p| !pending.contains(p)).collect();
        pending.extend(held);
        ctx.check(now, || pending.first().copied())?;
        let gone = pending
            .iter()
            .find_map(|&p| self.transport.check_peer(p).err().map(|g| (p, g)));
        if let Some((peer, g)) = gone {
            // The peer may have written its last bytes just before leaving: its state store is a
            // Release, our read an Acquire, so sweeping once more sees everything it sent.
            self.sweep_while_moving(ctx, pre, xfers)?;
            if waiting(&self.late, pre, xfers).contains(&peer) || self.held.holds_for(peer) {
                return Err(Error::PeerLost {
                    op: ctx.op,
                    peer: g.rank,
                    reason: g.reason,
                });
            }
        }
        // A peer that has started a shared-memory round we have not reached is running another
        // operation. It published the round after its last message to us, so sweeping once
        // more first takes in anything it sent for this one.
        let Some(b) = &self.transport.board else { return Ok(()) };
        let ahead = pending.iter().copied().find(|&p| b.peer_latest(p) >= b.next_round());
        if let Some(peer) = ahead {
            self.sweep_while_moving(ctx, pre, xfers)?;
            if waiting(&self.late, pre, xfers).contains(&peer) {
                // Named by field, as a header check names it, where the round says which
                // operation the peer is in and it is another (the peer may have moved on to
                // a later round since: then the fields stay unnamed).
                let theirs = (self.transport.board.as_ref())
                    .and_then(|b| b.peer_round(peer, b.peer_latest(peer)))
                    .map(|(label, _)| header::op_name(label as u8));
                let detail = match theirs {
                    Some(t) if t != ctx.op => format!(
                        "operation: this rank has {}, rank {peer} has {t} (in a shared-memory round, \
                         while this rank waits for its message)",
                        ctx.op
                    ),
                    _ => "it entered a shared-memory collective (all_reduce, all_gather, \
                          reduce_scatter, all_to_all or barrier of a small size, or a broadcast) while \
                          this rank waits for its message"
                        .into(),
                };
                return Err(Error::Mismatch {
                    op: ctx.op,
                    peer,
                    detail,
                });
            }
        }
        Ok(())
    }
}

/// The header of the next message on one ordered pair; `seqs` counts that direction's messages.
fn next_header(seqs: &mut [u64], peer: usize, tag: Tag, len: usize, call: Option<Call>) -> Header {
    let seq = seqs[peer];
    seqs[peer] += 1;
    Header {
        tag: Tag {
            nbytes: len as u64,
            ..tag
        },
        seq,
        call,
        refused: false,
    }
}

/// Reads one message's header and then discards the payload it announces; `pos` counts the
/// discarded bytes. A header that is not one cannot be drained past: it is left as it is.
fn drain_one(
    link: &mut Link,
    hdr: &mut [u8; HEADER_BYTES],
    hpos: &mut usize,
    pos: &mut usize,
    sink: &mut [u8],
) -> std::result::Result<bool, crate::net::links::Gone> {
    let mut moved = false;
    // None: a header that does not decode, left as it is.
    let left = |hdr: &[u8; HEADER_BYTES], pos: usize| header::stream_len(hdr).map(|n| n.saturating_sub(pos as u64));
    if *hpos < HEADER_BYTES {
        let n = link.read(&mut hdr[*hpos..])?;
        *hpos += n;
        moved |= n > 0;
        if *hpos < HEADER_BYTES {
            return Ok(moved);
        }
        if left(hdr, *pos) == Some(0) {
            link.end_message();
            return Ok(moved);
        }
    }
    let left = left(hdr, *pos).unwrap_or(0);
    if left > 0 {
        let take = left.min(sink.len() as u64) as usize;
        let n = if header::in_bulk(hdr) {
            link.read_bulk(&mut sink[..take])?
        } else {
            link.read(&mut sink[..take])?
        };
        *pos += n;
        moved |= n > 0;
        if n as u64 == left {
            link.end_message();
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::super::algorithms::Algo;
    use super::*;
    use crate::contracts::dtype::DType;
    use crate::net::links::{connect_threads_over_tcp, connect_threads_with, OwnerState};

    fn engines(n: usize) -> Vec<Engine> {
        let ts = connect_threads_with(n, Some(4096));
        ts.into_iter().enumerate().map(|(r, t)| Engine::new(r, n, t)).collect()
    }

    /// As `engines`, every link TCP: where a receiver holds its calls to a root.
    fn tcp_engines(n: usize) -> Vec<Engine> {
        let ts = connect_threads_over_tcp(n);
        ts.into_iter().enumerate().map(|(r, t)| Engine::new(r, n, t)).collect()
    }

    fn ctx(abort: &AtomicBool, after: Duration) -> OpCtx<'_> {
        OpCtx::new("send/recv", after, abort)
    }

    /// One direct broadcast of `buf` from `root`, as the backend runs it (mod.rs).
    fn broadcast(e: &mut Engine, abort: &AtomicBool, buf: &mut [u8], root: usize) -> Result<()> {
        broadcast_by(e, abort, buf, root, Algo::Direct, 1 << 20)
    }

    /// One broadcast of `algo` (the chain in pieces of `chunk`), as the backend runs it.
    fn broadcast_by(
        e: &mut Engine,
        abort: &AtomicBool,
        buf: &mut [u8],
        root: usize,
        algo: Algo,
        chunk: usize,
    ) -> Result<()> {
        let tag = super::super::tag(3, DType::U8, None);
        let call = Call {
            count: buf.len() as u64,
            root: root as u32,
            algo: algo.code(),
            seq: 0,
        };
        let lands = super::super::algorithms::broadcast_lands(e.rank, e.size, root, algo);
        let feeds = super::super::algorithms::broadcast_feeds(e.rank, e.size, root, algo);
        e.begin_broadcast_call(tag, call, algo == Algo::Direct, lands, feeds);
        let ctx = OpCtx::new("broadcast", Duration::from_secs(10), abort);
        let r = super::super::algorithms::broadcast(e, &ctx, tag, buf, root, algo, chunk);
        e.end_call();
        r
    }

    /// A header-only message that fails its check still ends where its writer ended it (on
    /// shared memory the next message starts on a line): the next message on that link reads
    /// whole.
    #[test]
    fn a_header_only_message_that_fails_its_check_leaves_the_stream_in_step() {
        let mut e = engines(2);
        let abort = AtomicBool::new(false);
        let c = ctx(&abort, Duration::from_secs(10));
        let (bytes, floats) = (
            super::super::tag(10, DType::U8, None),
            super::super::tag(10, DType::F32, None),
        );
        let mut x = [e[0].send(1, bytes, &[])];
        e[0].exchange(&c, &mut x).unwrap();
        let mut nothing = [0u8; 0];
        let mut x = [e[1].recv(0, floats, &mut nothing)];
        let err = e[1].exchange(&c, &mut x).unwrap_err();
        assert!(matches!(err, Error::Mismatch { peer: 0, .. }), "{err}");
        let mut x = [e[0].send(1, bytes, &[5u8; 8])];
        e[0].exchange(&c, &mut x).unwrap();
        let mut got = [0u8; 8];
        let mut x = [e[1].recv(0, bytes, &mut got)];
        e[1].exchange(&c, &mut x).unwrap();
        assert_eq!(got, [5u8; 8]);
    }

    /// An exchange whose messages all move whole in its first sweep ends with that sweep: a
    /// message the sweep finishes does not hold the exchange for another pass, which would
    /// cost every small send and receive a second look at every message.
    #[test]
    fn an_exchange_that_its_first_sweep_finishes_takes_one_sweep() {
        let mut e = engines(2);
        let abort = AtomicBool::new(false);
        let c = ctx(&abort, Duration::from_secs(10));
        let t = super::super::tag(10, DType::U8, None);
        let before = e[0].sweep;
        let mut x = [e[0].send(1, t, &[7u8; 8])];
        e[0].exchange(&c, &mut x).unwrap();
        assert_eq!(e[0].sweep - before, 1, "the send");
        let before = e[1].sweep;
        let mut got = [0u8; 8];
        let mut x = [e[1].recv(0, t, &mut got)];
        e[1].exchange(&c, &mut x).unwrap();
        assert_eq!(got, [7u8; 8]);
        assert_eq!(e[1].sweep - before, 1, "the receive, its message already there");
    }

    /// Over TCP a receiver holds its header-only calls to a root that writes nothing
    /// (held_calls.rs): none goes out until `HOLD_MAX_TCP` are held, then all go out together in
    /// the exchange that holds the last, and the root checks every one.
    #[test]
    fn a_receiver_holds_its_calls_to_a_quiet_root_and_sends_them_together() {
        let mut e = tcp_engines(2);
        let abort = AtomicBool::new(false);
        let hold_max = super::super::held_calls::HOLD_MAX_TCP;
        for _ in 0..hold_max {
            broadcast(&mut e[0], &abort, &mut [3u8; 8], 0).unwrap();
        }
        for i in 1..=hold_max {
            let mut got = [0u8; 8];
            broadcast(&mut e[1], &abort, &mut got, 0).unwrap();
            assert_eq!(got, [3u8; 8]);
            assert_eq!(e[1].held.holds_for(0), i < hold_max, "after {i} broadcasts");
        }
        let c = OpCtx::new("finalize", Duration::from_secs(10), &abort);
        e[0].settle_deferred(&c).unwrap();
        assert!(e[0].late.is_empty() && !e[0].transport.has_unread(1));
    }

    /// An exchange that stalls reads the late calls it owes before as many as its peers hold
    /// back have gathered: a peer's next calls may wait for room in a ring that the unread
    /// ones fill (a rank with a TCP link looks less often at its peers on one host too).
    #[test]
    fn a_stalled_exchange_reads_the_late_calls_it_owes() {
        let mut e = engines(3);
        let abort = AtomicBool::new(false);
        for r in [0, 2, 1] {
            for _ in 0..3 {
                broadcast(&mut e[r], &abort, &mut [1u8; 8], 0).unwrap();
            }
            if r == 2 {
                e[2].send_held_calls();
            }
        }
        // Rank 1 owes rank 2's three calls, fewer than a look waits for.
        assert_eq!((e[1].late.len(), e[1].late.owed_by(2)), (3, 3));
        let c = ctx(&abort, Duration::from_millis(200));
        let t = super::super::tag(10, DType::U8, None);
        let mut got = [0u8; 8];
        let mut x = [e[1].recv(0, t, &mut got)];
        let err = e[1].exchange(&c, &mut x).unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(e[1].late.is_empty(), "{} calls unread after the stall", e[1].late.len());
    }

    /// A root ahead of a receiver that holds its calls looks at the receiver's stream once per
    /// batch the receiver holds back (`poll_due`), not on every broadcast once that many are
    /// owed: over TCP every look is a system call. It looked on 185 of 192 before.
    #[test]
    fn a_root_ahead_looks_for_held_calls_once_per_batch_held() {
        let mut e = tcp_engines(2);
        let abort = AtomicBool::new(false);
        let batch = super::super::held_calls::HOLD_MAX_TCP;
        for _ in 0..3 * batch {
            broadcast(&mut e[0], &abort, &mut [3u8; 8], 0).unwrap();
        }
        assert_eq!(e[0].late.len(), 3 * batch);
        assert!(
            e[0].late_looks <= 3,
            "{} looks in {} broadcasts",
            e[0].late_looks,
            3 * batch
        );
        for _ in 0..3 * batch {
            broadcast(&mut e[1], &abort, &mut [0u8; 8], 0).unwrap();
        }
        let c = OpCtx::new("finalize", Duration::from_secs(10), &abort);
        e[0].settle_deferred(&c).unwrap();
        assert!(e[0].late.is_empty());
    }

    /// Every header-only call of a broadcast that no peer waits for is held: a direct
    /// broadcast's receivers hold theirs to the root and to each other, and the root holds
    /// none (its data carries its call); in the chain each rank holds all but its call to the
    /// next rank, which checks it before the bytes land. Settled, every call arrives.
    #[test]
    fn broadcast_ranks_hold_every_call_no_peer_waits_for() {
        let root = 1;
        for (algo, tcp) in [
            (Algo::Direct, true),
            (Algo::Ring, true),
            (Algo::Direct, false),
            (Algo::Ring, false),
        ] {
            let mut e = if tcp { tcp_engines(4) } else { engines(4) };
            // In order from the root on one thread: each rank's bytes are there when it starts,
            // so none stalls (a stall sends what it holds).
            for k in 0..4 {
                let eng = &mut e[(root + k) % 4];
                let mut buf = [eng.rank as u8; 64];
                broadcast_by(eng, &AtomicBool::new(false), &mut buf, root, algo, 16).unwrap();
                assert_eq!(buf, [root as u8; 64]);
            }
            for eng in &e {
                let me = eng.rank;
                let waits = match algo {
                    Algo::Direct => (0..4).filter(|&p| p != me && me == root).collect::<Vec<_>>(),
                    _ => [(me + 1) % 4].into_iter().filter(|&p| p != root).collect(),
                };
                let want: Vec<usize> = (0..4).filter(|&p| p != me && !waits.contains(&p)).collect();
                assert_eq!(eng.held.peers().collect::<Vec<_>>(), want, "{algo:?}, rank {me}");
            }
            std::thread::scope(|s| {
                for eng in e.iter_mut() {
                    s.spawn(move || {
                        let abort = AtomicBool::new(false);
                        eng.settle_deferred(&OpCtx::new("finalize", Duration::from_secs(10), &abort))
                            .unwrap();
                        assert!(eng.late.is_empty() && !eng.held.any());
                    });
                }
            });
        }
    }

    /// A broadcast's receiver checks the call of the rank whose bytes land in its buffer before
    /// they do, and the other receivers' calls as they come: it completes while another
    /// receiver has not called yet, and a mismatch with that receiver is the error of its next
    /// wait, naming it, as it is the root's.
    #[test]
    fn a_receiver_does_not_wait_for_the_other_receivers_and_meets_their_mismatch_later() {
        let mut e = engines(3);
        let abort = AtomicBool::new(false);
        broadcast(&mut e[0], &abort, &mut [5u8; 8], 0).unwrap();
        let mut got = [0u8; 8];
        broadcast(&mut e[1], &abort, &mut got, 0).unwrap();
        assert_eq!(got, [5u8; 8], "rank 2 has not called yet");
        let mut ranks = e.iter_mut();
        let (r0, r1, r2) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
        let errs: Vec<Error> = std::thread::scope(|s| {
            let late = s.spawn(move || {
                let mut other = [0u8; 4];
                let err = broadcast(r2, &AtomicBool::new(false), &mut other, 0).unwrap_err();
                assert_eq!(other, [0u8; 4]);
                err
            });
            let receiver = s.spawn(move || {
                let abort = AtomicBool::new(false);
                r1.settle_deferred(&OpCtx::new("finalize", Duration::from_secs(10), &abort))
                    .unwrap_err()
            });
            let root = r0
                .settle_deferred(&OpCtx::new("finalize", Duration::from_secs(10), &abort))
                .unwrap_err();
            vec![root, receiver.join().unwrap(), late.join().unwrap()]
        });
        for (rank, err) in errs.iter().enumerate() {
            let peer = if rank == 2 { 0 } else { 2 };
            assert!(
                matches!(err, Error::Mismatch { peer: p, detail, .. } if *p == peer && detail.contains("count")),
                "rank {rank}: {err}"
            );
        }
    }

    /// In the chain a receiver's bytes come from the rank before it, whose call it checks
    /// first: where that rank's call differs from the root's, the bytes it would forward never
    /// land, and both find the mismatch.
    #[test]
    fn a_chain_receiver_lands_nothing_from_a_rank_whose_call_differs() {
        let e = engines(3);
        let errs: Vec<(Result<()>, Vec<u8>)> = std::thread::scope(|s| {
            let hs: Vec<_> = (e.into_iter())
                .map(|mut e| {
                    s.spawn(move || {
                        let abort = AtomicBool::new(false);
                        let len = if e.rank == 1 { 32 } else { 64 };
                        let mut buf = vec![u8::from(e.rank == 0) * 9; len];
                        let r = broadcast_by(&mut e, &abort, &mut buf, 0, Algo::Ring, 16);
                        let r = r
                            .and_then(|()| e.settle_deferred(&OpCtx::new("finalize", Duration::from_secs(10), &abort)));
                        (r, buf)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (r, buf)) in errs.iter().enumerate().skip(1) {
            let peer = if rank == 1 { 0 } else { 1 };
            assert!(
                matches!(r, Err(Error::Mismatch { peer: p, .. }) if *p == peer),
                "rank {rank}: {r:?}"
            );
            assert!(buf.iter().all(|&b| b == 0), "rank {rank}: bytes landed");
        }
        assert!(
            matches!(&errs[0].0, Err(Error::Mismatch { peer: 1, .. })),
            "{:?}",
            errs[0].0
        );
    }

    /// Two ranks that each name the other as a broadcast's root both wait as receivers, each
    /// holding its call to the other: a wait that stalls sends what it holds, so both find the
    /// mismatch instead of waiting out the timeout.
    #[test]
    fn receivers_that_name_each_other_as_root_send_their_held_calls_and_find_the_mismatch() {
        let e = engines(2);
        let started = Instant::now();
        let errs: Vec<Error> = std::thread::scope(|s| {
            let hs: Vec<_> = (e.into_iter())
                .map(|mut e| {
                    s.spawn(move || {
                        let abort = AtomicBool::new(false);
                        let root = 1 - e.rank;
                        broadcast(&mut e, &abort, &mut [0u8; 8], root).unwrap_err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, err) in errs.iter().enumerate() {
            assert!(
                matches!(err, Error::Mismatch { peer, detail, .. } if *peer == 1 - rank && detail.contains("root")),
                "rank {rank}: {err}"
            );
        }
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    }

    /// After a mismatch a rank drains every peer's call until the deadline. A send by
    /// reference that its receiver has already taken in is done, and stepping it again must not
    /// count as progress: the drain checks its deadline only when nothing moves, so a drain
    /// still waiting for a peer that never calls would spin for ever (it did, in
    /// tests/reliability.rs). Rank 1 calls with another dtype and reads past rank 0's
    /// reference while it drains; rank 2 never calls.
    #[test]
    fn a_drain_after_a_copied_reference_still_ends_at_its_deadline() {
        let mut e = engines(3);
        // Rank 1 makes its link first, so that it offers to copy (rank 0 sends by reference).
        let _ = e[1].transport.link(0);
        let (bytes, floats) = (
            super::super::tag(6, DType::U8, None),
            super::super::tag(6, DType::F32, None),
        );
        let call = |count| Call {
            count,
            root: 0,
            algo: 0,
            seq: 0,
        };
        let mut ranks = e.drain(..);
        let (mut r0, mut r1, _r2) = (ranks.next().unwrap(), ranks.next().unwrap(), ranks.next().unwrap());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let started = Instant::now();
        std::thread::spawn(move || {
            let abort = AtomicBool::new(false);
            let (data, mut from1, mut from2) = (vec![1u8; 1 << 16], vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
            r0.begin_call(bytes, call(1 << 16), true, true);
            let mut x = [
                r0.send(1, bytes, &data),
                r0.recv(1, bytes, &mut from1),
                r0.recv(2, bytes, &mut from2),
            ];
            let r = r0.exchange(&ctx(&abort, Duration::from_secs(2)), &mut x);
            let _ = done_tx.send(r);
        });
        let abort = AtomicBool::new(false);
        let (data, mut from0) = (vec![2u8; 1 << 16], vec![0u8; 1 << 16]);
        r1.begin_call(floats, call(1 << 14), true, true);
        let mut x = [r1.send(0, floats, &data), r1.recv(0, floats, &mut from0)];
        let r1_got = r1.exchange(&ctx(&abort, Duration::from_secs(2)), &mut x);
        assert!(matches!(r1_got, Err(Error::Mismatch { peer: 0, .. })), "{r1_got:?}");
        let r0_got = done_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("rank 0's drain did not end at its deadline");
        assert!(matches!(r0_got, Err(Error::Mismatch { peer: 1, .. })), "{r0_got:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }

    /// A shrink that leaves out a rank a receiver holds calls for (the root, or the other
    /// receiver) drops them (that rank is gone, and its link may no longer take a byte); calls
    /// held for a member go to it.
    #[test]
    fn a_hand_over_drops_calls_held_for_a_rank_left_out_and_sends_a_members() {
        let abort = AtomicBool::new(false);
        let c = OpCtx::new("shrink", Duration::from_secs(10), &abort);
        for (root, members) in [(2usize, [0usize, 1]), (1, [0, 1])] {
            let mut e = tcp_engines(3);
            let mut data = [7u8; 8];
            broadcast(&mut e[root], &abort, &mut data, root).unwrap();
            let (mut got0, mut got_other) = ([0u8; 8], [0u8; 8]);
            let other = 3 - root; // the receiver besides rank 0
            std::thread::scope(|s| {
                let (a, b) = e.split_at_mut(1);
                let r = &mut b[other - 1];
                let h = s.spawn(move || broadcast(r, &AtomicBool::new(false), &mut got_other, root).unwrap());
                broadcast(&mut a[0], &abort, &mut got0, root).unwrap();
                h.join().unwrap();
            });
            let mut both = [root, other];
            both.sort();
            assert_eq!(
                e[0].held.peers().collect::<Vec<_>>(),
                both,
                "to the root and the other receiver"
            );
            if members.contains(&other) {
                // A member's call that rank 0 is owed: sent by that member's own hand-over.
                let o = &mut e[other];
                o.held.pump(0, o.transport.link(0)).unwrap();
            }
            let _links = e[0].hand_over(&c, &members, false).unwrap();
            assert!(!e[0].held.any(), "sent or dropped");
            if members.contains(&root) {
                // With the other receiver's call too, the root has every call it is owed.
                let o = &mut e[other];
                o.held.pump(root, o.transport.link(root)).unwrap();
                e[root].settle_deferred(&c).unwrap();
            }
        }
    }

    /// A root far ahead of a late receiver keeps at most `LATER_MAX` of its calls unread, and
    /// then waits for the oldest: what it keeps stays bounded.
    #[test]
    fn a_root_ahead_of_its_receivers_bounds_the_calls_it_has_not_read() {
        let mut e = engines(2);
        let abort = AtomicBool::new(false);
        let calls = 3 * LATER_MAX;
        let mut late = e.pop().unwrap();
        let receiver = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let abort = AtomicBool::new(false);
            for _ in 0..calls {
                let mut got = [0u8; 8];
                broadcast(&mut late, &abort, &mut got, 0).unwrap();
            }
            let ctx = OpCtx::new("broadcast", Duration::from_secs(10), &abort);
            late.settle_deferred(&ctx).unwrap();
        });
        let mut most = 0;
        for _ in 0..calls {
            broadcast(&mut e[0], &abort, &mut [1u8; 8], 0).unwrap();
            most = most.max(e[0].late.len());
        }
        assert!(most <= LATER_MAX + 1, "{most} calls unread");
        receiver.join().unwrap();
    }

    /// Rank 2 sends rank 0 a message by reference, gives up (its operation failed because it
    /// lost rank 1), takes the message back and says so in its segment. Rank 0, copying it,
    /// must name rank 1, the rank at the root, as every survivor does, not rank 2.
    #[test]
    fn a_withdrawn_message_names_the_rank_its_sender_lost() {
        let mut e = engines(3);
        let abort = AtomicBool::new(false);
        let tag = super::super::tag(10, DType::U8, None);
        let data = vec![7u8; 1 << 16];
        let mut into = vec![0u8; 1 << 16];
        // Rank 0 makes its link first, so that it offers to copy; rank 2 then sends by
        // reference and, with nobody copying yet, times out and withdraws it.
        let _ = e[0].transport.link(2);
        let sent = {
            let mut x = [e[2].send(0, tag, &data)];
            e[2].exchange(&ctx(&abort, Duration::from_millis(50)), &mut x)
        };
        assert!(matches!(sent, Err(Error::Timeout { .. })), "{sent:?}");
        let announcer = e[2].transport.announcer();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            announcer.announce(OwnerState::Lost(1));
        });
        let got = {
            let mut x = [e[0].recv(2, tag, &mut into)];
            e[0].exchange(&ctx(&abort, Duration::from_secs(5)), &mut x)
        };
        late.join().unwrap();
        assert!(
            matches!(&got, Err(Error::PeerLost { peer: 1, .. })),
            "wanted the rank at the root: {got:?}"
        );
    }
}
