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

/// AES blocks per refill: the first 2 become the next key, the rest is output.
const REFILL_BLOCKS: usize = 256;
const KEY_BYTES: usize = 32;
const BUFFER_BYTES: usize = REFILL_BLOCKS * 16;

struct NonceRng {
    cipher: Aes256,
    /// The last refill, encrypted in place; bytes before `used` are handed out and wiped (the
    /// first 32 were the next key, wiped at once).
    buffer: [aes::Block; REFILL_BLOCKS],
    used: usize,
    fork_generation: u64,
    bytes_since_seed: u64,
}

impl NonceRng {
    fn seeded() -> Result<Self, getrandom::Error> {
        let mut rng = NonceRng {
            cipher: Aes256::new(GenericArray::from_slice(os_seed()?.as_ref())),
            buffer: [aes::Block::default(); REFILL_BLOCKS],
            used: BUFFER_BYTES,
            fork_generation: crate::ffi::fork_generation(),
            bytes_since_seed: 0,
        };
        rng.refill();
        Ok(rng)
    }

    /// Take a fresh seed from the OS, in place. Cold and out of line, as are `refill` and the
    /// first seeding in `fill_random`: inlined, their stack temporaries (a whole generator is
    /// 4 KiB of buffer) gave every draw a 10 KiB stack frame, probed page by page, which cost
    /// a single-sector AEGIS-128L encryption about 3%.
    #[cold]
    #[inline(never)]
    fn reseed(&mut self) -> Result<(), getrandom::Error> {
        self.cipher = Aes256::new(GenericArray::from_slice(os_seed()?.as_ref()));
        self.fork_generation = crate::ffi::fork_generation();
        self.bytes_since_seed = 0;
        // Every block of the buffer is overwritten: nothing of the old output survives.
        self.refill();
        Ok(())
    }

    /// Encrypt counters 0..REFILL_BLOCKS in place under the current key; rekey with the first
    /// two blocks and wipe them.
    #[inline(never)]
    fn refill(&mut self) {
        for (i, b) in self.buffer.iter_mut().enumerate() {
            b[..8].copy_from_slice(&(i as u64).to_le_bytes());
            b[8..].fill(0);
        }
        self.cipher.encrypt_blocks(&mut self.buffer);
        let mut next_key = Zeroizing::new([0u8; KEY_BYTES]);
        next_key[..16].copy_from_slice(&self.buffer[0]);
        next_key[16..].copy_from_slice(&self.buffer[1]);
        self.cipher = Aes256::new(GenericArray::from_slice(next_key.as_ref()));
        self.buffer[0].fill(0);
        self.buffer[1].fill(0);
        self.used = KEY_BYTES;
    }

    /// The error is `getrandom`'s (4 bytes, returned in a register): with `CryptoError` the
    /// result went through memory on every draw.
    fn fill(&mut self, mut out: &mut [u8]) -> Result<(), getrandom::Error> {
        let generation = crate::ffi::fork_generation();
        if generation != self.fork_generation || self.bytes_since_seed >= RESEED_AFTER_BYTES {
            self.reseed()?;
        }
        self.bytes_since_seed += out.len() as u64;
        // Whole blocks while `used` is on a block boundary (16- and 32-byte nonces keep it
        // there; a 12-byte GCM nonce moves it off until the next refill): fixed-size copies and
        // wipes, where the general loop below calls `memmove` and `memset` for every piece (a
        // third of a 16-byte draw's time, `perf`).
        while self.used.is_multiple_of(16) && out.len() >= 16 {
            if self.used == BUFFER_BYTES {
                self.refill();
            }
            let (head, rest) = std::mem::take(&mut out).split_at_mut(16);
            let block = &mut self.buffer[self.used / 16];
            head.copy_from_slice(block);
            *block = aes::Block::default();
            self.used += 16;
            out = rest;
        }
        while !out.is_empty() {
            if self.used == BUFFER_BYTES {
                self.refill();
            }
            let block = &mut self.buffer[self.used / 16];
            let offset = self.used % 16;
            let n = out.len().min(16 - offset);
            out[..n].copy_from_slice(&block[offset..offset + n]);
            // A plain memset, not `zeroize` (a volatile store per byte, measurable at 20 GB/s):
            // the buffer lives on in this thread's generator and is read by later draws, so the
            // compiler cannot drop these stores as dead.
            block[offset..offset + n].fill(0);
            self.used += n;
            out = &mut out[n..];
        }
        Ok(())
    }
}

impl Drop for NonceRng {
    fn drop(&mut self) {
        for b in self.buffer.iter_mut() {
            b.zeroize();
        }
    }
}

fn os_seed() -> Result<Zeroizing<[u8; 32]>, getrandom::Error> {
    let mut seed = Zeroizing::new([0u8; 32]);
    getrandom::getrandom(seed.as_mut())?;
    Ok(seed)
}

thread_local! {
    static NONCE_RNG: RefCell<Option<NonceRng>> = const { RefCell::new(None) };
}

/// Fill `out` with fresh random bytes for IVs and nonces.
pub fn fill_random(out: &mut [u8]) -> Result<(), CryptoError> {
    NONCE_RNG
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            match slot.as_mut() {
                Some(rng) => rng.fill(out),
                None => first_fill(&mut slot, out),
            }
        })
        .map_err(|e| CryptoError::Rng(e.to_string()))
}

/// This thread's first draw: seed its generator, then draw (cold, see `NonceRng::reseed`).
#[cold]
#[inline(never)]
fn first_fill(slot: &mut Option<NonceRng>, out: &mut [u8]) -> Result<(), getrandom::Error> {
    slot.insert(NonceRng::seeded()?).fill(out)
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
        let bytes = |rng: &NonceRng| rng.buffer.iter().flatten().copied().collect::<Vec<u8>>();
        let mut rng = NonceRng::seeded().unwrap();
        assert!(
            bytes(&rng)[..KEY_BYTES].iter().all(|&b| b == 0),
            "next key left in the buffer"
        );
        let mut out = [0u8; 100];
        rng.fill(&mut out).unwrap();
        assert_eq!(rng.used, KEY_BYTES + 100);
        let buffer = bytes(&rng);
        assert!(
            buffer[..KEY_BYTES + 100].iter().all(|&b| b == 0),
            "output left in the buffer"
        );
        assert!(
            buffer[KEY_BYTES + 100..].iter().any(|&b| b != 0),
            "future output missing"
        );
        // Crossing a refill: the next buffer comes from a new key, so it differs from the first.
        let tail = buffer[BUFFER_BYTES - 16..].to_vec();
        let left = BUFFER_BYTES - KEY_BYTES - 100;
        let mut big = vec![0u8; left + 50];
        rng.fill(&mut big).unwrap();
        assert_eq!(rng.used, KEY_BYTES + 50);
        assert_eq!(&big[left - 16..left], &tail[..]);
        assert_ne!(&big[left..][..16], &tail[..]);
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
        assert!(
            (ones as f64 / bits - 0.5).abs() < 0.01,
            "bias: {}",
            ones as f64 / bits
        );
    }
}
