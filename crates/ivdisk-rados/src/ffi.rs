//! Our own minimal binding to librados' C API (Ceph 16 "Pacific", Debian 12's `librados-dev`),
//! and the only module of the crate allowed `unsafe`.
//!
//! What it covers: a cluster handle (config, connect, instance id), io contexts (pool,
//! namespace, read snapshot, self-managed snapshot write context), compound write and read
//! operations submitted asynchronously with their completions bridged to futures, self-managed
//! snapshots, the exclusive advisory lock calls, object listing, and watch/notify (a watch
//! that acknowledges every notify with a fixed reply and is registered again when librados
//! loses it; a notify that collects the replies). The store module builds
//! the ivdisk semantics on top; this module only makes librados' calls memory-safe.
//!
//! How an asynchronous operation stays sound: everything librados writes into after submission
//! (read buffers, out-lengths, per-step return values, omap iterators, the op handle itself)
//! lives in a heap-allocated payload whose address never changes. The payload is leaked into
//! the completion's callback argument at submission and reclaimed by the callback, which
//! librados calls exactly once; the callback hands it to the waiting future through a
//! oneshot channel. If the future was dropped meanwhile, the payload is dropped in the
//! callback and its `Drop` frees what librados allocated, so cancelling a future never leaves
//! librados writing into freed memory.
//!
//! Calls librados only offers synchronously (connect, locks, listing, rollback) are plain
//! blocking functions here; the store runs them on a helper thread.

#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::io;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use futures_channel::oneshot;
use ivdisk_store::{OmapPairs, WatchStatus};

#[allow(non_camel_case_types)]
mod sys {
    use std::ffi::{c_char, c_int, c_uchar, c_void};

    pub type rados_t = *mut c_void;
    pub type rados_ioctx_t = *mut c_void;
    pub type rados_completion_t = *mut c_void;
    pub type rados_write_op_t = *mut c_void;
    pub type rados_read_op_t = *mut c_void;
    pub type rados_omap_iter_t = *mut c_void;
    pub type rados_list_ctx_t = *mut c_void;
    pub type rados_snap_t = u64;
    pub type rados_callback_t = Option<unsafe extern "C" fn(rados_completion_t, *mut c_void)>;

    pub const LIBRADOS_SNAP_HEAD: u64 = -2i64 as u64;
    pub const LIBRADOS_CREATE_EXCLUSIVE: c_int = 1;
    /// Renew only a lock still held (librados.h: fails ENOENT otherwise).
    pub const LIBRADOS_LOCK_FLAG_MUST_RENEW: u8 = 2;

    #[link(name = "rados")]
    extern "C" {
        pub fn rados_create2(
            cluster: *mut rados_t,
            cluster_name: *const c_char,
            name: *const c_char,
            flags: u64,
        ) -> c_int;
        pub fn rados_conf_read_file(cluster: rados_t, path: *const c_char) -> c_int;
        pub fn rados_conf_set(
            cluster: rados_t,
            option: *const c_char,
            value: *const c_char,
        ) -> c_int;
        pub fn rados_conf_get(
            cluster: rados_t,
            option: *const c_char,
            buf: *mut c_char,
            len: usize,
        ) -> c_int;
        pub fn rados_connect(cluster: rados_t) -> c_int;
        pub fn rados_shutdown(cluster: rados_t);
        pub fn rados_get_instance_id(cluster: rados_t) -> u64;
        pub fn rados_blocklist_add(
            cluster: rados_t,
            client_address: *mut c_char,
            expire_seconds: u32,
        ) -> c_int;
        pub fn rados_wait_for_latest_osdmap(cluster: rados_t) -> c_int;

        pub fn rados_ioctx_create(
            cluster: rados_t,
            pool: *const c_char,
            ioctx: *mut rados_ioctx_t,
        ) -> c_int;
        pub fn rados_ioctx_destroy(io: rados_ioctx_t);
        pub fn rados_ioctx_set_namespace(io: rados_ioctx_t, nspace: *const c_char);
        pub fn rados_ioctx_snap_set_read(io: rados_ioctx_t, snap: rados_snap_t);
        pub fn rados_set_pool_full_try(io: rados_ioctx_t);
        pub fn rados_ioctx_selfmanaged_snap_set_write_ctx(
            io: rados_ioctx_t,
            seq: rados_snap_t,
            snaps: *mut rados_snap_t,
            num_snaps: c_int,
        ) -> c_int;
        // `void` in librados.h: the submission cannot fail, errors come through the
        // completion. (Declared returning `c_int`, the garbage in the return register was
        // read as a refusal now and then: the completion and its payload freed while
        // librados still wrote into them.)
        pub fn rados_aio_ioctx_selfmanaged_snap_create(
            io: rados_ioctx_t,
            snapid: *mut rados_snap_t,
            completion: rados_completion_t,
        );
        // `void` in librados.h: the submission cannot fail, errors come through the
        // completion. (Declared returning `c_int`, the garbage in the return register was
        // read as a refusal now and then: the completion and its payload freed while
        // librados still wrote into them.)
        pub fn rados_aio_ioctx_selfmanaged_snap_remove(
            io: rados_ioctx_t,
            snapid: rados_snap_t,
            completion: rados_completion_t,
        );
        pub fn rados_ioctx_selfmanaged_snap_rollback(
            io: rados_ioctx_t,
            oid: *const c_char,
            snapid: rados_snap_t,
        ) -> c_int;

        pub fn rados_aio_create_completion2(
            cb_arg: *mut c_void,
            cb_complete: rados_callback_t,
            pc: *mut rados_completion_t,
        ) -> c_int;
        pub fn rados_aio_get_return_value(c: rados_completion_t) -> c_int;
        pub fn rados_aio_get_version(c: rados_completion_t) -> u64;
        pub fn rados_aio_release(c: rados_completion_t);
        pub fn rados_aio_cancel(io: rados_ioctx_t, c: rados_completion_t) -> c_int;

        pub fn rados_create_write_op() -> rados_write_op_t;
        pub fn rados_release_write_op(op: rados_write_op_t);
        pub fn rados_write_op_create(
            op: rados_write_op_t,
            exclusive: c_int,
            category: *const c_char,
        );
        pub fn rados_write_op_assert_exists(op: rados_write_op_t);
        pub fn rados_write_op_assert_version(op: rados_write_op_t, ver: u64);
        pub fn rados_write_op_write(
            op: rados_write_op_t,
            buffer: *const c_char,
            len: usize,
            offset: u64,
        );
        pub fn rados_write_op_write_full(op: rados_write_op_t, buffer: *const c_char, len: usize);
        pub fn rados_write_op_zero(op: rados_write_op_t, offset: u64, len: u64);
        pub fn rados_write_op_truncate(op: rados_write_op_t, offset: u64);
        pub fn rados_write_op_remove(op: rados_write_op_t);
        pub fn rados_write_op_omap_set2(
            op: rados_write_op_t,
            keys: *const *const c_char,
            vals: *const *const c_char,
            key_lens: *const usize,
            val_lens: *const usize,
            num: usize,
        );
        pub fn rados_write_op_omap_rm_keys2(
            op: rados_write_op_t,
            keys: *const *const c_char,
            key_lens: *const usize,
            keys_len: usize,
        );
        pub fn rados_write_op_omap_rm_range2(
            op: rados_write_op_t,
            key_begin: *const c_char,
            key_begin_len: usize,
            key_end: *const c_char,
            key_end_len: usize,
        );
        pub fn rados_write_op_omap_clear(op: rados_write_op_t);
        pub fn rados_write_op_set_alloc_hint2(
            op: rados_write_op_t,
            expected_object_size: u64,
            expected_write_size: u64,
            flags: u32,
        );
        pub fn rados_aio_write_op_operate(
            op: rados_write_op_t,
            io: rados_ioctx_t,
            completion: rados_completion_t,
            oid: *const c_char,
            mtime: *mut libc::time_t,
            flags: c_int,
        ) -> c_int;

        pub fn rados_create_read_op() -> rados_read_op_t;
        pub fn rados_release_read_op(op: rados_read_op_t);
        pub fn rados_read_op_stat(
            op: rados_read_op_t,
            psize: *mut u64,
            pmtime: *mut libc::time_t,
            prval: *mut c_int,
        );
        pub fn rados_read_op_read(
            op: rados_read_op_t,
            offset: u64,
            len: usize,
            buffer: *mut c_char,
            bytes_read: *mut usize,
            prval: *mut c_int,
        );
        pub fn rados_read_op_omap_get_vals2(
            op: rados_read_op_t,
            start_after: *const c_char,
            filter_prefix: *const c_char,
            max_return: u64,
            iter: *mut rados_omap_iter_t,
            pmore: *mut c_uchar,
            prval: *mut c_int,
        );
        pub fn rados_read_op_omap_get_vals_by_keys2(
            op: rados_read_op_t,
            keys: *const *const c_char,
            num_keys: usize,
            key_lens: *const usize,
            iter: *mut rados_omap_iter_t,
            prval: *mut c_int,
        );
        pub fn rados_read_op_exec(
            op: rados_read_op_t,
            cls: *const c_char,
            method: *const c_char,
            in_buf: *const c_char,
            in_len: usize,
            out_buf: *mut *mut c_char,
            out_len: *mut usize,
            prval: *mut c_int,
        );
        pub fn rados_aio_read_op_operate(
            op: rados_read_op_t,
            io: rados_ioctx_t,
            completion: rados_completion_t,
            oid: *const c_char,
            flags: c_int,
        ) -> c_int;
        pub fn rados_omap_get_next2(
            iter: rados_omap_iter_t,
            key: *mut *mut c_char,
            val: *mut *mut c_char,
            key_len: *mut usize,
            val_len: *mut usize,
        ) -> c_int;
        pub fn rados_omap_get_end(iter: rados_omap_iter_t);
        pub fn rados_buffer_free(buf: *mut c_char);

        pub fn rados_lock_exclusive(
            io: rados_ioctx_t,
            oid: *const c_char,
            name: *const c_char,
            cookie: *const c_char,
            desc: *const c_char,
            duration: *mut libc::timeval,
            flags: u8,
        ) -> c_int;
        pub fn rados_unlock(
            io: rados_ioctx_t,
            oid: *const c_char,
            name: *const c_char,
            cookie: *const c_char,
        ) -> c_int;
        pub fn rados_break_lock(
            io: rados_ioctx_t,
            oid: *const c_char,
            name: *const c_char,
            client: *const c_char,
            cookie: *const c_char,
        ) -> c_int;

        pub fn rados_nobjects_list_open(io: rados_ioctx_t, ctx: *mut rados_list_ctx_t) -> c_int;
        pub fn rados_nobjects_list_next2(
            ctx: rados_list_ctx_t,
            entry: *mut *const c_char,
            key: *mut *const c_char,
            nspace: *mut *const c_char,
            entry_size: *mut usize,
            key_size: *mut usize,
            nspace_size: *mut usize,
        ) -> c_int;
        pub fn rados_nobjects_list_close(ctx: rados_list_ctx_t);

        pub fn rados_watch3(
            io: rados_ioctx_t,
            o: *const c_char,
            cookie: *mut u64,
            watchcb: rados_watchcb2_t,
            watcherrcb: rados_watcherrcb_t,
            timeout: u32,
            arg: *mut c_void,
        ) -> c_int;
        pub fn rados_unwatch2(io: rados_ioctx_t, cookie: u64) -> c_int;
        pub fn rados_watch_check(io: rados_ioctx_t, cookie: u64) -> c_int;
        pub fn rados_watch_flush(cluster: rados_t) -> c_int;
        pub fn rados_notify2(
            io: rados_ioctx_t,
            o: *const c_char,
            buf: *const c_char,
            buf_len: c_int,
            timeout_ms: u64,
            reply_buffer: *mut *mut c_char,
            reply_buffer_len: *mut usize,
        ) -> c_int;
        pub fn rados_notify_ack(
            io: rados_ioctx_t,
            o: *const c_char,
            notify_id: u64,
            cookie: u64,
            buf: *const c_char,
            buf_len: c_int,
        ) -> c_int;
    }

    /// A notify received on a watched object: (arg, notify id, watch cookie, notifier's
    /// id, payload, payload length).
    pub type rados_watchcb2_t =
        Option<unsafe extern "C" fn(*mut c_void, u64, u64, u64, *mut c_void, usize)>;
    /// A watch's session failed: (arg, watch cookie, negative errno).
    pub type rados_watcherrcb_t = Option<unsafe extern "C" fn(*mut c_void, u64, c_int)>;
}

/// A negative librados return value, as a positive errno.
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

/// A string for a C call; our strings never hold NUL (object names, pool names and lock
/// fields are checked before they get here), so one that does is refused as `EINVAL`.
pub fn c_string(s: &str) -> Result<CString, Errno> {
    CString::new(s).map_err(|_| Errno(libc::EINVAL))
}

// ---------------------------------------------------------------------------------------------
// Cluster and io contexts

/// A librados cluster handle (`rados_t`), shut down on drop.
pub struct Cluster {
    raw: sys::rados_t,
}

// SAFETY: librados cluster handles are thread-safe (librados serializes internally); the
// pointer is only freed in `Drop`, once every io context (which hold an `Arc<Cluster>`) is gone.
unsafe impl Send for Cluster {}
// SAFETY: as above; `&Cluster` methods only call thread-safe librados functions.
unsafe impl Sync for Cluster {}

impl Cluster {
    /// A handle for `client.<id>` of the cluster named "ceph" (not connected yet).
    pub fn create(client_id: &str) -> Result<Cluster, Errno> {
        let cluster = c_string("ceph")?;
        let name = c_string(&format!("client.{client_id}"))?;
        let mut raw = ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the strings live across the call.
        Errno::check(unsafe { sys::rados_create2(&mut raw, cluster.as_ptr(), name.as_ptr(), 0) })?;
        Ok(Cluster { raw })
    }

    /// Read a config file (`None`: librados' search: `$CEPH_CONF`, /etc/ceph/ceph.conf, ...).
    pub fn read_conf_file(&self, path: Option<&str>) -> Result<(), Errno> {
        let path = path.map(c_string).transpose()?;
        let p = path.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        // SAFETY: the handle is valid and not connected yet; `p` is NULL or a live C string.
        Errno::check(unsafe { sys::rados_conf_read_file(self.raw, p) })?;
        Ok(())
    }

    pub fn set_conf(&self, option: &str, value: &str) -> Result<(), Errno> {
        let (o, v) = (c_string(option)?, c_string(value)?);
        // SAFETY: valid handle; both strings live across the call.
        Errno::check(unsafe { sys::rados_conf_set(self.raw, o.as_ptr(), v.as_ptr()) })?;
        Ok(())
    }

    /// A config option's current value (for error messages).
    pub fn get_conf(&self, option: &str) -> Result<String, Errno> {
        let option = c_string(option)?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: valid handle; `buf` has `buf.len()` writable bytes; librados NUL-terminates
        // the value or fails with ENAMETOOLONG.
        Errno::check(unsafe {
            sys::rados_conf_get(
                self.raw,
                option.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// Connect (blocks up to `client_mount_timeout`).
    pub fn connect(&self) -> Result<(), Errno> {
        // SAFETY: valid, configured handle.
        Errno::check(unsafe { sys::rados_connect(self.raw) })?;
        Ok(())
    }

    /// This client's global id: lock holders are named `client.<instance id>`.
    pub fn instance_id(&self) -> u64 {
        // SAFETY: valid, connected handle (only called after `connect`).
        unsafe { sys::rados_get_instance_id(self.raw) }
    }

    /// Have the monitors blocklist the client at `address` (`IP:PORT/NONCE`) for
    /// `expire_seconds` (0: the cluster's default, an hour): the OSDs refuse its operations
    /// once their map says so (blocking: a monitor command).
    pub fn blocklist_add(&self, address: &str, expire_seconds: u32) -> Result<(), Errno> {
        let address = c_string(address)?;
        // SAFETY: valid, connected handle; librados only reads the string (the C API's `char *`
        // is not const, but `rados_blocklist_add` copies it into a `std::string`), which lives
        // across the call.
        Errno::check(unsafe {
            sys::rados_blocklist_add(self.raw, address.as_ptr().cast_mut(), expire_seconds)
        })?;
        Ok(())
    }

    /// Wait until this client has the newest OSD map (blocking): a blocklisting this client
    /// asked for is then in the map every later operation of every client carries.
    pub fn wait_for_latest_osdmap(&self) -> Result<(), Errno> {
        // SAFETY: valid, connected handle.
        Errno::check(unsafe { sys::rados_wait_for_latest_osdmap(self.raw) })?;
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: the handle came from rados_create2 and nothing uses it any more (io
        // contexts keep the cluster alive through their Arc).
        unsafe { sys::rados_shutdown(self.raw) }
    }
}

/// An io context: one pool and namespace of a connected cluster. The read snapshot and the
/// snapshot write context are per io context in librados; they are applied to an operation
/// when it is submitted, so the store keeps separate io contexts for head writes and
/// snapshot reads and serializes "set, then submit" on each (`&mut self` methods).
pub struct IoCtx {
    raw: sys::rados_ioctx_t,
    _cluster: Arc<Cluster>,
    /// Reads submitted on this context and not completed yet: dropping the context cancels
    /// them and waits for their completions (see `Drop`).
    reads: Arc<ReadsInFlight>,
}

/// The completions of an io context's reads in flight. librados takes a reference to the io
/// context for a write until it completes, but none for a read, whose completion still
/// reaches the context (`c->io->client`) when it fires: a read in flight when its context
/// was destroyed (its future dropped, then its store) made librados read freed memory.
#[derive(Default)]
struct ReadsInFlight {
    /// Completion addresses. An entry is removed under this lock before the completion's
    /// callback releases our reference, so a completion found here is still valid.
    completions: Mutex<HashSet<usize>>,
    /// Signalled when an entry is removed.
    removed: Condvar,
}

/// How long dropping an io context waits for its cancelled reads to complete before it
/// leaks the context (and keeps its cluster connected) instead of destroying it under them.
const CANCELLED_READS_WAIT: Duration = Duration::from_secs(10);

/// Reads submitted in this process and not completed yet (for the tests).
pub static READS_IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

// SAFETY: librados io contexts may be used from any thread; their only mutable state (read
// snapshot, write context) is changed through `&mut self` methods.
unsafe impl Send for IoCtx {}
// SAFETY: `&self` methods only submit operations and make thread-safe librados calls.
unsafe impl Sync for IoCtx {}

impl IoCtx {
    pub fn new(cluster: &Arc<Cluster>, pool: &str, namespace: &str) -> Result<IoCtx, Errno> {
        let pool = c_string(pool)?;
        let namespace = c_string(namespace)?;
        let mut raw = ptr::null_mut();
        // SAFETY: connected cluster handle, valid out-pointer, live C string.
        Errno::check(unsafe { sys::rados_ioctx_create(cluster.raw, pool.as_ptr(), &mut raw) })?;
        // SAFETY: `raw` was just created; librados copies the namespace string.
        unsafe { sys::rados_ioctx_set_namespace(raw, namespace.as_ptr()) };
        // Operations on a full pool (or cluster) fail at once with EDQUOT or ENOSPC, which
        // the store reports as `NoSpace` and NBD clients get as ENOSPC (qemu pauses the
        // guest), instead of waiting for space until the operation timeout says "timed out".
        // SAFETY: `raw` was just created and is not shared yet.
        unsafe { sys::rados_set_pool_full_try(raw) };
        Ok(IoCtx {
            raw,
            _cluster: cluster.clone(),
            reads: Arc::default(),
        })
    }

    /// The raw handle, for another binding that takes a `rados_ioctx_t` (librbd).
    pub fn raw(&self) -> *mut c_void {
        self.raw
    }

    /// Reads submitted after this see snapshot `snap` (`None`: the head).
    pub fn set_read_snap(&mut self, snap: Option<u64>) {
        // SAFETY: valid io context; exclusive access through `&mut self`.
        unsafe { sys::rados_ioctx_snap_set_read(self.raw, snap.unwrap_or(sys::LIBRADOS_SNAP_HEAD)) }
    }

    /// Writes submitted after this run under this self-managed snapshot context (`snaps`
    /// newest first; seq 0 and no snaps: none).
    pub fn set_write_context(&mut self, seq: u64, snaps: &[u64]) -> Result<(), Errno> {
        let mut snaps = snaps.to_vec();
        let n = c_int::try_from(snaps.len()).map_err(|_| Errno(libc::EINVAL))?;
        // SAFETY: valid io context, exclusive through `&mut self`; librados copies the array.
        Errno::check(unsafe {
            sys::rados_ioctx_selfmanaged_snap_set_write_ctx(self.raw, seq, snaps.as_mut_ptr(), n)
        })?;
        Ok(())
    }

    /// Submit a write operation on `oid`; the future resolves once it is durable on the OSDs.
    pub fn submit_write(&self, oid: &CStr, op: WriteOp) -> Result<Pending<WriteOp>, Errno> {
        let (raw_op, io, oid_ptr) = (op.raw, self.raw, oid.as_ptr());
        submit(op, None, move |c| {
            // SAFETY: the op, io context and completion are valid; `oid` outlives this call
            // (librados copies it); the op stays alive inside the payload until completion.
            unsafe { sys::rados_aio_write_op_operate(raw_op, io, c, oid_ptr, ptr::null_mut(), 0) }
        })
    }

    /// Submit a read operation on `oid` (at the io context's read snapshot).
    pub fn submit_read(&self, oid: &CStr, op: ReadOp) -> Result<Pending<ReadOp>, Errno> {
        let (raw_op, io, oid_ptr) = (op.raw, self.raw, oid.as_ptr());
        submit(op, Some(&self.reads), move |c| {
            // SAFETY: as in `submit_write`; every buffer the steps write into is owned by the
            // boxed payload, alive until the callback.
            unsafe { sys::rados_aio_read_op_operate(raw_op, io, c, oid_ptr, 0) }
        })
    }

    /// Allocate a self-managed snapshot id (a monitor round trip).
    pub fn snap_create(&self) -> Result<Pending<Box<u64>>, Errno> {
        let mut id = Box::new(0u64);
        let out: *mut u64 = &mut *id;
        let io = self.raw;
        // The snapshot operations' completions reach the cluster, not the io context.
        submit(id, None, move |c| {
            // SAFETY: `out` points into the boxed payload, which lives until the callback.
            unsafe { sys::rados_aio_ioctx_selfmanaged_snap_create(io, out, c) };
            0
        })
    }

    pub fn snap_remove(&self, snap: u64) -> Result<Pending<()>, Errno> {
        let io = self.raw;
        submit((), None, move |c| {
            // SAFETY: valid io context and completion.
            unsafe { sys::rados_aio_ioctx_selfmanaged_snap_remove(io, snap, c) };
            0
        })
    }

    /// Roll `oid` back to `snap` under the current write context (blocking).
    pub fn rollback(&self, oid: &CStr, snap: u64) -> Result<(), Errno> {
        // SAFETY: valid io context; `oid` is a live C string.
        Errno::check(unsafe {
            sys::rados_ioctx_selfmanaged_snap_rollback(self.raw, oid.as_ptr(), snap)
        })?;
        Ok(())
    }

    /// Take (or, with `renew`, extend) an exclusive lock (blocking).
    pub fn lock_exclusive(
        &self,
        oid: &CStr,
        name: &str,
        cookie: &str,
        description: &str,
        duration: Option<Duration>,
        renew: bool,
    ) -> Result<(), Errno> {
        let (name, cookie, description) =
            (c_string(name)?, c_string(cookie)?, c_string(description)?);
        // Rounded up to a microsecond: `cls_lock` takes a zero timeval for no expiry at all.
        let mut tv = duration.map(|d| libc::timeval {
            tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_usec: match (d.as_secs(), d.subsec_micros()) {
                (0, 0) => 1,
                (_, micros) => micros as libc::suseconds_t,
            },
        });
        let tv_ptr = tv
            .as_mut()
            .map_or(ptr::null_mut(), |t| t as *mut libc::timeval);
        let flags = if renew {
            sys::LIBRADOS_LOCK_FLAG_MUST_RENEW
        } else {
            0
        };
        // SAFETY: valid io context; all strings and the timeval live across the call.
        Errno::check(unsafe {
            sys::rados_lock_exclusive(
                self.raw,
                oid.as_ptr(),
                name.as_ptr(),
                cookie.as_ptr(),
                description.as_ptr(),
                tv_ptr,
                flags,
            )
        })?;
        Ok(())
    }

    pub fn unlock(&self, oid: &CStr, name: &str, cookie: &str) -> Result<(), Errno> {
        let (name, cookie) = (c_string(name)?, c_string(cookie)?);
        // SAFETY: valid io context; the strings live across the call.
        Errno::check(unsafe {
            sys::rados_unlock(self.raw, oid.as_ptr(), name.as_ptr(), cookie.as_ptr())
        })?;
        Ok(())
    }

    pub fn break_lock(
        &self,
        oid: &CStr,
        name: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), Errno> {
        let (name, client, cookie) = (c_string(name)?, c_string(client)?, c_string(cookie)?);
        // SAFETY: valid io context; the strings live across the call.
        Errno::check(unsafe {
            sys::rados_break_lock(
                self.raw,
                oid.as_ptr(),
                name.as_ptr(),
                client.as_ptr(),
                cookie.as_ptr(),
            )
        })?;
        Ok(())
    }

    /// The names of all objects in the io context's namespace (blocking; walks every PG).
    pub fn list_objects(&self) -> Result<Vec<Vec<u8>>, Errno> {
        let mut ctx = ptr::null_mut();
        // SAFETY: valid io context and out-pointer.
        Errno::check(unsafe { sys::rados_nobjects_list_open(self.raw, &mut ctx) })?;
        let mut names = Vec::new();
        let result = loop {
            let (mut entry, mut entry_len) = (ptr::null(), 0usize);
            // SAFETY: `ctx` is open; librados sets `entry`/`entry_len` to a buffer valid until
            // the next list call, which we copy at once. Key and namespace are not asked for.
            let r = unsafe {
                sys::rados_nobjects_list_next2(
                    ctx,
                    &mut entry,
                    ptr::null_mut(),
                    ptr::null_mut(),
                    &mut entry_len,
                    ptr::null_mut(),
                    ptr::null_mut(),
                )
            };
            if r == -libc::ENOENT {
                break Ok(names);
            }
            if r < 0 {
                break Err(Errno(-r));
            }
            // SAFETY: librados returned `entry_len` valid bytes at `entry`.
            names.push(
                unsafe { std::slice::from_raw_parts(entry.cast::<u8>(), entry_len) }.to_vec(),
            );
        };
        // SAFETY: `ctx` is open and closed exactly once.
        unsafe { sys::rados_nobjects_list_close(ctx) };
        result
    }
}

impl Drop for IoCtx {
    fn drop(&mut self) {
        if !self.cancel_reads_and_wait() {
            tracing::warn!(
                "leaking a RADOS io context: reads cancelled on it did not complete within \
                 {CANCELLED_READS_WAIT:?}"
            );
            // Its cluster stays connected too: shutting it down under the reads would free
            // what they still reach.
            std::mem::forget(self._cluster.clone());
            return;
        }
        // SAFETY: created by rados_ioctx_create; no operation is being submitted (we own it)
        // and no read is in flight on it; writes in flight hold a reference of their own.
        unsafe { sys::rados_ioctx_destroy(self.raw) }
    }
}

impl IoCtx {
    /// Cancel this context's reads in flight and wait until their completions have fired
    /// (after which librados no longer reaches the context for them); false if some did not
    /// within [`CANCELLED_READS_WAIT`].
    fn cancel_reads_and_wait(&self) -> bool {
        let mut completions = lock_unpoisoned(&self.reads.completions);
        if completions.is_empty() {
            return true;
        }
        tracing::debug!(reads = completions.len(), "cancelling reads in flight");
        for &c in completions.iter() {
            // SAFETY: valid io context; `c` is still in the set, so its callback has not
            // released our reference yet (it removes the entry under this lock first). A
            // cancelled read completes with ECANCELED; one already completing is not found
            // (ENOENT) and completes on its own.
            unsafe { sys::rados_aio_cancel(self.raw, c as sys::rados_completion_t) };
        }
        let deadline = Instant::now() + CANCELLED_READS_WAIT;
        while !completions.is_empty() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            completions = match self.reads.removed.wait_timeout(completions, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        true
    }
}

fn lock_unpoisoned<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Watch and notify

/// What a watch's callbacks need: shared by the [`Watch`] and any thread re-registering it,
/// at a fixed address for as long as librados may call back with it (its argument).
struct WatchContext {
    /// Holds the cluster alive for the threads that re-register the watch.
    io: Arc<IoCtx>,
    oid: CString,
    /// What every notify is acknowledged with.
    reply: Vec<u8>,
    /// Seconds the OSD keeps the watch of a client that stopped answering.
    timeout: u32,
    /// Written by registrations and unregistrations (which hold it across their round trip),
    /// read by [`Watch::status`], which never waits for it: a registration under way is a
    /// watch not held.
    state: RwLock<WatchState>,
}

struct WatchState {
    /// The current registration (0: none, between a loss and its re-registration). A cookie
    /// is librados' handle of the registration (a pointer), used only while it is
    /// registered: it is unregistered under the write lock.
    cookie: u64,
    /// Registrations since the first (0: the first, never lost).
    registration: u64,
    /// When the current registration was sent: the OSD holds the watch from before the
    /// registration succeeded, for at least its timeout from then (librados' own time of the
    /// last confirmation may be older at first).
    registered_at: Instant,
    /// The watched object is gone (a registration again found no object): nothing to retry.
    object_gone: bool,
    /// The `Watch` is gone: register nothing any more.
    dropped: bool,
}

impl WatchContext {
    fn state(&self) -> std::sync::RwLockWriteGuard<'_, WatchState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Register a watch with this context as the callbacks' argument; its cookie.
    fn register(self: &Arc<Self>, state: &mut WatchState) -> Result<u64, Errno> {
        let mut cookie = 0u64;
        let sent = Instant::now();
        // SAFETY: valid io context, live C string and out-pointer; the argument points at
        // this context, which stays allocated while librados may call back with it: the
        // `Watch` holds it until its last registration is unregistered and the callbacks
        // are flushed (`Unregistering::run`).
        Errno::check(unsafe {
            sys::rados_watch3(
                self.io.raw,
                self.oid.as_ptr(),
                &mut cookie,
                Some(on_notify),
                Some(on_watch_error),
                self.timeout,
                Arc::as_ptr(self).cast_mut().cast(),
            )
        })?;
        state.registered_at = sent;
        Ok(cookie)
    }

    /// After librados reported registration `lost` gone: unregister it and register anew,
    /// retrying every second while the OSDs do not take it, until the `Watch` is dropped or
    /// the client is found fenced.
    fn reregister(self: Arc<Self>, lost: u64) {
        let mut expected = lost;
        let mut failures = 0u32;
        loop {
            {
                let mut state = self.state();
                if state.dropped || state.cookie != expected {
                    return;
                }
                if expected != 0 {
                    // SAFETY: a cookie of a registration on this io context; librados.h asks
                    // for an errored watch to be unregistered before watching again.
                    unsafe { sys::rados_unwatch2(self.io.raw, expected) };
                    (state.cookie, expected) = (0, 0);
                }
                match self.register(&mut state) {
                    Ok(cookie) => {
                        state.cookie = cookie;
                        state.registration += 1;
                        tracing::warn!(lost, cookie, "a lost RADOS watch is registered again");
                        return;
                    }
                    // The object was removed while the watch was lost.
                    Err(Errno(libc::ENOENT)) => {
                        state.object_gone = true;
                        tracing::warn!(
                            "a lost RADOS watch is not registered again: its object is gone"
                        );
                        return;
                    }
                    // EBLOCKLISTED: this client was fenced, for good; nothing to retry.
                    Err(Errno(libc::ESHUTDOWN)) => {
                        tracing::warn!(
                            "a lost RADOS watch is not registered again: this client was fenced \
                             (blocklisted)"
                        );
                        return;
                    }
                    Err(e) => {
                        if failures == 0 {
                            tracing::warn!(error = %e, "registering a lost RADOS watch again failed; retrying every second");
                        }
                        failures += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// A watch on an object that acknowledges every notify with a fixed reply; registered again
/// if librados loses it, unregistered on drop. Holds its io context (and the cluster) alive.
pub struct Watch {
    context: Arc<WatchContext>,
}

impl Watch {
    /// Whether the OSD holds this watch now: librados confirms a watch by a ping every
    /// `objecter_tick_interval` (5 s); the OSD drops a watch it has not heard from for the
    /// watch's timeout, and then librados reports it lost at its next ping. A watch last
    /// confirmed nearly a timeout ago (this client cut off from the OSD, or stopped) counts as
    /// lost at once: the OSD may have dropped it, and a notify would not reach it.
    pub fn status(&self) -> WatchStatus {
        let context = &self.context;
        let state = match context.state.try_read() {
            Ok(state) => state,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // A registration or an unregistration under way.
            Err(std::sync::TryLockError::WouldBlock) => return WatchStatus::Lost,
        };
        if state.object_gone {
            return WatchStatus::ObjectGone;
        }
        if state.cookie == 0 {
            return WatchStatus::Lost;
        }
        // SAFETY: valid io context; the cookie is a registration on it that is not
        // unregistered: unregistering takes the state's write lock, held off by this read
        // guard. Only reads librados' record of the watch.
        let check = unsafe { sys::rados_watch_check(context.io.raw, state.cookie) };
        status_from_check(
            check,
            state.registered_at.elapsed(),
            Duration::from_secs(u64::from(context.timeout)),
            state.registration,
        )
    }
}

/// A registered watch's status from librados' check of it (`rados_watch_check`: an error
/// below 0, else one more than the milliseconds since the OSD last confirmed it), the time
/// since its registration was sent (confirmed from then, where librados' time may be
/// older) and its timeout.
fn status_from_check(
    check: c_int,
    since_registered: Duration,
    timeout: Duration,
    registration: u64,
) -> WatchStatus {
    if check <= 0 {
        return WatchStatus::Lost;
    }
    let confirmed_ago = Duration::from_millis(check as u64 - 1).min(since_registered);
    // A tenth of the timeout's margin for the OSD's timer and the clocks' rates.
    if confirmed_ago >= timeout - timeout / 10 {
        return WatchStatus::Lost;
    }
    WatchStatus::Held { registration }
}

unsafe extern "C" fn on_notify(
    arg: *mut c_void,
    notify_id: u64,
    cookie: u64,
    _notifier: u64,
    _data: *mut c_void,
    _data_len: usize,
) {
    // SAFETY: `arg` is the `WatchContext` of a registration, alive while librados may call
    // back with it (see `WatchContext::register`).
    let context = unsafe { &*arg.cast::<WatchContext>() };
    let len = context.reply.len().min(c_int::MAX as usize) as c_int;
    // SAFETY: valid io context, live C string and reply buffer; the ack is sent
    // asynchronously and librados copies the reply. A failed ack only makes this watch count
    // as unanswered at the notifier, which then refuses to go on.
    let _ = unsafe {
        sys::rados_notify_ack(
            context.io.raw,
            context.oid.as_ptr(),
            notify_id,
            cookie,
            context.reply.as_ptr().cast(),
            len,
        )
    };
}

unsafe extern "C" fn on_watch_error(arg: *mut c_void, cookie: u64, err: c_int) {
    // librados re-establishes watches across reconnections and PG moves by itself; this is
    // called when it could not (this client was cut off from the OSD for longer than the
    // watch timeout): the watch is gone, and with it what kept removals off until it is
    // registered again, from a thread of our own (not librados' callback thread).
    tracing::warn!(
        cookie,
        error = %Errno(-err),
        "a RADOS watch was lost (cut off from its OSD for longer than the watch timeout); \
         registering it again"
    );
    let context = arg.cast::<WatchContext>().cast_const();
    // SAFETY: `arg` is a live `Arc<WatchContext>`'s pointer (see `WatchContext::register`);
    // one more strong count for the thread, taken back by `from_raw`.
    let context = unsafe {
        Arc::increment_strong_count(context);
        Arc::from_raw(context)
    };
    if let Err(e) = std::thread::Builder::new()
        .name("ivdisk-rewatch".into())
        .spawn(move || context.reregister(cookie))
    {
        tracing::warn!(error = %e, "no thread to register a lost RADOS watch again");
    }
}

/// The answers to a notify: every watcher that acknowledged it (its client's global id and
/// its reply), and the global ids of those that did not answer in time.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NotifyReplies {
    pub acks: Vec<(u64, Vec<u8>)>,
    pub timeouts: Vec<u64>,
}

/// Decode a notify's reply buffer (its format is documented at `rados_notify2` in
/// librados.h: le32 count, {le64 gid, le64 cookie, le32 length, payload} acks, le32 count,
/// {le64 gid, le64 cookie} timeouts). `None` when it is cut short.
pub fn decode_notify_replies(buf: &[u8]) -> Option<NotifyReplies> {
    fn take<'a>(buf: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (buf.get(..n)?, buf.get(n..)?);
        *buf = rest;
        Some(head)
    }
    fn u32_le(buf: &mut &[u8]) -> Option<u32> {
        Some(u32::from_le_bytes(take(buf, 4)?.try_into().ok()?))
    }
    fn u64_le(buf: &mut &[u8]) -> Option<u64> {
        Some(u64::from_le_bytes(take(buf, 8)?.try_into().ok()?))
    }
    let mut buf = buf;
    let mut replies = NotifyReplies::default();
    for _ in 0..u32_le(&mut buf)? {
        let gid = u64_le(&mut buf)?;
        let _cookie = u64_le(&mut buf)?;
        let len = u32_le(&mut buf)? as usize;
        replies.acks.push((gid, take(&mut buf, len)?.to_vec()));
    }
    for _ in 0..u32_le(&mut buf)? {
        replies.timeouts.push(u64_le(&mut buf)?);
        let _cookie = u64_le(&mut buf)?;
    }
    Some(replies)
}

impl IoCtx {
    /// Watch `oid` (which must exist), answering every notify with `reply` (blocking). The
    /// OSDs drop the watch `timeout` after this client stops answering (it died, say).
    pub fn watch(
        self: &Arc<Self>,
        oid: &CStr,
        reply: Vec<u8>,
        timeout: Duration,
    ) -> Result<Watch, Errno> {
        let context = Arc::new(WatchContext {
            io: self.clone(),
            oid: oid.to_owned(),
            reply,
            timeout: timeout.as_secs().clamp(1, u32::MAX as u64) as u32,
            state: RwLock::new(WatchState {
                cookie: 0,
                registration: 0,
                registered_at: Instant::now(),
                object_gone: false,
                dropped: false,
            }),
        });
        // Held across the registration: a loss reported at once waits for its cookie.
        let mut state = context.state();
        state.cookie = context.register(&mut state)?;
        drop(state);
        Ok(Watch { context })
    }

    /// Notify the watchers of `oid` with an empty payload and collect their replies
    /// (blocking, up to `timeout` for watchers that do not answer).
    pub fn notify(&self, oid: &CStr, timeout: Duration) -> Result<NotifyReplies, Errno> {
        let mut reply: *mut c_char = ptr::null_mut();
        let mut reply_len = 0usize;
        // SAFETY: valid io context, live C string, an empty payload, valid out-pointers.
        let r = unsafe {
            sys::rados_notify2(
                self.raw,
                oid.as_ptr(),
                ptr::null(),
                0,
                timeout.as_millis().min(u64::MAX as u128) as u64,
                &mut reply,
                &mut reply_len,
            )
        };
        // The buffer is set even when some watchers timed out (ETIMEDOUT).
        let decoded = if reply.is_null() {
            None
        } else {
            // SAFETY: librados allocated `reply_len` bytes at `reply`.
            let bytes = unsafe { std::slice::from_raw_parts(reply.cast::<u8>(), reply_len) };
            let decoded = decode_notify_replies(bytes);
            // SAFETY: allocated by librados for this call, freed once.
            unsafe { sys::rados_buffer_free(reply) };
            decoded
        };
        match (Errno::check(r), decoded) {
            (Ok(_) | Err(Errno(libc::ETIMEDOUT)), Some(replies)) => Ok(replies),
            (Err(e), _) => Err(e),
            (Ok(_), None) => Err(Errno(libc::EBADMSG)),
        }
    }
}

/// How long dropping a [`Watch`] waits for its unregistration: it is a round trip to the
/// OSD, which waits for OSDs that are down (without an op timeout, for ever). After this the
/// drop returns and the unregistration goes on by itself; if the client goes away first, the
/// OSD drops the watch after its timeout.
const UNWATCH_WAIT: Duration = Duration::from_secs(10);

/// A dropped watch's context on its way to the thread that unregisters the watch.
struct Unregistering {
    context: Arc<WatchContext>,
}

impl Unregistering {
    fn run(self) {
        let cookie = {
            let mut state = self.context.state();
            state.dropped = true;
            std::mem::take(&mut state.cookie)
        };
        if cookie != 0 {
            // SAFETY: the cookie came from a successful rados_watch3 on this io context.
            let r = unsafe { sys::rados_unwatch2(self.context.io.raw, cookie) };
            if r < 0 {
                tracing::debug!(error = %Errno(-r), "unwatching a RADOS object");
            }
        }
        // SAFETY: a valid, connected cluster handle (the io context holds it alive). After
        // this, no callback of an unregistered watch runs any more, and with `dropped` set
        // nothing registers one: the context may go.
        unsafe { sys::rados_watch_flush(self.context.io._cluster.raw) };
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let job = Unregistering {
            context: self.context.clone(),
        };
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("ivdisk-unwatch".into())
            .spawn(move || {
                job.run();
                let _ = done.send(());
            });
        match spawned {
            Ok(_) => {
                if finished.recv_timeout(UNWATCH_WAIT).is_err() {
                    tracing::warn!(
                        "a RADOS watch is not unregistered yet (are OSDs down?); going on, the \
                         OSD drops it when it comes back or after its timeout"
                    );
                }
            }
            // A failed spawn drops the closure unrun: unregister here, however long it takes.
            Err(e) => {
                tracing::debug!(error = %e, "unwatching without a thread");
                Unregistering {
                    context: self.context.clone(),
                }
                .run();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous completions

/// What a completed operation hands back: its payload (buffers now filled), the operation's
/// return value and the object version it reported.
pub struct Done<T> {
    pub payload: T,
    pub rval: i32,
    pub version: u64,
}

/// A submitted operation; resolves when librados completes it.
pub type Pending<T> = oneshot::Receiver<Done<T>>;

struct Inflight<T> {
    payload: T,
    done: oneshot::Sender<Done<T>>,
    /// For a read: its io context's reads in flight, which it leaves on completion.
    read_of: Option<Arc<ReadsInFlight>>,
}

extern "C" fn on_complete<T: Send + 'static>(c: sys::rados_completion_t, arg: *mut c_void) {
    // SAFETY: `arg` is the `Box<Inflight<T>>` leaked by `submit` for this completion, and
    // librados calls this callback exactly once, so the box is reclaimed exactly once.
    let inflight = unsafe { Box::from_raw(arg.cast::<Inflight<T>>()) };
    // SAFETY: `c` is the completion this callback belongs to; it is still valid here.
    let (rval, version) = unsafe {
        (
            sys::rados_aio_get_return_value(c),
            sys::rados_aio_get_version(c),
        )
    };
    let Inflight {
        payload,
        done,
        read_of,
    } = *inflight;
    if let Some(reads) = read_of {
        // Before the release below: a context being dropped cancels only the completions it
        // finds in the set, so it never cancels a released one. Once this callback runs,
        // librados has finished with the io context for this read.
        lock_unpoisoned(&reads.completions).remove(&(c as usize));
        READS_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        reads.removed.notify_all();
    }
    // SAFETY: drops our reference; librados holds its own until the callback returns.
    unsafe { sys::rados_aio_release(c) };
    // A dropped receiver gets the payload dropped here, which frees its librados buffers.
    let _ = done.send(Done {
        payload,
        rval,
        version,
    });
}

/// Leak `payload` into a new completion's callback argument and run `start` (which must submit
/// an operation using that completion, touching the payload only through raw pointers taken
/// before). On a submission error the callback never runs, so the payload is reclaimed here.
/// A read (`read_of`: its io context's reads in flight) is entered there before it is
/// submitted, so that its callback always finds its entry.
fn submit<T: Send + 'static>(
    payload: T,
    read_of: Option<&Arc<ReadsInFlight>>,
    start: impl FnOnce(sys::rados_completion_t) -> c_int,
) -> Result<Pending<T>, Errno> {
    let (done, pending) = oneshot::channel();
    let read_of = read_of.cloned();
    let reads = read_of.clone();
    let inflight = Box::into_raw(Box::new(Inflight {
        payload,
        done,
        read_of,
    }));
    let mut c = ptr::null_mut();
    // SAFETY: valid out-pointer; the callback is a monomorphized `on_complete::<T>` matching
    // the argument's type.
    let r = unsafe {
        sys::rados_aio_create_completion2(inflight.cast(), Some(on_complete::<T>), &mut c)
    };
    if r < 0 {
        // SAFETY: no completion exists, so nobody else will reclaim the box.
        drop(unsafe { Box::from_raw(inflight) });
        return Err(Errno(-r));
    }
    if let Some(reads) = &reads {
        lock_unpoisoned(&reads.completions).insert(c as usize);
        READS_IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
    }
    let r = start(c);
    if r < 0 {
        if let Some(reads) = &reads {
            lock_unpoisoned(&reads.completions).remove(&(c as usize));
            READS_IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
        }
        // SAFETY: the operation was refused, so the callback will never run: release the
        // completion and reclaim the box here, exactly once.
        unsafe {
            sys::rados_aio_release(c);
            drop(Box::from_raw(inflight));
        }
        return Err(Errno(-r));
    }
    Ok(pending)
}

// ---------------------------------------------------------------------------------------------
// Write operations

/// A compound write operation (`rados_write_op_t`): the steps apply atomically on the OSD.
/// librados copies data and keys into the operation when a step is added.
pub struct WriteOp {
    raw: sys::rados_write_op_t,
}

// SAFETY: the op handle is owned exclusively by this value and only used by one thread at a
// time (built, then submitted, then released).
unsafe impl Send for WriteOp {}

/// Pointer and length arrays for a list of byte strings, as the `*2` omap calls take them.
fn byte_arrays(items: &[&[u8]]) -> (Vec<*const c_char>, Vec<usize>) {
    (
        items.iter().map(|i| i.as_ptr().cast()).collect(),
        items.iter().map(|i| i.len()).collect(),
    )
}

impl WriteOp {
    pub fn new() -> Result<WriteOp, Errno> {
        // SAFETY: plain allocation; NULL on failure.
        let raw = unsafe { sys::rados_create_write_op() };
        if raw.is_null() {
            return Err(Errno(libc::ENOMEM));
        }
        Ok(WriteOp { raw })
    }

    pub fn create_exclusive(&mut self) {
        // SAFETY: valid op; a NULL category is allowed (unused by librados).
        unsafe { sys::rados_write_op_create(self.raw, sys::LIBRADOS_CREATE_EXCLUSIVE, ptr::null()) }
    }

    pub fn assert_exists(&mut self) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_assert_exists(self.raw) }
    }

    pub fn assert_version(&mut self, version: u64) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_assert_version(self.raw, version) }
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        // SAFETY: valid op; librados copies `data` into the op before returning.
        unsafe { sys::rados_write_op_write(self.raw, data.as_ptr().cast(), data.len(), offset) }
    }

    pub fn write_full(&mut self, data: &[u8]) {
        // SAFETY: valid op; librados copies `data`.
        unsafe { sys::rados_write_op_write_full(self.raw, data.as_ptr().cast(), data.len()) }
    }

    pub fn zero(&mut self, offset: u64, len: u64) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_zero(self.raw, offset, len) }
    }

    pub fn truncate(&mut self, size: u64) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_truncate(self.raw, size) }
    }

    pub fn remove(&mut self) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_remove(self.raw) }
    }

    /// Set the pairs (`keys[i]`, `values[i]`); the two are of one length.
    pub fn omap_set(&mut self, keys: &[&[u8]], values: &[&[u8]]) {
        assert_eq!(keys.len(), values.len(), "a value per key");
        let (key_ptrs, key_lens) = byte_arrays(keys);
        let (value_ptrs, value_lens) = byte_arrays(values);
        // SAFETY: valid op; four arrays of `keys.len()` entries pointing at live bytes;
        // librados encodes them into the op before returning.
        unsafe {
            sys::rados_write_op_omap_set2(
                self.raw,
                key_ptrs.as_ptr(),
                value_ptrs.as_ptr(),
                key_lens.as_ptr(),
                value_lens.as_ptr(),
                keys.len(),
            )
        }
    }

    pub fn omap_remove_keys(&mut self, keys: &[Vec<u8>]) {
        let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let (ptrs, lens) = byte_arrays(&keys);
        // SAFETY: valid op; arrays of `keys.len()` entries pointing at live bytes, copied.
        unsafe {
            sys::rados_write_op_omap_rm_keys2(self.raw, ptrs.as_ptr(), lens.as_ptr(), keys.len())
        }
    }

    pub fn omap_remove_range(&mut self, start: &[u8], end: &[u8]) {
        // SAFETY: valid op; both keys are live byte ranges, copied by librados.
        unsafe {
            sys::rados_write_op_omap_rm_range2(
                self.raw,
                start.as_ptr().cast(),
                start.len(),
                end.as_ptr().cast(),
                end.len(),
            )
        }
    }

    pub fn omap_clear(&mut self) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_omap_clear(self.raw) }
    }

    /// Tell BlueStore the expected object and write sizes (allocation hint, no semantics).
    pub fn set_alloc_hint(&mut self, object_size: u64, write_size: u64) {
        // SAFETY: valid op.
        unsafe { sys::rados_write_op_set_alloc_hint2(self.raw, object_size, write_size, 0) }
    }
}

impl Drop for WriteOp {
    fn drop(&mut self) {
        // SAFETY: created by rados_create_write_op, released once; dropped only after its
        // completion ran (or if it was never submitted).
        unsafe { sys::rados_release_write_op(self.raw) }
    }
}

// ---------------------------------------------------------------------------------------------
// Read operations

/// Where one read step's results land. Boxed, so the addresses handed to librados stay put
/// while the op is built and in flight.
enum Slot {
    Read {
        buf: Vec<u8>,
        bytes_read: usize,
        rval: c_int,
    },
    Stat {
        size: u64,
        mtime: libc::time_t,
        rval: c_int,
    },
    Omap {
        iter: sys::rados_omap_iter_t,
        more: u8,
        rval: c_int,
    },
    Exec {
        out: *mut c_char,
        out_len: usize,
        rval: c_int,
    },
}

/// One read step's result.
#[derive(Debug)]
pub enum SlotResult {
    Read(Vec<u8>),
    Stat { size: u64 },
    Omap { pairs: OmapPairs, more: bool },
    Exec(Vec<u8>),
}

/// A compound read operation (`rados_read_op_t`): its steps see one state of the object.
pub struct ReadOp {
    raw: sys::rados_read_op_t,
    // Boxed on purpose: librados holds pointers into earlier slots while later ones are
    // pushed, so a slot must not move when the vector grows.
    #[allow(clippy::vec_box)]
    slots: Vec<Box<Slot>>,
}

// SAFETY: the op handle, the omap iterators and exec buffers in the slots are owned
// exclusively by this value; librados only writes into the slots until the completion, after
// which one thread at a time uses the value.
unsafe impl Send for ReadOp {}

impl ReadOp {
    pub fn new() -> Result<ReadOp, Errno> {
        // SAFETY: plain allocation; NULL on failure.
        let raw = unsafe { sys::rados_create_read_op() };
        if raw.is_null() {
            return Err(Errno(libc::ENOMEM));
        }
        Ok(ReadOp {
            raw,
            slots: Vec::new(),
        })
    }

    fn push(&mut self, slot: Slot) -> &mut Slot {
        self.slots.push(Box::new(slot));
        self.slots.last_mut().expect("just pushed")
    }

    /// A new omap slot's out-parameters: iterator, "more" flag, return value.
    fn push_omap(&mut self) -> (&mut sys::rados_omap_iter_t, &mut u8, &mut c_int) {
        match self.push(Slot::Omap {
            iter: ptr::null_mut(),
            more: 0,
            rval: 0,
        }) {
            Slot::Omap { iter, more, rval } => (iter, more, rval),
            _ => unreachable!("just pushed an omap slot"),
        }
    }

    /// Read up to `len` bytes at `offset` (fewer at the object's end; holes read as zeros).
    pub fn read(&mut self, offset: u64, len: usize) {
        let raw = self.raw;
        let Slot::Read {
            buf,
            bytes_read,
            rval,
        } = self.push(Slot::Read {
            buf: Vec::with_capacity(len),
            bytes_read: 0,
            rval: 0,
        })
        else {
            unreachable!()
        };
        // SAFETY: valid op; `buf` has capacity `len` and, like `bytes_read` and `rval`, lives
        // in a boxed slot that outlives the operation. librados writes at most `len` bytes.
        unsafe {
            sys::rados_read_op_read(raw, offset, len, buf.as_mut_ptr().cast(), bytes_read, rval)
        }
    }

    pub fn stat(&mut self) {
        let raw = self.raw;
        let Slot::Stat { size, mtime, rval } = self.push(Slot::Stat {
            size: 0,
            mtime: 0,
            rval: 0,
        }) else {
            unreachable!()
        };
        // SAFETY: valid op; the out-parameters live in a boxed slot that outlives the op.
        unsafe { sys::rados_read_op_stat(raw, size, mtime, rval) }
    }

    /// Up to `max` pairs with keys after `start_after` (a C string: RADOS takes no NUL here).
    pub fn omap_get_vals(&mut self, start_after: &CStr, max: u64) {
        let raw = self.raw;
        let (iter, more, rval) = self.push_omap();
        // SAFETY: valid op; librados copies `start_after` into the op; the out-parameters live
        // in a boxed slot that outlives the op.
        unsafe {
            sys::rados_read_op_omap_get_vals2(
                raw,
                start_after.as_ptr(),
                ptr::null(),
                max,
                iter,
                more,
                rval,
            )
        }
    }

    pub fn omap_get_vals_by_keys(&mut self, keys: &[Vec<u8>]) {
        let raw = self.raw;
        let keys: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let (ptrs, lens) = byte_arrays(&keys);
        let (iter, _, rval) = self.push_omap();
        // SAFETY: valid op; the key arrays are live for the call and copied by librados; the
        // out-parameters live in a boxed slot that outlives the op.
        unsafe {
            sys::rados_read_op_omap_get_vals_by_keys2(
                raw,
                ptrs.as_ptr(),
                keys.len(),
                lens.as_ptr(),
                iter,
                rval,
            )
        }
    }

    /// Call object class method `class.method` with `input` (read-only methods only).
    pub fn exec(&mut self, class: &CStr, method: &CStr, input: &[u8]) {
        let raw = self.raw;
        let Slot::Exec { out, out_len, rval } = self.push(Slot::Exec {
            out: ptr::null_mut(),
            out_len: 0,
            rval: 0,
        }) else {
            unreachable!()
        };
        // SAFETY: valid op; names and input are copied by librados; the out-parameters live in
        // a boxed slot that outlives the op; `out` is freed with rados_buffer_free in `Drop`.
        unsafe {
            sys::rados_read_op_exec(
                raw,
                class.as_ptr(),
                method.as_ptr(),
                input.as_ptr().cast(),
                input.len(),
                out,
                out_len,
                rval,
            )
        }
    }

    /// The steps' results in order (after completion; a step that failed gives its errno).
    /// What librados allocated (iterators, exec output) is freed by `Drop`.
    pub fn results(mut self) -> Vec<Result<SlotResult, Errno>> {
        self.slots
            .iter_mut()
            .map(|slot| match &mut **slot {
                Slot::Read { rval, .. }
                | Slot::Stat { rval, .. }
                | Slot::Omap { rval, .. }
                | Slot::Exec { rval, .. }
                    if *rval < 0 =>
                {
                    Err(Errno(-*rval))
                }
                Slot::Read {
                    buf, bytes_read, ..
                } => {
                    let n = (*bytes_read).min(buf.capacity());
                    // SAFETY: librados wrote `bytes_read` (at most the capacity we gave it)
                    // initialized bytes at the start of `buf`.
                    unsafe { buf.set_len(n) };
                    Ok(SlotResult::Read(std::mem::take(buf)))
                }
                Slot::Stat { size, .. } => Ok(SlotResult::Stat { size: *size }),
                Slot::Omap { iter, more, .. } => Ok(SlotResult::Omap {
                    pairs: drain_omap(iter),
                    more: *more != 0,
                }),
                Slot::Exec { out, out_len, .. } => Ok(SlotResult::Exec(if out.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: librados allocated `out_len` bytes at `out` (freed in `Drop`).
                    unsafe { std::slice::from_raw_parts(out.cast::<u8>(), *out_len) }.to_vec()
                })),
            })
            .collect()
    }
}

/// Copy every pair out of an omap iterator and end it (it is NULL if the step never ran).
fn drain_omap(iter: &mut sys::rados_omap_iter_t) -> OmapPairs {
    let mut pairs = OmapPairs::new();
    if iter.is_null() {
        return pairs;
    }
    loop {
        let (mut k, mut v, mut kl, mut vl) = (ptr::null_mut(), ptr::null_mut(), 0usize, 0usize);
        // SAFETY: `*iter` is a live iterator from a completed step; librados sets the
        // pointers to buffers valid until the next call, copied at once below.
        let r = unsafe { sys::rados_omap_get_next2(*iter, &mut k, &mut v, &mut kl, &mut vl) };
        if r < 0 || k.is_null() {
            break;
        }
        // SAFETY: librados returned `kl` and `vl` valid bytes at `k` and `v` (v may be NULL
        // for an empty value).
        let key = unsafe { std::slice::from_raw_parts(k.cast::<u8>(), kl) };
        let value = if v.is_null() {
            &[][..]
        } else {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(v.cast::<u8>(), vl) }
        };
        pairs.push(key, value);
    }
    // SAFETY: ends the live iterator exactly once; NULL afterwards so `Drop` skips it.
    unsafe { sys::rados_omap_get_end(*iter) };
    *iter = ptr::null_mut();
    pairs
}

impl Drop for ReadOp {
    fn drop(&mut self) {
        for slot in &mut self.slots {
            match &mut **slot {
                Slot::Omap { iter, .. } if !iter.is_null() => {
                    // SAFETY: a live iterator from a completed step, ended once.
                    unsafe { sys::rados_omap_get_end(*iter) };
                    *iter = ptr::null_mut();
                }
                Slot::Exec { out, .. } if !out.is_null() => {
                    // SAFETY: a buffer librados allocated for this step, freed once.
                    unsafe { sys::rados_buffer_free(*out) };
                    *out = ptr::null_mut();
                }
                _ => {}
            }
        }
        // SAFETY: created by rados_create_read_op, released once, after its completion ran
        // (or if it was never submitted).
        unsafe { sys::rados_release_read_op(self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_not_confirmed_for_nearly_its_timeout_counts_as_lost() {
        let timeout = Duration::from_secs(30);
        let secs = Duration::from_secs;
        let status = |check, since| status_from_check(check, since, timeout, 2);
        let held = WatchStatus::Held { registration: 2 };
        // Confirmed a second ago, registered long before.
        assert_eq!(status(1001, secs(600)), held);
        // librados' errors (ENOTCONN: the OSD said it dropped the watch).
        assert_eq!(status(-libc::ENOTCONN, secs(1)), WatchStatus::Lost);
        // Not confirmed for 27 s (nine tenths of the timeout) and more: maybe dropped.
        assert_eq!(status(26_001, secs(600)), held);
        assert_eq!(status(27_001, secs(600)), WatchStatus::Lost);
        assert_eq!(status(90_001, secs(600)), WatchStatus::Lost);
        // Just registered: held from the registration on, whatever librados' last
        // confirmation says (it may predate the registration).
        assert_eq!(status(90_001, secs(1)), held);
        assert_eq!(status(90_001, secs(28)), WatchStatus::Lost);
    }

    #[test]
    fn notify_replies_decode_as_librados_documents_them() {
        let mut buf = Vec::new();
        buf.extend(2u32.to_le_bytes());
        for (gid, cookie, reply) in [(4101u64, 7u64, &b"one"[..]), (4102, 9, b"")] {
            buf.extend(gid.to_le_bytes());
            buf.extend(cookie.to_le_bytes());
            buf.extend((reply.len() as u32).to_le_bytes());
            buf.extend(reply);
        }
        buf.extend(1u32.to_le_bytes());
        buf.extend(4103u64.to_le_bytes());
        buf.extend(11u64.to_le_bytes());
        let replies = decode_notify_replies(&buf).unwrap();
        assert_eq!(
            replies,
            NotifyReplies {
                acks: vec![(4101, b"one".to_vec()), (4102, Vec::new())],
                timeouts: vec![4103],
            }
        );
        // Cut anywhere short of the end: refused, never read past.
        for len in 0..buf.len() {
            assert_eq!(decode_notify_replies(&buf[..len]), None, "cut at {len}");
        }
    }
}
