//! The window contract (docs/memory-model.md) checked on one communicator. Used with ranks as
//! threads and as processes, over shared memory and over the TCP proxy, on allocated and on
//! registered memory.

use super::*;
use ferrocomm::{Error, Window, F8E4M3, F8E5M2};

const SLOT: usize = 4096;

fn pattern(seed: u64, tag: u64, len: usize) -> Vec<u8> {
    let mut r = rng(seed, tag);
    (0..len).map(|_| r.gen()).collect()
}

/// A ring of put + signal, flow-controlled by an acknowledgement signal back.
fn ring_put_signal(w: &Window, seed: u64, iters: u64) {
    let (n, me) = (w.size(), w.rank());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let (data_id, ack_id) = (0, 1);
    for i in 0..iters {
        let len = 1 + (i as usize * 977) % SLOT;
        if i > 0 {
            // Our right neighbour has read what we sent last time.
            w.wait_signal(ack_id, SignalSource::Rank(right), Cmp::Ge, i).unwrap();
        }
        w.put_signal(
            right,
            0,
            &pattern(seed, i * 1000 + me as u64, len),
            data_id,
            SignalOp::Add,
            1,
        )
        .unwrap();
        let o = w
            .wait_signal(data_id, SignalSource::Rank(left), Cmp::Ge, i + 1)
            .unwrap();
        assert_eq!(
            o,
            Observed {
                source: Some(left),
                value: i + 1
            }
        );
        let mut got = vec![0u8; len];
        w.read_local(0, &mut got).unwrap();
        assert!(
            got == pattern(seed, i * 1000 + left as u64, len),
            "ring iteration {i}: data from rank {left} differs"
        );
        w.signal(left, ack_id, SignalOp::Add, 1).unwrap();
    }
    w.barrier().unwrap();
}

/// Every rank writes its own slot on every rank in random chunks; afterwards each slot must
/// hold exactly its writer's bytes (nothing lost, torn or spilled into a neighbour slot).
fn all_pairs_put_storm(w: &Window, seed: u64, rounds: u64) {
    let (n, me) = (w.size(), w.rank());
    for round in 0..rounds {
        let mut r = rng(seed, 77 + round * 100 + me as u64);
        for p in 0..n {
            let data = pattern(seed, round * 10_000 + (me * n + p) as u64, SLOT);
            let mut at = 0;
            while at < SLOT {
                let len = r.gen_range(1..=SLOT - at).min(700);
                w.put(p, me * SLOT + at, &data[at..at + len]).unwrap();
                at += len;
            }
        }
        w.barrier().unwrap();
        let mut all = vec![0u8; n * SLOT];
        w.read_local(0, &mut all).unwrap();
        for src in 0..n {
            let want = pattern(seed, round * 10_000 + (src * n + me) as u64, SLOT);
            let got = &all[src * SLOT..(src + 1) * SLOT];
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "round {round}: {bad} wrong bytes in the slot of rank {src}");
        }
        w.barrier().unwrap();
    }
}

fn get_from_everyone(w: &Window, seed: u64) {
    let (n, me) = (w.size(), w.rank());
    w.write_local(0, &pattern(seed, 5000 + me as u64, w.bytes())).unwrap();
    w.barrier().unwrap();
    for p in 0..n {
        let mut got = vec![0u8; 999];
        w.get(p, 17, &mut got).unwrap();
        assert!(
            got[..] == pattern(seed, 5000 + p as u64, w.bytes())[17..17 + 999],
            "get from rank {p}"
        );
    }
    w.barrier().unwrap();
}

fn signals_set_add_any_sum(w: &Window) {
    let (n, me) = (w.size(), w.rank());
    let (id_set, id_sum) = (2, 3);
    // Everyone signals rank 0: Set to 5, then Add 3, on one id; Add 1 on another.
    w.signal(0, id_set, SignalOp::Set, 5).unwrap();
    w.signal(0, id_set, SignalOp::Add, 3).unwrap();
    w.signal(0, id_sum, SignalOp::Add, 1).unwrap();
    if me == 0 {
        for src in 0..n {
            let o = w.wait_signal(id_set, SignalSource::Rank(src), Cmp::Eq, 8).unwrap();
            assert_eq!(o.value, 8);
        }
        let o = w.wait_signal(id_sum, SignalSource::Sum, Cmp::Ge, n as u64).unwrap();
        assert_eq!(
            o,
            Observed {
                source: None,
                value: n as u64
            }
        );
        let o = w.wait_signal(id_sum, SignalSource::Any, Cmp::Eq, 1).unwrap();
        assert!(o.source.is_some_and(|s| s < n) && o.value == 1);
        // Conditions that already hold return at once, whatever the comparison.
        for (cmp, v) in [(Cmp::Ne, 0), (Cmp::Gt, 7), (Cmp::Le, 8), (Cmp::Lt, 9), (Cmp::Ge, 8)] {
            assert_eq!(w.wait_signal(id_set, SignalSource::Rank(0), cmp, v).unwrap().value, 8);
        }
        // And one that does not hold times out with the awaited rank named.
        let e = w.wait_signal_timeout(
            id_set,
            SignalSource::Rank(n - 1),
            Cmp::Gt,
            8,
            Duration::from_millis(100),
        );
        assert!(
            matches!(e, Err(Error::Timeout { op: "wait_signal", peer: Some(p), .. }) if p == n - 1),
            "{e:?}"
        );
    }
    w.barrier().unwrap();
}

fn atomics_under_contention(w: &Window, k: u64) {
    let n = w.size() as u64;
    let owner = w.size() - 1;
    if w.rank() == owner {
        w.write_local(8, &[0u64; 2]).unwrap();
    }
    w.barrier().unwrap();
    for _ in 0..k {
        w.fetch_add(owner, 8, 1).unwrap();
        // A compare-and-swap loop: a lost race retries with the value it saw.
        let mut seen = w.compare_swap(owner, 16, 0, 0).unwrap();
        loop {
            let prev = w.compare_swap(owner, 16, seen, seen + 1).unwrap();
            if prev == seen {
                break;
            }
            seen = prev;
        }
    }
    w.barrier().unwrap();
    assert_eq!(w.fetch_add(owner, 8, 0).unwrap(), n * k, "fetch_add total");
    assert_eq!(
        w.compare_swap(owner, 16, u64::MAX, 0).unwrap(),
        n * k,
        "compare_swap total"
    );
    w.barrier().unwrap();
}

fn bad_accesses_are_errors_and_write_nothing(w: &Window) {
    let (n, me, b) = (w.size(), w.rank(), w.bytes());
    let right = (me + 1) % n;
    w.barrier().unwrap();
    w.write_local(0, &vec![0xAAu8; b]).unwrap();
    w.barrier().unwrap();
    let oob = |r: Result<(), Error>| matches!(r, Err(Error::OutOfBounds { .. }));
    assert!(oob(w.put(right, b - 3, &[1u8; 4])));
    assert!(oob(w.put(right, usize::MAX - 1, &[1u8; 4])));
    assert!(oob(w.put(right, b + 1, &[0u8; 0])));
    assert!(oob(w.get(right, b, &mut [0u8; 1])));
    assert!(matches!(w.fetch_add(right, b, 1), Err(Error::OutOfBounds { .. })));
    assert!(matches!(w.fetch_add(right, 4, 1), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        w.compare_swap(right, 12, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(w.put(n, 0, &[1u8]), Err(Error::InvalidRank { op: "put", .. })));
    assert!(matches!(
        w.signal(n + 3, 0, SignalOp::Add, 1),
        Err(Error::InvalidRank { .. })
    ));
    assert!(matches!(
        w.signal(right, w.signals(), SignalOp::Add, 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        w.wait_signal(0, SignalSource::Rank(n), Cmp::Eq, 0),
        Err(Error::InvalidRank { .. })
    ));
    assert!(w.remote_ptr(n).is_none());
    w.barrier().unwrap();
    let mut all = vec![0u8; b];
    w.read_local(0, &mut all).unwrap();
    assert!(all.iter().all(|&x| x == 0xAA), "a refused access wrote into the window");
    w.barrier().unwrap();
}

fn async_put_get(comm: &Comm, w: &Window, seed: u64) {
    let (n, me) = (w.size(), w.rank());
    let right = (me + 1) % n;
    let data = pattern(seed, 9000 + me as u64, 256);
    let mut back = vec![0u8; 256];
    comm.scope(|s| {
        w.put_async(s, right, 0, &data).unwrap().wait().unwrap();
        w.signal_async(s, right, 4, SignalOp::Add, 1).unwrap().wait().unwrap();
    });
    w.wait_signal(4, SignalSource::Rank((me + n - 1) % n), Cmp::Ge, 1)
        .unwrap();
    w.barrier().unwrap();
    comm.scope(|s| {
        let g = w.get_async(s, right, 0, &mut back).unwrap();
        g.wait().unwrap();
    });
    // What we read back from the right neighbour is what we put there.
    assert!(back == data, "async get returned other bytes than the async put wrote");
    w.barrier().unwrap();
}

/// One vector of each of the 1- and 2-byte element types.
type Typed = (Vec<bool>, Vec<i16>, Vec<u16>, Vec<F8E4M3>, Vec<F8E5M2>);

/// Elements of every 1- and 2-byte type (bool, i16, u16, both fp8) put to the right neighbour
/// and read back from everyone, by `get`, `get_async` and `read_local`; then bytes other than 0
/// and 1 read as `bool` arrive as `true` (0 or 1 in memory), never as an invalid `bool`.
fn typed_elements(comm: &Comm, w: &Window, seed: u64) {
    let (n, me) = (w.size(), w.rank());
    let right = (me + 1) % n;
    let k = 97;
    let mut r = rng(seed, 7000 + me as u64);
    let mine_of = |r: &mut StdRng| -> Typed {
        (
            (0..k).map(|_| r.gen()).collect(),
            (0..k).map(|_| r.gen()).collect(),
            (0..k).map(|_| r.gen()).collect(),
            (0..k).map(|_| F8E4M3::from_bits(r.gen())).collect(),
            (0..k).map(|_| F8E5M2::from_bits(r.gen())).collect(),
        )
    };
    let mine = mine_of(&mut r);
    // Layout in a segment: bool, i16, u16, e4m3, e5m2, each k elements, 2-byte ones aligned.
    let (o_b, o_i, o_u, o_e4, o_e5) = (0, 128, 128 + 2 * k, 128 + 4 * k, 128 + 5 * k);
    w.put(right, o_b, &mine.0).unwrap();
    w.put(right, o_i, &mine.1).unwrap();
    w.put(right, o_u, &mine.2).unwrap();
    w.put(right, o_e4, &mine.3).unwrap();
    w.put(right, o_e5, &mine.4).unwrap();
    w.barrier().unwrap();
    for p in 0..n {
        let left_of_p = (p + n - 1) % n;
        let want = mine_of(&mut rng(seed, 7000 + left_of_p as u64));
        let mut got = (
            vec![false; k],
            vec![0i16; k],
            vec![0u16; k],
            vec![F8E4M3::default(); k],
            vec![F8E5M2::default(); k],
        );
        w.get(p, o_b, &mut got.0).unwrap();
        w.get(p, o_i, &mut got.1).unwrap();
        w.get(p, o_u, &mut got.2).unwrap();
        w.get(p, o_e4, &mut got.3).unwrap();
        w.get(p, o_e5, &mut got.4).unwrap();
        assert!(got == want, "rank {me}: typed elements in rank {p}'s segment");
        if p == me {
            let mut local = vec![false; k];
            w.read_local(o_b, &mut local).unwrap();
            assert!(local == want.0, "rank {me}: read_local of bools");
        }
    }
    let mut back = vec![F8E5M2::default(); k];
    comm.scope(|s| w.get_async(s, right, o_e5, &mut back).unwrap().wait().unwrap());
    assert!(back == mine.4, "rank {me}: get_async of e5m2");
    w.barrier().unwrap();

    // Bytes that are no bool, written as u8.
    let raw: Vec<u8> = (0..k).map(|i| [0u8, 1, 2, 0x80, 0xFF, 0x7F][i % 6]).collect();
    w.write_local(o_b, &raw).unwrap();
    w.barrier().unwrap();
    let want: Vec<bool> = raw.iter().map(|&b| b != 0).collect();
    for p in 0..n {
        let mut got = vec![false; k];
        w.get(p, o_b, &mut got).unwrap();
        assert!(got == want, "rank {me}: bools from rank {p}'s raw bytes");
        // SAFETY: a bool is one byte; this reads what get left in memory as plain bytes.
        let bytes = unsafe { std::slice::from_raw_parts(got.as_ptr().cast::<u8>(), k) };
        assert!(
            bytes.iter().all(|&b| b <= 1),
            "rank {me}: get left a byte that is no bool: {bytes:?}"
        );
    }
    let mut got = vec![false; k];
    w.read_local(o_b, &mut got).unwrap();
    assert!(got == want, "rank {me}: read_local of raw bytes as bools");
    let mut got = vec![false; k];
    comm.scope(|s| w.get_async(s, right, o_b, &mut got).unwrap().wait().unwrap());
    assert!(got == want, "rank {me}: get_async of raw bytes as bools");
    w.barrier().unwrap();
}

/// The whole suite on a window this rank already holds (allocated or registered).
pub fn run_on(comm: &Comm, w: &Window, seed: u64) {
    assert!(w.bytes() >= w.size() * SLOT);
    ring_put_signal(w, seed, 200);
    all_pairs_put_storm(w, seed, 3);
    get_from_everyone(w, seed);
    signals_set_add_any_sum(w);
    atomics_under_contention(w, 200);
    bad_accesses_are_errors_and_write_nothing(w);
    async_put_get(comm, w, seed);
    typed_elements(comm, w, seed);
}

/// Allocates a window and runs the suite, then the typed window suite; returns whether peers
/// were mapped directly.
pub fn run_all(comm: &Comm, seed: u64) -> bool {
    let w = comm.new_window(comm.size() * SLOT).unwrap();
    run_on(comm, &w, seed);
    // Typed windows in the same mode; map_remote reaches exactly the mapped segments.
    let typed_mapped = super::typed_window_suite::run_all(comm, seed);
    let ptrs = (0..comm.size()).filter(|&p| w.remote_ptr(p).is_some()).count();
    assert_eq!(
        typed_mapped, ptrs,
        "map_remote and remote_ptr disagree on which ranks are mapped"
    );
    let mapped = ptrs == comm.size();
    comm.barrier().unwrap();
    mapped
}
