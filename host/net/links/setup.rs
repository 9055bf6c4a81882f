//! Builds every link of one communicator through its store: ranks on the same host map each
//! other's shared-memory segment, ranks on other hosts connect over TCP and prove they belong to
//! the communicator with a per-communicator secret that only the (authenticated) store carries.
//!
//! What it costs, whatever the number of ranks: one store round (every rank publishes its
//! host, segment and listener in one key and reads every rank's in one request), and a second
//! only on hosts where ranks of several processes meet (once every process has mapped every
//! segment, their names are removed). Segments are mapped once per process, shared by its ranks;
//! rings get memory and their ends are made only when a link is first used (`Link::Pending`);
//! TCP links are accepted on a second thread while this one dials.

use super::crowding;
use super::liveness::ProcessWatch;
use super::ring::{unread_at, RingEnd, CTL_BYTES};
use super::shm::{OwnerState, Segment};
use super::shm_board::{self as board, Board};
use super::tcp::{accept_authenticated_or_stop, dial, Expect, Handshaken, Lane, TcpLink};
use super::{Link, PeerGone, PeerSegments, ShmLink};
use crate::bootstrap;
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// How much of a ring gets memory when its link is made, where the rings of all its peers would
/// take more than `WARM_BUDGET`. Small messages, the ones whose latency counts, then meet no
/// page fault; the rest of the ring is faulted in by the first large message, or a page at a
/// time as small ones walk the ring. Populating all of it cost a 1024-thread-rank group 2 GiB
/// zeroed at its first point-to-point exchange (docs/results/cpu.md, "Communicator creation").
const WARM_RING_BYTES: usize = 64 << 10;

/// Where a rank's rings from all its peers take at most this much, a ring gets all its memory
/// when its link is made (with 1 MiB rings, communicators of up to 65 ranks): else small
/// messages walking the ring meet a page fault every 4 KiB of the first pass, about a
/// microsecond each (measured: docs/results/cpu.md, "Rings warmed whole").
const WARM_BUDGET: usize = 64 << 20;

/// Where `FERROCOMM_TCP_BULK_BYTES` is unset: the payloads of a dialler's messages of at least
/// this many bytes go on its link's second connection (tcp.rs). Measured in ferrocomm-bench
/// (docs/results/cpu.md, "Two connections per TCP link").
const TCP_BULK_BYTES: usize = 1 << 20;

/// All links of one rank, indexed by peer rank.
pub(crate) struct Transport {
    /// Reach them through `link`, which makes pending ones.
    pub(crate) links: Vec<Link>,
    /// Present when every rank shares this host (and there are at least two).
    pub(crate) board: Option<Board>,
    own_seg: Option<Arc<Segment>>,
    /// The segments of the ranks on this host, when there are any besides us.
    peers: Option<Arc<PeerSegments>>,
    /// Where each peer's rings and board lie in the segments: its rank in the communicator
    /// the segments were made for (the same rank, unless `Comm::shrink` handed these links on:
    /// see `hand_over`).
    slots: Vec<usize>,
    /// Our own slot.
    slot: usize,
    ring_bytes: usize,
    /// Messages of at least this many bytes go by reference to peers that take them (pull.rs);
    /// `usize::MAX`: never.
    pull_bytes: usize,
    /// The ranks on this kernel outnumber their CPUs (crowding.rs).
    crowded: bool,
    /// The machine of every rank, numbered in rank order of first appearance (ranks that
    /// `FERROCOMM_TRANSPORT=tcp` makes hosts of their own share their machine's number).
    machines: Vec<usize>,
    /// The host of every rank, numbered alike: ranks of one host share memory, and links
    /// between hosts are TCP (those `FERROCOMM_TRANSPORT=tcp` makes hosts of their own too).
    hosts: Vec<usize>,
}

impl Transport {
    /// A handle that can announce our state while an operation holds the transport.
    pub(crate) fn announcer(&self) -> Announcer {
        let streams = self
            .links
            .iter()
            .flat_map(|l| match l {
                Link::Tcp(t) => t.try_clone_streams(),
                _ => Vec::new(),
            })
            .collect();
        Announcer {
            seg: self.own_seg.clone(),
            streams,
        }
    }

    /// The link to `peer`, made now if it is pending: its two rings are faulted in at once
    /// (`Segment::populate`; the first `WARM_RING_BYTES` of each past `WARM_BUDGET`) and its
    /// ends made.
    // Inlined: every step of every message looks its link up here; making one is the rare case.
    #[inline]
    pub(crate) fn link(&mut self, peer: usize) -> &mut Link {
        if matches!(self.links[peer], Link::Pending) {
            self.make_pending_link(peer);
        }
        &mut self.links[peer]
    }

    #[cold]
    fn make_pending_link(&mut self, peer: usize) {
        if let Some(l) = self.make_shm_link(peer) {
            self.links[peer] = Link::Shm(Box::new(l));
        }
    }

    fn make_shm_link(&self, peer: usize) -> Option<ShmLink> {
        let (own, peers) = (self.own_seg.as_ref()?, self.peers.as_ref()?);
        let theirs = peers.segs[self.slots[peer]].as_ref()?;
        let stride = ring_stride(self.ring_bytes);
        let (tx_at, rx_at) = (self.slot * stride, self.slots[peer] * stride);
        let whole = self.ring_bytes.saturating_mul(self.links.len().saturating_sub(1)) <= WARM_BUDGET;
        let warm = CTL_BYTES
            + if whole {
                self.ring_bytes
            } else {
                self.ring_bytes.min(WARM_RING_BYTES)
            };
        theirs.populate(tx_at, warm);
        own.populate(rx_at, warm);
        // SAFETY: each segment holds one ring per sender, in rank order, of CTL_BYTES +
        // ring_bytes (a power of two), zeroed at creation and 64-aligned; `peers` keeps both
        // mapped as long as the link lives. Each end is used by exactly one rank: we produce into
        // our slot of the peer's segment and consume the peer's slot of ours.
        let (tx, rx) = unsafe {
            (
                RingEnd::new(theirs.payload().add(tx_at), self.ring_bytes, true),
                RingEnd::new(own.payload().add(rx_at), self.ring_bytes, false),
            )
        };
        // The peer may send us messages by reference once we know we can read its memory.
        let pull_from = peers.readable[self.slots[peer]];
        if pull_from.is_some() {
            rx.offer_pulls();
        }
        Some(ShmLink {
            tx,
            rx,
            pull_from,
            peer_slot: self.slots[peer],
            pull_bytes: self.pull_bytes,
            segments: peers.clone(),
        })
    }

    /// Called only when no progress is being made: is `peer` still there to make it?
    /// TCP links report loss through read/write errors instead.
    pub(crate) fn check_peer(&self, peer: usize) -> std::result::Result<(), PeerGone> {
        match (&self.links[peer], &self.peers) {
            (Link::Pending | Link::Shm(_), Some(p)) => p.check(self.slots[peer], peer),
            _ => Ok(()),
        }
    }

    /// Has `peer` sent bytes we have not read? (See `Link::has_unread`.) A pending link is
    /// looked at without being made.
    pub(crate) fn has_unread(&self, peer: usize) -> bool {
        match (&self.links[peer], &self.own_seg) {
            (Link::Pending, Some(own)) => {
                // SAFETY: our segment holds the peer's ring to us at this offset (see
                // `make_shm_link`), mapped as long as `own_seg`.
                unsafe { unread_at(own.payload().add(self.slots[peer] * ring_stride(self.ring_bytes))) > 0 }
            }
            (l, _) => l.has_unread(),
        }
    }
}

impl Transport {
    /// Moves our links to `members` (peer indices, in the order of the smaller communicator
    /// that takes them over, ours among them) into a transport of their own, for
    /// `Comm::shrink`; the links to everyone else close, and this transport is left empty
    /// (it announces nothing when dropped). The caller has checked that no message is in
    /// flight between members. `keep_board`: the board goes too, its rounds numbered on from
    /// where they are, so a slot's old round is never taken for a new one; else there is none.
    pub(crate) fn hand_over(&mut self, members: &[usize], keep_board: bool) -> Transport {
        let me = members
            .iter()
            .position(|&m| matches!(self.links[m], Link::SelfLoop(_)))
            .expect("the caller is among the members");
        let links = members
            .iter()
            .map(|&m| std::mem::replace(&mut self.links[m], Link::Pending))
            .collect();
        let board = self.board.take().filter(|_| keep_board);
        let handed = Transport {
            links,
            board: board.map(|b| b.keep(members, me)),
            own_seg: self.own_seg.take(),
            peers: self.peers.take(),
            slots: members.iter().map(|&m| self.slots[m]).collect(),
            slot: self.slot,
            ring_bytes: self.ring_bytes,
            pull_bytes: self.pull_bytes,
            crowded: self.crowded,
            machines: machine_numbers(members.iter().map(|&m| self.machines[m])),
            hosts: machine_numbers(members.iter().map(|&m| self.hosts[m])),
        };
        // Ranks left out that still wait on us learn at once that we are gone, over TCP; on
        // shared memory our segment now belongs to the new communicator, so they wait for
        // their timeout.
        for l in self.links.drain(..) {
            if let Link::Tcp(t) = l {
                for s in t.try_clone_streams() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
        }
        handed
    }

    /// The number of peers (ourselves included).
    pub(crate) fn size(&self) -> usize {
        self.links.len()
    }

    /// How many rounds a wait for a peer spins before it yields (crowding.rs).
    pub(crate) fn spin_rounds(&self) -> u32 {
        crowding::spin_rounds(self.crowded)
    }

    /// Whether the ranks on this kernel outnumber their CPUs (crowding.rs); alike on every
    /// rank where all share one host.
    pub(crate) fn crowded(&self) -> bool {
        self.crowded
    }

    /// The machine of every rank (`machines()[r]`, numbered from 0 in order of first
    /// appearance); alike on every rank.
    pub(crate) fn machines(&self) -> &[usize] {
        &self.machines
    }

    /// Whether the ranks are on more than one host (some links are TCP); alike on every rank.
    pub(crate) fn spans_hosts(&self) -> bool {
        self.hosts.iter().any(|&h| h != self.hosts[0])
    }

    /// Says that the ranks run on these machines (`machines[r]` for rank `r`), as a test of
    /// the algorithms that follow machines wants them where all ranks are threads of one.
    #[cfg(test)]
    pub(crate) fn set_machines(&mut self, machines: Vec<usize>) {
        assert_eq!(machines.len(), self.links.len());
        self.machines = machines;
    }
}

impl Drop for Transport {
    fn drop(&mut self) {
        self.announcer().announce(OwnerState::Closed);
    }
}

/// Tells peers how we left: same-host peers read our segment header when they stall; remote
/// peers see their TCP connection shut down.
pub(crate) struct Announcer {
    seg: Option<Arc<Segment>>,
    streams: Vec<TcpStream>,
}

impl Announcer {
    pub(crate) fn announce(&self, state: OwnerState) {
        match (&self.seg, state) {
            (Some(s), OwnerState::Closed) => s.close(),
            (Some(s), _) => s.set_state(state),
            (None, _) => {}
        }
        if state != OwnerState::Live {
            for s in &self.streams {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

pub(crate) fn host_identity(rank: usize, opts: &TransportOptions) -> String {
    // Read once per process: its ranks (threads) all ask.
    static ID: OnceLock<String> = OnceLock::new();
    let id = ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        // The host name as gethostname(2) reports it (glibc reads it from uname's nodename too).
        let uname = rustix::system::uname();
        let name = uname.nodename().to_bytes();
        // Shared memory needs one kernel (boot id), one mount namespace (the same /dev/shm) and
        // one PID namespace (liveness checks open a pidfd on the peer's pid). Ranks in different
        // namespaces (containers, `ip netns exec`) count as different hosts and use TCP.
        let ns = |kind: &str| {
            std::fs::read_link(format!("/proc/self/ns/{kind}"))
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        format!(
            "{}/{}/{}/{}",
            String::from_utf8_lossy(name),
            boot.trim(),
            ns("mnt"),
            ns("pid")
        )
    });
    if opts.force_tcp {
        // Every rank its own "host": all links go over TCP (tests the multi-host path locally).
        format!("{id}{FORCED}{rank}")
    } else {
        id.clone()
    }
}

/// What `host_identity` appends where every rank is made a host of its own.
const FORCED: &str = "#rank";

/// The machine of a host identity: ranks made hosts of their own by `FERROCOMM_TRANSPORT=tcp`
/// still share it (their traffic never leaves it, so `auto` does not seal it).
pub(crate) fn machine(host: &str) -> &str {
    host.split_once(FORCED).map_or(host, |(m, _)| m)
}

/// The kernel of a host identity (its boot id): ranks in other namespaces of one machine,
/// which count as other hosts, still share its CPUs (crowding.rs). Read from the right, as
/// the fields after the host name hold no `/`.
pub(crate) fn kernel(host: &str) -> &str {
    match machine(host).rsplit('/').nth(2) {
        Some(boot) if !boot.is_empty() => boot,
        // No boot id read: the machine as a whole, so that two machines never count as one.
        _ => machine(host),
    }
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

static SEGMENT_COUNTER: AtomicU64 = AtomicU64::new(0);

/// What a rank publishes about itself, in one store key: its host and process, the CPUs it may
/// run on (crowding.rs), its segment (`-`: none), its link listener (`-`: none) and, from
/// rank 0 where the store cannot derive secrets, the communicator's link secret (`-`: none).
struct Hello<'a> {
    host: &'a str,
    pid: &'a str,
    cpus: &'a str,
    shm: &'a str,
    tcp: &'a str,
    secret: &'a str,
}

impl<'a> Hello<'a> {
    fn encode(&self) -> String {
        format!(
            "{}\n{}\n{}\n{}\n{}\n{}",
            self.host, self.pid, self.cpus, self.shm, self.tcp, self.secret
        )
    }

    fn decode(rank: usize, raw: &'a [u8]) -> Result<Hello<'a>> {
        let bad = || Error::protocol("transport setup", format!("malformed set-up record of rank {rank}"));
        let text = std::str::from_utf8(raw).map_err(|_| bad())?;
        let mut f = text.splitn(6, '\n');
        let mut next = || f.next().ok_or_else(bad);
        Ok(Hello {
            host: next()?,
            pid: next()?,
            cpus: next()?,
            shm: next()?,
            tcp: next()?,
            secret: next()?,
        })
    }
}

/// Connects `rank` to every other rank of a communicator of `size`, using `store` (already
/// prefixed for this communicator). Collective: every rank must call it.
pub(crate) fn connect_all(
    rank: usize,
    size: usize,
    store: &dyn Store,
    opts: &TransportOptions,
    timeout: Duration,
) -> Result<Transport> {
    let deadline = Instant::now() + timeout;
    let me = host_identity(rank, opts);
    let pid = std::process::id().to_string();
    // Made before anyone knows who shares the host (that would take another round): a segment
    // where peers may share memory, a listener where they may not. Each is dropped below if no
    // peer turns out to need it; neither costs much (the segment gets pages only when used).
    let own_seg = if size > 1 && !opts.force_tcp {
        let name = format!(
            "/ferrocomm-{pid}-{rank}-{}-{}",
            SEGMENT_COUNTER.fetch_add(1, Ordering::Relaxed),
            &bootstrap::random_token()?[..12]
        );
        Some(Segment::create_shared(&name, payload_bytes(size, opts.shm_ring_bytes))?)
    } else {
        None
    };
    let mut listener = if size > 1 {
        Some(bind_listener(opts, store, "link listener")?)
    } else {
        None
    };
    // The links' secret: derived from the job's secret where the store holds one, so it never
    // travels; else rank 0 makes one and publishes it in its record.
    let derived = if size > 1 { store.derive_secret("links")? } else { None };
    let secret = if rank == 0 && size > 1 && derived.is_none() {
        bootstrap::random_token()?
    } else {
        "-".to_owned()
    };
    let tcp_addr = published_addr(listener.as_ref())?;
    let cpus = crowding::own_cpus();
    let hello = Hello {
        host: &me,
        pid: &pid,
        cpus: &cpus,
        shm: own_seg.as_ref().map_or("-", |s| s.name()),
        tcp: &tcp_addr,
        secret: &secret,
    };
    store.set(&format!("hello/{rank}"), hello.encode().as_bytes())?;
    let keys: Vec<String> = (0..size).map(|r| format!("hello/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let raw = store.get_many(&refs, left(deadline))?;
    let hellos = raw
        .iter()
        .enumerate()
        .map(|(r, v)| Hello::decode(r, v))
        .collect::<Result<Vec<_>>>()?;
    let local: Vec<bool> = hellos.iter().map(|h| h.host == me).collect();
    let crowded = crowding::crowded(kernel(&me), hellos.iter().map(|h| (kernel(h.host), h.cpus)))?;
    let own_seg = own_seg.filter(|_| (0..size).any(|p| p != rank && local[p]));
    let expected = (rank + 1..size).filter(|&p| !local[p]).count();
    if expected == 0 {
        listener = None;
    }
    let secret: Vec<u8> = match derived {
        Some(k) => k.to_vec(),
        None => hellos[0].secret.as_bytes().to_vec(),
    };
    let secret = &secret[..];
    let peers = match &own_seg {
        Some(_) => Some(peer_segments(&hellos, &local, secret, size, opts.shm_ring_bytes)?),
        None => None,
    };

    // Peers on other hosts hold a placeholder until their TCP link replaces it below: each is
    // dialled or accepted, or the set-up fails.
    let mut links: Vec<Link> = (0..size)
        .map(|p| {
            if local[p] && p != rank {
                Link::Pending
            } else {
                Link::SelfLoop(Default::default())
            }
        })
        .collect();
    let bulk_bytes = match opts.tcp_bulk_bytes {
        Some(0) => usize::MAX,
        Some(n) => n,
        None => TCP_BULK_BYTES,
    };
    let stop = AtomicBool::new(false);
    let accepted = std::thread::scope(|s| -> Result<Vec<(usize, Handshaken)>> {
        let stop = &stop;
        let from: Vec<bool> = (0..size).map(|p| p > rank && !local[p]).collect();
        let seal = |p: usize| opts.encrypt.seals(machine(hellos[p].host) == machine(&me));
        // Plain links have a second connection for the dialler's large payloads (tcp.rs).
        let bulk = move |p: usize| !seal(p);
        let acceptor = listener.take().map(|l| {
            s.spawn(move || {
                let expect = Expect {
                    from: &from,
                    seal: &seal,
                    bulk: &bulk,
                };
                accept_authenticated_or_stop(l, rank, &expect, secret, deadline, stop)
            })
        });
        let dialled = dial_lower(rank, &hellos, &local, secret, &seal, bulk_bytes, deadline, &mut links);
        if dialled.is_err() {
            stop.store(true, Ordering::Release);
        }
        let accepted = match acceptor {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(Error::protocol("transport setup", "the accepting thread panicked"))),
            None => Ok(Vec::new()),
        };
        dialled?;
        accepted
    })?;
    // The acceptor took only ranks above ours on other hosts, each once (and the second
    // connection of each plain link once).
    let (mains, bulks): (Vec<_>, Vec<_>) = accepted.into_iter().partition(|(_, h)| h.lane == Lane::Main);
    for (p, conn) in mains {
        links[p] = Link::Tcp(TcpLink::new(conn)?);
    }
    for (p, conn) in bulks {
        let Link::Tcp(t) = std::mem::replace(&mut links[p], Link::Pending) else {
            let why = format!("rank {p}'s second connection came without its first");
            return Err(Error::protocol("transport setup", why));
        };
        links[p] = Link::Tcp(t.with_bulk(conn, None)?);
    }

    // Where ranks of other processes share this host, they map our segment by name: once all
    // of them have, remove the names, so nothing is left in /dev/shm even if a process dies
    // later. Ranks of one process share their mappings and need no names, so where this host
    // has one process the names go at once.
    if let Some(s) = &own_seg {
        let several = (0..size).any(|p| local[p] && hellos[p].pid != pid);
        let waited = if several {
            store.set(&format!("ready/{rank}"), b"1")?;
            let keys: Vec<String> = (0..size).filter(|&p| local[p]).map(|r| format!("ready/{r}")).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            store.wait(&refs, left(deadline))
        } else {
            Ok(())
        };
        s.unlink();
        waited?;
    }
    let board = board_over(rank, size, own_seg.as_ref(), peers.as_ref(), opts.shm_ring_bytes);
    let has_shm = own_seg.is_some();
    Ok(Transport {
        links,
        board,
        own_seg,
        peers,
        slots: (0..size).collect(),
        slot: rank,
        ring_bytes: opts.shm_ring_bytes,
        pull_bytes: match opts.shm_pull_bytes {
            Some(0) => usize::MAX,
            Some(n) => n,
            // Where the kernel's copy out of another process is slow, never (pull.rs, `pays`;
            // timed only where this rank has shared-memory links).
            None if has_shm && !super::pull::pays() => usize::MAX,
            // Measured (docs/results/cpu.md, "Rounds and references by crowding"): where every
            // rank has a CPU, 16-32 KiB by reference took 0.70-0.78 of the time through the
            // rings; with 4 ranks on 2 CPUs 16 KiB took 1.7x, the sender waiting for a receiver
            // that was not running.
            None if crowded => 64 << 10,
            None => 16 << 10,
        },
        crowded,
        machines: machine_numbers(hellos.iter().map(|h| machine(h.host))),
        hosts: machine_numbers(hellos.iter().map(|h| h.host)),
    })
}

/// Numbers machine identities in order of first appearance: `[a, b, a]` gives `[0, 1, 0]`.
fn machine_numbers<T: PartialEq>(ids: impl Iterator<Item = T>) -> Vec<usize> {
    let mut seen: Vec<T> = Vec::new();
    ids.map(|id| match seen.iter().position(|s| *s == id) {
        Some(i) => i,
        None => {
            seen.push(id);
            seen.len() - 1
        }
    })
    .collect()
}

/// The segments of every rank on this host, from this process's table of them: the first of
/// its ranks to get here maps them (where another rank of the process has not already: see
/// `Segment::open_shared`) and opens a liveness watch on each rank of another process; the
/// others share that. Keyed by the communicator's link secret, which is its own.
fn peer_segments(
    hellos: &[Hello<'_>],
    local: &[bool],
    key: &[u8],
    size: usize,
    ring_bytes: usize,
) -> Result<Arc<PeerSegments>> {
    static TABLES: OnceLock<Mutex<HashMap<Vec<u8>, Weak<PeerSegments>>>> = OnceLock::new();
    let mut tables = TABLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(t) = tables.get(key).and_then(Weak::upgrade) {
        return Ok(t);
    }
    let len = payload_bytes(size, ring_bytes);
    let mut segs = Vec::with_capacity(size);
    let mut watches = Vec::with_capacity(size);
    let mut readable = Vec::with_capacity(size);
    // Asked once per process: whether we may read its memory (pull.rs).
    let mut asked: HashMap<u32, bool> = HashMap::new();
    for (h, &here) in hellos.iter().zip(local) {
        let seg = if here {
            Some(Segment::open_shared(h.shm, len)?)
        } else {
            None
        };
        watches.push(seg.as_ref().and_then(|s| ProcessWatch::open(s.owner_pid())));
        readable.push(seg.as_ref().and_then(|s| {
            let pid = s.owner_pid();
            (*asked.entry(pid).or_insert_with(|| s.owner_readable())).then_some(pid)
        }));
        segs.push(seg);
    }
    let t = Arc::new(PeerSegments {
        segs,
        watches,
        readable,
    });
    tables.retain(|_, w| w.strong_count() > 0);
    tables.insert(key.to_vec(), Arc::downgrade(&t));
    Ok(t)
}

/// Dials the TCP listener of every rank of a lower rank on another host.
#[allow(clippy::too_many_arguments)]
fn dial_lower(
    rank: usize,
    hellos: &[Hello<'_>],
    local: &[bool],
    secret: &[u8],
    seal: &dyn Fn(usize) -> bool,
    bulk_bytes: usize,
    deadline: Instant,
    links: &mut [Link],
) -> Result<()> {
    for p in (0..rank).filter(|&p| !local[p]) {
        let h = &hellos[p];
        let addr: SocketAddr = h.tcp.parse().map_err(|_| {
            Error::protocol(
                "transport setup",
                format!("rank {p} published no TCP address ({:?})", h.tcp),
            )
        })?;
        let mut link = TcpLink::new(dial((rank, p), addr, secret, (seal(p), Lane::Main), deadline)?)?;
        if !seal(p) {
            let bulk = dial((rank, p), addr, secret, (false, Lane::Bulk), deadline)?;
            link = link.with_bulk(bulk, Some(bulk_bytes))?;
        }
        links[p] = Link::Tcp(link);
    }
    Ok(())
}

/// A rank's segment holds one incoming ring per sender, in rank order, then its board area.
fn ring_stride(ring_bytes: usize) -> usize {
    CTL_BYTES + ring_bytes
}

fn payload_bytes(size: usize, ring_bytes: usize) -> usize {
    size * ring_stride(ring_bytes) + board::area_bytes(size)
}

fn area_base(seg: &Segment, size: usize, ring_bytes: usize) -> *mut u8 {
    debug_assert_eq!(seg.payload_len(), payload_bytes(size, ring_bytes));
    // SAFETY: the area follows the rings (64-aligned: ring strides are multiples of 64 and the
    // payload starts on a page).
    unsafe { seg.payload().add(size * ring_stride(ring_bytes)) }
}

/// The board over every rank's area, when all ranks share memory with us.
fn board_over(
    rank: usize,
    size: usize,
    own: Option<&Arc<Segment>>,
    peers: Option<&Arc<PeerSegments>>,
    ring_bytes: usize,
) -> Option<Board> {
    let (_, peers) = (own?, peers?);
    let areas = (0..size)
        .map(|p| peers.segs[p].as_ref().map(|s| area_base(s, size, ring_bytes)))
        .collect::<Option<Vec<_>>>()?;
    // SAFETY: every segment was created zeroed with an area at its end and stays mapped inside
    // `peers`, which the Board holds; each rank writes only its own area.
    Some(unsafe { Board::new(rank, areas, peers.clone()) })
}

/// A listener for other ranks on an address they can reach: `FERROCOMM_SOCKET_ADDR`, else the
/// address this host uses to reach the store, else loopback.
pub(crate) fn bind_listener(opts: &TransportOptions, store: &dyn Store, what: &str) -> Result<TcpListener> {
    let ip = opts
        .bind_addr
        .or_else(|| store.local_addr_hint())
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("bind {what} on {ip}"), e))
}

/// How a listener's address is published in the store: `-` when there is none.
pub(crate) fn published_addr(listener: Option<&TcpListener>) -> Result<String> {
    match listener {
        Some(l) => Ok(l
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?
            .to_string()),
        None => Ok("-".into()),
    }
}

/// Transports of `n` ranks as threads of this process, over an in-memory store (64 KiB rings),
/// for tests of the links and of the engine above them.
#[cfg(test)]
pub(crate) fn connect_threads_with(n: usize, shm_pull_bytes: Option<usize>) -> Vec<Transport> {
    connect_threads_by(n, shm_pull_bytes, false)
}

/// As `connect_threads_with`, every link TCP over loopback.
#[cfg(test)]
pub(crate) fn connect_threads_over_tcp(n: usize) -> Vec<Transport> {
    connect_threads_by(n, None, true)
}

#[cfg(test)]
fn connect_threads_by(n: usize, shm_pull_bytes: Option<usize>, force_tcp: bool) -> Vec<Transport> {
    let store = crate::bootstrap::MemoryStore::new();
    let opts = TransportOptions {
        shm_ring_bytes: 1 << 16,
        shm_pull_bytes,
        tcp_bulk_bytes: None,
        force_tcp,
        net: crate::contracts::options::NetTransport::Auto,
        bind_addr: None,
        encrypt: crate::contracts::options::Encrypt::Auto,
    };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (store, opts) = (&store, &opts);
                s.spawn(move || connect_all(r, n, store, opts, Duration::from_secs(30)).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::links::REF_BYTES;

    #[test]
    fn a_kernel_is_the_boot_id_and_other_namespaces_share_it_but_an_unread_one_is_the_machine() {
        assert_eq!(kernel("node/boot-a/mnt:[1]/pid:[2]"), "boot-a");
        assert_eq!(kernel("node/boot-a/mnt:[7]/pid:[8]#rank3"), "boot-a");
        // Two machines whose boot ids could not be read are not one kernel.
        let (one, two) = ("node1//mnt:[1]/pid:[2]", "node2//mnt:[1]/pid:[2]");
        assert_ne!(kernel(one), kernel(two));
    }

    #[test]
    fn machines_are_numbered_in_order_of_first_appearance() {
        let ids = ["b/1/m/p#rank0", "a/1/m/p#rank1", "b/1/m/p#rank2", "c/1/m/p"];
        assert_eq!(machine_numbers(ids.iter().map(|h| machine(h))), [0, 1, 0, 2]);
        // After a shrink that keeps ranks 1..4 of machines [0, 0, 1, 1]: numbered from 0 again.
        assert_eq!(machine_numbers([0, 1, 1].into_iter()), [0, 1, 1]);
        assert_eq!(machine_numbers([1, 1, 0].into_iter()), [0, 0, 1]);
    }

    fn connect_threads(n: usize) -> Vec<Transport> {
        connect_threads_with(n, Some(64 << 10))
    }

    /// Ranks of one process share one mapping of each segment, whose names are gone at once;
    /// a link is made when first used, and a pending one still tells unread bytes and a peer
    /// that left.
    #[test]
    fn shared_memory_links_are_made_on_first_use() {
        let mut t = connect_threads(4);
        for (r, tr) in t.iter().enumerate() {
            assert!(tr
                .links
                .iter()
                .enumerate()
                .all(|(p, l)| (p == r) == matches!(l, Link::SelfLoop(_))));
            assert!(
                tr.links.iter().all(|l| !matches!(l, Link::Shm(_))),
                "no link is made at set-up"
            );
            assert!(Arc::ptr_eq(tr.peers.as_ref().unwrap(), t[0].peers.as_ref().unwrap()));
            let name = tr.own_seg.as_ref().unwrap().name().trim_start_matches('/').to_owned();
            assert!(
                !std::path::Path::new("/dev/shm").join(name).exists(),
                "the name is removed"
            );
            assert!(tr.board.is_some());
        }
        assert_eq!(t[0].link(1).write(b"hello").unwrap(), 5);
        assert!(matches!(t[0].links[1], Link::Shm(_)));
        assert!(t[1].has_unread(0), "bytes on a pending link are seen");
        assert!(matches!(t[1].links[0], Link::Pending));
        let mut got = [0u8; 5];
        assert_eq!(t[1].link(0).read(&mut got).unwrap(), 5);
        assert_eq!(&got, b"hello");
        assert!(t[1].has_unread(0), "the skip to the next line is the reader's to take");
        t[1].link(0).end_message();
        assert!(!t[1].has_unread(0));
        assert!(matches!(t[2].links[3], Link::Pending));
        assert!(t[2].check_peer(3).is_ok());
        drop(t.pop()); // rank 3 leaves
        let gone = t[2].check_peer(3).expect_err("a pending link sees its peer leave");
        assert_eq!(gone.rank, 3);
        assert!(gone.reason.contains("closed"), "{}", gone.reason);
    }

    /// A large message goes by reference once the receiver has made its link (it offers to
    /// copy), comes out whole, and frees the sender only when copied; a reference the sender
    /// took back makes the copy an error; a small message, or any with the threshold at 0,
    /// stays in the ring.
    #[test]
    fn large_messages_between_ranks_of_one_host_go_by_reference() {
        let mut t = connect_threads(2);
        if t[0].peers.as_ref().unwrap().readable[1].is_none() {
            println!("SKIPPED: process_vm_readv is not allowed here");
            return;
        }
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 253) as u8).collect();
        assert!(
            !t[0].link(1).sends_by_reference(big.len()),
            "the receiver has not offered yet"
        );
        t[1].link(0);
        assert!(t[0].link(1).sends_by_reference(big.len()));
        assert!(
            !t[0].link(1).sends_by_reference(1000),
            "small messages stay in the ring"
        );
        let r = t[0].link(1).reference_to(&big);
        assert_eq!(t[0].link(1).write(&r).unwrap(), r.len());
        let end = t[0].link(1).written();
        assert!(!t[0].link(1).taken(end), "not copied yet");
        let mut got = vec![0u8; big.len()];
        assert!(t[1].link(0).pull(&mut got).unwrap());
        assert_eq!(got, big);
        t[1].link(0).end_message();
        assert!(t[0].link(1).taken(end), "copied: the sender's buffer is free");

        // The sender took its reference back (its operation failed): the copy is not trusted,
        // and the next reference is.
        assert_eq!(t[0].link(1).write(&r).unwrap(), r.len());
        t[0].link(1).withdraw();
        let e = t[1].link(0).pull(&mut got).expect_err("the sender withdrew");
        assert!(e.contains("withdrew its message"), "{e}");
        let mut fresh = big.clone();
        fresh[0] ^= 1;
        let r = t[0].link(1).reference_to(&fresh);
        // The stream after a withdrawn reference is the peers' to resync: here only the link.
        let mut stale = [0u8; REF_BYTES];
        let _ = t[1].link(0).read(&mut stale);
        t[1].link(0).end_message();
        assert_eq!(t[0].link(1).write(&r).unwrap(), r.len());
        assert!(t[1].link(0).pull(&mut got).unwrap());
        assert_eq!(got, fresh);

        // Off: nothing goes by reference.
        let mut off = connect_threads_with(2, Some(0));
        off[1].link(0);
        assert!(!off[0].link(1).sends_by_reference(big.len()));
    }
}
