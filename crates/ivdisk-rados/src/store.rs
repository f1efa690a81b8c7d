//! [`RadosStore`]: the store trait's semantics on RADOS, over the `ffi` module.

use std::ffi::CString;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use futures_channel::oneshot;
use ivdisk_store::{
    check_range, Extent, LockRequest, Locker, NotifyReplies, ObjectName, ObjectStore,
    ObjectStoreExt, OmapPairs, ReadOp, ReadResult, ReadStep, SnapContext, SnapId, Stat, StoreError,
    Watch, WatchRegistration, WatchStatus, WriteOp, WriteOutcome, WriteStep, MAX_OBJECT_SIZE,
};

use crate::ffi::{self, Cluster, Errno, IoCtx, SlotResult};
use crate::{lock_info, RadosConfig, RadosError};

/// A connected io context (a pool and namespace) for FFI users; see
/// [`RadosStore::raw_io_context`]. It keeps its cluster connection alive, so a handle that
/// librbd dups from it stays valid for as long as this value lives.
#[derive(Clone)]
pub struct RawIoContext {
    io: Arc<IoCtx>,
}

impl RawIoContext {
    /// The `rados_ioctx_t`, valid while this value lives. For FFI users only: the callee may
    /// submit operations and duplicate the context (as `rbd_open` does) but must not destroy
    /// it, nor change its namespace, read snapshot or snapshot write context (the store
    /// relies on them).
    pub fn as_ptr(&self) -> *mut std::ffi::c_void {
        self.io.raw()
    }
}

/// An object store on one RADOS pool and namespace.
///
/// Where librados' C API cannot give what the trait describes, this store says so:
/// - no sparse read: read steps return every byte up to the object's size, holes as zeros
///   ([`ObjectStore::distinguishes_holes`] is `false`);
/// - rollback is a call of its own, not a step: a [`WriteStep::Rollback`] must be the only
///   step of its operation (`InvalidOperation` otherwise);
/// - omap range reads take their start as a C string: a range whose start key holds a NUL
///   byte is read from the key's NUL-free prefix, which only reaches starts within the OSD's
///   per-request listing limit (1024 keys by default) of it; beyond, `InvalidOperation`;
/// - a removed snapshot cannot be told from one where the object did not exist: a read at it
///   fails `NotFound`, where the other backends say `NoSuchSnapshot`.
///
/// Acknowledged writes are already durable on every replica, so `flush` has nothing to do.
pub struct RadosStore {
    /// Head writes, with the snapshot write context last set on them.
    writes: Mutex<(IoCtx, Option<SnapContext>)>,
    /// Reads, with the snapshot they were last pointed at. A separate io context, because
    /// librados refuses writes on one whose read snapshot is not the head.
    reads: Mutex<(IoCtx, Option<SnapId>)>,
    /// Locks, listing, snapshot ids: never points at a snapshot or carries a write context.
    control: Arc<IoCtx>,
    /// Rollbacks run (blocking) under their operation's write context.
    rollbacks: Arc<Mutex<IoCtx>>,
    client: String,
    /// The cephx user (`client.<id>`) this store connected as: whose capabilities count.
    user: String,
    pool: String,
    expected_object_size: Option<u64>,
    cluster: Arc<Cluster>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Run a blocking librados call on a helper thread.
async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, StoreError> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("ivdisk-rados".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|source| StoreError::Io {
            context: format!("starting a thread for {what}"),
            source,
        })?;
    rx.await
        .map_err(|_| StoreError::Closed(format!("the librados call for {what} panicked")))
}

fn cstring(object: &ObjectName) -> CString {
    // ObjectName holds printable ASCII only, never NUL.
    CString::new(object.as_str()).expect("object names hold no NUL")
}

fn invalid(object: &ObjectName, reason: impl Into<String>) -> StoreError {
    StoreError::InvalidOperation {
        object: object.to_string(),
        reason: reason.into(),
    }
}

fn closed(_: oneshot::Canceled) -> StoreError {
    StoreError::Closed("librados dropped an operation without completing it".into())
}

impl RadosStore {
    /// Connect to the cluster and open the pool (blocks a helper thread for up to
    /// `config.connect_timeout`).
    pub async fn open(config: &RadosConfig) -> Result<RadosStore, RadosError> {
        let config = config.clone();
        blocking("connecting", move || Self::open_blocking(&config))
            .await
            .map_err(|e| RadosError::Invalid(e.to_string()))?
    }

    fn open_blocking(config: &RadosConfig) -> Result<RadosStore, RadosError> {
        let client_id = &config.client_id;
        if client_id.is_empty() || !client_id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(RadosError::Invalid(format!(
                "client id {client_id:?}: give a name such as `admin` (without `client.`)"
            )));
        }
        if config.pool.is_empty() || config.pool.contains('\0') {
            return Err(RadosError::Invalid(format!("pool name {:?}", config.pool)));
        }
        if config.namespace.contains('\0') {
            return Err(RadosError::Invalid(format!(
                "namespace {:?}",
                config.namespace
            )));
        }
        // librados would only fail the connect with ENOENT, which reads as the cluster
        // refusing the client.
        if let Some(missing) = config.keyring.as_ref().filter(|k| !k.exists()) {
            return Err(RadosError::Invalid(format!(
                "keyring file {} (keyring= in the address) does not exist",
                missing.display()
            )));
        }
        let cluster = Cluster::create(client_id).map_err(|e| RadosError::Connect {
            client: client_id.clone(),
            source: e.io_error(),
        })?;
        let conf = config.conf.as_ref().map(|p| p.display().to_string());
        cluster
            .read_conf_file(conf.as_deref())
            .map_err(|e| RadosError::ConfigFile {
                path: conf
                    .clone()
                    .unwrap_or_else(|| "$CEPH_CONF or /etc/ceph/ceph.conf".into()),
                source: e.io_error(),
            })?;
        let set = |option: &str, value: String| {
            cluster
                .set_conf(option, &value)
                .map_err(|e| RadosError::ConfigOption {
                    option: option.into(),
                    value: value.clone(),
                    source: e.io_error(),
                })
        };
        if let Some(keyring) = &config.keyring {
            set("keyring", keyring.display().to_string())?;
        }
        // Whole seconds (librados' unit), at least 1: 0 would mean "wait forever".
        let secs = |d: Duration| (d.as_millis().div_ceil(1000) as u64).max(1).to_string();
        set("client_mount_timeout", secs(config.connect_timeout))?;
        set("rados_mon_op_timeout", secs(config.connect_timeout))?;
        // A timeout the config file sets is the user's: kept. Ours applies where librados
        // would wait forever (`0`, its default).
        let configured_op_timeout = cluster
            .get_conf("rados_osd_op_timeout")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|secs| *secs > 0.0);
        if let (Some(op_timeout), None) = (config.op_timeout, configured_op_timeout) {
            set("rados_osd_op_timeout", secs(op_timeout))?;
        }
        if config.inflight_bytes_headroom_permille > 0 {
            // Read back what the config file (or librados' default) gave, so a budget the user
            // set is widened, not replaced. Objecter reads it once, at connect.
            let option = "objecter_inflight_op_bytes";
            let budget = cluster
                .get_conf(option)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    RadosError::Invalid(format!("librados' {option} is not a byte count"))
                })?;
            let widened = budget
                .saturating_add(budget / 1000 * u64::from(config.inflight_bytes_headroom_permille));
            set(option, widened.to_string())?;
        }
        let started = std::time::Instant::now();
        // A setting as librados has it, for a message (`none` where it is unset or empty).
        let conf_or = |name: &str, none: &str| {
            cluster
                .get_conf(name)
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| none.into())
        };
        cluster.connect().map_err(|e| match e.0 {
            libc::ETIMEDOUT | libc::ECONNREFUSED | libc::EHOSTUNREACH => RadosError::Unreachable {
                client: client_id.clone(),
                monitors: conf_or("mon_host", "none configured"),
                timeout: config.connect_timeout,
            },
            // librados found no keyring for the client: no cluster was asked anything.
            libc::ENOENT => RadosError::NoKeyring {
                client: client_id.clone(),
                searched: conf_or("keyring", "none"),
            },
            libc::EACCES | libc::EPERM => RadosError::AuthFailed {
                client: client_id.clone(),
                source: e.io_error(),
            },
            // What librados' connect says of a keyring it read without a usable key in it.
            libc::EIO => RadosError::BadKeyring {
                client: client_id.clone(),
                keyring: conf_or("keyring", "none"),
            },
            _ => RadosError::Connect {
                client: client_id.clone(),
                source: e.io_error(),
            },
        })?;
        let cluster = Arc::new(cluster);
        let io = || {
            IoCtx::new(&cluster, &config.pool, &config.namespace).map_err(|e| match e.0 {
                libc::ENOENT => RadosError::NoSuchPool {
                    pool: config.pool.clone(),
                },
                _ => RadosError::Connect {
                    client: client_id.clone(),
                    source: e.io_error(),
                },
            })
        };
        let client = format!("client.{}", cluster.instance_id());
        tracing::debug!(
            %client,
            pool = %config.pool,
            namespace = %config.namespace,
            elapsed = ?started.elapsed(),
            "connected to RADOS"
        );
        Ok(RadosStore {
            writes: Mutex::new((io()?, None)),
            reads: Mutex::new((io()?, None)),
            control: Arc::new(io()?),
            rollbacks: Arc::new(Mutex::new(io()?)),
            client,
            user: format!("client.{client_id}"),
            pool: config.pool.clone(),
            expected_object_size: config.expected_object_size,
            cluster,
        })
    }

    /// The store's pool and namespace as a raw librados io context, for other FFI bindings
    /// that take a `rados_ioctx_t` (librbd's `rbd_open`, in ivdisk-rbd). It is the store's
    /// control io context: never pointed at a snapshot, never given a write context.
    pub fn raw_io_context(&self) -> RawIoContext {
        RawIoContext {
            io: self.control.clone(),
        }
    }

    /// How many reads this process has submitted to RADOS and not seen complete (a dropped
    /// store cancels its own and waits for them); for the tests.
    #[doc(hidden)]
    pub fn reads_in_flight() -> usize {
        ffi::READS_IN_FLIGHT.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This connection's budget of bytes in flight (librados' `objecter_inflight_op_bytes`,
    /// widened by [`RadosConfig::inflight_bytes_headroom_permille`]).
    pub fn inflight_bytes_budget(&self) -> Option<u64> {
        let value = self.cluster.get_conf("objecter_inflight_op_bytes").ok()?;
        value.trim().parse().ok()
    }

    /// An error of a failed operation on `object`, by errno.
    fn error(&self, object: &ObjectName, what: &str, e: Errno) -> StoreError {
        let object_name = object.to_string();
        match e.0 {
            libc::ENOENT => StoreError::NotFound {
                object: object_name,
            },
            libc::EEXIST => StoreError::Exists {
                object: object_name,
            },
            libc::ENOSPC | libc::EDQUOT => StoreError::NoSpace {
                context: format!(
                    "RADOS pool `{}` is full or over its quota, {what} `{object}`",
                    self.pool
                ),
            },
            libc::ETIMEDOUT => StoreError::Io {
                context: format!(
                    "RADOS {what} `{object}` in pool `{}`: the OSDs did not answer within the \
                     operation timeout (is an OSD down? `ceph -s`){}",
                    self.pool,
                    // Only a change leaves something to find out.
                    match what {
                        "reading" | "reading locks of" | "watching" => "",
                        _ =>
                            "; the change was applied entirely or not at all: read the object \
                              to find out which",
                    }
                ),
                source: e.io_error(),
            },
            // EBLOCKLISTED: the OSDs (or librados, once it has the map) refuse this client.
            libc::ESHUTDOWN => StoreError::Fenced {
                context: format!("RADOS {what} `{object}` ({})", self.client),
            },
            _ => StoreError::Io {
                context: format!("RADOS {what} `{object}` in pool `{}`", self.pool),
                source: e.io_error(),
            },
        }
    }

    /// The holders of `lock` on `object` as the OSD reports them, from `cls_lock`'s
    /// `get_info`, which, unlike `rados_list_lockers`, reports when each holder's lock
    /// expires.
    async fn raw_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<lock_info::RawLocker>, StoreError> {
        let mut op = ffi::ReadOp::new().map_err(|e| self.error(object, "reading locks of", e))?;
        let class = CString::new("lock").expect("no NUL");
        let method = CString::new("get_info").expect("no NUL");
        op.exec(&class, &method, &lock_info::encode_get_info_request(lock));
        let done = self
            .control
            .submit_read(&cstring(object), op)
            .map_err(|e| self.error(object, "reading locks of", e))?
            .await
            .map_err(closed)?;
        if done.rval == -libc::ENOENT || done.rval == -libc::ENODATA {
            return Ok(Vec::new());
        }
        if done.rval < 0 {
            return Err(self.error(object, "reading locks of", Errno(-done.rval)));
        }
        let reply = match done.payload.results().pop() {
            Some(Ok(SlotResult::Exec(reply))) => reply,
            Some(Err(e)) if e.0 == libc::ENOENT || e.0 == libc::ENODATA => return Ok(Vec::new()),
            Some(Err(e)) => return Err(self.error(object, "reading locks of", e)),
            other => {
                return Err(StoreError::Corrupt(format!(
                    "lock.get_info on `{object}` returned {other:?}"
                )))
            }
        };
        let info = lock_info::decode_get_info_reply(&reply).map_err(|e| {
            StoreError::Corrupt(format!(
                "cannot decode the lock info of `{object}` (lock `{lock}`): {e}"
            ))
        })?;
        Ok(info.lockers)
    }

    /// Apply a rollback, which librados only offers as a blocking call of its own.
    async fn rollback(
        &self,
        object: &ObjectName,
        snap: SnapId,
        context: Option<SnapContext>,
    ) -> Result<WriteOutcome, StoreError> {
        let io = self.rollbacks.clone();
        let oid = cstring(object);
        let context = context.unwrap_or_default();
        let r = blocking("a rollback", move || {
            let mut io = lock(&io);
            io.set_write_context(context.seq, &context.snaps)?;
            io.rollback(&oid, snap)
        })
        .await?;
        r.map_err(|e| self.error(object, "rolling back", e))?;
        // The call reports no version: read it (nobody writes the object meanwhile when a
        // whole image is rolled back under its lock).
        let version = self.stat(object).await?.map_or(0, |s| s.version);
        Ok(WriteOutcome { version })
    }

    async fn busy(&self, object: &ObjectName, lock: &str) -> StoreError {
        let holder = match self.list_lockers(object, lock).await {
            Ok(lockers) if !lockers.is_empty() => lockers
                .iter()
                .map(|l| format!("{} (cookie `{}`)", l.client, l.cookie))
                .collect::<Vec<_>>()
                .join(", "),
            _ => "another client".into(),
        };
        StoreError::Busy {
            object: object.to_string(),
            lock: lock.into(),
            holder,
        }
    }
}

/// Whether the object exists after these steps (`None`: as before them).
fn exists_after(steps: &[WriteStep]) -> Option<bool> {
    steps.iter().rev().find_map(|step| match step {
        WriteStep::Remove => Some(false),
        WriteStep::CreateExclusive
        | WriteStep::Write { .. }
        | WriteStep::WriteFull(_)
        | WriteStep::Truncate(_)
        | WriteStep::OmapSet(_) => Some(true),
        _ => None,
    })
}

/// How the results of one read step are found among the op's slots.
enum Plan {
    Read {
        offset: u64,
        slot: bool,
    },
    Stat,
    ByKeys,
    Range {
        start: Vec<u8>,
        end: Option<Vec<u8>>,
        max: usize,
        /// The start key is looked up by key (a separate slot before the listing).
        by_key: bool,
    },
}

impl RadosStore {
    /// The objects under `prefix` that exist at `snap` (`None`: the head), sorted. RADOS lists
    /// every object with a head or a preserved state (a pool has no per-snapshot listing), so
    /// each candidate is stat'ed where it is asked for, all stats in flight at once.
    async fn list_existing(
        &self,
        prefix: &str,
        snap: Option<SnapId>,
    ) -> Result<Vec<ObjectName>, StoreError> {
        let io = self.control.clone();
        let names = blocking("listing objects", move || io.list_objects())
            .await?
            .map_err(|e| StoreError::Io {
                context: format!("listing the objects of pool `{}`", self.pool),
                source: e.io_error(),
            })?;
        let mut candidates: Vec<ObjectName> = names
            .into_iter()
            .filter(|n| n.starts_with(prefix.as_bytes()))
            .filter_map(|n| String::from_utf8(n).ok())
            .filter_map(|n| ObjectName::new(n).ok())
            .collect();
        candidates.sort();
        candidates.dedup();
        let mut pending = Vec::with_capacity(candidates.len());
        {
            // At a snapshot: the reads' io context, pointed at it for these submissions.
            let mut reads = snap.map(|_| lock(&self.reads));
            if let Some((io, current)) = reads.as_deref_mut() {
                if *current != snap {
                    io.set_read_snap(snap);
                    *current = snap;
                }
            }
            for name in &candidates {
                let mut op = ffi::ReadOp::new().map_err(|e| self.error(name, "listing", e))?;
                op.stat();
                let io = match reads.as_deref() {
                    Some((io, _)) => io,
                    None => &self.control,
                };
                pending.push(
                    io.submit_read(&cstring(name), op)
                        .map_err(|e| self.error(name, "listing", e))?,
                );
            }
        }
        let mut out = Vec::with_capacity(candidates.len());
        for (name, pending) in candidates.into_iter().zip(pending) {
            match pending.await.map_err(closed)?.rval {
                r if r >= 0 => out.push(name),
                r if r == -libc::ENOENT => {}
                r => return Err(self.error(&name, "listing", Errno(-r))),
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl ObjectStore for RadosStore {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        for step in &op.steps {
            match step {
                WriteStep::Write { offset, data } => {
                    check_range(object, *offset, data.len() as u64)?
                }
                WriteStep::WriteFull(data) => check_range(object, 0, data.len() as u64)?,
                WriteStep::Zero { offset, len } => check_range(object, *offset, *len)?,
                WriteStep::Truncate(size) => check_range(object, *size, 0)?,
                _ => {}
            }
        }
        if let Some(snap) = op.steps.iter().find_map(|s| match s {
            WriteStep::Rollback(snap) => Some(*snap),
            _ => None,
        }) {
            if op.steps.len() != 1 {
                return Err(invalid(
                    object,
                    "on RADOS a Rollback must be the only step of its operation (librados' C \
                     API has no rollback step)",
                ));
            }
            return self.rollback(object, snap, op.snap_context).await;
        }

        // Only Zero steps of no length, which are not sent (see below): the OSD refuses an
        // operation of no steps (EINVAL), and this one changes nothing.
        if !op.steps.is_empty()
            && op
                .steps
                .iter()
                .all(|s| matches!(s, WriteStep::Zero { len: 0, .. }))
        {
            let version = self.stat(object).await?.map_or(0, |s| s.version);
            return Ok(WriteOutcome { version });
        }
        let what = "writing";
        let mut raw = ffi::WriteOp::new().map_err(|e| self.error(object, what, e))?;
        let mut hint = None;
        if let Some(object_size) = self.expected_object_size {
            let largest_write = op
                .steps
                .iter()
                .map(|s| match s {
                    WriteStep::Write { data, .. } | WriteStep::WriteFull(data) => data.len(),
                    _ => 0,
                })
                .max()
                .unwrap_or(0);
            if largest_write > 0 {
                hint = Some((object_size, largest_write as u64));
            }
        }
        for step in &op.steps {
            // The hint after the operation's leading asserts: the OSD creates the object for
            // a hint, and an assert after it then saw an object that did not exist (a
            // `CreateExclusive` failed `Exists`, an `AssertExists` passed and the write made
            // the object), as librbd knows (it asserts first).
            if !matches!(
                step,
                WriteStep::CreateExclusive | WriteStep::AssertExists | WriteStep::AssertVersion(_)
            ) {
                if let Some((object_size, write_size)) = hint.take() {
                    raw.set_alloc_hint(object_size, write_size);
                }
            }
            match step {
                WriteStep::CreateExclusive => raw.create_exclusive(),
                WriteStep::AssertExists => raw.assert_exists(),
                WriteStep::AssertVersion(v) => raw.assert_version(*v),
                WriteStep::Write { offset, data } => raw.write(*offset, data),
                WriteStep::WriteFull(data) => raw.write_full(data),
                // A ZERO of no length aborts the OSD (Ceph 16's `do_osd_ops` asserts on it:
                // the whole OSD goes down, every PG it holds with it); it changes nothing.
                WriteStep::Zero { len: 0, .. } => {}
                WriteStep::Zero { offset, len } => raw.zero(*offset, *len),
                WriteStep::Truncate(size) => raw.truncate(*size),
                WriteStep::Remove => raw.remove(),
                WriteStep::OmapSet(pairs) => {
                    let (keys, values): (Vec<&[u8]>, Vec<&[u8]>) = pairs.iter().unzip();
                    raw.omap_set(&keys, &values)
                }
                WriteStep::OmapRemoveKeys(keys) => raw.omap_remove_keys(keys),
                WriteStep::OmapRemoveRange { start, end } => raw.omap_remove_range(start, end),
                WriteStep::OmapClear => raw.omap_clear(),
                WriteStep::Rollback(_) => unreachable!("handled above"),
            }
        }
        let pending = {
            let mut writes = lock(&self.writes);
            let (io, current) = &mut *writes;
            if *current != op.snap_context {
                let context = op.snap_context.clone().unwrap_or_default();
                io.set_write_context(context.seq, &context.snaps)
                    .map_err(|e| invalid(object, format!("snapshot context refused: {e}")))?;
                *current = op.snap_context.clone();
            }
            io.submit_write(&cstring(object), raw)
        }
        .map_err(|e| self.error(object, what, e))?;
        let done = pending.await.map_err(closed)?;
        if done.rval < 0 {
            let e = Errno(-done.rval);
            let asserted = op.steps.iter().find_map(|s| match s {
                WriteStep::AssertVersion(v) => Some(*v),
                _ => None,
            });
            if let (Some(expected), libc::ERANGE | libc::EOVERFLOW) = (asserted, e.0) {
                // A missing object's version is 0 to the OSD: `NotFound`, as the other
                // backends answer, not a mismatch.
                let Some(stat) = self.stat(object).await? else {
                    return Err(self.error(object, what, Errno(libc::ENOENT)));
                };
                return Err(StoreError::VersionMismatch {
                    object: object.to_string(),
                    expected,
                    actual: stat.version,
                });
            }
            return Err(self.error(object, what, e));
        }
        let version = match exists_after(&op.steps) {
            Some(false) => 0,
            _ => done.version,
        };
        Ok(WriteOutcome { version })
    }

    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        let what = "reading";
        let mut raw = ffi::ReadOp::new().map_err(|e| self.error(object, what, e))?;
        let mut plans = Vec::with_capacity(op.steps.len());
        for step in &op.steps {
            plans.push(match step {
                ReadStep::Read { offset, len } => {
                    let len = (*len).min(MAX_OBJECT_SIZE.saturating_sub(*offset));
                    // A zero length means "to the end" to RADOS: leave such a step out.
                    let slot = len > 0;
                    if slot {
                        raw.read(*offset, len as usize);
                    }
                    Plan::Read {
                        offset: *offset,
                        slot,
                    }
                }
                ReadStep::Stat => {
                    raw.stat();
                    Plan::Stat
                }
                ReadStep::OmapGetByKeys(keys) => {
                    raw.omap_get_vals_by_keys(keys);
                    Plan::ByKeys
                }
                ReadStep::OmapGetRange { start, end, max } => {
                    // RADOS lists the keys strictly after a C-string key. A start without NUL:
                    // list after it, and look the start key itself up in the same operation.
                    // With a NUL: list after its NUL-free prefix (every key in range is after
                    // it; no C string lies closer) and drop the keys before the start. The
                    // OSD lists at most `osd_max_omap_entries_per_request` keys (default
                    // 1024) per operation, so this only reaches ranges that start within
                    // that many keys of the prefix.
                    let fetch = (*max as u64).saturating_add(1);
                    let nul = start.iter().position(|&b| b == 0);
                    let after = CString::new(&start[..nul.unwrap_or(start.len())])
                        .expect("cut before the first NUL");
                    if nul.is_none() {
                        raw.omap_get_vals_by_keys(std::slice::from_ref(start));
                    }
                    let budget = if nul.is_some() {
                        fetch.saturating_add(NUL_START_BUDGET)
                    } else {
                        fetch
                    };
                    raw.omap_get_vals(&after, budget);
                    Plan::Range {
                        start: start.clone(),
                        end: end.clone(),
                        max: *max,
                        by_key: nul.is_none(),
                    }
                }
            });
        }
        // An operation needs a step (RADOS refuses an empty one) and must fail `NotFound` on
        // a missing object: a stat nobody asked for does both.
        let hidden_stat = plans
            .iter()
            .all(|p| matches!(p, Plan::Read { slot: false, .. }));
        if hidden_stat {
            raw.stat();
        }
        let pending = {
            let mut reads = lock(&self.reads);
            let (io, current) = &mut *reads;
            if *current != op.snap {
                io.set_read_snap(op.snap);
                *current = op.snap;
            }
            io.submit_read(&cstring(object), raw)
        }
        .map_err(|e| self.error(object, what, e))?;
        let done = pending.await.map_err(closed)?;
        if done.rval < 0 {
            return Err(self.error(object, what, Errno(-done.rval)));
        }
        let version = done.version;
        let mut slots = done.payload.results().into_iter();
        let mut next = || match slots.next() {
            Some(Ok(result)) => Ok(result),
            Some(Err(e)) => Err(self.error(object, what, e)),
            None => Err(StoreError::Corrupt(format!(
                "a read of `{object}` returned fewer results than steps"
            ))),
        };
        let mut results = Vec::with_capacity(plans.len());
        for plan in plans {
            results.push(match plan {
                Plan::Read { offset, slot } => {
                    let data = if slot {
                        match next()? {
                            SlotResult::Read(data) => data,
                            other => return Err(mismatch(object, &other)),
                        }
                    } else {
                        Vec::new()
                    };
                    ReadResult::Extents(if data.is_empty() {
                        Vec::new()
                    } else {
                        vec![Extent { offset, data }]
                    })
                }
                Plan::Stat => match next()? {
                    SlotResult::Stat { size } => ReadResult::Stat(Stat { size, version }),
                    other => return Err(mismatch(object, &other)),
                },
                Plan::ByKeys => match next()? {
                    SlotResult::Omap { pairs, .. } => ReadResult::Omap { pairs, more: false },
                    other => return Err(mismatch(object, &other)),
                },
                Plan::Range {
                    start,
                    end,
                    max,
                    by_key,
                } => {
                    let first = if by_key {
                        match next()? {
                            SlotResult::Omap { pairs, .. } => pairs,
                            other => return Err(mismatch(object, &other)),
                        }
                    } else {
                        OmapPairs::new()
                    };
                    let (listed, rados_more) = match next()? {
                        SlotResult::Omap { pairs, more } => (pairs, more),
                        other => return Err(mismatch(object, &other)),
                    };
                    let past_end = |k: &[u8]| end.as_ref().is_some_and(|end| k >= end.as_slice());
                    let reached_end = listed.last().is_some_and(|(k, _)| past_end(k));
                    let mut pairs: OmapPairs = first
                        .iter()
                        .filter(|(k, _)| *k == start.as_slice())
                        .chain(listed.iter().filter(|(k, _)| *k >= start.as_slice()))
                        .filter(|(k, _)| !past_end(k))
                        .collect();
                    // Unseen keys may still be in range: more than `max` seen says so. A
                    // NUL start whose listing stopped before reaching any key in range
                    // cannot be continued (the next start would hold a NUL too); one that
                    // reached some can, from its last key (`last + [0]` lists right after it,
                    // exactly: how `foreign/rbd.rs` pages).
                    let unseen = rados_more && !reached_end;
                    if unseen && pairs.is_empty() && !by_key {
                        return Err(invalid(
                            object,
                            format!(
                                "omap range from key {} not reachable on RADOS: it holds a NUL \
                                 byte, and librados' C API can only list from its NUL-free \
                                 prefix, which has more keys after it than the OSD lists per \
                                 request; use omap keys without NUL bytes on RADOS",
                                hex_key(&start)
                            ),
                        ));
                    }
                    let more = pairs.len() > max || unseen;
                    pairs.truncate(max);
                    ReadResult::Omap { pairs, more }
                }
            });
        }
        if hidden_stat {
            next()?;
        }
        Ok(results)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
        self.list_existing(prefix, None).await
    }

    async fn list_at(&self, prefix: &str, snap: SnapId) -> Result<Vec<ObjectName>, StoreError> {
        self.list_existing(prefix, Some(snap)).await
    }

    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        let done = self
            .control
            .snap_create()
            .map_err(|e| snap_error("creating a snapshot", e))?
            .await
            .map_err(closed)?;
        if done.rval < 0 {
            return Err(snap_error("creating a snapshot", Errno(-done.rval)));
        }
        Ok(*done.payload)
    }

    async fn snap_remove(&self, snap: SnapId) -> Result<(), StoreError> {
        let what = format!("removing snapshot {snap}");
        let done = self
            .control
            .snap_remove(snap)
            .map_err(|e| snap_error(&what, e))?
            .await
            .map_err(closed)?;
        match done.rval {
            r if r >= 0 => Ok(()),
            r if r == -libc::ENOENT => Err(StoreError::NoSuchSnapshot(snap)),
            r => Err(snap_error(&what, Errno(-r))),
        }
    }

    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError> {
        let io = self.control.clone();
        let oid = cstring(object);
        let name = request.name.clone();
        let (renew, cookie) = (request.renew, request.cookie.clone());
        let r = blocking("taking a lock", move || {
            io.lock_exclusive(
                &oid,
                &request.name,
                &request.cookie,
                &request.description,
                request.duration,
                request.renew,
            )
        })
        .await?;
        match r {
            Ok(()) => Ok(()),
            // EEXIST: this client already holds it (and did not ask to renew).
            Err(Errno(libc::EBUSY | libc::EEXIST)) => Err(self.busy(object, &name).await),
            // MUST_RENEW on a lock this client no longer holds (expired or broken).
            Err(Errno(libc::ENOENT)) if renew => {
                Err(not_locked(object, &name, &self.client, &cookie))
            }
            Err(Errno(libc::EINVAL)) => Err(invalid(object, "lock name, cookie or description")),
            Err(e) => Err(self.error(object, "locking", e)),
        }
    }

    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let io = self.control.clone();
        let oid = cstring(object);
        let (name, cookie_owned) = (lock.to_string(), cookie.to_string());
        let r = blocking("releasing a lock", move || {
            io.unlock(&oid, &name, &cookie_owned)
        })
        .await?;
        match r {
            Ok(()) => Ok(()),
            Err(Errno(libc::ENOENT)) => Err(not_locked(object, lock, &self.client, cookie)),
            Err(e) => Err(self.error(object, "unlocking", e)),
        }
    }

    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError> {
        let lockers = self.raw_lockers(object, lock).await?;
        let now = SystemTime::now();
        Ok(lockers
            .into_iter()
            .map(|l| Locker {
                client: l.entity_name(),
                expires_in: l
                    .expiration()
                    .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO)),
                cookie: l.cookie,
                description: l.description,
                address: l.address,
            })
            .collect())
    }

    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let io = self.control.clone();
        let oid = cstring(object);
        let (name, client_owned, cookie_owned) =
            (lock.to_string(), client.to_string(), cookie.to_string());
        let r = blocking("breaking a lock", move || {
            io.break_lock(&oid, &name, &client_owned, &cookie_owned)
        })
        .await?;
        match r {
            Ok(()) => Ok(()),
            Err(Errno(libc::ENOENT)) => Err(not_locked(object, lock, client, cookie)),
            Err(Errno(libc::EINVAL)) => Err(invalid(
                object,
                format!("cannot break a lock of {client:?}: name the holder as `client.<id>`"),
            )),
            Err(e) => Err(self.error(object, "breaking a lock on", e)),
        }
    }

    async fn fence_client(&self, client: &str, address: &str) -> Result<bool, StoreError> {
        let cannot = |reason: String| StoreError::CannotFence {
            holder: format!("{client} (at {address})"),
            reason,
        };
        if client == self.client {
            return Err(cannot(
                "that is this client itself, which would cut itself off".into(),
            ));
        }
        let cluster = self.cluster.clone();
        let target = address.to_owned();
        // The expiry is the cluster's default (`mon_osd_blocklist_default_expire`, an hour), as
        // librbd's own lock breaking leaves it.
        let fenced = blocking("blocklisting a client", move || {
            cluster.blocklist_add(&target, 0)?;
            // The new map reaches the OSDs with the next operation of any client that has it:
            // every later client (the next writer among them) fetches it when it connects.
            cluster.wait_for_latest_osdmap()
        })
        .await?;
        match fenced {
            Ok(()) => Ok(true),
            Err(Errno(libc::EPERM | libc::EACCES)) => Err(cannot(format!(
                "{} may not blocklist clients (it needs the monitor capability `allow command \
                 \"osd blocklist\"`, which `profile rbd` grants)",
                self.user
            ))),
            Err(Errno(libc::EINVAL)) => {
                Err(cannot("the monitors did not take that address".into()))
            }
            Err(e) => Err(StoreError::Io {
                context: format!("RADOS: blocklisting {client} at {address}"),
                source: e.io_error(),
            }),
        }
    }

    async fn flush(&self) -> Result<(), StoreError> {
        // RADOS acknowledges a write once every replica has it durably.
        Ok(())
    }

    async fn watch(
        &self,
        object: &ObjectName,
        reply: Vec<u8>,
    ) -> Result<Option<Watch>, StoreError> {
        let (io, oid) = (self.control.clone(), cstring(object));
        let timeout = self.watch_timeout();
        match blocking("watching", move || io.watch(&oid, reply, timeout)).await? {
            Ok(watch) => Ok(Some(Watch::new(watch))),
            Err(e) => Err(self.error(object, "watching", e)),
        }
    }

    async fn notify(
        &self,
        object: &ObjectName,
        timeout: Duration,
    ) -> Result<NotifyReplies, StoreError> {
        let (io, oid) = (self.control.clone(), cstring(object));
        match blocking("notifying", move || io.notify(&oid, timeout)).await? {
            Ok(answers) => Ok(NotifyReplies {
                replies: answers
                    .acks
                    .into_iter()
                    .map(|(gid, reply)| (format!("client.{gid}"), reply))
                    .collect(),
                unanswered: answers
                    .timeouts
                    .into_iter()
                    .map(|gid| format!("client.{gid}"))
                    .collect(),
            }),
            Err(e) => Err(self.error(object, "notifying the watchers of", e)),
        }
    }

    fn client_id(&self) -> &str {
        &self.client
    }

    fn write_unit(&self) -> u64 {
        // BlueStore's allocation and checksum unit (`bluestore_min_alloc_size_{hdd,ssd}` since
        // Pacific): a partial block is read, merged and written again as a deferred write.
        4096
    }

    fn distinguishes_holes(&self) -> bool {
        false
    }
}

/// How long the OSDs keep a watch of a client that stopped answering (died, say), unless the
/// configuration says otherwise: Ceph's own default (`osd_client_watch_timeout`).
const WATCH_TIMEOUT: Duration = Duration::from_secs(30);

impl RadosStore {
    /// The watch timeout this client's configuration gives (`osd_client_watch_timeout`, as
    /// librados' own watches take it), or Ceph's default.
    fn watch_timeout(&self) -> Duration {
        self.cluster
            .get_conf("osd_client_watch_timeout")
            .ok()
            .and_then(|value| value.trim().parse::<f64>().ok())
            .filter(|seconds| seconds.is_finite() && *seconds >= 1.0)
            .map_or(WATCH_TIMEOUT, |seconds| Duration::from_secs(seconds as u64))
    }
}

impl WatchRegistration for crate::ffi::Watch {
    fn status(&self) -> WatchStatus {
        crate::ffi::Watch::status(self)
    }
}

/// Extra keys asked for when an omap range starts at a key holding a NUL byte (the OSD caps
/// the listing at its per-request limit anyway).
const NUL_START_BUDGET: u64 = 1 << 20;

fn hex_key(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// RADOS says ENOENT when `client` holds no lock `lock` with `cookie` on the object.
fn not_locked(object: &ObjectName, lock: &str, client: &str, cookie: &str) -> StoreError {
    StoreError::NotLocked {
        object: object.to_string(),
        lock: lock.into(),
        client: client.into(),
        cookie: cookie.into(),
    }
}

fn mismatch(object: &ObjectName, got: &SlotResult) -> StoreError {
    StoreError::Corrupt(format!(
        "a read of `{object}` returned an unexpected result: {got:?}"
    ))
}

fn snap_error(what: &str, e: Errno) -> StoreError {
    StoreError::Io {
        context: format!("RADOS: {what}"),
        source: io::Error::from_raw_os_error(e.0),
    }
}
