//! Host and device bytes for the GPU tests: views of host vectors as bytes and back, typed
//! views of device allocations, and one fused norm call on device buffers.

use super::inference_suite::{norm_inputs, Act, NormResult};
use ferrocomm::device::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use ferrocomm::device::{DeviceSlice, DeviceSliceMut};
use ferrocomm::{Collectives, Comm, Element, OpOptions, F8E4M3};
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

/// One fused norm call of `c` on device copies of the suite's inputs (`rows` = (tokens,
/// hidden)) with `hints`, outputs poisoned first; the results downloaded.
pub fn norm_on_gpu<T: Act>(
    c: &Comm,
    s: &Arc<CudaStream>,
    seed: u64,
    rows: (usize, usize),
    hints: &[(&str, &str)],
    fp8: bool,
) -> NormResult<T> {
    let (tokens, hidden) = rows;
    let (x, residual, gamma) = norm_inputs::<T>(seed, c.rank(), tokens, hidden);
    let (dx, mut dres, dgamma) = (
        s.clone_htod(bytes_of(&x)).unwrap(),
        s.clone_htod(bytes_of(&residual)).unwrap(),
        s.clone_htod(bytes_of(&gamma)).unwrap(),
    );
    let o = c.with_options(hints.iter().fold(OpOptions::new(), |o, &(k, v)| o.hint(k, v)));
    let got = if fp8 {
        let mut out = s.clone_htod(&vec![0x7Fu8; tokens * hidden]).unwrap();
        let mut scales = s.clone_htod(bytes_of(&vec![f32::NAN; tokens])).unwrap();
        o.all_reduce_residual_rmsnorm_fp8(
            input::<T>(&dx, s),
            view::<T>(&mut dres, s),
            input::<T>(&dgamma, s),
            view::<F8E4M3>(&mut out, s),
            view::<f32>(&mut scales, s),
            1e-5,
        )
        .unwrap();
        (s.clone_dtoh(&out).unwrap(), from_bytes(&s.clone_dtoh(&scales).unwrap()))
    } else {
        let mut out = s.clone_htod(&vec![0xEEu8; tokens * hidden * T::DTYPE.size()]).unwrap();
        o.all_reduce_residual_rmsnorm(
            input::<T>(&dx, s),
            view::<T>(&mut dres, s),
            input::<T>(&dgamma, s),
            view::<T>(&mut out, s),
            1e-5,
        )
        .unwrap();
        (s.clone_dtoh(&out).unwrap(), Vec::new())
    };
    s.synchronize().unwrap();
    (from_bytes(&s.clone_dtoh(&dres).unwrap()), got.0, got.1)
}
