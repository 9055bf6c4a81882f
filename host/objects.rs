//! Collectives of arbitrary serde values: lengths first, then the bytes (bincode).

use crate::collectives::Collectives;
use crate::comm::Comm;
use crate::error::{Error, Result};
use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

fn codec() -> impl Options {
    bincode::DefaultOptions::new()
}

fn encode<T: Serialize>(op: &'static str, v: &T) -> Result<Vec<u8>> {
    codec().serialize(v).map_err(|e| Error::Serialization {
        op,
        reason: e.to_string(),
    })
}

fn decode<T: DeserializeOwned>(op: &'static str, b: &[u8]) -> Result<T> {
    // The limit keeps a corrupt length prefix from allocating more than the bytes we hold.
    codec()
        .with_limit(b.len() as u64)
        .deserialize(b)
        .map_err(|e| Error::Serialization {
            op,
            reason: e.to_string(),
        })
}

fn lengths(v: &[i64]) -> Vec<usize> {
    v.iter().map(|&n| n.max(0) as usize).collect()
}

impl Comm {
    /// Every rank gets every rank's value, in rank order.
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>> {
        let mine = encode("all_gather_object", obj)?;
        let mut lens = vec![0i64; self.size()];
        self.all_gather(&mut lens, &[mine.len() as i64])?;
        let counts = lengths(&lens);
        let mut all = vec![0u8; counts.iter().sum()];
        self.all_gather_v(&mut all, &mine, &counts)?;
        let mut at = 0;
        counts
            .iter()
            .map(|&n| {
                at += n;
                decode("all_gather_object", &all[at - n..at])
            })
            .collect()
    }

    /// `root` passes `Some(value)`; every rank returns it.
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(&self, obj: Option<&T>, root: usize) -> Result<T> {
        let bytes = match (self.rank() == root, obj) {
            (true, Some(o)) => encode("broadcast_object", o)?,
            (true, None) => return Err(Error::invalid("broadcast_object", "the root must pass a value")),
            (false, _) => Vec::new(),
        };
        let mut len = [bytes.len() as i64];
        self.broadcast(&mut len, root)?;
        let mut buf = if self.rank() == root {
            bytes
        } else {
            vec![0u8; lengths(&len)[0]]
        };
        self.broadcast(&mut buf, root)?;
        decode("broadcast_object", &buf)
    }

    /// `root` returns every rank's value in rank order; the others return `None`.
    pub fn gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T, root: usize) -> Result<Option<Vec<T>>> {
        let mine = encode("gather_object", obj)?;
        let is_root = self.rank() == root;
        let mut lens = vec![0i64; if is_root { self.size() } else { 0 }];
        self.gather(is_root.then_some(&mut lens[..]), &[mine.len() as i64], root)?;
        if !is_root {
            self.run(
                crate::ops::Op::Gather {
                    input: crate::ops::Buf::new(&mine),
                    outputs: None,
                    root,
                },
                &Default::default(),
            )?;
            return Ok(None);
        }
        let mut bufs: Vec<Vec<u8>> = lengths(&lens).into_iter().map(|n| vec![0u8; n]).collect();
        let outputs = bufs.iter_mut().map(|b| crate::ops::BufMut::new(&mut b[..])).collect();
        self.run(
            crate::ops::Op::Gather {
                input: crate::ops::Buf::new(&mine),
                outputs: Some(outputs),
                root,
            },
            &Default::default(),
        )?;
        bufs.iter()
            .map(|b| decode("gather_object", b))
            .collect::<Result<Vec<T>>>()
            .map(Some)
    }

    /// `root` passes one value per rank; rank r returns value r.
    pub fn scatter_object<T: Serialize + DeserializeOwned>(&self, objs: Option<&[T]>, root: usize) -> Result<T> {
        let is_root = self.rank() == root;
        let encoded = match (is_root, objs) {
            (true, Some(o)) if o.len() == self.size() => Some(
                o.iter()
                    .map(|v| encode("scatter_object", v))
                    .collect::<Result<Vec<_>>>()?,
            ),
            (true, Some(o)) => {
                return Err(Error::SizeMismatch {
                    op: "scatter_object",
                    what: "values".into(),
                    expected: self.size(),
                    actual: o.len(),
                })
            }
            (true, None) => return Err(Error::invalid("scatter_object", "the root must pass the values")),
            (false, _) => None,
        };
        let lens: Vec<i64> = encoded.iter().flatten().map(|b| b.len() as i64).collect();
        let mut len = [0i64];
        self.scatter(&mut len, is_root.then_some(&lens[..]), root)?;
        let mut mine = vec![0u8; lengths(&len)[0]];
        let inputs = encoded
            .as_ref()
            .map(|e| e.iter().map(|b| crate::ops::Buf::new(&b[..])).collect());
        self.run(
            crate::ops::Op::Scatter {
                inputs,
                output: crate::ops::BufMut::new(&mut mine),
                root,
            },
            &Default::default(),
        )?;
        decode("scatter_object", &mine)
    }
}
