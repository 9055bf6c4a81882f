//! Collectives of arbitrary serde values: a header per value first (its length, or why there is
//! none), then the bytes (contracts/record.rs: a format-version byte, then MessagePack).
//!
//! A rank that has no value to send (a root without one, a value that does not serialize) still
//! sends its header, saying why, so every rank fails at once with an error naming that rank
//! rather than waiting out the timeout for bytes that never come; afterwards every rank has run
//! the same operations and the communicator stays usable.

use crate::collectives::Collectives;
use crate::comm::Comm;
use crate::contracts::error::{Error, Result};
use crate::contracts::ops::{Buf, BufMut, Op};
use crate::contracts::record;
use serde::{de::DeserializeOwned, Serialize};

fn encode<T: Serialize>(op: &'static str, v: &T) -> Result<Vec<u8>> {
    record::encode(v).map_err(|reason| Error::Serialization { op, reason })
}

fn decode<T: DeserializeOwned>(op: &'static str, b: &[u8]) -> Result<T> {
    record::decode(b).map_err(|reason| Error::Serialization { op, reason })
}

/// What a rank announces ahead of a value's bytes, in the message that carries the length
/// anyway, so saying "no value" costs no extra round trip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Header {
    /// The value's bytes follow: this many.
    Bytes(usize),
    /// The root passed no value (`None`).
    Missing,
    /// The root passed this many values, not one per rank.
    WrongCount(usize),
    /// The value could not be serialized.
    Unserializable,
}

/// A header travels as this many `i64`s: a tag and a number.
const WORDS: usize = 2;

impl Header {
    fn words(self) -> [i64; WORDS] {
        match self {
            Header::Bytes(n) => [0, n as i64],
            Header::Missing => [1, 0],
            Header::WrongCount(n) => [2, n as i64],
            Header::Unserializable => [3, 0],
        }
    }

    fn parse(op: &'static str, w: &[i64]) -> Result<Header> {
        match *w {
            [0, n] if n >= 0 => Ok(Header::Bytes(n as usize)),
            [1, _] => Ok(Header::Missing),
            [2, n] if n >= 0 => Ok(Header::WrongCount(n as usize)),
            [3, _] => Ok(Header::Unserializable),
            _ => Err(Error::protocol(op, format!("malformed object header {w:?}"))),
        }
    }

    /// How many bytes follow: none unless a value does.
    fn bytes(self) -> usize {
        match self {
            Header::Bytes(n) => n,
            _ => 0,
        }
    }

    /// The length of the value that follows, or the error of a rank told by `who` (e.g. "rank 0
    /// (the root)") that no value follows. The root builds its own error here too (`who` = "the
    /// root"), so both sides give the same reason.
    fn length(self, op: &'static str, who: &str, size: usize) -> Result<usize> {
        Err(match self {
            Header::Bytes(n) => return Ok(n),
            // Only the two root-based calls send Missing; each has its own noun.
            Header::Missing if op == "scatter_object" => Error::invalid(op, format!("{who} has no values to scatter")),
            Header::Missing => Error::invalid(op, format!("{who} has no value to broadcast")),
            Header::WrongCount(n) => Error::SizeMismatch {
                op,
                what: format!("the value list of {who}"),
                expected: size,
                actual: n,
            },
            Header::Unserializable => Error::Serialization {
                op,
                reason: format!("{who} could not serialize its value"),
            },
        })
    }
}

/// The headers of `words`, one per `WORDS` of them.
fn parse_all(op: &'static str, words: &[i64]) -> Result<Vec<Header>> {
    words.chunks(WORDS).map(|w| Header::parse(op, w)).collect()
}

/// How the other ranks name the root in their errors.
fn the_root(root: usize) -> String {
    format!("rank {root} (the root)")
}

/// A rank's own value encoded, and the header announcing it. A value that does not serialize
/// is announced as such, with no bytes; its error is the caller's to return once the others
/// have been told.
fn announce<T: Serialize>(op: &'static str, v: &T) -> (Header, Result<Vec<u8>>) {
    let bytes = encode(op, v);
    let header = match &bytes {
        Ok(b) => Header::Bytes(b.len()),
        Err(_) => Header::Unserializable,
    };
    (header, bytes)
}

impl Comm {
    /// Every rank gets every rank's value, in rank order.
    ///
    /// A value that does not serialize is `Error::Serialization` on every rank: on its own
    /// rank with the serializer's reason, on the others naming that rank.
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>> {
        const OP: &str = "all_gather_object";
        let (header, mine) = announce(OP, obj);
        let mut words = vec![0i64; WORDS * self.size()];
        self.all_gather(&mut words, &header.words()[..])?;
        let mine = mine?;
        // Every rank sees every header, so all skip the bytes together when one rank has none.
        let counts = parse_all(OP, &words)?
            .into_iter()
            .enumerate()
            .map(|(r, h)| h.length(OP, &format!("rank {r}"), self.size()))
            .collect::<Result<Vec<usize>>>()?;
        let mut all = vec![0u8; counts.iter().sum()];
        self.all_gather_v(&mut all, &mine, &counts)?;
        let mut at = 0;
        counts
            .iter()
            .map(|&n| {
                at += n;
                decode(OP, &all[at - n..at])
            })
            .collect()
    }

    /// `root` passes `Some(value)`; every rank returns it. Other ranks' `obj` is ignored.
    ///
    /// When the root passes `None`, every rank fails at once, without waiting for the timeout:
    /// the root with `Error::InvalidArgument` ("the root has no value to broadcast"), the others
    /// with `Error::InvalidArgument` naming it ("rank 0 (the root) has no value to broadcast").
    /// A root value that does not serialize is likewise `Error::Serialization` on every rank.
    /// The communicator stays usable. A rank on which the value does not deserialize gets
    /// `Error::Serialization`; the others are not affected.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(&self, obj: Option<&T>, root: usize) -> Result<T> {
        const OP: &str = "broadcast_object";
        let is_root = self.rank() == root;
        let (header, bytes) = match obj {
            Some(o) if is_root => announce(OP, o),
            _ => (Header::Missing, Ok(Vec::new())),
        };
        // Non-roots' words are overwritten by the root's.
        let mut words = header.words();
        self.broadcast(&mut words[..], root)?;
        let mut buf = if is_root {
            let bytes = bytes?;
            header.length(OP, "the root", self.size())?;
            bytes
        } else {
            vec![0u8; Header::parse(OP, &words)?.length(OP, &the_root(root), self.size())?]
        };
        self.broadcast(&mut buf, root)?;
        decode(OP, &buf)
    }

    /// `root` returns every rank's value in rank order; the others return `None`.
    ///
    /// A value that does not serialize is `Error::Serialization` on its own rank and on the
    /// root (naming that rank); every rank still completes the call, so none is left waiting.
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T, root: usize) -> Result<Option<Vec<T>>> {
        const OP: &str = "gather_object";
        let (header, mine) = announce(OP, obj);
        let is_root = self.rank() == root;
        let mut words = vec![0i64; if is_root { WORDS * self.size() } else { 0 }];
        self.gather(is_root.then_some(&mut words[..]), &header.words()[..], root)?;
        // Only the root learns of a rank without bytes, so every rank sends (maybe nothing)
        // to keep the call the same on all of them.
        let input = mine.as_deref().unwrap_or_default();
        if !is_root {
            self.run(
                Op::Gather {
                    input: Buf::new(input),
                    outputs: None,
                    root,
                },
                &Default::default(),
            )?;
            return mine.map(|_| None);
        }
        let headers = parse_all(OP, &words)?;
        let mut bufs: Vec<Vec<u8>> = headers.iter().map(|h| vec![0u8; h.bytes()]).collect();
        let outputs = bufs.iter_mut().map(|b| BufMut::new(&mut b[..])).collect();
        self.run(
            Op::Gather {
                input: Buf::new(input),
                outputs: Some(outputs),
                root,
            },
            &Default::default(),
        )?;
        mine?;
        for (r, h) in headers.iter().enumerate() {
            h.length(OP, &format!("rank {r}"), self.size())?;
        }
        bufs.iter().map(|b| decode(OP, b)).collect::<Result<Vec<T>>>().map(Some)
    }

    /// `root` passes one value per rank; rank r returns value r. Other ranks' `objs` is ignored.
    ///
    /// When the root passes `None`, every rank fails at once, without waiting for the timeout:
    /// the root with `Error::InvalidArgument` ("the root has no values to scatter"), the others
    /// with `Error::InvalidArgument` naming it ("rank 0 (the root) has no values to scatter").
    /// A list that does not hold one value per rank is `Error::SizeMismatch` on every rank
    /// ("the value list of rank 0 (the root) has 2 elements, expected 3"), and a value that
    /// does not serialize `Error::Serialization` on every rank. The communicator stays usable.
    pub fn scatter_object<T: Serialize + DeserializeOwned>(&self, objs: Option<&[T]>, root: usize) -> Result<T> {
        const OP: &str = "scatter_object";
        let (size, is_root) = (self.size(), self.rank() == root);
        // At the root: one header per rank, and the encoded values or the root's own error.
        let (headers, encoded) = match objs {
            _ if !is_root => (Vec::new(), Ok(Vec::new())),
            None => (vec![Header::Missing; size], Ok(Vec::new())),
            Some(o) if o.len() != size => (vec![Header::WrongCount(o.len()); size], Ok(Vec::new())),
            Some(o) => match o.iter().map(|v| encode(OP, v)).collect::<Result<Vec<_>>>() {
                Ok(e) => (e.iter().map(|b| Header::Bytes(b.len())).collect(), Ok(e)),
                // Every rank fails, not only the one whose value broke: no partial scatter.
                Err(e) => (vec![Header::Unserializable; size], Err(e)),
            },
        };
        let words: Vec<i64> = headers.iter().flat_map(|h| h.words()).collect();
        let mut mine = [0i64; WORDS];
        self.scatter(&mut mine[..], is_root.then_some(&words[..]), root)?;
        let encoded = encoded?;
        let who = if is_root { "the root".into() } else { the_root(root) };
        let len = Header::parse(OP, &mine)?.length(OP, &who, size)?;
        let mut out = vec![0u8; len];
        let inputs = is_root.then(|| encoded.iter().map(|b| Buf::new(&b[..])).collect());
        self.run(
            Op::Scatter {
                inputs,
                output: BufMut::new(&mut out),
                root,
            },
            &Default::default(),
        )?;
        decode(OP, &out)
    }
}
