//! Typed windows (`TypedWindow`) checked on one communicator, in every mode the window suite
//! runs in (window_suite::run_all calls `run_all` here): element offsets and lengths for
//! several element types, views at a byte offset, errors in elements, refused views, u64/i64
//! atomics under contention, and `map_remote` where segments are mapped (and its error where
//! they are not).

use super::*;
use ferrocomm::{bf16, f16, Error, TypedWindow};

/// Where rank `r` writes in every segment, and how many elements: odd offsets and lengths
/// that differ per rank, so an element-to-byte mistake lands somewhere visible.
fn slot(r: usize) -> (usize, usize) {
    (1 + 9 * r, 5 + r % 3)
}

fn values<T: TestElem>(seed: u64, tag: u64, len: usize) -> Vec<T> {
    let mut g = rng(seed, tag);
    (0..len).map(|_| T::random(&mut g, None)).collect()
}

/// Every rank puts its values into its slot of every segment at a non-zero element offset;
/// afterwards each segment holds exactly every writer's values there and poison elsewhere,
/// and a get at an offset inside the slot reads back a suffix.
fn put_get_at_element_offsets<T: TestElem>(c: &Comm, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    let len = 9 * n + 4;
    let w = c.new_typed_window::<T>(len).unwrap();
    assert_eq!((w.len(), w.window().bytes()), (len, len * size_of::<T>()));
    w.write_local(0, &vec![T::poison(); len]).unwrap();
    w.barrier().unwrap();
    let tag = |r: usize| 31 * r as u64 + T::DTYPE as u64 * 1000;
    let (at, k) = slot(me);
    let mine: Vec<T> = values(seed, tag(me), k);
    for p in 0..n {
        w.put(p, at, &mine).unwrap();
    }
    w.barrier().unwrap();
    let mut want = vec![T::poison(); len];
    for src in 0..n {
        let (at, k) = slot(src);
        want[at..at + k].copy_from_slice(&values::<T>(seed, tag(src), k));
    }
    let mut got = vec![T::default(); len];
    w.read_local(0, &mut got).unwrap();
    assert_eq!(got, want, "{}: segment of rank {me} after typed puts", T::DTYPE);
    let right = (me + 1) % n;
    let mut back = vec![T::default(); k - 1];
    w.get(right, at + 1, &mut back).unwrap();
    assert_eq!(back, mine[1..], "{}: typed get from rank {right}", T::DTYPE);
    // The async forms take element offsets too.
    let mut again = vec![T::default(); k];
    c.scope(|s| {
        w.put_async(s, right, at, &mine).unwrap().wait().unwrap();
        w.get_async(s, right, at, &mut again).unwrap().wait().unwrap();
    });
    assert_eq!(again, mine, "{}: async typed put/get", T::DTYPE);
    w.barrier().unwrap();
}

/// A typed view at a byte offset of a byte window: element i is byte `base + i * size`.
fn typed_at_a_byte_offset(c: &Comm, seed: u64) {
    let (n, me) = (c.size(), c.rank());
    let base = 24;
    let w = c.new_window(base + 8 * n + 8).unwrap();
    let t = w.typed_at::<u64>(base, n).unwrap();
    assert_eq!((t.len(), t.byte_offset()), (n, base));
    let v: u64 = rng(seed, 404 + me as u64).gen();
    t.put_signal((me + 1) % n, me, &[v], 5, SignalOp::Add, 1).unwrap();
    t.wait_signal(5, SignalSource::Rank((me + n - 1) % n), Cmp::Ge, 1)
        .unwrap();
    let left = (me + n - 1) % n;
    let mut raw = [0u64];
    w.read_local(base + 8 * left, &mut raw).unwrap();
    assert_eq!(
        raw[0],
        rng(seed, 404 + left as u64).gen::<u64>(),
        "element {left} is byte {base} + 8 * {left}"
    );
    w.barrier().unwrap();
}

/// Whether `r` is the `ElementsOutOfBounds` error with these fields (and says so).
fn is_oob<V: std::fmt::Debug>(
    r: Result<V, Error>,
    op: &str,
    rank: usize,
    offset: usize,
    len: usize,
    elements: usize,
) -> bool {
    match &r {
        Err(
            e @ Error::ElementsOutOfBounds {
                op: o,
                rank: r,
                offset: f,
                len: l,
                elements: el,
                ..
            },
        ) => {
            let says = e.to_string();
            assert!(says.starts_with(op) && says.contains("elements"), "{says}");
            (*o, *r, *f, *l, *el) == (op, rank, offset, len, elements)
        }
        other => {
            eprintln!("{op}: expected ElementsOutOfBounds, got {other:?}");
            false
        }
    }
}

/// Checks that `r` is the `InvalidArgument` of `op` whose reason contains `words`.
fn invalid<T: Element>(r: Result<TypedWindow<'_, T>, Error>, op: &str, words: &str) {
    match r {
        Err(Error::InvalidArgument { op: o, reason }) => {
            assert_eq!(o, op);
            assert!(reason.contains(words), "{op}: {reason}");
        }
        Err(e) => panic!("{op}: expected InvalidArgument, got {e}"),
        Ok(_) => panic!("{op}: a view that cannot be was accepted"),
    }
}

/// Out-of-range accesses are errors in elements (operation, rank, offset, length and the
/// window's length named), bad ranks are `InvalidRank`, and none of them writes anything.
fn bad_typed_accesses_are_errors_in_elements(c: &Comm) {
    let (n, me) = (c.size(), c.rank());
    let right = (me + 1) % n;
    let len = 10;
    let w = c.new_typed_window::<f32>(len).unwrap();
    let a = c.new_typed_window::<i64>(3).unwrap();
    w.write_local(0, &[7.5; 10]).unwrap();
    w.barrier().unwrap();
    assert!(is_oob(w.put(right, len - 1, &[1.0; 2]), "put", right, len - 1, 2, len));
    assert!(is_oob(
        w.put(right, usize::MAX, &[1.0; 2]),
        "put",
        right,
        usize::MAX,
        2,
        len
    ));
    assert!(is_oob(w.put(right, len + 1, &[]), "put", right, len + 1, 0, len));
    assert!(is_oob(w.get(right, 4, &mut [0.0; 7]), "get", right, 4, 7, len));
    assert!(is_oob(w.read_local(len, &mut [0.0]), "read_local", me, len, 1, len));
    assert!(is_oob(w.write_local(3, &[1.0; 8]), "write_local", me, 3, 8, len));
    assert!(is_oob(
        w.put_signal(right, 9, &[1.0; 2], 0, SignalOp::Add, 1),
        "put_signal",
        right,
        9,
        2,
        len
    ));
    assert!(is_oob(a.fetch_add(right, 3, 1), "fetch_add", right, 3, 1, 3));
    assert!(is_oob(
        a.compare_swap(right, usize::MAX, 0, 1),
        "compare_swap",
        right,
        usize::MAX,
        1,
        3
    ));
    // Whole-window accesses at the edges are fine.
    w.get(right, 0, &mut [0.0; 10]).unwrap();
    w.get(right, len, &mut []).unwrap();
    assert!(matches!(w.put(n, 0, &[1.0]), Err(Error::InvalidRank { op: "put", .. })));
    assert!(matches!(
        a.fetch_add(n + 2, 0, 1),
        Err(Error::InvalidRank { op: "fetch_add", .. })
    ));
    assert!(matches!(
        w.map_remote(n),
        Err(Error::InvalidRank { op: "map_remote", .. })
    ));
    w.barrier().unwrap();
    let mut all = [0f32; 10];
    w.read_local(0, &mut all).unwrap();
    assert_eq!(all, [7.5; 10], "a refused typed access wrote into the window");
    w.barrier().unwrap();
}

/// Views that cannot be made are refused once, at creation: a size that is not a whole number
/// of elements, an offset not aligned for the type, a range past the end, a length whose bytes
/// overflow (refused before the collective).
fn refused_views(c: &Comm) {
    let w = c.new_window(12).unwrap();
    invalid(w.typed::<u64>(), "typed", "whole number");
    assert_eq!(w.typed::<u32>().unwrap().len(), 3);
    assert_eq!(w.typed::<bf16>().unwrap().len(), 6);
    invalid(w.typed_at::<u64>(4, 1), "typed_at", "not a multiple of 8");
    invalid(w.typed_at::<u32>(2, 1), "typed_at", "alignment of u32");
    invalid(w.typed_at::<u64>(8, 1), "typed_at", "do not fit");
    invalid(w.typed_at::<u64>(0, usize::MAX / 4), "typed_at", "do not fit");
    assert_eq!(w.typed_at::<f16>(10, 1).unwrap().len(), 1);
    let t = w.typed_at::<u32>(4, 2).unwrap();
    assert!(is_oob(t.put(c.rank(), 1, &[1, 2]), "put", c.rank(), 1, 2, 2));
    invalid(
        c.new_typed_window::<u64>(usize::MAX / 4),
        "new_typed_window",
        "overflow",
    );
    // A window taken over by its typed view: same checks, and the view drops it.
    let owned = c.new_window(16).unwrap().into_typed::<i64>().unwrap();
    assert_eq!(owned.len(), 2);
    owned.barrier().unwrap();
    drop(owned);
    w.barrier().unwrap();
}

/// N ranks × K `fetch_add`s and `compare_swap` increments on one u64 and one i64 element of
/// the last rank (the i64 one counting down past zero): exact totals, and i64 wraps like
/// `wrapping_add`.
fn typed_atomics_under_contention(c: &Comm, k: u64) {
    let (n, owner) = (c.size() as u64, c.size() - 1);
    let u = c.new_typed_window::<u64>(3).unwrap();
    let i = c.new_typed_window::<i64>(3).unwrap();
    if c.rank() == owner {
        u.write_local(0, &[0, 0, 0]).unwrap();
        i.write_local(0, &[0, 5, 0]).unwrap();
    }
    u.barrier().unwrap();
    for _ in 0..k {
        u.fetch_add(owner, 1, 1).unwrap();
        i.fetch_add(owner, 1, -2).unwrap();
        // A compare-and-swap loop on element 2: a lost race retries with the value it saw.
        let mut seen = i.compare_swap(owner, 2, 0, 0).unwrap();
        loop {
            let prev = i.compare_swap(owner, 2, seen, seen - 3).unwrap();
            if prev == seen {
                break;
            }
            seen = prev;
        }
    }
    u.barrier().unwrap();
    assert_eq!(u.fetch_add(owner, 1, 0).unwrap(), n * k, "u64 fetch_add total");
    assert_eq!(
        i.fetch_add(owner, 1, 0).unwrap(),
        5 - 2 * (n * k) as i64,
        "i64 fetch_add total"
    );
    assert_eq!(
        i.compare_swap(owner, 2, 1, 1).unwrap(),
        -3 * (n * k) as i64,
        "i64 compare_swap total"
    );
    // Neighbouring elements are untouched.
    let mut edges = [9u64; 2];
    u.get(owner, 0, &mut edges[..1]).unwrap();
    u.get(owner, 2, &mut edges[1..]).unwrap();
    assert_eq!(edges, [0, 0]);
    u.barrier().unwrap();
    // Wrapping, in two's complement, on element 0 of our own segment.
    let me = c.rank();
    i.write_local(0, &[i64::MAX]).unwrap();
    assert_eq!(i.fetch_add(me, 0, 1).unwrap(), i64::MAX);
    assert_eq!(i.compare_swap(me, 0, i64::MIN, -1).unwrap(), i64::MIN);
    let mut v = [0i64];
    i.read_local(0, &mut v).unwrap();
    assert_eq!(v, [-1]);
    i.barrier().unwrap();
}

/// Copies a device view to the host through the driver, on this rank's GPU.
fn device_to_host(w: &TypedWindow<'_, f32>, d: ferrocomm::device::DeviceSlice<'_, f32>) -> Vec<f32> {
    use ferrocomm::device::cudarc::driver::sys;
    let stream = w.window().stream().unwrap();
    stream.context().bind_to_thread().unwrap();
    let mut host = vec![0f32; d.len()];
    // SAFETY: `d` is `d.len()` f32 of device memory readable from this context (the window is
    // alive), and `host` has room for them.
    unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), d.device_ptr(), d.len() * 4) }
        .result()
        .unwrap();
    host
}

/// After a barrier every rank reads every mapped segment in place and finds its owner's
/// values; a rank that is not mapped here is an `InvalidArgument` naming it. Returns how many
/// ranks were mapped.
fn map_remote_after_a_barrier(c: &Comm, seed: u64) -> usize {
    let (n, me) = (c.size(), c.rank());
    let len = 37;
    let w = c.new_typed_window::<f32>(len).unwrap();
    let data = |r: usize| values::<f32>(seed, 8080 + r as u64, len);
    w.write_local(0, &data(me)).unwrap();
    w.barrier().unwrap();
    let mut mapped = 0;
    for p in 0..n {
        let expect_mapped = p == me || w.window().remote_ptr(p).is_some();
        if w.window().is_device_memory() {
            assert!(matches!(
                w.map_remote(p),
                Err(Error::InvalidArgument { op: "map_remote", .. })
            ));
            match w.map_remote_device(p) {
                Ok(d) => {
                    assert!(
                        expect_mapped,
                        "rank {p} is not mapped but map_remote_device gave a view"
                    );
                    assert_eq!(d.len(), len);
                    assert_eq!(device_to_host(&w, d), data(p), "map_remote_device({p})");
                    mapped += 1;
                }
                Err(e) => assert!(!expect_mapped, "map_remote_device({p}): {e}"),
            }
            continue;
        }
        assert!(matches!(
            w.map_remote_device(p),
            Err(Error::InvalidArgument {
                op: "map_remote_device",
                ..
            })
        ));
        match w.map_remote(p) {
            Ok(seg) => {
                assert!(expect_mapped, "rank {p} is not mapped but map_remote gave a view");
                assert_eq!((seg.rank(), seg.len()), (p, len));
                assert_eq!(seg.to_vec(), data(p), "map_remote({p}).to_vec()");
                let mut part = [0f32; 5];
                seg.read(30, &mut part).unwrap();
                assert_eq!(part[..], data(p)[30..35]);
                assert!(is_oob(seg.read(33, &mut [0.0; 5]), "mapped read", p, 33, 5, len));
                // SAFETY: no rank writes `w` between the barrier above and the one below.
                let s = unsafe { seg.as_slice() };
                assert_eq!(s, &data(p)[..], "map_remote({p}).as_slice()");
                mapped += 1;
            }
            Err(Error::InvalidArgument {
                op: "map_remote",
                reason,
            }) => {
                assert!(!expect_mapped, "map_remote({p}) refused a mapped rank: {reason}");
                assert!(
                    reason.contains(&format!("rank {p}")) && reason.contains("not mapped"),
                    "{reason}"
                );
            }
            Err(e) => panic!("map_remote({p}): {e}"),
        }
    }
    w.barrier().unwrap();
    mapped
}

/// The whole typed suite; returns how many ranks' segments `map_remote` reached.
pub fn run_all(c: &Comm, seed: u64) -> usize {
    put_get_at_element_offsets::<f32>(c, seed);
    put_get_at_element_offsets::<bf16>(c, seed);
    put_get_at_element_offsets::<f16>(c, seed);
    put_get_at_element_offsets::<u64>(c, seed);
    put_get_at_element_offsets::<i8>(c, seed);
    put_get_at_element_offsets::<f64>(c, seed);
    typed_at_a_byte_offset(c, seed);
    bad_typed_accesses_are_errors_in_elements(c);
    refused_views(c);
    typed_atomics_under_contention(c, 100);
    map_remote_after_a_barrier(c, seed)
}
