//! The local embedded backend: one directory holding the objects of any number of images.
//!
//! ```text
//! DIR/LOCK            flock'ed by the one process that has the store open for writing (its pid)
//! DIR/meta.sqlite     SQLite (WAL mode): objects, extent maps, omap, snapshots, locks
//! DIR/data/seg-N      data segments, written once per allocation, sparse: dead ranges are
//!                     reused for large writes or punched out
//! ```
//!
//! See the engine module for the commit protocol and docs/ARCHITECTURE.md for why.
//!
//! A store opened read-only ([`LocalStore::open_read_only`]) changes nothing in the directory
//! (no `LOCK`, no recovery, SQLite opened read-only) and reads committed states, also while
//! another process has the store open for writing; see `ReadOnlyMeta`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::fs_space::FsSpace;
use rusqlite::{Connection, OpenFlags};
use rustix::fs::{fallocate, FallocateFlags};

use crate::engine::{
    delegate_object_store, random_client_id, Client, Engine, EngineHandle, Lifetime, MetaSource,
    Request, SegmentMark, Segments, WalFile,
};
use crate::free_space::FreeSpace;
use crate::process_flock::{exclusive_holder, lock_exclusive, FlockRefused, HeldFlock};
use crate::StoreError;

/// A data segment is closed and a new one started past this size.
pub const SEGMENT_SIZE: u64 = 1 << 30;

/// Bytes a local store takes on its file system ([`LocalStore::disk_usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    /// Allocated to the data segments.
    pub data: u64,
    /// Allocated to the metadata database and its log.
    pub metadata: u64,
    /// Held as room for the metadata's commits while the store is open for writing
    /// (`reserved-space`; none once it is closed).
    pub reserved: u64,
}

impl DiskUsage {
    /// Everything the store's directory takes.
    pub fn total(&self) -> u64 {
        self.data + self.metadata + self.reserved
    }
}

/// Options for [`LocalStore::open_with`].
#[derive(Debug, Clone, Default)]
pub struct LocalStoreOptions {
    /// Create the directory (and the store in it) if it does not exist.
    pub create: bool,
}

/// Start writeback of the active segment every this many appended bytes.
const WRITEBACK_KICK: u64 = 8 << 20;

/// Appends shorter than this are gathered in memory (`FileSegments::tail`) and written to the
/// active segment together, once `TAIL_FLUSH` bytes are gathered and before anything relies on
/// them being in the file (a sync, and so every commit; a rotation; a rewind below them).
/// Why: under small random writes the worker spent 13% of its time in one `pwrite` per append
/// (two per operation in the store bench), a system call and page-cache lookups for 2-4 KiB
/// (docs/BENCHMARKS.md, "Small appends gathered").
const TAIL_APPEND_MAX: usize = 64 << 10;

/// Gathered appends are written out once they reach this many bytes.
const TAIL_FLUSH: usize = 256 << 10;

/// Space for gathered appends is allocated ahead (`fallocate`) this many bytes at a time, so
/// that a small write on a full disk still fails itself, with `NoSpace`, instead of the
/// commit that writes the tail.
const RESERVE_STEP: u64 = 64 << 10;
/// The room kept for the metadata's commits (`CommitRoom`): this fraction of the file
/// system, within `COMMIT_ROOM_MIN..=COMMIT_ROOM_MAX`.
const COMMIT_ROOM_FRACTION: u64 = 64;
const COMMIT_ROOM_MIN: u64 = 1 << 20;
const COMMIT_ROOM_MAX: u64 = 64 << 20;

/// The file holding the reserved room (`CommitRoom`), in the store's directory.
const COMMIT_ROOM_FILE: &str = "reserved-space";

/// Every name a local store puts in its directory: a directory holding anything else is not
/// (only) a store.
pub const LOCAL_STORE_FILES: [&str; 7] = [
    "LOCK",
    "meta.sqlite",
    "meta.sqlite-wal",
    "meta.sqlite-shm",
    "data",
    "CLEAN",
    COMMIT_ROOM_FILE,
];

/// `fdatasync` the segments written to, off the worker, every this many bytes written
/// (`SyncAhead`). Why: the kicks above start writeback but did not make the commit's own
/// `fdatasync` short: under random 4 KiB writes through `ivdisk serve` it still took
/// 110-260 ms every 2 s, with every request waiting behind the worker; a file written at
/// 120 MB/s and synced every 16 MiB took 28 ms to sync at the end against 366 ms without
/// (docs/BENCHMARKS.md, "Log syncs off the worker, segment data synced ahead").
const SYNC_AHEAD: u64 = 16 << 20;

/// The writer's SQLite page cache, in KiB (`PRAGMA cache_size`; SQLite takes pages as it
/// needs them, up to this). Random 4 KiB image writes leave about 100 MB of metadata per
/// 4 GiB written (an extent row and its share of a packed omap value per block); with
/// 64 MiB, each write's statements read pages back from the OS and spilled dirty ones to the
/// log mid-transaction: through `ivdisk serve` on such an image, 256 MiB took random 4 KiB
/// writes from 15.1-15.9k to 16.7-18.3k per second (docs/BENCHMARKS.md, "Partial blocks
/// indexed only").
const META_CACHE_KIB: u32 = 256 * 1024;

/// A read-only opener's SQLite page cache, in KiB (taken as needed, up to this). With
/// SQLite's default of 2 MiB, random reads of a served read-only image read most of their
/// metadata pages back from the OS (docs/BENCHMARKS.md, "Read-only opens read in bursts").
const READ_ONLY_META_CACHE_KIB: u32 = 64 * 1024;

/// SQLite checkpoints its log into the database once the log holds this many pages of 4 KiB
/// (`PRAGMA wal_autocheckpoint`; SQLite's default is 1000).
///
/// Why 256 MiB: a checkpoint runs inside the commit that crosses the mark, on the worker
/// (syncing the log, copying the pages, syncing the database), with every request waiting.
/// Under random 4 KiB writes over a 4 GiB image a 2 s group commit writes about 80 MB of
/// pages to the log, so at 1000 pages every commit checkpointed: about 320 ms of each 500 ms
/// commit. At this mark one commit in three or four does, and since the same pages are
/// dirtied again commit after commit, a checkpoint copies hardly more than after one
/// (docs/BENCHMARKS.md, "Log syncs off the worker"). The log file grows to about this size
/// once and is reused from its start after each checkpoint. The price: after a crash,
/// recovery reads up to this much log (an open after SIGKILL in 3.0 s instead of 2.0 s on a
/// 4 GiB image under those writes).
///
/// Builds with the `fault-io` feature (the store's own tests) keep SQLite's default, so that
/// the crash and power-loss tests, which write little, cut through checkpoints too.
const WAL_CHECKPOINT_PAGES: u32 = if cfg!(feature = "fault-io") {
    1000
} else {
    65536
};

/// The file system block size assumed for alignment.
const BLOCK: usize = 4096;

/// Dead space held for reuse at most (past it, dead ranges are punched at once).
const REUSE_MAX: u64 = 1 << 30;

/// Dead space held for reuse is punched once no write has taken any for this long, so a
/// store that stopped writing (or only discards) gives its dead space back to the file
/// system soon.
const REUSE_IDLE: Duration = Duration::from_secs(2);

/// Once writes stopped, held space goes to the punch thread this many ranges at a time, the
/// next batch only when the last one is punched (checked every `RELEASE_STEP`), and stays
/// reusable until then. Handed over at once, the tens of thousands of 4 KiB ranges random
/// overwrites leave took the punch thread 5-10 s on a `discard` mount, and writes that came
/// back meanwhile found nothing to reuse and their file contended with the punches (random
/// 4 KiB writes through `ivdisk serve` 3 s after earlier ones: 10.5-12.9k IOPS against
/// 15.5-17.3k 20 s after; docs/BENCHMARKS.md, "held space released in batches").
const RELEASE_BATCH: usize = 256;
const RELEASE_STEP: Duration = Duration::from_millis(10);

/// A write of whole blocks goes into one held range that holds it all (best fit) when there
/// is one; otherwise it is split over held ranges of at least `min(its length, this)`, into
/// at most `REUSE_PIECES_MAX` pieces (each an extent of its own), and the rest is appended.
/// So a small write reuses a small dead range (a 4 KiB write the block an earlier 4 KiB
/// write left dead), while a large one is never cut into many small extents.
///
/// Builds with the `fault-io` feature (the store's own tests) use 16 KiB, so that the crash,
/// power-loss and space tests, whose writes are at most 32-256 KiB, go through the splitting
/// too.
const REUSE_SPLIT_MIN: u64 = if cfg!(feature = "fault-io") {
    16 << 10
} else {
    256 << 10
};
const REUSE_PIECES_MAX: usize = 16;

struct FileSegments {
    dir: PathBuf,
    /// Shared with the puncher thread.
    files: HashMap<u32, Arc<File>>,
    /// Punches and flush barriers, done in order off the worker thread: a hole punch can
    /// take long (ext4 mounted with `discard` issues the discard synchronously, measured at
    /// seconds under random overwrites) and the worker must keep serving meanwhile.
    puncher: Option<Puncher>,
    /// Punch jobs sent and not yet done (shared with the puncher thread): held space is
    /// released in batches, the next once this is back at zero.
    punches_queued: Arc<AtomicUsize>,
    /// Writeback starts (`kick_writeback`), done off the worker thread: submitting the
    /// writes can block in the block layer's writeback throttling (`rq_qos_wait`), and the
    /// worker, with every request behind it, would wait there.
    writeback: Option<Writeback>,
    active: u32,
    /// Where the next append goes in the active segment (past `tail`).
    len: u64,
    /// Appends to the active segment not written to its file yet: the bytes of
    /// `[len - tail.len(), len)` (see `TAIL_APPEND_MAX`). Reads of that range are answered
    /// from here.
    tail: Vec<u8>,
    /// The active segment's blocks are allocated up to here (`fallocate` past its end), so
    /// writing the tail cannot run out of space.
    reserved: u64,
    /// False once the file system refused `fallocate`: appends are then written at once.
    gather: bool,
    /// Set once the file system refused to read without waiting (`read_if_cached`).
    nowait_refused: Cell<bool>,
    unsynced: u64,
    /// Writeback of the active segment was started up to here (`write_tail`).
    kicked: u64,
    /// Appended ranges whose writeback was started, their pages to be dropped from the page
    /// cache once a sync has made them clean (`drop_written_back`).
    written_back: Vec<(Arc<File>, u64, u64)>,
    /// Segments written since the last sync (more than one after a rotation).
    dirty: Vec<u32>,
    /// Bytes past the last committed reference, truncated at open.
    dropped_at_open: u64,
    /// Unreferenced bytes found (and handed to the punch thread) by the reclaim after an
    /// unclean stop, so far; shared with the reclaim thread and the store's recovery report.
    reclaimed: Arc<AtomicU64>,
    /// The reclaim after an unclean stop, while its thread may run.
    reclaim: Option<Reclaim>,
    /// Dead whole blocks (their death durable) that writes of whole blocks go into before
    /// they grow a segment: rewriting pages the file already has costs a third of allocating
    /// fresh ones, and punching the old ones costs a discard each on a `discard` mount, which
    /// under random 4 KiB overwrites halved the writes a busy machine served
    /// (docs/BENCHMARKS.md, "dead space reused" and "small writes reuse dead space too").
    free: FreeSpace,
    /// Ranges taken from `free` since the last sync, in order (`rewind` gives them back).
    reused: Vec<(u32, u64, u64)>,
    /// Reused ranges whose writeback has not been started, and their bytes.
    unkicked: Vec<(u32, u64, u64)>,
    unkicked_bytes: u64,
    /// Bytes written (appended or into reused space) since the last sync ahead.
    unsynced_ahead: u64,
    /// When a write last took space from `free` (or space went in while it was empty).
    last_reuse: Instant,
    /// When a write of whole blocks (one that can reuse space) last came. Dead space is held
    /// only while such writes come; under other writes alone it would wait for nothing.
    last_block_write: Option<Instant>,
    /// Room kept on the file system for the metadata's commits.
    room: CommitRoom,
    /// The data directory and the metadata database as opened (device, inode): a durable
    /// commit checks they are still there (`Segments::check_in_place`).
    opened_as: Vec<(PathBuf, (u64, u64))>,
}

/// Start writeback of `[offset, offset + len)` of `file` without waiting for it
/// (`posix_fadvise(DONTNEED)` writes dirty pages back and drops only pages already clean).
fn start_writeback(file: &File, offset: u64, len: u64) {
    advise(file, offset, len, rustix::fs::Advice::DontNeed);
}

/// `posix_fadvise` over `[offset, offset + len)`; only a hint, so a refusal changes nothing.
fn advise(file: &File, offset: u64, len: u64, advice: rustix::fs::Advice) {
    let _ = rustix::fs::fadvise(file, offset, std::num::NonZeroU64::new(len), advice);
}

/// Start reading `[offset, offset + len)` of `file` into the page cache without waiting for
/// it (`posix_fadvise(WILLNEED)`): the disk then works on every piece of a fragmented read at
/// once, where reading them one by one waits for each in turn.
fn start_reading(file: &File, offset: u64, len: u64) {
    advise(file, offset, len, rustix::fs::Advice::WillNeed);
}

/// Read an extent's bytes from its segment. A segment that ends before the extent does was
/// cut short or replaced behind the store's back (the store never shortens a segment that
/// extents point into): that is damage, said as such with the sizes, where the bare
/// `UnexpectedEof` read as "failed to fill whole buffer".
fn read_segment_at(
    file: &File,
    offset: u64,
    buf: &mut [u8],
    path: impl Fn() -> PathBuf,
) -> Result<(), StoreError> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() != std::io::ErrorKind::UnexpectedEof {
            return StoreError::from_io(format!("reading {}", path().display()), e);
        }
        let held = file
            .metadata()
            .map_or_else(|_| "fewer".to_owned(), |m| m.len().to_string());
        StoreError::Corrupt(format!(
            "segment file {} ends before an extent in it: the extent is bytes {offset}..{} and \
             the file holds {held} bytes (it was cut short or replaced); restore the image from \
             a backup",
            path().display(),
            offset + buf.len() as u64,
        ))
    })
}

/// Fill `buf` from `file` at `offset` if the page cache holds all of it (`preadv2` with
/// `RWF_NOWAIT`); false when a read would wait for the disk (then `buf` holds anything and
/// the caller reads it the usual way, which also reports any error). A file system that
/// cannot read without waiting (`EOPNOTSUPP`: tmpfs, for one) is read the usual way here,
/// from then on without asking (`refused`): telling the caller "not cached" would have it
/// make every read twice and hint the disk for nothing (random 4 KiB reads through `ivdisk
/// serve` of an image on tmpfs lost a fifth).
fn read_if_cached(file: &File, offset: u64, buf: &mut [u8], refused: &Cell<bool>) -> bool {
    if refused.get() {
        return file.read_exact_at(buf, offset).is_ok();
    }
    let mut done = 0;
    while done < buf.len() {
        let piece = &mut [std::io::IoSliceMut::new(&mut buf[done..])];
        match rustix::io::preadv2(
            file,
            piece,
            offset + done as u64,
            rustix::io::ReadWriteFlags::NOWAIT,
        ) {
            Ok(0) => return false,
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::OPNOTSUPP) => {
                refused.set(true);
                return file
                    .read_exact_at(&mut buf[done..], offset + done as u64)
                    .is_ok();
            }
            Err(_) => return false,
        }
    }
    true
}

fn start_writeback_now(job: &WritebackJob) {
    match job {
        WritebackJob::Appended(file, offset, len) | WritebackJob::DropClean(file, offset, len) => {
            start_writeback(file, *offset, *len)
        }
        WritebackJob::Scattered(file, offset, len) => {
            crate::ffi_writeback::start_writeback_of_dirty(file, *offset, *len)
        }
        WritebackJob::SyncAhead(path) => {
            // A descriptor of its own: Linux reports a writeback error to each open file
            // once, so a sync through the segments' descriptor could take the error from the
            // commit's `fdatasync`, which must see it. Not reported to `fault_io`: the
            // power-loss model counts data synced only by the commit's own sync (conservative).
            // A segment removed meanwhile (a failed transaction's rotation taken back) has
            // nothing left to sync.
            match File::open(path).and_then(|f| f.sync_data()) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!(segment = %path.display(), error = %e, "syncing a segment ahead of its commit failed; the commit's own sync will report it");
                }
                _ => {}
            }
        }
    }
}

/// Segment writes go to the file in pieces of at most this much, each within one aligned
/// `WRITE_PIECE` of the file.
///
/// Why: the page cache gives a write a folio as large as the write's aligned length allows,
/// so a 2 MiB write at a 2 MiB boundary takes a 2 MiB folio (order 9). On a VM with free page
/// reporting (virtio-balloon; this project's machines) free blocks of that order are the ones
/// handed back to the host, and the copy into such a folio ran at about 0.5 GB/s, against
/// 3.5-4 GB/s in 1 MiB pieces (docs/BENCHMARKS.md, "4 MiB store writes in 1 MiB pieces").
/// On a later VM (Intel, 2026-12-02) 1 MiB folios crawled too: the worker spent 42% of the
/// machine's samples copying 4 MiB writes into them, at 0.5-0.7 GB/s; in 64 KiB pieces
/// 4 MiB store writes ran at 1.9-2.1 GB/s and 1 MiB ones 1.0-1.9 -> 2.0-2.2 GB/s, with 256
/// KiB pieces close behind (docs/BENCHMARKS.md, "Extent overlay keys as integers; segment
/// writes in 64 KiB pieces"). Sixteen system calls per MiB cost nothing measurable there.
const WRITE_PIECE: u64 = 64 << 10;

/// `write_all_at` in aligned pieces of at most `WRITE_PIECE` (see there).
fn write_in_pieces(file: &File, data: &[u8], at: u64) -> std::io::Result<()> {
    let mut done = 0;
    for len in piece_lengths(at, data.len()) {
        file.write_all_at(&data[done..done + len], at + done as u64)?;
        done += len;
    }
    Ok(())
}

/// The lengths of the pieces `write_in_pieces` cuts `len` bytes at `at` into: none crosses a
/// multiple of `WRITE_PIECE`.
fn piece_lengths(at: u64, len: usize) -> impl Iterator<Item = usize> {
    let mut next = at;
    let end = at + len as u64;
    std::iter::from_fn(move || {
        (next < end).then(|| {
            let piece_end = (next / WRITE_PIECE + 1) * WRITE_PIECE;
            let len = piece_end.min(end) - next;
            next += len;
            len as usize
        })
    })
}

/// The whole blocks inside `[offset, offset + len)`, as `[from, to)`; `None` if there are none.
fn whole_blocks(offset: u64, len: u64) -> Option<(u64, u64)> {
    let block = BLOCK as u64;
    let (from, to) = (
        offset.next_multiple_of(block),
        (offset + len) / block * block,
    );
    (from < to).then_some((from, to))
}

/// Open (creating if needed, never truncating) a file the store reads and writes.
fn open_read_write(path: &Path) -> Result<File, StoreError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(StoreError::io_with(|| {
            format!("opening {}", path.display())
        }))
}

fn segment_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("seg-{n:08}"))
}

/// Segment `n` of the data directory `dir` is not there, though an extent points into it:
/// deleted or moved behind the store's back (the store removes only segments nothing
/// references).
fn missing_segment(dir: &Path, n: u32) -> StoreError {
    StoreError::Corrupt(format!(
        "segment file {} is missing, and data of the store is in it (it was deleted or moved \
         behind the store's back): put it back if it was moved, or restore the image from a \
         backup",
        segment_path(dir, n).display()
    ))
}

/// After an unclean stop, make the state this open found durable before anything acts on it:
/// the segments, then the metadata log. A process killed between a group commit and the
/// durable commit after it leaves commits in the page cache, unsynced (and so does a run whose
/// log sync failed); the reclaim then punched the space those commits had freed, and a power
/// cut before this run's first durable commit brought back the synced state, whose extents
/// still referenced that space: flushed data read as holes. The segments first, as at every
/// durable commit: a log made durable must not reference data that is not.
fn make_found_state_durable(dir: &Path) -> Result<(), StoreError> {
    let segments = dir.join("data");
    let listed = match std::fs::read_dir(&segments) {
        Ok(listed) => listed,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::io(format!("listing {}", segments.display()))(e)),
    };
    let sync = |path: &Path| -> Result<(), StoreError> {
        match File::open(path) {
            Ok(file) => {
                file.sync_data().map_err(StoreError::io_with(|| {
                    format!(
                        "syncing {} after an unclean stop (the store cannot make what it \
                         holds durable: check the disk)",
                        path.display()
                    )
                }))?;
                crate::fault_io::synced(path);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(format!("opening {}", path.display()))(e)),
        }
    };
    for entry in listed {
        let entry = entry.map_err(StoreError::io_with(|| {
            format!("listing {}", segments.display())
        }))?;
        if entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("seg-"))
        {
            sync(&entry.path())?;
        }
    }
    sync(&dir.join("meta.sqlite-wal"))?;
    sync(&dir.join("meta.sqlite"))
}

impl FileSegments {
    /// Open the segments. After an unclean stop (`reclaim`), dead data whose punch was still
    /// pending when the process died is found (bytes no extent references) and punched.
    fn open(dir: PathBuf, db: &Connection, reclaim: bool) -> Result<Self, StoreError> {
        std::fs::create_dir_all(&dir).map_err(StoreError::io_with(|| {
            format!("creating {}", dir.display())
        }))?;
        let mut numbers: Vec<u32> = std::fs::read_dir(&dir)
            .map_err(StoreError::io_with(|| format!("listing {}", dir.display())))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("seg-"))
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        numbers.sort();
        // The segment the last commit appended to must be there: opened with `create`, a
        // deleted one came back empty, the store's data in it read as cut short, and the
        // appends after went on behind a hole.
        if let Some((segment, offset)) = Engine::stored_append_end(db)? {
            let segment = u32::try_from(segment).unwrap_or(u32::MAX);
            if offset > 0 && !numbers.contains(&segment) {
                return Err(missing_segment(&dir, segment));
            }
        }
        if numbers.is_empty() {
            numbers.push(1);
        }
        let mut files = HashMap::new();
        for &n in &numbers {
            let path = segment_path(&dir, n);
            files.insert(n, Arc::new(open_read_write(&path)?));
        }
        let active = *numbers.last().expect("at least one");
        // Appends past what committed metadata references belong to operations that never
        // committed (a crash): drop them.
        let len = Engine::committed_end(db, active)?;
        let file = &files[&active];
        let on_disk = file
            .metadata()
            .map_err(StoreError::io("reading a segment's size"))?
            .len();
        let dropped_at_open = on_disk.saturating_sub(len);
        if on_disk > len {
            tracing::info!(
                segment = active,
                dropped = on_disk - len,
                "dropping data of operations that did not commit before the last stop"
            );
            file.set_len(len)
                .map_err(StoreError::io("truncating the active segment"))?;
            crate::fault_io::set_len(|| segment_path(&dir, active), len);
        }
        let mut segments = FileSegments {
            room: CommitRoom::new(dir.parent().unwrap_or(&dir)),
            dir,
            files,
            puncher: None,
            punches_queued: Arc::new(AtomicUsize::new(0)),
            writeback: None,
            active,
            len,
            tail: Vec::new(),
            reserved: len,
            gather: true,
            nowait_refused: Cell::new(false),
            unsynced: 0,
            kicked: len,
            written_back: Vec::new(),
            dirty: Vec::new(),
            dropped_at_open,
            reclaimed: Arc::new(AtomicU64::new(0)),
            reclaim: None,
            free: FreeSpace::default(),
            reused: Vec::new(),
            unkicked: Vec::new(),
            unkicked_bytes: 0,
            unsynced_ahead: 0,
            last_reuse: Instant::now(),
            last_block_write: None,
            opened_as: Vec::new(),
        };
        let database = segments.dir.parent().map(|store| store.join("meta.sqlite"));
        for path in std::iter::once(segments.dir.clone()).chain(database) {
            if let Ok(meta) = std::fs::metadata(&path) {
                segments.opened_as.push((path, (meta.dev(), meta.ino())));
            }
        }
        if reclaim {
            segments.start_reclaim(db)?;
        }
        Ok(segments)
    }

    /// Start the reclaim after an unclean stop: a thread finds every byte range of the
    /// segments that no extent references and queues its punch (punched, not held for reuse:
    /// the open is not a durable commit).
    ///
    /// Why a thread: the search reads every extent row (0.5-1.1 s per million, a 4 GiB image
    /// after random 4 KiB writes), and an open (a server's restart after a crash) should not
    /// wait for it (docs/BENCHMARKS.md, "The reclaim after a crash off the open").
    ///
    /// Safe while the worker writes, because the search reads the state of this open (its read
    /// transaction starts here, before the worker exists) and only whole blocks are punched:
    /// a whole block no extent referenced then is referenced by nothing later. New data goes
    /// past the append position of this open or into blocks freed by later commits, which
    /// held live bytes at this open, and a dead range is widened only over partial blocks at
    /// its ends (see `punch_now_or_later`).
    fn start_reclaim(&mut self, db: &Connection) -> Result<(), StoreError> {
        let path = db
            .path()
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .ok_or_else(|| StoreError::Database("the store's database has no file".into()))?;
        let scan = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        scan.busy_timeout(Duration::from_secs(5))?;
        scan.execute_batch("PRAGMA query_only = ON; BEGIN")?;
        // The read transaction's snapshot is taken by its first read.
        scan.query_row("SELECT count(*) FROM meta", [], |_| Ok(()))?;
        let mut ends = Vec::with_capacity(self.files.len());
        for (&n, file) in &self.files {
            let end = match n == self.active {
                true => self.len,
                false => file
                    .metadata()
                    .map_err(StoreError::io("reading a segment's size"))?
                    .len(),
            };
            ends.push((n, end, file.clone()));
        }
        let queue = PunchQueue {
            dir: self.dir.clone(),
            jobs: self.puncher()?.clone(),
            queued: self.punches_queued.clone(),
        };
        let abandon = Arc::new(AtomicBool::new(false));
        let found = self.reclaimed.clone();
        let thread = std::thread::Builder::new()
            .name("ivdisk-store-reclaim".into())
            .spawn({
                let abandon = abandon.clone();
                move || {
                    let started = Instant::now();
                    let (before_reading, before_punching) = crate::fault_io::reclaim_delays();
                    std::thread::sleep(before_reading);
                    let search = queue_unreferenced(&scan, ends, &queue, &found, &abandon, || {
                        std::thread::sleep(before_punching)
                    });
                    match search {
                        Ok(finished) => {
                            if finished && found.load(Ordering::Relaxed) > 0 {
                                tracing::info!(
                                    bytes = found.load(Ordering::Relaxed),
                                    seconds = started.elapsed().as_secs_f64(),
                                    "found the segment data no committed operation references \
                                     (dead data whose release was pending at the last stop): \
                                     punching it"
                                );
                            }
                            finished
                        }
                        Err(e) => {
                            tracing::warn!(
                                error = %e,
                                "could not search the segments for dead data left by the \
                                 last stop: its space stays used until the next reclaim"
                            );
                            false
                        }
                    }
                }
            })
            .map_err(StoreError::io("starting the store's reclaim thread"))?;
        self.reclaim = Some(Reclaim { thread, abandon });
        Ok(())
    }

    /// Wait until the reclaim thread, if one runs, has queued every punch it found (with
    /// `abandon`, stop it first); false if it did not finish its search (stopped, or failed).
    fn finish_reclaim(&mut self, abandon: bool) -> bool {
        let Some(reclaim) = self.reclaim.take() else {
            return true;
        };
        if abandon {
            reclaim.abandon.store(true, Ordering::Relaxed);
        }
        reclaim.thread.join().unwrap_or(false)
    }

    fn rotate(&mut self) -> Result<(), StoreError> {
        self.write_tail()?;
        if self.reserved > self.len {
            // Space allocated ahead and not used: given back (ext4 frees blocks past the
            // end at a truncation to the same size).
            let _ = self.files[&self.active].set_len(self.len);
        }
        let next = self.active + 1;
        let path = segment_path(&self.dir, next);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(StoreError::io_with(|| {
                format!("creating {}", path.display())
            }))?;
        // The new file's directory entry must survive a power cut before data in it is
        // referenced by a commit.
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(StoreError::io_with(|| {
                format!("syncing {}", self.dir.display())
            }))?;
        // The old segment's last appends were not kicked; their pages go too after a sync.
        let old = self.files[&self.active].clone();
        if self.len > self.kicked {
            self.written_back
                .push((old, self.kicked, self.len - self.kicked));
        }
        self.files.insert(next, Arc::new(file));
        self.active = next;
        self.len = 0;
        self.reserved = 0;
        self.kicked = 0;
        Ok(())
    }
}

enum PunchJob {
    Punch {
        file: Arc<File>,
        offset: u64,
        len: u64,
    },
    /// Run once every earlier punch is done (a flush's reply).
    Barrier(Box<dyn FnOnce() + Send>),
}

/// The puncher thread: a failed punch only leaks space (reclaimed by the next open after an
/// unclean stop), so it is logged, not returned.
///
/// It takes every job queued so far at once and punches the ranges before each barrier
/// merged per file: on a file system mounted with `discard` each punch waits for the
/// device, so a backlog of thousands of small dead ranges (random overwrites) made a flush
/// wait seconds; neighbours in a segment often die together and merge into one punch.
///
/// Once `abandon` is set it punches nothing more (barriers still run), and it says it is done
/// by dropping `_finished`.
fn run_puncher(
    jobs: mpsc::Receiver<PunchJob>,
    abandon: Arc<AtomicBool>,
    queued: Arc<AtomicUsize>,
    _finished: mpsc::Sender<()>,
) {
    let mut ranges: Vec<(Arc<File>, u64, u64)> = Vec::new();
    let punch_all = |ranges: &mut Vec<(Arc<File>, u64, u64)>| {
        let n = ranges.len();
        punch_merged(ranges, &abandon);
        queued.fetch_sub(n, Ordering::AcqRel);
    };
    while let Ok(first) = jobs.recv() {
        let mut next = Some(first);
        while let Some(job) = next.take() {
            match job {
                PunchJob::Punch { file, offset, len } => ranges.push((file, offset, offset + len)),
                PunchJob::Barrier(done) => {
                    punch_all(&mut ranges);
                    done();
                }
            }
            next = jobs.try_recv().ok();
        }
        punch_all(&mut ranges);
    }
}

/// A range of a segment whose writeback is to start.
enum WritebackJob {
    /// Appended: `posix_fadvise(DONTNEED)` (see `start_writeback`).
    Appended(Arc<File>, u64, u64),
    /// Written into reused space, scattered over the range: `sync_file_range(WRITE)`, which
    /// walks only the dirty pages and drops no cached ones.
    Scattered(Arc<File>, u64, u64),
    /// `fdatasync` the segment at this path (`SYNC_AHEAD`).
    SyncAhead(PathBuf),
    /// Appended and synced since: `posix_fadvise(DONTNEED)` drops its clean pages
    /// (`FileSegments::drop_written_back`).
    DropClean(Arc<File>, u64, u64),
}

/// The writeback thread and what the segments keep of it.
struct Writeback {
    jobs: mpsc::Sender<WritebackJob>,
    thread: std::thread::JoinHandle<()>,
}

/// The puncher thread and what the segments keep of it.
struct Puncher {
    jobs: mpsc::Sender<PunchJob>,
    thread: std::thread::JoinHandle<()>,
    /// Set: punch nothing more.
    abandon: Arc<AtomicBool>,
    /// Disconnected once the thread is done.
    finished: mpsc::Receiver<()>,
}

fn punch_merged(ranges: &mut Vec<(Arc<File>, u64, u64)>, abandon: &AtomicBool) {
    if abandon.load(Ordering::Relaxed) {
        ranges.clear();
        return;
    }
    ranges.sort_unstable_by_key(|(file, from, _)| (Arc::as_ptr(file), *from));
    let mut pending: Option<(Arc<File>, u64, u64)> = None;
    for (file, from, to) in ranges.drain(..) {
        match pending.as_mut() {
            Some((f, _, end)) if Arc::ptr_eq(f, &file) && from <= *end => *end = (*end).max(to),
            _ => {
                if let Some(done) = pending.replace((file, from, to)) {
                    if abandon.load(Ordering::Relaxed) {
                        pending = None;
                        break;
                    }
                    punch_now(&done);
                }
            }
        }
    }
    ranges.clear();
    if let Some(done) = pending {
        if !abandon.load(Ordering::Relaxed) {
            punch_now(&done);
        }
    }
}

fn punch_now((file, from, to): &(Arc<File>, u64, u64)) {
    if let Err(e) = fallocate(
        &**file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        *from,
        to - from,
    ) {
        tracing::warn!(offset = from, len = to - from, error = %e, "could not punch dead data out of a segment; its space stays used");
    }
}

impl FileSegments {
    /// Start writeback of a range, on the writeback thread (best effort: the commit's
    /// `fdatasync` writes whatever this did not, so without the thread it is done here).
    fn kick_writeback(&mut self, job: WritebackJob) {
        if self.writeback.is_none() {
            let (jobs, queue) = mpsc::channel::<WritebackJob>();
            let started = std::thread::Builder::new()
                .name("ivdisk-store-wb".into())
                .spawn(move || {
                    while let Ok(job) = queue.recv() {
                        start_writeback_now(&job);
                    }
                });
            match started {
                Ok(thread) => self.writeback = Some(Writeback { jobs, thread }),
                Err(e) => {
                    tracing::warn!(error = %e, "could not start the store's writeback thread; starting writeback on the worker");
                    start_writeback_now(&job);
                    return;
                }
            }
        }
        let writeback = self.writeback.as_ref().expect("just set");
        if let Err(mpsc::SendError(job)) = writeback.jobs.send(job) {
            start_writeback_now(&job);
        }
    }

    fn puncher(&mut self) -> Result<&mpsc::Sender<PunchJob>, StoreError> {
        if self.puncher.is_none() {
            let (jobs, queue) = mpsc::channel();
            let abandon = Arc::new(AtomicBool::new(false));
            let (finished_tx, finished) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name("ivdisk-store-punch".into())
                .spawn({
                    let abandon = abandon.clone();
                    let queued = self.punches_queued.clone();
                    move || run_puncher(queue, abandon, queued, finished_tx)
                })
                .map_err(StoreError::io("starting the store's punch thread"))?;
            self.puncher = Some(Puncher {
                jobs,
                thread,
                abandon,
                finished,
            });
        }
        Ok(&self.puncher.as_ref().expect("just set").jobs)
    }
}

impl Drop for FileSegments {
    fn drop(&mut self) {
        // A clean stop has taken the reclaim already (`settle_within`); anything else stops it.
        self.finish_reclaim(true);
        self.settle();
        // A closed store commits nothing: its reserved room goes back to the file system.
        self.room.release("the store is closing");
    }
}

/// Room on the file system for the metadata's commits.
///
/// Why: a group commit writes the metadata of every operation acknowledged since the last one
/// into SQLite's log, and SQLite rolls back a COMMIT that runs out of space: those
/// operations are lost. Data that filled the disk to its last block (`nbdcopy` into a served
/// image until ENOSPC) lost 130 MB of acknowledged writes that way, and another program
/// filling the disk between a write and its flush did the same. So the store keeps room for
/// its commits, in two ways:
/// - while open for writing it holds a file of `size` bytes, allocated (`reserved-space` in
///   its directory). A commit that finds less than `size` bytes free deletes it first, so
///   the commit has that room whoever took the rest. It is made again at a later commit
///   once the file system has twice its size free, and deleted at a clean close;
/// - while it does not hold that file, appends leave `size` bytes free: a write that does not
///   fit fails itself with `NoSpace`, before it is acknowledged;
/// - held file or not, appends also leave free what SQLite's next checkpoint needs
///   (`checkpoint_debt`): a log that was not checkpointed is not written over from its start,
///   so without it the commits after a full disk, the next open's among them, had none.
///
/// `size` is 1/64 of the file system, 1..=64 MiB. Random 4 KiB writes need about 600 bytes of
/// log each, so a transaction on a file system short of space commits early, before it could
/// need more than the room (`Engine::commit_bytes`), and an operation whose metadata would
/// take its commit past half the room is refused before it is applied
/// (`Engine::check_commit_room`). A commit that needs more all the same (the pages around its
/// rows are estimated, not measured) is lost, and the image layer's fence
/// (`ImageError::WritesLost`) is the last line.
struct CommitRoom {
    path: PathBuf,
    /// `COMMIT_ROOM_FRACTION` of the file system, once measured (at the first commit).
    size: u64,
    /// The file is there with `size` bytes allocated.
    held: bool,
    /// The file system cannot allocate a file's space ahead: appends alone leave the room.
    unsupported: bool,
    /// Bytes appends may take before the file system is asked again
    /// (`FileSegments::check_room`); zero whenever the room is taken or given back, and at
    /// every commit (another program may have taken space meanwhile).
    unchecked: u64,
    /// Bytes free on the file system when it was last asked, counting the room's own.
    last_free: Option<u64>,
    /// Bytes the metadata database still needs to take in its log, as of the last commit
    /// (`Engine::checkpoint_debt`): kept free as well, held room or not.
    checkpoint_debt: u64,
}

impl CommitRoom {
    /// The room of a store whose directory is `store_dir`; a file left by a process that
    /// died while it held it is taken over (made whole at the first commit).
    fn new(store_dir: &Path) -> CommitRoom {
        let path = store_dir.join(COMMIT_ROOM_FILE);
        CommitRoom {
            held: path.is_file(),
            path,
            size: 0,
            unsupported: false,
            unchecked: 0,
            last_free: None,
            checkpoint_debt: 0,
        }
    }

    /// Bytes the room needs, for a file system of `total` bytes.
    fn size_for(total: u64) -> u64 {
        (total / COMMIT_ROOM_FRACTION).clamp(COMMIT_ROOM_MIN, COMMIT_ROOM_MAX)
    }

    /// Bytes the next commit has, as last seen: the free space and the room's own.
    fn commit_room(&self) -> Option<u64> {
        let free = self.last_free?;
        Some(match self.held {
            true => free.saturating_add(self.size),
            false => free,
        })
    }

    /// Bytes an append must leave free: the checkpoint's debt, and the room's size while the
    /// file does not hold it.
    fn kept_free(&self) -> u64 {
        let room = match self.held && self.size > 0 {
            true => 0,
            false => self.size.max(COMMIT_ROOM_MIN),
        };
        room.saturating_add(self.checkpoint_debt)
    }

    /// Before a commit, with `space` the file system's state now: give the file's space to the
    /// commit if the file system is short of it, or take the room again once it is roomy.
    fn before_commit(&mut self, space: FsSpace) {
        let free = space.usable;
        self.unchecked = 0;
        self.last_free = Some(free);
        if self.size == 0 {
            self.size = Self::size_for(space.total);
            if self.held {
                // Left by an earlier open that did not close: made whole (it may be short, or
                // of another size), or given to this commit if the file system is short.
                if free >= self.size.saturating_add(self.checkpoint_debt) {
                    self.held = false;
                    self.take(free);
                } else {
                    self.release("the file system is nearly full");
                }
                return;
            }
        }
        let debt = self.checkpoint_debt;
        if self.held && free < self.size.saturating_add(debt) {
            tracing::warn!(
                path = %self.path.display(),
                free,
                "the store's file system is nearly full: its reserved room goes to this commit, and writes that need new space are refused until space is freed"
            );
            self.release("the file system is nearly full");
        } else if !self.held && !self.unsupported && free >= (2 * self.size).saturating_add(debt) {
            self.take(free);
        }
    }

    fn take(&mut self, free: u64) {
        self.unchecked = 0;
        let made = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)
            .and_then(|file| {
                file.set_len(0)?;
                fallocate(&file, FallocateFlags::empty(), 0, self.size).map_err(Into::into)
            });
        match made {
            Ok(()) => {
                self.held = true;
                self.last_free = Some(free.saturating_sub(self.size));
                tracing::debug!(path = %self.path.display(), bytes = self.size, free, "reserved room for the store's commits");
            }
            Err(e) => {
                let _ = std::fs::remove_file(&self.path);
                if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                    self.unsupported = true;
                    tracing::info!("the file system cannot allocate space ahead; the store keeps room for its commits by refusing appends instead");
                } else {
                    tracing::debug!(path = %self.path.display(), error = %e, "could not reserve room for the store's commits");
                }
            }
        }
    }

    fn release(&mut self, why: &str) {
        if !self.held {
            return;
        }
        self.held = false;
        self.unchecked = 0;
        self.last_free = self.last_free.map(|free| free.saturating_add(self.size));
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                tracing::debug!(path = %self.path.display(), "reserved room given back: {why}")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "could not give back the store's reserved room")
            }
        }
    }
}

impl FileSegments {
    /// Write `data` at `at` of `segment`, a range just taken from the space held for reuse.
    /// Allocate the active segment's blocks up to at least `end` for the tail; false if the
    /// file system cannot (then appends are not gathered any more).
    fn reserve(&mut self, end: u64) -> Result<bool, StoreError> {
        if !self.gather {
            return Ok(false);
        }
        if end <= self.reserved {
            return Ok(true);
        }
        let from = self.reserved.max(self.len - self.tail.len() as u64);
        let to = end.next_multiple_of(RESERVE_STEP);
        self.check_room(to - from)?;
        let file = &*self.files[&self.active];
        match fallocate(file, FallocateFlags::KEEP_SIZE, from, to - from) {
            Ok(()) => {
                self.reserved = to;
                Ok(true)
            }
            Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
                tracing::info!(
                    "the file system cannot allocate space ahead; small appends are written one by one"
                );
                self.gather = false;
                Ok(false)
            }
            Err(e) => Err(StoreError::from_io(
                format!(
                    "allocating space in {}",
                    segment_path(&self.dir, self.active).display()
                ),
                e.into(),
            )),
        }
    }

    /// Refuse an append of `len` bytes that would leave the metadata's commits without room
    /// (`CommitRoom`): it fails itself, before it is acknowledged, instead of the commit that
    /// would lose every operation since the last flush.
    ///
    /// While the store holds the room's file, the file system is asked (`statfs`) only when
    /// appends since the last answer may have used half of what was free (a system call per
    /// 64 KiB append otherwise); while it does not, at every append.
    fn check_room(&mut self, len: u64) -> Result<(), StoreError> {
        if let Some(left) = self.room.unchecked.checked_sub(len) {
            self.room.unchecked = left;
            return Ok(());
        }
        let Some(space) = FsSpace::of(&*self.files[&self.active]) else {
            return Ok(());
        };
        let free = space.usable;
        let kept = self.room.kept_free();
        self.room.last_free = Some(free);
        // Without the room's file, each append asks: another program's writes would
        // otherwise go unseen until the commit that has no room left.
        self.room.unchecked = match self.room.held && self.room.size > 0 {
            true => free.saturating_sub(len.saturating_add(kept)) / 2,
            false => 0,
        };
        if free < len.saturating_add(kept) {
            return Err(StoreError::NoSpace {
                context: format!(
                    "appending {len} bytes to {}: its file system has {free} bytes free, and \
                     {kept} bytes are kept for the store's metadata",
                    segment_path(&self.dir, self.active).display()
                ),
            });
        }
        Ok(())
    }

    /// Write the tail (appends gathered in memory) to the active segment's file.
    fn write_tail(&mut self) -> Result<(), StoreError> {
        if self.tail.is_empty() {
            return Ok(());
        }
        let at = self.len - self.tail.len() as u64;
        write_in_pieces(&self.files[&self.active], &self.tail, at).map_err(StoreError::io_with(
            || format!("writing {}", segment_path(&self.dir, self.active).display()),
        ))?;
        crate::fault_io::write(|| segment_path(&self.dir, self.active), at, &self.tail);
        self.tail.clear();
        self.kick_appended();
        Ok(())
    }

    /// Start the disk writes of what was written to the active segment since the last kick
    /// once that is `WRITEBACK_KICK` bytes, without waiting for them: the commit's
    /// `fdatasync` (on the worker, every request waiting behind it) then finds little left
    /// to write. `DONTNEED` starts writeback of dirty pages and drops only pages already
    /// clean.
    fn kick_appended(&mut self) {
        let written = self.len - self.tail.len() as u64;
        if written - self.kicked.min(written) >= WRITEBACK_KICK {
            let from = self.kicked.min(written);
            let file = self.files[&self.active].clone();
            self.kick_writeback(WritebackJob::Appended(file.clone(), from, written - from));
            self.written_back.push((file, from, written - from));
            self.kicked = written;
        }
    }

    fn write_reused(&mut self, segment: u32, at: u64, data: &[u8]) -> Result<(), StoreError> {
        if segment == self.active && at + data.len() as u64 > self.len - self.tail.len() as u64 {
            // Never so (space is reused only once its death is committed, and every commit
            // writes the tail first); the tail's later write must not cover this one.
            self.write_tail()?;
        }
        let len = data.len() as u64;
        self.last_reuse = Instant::now();
        self.reused.push((segment, at, len));
        let file = self.files[&segment].clone();
        if let Err(e) = write_in_pieces(&file, data, at) {
            // Unreferenced either way: the range goes back.
            self.reused.pop();
            self.free.insert(segment, at, at + len);
            return Err(StoreError::io(format!(
                "writing {}",
                segment_path(&self.dir, segment).display()
            ))(e));
        }
        crate::fault_io::write(|| segment_path(&self.dir, segment), at, data);
        self.unsynced += len;
        if !self.dirty.contains(&segment) {
            self.dirty.push(segment);
        }
        self.unkicked.push((segment, at, len));
        self.unkicked_bytes += len;
        if self.unkicked_bytes >= WRITEBACK_KICK {
            // As for appends (see `append`): start the disk writes now so the commit's
            // `fdatasync` finds little left. Reused ranges are scattered, so one call per
            // segment over the span that holds them, which walks only the dirty pages.
            self.unkicked.sort_unstable();
            let mut spans: Vec<(u32, u64, u64)> = Vec::new();
            for (segment, at, len) in self.unkicked.drain(..) {
                match spans.last_mut() {
                    Some((s, _, end)) if *s == segment => *end = (*end).max(at + len),
                    _ => spans.push((segment, at, at + len)),
                }
            }
            for (segment, from, to) in spans {
                let file = self.files[&segment].clone();
                self.kick_writeback(WritebackJob::Scattered(file, from, to - from));
            }
            self.unkicked_bytes = 0;
        }
        self.sync_ahead_after(len);
        Ok(())
    }

    /// Count `written` bytes towards the next sync ahead (`SYNC_AHEAD`), and queue it when
    /// due: every segment written since the last sync, after the writeback kicks queued
    /// before it.
    fn sync_ahead_after(&mut self, written: u64) {
        self.unsynced_ahead += written;
        if self.unsynced_ahead < SYNC_AHEAD {
            return;
        }
        self.unsynced_ahead = 0;
        for segment in self.dirty.clone() {
            self.kick_writeback(WritebackJob::SyncAhead(segment_path(&self.dir, segment)));
        }
        // Queued behind those syncs, on the same thread: the pages are clean by then.
        self.drop_written_back();
    }

    /// Drop the page-cache pages of appended ranges whose writeback was started, on the
    /// writeback thread, behind the jobs queued so far (call it once a sync that covers them
    /// is done or queued before).
    ///
    /// Why: a kick's `DONTNEED` drops only pages already clean, and its range's pages are
    /// dirty then, so appended data stayed cached and the page cache grew with every byte
    /// appended. Each append then copied into pages fresh from the free memory, and on a VM
    /// with free page reporting (virtio-balloon; this project's machines) the host has taken
    /// those back: a paced 150 MB/s stream of 256 KiB appends copied at 0.7-0.8 GB/s of CPU
    /// with its file's cache growing, and at 2.4 GB/s with its cache kept to 17 MB this way,
    /// its pages freed and taken again before the host could take them back
    /// (docs/BENCHMARKS.md, "Appended pages dropped once clean"). What is lost: reads of
    /// data appended more than a sync ago come from the disk, not the page cache.
    fn drop_written_back(&mut self) {
        for (file, from, len) in std::mem::take(&mut self.written_back) {
            self.kick_writeback(WritebackJob::DropClean(file, from, len));
        }
    }

    /// Hand every range held for reuse to the punch thread.
    fn release_free_space(&mut self) {
        self.release_ranges(usize::MAX);
    }

    /// Hand the first `max` ranges held for reuse (by place) to the punch thread.
    fn release_ranges(&mut self, max: usize) {
        for (segment, from, to) in self.free.drain_first(max) {
            if let Err(e) = self.punch_now_or_later(segment, from, to - from) {
                tracing::warn!(segment, offset = from, len = to - from, error = %e, "could not punch dead data out of a segment; its space stays used");
            }
        }
    }

    /// Queue a punch of the whole blocks of `[offset, offset + len)` of `segment` (already
    /// clipped to what is written).
    ///
    /// Whole blocks only, and that keeps reuse safe: a punch runs later, so a block must never
    /// be handed to a new write while a punch of any of its bytes is queued. Blocks punched
    /// were wholly dead, so they never come back to `punch` (dead ranges come from bytes live
    /// until then, widened only over the partial blocks at their ends, which held live bytes
    /// too) and never reach the reuse pool; a partial-block punch (it frees no space anyway)
    /// could have been widened over later and its zeros landed on reused data.
    fn punch_now_or_later(
        &mut self,
        segment: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), StoreError> {
        if whole_blocks(offset, len).is_none() {
            return Ok(());
        }
        if let Some(file) = self.files.get(&segment).cloned() {
            self.puncher()?;
            let jobs = &self.puncher.as_ref().expect("just started").jobs;
            queue_punch(
                &self.dir,
                jobs,
                &self.punches_queued,
                segment,
                &file,
                offset,
                len,
            );
        }
        Ok(())
    }
}

/// What queues a punch for the puncher thread: the segments, and the reclaim thread.
struct PunchQueue {
    dir: PathBuf,
    jobs: mpsc::Sender<PunchJob>,
    queued: Arc<AtomicUsize>,
}

impl PunchQueue {
    fn punch(&self, segment: u32, file: &Arc<File>, offset: u64, len: u64) -> u64 {
        queue_punch(
            &self.dir,
            &self.jobs,
            &self.queued,
            segment,
            file,
            offset,
            len,
        )
    }
}

/// Queue a punch of the whole blocks of `[offset, offset + len)` of `segment` (see
/// `FileSegments::punch_now_or_later` for why only those); returns their bytes.
fn queue_punch(
    dir: &Path,
    jobs: &mpsc::Sender<PunchJob>,
    queued: &AtomicUsize,
    segment: u32,
    file: &Arc<File>,
    offset: u64,
    len: u64,
) -> u64 {
    let Some((offset, end)) = whole_blocks(offset, len) else {
        return 0;
    };
    let len = end - offset;
    crate::fault_io::punch(|| segment_path(dir, segment), offset, len);
    // Counted before it is sent: the puncher counts it off once punched.
    queued.fetch_add(1, Ordering::AcqRel);
    // The puncher runs until every sender is gone; a send fails only if it died.
    let _ = jobs.send(PunchJob::Punch {
        file: file.clone(),
        offset,
        len,
    });
    len
}

/// The reclaim thread after an unclean stop (`FileSegments::start_reclaim`).
struct Reclaim {
    /// Returns whether the search finished.
    thread: std::thread::JoinHandle<bool>,
    /// Set: stop searching (the store stops; the next open reclaims again).
    abandon: Arc<AtomicBool>,
}

/// The reclaim's search, in `scan`'s read transaction (the state at the open): queue a punch
/// of every byte range of the segments in `ends` (number, end at the open, file) that no
/// extent references and holds data, and count the bytes punched (whole blocks) in `found`.
/// `before_punching` runs between the reading and the punches (a test's delay). Returns false
/// if `abandon` stopped it.
fn queue_unreferenced(
    scan: &Connection,
    ends: Vec<(u32, u64, Arc<File>)>,
    queue: &PunchQueue,
    found: &AtomicU64,
    abandon: &AtomicBool,
    before_punching: impl FnOnce(),
) -> Result<bool, StoreError> {
    let mut by_segment: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
    let mut stmt = scan.prepare("SELECT seg, seg_off, hi - lo FROM extents WHERE seg >= 0")?;
    let mut rows = stmt.query([])?;
    let mut read = 0u64;
    while let Some(row) = rows.next()? {
        read += 1;
        if read.is_multiple_of(4096) && abandon.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let start = row.get::<_, i64>(1)? as u64;
        let len = row.get::<_, i64>(2)? as u64;
        by_segment
            .entry(row.get(0)?)
            .or_default()
            .push((start, start + len));
    }
    drop(rows);
    drop(stmt);
    // The snapshot is no longer needed: let checkpoints go past it.
    scan.execute_batch("COMMIT")?;
    before_punching();
    for (n, end, file) in ends {
        // A descriptor of its own for the seeks (they move the file position; the store's
        // reads and writes do not use it, but nothing should depend on that).
        let path = segment_path(&queue.dir, n);
        let seeker = File::open(&path).ok();
        let mut live = by_segment.remove(&n).unwrap_or_default();
        live.sort_unstable();
        let mut cursor = 0;
        for (start, stop) in live.into_iter().chain(std::iter::once((end, end))) {
            if start > cursor {
                if abandon.load(Ordering::Relaxed) {
                    return Ok(false);
                }
                // Only the parts that hold data: after random overwrites most dead space is
                // holes punched long before (4.5 GB of a used 4 GiB image's 6 GiB of
                // segments), which need no punch and are no space to report.
                let data = seeker
                    .as_ref()
                    .and_then(|f| crate::file_data_ranges(f, cursor, start))
                    .unwrap_or_else(|| vec![(cursor, start)]);
                for (from, to) in data {
                    let punched = queue.punch(n, &file, from, to - from);
                    found.fetch_add(punched, Ordering::Relaxed);
                }
            }
            cursor = cursor.max(stop);
        }
    }
    Ok(true)
}

impl FileSegments {
    /// The segment's file and the part of `buf` it holds from `offset` on; the rest of `buf`
    /// (bytes appended but still in the tail, not written to the file yet) is filled from
    /// the tail.
    fn in_file<'b>(
        &self,
        segment: u32,
        offset: u64,
        buf: &'b mut [u8],
    ) -> Result<(&File, &'b mut [u8]), StoreError> {
        let file = self
            .files
            .get(&segment)
            .ok_or_else(|| missing_segment(&self.dir, segment))?;
        let tail_at = self.len - self.tail.len() as u64;
        let end = offset + buf.len() as u64;
        if segment != self.active || end <= tail_at {
            return Ok((file, buf));
        }
        let in_file = tail_at.saturating_sub(offset) as usize;
        let (buf, from_tail) = buf.split_at_mut(in_file.min(buf.len()));
        let skip = (offset + in_file as u64 - tail_at) as usize;
        let tail = self.tail.get(skip..skip + from_tail.len()).ok_or_else(|| {
            StoreError::Corrupt(format!(
                "an extent points past the end of segment {segment}"
            ))
        })?;
        from_tail.copy_from_slice(tail);
        Ok((file, buf))
    }
}

impl Segments for FileSegments {
    /// Whole blocks go into dead space held for reuse: the smallest range that holds them
    /// all, else ranges of at least `min(len, REUSE_SPLIT_MIN)`, largest first, at most
    /// `REUSE_PIECES_MAX` of them; the rest is appended.
    fn place(&mut self, data: &[u8]) -> Result<Vec<(u32, u64, u64)>, StoreError> {
        let mut places = Vec::new();
        let mut rest = data;
        if data.len().is_multiple_of(BLOCK) && !data.is_empty() {
            self.last_block_write = Some(Instant::now());
            let piece_min = (data.len() as u64).min(REUSE_SPLIT_MIN);
            while !rest.is_empty() && places.len() < REUSE_PIECES_MAX {
                let Some((segment, at, len)) = self.free.take_up_to(rest.len() as u64, piece_min)
                else {
                    break;
                };
                let (now, later) = rest.split_at(len as usize);
                // On an error the pieces written before stay in `reused`: the operation's
                // rewind gives them back.
                self.write_reused(segment, at, now)?;
                places.push((segment, at, len));
                rest = later;
            }
        }
        if !rest.is_empty() {
            let (segment, at) = self.append(rest)?;
            places.push((segment, at, rest.len() as u64));
        }
        Ok(places)
    }

    fn append(&mut self, data: &[u8]) -> Result<(u32, u64), StoreError> {
        if self.len >= SEGMENT_SIZE {
            self.rotate()?;
        }
        // Appends of whole blocks start on a block boundary (the gap stays a hole, or zeros
        // in the tail: the rest of a block already written), so one odd append does not leave
        // every later one straddling blocks: a dead range of whole blocks is punched as it
        // is, without widening queries.
        if data.len().is_multiple_of(BLOCK) && !self.len.is_multiple_of(BLOCK as u64) {
            let aligned = self.len.next_multiple_of(BLOCK as u64);
            if !self.tail.is_empty() {
                self.tail
                    .resize(self.tail.len() + (aligned - self.len) as usize, 0);
            }
            // Counted as appended: `rewind` takes back `len - mark` bytes from the count, and
            // without the padding in it, earlier appends of the transaction (still unsynced)
            // dropped out, and the commit skipped the sync its extents need.
            self.unsynced += aligned - self.len;
            self.len = aligned;
        }
        let at = self.len;
        if data.len() < TAIL_APPEND_MAX && self.reserve(at + data.len() as u64)? {
            self.tail.extend_from_slice(data);
            self.len += data.len() as u64;
            if self.tail.len() >= TAIL_FLUSH {
                self.write_tail()?;
            }
        } else {
            self.check_room(data.len() as u64)?;
            self.write_tail()?;
            write_in_pieces(&self.files[&self.active], data, at).map_err(StoreError::io_with(
                || format!("writing {}", segment_path(&self.dir, self.active).display()),
            ))?;
            crate::fault_io::write(|| segment_path(&self.dir, self.active), at, data);
            self.len += data.len() as u64;
            self.kick_appended();
        }
        self.unsynced += data.len() as u64;
        if !self.dirty.contains(&self.active) {
            self.dirty.push(self.active);
        }
        self.sync_ahead_after(data.len() as u64);
        Ok((self.active, at))
    }

    fn read(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let (file, buf) = self.in_file(segment, offset, buf)?;
        if buf.is_empty() {
            return Ok(());
        }
        read_segment_at(file, offset, buf, || segment_path(&self.dir, segment))
    }

    fn read_cached(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<bool, StoreError> {
        let (file, buf) = self.in_file(segment, offset, buf)?;
        Ok(read_if_cached(file, offset, buf, &self.nowait_refused))
    }

    fn prefetch(&self, segment: u32, offset: u64, len: u64) {
        if let Some(file) = self.files.get(&segment) {
            // Bytes still in the tail are in memory.
            let in_file = match segment == self.active {
                true => (self.len - self.tail.len() as u64).saturating_sub(offset),
                false => len,
            };
            start_reading(file, offset, len.min(in_file));
        }
    }

    fn before_commit(&mut self, checkpoint_debt: u64) -> Option<u64> {
        self.room.checkpoint_debt = checkpoint_debt;
        let space = FsSpace::of(&*self.files[&self.active])?;
        self.room.before_commit(space);
        self.room.last_free
    }

    fn commit_room(&self) -> Option<u64> {
        self.room.commit_room()
    }

    fn fresh_commit_room(&mut self) -> Option<u64> {
        if let Some(space) = FsSpace::of(&*self.files[&self.active]) {
            self.room.last_free = Some(space.usable);
            self.room.unchecked = 0;
        }
        self.room.commit_room()
    }

    fn sync(&mut self) -> Result<(), StoreError> {
        self.write_tail()?;
        self.unsynced_ahead = 0;
        for n in std::mem::take(&mut self.dirty) {
            self.files[&n].sync_data().map_err(StoreError::io_with(|| {
                format!("syncing {}", segment_path(&self.dir, n).display())
            }))?;
            crate::fault_io::synced(&segment_path(&self.dir, n));
        }
        self.unsynced = 0;
        self.drop_written_back();
        // What was written into reused space stays listed until the commit that references
        // it is done (`committed`): a COMMIT that fails after this sync is rewound, and the
        // rewind gives those ranges back.
        Ok(())
    }

    fn committed(&mut self) {
        self.reused.clear();
    }

    fn check_in_place(&self) -> Result<(), StoreError> {
        let gone = |path: &Path| {
            StoreError::Corrupt(format!(
                "{} was deleted or replaced while the store was open: what was written since \
                 went into files no longer in the store's directory, and is lost when this \
                 process stops; stop writing, and restore the image from a backup",
                path.display()
            ))
        };
        for (path, opened) in &self.opened_as {
            let now = std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
            if now != Some(*opened) {
                return Err(gone(path));
            }
        }
        match self.files[&self.active].metadata() {
            Ok(meta) if meta.nlink() == 0 => Err(gone(&segment_path(&self.dir, self.active))),
            _ => Ok(()),
        }
    }

    fn punch(&mut self, segment: u32, offset: u64, len: u64) -> Result<(), StoreError> {
        // The engine widens punches over partial blocks whose other bytes are dead or not
        // written yet. Done later, a punch past the append position would destroy appends
        // made meanwhile: only what is written now is punched.
        let len = match segment == self.active {
            true => len.min(self.len.saturating_sub(offset)),
            false => len,
        };
        if len == 0 || !self.files.contains_key(&segment) {
            return Ok(());
        }
        // Only whole blocks are punched or held for reuse; a partial block's other bytes are
        // live, so punching it would free nothing (and see `punch_now_or_later`).
        let Some((from, to)) = whole_blocks(offset, len) else {
            return Ok(());
        };
        if self.reusing() && self.free.total() + (to - from) <= REUSE_MAX {
            if self.free.is_empty() {
                // The idle clock starts when space starts waiting for a write.
                self.last_reuse = Instant::now();
            }
            self.free.insert(segment, from, to);
            return Ok(());
        }
        self.punch_now_or_later(segment, from, to - from)
    }

    fn reusing(&self) -> bool {
        self.last_block_write
            .is_some_and(|at| at.elapsed() < REUSE_IDLE)
    }

    fn tick(&mut self) -> Option<Duration> {
        if self.free.is_empty() {
            return None;
        }
        let idle = self.last_reuse.elapsed();
        if idle < REUSE_IDLE {
            return Some(REUSE_IDLE - idle);
        }
        // A batch at a time (see `RELEASE_BATCH`): what is not handed over yet stays
        // reusable for writes that come back.
        if self.punches_queued.load(Ordering::Acquire) == 0 {
            self.release_ranges(RELEASE_BATCH);
        }
        (!self.free.is_empty()).then_some(RELEASE_STEP)
    }

    fn settle(&mut self) {
        self.finish_reclaim(false);
        self.release_free_space();
        if let Some(writeback) = self.writeback.take() {
            drop(writeback.jobs);
            let _ = writeback.thread.join();
        }
        if let Some(puncher) = self.puncher.take() {
            drop(puncher.jobs);
            let _ = puncher.thread.join();
        }
    }

    fn settle_within(&mut self, budget: Duration) -> bool {
        let deadline = Instant::now() + budget;
        // The reclaim's search within the budget too; stopped past it (the next open, which
        // finds no `CLEAN` marker, searches again).
        while self
            .reclaim
            .as_ref()
            .is_some_and(|r| !r.thread.is_finished())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let reclaimed = self.finish_reclaim(true);
        self.release_free_space();
        let Some(puncher) = self.puncher.take() else {
            return reclaimed;
        };
        drop(puncher.jobs);
        let settled = reclaimed
            && matches!(
                puncher
                    .finished
                    .recv_timeout(deadline.saturating_duration_since(Instant::now())),
                Err(mpsc::RecvTimeoutError::Disconnected)
            );
        if !settled {
            puncher.abandon.store(true, Ordering::Relaxed);
        }
        // Done at once when settled; otherwise after the punch under way.
        let _ = puncher.thread.join();
        settled
    }

    fn after_punches(&mut self, done: Box<dyn FnOnce() + Send>) {
        // Space is wanted back (it ran out, or `reclaim_space`): what the reclaim after an
        // unclean stop finds, and what is held for reuse too.
        self.finish_reclaim(false);
        self.release_free_space();
        match &self.puncher {
            Some(puncher) => puncher
                .jobs
                .send(PunchJob::Barrier(done))
                .expect("the puncher runs while its sender lives"),
            None => done(),
        }
    }

    fn mark(&self) -> SegmentMark {
        SegmentMark {
            segment: self.active,
            offset: self.len,
            reused: self.reused.len(),
        }
    }

    fn rewind(&mut self, mark: SegmentMark) -> Result<(), StoreError> {
        // Reused ranges written since the mark are referenced by nothing: held again.
        for (segment, at, len) in self.reused.drain(mark.reused.min(self.reused.len())..) {
            self.free.insert(segment, at, at + len);
        }
        let tail_at = self.len - self.tail.len() as u64;
        if self.active == mark.segment && mark.offset >= tail_at {
            // Only appends in the tail are taken back; the file is cut where the tail starts,
            // dropping what a failed write put past it (on a full disk, its space is wanted).
            self.tail.truncate((mark.offset - tail_at) as usize);
            self.files[&self.active]
                .set_len(tail_at)
                .map_err(StoreError::io("taking back a failed operation's data"))?;
            crate::fault_io::set_len(|| segment_path(&self.dir, self.active), tail_at);
            self.reserved = tail_at;
            self.unsynced = self
                .unsynced
                .saturating_sub(self.len.saturating_sub(mark.offset));
            self.len = mark.offset;
            return Ok(());
        }
        self.tail.clear();
        while self.active > mark.segment {
            let gone = self.active;
            self.files.remove(&gone);
            self.dirty.retain(|&n| n != gone);
            let _ = std::fs::remove_file(segment_path(&self.dir, gone));
            crate::fault_io::removed(&segment_path(&self.dir, gone));
            self.active -= 1;
        }
        self.files[&self.active]
            .set_len(mark.offset)
            .map_err(StoreError::io("taking back a failed operation's data"))?;
        crate::fault_io::set_len(|| segment_path(&self.dir, self.active), mark.offset);
        self.reserved = mark.offset;
        self.unsynced = self
            .unsynced
            .saturating_sub(self.len.saturating_sub(mark.offset));
        self.len = mark.offset;
        Ok(())
    }

    fn unsynced(&self) -> u64 {
        self.unsynced
    }
}

/// Refuse a directory whose data segments are there but whose metadata database is not (it
/// was removed, or lost with a partial copy): taken for no store at all, it was reported as an
/// image that does not exist, and a store created there cut the old segments to nothing.
/// Whether the store's database is missing: no file, or an empty one. SQLite takes an empty
/// file for a new database, and so did the store, which then had an empty database beside
/// its data segments (a file cut to nothing by a crash or by hand): every command said "no
/// image there", and a create or import wrote over the data. A database the store made is
/// never empty: switching it to WAL writes its first page.
fn database_missing(meta: &Path) -> bool {
    std::fs::metadata(meta).map_or(true, |m| m.len() == 0)
}

fn refuse_segments_without_database(dir: &Path) -> Result<(), StoreError> {
    let data = dir.join("data");
    let Ok(entries) = std::fs::read_dir(&data) else {
        return Ok(());
    };
    let (files, bytes) = entries
        .flatten()
        .filter(|e| e.file_name().as_bytes().starts_with(b"seg-"))
        .fold((0u64, 0u64), |(files, bytes), e| {
            (files + 1, bytes + e.metadata().map_or(0, |m| m.len()))
        });
    if files == 0 {
        return Ok(());
    }
    Err(StoreError::Corrupt(format!(
        "{} holds {files} data segment file(s) ({bytes} bytes) in {} but no metadata database \
         ({}, missing or empty): it was removed or lost, and without it the data cannot be \
         found; restore the directory, or its meta.sqlite, from a backup (to start over, \
         remove the directory first)",
        dir.display(),
        data.display(),
        dir.join("meta.sqlite").display()
    )))
}

/// The exclusive hold on a store directory, released when the store is closed: the flock of
/// `LOCK`, and one of the directory itself. A `LOCK` file removed while its writer runs (taken
/// for a stale one) is made anew by the next opener, which would then get its flock and write
/// beside the first: the directory's own flock, which no removal of a file in it drops, keeps
/// that second writer out. (Where a directory cannot be flocked, NFS say, `LOCK` alone.)
struct DirectoryLock {
    // Released first (fields drop in order): an opener that gets `LOCK` then finds the
    // directory free, instead of taking the moment between for a removed `LOCK`.
    _dir: Option<HeldFlock>,
    _lock: HeldFlock,
}

/// [`exclusive_holder`], an error reading `/proc/locks` named.
fn flock_holder(meta: &std::fs::Metadata) -> Result<Option<u32>, StoreError> {
    exclusive_holder(meta).map_err(StoreError::io("reading /proc/locks"))
}

/// Take the directory's own flock (see [`DirectoryLock`]) once `LOCK`'s is held.
fn lock_directory_itself(dir: &Path) -> Result<Option<HeldFlock>, StoreError> {
    let file = File::open(dir).map_err(StoreError::io(format!(
        "opening directory {}",
        dir.display()
    )))?;
    let ours = std::process::id();
    let holder = |file: &File| {
        file.metadata()
            .ok()
            .and_then(|m| flock_holder(&m).ok().flatten())
    };
    match lock_exclusive(file, |file| holder(file) == Some(ours)) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, FlockRefused::HeldHere)) => Err(StoreError::AlreadyOpen {
            path: dir.display().to_string(),
            pid: ours.to_string(),
        }),
        Err((file, FlockRefused::HeldElsewhere)) => Err(StoreError::AlreadyOpen {
            path: dir.display().to_string(),
            pid: format!(
                "{} (its {} file was removed while it ran)",
                holder(&file).map_or_else(|| "unknown".to_owned(), |pid| pid.to_string()),
                dir.join("LOCK").display()
            ),
        }),
        Err((_, FlockRefused::Io(e))) => {
            tracing::debug!(dir = %dir.display(), error = %e, "the directory cannot be flocked");
            Ok(None)
        }
    }
}

fn lock_directory(dir: &Path) -> Result<DirectoryLock, StoreError> {
    let path = dir.join("LOCK");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            // A read-only mount, no permission, an immutable file: nothing can be written.
            Some(libc::EROFS | libc::EACCES | libc::EPERM) => StoreError::NotWritable {
                path: dir.display().to_string(),
                reason: format!("opening {} for writing: {e}", path.display()),
            },
            _ => StoreError::io(format!("opening {}", path.display()))(e),
        })?;
    let ours = std::process::id().to_string();
    let mut holder = String::new();
    // The file holds the pid of the last process that took the lock.
    let read_holder = |file: &mut File, holder: &mut String| {
        holder.clear();
        let _ = file.rewind();
        let _ = file.read_to_string(holder);
        *holder = holder.trim().to_owned();
    };
    let lock = match lock_exclusive(file, |file| {
        read_holder(file, &mut holder);
        holder == ours
    }) {
        Ok(lock) => lock,
        Err((_, FlockRefused::HeldHere)) => {
            return Err(StoreError::AlreadyOpen {
                path: dir.display().to_string(),
                pid: ours,
            })
        }
        Err((mut file, FlockRefused::HeldElsewhere)) => {
            read_holder(&mut file, &mut holder);
            return Err(StoreError::AlreadyOpen {
                path: dir.display().to_string(),
                pid: holder,
            });
        }
        Err((_, FlockRefused::Io(e))) => {
            return Err(StoreError::io(format!("locking {}", path.display()))(e))
        }
    };
    // Overwrite, then cut: a second opener reading concurrently never sees an empty file.
    let _ = lock.file().write_all_at(ours.as_bytes(), 0);
    let _ = lock.file().set_len(ours.len() as u64);
    let dir_lock = lock_directory_itself(dir)?;
    Ok(DirectoryLock {
        _lock: lock,
        _dir: dir_lock,
    })
}

/// What opening a store found and repaired after an unclean stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecoveryReport {
    /// Commits replayed from the metadata log.
    pub replayed_commits: u64,
    /// Bytes of the metadata log past its last valid commit (a torn tail or a damaged record,
    /// detected by SQLite's frame checksums), dropped with the operations in them.
    pub discarded_log_bytes: u64,
    /// Bytes of segment data that no committed operation referenced, dropped from the end.
    pub dropped_data_bytes: u64,
    /// Bytes of dead segment data inside the segments (their release was pending when the
    /// process stopped), which a thread started by the open finds and punches out in the
    /// background: what it has found so far; all of it once [`LocalStore::reclaim_space`] has
    /// returned (which waits for the search and the punches).
    pub reclaimed_bytes: u64,
}

/// The local embedded object store: a directory, one writer process at a time, and any number
/// of read-only openers ([`LocalStore::open_read_only`]).
pub struct LocalStore(
    Client,
    RecoveryReport,
    Option<Arc<ReaderLink>>,
    /// What the reclaim after an unclean stop has found so far
    /// (`RecoveryReport::reclaimed_bytes`).
    Option<Arc<AtomicU64>>,
);

impl Drop for LocalStore {
    fn drop(&mut self) {
        // Before the client: the last client's drop waits for the worker, which stops only
        // when every request sender (the link holds one) is gone.
        self.2.take();
    }
}

impl LocalStore {
    /// Open an existing store.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(dir, &LocalStoreOptions::default())
    }

    /// Open a store, creating it first if `options.create` and it does not exist.
    pub fn open_with(
        dir: impl AsRef<Path>,
        options: &LocalStoreOptions,
    ) -> Result<Self, StoreError> {
        let dir = dir.as_ref();
        Self::open_for_writing(dir, options).map_err(|e| match e {
            // SQLite reports a log or index file it could not make on a full file system as
            // an IO error ("disk I/O error"): say what it is.
            StoreError::Database(what) => match FsSpace::at(dir) {
                Some(space) if space.usable < COMMIT_ROOM_MIN => StoreError::NoSpace {
                    context: format!(
                        "opening the store in {} ({what}): its file system has only {} bytes free",
                        dir.display(),
                        space.usable
                    ),
                },
                _ => StoreError::Database(what),
            },
            e => e,
        })
    }

    fn open_for_writing(dir: &Path, options: &LocalStoreOptions) -> Result<Self, StoreError> {
        let meta = dir.join("meta.sqlite");
        let creating = database_missing(&meta);
        if creating {
            refuse_segments_without_database(dir)?;
            if !options.create {
                return Err(StoreError::Io {
                    context: format!("{} holds no ivdisk store", dir.display()),
                    source: std::io::ErrorKind::NotFound.into(),
                });
            }
            std::fs::create_dir_all(dir).map_err(StoreError::io_with(|| {
                format!("creating {}", dir.display())
            }))?;
        }
        let lock = lock_directory(dir)?;
        // Decided again under the lock: another process may have created the database (and
        // been killed) while this one waited for it, and an open that took itself for the
        // creator skipped the reclaim that process's unclean stop needs.
        let creating = database_missing(&meta);
        if creating {
            refuse_segments_without_database(dir)?;
        }
        // Read-only stores of this directory in this process let go of their connections
        // until ours has created SQLite's shared-memory index (see `pause_readers`).
        let opening = opening_lock();
        let paused = pause_readers(&meta);
        let mut report = RecoveryReport::default();
        let wal_path = dir.join("meta.sqlite-wal");
        if let Some(scan) =
            crate::wal_check::scan_file(&wal_path).map_err(StoreError::io_with(|| {
                format!("reading {}", wal_path.display())
            }))?
        {
            report.replayed_commits = scan.valid_commits;
            report.discarded_log_bytes = scan.discarded_bytes;
            if scan.discarded_bytes > 0 {
                tracing::warn!(
                    store = %dir.display(),
                    replayed_commits = scan.valid_commits,
                    discarded_bytes = scan.discarded_bytes,
                    "the metadata log ends in {} bytes that are not a valid commit (torn by a \
                     crash, or damaged): the store opens at the last valid commit, operations \
                     after it are dropped",
                    scan.discarded_bytes
                );
            }
        }
        let db = Connection::open(&meta)?;
        if db.is_readonly(rusqlite::MAIN_DB)? {
            return Err(StoreError::NotWritable {
                path: dir.display().to_string(),
                reason: format!("{} is not writable", meta.display()),
            });
        }
        db.execute_batch(&format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = OFF;
             PRAGMA temp_store = MEMORY; PRAGMA cache_size = -{META_CACHE_KIB};"
        ))?;
        Engine::init_schema(&db)?;
        // Extent changes held by the last run go to their table before the segments'
        // recovery and reclaim read it. Not after a clean stop: then there is no reclaim, the
        // recovery reads only where the last commit's appends ended, and the engine holds
        // the pending changes in memory as a run does. A stop on a nearly full file system
        // leaves them pending, and writing them back here would take the room the open's
        // first commit (an image's writer lock) needs.
        let clean_marker = dir.join("CLEAN");
        let stopped_clean = clean_marker.exists() && Engine::stored_append_end(&db)?.is_some();
        if !stopped_clean {
            Engine::write_back_pending_extents(&db)?;
        }
        db.execute_batch(&format!(
            "PRAGMA wal_autocheckpoint = {WAL_CHECKPOINT_PAGES}"
        ))?;
        drop(paused);
        drop(opening);
        // A clean stop leaves CLEAN; without it, frees still pending at the crash are redone.
        let was_clean = match std::fs::remove_file(&clean_marker) {
            Ok(()) => {
                crate::fault_io::removed(&clean_marker);
                // The removal must be durable before this run frees anything: a marker that
                // came back after a power cut would make the next open skip the reclaim of
                // space freed (but not yet punched) by this run.
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(StoreError::io_with(|| format!("syncing {}", dir.display())))?;
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                return Err(StoreError::io(format!(
                    "removing {}",
                    clean_marker.display()
                ))(e))
            }
        };
        // (A store being created has nothing to reclaim.)
        let reclaim = !was_clean && !creating;
        if reclaim {
            make_found_state_durable(dir)?;
        }
        let segments = FileSegments::open(dir.join("data"), &db, reclaim)?;
        if creating {
            // A store that `open_with` returned survives a power cut: its schema is moved into
            // `meta.sqlite` and synced, and so are the directory entries down to the store.
            db.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
            // `data` too: the first segment's entry is in it (a file system may keep a new
            // file's data on its fsync and not its name; `rotate` syncs `data` likewise).
            let data = dir.join("data");
            for d in [
                Some(data.as_path()),
                Some(dir),
                dir.parent().filter(|p| !p.as_os_str().is_empty()),
            ]
            .into_iter()
            .flatten()
            {
                File::open(d)
                    .and_then(|d| d.sync_all())
                    .map_err(StoreError::io_with(|| format!("syncing {}", d.display())))?;
            }
        }
        report.dropped_data_bytes = segments.dropped_at_open;
        let reclaimed = segments.reclaimed.clone();
        let wal = WalFile {
            wal: dir.join("meta.sqlite-wal"),
            clean_marker,
        };
        let engine = Engine::new(db, Box::new(segments), Arc::new(wal))?;
        let (handle, worker) = EngineHandle::spawn(engine, "ivdisk-local-store")?;
        Ok(LocalStore(
            Client {
                handle,
                id: random_client_id("local"),
                _life: std::sync::Arc::new(Lifetime::new(worker, Box::new(lock))),
            },
            report,
            None,
            Some(reclaimed),
        ))
    }

    /// Open an existing store read-only. Nothing in the directory is created, written,
    /// truncated, punched, locked or renamed: no `LOCK` (so it opens while another process
    /// has the store open for writing), no recovery after an unclean stop (the committed
    /// state is read as it is), SQLite opened read-only. So it works on a read-only mount and
    /// on files this process may not write.
    ///
    /// Reads see committed states only (a writer commits every 2 s and on flush), each read
    /// operation one state: a read racing with a writer's commits may see the state before
    /// or after them, never a mix of two. Changes (writes, snapshots, locks) fail
    /// [`StoreError::ReadOnly`]; `list_lockers` works; `flush` does nothing. The recovery
    /// report is all zero (nothing is repaired).
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = dir.as_ref();
        let meta = dir.join("meta.sqlite");
        let id = match std::fs::metadata(&meta) {
            Ok(m) if m.len() == 0 => {
                refuse_segments_without_database(dir)?;
                return Err(StoreError::Io {
                    context: format!("{} holds no ivdisk store", dir.display()),
                    source: std::io::ErrorKind::NotFound.into(),
                });
            }
            Ok(m) => (m.dev(), m.ino()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                refuse_segments_without_database(dir)?;
                return Err(StoreError::Io {
                    context: format!("{} holds no ivdisk store", dir.display()),
                    source: e,
                });
            }
            Err(e) => return Err(StoreError::io(format!("reading {}", meta.display()))(e)),
        };
        let _opening = opening_lock();
        let source = ReadOnlyMeta {
            path: meta,
            private: None,
        };
        let segments = ReadOnlySegments {
            dir: dir.join("data"),
            files: RefCell::default(),
            nowait_refused: Cell::new(false),
        };
        let engine =
            Engine::new_read_only(Box::new(source), Box::new(segments)).map_err(|e| match e {
                // Being created by another process.
                StoreError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    StoreError::Io {
                        context: format!("{} holds no ivdisk store", dir.display()),
                        source,
                    }
                }
                other => other,
            })?;
        let (handle, worker) = EngineHandle::spawn(engine, "ivdisk-local-store-ro")?;
        let link = Arc::new(ReaderLink(handle.clone()));
        let mut readers = READERS.lock().unwrap_or_else(|e| e.into_inner());
        readers.retain(|(_, r)| r.strong_count() > 0);
        readers.push((id, Arc::downgrade(&link)));
        Ok(LocalStore(
            Client {
                handle,
                id: random_client_id("local"),
                _life: std::sync::Arc::new(Lifetime::new(worker, Box::new(()))),
            },
            RecoveryReport::default(),
            Some(link),
            None,
        ))
    }

    /// Flush, and also wait until the space of everything dead so far (overwritten,
    /// removed, released by a removed snapshot) is punched out of the data segments. A plain
    /// `flush` leaves that to the background (it only waits when space ran out since the
    /// previous flush): on a file system mounted with `discard` punching a backlog of small
    /// ranges can take seconds.
    pub async fn reclaim_space(&self) -> Result<(), StoreError> {
        self.0
            .handle
            .call(|reply| crate::engine::Request::Flush {
                reply,
                reclaim: true,
            })
            .await
    }

    /// Whether `dir` is a local store's directory (its lock file or its database is there),
    /// whole or damaged: what a new store must not be made inside.
    pub fn is_store_dir(dir: impl AsRef<Path>) -> bool {
        let dir = dir.as_ref();
        dir.join("LOCK").is_file() || dir.join("meta.sqlite").is_file()
    }

    /// The process that has the store in `dir` open for writing (it holds the flock of
    /// `dir/LOCK`, and of `dir` itself, as `/proc/locks` shows), or `None`: then no lock a
    /// client of the store holds can be renewed, and the next writer takes such locks over. Looking takes no lock,
    /// so it never gets in the way of a writer opening the store meanwhile.
    pub fn writing_process(dir: impl AsRef<Path>) -> Result<Option<u32>, StoreError> {
        let dir = dir.as_ref();
        let lock = dir.join("LOCK");
        match std::fs::metadata(&lock) {
            Ok(meta) => {
                if let Some(pid) = flock_holder(&meta)? {
                    return Ok(Some(pid));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io(format!("reading {}", lock.display()))(e)),
        }
        // A writer whose `LOCK` file was removed still holds the directory's flock.
        match std::fs::metadata(dir) {
            Ok(meta) => flock_holder(&meta),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(format!("reading {}", dir.display()))(e)),
        }
    }

    /// Whether this store was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.2.is_some()
    }

    /// A second client identity on the same open store (for locks between users in one
    /// process; other processes cannot open the store for writing while this one has it).
    pub fn another_client(&self) -> Self {
        LocalStore(
            self.0.another(random_client_id("local")),
            self.1,
            self.2.clone(),
            self.3.clone(),
        )
    }

    /// What the store in `dir` takes on its file system: the blocks allocated to its data
    /// segments and to its metadata files (holes cost nothing). Reads only file sizes, so it
    /// works whoever has the store open. `NotFound` if `dir` holds no store.
    pub fn disk_usage(dir: impl AsRef<Path>) -> Result<DiskUsage, StoreError> {
        let dir = dir.as_ref();
        let allocated = |path: &Path| -> Result<u64, StoreError> {
            match std::fs::symlink_metadata(path) {
                Ok(m) => Ok(m.blocks() * 512),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
                Err(e) => Err(StoreError::io(format!("reading {}", path.display()))(e)),
            }
        };
        let meta = dir.join("meta.sqlite");
        if !meta.is_file() {
            return Err(StoreError::NotFound {
                object: format!("a local store in {}", dir.display()),
            });
        }
        let mut metadata = 0;
        for name in ["meta.sqlite", "meta.sqlite-wal", "meta.sqlite-shm"] {
            metadata += allocated(&dir.join(name))?;
        }
        let segments = dir.join("data");
        let mut data = 0;
        let entries = match std::fs::read_dir(&segments) {
            Ok(entries) => Some(entries),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(StoreError::io(format!("listing {}", segments.display()))(e)),
        };
        for entry in entries.into_iter().flatten() {
            let entry = entry.map_err(StoreError::io_with(|| {
                format!("listing {}", segments.display())
            }))?;
            data += allocated(&entry.path())?;
        }
        let reserved = allocated(&dir.join(COMMIT_ROOM_FILE))?;
        Ok(DiskUsage {
            data,
            metadata,
            reserved,
        })
    }

    /// What opening found after an unclean stop (all zero after a clean one).
    pub fn recovery_report(&self) -> RecoveryReport {
        RecoveryReport {
            reclaimed_bytes: self.3.as_ref().map_or(0, |r| r.load(Ordering::Relaxed)),
            ..self.1
        }
    }
}

delegate_object_store!(LocalStore);

/// The metadata of a read-only store. SQLite needs care here (its "read-only WAL databases"):
///
/// - Without a `meta.sqlite-wal` (or with one of no commit), as after a clean stop, the database
///   file holds every commit. A plain read-only connection would still create the `-wal` and
///   `-shm` files (and fails where it cannot), so the file is opened `immutable=1`: no locks,
///   no side files.
/// - With a log and its `-shm` index (a writer is open, or stopped uncleanly, or stopped while
///   a reader held the log), the connection is `mode=ro&readonly_shm=1`: SQLite maps the index
///   read-only, and when no writer holds it builds a private index of the log in memory (the
///   commits with valid checksums); a writer that comes or goes meanwhile is noticed by
///   SQLite. Only advisory locks (`fcntl`) are taken, nothing is written.
/// - With a log but no index (no writer is open: a writer creates the index as it opens; a
///   copy of a crashed store without it), SQLite's lock-free VFS (`unix-none`) in exclusive
///   locking mode reads the log into an index in memory.
///
/// The first and last ways are right only while no writer changes the files, so `stale` checks
/// after every read that no writer has come (a log has appeared, or an index, or the files
/// changed: device, inode, size, mtime); if one has, the engine reconnects (now the
/// second way) and reads again.
struct ReadOnlyMeta {
    path: PathBuf,
    /// Opened the first or last way: the files as they were.
    private: Option<PrivateView>,
}

struct PrivateView {
    db: Option<FileStamp>,
    /// The log, for the last way (`None`: opened immutable, without a log).
    log: Option<FileStamp>,
}

/// Bytes of a SQLite log's header: a log no longer than that holds no commit.
const WAL_HEADER_BYTES: u64 = 32;

/// The log, if it holds at least part of a commit (it is longer than its header). A log of its
/// header alone counts as none: a writer killed right after it opened the store leaves one
/// beside an index it had not written yet (zeros), and SQLite, asked to read through such an
/// index that no writer holds (the second way below), failed every read after 10 s of
/// retries with "locking protocol": no read-only command worked until a writer opened the
/// store again. The database file holds every commit then, as without a log.
fn log_with_frames(path: &Path) -> Option<FileStamp> {
    FileStamp::of(path).filter(|l| l.size > WAL_HEADER_BYTES)
}

/// What changes when a file is written or replaced. Not ctime: SQLite running as root
/// `fchown`s the log it opens to the database's owner, which sets the log's ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
}

impl FileStamp {
    fn of(path: &Path) -> Option<FileStamp> {
        let m = std::fs::metadata(path).ok()?;
        Some(FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }
}

impl ReadOnlyMeta {
    fn side_file(&self, suffix: &str) -> PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(suffix);
        PathBuf::from(name)
    }

    /// `file:` URI of the database with `query` (the path percent-encoded).
    fn uri(&self, query: &str) -> String {
        // An absolute path goes after an empty authority (`file://` + `/...`): written right
        // after `file:`, a path that starts with `//` would be read as an authority.
        let mut uri = String::from(if self.path.is_absolute() {
            "file://"
        } else {
            "file:"
        });
        for &b in self.path.as_os_str().as_bytes() {
            match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'.' | b'_' | b'-' | b'~' => {
                    uri.push(b as char)
                }
                _ => uri.push_str(&format!("%{b:02X}")),
            }
        }
        uri.push('?');
        uri.push_str(query);
        uri
    }

    fn open(&self, query: &str, setup: &str) -> Result<Connection, StoreError> {
        let db = Connection::open_with_flags(
            self.uri(query),
            OpenFlags::SQLITE_OPEN_READ_ONLY
                | OpenFlags::SQLITE_OPEN_URI
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| {
            StoreError::Database(format!("opening {} read-only: {e}", self.path.display()))
        })?;
        db.busy_timeout(Duration::from_secs(5))?;
        db.execute_batch(setup)?;
        db.execute_batch(&format!("PRAGMA cache_size = -{READ_ONLY_META_CACHE_KIB}"))?;
        Ok(db)
    }
}

impl MetaSource for ReadOnlyMeta {
    fn connect(&mut self) -> Result<Connection, StoreError> {
        let log = log_with_frames(&self.side_file("-wal"));
        let db = FileStamp::of(&self.path);
        if log.is_some() && self.side_file("-shm").exists() {
            self.private = None;
            return self.open("mode=ro&readonly_shm=1", "PRAGMA query_only = 1");
        }
        // Stamps taken before opening: a change from here on is seen.
        self.private = Some(PrivateView { db, log });
        match log {
            None => self.open("mode=ro&immutable=1", "PRAGMA query_only = 1"),
            Some(_) => self.open(
                "mode=ro&vfs=unix-none",
                "PRAGMA query_only = 1; PRAGMA locking_mode = EXCLUSIVE",
            ),
        }
    }

    fn stale(&self) -> bool {
        let Some(view) = &self.private else {
            return false;
        };
        let log = log_with_frames(&self.side_file("-wal"));
        FileStamp::of(&self.path) != view.db
            || match view.log {
                None => log.is_some(),
                Some(_) => log != view.log || self.side_file("-shm").exists(),
            }
    }
}

/// The segments of a read-only store: opened for reading when first read (a writer in another
/// process may start new ones), never written.
struct ReadOnlySegments {
    dir: PathBuf,
    files: RefCell<HashMap<u32, File>>,
    /// Set once the file system refused to read without waiting (`read_if_cached`).
    nowait_refused: Cell<bool>,
}

impl ReadOnlySegments {
    /// Run `f` on the segment's file, opened when first needed.
    fn with_file<T>(
        &self,
        segment: u32,
        f: impl FnOnce(&File) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut files = self.files.borrow_mut();
        let file = match files.entry(segment) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            // The path only here: built at every read, it took 2-3% of the worker's time.
            std::collections::hash_map::Entry::Vacant(e) => {
                let path = segment_path(&self.dir, segment);
                match File::open(&path) {
                    Ok(file) => e.insert(file),
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                        return Err(missing_segment(&self.dir, segment))
                    }
                    Err(err) => {
                        return Err(StoreError::io(format!("opening {}", path.display()))(err))
                    }
                }
            }
        };
        f(file)
    }
}

impl Segments for ReadOnlySegments {
    fn append(&mut self, _data: &[u8]) -> Result<(u32, u64), StoreError> {
        Err(StoreError::ReadOnly {
            what: "appending data".into(),
        })
    }

    fn read(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        self.with_file(segment, |file| {
            read_segment_at(file, offset, buf, || segment_path(&self.dir, segment))
        })
    }

    fn read_cached(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<bool, StoreError> {
        self.with_file(segment, |file| {
            Ok(read_if_cached(file, offset, buf, &self.nowait_refused))
        })
    }

    fn prefetch(&self, segment: u32, offset: u64, len: u64) {
        let _ = self.with_file(segment, |file| {
            start_reading(file, offset, len);
            Ok(())
        });
    }

    fn sync(&mut self) -> Result<(), StoreError> {
        Ok(())
    }

    fn punch(&mut self, _segment: u32, _offset: u64, _len: u64) -> Result<(), StoreError> {
        Err(StoreError::ReadOnly {
            what: "punching dead data".into(),
        })
    }

    fn mark(&self) -> SegmentMark {
        SegmentMark::default()
    }

    fn rewind(&mut self, _mark: SegmentMark) -> Result<(), StoreError> {
        Ok(())
    }

    fn unsynced(&self) -> u64 {
        0
    }
}

/// How a read-write open reaches a read-only store of the same directory in this process.
/// Held by every client of the read-only store (so it lives exactly as long as they do).
struct ReaderLink(EngineHandle);

/// The read-only stores open in this process, by (device, inode) of their database file:
/// SQLite shares state between a process' connections to one file by inode, so a bind mount
/// of the directory elsewhere is the same store.
static READERS: Mutex<Vec<(FileId, Weak<ReaderLink>)>> = Mutex::new(Vec::new());

/// (device, inode).
type FileId = (u64, u64);

/// Held while a store of this process opens its metadata connection, so that no read-only
/// store opens between a read-write open pausing the others and creating its index.
static OPENING: Mutex<()> = Mutex::new(());

fn opening_lock() -> std::sync::MutexGuard<'static, ()> {
    OPENING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Read-only stores paused by a read-write open; dropping this lets them reconnect.
struct PausedReaders {
    _resume: Vec<mpsc::Sender<()>>,
}

/// Make every read-only store of `meta`'s store in this process close its connection, and
/// wait until they have. SQLite keeps one shared-memory index per file and process, opened
/// read-only if a read-only connection (`readonly_shm`) opened it first; a writer's
/// connection in the same process would then fail ("attempt to write a readonly database").
/// With the readers closed, the writer opens the index read-write, and the readers share it
/// when they reconnect.
fn pause_readers(meta: &Path) -> PausedReaders {
    let Ok(m) = std::fs::metadata(meta) else {
        return PausedReaders {
            _resume: Vec::new(),
        };
    };
    let id = (m.dev(), m.ino());
    let links: Vec<Arc<ReaderLink>> = {
        let mut readers = READERS.lock().unwrap_or_else(|e| e.into_inner());
        readers.retain(|(_, r)| r.strong_count() > 0);
        readers
            .iter()
            .filter(|(of, _)| *of == id)
            .filter_map(|(_, r)| r.upgrade())
            .collect()
    };
    let mut resumes = Vec::new();
    let mut released = Vec::new();
    for link in &links {
        let (done, wait) = mpsc::channel();
        let (resume, resumed) = mpsc::channel();
        if link.0.send(Request::Release {
            released: done,
            resume: resumed,
        }) {
            released.push(wait);
            resumes.push(resume);
        }
    }
    drop(links);
    for wait in released {
        let _ = wait.recv_timeout(Duration::from_secs(30));
    }
    PausedReaders { _resume: resumes }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a file system that cannot read without waiting (tmpfs, on the kernels of these
    /// VMs), cached bytes are read the usual way and reported as read, not as missed (which
    /// made every read of a burst twice).
    #[test]
    fn a_file_system_without_nowait_reads_is_read_at_once() {
        let dir = match tempfile::tempdir_in("/dev/shm") {
            Ok(dir) => dir,
            Err(e) => return eprintln!("note: no /dev/shm here ({e}); nothing to check"),
        };
        let path = dir.path().join("segment");
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = File::open(&path).unwrap();
        let refused = Cell::new(false);
        for at in [1000, 3000] {
            let mut buf = vec![0u8; 4096];
            assert!(
                read_if_cached(&file, at, &mut buf, &refused),
                "read at {at}"
            );
            assert!(
                buf == bytes[at as usize..at as usize + 4096],
                "the bytes at {at}"
            );
        }
    }

    /// Segments in a fresh directory, with 1 MiB of data appended and synced; returns the
    /// segment and offset of the data.
    fn segments_with_data(dir: &Path) -> (FileSegments, u32, u64) {
        let db = Connection::open_in_memory().unwrap();
        Engine::init_schema(&db).unwrap();
        let mut segments = FileSegments::open(dir.join("data"), &db, false).unwrap();
        let (seg, offset) = segments.append(&[7u8; 1 << 20]).unwrap();
        segments.sync().unwrap();
        (segments, seg, offset)
    }

    fn allocated(dir: &Path) -> u64 {
        std::fs::read_dir(dir.join("data"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
            .sum()
    }

    /// A rewind of appends that began with an alignment pad keeps the transaction's earlier
    /// appends counted as unsynced: the commit then syncs them before its extents point at
    /// them (it skips the sync when nothing is counted).
    #[test]
    fn a_rewind_past_an_alignment_pad_keeps_earlier_appends_unsynced() {
        let dir = tempfile::tempdir().unwrap();
        let (mut segments, _, _) = segments_with_data(dir.path());
        segments.append(&[1u8; 2000]).unwrap();
        let mark = segments.mark();
        segments.append(&[2u8; 4096]).unwrap();
        segments.rewind(mark).unwrap();
        assert_eq!(segments.unsynced(), 2000);
        segments.sync().unwrap();
        assert_eq!(segments.unsynced(), 0);
    }

    /// Reused space written by a transaction whose COMMIT then fails (after the data sync)
    /// goes back to the free ranges when the transaction is rewound; once committed, it is
    /// referenced and a rewind keeps it.
    #[test]
    fn reused_space_of_a_commit_that_fails_after_the_sync_is_held_again() {
        let dir = tempfile::tempdir().unwrap();
        let (mut segments, seg, offset) = segments_with_data(dir.path());
        // A write of whole blocks makes the segments reuse dead space.
        segments.place(&[0u8; 4096]).unwrap();
        assert!(segments.reusing());
        segments.punch(seg, offset, 4096).unwrap();
        assert_eq!(segments.free.total(), 4096);
        let mark = segments.mark();
        let places = segments.place(&[1u8; 4096]).unwrap();
        assert_eq!(places, [(seg, offset, 4096)], "the dead block is reused");
        segments.sync().unwrap();
        // The COMMIT failed: the transaction is taken back.
        segments.rewind(mark).unwrap();
        assert_eq!(
            segments.free.total(),
            4096,
            "the reused block is held again"
        );
        // Committed, the block is referenced: a later rewind to the mark leaves it.
        let mark = segments.mark();
        segments.place(&[1u8; 4096]).unwrap();
        segments.sync().unwrap();
        segments.committed();
        segments.rewind(mark).unwrap();
        assert_eq!(segments.free.total(), 0);
    }

    /// A stop waits for the punch backlog only so long: past the budget `settle_within` gives
    /// up what is still queued and says so (the engine then leaves no `CLEAN` marker, and the
    /// next open reclaims the space); within it, everything is punched.
    #[test]
    fn settle_within_gives_up_a_backlog_past_its_budget() {
        let dir = tempfile::tempdir().unwrap();
        let (mut segments, seg, offset) = segments_with_data(dir.path());
        // The puncher is held up (as by slow discards) before it reaches the punch: a first
        // punch starts it, a barrier behind that one sleeps in it.
        segments.punch(seg, offset, 4096).unwrap();
        segments.after_punches(Box::new(|| std::thread::sleep(Duration::from_millis(500))));
        segments
            .punch(seg, offset + 4096, (1 << 20) - 4096)
            .unwrap();
        assert!(
            !segments.settle_within(Duration::from_millis(50)),
            "settle_within waited for a backlog past its budget"
        );
        assert!(
            allocated(dir.path()) >= (1 << 20) - 4096,
            "a punch given up was done anyway"
        );

        let dir = tempfile::tempdir().unwrap();
        let (mut segments, seg, offset) = segments_with_data(dir.path());
        segments.punch(seg, offset, 1 << 20).unwrap();
        assert!(segments.settle_within(Duration::from_secs(30)));
        assert!(
            allocated(dir.path()) < 64 << 10,
            "{} bytes still allocated after a settled punch",
            allocated(dir.path())
        );
    }

    /// Wait up to 10 s for `[offset, offset + len)` of `file` to leave the page cache;
    /// returns the pages still cached.
    fn cached_after_waiting(file: &File, offset: u64, len: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let cached = crate::ffi_writeback::cached_pages(file, offset, len).unwrap();
            if cached == 0 || Instant::now() > deadline {
                return cached;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Appended data leaves the page cache once a sync made it clean: after a sync ahead
    /// (queued every `SYNC_AHEAD` bytes) and after the commit's own sync. Kept, it made the
    /// file's cache grow with every byte appended (see `FileSegments::drop_written_back`).
    #[test]
    fn appended_pages_leave_the_page_cache_once_synced() {
        let dir = tempfile::tempdir().unwrap();
        // Whether this file system drops clean pages at all (tmpfs cannot) and the kernel
        // reports them (`cachestat`, Linux 6.5).
        let probe = open_read_write(&dir.path().join("probe")).unwrap();
        probe.write_all_at(&[1u8; 1 << 20], 0).unwrap();
        probe.sync_data().unwrap();
        start_writeback(&probe, 0, 1 << 20);
        match crate::ffi_writeback::cached_pages(&probe, 0, 1 << 20) {
            Ok(0) => {}
            other => {
                eprintln!("skipped: clean pages not dropped or not reported here ({other:?})");
                return;
            }
        }

        let db = Connection::open_in_memory().unwrap();
        Engine::init_schema(&db).unwrap();
        let mut segments = FileSegments::open(dir.path().join("data"), &db, false).unwrap();
        let piece: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
        // 1 MiB appends (past `TAIL_APPEND_MAX`: written at once); the 16th queues a sync
        // ahead, behind it the drops of the two kicked 8 MiB ranges.
        let mut places = Vec::new();
        for _ in 0..17 {
            places.push(segments.append(&piece).unwrap());
        }
        assert!(
            places.iter().all(|(s, _)| *s == places[0].0),
            "the test expects one segment"
        );
        let file = segments.files[&places[0].0].clone();
        let synced_ahead = SYNC_AHEAD;
        assert_eq!(
            cached_after_waiting(&file, 0, synced_ahead),
            0,
            "appended pages stayed cached after a sync ahead"
        );
        // Up to the next kick, appends stay cached; the commit's sync drops what was kicked.
        for _ in 0..8 {
            places.push(segments.append(&piece).unwrap());
        }
        segments.sync().unwrap();
        assert_eq!(
            cached_after_waiting(&file, synced_ahead, WRITEBACK_KICK),
            0,
            "appended pages stayed cached after the commit's sync"
        );
        // Dropped from the cache, not lost.
        for (segment, at) in places {
            let mut back = vec![0u8; piece.len()];
            segments.read(segment, at, &mut back).unwrap();
            assert!(back == piece, "appended data read back at {at}");
        }
    }

    #[test]
    fn segment_writes_go_out_in_aligned_pieces_and_land_whole() {
        const P: u64 = WRITE_PIECE;
        for (at, len) in [
            (0, 0),
            (0, 4096),
            (0, 2 * P),
            (P - 4096, 8192),
            (P + 3, 2 * P + 17),
        ] {
            let pieces: Vec<usize> = piece_lengths(at, len as usize).collect();
            assert_eq!(pieces.iter().sum::<usize>(), len as usize, "{at} {len}");
            let mut start = at;
            for piece in pieces {
                assert!(
                    piece > 0 && piece as u64 <= P,
                    "{at} {len}: piece of {piece}"
                );
                assert_eq!(
                    start / P,
                    (start + piece as u64 - 1) / P,
                    "{at} {len}: crosses"
                );
                start += piece as u64;
            }
        }
        assert_eq!(piece_lengths(0, 2 * P as usize).count(), 2);
        assert_eq!(piece_lengths(P - 4096, 8192).count(), 2);

        let dir = tempfile::tempdir().unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let data: Vec<u8> = (0..2 * P + 17).map(|i| (i * 7 % 251) as u8).collect();
        write_in_pieces(&file, &data, P + 3).unwrap();
        let mut back = vec![0u8; data.len()];
        file.read_exact_at(&mut back, P + 3).unwrap();
        assert!(
            back == data,
            "the pieces put the bytes back in their places"
        );
    }

    /// Once writes stop, held space goes to the punch thread a batch at a time, and what is
    /// not handed over yet stays reusable: a write that comes back meanwhile goes into it
    /// instead of growing the segment. In the end everything is punched.
    #[test]
    fn held_space_goes_back_a_batch_at_a_time_and_stays_reusable() {
        const BLOCKS: u64 = 4 * RELEASE_BATCH as u64;
        let dir = tempfile::tempdir().unwrap();
        let db = Connection::open_in_memory().unwrap();
        Engine::init_schema(&db).unwrap();
        let mut segments = FileSegments::open(dir.path().join("data"), &db, false).unwrap();
        let (seg, base) = segments
            .append(&vec![7u8; (BLOCKS * BLOCK as u64) as usize])
            .unwrap();
        segments.sync().unwrap();
        // Every other block dies while whole-block writes come: held, none merged.
        segments.last_block_write = Some(Instant::now());
        for b in (0..BLOCKS).step_by(2) {
            segments
                .punch(seg, base + b * BLOCK as u64, BLOCK as u64)
                .unwrap();
        }
        let held = BLOCKS / 2 * BLOCK as u64;
        assert_eq!(segments.free.total(), held);
        let wait = segments.tick().expect("space is held: a tick is due");
        assert!(wait <= REUSE_IDLE);
        assert_eq!(
            segments.free.total(),
            held,
            "released before writes stopped"
        );

        // Writes stopped long enough: one batch goes, the rest stays held.
        segments.last_reuse = Instant::now() - REUSE_IDLE;
        assert_eq!(segments.tick(), Some(RELEASE_STEP));
        assert_eq!(
            segments.free.total(),
            held - RELEASE_BATCH as u64 * BLOCK as u64
        );
        // A write that comes back reuses what is still held.
        let length = segments.len;
        let places = segments.place(&[9u8; BLOCK]).unwrap();
        assert_eq!(places.len(), 1);
        let (at_seg, at, _) = places[0];
        assert!(
            at_seg == seg && at >= base && at < base + BLOCKS * BLOCK as u64,
            "the write went to {places:?}, not into held space"
        );
        assert_eq!(segments.len, length, "the segment grew");
        segments.sync().unwrap();

        // Left alone, the rest goes too, batch after batch.
        segments.last_reuse = Instant::now() - REUSE_IDLE;
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Some(wait) = segments.tick() {
            assert!(Instant::now() < deadline, "held space never fully released");
            std::thread::sleep(wait);
        }
        assert!(segments.free.is_empty());
        segments.settle();
        let live = (BLOCKS / 2 + 1) * BLOCK as u64;
        assert!(
            allocated(dir.path()) <= live + (64 << 10),
            "{} bytes allocated for {live} live",
            allocated(dir.path())
        );
    }
}
