//! The `device` backend: windows in GPU memory that kernels drive (device-api), with the same
//! host verbs as CPU windows. Collectives on host buffers, and the control plane of window
//! creation, run on the CPU engine underneath; device collectives arrive with their own
//! kernels, and NCCL behind them.

mod window;

use super::cpu::{self, CpuBackend};
use super::{Backend, BackendInit, RunOptions};
use crate::bootstrap::Store;
use crate::error::{Error, Result};
use crate::memory::Pinned;
use crate::ops::Op;
use crate::options::TransportOptions;
use crate::window::{WindowBackend, WindowSpec};
use crate::Device;
use std::sync::Arc;

pub(crate) struct DeviceBackend {
    ordinal: usize,
    rank: usize,
    size: usize,
    host: Arc<CpuBackend>,
    store: Arc<dyn Store>,
    transport: TransportOptions,
    /// docs/memory-model.md rule 5: one pinned word per communicator that every device spin
    /// loop polls; `abort` stores 1.
    abort_flag: Arc<Pinned<u32>>,
}

pub(crate) fn create(init: &BackendInit) -> Result<Box<dyn Backend>> {
    let Device::Cuda(ordinal) = init.device else {
        return Err(Error::Unavailable {
            backend: "device".into(),
            reason: format!("it drives CUDA devices, not {:?}", init.device),
        });
    };
    crate::cuda::context(ordinal)?;
    crate::device::library(ordinal)?;
    let abort_flag = Arc::new(Pinned::zeroed(1)?);
    Ok(Box::new(DeviceBackend {
        ordinal,
        rank: init.rank,
        size: init.size,
        host: Arc::new(cpu::create_host(init)?),
        store: init.store.clone(),
        transport: init.options.transport.clone(),
        abort_flag,
    }))
}

impl Backend for DeviceBackend {
    fn name(&self) -> &'static str {
        "device"
    }

    /// Operations on host buffers run on the CPU engine (same semantics, same oracle).
    fn run(&self, op: &mut Op<'_>, opts: &RunOptions) -> Result<()> {
        self.host.run(op, opts)
    }

    fn abort(&self) {
        self.abort_flag.write(0, 1);
        self.host.abort();
    }

    fn finalize(&self) -> Result<()> {
        self.host.finalize()
    }

    fn new_window(&self, spec: &WindowSpec) -> Result<Box<dyn WindowBackend>> {
        Ok(Box::new(window::DeviceWindow::create(self, spec)?))
    }
}
