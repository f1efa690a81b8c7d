//! Our own minimal binding to librbd's C API (Ceph 16 "Pacific", Debian 12's `librbd-dev`),
//! and the only module of the crate allowed `unsafe`.
//!
//! What it covers: opening an image (read-write or read-only, at the head or a snapshot) on
//! an io context that ivdisk-rados connected, its size, loading librbd's LUKS1/LUKS2
//! encryption, asynchronous read, write, discard, write-zeroes and flush with their
//! completions bridged to futures, and closing. The image module builds the API on top; this
//! module only makes librbd's calls memory-safe.
//!
//! How an asynchronous request stays sound (as in ivdisk-rados' binding): every buffer librbd
//! reads from or writes into after submission is owned by a heap-allocated payload whose
//! address never changes. The payload is leaked into the completion's callback argument at
//! submission and reclaimed by the callback, which librbd calls exactly once; the callback
//! hands it to the waiting future through a oneshot channel. If the future was dropped
//! meanwhile, the payload is dropped in the callback, so cancelling a future never leaves
//! librbd writing into (or reading from) freed memory. librbd's zero-copy writes delay the
//! completion until librbd has let go of the caller's buffer, so the write payload too lives
//! exactly as long as librbd may touch it.
//!
//! A handle counts its requests in flight, and its close waits until every one has run its
//! callback before `rbd_close`: librbd's users (qemu drains first) close idle images, and a
//! close racing completions that still run in librbd's threads is a path nobody else takes.
//!
//! Calls librbd only offers synchronously (open, encryption load, close) are plain blocking
//! functions here; the image module runs them on a helper thread.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_void, CStr, CString};
use std::fmt;
use std::io;
use std::ptr;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use futures_channel::oneshot;

use crate::LuksFormat;

#[allow(non_camel_case_types)]
mod sys {
    use std::ffi::{c_char, c_int, c_void};

    pub type rados_ioctx_t = *mut c_void;
    pub type rbd_image_t = *mut c_void;
    pub type rbd_completion_t = *mut c_void;
    pub type rbd_callback_t = Option<unsafe extern "C" fn(rbd_completion_t, *mut c_void)>;

    // rbd_encryption_format_t
    pub const RBD_ENCRYPTION_FORMAT_LUKS1: c_int = 0;
    pub const RBD_ENCRYPTION_FORMAT_LUKS2: c_int = 1;
    /// `rbd_aio_write_zeroes`: write zeros rather than deallocate.
    pub const RBD_WRITE_ZEROES_FLAG_THICK_PROVISION: c_int = 1;
    // rbd_encryption_algorithm_t (ignored when loading; the header names the cipher)
    pub const RBD_ENCRYPTION_ALGORITHM_AES256: c_int = 1;
    /// `rbd_lock_mode_t`.
    pub const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;

    /// `rbd_encryption_luks1_format_options_t` and `rbd_encryption_luks2_format_options_t`:
    /// in Pacific the two are the same layout, and `rbd_encryption_load` takes them too
    /// (`alg` is ignored there), checking `opts_size` against their size.
    #[repr(C)]
    pub struct rbd_encryption_luks_format_options_t {
        pub alg: c_int,
        pub passphrase: *const c_char,
        pub passphrase_size: usize,
    }

    #[link(name = "rbd")]
    extern "C" {
        pub fn rbd_open(
            io: rados_ioctx_t,
            name: *const c_char,
            image: *mut rbd_image_t,
            snap_name: *const c_char,
        ) -> c_int;
        pub fn rbd_open_read_only(
            io: rados_ioctx_t,
            name: *const c_char,
            image: *mut rbd_image_t,
            snap_name: *const c_char,
        ) -> c_int;
        pub fn rbd_close(image: rbd_image_t) -> c_int;
        pub fn rbd_namespace_exists(
            io: rados_ioctx_t,
            namespace_name: *const c_char,
            exists: *mut bool,
        ) -> c_int;
        pub fn rbd_lock_acquire(image: rbd_image_t, lock_mode: c_int) -> c_int;
        pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
        pub fn rbd_encryption_load(
            image: rbd_image_t,
            format: c_int,
            opts: *mut c_void,
            opts_size: usize,
        ) -> c_int;

        pub fn rbd_aio_create_completion(
            cb_arg: *mut c_void,
            complete_cb: rbd_callback_t,
            c: *mut rbd_completion_t,
        ) -> c_int;
        pub fn rbd_aio_get_return_value(c: rbd_completion_t) -> isize;
        pub fn rbd_aio_release(c: rbd_completion_t);
        pub fn rbd_aio_read(
            image: rbd_image_t,
            off: u64,
            len: usize,
            buf: *mut c_char,
            c: rbd_completion_t,
        ) -> c_int;
        pub fn rbd_aio_write(
            image: rbd_image_t,
            off: u64,
            len: usize,
            buf: *const c_char,
            c: rbd_completion_t,
        ) -> c_int;
        pub fn rbd_aio_discard(
            image: rbd_image_t,
            off: u64,
            len: u64,
            c: rbd_completion_t,
        ) -> c_int;
        pub fn rbd_aio_write_zeroes(
            image: rbd_image_t,
            off: u64,
            len: usize,
            c: rbd_completion_t,
            zero_flags: c_int,
            op_flags: c_int,
        ) -> c_int;
        pub fn rbd_aio_flush(image: rbd_image_t, c: rbd_completion_t) -> c_int;
    }
}

/// A negative librbd return value, as a positive errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    fn check(r: c_int) -> Result<c_int, Errno> {
        if r < 0 {
            Err(Errno(-r))
        } else {
            Ok(r)
        }
    }

    pub fn io_error(self) -> io::Error {
        io::Error::from_raw_os_error(self.0)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.io_error())
    }
}

/// A string for a C call; image and snapshot names are checked before they get here, so one
/// holding NUL is refused as `EINVAL`.
pub fn c_string(s: &str) -> Result<CString, Errno> {
    CString::new(s).map_err(|_| Errno(libc::EINVAL))
}

/// Whether the pool of `io` has the rbd namespace `name` (blocking: reads the pool's
/// directory of namespaces).
pub fn namespace_exists(io: *mut c_void, name: &CStr) -> Result<bool, Errno> {
    let mut exists = false;
    // SAFETY: `io` is a live io context of a connected cluster (the caller keeps its owner
    // alive); `name` is NUL-terminated and lives across the call; valid out-pointer.
    Errno::check(unsafe { sys::rbd_namespace_exists(io, name.as_ptr(), &mut exists) })?;
    Ok(exists)
}

/// An open librbd image (`rbd_image_t`), closed by [`ImageHandle::close`] or on drop.
///
/// It does not keep the cluster connection alive: its owner must keep the io context it was
/// opened on (ivdisk-rados' `RawIoContext`) until the handle is closed.
pub struct ImageHandle {
    raw: sys::rbd_image_t,
    in_flight: Arc<InFlight>,
}

// SAFETY: librbd image handles may be used from any thread: the asynchronous IO calls and
// `rbd_get_size` lock internally (librbd documents images as safe for concurrent aio, as
// qemu uses them). `rbd_encryption_load` and `rbd_close` take `&mut self`/`self`, so nothing
// else runs on the handle meanwhile.
unsafe impl Send for ImageHandle {}
// SAFETY: as above; `&self` methods only submit asynchronous requests and read the size.
unsafe impl Sync for ImageHandle {}

impl ImageHandle {
    /// Open image `name` (blocking: reads the image header from the OSDs; read-write opens
    /// also register a watch). `snapshot`: open at that snapshot (then read-only).
    pub fn open(
        io: *mut c_void,
        name: &CStr,
        snapshot: Option<&CStr>,
        read_only: bool,
    ) -> Result<ImageHandle, Errno> {
        let snap = snapshot.map_or(ptr::null(), CStr::as_ptr);
        let mut raw = ptr::null_mut();
        // SAFETY: `io` is a live io context of a connected cluster (the caller keeps its owner
        // alive; librbd dups it); `name` and `snap` are NUL-terminated strings (or NULL) that
        // live across the call; `raw` is a valid out-pointer.
        Errno::check(unsafe {
            if read_only {
                sys::rbd_open_read_only(io, name.as_ptr(), &mut raw, snap)
            } else {
                sys::rbd_open(io, name.as_ptr(), &mut raw, snap)
            }
        })?;
        Ok(ImageHandle {
            raw,
            in_flight: Arc::default(),
        })
    }

    /// Take librbd's exclusive lock in exclusive mode and keep it until the close (blocking:
    /// asks a holder in librbd's cooperative mode to give it up). Another client that asks
    /// for it then gets EROFS, where in the cooperative mode two writers took it in turn.
    pub fn lock_exclusive(&self) -> Result<(), Errno> {
        // SAFETY: open handle; the mode is `RBD_LOCK_MODE_EXCLUSIVE` of librbd.h's enum.
        Errno::check(unsafe { sys::rbd_lock_acquire(self.raw, sys::RBD_LOCK_MODE_EXCLUSIVE) })?;
        Ok(())
    }

    /// The size librbd reports: after an encryption load, the plaintext size (the LUKS header
    /// region is not part of it).
    pub fn size(&self) -> Result<u64, Errno> {
        let mut size = 0u64;
        // SAFETY: open handle; valid out-pointer.
        Errno::check(unsafe { sys::rbd_get_size(self.raw, &mut size) })?;
        Ok(size)
    }

    /// Unlock the image's LUKS header with `passphrase` and put librbd's crypto layer in the
    /// IO path (blocking: runs the header's key derivation, seconds by design).
    pub fn encryption_load(&mut self, format: LuksFormat, passphrase: &[u8]) -> Result<(), Errno> {
        let mut opts = sys::rbd_encryption_luks_format_options_t {
            alg: sys::RBD_ENCRYPTION_ALGORITHM_AES256,
            passphrase: passphrase.as_ptr().cast(),
            passphrase_size: passphrase.len(),
        };
        let format = match format {
            LuksFormat::Luks1 => sys::RBD_ENCRYPTION_FORMAT_LUKS1,
            LuksFormat::Luks2 => sys::RBD_ENCRYPTION_FORMAT_LUKS2,
        };
        // SAFETY: open handle, used by nobody else (`&mut self`); `opts` has the layout of
        // the luks1/luks2 options struct, its size is passed, and the passphrase it points
        // to lives across the call (librbd copies what it keeps).
        Errno::check(unsafe {
            sys::rbd_encryption_load(
                self.raw,
                format,
                (&mut opts as *mut sys::rbd_encryption_luks_format_options_t).cast(),
                std::mem::size_of::<sys::rbd_encryption_luks_format_options_t>(),
            )
        })?;
        Ok(())
    }

    /// Close the image (blocking: flushes librbd's cache, waits for requests in flight,
    /// releases the exclusive lock and the watch).
    pub fn close(mut self) -> Result<(), Errno> {
        self.in_flight.wait_until_none();
        let raw = std::mem::replace(&mut self.raw, ptr::null_mut());
        // SAFETY: an open handle, closed exactly once (`Drop` skips the NULL left behind).
        Errno::check(unsafe { sys::rbd_close(raw) })?;
        Ok(())
    }

    /// Read `len` bytes at `offset` into a buffer of the request's own; resolves to the buffer
    /// and librbd's return value (bytes read, or a negative errno).
    pub fn aio_read(&self, offset: u64, len: usize) -> Result<Pending<Vec<u8>>, Errno> {
        // Zeroed, so that the buffer is initialized whatever librbd fills in.
        let mut buf = vec![0u8; len];
        let (image, ptr) = (self.raw, buf.as_mut_ptr());
        submit(&self.in_flight, buf, move |c| {
            // SAFETY: open handle and fresh completion; `ptr` points at `len` writable bytes
            // of the payload's heap buffer, which the payload (owned by the callback until
            // librbd completes) keeps in place: moving a Vec does not move its heap block.
            unsafe { sys::rbd_aio_read(image, offset, len, ptr.cast(), c) }
        })
    }

    /// Write `data` (owned by the request until librbd completes it) at `offset`.
    pub fn aio_write(&self, offset: u64, data: Vec<u8>) -> Result<Pending<Vec<u8>>, Errno> {
        let (image, ptr, len) = (self.raw, data.as_ptr(), data.len());
        submit(&self.in_flight, data, move |c| {
            // SAFETY: as in `aio_read`: `ptr`/`len` describe the payload's heap buffer, alive
            // and unmoved until the callback; librbd's zero-copy path completes only after it
            // released the buffer.
            unsafe { sys::rbd_aio_write(image, offset, len, ptr.cast(), c) }
        })
    }

    /// Discard `[offset, offset + len)` (librbd may skip partial objects: see the image
    /// module for when that matters).
    pub fn aio_discard(&self, offset: u64, len: u64) -> Result<Pending<()>, Errno> {
        let image = self.raw;
        submit(&self.in_flight, (), move |c| {
            // SAFETY: open handle and fresh completion; no buffers involved.
            unsafe { sys::rbd_aio_discard(image, offset, len, c) }
        })
    }

    /// Make `[offset, offset + len)` read as zeros. `thick`: keep the range allocated
    /// (zeros are written); otherwise librbd zeroes partial objects and deallocates whole
    /// ones.
    pub fn aio_write_zeroes(
        &self,
        offset: u64,
        len: usize,
        thick: bool,
    ) -> Result<Pending<()>, Errno> {
        let image = self.raw;
        let flags = if thick {
            sys::RBD_WRITE_ZEROES_FLAG_THICK_PROVISION
        } else {
            0
        };
        submit(&self.in_flight, (), move |c| {
            // SAFETY: open handle and fresh completion; a flag librbd knows, no op flags.
            unsafe { sys::rbd_aio_write_zeroes(image, offset, len, c, flags, 0) }
        })
    }

    /// Make every completed write durable (flushes librbd's writeback cache).
    pub fn aio_flush(&self) -> Result<Pending<()>, Errno> {
        let image = self.raw;
        submit(&self.in_flight, (), move |c| {
            // SAFETY: open handle and fresh completion.
            unsafe { sys::rbd_aio_flush(image, c) }
        })
    }
}

impl Drop for ImageHandle {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        self.in_flight.wait_until_none();
        // SAFETY: an open handle nobody else uses any more (we are dropping the only owner),
        // with no request of ours in flight; closed exactly once.
        let r = unsafe { sys::rbd_close(self.raw) };
        if r < 0 {
            tracing::warn!(error = %Errno(-r), "closing an rbd image failed");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous completions

/// What a completed request hands back: its payload and librbd's return value (bytes for
/// reads, or a negative errno).
pub struct Done<T> {
    pub payload: T,
    pub rval: isize,
}

/// A submitted request; resolves when librbd completes it.
pub type Pending<T> = oneshot::Receiver<Done<T>>;

struct Submitted<T> {
    payload: T,
    done: oneshot::Sender<Done<T>>,
    /// The handle's count, told once the payload has been handed over or dropped.
    in_flight: Arc<InFlight>,
}

/// How many requests of a handle are submitted and have not yet run their callback.
#[derive(Default)]
struct InFlight {
    count: Mutex<usize>,
    none_left: Condvar,
}

impl InFlight {
    fn started(&self) {
        *self.count.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    }

    fn finished(&self) {
        let mut count = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        *count -= 1;
        if *count == 0 {
            self.none_left.notify_all();
        }
    }

    /// Block until no request is in flight. A request that never completes (a cluster gone
    /// for good) would hold `rbd_close` up as long, so this waits as long too, saying so.
    fn wait_until_none(&self) {
        const SAY_AFTER: Duration = Duration::from_secs(10);
        let mut count = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        let mut said = false;
        while *count > 0 {
            let (next, timeout) = self
                .none_left
                .wait_timeout(count, SAY_AFTER)
                .unwrap_or_else(PoisonError::into_inner);
            count = next;
            if timeout.timed_out() && *count > 0 && !said {
                said = true;
                tracing::warn!(
                    requests = *count,
                    "closing an rbd image waits for its requests in flight to complete"
                );
            }
        }
    }
}

extern "C" fn on_complete<T: Send + 'static>(c: sys::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Submitted<T>>` leaked by `submit` for this completion, and
    // librbd calls the callback exactly once, so the box is reclaimed exactly once.
    let submitted = unsafe { Box::from_raw(arg.cast::<Submitted<T>>()) };
    // SAFETY: `c` is the completion this callback belongs to, valid during the callback.
    let rval = unsafe { sys::rbd_aio_get_return_value(c) };
    // SAFETY: drops our reference (as qemu's rbd driver does in its callback); librbd holds
    // its own until the callback returns.
    unsafe { sys::rbd_aio_release(c) };
    let Submitted {
        payload,
        done,
        in_flight,
    } = *submitted;
    // A dropped receiver gets the payload dropped here, after librbd is done with it.
    let _ = done.send(Done { payload, rval });
    in_flight.finished();
}

/// Leak `payload` into a new completion's callback argument and run `start` (which must
/// submit a request using that completion, touching the payload only through raw pointers
/// taken before). On a submission error the callback never runs, so the payload is reclaimed
/// here.
fn submit<T: Send + 'static>(
    in_flight: &Arc<InFlight>,
    payload: T,
    start: impl FnOnce(sys::rbd_completion_t) -> c_int,
) -> Result<Pending<T>, Errno> {
    let (done, pending) = oneshot::channel();
    in_flight.started();
    let submitted = Box::into_raw(Box::new(Submitted {
        payload,
        done,
        in_flight: in_flight.clone(),
    }));
    let mut c = ptr::null_mut();
    // SAFETY: valid out-pointer; the callback is the monomorphized `on_complete::<T>`
    // matching the argument's type.
    let r =
        unsafe { sys::rbd_aio_create_completion(submitted.cast(), Some(on_complete::<T>), &mut c) };
    if r < 0 {
        // SAFETY: no completion exists, so nobody else will reclaim the box.
        drop(unsafe { Box::from_raw(submitted) });
        in_flight.finished();
        return Err(Errno(-r));
    }
    let r = start(c);
    if r < 0 {
        // SAFETY: the request was refused, so the callback will never run: release the
        // completion and reclaim the box here, exactly once.
        unsafe {
            sys::rbd_aio_release(c);
            drop(Box::from_raw(submitted));
        }
        in_flight.finished();
        return Err(Errno(-r));
    }
    Ok(pending)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::thread;

    /// The close's wait returns only once the last request in flight has finished, and at
    /// once when none is.
    #[test]
    fn the_close_waits_for_every_request_in_flight() {
        let in_flight = Arc::new(InFlight::default());
        in_flight.wait_until_none();
        in_flight.started();
        in_flight.started();
        let all_finished = Arc::new(AtomicBool::new(false));
        let completions = {
            let (in_flight, all_finished) = (in_flight.clone(), all_finished.clone());
            thread::spawn(move || {
                thread::sleep(Duration::from_millis(50));
                in_flight.finished();
                thread::sleep(Duration::from_millis(50));
                all_finished.store(true, Ordering::SeqCst);
                in_flight.finished();
            })
        };
        in_flight.wait_until_none();
        assert!(
            all_finished.load(Ordering::SeqCst),
            "returned with one in flight"
        );
        completions.join().unwrap();
    }
}
