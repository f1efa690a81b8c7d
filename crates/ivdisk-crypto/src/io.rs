//! Where a cipher reads its input and writes its output: one buffer (in place) or two (out of
//! place).
//!
//! Why out of place: the image layer's input is the caller's buffer and its output a fresh
//! buffer for the store (and back on reads). Copying first and then transforming in place is
//! two passes over the data; at AEGIS-128L's speed the copy costs as much as the cipher
//! (measured with `perf` on the image bench: `memcpy` next to the cipher at 1 MiB). The kernels
//! load from `src` and store to `dst`, so both ways are one pass.

/// A run's input and output.
pub(crate) enum Io<'a> {
    /// Read and write the same bytes.
    InPlace(&'a mut [u8]),
    /// Read `src`, write `dst` (same length).
    Copy { src: &'a [u8], dst: &'a mut [u8] },
}

impl<'a> Io<'a> {
    /// Out of place; the caller checked that the lengths match.
    pub(crate) fn copy(src: &'a [u8], dst: &'a mut [u8]) -> Io<'a> {
        debug_assert_eq!(src.len(), dst.len());
        Io::Copy { src, dst }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Io::InPlace(data) => data.len(),
            Io::Copy { dst, .. } => dst.len(),
        }
    }

    /// The input bytes.
    pub(crate) fn src(&self) -> &[u8] {
        match self {
            Io::InPlace(data) => data,
            Io::Copy { src, .. } => src,
        }
    }

    /// The output bytes.
    pub(crate) fn dst(&mut self) -> &mut [u8] {
        match self {
            Io::InPlace(data) => data,
            Io::Copy { dst, .. } => dst,
        }
    }

    /// The input's and the output's first byte (the same address in place), each valid for
    /// `len()` bytes. For SIMD loops: through `src()`/`dst()` the compiler re-reads this enum
    /// after every store (it cannot tell that the store did not change it), which cost the
    /// two-lane AEGIS-128L a third of its speed.
    pub(crate) fn as_ptrs(&mut self) -> (*const u8, *mut u8) {
        match self {
            Io::InPlace(data) => {
                let p = data.as_mut_ptr();
                (p.cast_const(), p)
            }
            Io::Copy { src, dst } => (src.as_ptr(), dst.as_mut_ptr()),
        }
    }

    /// Bring the input into the output, for code that only works in place: nothing for
    /// `InPlace`, a copy otherwise. Returns the output.
    pub(crate) fn into_in_place(self) -> &'a mut [u8] {
        match self {
            Io::InPlace(data) => data,
            Io::Copy { src, dst } => {
                copy_bytes(dst, src);
                dst
            }
        }
    }

    /// Split at `mid` into the two halves' runs.
    pub(crate) fn split_at(self, mid: usize) -> (Io<'a>, Io<'a>) {
        match self {
            Io::InPlace(data) => {
                let (a, b) = data.split_at_mut(mid);
                (Io::InPlace(a), Io::InPlace(b))
            }
            Io::Copy { src, dst } => {
                let (sa, sb) = src.split_at(mid);
                let (da, db) = dst.split_at_mut(mid);
                (Io::Copy { src: sa, dst: da }, Io::Copy { src: sb, dst: db })
            }
        }
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

/// Copy `src` into `dst` (same length), without the stall some CPUs have on one pattern.
///
/// Why not just `copy_from_slice`: glibc copies 4 KiB with `rep movsb` on CPUs without AVX-512,
/// and on an AMD EPYC (Zen 4) `rep movsb` ran at about 2 GB/s instead of 50-80 when the
/// destination lay 1-31 bytes past the source modulo 4 KiB: the loads wait for stores whose
/// low 12 address bits match ("4K aliasing"; docs/BENCHMARKS.md, issue 2). Two 4 KiB buffers
/// allocated one after the other are 4112 bytes apart, 16 modulo 4 KiB, so a decrypting read
/// meets this. Pieces of 1 KiB stay below every `rep movsb` threshold of glibc and go through
/// its vector loop, which does not stall (50+ GB/s at every distance, measured).
pub(crate) fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    const PIECE: usize = 1024;
    let distance = (dst.as_ptr() as usize).wrapping_sub(src.as_ptr() as usize) % 4096;
    if src.len() > PIECE && (1..64).contains(&distance) {
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
    } else {
        dst.copy_from_slice(src);
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
            let s = p.src().to_vec();
            p.dst().copy_from_slice(&s);
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
    fn into_in_place_copies_only_when_out_of_place() {
        let mut data = vec![7u8; 4];
        assert_eq!(Io::InPlace(&mut data).into_in_place(), &[7; 4]);
        let mut dst = vec![0u8; 4];
        assert_eq!(
            Io::copy(&[1, 2, 3, 4], &mut dst).into_in_place(),
            &[1, 2, 3, 4]
        );
    }
}
