//! A data-parallel training step, as PyTorch's DistributedDataParallel runs it: the backward
//! pass computes each layer's gradient from the last layer to the first, and whenever a bucket
//! of about 1 MiB of gradients is full it starts that bucket's all_reduce (average) at once,
//! with [`Comm::owned`], and keeps the [`Work`]; the next layers' gradients are computed while
//! the bucket travels. The optimizer step waits for every stored work, takes the averaged
//! bucket back and applies it. Every averaged gradient is checked against the exact average,
//! and the step time is compared with the same step run without overlap (compute every
//! gradient, then all_reduce each bucket).
//!
//! `cargo run --example ddp_overlap` runs 4 ranks as threads of this process;
//! `ferrocomm-run -n 4 -- target/debug/examples/ddp_overlap` runs them as 4 processes.
//!
//! The gradients are whole numbers times the number of ranks (f32 arithmetic on small whole
//! numbers is exact), so the average, the sum divided by that number, is exact too and the
//! check compares with `==`.

use ferrocomm::prelude::*;
use std::time::{Duration, Instant};

/// Layers of the model.
const LAYERS: usize = 16;
/// Parameters per layer (256 KiB of f32 gradients).
const LAYER_PARAMS: usize = 64 * 1024;
/// A bucket's all_reduce starts once it holds this many bytes of gradients.
const BUCKET_BYTES: usize = 1 << 20;
/// Training steps in each mode.
const STEPS: usize = 3;
/// Rounds of arithmetic per gradient element: the backward pass's "compute".
const WORK: u32 = 2;
/// The fake gradients are whole numbers below this.
const MODULUS: f32 = 251.0;
/// The optimizer's learning rate (a power of two: the update is exact).
const LR: f32 = 0.5;

/// The part of a gradient element that every rank computes alike: a few rounds of f32
/// arithmetic on whole numbers below `MODULUS`, exact in f32.
fn base(step: usize, layer: usize, i: usize) -> f32 {
    let mut x = ((step * 31 + layer * 17 + i) % 251) as f32;
    for _ in 0..WORK {
        x = (x * 3.0 + 1.0) % MODULUS;
    }
    x
}

/// Rank `rank`'s gradient of `layer` at `step`, appended to `bucket`: `size × (base + rank)`,
/// so the average over the ranks is `size × base + size (size - 1) / 2`, a whole number.
fn backward(step: usize, layer: usize, rank: usize, size: usize, bucket: &mut Vec<f32>) {
    let (size_f, rank_f) = (size as f32, rank as f32);
    bucket.extend((0..LAYER_PARAMS).map(|i| size_f * (base(step, layer, i) + rank_f)));
}

/// One bucket: the layers whose gradients it holds, in the order they were appended.
struct Bucket {
    layers: Vec<usize>,
    grads: Vec<f32>,
}

/// The model's parameters, one vector per layer.
struct Model {
    params: Vec<Vec<f32>>,
}

impl Model {
    fn new() -> Self {
        Model {
            params: vec![vec![0.0; LAYER_PARAMS]; LAYERS],
        }
    }

    /// The optimizer step for one averaged bucket: `param -= LR × grad`.
    fn apply(&mut self, bucket: &Bucket) {
        for (k, &layer) in bucket.layers.iter().enumerate() {
            let grads = &bucket.grads[k * LAYER_PARAMS..(k + 1) * LAYER_PARAMS];
            for (p, g) in self.params[layer].iter_mut().zip(grads) {
                *p -= LR * g;
            }
        }
    }
}

/// The exact average over `size` ranks of element `i` of `layer`'s gradient at `step`.
fn average(step: usize, layer: usize, i: usize, size: usize) -> f32 {
    size as f32 * base(step, layer, i) + (size * (size - 1) / 2) as f32
}

/// Checks every averaged gradient of `bucket` against the exact average (panics on a wrong one).
fn check(step: usize, size: usize, bucket: &Bucket) {
    for (k, &layer) in bucket.layers.iter().enumerate() {
        let grads = &bucket.grads[k * LAYER_PARAMS..(k + 1) * LAYER_PARAMS];
        for (i, &g) in grads.iter().enumerate() {
            let want = average(step, layer, i, size);
            assert!(
                g == want,
                "step {step}, layer {layer}, element {i}: averaged gradient {g}, expected {want}"
            );
        }
    }
}

/// The backward pass, cutting the gradients into buckets of `BUCKET_BYTES`; `full` is called
/// with each bucket as soon as it is full (the last one may be smaller).
fn backward_pass(
    step: usize,
    comm: &Comm,
    mut full: impl FnMut(Bucket) -> ferrocomm::Result<()>,
) -> ferrocomm::Result<()> {
    let per_bucket = BUCKET_BYTES / std::mem::size_of::<f32>();
    let mut bucket = Bucket {
        layers: Vec::new(),
        grads: Vec::with_capacity(per_bucket),
    };
    for layer in (0..LAYERS).rev() {
        backward(step, layer, comm.rank(), comm.size(), &mut bucket.grads);
        bucket.layers.push(layer);
        if bucket.grads.len() >= per_bucket {
            let next = Bucket {
                layers: Vec::new(),
                grads: Vec::with_capacity(per_bucket),
            };
            full(std::mem::replace(&mut bucket, next))?;
        }
    }
    if !bucket.layers.is_empty() {
        full(bucket)?;
    }
    Ok(())
}

/// What one step took and left.
struct Step {
    /// From the first gradient to the last parameter update (the check excluded).
    took: Duration,
    /// The buckets' all_reduces that had already completed when the backward pass ended.
    done_early: usize,
    /// The averaged buckets.
    buckets: Vec<Bucket>,
}

/// One step with overlap: each full bucket's all_reduce starts during the backward pass; the
/// optimizer step waits for the stored works.
fn step_overlapped(comm: &Comm, step: usize, model: &mut Model) -> ferrocomm::Result<Step> {
    let t0 = Instant::now();
    let mut works: Vec<(Vec<usize>, Work<Vec<f32>>)> = Vec::new();
    backward_pass(step, comm, |b| {
        let work = comm.owned().all_reduce(b.grads, ReduceOp::Avg)?;
        works.push((b.layers, work));
        Ok(())
    })?;
    let done_early = works.iter().filter(|(_, w)| w.is_completed()).count();
    let mut averaged = Vec::with_capacity(works.len());
    for (layers, work) in works {
        let bucket = Bucket {
            layers,
            grads: work.wait()?,
        };
        model.apply(&bucket);
        averaged.push(bucket);
    }
    Ok(Step {
        took: t0.elapsed(),
        done_early,
        buckets: averaged,
    })
}

/// The same step without overlap: the whole backward pass, then one blocking all_reduce per
/// bucket, then the optimizer step.
fn step_sequential(comm: &Comm, step: usize, model: &mut Model) -> ferrocomm::Result<Step> {
    let t0 = Instant::now();
    let mut buckets = Vec::new();
    backward_pass(step, comm, |b| {
        buckets.push(b);
        Ok(())
    })?;
    for b in &mut buckets {
        comm.all_reduce(&mut b.grads, ReduceOp::Avg)?;
    }
    for b in &buckets {
        model.apply(b);
    }
    Ok(Step {
        took: t0.elapsed(),
        done_early: 0,
        buckets,
    })
}

fn train(comm: &Comm) -> ferrocomm::Result<()> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut model = Model::new();
    let (mut overlapped, mut sequential) = (Duration::ZERO, Duration::ZERO);
    let (mut buckets_per_step, mut done_early) = (0, 0);
    // The two kinds of step alternate, so that neither gets the warmer caches.
    for step in 0..2 * STEPS {
        // Every rank starts the step together, so the times compare like with like.
        comm.barrier()?;
        let s = if step % 2 == 0 {
            let s = step_overlapped(comm, step, &mut model)?;
            overlapped += s.took;
            done_early += s.done_early;
            s
        } else {
            let s = step_sequential(comm, step, &mut model)?;
            sequential += s.took;
            s
        };
        buckets_per_step = s.buckets.len();
        for b in &s.buckets {
            check(step, size, b);
        }
    }
    // Every update reached the layer it belongs to: each parameter is -LR × the sum of its
    // averaged gradients (whole numbers and halves, exact).
    for (layer, params) in model.params.iter().enumerate() {
        for (i, &p) in params.iter().enumerate() {
            let want: f32 = (0..2 * STEPS).map(|step| -LR * average(step, layer, i, size)).sum();
            assert!(p == want, "layer {layer}, parameter {i}: {p}, expected {want}");
        }
    }
    println!(
        "ddp_overlap: rank {rank}: {} steps, {buckets_per_step} buckets, gradients checked",
        2 * STEPS
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3 / STEPS as f64;
    println!(
        "ddp_overlap: rank {rank}: step time overlapped {:.1} ms, sequential {:.1} ms (mean of {STEPS} each; \
         {done_early} of {} overlapped buckets were reduced before the backward pass ended)",
        ms(overlapped),
        ms(sequential),
        STEPS * buckets_per_step
    );
    comm.finalize()
}

fn main() -> ferrocomm::Result<()> {
    // The library installs no log subscriber: FERROCOMM_LOG=debug shows its events through this one.
    ferrocomm::init_logging()?;
    let options = CommOptions::from_env()?;
    if ferrocomm::discover(|k| std::env::var(k).ok())?.is_some() {
        // Started by a launcher: this process is one rank.
        let comm = new_comm("auto", Device::Cpu, "ddp_overlap", options)?;
        return train(&comm);
    }
    let comms = Comm::new_group("auto", &[Device::Cpu; 4], "ddp_overlap", options)?;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(move || train(c))).collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("rank thread panicked"))
    })
}
