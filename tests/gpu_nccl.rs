//! The `nccl` backend and the device backend's routes on a GPU: every operation on device
//! buffers against the CPU backend, graph capture and replay, asynchronous work, split, the
//! device backend with and without NCCL, and the fused norm around NCCL's all_reduce. Each test skips with a reason where there is no GPU
//! (or no NCCL); FERROCOMM_REQUIRE_GPU=1 turns a skip into a failure.
//!
//! NCCL refuses two ranks on one GPU, so its communicators here have one rank; the device
//! backend's own path runs several ranks on one GPU.

mod common;

use common::gpu::norm_on_gpu;
use common::inference_suite::check_norm;
use common::*;
use ferrocomm::device::cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr};
use ferrocomm::device::{self, DeviceSlice, DeviceSliceMut};
use ferrocomm::{bf16, f16, Error, OpOptions};
use std::sync::Arc;

fn require_gpu() -> bool {
    std::env::var("FERROCOMM_REQUIRE_GPU").as_deref() == Ok("1")
}

fn nccl_or_skip() -> bool {
    if !gpu_or_skip() {
        return false;
    }
    match device::nccl_library() {
        Ok(_) => true,
        Err(e) => {
            assert!(!require_gpu(), "FERROCOMM_REQUIRE_GPU=1 but {e}");
            eprintln!("SKIPPED: no NCCL: {e}");
            false
        }
    }
}

fn stream() -> Arc<CudaStream> {
    device::new_stream(0).unwrap()
}

fn bytes_of<T: Element>(v: &[T]) -> &[u8] {
    // SAFETY: ferrocomm's element types are plain numbers.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Device memory holding `n` elements of `T`, kept as bytes so that every element type works.
struct Dev<T> {
    mem: CudaSlice<u8>,
    n: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: TestElem + Clone> Dev<T> {
    fn upload(s: &Arc<CudaStream>, v: &[T]) -> Self {
        Dev {
            mem: s.clone_htod(bytes_of(v)).unwrap(),
            n: v.len(),
            _t: std::marker::PhantomData,
        }
    }
    fn poisoned(s: &Arc<CudaStream>, n: usize) -> Self {
        Self::upload(s, &vec![T::poison(); n])
    }
    fn ptr(&self, s: &Arc<CudaStream>) -> u64 {
        self.mem.device_ptr(s).0
    }
    fn view(&self, s: &Arc<CudaStream>) -> DeviceSlice<'_, T> {
        // SAFETY: `mem` holds n elements of T on GPU 0 and is borrowed for the view's life.
        unsafe { DeviceSlice::from_raw(0, self.ptr(s), self.n) }.unwrap()
    }
    fn view_mut(&mut self, s: &Arc<CudaStream>) -> DeviceSliceMut<'_, T> {
        let p = self.ptr(s);
        // SAFETY: as above, borrowed mutably.
        unsafe { DeviceSliceMut::from_raw(0, p, self.n) }.unwrap()
    }
    fn download(&self, s: &Arc<CudaStream>) -> Vec<T> {
        let bytes = s.clone_dtoh(&self.mem).unwrap();
        s.synchronize().unwrap();
        let mut out = vec![T::default(); self.n];
        // SAFETY: `bytes` holds n elements of T (bools are 0 or 1: moved, or NCCL's min and
        // max of 0 and 1).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr().cast(), bytes.len()) };
        out
    }
}

fn one_rank(backend: &str, name: &str) -> Comm {
    Comm::new_group(backend, &[Device::Cuda(0)], name, options(Duration::from_secs(60)))
        .unwrap()
        .pop()
        .unwrap()
}

fn cpu_rank(name: &str) -> Comm {
    Comm::new_group("cpu", &[Device::Cpu], name, options(Duration::from_secs(60)))
        .unwrap()
        .pop()
        .unwrap()
}

/// Whether the nccl backend reduces `d` with `op`: no bitwise ops (but bool's and / or, which
/// are its min / max), nothing on i16 or u16 (NCCL has no type for them).
fn nccl_reduces(d: DType, op: ReduceOp) -> bool {
    match d {
        DType::I16 | DType::U16 => false,
        DType::Bool => op != ReduceOp::BXor,
        _ => !op.is_bitwise(),
    }
}

/// Every operation of a one-rank communicator on device buffers, against the CPU backend on
/// the same random data: results must be identical. Reductions the nccl backend lacks are
/// `UnsupportedReduce` there.
fn every_op_matches_cpu<T: TestElem + Clone>(gpu: &Comm, cpu: &Comm, s: &Arc<CudaStream>, seed: u64) {
    let n = 1000 + (seed % 37) as usize; // odd sizes too
    let mut r = rng(seed, T::DTYPE as u64);
    let _current = device::use_stream(s);
    let lacks = |op: ReduceOp| gpu.backend_name() == "nccl" && !nccl_reduces(T::DTYPE, op);
    for &op in ops_for::<T>() {
        let x: Vec<T> = random_vec(&mut r, n, Some(op));
        let mut dev = Dev::upload(s, &x);
        let mut host = x.clone();
        let got = gpu.all_reduce(dev.view_mut(s), op);
        if lacks(op) {
            assert!(matches!(got, Err(Error::UnsupportedReduce { .. })), "{op}: {got:?}");
            continue;
        }
        got.unwrap();
        cpu.all_reduce(&mut host, op).unwrap();
        assert_eq!(dev.download(s), host, "all_reduce {op} {:?}", T::DTYPE);
    }
    let x: Vec<T> = random_vec(&mut r, n, None);
    let check = |what: &str, dev: &Dev<T>, host: &[T]| assert_eq!(dev.download(s), host, "{what} {:?}", T::DTYPE);

    let (mut d, mut h) = (Dev::upload(s, &x), x.clone());
    gpu.broadcast(d.view_mut(s), 0).unwrap();
    cpu.broadcast(&mut h, 0).unwrap();
    check("broadcast", &d, &h);

    let (mut d, mut h) = (Dev::upload(s, &x), x.clone());
    if lacks(ReduceOp::Max) {
        let got = gpu.reduce(d.view_mut(s), ReduceOp::Max, 0);
        assert!(matches!(got, Err(Error::UnsupportedReduce { .. })), "reduce: {got:?}");
    } else {
        gpu.reduce(d.view_mut(s), ReduceOp::Max, 0).unwrap();
        cpu.reduce(&mut h, ReduceOp::Max, 0).unwrap();
        check("reduce", &d, &h);
    }

    let input = Dev::upload(s, &x);
    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.all_gather(d.view_mut(s), input.view(s)).unwrap();
    cpu.all_gather(&mut h, &x).unwrap();
    check("all_gather", &d, &h);

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.all_gather_v(d.view_mut(s), input.view(s), &[n]).unwrap();
    cpu.all_gather_v(&mut h, &x, &[n]).unwrap();
    check("all_gather_v", &d, &h);

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    if lacks(ReduceOp::Sum) {
        let got = gpu.reduce_scatter(d.view_mut(s), input.view(s), ReduceOp::Sum);
        assert!(
            matches!(got, Err(Error::UnsupportedReduce { .. })),
            "reduce_scatter: {got:?}"
        );
    } else {
        gpu.reduce_scatter(d.view_mut(s), input.view(s), ReduceOp::Sum).unwrap();
        cpu.reduce_scatter(&mut h, &x, ReduceOp::Sum).unwrap();
        check("reduce_scatter", &d, &h);
    }

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.all_to_all(d.view_mut(s), input.view(s)).unwrap();
    cpu.all_to_all(&mut h, &x).unwrap();
    check("all_to_all", &d, &h);

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.all_to_all_v(d.view_mut(s), input.view(s), &[n], &[n]).unwrap();
    cpu.all_to_all_v(&mut h, &x, &[n], &[n]).unwrap();
    check("all_to_all_v", &d, &h);

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.scatter(d.view_mut(s), Some(input.view(s)), 0).unwrap();
    cpu.scatter(&mut h, Some(&x), 0).unwrap();
    check("scatter", &d, &h);

    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.gather(Some(d.view_mut(s)), input.view(s), 0).unwrap();
    cpu.gather(Some(&mut h), &x, 0).unwrap();
    check("gather", &d, &h);

    // A batch that sends to and receives from the rank itself.
    let (mut d, mut h) = (Dev::<T>::poisoned(s, n), vec![T::poison(); n]);
    gpu.batch()
        .send(input.view(s), 0)
        .recv(d.view_mut(s), 0)
        .issue()
        .unwrap();
    cpu.batch().send(&x, 0).recv(&mut h, 0).issue().unwrap();
    check("batch send/recv", &d, &h);

    gpu.barrier().unwrap();
}

#[test]
fn gpu_nccl_every_op_matches_the_cpu_backend() {
    if !nccl_or_skip() {
        return;
    }
    let (gpu, cpu) = (one_rank("nccl", "nccl-ops"), cpu_rank("nccl-ops-ref"));
    let s = stream();
    let seed = fresh_seed();
    every_op_matches_cpu::<f32>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<f64>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<bf16>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<f16>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<i32>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<u8>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<i64>(&gpu, &cpu, &s, seed);
    // Moved as bytes (NCCL has no type for them); bool reduces as u8 min / max.
    every_op_matches_cpu::<bool>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<i16>(&gpu, &cpu, &s, seed);
    every_op_matches_cpu::<u16>(&gpu, &cpu, &s, seed);
    gpu.finalize().unwrap();
}

#[test]
fn gpu_device_backend_with_nccl_matches_the_cpu_backend_on_both_routes() {
    if !nccl_or_skip() {
        return;
    }
    let (gpu, cpu) = (one_rank("device", "dev-nccl"), cpu_rank("dev-nccl-ref"));
    let s = stream();
    let seed = fresh_seed();
    every_op_matches_cpu::<f32>(&gpu, &cpu, &s, seed);
    // The same calls forced onto the device backend's own path.
    let own = OpOptions::default().hint("route", "device");
    let x: Vec<i32> = random_vec(&mut rng(seed, 1), 4099, None);
    let mut d = Dev::upload(&s, &x);
    {
        let _current = device::use_stream(&s);
        gpu.with_options(own).all_reduce(d.view_mut(&s), ReduceOp::Sum).unwrap();
    }
    assert_eq!(d.download(&s), x);
}

#[test]
fn gpu_nccl_graph_capture_replays_the_collective() {
    if !nccl_or_skip() {
        return;
    }
    let comm = one_rank("nccl", "nccl-graph");
    let s = stream();
    let x: Vec<f32> = (0..4096).map(|i| (i % 7) as f32 - 3.0).collect();
    let mut d = Dev::upload(&s, &x);
    let graph = {
        let _current = device::use_stream(&s);
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        // One rank: premul_sum(2) doubles every element, so each replay is visible.
        comm.all_reduce(d.view_mut(&s), ReduceOp::PremulSum(2.0)).unwrap();
        s.end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap()
            .expect("a captured graph")
    };
    // Capture recorded the work without running it.
    assert_eq!(d.download(&s), x);
    for _ in 0..100 {
        graph.launch().unwrap();
    }
    s.synchronize().unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 2f32.powi(100)).collect();
    assert_eq!(d.download(&s), want);
}

#[test]
fn gpu_nccl_async_work_orders_the_waiting_stream() {
    if !nccl_or_skip() {
        return;
    }
    let comm = one_rank("nccl", "nccl-async");
    let s = stream();
    let x: Vec<f32> = random_vec(&mut rng(fresh_seed(), 2), 1 << 20, None);
    let mut d = Dev::upload(&s, &x);
    let _current = device::use_stream(&s);
    comm.scope(|scope| {
        let w = scope.all_reduce(d.view_mut(&s), ReduceOp::PremulSum(4.0)).unwrap();
        w.wait().unwrap();
    });
    // The download is on `s`, which the wait ordered after the operation.
    let want: Vec<f32> = x.iter().map(|v| v * 4.0).collect();
    assert_eq!(d.download(&s), want);
}

/// An owned Work on a cudarc allocation: kept past the call, waited on another thread (which
/// then orders its own stream), and one dropped unwaited frees its allocation only once the
/// GPU is done with it.
#[test]
fn gpu_nccl_owned_work_hands_device_buffers_back() {
    if !nccl_or_skip() {
        return;
    }
    let comm = one_rank("nccl", "nccl-owned");
    let s = stream();
    let x: Vec<f32> = random_vec(&mut rng(fresh_seed(), 3), 1 << 20, None);
    let work = {
        let _current = device::use_stream(&s);
        comm.owned()
            .all_reduce(s.clone_htod(&x).unwrap(), ReduceOp::PremulSum(2.0))
            .unwrap()
    };
    let s2 = s.clone();
    let back = std::thread::spawn(move || {
        let _current = device::use_stream(&s2);
        let d = work.wait().unwrap();
        s2.clone_dtoh(&d).unwrap()
    })
    .join()
    .unwrap();
    let want: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    assert_eq!(back, want);
    for _ in 0..20 {
        let _current = device::use_stream(&s);
        drop(
            comm.owned()
                .all_reduce(s.clone_htod(&x).unwrap(), ReduceOp::Sum)
                .unwrap(),
        );
    }
    s.synchronize().unwrap();
}

#[test]
fn gpu_nccl_split_makes_a_working_sub_communicator() {
    if !nccl_or_skip() {
        return;
    }
    let comm = one_rank("nccl", "nccl-split");
    let child = comm
        .split(&[0], "nccl-split-child")
        .unwrap()
        .expect("rank 0 is in the group");
    assert_eq!((child.rank(), child.size()), (0, 1));
    let s = stream();
    let x: Vec<i32> = random_vec(&mut rng(fresh_seed(), 3), 513, None);
    let mut d = Dev::upload(&s, &x);
    let _current = device::use_stream(&s);
    child.all_reduce(d.view_mut(&s), ReduceOp::PremulSum(3.0)).unwrap();
    let want: Vec<i32> = x.iter().map(|v| v.wrapping_mul(3)).collect();
    assert_eq!(d.download(&s), want);
    // Host buffers of an NCCL communicator run on its CPU engine.
    let mut h = [5u64, 6];
    child.all_reduce(&mut h, ReduceOp::Sum).unwrap();
    assert_eq!(h, [5, 6]);
}

/// Four ranks on one GPU: NCCL cannot serve them, so the device backend takes its own path.
#[test]
fn gpu_device_backend_without_nccl_runs_ranks_that_share_a_gpu() {
    if !gpu_or_skip() {
        return;
    }
    let n = 4;
    let seed = fresh_seed();
    let comms = Comm::new_group(
        "device",
        &[Device::Cuda(0); 4],
        "dev-shared",
        options(Duration::from_secs(60)),
    )
    .unwrap();
    let count = 3001;
    let inputs: Vec<Vec<i64>> = (0..n)
        .map(|r| random_vec(&mut rng(seed, r as u64), count, None))
        .collect();
    std::thread::scope(|sc| {
        for (c, mine) in comms.iter().zip(&inputs) {
            let inputs = &inputs;
            sc.spawn(move || {
                let s = stream();
                let _current = device::use_stream(&s);
                let mut d = Dev::upload(&s, mine);
                c.all_reduce(d.view_mut(&s), ReduceOp::Sum).unwrap();
                let want: Vec<i64> = (0..count)
                    .map(|i| inputs.iter().fold(0i64, |a, v| a.wrapping_add(v[i])))
                    .collect();
                assert_eq!(d.download(&s), want, "rank {} all_reduce", c.rank());

                let input = Dev::upload(&s, mine);
                let mut out = Dev::<i64>::poisoned(&s, count * n);
                c.all_gather(out.view_mut(&s), input.view(&s)).unwrap();
                assert_eq!(out.download(&s), inputs.concat(), "rank {} all_gather", c.rank());
            });
        }
    });
}

/// The fused norm where NCCL carries the sum: the `nccl` backend (its only way), and the device
/// backend with the hint `route` = `nccl`, each as widen + ncclAllReduce + the norm kernel.
/// One rank (NCCL refuses two on one GPU): the reference, and the same bits as the device
/// backend's fused kernel (a one-rank sum is exact either way).
#[test]
fn gpu_fused_norm_through_nccl_matches_the_fused_kernels() {
    if !nccl_or_skip() {
        return;
    }
    let seed = fresh_seed();
    let s = stream();
    let _current = device::use_stream(&s);
    for (rows, fp8) in [((4, 4096), false), ((33, 7168), true), ((3, 129), false)] {
        let fused = norm_on_gpu::<bf16>(&one_rank("device", "norm-fused"), &s, seed, rows, &[], fp8);
        check_norm(1, seed, rows, fp8, &fused);
        for (backend, hints) in [("nccl", &[][..]), ("device", &[("route", "nccl")][..])] {
            let c = one_rank(backend, &format!("norm-{backend}"));
            let got = norm_on_gpu::<bf16>(&c, &s, seed, rows, hints, fp8);
            assert_eq!(
                got, fused,
                "{backend} {rows:?} fp8 {fp8}: NCCL's sum and the norm kernel"
            );
        }
    }
}
