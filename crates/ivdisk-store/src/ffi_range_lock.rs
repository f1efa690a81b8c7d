//! Byte-range locks of an open file description (Linux's `F_OFD_SETLK`). Like `flock`, such a
//! lock belongs to the description, not to the process: two opens in one process exclude each
//! other, and closing some other descriptor of the file releases nothing (a POSIX `F_SETLK`
//! lock would be dropped then). Unlike `flock`, it covers a range of bytes, so one file holds
//! many independent locks. Linux keeps them apart from `flock`s on the same file.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Who else may hold the range meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeLockKind {
    /// Other shared locks (needs the file open for reading).
    Shared,
    /// No other lock (needs the file open for writing).
    Exclusive,
}

/// Take a lock on `len` bytes from `start` (`len` 0: to any end of the file) without waiting.
/// `Ok(false)` when another open file description holds a conflicting lock.
pub(crate) fn try_lock_range(
    file: &File,
    kind: RangeLockKind,
    start: u64,
    len: u64,
) -> io::Result<bool> {
    let out_of_range = || io::Error::new(io::ErrorKind::InvalidInput, "lock range past off_t");
    let lock = libc::flock {
        l_type: match kind {
            RangeLockKind::Shared => libc::F_RDLCK,
            RangeLockKind::Exclusive => libc::F_WRLCK,
        } as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: libc::off_t::try_from(start).map_err(|_| out_of_range())?,
        l_len: libc::off_t::try_from(len).map_err(|_| out_of_range())?,
        // Must be 0 for open file description locks.
        l_pid: 0,
    };
    // SAFETY: `file` is an open descriptor for the duration of the call, and `F_OFD_SETLK`
    // reads the one `flock` structure it is given, which lives on this stack frame.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_of_two_descriptions_conflict_only_where_they_overlap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"").unwrap();
        let open_rw = || {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap()
        };
        let reader = File::open(&path).unwrap();
        assert!(try_lock_range(&reader, RangeLockKind::Shared, 5, 1).unwrap());
        let other_reader = File::open(&path).unwrap();
        assert!(try_lock_range(&other_reader, RangeLockKind::Shared, 5, 1).unwrap());
        let writer = open_rw();
        assert!(!try_lock_range(&writer, RangeLockKind::Exclusive, 5, 1).unwrap());
        assert!(!try_lock_range(&writer, RangeLockKind::Exclusive, 0, 0).unwrap());
        assert!(try_lock_range(&writer, RangeLockKind::Exclusive, 6, 1).unwrap());
        drop(reader);
        assert!(!try_lock_range(&writer, RangeLockKind::Exclusive, 5, 1).unwrap());
        drop(other_reader);
        assert!(try_lock_range(&writer, RangeLockKind::Exclusive, 0, 0).unwrap());
        // A reader is refused while the writer holds its byte.
        assert!(!try_lock_range(&File::open(&path).unwrap(), RangeLockKind::Shared, 5, 1).unwrap());
    }
}
