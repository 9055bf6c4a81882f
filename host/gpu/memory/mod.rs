//! GPU memory behind windows: physical allocations that can be exported as POSIX file
//! descriptors, mapped side by side into one virtual range per rank (symmetric layout);
//! multicast objects over every rank's segment (multimem); and host-pinned words the device
//! writes and the host reads (error records, abort flags); dma-buf exports of segments for NICs.
//!
//! May import: the contracts and the rest of the GPU wing (crate::gpu).

pub(crate) mod dmabuf;
pub(crate) mod multicast;
pub(crate) mod pinned;
pub(crate) mod result;
pub(crate) mod symmetric;

pub(crate) use multicast::{multicast_supported, MulticastMap};
pub(crate) use pinned::Pinned;
pub(crate) use symmetric::{Physical, SymmetricMap};
