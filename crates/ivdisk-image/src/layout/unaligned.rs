//! `unaligned`: sector `i` occupies the slot `[i * (S + M), (i + 1) * (S + M))`, its
//! ciphertext first and its metadata right after. One extent per run of sectors, but data is
//! no longer sector-aligned in the object (the paper measures what that costs on RADOS).

use ivdisk_crypto::{CryptoError, SectorCipher};
use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{extent_bytes, Decoded, ObjectGeometry, ReadOutput, SectorLayout};
use crate::PayloadPlacement;

#[derive(Debug)]
pub(crate) struct Unaligned(pub ObjectGeometry);

/// Sectors decrypted straight out of their slots at once (large reads, `Inner::decrypt_slots_down`)
/// are a multiple of this: AEGIS-128L's four-lane kernel takes four; fewer went through its
/// one-message code, which made 1 MiB writes slower than encrypting in place and moving when
/// writes did the same (docs/BENCHMARKS.md, "`unaligned` writes straight into their slots").
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

    /// The NBD server receives a write's payload straight into its slots: no second buffer,
    /// and no move of each sector up over the metadata below it after encrypting it, which
    /// cost AEGIS-128L 25-33 points of its cipher's time from 512 KiB up (docs/BENCHMARKS.md,
    /// "`unaligned` writes received into their slots").
    fn payload_placement(&self, _first: u32, _count: u32) -> PayloadPlacement {
        PayloadPlacement::Slots {
            sector: self.0.sector_size,
            slot: self.slot(),
        }
    }

    /// Each sector encrypted where it lies, its metadata written after it: the buffer is
    /// the object's extent as it is.
    fn write_encrypted_in_slots(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        mut slots: Vec<u8>,
    ) -> Result<(), CryptoError> {
        cipher.encrypt_sectors_in_slots(first_sector, &mut slots)?;
        self.store_slots(steps, first, slots);
        Ok(())
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

    /// Slots received with the plaintext at the start of each (anything in the slots'
    /// tails) store exactly what encrypting the whole run and interleaving it does, in the
    /// buffer handed over (not moved), for every suite with metadata.
    #[test]
    fn slots_encrypted_in_place_equal_the_whole_run_interleaved() {
        for suite in Suite::ALL.into_iter().filter(|s| s.metadata_len() > 0) {
            for sector_size in [512, 4096] {
                let ml = suite.metadata_len();
                let (cipher, layout) =
                    cipher_and_layout(suite, sector_size, (4 << 20) / sector_size as u32);
                assert_eq!(
                    layout.payload_placement(5, 3),
                    PayloadPlacement::Slots {
                        sector: sector_size,
                        slot: sector_size + ml
                    }
                );
                for sectors in [1, 3, 4, 9, 256, (4 << 20) / sector_size] {
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

                    let received: Vec<u8> = plaintext
                        .chunks_exact(sector_size)
                        .flat_map(|s| s.iter().copied().chain(std::iter::repeat_n(0x77, ml)))
                        .collect();
                    let at = received.as_ptr();
                    let mut steps = Vec::new();
                    layout
                        .write_encrypted_in_slots(&mut steps, 5, &*cipher, 1000, received)
                        .unwrap();
                    assert!(steps == whole, "{case}");
                    let WriteStep::Write { data, .. } = &steps[0] else {
                        panic!("{case}: not a write step");
                    };
                    assert_eq!(data.as_ptr(), at, "{case}: the slots moved to a new buffer");
                }
            }
        }
    }
}
