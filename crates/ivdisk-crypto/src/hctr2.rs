//! `aes-hctr2-plain64`: HCTR2 (Crowley, Huckleberry, Biggers 2021), a tweakable wide-block
//! cipher: every ciphertext bit depends on every plaintext bit of the sector.
//!
//! With M = first 16 bytes and N = rest of the message, T = tweak:
//!   MM = M xor H(T, N);  UU = E(MM);  S = MM xor UU xor L;  V = N xor XCTR(S);
//!   U = UU xor H(T, V);  ciphertext = U || V
//! where h = E(0), L = E(1), H is POLYVAL keyed by h over a length block, T and the padded
//! message, and XCTR's keystream block i (from 1) is E(S xor LE128(i)). The tweak is 32 bytes,
//! as in Linux's `hctr2(aes)`; the suite fills it like dm-crypt's plain64 (offset/512, LE64).

use aes::cipher::{BlockDecrypt, BlockEncrypt, KeyInit};
use aes::{Aes128, Aes256};
use polyval::universal_hash::UniversalHash;
use polyval::Polyval;

use crate::suite::{check_key_len, check_run, check_sector_size, plain64_iv};
use crate::{CryptoError, Suite};

/// An AES block (the `aes` crate's type); POLYVAL takes its own block type, converted by bytes.
type Block = aes::Block;

fn pv(block: &Block) -> polyval::Block {
    polyval::Block::from(<[u8; 16]>::from(*block))
}

fn from_pv(block: polyval::Block) -> Block {
    Block::from(<[u8; 16]>::from(block))
}

/// Tweak length: two POLYVAL blocks, as Linux's `hctr2` uses.
pub const TWEAK_LEN: usize = 32;
/// Keystream blocks generated per AES call (parallel AES-NI pipeline).
const XCTR_CHUNK: usize = 32;

// One per cipher, built once and never moved on the hot path: the size difference is harmless.
#[allow(clippy::large_enum_variant)]
enum Aes {
    K128(Aes128),
    K256(Aes256),
}

impl Aes {
    fn encrypt_blocks(&self, blocks: &mut [Block]) {
        match self {
            Aes::K128(c) => c.encrypt_blocks(blocks),
            Aes::K256(c) => c.encrypt_blocks(blocks),
        }
    }
    fn encrypt_block(&self, block: &mut Block) {
        match self {
            Aes::K128(c) => c.encrypt_block(block),
            Aes::K256(c) => c.encrypt_block(block),
        }
    }
    fn decrypt_block(&self, block: &mut Block) {
        match self {
            Aes::K128(c) => c.decrypt_block(block),
            Aes::K256(c) => c.decrypt_block(block),
        }
    }
}

/// HCTR2 over AES with one key: any message of at least 16 bytes, 32-byte tweak. Wiped on
/// drop: `l` (AES_K(1)) by hand, the AES and POLYVAL states by their crates' `zeroize`.
pub struct Hctr2 {
    aes: Aes,
    l: Block,
    /// POLYVAL states after the length block, for messages of whole blocks / with a remainder.
    hash_whole: Polyval,
    hash_partial: Polyval,
}

impl Drop for Hctr2 {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(self.l.as_mut_slice());
    }
}

impl Hctr2 {
    /// Key with 16 (AES-128) or 32 (AES-256) bytes.
    pub fn new(key: &[u8]) -> Result<Self, CryptoError> {
        check_key_len(Suite::AesHctr2Plain64, key)?;
        let aes = match key.len() {
            16 => Aes::K128(Aes128::new_from_slice(key).expect("length checked")),
            _ => Aes::K256(Aes256::new_from_slice(key).expect("length checked")),
        };
        let mut h = Block::default();
        aes.encrypt_block(&mut h);
        let mut l = Block::default();
        l[0] = 1;
        aes.encrypt_block(&mut l);
        let mut h_key = pv(&h);
        let base = Polyval::new(&h_key);
        // The hash key wiped where the optimiser cannot drop the stores as dead (plain
        // stores to a value never read again may be removed).
        zeroize::Zeroize::zeroize(h.as_mut_slice());
        zeroize::Zeroize::zeroize(h_key.as_mut_slice());
        let length_state = |remainder: bool| {
            let mut p = base.clone();
            let mut block = Block::default();
            let bits = (TWEAK_LEN * 8 * 2 + 2 + remainder as usize) as u64;
            block[..8].copy_from_slice(&bits.to_le_bytes());
            p.update(&[pv(&block)]);
            p
        };
        Ok(Hctr2 {
            hash_whole: length_state(false),
            hash_partial: length_state(true),
            aes,
            l,
        })
    }

    /// POLYVAL state after the length block and the tweak (shared by both hashes of a call).
    fn hashed_tweak(&self, tweak: &[u8; TWEAK_LEN], message_len: usize) -> Polyval {
        let mut p = if message_len.is_multiple_of(16) {
            self.hash_whole.clone()
        } else {
            self.hash_partial.clone()
        };
        p.update_padded(tweak);
        p
    }

    /// H(T, bulk): continue from the hashed tweak over the bulk, padded with 0x01 0x00...
    fn hash_bulk(mut p: Polyval, bulk: &[u8]) -> Block {
        let (whole, rest) = bulk.split_at(bulk.len() - bulk.len() % 16);
        // Whole blocks: no padding is added, so this is plain POLYVAL over them.
        p.update_padded(whole);
        if !rest.is_empty() {
            let mut last = Block::default();
            last[..rest.len()].copy_from_slice(rest);
            last[rest.len()] = 1;
            p.update(&[pv(&last)]);
        }
        from_pv(p.finalize())
    }

    /// XOR the XCTR keystream for nonce `s` into `bulk`.
    fn xctr(&self, s: &Block, bulk: &mut [u8]) {
        let mut counter: u64 = 1;
        for chunk in bulk.chunks_mut(XCTR_CHUNK * 16) {
            let mut ks = [Block::default(); XCTR_CHUNK];
            let n = chunk.len().div_ceil(16);
            for k in ks[..n].iter_mut() {
                *k = *s;
                for (b, c) in k.iter_mut().zip(counter.to_le_bytes()) {
                    *b ^= c;
                }
                counter += 1;
            }
            self.aes.encrypt_blocks(&mut ks[..n]);
            for (d, k) in chunk.iter_mut().zip(ks[..n].iter().flatten()) {
                *d ^= k;
            }
        }
    }

    /// Encrypt `data` (at least 16 bytes) in place under `tweak`.
    pub fn encrypt(&self, tweak: &[u8; TWEAK_LEN], data: &mut [u8]) {
        self.crypt(tweak, data, true)
    }

    /// Decrypt `data` (at least 16 bytes) in place under `tweak`.
    pub fn decrypt(&self, tweak: &[u8; TWEAK_LEN], data: &mut [u8]) {
        self.crypt(tweak, data, false)
    }

    fn crypt(&self, tweak: &[u8; TWEAK_LEN], data: &mut [u8], encrypt: bool) {
        assert!(data.len() >= 16, "HCTR2 needs at least one block");
        let hashed_tweak = self.hashed_tweak(tweak, data.len());
        let (first, bulk) = data.split_at_mut(16);
        // MM = M ^ H(T||N)   (decrypt: UU = U ^ H(T||V))
        let mut mm = Self::hash_bulk(hashed_tweak.clone(), bulk);
        xor_into(&mut mm, first);
        // UU = E(MM)         (decrypt: MM = D(UU))
        let mut uu = mm;
        if encrypt {
            self.aes.encrypt_block(&mut uu);
        } else {
            self.aes.decrypt_block(&mut uu);
        }
        // S = MM ^ UU ^ L
        let mut s = mm;
        xor_into(&mut s, &uu);
        xor_into(&mut s, &self.l);
        // V = N ^ XCTR(S)
        self.xctr(&s, bulk);
        // U = UU ^ H(T||V)
        let mut u = Self::hash_bulk(hashed_tweak, bulk);
        xor_into(&mut u, &uu);
        first.copy_from_slice(&u);
    }
}

fn xor_into(acc: &mut Block, other: &[u8]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a ^= b;
    }
}

/// The `aes-hctr2-plain64` suite.
pub(crate) struct Hctr2Suite {
    hctr2: Hctr2,
    sector_size: usize,
}

impl std::fmt::Debug for Hctr2Suite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hctr2Suite")
            .field("sector_size", &self.sector_size)
            .finish_non_exhaustive()
    }
}

impl Hctr2Suite {
    pub(crate) fn new(key: &[u8], sector_size: usize) -> Result<Self, CryptoError> {
        check_sector_size(sector_size)?;
        Ok(Hctr2Suite {
            hctr2: Hctr2::new(key)?,
            sector_size,
        })
    }
}

impl crate::SectorCipher for Hctr2Suite {
    fn suite(&self) -> Suite {
        Suite::AesHctr2Plain64
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
            Suite::AesHctr2Plain64,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        for (i, sector) in data.chunks_exact_mut(self.sector_size).enumerate() {
            let tweak = plain64_iv(first_sector + i as u64, self.sector_size);
            self.hctr2.encrypt(&tweak, sector);
        }
        Ok(())
    }

    fn decrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_run(
            Suite::AesHctr2Plain64,
            self.sector_size,
            first_sector,
            data.len(),
            metadata.len(),
        )?;
        for (i, sector) in data.chunks_exact_mut(self.sector_size).enumerate() {
            let tweak = plain64_iv(first_sector + i as u64, self.sector_size);
            self.hctr2.decrypt(&tweak, sector);
        }
        Ok(())
    }
}
