//! Buffers that start on a page, as the peers' benchmark's do.
//!
//! mpi_bench takes its two buffers from one `malloc` each of the largest size, which glibc
//! maps afresh, so every buffer it hands a library starts at the same offset in a page, and
//! the bytes it copies lie at the same offset in source and destination. A vector per row
//! comes from the heap at any 16-byte offset instead. A copy whose source and destination
//! differ in their offset within a cache line is slower (the kernel's copy for a message
//! by reference: 5–12% at 256 KiB on the 2-core guest, docs/results/cpu.md part 23), so
//! buffers at chance offsets would time ferrocomm on a layout its peers are never given.

use std::ops::{Deref, DerefMut};

const PAGE: usize = 4096;

/// `len` elements starting on a page boundary, zeroed (`T::default()`).
pub struct PageBuf<T> {
    vec: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Default + Clone> PageBuf<T> {
    pub fn new(len: usize) -> PageBuf<T> {
        let size = std::mem::size_of::<T>().max(1);
        // A page's worth of elements more than asked for holds a page boundary before `len`
        // elements. The vector starts on an element, and the bench's element sizes divide the
        // page, so the boundary is an element's start.
        let vec = vec![T::default(); len + PAGE / size];
        let start = (PAGE - vec.as_ptr() as usize % PAGE) % PAGE / size;
        PageBuf { vec, start, len }
    }
}

impl<T> Deref for PageBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.vec[self.start..self.start + self.len]
    }
}

impl<T> DerefMut for PageBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_page_and_hold_what_was_asked() {
        for len in [1usize, 3, 1000, 65536] {
            let mut a = PageBuf::<f32>::new(len);
            let b = PageBuf::<u8>::new(len);
            let c = PageBuf::<u64>::new(len);
            assert_eq!(a.as_ptr() as usize % PAGE, 0);
            assert_eq!(b.as_ptr() as usize % PAGE, 0);
            assert_eq!(c.as_ptr() as usize % PAGE, 0);
            assert_eq!((a.len(), b.len(), c.len()), (len, len, len));
            assert!(a.iter().all(|&x| x == 0.0));
            a[len - 1] = 2.0;
            assert_eq!(a[len - 1], 2.0);
        }
    }
}
