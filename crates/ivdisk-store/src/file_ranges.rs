//! Where a file holds data, as the file system knows it (`SEEK_DATA`/`SEEK_HOLE`): the local
//! store's reclaim after a crash punches only those parts of dead ranges, and `ivdisk import`
//! and `convert` read only those parts of a sparse source file; and where a buffer holds data
//! (not only zeros), so that only those parts are written.

use std::fs::File;

/// Whether every byte is zero.
pub fn all_zero(bytes: &[u8]) -> bool {
    // 16 bytes at a time: data chunks differ from zero in their first bytes almost always,
    // zero chunks are scanned at memory speed.
    let mut chunks = bytes.chunks_exact(16);
    chunks
        .by_ref()
        .all(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")) == 0)
        && chunks.remainder().iter().all(|&b| b == 0)
}

/// The runs of `bytes` that hold a non-zero byte, in whole units of `unit` bytes (the last
/// one may be shorter), as (start, length). Only these are written: an unwritten sector of an
/// image reads as zeros, as does a hole of a file, and a chunk with one byte of data in it
/// must not cost a whole object's space (a sparse file imported with one byte per MiB took
/// 120 times the space of its `convert`).
pub fn data_runs(bytes: &[u8], unit: usize) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, piece) in bytes.chunks(unit).enumerate() {
        if all_zero(piece) {
            continue;
        }
        let at = i * unit;
        match runs.last_mut() {
            Some((start, len)) if *start + *len == at => *len += piece.len(),
            _ => runs.push((at, piece.len())),
        }
    }
    runs
}

/// The data ranges of `[offset, end)` of `file` as the file system knows them
/// (`SEEK_DATA`/`SEEK_HOLE`), in order; `None` where it cannot tell (then everything counts as
/// data).
pub fn file_data_ranges(file: &File, offset: u64, end: u64) -> Option<Vec<(u64, u64)>> {
    use rustix::fs::{seek, SeekFrom};
    // A regular file shorter than promised (it shrank since its size was taken) would show
    // its missing end as a hole: let the reads find out, and fail.
    let meta = file.metadata().ok()?;
    if meta.is_file() && meta.len() < end {
        return None;
    }
    let mut ranges = Vec::new();
    let mut at = offset;
    while at < end {
        let start = match seek(file, SeekFrom::Data(at)) {
            Ok(start) => start,
            // No data at or after `at`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => break,
            Err(_) => return None,
        };
        if start >= end {
            break;
        }
        let stop = match seek(file, SeekFrom::Hole(start)) {
            Ok(stop) => stop.min(end),
            Err(_) => return None,
        };
        if stop <= start {
            return None;
        }
        ranges.push((start, stop));
        at = stop;
    }
    Some(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn data_runs_are_the_units_with_a_non_zero_byte() {
        let mut bytes = vec![0u8; 10 * 512 + 100];
        assert_eq!(data_runs(&bytes, 512), vec![]);
        bytes[3] = 1; // unit 0
        bytes[512 + 511] = 1; // unit 1, joined to unit 0
        bytes[4 * 512] = 1; // unit 4 alone
        bytes[10 * 512 + 99] = 1; // the short last unit
        assert_eq!(
            data_runs(&bytes, 512),
            vec![(0, 1024), (4 * 512, 512), (10 * 512, 100)]
        );
        let full = vec![7u8; 4096];
        assert_eq!(data_runs(&full, 512), vec![(0, 4096)]);
    }

    #[test]
    fn zero_detection_sees_every_byte() {
        for len in [0usize, 1, 15, 16, 17, 4096] {
            let zeros = vec![0u8; len];
            assert!(all_zero(&zeros), "{len}");
            for at in 0..len {
                let mut one = zeros.clone();
                one[at] = 1;
                assert!(!all_zero(&one), "{len}: byte {at}");
            }
        }
    }

    #[test]
    fn data_ranges_skip_holes() {
        const M: u64 = 1 << 20;
        // Data [0, 1M) and [2M, 4M); never written, so holes: [1M, 2M) and [4M, 6M).
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&vec![1u8; M as usize], 0).unwrap();
        file.write_all_at(&vec![2u8; 2 * M as usize], 2 * M)
            .unwrap();
        file.set_len(6 * M).unwrap();
        file.sync_all().unwrap();
        let ranges = |from, to| file_data_ranges(&file, from, to).unwrap();
        assert_eq!(ranges(0, 6 * M), vec![(0, M), (2 * M, 4 * M)]);
        assert_eq!(ranges(M, 2 * M), vec![]);
        assert_eq!(ranges(M / 2, 3 * M), vec![(M / 2, M), (2 * M, 3 * M)]);
        assert_eq!(ranges(4 * M, 6 * M), vec![]);
        // Past the end of the file: it cannot tell.
        assert_eq!(file_data_ranges(&file, 0, 7 * M), None);
    }
}
