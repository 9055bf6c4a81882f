//! The device a device backend drives: a CUDA GPU, or the host device (the same kernels on CPU
//! threads, crate::gpu::host_device). What the backend does to memory, streams and kernels goes
//! through the few types here, so that one backend serves both and the host device's tests
//! exercise the backend's own code.

use crate::contracts::error::{Error, Result};
use crate::gpu::cuda;
use crate::gpu::host_device;
use crate::gpu::kernels::{Function, Queue};
use crate::gpu::memory::{Physical, Pinned, SymmetricMap};
use cudarc::driver::{sys, CudaStream};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

/// Which device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gpu {
    Cuda(usize),
    /// The host device (crate::contracts::placement::Device::Host).
    Host,
}

impl Gpu {
    /// Ok once the device can run the library's kernels.
    pub(crate) fn open(self) -> Result<()> {
        match self {
            Gpu::Cuda(ordinal) => {
                cuda::context(ordinal)?;
                crate::gpu::library::library(ordinal).map(drop)
            }
            Gpu::Host => host_device::available(),
        }
    }

    /// Makes the device current on the calling thread (CUDA contexts are per thread).
    pub(crate) fn enter(self) -> Result<()> {
        match self {
            Gpu::Cuda(ordinal) => cuda::context(ordinal).map(drop),
            Gpu::Host => Ok(()),
        }
    }

    /// The library kernel `name`.
    pub(crate) fn function(self, name: &str) -> Result<Function> {
        match self {
            Gpu::Cuda(ordinal) => crate::gpu::library::library(ordinal)?
                .load_function(name)
                .map(Function::Cuda)
                .map_err(|e| cuda::err(&format!("cuModuleGetFunction({name})"), e)),
            Gpu::Host => host_device::module()?.function(name).map(Function::Host),
        }
    }

    pub(crate) fn stream(self) -> Result<Stream> {
        Ok(match self {
            Gpu::Cuda(ordinal) => Stream::Cuda(
                cuda::context(ordinal)?
                    .new_stream()
                    .map_err(|e| cuda::err("cuStreamCreate", e))?,
            ),
            Gpu::Host => Stream::Host(host_device::Stream::new()?),
        })
    }

    /// Words kernels write and the host reads (or the reverse) without a copy.
    pub(crate) fn records<T: Copy>(self, len: usize) -> Result<Pinned<T>> {
        match self {
            Gpu::Cuda(_) => Pinned::zeroed(len),
            Gpu::Host => Ok(Pinned::host(len)),
        }
    }

    /// A rank's window segment of at least `bytes`.
    pub(crate) fn segment(self, bytes: usize) -> Result<Segment> {
        Ok(match self {
            Gpu::Cuda(ordinal) => Segment::Cuda(Physical::create(ordinal, bytes)?),
            Gpu::Host => Segment::Host(host_device::Segment::create(bytes)?),
        })
    }

    /// A peer's segment received as a descriptor.
    pub(crate) fn import(self, fd: &OwnedFd, bytes: usize) -> Result<Segment> {
        Ok(match self {
            Gpu::Cuda(_) => Segment::Cuda(Physical::import(fd, bytes)?),
            Gpu::Host => Segment::Host(host_device::Segment::import(
                fd.try_clone().map_err(|e| Error::Backend {
                    backend: "host device".into(),
                    call: "dup".into(),
                    message: e.to_string(),
                })?,
                bytes,
            )?),
        })
    }

    /// The segments of this host's ranks side by side (None: a rank elsewhere).
    pub(crate) fn map(self, segments: Vec<Option<Segment>>) -> Result<Mapping> {
        Ok(match self {
            Gpu::Cuda(ordinal) => Mapping::Cuda(SymmetricMap::new(
                ordinal,
                segments
                    .into_iter()
                    .map(|s| s.map(|s| s.cuda()).transpose())
                    .collect::<Result<_>>()?,
            )?),
            Gpu::Host => Mapping::Host(host_device::SegmentMap::new(
                segments
                    .into_iter()
                    .map(|s| s.map(|s| s.host()).transpose())
                    .collect::<Result<_>>()?,
            )?),
        })
    }
}

/// A window segment.
#[derive(Clone)]
pub(crate) enum Segment {
    Cuda(Arc<Physical>),
    Host(Arc<host_device::Segment>),
}

impl Segment {
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Segment::Cuda(p) => p.bytes(),
            Segment::Host(s) => s.bytes(),
        }
    }

    /// A key naming the segment inside this process.
    pub(crate) fn key(&self) -> (bool, u64) {
        match self {
            Segment::Cuda(p) => (false, p.raw_handle()),
            Segment::Host(s) => (true, s.id()),
        }
    }

    pub(crate) fn export(&self) -> Result<OwnedFd> {
        match self {
            Segment::Cuda(p) => p.export(),
            Segment::Host(s) => s.export(),
        }
    }

    fn cuda(self) -> Result<Arc<Physical>> {
        match self {
            Segment::Cuda(p) => Ok(p),
            Segment::Host(_) => Err(Error::invalid("new_window", "a host-device segment on a GPU")),
        }
    }

    fn host(self) -> Result<Arc<host_device::Segment>> {
        match self {
            Segment::Host(s) => Ok(s),
            Segment::Cuda(_) => Err(Error::invalid("new_window", "a GPU segment on the host device")),
        }
    }

    /// The CUDA allocation (multicast binds it).
    pub(crate) fn physical(&self) -> Option<&Arc<Physical>> {
        match self {
            Segment::Cuda(p) => Some(p),
            Segment::Host(_) => None,
        }
    }
}

/// Every rank's segment of this host, mapped side by side.
pub(crate) enum Mapping {
    Cuda(SymmetricMap),
    Host(host_device::SegmentMap),
}

impl Mapping {
    pub(crate) fn base(&self) -> u64 {
        match self {
            Mapping::Cuda(m) => m.base(),
            Mapping::Host(m) => m.base(),
        }
    }

    pub(crate) fn stride(&self) -> usize {
        match self {
            Mapping::Cuda(m) => m.stride(),
            Mapping::Host(m) => m.stride(),
        }
    }

    pub(crate) fn is_mapped(&self, rank: usize) -> bool {
        match self {
            Mapping::Cuda(m) => m.is_mapped(rank),
            Mapping::Host(m) => m.is_mapped(rank),
        }
    }

    pub(crate) fn addr(&self, rank: usize, offset: usize) -> u64 {
        match self {
            Mapping::Cuda(m) => m.addr(rank, offset),
            Mapping::Host(m) => m.addr(rank, offset),
        }
    }
}

/// A stream of the device.
#[derive(Clone)]
pub(crate) enum Stream {
    Cuda(Arc<CudaStream>),
    Host(host_device::Stream),
}

impl Stream {
    pub(crate) fn queue(&self) -> Queue<'_> {
        match self {
            Stream::Cuda(s) => Queue::Cuda(s.cu_stream()),
            Stream::Host(s) => Queue::Host(s),
        }
    }

    /// The CUDA stream, for the public face of device windows.
    pub(crate) fn cuda(&self) -> Option<&Arc<CudaStream>> {
        match self {
            Stream::Cuda(s) => Some(s),
            Stream::Host(_) => None,
        }
    }

    /// Enqueues a copy of `bytes` from address `src` to `dst` (device addresses; host ones on
    /// the host device, and host memory on either side for CUDA's copies to and from it).
    ///
    /// # Safety
    /// Both ranges stay valid until the stream has passed the copy (the caller waits for it).
    pub(crate) unsafe fn copy(&self, dst: Place, src: Place, bytes: usize) -> Result<()> {
        match self {
            Stream::Cuda(s) => {
                let stream = s.cu_stream();
                // SAFETY: the caller's contract.
                cuda::check("cuMemcpyAsync", unsafe {
                    match (dst, src) {
                        (Place::Device(d), Place::Host(h)) => {
                            sys::cuMemcpyHtoDAsync_v2(d, h as *const std::ffi::c_void, bytes, stream)
                        }
                        (Place::Host(h), Place::Device(d)) => {
                            sys::cuMemcpyDtoHAsync_v2(h as *mut std::ffi::c_void, d, bytes, stream)
                        }
                        (Place::Device(d), Place::Device(s)) => sys::cuMemcpyDtoDAsync_v2(d, s, bytes, stream),
                        // Not a device copy: no caller has one to make.
                        (Place::Host(_), Place::Host(_)) => sys::CUresult::CUDA_ERROR_INVALID_VALUE,
                    }
                })
            }
            Stream::Host(s) => {
                let (d, from) = (dst.addr(), src.addr());
                s.enqueue(move || {
                    // SAFETY: the caller's contract; both are host addresses on the host device.
                    unsafe { std::ptr::copy(from as *const u8, d as *mut u8, bytes) };
                    Ok(())
                });
                Ok(())
            }
        }
    }

    /// Enqueues zeroing `bytes` at device address `addr`.
    ///
    /// # Safety
    /// The range stays valid until the stream has passed it.
    pub(crate) unsafe fn zero(&self, addr: u64, bytes: usize) -> Result<()> {
        match self {
            Stream::Cuda(s) => crate::gpu::memory::symmetric::memset_zero(addr, bytes, s.cu_stream()),
            Stream::Host(s) => {
                s.enqueue(move || {
                    // SAFETY: the caller's contract: the range stays valid until the stream
                    // has passed it; on the host device a device address is a host address.
                    unsafe { std::ptr::write_bytes(addr as *mut u8, 0, bytes) };
                    Ok(())
                });
                Ok(())
            }
        }
    }

    /// Blocks until everything enqueued has finished, or `limit` passes (`Error::Timeout`
    /// naming `op`).
    pub(crate) fn wait_idle(&self, op: &'static str, limit: Duration) -> Result<()> {
        match self {
            Stream::Cuda(s) => cuda::stream::wait_idle(s.cu_stream(), op, limit),
            Stream::Host(s) => s.wait_idle(op, limit),
        }
    }
}

/// One end of a copy.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Place {
    /// Host memory the device's copies may read or write.
    Host(usize),
    /// A device address (a host address on the host device).
    Device(u64),
}

impl Place {
    fn addr(self) -> u64 {
        match self {
            Place::Host(h) => h as u64,
            Place::Device(d) => d,
        }
    }
}
