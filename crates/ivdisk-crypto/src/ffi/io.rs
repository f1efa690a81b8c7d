//! Where a cipher reads its input and writes its output: one buffer (in place), two (out of
//! place), or an input and memory that holds nothing yet (a fresh buffer).
//!
//! Why out of place: the image layer's input is the caller's buffer and its output a fresh
//! buffer for the store (and back on reads). Copying first and then transforming in place is
//! two passes over the data; at AEGIS-128L's speed the copy costs as much as the cipher
//! (measured with `perf` on the image bench: `memcpy` next to the cipher at 1 MiB). The kernels
//! load from `src` and store to `dst`, so both ways are one pass.
//!
//! Why raw pointers, in this (`unsafe`) module: an output that holds nothing yet cannot be a
//! `&mut [u8]`, and an enum of slices with a third variant for it grew from 32 to 40 bytes and
//! cost the four-lane AEGIS-128L 6-10% in moving runs around (store-forwarding stalls in
//! `seal_run`, `perf annotate`). This struct is 32 bytes, and splitting it is arithmetic.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

/// A run's input and output: `len` bytes at `src`, `len` bytes at `dst`, the same address in
/// place, otherwise two regions that do not overlap. Built only from borrows that live for
/// `'a` and holds them: nothing else touches the bytes while it exists.
pub(crate) struct Io<'a> {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    /// False for a fresh output: its bytes may only be written until `settled` zeroes them.
    dst_initialised: bool,
    _borrow: PhantomData<&'a mut [u8]>,
}

/// A run whose output is initialised, as slices: what [`Io::settled`] gives code that works on
/// slices (OpenSSL, the AVX-512 one-message AEGIS-128L code).
pub(crate) enum Settled<'a> {
    InPlace(&'a mut [u8]),
    Copy { src: &'a [u8], dst: &'a mut [u8] },
}

impl<'a> Io<'a> {
    /// Read and write the same bytes.
    #[inline]
    pub(crate) fn in_place(data: &'a mut [u8]) -> Io<'a> {
        let p = data.as_mut_ptr();
        Io {
            src: p.cast_const(),
            dst: p,
            len: data.len(),
            dst_initialised: true,
            _borrow: PhantomData,
        }
    }

    /// Read `src`, write `dst` (same length).
    #[inline]
    pub(crate) fn copy(src: &'a [u8], dst: &'a mut [u8]) -> Io<'a> {
        assert_eq!(src.len(), dst.len(), "input and output of one length");
        Io {
            src: src.as_ptr(),
            dst: dst.as_mut_ptr(),
            len: dst.len(),
            dst_initialised: true,
            _borrow: PhantomData,
        }
    }

    /// Read `src`, write `dst` (same length), which holds nothing yet: a fresh buffer for the
    /// store (`ffi::spare`). The kernels that store through [`Io::as_ptrs`] write it directly;
    /// code that works on slices takes [`Io::settled`], which zeroes it first.
    #[inline]
    pub(crate) fn fresh(src: &'a [u8], dst: &'a mut [MaybeUninit<u8>]) -> Io<'a> {
        assert_eq!(src.len(), dst.len(), "input and output of one length");
        Io {
            src: src.as_ptr(),
            dst: dst.as_mut_ptr().cast::<u8>(),
            len: dst.len(),
            dst_initialised: false,
            _borrow: PhantomData,
        }
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn is_in_place(&self) -> bool {
        self.src == self.dst.cast_const()
    }

    /// The run as slices, for code that works on them: a fresh output is zeroed first (and
    /// counts as initialised afterwards).
    pub(crate) fn settled(&mut self) -> Settled<'_> {
        if !self.dst_initialised {
            // SAFETY: `dst` is valid for writes of `len` bytes (`fresh`'s borrow, held).
            unsafe { std::ptr::write_bytes(self.dst, 0, self.len) };
            self.dst_initialised = true;
        }
        if self.is_in_place() {
            // SAFETY: in place, `dst` is the whole borrowed, initialised buffer of `len` bytes;
            // the slice borrows `self` mutably, so no other access to it exists meanwhile.
            Settled::InPlace(unsafe { std::slice::from_raw_parts_mut(self.dst, self.len) })
        } else {
            // SAFETY: `src` and `dst` are `len` initialised bytes each (`dst` was zeroed above
            // if it was fresh) that do not overlap (two distinct borrows); both slices borrow
            // `self` mutably.
            unsafe {
                Settled::Copy {
                    src: std::slice::from_raw_parts(self.src, self.len),
                    dst: std::slice::from_raw_parts_mut(self.dst, self.len),
                }
            }
        }
    }

    /// Zero the output (a run whose tag did not verify must not leave its plaintext).
    pub(crate) fn clear_output(&mut self) {
        // SAFETY: `dst` is valid for writes of `len` bytes (the borrow this run holds).
        unsafe { std::ptr::write_bytes(self.dst, 0, self.len) };
        self.dst_initialised = true;
    }

    /// The input's and the output's first byte (the same address in place), each valid for
    /// `len()` bytes, for SIMD loops (through slices the compiler re-read the run after every
    /// store, which cost the two-lane AEGIS-128L a third of its speed). A fresh output may
    /// only be written through its pointer, never read.
    #[inline]
    pub(crate) fn as_ptrs(&mut self) -> (*const u8, *mut u8) {
        (self.src, self.dst)
    }

    /// The run's last bytes, from `from` on (at most 32), through `f(input, output)` by way of
    /// buffers on the stack: the message tail of the SIMD loops (a fresh output is written,
    /// never read).
    pub(crate) fn tail_through(&mut self, from: usize, f: impl FnOnce(&[u8], &mut [u8])) {
        assert!(
            from <= self.len && self.len - from <= 32,
            "a tail of at most 32 bytes"
        );
        let n = self.len - from;
        let mut input = [0u8; 32];
        // SAFETY: `from + n == len`: `n` bytes readable at `src + from`, inside the run.
        unsafe { std::ptr::copy_nonoverlapping(self.src.add(from), input.as_mut_ptr(), n) };
        let mut output = [0u8; 32];
        f(&input[..n], &mut output[..n]);
        // SAFETY: as above, `n` bytes writable at `dst + from`.
        unsafe { std::ptr::copy_nonoverlapping(output.as_ptr(), self.dst.add(from), n) };
    }

    /// Bring the input into the output, for code that only works in place: nothing in place,
    /// a copy otherwise. Returns the output.
    pub(crate) fn into_in_place(self) -> &'a mut [u8] {
        if !self.is_in_place() {
            // SAFETY: `src` is readable and `dst` writable for `len` bytes, and they do not
            // overlap (out of place: two distinct borrows).
            unsafe { copy_raw(self.dst, self.src, self.len) };
        }
        // SAFETY: `dst` holds `len` initialised bytes now (the input's, or its own in place),
        // borrowed for `'a` by this run, which is consumed.
        unsafe { std::slice::from_raw_parts_mut(self.dst, self.len) }
    }

    /// Split at `mid` into the two halves' runs.
    #[inline]
    pub(crate) fn split_at(self, mid: usize) -> (Io<'a>, Io<'a>) {
        assert!(mid <= self.len, "split inside the run");
        let tail = Io {
            // SAFETY: `mid <= len`: both stay inside (or one past) their regions.
            src: unsafe { self.src.add(mid) },
            // SAFETY: as above.
            dst: unsafe { self.dst.add(mid) },
            len: self.len - mid,
            dst_initialised: self.dst_initialised,
            _borrow: PhantomData,
        };
        let head = Io { len: mid, ..self };
        (head, tail)
    }

    /// Consecutive pieces of `len` bytes (the last one shorter if `len` does not divide).
    /// An iterator, not a `Vec`: the allocation and free were 2-4% of a single-sector XTS run
    /// (`perf`).
    pub(crate) fn chunks(self, len: usize) -> Chunks<'a> {
        assert!(len > 0, "chunks of zero bytes");
        Chunks {
            rest: Some(self),
            len,
        }
    }
}

/// The pieces of [`Io::chunks`].
pub(crate) struct Chunks<'a> {
    rest: Option<Io<'a>>,
    len: usize,
}

impl<'a> Iterator for Chunks<'a> {
    type Item = Io<'a>;

    #[inline]
    fn next(&mut self) -> Option<Io<'a>> {
        let rest = self.rest.take()?;
        if rest.len() > self.len {
            let (head, tail) = rest.split_at(self.len);
            self.rest = Some(tail);
            Some(head)
        } else if rest.len() > 0 {
            Some(rest)
        } else {
            None
        }
    }
}

/// Safe [`copy_raw`] between slices, for the tests.
#[cfg(test)]
pub(crate) fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copies of one length");
    // SAFETY: both slices hold `len` bytes; `&mut` and `&` borrows never overlap.
    unsafe { copy_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// Copy `len` bytes from `src` to `dst`, without the stall some CPUs have on one pattern.
///
/// Why not just `copy_from_slice`: glibc copies 4 KiB with `rep movsb` on CPUs without AVX-512,
/// and on an AMD EPYC (Zen 4) `rep movsb` ran at about 2 GB/s instead of 50-80 when the
/// destination lay 1-31 bytes past the source modulo 4 KiB: the loads wait for stores whose
/// low 12 address bits match ("4K aliasing"; docs/BENCHMARKS.md, issue 2). Two 4 KiB buffers
/// allocated one after the other are 4112 bytes apart, 16 modulo 4 KiB, so a decrypting read
/// meets this. Pieces of 1 KiB stay below every `rep movsb` threshold of glibc and go through
/// its vector loop, which does not stall (50+ GB/s at every distance, measured).
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping.
unsafe fn copy_raw(dst: *mut u8, src: *const u8, len: usize) {
    const PIECE: usize = 1024;
    let distance = (dst as usize).wrapping_sub(src as usize) % 4096;
    if len > PIECE && (1..64).contains(&distance) {
        let mut at = 0;
        while at < len {
            let n = PIECE.min(len - at);
            // SAFETY: `at + n <= len`, inside both regions (the caller's promise).
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n) };
            at += n;
        }
    } else {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_both_buffers_in_order() {
        let src: Vec<u8> = (0..10).collect();
        let mut dst = vec![0u8; 10];
        let pieces: Vec<_> = Io::copy(&src, &mut dst).chunks(4).collect();
        assert_eq!(pieces.iter().map(Io::len).collect::<Vec<_>>(), [4, 4, 2]);
        for mut p in pieces {
            match p.settled() {
                Settled::Copy { src, dst } => dst.copy_from_slice(src),
                Settled::InPlace(_) => panic!("out of place in, out of place out"),
            }
        }
        assert_eq!(src, dst);
    }

    #[test]
    fn copies_are_exact_at_every_distance_and_length() {
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 256) as u8).collect();
        let mut space = vec![0u8; 20_000];
        for distance in (0..80).chain([4095, 4096, 4097, 4112]) {
            for len in [0, 1, 1023, 1024, 1025, 4096, 4100, 8192] {
                let at =
                    (src.as_ptr() as usize + distance).wrapping_sub(space.as_ptr() as usize) % 4096;
                let dst = &mut space[at..at + len];
                dst.fill(0);
                copy_bytes(dst, &src[..len]);
                assert_eq!(dst, &src[..len], "distance {distance}, length {len}");
            }
        }
    }

    #[test]
    fn fresh_outputs_are_zeroed_for_slices_and_filled_by_into_in_place() {
        let src = [1u8, 2, 3, 4, 5, 6];
        let mut space = [MaybeUninit::<u8>::uninit(); 6];
        let (mut head, tail) = Io::fresh(&src, &mut space).split_at(2);
        match head.settled() {
            Settled::Copy { src, dst } => assert_eq!((src, &*dst), (&[1u8, 2][..], &[0u8, 0][..])),
            Settled::InPlace(_) => panic!("a fresh run is out of place"),
        }
        assert_eq!(tail.into_in_place(), &[3, 4, 5, 6]);
    }

    #[test]
    fn in_place_splits_stay_in_place() {
        let mut data = [1u8, 2, 3, 4];
        let (_, mut tail) = Io::in_place(&mut data).split_at(1);
        match tail.settled() {
            Settled::InPlace(d) => d.fill(9),
            Settled::Copy { .. } => panic!("split of an in-place run"),
        }
        assert_eq!(data, [1, 9, 9, 9]);
    }

    #[test]
    fn into_in_place_copies_only_when_out_of_place() {
        let mut data = vec![7u8; 4];
        assert_eq!(Io::in_place(&mut data).into_in_place(), &[7; 4]);
        let mut dst = vec![0u8; 4];
        assert_eq!(
            Io::copy(&[1, 2, 3, 4], &mut dst).into_in_place(),
            &[1, 2, 3, 4]
        );
    }
}
