//! The header in front of every framed message, and the call it describes.
//!
//! 48 bytes, little endian: magic (4), operation, dtype, reduce op, flags (1 each), the
//! sequence number of the message on its ordered rank pair (8), the payload length (8), and,
//! in the first message a rank sends each peer for a collective (flag `CALL`), the call: its
//! element count (8), root (4), algorithm (1, then 3 spare), and the collective's sequence
//! number on the communicator (8). The receiver knows what it expects; any difference means
//! the ranks called different operations, or the same one with different arguments, and
//! becomes `Error::Mismatch` naming the field, both values and the peer.
//!
//! A large message between ranks of one host may carry, instead of its payload, a reference to
//! the sender's buffer (flag `BY_REFERENCE`; net/links/pull.rs): the receiver copies the payload
//! from there. On a TCP link with a second connection, a large message's payload may follow on
//! that connection instead (flag `BULK`; net/links/tcp.rs): the two are read in the same order.
//!
//! A rank that refuses its call (an argument that fails its own checks) still sends each peer
//! the first message of the collective, flagged `REFUSED` and carrying the reason: the peer
//! stops there, with an error that names the rank (see `Engine::refuse`).

use crate::contracts::error::Error;
use crate::net::links::REF_BYTES;

const MAGIC: u32 = 0xFE44_0C02;
pub(crate) const HEADER_BYTES: usize = 48;
/// Flag: the message carries its collective's call.
const CALL: u8 = 1;
/// Flag, with `CALL`: the sender refuses the call; the payload says why.
const REFUSED: u8 = 2;
/// Flag: the payload is not in the stream: a reference to the sender's buffer is, and the
/// receiver copies the payload from there (net/links/pull.rs).
const BY_REFERENCE: u8 = 4;
/// Flag: the payload follows on the link's second connection, not after the header.
const BULK: u8 = 8;
/// A call's element count where ranks legitimately differ (all_to_all_v).
pub(crate) const ANY_COUNT: u64 = u64::MAX;

/// What a message claims to be. Equal tags on both sides mean matching calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    pub op: u8,
    pub dtype: u8,
    pub redop: u8,
    pub nbytes: u64,
}

/// The arguments of one collective that every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub count: u64,
    pub root: u32,
    pub algo: u8,
    /// The collective's number on this communicator (set by the engine).
    pub seq: u64,
}

pub(crate) fn op_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "reduce",
        3 => "broadcast",
        4 => "all_gather",
        5 => "reduce_scatter",
        6 => "all_to_all",
        7 => "scatter",
        8 => "gather",
        9 => "barrier",
        10 => "send/recv",
        11 => "all_reduce_residual_rmsnorm",
        12 => "moe_dispatch",
        13 => "moe_combine",
        _ => "unknown",
    }
}

fn dtype_name(code: u8) -> &'static str {
    crate::contracts::dtype::DType::from_code(code).map_or("-", |d| d.name())
}

fn redop_name(code: u8) -> String {
    // The codes of ReduceOp::code; 0: the operation has none.
    let names = [
        "none",
        "sum",
        "prod",
        "min",
        "max",
        "avg",
        "band",
        "bor",
        "bxor",
        "premul_sum",
    ];
    names
        .get(code as usize)
        .map_or_else(|| format!("code {code}"), |n| n.to_string())
}

fn algo_name(code: u8) -> &'static str {
    match code {
        0 => "direct",
        1 => "ring",
        2 => "two_level",
        3 => "tree",
        _ => "unknown",
    }
}

impl Tag {
    /// The tag in one word, as a shared-memory round records it (the length travels apart).
    pub(crate) fn label(&self) -> u64 {
        self.op as u64 | (self.dtype as u64) << 8 | (self.redop as u64) << 16
    }

    pub(crate) fn from_label(label: u64, nbytes: u64) -> Tag {
        Tag {
            op: label as u8,
            dtype: (label >> 8) as u8,
            redop: (label >> 16) as u8,
            nbytes,
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "{} ({} bytes, dtype {}, reduce op {})",
            op_name(self.op),
            self.nbytes,
            dtype_name(self.dtype),
            redop_name(self.redop)
        )
    }
}

/// One message's header as sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub tag: Tag,
    /// The message's number on its ordered rank pair.
    pub seq: u64,
    pub call: Option<Call>,
    /// The sender refuses its call (a call message only).
    pub refused: bool,
}

pub(crate) fn encode(h: &Header) -> [u8; HEADER_BYTES] {
    let mut b = [0u8; HEADER_BYTES];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4] = h.tag.op;
    b[5] = h.tag.dtype;
    b[6] = h.tag.redop;
    b[8..16].copy_from_slice(&h.seq.to_le_bytes());
    b[16..24].copy_from_slice(&h.tag.nbytes.to_le_bytes());
    if let Some(c) = h.call {
        b[7] = CALL | if h.refused { REFUSED } else { 0 };
        b[24..32].copy_from_slice(&c.count.to_le_bytes());
        b[32..36].copy_from_slice(&c.root.to_le_bytes());
        b[36] = c.algo;
        b[40..48].copy_from_slice(&c.seq.to_le_bytes());
    }
    b
}

pub(crate) fn decode(b: &[u8; HEADER_BYTES]) -> Option<Header> {
    let word = |r: std::ops::Range<usize>| b[r].iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64);
    if word(0..4) as u32 != MAGIC {
        return None;
    }
    let call = (b[7] & CALL != 0).then(|| Call {
        count: word(24..32),
        root: word(32..36) as u32,
        algo: b[36],
        seq: word(40..48),
    });
    Some(Header {
        tag: Tag {
            op: b[4],
            dtype: b[5],
            redop: b[6],
            nbytes: word(16..24),
        },
        seq: word(8..16),
        call,
        refused: b[7] & (CALL | REFUSED) == CALL | REFUSED,
    })
}

/// Checks a received header against what this rank expects; the error names the first field
/// that differs, with both values.
pub(crate) fn check(op: &'static str, peer: usize, raw: &[u8; HEADER_BYTES], want: &Header) -> Result<(), Error> {
    // Nearly every header is the one expected, byte for byte: one comparison says so. Any
    // other (a transport's flag, a spare byte, a real difference) is read field by field below,
    // which accepts or names what differs exactly as before.
    if !want.refused && *raw == encode(want) {
        return Ok(());
    }
    let mismatch = |detail: String| Error::Mismatch { op, peer, detail };
    let differ = |field: &str, ours: String, theirs: String| {
        mismatch(format!("{field}: this rank has {ours}, rank {peer} has {theirs}"))
    };
    let Some(got) = decode(raw) else {
        return Err(mismatch(
            "received bytes that are not a ferrocomm message header".into(),
        ));
    };
    if got.refused {
        return Err(refused(op, peer, &got));
    }
    let (g, w) = (got.tag, want.tag);
    if g.op != w.op {
        return Err(differ("operation", op_name(w.op).into(), op_name(g.op).into()));
    }
    match (want.call, got.call) {
        (Some(wc), Some(gc)) => {
            if gc.seq != wc.seq {
                return Err(differ(
                    "collective number",
                    wc.seq.to_string(),
                    format!("{} (the ranks called different collectives before this one)", gc.seq),
                ));
            }
            if g.dtype != w.dtype {
                return Err(differ("dtype", dtype_name(w.dtype).into(), dtype_name(g.dtype).into()));
            }
            if g.redop != w.redop {
                return Err(differ("reduce op", redop_name(w.redop), redop_name(g.redop)));
            }
            if gc.count != wc.count {
                return Err(differ("element count", wc.count.to_string(), gc.count.to_string()));
            }
            if gc.root != wc.root {
                // all_gather and reduce_scatter have no root: the field carries a digest of
                // their block lengths (backend/cpu/mod.rs, `block_digest`).
                let field = if matches!(w.op, 4 | 5) {
                    "block lengths (digest)"
                } else {
                    "root"
                };
                return Err(differ(field, wc.root.to_string(), gc.root.to_string()));
            }
            if gc.algo != wc.algo {
                return Err(differ(
                    "algorithm",
                    algo_name(wc.algo).into(),
                    format!("{} (the ranks' algorithm hints differ)", algo_name(gc.algo)),
                ));
            }
        }
        (Some(_), None) => {
            return Err(mismatch(format!(
                "it sent a later message of {} where this rank expected the start of {}",
                g.describe(),
                w.describe()
            )))
        }
        (None, Some(_)) => {
            return Err(mismatch(format!(
                "it started another collective ({}) while this rank expects a message of {}",
                g.describe(),
                w.describe()
            )))
        }
        (None, None) => {}
    }
    if want.call.is_some() && got.call == want.call && g.nbytes == 0 && w.nbytes > 0 {
        // The same call, without its data: a tree's inner rank that failed before it forwarded
        // sends its children its call alone (engine.rs, `exchange_all`).
        return Err(mismatch(format!(
            "it sent its call of {} without the data: it failed in this collective (another rank's call differs)",
            w.describe()
        )));
    }
    if g != w {
        return Err(mismatch(format!(
            "it sent {}, this rank expected {}",
            g.describe(),
            w.describe()
        )));
    }
    if got.seq != want.seq {
        return Err(mismatch(format!(
            "message {} arrived where message {} was expected",
            got.seq, want.seq
        )));
    }
    Ok(())
}

/// What `check` says of a refused call; the engine then reads the reason that follows (see
/// `refusal`).
fn refused(op: &'static str, peer: usize, got: &Header) -> Error {
    refusal(op, peer, got.tag.op, b"the reason follows")
}

/// The error of a rank whose peer `peer` refused its call of operation `code` because `why`.
pub(crate) fn refusal(op: &'static str, peer: usize, code: u8, why: &[u8]) -> Error {
    Error::InvalidArgument {
        op,
        reason: format!(
            "rank {peer} refused its call of {} ({}); nothing moved",
            op_name(code),
            String::from_utf8_lossy(why)
        ),
    }
}

/// Whether a received header is a refused call.
pub(crate) fn is_refusal(raw: &[u8; HEADER_BYTES]) -> bool {
    decode(raw).is_some_and(|h| h.refused)
}

/// The bytes that follow a received header, if it is a header at all: its payload (in the
/// stream, or on the second connection where `in_bulk`), or the reference to it.
pub(crate) fn stream_len(raw: &[u8; HEADER_BYTES]) -> Option<u64> {
    decode(raw).map(|h| {
        if by_reference(raw) {
            REF_BYTES as u64
        } else {
            h.tag.nbytes
        }
    })
}

/// Marks a header whose payload goes by reference.
pub(crate) fn mark_by_reference(raw: &mut [u8; HEADER_BYTES]) {
    raw[7] |= BY_REFERENCE;
}

/// Whether a header's payload comes by reference.
pub(crate) fn by_reference(raw: &[u8; HEADER_BYTES]) -> bool {
    raw[7] & BY_REFERENCE != 0
}

/// Marks a header whose payload goes on the link's second connection.
pub(crate) fn mark_bulk(raw: &mut [u8; HEADER_BYTES]) {
    raw[7] |= BULK;
}

/// Whether a header's payload comes on the link's second connection.
pub(crate) fn in_bulk(raw: &[u8; HEADER_BYTES]) -> bool {
    raw[7] & BULK != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(root: u32, count: u64) -> Header {
        Header {
            tag: Tag {
                op: 3,
                dtype: 0,
                redop: 0,
                nbytes: 0,
            },
            seq: 7,
            call: Some(Call {
                count,
                root,
                algo: 0,
                seq: 2,
            }),
            refused: false,
        }
    }

    /// A call that comes alone where the same call was to come with data (a tree's inner rank
    /// that failed before it forwarded) says so, rather than naming a length.
    #[test]
    fn the_same_call_without_its_data_says_its_sender_failed() {
        let mut want = header(0, 2);
        want.tag.nbytes = 8;
        let alone = header(0, 2);
        let Err(Error::Mismatch { peer, detail, .. }) = check("broadcast", 2, &encode(&alone), &want) else {
            panic!("a call without its data passed the check");
        };
        assert_eq!(peer, 2);
        assert!(detail.contains("without the data"), "{detail}");
    }

    #[test]
    fn a_header_survives_the_wire() {
        let h = header(5, 1 << 40);
        assert_eq!(decode(&encode(&h)), Some(h));
        assert!(check("broadcast", 1, &encode(&h), &h).is_ok());
    }

    /// `check` compares the bytes first and reads the fields only where they differ: a header
    /// that differs from the expected one's bytes only in what the fields do not say (a
    /// transport's flag, spare bytes, a call's bytes in a message without one) passes too.
    #[test]
    fn bytes_the_fields_do_not_say_pass_the_check() {
        let h = header(5, 8);
        let mut raw = encode(&h);
        mark_by_reference(&mut raw);
        mark_bulk(&mut raw);
        raw[37] = 0xee;
        assert!(check("broadcast", 1, &raw, &h).is_ok());
        let later = Header { call: None, ..h };
        let mut raw = encode(&later);
        raw[24..48].fill(0x5a);
        assert!(check("broadcast", 1, &raw, &later).is_ok());
        raw[8] ^= 1;
        let e = check("broadcast", 1, &raw, &later).unwrap_err();
        assert!(e.to_string().contains("message 6 arrived where message 7"), "{e}");
    }

    #[test]
    fn each_call_field_is_named_with_both_values() {
        let e = check("broadcast", 2, &encode(&header(1, 8)), &header(0, 8)).unwrap_err();
        assert!(
            matches!(&e, Error::Mismatch { peer: 2, detail, .. } if detail == "root: this rank has 0, rank 2 has 1"),
            "{e}"
        );
        let e = check("broadcast", 2, &encode(&header(0, 9)), &header(0, 8)).unwrap_err();
        assert!(
            e.to_string().contains("element count: this rank has 8, rank 2 has 9"),
            "{e}"
        );
        let mut other = header(0, 8);
        other.tag.op = 1;
        let e = check("broadcast", 2, &encode(&other), &header(0, 8)).unwrap_err();
        assert!(
            e.to_string()
                .contains("operation: this rank has broadcast, rank 2 has all_reduce"),
            "{e}"
        );
        let e = check("broadcast", 2, &[0u8; HEADER_BYTES], &header(0, 8)).unwrap_err();
        assert!(e.to_string().contains("not a ferrocomm message header"), "{e}");
    }

    #[test]
    fn a_refused_call_is_an_argument_error_naming_the_rank_whatever_its_fields() {
        let mut other = header(9, 1);
        other.refused = true;
        assert_eq!(decode(&encode(&other)), Some(other));
        let e = check("broadcast", 3, &encode(&other), &header(0, 8)).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { reason, .. } if reason.starts_with("rank 3 refused")),
            "{e}"
        );
        assert!(is_refusal(&encode(&other)) && !is_refusal(&encode(&header(9, 1))));
        let e = refusal("all_gather", 3, 3, b"root 9 is not a rank");
        assert_eq!(
            e.to_string(),
            Error::invalid(
                "all_gather",
                "rank 3 refused its call of broadcast (root 9 is not a rank); nothing moved"
            )
            .to_string()
        );
    }
}
