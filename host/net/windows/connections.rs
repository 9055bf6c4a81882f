//! The TCP connections behind a window's network paths, made while the window is created: each
//! rank that is reached over the network by some origin listens, and each origin dials the
//! targets it reaches that way, authenticated by a secret of the window. CPU and device windows
//! both build their links (tcp.rs) and servers on these connections.

use crate::bootstrap;
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::net::links::{accept_authenticated, bind_listener, dial, published_addr};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

/// This rank's connections.
pub(crate) struct Mesh {
    /// Per target rank: our connection to its server, where we reach it over the network.
    pub to: Vec<Option<TcpStream>>,
    /// The connections of the origins we serve, with their ranks.
    pub from: Vec<(usize, TcpStream)>,
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
    let serves = (0..size).filter(|&o| by_net(o, rank)).count();
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
    if serves == 0 && dials.is_empty() {
        return Ok(mesh);
    }
    let secret: Vec<u8> = match derived {
        Some(k) => k.to_vec(),
        None => store.get("net/secret", left())?,
    };
    let listener = if serves > 0 {
        Some(bind_listener(transport, store, "window server")?)
    } else {
        None
    };
    store.set(
        &format!("net/addr/{rank}"),
        published_addr(listener.as_ref())?.as_bytes(),
    )?;

    // Accept our origins on a helper thread while we dial our targets: no order deadlocks.
    let acceptor = listener.map(|l| {
        let secret = secret.clone();
        let from: Vec<bool> = (0..size).map(|o| by_net(o, rank)).collect();
        std::thread::spawn(move || accept_authenticated(l, rank, &from, &secret, deadline))
    });
    for t in dials {
        let v = String::from_utf8_lossy(&store.get(&format!("net/addr/{t}"), left())?).into_owned();
        let addr: SocketAddr = v
            .parse()
            .map_err(|_| Error::protocol("window setup", format!("rank {t} runs no window server ({v:?})")))?;
        mesh.to[t] = Some(dial(rank, t, addr, &secret, deadline)?);
    }
    if let Some(a) = acceptor {
        let accepted = a
            .join()
            .map_err(|_| Error::protocol("window setup", "window server acceptor panicked"))??;
        // Only origins that reach us over the network, each once.
        mesh.from = accepted;
    }
    Ok(mesh)
}
