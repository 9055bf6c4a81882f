//! Challenge-response with a shared secret: each side proves it knows the secret by returning
//! HMAC-SHA256(secret, its peer's fresh nonce || role). The secret itself never crosses the wire.

use crate::contracts::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub(crate) const NONCE_BYTES: usize = 32;
pub(crate) const PROOF_BYTES: usize = 32;

/// Fresh bytes from the OS generator. Its failure is an error, never a constant: a nonce or a
/// secret that an attacker can predict (all zeros) would let a forged hello through.
pub(crate) fn nonce() -> Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    fill_random(&mut n)?;
    Ok(n)
}

fn fill_random(buf: &mut [u8]) -> Result<()> {
    #[cfg(test)]
    if failing::IS.with(|f| f.get()) {
        return Err(unavailable(getrandom::Error::UNSUPPORTED));
    }
    getrandom::getrandom(buf).map_err(unavailable)
}

fn unavailable(e: getrandom::Error) -> Error {
    Error::io(
        "the OS random generator (for a nonce, a secret or a unique name): refusing to go on without it",
        e.raw_os_error().map_or_else(
            || std::io::Error::other(e.to_string()),
            std::io::Error::from_raw_os_error,
        ),
    )
}

/// A fresh random secret rendered as hex (64 characters), for job tokens and per-communicator
/// link secrets. `Error::Io` when the OS generator fails: there is no fallback.
///
/// ```
/// let t = ferrocomm::random_token()?;
/// assert_eq!(t.len(), 64);
/// assert_ne!(t, ferrocomm::random_token()?);
/// # Ok::<(), ferrocomm::Error>(())
/// ```
pub fn random_token() -> Result<String> {
    Ok(nonce()?.iter().map(|b| format!("{b:02x}")).collect())
}

/// Tests make this thread's generator fail, as a broken or unseeded OS generator would.
#[cfg(test)]
pub(crate) mod failing {
    thread_local! {
        pub(crate) static IS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Runs `f` with this thread's generator failing.
    pub(crate) fn with<R>(f: impl FnOnce() -> R) -> R {
        IS.with(|c| c.set(true));
        let r = f();
        IS.with(|c| c.set(false));
        r
    }
}

/// The key for `label` under the secret `root` (HKDF-SHA256; the salt names this use): ranks
/// that share `root` derive the same key, and a key reveals nothing of `root` or of any other
/// label's key. Labels are bytes: session keys put nonces in theirs.
pub(crate) fn derive(root: &[u8], label: &[u8]) -> [u8; 32] {
    let mut key = [0u8; 32];
    // 32 bytes is far below HKDF's limit (255 hash lengths), so `expand` cannot fail here.
    hkdf::Hkdf::<Sha256>::new(Some(b"ferrocomm derived secret v1"), root)
        .expand(label, &mut key)
        .unwrap_or_else(|_| unreachable!());
    key
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_generator_is_an_error_never_a_constant() {
        let e = failing::with(nonce).unwrap_err();
        assert!(
            matches!(e, Error::Io { .. }) && e.to_string().contains("random generator"),
            "{e}"
        );
        assert!(failing::with(random_token).is_err());
        let (a, b) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(a, b);
        assert_ne!(a, [0; NONCE_BYTES]);
    }
}
