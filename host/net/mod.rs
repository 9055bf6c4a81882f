//! The network, in two halves:
//!
//! - `links/` (layer 2): byte streams between the ranks of a communicator (shared-memory rings
//!   and the board on one host, TCP between hosts, a loop to oneself), liveness of peer
//!   processes, descriptor passing, and the fault record. The CPU backend's engine runs on them.
//! - `windows/` (layer 4): the window path over the network: proxy descriptors, the FIFO and
//!   the proxy thread that drains it, window links over TCP or RDMA verbs, the window server,
//!   and the one place where a window's network is set up, for CPU and device windows alike.
//!
//! `links` may import the contracts and bootstrap; `windows` also the GPU wing and `links`.

pub(crate) mod links;
pub(crate) mod windows;

pub use windows::{descriptor, measure_pickup, HostQueue, QueueProducer};
