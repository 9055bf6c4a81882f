//! Hardware queues for ranks that share a GPU in one process.
//!
//! CUDA feeds a context's streams to the GPU through a few hardware queues (connections):
//! `CUDA_DEVICE_MAX_CONNECTIONS` of them, 8 unless set, at most 32, read when the context is
//! made. Streams beyond that share queues, and a queue runs its work in the order it was
//! submitted. Ranks that share a GPU in one process run kernels that wait for each other, one
//! stream per rank. If rank A's stream holds a waiting kernel and then anything ordered after
//! it (a copy, the next kernel), and rank B's kernel was submitted later to the same queue,
//! B's kernel cannot start until A's ends, and A's waits for B's until its deadline: every
//! such call times out. Eight queues are too few for eight ranks and the streams around them;
//! with 32 the streams a process makes spread far wider. So ferrocomm asks for 32 before it
//! initialises CUDA unless the variable is set, and warns where ranks share a GPU in one
//! process without them.

use crate::contracts::config;
use std::sync::OnceLock;

const VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";
/// The most hardware queues CUDA gives a context.
const WANTED: u32 = 32;

/// Why ranks sharing a GPU in this process may stall, if they may (decided by `record`).
static CONCERN: OnceLock<Option<String>> = OnceLock::new();

/// Called once, before this process's first cuInit through ferrocomm: asks for 32 queues
/// unless the variable is set, and returns the user's value. The user's value is the one the
/// process's settings read ([`config::current`]), read here at the latest, so before this
/// write. The variable is only written while CUDA is not initialised yet by us; Rust's own
/// environment accesses are locked against each other.
pub(super) fn request() -> crate::contracts::error::Result<Option<String>> {
    let set = config::current()?.var(VAR);
    if set.is_none() {
        std::env::set_var(VAR, WANTED.to_string());
    }
    Ok(set)
}

/// Records, after cuInit, whether the queues were in effect: `user_value` is what `request`
/// found, `context_existed` whether a GPU's primary context was already made (by another
/// library of this process) before ferrocomm could ask.
pub(super) fn record(user_value: Option<&str>, context_existed: bool) {
    let _ = CONCERN.set(concern(user_value, context_existed));
}

/// Why ranks sharing a GPU in this process may stall; `None` when 32 queues are in effect
/// (or CUDA was never initialised through ferrocomm).
pub(crate) fn shared_gpu_concern() -> Option<&'static str> {
    CONCERN.get()?.as_deref()
}

fn concern(user_value: Option<&str>, context_existed: bool) -> Option<String> {
    let fix = format!("set {VAR}={WANTED} before the program starts");
    match user_value {
        Some(v) if v.trim().parse::<u32>().is_ok_and(|n| n >= WANTED) => None,
        Some(v) => Some(format!(
            "{VAR}={v} gives CUDA fewer than {WANTED} hardware queues: ranks' streams may share one, \
             and a rank's kernel may then wait behind a peer's that waits for it, until the timeout; {fix}"
        )),
        None if context_existed => Some(format!(
            "this process made its CUDA context before ferrocomm could ask for {WANTED} hardware \
             queues, so it has CUDA's default of 8: ranks' streams may share one, and a rank's kernel \
             may then wait behind a peer's that waits for it, until the timeout; {fix}"
        )),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_sharing_a_gpu_are_warned_only_without_32_queues() {
        assert_eq!(concern(None, false), None, "ferrocomm's own request is in effect");
        assert_eq!(concern(Some("32"), true), None, "the user's value is in effect");
        assert_eq!(concern(Some(" 32 "), false), None);
        for (value, existed) in [
            (Some("8"), false),
            (Some("1"), true),
            (Some("many"), false),
            (None, true),
        ] {
            let why = concern(value, existed).expect("a concern");
            assert!(why.contains("CUDA_DEVICE_MAX_CONNECTIONS=32"), "names the fix: {why}");
        }
        assert!(concern(Some("4"), false)
            .unwrap()
            .starts_with("CUDA_DEVICE_MAX_CONNECTIONS=4 "));
    }

    #[test]
    fn the_request_keeps_a_value_the_user_set() {
        // A concurrent request (another test initialising CUDA) writes 32 only where nothing
        // was set either, so the outcome is the same.
        let before = config::current().unwrap().var(VAR);
        request().unwrap();
        // A fresh read of the environment, unlike `current`'s copy from before the request.
        let now = config::Config::from_env()
            .unwrap()
            .var(VAR)
            .expect("set after the request");
        match before {
            Some(v) => assert_eq!(now, v),
            None => assert_eq!(now, "32"),
        }
    }
}
