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
//! The rounds run in our VAES code where the CPU has VAES (`ffi::xts_vaes`: the tweak is an
//! argument, four blocks per ZMM instruction with AVX-512, two per YMM without) and in
//! OpenSSL's AES-NI XTS otherwise, with reused
//! contexts where only the tweak is set per sector. Tests hold the two to the IEEE vectors and
//! to each other.

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use openssl::cipher::{Cipher, CipherRef};

use crate::evp::{ContextPool, Direction};
#[cfg(target_arch = "x86_64")]
use crate::ffi::xts_vaes::{AesBlockCipher, XtsVaes};
use crate::io::Io;
use crate::key::derive_subkey;
use crate::rng::NonceSource;
use crate::suite::{check_key_len, check_out_of_place, check_run, check_sector_size, plain64_iv};
use crate::{CipherParams, CryptoError, Suite};

/// AES-256 under `K_t`, the key that maps `aes-xts-random`'s R to the XTS tweak. With the VAES
/// engine its AES-NI single-block code (no dispatch per call); otherwise the `aes` crate
/// (AES-NI, 8 blocks in flight) rather than an OpenSSL ECB context, whose EVP call and context
/// pool would cost more than the AES rounds for one sector.
enum TweakKey {
    #[cfg(target_arch = "x86_64")]
    Vaes(Box<AesBlockCipher>),
    Soft(Box<Aes256>),
}

impl TweakKey {
    fn new(key: &[u8; 32]) -> TweakKey {
        #[cfg(target_arch = "x86_64")]
        if let Some(aes) = AesBlockCipher::new(key) {
            return TweakKey::Vaes(Box::new(aes));
        }
        TweakKey::Soft(Box::new(Aes256::new(GenericArray::from_slice(key))))
    }

    /// The XTS tweak values of `tweaks.len()` (at most [`TWEAK_BATCH`]) consecutive sectors
    /// from `first_sector`, written with the random values in `rs` (16 bytes each):
    /// `AES-256(K_t, r) xor LE128(sector)`. A batch, not one block per sector: a lone block is
    /// a chain of 14 dependent AES rounds in front of the sector's XTS.
    fn tweaks(&self, rs: &[u8], first_sector: u64, tweaks: &mut [[u8; 16]]) {
        for (t, r) in tweaks.iter_mut().zip(rs.chunks_exact(16)) {
            t.copy_from_slice(r);
        }
        match self {
            #[cfg(target_arch = "x86_64")]
            TweakKey::Vaes(aes) => aes.encrypt_blocks(tweaks),
            TweakKey::Soft(aes) => {
                for t in tweaks.iter_mut() {
                    aes.encrypt_block(GenericArray::from_mut_slice(t));
                }
            }
        }
        for (i, t) in tweaks.iter_mut().enumerate() {
            let sector = first_sector + i as u64;
            *t = (u128::from_le_bytes(*t) ^ u128::from(sector)).to_le_bytes();
        }
    }
}

/// Tweaks of `aes-xts-random` computed per batch (`TweakKey::tweaks`).
const TWEAK_BATCH: usize = 8;

/// Who runs the XTS rounds: our VAES code where the CPU has it (the tweak is an argument, four
/// blocks per instruction), OpenSSL's AES-NI XTS otherwise (one IV reset per sector).
enum Engine {
    #[cfg(target_arch = "x86_64")]
    Vaes(XtsVaes),
    OpenSsl {
        encrypt: ContextPool,
        decrypt: ContextPool,
    },
}

impl Engine {
    fn new(key: &[u8]) -> Engine {
        #[cfg(target_arch = "x86_64")]
        if let Some(vaes) = XtsVaes::new(key) {
            return Engine::Vaes(vaes);
        }
        Engine::openssl(key)
    }

    fn openssl(key: &[u8]) -> Engine {
        Engine::OpenSsl {
            encrypt: ContextPool::new(xts_cipher(key), key, Direction::Encrypt),
            decrypt: ContextPool::new(xts_cipher(key), key, Direction::Decrypt),
        }
    }

    /// Run `for_each` over the sectors of a run with a function that en- or decrypts one data
    /// unit under a given tweak value.
    fn run(
        &self,
        encrypt: bool,
        for_each: impl FnOnce(
            &mut dyn FnMut(&[u8; 16], Io<'_>) -> Result<(), CryptoError>,
        ) -> Result<(), CryptoError>,
    ) -> Result<(), CryptoError> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Engine::Vaes(vaes) => for_each(&mut |tweak, unit| {
                vaes.crypt(tweak, unit, encrypt);
                Ok(())
            }),
            Engine::OpenSsl {
                encrypt: enc,
                decrypt: dec,
            } => {
                let pool = if encrypt { enc } else { dec };
                pool.with(|ctx| {
                    for_each(&mut |tweak, unit| {
                        pool.set_iv(ctx, tweak)?;
                        match unit {
                            Io::InPlace(data) => {
                                ctx.cipher_update_inplace(data, data.len())?;
                            }
                            Io::Copy { src, dst } => {
                                ctx.cipher_update(src, Some(dst))?;
                            }
                        }
                        Ok(())
                    })
                })
            }
        }
    }
}

pub(crate) struct AesXts {
    suite: Suite,
    sector_size: usize,
    engine: Engine,
    /// Present for `aes-xts-random`: AES-256 under the key that maps R to the tweak.
    tweak_key: Option<TweakKey>,
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
            TweakKey::new(&k)
        });
        Ok(AesXts {
            suite,
            sector_size: params.sector_size,
            engine: Engine::new(key),
            tweak_key,
            nonces,
        })
    }

    fn crypt(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &[u8],
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        let md_len = self.suite.metadata_len();
        let sectors = metadata.len() / md_len.max(1);
        let mut batch = [[0u8; 16]; TWEAK_BATCH];
        self.engine.run(encrypt, |unit| {
            for (i, sector) in data.chunks(self.sector_size).into_iter().enumerate() {
                let number = first_sector + i as u64;
                let tweak = match &self.tweak_key {
                    None => plain64_iv(number, self.sector_size),
                    Some(k) => {
                        let j = i % TWEAK_BATCH;
                        if j == 0 {
                            let n = (sectors - i).min(TWEAK_BATCH);
                            k.tweaks(&metadata[i * md_len..], number, &mut batch[..n]);
                        }
                        batch[j]
                    }
                };
                unit(&tweak, sector)?;
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
            // One draw for the whole run.
            self.nonces.fill_each(first_sector, metadata, 16)?;
        }
        self.crypt(first_sector, Io::InPlace(data), metadata, true)
    }

    fn encrypt_sectors_to(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(plaintext, ciphertext)?;
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            plaintext.len(),
            metadata.len(),
        )?;
        if self.tweak_key.is_some() {
            self.nonces.fill_each(first_sector, metadata, 16)?;
        }
        self.crypt(
            first_sector,
            Io::copy(plaintext, ciphertext),
            metadata,
            true,
        )
    }

    fn decrypt_sectors_to(
        &self,
        first_sector: u64,
        ciphertext: &[u8],
        plaintext: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(ciphertext, plaintext)?;
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            ciphertext.len(),
            metadata.len(),
        )?;
        self.crypt(
            first_sector,
            Io::copy(ciphertext, plaintext),
            metadata,
            false,
        )
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
        self.crypt(first_sector, Io::InPlace(data), metadata, false)
    }
}

/// Raw XTS over one data unit (whole 16-byte blocks) with an explicit tweak value, for the
/// IEEE 1619 known-answer tests (data units of 32 and 512 bytes): through the engine the suites
/// use on this CPU, or with `openssl_only` through OpenSSL whatever the CPU, so tests can hold
/// the two engines to each other.
#[doc(hidden)]
pub fn xts_crypt_unit(
    key: &[u8],
    tweak: &[u8; 16],
    data: &mut [u8],
    encrypt: bool,
    openssl_only: bool,
) -> Result<(), CryptoError> {
    check_key_len(Suite::AesXtsPlain64, key)?;
    check_unit(data)?;
    let engine = if openssl_only {
        Engine::openssl(key)
    } else {
        Engine::new(key)
    };
    engine.run(encrypt, |unit| unit(tweak, Io::InPlace(data)))
}

fn check_unit(data: &[u8]) -> Result<(), CryptoError> {
    if data.is_empty() || !data.len().is_multiple_of(16) {
        return Err(CryptoError::BufferLength {
            len: data.len(),
            sector_size: 16,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched tweaks equal `AES-256(K_t, r) xor LE128(sector)` computed block by block with
    /// the `aes` crate, for every batch length, on both engines of the tweak key.
    #[test]
    fn batched_tweaks_are_aes_of_r_xor_sector() {
        let mut key = [0u8; 32];
        crate::fill_random(&mut key).unwrap();
        let reference = Aes256::new(GenericArray::from_slice(&key));
        let mut engines = vec![TweakKey::Soft(Box::new(Aes256::new(
            GenericArray::from_slice(&key),
        )))];
        #[cfg(target_arch = "x86_64")]
        if let Some(aes) = AesBlockCipher::new(&key) {
            engines.push(TweakKey::Vaes(Box::new(aes)));
        }
        for engine in &engines {
            for n in 1..=TWEAK_BATCH {
                let mut rs = vec![0u8; n * 16];
                crate::fill_random(&mut rs).unwrap();
                let first = u64::MAX - 3 - n as u64;
                let mut tweaks = [[0u8; 16]; TWEAK_BATCH];
                engine.tweaks(&rs, first, &mut tweaks[..n]);
                for (i, r) in rs.chunks_exact(16).enumerate() {
                    let mut t = GenericArray::clone_from_slice(r);
                    reference.encrypt_block(&mut t);
                    let t: [u8; 16] = t.into();
                    let expected =
                        (u128::from_le_bytes(t) ^ u128::from(first + i as u64)).to_le_bytes();
                    assert_eq!(tweaks[i], expected, "batch of {n}, tweak {i}");
                }
                assert!(
                    tweaks[n..].iter().all(|t| t == &[0u8; 16]),
                    "past the batch"
                );
            }
        }
    }
}
