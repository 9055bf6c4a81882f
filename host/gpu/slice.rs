//! Borrowed views of device memory that collectives accept in place of host slices.
//!
//! A view only carries a device pointer, a length and the GPU it lives on; the borrow keeps the
//! allocation alive while the call that takes it is issued. Work is stream ordered: an
//! operation issued on a stream may still read or write the memory after the call returns, as
//! with `cuMemcpyAsync`, so the allocation must not be freed before that stream has passed it
//! (cudarc's stream-ordered frees do this by themselves).

use crate::contracts::dtype::Element;
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::DeviceBytes;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;

/// Read-only device memory of `len` elements of `T`.
///
/// Collectives take it wherever they take `&[T]`; [`DeviceSliceMut`] goes where they take
/// `&mut [T]`. All buffers of one call must be on the communicator's GPU
/// (`Error::InvalidArgument` otherwise). A synchronous call on device buffers is enqueued on
/// the thread's current stream ([`use_stream`](crate::device::use_stream); the legacy default
/// stream otherwise) and returns before the GPU has run it, like a kernel launch.
///
/// ```no_run
/// // no_run: needs a CUDA GPU.
/// use ferrocomm::device::{self, DeviceSlice, DeviceSliceMut};
/// use ferrocomm::prelude::*;
///
/// type AnyError = Box<dyn std::error::Error + Send + Sync>;
///
/// // Two ranks on GPU 0, one thread each, each with a stream of its own.
/// let comms = Comm::new_group("device", &[Device::Cuda(0); 2], "gpu", CommOptions::from_env()?)?;
/// let rank_main = |c: &Comm| -> Result<(), AnyError> {
///     let stream = device::new_stream(0)?;
///     let _current = device::use_stream(&stream);
///     let r = c.rank() as f32;
///
///     // all_reduce in place on a cudarc allocation, enqueued on `stream`.
///     let mut grads = stream.clone_htod(&[r + 1.0; 1024])?;
///     c.all_reduce(DeviceSliceMut::new(&mut grads)?, ReduceOp::Sum)?;
///
///     // all_gather from a read-only view into a writable one.
///     let mine = stream.clone_htod(&[r; 4])?;
///     let mut all = stream.alloc_zeros::<f32>(4 * c.size())?;
///     c.all_gather(DeviceSliceMut::new(&mut all)?, DeviceSlice::new(&mine)?)?;
///
///     // Copies on the same stream come after the collectives.
///     let (grads, all) = (stream.clone_dtoh(&grads)?, stream.clone_dtoh(&all)?);
///     stream.synchronize()?;
///     assert!(grads.iter().all(|&v| v == 3.0));
///     assert_eq!(all, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
///     Ok(())
/// };
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
/// })?;
/// # Ok::<(), AnyError>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a, T> {
    bytes: DeviceBytes,
    _borrow: PhantomData<&'a [T]>,
}

/// Writable device memory of `len` elements of `T`: the output (or in-place) buffer of a
/// collective on device memory. See [`DeviceSlice`] for an example.
#[derive(Debug)]
pub struct DeviceSliceMut<'a, T> {
    bytes: DeviceBytes,
    _borrow: PhantomData<&'a mut [T]>,
}

fn raw<T: Element>(ordinal: usize, ptr: u64, len: usize) -> Result<DeviceBytes> {
    let align = std::mem::align_of::<T>() as u64;
    if ptr == 0 || ptr % align != 0 {
        return Err(Error::invalid(
            "device slice",
            format!("pointer {ptr:#x} is null or not aligned to {align} bytes"),
        ));
    }
    let len = len
        .checked_mul(std::mem::size_of::<T>())
        .ok_or_else(|| Error::invalid("device slice", format!("{len} elements overflow")))?;
    Ok(DeviceBytes { ordinal, ptr, len })
}

impl<'a, T: Element> DeviceSlice<'a, T> {
    /// Views a cudarc allocation. Reads are ordered after the allocation's earlier writes on
    /// its own stream (cudarc's event tracking).
    pub fn new(slice: &'a CudaSlice<T>) -> Result<Self> {
        let (ptr, _sync) = slice.device_ptr(slice.stream());
        Self::checked(slice.context().ordinal(), ptr, slice.len())
    }

    /// Views `len` elements at device address `ptr` on GPU `ordinal`.
    ///
    /// # Safety
    /// The range must be device memory of that GPU, readable for `'a`.
    pub unsafe fn from_raw(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
        Self::checked(ordinal, ptr, len)
    }
}

impl<'a, T: Element> DeviceSliceMut<'a, T> {
    /// Views a cudarc allocation for writing (ordered after its earlier reads and writes).
    pub fn new(slice: &'a mut CudaSlice<T>) -> Result<Self> {
        let (ordinal, len) = (slice.context().ordinal(), slice.len());
        let stream = slice.stream().clone();
        let (ptr, _sync) = slice.device_ptr_mut(&stream);
        Self::checked(ordinal, ptr, len)
    }

    /// Views `len` elements at device address `ptr` on GPU `ordinal` for writing.
    ///
    /// # Safety
    /// The range must be device memory of that GPU, writable and not otherwise accessed for `'a`.
    pub unsafe fn from_raw(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
        Self::checked(ordinal, ptr, len)
    }
}

/// What both views share: construction from checked raw parts and the accessors.
macro_rules! common {
    ($view:ident) => {
        impl<'a, T: Element> $view<'a, T> {
            fn checked(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
                Ok($view {
                    bytes: raw::<T>(ordinal, ptr, len)?,
                    _borrow: PhantomData,
                })
            }
            /// Elements.
            pub fn len(&self) -> usize {
                self.bytes.len / std::mem::size_of::<T>()
            }
            /// Whether the view has no elements.
            pub fn is_empty(&self) -> bool {
                self.bytes.len == 0
            }
            /// The GPU the memory is on.
            pub fn ordinal(&self) -> usize {
                self.bytes.ordinal
            }
            /// The device address of the first element (a `CUdeviceptr`).
            pub fn device_ptr(&self) -> u64 {
                self.bytes.ptr
            }
            pub(crate) fn bytes(&self) -> DeviceBytes {
                self.bytes
            }
        }
    };
}
common!(DeviceSlice);
common!(DeviceSliceMut);
