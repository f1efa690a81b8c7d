//! A write's plaintext as the NBD server receives it: one run of bytes, or, for an
//! `unaligned` run, each sector at the start of its slot, where it is encrypted in place.

/// Where a receiver should put the bytes of a write's payload ([`crate::Image::write_placement`])
/// before handing them over ([`crate::Image::write_payload`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadPlacement {
    /// One run of bytes, in a buffer with `spare` bytes of capacity past them (`omap-tail`
    /// appends a whole object's metadata to its data).
    Contiguous { spare: usize },
    /// Sector `i`'s `sector` bytes at `i * slot` in a buffer of `slot` bytes per sector; the
    /// rest of each slot is the image's (what it holds does not matter).
    Slots { sector: usize, slot: usize },
}

/// The plaintext of a write handed over to the image ([`crate::Image::write_payload`]):
/// together in one buffer, or one sector at the start of every slot of a buffer of slots.
///
/// Why slots: an `unaligned` run is stored as slots (each sector's ciphertext, then its
/// metadata). Received straight into them (one vectored read from the socket), each sector
/// is encrypted where it lies; received together, every sector had to move up over the
/// metadata of the sectors below it, which cost AEGIS-128L a quarter to a third of its
/// cipher's time per 1 MiB write (docs/BENCHMARKS.md).
pub struct WritePayload {
    buf: Vec<u8>,
    /// Bytes of plaintext per slot and bytes per slot, when `buf` holds slots.
    slots: Option<(usize, usize)>,
}

/// The shape only: a payload holds plaintext, which has no place in logs.
impl std::fmt::Debug for WritePayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WritePayload")
            .field("len", &self.len())
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl WritePayload {
    /// `buf` as it is: the plaintext, together.
    pub fn contiguous(buf: Vec<u8>) -> WritePayload {
        WritePayload { buf, slots: None }
    }

    /// A buffer of whole slots of `slot` bytes, the first `sector` bytes of each plaintext.
    ///
    /// # Panics
    /// If `sector` is 0 or more than `slot`, or `buf` is not a whole number of slots.
    pub fn in_slots(buf: Vec<u8>, sector: usize, slot: usize) -> WritePayload {
        assert!(
            sector > 0 && sector <= slot && buf.len().is_multiple_of(slot),
            "{} bytes are not slots of {slot} bytes with {sector} of plaintext each",
            buf.len()
        );
        WritePayload {
            buf,
            slots: Some((sector, slot)),
        }
    }

    /// Bytes of plaintext.
    pub fn len(&self) -> usize {
        match self.slots {
            None => self.buf.len(),
            Some((sector, slot)) => self.buf.len() / slot * sector,
        }
    }

    /// Whether the payload has no plaintext.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of plaintext per slot and bytes per slot, when the payload is in slots.
    pub fn slots(&self) -> Option<(usize, usize)> {
        self.slots
    }

    /// The buffer as it was handed over (slots and all).
    pub fn into_buf(self) -> Vec<u8> {
        self.buf
    }

    /// The plaintext in one buffer: the buffer itself when it is together, else a copy.
    pub fn into_contiguous(self) -> Vec<u8> {
        match self.slots {
            None => self.buf,
            Some((sector, slot)) => self
                .buf
                .chunks_exact(slot)
                .flat_map(|s| &s[..sector])
                .copied()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_give_their_sectors_in_order() {
        let slots: Vec<u8> = (0..3u8).flat_map(|i| [i, i, i, 0xee]).collect();
        let payload = WritePayload::in_slots(slots, 3, 4);
        assert_eq!(payload.len(), 9);
        assert_eq!(payload.slots(), Some((3, 4)));
        assert_eq!(payload.into_contiguous(), [0, 0, 0, 1, 1, 1, 2, 2, 2]);
        let together = WritePayload::contiguous(vec![5; 7]);
        assert_eq!((together.len(), together.slots()), (7, None));
        assert_eq!(together.into_contiguous(), [5; 7]);
    }

    #[test]
    #[should_panic(expected = "not slots")]
    fn a_partial_slot_is_refused() {
        WritePayload::in_slots(vec![0; 10], 3, 4);
    }
}
