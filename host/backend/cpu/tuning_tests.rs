//! The decisions of `Tuning`: hints honoured, ignored or refused.

use super::*;
use std::collections::BTreeMap;
use std::time::Duration;

const T: Tuning = Tuning {
    direct_max: 1024,
    chunk: 4096,
};

fn hints(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn choose(op: &'static str, bytes: usize, h: &[(&str, &str)]) -> Result<Algo> {
    let h = hints(h);
    T.choose(op, bytes, &RunOptions::new(Duration::from_secs(1), &h))
}

fn board(op: &'static str, bytes: usize, h: &[(&str, &str)], available: bool) -> Result<bool> {
    let h = hints(h);
    T.use_board(op, bytes, &RunOptions::new(Duration::from_secs(1), &h), available)
}

#[test]
fn without_a_hint_size_decides() {
    assert_eq!(choose("reduce", 1024, &[]).unwrap(), Algo::Direct);
    assert_eq!(choose("reduce", 1025, &[]).unwrap(), Algo::Ring);
    assert!(board("all_reduce", 1024, &[], true).unwrap());
    assert!(!board("all_reduce", 1025, &[], true).unwrap());
    assert!(!board("all_reduce", 8, &[], false).unwrap());
}

#[test]
fn direct_and_ring_are_honoured_at_any_size() {
    assert_eq!(choose("all_reduce", 8, &[("algorithm", "ring")]).unwrap(), Algo::Ring);
    assert_eq!(
        choose("broadcast", 1 << 20, &[("algorithm", "direct")]).unwrap(),
        Algo::Direct
    );
    // They also keep a small message off the board, which size alone would pick.
    assert!(!board("all_reduce", 8, &[("algorithm", "ring")], true).unwrap());
    assert!(!board("all_gather", 8, &[("algorithm", "direct")], true).unwrap());
}

#[test]
fn oneshot_where_it_cannot_run_is_ignored_for_the_default_choice() {
    let one = [("algorithm", "oneshot")];
    // Honoured where the board is available, even above the size rule's limit.
    assert!(board("all_reduce", 4096, &one, true).unwrap());
    // No board (TCP, or too big a contribution): the size rule, no error.
    assert!(!board("all_reduce", 8, &one, false).unwrap());
    assert_eq!(choose("all_reduce", 8, &one).unwrap(), Algo::Direct);
    assert_eq!(choose("all_reduce", 4096, &one).unwrap(), Algo::Ring);
    // Operations that have no shared-memory rounds run as without the hint.
    assert_eq!(choose("gather", 8, &one).unwrap(), Algo::Direct);
    assert_eq!(choose("reduce", 1 << 20, &one).unwrap(), Algo::Ring);
    // reduce_scatter has rounds: the board decides first, as for all_reduce.
    assert!(board("reduce_scatter", 4096, &one, true).unwrap());
}

#[test]
fn other_keys_are_ignored() {
    let h = [("foo", "bar"), ("route", "nccl")];
    assert_eq!(choose("broadcast", 8, &h).unwrap(), Algo::Direct);
    assert!(board("all_reduce", 8, &h, true).unwrap());
}

#[test]
fn an_unknown_algorithm_is_an_argument_error_listing_the_accepted_values() {
    let bad = [("algorithm", "banana")];
    for e in [
        choose("broadcast", 8, &bad).unwrap_err(),
        board("all_to_all", 0, &bad, true).unwrap_err(),
        board("all_reduce", 8, &bad, false).unwrap_err(),
    ] {
        let Error::InvalidArgument { op, reason } = &e else {
            panic!("{e:?}")
        };
        assert!(["broadcast", "all_to_all", "all_reduce"].contains(op));
        for word in ["banana", "oneshot", "direct", "ring"] {
            assert!(reason.contains(word), "{reason}");
        }
    }
}

#[test]
fn a_lower_round_limit_keeps_larger_operations_off_the_board_unless_the_hint_asks() {
    let h = hints(&[]);
    let o = RunOptions::new(Duration::from_secs(1), &h);
    assert!(T.use_board_for("broadcast", 2048, &o, true, 0..=2048).unwrap());
    assert!(!T.use_board_for("broadcast", 2049, &o, true, 0..=2048).unwrap());
    assert!(!T.use_board_for("broadcast", 2048, &o, true, 2049..=usize::MAX).unwrap());
    let h = hints(&[("algorithm", "oneshot")]);
    let o = RunOptions::new(Duration::from_secs(1), &h);
    assert!(T.use_board_for("broadcast", 4096, &o, true, 0..=2048).unwrap());
    assert!(T.use_board_for("broadcast", 8, &o, true, 2049..=usize::MAX).unwrap());
}

#[test]
fn two_level_runs_where_ranks_span_machines_evenly_from_its_size_or_by_its_hint() {
    let layout = two_level::Layout::of(&[0, 0, 1, 1], 0);
    let at = |bytes: usize, h: &[(&str, &str)], layout: Option<&two_level::Layout>| {
        let h = hints(h);
        T.two_level(bytes, &RunOptions::new(Duration::from_secs(1), &h), layout)
            .map(|l| l.is_some())
    };
    let from = two_level::TWO_LEVEL_FROM;
    assert!(!at(from - 4, &[], layout.as_ref()).unwrap());
    assert!(at(from, &[], layout.as_ref()).unwrap());
    // The hint takes any size; another algorithm's hint keeps it off.
    assert!(at(8, &[("algorithm", "two_level")], layout.as_ref()).unwrap());
    assert!(!at(from, &[("algorithm", "ring")], layout.as_ref()).unwrap());
    // One machine: ignored, hint or not.
    assert!(!at(from, &[("algorithm", "two_level")], None).unwrap());
    assert!(!at(from, &[], None).unwrap());
    assert!(at(from, &[("algorithm", "two_levels")], layout.as_ref()).is_err());
    // Other operations run by size under the hint.
    assert_eq!(
        choose("reduce", 8, &[("algorithm", "two_level")]).unwrap(),
        Algo::Direct
    );
    assert_eq!(
        choose("all_gather", 4096, &[("algorithm", "two_level")]).unwrap(),
        Algo::Ring
    );
}
