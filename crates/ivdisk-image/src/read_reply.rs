//! A read's plaintext as the NBD server sends it: one buffer, or the store's buffer of an
//! `unaligned` run with each sector's plaintext in its slot, which goes out in one vectored
//! write.

/// The plaintext of a read ([`crate::Image::read_reply`]), `len` bytes: together in one
/// buffer, or one sector at the start of every slot of a buffer of slots (each sector's
/// plaintext, then its metadata), in the order of the sectors.
///
/// Why slots: an `unaligned` run comes from the store as slots. Decrypting each sector where
/// it lies and sending the sectors from there (one `writev`) spares a second buffer or the
/// move of every sector down over the metadata below it, which cost AEGIS-128L a third to a
/// half of a 1-4 MiB read (docs/BENCHMARKS.md).
pub struct ReadReply {
    buf: Vec<u8>,
    len: usize,
    /// Bytes of plaintext per slot and bytes per slot, when `buf` holds slots.
    slots: Option<(usize, usize)>,
}

/// The shape only: a reply holds plaintext, which has no place in logs.
impl std::fmt::Debug for ReadReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadReply")
            .field("len", &self.len)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl ReadReply {
    /// `buf` as it is: the plaintext, together.
    pub fn contiguous(buf: Vec<u8>) -> ReadReply {
        ReadReply {
            len: buf.len(),
            buf,
            slots: None,
        }
    }

    /// `len` bytes of plaintext in `buf`, `sector` bytes at the start of each `slot` bytes.
    ///
    /// # Panics
    /// If `len` is not a multiple of `sector`, `sector` is 0 or more than `slot`, or `buf`
    /// is shorter than the slots that hold `len` bytes.
    pub fn in_slots(buf: Vec<u8>, len: usize, sector: usize, slot: usize) -> ReadReply {
        assert!(
            sector > 0
                && sector <= slot
                && len.is_multiple_of(sector)
                && buf.len() >= len / sector * slot,
            "{len} bytes in slots of {slot} bytes, {sector} per slot, do not fit {} bytes",
            buf.len()
        );
        ReadReply {
            buf,
            len,
            slots: Some((sector, slot)),
        }
    }

    /// Bytes of plaintext.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The plaintext, in order, as the pieces it lies in: one, or one per sector.
    pub fn pieces(&self) -> impl ExactSizeIterator<Item = &[u8]> + '_ {
        let (piece, stride) = self.slots.unwrap_or((self.len.max(1), self.len.max(1)));
        let count = self.len.div_ceil(piece);
        self.buf
            .chunks(stride)
            .take(count)
            .map(move |chunk| &chunk[..piece.min(chunk.len())])
    }

    /// The plaintext in one buffer (slots moved together: a pass over the data).
    pub fn into_vec(self) -> Vec<u8> {
        let mut buf = self.buf;
        if let Some((sector, slot)) = self.slots {
            for i in 1..self.len / sector {
                buf.copy_within(i * slot..i * slot + sector, i * sector);
            }
        }
        buf.truncate(self.len);
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_and_vec_are_the_plaintext_in_order() {
        let plaintext: Vec<u8> = (0..12u8).collect();
        // Sectors of 4 bytes in slots of 6: the last two bytes of each slot are metadata.
        let mut slots = Vec::new();
        for sector in plaintext.chunks(4) {
            slots.extend_from_slice(sector);
            slots.extend_from_slice(&[0xee, 0xee]);
        }
        let reply = ReadReply::in_slots(slots, 12, 4, 6);
        assert_eq!(reply.len(), 12);
        assert_eq!(reply.pieces().len(), 3);
        assert_eq!(
            reply.pieces().flatten().copied().collect::<Vec<_>>(),
            plaintext
        );
        assert_eq!(reply.into_vec(), plaintext);

        let reply = ReadReply::contiguous(plaintext.clone());
        assert_eq!(reply.pieces().len(), 1);
        assert_eq!(
            reply.pieces().flatten().copied().collect::<Vec<_>>(),
            plaintext
        );
        assert_eq!(reply.into_vec(), plaintext);

        let empty = ReadReply::contiguous(Vec::new());
        assert!(empty.is_empty());
        assert_eq!(empty.pieces().len(), 0);
    }
}
