//! Random IVs and nonces: a per-thread ChaCha12 generator seeded from the OS.
//!
//! ChaCha12 is what the `rand` crate's standard generator uses: 12 rounds keep a wide margin
//! over the best known attack (7 rounds) at 60% of ChaCha20's cost.
//!
//! A syscall per sector would cost as much as encrypting it; ChaCha12 in user space makes
//! 16-48 bytes of nonce cost a few nanoseconds. Each thread has its own generator (no lock),
//! seeded from `getrandom`, reseeded after every [`RESEED_AFTER_BYTES`] of output (bounds what a
//! leaked state reveals) and after `fork()` (see [`crate::ffi`]).

use std::cell::RefCell;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;
use zeroize::Zeroizing;

use crate::CryptoError;

/// Output after which a thread's generator takes a fresh seed from the OS.
pub const RESEED_AFTER_BYTES: u64 = 1 << 24;

struct NonceRng {
    rng: ChaCha12Rng,
    fork_generation: u64,
    bytes_since_seed: u64,
}

impl NonceRng {
    fn seeded() -> Result<Self, CryptoError> {
        Ok(NonceRng {
            rng: ChaCha12Rng::from_seed(*os_seed()?),
            fork_generation: crate::ffi::fork_generation(),
            bytes_since_seed: 0,
        })
    }

    fn fill(&mut self, out: &mut [u8]) -> Result<(), CryptoError> {
        let generation = crate::ffi::fork_generation();
        if generation != self.fork_generation || self.bytes_since_seed >= RESEED_AFTER_BYTES {
            *self = NonceRng::seeded()?;
        }
        self.rng.fill_bytes(out);
        self.bytes_since_seed += out.len() as u64;
        Ok(())
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
