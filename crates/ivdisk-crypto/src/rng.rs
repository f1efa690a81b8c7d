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
                sector_number_nonce(sector, out);
                Ok(())
            }
        }
    }

    /// The nonces of one run of consecutive sectors from `first_sector`, sealed together:
    /// one random value of `nonce_len` bytes for the run (at most [`MAX_RUN_NONCE`]).
    pub(crate) fn run(self, first_sector: u64, nonce_len: usize) -> Result<RunNonces, CryptoError> {
        let mut base = [0u8; MAX_RUN_NONCE];
        if self == NonceSource::Random {
            fill_random(&mut base[..nonce_len])?;
        }
        Ok(RunNonces {
            source: self,
            first_sector,
            base,
            nonce_len,
        })
    }
}

fn sector_number_nonce(sector: u64, out: &mut [u8]) {
    out.fill(0);
    let n = out.len().min(8);
    out[..n].copy_from_slice(&sector.to_le_bytes()[..n]);
}

/// The longest nonce [`NonceSource::run`] draws (AEGIS-256's).
pub(crate) const MAX_RUN_NONCE: usize = 32;

/// The nonces of one run of consecutive sectors sealed together: sector `first + i` gets the
/// run's random value plus `i` (little endian, wrapping within the nonce's bytes).
///
/// Why not a fresh random nonce per sector: on RADOS the metadata's bytes cost the OSDs in
/// proportion to their size, and consecutive nonces let the `omap-packed` layout store a run of
/// sectors' nonces as one (docs/CRYPTO.md, "Nonces of one write"). The AEAD suites need nonces
/// that never repeat under one key, not unpredictable ones; the runs' random starting points keep
/// the chance that two runs overlap at most what independent nonces per sector would give.
#[derive(Debug)]
pub(crate) struct RunNonces {
    source: NonceSource,
    first_sector: u64,
    base: [u8; MAX_RUN_NONCE],
    nonce_len: usize,
}

impl RunNonces {
    /// The nonce of `sector` (a sector of the run) into `out` (`nonce_len` bytes).
    pub(crate) fn fill(&self, sector: u64, out: &mut [u8]) {
        debug_assert_eq!(out.len(), self.nonce_len);
        match self.source {
            NonceSource::Random => {
                out.copy_from_slice(&self.base[..out.len()]);
                nonce_add(out, sector.wrapping_sub(self.first_sector));
            }
            NonceSource::SectorNumber => sector_number_nonce(sector, out),
        }
    }

    /// The nonces of consecutive sectors from `first_sector`, `nonce_len` bytes each, packed
    /// in `out`.
    #[cfg(test)]
    pub(crate) fn fill_each(&self, first_sector: u64, out: &mut [u8]) {
        for (i, nonce) in out.chunks_exact_mut(self.nonce_len).enumerate() {
            self.fill(first_sector + i as u64, nonce);
        }
    }
}

/// `bytes += value` as a little-endian number, wrapping at its width.
pub fn nonce_add(bytes: &mut [u8], value: u64) {
    let mut carry = value as u128;
    for b in bytes.iter_mut() {
        if carry == 0 {
            break;
        }
        let sum = *b as u128 + (carry & 0xff);
        *b = sum as u8;
        carry = (carry >> 8) + (sum >> 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_le_carries_and_wraps() {
        let mut n = [0xff, 0xff, 0x01, 0x00];
        nonce_add(&mut n, 1);
        assert_eq!(n, [0x00, 0x00, 0x02, 0x00]);
        let mut n = [0xfe, 0xff, 0xff, 0xff];
        nonce_add(&mut n, 3);
        assert_eq!(n, [0x01, 0x00, 0x00, 0x00], "wraps at the nonce's width");
        let mut n = [0u8; 16];
        nonce_add(&mut n, u64::MAX);
        assert_eq!(n[..8], [0xff; 8]);
        assert_eq!(n[8..], [0; 8]);
        nonce_add(&mut n, 1);
        assert_eq!(n[..9], [0, 0, 0, 0, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn a_runs_nonces_count_up_from_one_random_value() {
        let run = NonceSource::Random.run(100, 16).unwrap();
        let other = NonceSource::Random.run(100, 16).unwrap();
        let mut a = [0u8; 16 * 8];
        run.fill_each(100, &mut a);
        let mut b = [0u8; 16 * 8];
        other.fill_each(100, &mut b);
        assert_ne!(a[..16], b[..16], "two runs draw different values");
        for (i, nonce) in a.chunks_exact(16).enumerate() {
            let mut expected: [u8; 16] = a[..16].try_into().unwrap();
            nonce_add(&mut expected, i as u64);
            assert_eq!(nonce, expected, "sector {}", 100 + i);
        }
        // A sector asked for alone gets the nonce it has in the run.
        let mut one = [0u8; 16];
        run.fill(103, &mut one);
        assert_eq!(one, a[3 * 16..4 * 16]);
    }

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
