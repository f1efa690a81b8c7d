//! A shim SQLite VFS for the power-loss test (feature `fault-io` only): the default `unix` VFS
//! with every write, truncation, sync and delete of a named file reported to `fault_io`, the
//! only way to see SQLite's file IO. Everything else is passed through unchanged.
//!
//! `unsafe` is confined to the crate's three FFI modules: this one (SQLite's C VFS
//! interface), `ffi_writeback.rs` (one `sync_file_range` call) and `ffi_heap.rs`
//! (`malloc_trim`). Each shim file is a
//! `ShimFile` (SQLite allocates `szOsFile` bytes for it) holding the `unix` VFS's own file
//! object, allocated with `sqlite3_malloc`, and the file's path.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::OnceLock;

use rusqlite::ffi;

const NAME: &CStr = c"ivdisk-fault-io";

#[repr(C)]
struct ShimFile {
    /// Must be first: SQLite sees a `sqlite3_file`.
    base: ffi::sqlite3_file,
    /// The `unix` VFS's file (`sqlite3_malloc`ed, `unix.szOsFile` bytes).
    real: *mut ffi::sqlite3_file,
    /// The file's path (`Box::into_raw`), null for temporary files.
    path: *mut PathBuf,
}

/// Whether the shim was registered (once per process).
static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();

/// The `unix` VFS the shim `vfs` delegates to: its pAppData, set before the shim was
/// registered and never changed. Why not through `REGISTERED`: SQLite may call the shim
/// (another thread opening a connection) between its registration and the end of
/// `get_or_init`, while `REGISTERED` is still empty.
///
/// # Safety
/// `vfs` is the shim SQLite called.
unsafe fn unix_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    // SAFETY: the caller's promise: `vfs` is the registered shim, a leaked, valid struct.
    unsafe { (*vfs).pAppData as *mut ffi::sqlite3_vfs }
}

/// Register the shim as SQLite's default VFS for this process (idempotent): every connection
/// opened without naming a VFS goes through it.
pub fn register_default() -> Result<(), String> {
    let result = REGISTERED.get_or_init(|| {
        // SAFETY: sqlite3_vfs_find with a valid C string; SQLite initialises itself here.
        let unix = unsafe { ffi::sqlite3_vfs_find(c"unix".as_ptr()) };
        if unix.is_null() {
            return Err("SQLite has no `unix` VFS".into());
        }
        // SAFETY: `unix` is a valid registered VFS; copying the struct keeps its function
        // pointers (which do not use their VFS argument beyond `mxPathname`, kept equal)
        // except xOpen (which uses pAppData: called with `unix` itself below).
        let mut shim: ffi::sqlite3_vfs = unsafe { *unix };
        shim.szOsFile = std::mem::size_of::<ShimFile>() as c_int;
        shim.zName = NAME.as_ptr();
        shim.pNext = ptr::null_mut();
        shim.pAppData = unix as *mut c_void;
        shim.xOpen = Some(shim_open);
        shim.xDelete = Some(shim_delete);
        let shim = Box::into_raw(Box::new(shim));
        // SAFETY: `shim` is a valid, leaked (so 'static) VFS struct.
        let rc = unsafe { ffi::sqlite3_vfs_register(shim, 1) };
        if rc != ffi::SQLITE_OK {
            return Err(format!("sqlite3_vfs_register failed: {rc}"));
        }
        Ok(())
    });
    result.as_ref().map(|_| ()).map_err(Clone::clone)
}

fn path_of(name: *const c_char) -> Option<PathBuf> {
    if name.is_null() {
        return None;
    }
    // SAFETY: SQLite passes NUL-terminated file names.
    let bytes = unsafe { CStr::from_ptr(name) }.to_bytes();
    Some(PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes),
    ))
}

unsafe extern "C" fn shim_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    // SAFETY: SQLite calls xOpen with the VFS it belongs to: the shim.
    let unix = unsafe { unix_vfs(vfs) };
    let shim = file as *mut ShimFile;
    // SAFETY: `file` points at szOsFile (= size_of ShimFile) bytes SQLite allocated for us.
    unsafe {
        (*shim).base.pMethods = ptr::null();
        (*shim).real = ptr::null_mut();
        (*shim).path = ptr::null_mut();
    }
    // SAFETY: `unix` is the valid `unix` VFS (the shim's pAppData).
    let size = unsafe { (*unix).szOsFile };
    // SAFETY: plain allocation.
    let real = unsafe { ffi::sqlite3_malloc(size) } as *mut ffi::sqlite3_file;
    if real.is_null() {
        return ffi::SQLITE_NOMEM;
    }
    // SAFETY: `real` has `size` bytes; zeroing them is what SQLite does before xOpen.
    unsafe { ptr::write_bytes(real as *mut u8, 0, size as usize) };
    // SAFETY: delegating xOpen with the arguments SQLite gave us and a file of the right size.
    let rc =
        unsafe { ((*unix).xOpen.expect("unix has xOpen"))(unix, name, real, flags, out_flags) };
    if rc != ffi::SQLITE_OK {
        // SAFETY: per SQLite's contract, a file whose pMethods is set must be closed even
        // when xOpen fails; then its memory is ours to free.
        unsafe {
            if !(*real).pMethods.is_null() {
                ((*(*real).pMethods).xClose.expect("xClose"))(real);
            }
            ffi::sqlite3_free(real as *mut c_void);
        }
        return rc;
    }
    let path = path_of(name).map_or(ptr::null_mut(), |p| Box::into_raw(Box::new(p)));
    // SAFETY: `shim` is ours (see above); METHODS is 'static.
    unsafe {
        (*shim).real = real;
        (*shim).path = path;
        (*shim).base.pMethods = &METHODS;
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn shim_delete(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    sync_dir: c_int,
) -> c_int {
    // SAFETY: SQLite calls xDelete with the VFS it belongs to: the shim.
    let unix = unsafe { unix_vfs(vfs) };
    // SAFETY: delegating with SQLite's own arguments to the valid `unix` VFS.
    let rc = unsafe { ((*unix).xDelete.expect("unix has xDelete"))(unix, name, sync_dir) };
    if rc == ffi::SQLITE_OK {
        if let Some(path) = path_of(name) {
            crate::fault_io::removed(&path);
        }
    }
    rc
}

/// The real file and path of a shim file.
///
/// # Safety
/// `file` must be a `ShimFile` opened by `shim_open` and not yet closed.
unsafe fn parts<'a>(file: *mut ffi::sqlite3_file) -> (*mut ffi::sqlite3_file, Option<&'a Path>) {
    let shim = file as *mut ShimFile;
    // SAFETY: per the function's contract.
    unsafe { ((*shim).real, (*shim).path.as_ref().map(|p| p.as_path())) }
}

/// The real file's io method `$m`.
macro_rules! real_method {
    ($real:expr, $m:ident) => {
        (*(*$real).pMethods).$m
    };
}

unsafe extern "C" fn shim_close(file: *mut ffi::sqlite3_file) -> c_int {
    let shim = file as *mut ShimFile;
    // SAFETY: SQLite closes each file it opened once; we free what shim_open allocated.
    unsafe {
        let real = (*shim).real;
        let rc = (real_method!(real, xClose).expect("xClose"))(real);
        ffi::sqlite3_free(real as *mut c_void);
        if !(*shim).path.is_null() {
            drop(Box::from_raw((*shim).path));
        }
        (*shim).real = ptr::null_mut();
        (*shim).path = ptr::null_mut();
        (*shim).base.pMethods = ptr::null();
        rc
    }
}

unsafe extern "C" fn shim_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xRead).expect("xRead"))(real, buf, amount, offset)
    }
}

unsafe extern "C" fn shim_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: an open shim file; `buf` holds `amount` bytes (SQLite's contract).
    unsafe {
        let (real, path) = parts(file);
        let rc = (real_method!(real, xWrite).expect("xWrite"))(real, buf, amount, offset);
        if rc == ffi::SQLITE_OK {
            if let Some(path) = path {
                let data = std::slice::from_raw_parts(buf as *const u8, amount as usize);
                crate::fault_io::write(|| path.to_owned(), offset as u64, data);
            }
        }
        rc
    }
}

unsafe extern "C" fn shim_truncate(
    file: *mut ffi::sqlite3_file,
    size: ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, path) = parts(file);
        let rc = (real_method!(real, xTruncate).expect("xTruncate"))(real, size);
        if rc == ffi::SQLITE_OK {
            if let Some(path) = path {
                crate::fault_io::set_len(|| path.to_owned(), size as u64);
            }
        }
        rc
    }
}

unsafe extern "C" fn shim_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, path) = parts(file);
        let rc = (real_method!(real, xSync).expect("xSync"))(real, flags);
        if rc == ffi::SQLITE_OK {
            if let Some(path) = path {
                crate::fault_io::synced(path);
            }
        }
        rc
    }
}

unsafe extern "C" fn shim_file_size(
    file: *mut ffi::sqlite3_file,
    size: *mut ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xFileSize).expect("xFileSize"))(real, size)
    }
}

unsafe extern "C" fn shim_lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xLock).expect("xLock"))(real, level)
    }
}

unsafe extern "C" fn shim_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xUnlock).expect("xUnlock"))(real, level)
    }
}

unsafe extern "C" fn shim_check_reserved_lock(
    file: *mut ffi::sqlite3_file,
    out: *mut c_int,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xCheckReservedLock).expect("xCheckReservedLock"))(real, out)
    }
}

unsafe extern "C" fn shim_file_control(
    file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xFileControl).expect("xFileControl"))(real, op, arg)
    }
}

unsafe extern "C" fn shim_sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xSectorSize).expect("xSectorSize"))(real)
    }
}

unsafe extern "C" fn shim_device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        (real_method!(real, xDeviceCharacteristics).expect("xDeviceCharacteristics"))(real)
    }
}

unsafe extern "C" fn shim_shm_map(
    file: *mut ffi::sqlite3_file,
    page: c_int,
    page_size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments (the unix VFS's methods
    // are version 3, so the shared-memory methods exist).
    unsafe {
        let (real, _) = parts(file);
        match real_method!(real, xShmMap) {
            Some(f) => f(real, page, page_size, extend, out),
            None => ffi::SQLITE_IOERR,
        }
    }
}

unsafe extern "C" fn shim_shm_lock(
    file: *mut ffi::sqlite3_file,
    offset: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        match real_method!(real, xShmLock) {
            Some(f) => f(real, offset, n, flags),
            None => ffi::SQLITE_IOERR,
        }
    }
}

unsafe extern "C" fn shim_shm_barrier(file: *mut ffi::sqlite3_file) {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        if let Some(f) = real_method!(real, xShmBarrier) {
            f(real)
        }
    }
}

unsafe extern "C" fn shim_shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        match real_method!(real, xShmUnmap) {
            Some(f) => f(real, delete),
            None => ffi::SQLITE_OK,
        }
    }
}

unsafe extern "C" fn shim_fetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    amount: c_int,
    out: *mut *mut c_void,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        match real_method!(real, xFetch) {
            Some(f) => f(real, offset, amount, out),
            None => {
                *out = ptr::null_mut();
                ffi::SQLITE_OK
            }
        }
    }
}

unsafe extern "C" fn shim_unfetch(
    file: *mut ffi::sqlite3_file,
    offset: ffi::sqlite3_int64,
    p: *mut c_void,
) -> c_int {
    // SAFETY: an open shim file; delegating SQLite's own arguments.
    unsafe {
        let (real, _) = parts(file);
        match real_method!(real, xUnfetch) {
            Some(f) => f(real, offset, p),
            None => ffi::SQLITE_OK,
        }
    }
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(shim_close),
    xRead: Some(shim_read),
    xWrite: Some(shim_write),
    xTruncate: Some(shim_truncate),
    xSync: Some(shim_sync),
    xFileSize: Some(shim_file_size),
    xLock: Some(shim_lock),
    xUnlock: Some(shim_unlock),
    xCheckReservedLock: Some(shim_check_reserved_lock),
    xFileControl: Some(shim_file_control),
    xSectorSize: Some(shim_sector_size),
    xDeviceCharacteristics: Some(shim_device_characteristics),
    xShmMap: Some(shim_shm_map),
    xShmLock: Some(shim_shm_lock),
    xShmBarrier: Some(shim_shm_barrier),
    xShmUnmap: Some(shim_shm_unmap),
    xFetch: Some(shim_fetch),
    xUnfetch: Some(shim_unfetch),
};
