//! Builds every link of one communicator through its store: ranks on the same host map each
//! other's shared-memory segment, ranks on other hosts connect over TCP and prove they belong to
//! the communicator with a per-communicator secret that only the (authenticated) store carries.

use super::liveness::ProcessWatch;
use super::ring::{RingEnd, CTL_BYTES};
use super::shm::{OwnerState, Segment};
use super::shm_board::{self as board, Board};
use super::tcp::{accept_authenticated, dial, TcpLink};
use super::{Link, ShmLink};
use crate::bootstrap;
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// All links of one rank, indexed by peer rank.
pub(crate) struct Transport {
    pub(crate) links: Vec<Link>,
    /// Present when every rank shares this host (and there are at least two).
    pub(crate) board: Option<Board>,
    own_seg: Option<Arc<Segment>>,
}

impl Transport {
    /// A handle that can announce our state while an operation holds the transport.
    pub(crate) fn announcer(&self) -> Announcer {
        let streams = self
            .links
            .iter()
            .filter_map(|l| match l {
                Link::Tcp(t) => t.try_clone_stream(),
                _ => None,
            })
            .collect();
        Announcer {
            seg: self.own_seg.clone(),
            streams,
        }
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
    let id = format!(
        "{}/{}/{}/{}",
        String::from_utf8_lossy(name),
        boot.trim(),
        ns("mnt"),
        ns("pid")
    );
    if opts.force_tcp {
        // Every rank its own "host": all links go over TCP (tests the multi-host path locally).
        format!("{id}#rank{rank}")
    } else {
        id
    }
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn get_str(store: &dyn Store, key: &str, deadline: Instant) -> Result<String> {
    let v = store.get(key, left(deadline))?;
    String::from_utf8(v).map_err(|_| Error::protocol("transport setup", format!("store key `{key}` is not UTF-8")))
}

static SEGMENT_COUNTER: AtomicU64 = AtomicU64::new(0);

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
    store.set(&format!("host/{rank}"), me.as_bytes())?;
    let hosts = (0..size)
        .map(|r| get_str(store, &format!("host/{r}"), deadline))
        .collect::<Result<Vec<_>>>()?;
    let local = |p: usize| hosts[p] == me;
    let any_remote = hosts.iter().any(|h| h != &hosts[0]);

    let own_seg = if (0..size).any(|p| p != rank && local(p)) {
        let name = format!(
            "/ferrocomm-{}-{}-{}-{}",
            std::process::id(),
            rank,
            SEGMENT_COUNTER.fetch_add(1, Ordering::Relaxed),
            &bootstrap::random_token()[..12]
        );
        Some(Arc::new(Segment::create(
            &name,
            payload_bytes(size, opts.shm_ring_bytes),
        )?))
    } else {
        None
    };
    let listener = if (0..size).any(|p| !local(p)) {
        Some(bind_listener(opts, store, "link listener")?)
    } else {
        None
    };
    let secret = if any_remote {
        if rank == 0 {
            let s = bootstrap::random_token();
            store.set("link-secret", s.as_bytes())?;
            s
        } else {
            get_str(store, "link-secret", deadline)?
        }
    } else {
        String::new()
    };

    let shm_name = own_seg
        .as_ref()
        .map(|s| s.name().to_owned())
        .unwrap_or_else(|| "-".into());
    let tcp_addr = published_addr(listener.as_ref())?;
    store.set(&format!("endpoint/{rank}"), format!("{shm_name} {tcp_addr}").as_bytes())?;

    let mut links: Vec<Option<Link>> = (0..size).map(|_| None).collect();
    links[rank] = Some(Link::SelfLoop(Default::default()));
    for p in (0..size).filter(|&p| p != rank) {
        let ep = get_str(store, &format!("endpoint/{p}"), deadline)?;
        let (peer_shm, peer_tcp) = ep
            .split_once(' ')
            .ok_or_else(|| Error::protocol("transport setup", format!("malformed endpoint of rank {p}: {ep:?}")))?;
        if local(p) {
            let own = own_seg
                .clone()
                .ok_or_else(|| Error::protocol("transport setup", "no own segment"))?;
            links[p] = Some(shm_link(rank, p, own, peer_shm, size, opts.shm_ring_bytes)?);
        } else if rank > p {
            let addr: SocketAddr = peer_tcp.parse().map_err(|_| {
                Error::protocol(
                    "transport setup",
                    format!("rank {p} published no TCP address ({peer_tcp:?})"),
                )
            })?;
            links[p] = Some(Link::Tcp(TcpLink::new(dial(
                rank,
                p,
                addr,
                secret.as_bytes(),
                deadline,
            )?)?));
        }
    }
    if let Some(l) = &listener {
        let expected = (rank + 1..size).filter(|&p| !local(p)).count();
        for (p, stream) in accept_authenticated(l, expected, secret.as_bytes(), size, deadline)? {
            if links[p].is_some() || p <= rank || local(p) {
                return Err(Error::protocol(
                    "transport setup",
                    format!("unexpected link from rank {p}"),
                ));
            }
            links[p] = Some(Link::Tcp(TcpLink::new(stream)?));
        }
    }
    let links = links
        .into_iter()
        .enumerate()
        .map(|(p, l)| l.ok_or_else(|| Error::protocol("transport setup", format!("no link to rank {p}"))))
        .collect::<Result<Vec<_>>>()?;

    // Everyone has mapped every segment once all are ready: drop the names so nothing is left
    // in /dev/shm even if a process dies later.
    store.set(&format!("ready/{rank}"), b"1")?;
    let keys: Vec<String> = (0..size).map(|r| format!("ready/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let waited = store.wait(&refs, left(deadline));
    if let Some(s) = &own_seg {
        s.unlink();
    }
    waited?;
    let board = board_over(rank, &links, own_seg.as_ref(), opts.shm_ring_bytes);
    Ok(Transport { links, board, own_seg })
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
fn board_over(rank: usize, links: &[Link], own: Option<&Arc<Segment>>, ring_bytes: usize) -> Option<Board> {
    let own = own?;
    let mut segments = Vec::with_capacity(links.len());
    for (p, l) in links.iter().enumerate() {
        match l {
            Link::Shm(s) => segments.push(s.peer_seg.clone()),
            Link::SelfLoop(_) if p == rank => segments.push(own.clone()),
            _ => return None,
        }
    }
    let areas = segments.iter().map(|s| area_base(s, links.len(), ring_bytes)).collect();
    // SAFETY: every segment was created zeroed with an area at its end and stays mapped inside
    // the Board; each rank writes only its own area.
    Some(unsafe { Board::new(rank, areas, segments) })
}

fn ring_base(seg: &Segment, sender: usize, ring_bytes: usize) -> *mut u8 {
    debug_assert!((sender + 1) * ring_stride(ring_bytes) <= seg.payload_len());
    // SAFETY: in bounds: the segment was created with one ring per rank.
    unsafe { seg.payload().add(sender * ring_stride(ring_bytes)) }
}

fn shm_link(
    rank: usize,
    peer: usize,
    own: Arc<Segment>,
    peer_name: &str,
    size: usize,
    ring_bytes: usize,
) -> Result<Link> {
    let peer_seg = Arc::new(Segment::open(peer_name, payload_bytes(size, ring_bytes))?);
    // SAFETY: both rings lie inside mappings that the link keeps alive (the Arcs below); each
    // end is used by exactly one rank: we produce into our slot of the peer's segment and
    // consume the peer's slot of ours.
    let (tx, rx) = unsafe {
        (
            RingEnd::new(ring_base(&peer_seg, rank, ring_bytes), ring_bytes, true),
            RingEnd::new(ring_base(&own, peer, ring_bytes), ring_bytes, false),
        )
    };
    let watch = ProcessWatch::open(peer_seg.owner_pid());
    Ok(Link::Shm(ShmLink {
        tx,
        rx,
        peer_seg,
        _own_seg: own,
        watch,
    }))
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
