//! A fault-injecting file layer for the power-loss test (`tests/power_loss.rs`).
//!
//! Every change the local store makes to its files reports here: appends, truncations and
//! punches of the data segments, `fdatasync`s (segments, SQLite's log through `WalFile`), the
//! `CLEAN` marker; SQLite's own writes, truncations, syncs and deletes report through the shim
//! VFS of `ffi_vfs.rs`. Without the `fault-io` feature the hooks are empty and inlined away.
//!
//! With the feature, [`start`] begins recording the files under a directory `live` into a
//! shadow directory `disk` that starts as a copy of `live` and holds what the disk keeps at a
//! power cut: the writes of a file are pending (in memory) until the file is synced, then they
//! are applied to its copy in `disk`. [`cut`] is the power cut: it stops recording and returns
//! the writes still pending per file, in order, so that a test can put any subset of them on
//! the disk too (real disks persist some unsynced writes, in any order).
//!
//! The model, and where it is conservative:
//! - a file's writes, truncations and punches are durable once a sync of that file (any
//!   descriptor) completed after them; a sync makes a new file's directory entry durable too
//!   (ext4's behaviour; SQLite also syncs the directory when it first syncs its log);
//! - a punch counts from when the store queues it (the punch thread does it later): the model
//!   lets it reach the disk earlier than it can, never later;
//! - removing a file is durable at once (SQLite syncs the directory after deleting its log;
//!   the store removes only the `CLEAN` marker and segments it created itself);
//! - `-shm` (SQLite's shared-memory index, never synced, rebuilt after a crash) and `LOCK` are
//!   not files of the disk image.

use std::path::Path;
#[cfg(feature = "fault-io")]
use std::sync::atomic::{AtomicU64, Ordering};

/// A write of `data` at `offset` in `path` (the write has been done).
#[inline]
pub(crate) fn write(path: impl FnOnce() -> std::path::PathBuf, offset: u64, data: &[u8]) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        let data = data.to_vec();
        record::event(&path(), Op::Write { offset, data });
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = (path, offset, data);
}

/// `path` was cut or extended to `len` bytes.
#[inline]
pub(crate) fn set_len(path: impl FnOnce() -> std::path::PathBuf, len: u64) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        record::event(&path(), Op::SetLen(len));
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = (path, len);
}

/// `[offset, offset + len)` of `path` is (to be) punched out.
#[inline]
pub(crate) fn punch(path: impl FnOnce() -> std::path::PathBuf, offset: u64, len: u64) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        record::event(&path(), Op::Punch { offset, len });
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = (path, offset, len);
}

/// A sync of `path` completed: everything written to it before is durable.
#[inline]
pub(crate) fn synced(path: &Path) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        record::synced(path);
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = path;
}

/// Where the changes recorded for `path` stand, for [`synced_through`]: a sync that runs
/// while the file is being written covers only what was written before it started.
#[inline]
pub(crate) fn sync_point(path: &Path) -> u64 {
    #[cfg(feature = "fault-io")]
    if record::active() {
        return record::sync_point(path);
    }
    let _ = path;
    0
}

/// A sync of `path` that started at `point` ([`sync_point`]) completed: the changes recorded
/// before it are durable.
#[inline]
pub(crate) fn synced_through(path: &Path, point: u64) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        record::synced_through(path, point);
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = (path, point);
}

/// `path` was removed.
#[inline]
pub(crate) fn removed(path: &Path) {
    #[cfg(feature = "fault-io")]
    if record::active() {
        record::removed(path);
    }
    #[cfg(not(feature = "fault-io"))]
    let _ = path;
}

/// How long the reclaim thread after an unclean stop waits after taking its snapshot before
/// it reads the extents, and after that before it queues the punches (zero but in the tests
/// that set them: [`delay_reclaim_searches`]).
#[inline]
pub(crate) fn reclaim_delays() -> (std::time::Duration, std::time::Duration) {
    #[cfg(feature = "fault-io")]
    return (
        std::time::Duration::from_millis(RECLAIM_DELAYS_MS[0].load(Ordering::Relaxed)),
        std::time::Duration::from_millis(RECLAIM_DELAYS_MS[1].load(Ordering::Relaxed)),
    );
    #[cfg(not(feature = "fault-io"))]
    (std::time::Duration::ZERO, std::time::Duration::ZERO)
}

#[cfg(feature = "fault-io")]
static RECLAIM_DELAYS_MS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Test hook: every reclaim after an unclean stop that starts from now on waits
/// `before_reading` after taking its snapshot and `before_punching` after reading the
/// extents, so that a test can free and reuse space meanwhile (`tests/reclaim.rs`).
#[cfg(feature = "fault-io")]
pub fn delay_reclaim_searches(
    before_reading: std::time::Duration,
    before_punching: std::time::Duration,
) {
    RECLAIM_DELAYS_MS[0].store(before_reading.as_millis() as u64, Ordering::Relaxed);
    RECLAIM_DELAYS_MS[1].store(before_punching.as_millis() as u64, Ordering::Relaxed);
}

#[cfg(feature = "fault-io")]
pub use record::*;

#[cfg(feature = "fault-io")]
mod record {
    use std::collections::HashMap;
    use std::fs::{File, OpenOptions};
    use std::os::unix::fs::FileExt;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// One change to a file, not yet synced.
    #[derive(Debug, Clone)]
    pub enum Op {
        Write { offset: u64, data: Vec<u8> },
        SetLen(u64),
        Punch { offset: u64, len: u64 },
    }

    impl Op {
        /// Do this change to `file`.
        pub fn apply(&self, file: &File) -> std::io::Result<()> {
            match self {
                Op::Write { offset, data } => file.write_all_at(data, *offset),
                Op::SetLen(len) => file.set_len(*len),
                Op::Punch { offset, len } => {
                    // Within the file only (KEEP_SIZE): a punch past the end does nothing.
                    let end = file.metadata()?.len();
                    let stop = (offset + len).min(end);
                    if stop > *offset {
                        rustix::fs::fallocate(
                            file,
                            rustix::fs::FallocateFlags::PUNCH_HOLE
                                | rustix::fs::FallocateFlags::KEEP_SIZE,
                            *offset,
                            stop - offset,
                        )?;
                    }
                    Ok(())
                }
            }
        }
    }

    struct Recorder {
        live: PathBuf,
        disk: PathBuf,
        /// Pending changes by path relative to `live`, in the order they were made.
        pending: HashMap<PathBuf, Vec<Op>>,
        /// How many changes per path left `pending` (applied or dropped): with `pending`'s
        /// length, where a `sync_point` stands.
        settled: HashMap<PathBuf, u64>,
        /// Syncs applied to the disk image per file, for the test's report.
        syncs: HashMap<PathBuf, u64>,
        /// The first error applying a sync to the disk image (the test fails on it).
        error: Option<String>,
    }

    static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);
    /// Whether `RECORDER` is set (checked first: builds with the feature that record nothing,
    /// such as the benchmarks, pay one atomic load per hook).
    static ACTIVE: AtomicBool = AtomicBool::new(false);

    pub(super) fn active() -> bool {
        ACTIVE.load(Ordering::Relaxed)
    }

    fn recorder() -> std::sync::MutexGuard<'static, Option<Recorder>> {
        RECORDER.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `rel` (relative to the store's directory) is a file of the disk image.
    fn tracked(rel: &Path) -> bool {
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        !name.ends_with("-shm") && name != "LOCK"
    }

    pub(super) fn event(path: &Path, op: Op) {
        let mut guard = recorder();
        let Some(r) = guard.as_mut() else { return };
        let Ok(rel) = path.strip_prefix(&r.live) else {
            return;
        };
        if tracked(rel) {
            r.pending.entry(rel.to_owned()).or_default().push(op);
        }
    }

    pub(super) fn synced(path: &Path) {
        synced_through(path, u64::MAX);
    }

    pub(super) fn sync_point(path: &Path) -> u64 {
        let guard = recorder();
        let Some(r) = guard.as_ref() else { return 0 };
        let Ok(rel) = path.strip_prefix(&r.live) else {
            return 0;
        };
        let settled = r.settled.get(rel).copied().unwrap_or(0);
        settled + r.pending.get(rel).map_or(0, |ops| ops.len() as u64)
    }

    pub(super) fn synced_through(path: &Path, point: u64) {
        let mut guard = recorder();
        let Some(r) = guard.as_mut() else { return };
        let Ok(rel) = path.strip_prefix(&r.live) else {
            return;
        };
        if !tracked(rel) {
            return;
        }
        let settled = r.settled.entry(rel.to_owned()).or_default();
        let pending = r.pending.entry(rel.to_owned()).or_default();
        let count = point.saturating_sub(*settled).min(pending.len() as u64);
        *settled += count;
        let ops: Vec<Op> = pending.drain(..count as usize).collect();
        let target = r.disk.join(rel);
        let result = (|| -> std::io::Result<()> {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&target)?;
            for op in &ops {
                op.apply(&file)?;
            }
            Ok(())
        })();
        *r.syncs.entry(rel.to_owned()).or_default() += 1;
        if let Err(e) = result {
            r.error
                .get_or_insert(format!("applying a sync to {}: {e}", target.display()));
        }
    }

    pub(super) fn removed(path: &Path) {
        let mut guard = recorder();
        let Some(r) = guard.as_mut() else { return };
        let Ok(rel) = path.strip_prefix(&r.live) else {
            return;
        };
        if let Some(dropped) = r.pending.remove(rel) {
            *r.settled.entry(rel.to_owned()).or_default() += dropped.len() as u64;
        }
        let target = r.disk.join(rel);
        if let Err(e) = std::fs::remove_file(&target) {
            if e.kind() != std::io::ErrorKind::NotFound {
                r.error
                    .get_or_insert(format!("removing {}: {e}", target.display()));
            }
        }
    }

    /// Start recording the files under `live` (an absolute path without symbolic links: the
    /// paths the store and SQLite use must start with it) into the disk image `disk`, which
    /// must hold the same files as `live` now. Replaces an earlier recording.
    pub fn start(live: &Path, disk: &Path) {
        let mut guard = recorder();
        ACTIVE.store(true, Ordering::SeqCst);
        *guard = Some(Recorder {
            live: live.to_owned(),
            disk: disk.to_owned(),
            pending: HashMap::new(),
            settled: HashMap::new(),
            syncs: HashMap::new(),
            error: None,
        });
    }

    /// What the power cut left to decide: the unsynced changes per file.
    #[derive(Debug, Default)]
    pub struct Cut {
        /// Paths relative to the store's directory, with their unsynced changes in order.
        pub pending: Vec<(PathBuf, Vec<Op>)>,
        /// Syncs that reached the disk image during the recording, per file (relative path).
        pub syncs: HashMap<PathBuf, u64>,
    }

    /// The power cut: stop recording; `disk` now holds what was synced. Fails if a sync could
    /// not be applied to the image (or nothing was being recorded).
    pub fn cut() -> Result<Cut, String> {
        let r = {
            let mut guard = recorder();
            ACTIVE.store(false, Ordering::SeqCst);
            guard.take()
        }
        .ok_or_else(|| "no recording to cut".to_owned())?;
        if let Some(e) = r.error {
            return Err(e);
        }
        let mut pending: Vec<(PathBuf, Vec<Op>)> = r.pending.into_iter().collect();
        pending.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Cut {
            pending,
            syncs: r.syncs,
        })
    }
}
