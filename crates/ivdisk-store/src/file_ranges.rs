//! Where a file holds data, as the file system knows it (`SEEK_DATA`/`SEEK_HOLE`): the local
//! store's reclaim after a crash punches only those parts of dead ranges, and `ivdisk import`
//! and `convert` read only those parts of a sparse source file.

use std::fs::File;

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
