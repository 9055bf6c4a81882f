//! What the collective calls accept as buffers: host slices (and vectors and arrays) or views of
//! device memory. Each converts into the untyped [`Buf`] / [`BufMut`] of an `Op`.

use crate::contracts::dtype::Element;
use crate::contracts::ops::{Buf, BufMut};
use crate::device::{DeviceSlice, DeviceSliceMut};

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
