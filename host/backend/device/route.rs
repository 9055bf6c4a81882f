//! Which path the device backend takes for a collective on device buffers: NCCL, or its own.
//!
//! NCCL is used when every rank could load it and sits on a GPU of its own (NCCL refuses two
//! ranks on one GPU). Where the backend has a kernel of its own for the operation (all_reduce,
//! all_gather, reduce_scatter), NCCL takes only messages of at least `FERROCOMM_NCCL_THRESHOLD`
//! bytes (256 KiB by default); every other operation goes to NCCL at any size: all_to_all,
//! whose sizes may differ between ranks (no size rule could agree), and the operations whose
//! own path is the staged host copy. Per operation, the hint `route` = `nccl` or `device` overrides the
//! size rule; `nccl` without NCCL (or for a reduction NCCL lacks: bitwise, of i16 or u16) is ignored for
//! the own path: the device backend never fails for want of NCCL.
//!
//! The device backend's hints (see `CommOptions::hints` for the rule): `route`, and
//! `algorithm` = `oneshot` / `twoshot` / `multimem` for its all_reduce kernels, `unfused` for
//! the fused norm's separate steps (see `norm_route`), or `oneshot` / `direct` / `ring` /
//! `two_level` for the CPU engine that runs host buffers and the staged copy. A value
//! outside these lists is refused; a value that cannot be honoured where the operation runs is
//! ignored (debug event), and so is any other key.

use crate::contracts::backend::{hint_ignored, unknown_hints_ignored};
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::Op;
use std::collections::BTreeMap;

/// The values of the device backend's hints.
const ROUTES: [&str; 2] = ["nccl", "device"];
const ALGORITHMS: [&str; 7] = [
    "oneshot",
    "twoshot",
    "multimem",
    "unfused",
    "direct",
    "ring",
    "two_level",
];
/// The `algorithm` values of the CPU engine (host/backend/cpu).
const ENGINE_ALGORITHMS: [&str; 4] = ["oneshot", "direct", "ring", "two_level"];

/// Refuses a value the device backend does not know for a hint it reads, before anything
/// runs; notes (debug) the keys it does not read.
pub(crate) fn check_hints(op: &'static str, hints: &BTreeMap<String, String>) -> Result<()> {
    unknown_hints_ignored("device", op, hints, &["route", "algorithm"]);
    for (key, accepted) in [("route", &ROUTES[..]), ("algorithm", &ALGORITHMS[..])] {
        if let Some(v) = hints.get(key).filter(|v| !accepted.contains(&v.as_str())) {
            return Err(Error::invalid(
                op,
                format!("hint {key}={v:?}: the device backend accepts {}", quoted(accepted)),
            ));
        }
    }
    Ok(())
}

fn quoted(values: &[&str]) -> String {
    let q: Vec<String> = values.iter().map(|v| format!("{v:?}")).collect();
    q.join(", ")
}

/// Whether the hints ask for one of the CPU engine's own algorithms (`direct`, `ring`,
/// `two_level`): on the host device, whose buffers are host memory, the engine then runs the
/// operation.
pub(crate) fn wants_engine(hints: &BTreeMap<String, String>) -> bool {
    matches!(
        hints.get("algorithm").map(String::as_str),
        Some("direct" | "ring" | "two_level")
    )
}

/// The hints for the CPU engine underneath (host buffers, the staged copy): `algorithm` where
/// the engine knows the value. The kernels' algorithms cannot be honoured there and are
/// ignored; `route` has been applied already, and other keys were noted by `check_hints`.
pub(crate) fn engine_hints(op: &'static str, hints: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    match hints.get("algorithm") {
        Some(a) if ENGINE_ALGORITHMS.contains(&a.as_str()) => BTreeMap::from([("algorithm".into(), a.clone())]),
        Some(a) => {
            let why =
                "the CPU engine runs this operation (host buffers or the staged copy); it has oneshot, direct, ring and two_level";
            hint_ignored("device", op, "algorithm", a, why);
            BTreeMap::new()
        }
        None => BTreeMap::new(),
    }
}

/// How the device backend runs the fused all_reduce + residual + RMSNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NormRoute {
    /// The fused kernels (every rank on this host).
    Fused,
    /// Its steps apart (backend/norm_pass.rs): widen, an all_reduce by the usual route, then
    /// residual + norm in one kernel.
    Unfused,
    /// Where the other collectives go: the CPU engine (host buffers), the staged copy.
    Elsewhere,
}

/// The fused norm's route. `kernels_reach`: its buffers are device memory, or host memory on
/// the host device; `fused`: the fused kernels take the call; `nccl`: NCCL is present. The hint
/// `algorithm` = `unfused` asks for the steps apart; `route` = `nccl` for NCCL to carry the sum
/// (the steps apart, then); without hints the fused kernels run where they can, else the steps
/// apart with NCCL's all_reduce (the NCCL fallback), else the staged copy, which runs the whole
/// operation on the CPU engine in one round trip.
pub(crate) fn norm_route(hints: &BTreeMap<String, String>, kernels_reach: bool, fused: bool, nccl: bool) -> NormRoute {
    const OP: &str = "all_reduce_residual_rmsnorm";
    if !kernels_reach {
        return NormRoute::Elsewhere;
    }
    let unfused = hints.get("algorithm").is_some_and(|a| a == "unfused");
    let by_nccl = hints.get("route").is_some_and(|r| r == "nccl");
    if by_nccl && !nccl {
        hint_ignored("device", OP, "route", "nccl", "NCCL is not available to every rank");
    }
    match () {
        _ if unfused || (by_nccl && nccl) => NormRoute::Unfused,
        _ if fused => NormRoute::Fused,
        _ if nccl => NormRoute::Unfused,
        _ => NormRoute::Elsewhere,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Nccl,
    Own,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Policy {
    nccl_present: bool,
    threshold: usize,
}

impl Policy {
    /// `threshold`: `FERROCOMM_NCCL_THRESHOLD` (the communicator's settings).
    pub(crate) fn new(nccl_present: bool, threshold: usize) -> Policy {
        Policy {
            nccl_present,
            threshold,
        }
    }

    /// `own_kernel`: the backend has a kernel of its own for `op`.
    pub(crate) fn choose(&self, op: &Op<'_>, hints: &BTreeMap<String, String>, own_kernel: bool) -> Result<Route> {
        let bytes = op.message_bytes();
        let wanted = match hints.get("route").map(String::as_str) {
            Some("nccl") => Route::Nccl,
            Some("device") => Route::Own,
            Some(other) => {
                return Err(Error::invalid(
                    op.name(),
                    format!("hint route={other:?}: expected \"nccl\" or \"device\""),
                ))
            }
            None if own_kernel && same_size_everywhere(op) && bytes < self.threshold => Route::Own,
            None => Route::Nccl,
        };
        let route = match (self.nccl_present, nccl_supports(op)) {
            (true, true) => wanted,
            (present, _) => {
                if let Some(v) = hints.get("route").filter(|v| *v == "nccl") {
                    let why = if present {
                        "NCCL has no such reduction (bitwise, or of 16-bit integers)"
                    } else {
                        "NCCL is not available to every rank"
                    };
                    hint_ignored("device", op.name(), "route", v, why);
                }
                Route::Own
            }
        };
        tracing::debug!(
            op = op.name(),
            bytes,
            ?route,
            nccl_present = self.nccl_present,
            "device backend route"
        );
        Ok(route)
    }
}

/// Whether every rank's call moves the same bytes, so that a size rule picks the same route on
/// every rank. all_to_all's parts may differ between ranks (its v form): no size rule for it.
fn same_size_everywhere(op: &Op<'_>) -> bool {
    !matches!(op, Op::AllToAll { .. })
}

/// NCCL has no bitwise reductions (but for bool's and / or), no 16-bit integers to reduce and
/// no inference collectives; those take the own path whatever the hint.
fn nccl_supports(op: &Op<'_>) -> bool {
    if matches!(op, Op::AllReduceRmsNorm(_) | Op::MoeDispatch(_) | Op::MoeCombine(_)) {
        return false;
    }
    match op {
        Op::AllReduce { op, buf } | Op::Reduce { op, buf, .. } => crate::backend::nccl::reduces(buf.dtype(), *op),
        Op::ReduceScatter { op, output, .. } => crate::backend::nccl::reduces(output.dtype(), *op),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contracts::dtype::ReduceOp;
    use crate::contracts::ops::BufMut;

    #[test]
    fn the_fused_norm_runs_fused_where_it_can_else_apart_with_nccl_else_elsewhere() {
        let none = BTreeMap::new();
        let unfused = hints(&[("algorithm", "unfused")]);
        let by_nccl = hints(&[("route", "nccl"), ("algorithm", "oneshot")]);
        assert_eq!(norm_route(&none, true, true, true), NormRoute::Fused);
        assert_eq!(norm_route(&none, true, false, true), NormRoute::Unfused);
        assert_eq!(norm_route(&none, true, false, false), NormRoute::Elsewhere);
        assert_eq!(norm_route(&unfused, true, true, false), NormRoute::Unfused);
        assert_eq!(norm_route(&by_nccl, true, true, true), NormRoute::Unfused);
        // route=nccl without NCCL is ignored.
        assert_eq!(norm_route(&by_nccl, true, true, false), NormRoute::Fused);
        // Host buffers on a GPU: the CPU engine, whatever the hints.
        assert_eq!(norm_route(&unfused, false, false, true), NormRoute::Elsewhere);
    }

    /// The policy of a communicator whose environment sets only `FERROCOMM_NCCL_THRESHOLD`.
    fn policy(nccl: bool, threshold: Option<&str>) -> Policy {
        let env = |k: &str| threshold.filter(|_| k == "FERROCOMM_NCCL_THRESHOLD").map(Into::into);
        let config = crate::contracts::config::Config::from_lookup(env).unwrap();
        Policy::new(nccl, config.nccl_threshold)
    }

    #[test]
    fn size_threshold_and_hints_pick_the_route() {
        let mut small = [0f32; 16];
        let mut big = [0f32; 4096];
        let small = Op::AllReduce {
            buf: BufMut::new(&mut small),
            op: ReduceOp::Sum,
        };
        let big = Op::AllReduce {
            buf: BufMut::new(&mut big),
            op: ReduceOp::Sum,
        };
        let none = BTreeMap::new();
        let force = |v: &str| BTreeMap::from([("route".to_string(), v.to_string())]);
        // With an own kernel: below the threshold it runs, from the threshold NCCL does.
        let p = policy(true, Some("1K"));
        assert_eq!(p.choose(&small, &none, true).unwrap(), Route::Own);
        assert_eq!(p.choose(&big, &none, true).unwrap(), Route::Nccl);
        assert_eq!(p.choose(&small, &force("nccl"), true).unwrap(), Route::Nccl);
        assert_eq!(p.choose(&big, &force("device"), true).unwrap(), Route::Own);
        assert!(p.choose(&big, &force("fastest"), true).is_err());
        // Without an own kernel, NCCL at any size.
        assert_eq!(p.choose(&small, &none, false).unwrap(), Route::Nccl);
        // Without NCCL every route is the own one, whatever the hint.
        let p = policy(false, None);
        assert_eq!(p.choose(&big, &force("nccl"), false).unwrap(), Route::Own);
        // Default threshold 256 KiB.
        let p = policy(true, None);
        assert_eq!(p.choose(&big, &none, true).unwrap(), Route::Own);
        let mut bits = [0u32; 4];
        let bits = Op::AllReduce {
            buf: BufMut::new(&mut bits),
            op: ReduceOp::BXor,
        };
        assert_eq!(p.choose(&bits, &force("nccl"), false).unwrap(), Route::Own);
    }

    /// NCCL has no 16-bit integers to reduce and no bool exclusive or; it reduces bool's and /
    /// or as min / max, and moves every type (as bytes where it has no type).
    #[test]
    fn reductions_nccl_lacks_take_the_own_path_and_everything_else_may_go_to_nccl() {
        let p = policy(true, None);
        let nccl = BTreeMap::from([("route".to_string(), "nccl".to_string())]);
        let (mut i, mut u, mut b) = ([0i16; 4], [0u16; 4], [false; 4]);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::BAnd] {
            let ints = Op::AllReduce {
                buf: BufMut::new(&mut i),
                op,
            };
            assert_eq!(p.choose(&ints, &nccl, false).unwrap(), Route::Own, "i16 {op}");
            let ints = Op::Reduce {
                buf: BufMut::new(&mut u),
                op,
                root: 0,
            };
            assert_eq!(p.choose(&ints, &nccl, false).unwrap(), Route::Own, "u16 {op}");
        }
        for (op, by_nccl) in [
            (ReduceOp::Sum, true),
            (ReduceOp::Min, true),
            (ReduceOp::BOr, true),
            (ReduceOp::BXor, false),
        ] {
            let bools = Op::AllReduce {
                buf: BufMut::new(&mut b),
                op,
            };
            let want = if by_nccl { Route::Nccl } else { Route::Own };
            assert_eq!(p.choose(&bools, &nccl, false).unwrap(), want, "bool {op}");
        }
        let moved = Op::Broadcast {
            buf: BufMut::new(&mut i),
            root: 0,
        };
        assert_eq!(p.choose(&moved, &nccl, false).unwrap(), Route::Nccl);
    }

    #[test]
    fn all_to_all_takes_no_size_rule_since_its_sizes_may_differ_between_ranks() {
        use crate::contracts::ops::Buf;
        let (a, mut b) = ([0f32; 4], [0f32; 4]);
        let tiny = Op::AllToAll {
            inputs: vec![Buf::new(&a)],
            outputs: vec![BufMut::new(&mut b)],
        };
        let none = BTreeMap::new();
        // Far below the threshold, yet NCCL where present, exactly as on a rank with big parts.
        assert_eq!(
            policy(true, Some("1M")).choose(&tiny, &none, true).unwrap(),
            Route::Nccl
        );
        assert_eq!(policy(false, None).choose(&tiny, &none, true).unwrap(), Route::Own);
        let device = BTreeMap::from([("route".to_string(), "device".to_string())]);
        assert_eq!(policy(true, None).choose(&tiny, &device, true).unwrap(), Route::Own);
    }

    fn hints(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn unknown_values_of_known_hints_are_refused_and_unknown_keys_pass() {
        for ok in [
            hints(&[]),
            hints(&[("foo", "bar")]),
            hints(&[("route", "nccl"), ("algorithm", "twoshot")]),
            hints(&[("route", "device"), ("algorithm", "ring")]),
        ] {
            check_hints("all_reduce", &ok).unwrap();
        }
        for (bad, accepted) in [
            (hints(&[("algorithm", "banana")]), "\"multimem\""),
            (hints(&[("route", "fastest"), ("algorithm", "oneshot")]), "\"nccl\""),
        ] {
            let e = check_hints("broadcast", &bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { op: "broadcast", .. }), "{e:?}");
            assert!(e.to_string().contains(accepted), "{e}");
        }
    }

    #[test]
    fn the_cpu_engine_gets_only_the_algorithms_it_knows() {
        let only = |pairs: &[(&str, &str)]| engine_hints("all_reduce", &hints(pairs));
        assert_eq!(
            only(&[("algorithm", "ring"), ("route", "nccl")]),
            hints(&[("algorithm", "ring")])
        );
        assert_eq!(only(&[("algorithm", "oneshot")]), hints(&[("algorithm", "oneshot")]));
        // The kernels' algorithms mean nothing to the engine: it runs its default.
        assert!(only(&[("algorithm", "twoshot")]).is_empty());
        assert!(only(&[("algorithm", "multimem"), ("foo", "bar")]).is_empty());
        assert!(wants_engine(&hints(&[("algorithm", "direct")])));
        assert!(!wants_engine(&hints(&[("algorithm", "oneshot")])));
        assert!(!wants_engine(&hints(&[])));
    }
}
