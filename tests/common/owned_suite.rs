//! Owned asynchronous work (`Comm::owned`, `Comm::start`, `Work<B>`) on one communicator:
//! works kept in a list and waited out of order, moved to another thread, polled, waited with a
//! timeout, dropped unwaited (the drop must wait for the data), every owned call's result
//! against the borrowed call's, and local errors. Runs inside the collective suite, so in every
//! mode: threads, processes over shared memory, processes over TCP.

use super::*;
use ferrocomm::{Error, Work};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Integer-valued f32 so that sums are exact in any order.
fn ints(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.gen_range(-1000..1000) as f32).collect()
}

/// Every rank's inputs, drawn from the shared seed.
fn inputs(seed: u64, stream: u64, size: usize, n: usize) -> Vec<Vec<f32>> {
    let mut r = rng(seed, stream);
    (0..size).map(|_| ints(&mut r, n)).collect()
}

fn sum(all: &[Vec<f32>]) -> Vec<f32> {
    (0..all[0].len()).map(|i| all.iter().map(|v| v[i]).sum()).collect()
}

/// Buckets of a gradient started one by one, kept, and waited in reverse order (a DDP step).
fn stored_works(comm: &Comm, seed: u64) -> usize {
    let (me, size) = (comm.rank(), comm.size());
    let lens = [1usize, 37, 4096, 0, 70_000];
    let all: Vec<Vec<Vec<f32>>> = lens
        .iter()
        .enumerate()
        .map(|(b, &n)| inputs(seed, 900 + b as u64, size, n))
        .collect();
    let mut works: Vec<Work<Vec<f32>>> = all
        .iter()
        .map(|bucket| comm.owned().all_reduce(bucket[me].clone(), ReduceOp::Sum).unwrap())
        .collect();
    // Computation while the buckets reduce; then the optimizer waits, last bucket first.
    let mut b = works.len();
    while let Some(w) = works.pop() {
        b -= 1;
        assert_eq!(w.wait().unwrap(), sum(&all[b]), "owned all_reduce of bucket {b}");
    }
    lens.len()
}

/// A work moved to another thread and waited there; another polled until it completes.
fn moved_and_polled(comm: &Comm, seed: u64) -> usize {
    let (me, size) = (comm.rank(), comm.size());
    let all = inputs(seed, 950, size, 1000);
    let w = comm.owned().all_reduce(all[me].clone(), ReduceOp::Max).unwrap();
    let got = std::thread::spawn(move || w.wait().unwrap()).join().unwrap();
    let max: Vec<f32> = (0..1000)
        .map(|i| all.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
        .collect();
    assert_eq!(got, max, "owned all_reduce(max) waited on another thread");

    let w = comm
        .owned()
        .all_gather(vec![0f32; 3 * size], all[me][..3].to_vec())
        .unwrap();
    let deadline = Instant::now() + comm.timeout();
    while !w.is_completed() {
        assert!(Instant::now() < deadline, "is_completed never became true");
        std::thread::yield_now();
    }
    w.wait_timeout(Duration::from_millis(1)).unwrap();
    let (out, input) = w.wait().unwrap();
    let want: Vec<f32> = all.iter().flat_map(|v| v[..3].to_vec()).collect();
    assert_eq!((out, input), (want, all[me][..3].to_vec()), "owned all_gather");
    2
}

/// `wait_timeout` before the peer has sent is a Timeout (the work goes on); `wait` then gets
/// the data. (The sender only sleeps: the receiver's queued recv holds its communicator's
/// issue order, so nothing it issued later could tell the sender to go.)
fn wait_timeout_then_wait(comm: &Comm) -> usize {
    comm.barrier().unwrap();
    if comm.size() < 2 || comm.rank() > 1 {
        comm.barrier().unwrap();
        return 1;
    }
    if comm.rank() == 0 {
        let w = comm.owned().recv(vec![0u64; 9], 1).unwrap();
        match w.wait_timeout(Duration::from_millis(5)) {
            Err(Error::Timeout { op: "recv", .. }) => {}
            other => panic!("wait_timeout before the send: {other:?}"),
        }
        assert!(!w.is_completed());
        assert_eq!(w.wait().unwrap(), vec![42u64; 9]);
    } else {
        std::thread::sleep(Duration::from_millis(800));
        comm.send(&[42u64; 9], 0).unwrap();
    }
    comm.barrier().unwrap();
    1
}

/// A receive buffer that checks, as it is freed, that the message had arrived: a `Work`
/// dropped unwaited must wait for its operation before it frees the buffers.
struct Probe {
    data: Vec<u32>,
    freed: Arc<AtomicUsize>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        assert!(
            self.data.iter().all(|&x| x == 7),
            "a dropped Work freed its buffer before the message arrived"
        );
        self.freed.fetch_add(1, Ordering::SeqCst);
    }
}

fn drop_waits(comm: &Comm) -> usize {
    comm.barrier().unwrap();
    if comm.size() < 2 || comm.rank() > 1 {
        comm.barrier().unwrap();
        return 1;
    }
    if comm.rank() == 0 {
        let freed = Arc::new(AtomicUsize::new(0));
        let probe = Probe {
            data: vec![0; 5000],
            freed: freed.clone(),
        };
        let w = comm.start(probe, |s, p| s.recv(&mut p.data, 1)).unwrap();
        drop(w);
        assert_eq!(
            freed.load(Ordering::SeqCst),
            1,
            "the dropped Work did not free its buffers"
        );
    } else {
        std::thread::sleep(Duration::from_millis(100));
        comm.send(&vec![7u32; 5000], 0).unwrap();
    }
    comm.barrier().unwrap();
    1
}

/// Every owned call gives the borrowed call's result; `start` runs several calls as one Work.
fn every_owned_call(comm: &Comm, seed: u64) -> usize {
    let (me, size) = (comm.rank(), comm.size());
    let o = comm.owned().with_options(OpOptions::new().timeout(comm.timeout()));
    let all = inputs(seed, 970, size, 6 * size);
    let mine = all[me].clone();
    let total = sum(&all);

    assert_eq!(o.reduce(mine.clone(), ReduceOp::Sum, 0).unwrap().wait().unwrap(), {
        if me == 0 {
            total.clone()
        } else {
            mine.clone()
        }
    });
    let root = size - 1;
    assert_eq!(o.broadcast(mine.clone(), root).unwrap().wait().unwrap(), all[root]);

    let k = 6;
    let (block, _) = o
        .reduce_scatter(vec![0f32; k], mine.clone(), ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(block, total[me * k..(me + 1) * k]);
    let parts: Vec<Vec<f32>> = mine.chunks(k).map(|c| c.to_vec()).collect();
    let (block, _) = o
        .reduce_scatter_list(vec![0f32; k], parts, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(block, total[me * k..(me + 1) * k]);

    // all_to_all: block q of my output is rank q's block me.
    let (out, _) = o
        .all_to_all(vec![0f32; k * size], mine.clone())
        .unwrap()
        .wait()
        .unwrap();
    let want: Vec<f32> = (0..size).flat_map(|q| all[q][me * k..(me + 1) * k].to_vec()).collect();
    assert_eq!(out, want);
    let ins: Vec<Vec<f32>> = mine.chunks(k).map(|c| c.to_vec()).collect();
    let outs = vec![vec![0f32; k]; size];
    let (outs, _) = o.all_to_all_list(outs, ins).unwrap().wait().unwrap();
    assert_eq!(outs.concat(), want);
    let counts = vec![k; size];
    let (out, _) = o
        .all_to_all_v(vec![0f32; k * size], mine.clone(), &counts, &counts)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(out, want);

    // v-forms and lists of all_gather / reduce_scatter.
    let counts: Vec<usize> = (0..size).map(|q| q % 3 + 1).collect();
    let offset = |q: usize| counts[..q].iter().sum::<usize>();
    let (out, _) = o
        .all_gather_v(vec![0f32; offset(size)], all[me][..counts[me]].to_vec(), &counts)
        .unwrap()
        .wait()
        .unwrap();
    let want: Vec<f32> = (0..size).flat_map(|q| all[q][..counts[q]].to_vec()).collect();
    assert_eq!(out, want);
    let outs: Vec<Vec<f32>> = counts.iter().map(|&c| vec![0f32; c]).collect();
    let (outs, _) = o
        .all_gather_list(outs, all[me][..counts[me]].to_vec())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(outs.concat(), want);
    let input = mine[..offset(size)].to_vec();
    let (block, _) = o
        .reduce_scatter_v(vec![0f32; counts[me]], input, &counts, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(block, total[offset(me)..offset(me) + counts[me]]);

    // scatter / gather from root.
    let input = (me == root).then(|| mine.clone());
    let (part, _) = o.scatter(vec![0f32; 6], input, root).unwrap().wait().unwrap();
    assert_eq!(part, all[root][me * 6..(me + 1) * 6]);
    let output = (me == root).then(|| vec![0f32; 2 * size]);
    let (gathered, _) = o.gather(output, mine[..2].to_vec(), root).unwrap().wait().unwrap();
    if me == root {
        let want: Vec<f32> = (0..size).flat_map(|q| all[q][..2].to_vec()).collect();
        assert_eq!(gathered.unwrap(), want);
    }

    // A ring of owned buffers in one batch, and a barrier.
    let (right, left) = ((me + 1) % size, (me + size - 1) % size);
    let got = o
        .batch()
        .send(mine.clone(), right)
        .recv(vec![0f32; mine.len()], left)
        .issue()
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(got[1], all[left]);
    o.barrier().unwrap().wait().unwrap();

    // Several calls in one Work: all_gather then broadcast, in issue order.
    let w = comm
        .start(
            (vec![0f32; size], vec![mine[0]], mine.clone()),
            |s, (all_first, first, b)| {
                s.all_gather(all_first, &*first)?;
                s.broadcast(b, 0)
            },
        )
        .unwrap();
    let (all_first, _, b) = w.wait().unwrap();
    assert_eq!(all_first, all.iter().map(|v| v[0]).collect::<Vec<_>>());
    assert_eq!(b, all[0]);

    // The fused norm: the owned call gives the borrowed call's bits.
    let hidden = 3;
    let x: Vec<f32> = mine[..2 * hidden].iter().map(|v| v / 1000.0).collect();
    let residual = vec![0.5f32; 2 * hidden];
    let gamma = vec![1.25f32; hidden];
    let (mut r_ref, mut y_ref) = (residual.clone(), vec![0f32; 2 * hidden]);
    comm.all_reduce_residual_rmsnorm(&x, &mut r_ref, &gamma, &mut y_ref, 1e-6)
        .unwrap();
    let (_, r, _, y) = o
        .all_reduce_residual_rmsnorm(x, residual, gamma, vec![0f32; 2 * hidden], 1e-6)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!((r, y), (r_ref, y_ref), "owned fused norm");
    15
}

/// Local errors come back at once (nothing is queued, no rank waits), and the communicator
/// goes on.
fn errors(comm: &Comm) -> usize {
    let size = comm.size();
    match comm.owned().all_gather(vec![0f32; size + 1], vec![1f32]) {
        Err(Error::SizeMismatch { .. }) => {}
        other => panic!("owned all_gather of a wrong size: {other:?}"),
    }
    match comm.owned().send(vec![1u8], size) {
        Err(Error::InvalidRank { .. }) => {}
        other => panic!("owned send to rank {size}: {other:?}"),
    }
    match comm.owned().all_reduce(vec![1.5f32], ReduceOp::BAnd) {
        Err(Error::UnsupportedReduce { .. }) => {}
        other => panic!("owned bitwise all_reduce of f32: {other:?}"),
    }
    // A failure inside `start` after a queued call: that call still runs (every rank makes it)
    // and the error is returned.
    let r = comm.start((vec![1i64; 4], vec![0u8]), |s, (a, b)| {
        s.all_reduce(a, ReduceOp::Sum)?;
        s.send(&*b, size)
    });
    assert!(matches!(r, Err(Error::InvalidRank { .. })), "{r:?}");
    let b = comm
        .owned()
        .all_reduce(vec![2i64; 4], ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(b, vec![2 * size as i64; 4]);
    5
}

/// The whole owned-work suite; returns the number of checked calls.
pub fn on_comm(comm: &Comm, seed: u64) -> usize {
    stored_works(comm, seed)
        + moved_and_polled(comm, seed)
        + wait_timeout_then_wait(comm)
        + drop_waits(comm)
        + every_owned_call(comm, seed)
        + errors(comm)
}
