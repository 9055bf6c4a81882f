//! The 16-byte proxy descriptor of device-api's abi.h (`ferrocomm_proxy_queue`): encoding for
//! host producers, and decoding that checks every field, because the words come from kernels
//! and a bad one must become an error, not a wild copy.

use crate::contracts::window::SignalOp;

/// Op code of a put descriptor (bits 56..62 of word 0; `FERROCOMM_PROXY_PUT`).
pub const PUT: u64 = 1;
/// Op code of a signal descriptor (bits 56..62 of word 0; `FERROCOMM_PROXY_SIGNAL`).
pub const SIGNAL: u64 = 2;
/// Bit of word 0 that carries the lap parity (see [`parity`]).
pub const PARITY_BIT: u32 = 63;
/// Shift of the op code in word 0.
pub const OP_SHIFT: u32 = 56;
/// Shift of the target rank (16 bits) in word 0.
pub const PEER_SHIFT: u32 = 40;
/// Shift of a put's byte count (24 bits) in word 1.
pub const BYTES_SHIFT: u32 = 40;
/// Mask of the 40-bit window offsets (windows up to 1 TiB).
pub const OFFSET_MASK: u64 = (1 << 40) - 1;
/// Bytes per PUT descriptor; larger puts take several.
pub const MAX_PUT: usize = 1 << 23;
/// The largest rank a descriptor can name (16 bits).
pub const MAX_PEER: usize = 0xffff;
/// The largest window whose offsets fit a descriptor (40 bits).
pub const MAX_WINDOW_BYTES: usize = 1 << 40;

/// One decoded descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Descriptor {
    /// `bytes` from offset `src` of our window data to offset `dst` of `peer`'s.
    Put {
        /// The target rank.
        peer: usize,
        /// Byte offset in the target's window data.
        dst: usize,
        /// Byte offset in this rank's window data.
        src: usize,
        /// Length, bytes (at most [`MAX_PUT`]).
        bytes: usize,
    },
    /// Signal `id` of `peer`'s pad, our slot.
    Signal {
        /// The target rank.
        peer: usize,
        /// The signal id (below the window's signal count).
        id: usize,
        /// Whether `value` replaces the slot or is added to it.
        op: SignalOp,
        /// The operand.
        value: u64,
    },
}

/// The lap parity a descriptor with `ticket` carries in a ring of `capacity` slots: 1 on even
/// laps, so zeroed memory never looks like a lap-0 descriptor.
pub fn parity(ticket: u64, capacity: u64) -> u64 {
    (!(ticket / capacity)) & 1
}

impl Descriptor {
    /// The two words, word 0 without its parity bit (the producer adds it).
    pub fn encode(&self) -> [u64; 2] {
        match *self {
            Descriptor::Put { peer, dst, src, bytes } => [
                (PUT << OP_SHIFT) | ((peer as u64) << PEER_SHIFT) | (dst as u64 & OFFSET_MASK),
                ((bytes as u64) << BYTES_SHIFT) | (src as u64 & OFFSET_MASK),
            ],
            Descriptor::Signal { peer, id, op, value } => {
                let code = match op {
                    SignalOp::Set => 0u64,
                    SignalOp::Add => 1,
                };
                [
                    (SIGNAL << OP_SHIFT) | ((peer as u64) << PEER_SHIFT) | (code << 32) | (id as u64 & 0xffff_ffff),
                    value,
                ]
            }
        }
    }

    /// Whether a host producer may encode this descriptor without losing bits.
    pub fn encodable(&self) -> bool {
        match *self {
            Descriptor::Put { peer, dst, src, bytes } => {
                peer <= MAX_PEER && (dst as u64) <= OFFSET_MASK && (src as u64) <= OFFSET_MASK && bytes <= MAX_PUT
            }
            Descriptor::Signal { peer, id, .. } => peer <= MAX_PEER && id <= u32::MAX as usize,
        }
    }

    /// Reads words that a producer published (parity already checked) and checks them against
    /// the window: a known op, a peer in range, a range inside both windows, a signal id that
    /// exists. `Err` says what was wrong, for the error the proxy records.
    pub fn decode(w: [u64; 2], limits: &Limits) -> Result<Descriptor, String> {
        let op = (w[0] >> OP_SHIFT) & 0x7f;
        let peer = ((w[0] >> PEER_SHIFT) & MAX_PEER as u64) as usize;
        if peer >= limits.size {
            return Err(format!("descriptor names rank {peer} of {}", limits.size));
        }
        match op {
            PUT => {
                let dst = (w[0] & OFFSET_MASK) as usize;
                let src = (w[1] & OFFSET_MASK) as usize;
                let bytes = (w[1] >> BYTES_SHIFT) as usize;
                let fits = |off: usize| off.checked_add(bytes).is_some_and(|end| end <= limits.bytes);
                if bytes > MAX_PUT || !fits(dst) || !fits(src) {
                    return Err(format!(
                        "put of {bytes} bytes from offset {src} to offset {dst} leaves the {}-byte window",
                        limits.bytes
                    ));
                }
                Ok(Descriptor::Put { peer, dst, src, bytes })
            }
            SIGNAL => {
                let id = (w[0] & 0xffff_ffff) as usize;
                let op = match (w[0] >> 32) & 0xff {
                    0 => SignalOp::Set,
                    1 => SignalOp::Add,
                    other => return Err(format!("signal operation {other} is neither set (0) nor add (1)")),
                };
                if id >= limits.signals {
                    return Err(format!("signal id {id} of {}", limits.signals));
                }
                Ok(Descriptor::Signal {
                    peer,
                    id,
                    op,
                    value: w[1],
                })
            }
            other => Err(format!("unknown descriptor op {other}")),
        }
    }
}

/// The window a queue serves, for checking descriptors.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Ranks of the window's communicator.
    pub size: usize,
    /// Bytes of window data per rank.
    pub bytes: usize,
    /// Signal ids per source rank.
    pub signals: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        size: 4,
        bytes: 1 << 20,
        signals: 8,
    };

    #[test]
    fn descriptors_survive_encoding() {
        let cases = [
            Descriptor::Put {
                peer: 3,
                dst: 4096,
                src: 123,
                bytes: 1000,
            },
            Descriptor::Put {
                peer: 0,
                dst: (1 << 20) - 1,
                src: 0,
                bytes: 1,
            },
            Descriptor::Signal {
                peer: 2,
                id: 7,
                op: SignalOp::Add,
                value: u64::MAX,
            },
            Descriptor::Signal {
                peer: 1,
                id: 0,
                op: SignalOp::Set,
                value: 0,
            },
        ];
        for d in cases {
            assert!(d.encodable());
            let mut w = d.encode();
            w[0] |= 1 << PARITY_BIT;
            assert_eq!(Descriptor::decode(w, &LIMITS), Ok(d));
        }
    }

    #[test]
    fn bad_words_are_refused_with_a_reason() {
        let put = |peer, dst, src, bytes| Descriptor::Put { peer, dst, src, bytes }.encode();
        let bad = [
            (put(4, 0, 0, 8), "rank 4 of 4"),
            (put(1, (1 << 20) - 4, 0, 8), "leaves the"),
            (put(1, 0, (1 << 20) - 4, 8), "leaves the"),
            ([7 << OP_SHIFT, 0], "unknown descriptor op 7"),
            ([(SIGNAL << OP_SHIFT) | 8, 0], "signal id 8 of 8"),
            ([(SIGNAL << OP_SHIFT) | (2 << 32), 0], "neither set"),
        ];
        for (w, why) in bad {
            let e = Descriptor::decode(w, &LIMITS).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn parity_flips_every_lap_and_starts_at_one() {
        assert_eq!(parity(0, 8), 1);
        assert_eq!(parity(7, 8), 1);
        assert_eq!(parity(8, 8), 0);
        assert_eq!(parity(16, 8), 1);
    }
}
