//! What the collective calls accept as buffers: host slices (and vectors and arrays) or views of
//! device memory, borrowed; and owned buffers, which owned asynchronous calls take by value.
//! Each converts into the untyped [`Buf`] / [`BufMut`] of an `Op`.

use crate::contracts::dtype::Element;
use crate::contracts::error::Result;
use crate::contracts::ops::{Buf, BufMut};
use crate::device::{DeviceSlice, DeviceSliceMut};
use std::marker::PhantomData;

/// A buffer a collective reads: `&[T]`, `&Vec<T>`, `&[T; N]`, or a view of device memory
/// ([`DeviceSlice`], [`DeviceSliceMut`]).
pub trait InputBuffer<'a> {
    /// The element type; a call's input and output buffers must have the same one.
    type Elem: Element;
    /// The untyped, borrowed buffer an [`Op`](crate::Op) carries.
    fn into_buf(self) -> Buf<'a>;
}

/// A buffer a collective writes (or reads and writes, for in-place operations): `&mut [T]`,
/// `&mut Vec<T>`, `&mut [T; N]`, or a [`DeviceSliceMut`].
pub trait OutputBuffer<'a> {
    /// The element type; a call's input and output buffers must have the same one.
    type Elem: Element;
    /// The untyped, borrowed buffer an [`Op`](crate::Op) carries.
    fn into_buf_mut(self) -> BufMut<'a>;
}

impl<'a, T: Element> InputBuffer<'a> for &'a [T] {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        Buf::new(self)
    }
}

impl<'a, T: Element> InputBuffer<'a> for &'a Vec<T> {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        Buf::new(self)
    }
}

impl<'a, T: Element, const N: usize> InputBuffer<'a> for &'a [T; N] {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        Buf::new(self)
    }
}

impl<'a, T: Element> InputBuffer<'a> for DeviceSlice<'a, T> {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        Buf::device(self.bytes(), T::DTYPE)
    }
}

/// A writable view reads as well.
impl<'a, T: Element> InputBuffer<'a> for DeviceSliceMut<'a, T> {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        Buf::device(self.bytes(), T::DTYPE)
    }
}

impl<'a, T: Element> OutputBuffer<'a> for &'a mut [T] {
    type Elem = T;
    fn into_buf_mut(self) -> BufMut<'a> {
        BufMut::new(self)
    }
}

impl<'a, T: Element> OutputBuffer<'a> for &'a mut Vec<T> {
    type Elem = T;
    fn into_buf_mut(self) -> BufMut<'a> {
        BufMut::new(self)
    }
}

impl<'a, T: Element, const N: usize> OutputBuffer<'a> for &'a mut [T; N] {
    type Elem = T;
    fn into_buf_mut(self) -> BufMut<'a> {
        BufMut::new(self)
    }
}

impl<'a, T: Element> OutputBuffer<'a> for DeviceSliceMut<'a, T> {
    type Elem = T;
    fn into_buf_mut(self) -> BufMut<'a> {
        BufMut::device(self.bytes(), T::DTYPE)
    }
}

/// A buffer an owned asynchronous call ([`Comm::owned`](crate::Comm::owned)) takes by value
/// and hands back when its [`Work`](crate::Work) is waited for: `Vec<T>`, `Box<[T]>`, or a
/// cudarc `CudaSlice<T>` (device memory). Implement it for your own tensor type by viewing
/// its memory as a [`Buf`] / [`BufMut`] (the views must cover memory the value owns).
pub trait OwnedBuffer: Send + 'static {
    /// The element type; a call's input and output buffers must have the same one.
    type Elem: Element;
    /// The buffer as an operation's input.
    fn input(&self) -> Result<Buf<'_>>;
    /// The buffer as an operation's output (or in-place buffer).
    fn output(&mut self) -> Result<BufMut<'_>>;
    /// For device memory, the raw `CUstream` that frees or next uses the buffer (besides the
    /// waiter's current stream): [`Work::wait`](crate::Work::wait) orders it after the
    /// operation. `None` (the default) for host memory.
    fn device_stream(&self) -> Option<u64> {
        None
    }
}

impl<T: Element> OwnedBuffer for Vec<T> {
    type Elem = T;
    fn input(&self) -> Result<Buf<'_>> {
        Ok(Buf::new(self))
    }
    fn output(&mut self) -> Result<BufMut<'_>> {
        Ok(BufMut::new(self))
    }
}

impl<T: Element> OwnedBuffer for Box<[T]> {
    type Elem = T;
    fn input(&self) -> Result<Buf<'_>> {
        Ok(Buf::new(self))
    }
    fn output(&mut self) -> Result<BufMut<'_>> {
        Ok(BufMut::new(self))
    }
}

/// Device memory: the operation is enqueued on the issuing thread's current stream, like a
/// synchronous call on a [`DeviceSliceMut`].
impl<T: Element> OwnedBuffer for cudarc::driver::CudaSlice<T> {
    type Elem = T;
    fn input(&self) -> Result<Buf<'_>> {
        DeviceSlice::new(self).map(InputBuffer::into_buf)
    }
    fn output(&mut self) -> Result<BufMut<'_>> {
        DeviceSliceMut::new(self).map(OutputBuffer::into_buf_mut)
    }
    /// The allocation's own stream: cudarc frees it there.
    fn device_stream(&self) -> Option<u64> {
        Some(self.stream().cu_stream() as u64)
    }
}

/// An owned buffer's view, typed again for the borrowed calls of [`Collectives`](crate::Collectives).
pub(crate) struct Typed<B, T>(B, PhantomData<T>);

impl<B, T> Typed<B, T> {
    pub(crate) fn new(b: B) -> Self {
        Typed(b, PhantomData)
    }
}

impl<'a, T: Element> InputBuffer<'a> for Typed<Buf<'a>, T> {
    type Elem = T;
    fn into_buf(self) -> Buf<'a> {
        self.0
    }
}

impl<'a, T: Element> OutputBuffer<'a> for Typed<BufMut<'a>, T> {
    type Elem = T;
    fn into_buf_mut(self) -> BufMut<'a> {
        self.0
    }
}

/// `buf` as a typed input of a borrowed call.
pub(crate) fn owned_in<B: OwnedBuffer>(buf: &B) -> Result<Typed<Buf<'_>, B::Elem>> {
    buf.input().map(Typed::new)
}

/// `buf` as a typed output of a borrowed call.
pub(crate) fn owned_out<B: OwnedBuffer>(buf: &mut B) -> Result<Typed<BufMut<'_>, B::Elem>> {
    buf.output().map(Typed::new)
}
