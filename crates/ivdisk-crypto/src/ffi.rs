//! The crate's only `unsafe`: what the Rust compiler cannot check. Calls into C libraries (a
//! fork handler registered with libc, two OpenSSL calls, AEGIS-256 in libaegis with a run's
//! own pointers in `aegis256`) and CPU instructions used through
//! `core::arch` (XTS with VAES in `xts_vaes`, four-lane AEGIS-128L in `aegis128l_vaes`,
//! one-message AEGIS-128L with AVX-512VL, 256-bit VAES or AES-NI in `aegis128l_one`, where one
//! instruction is written out in `asm!` so that the compiler keeps it: callable only once the
//! CPU is known to have them, with unaligned SIMD loads and stores), the runs the kernels read
//! and write (`io`: raw pointers, so that an output may be memory that holds nothing yet), and
//! output buffers the kernels fill before anything reads them (`spare`). Every `unsafe` block says
//! why it is sound in a `// SAFETY:` line.
//!
//! Fork handler:
//! Why: the nonce generator keeps its state in user space. After `fork()` parent and child
//! would hold the same state and draw the same "random" nonces, which for GCM reveals the
//! authentication key. A `pthread_atfork` child handler bumps a generation counter; the
//! generator compares it (one relaxed atomic load) before every draw and reseeds from the OS
//! when it changed. No syscall on the hot path.

#[cfg(target_arch = "x86_64")]
pub(crate) mod aegis128l_one;
#[cfg(target_arch = "x86_64")]
pub(crate) mod aegis128l_vaes;
pub(crate) mod aegis256;
pub(crate) mod io;
#[cfg(target_arch = "x86_64")]
mod simd;
pub(crate) mod spare;
#[cfg(target_arch = "x86_64")]
pub(crate) mod xts_vaes;

/// Reproducible pseudo-random bytes (an LCG) for the kernels' tests: `n` bytes per call.
#[cfg(all(test, target_arch = "x86_64"))]
fn test_bytes(mut seed: u64) -> impl FnMut(usize) -> Vec<u8> {
    move |n| {
        (0..n)
            .map(|_| {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (seed >> 33) as u8
            })
            .collect()
    }
}

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
static REGISTER: Once = Once::new();

extern "C" fn on_fork_in_child() {
    // Only an atomic increment: async-signal-safe, as a post-fork handler must be.
    FORK_GENERATION.fetch_add(1, Ordering::SeqCst);
}

/// The number of forks this process is removed from its original (0 in the original).
pub(crate) fn fork_generation() -> u64 {
    REGISTER.call_once(|| {
        // SAFETY: pthread_atfork only records the function pointers; `on_fork_in_child` is a
        // plain `extern "C"` function with no captured state that performs one atomic add,
        // which is allowed in a post-fork child before exec.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(on_fork_in_child)) };
        assert_eq!(
            rc, 0,
            "pthread_atfork failed: cannot make the nonce generator fork-safe"
        );
    });
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// Set a new IV on an initialised cipher context, keeping its key schedule.
///
/// Why not `CipherCtxRef::encrypt_init(None, None, Some(iv))`: that wrapper first asks OpenSSL
/// for the context's IV length, which in OpenSSL 3 is a provider parameter query with string
/// compares; per 4 KiB sector it cost several percent. The length is checked here against the
/// value the suite fixed when it built the context.
pub(crate) fn reset_iv(
    ctx: &mut openssl::cipher_ctx::CipherCtxRef,
    iv: &[u8],
    expected_iv_len: usize,
    encrypt: bool,
) -> Result<(), openssl::error::ErrorStack> {
    use foreign_types::ForeignTypeRef;
    assert_eq!(
        iv.len(),
        expected_iv_len,
        "IV length does not match the cipher"
    );
    // SAFETY: `ctx` is a valid, initialised EVP_CIPHER_CTX (a live `CipherCtxRef`, borrowed
    // mutably so no one else uses it); cipher, engine and key are NULL, which OpenSSL documents
    // as "keep the current ones"; `iv` points to `expected_iv_len` readable bytes, which equals
    // the IV length of the cipher the context was initialised with (asserted by the caller's
    // construction and above), and OpenSSL copies the IV before returning.
    let rc = unsafe {
        openssl_sys::EVP_CipherInit_ex(
            ctx.as_ptr(),
            std::ptr::null(),
            std::ptr::null_mut(),
            std::ptr::null(),
            iv.as_ptr(),
            encrypt as libc::c_int,
        )
    };
    if rc == 1 {
        Ok(())
    } else {
        Err(openssl::error::ErrorStack::get())
    }
}

/// Run an initialised context's cipher over a run: its input into its output, which may be
/// the same bytes, another buffer, or memory that holds nothing yet (`Io::fresh`). For stream
/// modes (GCM), whose update writes exactly as many bytes as it reads.
///
/// Why not `CipherCtxRef::cipher_update`: it takes the output as `&mut [u8]`, which a fresh
/// buffer cannot be, so GCM's writes zeroed their output and copied the plaintext into it
/// before encrypting in place: two passes over the data besides the cipher's.
pub(crate) fn stream_update(
    ctx: &mut openssl::cipher_ctx::CipherCtxRef,
    run: &mut io::Io<'_>,
) -> Result<(), openssl::error::ErrorStack> {
    use foreign_types::ForeignTypeRef;
    assert_eq!(
        ctx.block_size(),
        1,
        "a stream mode writes as many bytes as it reads"
    );
    let len = libc::c_int::try_from(run.len()).expect("a run shorter than 2 GiB");
    let (src, dst) = run.as_ptrs();
    let mut written: libc::c_int = 0;
    // SAFETY: `ctx` is a valid, initialised EVP_CIPHER_CTX, borrowed mutably so no one else
    // uses it. `src` is readable and `dst` writable for `len` bytes (the run's borrows, held by
    // `run`, which is borrowed mutably), and they are the same address or do not overlap,
    // the two cases EVP_CipherUpdate allows. A stream mode (block size 1, asserted above)
    // buffers nothing and writes `len` bytes to `dst`, checked below; it reads `dst` only
    // where it wrote it (GHASH over the ciphertext it produced).
    let rc = unsafe { openssl_sys::EVP_CipherUpdate(ctx.as_ptr(), dst, &mut written, src, len) };
    if rc != 1 {
        return Err(openssl::error::ErrorStack::get());
    }
    assert_eq!(written, len, "a stream mode writes every byte it reads");
    Ok(())
}

#[cfg(test)]
mod tests {
    /// After fork(), parent and child must draw different nonces even though the child starts
    /// with a copy of the parent's generator state.
    #[test]
    fn nonces_differ_between_parent_and_child_after_fork() {
        // Seed this thread's generator before forking, so the child inherits a live state.
        let mut warm = [0u8; 16];
        crate::rng::fill_random(&mut warm).unwrap();

        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two c_ints for pipe() to fill.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only draws random bytes (no allocation: the thread-local generator
        // already exists), writes them to the pipe and calls _exit, never returning into the
        // test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut drawn = [0u8; 32];
            let ok = crate::rng::fill_random(&mut drawn).is_ok();
            // SAFETY: writes 32 bytes from a live stack buffer to the pipe's write end, then
            // ends the child without running destructors or atexit handlers.
            unsafe {
                if ok {
                    libc::write(fds[1], drawn.as_ptr().cast(), drawn.len());
                }
                libc::_exit(0);
            }
        }
        let mut parent = [0u8; 32];
        crate::rng::fill_random(&mut parent).unwrap();
        let mut child = [0u8; 32];
        // SAFETY: reads at most 32 bytes into a live buffer of 32 bytes; waits for the child.
        let n = unsafe {
            libc::close(fds[1]);
            let n = libc::read(fds[0], child.as_mut_ptr().cast(), child.len());
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            libc::close(fds[0]);
            n
        };
        assert_eq!(n, 32, "child did not report its nonce");
        assert_ne!(
            parent, child,
            "parent and child drew the same nonce after fork"
        );
        assert!(
            super::fork_generation() == 0,
            "the parent is not a forked child"
        );
    }
}
