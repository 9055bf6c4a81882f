//! The backends, each implementing the contracts of `crate::contracts` for one rank: `cpu`
//! (the progress engine over shared memory and TCP links), `nccl` (libnccl), `device`
//! (ferrocomm's own kernels through the GPU wing, with NCCL and the CPU engine beside them),
//! and the registry that names them. May import the contracts, bootstrap, the network and the
//! GPU wing; never the public face (comm, collectives, objects, window, work).

pub(crate) mod cpu;
mod device;
mod nccl;
mod norm_pass;
pub(crate) mod registry;
