//! `unaligned`: sector `i` occupies the slot `[i * (S + M), (i + 1) * (S + M))`, its
//! ciphertext first and its metadata right after. One extent per run of sectors, but data is
//! no longer sector-aligned in the object (the paper measures what that costs on RADOS).

use ivdisk_crypto::{CryptoError, SectorCipher};
use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{extent_bytes, Decoded, ObjectGeometry, ReadOutput, SectorLayout};

#[derive(Debug)]
pub(crate) struct Unaligned(pub ObjectGeometry);

/// Runs of at least this many bytes handed over by the caller are spread into slots in the
/// caller's buffer ([`SectorLayout::write_encrypted_owned`]); smaller ones go into a fresh
/// buffer, which the allocator hands out warm at these sizes.
const IN_PLACE_MIN_BYTES: usize = 512 << 10;
/// Sectors encrypted at once before they move up to their slots: small enough to stay in the
/// core's cache between the two.
const IN_PLACE_GROUP_BYTES: usize = 32 << 10;
/// Sectors encrypted straight into their slots at once are a multiple of this: AEGIS-128L's
/// four-lane kernel takes four; fewer went through its one-message code, which made 1 MiB
/// writes slower than encrypting in place and moving (docs/BENCHMARKS.md, "`unaligned`
/// writes straight into their slots").
pub(crate) const DIRECT_GROUP: usize = 4;

impl Unaligned {
    fn slot(&self) -> usize {
        self.0.sector_size + self.0.metadata_len
    }

    /// Append each sector of `ciphertext` and then its metadata to `slots`.
    fn interleave(&self, slots: &mut Vec<u8>, ciphertext: &[u8], metadata: &[u8]) {
        let (ss, ml) = (self.0.sector_size, self.0.metadata_len);
        for (sector, meta) in ciphertext.chunks_exact(ss).zip(metadata.chunks_exact(ml)) {
            slots.extend_from_slice(sector);
            slots.extend_from_slice(meta);
        }
    }

    fn store_slots(&self, steps: &mut Vec<WriteStep>, first: u32, slots: Vec<u8>) {
        steps.push(WriteStep::Write {
            offset: first as u64 * self.slot() as u64,
            data: slots,
        });
    }
}

impl SectorLayout for Unaligned {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        let mut slots = Vec::with_capacity(ciphertext.len() + metadata.len());
        self.interleave(&mut slots, &ciphertext, &metadata);
        self.store_slots(steps, first, slots);
    }

    /// Straight into the slots (`encrypt_sectors_append_slots`: AEGIS-128L writes each
    /// sector's ciphertext and metadata at its slot; the other suites encrypt 32 KiB pieces
    /// and copy each into its slots while it is in the cache). Encrypting the whole run and
    /// then interleaving it was a copy of the run on top of the cipher's pass.
    fn write_encrypted(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        plaintext: &[u8],
    ) -> Result<(), CryptoError> {
        let sectors = plaintext.len() / self.0.sector_size;
        let mut slots = Vec::with_capacity(sectors * self.slot());
        cipher.encrypt_sectors_append_slots(first_sector, plaintext, &mut slots)?;
        self.store_slots(steps, first, slots);
        Ok(())
    }

    /// A large run is encrypted in the caller's buffer and spread into slots there, when the
    /// buffer has the room ([`SectorLayout::data_headroom`], which the NBD server asks for
    /// before it reads a payload): from the last sectors to the first, a few at a time. A
    /// group of four sectors whose slots lie wholly past its plaintext (the upper half of a
    /// 4 MiB run of 4 KiB sectors) is encrypted straight into them (`encrypt_sectors_to_slots`);
    /// below that, each group is encrypted in place and then moved up to its slots while it
    /// is in the cache. Either way nothing written reaches plaintext not yet encrypted
    /// (sector `i` moves up by `i * M` bytes, onto bytes of its own and of sectors already
    /// moved). The move had cost AEGIS-128L 25-33 points of the cipher's cost from 512 KiB
    /// up (docs/BENCHMARKS.md, "`unaligned` writes straight into their slots"). The slots in
    /// a second buffer of the run's size, as for smaller runs, made a 4 MiB write through the
    /// server cost 4-6 times the cipher: two buffers of that size per write no longer stay in
    /// the cache (docs/BENCHMARKS.md, "`unaligned` writes spread into slots in the payload").
    fn write_encrypted_owned(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        mut buf: Vec<u8>,
    ) -> Result<(), CryptoError> {
        let (ss, ml, slot) = (self.0.sector_size, self.0.metadata_len, self.slot());
        let sectors = buf.len() / ss;
        if self.data_headroom(first, sectors as u32) == 0 || buf.capacity() < sectors * slot {
            return self.write_encrypted(steps, first, cipher, first_sector, &buf);
        }
        // Sized once; the growth is the headroom, so nothing moves.
        buf.resize(sectors * slot, 0);
        let group = (IN_PLACE_GROUP_BYTES / ss).max(1);
        let mut metadata = vec![0u8; group * ml];
        let mut end = sectors;
        while end > 0 {
            // The sectors from `start` to `end` have their slots wholly past their plaintext
            // once `start * slot >= end * ss`: those are encrypted straight into their slots,
            // no move, four at a time or more (with 32 bytes of metadata per 4 KiB sector, from
            // sector 512 on).
            let direct = (end - (end * ss).div_ceil(slot)) / DIRECT_GROUP * DIRECT_GROUP;
            if direct > 0 {
                let start = end - direct;
                let (plaintext, slots) = buf.split_at_mut(start * slot);
                cipher.encrypt_sectors_to_slots(
                    first_sector + start as u64,
                    &plaintext[start * ss..end * ss],
                    &mut slots[..(end - start) * slot],
                )?;
                end = start;
                continue;
            }
            let start = end.saturating_sub(group);
            let meta = &mut metadata[..(end - start) * ml];
            cipher.encrypt_sectors(
                first_sector + start as u64,
                &mut buf[start * ss..end * ss],
                meta,
            )?;
            for (i, m) in (start..end).zip(meta.chunks_exact(ml)).rev() {
                buf.copy_within(i * ss..(i + 1) * ss, i * slot);
                buf[i * slot + ss..(i + 1) * slot].copy_from_slice(m);
            }
            end = start;
        }
        self.store_slots(steps, first, buf);
        Ok(())
    }

    /// Room for the slots' metadata, for runs spread into slots in the caller's buffer.
    fn data_headroom(&self, _first: u32, count: u32) -> usize {
        let bytes = count as usize * self.0.sector_size;
        if bytes >= IN_PLACE_MIN_BYTES {
            count as usize * self.0.metadata_len
        } else {
            0
        }
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        steps.push(WriteStep::Zero {
            offset: first as u64 * self.slot() as u64,
            len: count as u64 * self.slot() as u64,
        });
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        steps.push(ReadStep::Read {
            offset: first as u64 * self.slot() as u64,
            len: count as u64 * self.slot() as u64,
        });
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        count: u32,
        _ciphertext: &mut ReadOutput<'_>,
        _metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        // The slots as they are: the caller decrypts from them (`decrypt_sectors_from_slots`),
        // with no copy to take sectors and metadata apart. The store's buffer when one extent
        // holds the run.
        let slots = extent_bytes(
            results.next(),
            first as u64 * self.slot() as u64,
            count as usize * self.slot(),
        )?;
        Ok(Decoded::Slots(slots))
    }
}

#[cfg(test)]
mod tests {
    use ivdisk_crypto::{
        insecure_cipher_with_sector_number_nonces, CipherParams, ImageId, Suite, VolumeKey,
    };

    use super::*;

    /// A cipher whose nonces follow the sector numbers, so that runs encrypted in different
    /// ways can be compared byte for byte, and the layout for its suite.
    fn cipher_and_layout(
        suite: Suite,
        sector_size: usize,
        sectors_per_object: u32,
    ) -> (Box<dyn SectorCipher>, Unaligned) {
        let key = VolumeKey::new((0..suite.default_key_len() as u8).collect());
        let params = CipherParams::new(sector_size, ImageId([7; 16]));
        let cipher = insecure_cipher_with_sector_number_nonces(suite, &key, &params).unwrap();
        let layout = Unaligned(ObjectGeometry {
            sector_size,
            metadata_len: suite.metadata_len(),
            nonce_len: suite.counted_nonce_len(),
            sectors_per_object,
        });
        (cipher, layout)
    }

    /// Encrypting piece by piece into the slots stores exactly what encrypting the whole run
    /// and interleaving it does (nonces fixed per sector so the two can be compared), for runs
    /// shorter than a piece, of several pieces and ending inside one.
    #[test]
    fn piecewise_slots_equal_the_whole_run_interleaved() {
        for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
            for sector_size in [512, 4096] {
                let (cipher, layout) = cipher_and_layout(suite, sector_size, 1024);
                for sectors in [1, 3, 8, 9, 70, 131] {
                    let plaintext: Vec<u8> = (0..sectors * sector_size)
                        .map(|i| (i * 31 % 251) as u8)
                        .collect();
                    let mut piecewise = Vec::new();
                    layout
                        .write_encrypted(&mut piecewise, 5, &*cipher, 1000, &plaintext)
                        .unwrap();
                    let mut ciphertext = plaintext.clone();
                    let mut metadata = vec![0u8; sectors * suite.metadata_len()];
                    cipher
                        .encrypt_sectors(1000, &mut ciphertext, &mut metadata)
                        .unwrap();
                    let mut whole = Vec::new();
                    layout.write(&mut whole, 5, ciphertext, metadata);
                    assert!(
                        piecewise == whole,
                        "{suite}, {sector_size}-byte sectors, {sectors} sectors"
                    );
                }
            }
        }
    }

    /// A run handed over with the headroom is spread into slots in its own buffer (the
    /// buffer is not moved) and stores exactly what encrypting the whole run and
    /// interleaving it does: runs of one group, of several, ending inside one, for every
    /// suite with metadata. Without the headroom, and below the size for it, the fresh
    /// buffer's way stores the same.
    #[test]
    fn slots_spread_in_the_callers_buffer_equal_the_whole_run_interleaved() {
        for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
            for sector_size in [512, 4096] {
                let ml = suite.metadata_len();
                let (cipher, layout) =
                    cipher_and_layout(suite, sector_size, (4 << 20) / sector_size as u32);
                let min = IN_PLACE_MIN_BYTES / sector_size;
                let group = IN_PLACE_GROUP_BYTES / sector_size;
                let object = (4 << 20) / sector_size;
                for sectors in [1, min - 1, min, min + 3, min + group * 2 + 5, object] {
                    let case = format!("{suite}, {sector_size}-byte sectors, {sectors} sectors");
                    let plaintext: Vec<u8> = (0..sectors * sector_size)
                        .map(|i| (i * 31 % 251) as u8)
                        .collect();
                    let mut ciphertext = plaintext.clone();
                    let mut metadata = vec![0u8; sectors * ml];
                    cipher
                        .encrypt_sectors(1000, &mut ciphertext, &mut metadata)
                        .unwrap();
                    let mut whole = Vec::new();
                    layout.write(&mut whole, 5, ciphertext, metadata);

                    let room = layout.data_headroom(5, sectors as u32);
                    assert_eq!(
                        room,
                        if sectors >= min { sectors * ml } else { 0 },
                        "{case}"
                    );
                    let mut handed = Vec::with_capacity(plaintext.len() + room);
                    handed.extend_from_slice(&plaintext);
                    let at = handed.as_ptr();
                    let mut spread = Vec::new();
                    layout
                        .write_encrypted_owned(&mut spread, 5, &*cipher, 1000, handed)
                        .unwrap();
                    assert!(spread == whole, "{case}, with the headroom");
                    if room > 0 {
                        let WriteStep::Write { data, .. } = &spread[0] else {
                            panic!("{case}: not a write step");
                        };
                        assert_eq!(data.as_ptr(), at, "{case}: the slots moved to a new buffer");
                    }

                    let mut tight = plaintext.clone();
                    tight.shrink_to_fit();
                    let mut fresh = Vec::new();
                    layout
                        .write_encrypted_owned(&mut fresh, 5, &*cipher, 1000, tight)
                        .unwrap();
                    assert!(fresh == whole, "{case}, without the headroom");
                }
            }
        }
    }
}
