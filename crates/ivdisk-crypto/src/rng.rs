//! Random IVs and nonces: a per-thread AES-256-CTR generator with fast key erasure, seeded from
//! the OS.
//!
//! A syscall per sector would cost as much as encrypting it, and at 20 GB/s (four-lane
//! AEGIS-128L) even ChaCha12's ~2.5 cycles per byte showed as 5-8% of a sector. AES-CTR on
//! AES-NI costs well under a cycle per byte. The construction is "fast key erasure"
//! (D. J. Bernstein, 2017): each refill encrypts a counter under the current key; the first 32
//! bytes become the next key, the rest is handed out, and every byte handed out is wiped from the
//! buffer, so a later look at the generator's memory reveals neither past output nor the key
//! that made it.
//!
//! Each thread has its own generator (no lock), seeded from `getrandom`, reseeded after every
//! [`RESEED_AFTER_BYTES`] of output and after `fork()` (see [`crate::ffi`]).

use std::cell::RefCell;

use aes::cipher::generic_array::GenericArray;
use aes::cipher::{BlockEncrypt, KeyInit};
use aes::Aes256;
use zeroize::{Zeroize, Zeroizing};

use crate::CryptoError;

/// Output after which a thread's generator takes a fresh seed from the OS.
pub const RESEED_AFTER_BYTES: u64 = 1 << 24;

/// AES blocks per refill: 2 become the next key, the rest is output.
const REFILL_BLOCKS: usize = 64;
const OUTPUT_BYTES: usize = (REFILL_BLOCKS - 2) * 16;

struct NonceRng {
    cipher: Aes256,
    buffer: [u8; OUTPUT_BYTES],
    /// Bytes of `buffer` already handed out (and wiped).
    used: usize,
    fork_generation: u64,
    bytes_since_seed: u64,
}

impl NonceRng {
    fn seeded() -> Result<Self, CryptoError> {
        let mut rng = NonceRng {
            cipher: Aes256::new(GenericArray::from_slice(os_seed()?.as_ref())),
            buffer: [0u8; OUTPUT_BYTES],
            used: OUTPUT_BYTES,
            fork_generation: crate::ffi::fork_generation(),
            bytes_since_seed: 0,
        };
        rng.refill();
        Ok(rng)
    }

    /// Encrypt counters 0..REFILL_BLOCKS under the current key; rekey with the first two blocks.
    fn refill(&mut self) {
        let mut blocks = [aes::Block::default(); REFILL_BLOCKS];
        for (i, b) in blocks.iter_mut().enumerate() {
            b[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
        self.cipher.encrypt_blocks(&mut blocks);
        let mut next_key = Zeroizing::new([0u8; 32]);
        next_key[..16].copy_from_slice(&blocks[0]);
        next_key[16..].copy_from_slice(&blocks[1]);
        self.cipher = Aes256::new(GenericArray::from_slice(next_key.as_ref()));
        for (out, b) in self.buffer.chunks_exact_mut(16).zip(&blocks[2..]) {
            out.copy_from_slice(b);
        }
        for b in blocks.iter_mut() {
            b.zeroize();
        }
        self.used = 0;
    }

    fn fill(&mut self, mut out: &mut [u8]) -> Result<(), CryptoError> {
        let generation = crate::ffi::fork_generation();
        if generation != self.fork_generation || self.bytes_since_seed >= RESEED_AFTER_BYTES {
            *self = NonceRng::seeded()?;
        }
        self.bytes_since_seed += out.len() as u64;
        while !out.is_empty() {
            if self.used == OUTPUT_BYTES {
                self.refill();
            }
            let n = out.len().min(OUTPUT_BYTES - self.used);
            let src = &mut self.buffer[self.used..self.used + n];
            out[..n].copy_from_slice(src);
            src.zeroize();
            self.used += n;
            out = &mut out[n..];
        }
        Ok(())
    }
}

impl Drop for NonceRng {
    fn drop(&mut self) {
        self.buffer.zeroize();
    }
}

fn os_seed() -> Result<Zeroizing<[u8; 32]>, CryptoError> {
    let mut seed = Zeroizing::new([0u8; 32]);
    getrandom::getrandom(seed.as_mut()).map_err(|e| CryptoError::Rng(e.to_string()))?;
    Ok(seed)
}

thread_local! {
    static NONCE_RNG: RefCell<Option<NonceRng>> = const { RefCell::new(None) };
}

/// Fill `out` with fresh random bytes for IVs and nonces.
pub fn fill_random(out: &mut [u8]) -> Result<(), CryptoError> {
    NONCE_RNG.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(NonceRng::seeded()?);
        }
        slot.as_mut().expect("just seeded").fill(out)
    })
}

/// Where a randomized suite takes its per-write IV or nonce from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NonceSource {
    /// Fresh random bytes per write: the only source a disk ever uses.
    Random,
    /// The sector number, little endian, zero padded: deterministic, so INSECURE (nonces repeat
    /// on overwrite). Only for benchmarks that measure what the random source costs.
    SectorNumber,
}

impl NonceSource {
    /// Fill the nonces of consecutive sectors from `first_sector`, `nonce_len` bytes each,
    /// packed in `out`: one draw for all of them.
    pub(crate) fn fill_each(
        self,
        first_sector: u64,
        out: &mut [u8],
        nonce_len: usize,
    ) -> Result<(), CryptoError> {
        match self {
            NonceSource::Random => fill_random(out),
            NonceSource::SectorNumber => {
                for (i, nonce) in out.chunks_exact_mut(nonce_len).enumerate() {
                    self.fill(first_sector + i as u64, nonce)?;
                }
                Ok(())
            }
        }
    }

    pub(crate) fn fill(self, sector: u64, out: &mut [u8]) -> Result<(), CryptoError> {
        match self {
            NonceSource::Random => fill_random(out),
            NonceSource::SectorNumber => {
                out.fill(0);
                let n = out.len().min(8);
                out[..n].copy_from_slice(&sector.to_le_bytes()[..n]);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handed_out_bytes_are_wiped_and_refills_rekey() {
        let mut rng = NonceRng::seeded().unwrap();
        let mut out = [0u8; 100];
        rng.fill(&mut out).unwrap();
        assert_eq!(rng.used, 100);
        assert!(rng.buffer[..100].iter().all(|&b| b == 0), "output left in the buffer");
        assert!(rng.buffer[100..].iter().any(|&b| b != 0), "future output missing");
        // Crossing a refill: the next buffer comes from a new key, so it differs from the first.
        let first_buffer_tail = rng.buffer[OUTPUT_BYTES - 16..].to_vec();
        let mut big = vec![0u8; OUTPUT_BYTES + 50];
        rng.fill(&mut big).unwrap();
        assert_eq!(rng.used, 150);
        assert_eq!(&big[OUTPUT_BYTES - 100 - 16..OUTPUT_BYTES - 100], &first_buffer_tail[..]);
        assert_ne!(&big[OUTPUT_BYTES - 100..][..16], &first_buffer_tail[..]);
    }

    #[test]
    fn nonces_do_not_repeat() {
        let mut seen = std::collections::HashSet::new();
        let mut nonces = vec![0u8; 16 * 20_000];
        fill_random(&mut nonces).unwrap();
        for n in nonces.chunks_exact(16) {
            assert!(seen.insert(n.to_vec()), "a 16-byte nonce repeated");
        }
        // Bits are balanced (a broken generator of zeros or a stuck counter would fail this).
        let ones: u32 = nonces.iter().map(|b| b.count_ones()).sum();
        let bits = (nonces.len() * 8) as f64;
        assert!((ones as f64 / bits - 0.5).abs() < 0.01, "bias: {}", ones as f64 / bits);
    }
}
