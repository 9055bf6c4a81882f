//! Buffers as operations carry them: [`Buf`] and [`BufMut`], typed views of host or device
//! memory that borrow the caller's bytes, and the cutting of a buffer into per-rank parts.

use crate::contracts::dtype::{as_bytes, as_bytes_mut, DType, Element};
use crate::contracts::error::{Error, Result};

/// Where a buffer's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Ordinary host memory (also the memory of the host device, `Device::Host`).
    Host,
    /// Memory of CUDA device `ordinal` (a device pointer; ranks in one process may share it).
    Cuda(usize),
}

/// Bytes in device memory: a device pointer, never dereferenced on the host.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBytes {
    /// The CUDA device the memory belongs to.
    pub ordinal: usize,
    /// The device address of the first byte (a `CUdeviceptr`).
    pub ptr: u64,
    /// Length, bytes.
    pub len: usize,
}

impl DeviceBytes {
    fn split_at(self, at: usize) -> (DeviceBytes, DeviceBytes) {
        let head = DeviceBytes { len: at, ..self };
        let tail = DeviceBytes {
            ptr: self.ptr + at as u64,
            len: self.len - at,
            ..self
        };
        (head, tail)
    }
}

#[derive(Debug)]
enum Bytes<'a> {
    Host(&'a [u8]),
    Device(DeviceBytes),
}

#[derive(Debug)]
enum BytesMut<'a> {
    Host(&'a mut [u8]),
    Device(DeviceBytes),
}

/// A read-only buffer of one element type, in host or device memory.
#[derive(Debug)]
pub struct Buf<'a> {
    bytes: Bytes<'a>,
    dtype: DType,
}

/// A writable buffer of one element type, in host or device memory.
#[derive(Debug)]
pub struct BufMut<'a> {
    bytes: BytesMut<'a>,
    dtype: DType,
}

const DEVICE_ON_HOST: &str = "host_bytes called on a device buffer; backends check Op::location first";

impl<'a> Buf<'a> {
    /// Views a host slice; its element type becomes the buffer's [`DType`].
    pub fn new<T: Element>(s: &'a [T]) -> Self {
        Buf {
            bytes: Bytes::Host(as_bytes(s)),
            dtype: T::DTYPE,
        }
    }
    pub(crate) fn from_host_bytes(bytes: &'a [u8], dtype: DType) -> Self {
        Buf {
            bytes: Bytes::Host(bytes),
            dtype,
        }
    }
    /// A buffer in device memory (see `device::DeviceSlice` for the safe way in).
    pub(crate) fn device(bytes: DeviceBytes, dtype: DType) -> Self {
        Buf {
            bytes: Bytes::Device(bytes),
            dtype,
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Length in bytes.
    pub fn byte_len(&self) -> usize {
        match &self.bytes {
            Bytes::Host(b) => b.len(),
            Bytes::Device(d) => d.len,
        }
    }
    /// Length in elements of [`dtype`](Self::dtype).
    pub fn count(&self) -> usize {
        self.byte_len() / self.dtype.size()
    }
    /// Whether the bytes are in host or device memory (and on which device).
    pub fn location(&self) -> Location {
        match &self.bytes {
            Bytes::Host(_) => Location::Host,
            Bytes::Device(d) => Location::Cuda(d.ordinal),
        }
    }
    /// The device pointer, for a buffer in device memory.
    pub fn device_bytes(&self) -> Option<DeviceBytes> {
        match &self.bytes {
            Bytes::Host(_) => None,
            Bytes::Device(d) => Some(*d),
        }
    }
    /// The host bytes of the buffer.
    ///
    /// # Panics
    /// If the buffer is in device memory: a backend checks [`Op::location`](crate::Op::location) before it reads.
    pub fn host_bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Host(b) => b,
            Bytes::Device(_) => panic!("{DEVICE_ON_HOST}"),
        }
    }
    /// Consecutive parts of `counts` elements, which must cover the buffer exactly.
    pub(crate) fn split(self, op: &'static str, counts: &[usize]) -> Result<Vec<Buf<'a>>> {
        check_total(op, self.count(), counts)?;
        Ok(self.parts(counts.iter().copied()))
    }
    /// `n` equal consecutive parts; an error if the buffer does not divide into them.
    pub(crate) fn split_equal(self, op: &'static str, n: usize) -> Result<Vec<Buf<'a>>> {
        let each = equal_part(op, self.count(), n)?;
        Ok(self.parts((0..n).map(|_| each)))
    }
    fn parts(self, counts: impl ExactSizeIterator<Item = usize>) -> Vec<Buf<'a>> {
        let (dtype, size) = (self.dtype, self.dtype.size());
        let mut parts = Vec::with_capacity(counts.len());
        match self.bytes {
            Bytes::Host(mut rest) => {
                for c in counts {
                    let (a, b) = rest.split_at(c * size);
                    rest = b;
                    parts.push(Buf {
                        bytes: Bytes::Host(a),
                        dtype,
                    });
                }
            }
            Bytes::Device(mut rest) => {
                for c in counts {
                    let (a, b) = rest.split_at(c * size);
                    rest = b;
                    parts.push(Buf::device(a, dtype));
                }
            }
        }
        parts
    }
}

impl<'a> BufMut<'a> {
    /// Views a mutable host slice; its element type becomes the buffer's [`DType`].
    pub fn new<T: Element>(s: &'a mut [T]) -> Self {
        BufMut {
            bytes: BytesMut::Host(as_bytes_mut(s)),
            dtype: T::DTYPE,
        }
    }
    pub(crate) fn from_host_bytes(bytes: &'a mut [u8], dtype: DType) -> Self {
        BufMut {
            bytes: BytesMut::Host(bytes),
            dtype,
        }
    }
    pub(crate) fn device(bytes: DeviceBytes, dtype: DType) -> Self {
        BufMut {
            bytes: BytesMut::Device(bytes),
            dtype,
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Length in bytes.
    pub fn byte_len(&self) -> usize {
        match &self.bytes {
            BytesMut::Host(b) => b.len(),
            BytesMut::Device(d) => d.len,
        }
    }
    /// Length in elements of [`dtype`](Self::dtype).
    pub fn count(&self) -> usize {
        self.byte_len() / self.dtype.size()
    }
    /// Whether the bytes are in host or device memory (and on which device).
    pub fn location(&self) -> Location {
        match &self.bytes {
            BytesMut::Host(_) => Location::Host,
            BytesMut::Device(d) => Location::Cuda(d.ordinal),
        }
    }
    /// The device pointer, for a buffer in device memory.
    pub fn device_bytes(&self) -> Option<DeviceBytes> {
        match &self.bytes {
            BytesMut::Host(_) => None,
            BytesMut::Device(d) => Some(*d),
        }
    }
    /// The host bytes of the buffer.
    ///
    /// # Panics
    /// If the buffer is in device memory (see [`Buf::host_bytes`]).
    pub fn host_bytes(&self) -> &[u8] {
        match &self.bytes {
            BytesMut::Host(b) => b,
            BytesMut::Device(_) => panic!("{DEVICE_ON_HOST}"),
        }
    }
    /// The host bytes of the buffer, for writing.
    ///
    /// # Panics
    /// If the buffer is in device memory (see [`Buf::host_bytes`]).
    pub fn host_bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.bytes {
            BytesMut::Host(b) => b,
            BytesMut::Device(_) => panic!("{DEVICE_ON_HOST}"),
        }
    }
    /// A read-only view of the same bytes (an in-place operation's input).
    pub fn as_buf(&self) -> Buf<'_> {
        let bytes = match &self.bytes {
            BytesMut::Host(b) => Bytes::Host(b),
            BytesMut::Device(d) => Bytes::Device(*d),
        };
        Buf {
            bytes,
            dtype: self.dtype,
        }
    }
    /// Consecutive parts of `counts` elements, which must cover the buffer exactly.
    pub(crate) fn split(self, op: &'static str, counts: &[usize]) -> Result<Vec<BufMut<'a>>> {
        check_total(op, self.count(), counts)?;
        Ok(self.parts(counts.iter().copied()))
    }
    /// `n` equal consecutive parts; an error if the buffer does not divide into them.
    pub(crate) fn split_equal(self, op: &'static str, n: usize) -> Result<Vec<BufMut<'a>>> {
        let each = equal_part(op, self.count(), n)?;
        Ok(self.parts((0..n).map(|_| each)))
    }
    fn parts(self, counts: impl ExactSizeIterator<Item = usize>) -> Vec<BufMut<'a>> {
        let (dtype, size) = (self.dtype, self.dtype.size());
        let mut parts = Vec::with_capacity(counts.len());
        match self.bytes {
            BytesMut::Host(mut rest) => {
                for c in counts {
                    let (a, b) = std::mem::take(&mut rest).split_at_mut(c * size);
                    rest = b;
                    parts.push(BufMut {
                        bytes: BytesMut::Host(a),
                        dtype,
                    });
                }
            }
            BytesMut::Device(mut rest) => {
                for c in counts {
                    let (a, b) = rest.split_at(c * size);
                    rest = b;
                    parts.push(BufMut::device(a, dtype));
                }
            }
        }
        parts
    }
}

fn check_total(op: &'static str, len: usize, counts: &[usize]) -> Result<()> {
    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
    if total != Some(len) {
        return Err(Error::SizeMismatch {
            op,
            what: format!("buffer (split by counts {counts:?})"),
            expected: total.unwrap_or(usize::MAX),
            actual: len,
        });
    }
    Ok(())
}

/// The elements of each of `size` equal parts of `len` elements; an error if `len` does not
/// divide.
fn equal_part(op: &'static str, len: usize, size: usize) -> Result<usize> {
    if len % size != 0 {
        return Err(Error::SizeMismatch {
            op,
            what: format!("buffer split into {size} equal parts"),
            expected: len.div_ceil(size) * size,
            actual: len,
        });
    }
    Ok(len / size)
}
