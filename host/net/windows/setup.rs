//! The one place a window's network is set up, for CPU and device windows alike: TCP
//! connections between the ranks that reach each other over the network (connections.rs),
//! a link per target over them, moved to RDMA verbs where `FERROCOMM_NET` chooses it and both
//! ends can (`select_links`), and a server thread per origin that applies the origin's requests
//! to this rank's memory (tcp.rs). Collective over the window's ranks.

use super::connections;
use super::link::SharedLink;
use super::tcp::{self, Target, TcpLink};
use super::{select_links, NetResources, RdmaPlan, WindowMemory};
use crate::contracts::error::{Error, Result};
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a window hands to [`WindowNetwork::start`].
pub(crate) struct NetPlan<'a> {
    /// The window's store namespace.
    pub store: &'a dyn Store,
    pub rank: usize,
    pub size: usize,
    /// Whether `origin` reaches `target` over the network rather than by load/store.
    pub by_net: &'a dyn Fn(usize, usize) -> bool,
    pub transport: &'a TransportOptions,
    /// This rank's memory, as a NIC registers it for peers' RDMA links.
    pub memory: WindowMemory,
    /// Bound of every operation on a link.
    pub timeout: Duration,
    pub deadline: Instant,
}

/// A window's links toward the ranks it reaches over the network, and the servers that apply
/// those ranks' requests to this rank's memory.
pub(crate) struct WindowNetwork {
    /// Per rank, the link where the rank is reached over the network.
    pub(crate) links: Vec<Option<Arc<SharedLink>>>,
    /// Per rank: its connection to our server has closed (it can no longer write to us).
    gone: Arc<Vec<AtomicBool>>,
    /// The connections we serve, to shut down when serving stops.
    served: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
    /// Our memory's registration with the NIC for peers' RDMA links.
    registered: NetResources,
}

impl WindowNetwork {
    /// Connects, makes the links and starts one server per origin, each applying requests
    /// through the target `target()` makes for it.
    pub(crate) fn start<T: Target + 'static>(
        p: NetPlan,
        mut target: impl FnMut() -> Result<T>,
    ) -> Result<WindowNetwork> {
        let mut mesh = connections::connect(p.store, p.rank, p.size, p.by_net, p.transport, p.deadline)?;
        let mut links = Vec::with_capacity(p.size);
        for (t, stream) in mesh.to.iter_mut().enumerate() {
            links.push(match stream.take() {
                Some(s) => Some(Arc::new(SharedLink::new(Box::new(TcpLink::new(s, t, p.timeout)?)))),
                None => None,
            });
        }
        let registered = select_links(
            &mut links,
            &RdmaPlan {
                choice: p.transport.net,
                rank: p.rank,
                size: p.size,
                store: p.store,
                memory: p.memory,
                timeout: p.deadline.saturating_duration_since(Instant::now()),
            },
        )?;
        let mut net = WindowNetwork {
            links,
            gone: Arc::new((0..p.size).map(|_| AtomicBool::new(false)).collect()),
            served: Vec::new(),
            threads: Vec::new(),
            registered,
        };
        // From here an error drops `net`, which stops the servers already started.
        for (origin, stream) in mesh.from {
            net.served.push(
                stream
                    .get_ref()
                    .try_clone()
                    .map_err(|e| Error::io("window server", e))?,
            );
            let target = target()?;
            let gone = net.gone.clone();
            net.threads.push(
                std::thread::Builder::new()
                    .name("ferrocomm-winserve".into())
                    .spawn(move || tcp::serve(stream, origin, target, gone))
                    .map_err(|e| Error::io("starting a window server thread", e))?,
            );
        }
        Ok(net)
    }

    /// Whether `origin`'s connection to our server has closed (it can no longer signal us).
    pub(crate) fn lost(&self, origin: usize) -> bool {
        self.gone.get(origin).is_some_and(|g| g.load(Ordering::Acquire))
    }

    /// Stops the servers and drops the NIC registration. The owner calls it (or drops the
    /// network) before the memory the servers write goes away; a second call does nothing.
    pub(crate) fn stop(&mut self) {
        for s in self.served.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.registered = NetResources::default();
    }
}

impl Drop for WindowNetwork {
    fn drop(&mut self) {
        self.stop();
    }
}
