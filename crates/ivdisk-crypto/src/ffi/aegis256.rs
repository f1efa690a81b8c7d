//! AEGIS-256 through libaegis with a run's own pointers: input and output apart, the output
//! possibly memory that holds nothing yet.
//!
//! Why: the `aegis` crate (which builds and links libaegis) offers one-shot AEGIS-256 only in
//! place or into a `Vec` it allocates. In place, a write first copies the plaintext into the
//! store's fresh buffer and a read copies the ciphertext into the caller's buffer: a pass over
//! the data of its own, which put `aegis256-random` 39-72% over the raw cipher in the image
//! bench (docs/BENCHMARKS.md). libaegis's `aegis256_encrypt_detached` and
//! `aegis256_decrypt_detached` (its public C API, `aegis256.h`) take separate input and output
//! pointers, so both directions are one pass.

use std::ffi::c_int;

use super::io::Io;

/// AEGIS-256's tag length here (the suite's metadata holds a 128-bit tag).
const TAG_LEN: usize = 16;

extern "C" {
    // libaegis, `include/aegis256.h`: 0 on success; decryption returns -1 when the tag does
    // not verify.
    fn aegis256_encrypt_detached(
        c: *mut u8,
        mac: *mut u8,
        maclen: usize,
        m: *const u8,
        mlen: usize,
        ad: *const u8,
        adlen: usize,
        npub: *const u8,
        k: *const u8,
    ) -> c_int;

    fn aegis256_decrypt_detached(
        m: *mut u8,
        c: *const u8,
        clen: usize,
        mac: *const u8,
        maclen: usize,
        ad: *const u8,
        adlen: usize,
        npub: *const u8,
        k: *const u8,
    ) -> c_int;
}

/// libaegis picks its implementation for the CPU in `aegis_init`, which the `aegis` crate
/// runs once (behind a `Once`) when an AEGIS-256 instance is first made; the suite makes one
/// when it is built, so this is done before any run gets here.
pub(crate) fn ensure_init() {
    let _ = aegis::aegis256::Aegis256::<TAG_LEN>::new(&[0; 32], &[0; 32]);
}

/// Seal `run` (its input into its output, one pass) under `key` and `nonce` with `aad`;
/// returns the tag. Every byte of the output is written.
pub(crate) fn seal(
    key: &[u8; 32],
    nonce: &[u8; 32],
    aad: &[u8],
    run: &mut Io<'_>,
) -> [u8; TAG_LEN] {
    let len = run.len();
    let (src, dst) = run.as_ptrs();
    let mut tag = [0u8; TAG_LEN];
    // SAFETY: `src` is readable and `dst` writable for `len` bytes (the run's borrows, held by
    // `run`), either the same address (libaegis encrypts in place, as the `aegis` crate's
    // `encrypt_in_place` relies on) or regions that do not overlap; libaegis writes all `len`
    // output bytes and only reads the input. `tag` holds `TAG_LEN` bytes, `aad`, `nonce` and
    // `key` are live slices of the lengths passed or of the lengths the API fixes (32 bytes
    // each for AEGIS-256's nonce and key). libaegis was initialised (`ensure_init`).
    let rc = unsafe {
        aegis256_encrypt_detached(
            dst,
            tag.as_mut_ptr(),
            TAG_LEN,
            src,
            len,
            aad.as_ptr(),
            aad.len(),
            nonce.as_ptr(),
            key.as_ptr(),
        )
    };
    // Encryption fails only for a tag length other than 16 or 32.
    assert_eq!(rc, 0, "libaegis refused an AEGIS-256 encryption");
    tag
}

/// Open `run` (its input into its output, one pass); false, with the output zeroed, when the
/// tag does not verify.
pub(crate) fn open(
    key: &[u8; 32],
    nonce: &[u8; 32],
    aad: &[u8],
    run: &mut Io<'_>,
    tag: &[u8; TAG_LEN],
) -> bool {
    let len = run.len();
    let (src, dst) = run.as_ptrs();
    // SAFETY: as in `seal`: `src` readable and `dst` writable for `len` bytes, the same
    // address or apart; `tag`, `aad`, `nonce`, `key` live and of the lengths passed or fixed.
    let rc = unsafe {
        aegis256_decrypt_detached(
            dst,
            src,
            len,
            tag.as_ptr(),
            TAG_LEN,
            aad.as_ptr(),
            aad.len(),
            nonce.as_ptr(),
            key.as_ptr(),
        )
    };
    if rc != 0 {
        // Never hand out unauthenticated plaintext (libaegis clears it too; this does not
        // depend on that).
        run.clear_output();
        return false;
    }
    true
}
