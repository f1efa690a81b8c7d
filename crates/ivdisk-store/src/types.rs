//! What crosses the object store interface: names, operations and their results.

use std::fmt;
use std::time::Duration;

use crate::StoreError;

/// A snapshot id, allocated by [`crate::ObjectStore::snap_create`]; larger ids are newer.
pub type SnapId = u64;

/// Longest object name accepted (RADOS' default `osd_max_object_name_len` is 2048; image
/// objects are far shorter).
pub const MAX_NAME_LEN: usize = 1024;

/// Largest object size (RADOS' default `osd_max_object_size`).
pub const MAX_OBJECT_SIZE: u64 = 128 << 20;

/// Fails `OutOfRange` unless `[offset, offset + len)` ends within [`MAX_OBJECT_SIZE`]: every
/// backend checks its write steps with this before applying anything.
pub fn check_range(object: &ObjectName, offset: u64, len: u64) -> Result<(), StoreError> {
    if offset
        .checked_add(len)
        .is_none_or(|end| end > MAX_OBJECT_SIZE)
    {
        return Err(StoreError::OutOfRange {
            object: object.to_string(),
            offset,
            len,
            limit: MAX_OBJECT_SIZE,
        });
    }
    Ok(())
}

/// A validated object name: 1..=1024 bytes of printable ASCII.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName(String);

impl ObjectName {
    pub fn new(name: impl Into<String>) -> Result<Self, StoreError> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > MAX_NAME_LEN {
            Some("it is longer than 1024 bytes")
        } else if !name.bytes().all(|b| b.is_ascii_graphic()) {
            Some("only printable ASCII without spaces is allowed")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(StoreError::InvalidName {
                name: name.escape_debug().to_string(),
                reason,
            }),
            None => Ok(ObjectName(name)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// RADOS' self-managed snapshot context: the newest snapshot id (`seq`) and the live
/// snapshots, newest first. A write under a context newer than the object's last write first
/// preserves the object's current state for those snapshots (copy-on-write).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapContext {
    pub seq: SnapId,
    pub snaps: Vec<SnapId>,
}

/// One step of a write operation. The steps of one [`WriteOp`] apply in order and atomically:
/// all of them or, if any fails, none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteStep {
    /// Fail with `Exists` if the object exists; create it (empty) otherwise.
    CreateExclusive,
    /// Fail with `NotFound` unless the object exists.
    AssertExists,
    /// Fail with `VersionMismatch` unless the object's version is this.
    AssertVersion(u64),
    /// Write bytes at an offset (creates the object; grows it).
    Write { offset: u64, data: Vec<u8> },
    /// Replace the whole content (RADOS `write_full`).
    WriteFull(Vec<u8>),
    /// Make a range a hole again: reads as zeros, costs no space, and sparse reads skip it.
    Zero { offset: u64, len: u64 },
    /// Set the size; bytes past it are dropped.
    Truncate(u64),
    /// Delete the object (with its omap).
    Remove,
    /// Set omap keys.
    OmapSet(Vec<(Vec<u8>, Vec<u8>)>),
    /// Remove omap keys (missing keys are fine).
    OmapRemoveKeys(Vec<Vec<u8>>),
    /// Remove the omap keys in `[start, end)`.
    OmapRemoveRange { start: Vec<u8>, end: Vec<u8> },
    /// Put the object back to its state at a snapshot (deleting it if it did not exist then).
    Rollback(SnapId),
}

/// An atomic write operation on one object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WriteOp {
    pub steps: Vec<WriteStep>,
    /// The snapshot context the write runs under (`None`: no snapshots to preserve).
    pub snap_context: Option<SnapContext>,
}

impl WriteOp {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn step(mut self, step: WriteStep) -> Self {
        self.steps.push(step);
        self
    }
    pub fn write(self, offset: u64, data: impl Into<Vec<u8>>) -> Self {
        self.step(WriteStep::Write {
            offset,
            data: data.into(),
        })
    }
    pub fn omap_set(self, pairs: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        self.step(WriteStep::OmapSet(pairs))
    }
    pub fn with_snap_context(mut self, context: SnapContext) -> Self {
        self.snap_context = Some(context);
        self
    }
}

/// What a write operation reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOutcome {
    /// The object's version after the operation (0 if it removed the object).
    pub version: u64,
}

/// One step of a read operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadStep {
    /// The written extents within `[offset, offset + len)`, clipped to the object size.
    Read { offset: u64, len: u64 },
    /// Size and version.
    Stat,
    /// The values of these keys, in key order (absent keys are left out).
    OmapGetByKeys(Vec<Vec<u8>>),
    /// Up to `max` pairs with `start <= key < end` (no `end`: to the last key), in key order.
    /// Portable callers start ranges at keys without NUL bytes: RADOS (librados' C API)
    /// reaches a NUL-holding start only near its NUL-free prefix (see `ivdisk-rados`).
    OmapGetRange {
        start: Vec<u8>,
        end: Option<Vec<u8>>,
        max: usize,
    },
}

/// A read operation on one object, at the head or at a snapshot. It fails with `NotFound` if
/// the object does not exist (at that snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadOp {
    pub steps: Vec<ReadStep>,
    pub snap: Option<SnapId>,
}

impl ReadOp {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn step(mut self, step: ReadStep) -> Self {
        self.steps.push(step);
        self
    }
    pub fn at_snap(mut self, snap: SnapId) -> Self {
        self.snap = Some(snap);
        self
    }
}

/// A written range: bytes that were written (zeros included), as opposed to a hole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub data: Vec<u8>,
}

/// Size and version of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub size: u64,
    pub version: u64,
}

/// The result of one read step, in the order of the steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadResult {
    Extents(Vec<Extent>),
    Stat(Stat),
    Omap {
        pairs: Vec<(Vec<u8>, Vec<u8>)>,
        /// More pairs were in range than `max`.
        more: bool,
    },
}

/// An advisory lock holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Locker {
    /// The store client that holds it ([`crate::ObjectStore::client_id`]).
    pub client: String,
    pub cookie: String,
    pub description: String,
    /// Time left before the lock expires by itself (`None`: held until unlocked or broken).
    pub expires_in: Option<Duration>,
}

/// How to take an advisory exclusive lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRequest {
    pub name: String,
    pub cookie: String,
    pub description: String,
    /// The lock expires this long after it is taken or renewed (`None`: never).
    pub duration: Option<Duration>,
    /// Renew a lock this client holds with this cookie. The lock must still be held: if it
    /// expired or was broken, renewal fails `NotLocked` instead of taking it again (librados'
    /// `LIBRADOS_LOCK_FLAG_MUST_RENEW`), so a holder learns it lost the lock.
    pub renew: bool,
}
