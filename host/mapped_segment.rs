//! A rank's window segment borrowed in place, where it is mapped into this process: what
//! [`TypedWindow::map_remote`](crate::TypedWindow::map_remote) returns (torchcomms'
//! `map_remote_tensor`) for windows in host memory.
//!
//! Why a view and not a `&[T]`: the segment is written by other ranks (puts, atomics, kernels,
//! proxy threads) whenever the program lets them, and a `&[T]` promises Rust that nothing
//! mutates the memory while it lives; the compiler may act on that promise (keep an element in
//! a register across a wait, merge or hoist reads), so a slice held while a peer writes is
//! undefined behaviour, not just stale data. The library cannot prove from one rank that the
//! others are quiet. So the safe accessors copy through raw pointers, like `Window::get` on a
//! mapped peer, and the zero-copy `&[T]` ([`MappedSegment::as_slice`]) is `unsafe`, with the
//! synchronisation that makes it sound written as its contract.

use crate::contracts::dtype::Element;
use crate::contracts::error::{Error, Result};
use std::marker::PhantomData;
use std::ptr::NonNull;

/// `len` elements of `T`: rank [`rank`](Self::rank)'s segment of a typed window, mapped into
/// this process (a rank of this host, or this rank itself), borrowed from the window for `'w`.
/// The mapping stays valid while the window lives, even if the owner drops its window first
/// (this rank's window keeps its mapping).
///
/// Reads see what the ordering contract (docs/memory-model.md) makes visible: after a
/// `barrier`, or after a `wait_signal` that acquired the signal the writer released after its
/// puts, every element put before it; elements written concurrently may be old or new. Reads
/// are copies ([`read`](Self::read), [`to_vec`](Self::to_vec)); [`as_slice`](Self::as_slice)
/// borrows the elements in place under a contract that no rank writes them meanwhile.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 2], "mapped", CommOptions::from_env()?)?;
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms
///         .iter()
///         .map(|c| {
///             s.spawn(move || -> ferrocomm::Result<()> {
///                 let w = c.new_typed_window::<u32>(4)?;
///                 w.write_local(0, &[c.rank() as u32 * 10; 4])?;
///                 w.barrier()?; // the writes above are visible to every rank after it
///                 let peer = w.map_remote(1 - c.rank())?;
///                 assert_eq!(peer.to_vec(), [(1 - c.rank()) as u32 * 10; 4]);
///                 // SAFETY: nobody writes the window until the barrier below, which comes
///                 // after the last use of `seen`.
///                 let seen = unsafe { peer.as_slice() };
///                 assert_eq!(seen.iter().sum::<u32>(), 4 * (1 - c.rank()) as u32 * 10);
///                 w.barrier()
///             })
///         })
///         .collect();
///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
/// })?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
#[derive(Clone, Copy)]
pub struct MappedSegment<'w, T: Element> {
    ptr: NonNull<T>,
    len: usize,
    rank: usize,
    _window: PhantomData<&'w [T]>,
}

// SAFETY: the view only reads the segment, through raw copies (the window's own access rule for
// shared memory, as `Window` does from any thread) or through `as_slice`, whose caller promises
// that no one writes it meanwhile; `T: Element` is plain data that is Send and Sync.
unsafe impl<T: Element> Send for MappedSegment<'_, T> {}
// SAFETY: as for Send: `&MappedSegment` gives no access beyond copies and the unsafe borrow.
unsafe impl<T: Element> Sync for MappedSegment<'_, T> {}

impl<'w, T: Element> MappedSegment<'w, T> {
    /// # Safety
    /// `ptr` is aligned for `T` and points at `len` elements of `rank`'s segment, mapped into
    /// this process and readable for `'w`.
    pub(crate) unsafe fn new(rank: usize, ptr: NonNull<T>, len: usize) -> Self {
        MappedSegment {
            ptr,
            len,
            rank,
            _window: PhantomData,
        }
    }

    /// The rank whose segment this is.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Elements of the segment (the typed window's [`len`](crate::TypedWindow::len)).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segment has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first element, in this process's address space. Valid for reads of `len()`
    /// elements while the window lives; peers may write the elements at any time (see the
    /// type's documentation).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// Copies elements `offset..offset + dst.len()` into `dst`. `Error::ElementsOutOfBounds`
    /// outside the segment.
    pub fn read(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        match offset.checked_add(dst.len()) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(Error::ElementsOutOfBounds {
                    op: "mapped read",
                    rank: self.rank,
                    offset,
                    len: dst.len(),
                    elements: self.len,
                    dtype: T::DTYPE.name(),
                })
            }
        }
        // SAFETY: in bounds (checked above) of memory readable for 'w (`new`'s contract), and
        // `dst` is ours alone. A copy through raw pointers, because peers may write the
        // segment concurrently (the bytes are then old or new, as for `Window::get`).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// A copy of the whole segment.
    pub fn to_vec(&self) -> Vec<T> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: as in `read`, for all `len` elements; `v` has room for them and every bit
        // pattern is a valid `T` (Element; `bool`, the one exception, is never mapped: see
        // `TypedWindow::map_remote`), so `set_len` exposes initialised elements.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.as_mut_ptr(), self.len);
            v.set_len(self.len);
        }
        v
    }

    /// The segment as a slice, without a copy.
    ///
    /// # Safety
    ///
    /// While the returned slice (or anything derived from it) lives, no rank writes these
    /// elements: no `put`, `write_local`, atomic or kernel store of any rank, and no proxy
    /// thread applying one. The window's synchronisation is how a program knows: borrow after
    /// a `barrier` (or a `wait_signal` that acquired every writer's release) and drop the
    /// slice before the point that lets writers go on (the next `barrier`, or the signal that
    /// hands the buffer back). Writes to *other* elements of the segment may go on.
    ///
    /// Breaking this is a data race (undefined behaviour), not only stale data: Rust assumes
    /// memory behind a shared reference does not change.
    pub unsafe fn as_slice(&self) -> &[T] {
        // SAFETY: `new`'s contract gives an aligned, readable range of `len` elements that
        // lives for 'w (longer than `&self`); the caller promises no one mutates it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> std::fmt::Debug for MappedSegment<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedSegment")
            .field("rank", &self.rank)
            .field("len", &self.len)
            .field("dtype", &T::DTYPE)
            .field("ptr", &self.ptr)
            .finish()
    }
}
