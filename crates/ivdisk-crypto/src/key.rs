//! Volume keys and the subkeys derived from them.

use std::fmt;

use hkdf::Hkdf;
use sha2::Sha256;
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

/// The volume key: the secret that encrypts the sectors, unwrapped from a keyslot.
/// Zeroized on drop; its `Debug` never shows the bytes.
#[derive(Clone, Zeroize, ZeroizeOnDrop)]
pub struct VolumeKey(Vec<u8>);

impl VolumeKey {
    /// Wrap key bytes (taking ownership, so no copy is left behind).
    pub fn new(bytes: Vec<u8>) -> Self {
        VolumeKey(bytes)
    }

    /// Copy key bytes from a slice.
    pub fn from_slice(bytes: &[u8]) -> Self {
        VolumeKey(bytes.to_vec())
    }

    /// A fresh random key of `len` bytes from the operating system.
    pub fn generate(len: usize) -> Result<Self, crate::CryptoError> {
        let mut key = vec![0u8; len];
        getrandom::getrandom(&mut key).map_err(|e| crate::CryptoError::Rng(e.to_string()))?;
        Ok(VolumeKey(key))
    }

    /// The key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key is empty (never a valid key).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VolumeKey({} bytes, redacted)", self.0.len())
    }
}

/// Salt of every HKDF derivation: fixed, so the same volume key always yields the same subkeys.
const HKDF_SALT: &[u8] = b"ivdisk sector crypto v1";

/// Derive a subkey of `N` bytes for one purpose (HKDF-SHA256, RFC 5869). `info` is the
/// concatenation of its parts: the suite and the key's role first, so no two roles ever share
/// a subkey, then anything the key is bound to (such as the image id).
pub(crate) fn derive_subkey<const N: usize>(
    volume_key: &[u8],
    info: &[&[u8]],
) -> Zeroizing<[u8; N]> {
    let hk = Hkdf::<Sha256>::new(Some(HKDF_SALT), volume_key);
    let mut out = Zeroizing::new([0u8; N]);
    hk.expand_multi_info(info, out.as_mut())
        .expect("HKDF-SHA256 yields up to 8160 bytes; subkeys are at most 64");
    out
}
