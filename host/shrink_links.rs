//! Whether the communicator that `Comm::shrink` makes can take over the links of the one it
//! replaces (NCCL's `ncclCommShrink` keeps its parent's resources the same way when the parent
//! is healthy).
//!
//! Each survivor puts its host engine's [`LinkLedger`] in the `alive` key it sets anyway, so the
//! decision costs no store round: once the members are agreed, every member reads the same
//! keys and comes to the same answer. The links are taken over when every member has a ledger
//! (its engine is not broken, aborted or mid-operation) and every message one member sent
//! another was taken in by it or is owed to it (`LinkLedger::owed`, taken in before the hand
//! over). Otherwise, and always after a failure (which closes a rank's links on purpose, so
//! that its peers learn of it at once), the new communicator is built fresh over the store.
//!
//! The shared-memory board goes along only where every rank left out is done with it for
//! good, as some member saw (closed, aborted, failed, or its process gone): a rank still
//! reading an old round from a member's slot would otherwise read it torn once the member
//! reuses the slot.

use crate::contracts::backend::LinkLedger;
use crate::contracts::error::{Error, Result};

/// How the smaller communicator gets its links.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handover {
    /// Built over the store, as any new communicator.
    Fresh,
    /// The members' links, and the board with them if `keep_board`.
    Links { keep_board: bool },
}

/// What a survivor sets as its `alive` key: `1`, then its ledger if it has one.
pub(crate) fn encode_alive(ledger: Option<&LinkLedger>) -> Vec<u8> {
    let Some(l) = ledger else { return b"1".to_vec() };
    let list = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let quiet: Vec<u64> = l.quiet.iter().map(|&q| u64::from(q)).collect();
    let board = l.board_round.map_or("-".to_owned(), |b| b.to_string());
    format!(
        "1;b={board};s={};t={};o={};q={}",
        list(&l.sent),
        list(&l.taken),
        list(&l.owed),
        list(&quiet)
    )
    .into_bytes()
}

/// The ledger in an `alive` key of a communicator of `size` ranks (`None`: the rank has none).
pub(crate) fn decode_alive(raw: &[u8], size: usize) -> Result<Option<LinkLedger>> {
    let bad = |why: &str| Error::Protocol {
        context: "shrink agreement",
        reason: format!("malformed alive key {:?}: {why}", String::from_utf8_lossy(raw)),
    };
    let text = std::str::from_utf8(raw).map_err(|_| bad("not text"))?;
    let mut fields = text.split(';');
    if fields.next() != Some("1") {
        return Err(bad("no leading 1"));
    }
    let mut field = |name: &str| {
        fields
            .next()
            .and_then(|f| f.strip_prefix(name))
            .and_then(|f| f.strip_prefix('='))
            .ok_or_else(|| bad(&format!("no field {name}")))
    };
    let Ok(board) = field("b") else {
        return if text == "1" {
            Ok(None)
        } else {
            Err(bad("unknown fields"))
        };
    };
    let list = |f: &str| -> Result<Vec<u64>> {
        let v = if f.is_empty() {
            Vec::new()
        } else {
            f.split(',')
                .map(|n| n.parse().map_err(|_| bad("not a number")))
                .collect::<Result<_>>()?
        };
        if v.len() == size {
            Ok(v)
        } else {
            Err(bad(&format!(
                "{} entries where the communicator has {size} ranks",
                v.len()
            )))
        }
    };
    let board_round = match board {
        "-" => None,
        n => Some(n.parse().map_err(|_| bad("board round not a number"))?),
    };
    let (sent, taken, owed) = (list(field("s")?)?, list(field("t")?)?, list(field("o")?)?);
    let quiet = list(field("q")?)?;
    if fields.next().is_some() || quiet.iter().any(|&q| q > 1) {
        return Err(bad("trailing fields or a quiet flag other than 0 and 1"));
    }
    Ok(Some(LinkLedger {
        sent,
        taken,
        owed,
        board_round,
        quiet: quiet.into_iter().map(|q| q == 1).collect(),
    }))
}

/// The hand-over for `members` (ranks of the old communicator, ascending), given each
/// member's ledger in that order, and the old communicator's `size`.
pub(crate) fn decide(members: &[usize], ledgers: &[Option<LinkLedger>], size: usize) -> Handover {
    let Some(all) = ledgers.iter().map(Option::as_ref).collect::<Option<Vec<&LinkLedger>>>() else {
        return Handover::Fresh;
    };
    let in_step = members.iter().zip(&all).all(|(&a, la)| {
        members
            .iter()
            .zip(&all)
            .all(|(&b, lb)| a == b || la.sent[b] == lb.taken[a] + lb.owed[a])
    });
    if !in_step {
        return Handover::Fresh;
    }
    let round = all[0].board_round;
    let left_out_quiet = (0..size)
        .filter(|r| !members.contains(r))
        .all(|r| all.iter().any(|l| l.quiet[r]));
    Handover::Links {
        keep_board: round.is_some() && all.iter().all(|l| l.board_round == round) && left_out_quiet,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(sent: [u64; 3], taken: [u64; 3], owed: [u64; 3], board: Option<u64>, quiet: [bool; 3]) -> LinkLedger {
        LinkLedger {
            sent: sent.to_vec(),
            taken: taken.to_vec(),
            owed: owed.to_vec(),
            board_round: board,
            quiet: quiet.to_vec(),
        }
    }

    #[test]
    fn alive_keys_round_trip_and_garbage_is_a_protocol_error() {
        let l = ledger([0, 4, 7], [0, 3, 6], [0, 1, 0], Some(12), [false, false, true]);
        assert_eq!(decode_alive(&encode_alive(Some(&l)), 3).unwrap(), Some(l.clone()));
        assert_eq!(decode_alive(&encode_alive(None), 3).unwrap(), None);
        let no_board = LinkLedger { board_round: None, ..l };
        assert_eq!(
            decode_alive(&encode_alive(Some(&no_board)), 3).unwrap(),
            Some(no_board.clone())
        );
        let good = String::from_utf8(encode_alive(Some(&no_board))).unwrap();
        for bad in [
            "",
            "2",
            "1;x=1",
            "1;b=-;s=1,2;t=0,0,0;o=0,0,0;q=0,0,0",
            "1;b=-;s=1,2,x;t=0,0,0;o=0,0,0;q=0,0,0",
            "1;b=z;s=1,2,3;t=0,0,0;o=0,0,0;q=0,0,0",
            "1;b=-;s=1,2,3;t=0,0,0;o=0,0,0;q=0,2,0",
            "1;b=-;s=1,2,3;t=0,0,0;o=0,0,0",
            &format!("{good};more"),
        ] {
            assert!(
                matches!(decode_alive(bad.as_bytes(), 3), Err(Error::Protocol { .. })),
                "{bad:?}"
            );
        }
        assert!(decode_alive(b"\xff", 3).is_err());
        // The same key read for a communicator of another size does not fit.
        assert!(decode_alive(good.as_bytes(), 4).is_err());
    }

    #[test]
    fn links_are_handed_over_only_in_step_and_the_board_only_when_those_left_out_are_quiet() {
        // Ranks 0 and 2 stay; rank 1 leaves. 0 sent 5 to 2, which took 4 and is owed 1; 2
        // sent 3 to 0, which took them all.
        let l0 = ledger([0, 9, 5], [0, 9, 3], [0, 0, 0], Some(8), [false, true, false]);
        let l2 = ledger([3, 9, 0], [4, 9, 0], [1, 0, 0], Some(8), [false, false, false]);
        let members = [0, 2];
        assert_eq!(
            decide(&members, &[Some(l0.clone()), Some(l2.clone())], 3),
            Handover::Links { keep_board: true }
        );
        // Rank 1 quiet in nobody's view: links, no board.
        let loud = LinkLedger {
            quiet: vec![false; 3],
            ..l0.clone()
        };
        assert_eq!(
            decide(&members, &[Some(loud), Some(l2.clone())], 3),
            Handover::Links { keep_board: false }
        );
        // Boards at different rounds, or one rank without one: no board.
        let later = LinkLedger {
            board_round: Some(9),
            ..l2.clone()
        };
        assert_eq!(
            decide(&members, &[Some(l0.clone()), Some(later)], 3),
            Handover::Links { keep_board: false }
        );
        // A message in flight that nobody owes: fresh.
        let short = LinkLedger {
            taken: vec![0, 9, 2],
            ..l0.clone()
        };
        assert_eq!(decide(&members, &[Some(short), Some(l2.clone())], 3), Handover::Fresh);
        // A member without a ledger (broken, aborted): fresh.
        assert_eq!(decide(&members, &[Some(l0), None], 3), Handover::Fresh);
    }
}
