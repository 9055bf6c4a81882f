//! Object collectives that cannot deliver a value fail every rank at once, with an error that
//! says why and names the rank at fault, well under the communicator's timeout, and leave the
//! communicator usable: a root without a value (broadcast_object, scatter_object), a root with
//! the wrong number of values (scatter_object), a value that does not serialize on its rank, or
//! does not deserialize on a receiving one; and values of different sizes, which must still
//! work. Three ranks as threads of this process, and as processes over shared memory and TCP.

mod common;
use common::*;
use ferrocomm::Error;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::time::Instant;

/// The communicator's timeout: a rank left waiting for bytes would take this long.
const TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failing call may take on any rank.
const PROMPTLY: Duration = Duration::from_secs(2);

/// Runs `f`, requiring it to return within `PROMPTLY`.
fn promptly<R>(c: &Comm, what: &str, f: impl FnOnce() -> R) -> R {
    let t0 = Instant::now();
    let r = f();
    let took = t0.elapsed();
    assert!(took < PROMPTLY, "rank {}: {what} took {took:?}", c.rank());
    r
}

/// Requires `InvalidArgument { op, reason }` with exactly `reason`.
fn expect_invalid<T: std::fmt::Debug>(c: &Comm, got: ferrocomm::Result<T>, op: &str, reason: &str) {
    let e = got.expect_err(&format!("rank {}: {op} should fail", c.rank()));
    assert!(
        matches!(&e, Error::InvalidArgument { op: o, reason: r } if *o == op && r == reason),
        "rank {}: expected InvalidArgument {op}: {reason:?}, got {e:?}",
        c.rank()
    );
    assert_eq!(e.to_string(), format!("{op}: {reason}"));
}

/// Requires `Serialization { op, reason }` with `reason` containing `part`.
fn expect_serialization<T: std::fmt::Debug>(c: &Comm, got: ferrocomm::Result<T>, op: &str, part: &str) {
    match got {
        Err(Error::Serialization { op: o, reason }) if o == op && reason.contains(part) => {}
        other => panic!(
            "rank {}: expected Serialization {op} with {part:?}, got {other:?}",
            c.rank()
        ),
    }
}

/// A number that serializes unless it is 13.
#[derive(Debug, PartialEq)]
struct Picky(u32);

impl Serialize for Picky {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == 13 {
            return Err(serde::ser::Error::custom("13 refuses to be serialized"));
        }
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Picky {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        u32::deserialize(d).map(Picky)
    }
}

/// The root (rank 1) passes `None`; then a broadcast with a value.
fn broadcast_without_a_value(c: &Comm) {
    let root = 1;
    let got = promptly(c, "broadcast_object(None)", || c.broadcast_object::<String>(None, root));
    let reason = if c.rank() == root {
        "the root has no value to broadcast"
    } else {
        "rank 1 (the root) has no value to broadcast"
    };
    expect_invalid(c, got, "broadcast_object", reason);

    let value = (c.rank() == root).then(|| "after".to_string());
    assert_eq!(c.broadcast_object(value.as_ref(), root).unwrap(), "after");
}

/// The root (rank 2) passes no values, then two values for three ranks; then a scatter that
/// works.
fn scatter_without_values(c: &Comm) {
    let root = 2;
    let is_root = c.rank() == root;
    let got = promptly(c, "scatter_object(None)", || c.scatter_object::<u32>(None, root));
    let reason = if is_root {
        "the root has no values to scatter"
    } else {
        "rank 2 (the root) has no values to scatter"
    };
    expect_invalid(c, got, "scatter_object", reason);

    let two = [7u32, 8];
    let got = promptly(c, "scatter_object(2 values)", || {
        c.scatter_object(is_root.then_some(&two[..]), root)
    });
    let list = if is_root {
        "the value list of the root"
    } else {
        "the value list of rank 2 (the root)"
    };
    match got {
        Err(Error::SizeMismatch {
            op: "scatter_object",
            what,
            expected: 3,
            actual: 2,
        }) => assert_eq!(what, list, "rank {}", c.rank()),
        other => panic!("rank {}: expected SizeMismatch, got {other:?}", c.rank()),
    }

    let three = [10u32, 20, 30];
    assert_eq!(
        c.scatter_object(is_root.then_some(&three[..]), root).unwrap(),
        [10, 20, 30][c.rank()]
    );
}

/// Values that do not deserialize on the ranks that receive them: only those ranks fail.
fn undeserializable_on_a_receiver(c: &Comm) {
    // A string's bytes (length 5, then "hello") are no bool: rank 2 asks for one.
    let hello = (c.rank() == 0).then(|| "hello".to_string());
    if c.rank() == 2 {
        let got = promptly(c, "broadcast_object as bool", || c.broadcast_object::<bool>(None, 0));
        expect_serialization(c, got, "broadcast_object", "");
    } else {
        let got = promptly(c, "broadcast_object", || c.broadcast_object(hello.as_ref(), 0));
        assert_eq!(got.unwrap(), "hello");
    }

    let words = ["zero".to_string(), "one!".into(), "two!".into()];
    let words = (c.rank() == 0).then_some(&words[..]);
    if c.rank() == 1 {
        let got = promptly(c, "scatter_object as bool", || c.scatter_object::<bool>(None, 0));
        expect_serialization(c, got, "scatter_object", "");
    } else {
        let got = promptly(c, "scatter_object", || c.scatter_object(words, 0));
        assert_eq!(got.unwrap(), ["zero", "one!", "two!"][c.rank()]);
    }

    let all = c.all_gather_object(&c.rank()).unwrap();
    assert_eq!(all, [0, 1, 2]);
}

/// Values that do not serialize: on the root of broadcast_object and scatter_object, on one
/// rank of all_gather_object and gather_object. Then every call with good values.
fn unserializable_on_one_rank(c: &Comm) {
    let me = c.rank();
    const OWN: &str = "13 refuses to be serialized";

    let got = promptly(c, "broadcast_object(13)", || {
        c.broadcast_object((me == 0).then_some(&Picky(13)), 0)
    });
    let part = if me == 0 {
        OWN
    } else {
        "rank 0 (the root) could not serialize its value"
    };
    expect_serialization(c, got, "broadcast_object", part);

    let got = promptly(c, "all_gather_object(13 on rank 1)", || {
        c.all_gather_object(&Picky(if me == 1 { 13 } else { 0 }))
    });
    let part = if me == 1 {
        OWN
    } else {
        "rank 1 could not serialize its value"
    };
    expect_serialization(c, got, "all_gather_object", part);

    // Only the root gathers, so only it and the failing rank hear of it.
    let got = promptly(c, "gather_object(13 on rank 2)", || {
        c.gather_object(&Picky(if me == 2 { 13 } else { 0 }), 0)
    });
    match me {
        0 => expect_serialization(c, got, "gather_object", "rank 2 could not serialize its value"),
        1 => assert_eq!(got.unwrap(), None),
        _ => expect_serialization(c, got, "gather_object", OWN),
    }

    let values = [Picky(1), Picky(13), Picky(3)];
    let got = promptly(c, "scatter_object(13 for rank 1)", || {
        c.scatter_object((me == 1).then_some(&values[..]), 1)
    });
    let part = if me == 1 {
        OWN
    } else {
        "rank 1 (the root) could not serialize its value"
    };
    expect_serialization(c, got, "scatter_object", part);

    let good = Picky(me as u32 + 100);
    assert_eq!(
        c.all_gather_object(&good).unwrap(),
        [Picky(100), Picky(101), Picky(102)]
    );
    let gathered = c.gather_object(&good, 2).unwrap();
    assert_eq!(gathered, (me == 2).then(|| vec![Picky(100), Picky(101), Picky(102)]));
    assert_eq!(c.broadcast_object((me == 0).then_some(&good), 0).unwrap(), Picky(100));
    let values = [Picky(5), Picky(6), Picky(7)];
    assert_eq!(
        c.scatter_object((me == 0).then_some(&values[..]), 0).unwrap(),
        Picky(5 + me as u32)
    );
}

/// Values whose encodings differ in size from rank to rank (the object collectives are
/// v-collectives underneath), and the empty value.
fn values_of_different_sizes(c: &Comm) {
    let me = c.rank();
    let text = |r: usize| "x".repeat(r * 1000);
    let want: Vec<String> = (0..3).map(text).collect();
    assert_eq!(c.all_gather_object(&text(me)).unwrap(), want);
    assert_eq!(c.gather_object(&text(me), 1).unwrap(), (me == 1).then(|| want.clone()));
    assert_eq!(c.scatter_object((me == 2).then_some(&want[..]), 2).unwrap(), text(me));
    assert_eq!(c.broadcast_object((me == 0).then_some(&()), 0).unwrap(), ());
}

type Check = fn(&Comm);
const CHECKS: [(&str, Check); 5] = [
    ("values_of_different_sizes", values_of_different_sizes),
    ("broadcast_without_a_value", broadcast_without_a_value),
    ("scatter_without_values", scatter_without_values),
    ("undeserializable_on_a_receiver", undeserializable_on_a_receiver),
    ("unserializable_on_one_rank", unserializable_on_one_rank),
];

fn on_threads(name: &str) {
    let (_, check) = CHECKS.iter().find(|(n, _)| *n == name).unwrap();
    run_group(3, name, options(TIMEOUT), check);
}

#[test]
fn values_of_different_sizes_reach_every_rank() {
    on_threads("values_of_different_sizes");
}

#[test]
fn broadcast_object_without_a_value_at_the_root_fails_every_rank_at_once() {
    on_threads("broadcast_without_a_value");
}

#[test]
fn scatter_object_without_one_value_per_rank_at_the_root_fails_every_rank_at_once() {
    on_threads("scatter_without_values");
}

#[test]
fn a_value_that_does_not_deserialize_fails_only_its_receiver() {
    on_threads("undeserializable_on_a_receiver");
}

#[test]
fn a_value_that_does_not_serialize_fails_every_rank_that_waits_for_it() {
    on_threads("unserializable_on_one_rank");
}

const MODE: &str = "FERROCOMM_TEST_MODE";

/// The rank side of the process tests: every check in turn. Does nothing unless started by
/// `every_check_as_processes_over_shared_memory_and_tcp`.
#[test]
#[ignore = "run by the process test as its ranks"]
fn child_entry() {
    if std::env::var(MODE).as_deref() != Ok("objects") {
        eprintln!("child_entry: not started by the process test, nothing to do");
        return;
    }
    let comm = new_comm("cpu", Device::Cpu, "objects", CommOptions::from_env().unwrap()).unwrap();
    for (name, check) in CHECKS {
        check(&comm);
        println!("checked {name}");
    }
    comm.finalize().unwrap();
    println!("child ok");
}

#[test]
fn every_check_as_processes_over_shared_memory_and_tcp() {
    for transport in ["auto", "tcp"] {
        let env = [
            (MODE, "objects"),
            ("FERROCOMM_TIMEOUT", "30"),
            ("FERROCOMM_TRANSPORT", transport),
        ];
        let job = start_direct("child_entry", 3, &env);
        let deadline = Instant::now() + Duration::from_secs(60);
        for (r, child) in job.ranks.into_iter().enumerate() {
            let (status, out, _) = wait_child(child, deadline);
            assert!(
                status.is_some_and(|s| s.success()) && out.contains("child ok"),
                "{transport}: rank {r} ({status:?}):\n{out}"
            );
        }
    }
}
