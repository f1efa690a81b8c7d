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

    /// Bring the input into the output, for code that only works in place: nothing for
    /// `InPlace`, a copy otherwise. Returns the output.
    pub(crate) fn into_in_place(self) -> &'a mut [u8] {
        match self {
            Io::InPlace(data) => data,
            Io::Copy { src, dst } => {
                dst.copy_from_slice(src);
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
    pub(crate) fn chunks(self, len: usize) -> Vec<Io<'a>> {
        let mut out = Vec::with_capacity(self.len().div_ceil(len));
        let mut rest = self;
        while rest.len() > len {
            let (head, tail) = rest.split_at(len);
            out.push(head);
            rest = tail;
        }
        if rest.len() > 0 {
            out.push(rest);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_both_buffers_in_order() {
        let src: Vec<u8> = (0..10).collect();
        let mut dst = vec![0u8; 10];
        let pieces = Io::copy(&src, &mut dst).chunks(4);
        assert_eq!(pieces.iter().map(Io::len).collect::<Vec<_>>(), [4, 4, 2]);
        for mut p in pieces {
            let s = p.src().to_vec();
            p.dst().copy_from_slice(&s);
        }
        assert_eq!(src, dst);
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
