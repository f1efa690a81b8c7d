//! Output buffers written before they are read: a cipher's ciphertext goes into memory that
//! held nothing, with no zero-fill first.
//!
//! Why: the image layer hands the store a fresh buffer per write. Zeroing it before the cipher
//! overwrites it was a pass of its own (`memset`, 13% of the samples of 4 MiB AEGIS-128L writes
//! in the image bench), and safe Rust cannot hand uninitialised memory to code that takes
//! `&mut [u8]`. The kernels that store through raw pointers (`Io::as_ptrs`) write such memory
//! directly; everything else zeroes it first (`Io::settled`).

use std::mem::MaybeUninit;

/// Append `len` bytes to `out`, written by `write` into `out`'s spare capacity. The bytes
/// become part of `out` only when `write` returns `Ok`; on `Err` `out` keeps its length.
///
/// The caller's promise: on `Ok`, `write` has written every one of the `len` bytes. The
/// callers (`encrypt_sectors_append` of the AEAD suites in `aead.rs` and of AES-XTS in
/// `xts.rs`; `encrypt_sectors_append_slots` of AEGIS-128L, AEGIS-256, AES-GCM and
/// `aes-xts-random`, whose `seal_slots`, `seal_each_slot` (AEGIS-256, AES-GCM) and
/// `encrypt_slots` pass each slot's sector part as an `Io::fresh` run and write every byte of
/// its metadata part) pass
/// the region to their encryption path as `Io::fresh`, whose every branch writes the whole
/// output of a successful run: the four-lane AEGIS-128L kernels, the 256-bit
/// one-message AEGIS-128L code and the XTS kernels store every block of each sector through
/// `Io::as_ptrs`, GCM's `ffi::stream_update` hands those pointers to OpenSSL and checks that
/// it wrote every byte, `ffi::aegis256` hands them to libaegis, whose encryption writes
/// every output byte; the other code (the AVX-512 one-message code, OpenSSL's XTS) works on
/// the region
/// after `Io::settled` zeroed it, and the in-place fallback after `Io::into_in_place` copied
/// the input into it. One caller decrypts: `decrypt_sectors_from_slots_append` of
/// AEGIS-128L passes each slot's sector part and its output as an `Io::fresh` run to
/// `open_slots`, whose four-lane kernel stores every block through `Io::as_ptrs`, whose
/// one-message code for the last sectors works after `Io::settled`, and which zeroes every
/// sector whose tag does not verify (`Io::clear_output`), so it returns `Ok` to this function
/// for such a run too. `tests/properties.rs` holds the appended bytes to `encrypt_sectors`
/// (and to `decrypt_sectors_from_slots`) byte for byte for every suite and shape of run, and
/// CI runs it with each kernel width and with VAES off.
pub(crate) fn append_written<E>(
    out: &mut Vec<u8>,
    len: usize,
    write: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<(), E>,
) -> Result<(), E> {
    out.reserve(len);
    let at = out.len();
    write(&mut out.spare_capacity_mut()[..len])?;
    // SAFETY: `reserve` made room for `len` more bytes, and `write` returned `Ok`, which by the
    // promise above means it wrote all `len` bytes after the current length.
    unsafe { out.set_len(at + len) };
    Ok(())
}

/// Let `write`, one of the writers `append_written` lists, fill `buf`, memory that is already
/// initialised (`encrypt_sectors_to_slots` of the same suites, into slots the caller has).
/// On an error `buf` holds some mix of its old bytes and what was written.
pub(crate) fn write_over<E>(
    buf: &mut [u8],
    write: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<(), E>,
) -> Result<(), E> {
    // SAFETY: `MaybeUninit<u8>` has the size and alignment of `u8`, so this is the same memory
    // at the same length. `buf` stays initialised because `write` is one of the writers
    // `append_written` lists, which store only initialised bytes (through `Io::as_ptrs`,
    // `MaybeUninit::write` and `write_copy`), never `MaybeUninit::uninit()`.
    let spare = unsafe { &mut *(buf as *mut [u8] as *mut [MaybeUninit<u8>]) };
    write(spare)
}

/// Write `src` into `dst` (same length): `<[MaybeUninit<u8>]>::write_copy_of_slice`, which
/// is newer than this workspace's minimum Rust.
pub(crate) fn write_copy(dst: &mut [MaybeUninit<u8>], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "a copy of one length");
    for (d, s) in dst.iter_mut().zip(src) {
        d.write(*s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_only_on_success() {
        let mut out = vec![1u8, 2];
        append_written(&mut out, 3, |spare| {
            write_copy(spare, &[3, 4, 5]);
            Ok::<(), ()>(())
        })
        .unwrap();
        assert_eq!(out, [1, 2, 3, 4, 5]);
        let failed = append_written(&mut out, 4, |spare| {
            spare[0].write(9);
            Err("half way")
        });
        assert_eq!(failed, Err("half way"));
        assert_eq!(out, [1, 2, 3, 4, 5]);
    }
}
