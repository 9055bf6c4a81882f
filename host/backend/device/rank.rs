//! What one rank of a device communicator holds for its windows and its own collective
//! kernels alike: the device it drives, its place in the communicator, the CPU engine
//! underneath (control plane), the store, and the abort flag every device wait polls.

use crate::backend::cpu::CpuBackend;
use crate::contracts::options::TransportOptions;
use crate::contracts::store::Store;
use crate::gpu::memory::Pinned;
use crate::gpu::target::Gpu;
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct DeviceRank {
    pub(crate) gpu: Gpu,
    /// The CUDA device (0 on the host device, where nothing reads it).
    pub(crate) ordinal: usize,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) host: Arc<CpuBackend>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) transport: TransportOptions,
    /// docs/memory-model.md rule 5: one pinned word per communicator that every device spin
    /// loop polls; `abort` stores 1.
    pub(crate) abort_flag: Arc<Pinned<u32>>,
    /// Every rank has a GPU of its own that supports multicast: windows bind a multicast object.
    pub(crate) multicast: bool,
    /// Every rank is on this host; else why not.
    pub(crate) one_host: std::result::Result<(), String>,
    pub(crate) timeout: Duration,
}
