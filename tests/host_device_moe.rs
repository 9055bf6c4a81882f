//! The device backend's own MoE dispatch and combine kernels (kernels/moe.cu) on the host
//! device: against a reference computed here (f64 for combine), against the CPU backend on the
//! same inputs (bitwise), and bit-identical across runs. Every check runs with the ranks on one
//! host (the kernels store into mapped segments) and, where there are several, with every rank
//! on a host of its own (the TCP transport: the kernels put through the window's proxy queue).
//! Needs the `host-kernels` feature.

#![cfg(feature = "host-kernels")]

mod common;
use common::*;
use ferrocomm::{bf16, Combine, Dispatch, Error, MoeShape, F8E4M3};

/// Where the ranks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hosts {
    /// All on one host: the kernels store into each other's mapped segments.
    One,
    /// Each on a host of its own (the TCP transport): no peer is mapped, and the kernels build
    /// each peer's slot in an outbox and put it, and signal, through the proxy queue.
    Each,
}

impl Hosts {
    /// Both layouts where there are peers; one rank alone is always on one host.
    fn of(world: usize) -> &'static [Hosts] {
        if world > 1 {
            &[Hosts::One, Hosts::Each]
        } else {
            &[Hosts::One]
        }
    }

    fn opts(self) -> CommOptions {
        match self {
            Hosts::One => options(Duration::from_secs(30)),
            Hosts::Each => tcp_options(Duration::from_secs(30)),
        }
    }
}

fn opts() -> CommOptions {
    Hosts::One.opts()
}

/// `f(comm)` on `world` host-device ranks placed as `hosts` says.
fn on_device<R: Send>(hosts: Hosts, world: usize, name: &str, f: impl Fn(&Comm) -> R + Sync) -> Vec<R> {
    let name = format!("{name}-{hosts:?}-{}", rand::random::<u32>());
    run_group_on_device("device", Device::Host(0), world, &name, hosts.opts(), f)
}

/// A token element: random values, a poison, its bits and its value.
trait Tok: Element + Copy + Send + Sync + std::fmt::Debug {
    fn random(r: &mut StdRng) -> Self;
    fn poison() -> Self;
    fn bits(self) -> u64;
}

impl Tok for f32 {
    fn random(r: &mut StdRng) -> Self {
        r.gen_range(-2.0..2.0)
    }
    fn poison() -> Self {
        f32::from_bits(0x7fc0_dead)
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}

impl Tok for bf16 {
    fn random(r: &mut StdRng) -> Self {
        bf16::from_f32(r.gen_range(-2.0..2.0))
    }
    fn poison() -> Self {
        bf16::from_bits(0x7fcd)
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}

impl Tok for F8E4M3 {
    fn random(r: &mut StdRng) -> Self {
        F8E4M3::from_bits(r.gen_range(0u8..0x7e) | if r.gen() { 0x80 } else { 0 })
    }
    fn poison() -> Self {
        F8E4M3::from_bits(0x7f)
    }
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}

#[derive(Clone, Copy, Debug)]
enum Routing {
    /// K distinct random experts per token, some slots -1.
    Random,
    /// Every token's first slot to this expert, the others -1: one expert gets everything,
    /// every other expert nothing.
    AllTo(usize),
}

#[derive(Clone, Debug)]
struct Case {
    world: usize,
    shape: MoeShape,
    /// Tokens per rank.
    tokens: Vec<usize>,
    routing: Routing,
    idx64: bool,
}

/// Every rank's inputs (each rank computes all of them from the seed, for the reference).
struct Inputs<T> {
    tokens: Vec<T>,
    scales: Vec<f32>,
    idx: Vec<i64>,
    weights: Vec<f32>,
}

fn inputs<T: Tok>(seed: u64, c: &Case, rank: usize) -> Inputs<T> {
    let mut r = rng(seed, rank as u64 + 1);
    let (t, s) = (c.tokens[rank], c.shape);
    let tokens = (0..t * s.hidden).map(|_| T::random(&mut r)).collect();
    let scales = (0..t * (s.hidden / 128)).map(|_| r.gen_range(0.01f32..4.0)).collect();
    let mut idx = vec![-1i64; t * s.topk];
    for tok in 0..t {
        match c.routing {
            Routing::Random => {
                let mut picked: Vec<i64> = Vec::new();
                while picked.len() < s.topk {
                    let x = r.gen_range(0..s.experts) as i64;
                    if !picked.contains(&x) {
                        picked.push(x);
                    }
                }
                for (k, x) in picked.into_iter().enumerate() {
                    // Some slots skipped (never all of a token's).
                    idx[tok * s.topk + k] = if k > 0 && r.gen_ratio(1, 5) { -1 } else { x };
                }
            }
            Routing::AllTo(x) => idx[tok * s.topk] = x as i64,
        }
    }
    let weights = (0..t * s.topk).map(|_| r.gen_range(-1.0f32..1.0)).collect();
    Inputs {
        tokens,
        scales,
        idx,
        weights,
    }
}

/// The reference dispatch to `rank`: per local expert, the (source, token, k) of its rows.
fn reference(all_idx: &[Vec<i64>], c: &Case, rank: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let local = c.shape.experts / c.world;
    let mut rows = vec![Vec::new(); local];
    for (p, idx) in all_idx.iter().enumerate() {
        for (q, &x) in idx.iter().enumerate() {
            if x >= 0 && x as usize / local == rank {
                rows[x as usize % local].push((p, q / c.shape.topk, q % c.shape.topk));
            }
        }
    }
    rows
}

/// One rank's results of a dispatch then a combine (outputs poisoned first).
#[derive(Clone, Debug, PartialEq)]
struct Out {
    dispatch: std::result::Result<(), String>,
    tokens: Vec<u64>,
    scales: Vec<u32>,
    counts: Vec<i32>,
    src: Vec<i32>,
    combine: Option<std::result::Result<(), String>>,
    out: Vec<u32>,
}

/// An error's kind (the variant's name): the CPU engine words its messages differently.
fn kind(r: &std::result::Result<(), String>) -> std::result::Result<(), String> {
    r.clone()
        .map_err(|e| e.chars().take_while(|c| c.is_alphanumeric()).collect())
}

/// Runs a dispatch (both halves at once, or send then receive) and, if `combine`, a combine of
/// expert outputs made from `seed` back (bf16 rows), on one rank.
fn run_rank<T: Tok>(comm: &Comm, seed: u64, c: &Case, separate: bool, combine: bool) -> Out {
    let rank = comm.rank();
    let s = c.shape;
    let local = s.experts / c.world;
    let rows = local * s.capacity;
    let fp8 = T::DTYPE == DType::F8E4M3;
    let inp = inputs::<T>(seed, c, rank);
    let idx32: Vec<i32> = inp.idx.iter().map(|&x| x as i32).collect();
    let mut rt = vec![T::poison(); rows * s.hidden];
    let mut rsc = vec![f32::from_bits(0x7fc0_beef); rows * (s.hidden / 128)];
    let mut counts = vec![-7i32; local];
    let mut src = vec![-9i32; rows * 3];
    let send = || {
        let d = if c.idx64 {
            Dispatch::send(&inp.tokens, &inp.idx)
        } else {
            Dispatch::send(&inp.tokens, &idx32)
        };
        if fp8 {
            d.scales(&inp.scales)
        } else {
            d
        }
    };
    let dispatch = if separate {
        comm.moe_dispatch(s, send())
            .map_err(|e| format!("{e:?}"))
            .and_then(|()| {
                let d = Dispatch::recv_only().recv(&mut rt, &mut counts, &mut src);
                let d = if fp8 { d.recv_scales(&mut rsc) } else { d };
                comm.moe_dispatch(s, d).map_err(|e| format!("{e:?}"))
            })
    } else {
        let d = send().recv(&mut rt, &mut counts, &mut src);
        let d = if fp8 { d.recv_scales(&mut rsc) } else { d };
        comm.moe_dispatch(s, d).map_err(|e| format!("{e:?}"))
    };
    // Combine in f32 after an f32 dispatch, else in bf16.
    let (combined, out) = if T::DTYPE == DType::F32 {
        combine_rank::<f32>(comm, seed, c, separate, combine, &inp, &idx32, &src, &counts)
    } else {
        combine_rank::<bf16>(comm, seed, c, separate, combine, &inp, &idx32, &src, &counts)
    };
    Out {
        dispatch,
        tokens: rt.iter().map(|t| t.bits()).collect(),
        scales: rsc.iter().map(|x| x.to_bits()).collect(),
        counts,
        src,
        combine: combined,
        out,
    }
}

/// The element type of a combine's rows.
trait Act: Element + Copy + Send + Sync {
    fn from(x: f32) -> Self;
    fn poison() -> Self;
    fn bits(self) -> u32;
    fn from_bits32(b: u32) -> f64;
    /// Relative tolerance against the f64 reference.
    const TOL: f64;
}

impl Act for bf16 {
    fn from(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn poison() -> Self {
        bf16::from_bits(0x7fcd)
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
    fn from_bits32(b: u32) -> f64 {
        bf16::from_bits(b as u16).to_f64()
    }
    const TOL: f64 = 1e-2;
}

impl Act for f32 {
    fn from(x: f32) -> Self {
        x
    }
    fn poison() -> Self {
        f32::from_bits(0x7fc0_dead)
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn from_bits32(b: u32) -> f64 {
        f32::from_bits(b) as f64
    }
    const TOL: f64 = 1e-5;
}

/// Expert outputs of rank `rank` (random, from the seed), `C` rows.
fn expert_out<C: Act>(seed: u64, c: &Case, rank: usize) -> Vec<C> {
    let rows = c.shape.experts / c.world * c.shape.capacity;
    let mut r = rng(seed, 1000 + rank as u64);
    (0..rows * c.shape.hidden)
        .map(|_| C::from(r.gen_range(-2.0..2.0)))
        .collect()
}

/// A combine of `expert_out` back to the tokens (if `combine`), with `out` poisoned first.
#[allow(clippy::too_many_arguments)]
fn combine_rank<C: Act>(
    comm: &Comm,
    seed: u64,
    c: &Case,
    separate: bool,
    combine: bool,
    inp: &Inputs<impl Tok>,
    idx32: &[i32],
    src: &[i32],
    counts: &[i32],
) -> (Option<std::result::Result<(), String>>, Vec<u32>) {
    let (rank, s) = (comm.rank(), c.shape);
    let mut out = vec![C::poison(); c.tokens[rank] * s.hidden];
    let combined = combine.then(|| {
        let eo = expert_out::<C>(seed, c, rank);
        let r = match (separate, c.idx64) {
            (true, idx64) => comm.moe_combine(s, Combine::send(&eo, src, counts)).and_then(|()| {
                let recv = Combine::recv_only();
                let recv = if idx64 {
                    recv.recv(&inp.idx, &inp.weights, &mut out)
                } else {
                    recv.recv(idx32, &inp.weights, &mut out)
                };
                comm.moe_combine(s, recv)
            }),
            (false, true) => comm.moe_combine(
                s,
                Combine::send(&eo, src, counts).recv(&inp.idx, &inp.weights, &mut out),
            ),
            (false, false) => comm.moe_combine(s, Combine::send(&eo, src, counts).recv(idx32, &inp.weights, &mut out)),
        };
        r.map_err(|e| format!("{e:?}"))
    });
    (combined, out.iter().map(|x| x.bits()).collect())
}

/// Checks one rank's dispatch against the reference, and its combine against f64.
fn check<T: Tok>(seed: u64, c: &Case, rank: usize, got: &Out) {
    let s = c.shape;
    let all: Vec<Inputs<T>> = (0..c.world).map(|r| inputs::<T>(seed, c, r)).collect();
    let all_idx: Vec<Vec<i64>> = all.iter().map(|i| i.idx.clone()).collect();
    let want = reference(&all_idx, c, rank);
    let nb = s.hidden / 128;
    let over = want.iter().any(|w| w.len() > s.capacity);
    match (&got.dispatch, over) {
        (Ok(()), false) => {}
        (Err(e), true) => assert!(e.contains("CapacityExceeded"), "rank {rank}: {e}"),
        (r, _) => panic!("rank {rank}: dispatch {r:?}, overflow expected: {over} ({c:?})"),
    }
    for (e, rows) in want.iter().enumerate() {
        assert_eq!(got.counts[e] as usize, rows.len(), "rank {rank} counts[{e}] ({c:?})");
        for i in 0..s.capacity {
            let slot = e * s.capacity + i;
            let row = &got.tokens[slot * s.hidden..(slot + 1) * s.hidden];
            match rows.get(i) {
                Some(&(p, t, k)) => {
                    assert_eq!(
                        &got.src[slot * 3..slot * 3 + 3],
                        &[p as i32, t as i32, k as i32],
                        "rank {rank} src[{e},{i}]"
                    );
                    let want_row: Vec<u64> = all[p].tokens[t * s.hidden..(t + 1) * s.hidden]
                        .iter()
                        .map(|x| x.bits())
                        .collect();
                    assert_eq!(row, &want_row[..], "rank {rank} row [{e},{i}] = token {t} of rank {p}");
                    if T::DTYPE == DType::F8E4M3 {
                        let ws: Vec<u32> = all[p].scales[t * nb..(t + 1) * nb]
                            .iter()
                            .map(|x| x.to_bits())
                            .collect();
                        assert_eq!(
                            &got.scales[slot * nb..(slot + 1) * nb],
                            &ws[..],
                            "rank {rank} scales [{e},{i}]"
                        );
                    }
                }
                None => {
                    assert!(
                        row.iter().all(|&b| b == T::poison().bits()),
                        "rank {rank}: row [{e},{i}] past the count was written"
                    );
                    assert_eq!(&got.src[slot * 3..slot * 3 + 3], &[-9, -9, -9]);
                }
            }
        }
    }
    // Combine: every rank's expert outputs, as run_rank made them.
    if got.combine.is_none() {
        return;
    }
    if T::DTYPE == DType::F32 {
        check_combine::<f32>(seed, c, rank, got, &all_idx, &all[rank].idx, &all[rank].weights);
    } else {
        check_combine::<bf16>(seed, c, rank, got, &all_idx, &all[rank].idx, &all[rank].weights);
    }
}

/// One rank's combine against the f64 reference. A token whose row was cut by an expert's
/// capacity keeps its poison, and then the combine must fail saying so.
fn check_combine<C: Act>(
    seed: u64,
    c: &Case,
    rank: usize,
    got: &Out,
    all_idx: &[Vec<i64>],
    idx: &[i64],
    weights: &[f32],
) {
    let s = c.shape;
    let expert_out: Vec<Vec<C>> = (0..c.world).map(|q| expert_out::<C>(seed, c, q)).collect();
    // Where (rank, token, k) landed: (owner, expert, row).
    let mut at = std::collections::HashMap::new();
    for q in 0..c.world {
        for (e, list) in reference(all_idx, c, q).iter().enumerate() {
            for (i, &(p, t, k)) in list.iter().enumerate().take(s.capacity) {
                at.insert((p, t, k), (q, e, i));
            }
        }
    }
    let mut lost = None;
    for t in 0..c.tokens[rank] {
        let row = &got.out[t * s.hidden..(t + 1) * s.hidden];
        if (0..s.topk).any(|k| idx[t * s.topk + k] >= 0 && !at.contains_key(&(rank, t, k))) {
            assert!(
                row.iter().all(|&b| b == C::poison().bits()),
                "rank {rank}: token {t} lost a row to capacity, yet its output was written"
            );
            lost.get_or_insert(t);
            continue;
        }
        for j in 0..s.hidden {
            let (mut sum, mut mag) = (0f64, 0f64);
            for k in 0..s.topk {
                if idx[t * s.topk + k] < 0 {
                    continue;
                }
                let (q, e, i) = at[&(rank, t, k)];
                let row = expert_out[q][(e * s.capacity + i) * s.hidden + j];
                let v = C::from_bits32(row.bits()) * weights[t * s.topk + k] as f64;
                sum += v;
                mag += v.abs();
            }
            let g = C::from_bits32(got.out[t * s.hidden + j]);
            assert!(
                (g - sum).abs() <= C::TOL * mag.max(sum.abs()) + 1e-6,
                "rank {rank} out[{t},{j}] = {g}, want {sum} (|terms| {mag})"
            );
        }
    }
    match (got.combine.as_ref().unwrap(), lost) {
        (Ok(()), None) => {}
        (Err(e), Some(_)) => assert!(e.contains("no row came back"), "rank {rank}: combine {e}"),
        (r, lost) => panic!("rank {rank}: combine {r:?}, first token with a lost row: {lost:?}"),
    }
}

/// The case on the device backend (at every placement of `Hosts::of`: two calls in a row on one
/// communicator, halves apart and together) and on the CPU backend: each against the
/// reference, and the device's bits equal to the CPU engine's.
fn run_case<T: Tok>(c: &Case, separate: bool, combine: bool) {
    let seed = fresh_seed();
    let name = format!("moe-{}-{}-{}", c.world, T::DTYPE, rand::random::<u32>());
    let cpu = run_group_on_device("cpu", Device::Cpu, c.world, &format!("{name}-cpu"), opts(), |comm| {
        run_rank::<T>(comm, seed, c, separate, combine)
    });
    for &hosts in Hosts::of(c.world) {
        let dev = on_device(hosts, c.world, &name, |comm| {
            let a = run_rank::<T>(comm, seed, c, separate, combine);
            let b = run_rank::<T>(comm, seed, c, !separate, combine);
            (a, b)
        });
        compare::<T>(seed, c, hosts, &dev, &cpu);
    }
}

/// Device results (two runs per rank) against the reference and the CPU engine's.
fn compare<T: Tok>(seed: u64, c: &Case, hosts: Hosts, dev: &[(Out, Out)], cpu: &[Out]) {
    for (rank, ((a, b), cpu)) in dev.iter().zip(cpu).enumerate() {
        check::<T>(seed, c, rank, a);
        assert_eq!(
            a, b,
            "rank {rank} ({hosts:?}): two runs (halves apart and together) differ"
        );
        // The CPU engine's messages differ in wording; the data must not.
        let strip = |o: &Out| Out {
            dispatch: kind(&o.dispatch),
            combine: o.combine.as_ref().map(kind),
            ..o.clone()
        };
        assert_eq!(
            strip(a),
            strip(cpu),
            "rank {rank} ({hosts:?}): the device kernels and the CPU engine differ"
        );
    }
}

fn shape(experts: usize, topk: usize, hidden: usize, capacity: usize) -> MoeShape {
    MoeShape {
        experts,
        topk,
        hidden,
        capacity,
    }
}

#[test]
fn dispatch_and_combine_match_the_reference_and_the_cpu_engine() {
    for world in [1, 2, 4] {
        for (topk, experts) in [(1, 4 * world), (8, 16.max(2 * world))] {
            let c = Case {
                world,
                shape: shape(experts, topk, 256, 64),
                tokens: (0..world).map(|r| 5 + 3 * r).collect(),
                routing: Routing::Random,
                idx64: topk == 8,
            };
            run_case::<bf16>(&c, false, true);
        }
    }
}

#[test]
fn fp8_tokens_travel_with_their_scales() {
    for world in [1, 2, 4] {
        let c = Case {
            world,
            shape: shape(8 * world, 4, 384, 48),
            tokens: (0..world).map(|r| 9 + r).collect(),
            routing: Routing::Random,
            idx64: false,
        };
        run_case::<F8E4M3>(&c, true, true);
    }
}

#[test]
fn f32_tokens_and_odd_rows() {
    // 100 f32: rows of 400 bytes (16-byte copies); the combine in f32 (tolerance 1e-5).
    for world in [2, 4] {
        let c = Case {
            world,
            shape: shape(2 * world, 2, 100, 40),
            tokens: (0..world).map(|r| 7 + 2 * r).collect(),
            routing: Routing::Random,
            idx64: true,
        };
        run_case::<f32>(&c, false, true);
    }
}

#[test]
fn skewed_routing_one_expert_gets_everything() {
    for world in [1, 2, 4] {
        let c = Case {
            world,
            shape: shape(4 * world, 2, 128, 8 * world),
            tokens: vec![8; world],
            routing: Routing::AllTo(world.min(3)),
            idx64: false,
        };
        run_case::<bf16>(&c, true, true);
    }
}

#[test]
fn capacity_overflow_is_an_error_with_exact_counts_and_the_window_stays_usable() {
    for world in [1, 2, 4] {
        // 6 tokens per rank to one expert of capacity 5: that rank overflows.
        let c = Case {
            world,
            shape: shape(2 * world, 2, 128, 5),
            tokens: vec![6; world],
            routing: Routing::AllTo(2 * world - 1),
            idx64: false,
        };
        run_case::<bf16>(&c, false, false);
        // The tokens whose rows all came back are combined, on both engines to the same bits.
        run_case::<bf16>(&c, true, true);
        // Combine after an overflow: the owner of the tokens with a missing row says so.
        let seed = fresh_seed();
        for &hosts in Hosts::of(world) {
            let res = on_device(hosts, world, &format!("moe-over-{world}"), |comm| {
                let first = run_rank::<bf16>(comm, seed, &c, false, true);
                // The next call on the same communicator works.
                let ok = Case {
                    routing: Routing::Random,
                    shape: shape(2 * world, 2, 128, 64),
                    ..c.clone()
                };
                let second = run_rank::<bf16>(comm, seed, &ok, false, true);
                (first, second, ok)
            });
            for (rank, (first, second, ok)) in res.iter().enumerate() {
                let comb = first.combine.as_ref().unwrap();
                assert!(
                    comb.as_ref().is_err_and(|e| e.contains("no row came back")),
                    "rank {rank} ({hosts:?}): combine after an overflow: {comb:?}"
                );
                check::<bf16>(seed, ok, rank, second);
            }
        }
    }
}

/// A source with more tokens for one rank than its staging holds (local experts x capacity):
/// the counts stay exact (the sender counts them) and the rows within capacity are right.
#[test]
fn more_tokens_for_one_rank_than_its_staging_holds() {
    for world in [1, 2, 4] {
        let c = Case {
            world,
            shape: shape(world, 1, 128, 3),
            tokens: vec![8; world],
            routing: Routing::AllTo(world - 1),
            idx64: true,
        };
        run_case::<bf16>(&c, false, false);
        run_case::<bf16>(&c, true, false);
    }
}

#[test]
fn eight_ranks() {
    let c = Case {
        world: 8,
        shape: shape(16, 8, 128, 32),
        tokens: (0..8).map(|r| 3 + r).collect(),
        routing: Routing::Random,
        idx64: false,
    };
    run_case::<bf16>(&c, true, true);
}

#[test]
fn halves_out_of_order_are_refused() {
    for &hosts in Hosts::of(2) {
        halves_out_of_order_are_refused_on(hosts);
    }
}

fn halves_out_of_order_are_refused_on(hosts: Hosts) {
    let res = on_device(hosts, 2, "moe-order", |comm| {
        let s = shape(4, 1, 128, 8);
        let (mut rt, mut counts, mut src) = (vec![bf16::ZERO; 2 * 8 * 128], vec![0i32; 2], vec![0i32; 2 * 8 * 3]);
        let recv_first = comm
            .moe_dispatch(s, Dispatch::recv_only().recv(&mut rt, &mut counts, &mut src))
            .unwrap_err();
        let tokens = vec![bf16::ONE; 3 * 128];
        let idx = vec![0i32, 1, 2];
        comm.moe_dispatch(s, Dispatch::send(&tokens, &idx)).unwrap();
        let twice = comm.moe_dispatch(s, Dispatch::send(&tokens, &idx)).unwrap_err();
        comm.moe_dispatch(s, Dispatch::recv_only().recv(&mut rt, &mut counts, &mut src))
            .unwrap();
        (recv_first, twice)
    });
    for (a, b) in res {
        assert!(matches!(a, Error::InvalidArgument { .. }), "{a}");
        assert!(b.to_string().contains("cannot overlap"), "{b}");
    }
}

/// Runs `bad(comm, culprit)` on `world` ranks (rank `culprit` with a bad argument), then a
/// dispatch and combine of random tokens, on the device backend (both placements) and on the
/// CPU engine. The culprit gets its own error (containing `why`); every other rank fails at
/// once with `Error::InvalidArgument` saying "rank {culprit} refused its call" (and `why`, where
/// `peers_why`: the kernels carry the data errors they find, not the host's text); no output
/// is written; and the next call matches the reference and, bit for bit, the CPU engine.
fn one_rank_refuses(
    world: usize,
    culprit: usize,
    name: &str,
    why: &str,
    peers_why: bool,
    bad: impl Fn(&Comm, bool, MoeShape) -> ferrocomm::Result<()> + Sync,
) {
    let seed = fresh_seed();
    let c = Case {
        world,
        shape: shape(4 * world, 2, 128, 16),
        tokens: (0..world).map(|r| 4 + 2 * r).collect(),
        routing: Routing::Random,
        idx64: false,
    };
    let rank_main = |comm: &Comm| {
        let t0 = std::time::Instant::now();
        let refused = bad(comm, comm.rank() == culprit, c.shape);
        let took = t0.elapsed();
        (refused, took, run_rank::<bf16>(comm, seed, &c, false, true))
    };
    let cpu = run_group_on_device("cpu", Device::Cpu, world, &format!("{name}-cpu"), opts(), rank_main);
    for &hosts in Hosts::of(world) {
        let dev = on_device(hosts, world, name, rank_main);
        for (rank, ((refused, took, next), (cpu_refused, _, cpu_next))) in dev.iter().zip(&cpu).enumerate() {
            for (backend, r) in [("device", refused), ("cpu", cpu_refused)] {
                match r {
                    Err(e) if rank == culprit => assert!(
                        e.to_string().contains(why),
                        "{backend} rank {rank} ({hosts:?}), the culprit: {e}"
                    ),
                    Err(Error::InvalidArgument { reason, .. }) => assert!(
                        reason.contains(&format!("rank {culprit} refused its call"))
                            && (!peers_why || reason.contains(why)),
                        "{backend} rank {rank} ({hosts:?}): {reason}"
                    ),
                    other => panic!("{backend} rank {rank} ({hosts:?}): {other:?}"),
                }
            }
            assert!(
                *took < Duration::from_secs(10),
                "rank {rank} ({hosts:?}) waited {took:?} for the culprit"
            );
            check::<bf16>(seed, &c, rank, next);
            let strip = |o: &Out| Out {
                dispatch: kind(&o.dispatch),
                combine: o.combine.as_ref().map(kind),
                ..o.clone()
            };
            assert_eq!(
                strip(next),
                strip(cpu_next),
                "rank {rank} ({hosts:?}): the next call differs from the CPU engine's"
            );
        }
    }
}

/// An expert id out of range on one rank (found by its send kernel): that rank gets its
/// argument error, every other rank fails at once naming it (the id travels in the slot
/// headers), nothing is written, and the next call runs in step; as on the CPU engine.
#[test]
fn a_bad_expert_id_on_one_rank_fails_every_rank_naming_it_and_the_next_call_works() {
    for world in [2, 4] {
        one_rank_refuses(
            world,
            world - 1,
            "moe-bad-id",
            "topk_idx[3] = 99",
            true,
            |comm, bad, s| {
                let tokens = vec![bf16::ONE; 3 * 128];
                let idx = [0i32, 1, 2, if bad { 99 } else { 3 }, -1, 5];
                let local = s.experts / comm.size();
                let mut rt = vec![bf16::from_bits(0x7fcd); local * s.capacity * 128];
                let (mut counts, mut src) = (vec![-7i32; local], vec![-9i32; local * s.capacity * 3]);
                let r = comm.moe_dispatch(s, Dispatch::send(&tokens, &idx).recv(&mut rt, &mut counts, &mut src));
                assert!(
                    rt.iter().all(|x| x.to_bits() == 0x7fcd) && counts.iter().all(|&c| c == -7),
                    "a refused dispatch wrote"
                );
                r
            },
        );
    }
}

/// A bad source row in one rank's combine (found by its send kernel): every rank fails,
/// naming it.
#[test]
fn a_bad_combine_source_on_one_rank_fails_every_rank_naming_it() {
    one_rank_refuses(2, 0, "moe-bad-src", "src[0, 0] = (", true, |comm, bad, s| {
        let tokens = vec![bf16::ONE; 2 * 128];
        let idx = [0i32, 5, 1, 6];
        let local = s.experts / comm.size();
        let mut rt = vec![bf16::ZERO; local * s.capacity * 128];
        let (mut counts, mut src) = (vec![0i32; local], vec![0i32; local * s.capacity * 3]);
        comm.moe_dispatch(s, Dispatch::send(&tokens, &idx).recv(&mut rt, &mut counts, &mut src))?;
        if bad {
            src[0] = 7; // row 0 of expert 0 "came from" rank 7
        }
        let mut out = vec![bf16::from_bits(0x7fcd); 2 * 128];
        let r = comm.moe_combine(s, Combine::send(&rt, &src, &counts).recv(&idx, &[1.0f32; 4], &mut out));
        assert!(out.iter().all(|x| x.to_bits() == 0x7fcd), "a refused combine wrote");
        r
    });
}

/// A bad expert id on one rank whose halves are called apart: no rank's receive half succeeds
/// (nothing is written), the culprit's included; on the device the peers' send halves succeed
/// (they return while the tokens travel) and their receive halves name the culprit; on the CPU
/// engine the peers' send halves already fail naming it. The next call runs in step.
#[test]
fn a_bad_expert_id_with_the_halves_apart_fails_every_receive() {
    let world = 2;
    let culprit = 1;
    let seed = fresh_seed();
    let c = Case {
        world,
        shape: shape(4 * world, 2, 128, 16),
        tokens: vec![4, 5],
        routing: Routing::Random,
        idx64: false,
    };
    let rank_main = |comm: &Comm| {
        let s = c.shape;
        let tokens = vec![bf16::ONE; 3 * 128];
        let idx = [0i32, 1, 2, if comm.rank() == culprit { 99 } else { 3 }, -1, 5];
        let sent = comm
            .moe_dispatch(s, Dispatch::send(&tokens, &idx))
            .map_err(|e| e.to_string());
        let local = s.experts / world;
        let mut rt = vec![bf16::from_bits(0x7fcd); local * s.capacity * 128];
        let (mut counts, mut src) = (vec![-7i32; local], vec![-9i32; local * s.capacity * 3]);
        let got = comm
            .moe_dispatch(s, Dispatch::recv_only().recv(&mut rt, &mut counts, &mut src))
            .map_err(|e| e.to_string());
        let untouched = rt.iter().all(|x| x.to_bits() == 0x7fcd) && counts.iter().all(|&c| c == -7);
        (sent, got, untouched, run_rank::<bf16>(comm, seed, &c, false, true))
    };
    let cpu = run_group_on_device("cpu", Device::Cpu, world, "moe-apart-cpu", opts(), rank_main);
    let mut runs = vec![("cpu".to_string(), cpu)];
    for &hosts in Hosts::of(world) {
        runs.push((
            format!("device {hosts:?}"),
            on_device(hosts, world, "moe-apart", rank_main),
        ));
    }
    for (backend, res) in &runs {
        for (rank, (sent, got, untouched, next)) in res.iter().enumerate() {
            let on_cpu = backend == "cpu";
            if rank == culprit {
                let e = sent.as_ref().expect_err("the culprit's send half");
                assert!(e.contains("topk_idx[3] = 99"), "{backend} culprit: {e}");
            } else if on_cpu {
                let e = sent.as_ref().expect_err("a peer's send half on the CPU engine");
                assert!(
                    e.contains(&format!("rank {culprit} refused its call")),
                    "{backend} rank {rank}: {e}"
                );
            } else {
                assert!(sent.is_ok(), "{backend} rank {rank}: the send half alone: {sent:?}");
            }
            assert!(
                got.is_err(),
                "{backend} rank {rank}: the receive half succeeded: {got:?}"
            );
            if !on_cpu && rank != culprit {
                let e = got.as_ref().unwrap_err();
                assert!(
                    e.contains(&format!("rank {culprit} refused its call")),
                    "{backend} rank {rank}: {e}"
                );
            }
            assert!(*untouched, "{backend} rank {rank}: a failed receive wrote");
            check::<bf16>(seed, &c, rank, next);
        }
    }
}

/// An argument error found on the host (a buffer of the wrong size): the device backend still
/// takes part (a header flagged refused to every peer), so every rank fails at once.
#[test]
fn a_wrong_buffer_size_on_one_rank_fails_every_rank_naming_it() {
    for world in [2, 4] {
        one_rank_refuses(world, world - 1, "moe-short", "topk_idx has", false, |comm, bad, s| {
            let tokens = vec![bf16::ONE; 2 * 128];
            let idx: &[i32] = if bad { &[0, 1, 2] } else { &[0, 1, 2, 3] };
            let local = s.experts / comm.size();
            let mut rt = vec![bf16::ZERO; local * s.capacity * 128];
            let (mut counts, mut src) = (vec![0i32; local], vec![0i32; local * s.capacity * 3]);
            comm.moe_dispatch(s, Dispatch::send(&tokens, idx).recv(&mut rt, &mut counts, &mut src))
        });
    }
}

/// A dispatch (both halves) of two tokens of ones routed by `idx`, on this rank: its result and
/// how long it took.
fn dispatch_two_tokens(comm: &Comm, s: MoeShape, idx: &[i32]) -> (ferrocomm::Result<()>, Duration) {
    let local = s.experts / comm.size();
    let tokens = vec![bf16::ONE; 2 * s.hidden];
    let mut rt = vec![bf16::ZERO; local * s.capacity * s.hidden];
    let (mut counts, mut src) = (vec![0i32; local], vec![0i32; local * s.capacity * 3]);
    let t0 = std::time::Instant::now();
    let r = comm.moe_dispatch(s, Dispatch::send(&tokens, idx).recv(&mut rt, &mut counts, &mut src));
    (r, t0.elapsed())
}

/// Expert ids for two tokens of `s`: 0, 1, 2, ... in turn.
fn every_expert_in_turn(s: MoeShape) -> Vec<i32> {
    (0..2 * s.topk).map(|i| (i % s.experts) as i32).collect()
}

/// One rank calls with another `topk`, or another number of experts (a shape whose staging
/// fits the window the first call made), or another `hidden` (whose staging needs a larger
/// window, which that rank announces on the old one before making it): `Error::Mismatch` on
/// every rank, naming the field and a rank of the other shape, at once; the kernels finish
/// their protocol and no window is replaced, so the next call with one shape works.
#[test]
fn a_shape_that_differs_on_one_rank_is_a_mismatch_on_every_rank() {
    for world in [2, 4] {
        for &hosts in Hosts::of(world) {
            for field in ["topk", "experts", "hidden"] {
                a_shape_mismatch_on(hosts, world, field);
            }
        }
    }
}

fn a_shape_mismatch_on(hosts: Hosts, world: usize, field: &str) {
    let seed = fresh_seed();
    let c = Case {
        world,
        shape: shape(4 * world, 2, 128, 16),
        tokens: (0..world).map(|r| 3 + r).collect(),
        routing: Routing::Random,
        idx64: false,
    };
    let res = on_device(hosts, world, "moe-shape", |comm| {
        let first = run_rank::<bf16>(comm, seed, &c, false, false);
        let odd = match field {
            "topk" => shape(4 * world, 1, 128, 16),
            "hidden" => shape(4 * world, 2, 512, 16),
            _ => shape(2 * world, 2, 128, 16),
        };
        let s = if comm.rank() == 1 { odd } else { c.shape };
        let (r, took) = dispatch_two_tokens(comm, s, &every_expert_in_turn(s));
        (first, r, took, run_rank::<bf16>(comm, seed, &c, false, true))
    });
    for (rank, (first, r, took, next)) in res.iter().enumerate() {
        check::<bf16>(seed, &c, rank, first);
        let peer_ok = |p: usize| if rank == 1 { p != 1 } else { p == 1 };
        assert!(
            matches!(r, Err(Error::Mismatch { peer, detail, .. }) if peer_ok(*peer) && detail.contains(field)),
            "rank {rank} ({hosts:?}, world {world}, {field}): {r:?}"
        );
        assert!(*took < Duration::from_secs(10), "rank {rank} waited {took:?}");
        check::<bf16>(seed, &c, rank, next);
    }
}

/// The first call, which makes the window, with another `hidden` on one rank (so another
/// window size): every rank gets `Error::Mismatch` naming a rank of the other size, at once,
/// and the next call with one shape works.
#[test]
fn a_first_call_of_another_shape_is_a_mismatch_on_every_rank() {
    let world = 2;
    for &hosts in Hosts::of(world) {
        let seed = fresh_seed();
        let c = Case {
            world,
            shape: shape(4 * world, 2, 128, 16),
            tokens: vec![3, 4],
            routing: Routing::Random,
            idx64: false,
        };
        let res = on_device(hosts, world, "moe-first-shape", |comm| {
            let s = if comm.rank() == 1 {
                shape(4 * world, 2, 256, 16)
            } else {
                c.shape
            };
            let (r, took) = dispatch_two_tokens(comm, s, &every_expert_in_turn(s));
            (r, took, run_rank::<bf16>(comm, seed, &c, false, true))
        });
        for (rank, (r, took, next)) in res.iter().enumerate() {
            assert!(
                matches!(r, Err(Error::Mismatch { peer, .. }) if *peer == 1 - rank),
                "rank {rank} ({hosts:?}): {r:?}"
            );
            assert!(*took < Duration::from_secs(10), "rank {rank} waited {took:?}");
            check::<bf16>(seed, &c, rank, next);
        }
    }
}

/// A rank that refuses a call whose shape needs a larger window (a buffer of the wrong size)
/// while its peers announce that shape: the peers name the refusing rank (not a shape
/// mismatch), no window is replaced, and the next call of that shape grows it on every rank.
#[test]
fn a_refusal_among_ranks_announcing_a_larger_window_names_the_refusing_rank() {
    let world = 2;
    let culprit = 1;
    for &hosts in Hosts::of(world) {
        let seed = fresh_seed();
        let case = |hidden| Case {
            world,
            shape: shape(4 * world, 2, hidden, 16),
            tokens: vec![3, 4],
            routing: Routing::Random,
            idx64: false,
        };
        let (small, big) = (case(128), case(512));
        let res = on_device(hosts, world, "moe-grow-refused", |comm| {
            let first = run_rank::<bf16>(comm, seed, &small, false, false);
            // The culprit's topk_idx is one id short.
            let idx: Vec<i32> = (0..if comm.rank() == culprit { 3 } else { 4 }).collect();
            let (r, took) = dispatch_two_tokens(comm, big.shape, &idx);
            (first, r, took, run_rank::<bf16>(comm, seed, &big, false, true))
        });
        for (rank, (first, r, took, next)) in res.iter().enumerate() {
            check::<bf16>(seed, &small, rank, first);
            match r {
                Err(e) if rank == culprit => assert!(e.to_string().contains("topk_idx has"), "{hosts:?} culprit: {e}"),
                Err(Error::InvalidArgument { reason, .. }) => assert!(
                    reason.contains(&format!("rank {culprit} refused its call")),
                    "{hosts:?} rank {rank}: {reason}"
                ),
                other => panic!("{hosts:?} rank {rank}: {other:?}"),
            }
            assert!(*took < Duration::from_secs(10), "rank {rank} waited {took:?}");
            check::<bf16>(seed, &big, rank, next);
        }
    }
}

/// A combine whose `src` names a token its rank never sent: that rank is told (a stray row, or
/// the row its token misses), as the CPU engine tells it.
#[test]
fn a_combine_row_for_a_token_never_sent_is_reported() {
    for &hosts in Hosts::of(2) {
        a_stray_row_on(hosts);
    }
}

fn a_stray_row_on(hosts: Hosts) {
    let res = on_device(hosts, 2, "moe-stray", |comm| {
        let s = shape(2, 1, 128, 8);
        let tokens = vec![bf16::ONE; 2 * 128];
        // Every token of both ranks to expert 1 (rank 1).
        let idx = vec![1i32, 1];
        let (mut rt, mut counts, mut src) = (vec![bf16::ZERO; 8 * 128], vec![0i32; 1], vec![0i32; 8 * 3]);
        comm.moe_dispatch(s, Dispatch::send(&tokens, &idx).recv(&mut rt, &mut counts, &mut src))
            .unwrap();
        if comm.rank() == 1 {
            // Row 0 came from rank 0, token 0: say token 57 instead.
            assert_eq!(&src[..3], &[0, 0, 0]);
            src[1] = 57;
        }
        let mut out = vec![bf16::ZERO; 2 * 128];
        comm.moe_combine(
            s,
            Combine::send(&rt, &src, &counts).recv(&idx, &[1.0f32, 1.0], &mut out),
        )
        .map_err(|e| e.to_string())
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(
        e.contains("which it was not sent") || e.contains("no row came back for token 0"),
        "{e}"
    );
    assert!(res[1].is_ok(), "{:?}", res[1]);
}

/// Shapes change between calls (the window grows, and stays for smaller ones), and a dispatch
/// of one shape waits, sent, across a combine of another.
#[test]
fn shapes_change_between_calls_and_halves_of_one_shape_span_another() {
    for &hosts in Hosts::of(2) {
        shapes_change_on(hosts);
    }
}

fn shapes_change_on(hosts: Hosts) {
    let seed = fresh_seed();
    let world = 2;
    let case = |experts, topk, hidden, capacity| Case {
        world,
        shape: shape(experts, topk, hidden, capacity),
        tokens: vec![5, 7],
        routing: Routing::Random,
        idx64: false,
    };
    let (a, b) = (case(4, 2, 128, 16), case(8, 8, 384, 24));
    let res = on_device(hosts, world, "moe-shapes", |comm| {
        let first = run_rank::<bf16>(comm, seed, &a, false, true);
        let bigger = run_rank::<bf16>(comm, seed, &b, false, true);
        let again = run_rank::<bf16>(comm, seed, &a, true, true);
        // A dispatch of shape b sent; a combine of shape a (nothing routed) runs; then b's
        // receive half.
        let inp = inputs::<bf16>(seed, &b, comm.rank());
        let idx32: Vec<i32> = inp.idx.iter().map(|&x| x as i32).collect();
        comm.moe_dispatch(b.shape, Dispatch::send(&inp.tokens, &idx32)).unwrap();
        let rows = 2 * 16;
        let (eo, src, counts) = (vec![bf16::ONE; rows * 128], vec![0i32; rows * 3], vec![0i32; 2]);
        let none = vec![-1i32; 3 * 2];
        let mut out = vec![bf16::from_bits(0x7fcd); 3 * 128];
        comm.moe_combine(
            a.shape,
            Combine::send(&eo, &src, &counts).recv(&none, &[0.5f32; 6], &mut out),
        )
        .unwrap();
        assert!(out.iter().all(|x| *x == bf16::ZERO), "tokens with no expert sum to 0");
        let local = 4;
        let mut rt = vec![bf16::from_bits(0x7fcd); local * 24 * 384];
        let (mut cnt, mut s) = (vec![-7i32; local], vec![-9i32; local * 24 * 3]);
        comm.moe_dispatch(b.shape, Dispatch::recv_only().recv(&mut rt, &mut cnt, &mut s))
            .unwrap();
        let spanned = Out {
            dispatch: Ok(()),
            tokens: rt.iter().map(|t| t.to_bits() as u64).collect(),
            scales: vec![0x7fc0_beef; 0],
            counts: cnt,
            src: s,
            combine: None,
            out: Vec::new(),
        };
        (first, bigger, again, spanned)
    });
    for (rank, (first, bigger, again, spanned)) in res.iter().enumerate() {
        check::<bf16>(seed, &a, rank, first);
        check::<bf16>(seed, &b, rank, bigger);
        check::<bf16>(seed, &a, rank, again);
        check::<bf16>(seed, &b, rank, spanned);
    }
}

/// Ranks on hosts of their own run the own kernels too, not the CPU engine: only the kernels'
/// window, sized at the first call of a shape, refuses to grow while a send half waits for its
/// receive half (the engine keeps pending rows of any shape). After that refusal, the pending
/// half completes and the larger shape runs.
#[test]
fn ranks_on_several_hosts_run_the_own_kernels_through_the_proxy() {
    let seed = fresh_seed();
    let small = Case {
        world: 2,
        shape: shape(4, 2, 128, 16),
        tokens: vec![5, 6],
        routing: Routing::Random,
        idx64: false,
    };
    let large = Case {
        shape: shape(4, 2, 256, 16),
        ..small.clone()
    };
    let res = on_device(Hosts::Each, 2, "moe-tcp", |comm| {
        let inp = inputs::<bf16>(seed, &small, comm.rank());
        let idx32: Vec<i32> = inp.idx.iter().map(|&x| x as i32).collect();
        comm.moe_dispatch(small.shape, Dispatch::send(&inp.tokens, &idx32))
            .unwrap();
        let rows = 2 * 16;
        let (eo, src, counts) = (vec![bf16::ONE; rows * 256], vec![0i32; rows * 3], vec![0i32; 2]);
        let none = vec![-1i32; 5 * 2];
        let mut out = vec![bf16::ZERO; 5 * 256];
        let grow = comm
            .moe_combine(
                large.shape,
                Combine::send(&eo, &src, &counts).recv(&none, &[0.5f32; 10], &mut out),
            )
            .map_err(|e| e.to_string());
        let (mut rt, mut cnt, mut s) = (
            vec![bf16::from_bits(0x7fcd); rows * 128],
            vec![-7i32; 2],
            vec![-9i32; rows * 3],
        );
        comm.moe_dispatch(small.shape, Dispatch::recv_only().recv(&mut rt, &mut cnt, &mut s))
            .unwrap();
        let pending = Out {
            dispatch: Ok(()),
            tokens: rt.iter().map(|t| t.to_bits() as u64).collect(),
            scales: Vec::new(),
            counts: cnt,
            src: s,
            combine: None,
            out: Vec::new(),
        };
        (grow, pending, run_rank::<bf16>(comm, seed, &large, true, true))
    });
    for (rank, (grow, pending, after)) in res.iter().enumerate() {
        assert!(
            grow.as_ref()
                .is_err_and(|e| e.contains("a larger MoE shape while a send half waits")),
            "rank {rank}: {grow:?}"
        );
        check::<bf16>(seed, &small, rank, pending);
        check::<bf16>(seed, &large, rank, after);
    }
}
