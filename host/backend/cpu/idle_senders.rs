//! One thread per process that sends the held calls of ranks that have gone quiet.
//!
//! A rank holds its header-only calls to peers that do not wait for them (held_calls.rs) and
//! sends them with later ones, when it waits, or at its close. A rank that makes no further
//! call and is not yet closed would keep them, while a peer's close waits for the calls it is
//! owed (engine.rs, `settle_deferred`): the ranks of one process closed one after another on one
//! thread (a group of threads dropped in turn), or of two processes each closing its ranks in
//! turn, then waited on each other until the timeout. This thread looks every `TICK` at the
//! ranks that hold calls and sends those of a rank that has run nothing since its last look and
//! is not running anything now. It sleeps while no rank holds any.

use std::sync::{Arc, Mutex, Weak};
use std::thread::Thread;
use std::time::Duration;

/// How often the thread looks: a quiet rank's held calls leave within two looks.
const TICK: Duration = Duration::from_millis(1);

/// A rank that may hold calls, as this thread sees it.
pub(crate) trait QuietSender: Send + Sync {
    /// Sends the rank's held calls if it has run nothing since the last look and runs nothing
    /// now; returns whether to look at it again (it still holds calls).
    fn send_if_quiet(&self) -> bool;
}

type Ranks = Mutex<Vec<Weak<dyn QuietSender>>>;

/// The ranks that held calls when they last ran, and the thread that looks at them.
struct Watch {
    ranks: Arc<Ranks>,
    thread: Thread,
}

static WATCH: Mutex<Option<Watch>> = Mutex::new(None);

/// Starts the thread, once per process: a communicator that may hold calls needs it.
pub(crate) fn start() -> std::io::Result<()> {
    let mut w = WATCH.lock().unwrap_or_else(|p| p.into_inner());
    if w.is_some() {
        return Ok(());
    }
    let ranks = Arc::new(Ranks::default());
    let looked_at = ranks.clone();
    let handle = std::thread::Builder::new()
        .name("ferrocomm-held-calls".into())
        .spawn(move || look_forever(&looked_at))?;
    *w = Some(Watch {
        ranks,
        thread: handle.thread().clone(),
    });
    Ok(())
}

/// Adds a rank that holds calls (its caller marks it watched until `send_if_quiet` says to
/// look no more). Without a started thread nothing is watched, and `start` said why.
pub(crate) fn watch(rank: Weak<dyn QuietSender>) {
    let w = WATCH.lock().unwrap_or_else(|p| p.into_inner());
    let Some(w) = w.as_ref() else { return };
    let mut ranks = w.ranks.lock().unwrap_or_else(|p| p.into_inner());
    let was_empty = ranks.is_empty();
    ranks.push(rank);
    drop(ranks);
    if was_empty {
        w.thread.unpark();
    }
}

fn look_forever(ranks: &Ranks) -> ! {
    loop {
        let empty = ranks.lock().unwrap_or_else(|p| p.into_inner()).is_empty();
        if empty {
            // An unpark from `watch` between the look and the park is kept as a token.
            std::thread::park();
            continue;
        }
        std::thread::sleep(TICK);
        // The whole pass under the list's lock: a rank that `send_if_quiet` lets go and that
        // holds calls again waits here to be listed anew, after the pass has dropped the old
        // entry. `send_if_quiet` only tries its rank's lock, so this lock never waits on it.
        let mut ranks = ranks.lock().unwrap_or_else(|p| p.into_inner());
        ranks.retain(|r| r.upgrade().is_some_and(|r| r.send_if_quiet()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    /// Quiet after `busy` looks; then sends, and is looked at no more.
    struct Counting {
        looks: AtomicUsize,
        busy: usize,
    }

    impl QuietSender for Counting {
        fn send_if_quiet(&self) -> bool {
            self.looks.fetch_add(1, Ordering::SeqCst) < self.busy
        }
    }

    #[test]
    fn a_watched_rank_is_looked_at_until_it_has_sent() {
        start().unwrap();
        let r = Arc::new(Counting {
            looks: AtomicUsize::new(0),
            busy: 3,
        });
        watch(Arc::downgrade(&r) as Weak<dyn QuietSender>);
        let t0 = Instant::now();
        while r.looks.load(Ordering::SeqCst) < 4 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "looked at {} times",
                r.looks.load(Ordering::SeqCst)
            );
            std::thread::sleep(TICK);
        }
        std::thread::sleep(TICK * 20);
        assert_eq!(
            r.looks.load(Ordering::SeqCst),
            4,
            "no look after it said it holds nothing"
        );
    }
}
