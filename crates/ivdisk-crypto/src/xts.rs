//! AES-XTS suites: `aes-xts-plain64` (deterministic, LUKS2-compatible) and `aes-xts-random`.
//!
//! `aes-xts-plain64`: the tweak of a sector is its byte offset / 512, little endian (so
//! 4096-byte sectors step it by 8), exactly as dm-crypt, cryptsetup and librbd compute it.
//!
//! `aes-xts-random`: per write a random 16-byte value R is drawn and stored as the metadata;
//! the XTS tweak is `AES-256(K_t, R) xor LE128(sector)` with `K_t` derived by HKDF from the
//! volume key and the image id. R alone says nothing about the tweak; moving (ciphertext, R) to
//! sector s' or into another image gives another tweak, so it decrypts to garbage; forging an R'
//! that yields the same tweak at s' requires `K_t`.
//!
//! The data path is OpenSSL's XTS (AES-NI, many blocks in flight, SIMD tweak updates) with
//! reused contexts: only the 16-byte tweak is set per sector. For `aes-xts-random` the tweaks
//! of a run are derived in batches, so that AES runs many blocks wide there too.

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use openssl::cipher::{Cipher, CipherRef};

use crate::evp::{ContextPool, Direction};
use crate::key::derive_subkey;
use crate::rng::NonceSource;
use crate::suite::{check_key_len, check_run, check_sector_size, plain64_iv};
use crate::{CipherParams, CryptoError, Suite};

/// Sectors whose random tweaks are derived per batch: enough to keep AES-NI's 8-block pipeline
/// full, small enough that zeroing the stack buffer does not show on one-sector runs.
const TWEAK_BATCH: usize = 16;

pub(crate) struct AesXts {
    suite: Suite,
    sector_size: usize,
    encrypt: ContextPool,
    decrypt: ContextPool,
    /// Present for `aes-xts-random`: AES-256 under the key that maps R to the tweak. The `aes`
    /// crate (AES-NI, 8 blocks in flight) rather than an OpenSSL ECB context: for one sector the
    /// EVP call and its context pool cost more than the AES rounds.
    tweak_key: Option<Aes256>,
    nonces: NonceSource,
}

impl std::fmt::Debug for AesXts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AesXts")
            .field("suite", &self.suite)
            .field("sector_size", &self.sector_size)
            .finish_non_exhaustive()
    }
}

impl AesXts {
    pub(crate) fn new(
        suite: Suite,
        key: &[u8],
        params: &CipherParams,
        nonces: NonceSource,
    ) -> Result<Self, CryptoError> {
        debug_assert!(matches!(suite, Suite::AesXtsPlain64 | Suite::AesXtsRandom));
        check_key_len(suite, key)?;
        check_sector_size(params.sector_size)?;
        let (k1, k2) = key.split_at(key.len() / 2);
        if k1 == k2 {
            return Err(CryptoError::XtsKeyHalvesEqual { suite });
        }
        let tweak_key = (suite == Suite::AesXtsRandom).then(|| {
            let k = derive_subkey::<32>(key, &[b"aes-xts-random/tweak-key/", &params.image_id.0]);
            Aes256::new(GenericArray::from_slice(k.as_ref()))
        });
        Ok(AesXts {
            suite,
            sector_size: params.sector_size,
            encrypt: ContextPool::new(xts_cipher(key), key, Direction::Encrypt),
            decrypt: ContextPool::new(xts_cipher(key), key, Direction::Decrypt),
            tweak_key,
            nonces,
        })
    }

    fn crypt(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        let pool = if encrypt {
            &self.encrypt
        } else {
            &self.decrypt
        };
        let batch_bytes = TWEAK_BATCH * self.sector_size;
        let md_len = self.suite.metadata_len();
        pool.with(|ctx| {
            for (b, data) in data.chunks_mut(batch_bytes).enumerate() {
                let base = first_sector + (b * TWEAK_BATCH) as u64;
                let n = data.len() / self.sector_size;
                let mut tweaks = [aes::Block::default(); TWEAK_BATCH];
                match &self.tweak_key {
                    None => {
                        for (i, sector) in data.chunks_exact_mut(self.sector_size).enumerate() {
                            let iv = plain64_iv::<16>(base + i as u64, self.sector_size);
                            pool.set_iv(ctx, &iv)?;
                            ctx.cipher_update_inplace(sector, self.sector_size)?;
                        }
                        continue;
                    }
                    Some(tweak_key) => {
                        let rs = &metadata[b * TWEAK_BATCH * md_len..][..n * md_len];
                        for (t, r) in tweaks[..n].iter_mut().zip(rs.chunks_exact(md_len)) {
                            t.copy_from_slice(r);
                        }
                        tweak_key.encrypt_blocks(&mut tweaks[..n]);
                        for (i, t) in tweaks[..n].iter_mut().enumerate() {
                            let v = u128::from_le_bytes((*t).into()) ^ u128::from(base + i as u64);
                            *t = v.to_le_bytes().into();
                        }
                    }
                }
                for (sector, t) in data.chunks_exact_mut(self.sector_size).zip(&tweaks) {
                    pool.set_iv(ctx, t)?;
                    ctx.cipher_update_inplace(sector, self.sector_size)?;
                }
            }
            Ok(())
        })
    }
}

fn xts_cipher(key: &[u8]) -> &'static CipherRef {
    if key.len() == 64 {
        Cipher::aes_256_xts()
    } else {
        Cipher::aes_128_xts()
    }
}

impl crate::SectorCipher for AesXts {
    fn suite(&self) -> Suite {
        self.suite
    }

    fn sector_size(&self) -> usize {
        self.sector_size
    }

    fn encrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        if self.tweak_key.is_some() {
            match self.nonces {
                // One draw for the whole run.
                NonceSource::Random => crate::rng::fill_random(metadata)?,
                source => {
                    for (i, r) in metadata.chunks_exact_mut(16).enumerate() {
                        source.fill(first_sector + i as u64, r)?;
                    }
                }
            }
        }
        self.crypt(first_sector, data, metadata, true)
    }

    fn decrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        self.crypt(first_sector, data, metadata, false)
    }
}

/// Raw XTS over one data unit with an explicit tweak, for the IEEE 1619 known-answer tests
/// (whose data units are 32 and 512 bytes); the same OpenSSL path as the suites.
#[doc(hidden)]
pub fn xts_encrypt_unit(key: &[u8], tweak: &[u8; 16], data: &mut [u8]) -> Result<(), CryptoError> {
    xts_unit(key, tweak, data, Direction::Encrypt)
}

/// Inverse of [`xts_encrypt_unit`].
#[doc(hidden)]
pub fn xts_decrypt_unit(key: &[u8], tweak: &[u8; 16], data: &mut [u8]) -> Result<(), CryptoError> {
    xts_unit(key, tweak, data, Direction::Decrypt)
}

fn xts_unit(
    key: &[u8],
    tweak: &[u8; 16],
    data: &mut [u8],
    direction: Direction,
) -> Result<(), CryptoError> {
    check_key_len(Suite::AesXtsPlain64, key)?;
    let pool = ContextPool::new(xts_cipher(key), key, direction);
    pool.with(|ctx| {
        pool.set_iv(ctx, tweak)?;
        let len = data.len();
        ctx.cipher_update_inplace(data, len)?;
        Ok(())
    })
}
