//! `unaligned`: sector `i` occupies the slot `[i * (S + M), (i + 1) * (S + M))`, its
//! ciphertext first and its metadata right after. One extent per run of sectors, but data is
//! no longer sector-aligned in the object (the paper measures what that costs on RADOS).

use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{extent_bytes, ObjectGeometry, SectorLayout};

#[derive(Debug)]
pub(crate) struct Unaligned(pub ObjectGeometry);

impl Unaligned {
    fn slot(&self) -> usize {
        self.0.sector_size + self.0.metadata_len
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
        let (ss, ml) = (self.0.sector_size, self.0.metadata_len);
        let mut slots = Vec::with_capacity(ciphertext.len() + metadata.len());
        for (sector, meta) in ciphertext.chunks_exact(ss).zip(metadata.chunks_exact(ml)) {
            slots.extend_from_slice(sector);
            slots.extend_from_slice(meta);
        }
        steps.push(WriteStep::Write {
            offset: first as u64 * self.slot() as u64,
            data: slots,
        });
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
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<Option<Vec<u8>>, String> {
        let (ss, ml) = (self.0.sector_size, self.0.metadata_len);
        // Sector and metadata interleave, so the ciphertext is copied out either way; only
        // the store's buffer is used as it is when one extent holds the run.
        let slots = extent_bytes(
            results.next(),
            first as u64 * self.slot() as u64,
            count as usize * self.slot(),
        )?;
        for ((slot, sector), meta) in slots
            .chunks_exact(self.slot())
            .zip(ciphertext.chunks_exact_mut(ss))
            .zip(metadata.chunks_exact_mut(ml))
        {
            sector.copy_from_slice(&slot[..ss]);
            meta.copy_from_slice(&slot[ss..]);
        }
        Ok(None)
    }
}
