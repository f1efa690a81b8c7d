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
//! Encryption draws `U = AES-256(K_t, R)` instead of R: U is as uniform as R, the tweak
//! `U xor LE128(sector)` is ready at once, and the stored `R = AES-256^-1(K_t, U)` is computed
//! beside the XTS rounds instead of in front of them (a chain of 14 dependent AES rounds that
//! made a single-sector encryption about 5% slower than `aes-xts-plain64`). The format is the
//! same; decryption still computes the tweak from R.
//!
//! The rounds run in our VAES code where the CPU has VAES (`ffi::xts_vaes`: the tweak is an
//! argument, four blocks per ZMM instruction with AVX-512, two per YMM without) and in
//! OpenSSL's AES-NI XTS otherwise, with reused
//! contexts where only the tweak is set per sector. Tests hold the two to the IEEE vectors and
//! to each other.

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::Aes256;
use openssl::cipher::{Cipher, CipherRef};
use std::mem::MaybeUninit;

use crate::evp::{ContextPool, Direction};
#[cfg(target_arch = "x86_64")]
use crate::ffi::xts_vaes::{AesBlockCipher, XtsVaes};
use crate::io::{Io, Settled};
use crate::key::derive_subkey;
use crate::rng::NonceSource;
use crate::suite::{
    append_slots_piecewise, check_key_len, check_out_of_place, check_run, check_sector_size,
    check_slots, check_slots_append, check_whole_sectors, decrypt_slots_apart, plain64_iv,
};
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
            TweakKey::Vaes(aes) if tweaks.len() == 1 => aes.encrypt_one(&mut tweaks[0]),
            #[cfg(target_arch = "x86_64")]
            TweakKey::Vaes(aes) => aes.encrypt_blocks(tweaks),
            TweakKey::Soft(aes) => {
                for t in tweaks.iter_mut() {
                    aes.encrypt_block(GenericArray::from_mut_slice(t));
                }
            }
        }
        for (i, t) in tweaks.iter_mut().enumerate() {
            *t = tweak_of(t, first_sector + i as u64);
        }
    }

    /// Turn drawn values U (16 bytes each, in place) into the values R stored for them:
    /// `R = AES-256^-1(K_t, U)`, so that `AES-256(K_t, R) = U`.
    fn stored_values(&self, us: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if let (TweakKey::Vaes(aes), Ok(one)) = (self, <&mut [u8; 16]>::try_from(&mut *us)) {
            aes.decrypt_one(one);
            return;
        }
        for batch in us.chunks_mut(16 * TWEAK_BATCH) {
            let mut blocks = [[0u8; 16]; TWEAK_BATCH];
            let n = batch.len() / 16;
            for (b, u) in blocks.iter_mut().zip(batch.chunks_exact(16)) {
                b.copy_from_slice(u);
            }
            match self {
                #[cfg(target_arch = "x86_64")]
                TweakKey::Vaes(aes) => aes.decrypt_blocks(&mut blocks[..n]),
                TweakKey::Soft(aes) => {
                    for b in blocks[..n].iter_mut() {
                        aes.decrypt_block(GenericArray::from_mut_slice(b));
                    }
                }
            }
            for (u, b) in batch.chunks_exact_mut(16).zip(blocks.iter()) {
                u.copy_from_slice(b);
            }
        }
    }
}

/// `value xor LE128(sector)`: the XTS tweak of `aes-xts-random` from `AES-256(K_t, R)`.
fn tweak_of(value: &[u8; 16], sector: u64) -> [u8; 16] {
    (u128::from_le_bytes(*value) ^ u128::from(sector)).to_le_bytes()
}

/// Where `AesXts::crypt` takes each sector's tweak from.
enum Tweaks<'m> {
    /// `aes-xts-plain64`: the sector's byte offset / 512.
    Plain64,
    /// `aes-xts-random`, decrypting: from the stored values R, 16 bytes per sector.
    Stored(&'m [u8]),
    /// `aes-xts-random`, encrypting: from freshly drawn values U = AES-256(K_t, R), 16 bytes
    /// per sector, which `crypt` turns into the R to store (`TweakKey::stored_values`).
    Drawn(&'m mut [u8]),
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
                    for_each(&mut |tweak, mut unit| {
                        pool.set_iv(ctx, tweak)?;
                        // OpenSSL takes slices (an output that holds nothing yet is zeroed).
                        match unit.settled() {
                            Settled::InPlace(data) => {
                                ctx.cipher_update_inplace(data, data.len())?;
                            }
                            Settled::Copy { src, dst } => {
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

    /// A run's buffers against this cipher's geometry.
    fn check(&self, first_sector: u64, data: &[u8], metadata: &[u8]) -> Result<(), CryptoError> {
        check_run(
            self.suite,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )
        .map(|_| ())
    }

    /// Where decryption takes its tweaks from.
    fn stored_tweaks<'m>(&self, metadata: &'m [u8]) -> Tweaks<'m> {
        match self.tweak_key {
            Some(_) => Tweaks::Stored(metadata),
            None => Tweaks::Plain64,
        }
    }

    /// Encrypt a checked run; for `aes-xts-random` draw U per sector (one draw for the run)
    /// and let `crypt` encrypt under `U xor sector` and store R for each U.
    fn encrypt_run(
        &self,
        first_sector: u64,
        data: Io<'_>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        if self.tweak_key.is_none() {
            return self.crypt(first_sector, data, Tweaks::Plain64, true);
        }
        self.nonces.fill_each(first_sector, metadata, 16)?;
        self.crypt(first_sector, data, Tweaks::Drawn(metadata), true)
    }

    fn crypt(
        &self,
        first_sector: u64,
        data: Io<'_>,
        tweaks: Tweaks<'_>,
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        let sectors = data.len() / self.sector_size;
        let units = data.chunks(self.sector_size);
        self.crypt_units(first_sector, sectors, units, tweaks, encrypt)
    }

    /// [`AesXts::crypt`] over sectors that need not lie one after another: `units` yields
    /// each of the `sectors` sectors' runs in order (the `unaligned` layout's slots).
    fn crypt_units<'a>(
        &self,
        first_sector: u64,
        sectors: usize,
        units: impl Iterator<Item = Io<'a>>,
        mut tweaks: Tweaks<'_>,
        encrypt: bool,
    ) -> Result<(), CryptoError> {
        let mut batch = [[0u8; 16]; TWEAK_BATCH];
        self.engine.run(encrypt, |unit| {
            for (i, sector) in units.enumerate() {
                let number = first_sector + i as u64;
                let j = i % TWEAK_BATCH;
                let n = (sectors - i).min(TWEAK_BATCH);
                let tweak = match (&self.tweak_key, &mut tweaks) {
                    (Some(k), Tweaks::Stored(rs)) => {
                        if j == 0 {
                            k.tweaks(&rs[i * 16..], number, &mut batch[..n]);
                        }
                        batch[j]
                    }
                    (Some(k), Tweaks::Drawn(values)) => {
                        if j == 0 {
                            // The batch's tweaks first, then R for each U: the R's rounds run
                            // beside the XTS rounds that follow, which do not wait for them.
                            let us = &mut values[i * 16..][..n * 16];
                            let pairs = batch[..n].iter_mut().zip(us.chunks_exact(16));
                            for (m, (b, u)) in pairs.enumerate() {
                                *b = tweak_of(u.try_into().expect("16 bytes"), number + m as u64);
                            }
                            k.stored_values(us);
                        }
                        batch[j]
                    }
                    _ => plain64_iv(number, self.sector_size),
                };
                unit(&tweak, sector)?;
            }
            Ok(())
        })
    }

    /// `aes-xts-random` straight into slots (`encrypt_sectors_append_slots`): each sector
    /// encrypted from the plaintext into its slot, its stored value R after it. The caller
    /// checked the run. Values are drawn for [`SLOT_PIECE`] sectors at a time, on the stack.
    fn encrypt_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [MaybeUninit<u8>],
    ) -> Result<(), CryptoError> {
        let ss = self.sector_size;
        let slot = ss + 16;
        let mut values = [0u8; SLOT_PIECE * 16];
        let pieces = plaintext
            .chunks(SLOT_PIECE * ss)
            .zip(slots.chunks_mut(SLOT_PIECE * slot));
        for (k, (plain, slots)) in pieces.enumerate() {
            let n = plain.len() / ss;
            let number = first_sector + (k * SLOT_PIECE) as u64;
            let values = &mut values[..n * 16];
            self.nonces.fill_each(number, values, 16)?;
            let units = plain
                .chunks_exact(ss)
                .zip(slots.chunks_exact_mut(slot))
                .map(|(p, s)| Io::fresh(p, &mut s[..ss]));
            self.crypt_units(number, n, units, Tweaks::Drawn(values), true)?;
            for (s, r) in slots.chunks_exact_mut(slot).zip(values.chunks_exact(16)) {
                crate::ffi::spare::write_copy(&mut s[ss..], r);
            }
        }
        Ok(())
    }

    /// `aes-xts-random` in place in slots (`encrypt_sectors_in_slots`): values drawn for
    /// [`SLOT_PIECE`] sectors at a time on the stack, each sector encrypted where it lies and
    /// its stored value R written after it. The caller checked the run.
    fn encrypt_in_slots(&self, first_sector: u64, slots: &mut [u8]) -> Result<(), CryptoError> {
        let ss = self.sector_size;
        let slot = ss + 16;
        let mut values = [0u8; SLOT_PIECE * 16];
        for (k, piece) in slots.chunks_mut(SLOT_PIECE * slot).enumerate() {
            let n = piece.len() / slot;
            let number = first_sector + (k * SLOT_PIECE) as u64;
            let values = &mut values[..n * 16];
            self.nonces.fill_each(number, values, 16)?;
            let units = piece
                .chunks_exact_mut(slot)
                .map(|s| Io::in_place(&mut s[..ss]));
            self.crypt_units(number, n, units, Tweaks::Drawn(values), true)?;
            for (s, r) in piece.chunks_exact_mut(slot).zip(values.chunks_exact(16)) {
                s[ss..].copy_from_slice(r);
            }
        }
        Ok(())
    }

    /// `aes-xts-random` straight from slots (`decrypt_sectors_from_slots`): the stored values
    /// of [`SLOT_PIECE`] sectors gathered on the stack, each sector decrypted from its slot.
    /// The caller checked the run.
    fn decrypt_slots(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut [u8],
    ) -> Result<(), CryptoError> {
        let ss = self.sector_size;
        let slot = ss + 16;
        let mut values = [0u8; SLOT_PIECE * 16];
        let pieces = slots
            .chunks(SLOT_PIECE * slot)
            .zip(plaintext.chunks_mut(SLOT_PIECE * ss));
        for (k, (slots, plain)) in pieces.enumerate() {
            let n = plain.len() / ss;
            let number = first_sector + (k * SLOT_PIECE) as u64;
            for (r, s) in values.chunks_exact_mut(16).zip(slots.chunks_exact(slot)) {
                r.copy_from_slice(&s[ss..]);
            }
            let units = slots
                .chunks_exact(slot)
                .zip(plain.chunks_exact_mut(ss))
                .map(|(s, p)| Io::copy(&s[..ss], p));
            self.crypt_units(number, n, units, Tweaks::Stored(&values[..n * 16]), false)?;
        }
        Ok(())
    }
}

/// Sectors per piece of a slotted run: their 16-byte values (1 KiB) stay on the stack.
const SLOT_PIECE: usize = 64;

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
        self.check(first_sector, data, metadata)?;
        self.encrypt_run(first_sector, Io::in_place(data), metadata)
    }

    fn encrypt_sectors_to(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(plaintext, ciphertext)?;
        self.check(first_sector, plaintext, metadata)?;
        self.encrypt_run(first_sector, Io::copy(plaintext, ciphertext), metadata)
    }

    fn encrypt_sectors_append(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut Vec<u8>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        self.check(first_sector, plaintext, metadata)?;
        // The VAES kernels store through pointers: straight into the spare capacity (the
        // OpenSSL engine zeroes each sector first).
        crate::ffi::spare::append_written(ciphertext, plaintext.len(), |spare| {
            let run = Io::fresh(plaintext, spare);
            self.encrypt_run(first_sector, run, metadata)
        })
    }

    fn encrypt_sectors_append_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut Vec<u8>,
    ) -> Result<(), CryptoError> {
        if self.tweak_key.is_none() {
            // No metadata: a slot is the sector.
            return append_slots_piecewise(self, first_sector, plaintext, slots);
        }
        let len = check_whole_sectors(self, first_sector, plaintext)? * (self.sector_size + 16);
        crate::ffi::spare::append_written(slots, len, |spare| {
            self.encrypt_slots(first_sector, plaintext, spare)
        })
    }

    fn encrypt_sectors_to_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        if self.tweak_key.is_none() {
            // No metadata: a slot is the sector.
            return self.encrypt_sectors_to(first_sector, plaintext, slots, &mut []);
        }
        crate::ffi::spare::write_over(slots, |spare| {
            self.encrypt_slots(first_sector, plaintext, spare)
        })
    }

    fn encrypt_sectors_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        if self.tweak_key.is_none() {
            // No metadata: a slot is the sector.
            return self.encrypt_sectors(first_sector, slots, &mut []);
        }
        check_slots_append(self, first_sector, slots)?;
        self.encrypt_in_slots(first_sector, slots)
    }

    fn decrypt_sectors_from_slots(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        if self.tweak_key.is_none() {
            return decrypt_slots_apart(self, first_sector, slots, plaintext);
        }
        self.decrypt_slots(first_sector, slots, plaintext)
    }

    fn decrypt_sectors_to(
        &self,
        first_sector: u64,
        ciphertext: &[u8],
        plaintext: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(ciphertext, plaintext)?;
        self.check(first_sector, ciphertext, metadata)?;
        self.crypt(
            first_sector,
            Io::copy(ciphertext, plaintext),
            self.stored_tweaks(metadata),
            false,
        )
    }

    fn decrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        self.check(first_sector, data, metadata)?;
        self.crypt(
            first_sector,
            Io::in_place(data),
            self.stored_tweaks(metadata),
            false,
        )
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
    engine.run(encrypt, |unit| unit(tweak, Io::in_place(data)))
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

    /// The tweak key on every engine this CPU has: the `aes` crate, and AES-NI where present.
    fn tweak_key_engines(key: &[u8; 32]) -> Vec<TweakKey> {
        let mut engines = vec![TweakKey::Soft(Box::new(Aes256::new(
            GenericArray::from_slice(key),
        )))];
        #[cfg(target_arch = "x86_64")]
        if let Some(aes) = AesBlockCipher::new(key) {
            engines.push(TweakKey::Vaes(Box::new(aes)));
        }
        engines
    }

    /// The batched tweaks equal `AES-256(K_t, r) xor LE128(sector)` computed block by block with
    /// the `aes` crate, for every batch length, on both engines of the tweak key.
    #[test]
    fn batched_tweaks_are_aes_of_r_xor_sector() {
        let mut key = [0u8; 32];
        crate::fill_random(&mut key).unwrap();
        let reference = Aes256::new(GenericArray::from_slice(&key));
        let engines = tweak_key_engines(&key);
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

    /// Stored values R come back from the drawn U on both engines of the tweak key:
    /// `AES-256(K_t, R) = U`, for runs shorter and longer than a batch.
    #[test]
    fn stored_values_encrypt_back_to_the_drawn_ones() {
        let mut key = [0u8; 32];
        crate::fill_random(&mut key).unwrap();
        let reference = Aes256::new(GenericArray::from_slice(&key));
        let engines = tweak_key_engines(&key);
        for engine in &engines {
            for n in [1, 7, 8, 9, 17] {
                let mut us = vec![0u8; n * 16];
                crate::fill_random(&mut us).unwrap();
                let mut stored = us.clone();
                engine.stored_values(&mut stored);
                for (r, u) in stored.chunks_exact(16).zip(us.chunks_exact(16)) {
                    assert_ne!(r, u);
                    let mut t = GenericArray::clone_from_slice(r);
                    reference.encrypt_block(&mut t);
                    assert_eq!(t.as_slice(), u, "run of {n}");
                }
            }
        }
    }

    /// The format, from outside the code that writes it: a sector of `aes-xts-random` is XTS
    /// under the tweak `AES-256(K_t, R) xor LE128(sector)`, R being its metadata and K_t the
    /// HKDF subkey, on every engine and for runs of 1 and 11 sectors (encryption draws U and
    /// stores R; this holds the two together).
    #[test]
    fn random_sectors_are_xts_under_aes_of_the_stored_value() {
        let mut key = [0u8; 64];
        crate::fill_random(&mut key).unwrap();
        let params = CipherParams::new(4096, crate::ImageId([3; 16]));
        let k_t = derive_subkey::<32>(&key, &[b"aes-xts-random/tweak-key/", &params.image_id.0]);
        let reference = Aes256::new(GenericArray::from_slice(k_t.as_ref()));
        let mut engines =
            vec![AesXts::new(Suite::AesXtsRandom, &key, &params, NonceSource::Random).unwrap()];
        let mut openssl =
            AesXts::new(Suite::AesXtsRandom, &key, &params, NonceSource::Random).unwrap();
        openssl.engine = Engine::openssl(&key);
        engines.push(openssl);
        for cipher in &engines {
            for run in [1usize, 11] {
                let first = 77u64;
                let plaintext: Vec<u8> = (0..run * 4096).map(|i| (i * 31 % 251) as u8).collect();
                let mut data = plaintext.clone();
                let mut metadata = vec![0u8; run * 16];
                crate::SectorCipher::encrypt_sectors(cipher, first, &mut data, &mut metadata)
                    .unwrap();
                for i in 0..run {
                    let mut t = GenericArray::clone_from_slice(&metadata[i * 16..][..16]);
                    reference.encrypt_block(&mut t);
                    let tweak = tweak_of(&t.into(), first + i as u64);
                    let mut expected = plaintext[i * 4096..][..4096].to_vec();
                    xts_crypt_unit(&key, &tweak, &mut expected, true, true).unwrap();
                    assert_eq!(
                        &data[i * 4096..][..4096],
                        &expected[..],
                        "run {run}, sector {i}"
                    );
                }
            }
        }
    }
}
