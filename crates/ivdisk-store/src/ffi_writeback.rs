//! `sync_file_range(2)`, which neither std nor rustix wraps: start writeback of the dirty
//! pages in a range of a file without waiting for it and without dropping cached pages.
//!
//! Writes into reused space are scattered over a segment. Starting their writeback one range
//! at a time (`posix_fadvise(DONTNEED)` per range, as appends do) cost a system call and a
//! page-cache walk per 4-32 KiB write, and `DONTNEED` over the span that holds them would
//! also drop the clean pages of live data in between (the read cache). This walks only the
//! dirty pages of the span, once.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd;

/// Start writeback of the dirty pages of `[offset, offset + len)`; best effort (the commit's
/// `fdatasync` writes whatever this did not).
pub(crate) fn start_writeback_of_dirty(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return;
    };
    // SAFETY: `sync_file_range` only reads its integer arguments; the descriptor is owned by
    // `file`, which outlives the call.
    let _ = unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
    };
}

/// Pages of `[offset, offset + len)` of `file` in the page cache (`cachestat(2)`, Linux 6.5;
/// a kernel without it answers `ENOSYS`). For tests that check what the segments leave there.
#[cfg(test)]
pub(crate) fn cached_pages(file: &File, offset: u64, len: u64) -> std::io::Result<u64> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    // The same number on every architecture (the tables were unified before it came).
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: `range` and `stat` are live, properly aligned `repr(C)` structs of the layout
    // the kernel reads and writes (`struct cachestat_range`, `struct cachestat`); the
    // descriptor is owned by `file`, which outlives the call.
    let done = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0u32,
        )
    };
    if done != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stat.nr_cache)
}
