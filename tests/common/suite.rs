//! Every collective × dtype × reduce op × algorithm on one communicator, random data each
//! time, outputs poisoned first, results checked against a host reference. Every rank draws
//! every rank's inputs from the same seed, so each can compute the reference on its own.

use super::*;
use ferrocomm::{bf16, f16, F8E4M3, F8E5M2};

struct Ctx<'c> {
    comm: &'c Comm,
    seed: u64,
    stream: u64,
    checks: usize,
}

impl Ctx<'_> {
    fn next(&mut self) -> StdRng {
        self.stream += 1;
        rng(self.seed, self.stream)
    }
}

fn all_inputs<T: TestElem>(r: &mut StdRng, n: usize, count: usize, op: Option<ReduceOp>) -> Vec<Vec<T>> {
    (0..n).map(|_| random_vec(r, count, op)).collect()
}

fn counts(r: &mut StdRng, n: usize) -> Vec<usize> {
    (0..n).map(|_| r.gen_range(0..12)).collect()
}

fn check_all<T: TestElem>(what: &str, inputs: &[Vec<T>], op: ReduceOp, got: &[T], offset: usize) {
    for (i, g) in got.iter().enumerate() {
        let col: Vec<T> = inputs.iter().map(|v| v[offset + i]).collect();
        if let Err(e) = T::check_reduced(&col, op, *g) {
            panic!("{what} {} element {i}: {e}", T::DTYPE);
        }
    }
}

fn reductions<T: TestElem>(cx: &mut Ctx, algo: &OpOptions) {
    let c = cx.comm.with_options(algo.clone());
    let (n, me) = (cx.comm.size(), cx.comm.rank());
    for &op in ops_for::<T>() {
        let mut r = cx.next();
        let count = r.gen_range(0..40);
        let inputs = all_inputs::<T>(&mut r, n, count, Some(op));

        // all_reduce, and every rank ends with bit-identical results.
        let mut buf = inputs[me].clone();
        c.all_reduce(&mut buf, op).unwrap();
        check_all("all_reduce", &inputs, op, &buf, 0);
        let mut everyone = vec![T::poison(); count * n];
        cx.comm.all_gather(&mut everyone, &buf).unwrap();
        for q in 0..n {
            assert!(
                everyone[q * count..(q + 1) * count] == buf[..],
                "all_reduce results differ between ranks ({op})"
            );
        }

        // reduce: only the root's buffer changes.
        let root = r.gen_range(0..n);
        let mut buf = inputs[me].clone();
        c.reduce(&mut buf, op, root).unwrap();
        if me == root {
            check_all("reduce", &inputs, op, &buf, 0);
        } else {
            assert!(buf == inputs[me], "reduce changed a non-root buffer");
        }

        // reduce_scatter, single buffer.
        let big = all_inputs::<T>(&mut r, n, count * n, Some(op));
        let mut out = vec![T::poison(); count];
        c.reduce_scatter(&mut out, &big[me], op).unwrap();
        check_all("reduce_scatter", &big, op, &out, me * count);

        // reduce_scatter_v and the list form, with uneven blocks.
        let cnt = counts(&mut r, n);
        let total: usize = cnt.iter().sum();
        let off: usize = cnt[..me].iter().sum();
        let vin = all_inputs::<T>(&mut r, n, total, Some(op));
        let mut out = vec![T::poison(); cnt[me]];
        c.reduce_scatter_v(&mut out, &vin[me], &cnt, op).unwrap();
        check_all("reduce_scatter_v", &vin, op, &out, off);
        let mut out = vec![T::poison(); cnt[me]];
        let mut rest = &vin[me][..];
        let list: Vec<&[T]> = cnt
            .iter()
            .map(|&k| {
                let (a, b) = rest.split_at(k);
                rest = b;
                a
            })
            .collect();
        c.reduce_scatter_list(&mut out, list, op).unwrap();
        check_all("reduce_scatter_list", &vin, op, &out, off);
        cx.checks += 6;
    }
}

fn movement<T: TestElem>(cx: &mut Ctx, algo: &OpOptions) {
    let c = cx.comm.with_options(algo.clone());
    let (n, me) = (cx.comm.size(), cx.comm.rank());
    let mut r = cx.next();
    let count = r.gen_range(0..50);
    let inputs = all_inputs::<T>(&mut r, n, count, None);
    let concat = |v: &[Vec<T>]| v.concat();

    let mut out = vec![T::poison(); count * n];
    c.all_gather(&mut out, &inputs[me]).unwrap();
    assert!(out == concat(&inputs), "all_gather");

    let cnt = counts(&mut r, n);
    let vin: Vec<Vec<T>> = (0..n).map(|q| random_vec(&mut r, cnt[q], None)).collect();
    let mut out = vec![T::poison(); cnt.iter().sum()];
    c.all_gather_v(&mut out, &vin[me], &cnt).unwrap();
    assert!(out == concat(&vin), "all_gather_v");
    let mut outs: Vec<Vec<T>> = cnt.iter().map(|&k| vec![T::poison(); k]).collect();
    c.all_gather_list(outs.iter_mut().map(|o| &mut o[..]).collect(), &vin[me])
        .unwrap();
    assert!(outs == vin, "all_gather_list");

    // all_to_all: block (src -> dst) is inputs[src][dst*count..].
    let a2a = all_inputs::<T>(&mut r, n, count * n, None);
    let mut out = vec![T::poison(); count * n];
    c.all_to_all(&mut out, &a2a[me]).unwrap();
    let want: Vec<T> = (0..n)
        .flat_map(|src| a2a[src][me * count..(me + 1) * count].to_vec())
        .collect();
    assert!(out == want, "all_to_all");

    // all_to_all_v: sizes[src][dst] elements go from src to dst.
    let sizes: Vec<Vec<usize>> = (0..n).map(|_| counts(&mut r, n)).collect();
    let blocks: Vec<Vec<Vec<T>>> = (0..n)
        .map(|src| (0..n).map(|dst| random_vec(&mut r, sizes[src][dst], None)).collect())
        .collect();
    let input: Vec<T> = blocks[me].concat();
    let recv_counts: Vec<usize> = (0..n).map(|src| sizes[src][me]).collect();
    let mut out = vec![T::poison(); recv_counts.iter().sum()];
    c.all_to_all_v(&mut out, &input, &recv_counts, &sizes[me]).unwrap();
    let want: Vec<T> = (0..n).flat_map(|src| blocks[src][me].clone()).collect();
    assert!(out == want, "all_to_all_v");
    let mut outs: Vec<Vec<T>> = recv_counts.iter().map(|&k| vec![T::poison(); k]).collect();
    c.all_to_all_list(
        outs.iter_mut().map(|o| &mut o[..]).collect(),
        blocks[me].iter().map(|b| &b[..]).collect(),
    )
    .unwrap();
    let want: Vec<Vec<T>> = (0..n).map(|src| blocks[src][me].clone()).collect();
    assert!(outs == want, "all_to_all_list");

    let root = r.gen_range(0..n);
    let mut buf = if me == root {
        inputs[root].clone()
    } else {
        vec![T::poison(); count]
    };
    c.broadcast(&mut buf, root).unwrap();
    assert!(buf == inputs[root], "broadcast");

    let mut out = vec![T::poison(); count];
    let whole = &a2a[root];
    c.scatter(&mut out, (me == root).then_some(&whole[..]), root).unwrap();
    assert!(out[..] == whole[me * count..(me + 1) * count], "scatter");

    let mut gathered = vec![T::poison(); count * n];
    c.gather((me == root).then_some(&mut gathered[..]), &inputs[me], root)
        .unwrap();
    if me == root {
        assert!(gathered == concat(&inputs), "gather");
    }

    // A ring of plain send/recv (even ranks send first, odd ranks receive first).
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let mut got = vec![T::poison(); count];
    if n > 1 {
        if me % 2 == 0 {
            c.send(&inputs[me], right).unwrap();
            c.recv(&mut got, left).unwrap();
        } else {
            c.recv(&mut got, left).unwrap();
            c.send(&inputs[me], right).unwrap();
        }
        assert!(got == inputs[left], "send/recv ring");
    }
    // A batch with receives listed first, in both directions, plus a message to ourselves.
    let (mut from_left, mut from_right, mut from_me) = (
        vec![T::poison(); count],
        vec![T::poison(); count],
        vec![T::poison(); count],
    );
    c.batch()
        .recv(&mut from_left, left)
        .recv(&mut from_right, right)
        .recv(&mut from_me, me)
        .send(&inputs[me], right)
        .send(&inputs[me], left)
        .send(&inputs[me], me)
        .issue()
        .unwrap();
    assert!(
        from_left == inputs[left] && from_right == inputs[right] && from_me == inputs[me],
        "batch"
    );

    c.barrier().unwrap();
    cx.checks += 13;
}

fn one_dtype<T: TestElem>(cx: &mut Ctx, algos: &[OpOptions]) {
    for a in algos {
        reductions::<T>(cx, a);
        movement::<T>(cx, a);
    }
}

/// Runs the whole suite on `comm`; returns the number of checked calls.
pub fn run_all(comm: &Comm, seed: u64) -> usize {
    let algos = [
        OpOptions::new().hint("algorithm", "direct"),
        OpOptions::new().hint("algorithm", "ring"),
        OpOptions::new(),
    ];
    let mut cx = Ctx {
        comm,
        seed,
        stream: 0,
        checks: 0,
    };
    one_dtype::<f32>(&mut cx, &algos);
    one_dtype::<f64>(&mut cx, &algos);
    one_dtype::<f16>(&mut cx, &algos);
    one_dtype::<bf16>(&mut cx, &algos);
    one_dtype::<i8>(&mut cx, &algos);
    one_dtype::<u8>(&mut cx, &algos);
    one_dtype::<i32>(&mut cx, &algos);
    one_dtype::<i64>(&mut cx, &algos);
    one_dtype::<u32>(&mut cx, &algos);
    one_dtype::<u64>(&mut cx, &algos);
    one_dtype::<bool>(&mut cx, &algos);
    one_dtype::<i16>(&mut cx, &algos);
    one_dtype::<u16>(&mut cx, &algos);
    one_dtype::<F8E4M3>(&mut cx, &algos);
    one_dtype::<F8E5M2>(&mut cx, &algos);
    cx.checks + super::inference_suite::on_comm(comm, seed) + super::owned_suite::on_comm(comm, seed)
}
