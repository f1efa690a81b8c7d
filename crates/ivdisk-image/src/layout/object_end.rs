//! `object-end` (the paper's best layout): sector `i`'s ciphertext at `i * sector_size`, the
//! object's packed metadata after all its sectors, sector `i`'s at
//! `sectors_per_object * sector_size + i * metadata_len`. Data stays sector-aligned; a write
//! of a run of sectors is two extents in one operation.

use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{place_extents, take_or_place_extents, Decoded, ObjectGeometry, SectorLayout};

#[derive(Debug)]
pub(crate) struct ObjectEnd(pub ObjectGeometry);

impl ObjectEnd {
    fn data_offset(&self, sector: u32) -> u64 {
        sector as u64 * self.0.sector_size as u64
    }
    fn metadata_offset(&self, sector: u32) -> u64 {
        self.0.sectors_per_object as u64 * self.0.sector_size as u64
            + sector as u64 * self.0.metadata_len as u64
    }
}

impl SectorLayout for ObjectEnd {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        steps.push(WriteStep::Write {
            offset: self.data_offset(first),
            data: ciphertext,
        });
        steps.push(WriteStep::Write {
            offset: self.metadata_offset(first),
            data: metadata,
        });
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        steps.push(WriteStep::Zero {
            offset: self.data_offset(first),
            len: count as u64 * self.0.sector_size as u64,
        });
        steps.push(WriteStep::Zero {
            offset: self.metadata_offset(first),
            len: count as u64 * self.0.metadata_len as u64,
        });
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        steps.push(ReadStep::Read {
            offset: self.data_offset(first),
            len: count as u64 * self.0.sector_size as u64,
        });
        steps.push(ReadStep::Read {
            offset: self.metadata_offset(first),
            len: count as u64 * self.0.metadata_len as u64,
        });
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        _count: u32,
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        let taken = take_or_place_extents(results.next(), self.data_offset(first), ciphertext)?;
        place_extents(results.next(), self.metadata_offset(first), metadata)?;
        Ok(taken.into())
    }
}
