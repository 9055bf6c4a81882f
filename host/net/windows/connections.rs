//! The TCP connections behind a window's network paths, made while the window is created: each
//! rank that is reached over the network by some origin listens, and each origin dials the
//! targets it reaches that way, authenticated both ways by a secret of the window and sealed
//! where `FERROCOMM_ENCRYPT` says. CPU and device windows both build their links (tcp.rs) and
//! servers on these connections.

use super::tcp::Conn;
use crate::bootstrap;
use crate::bootstrap::seal::SealedStream;
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::net::links::{
    accept_authenticated, bind_listener, dial, host_identity, machine, published_addr, Expect, Handshaken, Lane,
};
use std::net::SocketAddr;
use std::time::Instant;

/// This rank's connections.
pub(crate) struct Mesh {
    /// Per target rank: our connection to its server, where we reach it over the network.
    pub to: Vec<Option<Conn>>,
    /// The connections of the origins we serve, with their ranks.
    pub from: Vec<(usize, Conn)>,
}

/// What a rank publishes for the window's network: its server's address (`-`: none) and its
/// machine, from which both ends of a connection decide whether to seal it.
fn record(addr: &str, machine: &str) -> String {
    format!("{addr}\n{machine}")
}

fn parse_record(rank: usize, raw: &[u8]) -> Result<(String, String)> {
    let text = String::from_utf8_lossy(raw);
    let (addr, machine) = text
        .split_once('\n')
        .ok_or_else(|| Error::protocol("window setup", format!("malformed network record of rank {rank}")))?;
    Ok((addr.to_owned(), machine.to_owned()))
}

/// Collective over the window's ranks (`store` is the window's namespace). `by_net(origin,
/// target)` says whether `origin` reaches `target` over the network; every rank must pass the
/// same relation. Ranks with no network path at all exchange nothing.
pub(crate) fn connect(
    store: &dyn Store,
    rank: usize,
    size: usize,
    by_net: &dyn Fn(usize, usize) -> bool,
    transport: &TransportOptions,
    deadline: Instant,
) -> Result<Mesh> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let origins: Vec<usize> = (0..size).filter(|&o| by_net(o, rank)).collect();
    let dials: Vec<usize> = (0..size).filter(|&t| by_net(rank, t)).collect();
    let mut mesh = Mesh {
        to: (0..size).map(|_| None).collect(),
        from: Vec::new(),
    };
    // The window's secret, derived from the job's where the store holds one (it never
    // travels); else rank 0 makes one when anyone needs it, even if it has no path itself,
    // and publishes it, and only ranks with a path read it.
    let derived = store.derive_secret("net")?;
    let any = (0..size).any(|o| (0..size).any(|t| by_net(o, t)));
    if rank == 0 && any && derived.is_none() {
        store.set("net/secret", bootstrap::random_token()?.as_bytes())?;
    }
    if origins.is_empty() && dials.is_empty() {
        return Ok(mesh);
    }
    let secret: Vec<u8> = match derived {
        Some(k) => k.to_vec(),
        None => store.get("net/secret", left())?,
    };
    let listener = if origins.is_empty() {
        None
    } else {
        Some(bind_listener(transport, store, "window server")?)
    };
    let me = host_identity(rank, transport);
    let mine = machine(&me).to_owned();
    store.set(
        &format!("net/addr/{rank}"),
        record(&published_addr(listener.as_ref())?, &mine).as_bytes(),
    )?;
    let seals = |their: &str| transport.encrypt.seals(their == mine);

    // Accept our origins on a helper thread while we dial our targets: no order deadlocks.
    let acceptor = match listener {
        Some(l) => {
            let keys: Vec<String> = origins.iter().map(|o| format!("net/addr/{o}")).collect();
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut seal = vec![false; size];
            for (&o, raw) in origins.iter().zip(store.get_many(&refs, left())?) {
                seal[o] = seals(&parse_record(o, &raw)?.1);
            }
            let mut from = vec![false; size];
            origins.iter().for_each(|&o| from[o] = true);
            let secret = secret.clone();
            Some(std::thread::spawn(move || {
                let expect = Expect {
                    from: &from,
                    seal: &|o| seal[o],
                    bulk: &|_| false,
                };
                accept_authenticated(l, rank, &expect, &secret, deadline)
            }))
        }
        None => None,
    };
    for t in dials {
        let (addr, theirs) = parse_record(t, &store.get(&format!("net/addr/{t}"), left())?)?;
        let addr: SocketAddr = addr
            .parse()
            .map_err(|_| Error::protocol("window setup", format!("rank {t} runs no window server ({addr:?})")))?;
        mesh.to[t] = Some(conn(dial(
            (rank, t),
            addr,
            &secret,
            (seals(&theirs), Lane::Main),
            deadline,
        )?));
    }
    if let Some(a) = acceptor {
        let accepted = a
            .join()
            .map_err(|_| Error::protocol("window setup", "window server acceptor panicked"))??;
        // Only origins that reach us over the network, each once.
        mesh.from = accepted.into_iter().map(|(o, h)| (o, conn(h))).collect();
    }
    Ok(mesh)
}

/// The connection a handshake made, sealed where both ends agreed to.
fn conn(h: Handshaken) -> Conn {
    if h.sealed {
        SealedStream::sealed(h.stream, &h.keys)
    } else {
        SealedStream::plain(h.stream)
    }
}
