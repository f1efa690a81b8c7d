//! `object-end` (the paper's best layout): sector `i`'s ciphertext at `i * sector_size`, the
//! object's packed metadata after all its sectors, sector `i`'s at
//! `sectors_per_object * sector_size + i * metadata_len`. Data stays sector-aligned; a write
//! of a run of sectors is two extents in one operation.

use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{
    place_extents, take_or_place_extents, Decoded, ObjectGeometry, ReadOutput, SectorLayout,
};

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

/// The two write steps of a run whose ciphertext is at `data_offset` and packed metadata at
/// `metadata_offset` (also what `omap-packed` hands its cache).
pub(super) fn write_apart(
    steps: &mut Vec<WriteStep>,
    (data_offset, ciphertext): (u64, Vec<u8>),
    (metadata_offset, metadata): (u64, Vec<u8>),
) {
    steps.push(WriteStep::Write {
        offset: data_offset,
        data: ciphertext,
    });
    steps.push(WriteStep::Write {
        offset: metadata_offset,
        data: metadata,
    });
}

/// The two zeroing steps of `count` sectors laid out as [`write_apart`] writes them.
pub(super) fn discard_apart(
    steps: &mut Vec<WriteStep>,
    geometry: &ObjectGeometry,
    (data_offset, metadata_offset): (u64, u64),
    count: u32,
) {
    steps.push(WriteStep::Zero {
        offset: data_offset,
        len: count as u64 * geometry.sector_size as u64,
    });
    steps.push(WriteStep::Zero {
        offset: metadata_offset,
        len: count as u64 * geometry.metadata_len as u64,
    });
}

impl SectorLayout for ObjectEnd {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        write_apart(
            steps,
            (self.data_offset(first), ciphertext),
            (self.metadata_offset(first), metadata),
        );
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        let offsets = (self.data_offset(first), self.metadata_offset(first));
        discard_apart(steps, &self.0, offsets, count);
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
        ciphertext: &mut ReadOutput<'_>,
        metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        let taken = take_or_place_extents(results.next(), self.data_offset(first), ciphertext)?;
        place_extents(results.next(), self.metadata_offset(first), metadata)?;
        Ok(taken.into())
    }
}
