//! Every collective, dtype, reduce op and algorithm against a host reference, with the ranks
//! as threads of this process (world sizes 1, 2, 3, 4, 8).

mod common;
use common::*;
use std::time::Duration;

fn world(n: usize) {
    let seed = fresh_seed();
    let checks = run_group(n, &format!("suite{n}"), options(Duration::from_secs(60)), |c| {
        common::suite::run_all(c, seed)
    });
    assert!(checks.iter().all(|&k| k == checks[0] && k > 0));
    eprintln!("world {n}: {} checked calls per rank", checks[0]);
}

#[test]
fn every_collective_world_1() {
    world(1);
}
#[test]
fn every_collective_world_2() {
    world(2);
}
#[test]
fn every_collective_world_3() {
    world(3);
}
#[test]
fn every_collective_world_4() {
    world(4);
}
#[test]
fn every_collective_world_8() {
    world(8);
}
