//! The one byte format for serde values that cross process boundaries: users' objects in the
//! object collectives and the records ranks swap through the store.
//!
//! postcard (a maintained format with a frozen 1.0 wire specification, compact varints, no
//! schema) after one format-version byte. The byte makes ranks built from different
//! ferrocomm releases fail with an error that says so, instead of decoding each other's
//! bytes into garbage or a baffling "unexpected end of input".

use serde::{de::DeserializeOwned, Serialize};

/// Bumped whenever the bytes a value encodes to may change: a new format, a new framing.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// `v` as bytes: the version byte, then postcard. The error says why `v` does not serialize.
pub(crate) fn encode<T: Serialize + ?Sized>(v: &T) -> Result<Vec<u8>, String> {
    postcard::to_extend(v, vec![FORMAT_VERSION]).map_err(|e| e.to_string())
}

/// The value `bytes` encodes. Refuses bytes of another format version, bytes left over after
/// the value, and malformed bytes, saying which.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match bytes.split_first() {
        None => Err("no bytes: not even the format version".into()),
        Some((&FORMAT_VERSION, body)) => match postcard::take_from_bytes(body) {
            Ok((v, [])) => Ok(v),
            Ok((_, rest)) => Err(format!("{} bytes left over after the value", rest.len())),
            Err(e) => Err(e.to_string()),
        },
        Some((&other, _)) => Err(format!(
            "encoded in format version {other}, this build reads version {FORMAT_VERSION} \
             (are the ranks built from different ferrocomm releases?)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_come_back_as_they_went() {
        let v = (7u32, "seven".to_string(), vec![1.5f64, -2.0], Some(u64::MAX));
        let b = encode(&v).unwrap();
        assert_eq!(b[0], FORMAT_VERSION);
        assert_eq!(decode::<(u32, String, Vec<f64>, Option<u64>)>(&b).unwrap(), v);
    }

    #[test]
    fn another_format_version_is_named() {
        let mut b = encode(&42u32).unwrap();
        b[0] = FORMAT_VERSION + 1;
        let e = decode::<u32>(&b).unwrap_err();
        assert!(e.contains(&format!("format version {}", FORMAT_VERSION + 1)), "{e}");
        assert!(e.contains(&format!("reads version {FORMAT_VERSION}")), "{e}");
    }

    #[test]
    fn empty_truncated_and_trailing_bytes_are_refused() {
        assert!(decode::<u32>(&[]).unwrap_err().contains("no bytes"));
        let b = encode(&"a string of some length").unwrap();
        assert!(decode::<String>(&b[..b.len() - 3]).is_err());
        let mut long = encode(&1u8).unwrap();
        long.push(0);
        assert!(
            decode::<u8>(&long).unwrap_err().contains("left over"),
            "trailing byte accepted"
        );
    }

    #[test]
    fn a_corrupt_length_does_not_allocate_it() {
        // A Vec<u8> claiming u32::MAX elements, followed by three bytes.
        let mut b = vec![FORMAT_VERSION];
        b.extend([0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2, 3]);
        assert!(decode::<Vec<u8>>(&b).is_err());
    }
}
