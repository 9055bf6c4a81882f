//! The one byte format for serde values that cross process boundaries: users' objects in the
//! object collectives and the records ranks swap through the store.
//!
//! MessagePack (rmp-serde: maintained, compact, a published specification that other languages
//! read too; structs as arrays, no field names) after one format-version byte. The byte makes
//! ranks built from different ferrocomm releases fail with an error that says so, instead of
//! decoding each other's bytes into garbage or a baffling "unexpected end of input".
//!
//! Why not postcard, the usual choice: it replaces the message of a value's own
//! `Error::custom` ("13 refuses to be serialized") by a fixed "Serde Serialization Error", and
//! the object collectives owe the user that message; MessagePack keeps it.

use serde::{de::DeserializeOwned, Serialize};
use std::io::Cursor;

/// Bumped whenever the bytes a value encodes to may change: a new format, a new framing.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// `v` as bytes: the version byte, then MessagePack. The error says why `v` does not serialize.
pub(crate) fn encode<T: Serialize + ?Sized>(v: &T) -> Result<Vec<u8>, String> {
    let mut bytes = vec![FORMAT_VERSION];
    rmp_serde::encode::write(&mut bytes, v).map_err(|e| e.to_string())?;
    Ok(bytes)
}

/// The value `bytes` encodes. Refuses bytes of another format version, bytes left over after
/// the value, and malformed bytes, saying which.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    match bytes.split_first() {
        None => Err("no bytes: not even the format version".into()),
        Some((&FORMAT_VERSION, body)) => {
            // A reader, not the slice: it reads a declared length as it comes, so a corrupt one
            // fails at the end of the bytes instead of allocating what it claims.
            let mut de = rmp_serde::Deserializer::new(Cursor::new(body));
            let v = T::deserialize(&mut de).map_err(|e| e.to_string())?;
            match body.len() as u64 - de.position() {
                0 => Ok(v),
                left => Err(format!("{left} bytes left over after the value")),
            }
        }
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
        // A byte string (bin32) and a text string (str32) claiming 4 GiB, followed by three bytes.
        for marker in [0xc6, 0xdb] {
            let b = [FORMAT_VERSION, marker, 0xff, 0xff, 0xff, 0xff, 1, 2, 3];
            assert!(decode::<Vec<u8>>(&b).is_err());
            assert!(decode::<String>(&b).is_err());
        }
        // An array (array32) claiming 4 G elements.
        let b = [FORMAT_VERSION, 0xdd, 0xff, 0xff, 0xff, 0xff, 1, 2, 3];
        assert!(decode::<Vec<u8>>(&b).is_err());
    }

    #[test]
    fn a_values_own_error_message_survives() {
        struct Refuses;
        impl Serialize for Refuses {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("13 refuses to be serialized"))
            }
        }
        assert!(encode(&Refuses).unwrap_err().contains("13 refuses to be serialized"));
    }
}
