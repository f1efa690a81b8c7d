//! `omap`: ciphertext at the sector's own offset, metadata as the value of omap key
//! `{index:08x}` (fixed-width hex: sorts in sector order, and holds no NUL byte, which
//! librados' C API cannot start a range at).

use ivdisk_store::{OmapPairs, ReadResult, ReadStep, WriteStep};

use super::{
    take_or_place_extents, Decoded, ObjectGeometry, ReadOutput, SectorLayout, DAMAGED_METADATA,
};

/// The most keys one read step asks for (the OSD's default `osd_max_omap_entries_per_request`).
const MAX_KEYS_PER_STEP: u32 = 1024;
/// Keys of no sector (another tool's) a range read lists past, beyond the range's own.
const FOREIGN_KEYS_TOLERATED: usize = 16;

#[derive(Debug)]
pub(crate) struct Omap(pub ObjectGeometry);

/// `{index:08x}`, written out: through `format!` the key was a quarter of the engine's own
/// time in writes of 1 MiB (256 keys each). (All eight digits at once in a `u64` measured
/// no different, docs/BENCHMARKS.md.)
pub(super) fn key_digits(index: u32) -> [u8; 8] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    std::array::from_fn(|i| HEX[(index >> (4 * (7 - i))) as usize & 15])
}

pub(super) fn key(index: u32) -> Vec<u8> {
    key_digits(index).to_vec()
}

/// The sector index of a key written by [`key`] (lowercase only), read out by hand as
/// [`key`] writes it: `from_utf8` and `from_str_radix` per key showed in 1 MiB reads.
pub(super) fn index_of(key: &[u8]) -> Option<u32> {
    let digits: &[u8; 8] = key.try_into().ok()?;
    digits.iter().try_fold(0u32, |index, &d| {
        let value = match d {
            b'0'..=b'9' => d - b'0',
            b'a'..=b'f' => d - b'a' + 10,
            _ => return None,
        };
        Some(index << 4 | u32::from(value))
    })
}

impl SectorLayout for Omap {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        steps.push(WriteStep::Write {
            offset: first as u64 * self.0.sector_size as u64,
            data: ciphertext,
        });
        // One buffer for all the keys and values (`OmapPairs`), not two per sector.
        let ml = self.0.metadata_len;
        let sectors = metadata.len() / ml;
        let mut pairs = OmapPairs::with_capacity(sectors, sectors * (8 + ml));
        for (i, meta) in metadata.chunks_exact(ml).enumerate() {
            pairs.push(&key_digits(first + i as u32), meta);
        }
        steps.push(WriteStep::OmapSet(pairs));
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(WriteStep::Zero {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
        steps.push(WriteStep::OmapRemoveRange {
            start: key(first),
            end: key(first + count),
        });
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(ReadStep::Read {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
        let mut at = first;
        while at < first + count {
            let n = (first + count - at).min(MAX_KEYS_PER_STEP);
            // A few more than the range's keys: keys of no sector that sort inside it take
            // places in the listing and would cut the last of ours.
            steps.push(ReadStep::OmapGetRange {
                start: key(at),
                end: Some(key(at + n)),
                max: n as usize + FOREIGN_KEYS_TOLERATED,
            });
            at += n;
        }
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        count: u32,
        ciphertext: &mut ReadOutput<'_>,
        metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        let ml = self.0.metadata_len;
        let taken = take_or_place_extents(
            results.next(),
            first as u64 * self.0.sector_size as u64,
            ciphertext,
        )?;
        let steps = count.div_ceil(MAX_KEYS_PER_STEP);
        for step in 0..steps {
            let Some(ReadResult::Omap { pairs, more }) = results.next() else {
                return Err("expected the pairs of an omap range read".into());
            };
            // A store may list fewer pairs than asked and say `more` (a Ceph OSD lists at most
            // `osd_max_omap_entries_per_request`). The sectors past the cut would read with
            // zero metadata: failing authentication, or for `aes-xts-random` decrypting to
            // garbage taken for data. The whole range has `asked` keys at most, so a short
            // listing with `more` is known to be incomplete.
            let asked = (count - step * MAX_KEYS_PER_STEP).min(MAX_KEYS_PER_STEP) as usize;
            let mut ours = 0;
            for (k, value) in &pairs {
                // A key that is no sector's (another tool's, `0000000A`) is no metadata: left
                // out, it fails no sector. It failed the whole read, every sector of it.
                let Some(index) = index_of(k) else {
                    tracing::debug!(key = ?String::from_utf8_lossy(k), "omap key of no sector");
                    continue;
                };
                if !(first..first + count).contains(&index) {
                    return Err(format!(
                        "unexpected omap key {:?}",
                        String::from_utf8_lossy(k)
                    ));
                }
                ours += 1;
                let at = (index - first) as usize * ml;
                match value.len() == ml {
                    true => metadata[at..at + ml].copy_from_slice(value),
                    // Damaged: the sector fails authentication.
                    false => metadata[at..at + ml].fill(DAMAGED_METADATA),
                }
            }
            // Checked after: keys of no sector count toward what the store lists.
            if more && ours < asked {
                return Err(format!(
                    "the store listed {ours} of up to {asked} metadata keys in one read and has \
                     more: the `omap` layout reads up to {MAX_KEYS_PER_STEP} keys at once (on \
                     Ceph, set `osd_max_omap_entries_per_request` to at least \
                     {MAX_KEYS_PER_STEP}; and remove omap keys other tools put on data objects)"
                ));
            }
        }
        Ok(taken.into())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_eight_hex_digits_and_parse_back() {
        // Every digit value at every position, and a spread of indexes between.
        let mut indexes = vec![0, 1, 0xa, 0xff, 0x0123_4567, 0xfedc_ba98, u32::MAX];
        for digit in 0..16u32 {
            indexes.push(digit * 0x1111_1111);
            indexes.extend((0..8).map(|at| digit << (4 * at)));
        }
        indexes.extend((0..100_000u32).map(|i| i.wrapping_mul(0x9e37_79b9)));
        for index in indexes {
            let key = super::key(index);
            assert_eq!(key, format!("{index:08x}").into_bytes());
            assert_eq!(super::index_of(&key), Some(index));
        }
        // Anything else is no key of ours.
        for other in [
            &b"0000000"[..],
            b"000000000",
            b"0000000A",
            b"0000000g",
            b"+0000001",
            b"",
        ] {
            assert_eq!(super::index_of(other), None, "{other:?}");
        }
    }
}
