//! The C heap, where SQLite keeps its page cache: SQLite allocates through the C library's
//! `malloc`, not through the binary's Rust allocator. glibc keeps the pages of chunks freed in
//! the middle of its heaps resident until `malloc_trim(3)` walks them, so a page cache
//! emptied by `PRAGMA shrink_memory` would still count in the process's memory.
#![allow(unsafe_code)]

/// Hand the free pages of the C heap back to the kernel (glibc's `malloc_trim(0)`); a no-op
/// on other C libraries, whose `free` returns what it can by itself or not at all.
pub(crate) fn release_free_c_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes only an integer and walks glibc's own heaps under their
    // locks; nothing of ours is touched.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Bytes of page cache the connection `db` holds (`SQLITE_DBSTATUS_CACHE_USED`). For tests
/// that check what an idle store gives back.
#[cfg(test)]
pub(crate) fn sqlite_cache_used(db: &rusqlite::Connection) -> i64 {
    let (mut current, mut highwater) = (0, 0);
    // SAFETY: `db.handle()` is the open connection's pointer, valid while `db` is borrowed;
    // `sqlite3_db_status` only writes the two integers it is given.
    let rc = unsafe {
        rusqlite::ffi::sqlite3_db_status(
            db.handle(),
            rusqlite::ffi::SQLITE_DBSTATUS_CACHE_USED,
            &mut current,
            &mut highwater,
            0,
        )
    };
    assert_eq!(rc, rusqlite::ffi::SQLITE_OK, "sqlite3_db_status");
    i64::from(current)
}
