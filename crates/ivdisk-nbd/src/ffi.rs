//! The crate's one module with `unsafe`: a write's payload received from the socket straight
//! into slots (`readv(2)` into memory not yet initialised), for devices that ask for it
//! ([`ivdisk_image::PayloadPlacement::Slots`]).
//!
//! Why not through tokio's reader: `AsyncRead` has no vectored read, and a safe vectored read
//! (`IoSliceMut`) needs the buffer zeroed first, a pass over the payload as dear as the move
//! of every sector up over the metadata below it that slots are there to spare.

#![allow(unsafe_code)]

use std::mem::MaybeUninit;
use std::os::fd::RawFd;

/// Buffers one `readv` call takes at most (`IOV_MAX` on Linux).
const MAX_READ_PIECES: usize = 1024;
/// Bytes one `readv` call asks for at most. Why: the kernel copies in and checks every
/// buffer of the call, and a socket rarely holds more than its buffer's worth (about 208 KiB
/// by default) at once, so buffers past that are work for nothing.
const MAX_READ_BYTES: usize = 256 << 10;

/// A buffer of slots being filled with a payload: sector `i`'s `sector` bytes go to
/// `i * slot`, the rest of each slot is zeroed when the payload is complete. Until then the
/// buffer's length is 0 and nothing reads what is not yet written.
pub(crate) struct SlotBuffer {
    buf: Vec<u8>,
    sector: usize,
    slot: usize,
    /// Bytes of payload.
    len: usize,
    /// Bytes of payload received so far, in order.
    filled: usize,
}

impl SlotBuffer {
    /// Room for a `len`-byte payload in slots of `slot` bytes, `sector` bytes of it per slot.
    ///
    /// # Panics
    /// If `sector` is 0 or more than `slot`, or `len` is not a multiple of `sector`.
    pub(crate) fn new(len: usize, sector: usize, slot: usize) -> SlotBuffer {
        assert!(
            sector > 0 && sector <= slot && len.is_multiple_of(sector),
            "a {len}-byte payload does not fill slots of {slot} bytes with {sector} each"
        );
        SlotBuffer {
            buf: Vec::with_capacity(len / sector * slot),
            sector,
            slot,
            len,
            filled: 0,
        }
    }

    /// Bytes of payload still to come.
    pub(crate) fn missing(&self) -> usize {
        self.len - self.filled
    }

    /// Where the next bytes of payload go, and how many fit there before the slot's tail.
    fn next_piece(&self) -> (usize, usize) {
        let (i, within) = (self.filled / self.sector, self.filled % self.sector);
        (i * self.slot + within, self.sector - within)
    }

    /// Take payload bytes the caller already has (the reader's buffer), up to what is
    /// missing; returns how many it took.
    pub(crate) fn fill_from(&mut self, bytes: &[u8]) -> usize {
        let take = bytes.len().min(self.missing());
        let mut rest = &bytes[..take];
        while !rest.is_empty() {
            let (at, room) = self.next_piece();
            let n = room.min(rest.len());
            let spare = &mut self.buf.spare_capacity_mut()[at..at + n];
            for (dst, &src) in spare.iter_mut().zip(&rest[..n]) {
                dst.write(src);
            }
            rest = &rest[n..];
            self.filled += n;
        }
        take
    }

    /// One `readv` from `fd` into the next slots (at most [`MAX_READ_PIECES`] of them and
    /// [`MAX_READ_BYTES`] in all);
    /// returns the bytes read (0 at the end of the stream) or the call's error, `WouldBlock`
    /// included, for the caller's readiness loop.
    pub(crate) fn read_from(&mut self, fd: RawFd) -> std::io::Result<usize> {
        let missing = self.missing();
        if missing == 0 {
            return Ok(0);
        }
        let base = self.buf.spare_capacity_mut().as_mut_ptr();
        let (mut at, mut room) = self.next_piece();
        let mut left = missing.min(MAX_READ_BYTES);
        let mut pieces = Vec::with_capacity(left.div_ceil(self.sector).min(MAX_READ_PIECES) + 1);
        while left > 0 && pieces.len() < MAX_READ_PIECES {
            let n = room.min(left);
            pieces.push(libc::iovec {
                // SAFETY: `at + n` is at most the capacity (`next_piece` stays inside the slot of
                // a sector below `len / sector`), so the pointer stays inside the allocation.
                iov_base: unsafe { base.add(at) }.cast(),
                iov_len: n,
            });
            left -= n;
            at = (at / self.slot + 1) * self.slot;
            room = self.sector;
        }
        // SAFETY: every piece lies in the buffer's spare capacity, which `self` borrows
        // mutably for the call, and the pieces do not overlap; `readv` writes at most their
        // lengths and the count is at most `IOV_MAX`.
        let got = unsafe { libc::readv(fd, pieces.as_ptr(), pieces.len() as libc::c_int) };
        if got < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.filled += got as usize;
        Ok(got as usize)
    }

    /// One read from `reader` into the next slot's room (a stream that cannot be read with
    /// `readv`, such as a TLS session, whose reads copy out of its decrypted records anyway);
    /// returns the bytes read (0 at the end of the stream).
    pub(crate) fn poll_read_next<R: tokio::io::AsyncRead + Unpin>(
        &mut self,
        reader: &mut R,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.missing() == 0 {
            return std::task::Poll::Ready(Ok(0));
        }
        let (at, room) = self.next_piece();
        let room = room.min(self.missing());
        let spare = &mut self.buf.spare_capacity_mut()[at..at + room];
        let mut read = tokio::io::ReadBuf::uninit(spare);
        std::task::ready!(std::pin::Pin::new(reader).poll_read(cx, &mut read))?;
        let got = read.filled().len();
        self.filled += got;
        std::task::Poll::Ready(Ok(got))
    }

    /// The buffer of slots, once the whole payload is in: each slot's tail zeroed.
    ///
    /// # Panics
    /// If payload is missing.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        assert_eq!(self.missing(), 0, "the payload is not complete");
        let (sector, slot) = (self.sector, self.slot);
        let total = self.len / sector * slot;
        let spare = &mut self.buf.spare_capacity_mut()[..total];
        for tail in spare.chunks_exact_mut(slot).map(|s| &mut s[sector..]) {
            tail.fill(MaybeUninit::new(0));
        }
        // SAFETY: the first `total` bytes are initialised: every slot's first `sector` bytes
        // by the payload (all of it came in, in order), the rest of it just above; `total` is
        // the capacity asked for in `new`.
        unsafe { self.buf.set_len(total) };
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use super::*;

    /// A payload split across the bytes the caller has and several `readv` calls (the writer
    /// sends it in pieces that end inside sectors) lands in its slots, tails zeroed.
    #[test]
    fn payload_lands_in_its_slots_however_it_arrives() {
        let (sector, slot, sectors) = (512, 544, 2000);
        let payload: Vec<u8> = (0..sector * sectors).map(|i| (i % 251) as u8).collect();
        let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut buf = SlotBuffer::new(payload.len(), sector, slot);
        assert_eq!(buf.fill_from(&payload[..700]), 700);
        let writer = {
            let payload = payload[700..].to_vec();
            std::thread::spawn(move || {
                for piece in payload.chunks(100_003) {
                    tx.write_all(piece).unwrap();
                }
            })
        };
        while buf.missing() > 0 {
            let got = buf.read_from(rx.as_raw_fd()).unwrap();
            assert!(got > 0, "the stream ended early");
        }
        writer.join().unwrap();
        let slots = buf.finish();
        assert_eq!(slots.len(), sectors * slot);
        for (i, s) in slots.chunks_exact(slot).enumerate() {
            assert!(s[..sector] == payload[i * sector..][..sector], "sector {i}");
            assert!(s[sector..].iter().all(|&b| b == 0), "slot {i}'s tail");
        }
    }

    /// Bytes the caller has beyond the payload are left to it.
    #[test]
    fn only_the_payload_is_taken() {
        let mut buf = SlotBuffer::new(8, 4, 6);
        assert_eq!(buf.fill_from(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 8);
        assert_eq!(buf.finish(), [1, 2, 3, 4, 0, 0, 5, 6, 7, 8, 0, 0]);
    }
}
