//! The engine under the local and memory backends: object data in segments, never written
//! over live data, everything else (object table, extent maps, omap, snapshots, locks) in
//! SQLite.
//!
//! Why this shape (docs/ARCHITECTURE.md, "Local backend"): live data is never overwritten in
//! place, so an operation becomes visible by one SQLite transaction that points at data already
//! on disk: atomic without writing data twice, whatever the write size. Snapshots are free (a
//! preserved state shares the segment ranges of its data). Space of dead data goes back to the
//! segments (`Segments::punch`: reused for new data, or punched out) once the change that
//! killed it is durable.
//!
//! One worker thread owns the database and the segments; requests arrive on a channel and are
//! applied in arrival order (so operations on one object apply in submission order). Each
//! operation runs in a SAVEPOINT inside a long transaction (group commit): a failed step rolls
//! back only its own operation. The transaction commits after the segment data it references
//! has been synced, at the latest every 2 s, and durably (WAL synced) on flush and at least
//! as often (`COMMIT_INTERVAL`, `DURABLE_INTERVAL`). The WAL sync runs on a thread of its own
//! (`WalSync`); flushes and the punching of freed space wait for it, the worker does not.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_channel::oneshot;
use rusqlite::{config::DbConfig, params, Connection, OptionalExtension};

use crate::held_extents::{ExtentWriteBack, Held, HeldExtents};
use crate::omap_overlay::{Lookup, OmapKey, OmapOverlay, WriteBack};
use crate::{
    check_range, Extent, LockRequest, Locker, ObjectName, OmapPairs, ReadOp, ReadResult, ReadStep,
    SnapContext, SnapId, Stat, StoreError, WriteOp, WriteOutcome, WriteStep,
};

/// Where object data lives: segments addressed by (segment, offset), written only where no
/// committed extent points.
pub(crate) trait Segments: Send {
    /// Append `data`; returns where it went.
    fn append(&mut self, data: &[u8]) -> Result<(u32, u64), StoreError>;
    /// Write `data` where the segments choose: one place or several, in order, as
    /// (segment, offset, length). Appends it by default; segments that reuse dead space put
    /// large writes of whole blocks there.
    fn place(&mut self, data: &[u8]) -> Result<Vec<(u32, u64, u64)>, StoreError> {
        let (segment, offset) = self.append(data)?;
        Ok(vec![(segment, offset, data.len() as u64)])
    }
    fn read(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<(), StoreError>;
    /// [`Segments::read`] if every byte is in memory now (the page cache, a buffer): false
    /// when the read would wait for the disk (then `buf` holds anything).
    fn read_cached(&self, segment: u32, offset: u64, buf: &mut [u8]) -> Result<bool, StoreError> {
        self.read(segment, offset, buf)?;
        Ok(true)
    }
    /// These bytes are read soon: start reading them from the disk (a hint; nothing where
    /// the bytes are in memory).
    fn prefetch(&self, _segment: u32, _offset: u64, _len: u64) {}
    /// Make every append so far durable.
    fn sync(&mut self) -> Result<(), StoreError>;
    /// At a durable commit: the store's files are still where they were opened. Deleted
    /// under a running store (`rm -r` of its directory's content), they go on taking writes
    /// and syncs that nothing will ever read, and every flush said they were durable.
    fn check_in_place(&self) -> Result<(), StoreError> {
        Ok(())
    }
    /// A commit of the metadata follows: make sure it has room on the file system, where the
    /// segments keep some for it (local.rs, `CommitRoom`). `checkpoint_debt`: bytes the
    /// database file must still grow by to take in what its log holds (`checkpoint_debt`).
    /// Returns the bytes free on the file system, where the segments asked it.
    fn before_commit(&mut self, _checkpoint_debt: u64) -> Option<u64> {
        None
    }
    /// Bytes the next commit has on the file system, as last seen, where the segments know
    /// (local.rs, `CommitRoom`).
    fn commit_room(&self) -> Option<u64> {
        None
    }
    /// [`Segments::commit_room`], the file system asked again now.
    fn fresh_commit_room(&mut self) -> Option<u64> {
        self.commit_room()
    }
    /// The data in this range is dead, and its death durable: return its space (reused for
    /// later writes, or punched, possibly later, in the background).
    fn punch(&mut self, segment: u32, offset: u64, len: u64) -> Result<(), StoreError>;
    /// Wait until every punch asked for so far is done.
    fn settle(&mut self) {}
    /// [`Segments::settle`] for at most `budget`, then give up the punches still waiting;
    /// false when some were given up (their space stays used until a reclaim finds it).
    fn settle_within(&mut self, _budget: Duration) -> bool {
        self.settle();
        true
    }
    /// Run `done` once every punch asked for so far is done (at once where punches are).
    fn after_punches(&mut self, done: Box<dyn FnOnce() + Send>) {
        done()
    }
    /// The transaction since the last mark is committed: what it wrote is referenced, and
    /// a rewind will not take it back.
    fn committed(&mut self) {}
    /// The current append position (to undo the appends of a failed operation).
    fn mark(&self) -> SegmentMark;
    /// Take back every append made since `mark` (a mark of the open transaction).
    fn rewind(&mut self, mark: SegmentMark) -> Result<(), StoreError>;
    /// Bytes appended since the last sync.
    fn unsynced(&self) -> u64;
    /// Called by the worker after each burst of requests and at least every
    /// `DURABLE_INTERVAL`: a chance to give back space held for reuse when writes have
    /// stopped. Returns how soon it wants to be called again, if sooner.
    fn tick(&mut self) -> Option<Duration> {
        None
    }
    /// Whether writes are reusing dead space now (then frees are worth a durable commit).
    fn reusing(&self) -> bool {
        false
    }
}

/// Where appends stood: the append position and, for segments that reuse dead space, how
/// many reuses came before.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SegmentMark {
    pub(crate) segment: u32,
    pub(crate) offset: u64,
    pub(crate) reused: usize,
}

/// How the metadata database makes commits durable. Shared with the sync thread
/// (`WalSync`), which calls `sync_wal` while the worker goes on.
pub(crate) trait Durability: Send + Sync {
    /// Sync the database's write-ahead log after a COMMIT: every commit made before the call
    /// is durable when it returns.
    fn sync_wal(&self) -> Result<(), StoreError>;
    /// The worker stopped after a successful durable commit: nothing is pending anywhere.
    fn mark_clean(&self) {}
    /// Whether `sync_wal` returns at once (nothing to sync): then the worker calls it itself.
    fn instant(&self) -> bool {
        false
    }
    /// Bytes this process may still use on the file system holding the database, if it has
    /// one.
    fn space_left(&self) -> Option<u64> {
        None
    }
}

pub(crate) struct NoDurability;
impl Durability for NoDurability {
    fn sync_wal(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn instant(&self) -> bool {
        true
    }
}

/// Where a read-only engine gets its metadata connections (local.rs): read-only ones that see
/// committed states only, while a writer in another process may be committing.
pub(crate) trait MetaSource: Send {
    /// A new read-only connection.
    fn connect(&mut self) -> Result<Connection, StoreError>;
    /// Whether what the current connection reads may no longer be the committed state (it
    /// reads the database file as immutable and a writer has changed it since): the engine
    /// then reconnects and reads again.
    fn stale(&self) -> bool;
}

/// The state of a read-only engine.
struct ReadOnlyState {
    source: Box<dyn MetaSource>,
    /// `Engine::db` is a connection from `source` (not a placeholder after a release).
    connected: bool,
}

/// How often a read of a read-only engine is tried before giving up (on SQLite refusing to
/// start a read transaction, or the object changing under every attempt).
const READ_ONLY_ATTEMPTS: u32 = 50;

/// A WAL file synced through a second descriptor (SQLite's own sync is off between flushes),
/// and the marker file a clean stop leaves (`clean_marker`).
pub(crate) struct WalFile {
    pub wal: PathBuf,
    pub clean_marker: PathBuf,
}
impl Durability for WalFile {
    fn mark_clean(&self) {
        match std::fs::write(&self.clean_marker, b"") {
            Ok(()) => crate::fault_io::write(|| self.clean_marker.clone(), 0, b""),
            Err(e) => tracing::warn!("could not mark the store as cleanly stopped: {e}"),
        }
    }

    fn sync_wal(&self) -> Result<(), StoreError> {
        match std::fs::File::open(&self.wal) {
            Ok(f) => {
                // SQLite may write the next commit into the log while this sync runs: only
                // what was written before it counts as synced in the power-loss model.
                let before = crate::fault_io::sync_point(&self.wal);
                f.sync_data().map_err(StoreError::io_with(|| {
                    format!("syncing {}", self.wal.display())
                }))?;
                crate::fault_io::synced_through(&self.wal, before);
                Ok(())
            }
            // No WAL yet (nothing written since the last checkpoint): nothing to sync.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(format!("opening {}", self.wal.display()))(e)),
        }
    }

    fn space_left(&self) -> Option<u64> {
        Some(crate::fs_space::FsSpace::at(self.wal.parent()?)?.usable)
    }
}

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;
/// A read request taken from a burst: its object, operation and reply.
type PendingRead = (ObjectName, ReadOp, Reply<Vec<ReadResult>>);
/// A read's result, and whether it missed the page cache (`PieceReads::NoWait`).
type ReadOutcome = (Result<Vec<ReadResult>, StoreError>, bool);

/// A read of more pieces than this is made as usual in a `PieceReads::NoWait` pass too: its
/// own pieces keep the disk busy (they are asked for at once), and made twice over, its
/// lookups and hints cost more than the burst brings (an export of a fragmented image, 4 MiB
/// reads of about a thousand pieces 8 at a time, took 11% longer; `nbdcopy` of it kept its
/// gain from the bursts with this bound, and lost it with a bound of one piece).
const NOWAIT_PIECES_MAX: usize = 64;

/// How a read takes its pieces of segment data (`Engine::read_extents`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum PieceReads {
    /// Each piece but the last from memory if there; at the first that is not, every later
    /// piece is asked for at once, then they are read in order.
    #[default]
    Usual,
    /// Never waiting for the disk: at the first piece not in memory it and every later one
    /// are asked for, `read_missed` is set and the read's result is to be thrown away.
    NoWait,
    /// Again after a `NoWait` pass that asked for every piece not in memory: plainly read
    /// (asking again, piece by piece, made a fragmented 4 MiB read's hints twice).
    Asked,
}

pub(crate) enum Request {
    Write {
        object: ObjectName,
        op: WriteOp,
        reply: Reply<WriteOutcome>,
    },
    Read {
        object: ObjectName,
        op: ReadOp,
        reply: Reply<Vec<ReadResult>>,
    },
    List {
        prefix: String,
        /// `None`: the head.
        snap: Option<SnapId>,
        reply: Reply<Vec<ObjectName>>,
    },
    SnapCreate {
        reply: Reply<SnapId>,
    },
    SnapRemove {
        snap: SnapId,
        reply: Reply<()>,
    },
    Lock {
        object: ObjectName,
        client: String,
        request: LockRequest,
        reply: Reply<()>,
    },
    /// Release a lock: the holder's own unlock, or another client's break (same removal).
    Unlock {
        object: ObjectName,
        lock: String,
        client: String,
        cookie: String,
        reply: Reply<()>,
    },
    ListLockers {
        object: ObjectName,
        lock: String,
        reply: Reply<Vec<Locker>>,
    },
    /// With `reclaim`, the reply also waits until the dead data freed so far is punched.
    Flush {
        reply: Reply<()>,
        reclaim: bool,
    },
    /// Close the metadata connection (a read-only engine), say so on `released`, and open a
    /// new one once `resume` is dropped: a read-write open of the same store in this process
    /// must create SQLite's shared-memory index itself (SQLite shares it between a process'
    /// connections, read-only if a read-only connection created it). Read-write engines only
    /// say `released`.
    Release {
        released: mpsc::Sender<()>,
        resume: mpsc::Receiver<()>,
    },
}

/// Group commit: how long a transaction stays open, and how many operations or bytes of
/// segment data it takes. Every commit costs a segment `fdatasync` (no committed metadata may
/// point at data a power cut could lose), so commits are rare: operations are acknowledged as
/// soon as they are applied inside the open transaction (reads see them), and only `flush`
/// promises durability. A crash loses the open transaction whole: acknowledged but unflushed
/// operations, never part of one.
///
/// Why 2 s and not less: a commit writes every database page the interval's operations
/// changed into SQLite's log, and the checkpoint copies them into the database file. Under
/// random 4 KiB writes over a 1 GiB disk in the `object-end` layout (two extent rows each),
/// `ivdisk serve` wrote 9.1 KiB per write at 500 ms (5 KiB of it database pages) and 5.6 KiB
/// at 2 s, where a page takes several writes before it is written out: 10-24% less server CPU
/// per write, 1.06-1.28x the writes (docs/BENCHMARKS.md, "group commits every 2 s"). Block
/// devices promise nothing before a flush; ext4 commits its journal every 5 s.
///
/// Builds with the `fault-io` feature (the store's own tests) keep 500 ms and 1 s: the
/// power-loss and crash tests cut within a second and must find the store's own group
/// commits, synced and unsynced, in SQLite's log.
const COMMIT_INTERVAL: Duration = if cfg!(feature = "fault-io") {
    Duration::from_millis(500)
} else {
    Duration::from_secs(2)
};
/// At most this many object heads are cached (`Engine::heads`); then the cache starts over.
const HEAD_CACHE_SIZE: usize = 1 << 16;
/// At most this many requests are handled before their replies are sent.
const ANSWER_BURST: usize = 32;
const COMMIT_MAX_OPS: usize = 200_000;
/// Omap changes held in memory (omap_overlay.rs) are written back in pieces, one per commit,
/// once they take more than this (about 200,000 values of an `omap-packed` image), down to
/// three quarters of it. The more held, the fewer B-tree pages each value dirties: random
/// 4 KiB writes over a 32 GiB image went +12% holding 64 Ki values, +30% holding 256 Ki, in
/// builds without pending rows (docs/BENCHMARKS.md, "Omap values written behind").
/// `IVDISK_STORE_OMAP_HELD_MAX` (bytes) overrides it, for tests that crash writers in the
/// middle of pieces and for measurements.
const OMAP_HELD_MAX: usize = 128 << 20;

/// Once no write came for this long, a read-write engine compacts its metadata
/// (`Engine::compact_step`): it writes back everything the overlays hold, a piece at a time
/// (their pending rows' pages become free for later writes), rebuilds the database without
/// its free pages if it is mostly free and small (`Engine::vacuum_if_mostly_free`), and
/// truncates SQLite's log (`PRAGMA wal_checkpoint(TRUNCATE)`). Why: the metadata files only
/// grew otherwise. Random 4 KiB writes through `ivdisk serve` to a 2 GiB image left 178 MB
/// of database and 287 MB of log, and after a discard of the whole disk, whose data then
/// took 120 KB, both stayed as large (docs/BENCHMARKS.md, "Metadata given back when
/// idle"). `IVDISK_STORE_COMPACT_IDLE_MS` overrides it (tests).
const COMPACT_IDLE: Duration = Duration::from_secs(10);
/// Held changes written back per compaction step, and the pause between steps: each step is
/// one short transaction (10-60 ms), and requests that come meanwhile are handled between
/// steps (a write stops the compaction until the store is idle again).
const COMPACT_WRITE_BACK_PIECE: usize = 8 << 10;
const COMPACT_PAUSE: Duration = Duration::from_millis(5);
/// The database is rebuilt without its free pages only if they are at least this many bytes
/// and three times what is in use, and what is in use is at most `COMPACT_VACUUM_LIVE_MAX`
/// (the rebuild holds it in memory and stalls the worker while it copies it: about 10 ms per
/// MB). A store whose metadata is mostly in use keeps its free pages for later writes.
/// Builds with the `fault-io` feature (the store's own tests, which write little) rebuild from
/// 256 KiB of free pages.
const COMPACT_FREE_MIN: u64 = if cfg!(feature = "fault-io") {
    256 << 10
} else {
    16 << 20
};
const COMPACT_VACUUM_LIVE_MAX: u64 = 64 << 20;
/// On a file system with less room than this, an idle store only truncates its log (which
/// gives space back) and leaves that room to the writes to come. Builds with the `fault-io`
/// feature (the store's own tests) compact whatever the room, so that `tests/compaction.rs`
/// sees a write-back commit fail for lack of space and lose nothing (`only_write_back` in
/// `Engine::commit`).
const COMPACT_ROOM_MIN: Option<u64> = if cfg!(feature = "fault-io") {
    None
} else {
    Some(64 << 20)
};

/// `COMMIT_INTERVAL` and `DURABLE_INTERVAL`, unless `IVDISK_STORE_COMMIT_INTERVAL_MS` sets
/// both (tests that need a transaction to grow, as it does in a release build's 2 s).
fn commit_intervals() -> (Duration, Duration) {
    match std::env::var("IVDISK_STORE_COMMIT_INTERVAL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(ms) => (Duration::from_millis(ms), Duration::from_millis(ms)),
        None => (COMMIT_INTERVAL, DURABLE_INTERVAL),
    }
}

/// A clean stop writes back what the overlays hold only if the file system has four times
/// their memory free and this much more (SQLite's log takes a page per row it touches), or
/// `COMPACT_ROOM_MIN` where that is more.
const STOP_WRITE_BACK_MARGIN: u64 = 1 << 20;

/// A checkpoint of the metadata log runs only if the file system has what it needs and this
/// much more (`Engine::checkpoint_fits`): the next commits' room, among them the next open's.
const CHECKPOINT_MARGIN: u64 = 1 << 20;

/// Below this much free space (plus twice the debt), every commit measures the checkpoint's
/// debt (`Engine::commit_checkpoint_debt`); above it, one in `DEBT_MAX_AGE` does, as commits
/// within that time cannot make a debt of this size.
const DEBT_MEASURED_BELOW: u64 = 256 << 20;
const DEBT_MAX_AGE: Duration = Duration::from_millis(100);

fn compact_idle() -> Duration {
    std::env::var("IVDISK_STORE_COMPACT_IDLE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
        .unwrap_or(COMPACT_IDLE)
}

/// How many of `count` held changes (taking `bytes`) the next piece writes back: none while
/// at most `max` bytes are held, else enough to hold three quarters of `max` after.
fn piece_limit((count, bytes): (usize, usize), max: usize) -> Option<usize> {
    if bytes <= max {
        return None;
    }
    let over = bytes - max / 4 * 3;
    Some((over as u128 * count as u128 / bytes.max(1) as u128) as usize + 1)
}

/// How many bytes of pending rows a table may hold: twice what its held changes take (every
/// held change is in some row), and half the bound of held changes besides, so that the rows
/// written back early are old ones, whose changes were mostly changed again since.
fn pending_max(held_bytes: usize, held_max: usize) -> usize {
    held_bytes.saturating_mul(2).saturating_add(held_max / 2)
}

fn omap_held_max() -> usize {
    std::env::var("IVDISK_STORE_OMAP_HELD_MAX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(OMAP_HELD_MAX)
}
const COMMIT_MAX_BYTES: u64 = 1 << 30;
/// What a commit may write to SQLite's log per operation it holds, besides the changes in
/// its pending rows, which are counted as encoded (`Engine::commit_bytes`): the pages of
/// the rows' tables, the objects' heads and the `meta` rows they touch. A transaction commits
/// once it could need an eighth of the room the commit has on the file system
/// (`Segments::commit_room`, as last seen; the appends may have taken half of it since):
/// random 4 KiB writes until the disk was full, 20-22k of them in one transaction, needed
/// more than the store's room and lost them all. A full disk then has room for its commit.
/// (This bound counted 512 bytes per operation for everything, and the rows of random 4 KiB
/// writes through `ivdisk serve` in the default layout, `omap-packed`, take about 600.)
const COMMIT_BYTES_PER_OP: u64 = 256;
/// While the metadata log cannot be checkpointed for lack of space
/// (`hold_checkpoints_while_short`), a lock renewal stores an expiry this many times its
/// duration ahead, and the renewals after it store nothing while the stored expiry is still
/// a whole duration ahead: each stored renewal adds pages to a log that grows until space is
/// freed (12 KB per renewal every 10 s, an image's writer lock, was 4.4 MB an hour). On the
/// local store the longer expiry changes only what a lock listing shows: the store's writer
/// holds its directory's lock, and the next writer takes over a lock its holder left behind
/// (`orphaned_locks`).
const SHORT_RENEWAL_STRETCH: u128 = 20;
/// Durable commits happen at least this often even without a flush (bounds the loss after a
/// power cut and lets dead space be punched).
const DURABLE_INTERVAL: Duration = if cfg!(feature = "fault-io") {
    Duration::from_secs(1)
} else {
    Duration::from_secs(2)
};
/// How long a clean stop waits for the punch backlog before it leaves the rest to the reclaim
/// at the next open.
const STOP_PUNCH_BUDGET: Duration = Duration::from_secs(2);
/// How often the worker looks for finished log syncs while one runs and no request comes.
const SYNC_POLL: Duration = Duration::from_micros(200);

/// The thread that syncs the metadata log for durable commits (`Durability::sync_wal`).
///
/// Why a thread: under random 4 KiB writes through `ivdisk serve` the log's `fdatasync` took
/// 150-200 ms every 2 s, and done by the worker every request waited behind it. Nothing the
/// worker does next needs the log durable, only what waits for a durable commit: the flushes
/// that asked for it, and the punching of data whose death it commits
/// (docs/BENCHMARKS.md, "Log syncs off the worker").
struct WalSync {
    /// One message per durable commit.
    jobs: mpsc::Sender<()>,
    /// How many durable commits one sync covered (jobs that were queued together share it),
    /// and its failure: whether for lack of space, and what happened.
    done: mpsc::Receiver<(usize, Option<(bool, String)>)>,
    thread: std::thread::JoinHandle<()>,
}

impl WalSync {
    fn start(durability: Arc<dyn Durability>) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<()>();
        let (finished, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ivdisk-store-sync".into())
            .spawn(move || {
                while queue.recv().is_ok() {
                    let mut covered = 1;
                    while queue.try_recv().is_ok() {
                        covered += 1;
                    }
                    let failure = sync_failure(durability.sync_wal());
                    if finished.send((covered, failure)).is_err() {
                        break;
                    }
                }
            })?;
        Ok(WalSync { jobs, done, thread })
    }
}

/// Pending rows a read-only engine tracks while following a writer's commits past which,
/// when the oldest of them is gone from the table, it replays the rows left from the start
/// (`follow_omap_pending`).
const FOLLOWED_ROWS_MAX: usize = 4096;

/// A durable commit whose log sync has not finished, and what waits for it.
struct DurablePoint {
    /// Dead ranges to give back once the commit is durable (`Engine::widened_frees`).
    frees: Vec<(u32, u64, u64)>,
    /// Flushes to answer then: the reply, what it reports unless the sync fails, and whether
    /// it waits for the punches too (see the flush request).
    flushes: Vec<(Reply<()>, Result<(), StoreError>, bool)>,
}

/// A log sync's failure as the worker keeps it: whether for lack of space, and what happened.
fn sync_failure(synced: Result<(), StoreError>) -> Option<(bool, String)> {
    synced
        .err()
        .map(|e| (matches!(e, StoreError::NoSpace { .. }), e.to_string()))
}

/// What a flush reports for a failure noted by `Engine::note_flush_error`.
fn flush_error((no_space, what): (bool, String)) -> StoreError {
    match no_space {
        true => StoreError::NoSpace { context: what },
        false => StoreError::Database(what),
    }
}

/// The other nodes (head, clones) of the object of node `?1`, for `Engine::shared_parts`.
const OTHER_NODES_OF_OBJECT: &str = "
    SELECT id FROM nodes WHERE clone_to IS NULL AND id != ?1
      AND name = (SELECT name FROM nodes WHERE id = ?1)
    UNION ALL
    SELECT id FROM nodes WHERE clone_to IS NOT NULL AND id != ?1
      AND name = (SELECT name FROM nodes WHERE id = ?1)";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    clone_from INTEGER,
    clone_to INTEGER,
    size INTEGER NOT NULL,
    version INTEGER NOT NULL,
    snap_seq INTEGER NOT NULL,
    birth_seq INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS head_by_name ON nodes(name) WHERE clone_to IS NULL;
CREATE INDEX IF NOT EXISTS clone_by_name ON nodes(name, clone_to) WHERE clone_to IS NOT NULL;
CREATE TABLE IF NOT EXISTS extents (
    node INTEGER NOT NULL, lo INTEGER NOT NULL, hi INTEGER NOT NULL,
    seg INTEGER NOT NULL, seg_off INTEGER NOT NULL,
    blob INTEGER NOT NULL, blob_end INTEGER NOT NULL,
    inline BLOB,
    PRIMARY KEY (node, lo)
) WITHOUT ROWID;
-- Where the segment extents that do not cover whole blocks are (`Engine::referenced`, which
-- asks only about blocks partly dead, where no extent of whole blocks can be). Extents of
-- whole blocks (every data extent of 4 KiB-aligned image IO) and inline extents (seg -1)
-- are left out: an entry to delete and insert on every overwrite cost random 4 KiB writes
-- through `ivdisk serve` a sixth of their rate (docs/BENCHMARKS.md, section Partial blocks
-- indexed only). `REFERENCED` repeats the terms, as SQLite requires to use a partial index.
-- 4096 is `BLOCK`.
CREATE INDEX IF NOT EXISTS partial_block_by_place ON extents(seg, seg_off)
    WHERE seg >= 0 AND (seg_off % 4096 != 0 OR (hi - lo) % 4096 != 0);
-- Its predecessors, on (seg, seg_off) and (seg, blob) of every extent (stores made before).
DROP INDEX IF EXISTS extent_by_place;
DROP INDEX IF EXISTS extent_by_blob;
CREATE TABLE IF NOT EXISTS omap (
    node INTEGER NOT NULL, key BLOB NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (node, key)
) WITHOUT ROWID;
-- Omap changes of committed transactions not yet written to `omap`, one row per group commit
-- (omap_overlay.rs); replayed in order at an open. AUTOINCREMENT: a read-only engine tells
-- new rows from rows it has seen by their numbers, which must not come back after a
-- write-back deleted every row.
CREATE TABLE IF NOT EXISTS omap_pending (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, changes BLOB NOT NULL
);
-- The same for `extents` (held_extents.rs). A writer's open writes them all back first.
CREATE TABLE IF NOT EXISTS extents_pending (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, changes BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS snaps (id INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS locks (
    name TEXT NOT NULL, lock TEXT NOT NULL, client TEXT NOT NULL, cookie TEXT NOT NULL,
    description TEXT NOT NULL, expires_ms INTEGER,
    PRIMARY KEY (name, lock, client, cookie)
);
";

/// Writes of at most this many bytes are kept in their extent's row in SQLite (`inline`)
/// instead of a segment: a segment append this small costs a system call and leaves later
/// appends off block boundaries, so that every dead range needs widening queries before it can
/// be punched (the 32-byte metadata extent of a 4 KiB write in the `object-end` layout was a
/// quarter of the worker's time that way).
const INLINE_MAX: usize = 1024;

/// What the engine reports as its write unit ([`crate::ObjectStore::write_unit`]): writes of
/// whole, aligned pieces this size stay in their own rows (at most `INLINE_MAX`), and
/// rewriting such a piece whole, or a few bytes of it, is one `UPDATE` of its row
/// (`replace_inline`, `patch_inline`). A few bytes inside data kept in a segment split its
/// extent instead: after a sequential fill (1 MiB writes,
/// 8 KiB of packed metadata each, kept in the segments), every random 4 KiB write cut that
/// 8 KiB extent in three rows and left 32 dead bytes to widen at the commit: a fifth more of
/// the worker's CPU per write than one `UPDATE` (docs/BENCHMARKS.md, "`object-end` metadata
/// in 512-byte pieces"). 512 and not `INLINE_MAX`: a row with a 1 KiB value no longer fits in
/// a B-tree page and spills into an overflow page.
pub(crate) const SMALL_WRITE_UNIT: u64 = 512;

/// Where an extent's bytes are.
#[derive(Debug, Clone)]
pub(crate) enum Stored {
    Segment(Piece),
    /// In the extent's row (column `inline`; `seg` is -1).
    Inline(Vec<u8>),
}

impl Stored {
    /// The same bytes from `skip` on (`len` of them).
    fn sub(&self, skip: u64, len: u64) -> Stored {
        match self {
            Stored::Segment(piece) => Stored::Segment(Piece {
                seg_off: piece.seg_off + skip,
                ..*piece
            }),
            Stored::Inline(data) => {
                Stored::Inline(data[skip as usize..(skip + len) as usize].to_vec())
            }
        }
    }
}

/// An extent as `read_extents` selects it: lo, hi, seg, seg_off, inline data.
type ExtentRow = (u64, u64, i64, u64, Option<Vec<u8>>);

/// `seg` of inline extents.
pub(crate) const INLINE_SEG: i64 = -1;

/// The segment extents that may reference bytes below `?2` in segment `?1`, by place,
/// descending; only those not covering whole blocks (`Engine::referenced`). The alignment
/// terms are the index's, as written there: SQLite uses a partial index only for a query that
/// has its terms (`referenced_uses_the_partial_block_index`).
const REFERENCED: &str = "SELECT seg_off, hi - lo, blob_end, node, lo FROM extents WHERE seg = ?1
     AND seg >= 0 AND (seg_off % 4096 != 0 OR (hi - lo) % 4096 != 0)
     AND seg_off < ?2 ORDER BY seg_off DESC";

/// The unit of space in the segments: only whole blocks are punched or reused, so dead ranges
/// are widened to whole blocks (`widen_to_blocks`). The index `partial_block_by_place` and
/// `Engine::referenced` write it as a literal.
pub(crate) const BLOCK: u64 = 4096;

/// The extents overlapping `[?3, ?2)` of node `?1`: the last one starting at or before `?3`
/// and those starting inside (a seek on `(node, lo)`, not a walk over the node's extents).
const READ_EXTENTS: &str = "SELECT lo, hi, seg, seg_off, inline FROM extents
     WHERE node = ?1 AND lo >= (SELECT COALESCE((SELECT lo FROM extents
         WHERE node = ?1 AND lo <= ?3 ORDER BY lo DESC LIMIT 1), 0))
     AND lo < ?2 AND hi > ?3 ORDER BY lo";
const READ_EXTENTS_WITHOUT_INLINE: &str = "SELECT lo, hi, seg, seg_off, NULL FROM extents
     WHERE node = ?1 AND lo >= (SELECT COALESCE((SELECT lo FROM extents
         WHERE node = ?1 AND lo <= ?3 ORDER BY lo DESC LIMIT 1), 0))
     AND lo < ?2 AND hi > ?3 ORDER BY lo";

/// Where an extent's bytes are in the segments: `seg_off` in segment `seg`, inside the blob
/// (the one append) `[blob, blob_end)` they were written by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub(crate) seg: u32,
    pub(crate) seg_off: u64,
    pub(crate) blob: u64,
    pub(crate) blob_end: u64,
}

impl Piece {
    fn placed((seg, seg_off, len): (u32, u64, u64)) -> Self {
        Piece {
            seg,
            seg_off,
            blob: seg_off,
            blob_end: seg_off + len,
        }
    }

    /// Bytes of a piece just placed (the whole blob).
    fn len(&self) -> u64 {
        self.blob_end - self.blob
    }
}

/// A node: the head of an object, or a preserved state (clone) for snapshots in
/// `(clone_from, clone_to]`.
#[derive(Debug, Clone, Copy)]
struct Node {
    id: i64,
    size: u64,
    version: u64,
    snap_seq: u64,
    birth_seq: u64,
}

pub(crate) struct Engine {
    /// Expiring locks that clients of an earlier opening held when this read-write engine
    /// opened (name, lock, client, cookie). Only clients of an open engine can renew a lock,
    /// and a store has one read-write engine at a time (the local store's directory lock), so
    /// their holders are gone: a lock request takes such a lock over at once instead of
    /// waiting out its expiry (a restarted `ivdisk serve` after a crash). Listing and breaking
    /// still see them.
    orphaned_locks: HashSet<(String, String, String, String)>,
    db: Connection,
    segments: Box<dyn Segments>,
    /// How reads take segment data (`PieceReads`; `handle_reads` changes it).
    piece_reads: std::cell::Cell<PieceReads>,
    /// Set by a `PieceReads::NoWait` read that missed the page cache.
    read_missed: std::cell::Cell<bool>,
    durability: Arc<dyn Durability>,
    /// The thread syncing the log for durable commits (started at the first), and the
    /// durable commits whose sync is not done yet, oldest first.
    wal_sync: Option<WalSync>,
    durable_points: VecDeque<DurablePoint>,
    in_txn: bool,
    /// Where the open transaction started: its first append and its first pending free.
    txn_mark: SegmentMark,
    txn_frees: usize,
    txn_ops: usize,
    txn_started: Instant,
    last_durable: Instant,
    /// Dead segment ranges, freed by a transaction not yet durable.
    frees_pending: Vec<(u32, u64, u64)>,
    /// An empty vector with room, for `frees_pending` to go on in (`recycle_frees`).
    frees_spare: Vec<(u32, u64, u64)>,
    /// A commit failed: operations acknowledged since the last flush are lost; the next flush
    /// reports it (whether it was for lack of space, and the cause).
    lost: Option<(bool, String)>,
    /// How many transactions were lost after their operations were acknowledged
    /// (`ObjectStore::lost_transactions`, read by the clients' threads), and whether the last
    /// loss was for lack of space.
    losses: Arc<AtomicU64>,
    last_loss_no_space: bool,
    /// Some node is a snapshot's preserved state (a clone), so segment ranges may be shared
    /// between nodes. Until then a range cut from an extent is dead for sure and `note_dead`
    /// skips its query (a fifth of a small write's CPU). Set, never cleared while open.
    clones_may_exist: bool,
    /// Opened read-only (local.rs): changes are refused, reads see committed states.
    read_only: Option<ReadOnlyState>,
    /// Space ran out since the last flush (see the flush request).
    space_short: bool,
    /// The extents table has the `inline` column (always, once a read-write open ran).
    inline_column: bool,
    /// A log sync failed (whether for lack of space, and what the flushes say): for the rest
    /// of this open every flush fails, and no dead space is given back. Linux marks the pages
    /// a failed writeback dropped as clean and does not report the error to a later sync of
    /// another descriptor, so a later sync that succeeds does not make the failed commit's
    /// log frames durable; after a power cut the store may come back at a state before them,
    /// which the ranges freed since still hold. The next open reclaims what was left.
    log_unsynced: Option<(bool, String)>,
    /// Dead ranges were dropped unpunched (their widening's lookups or their punch failed):
    /// the stop then leaves the store unclean, so that the next open's reclaim finds them.
    /// Marked clean, the open skipped that search and their space was never given back.
    frees_dropped: bool,
    /// The heads of objects written or read lately, as in the open transaction (read-write
    /// engines only): a write looks its object up here instead of in SQLite. Cleared whenever
    /// SQLite's state goes back (a rolled back operation or transaction).
    heads: std::cell::RefCell<HashMap<String, Node>>,
    /// Heads changed in the open transaction whose `nodes` row is not updated yet, by node id:
    /// stored once per commit (`store_dirty_heads`) rather than by one `UPDATE` per write, a
    /// fifth of a small write's statements. Every reader of the writer's heads goes through
    /// `heads`, which keeps these whatever else it drops; the rows are brought up to date
    /// before the commit and before a SAVEPOINT (whose rollback forgets the cached heads).
    dirty_heads: std::cell::RefCell<HashMap<i64, Node>>,
    /// Replies of the requests handled in the current burst (`answer`).
    answers: Vec<Box<dyn FnOnce() + Send>>,
    /// The last object version handed out and the value stored in `meta` (written once per
    /// commit, not per operation). Versions only grow: one handed to an operation that is
    /// then rolled back is simply skipped.
    version: u64,
    version_stored: u64,
    /// Omap changes not yet in the `omap` table (omap_overlay.rs): a read-write engine's own,
    /// and those a read-only engine replayed from `omap_pending`.
    omap: std::cell::RefCell<OmapOverlay>,
    /// A read-only engine: the write-back generation (`meta` row `omap_generation`, counted
    /// up by every write-back of all changes) and the last `omap_pending` row `omap` holds,
    /// and whether the store has that table (stores made before it have none).
    omap_rows_seen: Option<(i64, i64)>,
    omap_pending_table: bool,
    /// The open transaction counted `omap_generation` up already.
    omap_generation_counted: bool,
    /// `OMAP_HELD_MAX`, unless overridden (`omap_held_max`).
    omap_held_max: usize,
    /// Changed `extents` rows not yet in the table (held_extents.rs), as `omap`.
    extents: std::cell::RefCell<HeldExtents>,
    /// Extent changes go straight to SQLite: inside a SAVEPOINT (`in_operation` of a step
    /// that works on whole nodes), whose rollback would not undo changes held in memory.
    /// Everything held is written back before.
    extents_direct: bool,
    /// The id the next node made gets (`new_node_id`). Never one a node had before in this
    /// run, nor one a pending row names: SQLite's own choice (the highest rowid + 1) gave a
    /// removed node's id to the next node made, and a pending row that still held that
    /// node's extent removals then removed the newcomer's extents when it was replayed (a
    /// snapshot's clone, copied in SQL, lost its extents after a crash).
    next_node_id: std::cell::Cell<i64>,
    /// The highest snapshot id handed out in this run. The stored counter goes back with a
    /// lost transaction, and an id handed out twice named two snapshots: a writer still
    /// carrying the first in its context made clones for it, which the second then read as
    /// its own (older data), as node ids were (`next_node_id`).
    snap_ids_issued: std::cell::Cell<u64>,
    /// A read-only engine: the last `extents_pending` row replayed, and whether the store
    /// has that table.
    extent_rows_seen: i64,
    extents_pending_table: bool,
    /// Metadata compaction (`compact_step`): whether one is due (something changed since
    /// the last), when the last write came, and whether commits write back a piece of the
    /// held changes whatever their size (set while compacting).
    compaction: Compaction,
    /// SQLite's automatic checkpoints are off because the file system is short of what one
    /// needs (`hold_checkpoints_while_short`): the setting to restore.
    autocheckpoint_held: Option<i64>,
    /// The open transaction holds a write-back alone (`write_back_in_own_commit`): its
    /// failed commit loses no operation.
    writing_back_alone: bool,
    /// The last `checkpoint_debt` measured at a commit, and when (`commit_checkpoint_debt`).
    debt_seen: (u64, Instant),
    /// Where the appends end and the store's version, as the last successful commit stored
    /// them in `meta` (`None`: not known, written at the next commit). A commit that changes
    /// neither writes no page of `meta`: on a full disk, where the log cannot be
    /// checkpointed, every page a commit writes stays in the log.
    append_stored: Option<(u32, u64, u64)>,
}

struct Compaction {
    due: bool,
    last_write: Instant,
    idle: Duration,
    draining: bool,
}

impl Compaction {
    fn new(due: bool) -> Compaction {
        Compaction {
            due,
            last_write: Instant::now(),
            idle: compact_idle(),
            draining: false,
        }
    }
}

/// A failed read of a read-only engine; `transient` if SQLite only could not start the read
/// transaction for now.
struct Failure {
    error: StoreError,
    transient: bool,
}

/// SQLite refusing to start a read transaction for now: busy, or a read-only connection that
/// cannot use the shared-memory index until a writer has rebuilt it.
fn transient(e: &rusqlite::Error) -> bool {
    const SQLITE_READONLY_RECOVERY: i32 = 8 | (1 << 8);
    const SQLITE_READONLY_CANTINIT: i32 = 8 | (5 << 8);
    match e {
        rusqlite::Error::SqliteFailure(code, _) => {
            matches!(
                code.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ) || matches!(
                code.extended_code,
                SQLITE_READONLY_RECOVERY | SQLITE_READONLY_CANTINIT
            )
        }
        _ => false,
    }
}

/// Milliseconds since the epoch for lock expiry: the wall clock read once per process, then
/// advanced by the monotonic clock. A wall clock stepped forward (NTP after boot, a restored
/// VM) made the writer's own lock look expired at its next renewal, which then failed with
/// `NotLocked` and every write after it with "lock lost" until a reopen; stepped back, it
/// stretched every lock. Expiries stored in the database stay comparable across processes:
/// each anchors on the same wall clock.
fn now_ms() -> i64 {
    static ANCHOR: std::sync::OnceLock<(i64, Instant)> = std::sync::OnceLock::new();
    let (wall, at) = *ANCHOR.get_or_init(|| (wall_ms(), Instant::now()));
    wall.saturating_add(at.elapsed().as_millis() as i64)
}

/// The wall clock in milliseconds since the epoch (0 before it).
fn wall_ms() -> i64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH);
    let ms = now.map(|d| d.as_millis() as i64).unwrap_or(0);
    #[cfg(test)]
    let ms = ms + WALL_CLOCK_STEP_MS.load(std::sync::atomic::Ordering::Relaxed);
    ms
}

/// Tests step the wall clock by this much.
#[cfg(test)]
static WALL_CLOCK_STEP_MS: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Every error `op` would meet on an object whose head is `head`, found before anything
/// changes: the same errors, for the same first failing step, as applying it step by step.
/// (A version only changes at the end of an operation, so `AssertVersion` compares with the
/// version at its start, or 0 for an object the operation created.)
fn check_write(object: &ObjectName, op: &WriteOp, head: Option<&Node>) -> Result<(), StoreError> {
    if let Some(context) = op.snap_context.as_ref().filter(|c| !c.is_valid()) {
        return Err(StoreError::InvalidOperation {
            object: object.to_string(),
            reason: format!(
                "snapshot context {context:?} is not valid: its snapshots must be newest first \
                 and none newer than its seq"
            ),
        });
    }
    let mut version = head.map(|h| h.version);
    for step in &op.steps {
        match step {
            WriteStep::CreateExclusive => {
                if version.is_some() {
                    return Err(StoreError::Exists {
                        object: object.to_string(),
                    });
                }
                version = Some(0);
            }
            WriteStep::AssertExists => {
                version.ok_or_else(|| not_found(object))?;
            }
            WriteStep::AssertVersion(expected) => {
                let actual = version.ok_or_else(|| not_found(object))?;
                if actual != *expected {
                    return Err(StoreError::VersionMismatch {
                        object: object.to_string(),
                        expected: *expected,
                        actual,
                    });
                }
            }
            WriteStep::Write { offset, data } => {
                check_range(object, *offset, data.len() as u64)?;
                version.get_or_insert(0);
            }
            WriteStep::WriteFull(data) => {
                check_range(object, 0, data.len() as u64)?;
                version.get_or_insert(0);
            }
            WriteStep::Zero { offset, len } => {
                check_range(object, *offset, *len)?;
                version.ok_or_else(|| not_found(object))?;
            }
            WriteStep::Truncate(size) => {
                check_range(object, *size, 0)?;
                version.get_or_insert(0);
            }
            WriteStep::Remove => {
                version.take().ok_or_else(|| not_found(object))?;
            }
            WriteStep::OmapSet(_) => {
                version.get_or_insert(0);
            }
            WriteStep::OmapRemoveKeys(_)
            | WriteStep::OmapRemoveRange { .. }
            | WriteStep::OmapClear => {
                version.ok_or_else(|| not_found(object))?;
            }
            // Depends on the snapshot's state: applied in a SAVEPOINT instead.
            WriteStep::Rollback(_) => {}
        }
    }
    Ok(())
}

fn not_found(object: &ObjectName) -> StoreError {
    StoreError::NotFound {
        object: object.to_string(),
    }
}

impl Engine {
    pub(crate) fn new(
        db: Connection,
        segments: Box<dyn Segments>,
        durability: Arc<dyn Durability>,
    ) -> Result<Self, StoreError> {
        Self::init_schema(&db)?;
        let clones_may_exist = db.query_row(
            "SELECT EXISTS (SELECT 1 FROM nodes WHERE clone_to IS NOT NULL)",
            [],
            |r| r.get::<_, bool>(0),
        )?;
        let version = Self::stored_meta(&db, "version")?;
        let orphaned_locks = db
            .prepare("SELECT name, lock, client, cookie FROM locks WHERE expires_ms IS NOT NULL")?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?
            .collect::<Result<_, _>>()?;
        Ok(Engine {
            orphaned_locks,
            version,
            version_stored: version,
            clones_may_exist,
            db,
            segments,
            piece_reads: Default::default(),
            read_missed: Default::default(),
            durability,
            wal_sync: None,
            durable_points: VecDeque::new(),
            in_txn: false,
            txn_mark: SegmentMark::default(),
            txn_frees: 0,
            txn_ops: 0,
            txn_started: Instant::now(),
            last_durable: Instant::now(),
            frees_pending: Vec::new(),
            frees_spare: Vec::new(),
            lost: None,
            losses: Arc::default(),
            last_loss_no_space: false,
            read_only: None,
            answers: Vec::new(),
            space_short: false,
            heads: Default::default(),
            dirty_heads: Default::default(),
            inline_column: true,
            log_unsynced: None,
            frees_dropped: false,
            omap: Default::default(),
            omap_rows_seen: None,
            omap_pending_table: true,
            omap_held_max: omap_held_max(),
            omap_generation_counted: false,
            extents: Default::default(),
            extents_direct: false,
            extent_rows_seen: 0,
            extents_pending_table: true,
            next_node_id: Default::default(),
            snap_ids_issued: Default::default(),
            // Due at the open too: a store stopped by a crash, or by a build without
            // compaction, may hold a large log and free pages.
            compaction: Compaction::new(true),
            autocheckpoint_held: None,
            writing_back_alone: false,
            debt_seen: (0, Instant::now()),
            append_stored: None,
        })
        .and_then(|mut engine| {
            engine.replay_omap_pending()?;
            engine.replay_extents_pending()?;
            // Above every node SQLite has and every node the pending rows name.
            let highest: i64 =
                engine
                    .db
                    .query_row("SELECT coalesce(max(id), 0) FROM nodes", [], |r| r.get(0))?;
            let named = [
                engine.omap.get_mut().last_node(),
                engine.extents.get_mut().last_node(),
            ];
            let highest = named.into_iter().flatten().fold(highest, i64::max);
            engine.next_node_id.set(highest + 1);
            // After the ids: the pending rows still name those nodes.
            engine.forget_removed_nodes()?;
            Ok(engine)
        })
    }

    /// An engine that only reads, through connections from `source` (committed states only),
    /// and refuses every change with [`StoreError::ReadOnly`].
    pub(crate) fn new_read_only(
        mut source: Box<dyn MetaSource>,
        segments: Box<dyn Segments>,
    ) -> Result<Self, StoreError> {
        let db = source.connect()?;
        let mut engine = Engine {
            orphaned_locks: HashSet::new(),
            version: 0,
            version_stored: 0,
            clones_may_exist: false,
            db,
            segments,
            piece_reads: Default::default(),
            read_missed: Default::default(),
            durability: Arc::new(NoDurability),
            wal_sync: None,
            durable_points: VecDeque::new(),
            in_txn: false,
            txn_mark: SegmentMark::default(),
            txn_frees: 0,
            txn_ops: 0,
            txn_started: Instant::now(),
            last_durable: Instant::now(),
            frees_pending: Vec::new(),
            frees_spare: Vec::new(),
            lost: None,
            losses: Arc::default(),
            last_loss_no_space: false,
            answers: Vec::new(),
            space_short: false,
            heads: Default::default(),
            dirty_heads: Default::default(),
            inline_column: true,
            log_unsynced: None,
            frees_dropped: false,
            read_only: Some(ReadOnlyState {
                source,
                connected: true,
            }),
            omap: Default::default(),
            omap_rows_seen: None,
            omap_pending_table: false,
            omap_held_max: omap_held_max(),
            omap_generation_counted: false,
            extents: Default::default(),
            extents_direct: false,
            extent_rows_seen: 0,
            extents_pending_table: false,
            next_node_id: Default::default(),
            snap_ids_issued: Default::default(),
            compaction: Compaction::new(false),
            autocheckpoint_held: None,
            writing_back_alone: false,
            debt_seen: (0, Instant::now()),
            append_stored: None,
        };
        // Fail now on what is no store (or not readable), not at the first read. A database
        // without the schema, or without its version yet, is a store another process is
        // creating: no store (yet), not a damaged one.
        let version = engine.consistent(|e| {
            if !Self::has_table(&e.db, "meta")? {
                return Ok((None, Vec::new()));
            }
            let version =
                e.db.query_row("SELECT value FROM meta WHERE key = 'version'", [], |r| {
                    r.get::<_, i64>(0)
                })
                .optional()?;
            Ok((version, Vec::new()))
        })?;
        if version.is_none() {
            return Err(StoreError::Io {
                context: "the metadata database holds no store (yet)".into(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        engine.inline_column = Self::has_inline_column(&engine.db)?;
        engine.omap_pending_table = Self::has_table(&engine.db, "omap_pending")?;
        engine.extents_pending_table = Self::has_table(&engine.db, "extents_pending")?;
        Ok(engine)
    }

    /// A read-only engine opened on a store of an older version, without the pending tables:
    /// a current writer opening it meanwhile creates them and keeps its changes in them from
    /// then on. Looked for at each read transaction while missing (only such stores pay the
    /// query), and every row replayed once they are there. Set once at the open, the reader
    /// read extents and omap from the tables alone for as long as it ran: zeros for objects
    /// the writer created, and old places (punched or reused since) for those it overwrote.
    fn notice_pending_tables(&mut self) -> Result<(), StoreError> {
        if self.read_only.is_none() || (self.omap_pending_table && self.extents_pending_table) {
            return Ok(());
        }
        let tables = (
            Self::has_table(&self.db, "omap_pending")?,
            Self::has_table(&self.db, "extents_pending")?,
        );
        if tables != (self.omap_pending_table, self.extents_pending_table) {
            (self.omap_pending_table, self.extents_pending_table) = tables;
            self.omap_rows_seen = None;
            self.replay_extents_pending()?;
        }
        Ok(())
    }

    /// Whether the store has the table `name` (a read-only open of a store last written by
    /// an older version may lack `omap_pending` or `extents_pending`; it then has no pending
    /// changes either).
    fn has_table(db: &Connection, name: &str) -> Result<bool, StoreError> {
        Ok(db.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            [name],
            |r| r.get::<_, bool>(0),
        )?)
    }

    /// Hold the extent changes of every `extents_pending` row again, oldest first: at an open
    /// (a writer's finds rows only after a clean stop on a nearly full file system; after
    /// any other stop it wrote them back, `write_back_pending_extents`), after a lost
    /// transaction, whose changes the rollback took out of the table, and in read-only engines.
    fn replay_extents_pending(&mut self) -> Result<(), StoreError> {
        let extents = self.extents.get_mut();
        extents.clear();
        if !self.extents_pending_table {
            return Ok(());
        }
        let last = each_pending_row(&self.db, "extents_pending", 0, |seq, row| {
            extents.replay(seq, row)
        })?;
        extents.index_places();
        let used = rows_stored(&self.db, "extents_pending")?.max(last);
        extents.next_row(used as u64 + 1);
        // Rows up to `used` that are gone were written back: SQLite has their changes.
        self.extent_rows_seen = used;
        Ok(())
    }

    /// At a writer's open, before anything reads `extents` (the segments' recovery, its
    /// reclaim): apply every `extents_pending` row to the table, oldest first, and delete
    /// them. Read-only engines beside start over (the write-back generation).
    pub(crate) fn write_back_pending_extents(db: &Connection) -> Result<(), StoreError> {
        let pending: i64 =
            db.query_row("SELECT count(*) FROM extents_pending", [], |r| r.get(0))?;
        if pending == 0 {
            return Ok(());
        }
        let started = Instant::now();
        let mut held = HeldExtents::default();
        each_pending_row(db, "extents_pending", 0, |seq, row| held.replay(seq, row))?;
        let changes = held.take_all();
        let tx = db.unchecked_transaction()?;
        Self::store_extents_in(db, &changes)?;
        db.execute_batch(
            "DELETE FROM extents_pending;
             INSERT OR REPLACE INTO meta (key, value) VALUES ('omap_generation',
                 coalesce((SELECT value FROM meta WHERE key = 'omap_generation'), 0) + 1);",
        )?;
        tx.commit()?;
        tracing::info!(
            rows = pending,
            changes = changes.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "extent changes of the last run written back"
        );
        Ok(())
    }

    /// Write extent changes to the `extents` table (in the open transaction).
    fn store_extents_in(db: &Connection, changes: &[ExtentWriteBack]) -> Result<(), StoreError> {
        let mut set = db.prepare_cached(
            "INSERT OR REPLACE INTO extents (node, lo, hi, seg, seg_off, blob, blob_end, inline)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?;
        let mut remove = db.prepare_cached("DELETE FROM extents WHERE node = ?1 AND lo = ?2")?;
        for (node, lo, extent) in changes {
            match extent {
                Some((hi, Stored::Segment(piece))) => set.execute(params![
                    node,
                    *lo as i64,
                    *hi as i64,
                    piece.seg,
                    piece.seg_off as i64,
                    piece.blob as i64,
                    piece.blob_end as i64,
                    None::<Vec<u8>>
                ])?,
                Some((hi, Stored::Inline(data))) => set.execute(params![
                    node, *lo as i64, *hi as i64, INLINE_SEG, 0i64, 0i64, 0i64, data
                ])?,
                None => remove.execute(params![node, *lo as i64])?,
            };
        }
        Ok(())
    }

    /// Count the write-back generation up, once per transaction: read-only engines beside
    /// this one then replay the pending rows left (see `follow_omap_pending`).
    fn count_write_back_generation(&mut self) -> Result<(), StoreError> {
        if !self.omap_generation_counted {
            self.db.execute_batch(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('omap_generation',
                     coalesce((SELECT value FROM meta WHERE key = 'omap_generation'), 0) + 1);",
            )?;
            self.omap_generation_counted = true;
        }
        Ok(())
    }

    /// Write every held extent change to the `extents` table and delete the pending rows,
    /// in the open transaction: before a SAVEPOINT in which extents change in SQL
    /// (`extents_direct`), and at a clean stop.
    fn write_back_extents(&mut self) -> Result<(), StoreError> {
        self.begin()?;
        self.count_write_back_generation()?;
        if !self.extents.get_mut().pending() {
            return Ok(());
        }
        let started = Instant::now();
        let held = self.extents.get_mut().take_all();
        self.db.execute_batch("DELETE FROM extents_pending")?;
        self.store_extents(&held, started, "every held extent change written back")
    }

    fn store_extents(
        &self,
        changes: &[ExtentWriteBack],
        started: Instant,
        what: &str,
    ) -> Result<(), StoreError> {
        Self::store_extents_in(&self.db, changes)?;
        log_written_back(changes.len(), started, what);
        Ok(())
    }

    /// How many of an overlay's `held` changes (count, bytes) the next piece writes back, if
    /// any: enough to come back under `omap_held_max`, or, while a compaction drains the
    /// overlays, the next `COMPACT_WRITE_BACK_PIECE` of whatever is held.
    fn write_back_limit(&self, held: (usize, usize)) -> Option<usize> {
        match self.compaction.draining {
            true => (held.0 > 0).then_some(COMPACT_WRITE_BACK_PIECE),
            false => piece_limit(held, self.omap_held_max),
        }
    }

    /// As `write_back_omap_piece`, for held extent changes.
    fn write_back_extents_piece(&mut self) -> Result<(), StoreError> {
        let started = Instant::now();
        let held = self.extents.get_mut().held();
        let Some(limit) = self.write_back_limit(held) else {
            return Ok(());
        };
        let piece = self.extents.get_mut().take_piece(limit);
        self.store_extents(
            &piece,
            started,
            "a piece of the extent changes written back",
        )
    }

    /// At a commit, past `pending_max` bytes of `extents_pending` rows: write back what the
    /// oldest rows still hold (see `OmapOverlay::take_oldest`).
    fn write_back_oldest_extents(&mut self) -> Result<(), StoreError> {
        let started = Instant::now();
        let extents = self.extents.get_mut();
        let oldest = extents.take_oldest(pending_max(extents.held().1, self.omap_held_max));
        if oldest.is_empty() {
            return Ok(());
        }
        self.store_extents(
            &oldest,
            started,
            "the oldest pending rows' extent changes written back",
        )
    }

    /// Hold the omap changes of every `omap_pending` row again, oldest first (at an open, and
    /// after a lost transaction, whose changes the rollback took out of the table).
    fn replay_omap_pending(&mut self) -> Result<(), StoreError> {
        let omap = self.omap.get_mut();
        omap.clear();
        let last = each_pending_row(&self.db, "omap_pending", 0, |seq, row| {
            omap.replay(seq, row)
        })?;
        // Row numbers are never used twice (AUTOINCREMENT keeps the highest ever used), so
        // that a read-only engine following the table tells new rows from old ones.
        let used = rows_stored(&self.db, "omap_pending")?.max(last);
        omap.next_row(used as u64 + 1);
        let generation = Self::omap_generation(&self.db)?;
        // Rows up to `used` that are gone were written back: SQLite has their changes.
        self.omap_rows_seen = Some((generation, used));
        Ok(())
    }

    /// Drop the replayed omap changes of nodes that are gone: an object's removal drops its
    /// node's held changes without writing them back (see omap_overlay.rs), and pending
    /// rows older than it replay them. Written back, they would stay in `omap` for ever
    /// under an id no node has (never seen: ids are never given twice).
    fn forget_removed_nodes(&mut self) -> Result<(), StoreError> {
        let nodes = self.omap.get_mut().held_nodes();
        let (Some(&first), Some(&last)) = (nodes.first(), nodes.last()) else {
            return Ok(());
        };
        // One pass over the ids in that range, merged with the held nodes (both ascending):
        // a lookup per node took a descent each, and a crashed store may hold changes of
        // tens of thousands of nodes.
        let mut stmt = self
            .db
            .prepare_cached("SELECT id FROM nodes WHERE id BETWEEN ?1 AND ?2 ORDER BY id")?;
        let mut existing = stmt.query_map([first, last], |r| r.get::<_, i64>(0))?;
        let mut next = existing.next().transpose()?;
        let mut gone = Vec::new();
        for node in nodes {
            while next.is_some_and(|id| id < node) {
                next = existing.next().transpose()?;
            }
            if next != Some(node) {
                gone.push(node);
            }
        }
        drop(existing);
        drop(stmt);
        let omap = self.omap.get_mut();
        for node in gone {
            omap.drop_node(node);
        }
        Ok(())
    }

    fn omap_generation(db: &Connection) -> Result<i64, StoreError> {
        // Cached: a read-only engine asks at every read transaction.
        Ok(db
            .prepare_cached("SELECT value FROM meta WHERE key = 'omap_generation'")?
            .query_row([], |r| r.get(0))
            .optional()?
            .unwrap_or(0))
    }

    /// A read-only engine, at the start of each read transaction: catch up with the rows a
    /// writer added to `omap_pending` and `extents_pending`, or replay them all again if it
    /// wrote every change back since (a later step may have removed in SQL what older rows
    /// set), or deleted a row this engine never saw. Rows the writer deleted one by one were
    /// written back or changed again by later rows; what this engine still holds of them
    /// agrees with SQLite only if it saw those later rows: a row written back and deleted
    /// unseen leaves it holding the older change (a value set again, an extent's old place,
    /// which may be punched or reused by then). Rows are deleted oldest first and numbered
    /// one after the other, so an unseen deletion shows as the next row missing.
    fn follow_omap_pending(&mut self) -> Result<(), StoreError> {
        if !self.omap_pending_table {
            return Ok(());
        }
        let generation = Self::omap_generation(&self.db)?;
        let missed = match self.omap_rows_seen {
            Some((_, last)) => {
                rows_missed(&self.db, "omap_pending", last)?
                    || (self.extents_pending_table
                        && rows_missed(&self.db, "extents_pending", self.extent_rows_seen)?)
            }
            None => true,
        };
        // What this engine tracks of the rows it followed stays bounded: rows none of whose
        // changes it holds any more are dropped (the transaction row is moved past the newest
        // seen, as a writer's is past its own), and past `FOLLOWED_ROWS_MAX` rows held up
        // behind a change of a row the writer has deleted since (written back: SQLite has
        // it, and nothing the follower sees releases it) it starts over. It once grew by a
        // row per writer commit for as long as it ran.
        let behind = |db: &Connection, rows: usize, first: Option<u64>, table: &str| {
            if rows <= FOLLOWED_ROWS_MAX {
                return Ok::<_, StoreError>(false);
            }
            let oldest: Option<i64> = db
                .prepare_cached(&format!("SELECT min(seq) FROM {table}"))?
                .query_row([], |r| r.get(0))?;
            Ok(first.is_some_and(|first| oldest.is_none_or(|oldest| (first as i64) < oldest)))
        };
        let omap = self.omap.get_mut();
        let behind = behind(&self.db, omap.rows_len(), omap.first_row(), "omap_pending")?
            || (self.extents_pending_table && {
                let extents = self.extents.get_mut();
                let (rows, first) = (extents.rows_len(), extents.first_row());
                behind(&self.db, rows, first, "extents_pending")?
            });
        match self.omap_rows_seen {
            Some((seen_generation, last))
                if !missed
                    && seen_generation == generation
                    && self.omap.get_mut().held().1 <= 2 * self.omap_held_max
                    && self.extents.get_mut().held().1 <= 2 * self.omap_held_max
                    && !behind =>
            {
                let omap = self.omap.get_mut();
                let newest = each_pending_row(&self.db, "omap_pending", last, |seq, row| {
                    omap.replay(seq, row)
                })?;
                omap.next_row(newest as u64 + 1);
                omap.take_emptied();
                self.omap_rows_seen = Some((generation, newest));
                if self.extents_pending_table {
                    let extents = self.extents.get_mut();
                    let seen = self.extent_rows_seen;
                    self.extent_rows_seen =
                        each_pending_row(&self.db, "extents_pending", seen, |seq, row| {
                            extents.replay(seq, row)
                        })?;
                    extents.next_row(self.extent_rows_seen as u64 + 1);
                    extents.take_emptied();
                    if self.extent_rows_seen != seen {
                        extents.index_places();
                    }
                }
                Ok(())
            }
            _ => {
                self.replay_omap_pending()?;
                self.omap.get_mut().take_emptied();
                self.replay_extents_pending()?;
                self.extents.get_mut().take_emptied();
                Ok(())
            }
        }
    }

    /// Write every held omap change to the `omap` table, in key order, and delete the pending
    /// rows, in the open transaction. Done before any step that reads or changes a node's
    /// omap in SQL as a whole (see omap_overlay.rs), before a SAVEPOINT (whose rollback would
    /// undo the write-back but not bring the changes back), and at a clean stop.
    fn write_back_omap(&mut self) -> Result<(), StoreError> {
        self.begin()?;
        // Read-only engines beside this one start over from the rows left (see
        // `follow_omap_pending`): once per transaction is enough, as they see whole ones.
        self.count_write_back_generation()?;
        if self.omap.get_mut().is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let held = self.omap.get_mut().take_all();
        let count = held.len();
        self.store_omap(&held)?;
        self.db.execute_batch("DELETE FROM omap_pending")?;
        log_written_back(count, started, "every held omap change written back");
        Ok(())
    }

    /// Write changes taken from the overlay to the `omap` table (in the open transaction).
    fn store_omap(&self, changes: &[WriteBack]) -> Result<(), StoreError> {
        let mut set = self
            .db
            .prepare_cached("INSERT OR REPLACE INTO omap (node, key, value) VALUES (?1, ?2, ?3)")?;
        let mut remove = self
            .db
            .prepare_cached("DELETE FROM omap WHERE node = ?1 AND key = ?2")?;
        for ((node, key), value) in changes {
            match value {
                Some(value) => set.execute(params![node, key.as_bytes(), value])?,
                None => remove.execute(params![node, key.as_bytes()])?,
            };
        }
        Ok(())
    }

    /// At a commit, past `omap_held_max`: write back the next piece of held changes in key
    /// order, enough to hold three quarters of it after, and delete the rows this leaves
    /// unneeded. A piece per commit keeps each commit short, where writing every change back
    /// at once held the worker for 1.7-1.8 s (about 200,000 changes).
    fn write_back_omap_piece(&mut self) -> Result<(), StoreError> {
        let held = self.omap.get_mut().held();
        let Some(limit) = self.write_back_limit(held) else {
            return Ok(());
        };
        let started = Instant::now();
        let piece = self.omap.get_mut().take_piece(limit);
        self.store_omap(&piece)?;
        log_written_back(
            piece.len(),
            started,
            "a piece of the omap changes written back",
        );
        Ok(())
    }

    /// At a commit, past `pending_max` bytes of `omap_pending` rows: write back what the
    /// oldest rows still hold (see `OmapOverlay::take_oldest`).
    fn write_back_oldest_omap(&mut self) -> Result<(), StoreError> {
        let started = Instant::now();
        let omap = self.omap.get_mut();
        let oldest = omap.take_oldest(pending_max(omap.held().1, self.omap_held_max));
        if oldest.is_empty() {
            return Ok(());
        }
        self.store_omap(&oldest)?;
        log_written_back(
            oldest.len(),
            started,
            "the oldest pending rows' omap changes written back",
        );
        Ok(())
    }

    /// Create the tables of a new store (a no-op on an existing one).
    pub(crate) fn init_schema(db: &Connection) -> Result<(), StoreError> {
        db.execute_batch(SCHEMA)?;
        // Stores made before inline extents existed gain the column.
        if !Self::has_inline_column(db)? {
            db.execute_batch("ALTER TABLE extents ADD COLUMN inline BLOB")?;
        }
        db.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('version', 0), ('snap_seq', 0)",
            [],
        )?;
        Ok(())
    }

    /// Whether the extents table has the `inline` column (a read-only open of a store last
    /// written by an older version may lack it; it then has no inline extents either).
    fn has_inline_column(db: &Connection) -> Result<bool, StoreError> {
        Ok(db.query_row(
            "SELECT COUNT(*) FROM pragma_table_info('extents') WHERE name = 'inline'",
            [],
            |r| r.get::<_, i64>(0),
        )? > 0)
    }

    /// Where the appends of the last commit ended in `segment`, the active one (recovery
    /// truncates the rest): stored by each commit (`append_segment`, `append_offset`) with
    /// the version it committed (`append_version`). A store last written by a build that did
    /// not store it (the version moved on without it) is asked `referenced_end` instead, which
    /// without an index of every extent by place reads all of them.
    pub(crate) fn committed_end(db: &Connection, segment: u32) -> Result<u64, StoreError> {
        match Self::stored_append_end(db)? {
            Some((s, offset)) if s == i64::from(segment) => Ok(offset as u64),
            _ => Self::referenced_end(db, segment),
        }
    }

    /// The segment and offset where the last commit's appends ended, if that commit stored
    /// them (`committed_end`).
    pub(crate) fn stored_append_end(db: &Connection) -> Result<Option<(i64, i64)>, StoreError> {
        Ok(db
            .query_row(
                "SELECT (SELECT value FROM meta WHERE key = 'append_segment'),
                        (SELECT value FROM meta WHERE key = 'append_offset')
                 WHERE (SELECT value FROM meta WHERE key = 'append_version')
                     = (SELECT value FROM meta WHERE key = 'version')",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// The largest segment offset referenced in `segment`: a read of every extent (no index
    /// finds extents of whole blocks by place), for stores whose last commit did not store
    /// where its appends ended (`committed_end`).
    fn referenced_end(db: &Connection, segment: u32) -> Result<u64, StoreError> {
        let end: i64 = db.query_row(
            "SELECT IFNULL(MAX(seg_off + hi - lo), 0) FROM extents WHERE seg = ?1",
            [segment],
            |r| r.get(0),
        )?;
        Ok(end as u64)
    }

    /// Run the worker loop until every sender is gone, then commit durably.
    pub(crate) fn run(mut self, requests: mpsc::Receiver<Request>) {
        let mut tick_due: Option<Instant> = None;
        let (commit_interval, durable_interval) = commit_intervals();
        loop {
            let mut wait = match self.in_txn {
                true => commit_interval.saturating_sub(self.txn_started.elapsed()),
                false => durable_interval,
            };
            if let Some(due) = tick_due {
                wait = wait.min(due.saturating_duration_since(Instant::now()));
            }
            if !self.durable_points.is_empty() {
                wait = wait.min(SYNC_POLL);
            }
            let request = match requests.recv_timeout(wait) {
                Ok(r) => Some(r),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            if let Some(request) = request {
                // Take what else is queued before replying (see `answer`), a bounded burst so
                // the first reply is not held back long.
                let mut burst = Vec::with_capacity(ANSWER_BURST);
                burst.push(request);
                while burst.len() < ANSWER_BURST {
                    match requests.try_recv() {
                        Ok(request) => burst.push(request),
                        Err(_) => break,
                    }
                }
                self.handle_burst(burst);
            }
            self.finish_durable_points(false);
            self.send_answers();
            if self.in_txn
                && (self.txn_ops >= COMMIT_MAX_OPS
                    || self.segments.unsynced() >= COMMIT_MAX_BYTES
                    || self.txn_started.elapsed() >= commit_interval
                    || self
                        .segments
                        .commit_room()
                        .is_some_and(|room| self.commit_bytes() >= room / 8))
            {
                // Durable when it frees data the segments would reuse: the space comes back
                // only once its death is durable, and under large overwrites waiting for the
                // next durable commit made new data grow the segments meanwhile.
                self.commit(!self.frees_pending.is_empty() && self.segments.reusing());
            }
            if self.last_durable.elapsed() >= durable_interval
                && (self.in_txn || !self.frees_pending.is_empty())
            {
                self.commit(true);
            }
            let after = match (self.segments.tick(), self.compact_step()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            tick_due = after.map(|after| Instant::now() + after);
        }
        // Acknowledged operations first, in a commit of their own: the write-back below may
        // not fit on a full disk, and only it may fail then.
        if self.in_txn {
            self.commit(true);
        }
        // A clean stop leaves no omap or extent change pending: nothing to replay at the
        // next open (and nothing an older build would not know to replay). Unless the file
        // system is nearly full: the write-back took the last blocks of one that the store's
        // data had filled, and the next open, which must commit to take an image's writer
        // lock, found no room at all. The changes then stay in their pending rows, which the
        // next open replays in memory (after a clean stop it does not write them back first:
        // `LocalStore::open_with`).
        let held = self.omap.get_mut().held().1 + self.extents.get_mut().held().1;
        let need = (4 * held as u64 + STOP_WRITE_BACK_MARGIN).max(COMPACT_ROOM_MIN.unwrap_or(0))
            + self.checkpoint_debt();
        let roomy = self.durability.space_left().is_none_or(|left| left >= need);
        if self.read_only.is_none()
            && (self.omap.get_mut().pending() || self.extents.get_mut().pending())
        {
            let written_back = match roomy {
                true => self
                    .write_back_omap()
                    .and_then(|()| self.write_back_extents()),
                false => {
                    tracing::info!(
                        "the store's file system is nearly full: its pending omap and extent \
                         changes stay in their log rows for the next open to replay"
                    );
                    Ok(())
                }
            };
            if let Err(e) = written_back {
                self.lose_transaction(&e);
            }
        }
        self.commit(true);
        self.finish_durable_points(true);
        self.send_answers();
        // A process that removed most objects and stops (`ivdisk delete`) leaves a small
        // database, as an idle one would (SQLite truncates the log as it closes).
        if self.read_only.is_none() && self.lost.is_none() && !self.in_txn {
            if let Err(e) = self.vacuum_if_mostly_free() {
                tracing::warn!("rebuilding the store's metadata without its free pages: {e}");
            }
        }
        if let Some(wal_sync) = self.wal_sync.take() {
            drop(wal_sync.jobs);
            let _ = wal_sync.thread.join();
        }
        // Punches run in the background; a clean stop waits for them, for a while (an unclean
        // one leaves the dead bytes to the reclaim at the next open). On a `discard` mount the
        // backlog of random overwrites takes seconds (4 s after 120k random 4 KiB writes), and
        // a stop, which a service manager or a guest's shutdown waits for, should not.
        let settled = self.segments.settle_within(STOP_PUNCH_BUDGET);
        if !settled {
            tracing::info!(
                "stopping before every dead range was punched; the next open reclaims their space"
            );
        }
        if self.lost.is_none() && self.log_unsynced.is_none() && !self.frees_dropped && settled {
            self.durability.mark_clean();
        }
        // SQLite checkpoints the log as the database closes: not when that cannot complete
        // (`checkpoint_fits`). The log then stays, whole, for the next open.
        if self.read_only.is_none() && !self.checkpoint_fits(self.checkpoint_debt()) {
            tracing::info!(
                "the store's file system is short of the space a checkpoint of its metadata \
                 log needs: the log stays for the next open"
            );
            if let Err(e) = self
                .db
                .set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)
            {
                tracing::warn!("keeping the store's metadata log at the close: {e}");
            }
        }
    }

    /// Queue a reply; `send_answers` sends the queue. Replies go out in bursts because each
    /// send wakes the awaiting task's runtime thread, and a wakeup per operation (a futex call
    /// and, on a VM, an inter-processor interrupt) was a quarter of the worker's time on
    /// 4 KiB writes at queue depth 32 (docs/BENCHMARKS.md, "Local store writes").
    fn answer<T: Send + 'static>(&mut self, reply: Reply<T>, result: Result<T, StoreError>) {
        if let Err(StoreError::NoSpace { .. }) = &result {
            self.space_short = true;
        }
        self.answers.push(Box::new(move || {
            let _ = reply.send(result);
        }));
    }

    /// Operations since the last flush are lost (the next flush says so).
    fn note_lost(&mut self, e: &StoreError) {
        self.note_flush_error(
            e,
            format!(
                "a commit failed, so operations completed since the previous flush were lost: {e}"
            ),
        );
    }

    /// What the next flush reports (whether it was for lack of space, and what happened).
    fn note_flush_error(&mut self, e: &StoreError, what: String) {
        let no_space = matches!(e, StoreError::NoSpace { .. });
        self.space_short |= no_space;
        self.lost = Some((no_space, what));
    }

    /// The open transaction was rolled back after its operations were acknowledged: count it,
    /// so that operations built on what those wrote are refused (`WriteOp::unless_lost_since`).
    fn count_lost_transaction(&mut self, e: &StoreError) {
        self.last_loss_no_space = matches!(e, StoreError::NoSpace { .. });
        self.losses.fetch_add(1, Ordering::Release);
    }

    /// Why `op` must not be applied, if it was built before the last loss of acknowledged
    /// operations: what it was built on may be gone (an image's metadata cache had blocks
    /// that held the lost writes' metadata).
    fn built_before_a_loss(&self, object: &ObjectName, op: &WriteOp) -> Option<StoreError> {
        let seen = op.unless_lost_since?;
        if seen == self.losses.load(Ordering::Acquire) {
            return None;
        }
        let context = format!(
            "object `{object}`: a failed commit lost the operations acknowledged since the \
             commit before, and this write was built on what they wrote; it was not applied: \
             retry it"
        );
        Some(match self.last_loss_no_space {
            true => StoreError::NoSpace { context },
            false => StoreError::Database(context),
        })
    }

    fn send_answers(&mut self) {
        for answer in self.answers.drain(..) {
            answer();
        }
    }

    /// Answer a flush, after the punches queued so far if `reclaim` (see the flush request).
    fn answer_flush(&mut self, reply: Reply<()>, result: Result<(), StoreError>, reclaim: bool) {
        match reclaim {
            true => self.segments.after_punches(Box::new(move || {
                let _ = reply.send(result);
            })),
            false => self.answer(reply, result),
        }
    }

    /// Keep the vector of a durable commit's dead ranges, given back, for the next ranges
    /// (see `widened_frees`).
    fn recycle_frees(&mut self, mut frees: Vec<(u32, u64, u64)>) {
        if frees.capacity() > self.frees_spare.capacity() {
            frees.clear();
            self.frees_spare = frees;
        }
    }

    /// Make what was just committed durable: sync the log on the sync thread; `frees` are
    /// given back and waiting flushes answered once that is done (`finish_durable_points`).
    fn start_wal_sync(&mut self, frees: Vec<(u32, u64, u64)>) {
        self.durable_points.push_back(DurablePoint {
            frees,
            flushes: Vec::new(),
        });
        if self.wal_sync.is_none() && !self.durability.instant() {
            match WalSync::start(self.durability.clone()) {
                Ok(wal_sync) => self.wal_sync = Some(wal_sync),
                Err(e) => {
                    tracing::warn!(error = %e, "could not start the store's sync thread; syncing on the worker")
                }
            }
        }
        if let Some(wal_sync) = &self.wal_sync {
            if wal_sync.jobs.send(()).is_ok() {
                return;
            }
        }
        // No sync thread (or it is gone): synced here, which covers every commit before.
        let failure = sync_failure(self.durability.sync_wal());
        while !self.durable_points.is_empty() {
            self.durable_point_done(failure.clone());
        }
    }

    /// Take the results of finished log syncs (waiting for all of them with `wait`), and
    /// finish their durable commits.
    fn finish_durable_points(&mut self, wait: bool) {
        while !self.durable_points.is_empty() {
            let Some(wal_sync) = &self.wal_sync else {
                return;
            };
            let (covered, failure) = match wait {
                true => match wal_sync.done.recv() {
                    Ok(done) => done,
                    Err(_) => (usize::MAX, Some((false, "the sync thread stopped".into()))),
                },
                false => match wal_sync.done.try_recv() {
                    Ok(done) => done,
                    Err(mpsc::TryRecvError::Empty) => return,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        (usize::MAX, Some((false, "the sync thread stopped".into())))
                    }
                },
            };
            for _ in 0..covered.min(self.durable_points.len()) {
                self.durable_point_done(failure.clone());
            }
        }
    }

    /// The oldest durable commit's log sync finished (`failure` if it failed).
    fn durable_point_done(&mut self, failure: Option<(bool, String)>) {
        let Some(point) = self.durable_points.pop_front() else {
            return;
        };
        if let Some(unsynced) = self.log_unsynced.clone() {
            // The ranges stay, for the next open's reclaim; every flush fails.
            drop(point.frees);
            for (reply, _, reclaim) in point.flushes {
                self.answer_flush(reply, Err(flush_error(unsynced.clone())), reclaim);
            }
            return;
        }
        let Some((no_space, e)) = failure else {
            let mut punch_failure = None;
            for &(segment, from, to) in &point.frees {
                if let Err(e) = self.segments.punch(segment, from, to - from) {
                    self.frees_dropped = true;
                    punch_failure.get_or_insert(e);
                }
            }
            self.recycle_frees(point.frees);
            let punch_failure = punch_failure.map(|e| {
                tracing::error!("giving back dead space failed: {e}");
                let what = format!("giving back dead space failed: {e}");
                if point.flushes.is_empty() {
                    self.note_flush_error(&e, what.clone());
                }
                (matches!(e, StoreError::NoSpace { .. }), what)
            });
            for (reply, result, reclaim) in point.flushes {
                let result = match (result, &punch_failure) {
                    (Ok(()), Some(failure)) => Err(flush_error(failure.clone())),
                    (result, _) => result,
                };
                self.answer_flush(reply, result, reclaim);
            }
            return;
        };
        tracing::error!(
            "store commit failed: syncing the metadata log: {e}; every flush fails until the \
             store is opened again"
        );
        let what = format!(
            "syncing the store's metadata log failed: what was written since it was opened \
             may not survive a power cut, and every flush fails until it is opened again \
             (stop, check the disk, open it again): {e}"
        );
        // Their death is not durable, nor will a later sync make it so: the ranges are left
        // for the next open's reclaim.
        drop(point.frees);
        self.log_unsynced = Some((no_space, what.clone()));
        if point.flushes.is_empty() {
            self.lost = Some((no_space, what));
            return;
        }
        for (reply, _, reclaim) in point.flushes {
            self.answer_flush(reply, Err(flush_error((no_space, what.clone()))), reclaim);
        }
    }

    /// Handle a burst of requests in order, where reads follow one another those together
    /// ([`Engine::handle_reads`]).
    fn handle_burst(&mut self, burst: Vec<Request>) {
        let is_read = |r: &Request| matches!(r, Request::Read { .. });
        let mut requests = burst.into_iter().peekable();
        while let Some(request) = requests.next() {
            if is_read(&request) && requests.peek().is_some_and(is_read) {
                let mut run = vec![request];
                while let Some(read) = requests.next_if(is_read) {
                    run.push(read);
                }
                self.handle_reads(run);
            } else {
                self.handle(request);
            }
        }
    }

    /// Reads that came in one after another, none of them waiting for the disk behind
    /// another: each is first made without waiting (`PieceReads::NoWait`), which answers those
    /// whose bytes are in memory and asks the disk for the pieces of the others, all of
    /// them, before any is read; then the others are read, in order. Without this a burst of
    /// random reads of data not in the page cache (after a restart, or once its pages were
    /// dropped) kept the disk at one read at a time. Reads change nothing, so answering
    /// some before others that came first is the same as in order. A read-only engine does
    /// the same, each pass in one checked query (`reads_consistent`).
    fn handle_reads(&mut self, run: Vec<Request>) {
        let reads = run
            .into_iter()
            .map(|request| match request {
                Request::Read { object, op, reply } => (object, op, reply),
                _ => unreachable!("a run of reads"),
            })
            .collect();
        let waiting = self.answer_reads(reads, PieceReads::NoWait);
        self.answer_reads(waiting, PieceReads::Asked);
    }

    /// Make `reads` (taking their pieces as `mode` says) and answer them, all but those that
    /// missed the page cache, which are given back.
    fn answer_reads(&mut self, reads: Vec<PendingRead>, mode: PieceReads) -> Vec<PendingRead> {
        if reads.is_empty() {
            return reads;
        }
        self.piece_reads.set(mode);
        let outcomes = match self.read_only {
            Some(_) => {
                let pairs: Vec<_> = reads.iter().map(|(object, op, _)| (object, op)).collect();
                self.reads_consistent(&pairs)
            }
            None => Ok(reads
                .iter()
                .map(|(object, op, _)| {
                    self.read_missed.set(false);
                    let result = self.read(object, op);
                    (result, self.read_missed.get())
                })
                .collect()),
        };
        self.piece_reads.set(PieceReads::Usual);
        self.read_missed.set(false);
        let mut missed = Vec::new();
        match outcomes {
            Ok(outcomes) => {
                for ((object, op, reply), (result, miss)) in reads.into_iter().zip(outcomes) {
                    match miss {
                        true => missed.push((object, op, reply)),
                        false => self.answer(reply, result),
                    }
                }
            }
            // The query as a whole failed (no read transaction, or the data kept changing):
            // each read on its own, so that each gets its own answer.
            Err(_) => {
                for (object, op, reply) in reads {
                    let result = self.read_consistent(&object, &op);
                    self.answer(reply, result);
                }
            }
        }
        missed
    }

    /// One read of a read-only engine, checked as `reads_consistent` checks a burst's.
    fn read_consistent(
        &mut self,
        object: &ObjectName,
        op: &ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        self.reads_consistent(&[(object, op)])
            .and_then(|mut outcomes| outcomes.remove(0).0)
    }

    /// Reads of a read-only engine in one query (see `consistent`): the nodes whose segment
    /// data they read are checked unchanged afterwards, all at once. Each read's result
    /// comes with whether it missed the page cache (`PieceReads::NoWait`).
    fn reads_consistent(
        &mut self,
        reads: &[(&ObjectName, &ReadOp)],
    ) -> Result<Vec<ReadOutcome>, StoreError> {
        self.consistent(|e| {
            let mut nodes = Vec::new();
            let outcomes = reads
                .iter()
                .map(|&(object, op)| {
                    e.read_missed.set(false);
                    let result = e.read_with_node(object, op).map(|(results, node)| {
                        if op.steps.iter().any(|s| matches!(s, ReadStep::Read { .. })) {
                            nodes.push(node);
                        }
                        results
                    });
                    (result, e.read_missed.get())
                })
                .collect();
            // Reads of a burst often share objects: each node checked once.
            nodes.sort_unstable();
            nodes.dedup();
            Ok((outcomes, nodes))
        })
    }

    fn handle(&mut self, request: Request) {
        if self.read_only.is_some() {
            return self.handle_read_only(request);
        }
        if matches!(
            request,
            Request::Write { .. } | Request::SnapCreate { .. } | Request::SnapRemove { .. }
        ) {
            self.compaction.due = true;
            self.compaction.last_write = Instant::now();
        }
        match request {
            Request::Write { object, op, reply } => {
                let result = self.apply_write(&object, &op);
                self.answer(reply, result);
            }
            Request::Read { object, op, reply } => {
                let result = self.read(&object, &op);
                self.answer(reply, result);
            }
            Request::List {
                prefix,
                snap,
                reply,
            } => {
                let result = self.list(&prefix, snap);
                self.answer(reply, result);
            }
            Request::SnapCreate { reply } => {
                let result = self.in_operation(false, |e| e.snap_create());
                self.answer(reply, result);
            }
            Request::SnapRemove { snap, reply } => {
                let result = self.in_operation(true, |e| e.snap_remove(snap));
                self.answer(reply, result);
            }
            Request::Lock {
                object,
                client,
                request,
                reply,
            } => {
                let result = self.in_operation(false, |e| e.lock(&object, &client, &request));
                self.answer(reply, result);
            }
            Request::Unlock {
                object,
                lock,
                client,
                cookie,
                reply,
            } => {
                let result =
                    self.in_operation(false, |e| e.unlock(&object, &lock, &client, &cookie));
                self.answer(reply, result);
            }
            Request::ListLockers {
                object,
                lock,
                reply,
            } => {
                let result = self.lockers(&object, &lock);
                self.answer(reply, result);
            }
            Request::Flush { reply, reclaim } => {
                self.send_answers();
                let points = self.durable_points.len();
                self.commit(true);
                let result = match (self.lost.take(), &self.log_unsynced) {
                    (Some(lost), _) => Err(flush_error(lost)),
                    (None, Some(unsynced)) => Err(flush_error(unsynced.clone())),
                    (None, None) => Ok(()),
                };
                // Dead data is punched in the background (on a file system mounted with
                // `discard` each punch waits for the device: seconds for a backlog of small
                // ranges), so a flush does not wait for it, except when space ran out since
                // the last flush, or when asked (`LocalStore::reclaim_space`): then the reply
                // waits for the punches this commit queued, so space is back when flush
                // returns (without holding up other requests).
                let reclaim = std::mem::take(&mut self.space_short) || reclaim;
                match self.durable_points.len() > points {
                    // The reply waits for the log sync the commit started.
                    true => self
                        .durable_points
                        .back_mut()
                        .expect("just queued")
                        .flushes
                        .push((reply, result, reclaim)),
                    // The commit failed before its sync: nothing to wait for.
                    false => self.answer_flush(reply, result, reclaim),
                }
            }
            Request::Release { released, .. } => {
                self.send_answers();
                let _ = released.send(());
            }
        }
    }

    /// A request to a read-only engine: reads in read transactions, changes refused, flush
    /// a no-op (nothing to make durable).
    fn handle_read_only(&mut self, request: Request) {
        fn refuse<T>(what: String) -> Result<T, StoreError> {
            Err(StoreError::ReadOnly { what })
        }
        match request {
            Request::Read { object, op, reply } => {
                let _ = reply.send(self.read_consistent(&object, &op));
            }
            Request::List {
                prefix,
                snap,
                reply,
            } => {
                let _ = reply.send(self.consistent(|e| Ok((e.list(&prefix, snap)?, Vec::new()))));
            }
            Request::ListLockers {
                object,
                lock,
                reply,
            } => {
                let _ =
                    reply.send(self.consistent(|e| Ok((e.lockers(&object, &lock)?, Vec::new()))));
            }
            Request::Flush { reply, .. } => {
                let _ = reply.send(Ok(()));
            }
            Request::Write { object, reply, .. } => {
                let _ = reply.send(refuse(format!("writing object `{object}`")));
            }
            Request::SnapCreate { reply } => {
                let _ = reply.send(refuse("creating a snapshot".into()));
            }
            Request::SnapRemove { snap, reply } => {
                let _ = reply.send(refuse(format!("removing snapshot {snap}")));
            }
            Request::Lock {
                object,
                request,
                reply,
                ..
            } => {
                let _ = reply.send(refuse(format!(
                    "taking lock `{}` on `{object}`",
                    request.name
                )));
            }
            Request::Unlock {
                object,
                lock,
                reply,
                ..
            } => {
                let _ = reply.send(refuse(format!("removing lock `{lock}` on `{object}`")));
            }
            Request::Release { released, resume } => {
                self.disconnect();
                let _ = released.send(());
                // Until the read-write open is done (`resume` dropped); a bound for safety.
                let _ = resume.recv_timeout(Duration::from_secs(60));
            }
        }
    }

    /// Replace a read-only engine's connection by a placeholder (the next read reconnects).
    fn disconnect(&mut self) {
        if let Some(state) = self.read_only.as_mut() {
            if let Ok(placeholder) = Connection::open_in_memory() {
                self.db = placeholder;
                state.connected = false;
            }
        }
    }

    /// Run `query` in a read-only engine so that everything it returns comes from one
    /// committed state: in one read transaction (a writer in another process may commit
    /// meanwhile), read again on a fresh connection when the source says the connection went
    /// stale, and tried again when SQLite cannot start a read transaction for now.
    ///
    /// `query` also returns the nodes (id, version) whose segment data it read. Segment
    /// data is not under the transaction: a writer frees the data of an overwritten range and
    /// punches it out of its segment, or writes new data there, once that commit is durable,
    /// so a read racing with it can find zeros or other data. The node being unchanged in a
    /// later state proves the data read was live throughout (a punch or a reuse only follows a
    /// commit that changed or removed every node using the range); otherwise the query runs
    /// again.
    fn consistent<T>(
        &mut self,
        mut query: impl FnMut(&mut Self) -> Result<(T, Vec<(i64, u64)>), StoreError>,
    ) -> Result<T, StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let outcome = match self.read_transaction(&mut query) {
                Ok((value, nodes)) if nodes.is_empty() => Ok(Some(value)),
                Ok((value, nodes)) => self
                    .read_transaction(&mut |e: &mut Self| {
                        let mut same = true;
                        for &(id, version) in &nodes {
                            same &= e.node_unchanged(id, version)?;
                        }
                        Ok((same, ()))
                    })
                    .map(|(same, ())| same.then_some(value)),
                Err(failure) => Err(failure),
            };
            let stale = self.read_only.as_ref().is_some_and(|s| s.source.stale());
            let (retry, waiting, last) = match outcome {
                Ok(Some(value)) if !stale => return Ok(value),
                Ok(_) => (true, false, None),
                Err(Failure { error, transient }) => (stale || transient, transient, Some(error)),
            };
            if !retry || attempt >= READ_ONLY_ATTEMPTS {
                return Err(last.unwrap_or_else(|| {
                    StoreError::Database(format!(
                        "the data read kept changing under a concurrent writer ({attempt} \
                         attempts); try again"
                    ))
                }));
            }
            if waiting {
                // SQLite cannot start a read transaction for now (a writer is busy with the
                // log index). Now and then on a new connection: one that mapped the index of
                // a writer that died since sees it torn until a writer comes, a new one reads
                // the log itself.
                std::thread::sleep(Duration::from_millis(u64::from(attempt.min(20))));
            }
            if stale || (waiting && attempt % 10 == 0) {
                self.disconnect();
            }
        }
    }

    /// One read transaction of a read-only engine, reconnecting first if needed.
    fn read_transaction<T, U>(
        &mut self,
        body: &mut impl FnMut(&mut Self) -> Result<(T, U), StoreError>,
    ) -> Result<(T, U), Failure> {
        let permanent = |error: StoreError| Failure {
            error,
            transient: false,
        };
        if let Some(state) = self.read_only.as_mut() {
            if !state.connected {
                self.db = state.source.connect().map_err(permanent)?;
                state.connected = true;
                self.inline_column = Self::has_inline_column(&self.db).map_err(permanent)?;
            }
        }
        // Cached statements, as every read makes this transaction: parsing its three
        // statements anew was a fifth of a read-only server's worker (random 4 KiB reads).
        self.db
            .prepare_cached("BEGIN")
            .and_then(|mut begin| begin.execute([]))
            .map_err(|e| permanent(e.into()))?;
        // The read transaction starts at the first read: done here, so that SQLite's refusals
        // to start one for now (busy, a log being recovered) are told from real failures.
        // (The schema, not a table of the store: a database another process is creating may
        // have none yet, which the body is to tell.)
        let started = self
            .db
            .prepare_cached("SELECT count(*) FROM sqlite_master")
            .and_then(|mut count| count.query_row([], |r| r.get::<_, i64>(0)));
        let result = match started {
            Ok(_) => self
                .notice_pending_tables()
                .and_then(|()| self.follow_omap_pending())
                .and_then(|()| body(self))
                .map_err(permanent),
            Err(e) => Err(Failure {
                transient: transient(&e),
                error: e.into(),
            }),
        };
        if !self.db.is_autocommit() {
            let _ = self
                .db
                .prepare_cached("COMMIT")
                .and_then(|mut commit| commit.execute([]));
        }
        result
    }

    /// Whether node `id` still exists at `version`.
    fn node_unchanged(&self, id: i64, version: u64) -> Result<bool, StoreError> {
        Ok(self
            .db
            .prepare_cached("SELECT EXISTS (SELECT 1 FROM nodes WHERE id = ?1 AND version = ?2)")?
            .query_row(params![id, version as i64], |r| r.get::<_, bool>(0))?)
    }

    /// Open the group transaction if none is open.
    fn begin(&mut self) -> Result<(), StoreError> {
        if !self.in_txn {
            self.db.execute_batch("BEGIN IMMEDIATE")?;
            self.in_txn = true;
            self.txn_ops = 0;
            self.txn_started = Instant::now();
            self.txn_mark = self.segments.mark();
            self.txn_frees = self.frees_pending.len();
            self.omap_generation_counted = false;
        }
        Ok(())
    }

    /// Apply a write operation, all or nothing.
    ///
    /// Most operations can be checked completely before anything changes (see
    /// `check_write`): those append their data, then change the metadata without a SAVEPOINT
    /// (whose sub-journal and statement parsing were about a sixth of a small write's CPU).
    /// Nothing but an SQLite or IO error can then fail them, and such an error takes the
    /// whole open transaction with it, as a failed commit does. The rest (rollbacks to a
    /// snapshot) run in a SAVEPOINT.
    fn apply_write(
        &mut self,
        object: &ObjectName,
        op: &WriteOp,
    ) -> Result<WriteOutcome, StoreError> {
        if let Some(refused) = self.built_before_a_loss(object, op) {
            return Err(refused);
        }
        if op.steps.iter().any(|s| matches!(s, WriteStep::Rollback(_))) {
            return self.in_operation(true, |e| {
                let head = e.head(object)?;
                e.write(object, op, head, None)
            });
        }
        if op.steps.iter().any(changes_whole_node_omap) {
            // Its extents change through the overlay (`extents_direct` is off): only the
            // omap's held changes must be in SQL first. Not for an object's removal (see
            // omap_overlay.rs).
            self.write_back_in_own_commit(false)?;
        }
        self.check_commit_room(object, op)?;
        self.begin()?;
        let head = self.head(object)?;
        check_write(object, op, head.as_ref())?;
        let mark = self.segments.mark();
        let mut pieces: Vec<Vec<Piece>> = Vec::with_capacity(op.steps.len());
        for step in &op.steps {
            let data = match step {
                WriteStep::Write { data, .. } | WriteStep::WriteFull(data) => data,
                _ => continue,
            };
            if data.len() <= INLINE_MAX {
                continue;
            }
            match self.segments.place(data) {
                Ok(places) => pieces.push(places.into_iter().map(Piece::placed).collect()),
                Err(e) => {
                    if let Err(rewind) = self.segments.rewind(mark) {
                        tracing::warn!("could not take back a failed operation's data: {rewind}");
                    }
                    return Err(e);
                }
            }
        }
        match self.write(object, op, head, Some(pieces)) {
            Ok(outcome) => {
                self.omap.get_mut().operation_done();
                self.txn_ops += 1;
                Ok(outcome)
            }
            Err(e) => {
                self.omap.get_mut().operation_failed();
                self.lose_transaction(&e);
                Err(e)
            }
        }
    }

    /// Before an operation that reads or rewrites a node's omap in SQL as a whole: write
    /// every held omap change back (and, with `extents_too`, for steps that change extents
    /// in SQL directly, every held extent change) in a commit of its own, after one of the
    /// operations acknowledged so far.
    ///
    /// Why: the write-back rewrites a page of the tables for every few changes held, and
    /// after random writes those lie all over them: on a file system that random 4 KiB writes
    /// through `ivdisk serve` had filled, the write-back of a discard's object removal needed
    /// more than the room kept for a commit (`CommitRoom`), and inside the operation's
    /// transaction its failed commit took every operation acknowledged since the last flush
    /// with it (and the image layer then refused all IO until the image was opened again).
    /// Alone, a write-back whose commit fails loses nothing: its changes are still in their
    /// pending rows and are held again. Only the operation that needed it is refused. (An
    /// object's removal no longer needs one: see omap_overlay.rs.)
    fn write_back_in_own_commit(&mut self, extents_too: bool) -> Result<(), StoreError> {
        if !(self.omap.get_mut().pending() || extents_too && self.extents.get_mut().pending()) {
            return Ok(());
        }
        if self.in_txn && self.txn_ops > 0 {
            self.try_commit(false)?;
        }
        self.begin()?;
        let written_back = match extents_too {
            true => self
                .write_back_omap()
                .and_then(|()| self.write_back_extents()),
            false => self.write_back_omap(),
        };
        if let Err(e) = written_back {
            self.lose_transaction(&e);
            return Err(e);
        }
        self.writing_back_alone = true;
        let committed = self.try_commit(false);
        self.writing_back_alone = false;
        committed.map_err(|e| match e {
            StoreError::NoSpace { context } => StoreError::NoSpace {
                context: format!(
                    "writing back the metadata changes the store holds in memory, which \
                     clearing an object's omap or rolling it back needs first: \
                     {context}"
                ),
            },
            e => e,
        })
    }

    /// An error inside the open transaction that cannot be undone alone: roll back every
    /// operation since the last commit (the next flush reports the loss).
    fn lose_transaction(&mut self, e: &StoreError) {
        self.forget_caches();
        if !self.db.is_autocommit() {
            let _ = self.db.execute_batch("ROLLBACK");
        }
        tracing::error!("an operation failed and took its transaction with it: {e}");
        self.in_txn = false;
        self.frees_pending.truncate(self.txn_frees);
        // Reported and counted only when it held acknowledged operations: a count makes the
        // image layer refuse further writes and flushes of that open (`ImageError::WritesLost`).
        if self.txn_ops > 0 {
            self.note_lost(e);
            self.count_lost_transaction(e);
        }
        if let Err(rewind) = self.segments.rewind(self.txn_mark) {
            tracing::warn!("could not take back the lost operations' data: {rewind}");
        }
        self.omap_after_lost_transaction();
    }

    /// The open transaction was rolled back: hold what `omap_pending` and `extents_pending`
    /// still have, no more.
    fn omap_after_lost_transaction(&mut self) {
        self.omap.get_mut().operation_failed();
        if let Err(e) = self.replay_extents_pending() {
            // Reads would see SQLite's older extents: refuse everything until the store is
            // opened again, as after a failed commit.
            tracing::error!("could not read back the extent changes not yet written back: {e}");
            self.extents.get_mut().clear();
            self.note_lost(&e);
        }
        if let Err(e) = self
            .replay_omap_pending()
            .and_then(|()| self.forget_removed_nodes())
        {
            // Reads would see SQLite's older values of keys changed before the loss: refuse
            // everything until the store is opened again, as after a failed commit.
            tracing::error!("could not read back the omap changes not yet written back: {e}");
            self.omap.get_mut().clear();
            self.note_lost(&e);
        }
    }

    /// Run one mutating operation inside the group transaction, all or nothing. With
    /// `omap_whole`, the operation may read or rewrite a node's omap in SQL as a whole: the
    /// held omap changes are written back before the SAVEPOINT, whose rollback would undo a
    /// write-back inside it but not bring the changes back into memory.
    fn in_operation<T>(
        &mut self,
        omap_whole: bool,
        body: impl FnOnce(&mut Self) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if omap_whole {
            self.write_back_in_own_commit(true)?;
        }
        self.begin()?;
        // A rollback to the savepoint forgets the cached heads: the rows must hold them first.
        // Failing half-way, some are stored and the rest only cached: the whole transaction
        // goes, as when a commit fails.
        if let Err(e) = self.store_dirty_heads().and_then(|()| match omap_whole {
            true => self
                .write_back_omap()
                .and_then(|()| self.write_back_extents()),
            false => Ok(()),
        }) {
            self.lose_transaction(&e);
            return Err(e);
        }
        self.db.execute_batch("SAVEPOINT op")?;
        let mark = self.segments.mark();
        let frees = self.frees_pending.len();
        // Steps on whole nodes change extents in SQL, where the rollback to the savepoint
        // undoes them; the others change none.
        self.extents_direct = omap_whole;
        let result = body(self);
        self.extents_direct = false;
        match result {
            Ok(value) => {
                if let Err(e) = self.db.execute_batch("RELEASE op") {
                    self.omap.get_mut().operation_failed();
                    return Err(e.into());
                }
                self.omap.get_mut().operation_done();
                self.txn_ops += 1;
                Ok(value)
            }
            Err(e) => {
                self.omap.get_mut().operation_failed();
                self.forget_caches();
                // SQLite rolls the whole transaction back by itself on some errors
                // (SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM): then every operation since the
                // last commit is gone, as if the commit had failed.
                let whole = self.db.is_autocommit()
                    || self.db.execute_batch("ROLLBACK TO op; RELEASE op").is_err();
                if whole {
                    // Counted (and reported by the next flush) only if the transaction held
                    // acknowledged operations: a failed first operation after a commit lost
                    // nothing else, yet fenced the image with `WritesLost`.
                    self.lose_transaction(&e);
                    return Err(e);
                }
                self.frees_pending.truncate(frees);
                // The failed operation's appends are referenced by nothing: take them back.
                if let Err(rewind) = self.segments.rewind(mark) {
                    tracing::warn!("could not take back a failed operation's data: {rewind}");
                }
                Err(e)
            }
        }
    }

    /// Commit the open transaction after syncing the data it references; with `durable`, also
    /// sync the database log and return the space of data that is now dead for good.
    /// One step of the metadata compaction (see `COMPACT_IDLE`) of a read-write engine, once
    /// no write came for that long and nothing is left to commit: a commit that writes back a
    /// piece of what the overlays hold; once they hold nothing, the rebuild of a mostly free
    /// database and a checkpoint that truncates the log, which end it until the next write.
    /// Returns how soon it wants to be called again.
    fn compact_step(&mut self) -> Option<Duration> {
        if self.read_only.is_some() || !self.compaction.due {
            return None;
        }
        let idle = self.compaction.last_write.elapsed();
        if idle < self.compaction.idle {
            return Some(self.compaction.idle - idle);
        }
        if self.in_txn || !self.durable_points.is_empty() || !self.frees_pending.is_empty() {
            // The loop commits these first, within `DURABLE_INTERVAL`.
            return Some(Duration::from_millis(100));
        }
        let roomy = COMPACT_ROOM_MIN
            .is_none_or(|min| self.durability.space_left().is_none_or(|left| left >= min));
        if roomy && (self.omap.get_mut().pending() || self.extents.get_mut().pending()) {
            let held = |e: &mut Engine| e.omap.get_mut().held().0 + e.extents.get_mut().held().0;
            let before = held(self);
            self.compaction.draining = true;
            let begun = self.begin();
            if begun.is_ok() {
                self.commit(false);
            }
            self.compaction.draining = false;
            let after = held(self);
            if let Err(e) = begun {
                tracing::warn!("compacting the store's metadata: {e}");
            } else if after < before || (after == 0 && self.lost.is_none()) {
                // Progress, or only emptied pending rows left, which that commit deleted.
                return Some(COMPACT_PAUSE);
            }
            // A failed commit says so itself (and the next flush reports it): not retried
            // until the next write.
            self.compaction.due = false;
            return None;
        }
        self.compaction.due = false;
        if !roomy {
            tracing::debug!(
                "the store's file system is nearly full: its metadata log is only truncated"
            );
        } else if let Err(e) = self.vacuum_if_mostly_free() {
            tracing::warn!("rebuilding the store's metadata without its free pages: {e}");
        }
        // Readers in other processes hold the log while they read: wait for none of them
        // (the worker would stall its requests), try again after the next write.
        if !self.checkpoint_fits(self.checkpoint_debt()) {
            tracing::debug!("the store's file system is short of the space a checkpoint needs");
            self.release_idle_memory();
            return None;
        }
        let _ = self.db.busy_timeout(Duration::ZERO);
        let checkpoint = self
            .db
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
                r.get::<_, i64>(0)
            });
        let _ = self.db.busy_timeout(Duration::from_secs(5));
        match checkpoint {
            Ok(0) => tracing::debug!("store metadata compacted: log truncated"),
            Ok(_) => tracing::debug!("store metadata compacted; a reader kept the log"),
            Err(e) => tracing::warn!("truncating the store's metadata log: {e}"),
        }
        self.release_idle_memory();
        None
    }

    /// Give back the memory of SQLite's page cache (up to `META_CACHE_KIB`, filled by the
    /// writes before): empty it (`PRAGMA shrink_memory`) and return the C heap's free pages
    /// to the kernel (`ffi_heap`). Why: an idle `ivdisk serve` kept hundreds of MB resident
    /// for as long as it ran, per image. The next writes read their pages back from the page
    /// cache of the database file (docs/BENCHMARKS.md, "Memory given back when idle"). The
    /// held extents' partial index gives back its log of changes (up to 10 MB) and its spare
    /// vector (as large as the index) too, and both overlays their transaction buffers (tens
    /// of MB under random writes).
    fn release_idle_memory(&mut self) {
        self.extents.get_mut().release_idle_memory();
        self.omap.get_mut().release_idle_memory();
        if let Err(e) = self.db.execute_batch("PRAGMA shrink_memory") {
            tracing::debug!("emptying the store's metadata cache: {e}");
        }
        crate::ffi_heap::release_free_c_heap();
    }

    /// Rebuild the database without its free pages (`VACUUM`; the file shrinks at the
    /// checkpoint after) if they are many and most of it (see `COMPACT_FREE_MIN`): objects were
    /// removed, or a disk discarded. Why not SQLite's incremental vacuum, which frees pages a
    /// few at a time: a database has it only if made with it, and one that was took random
    /// 4 KiB writes through `ivdisk serve` from 32-42k to 24-28k a second (its map of page
    /// parents, kept up to date on every page a write moves; docs/BENCHMARKS.md, "Metadata
    /// given back when idle").
    fn vacuum_if_mostly_free(&mut self) -> Result<(), StoreError> {
        let pragma = |name: &str| -> Result<u64, StoreError> {
            let n: i64 = self
                .db
                .query_row(&format!("PRAGMA {name}"), [], |r| r.get(0))?;
            Ok(n.max(0) as u64)
        };
        let page = pragma("page_size")?;
        let (pages, free) = (pragma("page_count")?, pragma("freelist_count")?);
        let (free_bytes, live_bytes) = (free * page, pages.saturating_sub(free) * page);
        if free_bytes < COMPACT_FREE_MIN
            || free_bytes < 3 * live_bytes
            || live_bytes > COMPACT_VACUUM_LIVE_MAX
        {
            return Ok(());
        }
        // The rebuild writes what is in use into the log before the database shrinks: on a
        // file system short of that (and of room for the next commits after), it waits.
        if let Some(left) = self.durability.space_left() {
            if left < 2 * live_bytes + COMPACT_FREE_MIN {
                tracing::debug!(left, live_bytes, "no room to rebuild the store's metadata");
                return Ok(());
            }
        }
        let started = Instant::now();
        self.db.execute_batch("VACUUM")?;
        tracing::debug!(
            free_bytes,
            live_bytes,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "store metadata rebuilt without its free pages"
        );
        Ok(())
    }

    /// Bytes the database file must still grow by before a checkpoint can copy the log into
    /// it: the database's size as this connection sees it (log included) past the file's.
    /// Until a checkpoint completes, SQLite appends every commit to the log, and the close's
    /// checkpoint is what lets the next open write over the old log instead of growing it:
    /// so on a file system short of space the store keeps this much free too (`CommitRoom`).
    /// Zero where the database has no file.
    fn checkpoint_debt(&self) -> u64 {
        let Some(path) = self.db.path().filter(|p| !p.is_empty()) else {
            return 0;
        };
        // Cached statements: this runs at commits (`commit_checkpoint_debt`).
        let pragma = |name: &str| -> Result<i64, rusqlite::Error> {
            self.db
                .prepare_cached(name)?
                .query_row([], |r| r.get::<_, i64>(0))
        };
        let size = pragma("PRAGMA page_count").and_then(|n| Ok(n * pragma("PRAGMA page_size")?));
        match (size, std::fs::metadata(path)) {
            (Ok(size), Ok(file)) => (size.max(0) as u64).saturating_sub(file.len()),
            _ => 0,
        }
    }

    /// `checkpoint_debt` for a commit: measured again when the file system was short of space
    /// at the last commit (less than `DEBT_MEASURED_BELOW` and twice the debt free) or the
    /// last measure is `DEBT_MAX_AGE` old. Why not at every commit: 4 KiB writes flushed one
    /// by one, a commit each, went 2-5% slower measuring it (docs/BENCHMARKS.md, "Room for
    /// SQLite's checkpoint").
    fn commit_checkpoint_debt(&mut self) -> u64 {
        let (debt, when) = self.debt_seen;
        let short = self
            .segments
            .commit_room()
            .is_none_or(|free| free < DEBT_MEASURED_BELOW.saturating_add(debt.saturating_mul(2)));
        if short || when.elapsed() >= DEBT_MAX_AGE {
            self.debt_seen = (self.checkpoint_debt(), Instant::now());
        }
        self.debt_seen.0
    }

    /// Whether a checkpoint could complete: the file system has the database's debt free and
    /// `CHECKPOINT_MARGIN` more. One that cannot still takes every free block before it fails
    /// (SQLite writes the log's pages into the database file one by one), leaving nothing for
    /// the commits after it: the held room of `CommitRoom`, or the first commit of the next
    /// open, which takes an image's writer lock.
    fn checkpoint_fits(&self, debt: u64) -> bool {
        Self::checkpoint_fits_in(self.durability.space_left(), debt)
    }

    /// `checkpoint_fits` with `free` bytes free on the file system (`None`: not known).
    fn checkpoint_fits_in(free: Option<u64>, debt: u64) -> bool {
        free.is_none_or(|left| left >= debt.saturating_add(CHECKPOINT_MARGIN))
    }

    /// What committing the open transaction may write to SQLite's log, at most: its pending
    /// rows as encoded so far, and `COMMIT_BYTES_PER_OP` per operation for the rest.
    fn commit_bytes(&mut self) -> u64 {
        let rows = self.omap.get_mut().transaction_row().1.len()
            + self.extents.get_mut().transaction_row().1.len();
        (rows as u64).saturating_add((self.txn_ops as u64).saturating_mul(COMMIT_BYTES_PER_OP))
    }

    /// Refuse, before anything is applied, an operation whose metadata (omap values, data
    /// inline in the database) would take the open transaction's commit past half the room
    /// it has (`Segments::commit_room`). Appends of data leave that room free, but metadata
    /// goes into SQLite's log only at the commit: on a full disk, omap updates of 1 MiB each
    /// were acknowledged and committed one by one (each past an eighth of the room) until one
    /// commit found no space, and then the commit that removed objects to free space had
    /// none either.
    fn check_commit_room(&mut self, object: &ObjectName, op: &WriteOp) -> Result<(), StoreError> {
        let Some(room) = self.segments.commit_room() else {
            return Ok(());
        };
        let op_bytes: u64 = op
            .steps
            .iter()
            .map(|step| match step {
                WriteStep::OmapSet(pairs) => pairs.iter().map(|(k, v)| k.len() + v.len()).sum(),
                WriteStep::Write { data, .. } | WriteStep::WriteFull(data)
                    if data.len() <= INLINE_MAX =>
                {
                    data.len()
                }
                _ => 0,
            } as u64)
            .sum::<u64>()
            .saturating_add(COMMIT_BYTES_PER_OP);
        let needed = self.commit_bytes().saturating_add(op_bytes);
        if needed <= room / 2 {
            return Ok(());
        }
        // As last seen, at the last commit or append: space freed since (the store's own
        // punches, another program's files) would otherwise stay unseen while every write
        // that could commit is refused.
        let room = self.segments.fresh_commit_room().unwrap_or(room);
        if needed <= room / 2 {
            return Ok(());
        }
        Err(StoreError::NoSpace {
            context: format!(
                "writing `{object}`: its commit would write {needed} bytes to the store's \
                 metadata log, more than half of the {room} bytes its file system has left \
                 for the next commit"
            ),
        })
    }

    /// Turn SQLite's automatic checkpoints off while one could not complete
    /// (`checkpoint_fits`), and on again once it could: meanwhile commits go on growing the
    /// log, in the room the segments keep for them.
    fn hold_checkpoints_while_short(&mut self, debt: u64, free: Option<u64>) {
        if self.read_only.is_some() {
            return;
        }
        let fits = Self::checkpoint_fits_in(free, debt);
        let result = match (fits, self.autocheckpoint_held) {
            (false, None) => self
                .db
                .query_row("PRAGMA wal_autocheckpoint", [], |r| r.get::<_, i64>(0))
                .and_then(|pages| {
                    self.db.execute_batch("PRAGMA wal_autocheckpoint = 0")?;
                    tracing::info!(
                        debt,
                        "the store's file system is short of the space a checkpoint of its \
                         metadata log needs: the log grows until space is freed"
                    );
                    self.autocheckpoint_held = Some(pages);
                    Ok(())
                }),
            (true, Some(pages)) => self
                .db
                .execute_batch(&format!("PRAGMA wal_autocheckpoint = {pages}"))
                .map(|()| {
                    tracing::debug!("checkpoints of the store's metadata log resumed");
                    self.autocheckpoint_held = None;
                }),
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!("setting the store's automatic checkpoints: {e}");
        }
    }

    fn commit(&mut self, durable: bool) {
        // A failure is handled in `try_commit` (and reported by the next flush).
        let _ = self.try_commit(durable);
    }

    /// `commit`, with its error, for a caller that acts on it.
    fn try_commit(&mut self, durable: bool) -> Result<(), StoreError> {
        // Whether the transaction's operations are in the database (a failure after its
        // COMMIT loses none of them).
        let mut committed = !self.in_txn;
        let started = Instant::now();
        let ops = self.txn_ops;
        // A compaction's commit holds write-backs only: if it fails, the held changes come
        // back from their pending rows and no acknowledged operation is lost, so the next
        // flush has nothing to report and the image layer's caches nothing to forget.
        let only_write_back = (self.compaction.draining || self.writing_back_alone) && ops == 0;
        let mut data_synced = Duration::ZERO;
        let mut row_bytes = 0;
        let result = (|| -> Result<(), StoreError> {
            if self.in_txn {
                let debt = self.commit_checkpoint_debt();
                let free = self.segments.before_commit(debt);
                self.hold_checkpoints_while_short(debt, free);
                if self.segments.unsynced() > 0 {
                    self.segments.sync()?;
                }
                data_synced = started.elapsed();
                let (row, changes) = self.omap.get_mut().transaction_row();
                row_bytes += changes.len();
                if store_pending_row(&self.db, "omap_pending", row, changes)? {
                    self.omap.get_mut().transaction_row_stored();
                }
                self.write_back_omap_piece()?;
                self.write_back_oldest_omap()?;
                let emptied = self.omap.get_mut().take_emptied();
                delete_pending_rows(&self.db, "omap_pending", emptied)?;
                let (row, changes) = self.extents.get_mut().transaction_row();
                row_bytes += changes.len();
                if store_pending_row(&self.db, "extents_pending", row, changes)? {
                    self.extents.get_mut().transaction_row_stored();
                }
                self.write_back_extents_piece()?;
                self.write_back_oldest_extents()?;
                let emptied = self.extents.get_mut().take_emptied();
                delete_pending_rows(&self.db, "extents_pending", emptied)?;
                self.store_dirty_heads()?;
                if self.version != self.version_stored {
                    self.db
                        .prepare_cached("UPDATE meta SET value = ?1 WHERE key = 'version'")?
                        .execute([self.version as i64])?;
                }
                // Where this commit's appends end (`committed_end`), written by every commit
                // that moved it (`append_stored` is what the last successful one stored: a
                // commit that fails takes its rows back).
                let appended = self.segments.mark();
                let append = (appended.segment, appended.offset, self.version);
                if self.append_stored != Some(append) {
                    let mut stmt = self.db.prepare_cached(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
                    )?;
                    stmt.execute(params!["append_segment", appended.segment])?;
                    stmt.execute(params!["append_offset", appended.offset as i64])?;
                    stmt.execute(params!["append_version", self.version as i64])?;
                }
                self.in_txn = false;
                self.db.execute_batch("COMMIT")?;
                committed = true;
                self.segments.committed();
                self.version_stored = self.version;
                self.append_stored = Some(append);
            }
            if durable {
                self.segments.sync()?;
                self.segments.check_in_place()?;
                let frees = self.widened_frees()?;
                self.last_durable = Instant::now();
                self.start_wal_sync(frees);
            }
            Ok(())
        })();
        // Every request waits while the worker commits: the time is worth seeing.
        tracing::debug!(
            ops,
            row_bytes,
            durable,
            data_sync_ms = data_synced.as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "group commit"
        );
        if let Err(e) = result {
            self.forget_caches();
            tracing::error!("store commit failed: {e}");
            if !self.db.is_autocommit() {
                let _ = self.db.execute_batch("ROLLBACK");
            }
            if !committed {
                // The transaction is gone (SQLite rolls back a COMMIT that fails for lack of
                // space), so its frees never happened: the ranges it found dead are live
                // again, and punching them at the next durable commit would zero data.
                // Earlier transactions' frees stay pending. Its appends are referenced by
                // nothing: taken back, as when an operation takes its transaction with it.
                self.frees_pending.truncate(self.txn_frees);
                if let Err(rewind) = self.segments.rewind(self.txn_mark) {
                    tracing::warn!("could not take back the lost operations' data: {rewind}");
                }
                if !only_write_back && ops > 0 {
                    self.count_lost_transaction(&e);
                }
                self.omap_after_lost_transaction();
            }
            self.in_txn = false;
            if committed {
                // Only making it durable failed (syncing the log, punching dead ranges), or
                // the store's files are gone (`check_in_place`, which says what that means).
                let what = match &e {
                    StoreError::Corrupt(_) => e.to_string(),
                    _ => format!(
                        "a durable commit failed after its transaction was committed: what was \
                         written since the previous flush is in the store but may not survive \
                         a power cut: {e}"
                    ),
                };
                self.note_flush_error(&e, what);
            } else if !only_write_back {
                self.note_lost(&e);
            }
            return Err(e);
        }
        Ok(())
    }

    /// The dead ranges freed so far, merged and widened over partial blocks whose other
    /// bytes are dead or not written (against the state just committed, which the WAL sync
    /// being started makes durable), and cut at the append position: they are punched only
    /// once that sync is done, when appends made meanwhile may have filled the rest of the
    /// last block.
    ///
    /// All of it happens in the vector the ranges were gathered in, and `frees_pending` goes
    /// on in the one the last durable commit gave back (`recycle_frees`). Why: a second of
    /// random 4 KiB writes frees about 100k ranges, and vectors of megabytes grown afresh
    /// at every durable commit (four per commit) made the kernel zero new pages for them, 8%
    /// of the worker's time in the store bench (docs/BENCHMARKS.md).
    fn widened_frees(&mut self) -> Result<Vec<(u32, u64, u64)>, StoreError> {
        let widened = self.widen_frees();
        // The ranges were taken: on an error they are gone (widened part-way, they cannot go
        // back: past the append position they could cover bytes appended later).
        self.frees_dropped |= widened.is_err();
        widened
    }

    fn widen_frees(&mut self) -> Result<Vec<(u32, u64, u64)>, StoreError> {
        let spare = std::mem::take(&mut self.frees_spare);
        let mut frees = std::mem::replace(&mut self.frees_pending, spare);
        // (segment, offset, length) -> (segment, from, to).
        for (_, offset, len) in frees.iter_mut() {
            *len += *offset;
        }
        // Neighbouring dead ranges (appended one after the other, overwritten in the
        // same interval) become one punch, with one widening.
        frees.sort_unstable();
        merge_touching(&mut frees);
        // One read transaction for all the lookups: outside one, each query takes and
        // drops SQLite's shared lock (two `fcntl` calls), and a durable commit after
        // 2 s of random 4 KiB writes widens about 100k ranges.
        let reading = frees.len() > 1;
        if reading {
            self.db.execute_batch("BEGIN DEFERRED")?;
        }
        // One statement for all of them: taking it from rusqlite's cache and handing it back
        // per lookup was 2% of the store worker's time in 4 KiB store writes.
        let lookups = (|| {
            let mut referenced = self.db.prepare_cached(REFERENCED)?;
            frees.iter_mut().try_for_each(|(segment, from, to)| {
                (*from, *to) = self.widen_to_blocks(&mut referenced, *segment, *from, *to)?;
                Ok::<(), StoreError>(())
            })
        })();
        if reading {
            self.db.execute_batch("COMMIT")?;
        }
        lookups?;
        // Two ranges can widen into the same partial block from both sides (the bytes
        // between them died earlier): merged again, so that no block is freed twice.
        // A block freed twice could be punched after a write reused it. (Widening keeps
        // the order: each start moves down to its block's, each end up to its block's.)
        merge_touching(&mut frees);
        let written = self.segments.mark();
        for (segment, _, to) in frees.iter_mut() {
            if *segment == written.segment {
                *to = (*to).min(written.offset);
            }
        }
        frees.retain(|(_, from, to)| from < to);
        Ok(frees)
    }

    /// Whether any extent still references bytes of `[from, to)` in `seg`, a part of one
    /// block whose other bytes are dead (`widen_to_blocks`).
    ///
    /// Only extents that do not cover whole blocks are looked at (the index
    /// `partial_block_by_place` holds no others): an extent of whole blocks that reached into
    /// the block would reference its dead bytes too. Walks them by segment offset downwards
    /// from `to`. One starting inside the range references it. Below `from`: without snapshot
    /// clones, extents reference disjoint bytes, so only the first one can reach into the range
    /// (a single index seek). With clones, two nodes may share bytes, and the walk goes on
    /// through the extents of the blob (one append, `[blob, blob_end)`) that holds `from`:
    /// every extent lies inside the blob its data was written in, blobs do not overlap, so
    /// the first extent of a blob ending at or before `from` ends the search.
    ///
    /// `stmt` is `REFERENCED`, prepared once for all of a durable commit's lookups.
    fn referenced(
        &self,
        stmt: &mut rusqlite::Statement<'_>,
        seg: u32,
        from: u64,
        to: u64,
    ) -> Result<bool, StoreError> {
        if from >= to {
            return Ok(false);
        }
        // Held extents and SQLite's rows that no held change replaces are each a set of
        // extents referencing disjoint bytes (blobs), so each is walked down on its own.
        self.extents.borrow_mut().settle_partial();
        let extents = self.extents.borrow();
        for (start, len, blob_end) in extents.partial_below(seg, to) {
            if start + len > from {
                return Ok(true);
            }
            if !self.clones_may_exist || blob_end <= from {
                break;
            }
        }
        let mut rows = stmt.query(params![seg, to as i64])?;
        while let Some(row) = rows.next()? {
            let (node, lo) = (row.get::<_, i64>(3)?, row.get::<_, i64>(4)? as u64);
            if !matches!(extents.get(node, lo), Held::Unknown) {
                continue;
            }
            let start = row.get::<_, i64>(0)? as u64;
            let end = start + row.get::<_, i64>(1)? as u64;
            if end > from {
                return Ok(true);
            }
            if !self.clones_may_exist || row.get::<_, i64>(2)? as u64 <= from {
                break;
            }
        }
        Ok(false)
    }

    /// Appends are packed, so a dead range rarely starts or ends on a block boundary and a punch
    /// of just its bytes would free no block. Extend it over the partial blocks at its ends when
    /// nothing live shares them (their other bytes are dead too, or not written yet). Called
    /// only between transactions, when every extent is committed.
    fn widen_to_blocks(
        &self,
        referenced: &mut rusqlite::Statement<'_>,
        seg: u32,
        from: u64,
        to: u64,
    ) -> Result<(u64, u64), StoreError> {
        let down = from / BLOCK * BLOCK;
        let up = to.div_ceil(BLOCK) * BLOCK;
        let start = if down < from && !self.referenced(referenced, seg, down, from)? {
            down
        } else {
            from
        };
        let end = if up > to && !self.referenced(referenced, seg, to, up)? {
            up
        } else {
            to
        };
        Ok((start, end))
    }

    fn meta(&self, key: &str) -> Result<u64, StoreError> {
        Self::stored_meta(&self.db, key)
    }

    fn stored_meta(db: &Connection, key: &str) -> Result<u64, StoreError> {
        Ok(db
            .prepare_cached("SELECT value FROM meta WHERE key = ?1")?
            .query_row([key], |r| r.get::<_, i64>(0))? as u64)
    }

    fn next_version(&mut self) -> u64 {
        self.version += 1;
        self.version
    }

    fn bump_meta(&self, key: &str) -> Result<u64, StoreError> {
        // Cached statements on the IO path: parsing SQL again per operation was 7-8% of a
        // 4 KiB write's CPU (docs/BENCHMARKS.md, NBD server vs qemu-nbd).
        self.db
            .prepare_cached("UPDATE meta SET value = value + 1 WHERE key = ?1")?
            .execute([key])?;
        self.meta(key)
    }

    fn head(&self, object: &ObjectName) -> Result<Option<Node>, StoreError> {
        if self.read_only.is_some() {
            return self.stored_head(object);
        }
        if let Some(node) = self.heads.borrow().get(object.as_str()) {
            return Ok(Some(*node));
        }
        let node = self.stored_head(object)?;
        if let Some(node) = node {
            self.cache_head(object, Some(node));
        }
        Ok(node)
    }

    /// Record an object's head as it now is in the open transaction (`None`: removed).
    fn cache_head(&self, object: &ObjectName, node: Option<Node>) {
        if self.read_only.is_some() {
            return;
        }
        let mut heads = self.heads.borrow_mut();
        match node {
            Some(node) => {
                if heads.len() >= HEAD_CACHE_SIZE && !heads.contains_key(object.as_str()) {
                    // Start over, but keep the heads whose rows are not updated yet: SQLite
                    // would answer for them with what they were.
                    let dirty = self.dirty_heads.borrow();
                    heads.retain(|_, head| dirty.contains_key(&head.id));
                }
                heads.insert(object.as_str().to_owned(), node);
            }
            None => {
                heads.remove(object.as_str());
            }
        }
    }

    /// A head changed by the open transaction: cached now, its row updated at the latest
    /// when the transaction commits.
    fn update_head(&self, object: &ObjectName, node: Node) {
        self.dirty_heads.borrow_mut().insert(node.id, node);
        self.cache_head(object, Some(node));
    }

    /// Update the `nodes` rows of the heads changed since they were last stored.
    fn store_dirty_heads(&self) -> Result<(), StoreError> {
        let dirty = std::mem::take(&mut *self.dirty_heads.borrow_mut());
        if dirty.is_empty() {
            return Ok(());
        }
        let mut stmt = self.db.prepare_cached(
            "UPDATE nodes SET size = ?2, version = ?3, snap_seq = ?4 WHERE id = ?1",
        )?;
        for node in dirty.values() {
            stmt.execute(params![
                node.id,
                node.size as i64,
                node.version as i64,
                node.snap_seq as i64
            ])?;
        }
        Ok(())
    }

    /// SQLite's state went back (a rolled back operation or transaction): what the caches
    /// hold may be newer than it.
    fn forget_caches(&self) {
        self.heads.borrow_mut().clear();
        self.dirty_heads.borrow_mut().clear();
    }

    fn stored_head(&self, object: &ObjectName) -> Result<Option<Node>, StoreError> {
        Ok(self
            .db
            .prepare_cached(
                "SELECT id, size, version, snap_seq, birth_seq FROM nodes
                 WHERE name = ?1 AND clone_to IS NULL",
            )?
            .query_row([object.as_str()], |r| {
                Ok(Node {
                    id: r.get(0)?,
                    size: r.get::<_, i64>(1)? as u64,
                    version: r.get::<_, i64>(2)? as u64,
                    snap_seq: r.get::<_, i64>(3)? as u64,
                    birth_seq: r.get::<_, i64>(4)? as u64,
                })
            })
            .optional()?)
    }

    /// The node holding an object's state as of snapshot `snap`, if it existed then.
    fn node_at(&self, object: &ObjectName, snap: SnapId) -> Result<Option<Node>, StoreError> {
        self.check_snap_live(snap)?;
        let clone = self
            .db
            .query_row(
                "SELECT id, size, version FROM nodes
                 WHERE name = ?1 AND clone_to IS NOT NULL AND clone_from < ?2 AND clone_to >= ?2
                 ORDER BY clone_to LIMIT 1",
                params![object.as_str(), snap as i64],
                |r| {
                    Ok(Node {
                        id: r.get(0)?,
                        size: r.get::<_, i64>(1)? as u64,
                        version: r.get::<_, i64>(2)? as u64,
                        snap_seq: 0,
                        birth_seq: 0,
                    })
                },
            )
            .optional()?;
        if clone.is_some() {
            return Ok(clone);
        }
        Ok(self
            .head(object)?
            .filter(|h| h.birth_seq < snap && h.snap_seq < snap))
    }

    fn check_snap_live(&self, snap: SnapId) -> Result<(), StoreError> {
        let live: bool = self
            .db
            .prepare_cached("SELECT 1 FROM snaps WHERE id = ?1")?
            .query_row([snap as i64], |_| Ok(()))
            .optional()?
            .is_some();
        if !live {
            return Err(StoreError::NoSuchSnapshot(snap));
        }
        Ok(())
    }

    /// An id for a node about to be made (see `next_node_id`).
    fn new_node_id(&self) -> i64 {
        let id = self.next_node_id.get();
        self.next_node_id.set(id + 1);
        id
    }

    fn create_head(&self, object: &ObjectName, seq: u64) -> Result<Node, StoreError> {
        let id = self.new_node_id();
        self.db.execute(
            "INSERT INTO nodes (id, name, size, version, snap_seq, birth_seq)
             VALUES (?1, ?2, 0, 0, ?3, ?3)",
            params![id, object.as_str(), seq as i64],
        )?;
        Ok(Node {
            id,
            size: 0,
            version: 0,
            snap_seq: seq,
            birth_seq: seq,
        })
    }

    /// Copy a node's extents (sharing their data) and omap into `to`.
    fn copy_node(&mut self, from: i64, to: i64) -> Result<(), StoreError> {
        // The copy is made in SQL: the held extent changes of `from` go there first. `to` is
        // new and was never any node's id before (`next_node_id`), so no held change and no
        // pending row names it: none can hide or remove the rows copied.
        debug_assert!(!self.extents.get_mut().holds_node(to));
        let held = self.extents.get_mut().take_node(from);
        Self::store_extents_in(&self.db, &held)?;
        self.db.execute(
            "INSERT INTO extents (node, lo, hi, seg, seg_off, blob, blob_end, inline)
             SELECT ?2, lo, hi, seg, seg_off, blob, blob_end, inline FROM extents WHERE node = ?1",
            params![from, to],
        )?;
        self.db.execute(
            "INSERT INTO omap (node, key, value) SELECT ?2, key, value FROM omap WHERE node = ?1",
            params![from, to],
        )?;
        self.omap.borrow_mut().copy_node(from, to);
        Ok(())
    }

    /// Before the first write under a newer snapshot context, keep the head's state for the
    /// snapshots taken since its last write (copy-on-write by reference).
    fn preserve_for_snapshots(
        &mut self,
        object: &ObjectName,
        head: &mut Node,
        context: &SnapContext,
    ) -> Result<(), StoreError> {
        if context.seq <= head.snap_seq {
            return Ok(());
        }
        if context.snaps.iter().any(|&s| s > head.snap_seq) {
            self.clones_may_exist = true;
            let clone = self.new_node_id();
            self.db.execute(
                "INSERT INTO nodes (id, name, clone_from, clone_to, size, version, snap_seq,
                                    birth_seq)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 0, 0)",
                params![
                    clone,
                    object.as_str(),
                    head.snap_seq as i64,
                    context.seq as i64,
                    head.size as i64,
                    head.version as i64
                ],
            )?;
            self.copy_node(head.id, clone)?;
        }
        head.snap_seq = context.seq;
        Ok(())
    }

    /// Drop a node's extents in `[lo, hi)`, keeping the parts outside, and note dead data.
    fn cut_extents(&mut self, node: i64, lo: u64, hi: u64) -> Result<(), StoreError> {
        self.cut_extents_for(node, lo, hi, false)
    }

    /// `cut_extents`; with `refilled`, the caller writes an extent at `lo` next (with
    /// `insert_extent`, which replaces), so an extent starting at `lo` is not deleted first:
    /// an overwrite of exactly one earlier write costs one statement less.
    fn cut_extents_for(
        &mut self,
        node: i64,
        lo: u64,
        hi: u64,
        refilled: bool,
    ) -> Result<(), StoreError> {
        if lo >= hi {
            return Ok(());
        }
        let overlapping = self.lookup_extents(node, lo, hi)?;
        self.cut_found(node, lo, hi, refilled, overlapping)
    }

    /// `cut_extents_for` with the extents overlapping `[lo, hi)` already looked up.
    fn cut_found(
        &mut self,
        node: i64,
        lo: u64,
        hi: u64,
        refilled: bool,
        overlapping: Vec<(u64, u64, Stored)>,
    ) -> Result<(), StoreError> {
        for (e_lo, e_hi, stored) in overlapping {
            // An extent starting at `lo` that the caller writes again keeps its key.
            let refilled_here = refilled && e_lo == lo;
            if !self.extents_direct {
                if e_lo < lo {
                    let before = stored.sub(0, lo - e_lo);
                    self.extents.get_mut().put(node, e_lo, Some((lo, before)));
                } else if !refilled_here {
                    self.extents.get_mut().put(node, e_lo, None);
                }
            } else if e_lo < lo {
                // The part before the cut keeps its row (same key, same place in the
                // segments): only its end moves, and no index entry changes.
                match stored.sub(0, lo - e_lo) {
                    Stored::Segment(_) => self
                        .db
                        .prepare_cached("UPDATE extents SET hi = ?3 WHERE node = ?1 AND lo = ?2")?
                        .execute(params![node, e_lo as i64, lo as i64])?,
                    Stored::Inline(data) => self
                        .db
                        .prepare_cached(
                            "UPDATE extents SET hi = ?3, inline = ?4 WHERE node = ?1 AND lo = ?2",
                        )?
                        .execute(params![node, e_lo as i64, lo as i64, data])?,
                };
            } else if !refilled_here {
                self.db
                    .prepare_cached("DELETE FROM extents WHERE node = ?1 AND lo = ?2")?
                    .execute(params![node, e_lo as i64])?;
            }
            if e_hi > hi {
                self.insert_extent(node, hi, e_hi, &stored.sub(hi - e_lo, e_hi - hi))?;
            }
            if let Stored::Segment(piece) = stored {
                let dead_lo = e_lo.max(lo);
                let dead_hi = e_hi.min(hi);
                self.note_dead(
                    node,
                    dead_lo,
                    (
                        piece.seg,
                        piece.seg_off + (dead_lo - e_lo),
                        dead_hi - dead_lo,
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// The extents of `node` overlapping `[lo, hi)` in the database, ascending.
    fn lookup_extents(
        &self,
        node: i64,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<(u64, u64, Stored)>, StoreError> {
        let found = self.lookup_extents_unchecked(node, lo, hi)?;
        // The write path slices inline bytes by the extent's range: a row whose inline value
        // does not fill it (damaged metadata) is refused here, as reads refuse it, where the
        // slicing panicked the worker and took the open transaction with it unreported.
        for (e_lo, e_hi, stored) in &found {
            if let Stored::Inline(bytes) = stored {
                if bytes.len() as u64 != e_hi - e_lo {
                    return Err(StoreError::Database(format!(
                        "an inline extent of {} bytes holds {} (damaged metadata)",
                        e_hi - e_lo,
                        bytes.len()
                    )));
                }
            }
        }
        Ok(found)
    }

    /// [`Engine::lookup_extents`] without checking inline extents' lengths.
    fn lookup_extents_unchecked(
        &self,
        node: i64,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<(u64, u64, Stored)>, StoreError> {
        let extents = self.extents.borrow();
        // Held changes replace SQLite's rows of their keys. Both walked down from `hi`,
        // merged: a node's extents are disjoint in the merged view too, so the first one
        // that ends at or before `lo` ends the search.
        let mut held = extents.below(node, hi).peekable();
        // None held below `hi`: SQLite's rows are the answer (changes held from `hi` on are
        // of extents that start past the range). One descent of the held changes: asking
        // `holds_node` first was a second, 9% of the worker under random 4 KiB writes.
        if held.peek().is_none() {
            drop(held);
            drop(extents);
            return self.lookup_stored_extents(node, lo, hi);
        }
        // An extent held from `lo` or before to `hi` or after is the only one in the range
        // (any other would overlap it): no seek in SQLite (a rewrite of a range written
        // since the last write-back).
        if let Some((e_lo, Some(extent))) = held.peek() {
            if *e_lo <= lo && extent.hi >= hi {
                return Ok(vec![(*e_lo, extent.hi, extent.stored.clone())]);
            }
        }
        let mut stmt = self.db.prepare_cached(
            "SELECT lo, hi, seg, seg_off, blob, blob_end, inline FROM extents
             WHERE node = ?1 AND lo < ?2 ORDER BY lo DESC",
        )?;
        let mut rows = stmt.query(params![node, hi as i64])?;
        let mut row = rows.next()?;
        let mut found = Vec::new();
        loop {
            let row_lo = match row {
                Some(r) => Some(r.get::<_, i64>(0)? as u64),
                None => None,
            };
            let held_lo = held.peek().map(|(held_lo, _)| *held_lo);
            let (e_lo, e_hi, stored) = match (row_lo, held_lo) {
                (None, None) => break,
                (Some(r_lo), h) if h.is_none_or(|h_lo| r_lo > h_lo) => {
                    let r = row.expect("a row");
                    let e_hi = r.get::<_, i64>(1)? as u64;
                    let stored = Self::stored_of(r)?;
                    row = rows.next()?;
                    (r_lo, e_hi, stored)
                }
                (r, Some(h_lo)) => {
                    if r == Some(h_lo) {
                        // SQLite's row of a held key is out of date.
                        row = rows.next()?;
                    }
                    match held.next().expect("peeked") {
                        (_, Some(extent)) => (h_lo, extent.hi, extent.stored.clone()),
                        (_, None) => continue,
                    }
                }
                (Some(_), None) => unreachable!("handled above"),
            };
            if e_hi <= lo {
                break;
            }
            found.push((e_lo, e_hi, stored));
        }
        found.reverse();
        Ok(found)
    }

    /// An extent row's place (columns 2-6: seg, seg_off, blob, blob_end, inline).
    fn stored_of(r: &rusqlite::Row<'_>) -> Result<Stored, StoreError> {
        Ok(if r.get::<_, i64>(2)? == INLINE_SEG {
            Stored::Inline(r.get(6)?)
        } else {
            Stored::Segment(Piece {
                seg: r.get(2)?,
                seg_off: r.get::<_, i64>(3)? as u64,
                blob: r.get::<_, i64>(4)? as u64,
                blob_end: r.get::<_, i64>(5)? as u64,
            })
        })
    }

    /// `lookup_extents` of a node without held changes: SQLite's rows only.
    fn lookup_stored_extents(
        &self,
        node: i64,
        lo: u64,
        hi: u64,
    ) -> Result<Vec<(u64, u64, Stored)>, StoreError> {
        // One seek: a node's extents are disjoint, so walking down from the last one that
        // starts before `hi`, the first that ends at or before `lo` ends the search (the
        // two-seek form of `READ_EXTENTS` cost a second index descent on every write).
        let mut stmt = self.db.prepare_cached(
            "SELECT lo, hi, seg, seg_off, blob, blob_end, inline FROM extents
             WHERE node = ?1 AND lo < ?2 ORDER BY lo DESC",
        )?;
        let mut rows = stmt.query(params![node, hi as i64])?;
        let mut found = Vec::new();
        while let Some(r) = rows.next()? {
            let e_hi = r.get::<_, i64>(1)? as u64;
            if e_hi <= lo {
                break;
            }
            found.push((r.get::<_, i64>(0)? as u64, e_hi, Self::stored_of(r)?));
        }
        found.reverse();
        Ok(found)
    }

    /// Overwrite an inline extent that spans exactly `[lo, hi)`, if there is one: then no
    /// other extent overlaps the range (a node's extents are disjoint) and no segment bytes
    /// die, so one statement does what a lookup, a cut and an insert would. This is every
    /// rewrite of a sector's metadata in the `object-end` layout after its first.
    fn replace_inline(
        &mut self,
        node: i64,
        lo: u64,
        hi: u64,
        data: &[u8],
    ) -> Result<bool, StoreError> {
        if !self.extents_direct {
            let exact = match self.extents.get_mut().get(node, lo) {
                Held::Extent(e_hi, Stored::Inline(_)) => e_hi == hi,
                Held::Extent(..) | Held::Removed => false,
                Held::Unknown => self
                    .db
                    .prepare_cached(
                        "SELECT 1 FROM extents WHERE node = ?1 AND lo = ?2 AND hi = ?3
                         AND seg = ?4",
                    )?
                    .query_row(params![node, lo as i64, hi as i64, INLINE_SEG], |_| Ok(()))
                    .optional()?
                    .is_some(),
            };
            if exact {
                self.extents
                    .get_mut()
                    .put(node, lo, Some((hi, Stored::Inline(data.to_vec()))));
            }
            return Ok(exact);
        }
        let changed = self
            .db
            .prepare_cached(
                "UPDATE extents SET inline = ?4
                 WHERE node = ?1 AND lo = ?2 AND hi = ?3 AND seg = ?5",
            )?
            .execute(params![node, lo as i64, hi as i64, data, INLINE_SEG])?;
        Ok(changed == 1)
    }

    /// Write `data` at `skip` inside the inline extent at `lo` that holds `old` and covers it
    /// whole: one statement where a cut would update, insert and insert again, and the piece
    /// stays one row (a write of a few bytes of metadata into a piece the image layer wrote
    /// whole, `SMALL_WRITE_UNIT`).
    fn patch_inline(
        &mut self,
        node: i64,
        (lo, hi): (u64, u64),
        old: &[u8],
        skip: u64,
        data: &[u8],
    ) -> Result<(), StoreError> {
        let mut patched = old.to_vec();
        patched[skip as usize..skip as usize + data.len()].copy_from_slice(data);
        if !self.extents_direct {
            self.extents
                .get_mut()
                .put(node, lo, Some((hi, Stored::Inline(patched))));
            return Ok(());
        }
        self.db
            .prepare_cached("UPDATE extents SET inline = ?3 WHERE node = ?1 AND lo = ?2")?
            .execute(params![node, lo as i64, patched])?;
        Ok(())
    }

    /// Point the segment extent at `lo`, which a write of exactly its range replaces, at the
    /// write's `piece`: one UPDATE of the row in place, where deleting it and inserting the
    /// new one (`INSERT OR REPLACE`) moved the row and its key in the B-tree.
    fn repoint_extent(
        &mut self,
        node: i64,
        (lo, hi): (u64, u64),
        piece: &Piece,
    ) -> Result<(), StoreError> {
        if !self.extents_direct {
            self.extents
                .get_mut()
                .put(node, lo, Some((hi, Stored::Segment(*piece))));
            return Ok(());
        }
        self.db
            .prepare_cached(
                "UPDATE extents SET seg = ?3, seg_off = ?4, blob = ?5, blob_end = ?6
                 WHERE node = ?1 AND lo = ?2",
            )?
            .execute(params![
                node,
                lo as i64,
                piece.seg,
                piece.seg_off as i64,
                piece.blob as i64,
                piece.blob_end as i64
            ])?;
        Ok(())
    }

    /// Insert the extents of one step's data, stored in `pieces` (in order), from `lo` on.
    fn insert_extents(&mut self, node: i64, lo: u64, pieces: &[Stored]) -> Result<(), StoreError> {
        let mut at = lo;
        for stored in pieces {
            let len = match stored {
                Stored::Segment(piece) => piece.len(),
                Stored::Inline(data) => data.len() as u64,
            };
            self.insert_extent(node, at, at + len, stored)?;
            at += len;
        }
        Ok(())
    }

    fn insert_extent(
        &mut self,
        node: i64,
        lo: u64,
        hi: u64,
        stored: &Stored,
    ) -> Result<(), StoreError> {
        if !self.extents_direct {
            self.extents
                .get_mut()
                .put(node, lo, Some((hi, stored.clone())));
            return Ok(());
        }
        let mut stmt = self.db.prepare_cached(
            "INSERT OR REPLACE INTO extents (node, lo, hi, seg, seg_off, blob, blob_end, inline)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )?;
        match stored {
            Stored::Segment(piece) => stmt.execute(params![
                node,
                lo as i64,
                hi as i64,
                piece.seg,
                piece.seg_off as i64,
                piece.blob as i64,
                piece.blob_end as i64,
                None::<Vec<u8>>
            ])?,
            Stored::Inline(data) => stmt.execute(params![
                node, lo as i64, hi as i64, INLINE_SEG, 0i64, 0i64, 0i64, data
            ])?,
        };
        Ok(())
    }

    /// Node `node` no longer references the segment range `[offset, offset + len)`, which it
    /// held at object offset `lo`: free what no other node (a snapshot's clone, or the head a
    /// removed snapshot's clone shared with) still references. Only the shared parts stay:
    /// freeing nothing when any byte was shared left, for example, a whole 4 MiB write
    /// allocated after its snapshot went away because the head still used 32 bytes of it.
    fn note_dead(
        &mut self,
        node: i64,
        lo: u64,
        (seg, offset, len): (u32, u64, u64),
    ) -> Result<(), StoreError> {
        if !self.clones_may_exist {
            self.frees_pending.push((seg, offset, len));
            return Ok(());
        }
        let end = offset + len;
        let mut live = self.shared_parts(node, lo, (seg, offset, len))?;
        live.sort_unstable();
        let mut at = offset;
        for (lo, hi) in live {
            if lo > at {
                self.frees_pending.push((seg, at, lo - at));
            }
            at = at.max(hi);
        }
        if at < end {
            self.frees_pending.push((seg, at, end - at));
        }
        Ok(())
    }

    /// The parts of the segment range `[offset, offset + len)`, which `node` referenced at
    /// object offset `lo`, that other nodes still reference (unordered, may overlap).
    ///
    /// Nodes share segment bytes only by copying rows (`copy_node`: a snapshot's clone, a
    /// rollback to one), between nodes of one object, and every later change of a row keeps
    /// each byte at its object offset: so only the other nodes of the object, at the same
    /// object range, can hold them (looked up by their key, with no index by place).
    fn shared_parts(
        &self,
        node: i64,
        lo: u64,
        (seg, offset, len): (u32, u64, u64),
    ) -> Result<Vec<(u64, u64)>, StoreError> {
        let others: Vec<i64> = self
            .db
            // In two halves, each in its own partial index (`head_by_name`, `clone_by_name`):
            // SQLite uses a partial index only for a query whose terms imply its condition,
            // so `name = ?` alone read the whole table, once per dead range of a write to an
            // object with clones (writes after a snapshot, rollbacks and snapshot removals
            // took time growing with the square of the objects: 4 s for 4000).
            .prepare_cached(OTHER_NODES_OF_OBJECT)?
            .query_map([node], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let mut parts = Vec::new();
        for other in others {
            for (e_lo, e_hi, stored) in self.lookup_extents(other, lo, lo + len)? {
                let Stored::Segment(piece) = stored else {
                    continue;
                };
                if piece.seg != seg {
                    continue;
                }
                // Where the part of the other extent inside `[lo, lo + len)` is, intersected
                // with the dead range by place (not assuming the offsets line up).
                let from = e_lo.max(lo);
                let start = piece.seg_off + (from - e_lo);
                let stop = start + (e_hi.min(lo + len) - from);
                let (start, stop) = (start.max(offset), stop.min(offset + len));
                if start < stop {
                    parts.push((start, stop));
                }
            }
        }
        Ok(parts)
    }

    fn delete_node(&mut self, node: i64) -> Result<(), StoreError> {
        self.dirty_heads.borrow_mut().remove(&node);
        self.omap.borrow_mut().drop_node(node);
        self.cut_extents(node, 0, u64::MAX >> 1)?;
        self.db
            .execute("DELETE FROM omap WHERE node = ?1", [node])?;
        self.db.execute("DELETE FROM nodes WHERE id = ?1", [node])?;
        Ok(())
    }

    /// Apply `op` to the object whose head is `head`. With `appended`, the data of its
    /// non-empty `Write`/`WriteFull` steps longer than `INLINE_MAX`, in order, is already in
    /// the segments there (one or more pieces per step, in order).
    fn write(
        &mut self,
        object: &ObjectName,
        op: &WriteOp,
        mut head: Option<Node>,
        appended: Option<Vec<Vec<Piece>>>,
    ) -> Result<WriteOutcome, StoreError> {
        if op.steps.iter().any(changes_whole_node_omap) {
            self.write_back_omap()?;
        }
        let seq = op.snap_context.as_ref().map_or(0, |c| c.seq);
        let mut appended = appended.map(Vec::into_iter);
        let mut append = |segments: &mut Box<dyn Segments>,
                          data: &[u8]|
         -> Result<Vec<Stored>, StoreError> {
            if data.len() <= INLINE_MAX {
                return Ok(vec![Stored::Inline(data.to_vec())]);
            }
            let pieces = match appended.as_mut() {
                Some(pieces) => pieces.next().ok_or_else(|| {
                    StoreError::Database("an operation's data was not appended in advance".into())
                })?,
                None => segments
                    .place(data)?
                    .into_iter()
                    .map(Piece::placed)
                    .collect(),
            };
            Ok(pieces.into_iter().map(Stored::Segment).collect())
        };
        let mutates = op
            .steps
            .iter()
            .any(|s| !matches!(s, WriteStep::AssertExists | WriteStep::AssertVersion(_)));
        if let (Some(h), Some(context), true) = (head.as_mut(), op.snap_context.as_ref(), mutates) {
            self.preserve_for_snapshots(object, h, context)?;
        }
        let mut changed = false;
        for step in &op.steps {
            match step {
                WriteStep::CreateExclusive => {
                    if head.is_some() {
                        return Err(StoreError::Exists {
                            object: object.to_string(),
                        });
                    }
                    head = Some(self.create_head(object, seq)?);
                    changed = true;
                }
                WriteStep::AssertExists => {
                    if head.is_none() {
                        return Err(not_found(object));
                    }
                }
                WriteStep::AssertVersion(expected) => {
                    let h = head.as_ref().ok_or_else(|| not_found(object))?;
                    if h.version != *expected {
                        return Err(StoreError::VersionMismatch {
                            object: object.to_string(),
                            expected: *expected,
                            actual: h.version,
                        });
                    }
                }
                WriteStep::Write { offset, data } => {
                    check_range(object, *offset, data.len() as u64)?;
                    let h = match head.as_mut() {
                        Some(h) => h,
                        None => head.insert(self.create_head(object, seq)?),
                    };
                    let end = offset + data.len() as u64;
                    if !data.is_empty() {
                        let stored = append(&mut self.segments, data)?;
                        let node = h.id;
                        let replaced = match stored.as_slice() {
                            [Stored::Inline(bytes)] => {
                                self.replace_inline(node, *offset, end, bytes)?
                            }
                            _ => false,
                        };
                        if !replaced {
                            let overlapping = self.lookup_extents(node, *offset, end)?;
                            let patched = match (stored.as_slice(), overlapping.as_slice()) {
                                ([Stored::Inline(bytes)], [(e_lo, e_hi, Stored::Inline(old))])
                                    if *e_lo <= *offset && end <= *e_hi =>
                                {
                                    let (e_lo, e_hi, old) = (*e_lo, *e_hi, old.clone());
                                    self.patch_inline(
                                        node,
                                        (e_lo, e_hi),
                                        &old,
                                        *offset - e_lo,
                                        bytes,
                                    )?;
                                    true
                                }
                                ([Stored::Segment(new)], [(e_lo, e_hi, Stored::Segment(old))])
                                    if *e_lo == *offset && end == *e_hi =>
                                {
                                    self.repoint_extent(node, (*offset, end), new)?;
                                    self.note_dead(
                                        node,
                                        *e_lo,
                                        (old.seg, old.seg_off, end - offset),
                                    )?;
                                    true
                                }
                                _ => false,
                            };
                            if !patched {
                                self.cut_found(node, *offset, end, true, overlapping)?;
                                self.insert_extents(node, *offset, &stored)?;
                            }
                        }
                    }
                    h.size = h.size.max(end);
                    changed = true;
                }
                WriteStep::WriteFull(data) => {
                    check_range(object, 0, data.len() as u64)?;
                    let h = match head.as_mut() {
                        Some(h) => h,
                        None => head.insert(self.create_head(object, seq)?),
                    };
                    let node = h.id;
                    let appended = if data.is_empty() {
                        None
                    } else {
                        Some(append(&mut self.segments, data)?)
                    };
                    self.cut_extents(node, 0, u64::MAX >> 1)?;
                    if let Some(stored) = appended {
                        self.insert_extents(node, 0, &stored)?;
                    }
                    h.size = data.len() as u64;
                    changed = true;
                }
                WriteStep::Zero { offset, len } => {
                    check_range(object, *offset, *len)?;
                    let h = head.as_mut().ok_or_else(|| not_found(object))?;
                    let node = h.id;
                    self.cut_extents(node, *offset, offset + len)?;
                    changed = true;
                }
                WriteStep::Truncate(size) => {
                    check_range(object, *size, 0)?;
                    let h = match head.as_mut() {
                        Some(h) => h,
                        None => head.insert(self.create_head(object, seq)?),
                    };
                    let node = h.id;
                    self.cut_extents(node, *size, u64::MAX >> 1)?;
                    h.size = *size;
                    changed = true;
                }
                WriteStep::Remove => {
                    let h = head.take().ok_or_else(|| not_found(object))?;
                    self.delete_node(h.id)?;
                    changed = true;
                }
                WriteStep::OmapSet(pairs) => {
                    let h = match head.as_mut() {
                        Some(h) => h,
                        None => head.insert(self.create_head(object, seq)?),
                    };
                    let node = h.id;
                    let mut omap = self.omap.borrow_mut();
                    for (key, value) in pairs {
                        omap.set(node, OmapKey::new(key), value.to_vec());
                    }
                    changed = true;
                }
                WriteStep::OmapRemoveKeys(keys) => {
                    let h = head.as_ref().ok_or_else(|| not_found(object))?;
                    let mut omap = self.omap.borrow_mut();
                    for key in keys {
                        omap.remove(h.id, OmapKey::new(key));
                    }
                    changed = true;
                }
                WriteStep::OmapRemoveRange { start, end } => {
                    let h = head.as_ref().ok_or_else(|| not_found(object))?;
                    self.omap
                        .borrow_mut()
                        .forget_in_operation(h.id, Some((start, end)));
                    self.db.execute(
                        "DELETE FROM omap WHERE node = ?1 AND key >= ?2 AND key < ?3",
                        params![h.id, start, end],
                    )?;
                    changed = true;
                }
                WriteStep::OmapClear => {
                    let h = head.as_ref().ok_or_else(|| not_found(object))?;
                    self.omap.borrow_mut().forget_in_operation(h.id, None);
                    self.db
                        .execute("DELETE FROM omap WHERE node = ?1", params![h.id])?;
                    changed = true;
                }
                WriteStep::Rollback(snap) => {
                    let target = self.node_at(object, *snap)?;
                    match (target, head.as_mut()) {
                        // Unchanged since the snapshot: nothing to do.
                        (Some(t), Some(h)) if t.id == h.id => {}
                        (Some(t), current) => {
                            let h = match current {
                                Some(h) => h,
                                None => head.insert(self.create_head(object, seq)?),
                            };
                            let node = h.id;
                            self.cut_extents(node, 0, u64::MAX >> 1)?;
                            self.omap.borrow_mut().forget_in_operation(node, None);
                            self.db
                                .execute("DELETE FROM omap WHERE node = ?1", [node])?;
                            self.copy_node(t.id, node)?;
                            h.size = t.size;
                        }
                        (None, Some(h)) => {
                            let id = h.id;
                            head = None;
                            self.delete_node(id)?;
                        }
                        (None, None) => {}
                    }
                    changed = true;
                }
            }
        }
        let version = match (changed, head.as_mut()) {
            (true, Some(h)) => {
                h.version = self.next_version();
                self.update_head(object, *h);
                h.version
            }
            (false, Some(h)) => {
                self.cache_head(object, Some(*h));
                h.version
            }
            (_, None) => {
                self.cache_head(object, None);
                0
            }
        };
        Ok(WriteOutcome { version })
    }

    fn read(&mut self, object: &ObjectName, op: &ReadOp) -> Result<Vec<ReadResult>, StoreError> {
        self.read_with_node(object, op).map(|(results, _)| results)
    }

    /// A read, and the node it read: (id, version).
    fn read_with_node(
        &mut self,
        object: &ObjectName,
        op: &ReadOp,
    ) -> Result<(Vec<ReadResult>, (i64, u64)), StoreError> {
        let node = match op.snap {
            Some(snap) => self.node_at(object, snap)?,
            None => self.head(object)?,
        }
        .ok_or_else(|| not_found(object))?;
        let mut results = Vec::with_capacity(op.steps.len());
        for step in &op.steps {
            results.push(match step {
                ReadStep::Stat => ReadResult::Stat(Stat {
                    size: node.size,
                    version: node.version,
                }),
                ReadStep::Read { offset, len } => {
                    ReadResult::Extents(self.read_extents(&node, *offset, *len)?)
                }
                ReadStep::OmapGetByKeys(keys) => {
                    let omap = self.omap.borrow();
                    let mut stmt = self
                        .db
                        .prepare_cached("SELECT value FROM omap WHERE node = ?1 AND key = ?2")?;
                    let mut found = Vec::new();
                    for key in keys {
                        match omap.get(node.id, key) {
                            Lookup::Value(value) => {
                                found.push((key, value.to_vec()));
                                continue;
                            }
                            Lookup::Removed => continue,
                            Lookup::Unknown => {}
                        }
                        if let Some(value) = stmt
                            .query_row(params![node.id, key], |r| r.get::<_, Vec<u8>>(0))
                            .optional()?
                        {
                            found.push((key, value));
                        }
                    }
                    found.sort();
                    found.dedup_by(|a, b| a.0 == b.0);
                    ReadResult::Omap {
                        pairs: found.into(),
                        more: false,
                    }
                }
                ReadStep::OmapGetRange { start, end, max } => {
                    // One more than asked tells whether there is more; SQLite reads a negative
                    // LIMIT as none (a `max` past i64, such as usize::MAX, means all).
                    let limit = i64::try_from(*max).map_or(-1, |m| m.saturating_add(1));
                    // The changes held in memory in the range go over SQLite's rows; as many
                    // more rows as they remove are read, so that the first `max + 1` that
                    // remain are all among those read.
                    let omap = self.omap.borrow();
                    let mut held = omap.range(node.id, start, end.as_deref()).peekable();
                    let removed = omap
                        .range(node.id, start, end.as_deref())
                        .filter(|(_, value)| value.is_none())
                        .count();
                    let limit = match limit {
                        -1 => -1,
                        limit => limit.saturating_add(removed as i64),
                    };
                    let mut stmt = match end {
                        Some(_) => self.db.prepare_cached(
                            "SELECT key, value FROM omap WHERE node = ?1 AND key >= ?2
                             AND key < ?3 ORDER BY key LIMIT ?4",
                        )?,
                        None => self.db.prepare_cached(
                            "SELECT key, value FROM omap WHERE node = ?1 AND key >= ?2
                             ORDER BY key LIMIT ?3",
                        )?,
                    };
                    let mut rows = match end {
                        Some(end) => stmt.query(params![node.id, start, end, limit])?,
                        None => stmt.query(params![node.id, start, limit])?,
                    };
                    // Each row's key and value copied straight into the one buffer of the
                    // pairs, not into two allocations of its own.
                    let mut pairs = OmapPairs::new();
                    let mut more = false;
                    'merge: loop {
                        let row = rows.next()?;
                        let row_key = row.map(|row| blob_at(row, 0)).transpose()?;
                        // Held changes of keys before this row's (all of them after the last).
                        while let Some(&(key, value)) = held.peek() {
                            if row_key.is_some_and(|row_key| key >= row_key) {
                                break;
                            }
                            held.next();
                            if let Some(value) = value {
                                if pairs.len() == *max {
                                    more = true;
                                    break 'merge;
                                }
                                pairs.push(key, value);
                            }
                        }
                        let (Some(row), Some(row_key)) = (row, row_key) else {
                            break;
                        };
                        let value = match held.peek() {
                            Some(&(key, changed)) if key == row_key => {
                                held.next();
                                match changed {
                                    Some(value) => value,
                                    None => continue,
                                }
                            }
                            _ => blob_at(row, 1)?,
                        };
                        if pairs.len() == *max {
                            more = true;
                            break;
                        }
                        pairs.push(row_key, value);
                    }
                    ReadResult::Omap { pairs, more }
                }
            });
        }
        Ok((results, (node.id, node.version)))
    }

    /// Ask the segments for the bytes of `pieces` (extent rows of a read of `[offset, end)`)
    /// that live in segments.
    fn prefetch_pieces(&self, pieces: &[ExtentRow], offset: u64, end: u64) {
        for &(lo, hi, seg, seg_off, _) in pieces {
            if seg != INLINE_SEG {
                let from = lo.max(offset);
                let to = hi.min(end);
                self.segments
                    .prefetch(seg as u32, seg_off + (from - lo), to - from);
            }
        }
    }

    fn read_extents(&self, node: &Node, offset: u64, len: u64) -> Result<Vec<Extent>, StoreError> {
        let end = node.size.min(offset.saturating_add(len));
        if offset >= end {
            return Ok(Vec::new());
        }
        // Without the `inline` column (a read-only open of a store from before inline
        // extents) there are no inline extents.
        let sql = match self.inline_column {
            true => READ_EXTENTS,
            false => READ_EXTENTS_WITHOUT_INLINE,
        };
        let pieces: Vec<ExtentRow> = if self.extents.borrow().holds_node(node.id) {
            self.lookup_extents(node.id, offset, end)?
                .into_iter()
                .map(|(lo, hi, stored)| match stored {
                    Stored::Segment(p) => (lo, hi, i64::from(p.seg), p.seg_off, None),
                    Stored::Inline(data) => (lo, hi, INLINE_SEG, 0, Some(data)),
                })
                .collect()
        } else {
            self.db
                .prepare_cached(sql)?
                .query_map(params![node.id, end as i64, offset as i64], |r| {
                    Ok((
                        r.get::<_, i64>(0)? as u64,
                        r.get::<_, i64>(1)? as u64,
                        r.get::<_, i64>(2)?,
                        r.get::<_, i64>(3)? as u64,
                        r.get(4)?,
                    ))
                })?
                .collect::<Result<_, _>>()?
        };
        let mut out: Vec<Extent> = Vec::new();
        // Whether a piece had to come from the disk: then every later piece was asked for at
        // once (`prefetch`), so the disk works on them together instead of one by one. After
        // a `NoWait` pass every piece was asked for already.
        let mut cold = self.piece_reads.get() == PieceReads::Asked;
        for (i, &(lo, hi, seg, seg_off, ref inline)) in pieces.iter().enumerate() {
            let from = lo.max(offset);
            let to = hi.min(end);
            let data = match inline {
                Some(bytes) if seg == INLINE_SEG => {
                    let at = (from - lo) as usize;
                    bytes
                        .get(at..at + (to - from) as usize)
                        .ok_or_else(|| {
                            StoreError::Database(format!(
                                "an inline extent of {} bytes holds {} (damaged metadata)",
                                hi - lo,
                                bytes.len()
                            ))
                        })?
                        .to_vec()
                }
                _ if seg == INLINE_SEG => {
                    return Err(StoreError::Database(
                        "the store gained inline extents while open read-only: open it again"
                            .into(),
                    ))
                }
                _ => {
                    let mut data = vec![0u8; (to - from) as usize];
                    let at = seg_off + (from - lo);
                    let later = &pieces[i + 1..];
                    if self.piece_reads.get() == PieceReads::NoWait
                        && pieces.len() <= NOWAIT_PIECES_MAX
                    {
                        if !self.read_missed.get()
                            && !self.segments.read_cached(seg as u32, at, &mut data)?
                        {
                            self.read_missed.set(true);
                            self.segments.prefetch(seg as u32, at, to - from);
                            self.prefetch_pieces(later, offset, end);
                        }
                    } else if cold
                        || later.is_empty()
                        || !self.segments.read_cached(seg as u32, at, &mut data)?
                    {
                        if !cold && !later.is_empty() {
                            cold = true;
                            self.prefetch_pieces(later, offset, end);
                        }
                        self.segments.read(seg as u32, at, &mut data)?;
                    }
                    data
                }
            };
            match out.last_mut() {
                Some(prev) if prev.offset + prev.data.len() as u64 == from => {
                    prev.data.extend_from_slice(&data)
                }
                _ => out.push(Extent { offset: from, data }),
            }
        }
        Ok(out)
    }

    fn list(&self, prefix: &str, snap: Option<SnapId>) -> Result<Vec<ObjectName>, StoreError> {
        // Names are printable ASCII (< 0x7f), so prefix + DEL bounds every name with the prefix.
        let upper = format!("{prefix}\u{7f}");
        let Some(snap) = snap else {
            let names: Vec<String> = self
                .db
                .prepare_cached(
                    "SELECT name FROM nodes WHERE clone_to IS NULL AND name >= ?1 AND name < ?2
                     ORDER BY name",
                )?
                .query_map(params![prefix, upper], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            return names.into_iter().map(ObjectName::new).collect();
        };
        // At a snapshot: every object with a head or a preserved state is a candidate, and
        // `node_at` (what a read at the snapshot goes by) decides.
        let candidates: Vec<String> = self
            .db
            .prepare_cached(
                "SELECT DISTINCT name FROM nodes WHERE name >= ?1 AND name < ?2 ORDER BY name",
            )?
            .query_map(params![prefix, upper], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let mut out = Vec::new();
        for name in candidates {
            let name = ObjectName::new(name)?;
            if self.node_at(&name, snap)?.is_some() {
                out.push(name);
            }
        }
        // A snapshot that does not exist is refused even when no object is a candidate.
        if out.is_empty() {
            self.check_snap_live(snap)?;
        }
        Ok(out)
    }

    fn snap_create(&mut self) -> Result<SnapId, StoreError> {
        let mut id = self.bump_meta("snap_seq")?;
        if id <= self.snap_ids_issued.get() {
            id = self.snap_ids_issued.get() + 1;
            self.db
                .prepare_cached("UPDATE meta SET value = ?1 WHERE key = 'snap_seq'")?
                .execute([id as i64])?;
        }
        self.snap_ids_issued.set(id);
        self.db
            .execute("INSERT INTO snaps (id) VALUES (?1)", [id as i64])?;
        Ok(id)
    }

    fn snap_remove(&mut self, snap: SnapId) -> Result<(), StoreError> {
        if self
            .db
            .execute("DELETE FROM snaps WHERE id = ?1", [snap as i64])?
            == 0
        {
            return Err(StoreError::NoSuchSnapshot(snap));
        }
        // Clones that covered the snapshot and no other live one are dead.
        let dead: Vec<i64> = self
            .db
            .prepare(
                "SELECT n.id FROM nodes n WHERE n.clone_to IS NOT NULL
                 AND n.clone_from < ?1 AND n.clone_to >= ?1
                 AND NOT EXISTS (SELECT 1 FROM snaps s WHERE s.id > n.clone_from AND s.id <= n.clone_to)",
            )?
            .query_map([snap as i64], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        for node in dead {
            self.delete_node(node)?;
        }
        Ok(())
    }

    fn purge_expired_locks(&self, object: &ObjectName, lock: &str) -> Result<(), StoreError> {
        self.db.execute(
            "DELETE FROM locks WHERE name = ?1 AND lock = ?2 AND expires_ms IS NOT NULL
             AND expires_ms <= ?3",
            params![object.as_str(), lock, now_ms()],
        )?;
        Ok(())
    }

    fn lock(
        &mut self,
        object: &ObjectName,
        client: &str,
        request: &LockRequest,
    ) -> Result<(), StoreError> {
        self.purge_expired_locks(object, &request.name)?;
        let mut holders = self.lockers(object, &request.name)?;
        if let Some(h) = holders.first().filter(|h| h.client != client) {
            let key = (
                object.as_str().to_owned(),
                request.name.clone(),
                h.client.clone(),
                h.cookie.clone(),
            );
            if self.orphaned_locks.remove(&key) {
                tracing::warn!(
                    object = %object,
                    lock = %request.name,
                    holder = %h.client,
                    "released lock `{}` on `{object}` left behind by {} ({}), whose opening \
                     of the store ended without unlocking (the process was killed or crashed): \
                     this process is the store's only writer now",
                    request.name,
                    h.client,
                    h.description
                );
                self.db.execute(
                    "DELETE FROM locks WHERE name = ?1 AND lock = ?2 AND client = ?3 AND cookie = ?4",
                    params![object.as_str(), request.name, h.client, h.cookie],
                )?;
                holders = self.lockers(object, &request.name)?;
            }
        }
        let expires = request
            .duration
            .map(|d| now_ms().saturating_add(d.as_millis() as i64));
        match holders.first() {
            Some(h) if request.renew && h.client == client && h.cookie == request.cookie => {
                // While the log cannot be checkpointed, renewals store rarely
                // (`SHORT_RENEWAL_STRETCH`).
                let expires = match (self.autocheckpoint_held, request.duration) {
                    (Some(_), Some(duration)) => {
                        let left = h.expires_in.unwrap_or(Duration::MAX);
                        if left >= duration && h.description == request.description {
                            return Ok(());
                        }
                        let more = duration
                            .as_millis()
                            .saturating_mul(SHORT_RENEWAL_STRETCH - 1);
                        expires.map(|e| e.saturating_add(i64::try_from(more).unwrap_or(i64::MAX)))
                    }
                    _ => expires,
                };
                self.db.execute(
                    "UPDATE locks SET expires_ms = ?5, description = ?6
                     WHERE name = ?1 AND lock = ?2 AND client = ?3 AND cookie = ?4",
                    params![
                        object.as_str(),
                        request.name,
                        client,
                        request.cookie,
                        expires,
                        request.description
                    ],
                )?;
                Ok(())
            }
            Some(h) => Err(StoreError::Busy {
                object: object.to_string(),
                lock: request.name.clone(),
                holder: format!("{} (cookie `{}`)", h.client, h.cookie),
            }),
            None if request.renew => Err(StoreError::NotLocked {
                object: object.to_string(),
                lock: request.name.clone(),
                client: client.to_owned(),
                cookie: request.cookie.clone(),
            }),
            None => {
                self.db.execute(
                    "INSERT INTO locks (name, lock, client, cookie, description, expires_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    params![
                        object.as_str(),
                        request.name,
                        client,
                        request.cookie,
                        request.description,
                        expires
                    ],
                )?;
                Ok(())
            }
        }
    }

    fn unlock(
        &mut self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        self.purge_expired_locks(object, lock)?;
        let removed = self.db.execute(
            "DELETE FROM locks WHERE name = ?1 AND lock = ?2 AND client = ?3 AND cookie = ?4",
            params![object.as_str(), lock, client, cookie],
        )?;
        if removed == 0 {
            return Err(StoreError::NotLocked {
                object: object.to_string(),
                lock: lock.to_owned(),
                client: client.to_owned(),
                cookie: cookie.to_owned(),
            });
        }
        Ok(())
    }

    fn lockers(&self, object: &ObjectName, lock: &str) -> Result<Vec<Locker>, StoreError> {
        let now = now_ms();
        let lockers = self
            .db
            .prepare_cached(
                "SELECT client, cookie, description, expires_ms FROM locks
                 WHERE name = ?1 AND lock = ?2 AND (expires_ms IS NULL OR expires_ms > ?3)
                 ORDER BY client, cookie",
            )?
            .query_map(params![object.as_str(), lock, now], |r| {
                let expires: Option<i64> = r.get(3)?;
                Ok(Locker {
                    client: r.get(0)?,
                    cookie: r.get(1)?,
                    description: r.get(2)?,
                    expires_in: expires.map(|e| Duration::from_millis((e - now).max(0) as u64)),
                    address: None,
                })
            })?
            .collect::<Result<_, _>>()?;
        Ok(lockers)
    }
}

/// A handle that sends requests to an engine's worker and awaits the replies. Cloned per
/// client; the worker stops when the last handle is dropped.
#[derive(Clone)]
pub(crate) struct EngineHandle {
    sender: mpsc::Sender<Request>,
    /// The engine's count of lost transactions.
    losses: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Start the worker thread for `engine`.
    pub(crate) fn spawn(
        engine: Engine,
        name: &str,
    ) -> Result<(Self, std::thread::JoinHandle<()>), StoreError> {
        let (sender, receiver) = mpsc::channel();
        let losses = engine.losses.clone();
        let worker = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || engine.run(receiver))
            .map_err(StoreError::io("starting the store worker thread"))?;
        Ok((EngineHandle { sender, losses }, worker))
    }

    /// Send a request without awaiting a reply (false if the worker is gone).
    pub(crate) fn send(&self, request: Request) -> bool {
        self.sender.send(request).is_ok()
    }

    pub(crate) async fn call<T>(
        &self,
        make: impl FnOnce(Reply<T>) -> Request,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .send(make(reply))
            .map_err(|_| StoreError::Closed("the worker thread is gone".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Closed("the worker dropped the request".into()))?
    }
}

/// One client of an engine: what the backends hand out. Dropping the last client stops the
/// worker after a final durable commit.
#[derive(Clone)]
pub(crate) struct Client {
    pub(crate) handle: EngineHandle,
    pub(crate) id: String,
    pub(crate) _life: std::sync::Arc<Lifetime>,
}

/// What must outlive the worker: joined (final commit done) before anything else is dropped.
pub(crate) struct Lifetime {
    worker: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Resources released after the worker stopped (the local store's directory lock).
    pub(crate) _after: Box<dyn std::any::Any + Send + Sync>,
}

impl Lifetime {
    pub(crate) fn new(
        worker: std::thread::JoinHandle<()>,
        after: Box<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        Lifetime {
            worker: std::sync::Mutex::new(Some(worker)),
            _after: after,
        }
    }
}

impl Drop for Lifetime {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.lock().ok().and_then(|mut w| w.take()) {
            let _ = worker.join();
        }
    }
}

impl Client {
    /// Another client identity on the same store (another "process" for locks).
    pub(crate) fn another(&self, id: String) -> Client {
        Client {
            handle: self.handle.clone(),
            id,
            _life: self._life.clone(),
        }
    }
}

pub(crate) fn random_client_id(kind: &str) -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::getrandom(&mut b);
    format!("{kind}.{}.{}", std::process::id(), hex::encode(b))
}

#[async_trait::async_trait]
impl crate::ObjectStore for Client {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        let object = object.clone();
        self.handle
            .call(|reply| Request::Write { object, op, reply })
            .await
    }

    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        let object = object.clone();
        self.handle
            .call(|reply| Request::Read { object, op, reply })
            .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
        let prefix = prefix.to_owned();
        self.handle
            .call(|reply| Request::List {
                prefix,
                snap: None,
                reply,
            })
            .await
    }

    async fn list_at(&self, prefix: &str, snap: SnapId) -> Result<Vec<ObjectName>, StoreError> {
        let prefix = prefix.to_owned();
        self.handle
            .call(|reply| Request::List {
                prefix,
                snap: Some(snap),
                reply,
            })
            .await
    }

    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        self.handle
            .call(|reply| Request::SnapCreate { reply })
            .await
    }

    fn lost_transactions(&self) -> Option<u64> {
        Some(self.handle.losses.load(Ordering::Acquire))
    }

    async fn snap_remove(&self, snap: SnapId) -> Result<(), StoreError> {
        self.handle
            .call(|reply| Request::SnapRemove { snap, reply })
            .await
    }

    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError> {
        let object = object.clone();
        let client = self.id.clone();
        self.handle
            .call(|reply| Request::Lock {
                object,
                client,
                request,
                reply,
            })
            .await
    }

    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let (object, lock, cookie, client) = (
            object.clone(),
            lock.to_owned(),
            cookie.to_owned(),
            self.id.clone(),
        );
        self.handle
            .call(|reply| Request::Unlock {
                object,
                lock,
                client,
                cookie,
                reply,
            })
            .await
    }

    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError> {
        let (object, lock) = (object.clone(), lock.to_owned());
        self.handle
            .call(|reply| Request::ListLockers {
                object,
                lock,
                reply,
            })
            .await
    }

    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let (object, lock, client, cookie) = (
            object.clone(),
            lock.to_owned(),
            client.to_owned(),
            cookie.to_owned(),
        );
        self.handle
            .call(|reply| Request::Unlock {
                object,
                lock,
                client,
                cookie,
                reply,
            })
            .await
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.handle
            .call(|reply| Request::Flush {
                reply,
                reclaim: false,
            })
            .await
    }

    fn client_id(&self) -> &str {
        &self.id
    }

    fn write_unit(&self) -> u64 {
        SMALL_WRITE_UNIT
    }
}

/// Implement [`crate::ObjectStore`] for a backend newtype over [`Client`].
macro_rules! delegate_object_store {
    ($backend:ty) => {
        // Field 0 of the backend newtype is its engine client.
        $crate::object_store_forwarding_to_inner!(impl[] $backend, 0 {
            async fn write_op(
                &self,
                object: &$crate::ObjectName,
                op: $crate::WriteOp,
            ) -> Result<$crate::WriteOutcome, $crate::StoreError> {
                self.0.write_op(object, op).await
            }
            async fn read_op(
                &self,
                object: &$crate::ObjectName,
                op: $crate::ReadOp,
            ) -> Result<Vec<$crate::ReadResult>, $crate::StoreError> {
                self.0.read_op(object, op).await
            }
            fn write_unit(&self) -> u64 {
                self.0.write_unit()
            }
        });
    };
}
pub(crate) use delegate_object_store;

/// Merge ranges `(segment, from, to)`, sorted, that overlap or touch, in place.
fn merge_touching(ranges: &mut Vec<(u32, u64, u64)>) {
    let mut kept: usize = 0;
    for at in 0..ranges.len() {
        let (segment, from, to) = ranges[at];
        if let Some((s, _, end)) = kept.checked_sub(1).map(|last| &mut ranges[last]) {
            if *s == segment && from <= *end {
                *end = (*end).max(to);
                continue;
            }
        }
        ranges[kept] = (segment, from, to);
        kept += 1;
    }
    ranges.truncate(kept);
}

/// Say at debug level how many held changes were written back, and how long it took.
fn log_written_back(count: usize, started: Instant, what: &str) {
    tracing::debug!(count, ms = started.elapsed().as_secs_f64() * 1e3, "{what}");
}

/// Store a transaction's row of changes in the pending-changes table `table`, unless it has
/// none; whether it was stored.
///
/// The row is inserted as zeros and its changes written into it as a blob: bound as a
/// parameter, SQLite copied them into a fresh allocation and then again into the record it
/// builds, two copies of tens of megabytes per 2 s commit under random 4 KiB writes, into
/// memory the kernel had to fault in and clear first (8.6% of the server's samples).
fn store_pending_row(
    db: &Connection,
    table: &str,
    row: u64,
    changes: &[u8],
) -> Result<bool, StoreError> {
    if changes.is_empty() {
        return Ok(false);
    }
    db.prepare_cached(&format!(
        "INSERT INTO {table} (seq, changes) VALUES (?1, zeroblob(?2))"
    ))?
    .execute(params![row as i64, changes.len() as i64])?;
    // `seq` is the table's rowid (INTEGER PRIMARY KEY).
    let mut blob = db.blob_open(rusqlite::MAIN_DB, table, "changes", row as i64, false)?;
    blob.write_at(changes, 0)?;
    blob.close()?;
    Ok(true)
}

/// Delete `rows` (no longer needed) from the pending-changes table `table`.
fn delete_pending_rows(db: &Connection, table: &str, rows: Vec<u64>) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut stmt = db.prepare_cached(&format!("DELETE FROM {table} WHERE seq = ?1"))?;
    for row in rows {
        stmt.execute([row as i64])?;
    }
    Ok(())
}

/// The number of the last row ever stored in the pending-changes table `table` (0 if none).
fn rows_stored(db: &Connection, table: &str) -> Result<i64, StoreError> {
    Ok(db
        .prepare_cached("SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = ?1")?
        .query_row([table], |r| r.get(0))?)
}

/// Whether a row of the pending-changes table `table` numbered above `seen` was stored and
/// deleted again (see `Engine::follow_omap_pending`). Rows are numbered one after the other;
/// a number skipped (a transaction that stored its row and was then lost) looks the same, and
/// costs the reader a replay it did not need.
fn rows_missed(db: &Connection, table: &str, seen: i64) -> Result<bool, StoreError> {
    if rows_stored(db, table)? <= seen {
        return Ok(false);
    }
    let next: Option<i64> = db
        .prepare_cached(&format!("SELECT min(seq) FROM {table} WHERE seq > ?1"))?
        .query_row([seen], |r| r.get(0))?;
    Ok(next != Some(seen + 1))
}

/// Call `each` with every row of the pending-changes table `table` (`omap_pending`,
/// `extents_pending`) numbered above `after`, oldest first; the last row's number (`after`
/// if none).
fn each_pending_row(
    db: &Connection,
    table: &str,
    after: i64,
    mut each: impl FnMut(u64, &[u8]) -> Result<(), StoreError>,
) -> Result<i64, StoreError> {
    let mut stmt = db.prepare_cached(&format!(
        "SELECT seq, changes FROM {table} WHERE seq > ?1 ORDER BY seq"
    ))?;
    let mut rows = stmt.query([after])?;
    let mut last = after;
    while let Some(row) = rows.next()? {
        last = row.get(0)?;
        each(last as u64, blob_at(row, 1)?)?;
    }
    Ok(last)
}

fn blob_at<'row>(row: &'row rusqlite::Row<'_>, column: usize) -> rusqlite::Result<&'row [u8]> {
    let value = row.get_ref(column)?;
    value.as_blob().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(column, value.data_type(), Box::new(e))
    })
}

/// Whether a step reads or rewrites its node's omap in SQL as a whole, which needs every
/// held omap change written back first (see omap_overlay.rs).
fn changes_whole_node_omap(step: &WriteStep) -> bool {
    // Not `Remove`: the node goes with its omap, and its held changes are dropped (see
    // omap_overlay.rs).
    matches!(
        step,
        WriteStep::OmapRemoveRange { .. } | WriteStep::OmapClear | WriteStep::Rollback(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lookup `shared_parts` makes for every dead range of an object with clones goes
    /// through indexes only: a scan of `nodes` made writes after a snapshot, rollbacks and
    /// snapshot removals take time growing with the square of the image's objects.
    #[test]
    fn other_nodes_of_an_object_are_found_without_a_scan() {
        let db = Connection::open_in_memory().unwrap();
        db.execute_batch(SCHEMA).unwrap();
        let plan: Vec<String> = db
            .prepare(&format!("EXPLAIN QUERY PLAN {OTHER_NODES_OF_OBJECT}"))
            .unwrap()
            .query_map([1], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            plan.iter().all(|step| !step.starts_with("SCAN")),
            "{plan:?}"
        );
        assert!(
            plan.iter().any(|step| step.contains("head_by_name"))
                && plan.iter().any(|step| step.contains("clone_by_name")),
            "{plan:?}"
        );
    }
    use crate::memory::MemorySegments;

    type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

    fn kv(key: &str, value: &str) -> (Vec<u8>, Vec<u8>) {
        (key.into(), value.into())
    }

    fn omap_range(
        engine: &mut Engine,
        object: &ObjectName,
        start: &str,
        end: Option<&str>,
        max: usize,
    ) -> (Pairs, bool) {
        let op = ReadOp::new().step(ReadStep::OmapGetRange {
            start: start.into(),
            end: end.map(Into::into),
            max,
        });
        match engine.read(object, &op).unwrap().pop() {
            Some(ReadResult::Omap { pairs, more }) => (pairs.to_vec(), more),
            other => panic!("{other:?}"),
        }
    }

    /// An engine on the database file `path` (kept across reopens) and fresh in-memory
    /// segments (data written to them is lost at a reopen: inline extents and omap are not).
    fn engine_on_file(path: &std::path::Path) -> Engine {
        let db = Connection::open(path).unwrap();
        let segments = Box::<MemorySegments>::default();
        Engine::new(db, segments, Arc::new(NoDurability)).unwrap()
    }

    fn omap_of(engine: &mut Engine, object: &ObjectName) -> Pairs {
        omap_range(engine, object, "", None, usize::MAX).0
    }

    fn rows_of(db: &Connection, table: &str) -> i64 {
        db.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap()
    }

    fn rows(engine: &Engine, table: &str) -> i64 {
        engine
            .db
            .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap()
    }

    /// A write, truncate or zero over an inline extent whose stored bytes do not fill its
    /// range (damaged metadata) fails with an error naming it, as a read does. It panicked
    /// the worker thread, which took the open transaction with it without counting a loss.
    #[test]
    fn a_damaged_inline_extent_fails_writes_over_it_without_a_panic() {
        let db = Connection::open_in_memory().unwrap();
        let mut engine =
            Engine::new(db, Box::<MemorySegments>::default(), Arc::new(NoDurability)).unwrap();
        let object = ObjectName::new("o").unwrap();
        engine
            .apply_write(&object, &WriteOp::new().write(0, vec![7u8; 100]))
            .unwrap();
        engine.write_back_extents().unwrap();
        engine.commit(false);
        let damaged = engine
            .db
            .execute("UPDATE extents SET inline = x'00' WHERE seg = -1", [])
            .unwrap();
        assert_eq!(damaged, 1);
        engine.forget_caches();
        for op in [
            WriteOp::new().write(10, b"x".to_vec()),
            WriteOp::new().step(WriteStep::Truncate(50)),
            WriteOp::new().step(WriteStep::Zero {
                offset: 20,
                len: 10,
            }),
        ] {
            let err = engine.apply_write(&object, &op).unwrap_err();
            assert!(err.to_string().contains("damaged metadata"), "{err}");
        }
    }

    fn in_memory_engine() -> Engine {
        let db = Connection::open_in_memory().unwrap();
        Engine::new(db, Box::<MemorySegments>::default(), Arc::new(NoDurability)).unwrap()
    }

    /// An operation that fails and takes the whole transaction with it (SQLite rolls back
    /// itself on SQLITE_FULL or SQLITE_IOERR, as here).
    fn whole_transaction_gone(e: &mut Engine) -> Result<(), StoreError> {
        e.db.execute_batch("ROLLBACK")?;
        Err(StoreError::Database("the disk is full (test)".into()))
    }

    /// An operation that fails and takes the whole transaction with it (SQLite rolls back by
    /// itself on SQLITE_FULL or SQLITE_IOERR) when it is the first since a commit loses
    /// nothing acknowledged: no loss is counted or reported. It was counted, and the image
    /// layer then refused every write of that open (`WritesLost`) although nothing was lost;
    /// a later one that follows acknowledged operations is still counted.
    #[test]
    fn a_failed_first_operation_after_a_commit_counts_no_loss() {
        let mut engine = in_memory_engine();
        assert!(engine.in_operation(false, whole_transaction_gone).is_err());
        assert_eq!(engine.losses.load(Ordering::Acquire), 0);
        assert!(engine.lost.is_none(), "{:?}", engine.lost);

        let object = ObjectName::new("o").unwrap();
        engine
            .apply_write(&object, &WriteOp::new().write(0, b"acknowledged".to_vec()))
            .unwrap();
        assert!(engine.in_operation(false, whole_transaction_gone).is_err());
        assert_eq!(engine.losses.load(Ordering::Acquire), 1);
        assert!(engine.lost.is_some());
    }

    /// Dead ranges whose widening failed (here: the read transaction could not begin) are
    /// dropped unpunched; the stop must not mark the store clean then, or the next open
    /// skips the search that finds them, and their space is never given back.
    #[test]
    fn dead_ranges_dropped_unpunched_leave_the_store_unclean() {
        let mut engine = in_memory_engine();
        assert!(!engine.frees_dropped);
        engine.frees_pending.extend([(0, 0, 4096), (0, 8192, 4096)]);
        engine.db.execute_batch("BEGIN").unwrap();
        assert!(engine.widened_frees().is_err());
        engine.db.execute_batch("ROLLBACK").unwrap();
        assert!(engine.frees_dropped, "dropped ranges not noted");
    }

    /// A snapshot id handed out in a transaction that is then lost is not handed out again:
    /// the stored counter went back with the transaction, and the next snapshot got the id a
    /// writer may still carry in its context (its clones then read as the new snapshot's).
    #[test]
    fn a_snapshot_id_of_a_lost_transaction_is_not_given_again() {
        let mut engine = in_memory_engine();
        let first = engine.in_operation(false, |e| e.snap_create()).unwrap();
        assert!(engine.in_operation(false, whole_transaction_gone).is_err());
        assert_eq!(engine.losses.load(Ordering::Acquire), 1);
        let second = engine.in_operation(false, |e| e.snap_create()).unwrap();
        assert!(second > first, "snapshot id {first} given twice ({second})");
        assert_eq!(engine.meta("snap_seq").unwrap(), second);
    }

    /// The wall clock stepped forward while a writer holds its lock (NTP stepping after
    /// boot, a restored VM): the next renewal keeps the lock. Before, the lock's expiry was
    /// judged by the wall clock, so the renewal found it expired and purged, failed with
    /// `NotLocked`, and the image refused every write until it was reopened.
    #[tokio::test]
    async fn a_wall_clock_stepped_forward_does_not_expire_a_held_lock() {
        use crate::{ObjectStore, ObjectStoreExt};
        let store = crate::MemoryStore::new().unwrap();
        let object = ObjectName::new("header").unwrap();
        store.write(&object, 0, b"h").await.unwrap();
        let request = LockRequest {
            name: "writer".into(),
            cookie: "c1".into(),
            description: "d".into(),
            duration: Some(Duration::from_secs(3)),
            renew: false,
        };
        store
            .lock_exclusive(&object, request.clone())
            .await
            .unwrap();
        let step = 60_000;
        WALL_CLOCK_STEP_MS.fetch_add(step, std::sync::atomic::Ordering::Relaxed);
        let renew = LockRequest {
            renew: true,
            ..request
        };
        let renewed = store.lock_exclusive(&object, renew).await;
        let lockers = store.list_lockers(&object, "writer").await;
        WALL_CLOCK_STEP_MS.fetch_sub(step, std::sync::atomic::Ordering::Relaxed);
        renewed.unwrap();
        assert_eq!(lockers.unwrap().len(), 1);
    }

    #[test]
    fn touching_ranges_merge_in_place_and_others_stay() {
        let mut ranges = vec![
            (1, 0, 10),
            (1, 10, 20),
            (1, 15, 18),
            (1, 30, 40),
            (2, 40, 50),
            (2, 45, 60),
            (3, 0, 1),
        ];
        merge_touching(&mut ranges);
        assert_eq!(ranges, [(1, 0, 20), (1, 30, 40), (2, 40, 60), (3, 0, 1)]);
        let mut none: Vec<(u32, u64, u64)> = Vec::new();
        merge_touching(&mut none);
        assert!(none.is_empty());
    }

    /// Extent changes wait in memory and in `extents_pending` (held_extents.rs): random
    /// writes (inline, partial blocks, whole blocks), zeroes and truncates read back as a
    /// model of the object says while held, after a write-back in pieces or whole, after a
    /// lost transaction (its own changes only), after an open that replays the rows (a stop
    /// without write-back) and after the writer-open write-back; and `referenced` sees the
    /// held extents' bytes.
    #[test]
    fn extent_changes_held_in_front_of_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let open = |segments: Box<dyn Segments>| {
            let db = Connection::open(&path).unwrap();
            Engine::new(db, segments, Arc::new(NoDurability)).unwrap()
        };
        let object = ObjectName::new("o").unwrap();
        let read_all = |engine: &mut Engine, size: usize| -> Vec<u8> {
            let op = ReadOp::new().step(ReadStep::Read {
                offset: 0,
                len: 1 << 20,
            });
            let mut out = vec![0u8; size];
            match engine.read(&object, &op).unwrap().pop() {
                Some(ReadResult::Extents(extents)) => {
                    for e in extents {
                        out[e.offset as usize..e.offset as usize + e.data.len()]
                            .copy_from_slice(&e.data);
                    }
                }
                other => panic!("{other:?}"),
            }
            out
        };
        let mut seed = 0x9e37_79b9_7f4a_7c15u64
            ^ std::env::var("IVDISK_TEST_SEED")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        let mut next = move |bound: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % bound
        };
        let mut engine = open(Box::<MemorySegments>::default());
        engine
            .apply_write(&object, &WriteOp::new().write(0, vec![1u8]))
            .unwrap();
        engine.commit(false);
        let mut model: Vec<u8> = vec![1];
        let mut log = Vec::new();
        for round in 0..400u64 {
            let committed = model.clone();
            let ops = 1 + next(4);
            for _ in 0..ops {
                let offset = next(200_000);
                let op = match next(10) {
                    0 => {
                        // Zeroes do not extend the object.
                        let len = 1 + next(20_000);
                        let end = ((offset + len) as usize).min(model.len());
                        model[(offset as usize).min(end)..end].fill(0);
                        WriteOp::new().step(WriteStep::Zero { offset, len })
                    }
                    1 => {
                        let size = next(220_000);
                        model.resize(size as usize, 0);
                        WriteOp::new().step(WriteStep::Truncate(size))
                    }
                    kind => {
                        let (offset, len) = match kind {
                            2 | 3 => (offset, 1 + next(INLINE_MAX as u64)),
                            4 | 5 => (offset / 4096 * 4096, 4096 * (1 + next(4))),
                            _ => (offset, 1 + next(30_000)),
                        };
                        let data: Vec<u8> = (0..len).map(|i| (round + i) as u8 | 1).collect();
                        model.resize(model.len().max((offset + len) as usize), 0);
                        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                        WriteOp::new().write(offset, data)
                    }
                };
                log.push(format!(
                    "{round}: {:?}",
                    op.steps
                        .iter()
                        .map(|s| match s {
                            WriteStep::Write { offset, data } =>
                                format!("W {offset}+{}", data.len()),
                            o => format!("{o:?}"),
                        })
                        .collect::<Vec<_>>()
                ));
                engine.apply_write(&object, &op).unwrap();
            }
            let action = next(8);
            log.push(format!(
                "{round}: action {action} held {:?}",
                engine.extents.get_mut().held()
            ));
            match action {
                0 => {
                    // Lost: back to the last commit.
                    engine.lose_transaction(&StoreError::Database("a test's loss".into()));
                    model = committed;
                }
                1 => engine.commit(true),
                2 => {
                    engine.write_back_extents().unwrap();
                    engine.commit(false);
                    assert_eq!(rows(&engine, "extents_pending"), 0);
                }
                3 => {
                    // A stop without a write-back: the next open replays the rows, or a
                    // writer's open writes them back first.
                    engine.commit(false);
                    let fresh: Box<dyn Segments> = Box::new(MemorySegments::default());
                    let segments = std::mem::replace(&mut engine.segments, fresh);
                    drop(engine);
                    if next(2) == 0 {
                        let db = Connection::open(&path).unwrap();
                        Engine::write_back_pending_extents(&db).unwrap();
                        assert_eq!(rows_of(&db, "extents_pending"), 0);
                    }
                    engine = open(segments);
                }
                _ => engine.commit(false),
            }
            engine.omap_held_max = [0, 2048, 1 << 20, OMAP_HELD_MAX][next(4) as usize];
            let read = read_all(&mut engine, model.len());
            let first_wrong = read.iter().zip(&model).position(|(a, b)| a != b);
            if let Some(i) = first_wrong {
                // The operations and steps of the last rounds, for the one who debugs it.
                for l in &log[log.len().saturating_sub(30)..] {
                    eprintln!("{l}");
                }
                let end = (i + 8).min(model.len());
                eprintln!("got {:?} want {:?}", &read[i..end], &model[i..end]);
            }
            assert_eq!(first_wrong, None, "round {round}: first wrong byte");
        }
        // Held partial extents are referenced where they are, not around them.
        engine.omap_held_max = OMAP_HELD_MAX;
        engine.write_back_extents().unwrap();
        engine.commit(false);
        engine
            .apply_write(&object, &WriteOp::new().write(500_000, vec![9u8; 3000]))
            .unwrap();
        engine.commit(false);
        let held = engine
            .lookup_extents(engine.head(&object).unwrap().unwrap().id, 500_000, 503_000)
            .unwrap();
        let [(_, _, Stored::Segment(piece))] = held.as_slice() else {
            panic!("{held:?}");
        };
        assert_eq!(rows(&engine, "extents_pending"), 1);
        let (seg, at) = (piece.seg, piece.seg_off);
        let mut stmt = engine.db.prepare_cached(REFERENCED).unwrap();
        assert!(engine.referenced(&mut stmt, seg, at, at + 1).unwrap());
        assert!(engine
            .referenced(&mut stmt, seg, at + 2999, at + 3000)
            .unwrap());
        assert!(!engine
            .referenced(&mut stmt, seg, at + 3000, at + 4096)
            .unwrap());
    }

    /// A snapshot's clone copies its head's extents in SQL. SQLite would give it the id of a
    /// node removed in the same transaction (the highest rowid, once its row is gone), whose
    /// extent removals wait in the transaction's pending row: replayed after a crash or a lost
    /// transaction, they removed the clone's copied extents. Node ids are never given twice,
    /// also after an open that replays such a row (as one after a clean stop does).
    #[test]
    fn a_clone_made_after_a_removal_keeps_its_extents_through_replays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let (a, b) = (ObjectName::new("a").unwrap(), ObjectName::new("b").unwrap());
        // Inline (small): kept in SQLite, so the in-memory segments lost at a reopen do not
        // matter.
        let data = |byte: u8| vec![byte; 600];
        let whole = |snap: Option<SnapId>| {
            let op = ReadOp::new().step(ReadStep::Read {
                offset: 0,
                len: 600,
            });
            match snap {
                Some(s) => op.at_snap(s),
                None => op,
            }
        };
        let read = |engine: &mut Engine, op: ReadOp| match engine.read(&b, &op).unwrap().pop() {
            Some(ReadResult::Extents(extents)) => extents
                .into_iter()
                .flat_map(|e| e.data)
                .collect::<Vec<u8>>(),
            other => panic!("{other:?}"),
        };
        for (lose, reopen_before_clone) in [(false, false), (true, false), (false, true)] {
            std::fs::remove_file(&path).ok();
            let mut engine = engine_on_file(&path);
            engine
                .apply_write(&b, &WriteOp::new().write(0, data(1)))
                .unwrap();
            engine
                .apply_write(&a, &WriteOp::new().write(0, data(2)))
                .unwrap();
            engine.commit(false);
            engine.write_back_extents().unwrap();
            engine.commit(false);
            let a_id = engine.head(&a).unwrap().unwrap().id;
            assert!(a_id > engine.head(&b).unwrap().unwrap().id);
            // One transaction: a's removal held, then b's clone made (or the removal, an open
            // that replays its row, then the clone).
            engine
                .apply_write(&a, &WriteOp::new().step(WriteStep::Remove))
                .unwrap();
            if reopen_before_clone {
                engine.commit(false);
                drop(engine);
                engine = engine_on_file(&path);
            }
            let snap = engine.snap_create().unwrap();
            let context = SnapContext {
                seq: snap,
                snaps: vec![snap],
            };
            engine
                .apply_write(
                    &b,
                    &WriteOp::new().write(0, data(3)).with_snap_context(context),
                )
                .unwrap();
            engine.commit(false);
            let clone: i64 = engine
                .db
                .query_row("SELECT id FROM nodes WHERE clone_to IS NOT NULL", [], |r| {
                    r.get(0)
                })
                .unwrap();
            assert!(
                clone > a_id,
                "the clone got a new id, not the removed node's"
            );
            assert!(
                rows(&engine, "extents_pending") > 0,
                "a's removal is pending"
            );
            assert_eq!(read(&mut engine, whole(Some(snap))), data(1));
            if lose {
                // The next transaction is lost: the pending rows are replayed.
                engine
                    .apply_write(&b, &WriteOp::new().write(0, data(4)))
                    .unwrap();
                engine.lose_transaction(&StoreError::Database("lost for the test".into()));
            } else {
                // A crash: the next open replays the pending rows.
                drop(engine);
                engine = engine_on_file(&path);
            }
            let case = format!("lost {lose}, reopened before the clone {reopen_before_clone}");
            assert!(read(&mut engine, whole(Some(snap))) == data(1), "{case}");
            assert!(read(&mut engine, whole(None)) == data(3), "{case}");
            engine.write_back_extents().unwrap();
            engine.commit(false);
            assert!(read(&mut engine, whole(Some(snap))) == data(1), "{case}");
        }
    }

    /// An object's removal writes nothing back: its node's held omap changes are dropped
    /// (the whole write-back after random small writes needed more room than a full disk
    /// had, and a guest's trim was refused there). Pending rows older than the removal still
    /// hold its changes: replayed after a crash or a lost transaction, they are dropped too,
    /// so the object made again under the same name has none of them, and nothing of the
    /// removed node is ever written to `omap`.
    #[test]
    fn a_removal_drops_its_held_omap_changes_and_replays_do_not_bring_them_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let (a, b) = (ObjectName::new("a").unwrap(), ObjectName::new("b").unwrap());
        let kv = |k: &str, v: &str| (k.as_bytes().to_vec(), v.as_bytes().to_vec());
        for lose in [false, true] {
            std::fs::remove_file(&path).ok();
            let mut engine = engine_on_file(&path);
            // b's change and a's in one row; a's written back to `omap` in part.
            engine
                .apply_write(&a, &WriteOp::new().omap_set(vec![kv("k1", "a1")]))
                .unwrap();
            engine.write_back_omap().unwrap();
            engine
                .apply_write(&a, &WriteOp::new().omap_set(vec![kv("k2", "a2")]))
                .unwrap();
            engine
                .apply_write(&b, &WriteOp::new().omap_set(vec![kv("k1", "b1")]))
                .unwrap();
            engine.commit(false);
            let a_id = engine.head(&a).unwrap().unwrap().id;
            let generation = Engine::omap_generation(&engine.db).unwrap();
            engine
                .apply_write(&a, &WriteOp::new().step(WriteStep::Remove))
                .unwrap();
            engine.commit(false);
            assert_eq!(
                Engine::omap_generation(&engine.db).unwrap(),
                generation,
                "the removal wrote the held changes back"
            );
            assert!(rows(&engine, "omap_pending") > 0, "b's change is pending");
            assert!(!engine.omap.get_mut().holds_node(a_id));
            if lose {
                // The next transaction is lost: the pending rows are replayed.
                engine
                    .apply_write(&b, &WriteOp::new().omap_set(vec![kv("k9", "lost")]))
                    .unwrap();
                engine.lose_transaction(&StoreError::Database("lost for the test".into()));
            } else {
                // A crash: the next open replays the pending rows.
                drop(engine);
                engine = engine_on_file(&path);
            }
            let case = format!("lost {lose}");
            assert!(
                !engine.omap.get_mut().holds_node(a_id),
                "{case}: the removed node's changes are held again"
            );
            assert_eq!(omap_of(&mut engine, &b), vec![kv("k1", "b1")], "{case}");
            engine
                .apply_write(&a, &WriteOp::new().omap_set(vec![kv("k3", "new")]))
                .unwrap();
            assert!(engine.head(&a).unwrap().unwrap().id > a_id, "{case}");
            assert_eq!(omap_of(&mut engine, &a), vec![kv("k3", "new")], "{case}");
            engine.write_back_omap().unwrap();
            engine.commit(false);
            let left: i64 = engine
                .db
                .query_row("SELECT count(*) FROM omap WHERE node = ?1", [a_id], |r| {
                    r.get(0)
                })
                .unwrap();
            assert_eq!(
                left, 0,
                "{case}: the removed node's values were written back"
            );
            assert_eq!(omap_of(&mut engine, &b), vec![kv("k1", "b1")], "{case}");
        }
    }

    /// A read-only engine on the database file `path`, as `LocalStore::open_read_only` makes
    /// one (plain read-only connections here: the writer keeps its log and index open).
    fn reader_on_file(path: &std::path::Path) -> Engine {
        struct File(std::path::PathBuf);
        impl MetaSource for File {
            fn connect(&mut self) -> Result<Connection, StoreError> {
                let db = Connection::open_with_flags(
                    &self.0,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )?;
                db.execute_batch("PRAGMA query_only = 1")?;
                Ok(db)
            }
            fn stale(&self) -> bool {
                false
            }
        }
        Engine::new_read_only(
            Box::new(File(path.to_owned())),
            Box::<MemorySegments>::default(),
        )
        .unwrap()
    }

    /// A reader following a writer's commits drops the rows whose changes later rows
    /// replaced: one row per writer commit was kept for as long as the reader ran (its
    /// transaction row stayed where its open put it, and rows from there on were never
    /// dropped).
    #[test]
    fn a_reader_following_commits_drops_the_rows_it_no_longer_needs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let object = ObjectName::new("o").unwrap();
        let set = |writer: &mut Engine, value: u32| {
            let op = WriteOp::new().omap_set(vec![(b"k".to_vec(), value.to_le_bytes().to_vec())]);
            writer.apply_write(&object, &op).unwrap();
            writer.commit(false);
        };
        let mut writer = engine_on_file(&path);
        set(&mut writer, 0);
        let mut reader = reader_on_file(&path);
        for i in 1..=2000u32 {
            set(&mut writer, i);
            let seen = reader
                .consistent(|engine| Ok((omap_of(engine, &object), Vec::new())))
                .unwrap();
            assert_eq!(seen, [(b"k".to_vec(), i.to_le_bytes().to_vec())]);
            let rows = reader.omap.get_mut().rows_len();
            assert!(rows < 10, "commit {i}: {rows} rows tracked");
        }
    }

    /// A reader holds what the pending rows it saw changed. When the writer changes that
    /// again and writes the newer change back and deletes its row before the reader looks
    /// (pieces written back under load, or an idle store's compaction), the reader must not
    /// go on with the older change: a value set again, an extent's old place.
    #[test]
    fn a_reader_does_not_keep_changes_written_back_while_it_was_away() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let object = ObjectName::new("o").unwrap();
        let op = |byte: u8, value: &[u8]| {
            WriteOp::new()
                .write(0, vec![byte; 600])
                .omap_set(vec![(b"k".to_vec(), value.to_vec())])
        };
        let state = |engine: &mut Engine| {
            let data = match engine
                .read(
                    &object,
                    &ReadOp::new().step(ReadStep::Read {
                        offset: 0,
                        len: 600,
                    }),
                )
                .unwrap()
                .pop()
            {
                Some(ReadResult::Extents(extents)) => extents
                    .into_iter()
                    .flat_map(|e| e.data)
                    .collect::<Vec<u8>>(),
                other => panic!("{other:?}"),
            };
            (data[0], omap_of(engine, &object))
        };
        // As a read-only store reads: one read transaction that follows the pending rows.
        let follow = |reader: &mut Engine| {
            reader
                .consistent(|engine| Ok((state(engine), Vec::new())))
                .unwrap()
        };
        let mut writer = engine_on_file(&path);
        writer.apply_write(&object, &op(1, b"v1")).unwrap();
        writer.commit(false);
        let mut reader = reader_on_file(&path);
        assert_eq!(
            follow(&mut reader),
            (1, vec![(b"k".to_vec(), b"v1".to_vec())])
        );
        // The reader replayed the writer's rows: it holds both changes.
        assert_eq!(reader.omap.get_mut().held().0, 1);
        assert!(reader.extents.get_mut().held().0 > 0);
        writer.apply_write(&object, &op(2, b"v2")).unwrap();
        // Written back in pieces at the commit, as an idle store's compaction does: every
        // row is emptied and deleted, and no whole write-back is counted.
        writer.compaction.draining = true;
        writer.commit(false);
        writer.compaction.draining = false;
        assert_eq!(rows(&writer, "omap_pending"), 0);
        assert_eq!(rows(&writer, "extents_pending"), 0);
        assert_eq!(
            follow(&mut reader),
            (2, vec![(b"k".to_vec(), b"v2".to_vec())])
        );
        // And it follows new rows without starting over.
        writer.apply_write(&object, &op(3, b"v3")).unwrap();
        writer.commit(false);
        assert_eq!(
            follow(&mut reader),
            (3, vec![(b"k".to_vec(), b"v3".to_vec())])
        );
    }

    /// Omap changes wait in memory and in `omap_pending` (omap_overlay.rs): reads see them
    /// over SQLite's rows, an open after a stop without write-back (a crash) replays them, a
    /// lost transaction drops only its own, a clear in the same operation drops the changes
    /// before it, and a write-back puts them in `omap` and empties `omap_pending`.
    #[test]
    fn omap_changes_held_in_front_of_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let open = || engine_on_file(&path);
        let object = ObjectName::new("o").unwrap();
        let write = |engine: &mut Engine, op: WriteOp| {
            engine.apply_write(&object, &op).unwrap();
        };
        let mut engine = open();
        write(
            &mut engine,
            WriteOp::new().omap_set(vec![kv("a", "1"), kv("b", "1"), kv("c", "1")]),
        );
        engine.commit(false);
        assert_eq!(
            (rows(&engine, "omap"), rows(&engine, "omap_pending")),
            (0, 1)
        );
        engine.write_back_omap().unwrap();
        engine.commit(false);
        assert_eq!(
            (rows(&engine, "omap"), rows(&engine, "omap_pending")),
            (3, 0)
        );

        write(
            &mut engine,
            WriteOp::new().omap_set(vec![kv("b", "2"), kv("d", "2")]),
        );
        write(
            &mut engine,
            WriteOp::new().step(WriteStep::OmapRemoveKeys(vec!["c".into()])),
        );
        engine.commit(false);
        assert_eq!(
            (rows(&engine, "omap"), rows(&engine, "omap_pending")),
            (3, 1)
        );
        let expected = vec![kv("a", "1"), kv("b", "2"), kv("d", "2")];
        assert_eq!(omap_of(&mut engine, &object), expected);
        // Ranges over both: bounds, limits and `more` as over SQLite's rows alone.
        assert_eq!(
            omap_range(&mut engine, &object, "b", Some("d"), 9),
            (expected[1..2].to_vec(), false)
        );
        assert_eq!(
            omap_range(&mut engine, &object, "", None, 1),
            (expected[..1].to_vec(), true)
        );
        assert_eq!(
            omap_range(&mut engine, &object, "", None, 2),
            (expected[..2].to_vec(), true)
        );
        assert_eq!(
            omap_range(&mut engine, &object, "", None, 3),
            (expected.clone(), false)
        );
        assert_eq!(
            omap_range(&mut engine, &object, "c", None, 1),
            (expected[2..].to_vec(), false)
        );
        assert_eq!(
            omap_range(&mut engine, &object, "d", Some("a"), 9),
            (vec![], false)
        );
        let by_keys = ReadOp::new().step(ReadStep::OmapGetByKeys(vec!["c".into(), "b".into()]));
        match engine.read(&object, &by_keys).unwrap().pop() {
            Some(ReadResult::Omap { pairs, .. }) => assert_eq!(pairs.to_vec(), vec![kv("b", "2")]),
            other => panic!("{other:?}"),
        }

        // A lost transaction takes its own changes only.
        write(&mut engine, WriteOp::new().omap_set(vec![kv("a", "lost")]));
        engine.lose_transaction(&StoreError::Database("a test's loss".into()));
        assert_eq!(omap_of(&mut engine, &object), expected);
        // A stop without a write-back, as a crash: the next open replays omap_pending.
        drop(engine);
        let mut engine = open();
        assert_eq!(omap_of(&mut engine, &object), expected);

        // A clear takes the same operation's earlier changes too, not its later ones.
        let op = WriteOp::new()
            .omap_set(vec![kv("e", "3")])
            .step(WriteStep::OmapClear)
            .omap_set(vec![kv("f", "3")]);
        write(&mut engine, op);
        engine.commit(false);
        assert_eq!(omap_of(&mut engine, &object), vec![kv("f", "3")]);
        drop(engine);
        let mut engine = open();
        assert_eq!(omap_of(&mut engine, &object), vec![kv("f", "3")]);

        // Past the size held, a commit writes everything back.
        engine.omap_held_max = 0;
        write(&mut engine, WriteOp::new().omap_set(vec![kv("g", "4")]));
        engine.commit(false);
        assert_eq!(
            (rows(&engine, "omap"), rows(&engine, "omap_pending")),
            (2, 0)
        );
        assert_eq!(
            omap_of(&mut engine, &object),
            vec![kv("f", "3"), kv("g", "4")]
        );
    }

    /// A key set once (an image's header value) must not keep every later pending row in
    /// the table: under many commits that rewrite other keys, with far less held than the
    /// bound of held changes (so no piece is written back), the pending rows stay bounded,
    /// and a reopen (a crash: no write-back at the stop) reads the same values.
    #[test]
    fn a_key_set_once_does_not_keep_every_later_pending_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.sqlite");
        let open = || engine_on_file(&path);
        let header = ObjectName::new("header").unwrap();
        let data = ObjectName::new("data").unwrap();
        let mut engine = open();
        // A bound of held changes that 16 keys of 1 KiB stay far below.
        engine.omap_held_max = 1 << 20;
        let op = WriteOp::new()
            .omap_set(vec![kv("size", "1")])
            .write(0, b"header".to_vec());
        engine.apply_write(&header, &op).unwrap();
        engine.commit(false);
        let value = |round: usize| format!("{round:01024}");
        let pending_bytes = |engine: &Engine, table: &str| -> i64 {
            engine
                .db
                .query_row(
                    &format!("SELECT coalesce(sum(length(changes)), 0) FROM {table}"),
                    [],
                    |r| r.get(0),
                )
                .unwrap()
        };
        let mut most = (0, 0);
        for round in 0..600 {
            let pairs = (0..16).map(|key| kv(&format!("k{key:02}"), &value(round)));
            let mut op = WriteOp::new().omap_set(pairs.collect::<Vec<_>>());
            for block in 0..64 {
                op = op.write(4096 * block, vec![round as u8; 64]);
            }
            engine.apply_write(&data, &op).unwrap();
            engine.commit(false);
            most = (
                most.0.max(pending_bytes(&engine, "omap_pending")),
                most.1.max(pending_bytes(&engine, "extents_pending")),
            );
        }
        // 600 rounds stored about 10 MiB of omap rows and 2.5 MiB or more of extent rows;
        // twice the held changes and half the bound of held changes besides (about 0.6 MiB)
        // is the most kept.
        assert!(most.0 < 1 << 20, "omap_pending grew to {} bytes", most.0);
        assert!(most.1 < 1 << 20, "extents_pending grew to {} bytes", most.1);
        drop(engine);
        let mut engine = open();
        let expected: Vec<_> = (0..16)
            .map(|key| kv(&format!("k{key:02}"), &value(599)))
            .collect();
        assert_eq!(omap_of(&mut engine, &data), expected);
        let read = ReadOp::new().step(ReadStep::Read {
            offset: 4096 * 63,
            len: 64,
        });
        match engine.read(&data, &read).unwrap().pop() {
            Some(ReadResult::Extents(extents)) => {
                let bytes: Vec<u8> = extents.iter().flat_map(|e| e.data.to_vec()).collect();
                assert_eq!(bytes, vec![599_u32 as u8; 64]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(omap_of(&mut engine, &header), vec![kv("size", "1")]);
    }

    /// A log sync that fails once, when armed.
    #[derive(Default)]
    struct SyncFailingOnce(std::sync::atomic::AtomicBool);
    impl Durability for SyncFailingOnce {
        fn sync_wal(&self) -> Result<(), StoreError> {
            match self.0.swap(false, std::sync::atomic::Ordering::SeqCst) {
                true => Err(StoreError::Database("injected log sync failure".into())),
                false => Ok(()),
            }
        }
        fn instant(&self) -> bool {
            true
        }
    }

    /// After a log sync failed, no dead range is given back and every flush fails, until the
    /// store is opened again. The failed commit's log frames may never reach the disk however
    /// later syncs go (Linux drops the pages of a failed writeback and reports it once), so
    /// after a power cut the store can come back at a state before them, which references
    /// the ranges: they were given back at the next durable commit (and earlier put back as
    /// `(from, to)` where `(offset, length)` belongs, punching live data after them), and
    /// later flushes reported success.
    #[test]
    fn after_a_failed_log_sync_no_space_is_given_back_and_flushes_fail() {
        let durability = Arc::new(SyncFailingOnce::default());
        let db = Connection::open_in_memory().unwrap();
        let mut engine = Engine::new(
            db,
            Box::<MemorySegments>::default(),
            durability.clone() as Arc<dyn Durability>,
        )
        .unwrap();
        let name = |n: &str| ObjectName::new(n).unwrap();
        let write = |engine: &mut Engine, object: &str, byte: u8, len: usize| {
            engine
                .apply_write(&name(object), &WriteOp::new().write(0, vec![byte; len]))
                .unwrap();
        };
        let read = |engine: &mut Engine, object: &str| -> Vec<u8> {
            let op = ReadOp::new().step(ReadStep::Read {
                offset: 0,
                len: 1 << 20,
            });
            match engine.read(&name(object), &op).unwrap().pop() {
                Some(ReadResult::Extents(extents)) => {
                    let mut out = Vec::new();
                    for e in extents {
                        out.resize(e.offset as usize + e.data.len(), 0);
                        out[e.offset as usize..].copy_from_slice(&e.data);
                    }
                    out
                }
                other => panic!("{other:?}"),
            }
        };
        let flush = |engine: &mut Engine| -> Result<(), StoreError> {
            let (reply, mut answer) = oneshot::channel();
            engine.handle(Request::Flush {
                reply,
                reclaim: false,
            });
            engine.send_answers();
            answer.try_recv().unwrap().expect("answered at once")
        };
        let segment = |engine: &Engine| -> Vec<u8> {
            let mut bytes = vec![0; 20480];
            engine.segments.read(0, 0, &mut bytes).unwrap();
            bytes
        };
        write(&mut engine, "a", 1, 16384);
        write(&mut engine, "b", 2, 4096);
        flush(&mut engine).unwrap();
        let b_first = segment(&engine)
            .windows(4096)
            .position(|w| w.iter().all(|&x| x == 2))
            .expect("b's first place");
        // The overwrite frees b's first place; the commit that would give it back fails.
        durability
            .0
            .store(true, std::sync::atomic::Ordering::SeqCst);
        write(&mut engine, "b", 3, 4096);
        let err = flush(&mut engine).unwrap_err();
        assert!(
            err.to_string().contains("injected log sync failure"),
            "{err}"
        );
        assert!(!durability.0.load(std::sync::atomic::Ordering::SeqCst));
        // Later syncs succeed, yet flushes keep failing and nothing is given back.
        write(&mut engine, "c", 4, 16384);
        write(&mut engine, "a", 5, 4096);
        let err = flush(&mut engine).unwrap_err();
        assert!(err.to_string().contains("opened again"), "{err}");
        assert!(flush(&mut engine).is_err());
        assert!(
            segment(&engine)[b_first..b_first + 4096]
                .iter()
                .all(|&x| x == 2),
            "b's first place was given back"
        );
        assert!(
            segment(&engine)[..4096].iter().all(|&x| x == 1),
            "a's first block was given back"
        );
        for (object, byte, len) in [("b", 3, 4096), ("c", 4, 16384)] {
            let data = read(&mut engine, object);
            let wrong = data.iter().filter(|&&b| b != byte).count();
            assert!(
                data.len() == len && wrong == 0,
                "{object}: {} bytes read, {wrong} of them not {byte}",
                data.len()
            );
        }
    }

    /// `Engine::referenced` is answered from the partial index: its query must carry the
    /// index's terms exactly, or SQLite reads every extent instead.
    #[test]
    fn referenced_uses_the_partial_block_index() {
        let db = Connection::open_in_memory().unwrap();
        Engine::init_schema(&db).unwrap();
        let plan: Vec<String> = db
            .prepare(&format!("EXPLAIN QUERY PLAN {REFERENCED}"))
            .unwrap()
            .query_map(params![1, 8192], |r| r.get(3))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            plan.iter()
                .any(|p| p.contains("USING INDEX partial_block_by_place")),
            "{plan:?}"
        );
    }

    /// An idle store's compaction ends by emptying SQLite's page cache, which the writes
    /// before had filled: it is the bulk of what an idle `ivdisk serve` kept resident.
    /// Without `release_idle_memory` the cache keeps every page.
    #[test]
    fn idle_compaction_empties_the_sqlite_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let mut engine = engine_on_file(&dir.path().join("meta.sqlite"));
        engine
            .db
            .execute_batch("PRAGMA cache_size = -32768")
            .unwrap();
        for i in 0..16 {
            let object = ObjectName::new(format!("o{i}")).unwrap();
            let mut pairs = OmapPairs::new();
            for k in 0..256u32 {
                pairs.push(format!("{k:08}").as_bytes(), &[i as u8; 1000]);
            }
            let op = WriteOp::new().write(0, vec![i as u8; 100]).omap_set(pairs);
            engine.apply_write(&object, &op).unwrap();
            engine.commit(false);
        }
        // Partial segment extents: their places wait in the held extents' log.
        for name in ["partial-1", "partial-2"] {
            let op = WriteOp::new().write(0, vec![1; 6000]);
            engine
                .apply_write(&ObjectName::new(name).unwrap(), &op)
                .unwrap();
        }
        engine.commit(false);
        assert!(engine.extents.borrow().partial_reserve_capacity() > 0);
        engine.write_back_omap().unwrap();
        engine.commit(false);
        let full = crate::ffi_heap::sqlite_cache_used(&engine.db);
        assert!(
            full > 2 << 20,
            "4 MB of omap values written: {full} bytes cached"
        );

        engine.compaction.idle = Duration::ZERO;
        engine.compaction.due = true;
        let mut steps = 0;
        while engine.compact_step().is_some() {
            steps += 1;
            assert!(steps < 1000, "compaction does not end");
        }
        let idle = crate::ffi_heap::sqlite_cache_used(&engine.db);
        assert!(
            idle < full / 16,
            "{idle} bytes cached after compaction, {full} before"
        );
        assert_eq!(engine.extents.borrow().partial_reserve_capacity(), 0);

        // The store reads on as before, from the file.
        let object = ObjectName::new("o7").unwrap();
        let pairs = omap_of(&mut engine, &object);
        assert_eq!(pairs.len(), 256);
        assert!(pairs.iter().all(|(_, v)| v == &vec![7u8; 1000]));
    }
}
