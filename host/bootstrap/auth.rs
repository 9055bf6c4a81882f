//! Challenge-response with a shared secret: each side proves it knows the secret by returning
//! HMAC-SHA256(secret, its peer's fresh nonce || role). The secret itself never crosses the wire.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const PROOF_BYTES: usize = 32;

pub(crate) fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    // The OS generator failing is not something a caller can act on; an all-zero nonce would
    // still not reveal the secret, and the peer's proof check stays sound.
    let _ = getrandom::getrandom(&mut n);
    n
}

/// A fresh random secret rendered as hex, for job tokens and per-communicator link secrets.
pub fn random_token() -> String {
    nonce().iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn proof(secret: &[u8], nonce: &[u8], role: &[u8]) -> [u8; PROOF_BYTES] {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail here.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    mac.update(nonce);
    mac.update(role);
    mac.finalize().into_bytes().into()
}

/// Constant-time check of a proof.
pub(crate) fn verify(secret: &[u8], nonce: &[u8], role: &[u8], got: &[u8]) -> bool {
    let want = proof(secret, nonce, role);
    got.len() == want.len() && want.iter().zip(got).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}
