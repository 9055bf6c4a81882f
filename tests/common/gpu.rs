//! Host and device bytes for the GPU tests: views of host vectors as bytes and back, and
//! typed views of device allocations.

use ferrocomm::device::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ferrocomm::device::{DeviceSlice, DeviceSliceMut};
use ferrocomm::Element;
use std::sync::Arc;

pub fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: ferrocomm's element types are plain numbers.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn from_bytes<T: Element + Default + Clone>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::default(); b.len() / std::mem::size_of::<T>()];
    // SAFETY: `v` has exactly `b.len()` bytes.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr().cast(), b.len()) };
    v
}

pub fn view<T: Element>(mem: &mut CudaSlice<u8>, s: &Arc<CudaStream>) -> DeviceSliceMut<'static, T> {
    let n = mem.len() / std::mem::size_of::<T>();
    let (ptr, _sync) = mem.device_ptr(s);
    // SAFETY: `mem` holds n elements of T on GPU 0 and outlives every call that uses the view
    // (each test keeps it until after the stream is synchronised).
    unsafe { DeviceSliceMut::from_raw(0, ptr, n) }.unwrap()
}

/// A read-only view of `mem` as elements of `T` (see `view`).
pub fn input<T: Element>(mem: &CudaSlice<u8>, s: &Arc<CudaStream>) -> DeviceSlice<'static, T> {
    let n = mem.len() / std::mem::size_of::<T>();
    let (ptr, _sync) = mem.device_ptr(s);
    // SAFETY: as in `view`.
    unsafe { DeviceSlice::from_raw(0, ptr, n) }.unwrap()
}
