//! Sector crypto for ivdisk: cipher suites that turn (key, sector number, plaintext sector)
//! into (ciphertext, per-sector metadata) and back, or fail authentication.
//!
//! One interface, [`SectorCipher`], for every suite; build one with [`new_cipher`]. Suites and
//! their constructions are described in `docs/CRYPTO.md`.
//!
//! ```
//! use ivdisk_crypto::{new_cipher, CipherParams, ImageId, Suite, VolumeKey};
//!
//! let key = VolumeKey::generate(Suite::DEFAULT.default_key_len()).unwrap();
//! let cipher = new_cipher(Suite::DEFAULT, &key, &CipherParams::new(4096, ImageId([7; 16]))).unwrap();
//! let mut data = vec![0x5a; 2 * 4096];
//! let mut metadata = vec![0; 2 * cipher.metadata_len()];
//! cipher.encrypt_sectors(10, &mut data, &mut metadata).unwrap();
//! cipher.decrypt_sectors(10, &mut data, &metadata).unwrap();
//! assert!(data.iter().all(|&b| b == 0x5a));
//! ```

#![deny(unsafe_code)]

mod aead;
mod error;
mod evp;
#[allow(unsafe_code)]
mod ffi;
mod hctr2;
use ffi::io;
mod key;
mod rng;
mod suite;
mod xts;

pub use aead::GCM_RANDOM_NONCE_WRITE_LIMIT;
pub use error::CryptoError;
pub use key::VolumeKey;
pub use rng::{fill_random, nonce_add};
pub use suite::{CipherParams, ImageId, SectorCipher, Suite};

use rng::NonceSource;

/// The raw primitives under the suites, exposed for known-answer tests against the standards'
/// vectors (which use arbitrary lengths, nonces and tweaks). Not for building disks.
#[doc(hidden)]
pub mod primitives {
    pub use crate::aead::{
        aegis128l_open, aegis128l_seal, aegis256_open, aegis256_seal, gcm_open_once, gcm_seal_once,
    };
    pub use crate::hctr2::{Hctr2, TWEAK_LEN as HCTR2_TWEAK_LEN};
    pub use crate::xts::xts_crypt_unit;
}

/// Build the cipher of `suite` for a volume key and image parameters.
///
/// Fails with a typed error for a key of the wrong length, an XTS key with equal halves, or an
/// unsupported sector size.
pub fn new_cipher(
    suite: Suite,
    key: &VolumeKey,
    params: &CipherParams,
) -> Result<Box<dyn SectorCipher>, CryptoError> {
    build(suite, key, params, NonceSource::Random)
}

/// INSECURE: the randomized suites with the sector number in place of the random IV/nonce, so
/// an overwrite reuses it. Exists only so that benchmarks can show what the random source
/// costs ("deterministic counterpart"); never use it for data.
#[doc(hidden)]
pub fn insecure_cipher_with_sector_number_nonces(
    suite: Suite,
    key: &VolumeKey,
    params: &CipherParams,
) -> Result<Box<dyn SectorCipher>, CryptoError> {
    build(suite, key, params, NonceSource::SectorNumber)
}

fn build(
    suite: Suite,
    key: &VolumeKey,
    params: &CipherParams,
    nonces: NonceSource,
) -> Result<Box<dyn SectorCipher>, CryptoError> {
    let key = key.as_bytes();
    Ok(match suite {
        Suite::AesXtsPlain64 | Suite::AesXtsRandom => {
            Box::new(xts::AesXts::new(suite, key, params, nonces)?)
        }
        Suite::Aegis128lRandom | Suite::Aegis256Random | Suite::AesGcmRandom => {
            Box::new(aead::AeadSuite::new(suite, key, params, nonces)?)
        }
        Suite::AesHctr2Plain64 => Box::new(hctr2::Hctr2Suite::new(key, params.sector_size)?),
    })
}
