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
