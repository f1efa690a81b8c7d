//! `none`: ciphertext at the sector's own offset, no metadata. Byte-compatible with the data
//! of LUKS2 volumes and librbd's encrypted images (for `aes-xts-plain64`).

use ivdisk_store::{ReadResult, ReadStep, WriteStep};

use super::{take_or_place_extents, Decoded, ObjectGeometry, ReadOutput, SectorLayout};

#[derive(Debug)]
pub(crate) struct NoMetadata(pub ObjectGeometry);

impl SectorLayout for NoMetadata {
    fn write(&self, steps: &mut Vec<WriteStep>, first: u32, ciphertext: Vec<u8>, _: Vec<u8>) {
        let offset = first as u64 * self.0.sector_size as u64;
        steps.push(WriteStep::Write {
            offset,
            data: ciphertext,
        });
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(WriteStep::Zero {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(ReadStep::Read {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        _count: u32,
        ciphertext: &mut ReadOutput<'_>,
        _metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        take_or_place_extents(
            results.next(),
            first as u64 * self.0.sector_size as u64,
            ciphertext,
        )
        .map(Decoded::from)
    }
}
