//! Reused OpenSSL cipher contexts.
//!
//! Key setup (AES key expansion, GCM's H table) costs about as much as encrypting a sector, so a
//! suite keeps initialised contexts and only resets the IV per sector. A context is taken for
//! one run of sectors and given back after, so concurrent runs never share one.
//!
//! The contexts sit in a fixed array of slots, each behind its own lock. A run tries the slots
//! from a per-thread starting point with `try_lock`: uncontended, that is one atomic operation
//! to take a context and one to give it back (a shared free list behind one lock took four and
//! showed as 3% of a one-sector run).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use openssl::cipher::CipherRef;
use openssl::cipher_ctx::{CipherCtx, CipherCtxRef};
use zeroize::Zeroizing;

use crate::CryptoError;

/// Slots per pool: more than the threads that encrypt at once in practice. When every slot is
/// busy a run builds a context of its own and frees it after.
const SLOTS: usize = 16;

/// Which way the contexts of a pool run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    Encrypt,
    Decrypt,
}

pub(crate) struct ContextPool {
    cipher: &'static CipherRef,
    key: Zeroizing<Vec<u8>>,
    direction: Direction,
    iv_len: usize,
    slots: [Mutex<Option<CipherCtx>>; SLOTS],
}

thread_local! {
    /// The slot this thread tries first: threads spread over the slots, and a thread keeps
    /// finding "its" context warm in cache.
    static FIRST_SLOT: usize = {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed) % SLOTS
    };
}

impl ContextPool {
    pub(crate) fn new(cipher: &'static CipherRef, key: &[u8], direction: Direction) -> Self {
        ContextPool {
            cipher,
            key: Zeroizing::new(key.to_vec()),
            direction,
            iv_len: cipher.iv_length(),
            slots: std::array::from_fn(|_| Mutex::new(None)),
        }
    }

    fn fresh(&self) -> Result<CipherCtx, CryptoError> {
        let mut ctx = CipherCtx::new()?;
        match self.direction {
            Direction::Encrypt => ctx.encrypt_init(Some(self.cipher), Some(&self.key), None)?,
            Direction::Decrypt => ctx.decrypt_init(Some(self.cipher), Some(&self.key), None)?,
        }
        Ok(ctx)
    }

    fn free_slot(&self) -> Option<MutexGuard<'_, Option<CipherCtx>>> {
        let first = FIRST_SLOT.with(|s| *s);
        (0..SLOTS).find_map(|i| match self.slots[(first + i) % SLOTS].try_lock() {
            Ok(guard) => Some(guard),
            // A run that panicked mid-way left its context in an unknown state: start afresh.
            Err(TryLockError::Poisoned(p)) => {
                let mut guard = p.into_inner();
                *guard = None;
                Some(guard)
            }
            Err(TryLockError::WouldBlock) => None,
        })
    }

    /// Run `f` with a context keyed for this pool; the IV is the caller's to set.
    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&mut CipherCtxRef) -> Result<T, CryptoError>,
    ) -> Result<T, CryptoError> {
        let Some(mut slot) = self.free_slot() else {
            let mut ctx = self.fresh()?;
            return f(&mut ctx);
        };
        if slot.is_none() {
            *slot = Some(self.fresh()?);
        }
        let result = f(slot.as_mut().expect("filled above"));
        if result.is_err() {
            // A context that failed mid-run may be in any state: drop it rather than reuse it.
            *slot = None;
        }
        result
    }

    /// Reset the context's IV, keeping its key schedule.
    pub(crate) fn set_iv(&self, ctx: &mut CipherCtxRef, iv: &[u8]) -> Result<(), CryptoError> {
        crate::ffi::reset_iv(ctx, iv, self.iv_len, self.direction == Direction::Encrypt)?;
        Ok(())
    }
}
