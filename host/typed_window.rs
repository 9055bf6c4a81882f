//! Typed windows: a [`Window`] seen as `len` elements of `T` on every rank, with offsets and
//! lengths in elements, atomics on `u64`/`i64` elements, and a rank's segment borrowed in place
//! where it is mapped into this process (torchcomms' `map_remote_tensor`). Size and alignment
//! are checked once, when the view is made; every call then checks its rank and element range
//! and hands the byte window a byte offset, so the byte window's contract
//! (docs/memory-model.md) is the typed window's too.

use crate::comm::Comm;
use crate::contracts::dtype::{DType, Element};
use crate::contracts::error::{Error, Result};
use crate::contracts::window::{Cmp, Observed, SignalOp, SignalSource, WindowOptions};
use crate::gpu::slice::DeviceSlice;
use crate::mapped_segment::MappedSegment;
use crate::window::Window;
use crate::work::{Scope, ScopedWork};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::time::Duration;

mod sealed {
    /// The u64 word a window atomic works on, and back.
    pub trait Sealed: Copy {
        fn to_word(self) -> u64;
        fn from_word(word: u64) -> Self;
    }
    impl Sealed for u64 {
        fn to_word(self) -> u64 {
            self
        }
        fn from_word(word: u64) -> Self {
            word
        }
    }
    impl Sealed for i64 {
        // Two's complement: a wrapping u64 add of the bits is the wrapping i64 add, and equal
        // bits are equal values, so fetch_add and compare_swap go through the u64 atomics.
        fn to_word(self) -> u64 {
            self as u64
        }
        fn from_word(word: u64) -> Self {
            word as i64
        }
    }
}

/// An element type with window atomics: `u64` and `i64` (8 bytes, the word of
/// [`Window::fetch_add`] and [`Window::compare_swap`]). Sealed. `i64` goes through the u64
/// atomics in two's complement, so its `fetch_add` wraps on overflow like `i64::wrapping_add`.
pub trait AtomicElement: Element + sealed::Sealed {}
impl AtomicElement for u64 {}
impl AtomicElement for i64 {}

/// The byte window a typed view reads through: its own, or one borrowed.
enum Held<'w> {
    Owned(Window<'w>),
    Borrowed(&'w Window<'w>),
}

impl<'w> std::ops::Deref for Held<'w> {
    type Target = Window<'w>;
    fn deref(&self) -> &Window<'w> {
        match self {
            Held::Owned(w) => w,
            Held::Borrowed(w) => w,
        }
    }
}

/// A window of `len` elements of `T` per rank: [`Window`]'s verbs with offsets and lengths in
/// elements. Made collectively by [`Comm::new_typed_window`], or as a view of a byte window
/// ([`Window::typed`], [`Window::typed_at`], [`Window::into_typed`]).
///
/// - The window's size and every segment's alignment for `T` are checked once, when the view
///   is made (`Error::InvalidArgument`). Every call checks its rank (`Error::InvalidRank`) and
///   its element range (`Error::ElementsOutOfBounds`, naming the operation, the rank, the
///   offset, the length and the window's length, all in elements), with overflow-safe
///   arithmetic, before anything moves.
/// - Signals, waits, `fence`, `flush` and `barrier` are the byte window's; the ordering
///   contract is docs/memory-model.md.
/// - For `u64` and `i64` elements ([`AtomicElement`]), [`fetch_add`](Self::fetch_add) and
///   [`compare_swap`](Self::compare_swap) work on one element.
/// - [`map_remote`](Self::map_remote) borrows a rank's segment where it is mapped into this
///   process (host memory: the CPU backend's ranks of this host, the host device's ranks);
///   [`map_remote_device`](Self::map_remote_device) is its form for windows in GPU memory.
///
/// ```
/// use ferrocomm::prelude::*;
///
/// const DONE: usize = 0; // a signal id
/// let comms = Comm::new_group("cpu", &[Device::Cpu; 3], "typed", CommOptions::from_env()?)?;
/// let rank_main = |c: &Comm| -> ferrocomm::Result<()> {
///     let (rank, n) = (c.rank(), c.size());
///     // Collective: 4 f32 per rank for each rank, and one u64 counter.
///     let rows = c.new_typed_window::<f32>(4 * n)?;
///     let counter = c.new_typed_window::<u64>(1)?;
///     // Every rank puts its row at element offset 4 * rank of every rank's segment.
///     for dst in 0..n {
///         rows.put_signal(dst, 4 * rank, &[rank as f32; 4], DONE, SignalOp::Add, 1)?;
///     }
///     rows.wait_signal(DONE, SignalSource::Sum, Cmp::Ge, n as u64)?; // acquire all rows
///     let mut all = vec![0f32; 4 * n];
///     rows.read_local(0, &mut all)?;
///     assert!((0..n).all(|r| all[4 * r..4 * r + 4] == [r as f32; 4]));
///     // Element offsets are checked, in elements.
///     let err = rows.put(0, 4 * n - 1, &[0f32; 2]).unwrap_err();
///     assert!(matches!(err, ferrocomm::Error::ElementsOutOfBounds { offset: 11, len: 2, elements: 12, .. }));
///     // Atomics on u64 elements: every rank takes a ticket from rank 0's counter.
///     let ticket = counter.fetch_add(0, 0, 1)?;
///     assert!(ticket < n as u64);
///     counter.barrier()?;
///     // The counter's segment, mapped here: read it in place after the barrier.
///     assert_eq!(counter.map_remote(0)?.to_vec(), [n as u64]);
///     rows.barrier() // nobody drops a segment others still read
/// };
/// std::thread::scope(|s| {
///     let ranks: Vec<_> = comms.iter().map(|c| s.spawn(move || rank_main(c))).collect();
///     ranks.into_iter().try_for_each(|h| h.join().unwrap())
/// })?;
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub struct TypedWindow<'w, T: Element> {
    win: Held<'w>,
    /// Byte offset of element 0 in every segment.
    base: usize,
    /// Elements per rank.
    len: usize,
    _elem: PhantomData<T>,
}

/// Typed window creation on the communicator.
impl Comm {
    /// Creates a window of `len` elements of `T` per rank, with the default options.
    /// Collective: every rank calls it with the same `T` and `len`.
    pub fn new_typed_window<T: Element>(&self, len: usize) -> Result<TypedWindow<'static, T>> {
        self.new_typed_window_with(len, WindowOptions::default())
    }

    /// Creates a window of `len` elements of `T` per rank with `opts`. Collective, like
    /// [`Comm::new_window_with`]; `Error::InvalidArgument` (on every rank, before anything
    /// is made) where `len` elements overflow `usize` bytes.
    pub fn new_typed_window_with<T: Element>(
        &self,
        len: usize,
        opts: WindowOptions,
    ) -> Result<TypedWindow<'static, T>> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
            Error::invalid(
                "new_typed_window",
                format!("{len} elements of {} overflow the address space", T::DTYPE),
            )
        })?;
        TypedWindow::view(
            Held::Owned(self.new_window_with(bytes, opts)?),
            0,
            len,
            "new_typed_window",
        )
    }
}

/// Typed views of a byte window.
impl<'buf> Window<'buf> {
    /// The whole window as elements of `T`: `bytes() / size_of::<T>()` per rank.
    /// `Error::InvalidArgument` where the size is not a whole number of elements or a segment
    /// is not aligned for `T`. Not collective: each rank makes its own view.
    pub fn typed<T: Element>(&self) -> Result<TypedWindow<'_, T>> {
        let len = self.checked_whole::<T>("typed")?;
        TypedWindow::view(Held::Borrowed(self), 0, len, "typed")
    }

    /// `len` elements of `T` from byte `byte_offset` of every segment, for windows that hold
    /// several arrays. The offset must be a multiple of `size_of::<T>()` and the range inside
    /// the window (`Error::InvalidArgument` otherwise). Not collective.
    pub fn typed_at<T: Element>(&self, byte_offset: usize, len: usize) -> Result<TypedWindow<'_, T>> {
        TypedWindow::view(Held::Borrowed(self), byte_offset, len, "typed_at")
    }

    /// [`typed`](Self::typed), keeping the window: the typed window owns it (and drops it).
    /// On an error the window is dropped; peers still using it then see this rank as lost, so
    /// call it where every rank makes the same view (the size check gives every rank the same
    /// answer; the alignment check can differ only for registered buffers).
    pub fn into_typed<T: Element>(self) -> Result<TypedWindow<'buf, T>> {
        let len = self.checked_whole::<T>("into_typed")?;
        TypedWindow::view(Held::Owned(self), 0, len, "into_typed")
    }

    fn checked_whole<T: Element>(&self, op: &'static str) -> Result<usize> {
        let size = size_of::<T>();
        if self.bytes() % size != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "the window's {} bytes are not a whole number of {} elements ({size} bytes each)",
                    self.bytes(),
                    T::DTYPE
                ),
            ));
        }
        Ok(self.bytes() / size)
    }
}

impl<'w, T: Element> TypedWindow<'w, T> {
    /// The view of `len` elements at `base`, after the checks made once: the range fits, and
    /// element 0 of every segment whose address this rank knows is aligned to the element's
    /// size (which every type's alignment, and the 8 bytes of atomics, divide). The offset is
    /// checked on its own too, so every rank decides alike even where it cannot see a segment.
    fn view(win: Held<'w>, base: usize, len: usize, op: &'static str) -> Result<Self> {
        let size = size_of::<T>();
        let fits = len
            .checked_mul(size)
            .and_then(|b| b.checked_add(base))
            .is_some_and(|end| end <= win.bytes());
        if !fits {
            return Err(Error::invalid(
                op,
                format!(
                    "{len} elements of {} at byte {base} do not fit in the window of {} bytes",
                    T::DTYPE,
                    win.bytes()
                ),
            ));
        }
        if base % size != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "byte offset {base} is not a multiple of {size}, the alignment of {}",
                    T::DTYPE
                ),
            ));
        }
        for rank in 0..win.size() {
            let Some(p) = segment(&win, rank) else { continue };
            let at = (p as usize).wrapping_add(base);
            if at % size != 0 {
                return Err(Error::invalid(
                    op,
                    format!("rank {rank}'s segment at {at:#x} is not aligned for {}", T::DTYPE),
                ));
            }
        }
        Ok(TypedWindow {
            win,
            base,
            len,
            _elem: PhantomData,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.win.rank()
    }
    /// The number of ranks, each with a segment.
    pub fn size(&self) -> usize {
        self.win.size()
    }
    /// Elements of every rank's segment.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the segments have no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Byte offset of element 0 in the byte window (0 but for [`Window::typed_at`]).
    pub fn byte_offset(&self) -> usize {
        self.base
    }
    /// The byte window: its handle for kernels, stream, proxy queue and byte verbs.
    pub fn window(&self) -> &Window<'w> {
        &self.win
    }

    /// Checks `rank` and the element range; returns the range's byte offset in the window.
    fn check(&self, op: &'static str, rank: usize, offset: usize, len: usize) -> Result<usize> {
        self.check_rank(op, rank)?;
        match offset.checked_add(len) {
            // No overflow below: `end <= self.len`, and `base + self.len * size` fits the window.
            Some(end) if end <= self.len => Ok(self.base + offset * size_of::<T>()),
            _ => Err(Error::ElementsOutOfBounds {
                op,
                rank,
                offset,
                len,
                elements: self.len,
                dtype: T::DTYPE.name(),
            }),
        }
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank < self.size() {
            Ok(())
        } else {
            Err(Error::InvalidRank {
                op,
                rank,
                size: self.size(),
            })
        }
    }

    /// Copies `src` to `dst`'s segment at element `offset`. Complete at the target by the
    /// next signal to it, `flush` or `barrier`.
    pub fn put(&self, dst: usize, offset: usize, src: &[T]) -> Result<()> {
        let at = self.check("put", dst, offset, src.len())?;
        self.win.put(dst, at, src)
    }

    /// Copies `src`'s segment at element `offset` into `dst`.
    pub fn get(&self, src: usize, offset: usize, dst: &mut [T]) -> Result<()> {
        let at = self.check("get", src, offset, dst.len())?;
        self.win.get(src, at, dst)
    }

    /// `put` then [`signal`](Self::signal) to the same rank: the signal releases the put.
    pub fn put_signal(&self, dst: usize, offset: usize, src: &[T], id: usize, op: SignalOp, value: u64) -> Result<()> {
        let at = self.check("put_signal", dst, offset, src.len())?;
        self.win.put_signal(dst, at, src, id, op, value)
    }

    /// Copies from this rank's own segment at element `offset` (elements a peer is writing
    /// concurrently may be old or new).
    pub fn read_local(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        let at = self.check("read_local", self.rank(), offset, dst.len())?;
        self.win.read_local(at, dst)
    }

    /// Copies into this rank's own segment at element `offset`.
    pub fn write_local(&self, offset: usize, src: &[T]) -> Result<()> {
        let at = self.check("write_local", self.rank(), offset, src.len())?;
        self.win.write_local(at, src)
    }

    /// [`Window::signal`]: release-writes our slot of signal `id` on `dst`.
    pub fn signal(&self, dst: usize, id: usize, op: SignalOp, value: u64) -> Result<()> {
        self.win.signal(dst, id, op, value)
    }

    /// [`Window::wait_signal`]: waits (acquire) until signal `id` from `from` satisfies
    /// `cmp value`, within the communicator's timeout.
    pub fn wait_signal(&self, id: usize, from: SignalSource, cmp: Cmp, value: u64) -> Result<Observed> {
        self.win.wait_signal(id, from, cmp, value)
    }

    /// [`Window::wait_signal_timeout`]: `wait_signal` with its own bound.
    pub fn wait_signal_timeout(
        &self,
        id: usize,
        from: SignalSource,
        cmp: Cmp,
        value: u64,
        timeout: Duration,
    ) -> Result<Observed> {
        self.win.wait_signal_timeout(id, from, cmp, value, timeout)
    }

    /// [`Window::fence`]: orders our earlier puts to each rank before our later ones.
    pub fn fence(&self) -> Result<()> {
        self.win.fence()
    }

    /// [`Window::flush`]: waits until every earlier operation of ours is complete at its target.
    pub fn flush(&self) -> Result<()> {
        self.win.flush()
    }

    /// [`Window::barrier`]: `flush`, then a barrier over the communicator.
    pub fn barrier(&self) -> Result<()> {
        self.win.barrier()
    }

    /// `put` as a [`ScopedWork`] of `scope`, in issue order with the communicator's other work.
    pub fn put_async<'s>(
        &'s self,
        scope: &'s Scope<'s, '_>,
        dst: usize,
        offset: usize,
        src: &'s [T],
    ) -> Result<ScopedWork<'s>> {
        let at = self.check("put", dst, offset, src.len())?;
        self.win.put_async(scope, dst, at, src)
    }

    /// `get` as a [`ScopedWork`] of `scope`.
    pub fn get_async<'s>(
        &'s self,
        scope: &'s Scope<'s, '_>,
        src: usize,
        offset: usize,
        dst: &'s mut [T],
    ) -> Result<ScopedWork<'s>> {
        let at = self.check("get", src, offset, dst.len())?;
        self.win.get_async(scope, src, at, dst)
    }

    /// Rank `rank`'s segment borrowed in place, for windows in host memory: the CPU backend's
    /// ranks of this host (threads or processes over shared memory) and the host device's
    /// ranks (`Device::Host`), and always this rank's own segment. See [`MappedSegment`] for
    /// how to read it soundly while peers may write.
    ///
    /// `Error::InvalidArgument` for a rank whose segment is not mapped here (a rank on another
    /// host or behind the TCP transport, every peer of a registered buffer), and for a window
    /// in GPU memory (use [`map_remote_device`](Self::map_remote_device)); `InvalidRank`
    /// outside the communicator.
    pub fn map_remote(&self, rank: usize) -> Result<MappedSegment<'_, T>> {
        self.check_rank("map_remote", rank)?;
        if T::DTYPE == DType::Bool {
            // Peers may write any byte, and a byte other than 0 or 1 read as a bool is UB.
            return Err(Error::invalid(
                "map_remote",
                "a bool segment cannot be borrowed in place: peers may write any byte into it; \
                 view the window as u8 (Window::typed::<u8>) or use get",
            ));
        }
        if self.win.is_device_memory() {
            return Err(Error::invalid(
                "map_remote",
                "this window is in GPU memory: map_remote_device borrows it as a DeviceSlice",
            ));
        }
        let p = self.mapped("map_remote", rank)?;
        // SAFETY: `p` is `rank`'s segment mapped into this process, in host memory, valid while
        // the window lives (it outlives the `&self` borrow); `view` checked that
        // `base + len * size` fits the segment and that `p + base` is aligned for `T`.
        Ok(unsafe { MappedSegment::new(rank, p.cast::<u8>().add(self.base).cast::<T>(), self.len) })
    }

    /// Rank `rank`'s segment as a [`DeviceSlice`] on this rank's GPU, for windows in GPU
    /// memory whose peers are mapped here (ranks of this process or of this host on the
    /// `device` backend): an input for collectives and kernels, like torchcomms'
    /// `map_remote_tensor`. The view is valid while the window lives. Kernels reading it
    /// follow the window's ordering contract (read after a barrier, or after a device
    /// `wait_signal` of the writer's signal).
    ///
    /// `Error::InvalidArgument` for a window in host memory (use
    /// [`map_remote`](Self::map_remote)) and for a rank that is not mapped here.
    pub fn map_remote_device(&self, rank: usize) -> Result<DeviceSlice<'_, T>> {
        self.check_rank("map_remote_device", rank)?;
        if !self.win.is_device_memory() {
            return Err(Error::invalid(
                "map_remote_device",
                "this window is in host memory: map_remote borrows it",
            ));
        }
        let ordinal = self.win.stream()?.context().ordinal();
        let p = self.mapped("map_remote_device", rank)?;
        let addr = (p.as_ptr() as u64) + self.base as u64;
        // SAFETY: `addr` is `rank`'s segment as mapped into this rank's GPU context (device
        // memory, readable from that GPU while the window lives, longer than `&self`), and
        // `len` elements from it fit the segment (`view`).
        unsafe { DeviceSlice::from_raw(ordinal, addr, self.len) }
    }

    /// Rank `rank`'s segment base in this process, or the error saying why there is none.
    fn mapped(&self, op: &'static str, rank: usize) -> Result<NonNull<u8>> {
        segment(&self.win, rank).and_then(NonNull::new).ok_or_else(|| {
            Error::invalid(
                op,
                format!(
                    "rank {rank}'s segment is not mapped into this process (rank {rank} is on another \
                     host, behind the TCP transport, or the window is a registered buffer): \
                     use get"
                ),
            )
        })
    }
}

/// Atomics on one `u64` or `i64` element.
impl<T: AtomicElement> TypedWindow<'_, T> {
    /// Atomically adds `value` to element `index` of `dst`'s segment; returns the old value.
    /// Wraps on overflow (for `i64`, two's complement). Atomic with every `fetch_add` and
    /// `compare_swap` on that element from any rank (docs/memory-model.md, rule 4).
    pub fn fetch_add(&self, dst: usize, index: usize, value: T) -> Result<T> {
        let at = self.check("fetch_add", dst, index, 1)?;
        self.win.fetch_add(dst, at, value.to_word()).map(T::from_word)
    }

    /// Atomically replaces element `index` of `dst`'s segment by `desired` if it equals
    /// `expected`; returns the old value (equal to `expected` when the swap happened).
    pub fn compare_swap(&self, dst: usize, index: usize, expected: T, desired: T) -> Result<T> {
        let at = self.check("compare_swap", dst, index, 1)?;
        self.win
            .compare_swap(dst, at, expected.to_word(), desired.to_word())
            .map(T::from_word)
    }
}

impl<T: Element> std::fmt::Debug for TypedWindow<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TypedWindow")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("byte_offset", &self.base)
            .finish()
    }
}

/// `rank`'s segment base in this process, where it has one.
fn segment(win: &Window, rank: usize) -> Option<*mut u8> {
    if rank == win.rank() {
        Some(win.local_ptr())
    } else {
        win.remote_ptr(rank)
    }
}
