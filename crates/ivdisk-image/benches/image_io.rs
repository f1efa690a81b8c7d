//! The image IO path in process (no NBD) at queue depth 32: CPU time per IO and throughput per
//! suite, layout, IO size and direction, next to the suite's raw crypto cost for the same bytes
//! measured in the same run (issue 6, point 7: for IO >= 64 KiB the engine should add at most
//! 30% over the raw crypto).
//!
//! For each suite x layout that fits it x IO size (4 KiB .. 4 MiB) x store:
//! - a fresh store and a fresh image on it (`Image::create_on`, fast PBKDF2, 4 MiB objects,
//!   `IVDISK_BENCH_IMAGE_MIB` (256) MiB), written in full first in 4 MiB writes (untimed), so
//!   reads decrypt real data;
//! - **read**, **write**, **nbd-read**, **nbd-write**: 32 tokio tasks (2 worker threads on this
//!   2-core machine), each with one IO of the IO size in flight at a random size-aligned
//!   offset. `read` is `Image::read` into the task's buffer, reused from IO to IO; `write` is
//!   `Image::write` of a borrowed buffer (which the engine must encrypt into a new one).
//!   `nbd-read` and `nbd-write` make the same IO as `ivdisk serve` does: a read into a buffer
//!   the image returns (`Image::read_reply`: the store's, decrypted in place), a write of a
//!   payload received into a fresh buffer placed as the image asks (`Image::write_placement`:
//!   in slots for `unaligned`; a copy here) and handed over (`Image::write_payload`,
//!   encrypted in place). The front end's part (freeing the read's
//!   buffer; the payload's allocation and copy) is timed in the IO threads and taken out of
//!   the engine's figure, as the store's is. Task
//!   `t` only uses the slots `t, t + 32, ...`, so no two IOs in flight overlap (no waits on
//!   the engine's range locks; those are not what is measured). `IVDISK_BENCH_REPS`
//!   windows, each after a warm-up (0.05 s after the first) and followed by the raw crypto
//!   baseline with the IO tasks stopped; per window of `IVDISK_BENCH_SECONDS`: the IOs
//!   completed in it, the process' CPU time
//!   (`cpu_time::ProcessTime`: the tokio workers, the store's threads, everything) and the wall
//!   time; per-thread CPU from `/proc/self/task/*/schedstat` splits it into the IO threads
//!   (tokio workers: engine, crypto and, for `map`, the store) and the store's worker thread
//!   (`memory`). The `map` store's operations complete without waiting, so there each worker
//!   runs one task's IOs back to back: 2 IOs in flight, not 32 (the CPU cost per IO is what
//!   counts here).
//!
//! Stores (`IVDISK_BENCH_STORES`):
//! - `memory`: `ivdisk_store::MemoryStore`, what `mem:` images use: the local store's engine
//!   (SQLite in memory, segments in a vector, one worker thread). A fresh one per measurement:
//!   its segments are append-only and never shrink (dead data is zeroed, not freed), so the one
//!   process-wide store behind `mem:` would only grow over a run (tens of GB). Writes stop early
//!   once 1.5 GiB went into one store.
//! - `map`: a trivial store in this file: objects as vectors in a hash map, omap as a B-tree,
//!   applied in the caller's thread under a per-object mutex. What is left over its cost is the
//!   engine's (splitting, buffers, layout encoding, futures, locks).
//! - `mem-uri`: the `memory` engine as `Image::create` opens it for `mem:NAME` (the process-wide
//!   store), to check that it measures as `memory` does (not in the default set).
//!
//! The bench runs on mimalloc, the allocator the `ivdisk` binary (and so `ivdisk serve`) links:
//! what is measured is the engine as it runs in the product. With glibc's malloc the same
//! engine took 17-35% more CPU per IO in the library's calls (docs/BENCHMARKS.md, "The bench on
//! the product's allocator"). The store's and the front end's work is timed with the monotonic
//! clock ([`WorkTally`]; `IVDISK_BENCH_TIMER=thread-cpu` for the thread CPU clock of earlier
//! runs).
//!
//! Baseline, before the first window and after each (a window is compared with the mean of the
//! two around it; the figures are medians over the windows): the suite's cipher
//! (`new_cipher`, default key size) encrypting / decrypting IO-sized buffers of random data
//! (decrypting real ciphertext), in batches of at least 1 MiB whose buffers are refilled
//! (untimed) before each batch, on as many threads at once as the engine has (2), summed thread
//! CPU time: CPU us per IO of raw crypto. Engine overhead = (CPU us/IO less the store's - raw
//! crypto) / raw crypto, same direction (write: encrypt, read: decrypt); the front end's part
//! of `nbd-read`/`nbd-write` is taken out of the CPU us/IO as well.
//!
//! ```text
//! cargo bench -p ivdisk-image --bench image_io            # all; scripts/bench-image wraps it
//! IVDISK_BENCH_SUITES=aegis128l-random IVDISK_BENCH_LAYOUTS=object-end \
//!   IVDISK_BENCH_SIZES=64,1024 IVDISK_BENCH_STORES=map \
//!   cargo bench -p ivdisk-image --bench image_io
//! ```
//!
//! Knobs: `IVDISK_BENCH_SUITES`, `IVDISK_BENCH_LAYOUTS`, `IVDISK_BENCH_STORES` (comma lists of
//! names), `IVDISK_BENCH_SIZES` (KiB), `IVDISK_BENCH_RW` (`read`, `write`,
//! `nbd-read`, `nbd-write`; all four by default),
//! `IVDISK_BENCH_REPS` (3), `IVDISK_BENCH_SECONDS` (0.35), `IVDISK_BENCH_WARMUP` (0.25),
//! `IVDISK_BENCH_CRYPTO_SECONDS` (0.05 per thread), `IVDISK_BENCH_IMAGE_MIB` (256),
//! `IVDISK_BENCH_TIMER` (`monotonic` or `thread-cpu`), `IVDISK_BENCH_QUICK=1` (64 KiB and
//! 1 MiB, 1 window of 0.25 s after 0.1 s, a 128 MiB image), `IVDISK_BENCH_JSON` (where the
//! samples go; default `target/bench-image/image_io.json`).
//! Without `--bench` (as `cargo test --all-targets` runs it): one short pass of
//! aegis128l-random with `object-end` and with `omap-packed` (the default layout) at 64 KiB on
//! both stores, all four directions, no JSON.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use cpu_time::{ProcessTime, ThreadTime};
use ivdisk_bench_support::{
    env_or, json_list, json_num, json_str, machine, median, size_label, sizes_from_env, target_dir,
    Rng,
};
use ivdisk_crypto::{new_cipher, CipherParams, ImageId, SectorCipher, Suite, VolumeKey};
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{
    CreateOptions, Image, ImageUri, LayoutKind, PayloadPlacement, WritePayload, DEFAULT_OBJECT_SIZE,
};
use ivdisk_store::{
    check_range, Extent, LockRequest, Locker, MemoryStore, ObjectName, ObjectStore, OmapPairs,
    ReadOp, ReadResult, ReadStep, SnapId, Stat, StoreError, WriteOp, WriteOutcome, WriteStep,
};

/// The product's allocator (`crates/ivdisk/src/main.rs`), so that the engine is measured as it
/// runs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
const QUICK_SIZES: [usize; 2] = [64 << 10, 1 << 20];
const QUEUE_DEPTH: usize = 32;
const SECTOR: usize = 4096;
const PASSPHRASE: &[u8] = b"image-io bench";
/// The fill writes the image in IOs of this size.
const FILL_IO: usize = 4 << 20;
/// Warm-up of the windows after the first of a measurement (the image and store are warm).
const REWARM: f64 = 0.05;
/// Bytes written into one `memory` store (fill excluded) after which a write window ends early.
const MEMORY_WRITE_CAP: u64 = 3 << 29;
/// IO threads: the tokio workers (named so that per-thread CPU and `perf` can tell them).
const IO_THREAD: &str = "bench-io";
/// The memory store's worker (`ivdisk-mem-store`, cut to 15 bytes by the kernel).
const STORE_THREAD: &str = "ivdisk-mem-stor";

// ---------------------------------------------------------------------------------------------
// The trivial store.

#[derive(Default)]
struct MapObject {
    exists: bool,
    version: u64,
    data: Vec<u8>,
    omap: BTreeMap<Vec<u8>, Vec<u8>>,
}

struct MapLock {
    client: String,
    cookie: String,
    description: String,
    expires: Option<Instant>,
}

/// Objects in a hash map, one mutex per object; every operation runs in the caller's thread.
/// Holes are not tracked (reads return every byte up to the object's size, as RADOS does).
/// Snapshots are not supported. Enough for the image layer, nothing more. The thread CPU time
/// spent in its read and write operations is summed in `tally`.
#[derive(Default)]
struct MapStore {
    objects: RwLock<HashMap<ObjectName, Arc<Mutex<MapObject>>>>,
    locks: Mutex<HashMap<(ObjectName, String), MapLock>>,
    tally: WorkTally,
}

/// Time of one kind of work done inside the IO threads (the `map` store's operations, the
/// front end's buffers), summed, and how many times it was timed; the cost of the two clock
/// reads per timing is calibrated at start-up ([`timer_pair_ns`]) and taken out of the figures.
///
/// The clock is the monotonic one (`Instant`, read in user space through the vDSO: tens of
/// nanoseconds) unless `IVDISK_BENCH_TIMER=thread-cpu` asks for the thread's CPU clock, which
/// earlier runs used. Why not that one: reading it is a system call, and under load (both
/// vCPUs busy, its kernel paths cold after each 64 KiB copy) a read costs more than the
/// calibration loop measures: in a profile of 64 KiB `omap-packed` `nbd-write`s the timers
/// took 13.6% of the IO threads, about 1.6 us per IO, of which 1.1 us were taken out; on this
/// clock the engine's figure came out 0.04-0.17 us per 64 KiB IO lower (docs/BENCHMARKS.md).
/// Wall time stands for CPU time here because the timed work does not wait: a wait for the
/// `map` store's object lock is left out ([`lock_timed`]), and a copy or a free does not
/// block (the VM's steal time is about 0.1%).
///
/// Each thread adds into a slot of its own (cache-line sized): shared counters cost a cache
/// line moving between the two vCPUs on every timing.
#[derive(Default)]
struct WorkTally {
    slots: [TallySlot; TALLY_SLOTS],
}

const TALLY_SLOTS: usize = 16;

#[derive(Default)]
#[repr(align(128))]
struct TallySlot {
    ns: AtomicU64,
    calls: AtomicU64,
}

/// Which clock a [`WorkTally`] reads (`IVDISK_BENCH_TIMER`: `monotonic`, the default, or
/// `thread-cpu`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum TimerClock {
    Monotonic,
    ThreadCpu,
}

fn timer_clock() -> TimerClock {
    static CLOCK: std::sync::OnceLock<TimerClock> = std::sync::OnceLock::new();
    *CLOCK.get_or_init(|| match std::env::var("IVDISK_BENCH_TIMER").as_deref() {
        Ok("thread-cpu") => TimerClock::ThreadCpu,
        Ok("monotonic") | Err(_) => TimerClock::Monotonic,
        Ok(other) => panic!("IVDISK_BENCH_TIMER: monotonic or thread-cpu, not {other:?}"),
    })
}

impl TimerClock {
    fn name(self) -> &'static str {
        match self {
            TimerClock::Monotonic => "monotonic",
            TimerClock::ThreadCpu => "thread-cpu",
        }
    }
}

thread_local! {
    /// Nanoseconds the timed work on this thread spent waiting for a lock ([`lock_timed`]),
    /// taken out of its timing: a wait is not work.
    static WAITED_NS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Locks `mutex`; if another thread holds it, the wait is counted in [`WAITED_NS`]. (The
/// engine's metadata cache already keeps two operations on one object apart, so waits are
/// rare; this makes sure none is counted as the store's work.)
fn lock_timed<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.try_lock() {
        Ok(guard) => guard,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            let start = Instant::now();
            let guard = mutex.lock().unwrap_or_else(|e| e.into_inner());
            let waited = start.elapsed().as_nanos() as u64;
            WAITED_NS.with(|w| w.set(w.get() + waited));
            guard
        }
    }
}

/// This thread's slot in every [`WorkTally`]: threads take slots in turn as they first time
/// something (the bench has two IO threads and a main thread).
fn tally_slot() -> usize {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static SLOT: usize = (NEXT.fetch_add(1, Ordering::Relaxed) as usize) % TALLY_SLOTS;
    }
    SLOT.with(|s| *s)
}

impl WorkTally {
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        WAITED_NS.with(|w| w.set(0));
        let (out, ns) = match timer_clock() {
            TimerClock::Monotonic => {
                let start = Instant::now();
                let out = f();
                (out, start.elapsed().as_nanos() as u64)
            }
            TimerClock::ThreadCpu => {
                let start = ThreadTime::now();
                let out = f();
                (out, start.elapsed().as_nanos() as u64)
            }
        };
        let ns = ns.saturating_sub(WAITED_NS.with(|w| w.get()));
        let slot = &self.slots[tally_slot()];
        slot.ns.fetch_add(ns, Ordering::Relaxed);
        slot.calls.fetch_add(1, Ordering::Relaxed);
        out
    }

    /// Nanoseconds timed and timings, over all threads.
    fn totals(&self) -> (u64, u64) {
        self.slots.iter().fold((0, 0), |(ns, calls), s| {
            (
                ns + s.ns.load(Ordering::Relaxed),
                calls + s.calls.load(Ordering::Relaxed),
            )
        })
    }
}

impl MapStore {
    fn object(&self, name: &ObjectName, create: bool) -> Option<Arc<Mutex<MapObject>>> {
        if let Some(o) = self.objects.read().unwrap().get(name) {
            return Some(o.clone());
        }
        if !create {
            return None;
        }
        let mut objects = self.objects.write().unwrap();
        Some(objects.entry(name.clone()).or_default().clone())
    }
}

fn not_found(object: &ObjectName) -> StoreError {
    StoreError::NotFound {
        object: object.to_string(),
    }
}

fn unsupported(what: &str) -> StoreError {
    StoreError::InvalidOperation {
        object: String::new(),
        reason: format!("{what} is not supported by the bench's map store"),
    }
}

fn write_at(data: &mut Vec<u8>, offset: u64, bytes: &[u8]) {
    let (at, end) = (offset as usize, offset as usize + bytes.len());
    if data.len() < end {
        data.resize(end, 0);
    }
    data[at..end].copy_from_slice(bytes);
}

/// IOs completed, counted per thread like [`WorkTally`]: one counter that both IO threads
/// add to moves its cache line between the vCPUs on every IO, a cost of the bench's own
/// bookkeeping that would land in the engine's figure.
#[derive(Default)]
struct OpCount {
    slots: [TallySlot; TALLY_SLOTS],
}

impl OpCount {
    fn add_one(&self) {
        self.slots[tally_slot()]
            .calls
            .fetch_add(1, Ordering::Relaxed);
    }

    fn total(&self) -> u64 {
        self.slots
            .iter()
            .map(|s| s.calls.load(Ordering::Relaxed))
            .sum()
    }
}

impl MapStore {
    fn apply_write(&self, name: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        let object = self.object(name, true).expect("created");
        let mut o = lock_timed(&object);
        // Checks first, so that a failing operation changes nothing.
        for step in &op.steps {
            match step {
                WriteStep::CreateExclusive if o.exists => {
                    return Err(StoreError::Exists {
                        object: name.to_string(),
                    })
                }
                WriteStep::AssertExists if !o.exists => return Err(not_found(name)),
                WriteStep::AssertVersion(v) if *v != o.version => {
                    return Err(StoreError::VersionMismatch {
                        object: name.to_string(),
                        expected: *v,
                        actual: o.version,
                    })
                }
                WriteStep::Write { offset, data } => check_range(name, *offset, data.len() as u64)?,
                WriteStep::Zero { offset, len } => check_range(name, *offset, *len)?,
                WriteStep::Rollback(_) => return Err(unsupported("rollback")),
                _ => {}
            }
        }
        for step in op.steps {
            match step {
                WriteStep::CreateExclusive => o.exists = true,
                WriteStep::AssertExists | WriteStep::AssertVersion(_) => {}
                WriteStep::Write { offset, data } => {
                    write_at(&mut o.data, offset, &data);
                    o.exists = true;
                }
                WriteStep::WriteFull(data) => {
                    o.data = data;
                    o.exists = true;
                }
                WriteStep::Zero { offset, len } => {
                    let end = ((offset + len) as usize).min(o.data.len());
                    if (offset as usize) < end {
                        o.data[offset as usize..end].fill(0);
                    }
                    o.exists = true;
                }
                WriteStep::Truncate(len) => {
                    o.data.resize(len as usize, 0);
                    o.exists = true;
                }
                WriteStep::Remove => {
                    o.data = Vec::new();
                    o.omap.clear();
                    o.exists = false;
                }
                WriteStep::OmapSet(pairs) => {
                    // The store keeps its own copies, as a real one stores them.
                    o.omap
                        .extend(pairs.iter().map(|(k, v)| (k.to_vec(), v.to_vec())));
                    o.exists = true;
                }
                WriteStep::OmapRemoveKeys(keys) => {
                    for k in keys {
                        o.omap.remove(&k);
                    }
                }
                WriteStep::OmapRemoveRange { start, end } => {
                    if start < end {
                        let doomed: Vec<Vec<u8>> =
                            o.omap.range(start..end).map(|(k, _)| k.clone()).collect();
                        for k in doomed {
                            o.omap.remove(&k);
                        }
                    }
                }
                WriteStep::OmapClear => o.omap.clear(),
                WriteStep::Rollback(_) => unreachable!("refused above"),
            }
        }
        let version = if o.exists {
            o.version += 1;
            o.version
        } else {
            o.version = 0;
            0
        };
        Ok(WriteOutcome { version })
    }

    fn apply_read(&self, name: &ObjectName, op: ReadOp) -> Result<Vec<ReadResult>, StoreError> {
        if op.snap.is_some() {
            return Err(unsupported("reading at a snapshot"));
        }
        let object = self.object(name, false).ok_or_else(|| not_found(name))?;
        let o = lock_timed(&object);
        if !o.exists {
            return Err(not_found(name));
        }
        let mut results = Vec::with_capacity(op.steps.len());
        for step in op.steps {
            results.push(match step {
                ReadStep::Read { offset, len } => {
                    let size = o.data.len() as u64;
                    let end = offset.saturating_add(len).min(size);
                    let extents = if offset < end {
                        vec![Extent {
                            offset,
                            data: o.data[offset as usize..end as usize].to_vec(),
                        }]
                    } else {
                        Vec::new()
                    };
                    ReadResult::Extents(extents)
                }
                ReadStep::Stat => ReadResult::Stat(Stat {
                    size: o.data.len() as u64,
                    version: o.version,
                }),
                ReadStep::OmapGetByKeys(mut keys) => {
                    keys.sort();
                    keys.dedup();
                    let pairs = keys
                        .into_iter()
                        .filter_map(|k| o.omap.get(&k).map(|v| (k, v)))
                        .collect();
                    ReadResult::Omap { pairs, more: false }
                }
                ReadStep::OmapGetRange { start, end, max } => {
                    let range = o.omap.range(start..);
                    let mut pairs = OmapPairs::new();
                    let mut more = false;
                    for (k, v) in range {
                        if end.as_ref().is_some_and(|e| k >= e) {
                            break;
                        }
                        if pairs.len() == max {
                            more = true;
                            break;
                        }
                        pairs.push(k, v);
                    }
                    ReadResult::Omap { pairs, more }
                }
            });
        }
        Ok(results)
    }
}

#[async_trait::async_trait]
impl ObjectStore for MapStore {
    async fn write_op(&self, name: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        self.tally.timed(|| self.apply_write(name, op))
    }

    async fn read_op(&self, name: &ObjectName, op: ReadOp) -> Result<Vec<ReadResult>, StoreError> {
        self.tally.timed(|| self.apply_read(name, op))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
        let objects = self.objects.read().unwrap();
        let mut names: Vec<ObjectName> = objects
            .iter()
            .filter(|(n, o)| n.as_str().starts_with(prefix) && o.lock().unwrap().exists)
            .map(|(n, _)| n.clone())
            .collect();
        names.sort();
        Ok(names)
    }

    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        Err(unsupported("snapshots"))
    }

    async fn snap_remove(&self, _snap: SnapId) -> Result<(), StoreError> {
        Err(unsupported("snapshots"))
    }

    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError> {
        let mut locks = self.locks.lock().unwrap();
        let key = (object.clone(), request.name.clone());
        let held = locks
            .get(&key)
            .filter(|h| h.expires.is_none_or(|e| e > Instant::now()));
        let ours = held.is_some_and(|h| h.client == self.client_id() && h.cookie == request.cookie);
        match held {
            // Renewing extends a lock this client still holds, nothing else.
            _ if request.renew && !ours => {
                return Err(StoreError::NotLocked {
                    object: object.to_string(),
                    lock: request.name,
                    client: self.client_id().to_owned(),
                    cookie: request.cookie,
                })
            }
            Some(h) if !request.renew => {
                return Err(StoreError::Busy {
                    object: object.to_string(),
                    lock: request.name,
                    holder: h.client.clone(),
                })
            }
            _ => {}
        }
        locks.insert(
            key,
            MapLock {
                client: self.client_id().to_owned(),
                cookie: request.cookie,
                description: request.description,
                expires: request.duration.map(|d| Instant::now() + d),
            },
        );
        Ok(())
    }

    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let client = self.client_id().to_owned();
        self.break_lock(object, lock, &client, cookie).await
    }

    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError> {
        let locks = self.locks.lock().unwrap();
        let now = Instant::now();
        Ok(locks
            .get(&(object.clone(), lock.to_owned()))
            .filter(|l| l.expires.is_none_or(|e| e > now))
            .map(|l| Locker {
                client: l.client.clone(),
                cookie: l.cookie.clone(),
                description: l.description.clone(),
                expires_in: l.expires.map(|e| e - now),
                address: None,
            })
            .into_iter()
            .collect())
    }

    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let mut locks = self.locks.lock().unwrap();
        let key = (object.clone(), lock.to_owned());
        match locks.get(&key) {
            Some(l) if l.client == client && l.cookie == cookie => {
                locks.remove(&key);
                Ok(())
            }
            _ => Err(StoreError::NotLocked {
                object: object.to_string(),
                lock: lock.to_owned(),
                client: client.to_owned(),
                cookie: cookie.to_owned(),
            }),
        }
    }

    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn client_id(&self) -> &str {
        "bench-map"
    }

    fn distinguishes_holes(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum StoreKind {
    Map,
    Memory,
    MemUri,
}

impl StoreKind {
    const ALL: [StoreKind; 3] = [StoreKind::Map, StoreKind::Memory, StoreKind::MemUri];
    fn name(self) -> &'static str {
        match self {
            StoreKind::Map => "map",
            StoreKind::Memory => "memory",
            StoreKind::MemUri => "mem-uri",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rw {
    /// `Image::read` into the task's own buffer, reused from IO to IO.
    Read,
    /// `Image::write` of a borrowed buffer (encrypted into a new one).
    Write,
    /// A read as `ivdisk serve` makes it: `Image::read_reply`, the buffer it returns freed
    /// once sent (the front end's work, timed and taken out).
    NbdRead,
    /// A write as `ivdisk serve` makes it: the payload received into a fresh buffer (a copy
    /// here, the front end's work, timed and taken out), then handed over (`Image::write_owned`,
    /// encrypted in place).
    NbdWrite,
}

impl Rw {
    const ALL: [Rw; 4] = [Rw::Read, Rw::Write, Rw::NbdRead, Rw::NbdWrite];
    fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::NbdRead => "nbd-read",
            Rw::NbdWrite => "nbd-write",
        }
    }
    /// The raw crypto this direction is compared with.
    fn crypto(self) -> Rw {
        match self {
            Rw::Read | Rw::NbdRead => Rw::Read,
            Rw::Write | Rw::NbdWrite => Rw::Write,
        }
    }
}

struct Config {
    suites: Vec<Suite>,
    layouts: Vec<LayoutKind>,
    stores: Vec<StoreKind>,
    sizes: Vec<usize>,
    rws: Vec<Rw>,
    seconds: f64,
    warmup: f64,
    crypto_seconds: f64,
    /// Windows per measurement, each between two raw crypto measurements.
    reps: usize,
    image_size: u64,
    quick: bool,
    json: Option<PathBuf>,
    /// CPU cost of timing one `map` store operation ([`timer_pair_ns`]).
    timer_pair_ns: f64,
}

fn list_from_env<T: Copy>(var: &str, all: &[T], name: impl Fn(T) -> String) -> Vec<T> {
    match std::env::var(var) {
        Err(_) => all.to_vec(),
        Ok(list) => list
            .split(',')
            .map(|s| {
                let s = s.trim();
                *all.iter().find(|&&x| name(x) == s).unwrap_or_else(|| {
                    let known: Vec<String> = all.iter().map(|&x| name(x)).collect();
                    panic!("{var}: unknown `{s}` (known: {})", known.join(", "))
                })
            })
            .collect(),
    }
}

impl Config {
    fn from_env() -> Config {
        let bench = std::env::args().any(|a| a == "--bench");
        let quick = std::env::var("IVDISK_BENCH_QUICK").is_ok_and(|v| v == "1");
        let suites = list_from_env("IVDISK_BENCH_SUITES", &Suite::ALL, |s| s.name().into());
        let layouts = list_from_env("IVDISK_BENCH_LAYOUTS", &LayoutKind::ALL, |l| {
            l.name().into()
        });
        let default_stores = [StoreKind::Map, StoreKind::Memory];
        let stores = match std::env::var("IVDISK_BENCH_STORES") {
            Ok(_) => list_from_env("IVDISK_BENCH_STORES", &StoreKind::ALL, |s| s.name().into()),
            Err(_) => default_stores.to_vec(),
        };
        let rws = list_from_env("IVDISK_BENCH_RW", &Rw::ALL, |r| r.name().into());
        if !bench {
            // Smoke test (cargo test --all-targets): every code path once, briefly.
            return Config {
                suites: vec![Suite::Aegis128lRandom],
                layouts: vec![LayoutKind::ObjectEnd, LayoutKind::OmapPacked],
                stores: default_stores.to_vec(),
                sizes: vec![64 << 10],
                rws: Rw::ALL.to_vec(),
                seconds: 0.1,
                warmup: 0.05,
                crypto_seconds: 0.02,
                reps: 2,
                image_size: 16 << 20,
                quick: true,
                json: None,
                timer_pair_ns: timer_pair_ns(),
            };
        }
        let sizes = sizes_from_env().unwrap_or_else(|| {
            if quick {
                QUICK_SIZES.to_vec()
            } else {
                SIZES.to_vec()
            }
        });
        let (seconds, warmup, crypto, reps, mib) = if quick {
            (0.25, 0.1, 0.05, 1, 128)
        } else {
            (0.35, 0.25, 0.05, 3, 256)
        };
        let image_size = env_or("IVDISK_BENCH_IMAGE_MIB", mib as u64) << 20;
        assert!(
            image_size >= FILL_IO as u64 && image_size.is_multiple_of(FILL_IO as u64),
            "IVDISK_BENCH_IMAGE_MIB: a multiple of 4"
        );
        let json = std::env::var_os("IVDISK_BENCH_JSON")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                target_dir(env!("CARGO_MANIFEST_DIR"))
                    .join("bench-image")
                    .join("image_io.json")
            });
        Config {
            suites,
            layouts,
            stores,
            sizes,
            rws,
            seconds: env_or("IVDISK_BENCH_SECONDS", seconds),
            warmup: env_or("IVDISK_BENCH_WARMUP", warmup),
            crypto_seconds: env_or("IVDISK_BENCH_CRYPTO_SECONDS", crypto),
            reps: env_or("IVDISK_BENCH_REPS", reps),
            image_size,
            quick,
            json: Some(json),
            timer_pair_ns: timer_pair_ns(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Measuring.

/// CPU nanoseconds that timing one piece of work costs (an empty one timed as [`WorkTally`]
/// times); the least of a few rounds.
fn timer_pair_ns() -> f64 {
    let tally = WorkTally::default();
    (0..5)
        .map(|_| {
            let n = 20_000;
            let t = ThreadTime::now();
            for _ in 0..n {
                tally.timed(|| std::hint::black_box(()));
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// CPU time per thread group, from `/proc/self/task/*/schedstat` (nanoseconds on the CPU).
#[derive(Default, Clone, Copy)]
struct ThreadCpu {
    /// The IO threads (with the `map` store's operations in them).
    io: u64,
    /// The store: the memory store's worker thread, or the `map` store's operations.
    store: u64,
    /// Operations of the `map` store (each timed with two `clock_gettime` calls).
    store_calls: u64,
    /// The front end's work (`nbd-read`, `nbd-write`), timed inside the IO threads.
    front: u64,
    front_calls: u64,
    other: u64,
}

fn thread_cpu() -> ThreadCpu {
    let mut out = ThreadCpu::default();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in dir.flatten() {
        let path = task.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let ns: u64 = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        match comm.trim() {
            IO_THREAD => out.io += ns,
            STORE_THREAD => out.store += ns,
            _ => out.other += ns,
        }
    }
    out
}

struct Snapshot {
    at: Instant,
    cpu: ProcessTime,
    threads: ThreadCpu,
    ops: u64,
}

impl Snapshot {
    fn take(ops: &OpCount, map: Option<&MapStore>, front: &WorkTally) -> Snapshot {
        let mut threads = thread_cpu();
        let (store_ns, store_calls) = map.map_or((0, 0), |m| m.tally.totals());
        threads.store += store_ns;
        threads.store_calls = store_calls;
        (threads.front, threads.front_calls) = front.totals();
        Snapshot {
            at: Instant::now(),
            cpu: ProcessTime::now(),
            threads,
            ops: ops.total(),
        }
    }
}

/// One measured window.
#[derive(Clone, Copy)]
struct Window {
    ops: u64,
    wall: f64,
    cpu: f64,
    io_cpu: f64,
    store_cpu: f64,
    /// The front end's work in the IO threads (part of `io_cpu`).
    front_cpu: f64,
    other_cpu: f64,
}

impl Window {
    /// The CPU between two snapshots, less the timers (`pair_ns` per timing; about half of it
    /// falls between the two clock readings, so inside the timed share).
    fn between(a: &Snapshot, b: &Snapshot, pair_ns: f64) -> Window {
        let ns = |x: u64, y: u64| y.saturating_sub(x) as f64 * 1e-9;
        let (ta, tb) = (&a.threads, &b.threads);
        let store_timers = (tb.store_calls - ta.store_calls) as f64 * pair_ns * 1e-9;
        let front_timers = (tb.front_calls - ta.front_calls) as f64 * pair_ns * 1e-9;
        let timers = store_timers + front_timers;
        Window {
            ops: b.ops - a.ops,
            wall: (b.at - a.at).as_secs_f64(),
            cpu: b.cpu.duration_since(a.cpu).as_secs_f64() - timers,
            io_cpu: ns(ta.io, tb.io) - timers,
            store_cpu: (ns(ta.store, tb.store) - store_timers / 2.0).max(0.0),
            front_cpu: (ns(ta.front, tb.front) - front_timers / 2.0).max(0.0),
            other_cpu: ns(a.threads.other, b.threads.other),
        }
    }
    fn per_io_us(&self, seconds: f64) -> f64 {
        seconds * 1e6 / self.ops as f64
    }
    fn iops(&self) -> f64 {
        self.ops as f64 / self.wall
    }
    fn gb_per_s(&self, size: usize) -> f64 {
        self.iops() * size as f64 / 1e9
    }
}

/// What one measurement runs.
struct Load {
    rw: Rw,
    size: usize,
    seed: u64,
    /// End a window once this many bytes were transferred since its tasks started.
    byte_cap: Option<u64>,
}

/// `cfg.reps` windows of `QUEUE_DEPTH` tasks doing the load's IOs on `image`. Before each
/// window the tasks start (after a warm-up: `cfg.warmup` the first time, `REWARM` after);
/// after it they stop and `between` runs (the raw crypto baseline, with the machine to itself).
fn measure_io(
    rt: &tokio::runtime::Runtime,
    cfg: &Config,
    image: &Image,
    load: Load,
    data: &Arc<Vec<u8>>,
    map: Option<&MapStore>,
    mut between: impl FnMut(),
) -> Vec<Window> {
    let front = Arc::new(WorkTally::default());
    let Load {
        rw,
        size,
        seed,
        byte_cap,
    } = load;
    let slots = image.size() / size as u64;
    let mut windows = Vec::new();
    for rep in 0..cfg.reps as u64 {
        let ops = Arc::new(OpCount::default());
        let stop = Arc::new(AtomicBool::new(false));
        let tasks: Vec<_> = (0..QUEUE_DEPTH as u64)
            .map(|t| {
                let (image, ops, stop) = (image.clone(), ops.clone(), stop.clone());
                let (data, front) = (data.clone(), front.clone());
                let seed = seed.wrapping_mul(1_000_003).wrapping_add(rep * 1000 + t);
                rt.spawn(async move {
                    let mut rng = Rng(seed);
                    let mut buf = vec![0u8; size];
                    let q = QUEUE_DEPTH as u64;
                    while !stop.load(Ordering::Relaxed) {
                        // Disjoint slots per task (t, t + 32, ...) when there are enough.
                        let slot = if slots >= q {
                            t + q * rng.below(slots / q)
                        } else {
                            rng.below(slots)
                        };
                        let offset = slot * size as u64;
                        match rw {
                            Rw::Read => image.read(offset, &mut buf).await.expect("image read"),
                            Rw::Write => image
                                .write(offset, &data[..size])
                                .await
                                .expect("image write"),
                            Rw::NbdRead => {
                                // As the NBD server reads: into a buffer the image returns,
                                // which the server frees once it sent it.
                                let reply =
                                    image.read_reply(offset, size).await.expect("image read");
                                front.timed(|| drop(reply));
                            }
                            Rw::NbdWrite => {
                                // As the NBD server receives a payload: into a fresh buffer,
                                // placed as the image asks (with room for `omap-tail`'s
                                // metadata after it; in slots for `unaligned`).
                                let placement = image.write_placement(offset, size as u64);
                                let payload = front.timed(|| received(&data[..size], placement));
                                image
                                    .write_payload(offset, payload)
                                    .await
                                    .expect("image write");
                            }
                        }
                        ops.add_one();
                    }
                })
            })
            .collect();
        let cap_ops = byte_cap.map_or(u64::MAX, |b| b / size as u64);
        let warmup = if rep == 0 { cfg.warmup } else { REWARM };
        std::thread::sleep(Duration::from_secs_f64(warmup));
        let start = Snapshot::take(&ops, map, &front);
        let deadline = start.at + Duration::from_secs_f64(cfg.seconds);
        loop {
            std::thread::sleep(Duration::from_millis(5));
            if Instant::now() >= deadline || ops.total() >= cap_ops {
                break;
            }
        }
        let end = Snapshot::take(&ops, map, &front);
        stop.store(true, Ordering::Relaxed);
        rt.block_on(async {
            for t in tasks {
                t.await.expect("IO task");
            }
        });
        windows.push(Window::between(&start, &end, cfg.timer_pair_ns));
        between();
    }
    windows
}

/// `data` as the NBD server receives a write's payload into a fresh buffer placed as the
/// image asked (its socket reads copy the bytes in, a sector to each slot for slots).
fn received(data: &[u8], placement: PayloadPlacement) -> WritePayload {
    match placement {
        PayloadPlacement::Contiguous { spare } => {
            let mut payload = Vec::with_capacity(data.len() + spare);
            payload.extend_from_slice(data);
            WritePayload::contiguous(payload)
        }
        PayloadPlacement::Slots { sector, slot } => {
            let mut slots = Vec::with_capacity(data.len() / sector * slot);
            for piece in data.chunks_exact(sector) {
                slots.extend_from_slice(piece);
                slots.resize(slots.len() + slot - sector, 0);
            }
            WritePayload::in_slots(slots, sector, slot)
        }
    }
}

/// Write the whole image once, in `FILL_IO` writes at queue depth 32. Returns GB/s.
fn fill(rt: &tokio::runtime::Runtime, image: &Image, data: &Arc<Vec<u8>>) -> f64 {
    let start = Instant::now();
    let chunks = image.size() / FILL_IO as u64;
    rt.block_on(async {
        let tasks: Vec<_> = (0..QUEUE_DEPTH as u64)
            .map(|t| {
                let (image, data) = (image.clone(), data.clone());
                tokio::spawn(async move {
                    let mut c = t;
                    while c < chunks {
                        image
                            .write(c * FILL_IO as u64, &data[..FILL_IO])
                            .await
                            .expect("fill write");
                        c += QUEUE_DEPTH as u64;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("fill task");
        }
        image.flush().await.expect("flush");
    });
    image.size() as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Raw crypto on this thread for `seconds` of its CPU time: IOs of `size` bytes encrypted
/// (`Rw::Write`) or decrypted from real ciphertext (`Rw::Read`), and the CPU time they took.
fn crypto_run(cipher: &dyn SectorCipher, rw: Rw, size: usize, seconds: f64) -> (Duration, u64) {
    let batch = size.max(1 << 20);
    let per = size / SECTOR;
    let ml = cipher.metadata_len();
    let mut work = Rng(size as u64).bytes(batch);
    let mut meta = vec![0u8; batch / SECTOR * ml];
    let lba = |i: usize| 1000 + (i * per) as u64;
    for (i, d) in work.chunks_mut(size).enumerate() {
        let m = &mut meta[i * per * ml..(i + 1) * per * ml];
        cipher.encrypt_sectors(lba(i), d, m).expect("encrypt");
    }
    let pristine = work.clone();
    let mut total = Duration::ZERO;
    let mut ios = 0u64;
    while total.as_secs_f64() < seconds || ios == 0 {
        work.copy_from_slice(&pristine);
        let t = ThreadTime::now();
        for (i, d) in work.chunks_mut(size).enumerate() {
            let m = &mut meta[i * per * ml..(i + 1) * per * ml];
            match rw.crypto() {
                Rw::Write => cipher.encrypt_sectors(lba(i), d, m).expect("encrypt"),
                _ => cipher.decrypt_sectors(lba(i), d, m).expect("decrypt"),
            }
        }
        total += t.elapsed();
        ios += (batch / size) as u64;
    }
    (total, ios)
}

/// Raw crypto CPU us per IO, on as many threads at once as the runtime has workers (the
/// engine runs on all of them: on a VM, a thread computes slower while its sibling vCPU is busy
/// too, so a one-thread baseline would flatter the comparison).
fn crypto_cost(
    cipher: &dyn SectorCipher,
    rw: Rw,
    size: usize,
    seconds: f64,
    threads: usize,
) -> f64 {
    let runs: Vec<(Duration, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| crypto_run(cipher, rw, size, seconds)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("crypto thread"))
            .collect()
    });
    let cpu: f64 = runs.iter().map(|r| r.0.as_secs_f64()).sum();
    let ios: u64 = runs.iter().map(|r| r.1).sum();
    cpu * 1e6 / ios as f64
}

// ---------------------------------------------------------------------------------------------
// Results.

/// The 1, 5 and 15 minute load averages (the machine is shared: others' load shows here).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

struct EngineResult {
    suite: Suite,
    layout: LayoutKind,
    store: StoreKind,
    size: usize,
    rw: Rw,
    windows: Vec<Window>,
    fill_gb_per_s: f64,
    /// Raw crypto CPU us per IO before the first window and after each.
    crypto: Vec<f64>,
}

/// One window's figures (CPU us per IO) against the raw crypto around it.
struct Figures {
    all: f64,
    store: f64,
    /// The front end's buffers (`nbd-read`, `nbd-write`).
    front: f64,
    engine: f64,
    crypto: f64,
    gb_per_s: f64,
    cores: f64,
}

impl Figures {
    fn overhead(&self) -> f64 {
        (self.engine - self.crypto) / self.crypto
    }
    fn all_over_crypto(&self) -> f64 {
        self.all / self.crypto
    }
}

impl EngineResult {
    fn figures(&self) -> Vec<Figures> {
        self.windows
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let all = w.per_io_us(w.cpu);
                let store = w.per_io_us(w.store_cpu);
                let front = w.per_io_us(w.front_cpu);
                Figures {
                    all,
                    store,
                    front,
                    engine: all - store - front,
                    crypto: (self.crypto[i] + self.crypto[i + 1]) / 2.0,
                    gb_per_s: w.gb_per_s(self.size),
                    cores: w.cpu / w.wall,
                }
            })
            .collect()
    }

    /// The median over the windows of `f`.
    fn median(&self, f: impl Fn(&Figures) -> f64) -> f64 {
        median(&self.figures().iter().map(f).collect::<Vec<_>>())
    }
}

/// A store to measure on, and the image on it.
struct Bench {
    image: Image,
    /// Keeps a fresh store alive until the image is closed (dropping a memory store joins its
    /// worker thread).
    store: Option<Arc<dyn ObjectStore>>,
    map: Option<Arc<MapStore>>,
}

async fn create_image(kind: StoreKind, name: &str, options: &CreateOptions) -> Bench {
    let (store, map): (Option<Arc<dyn ObjectStore>>, _) = match kind {
        StoreKind::Map => {
            let map = Arc::new(MapStore::default());
            (Some(map.clone()), Some(map))
        }
        StoreKind::Memory => (
            Some(Arc::new(MemoryStore::new().expect("an in-memory store"))),
            None,
        ),
        StoreKind::MemUri => (None, None),
    };
    let image = match &store {
        Some(store) => Image::create_on(store.clone(), name, options, PASSPHRASE).await,
        None => {
            let uri = ImageUri::parse(&format!("mem:{name}")).expect("mem: URI");
            Image::create(&uri, options, PASSPHRASE).await
        }
    }
    .expect("creating the image");
    Bench { image, store, map }
}

fn json_engine(e: &EngineResult) -> String {
    let list = |f: &dyn Fn(&Figures) -> f64, d: usize| {
        let v: Vec<f64> = e.figures().iter().map(f).collect();
        json_list(&v, d)
    };
    let w = &e.windows;
    format!(
        "{{\"suite\": {}, \"layout\": {}, \"store\": {}, \"size\": {}, \"op\": \"{}\", \
         \"cpu_us_per_io\": {}, \"store_us_per_io\": {}, \"front_us_per_io\": {}, \
         \"engine_us_per_io\": {}, \
         \"crypto_us_per_io\": {}, \"engine_overhead\": {}, \"all_over_crypto\": {}, \
         \"gb_per_s\": {}, \"cores\": {}, \"fill_gb_per_s\": {}, \"windows\": {{\
         \"ops\": {}, \"wall_s\": {}, \"cpu_s\": {}, \"io_threads_cpu_s\": {}, \
         \"store_cpu_s\": {}, \"other_threads_cpu_s\": {}, \"cpu_us_per_io\": {}, \
         \"store_us_per_io\": {}, \"crypto_us_per_io_around\": {}, \"engine_overhead\": {}}}}}",
        json_str(e.suite.name()),
        json_str(e.layout.name()),
        json_str(e.store.name()),
        e.size,
        e.rw.name(),
        json_num(e.median(|f| f.all), 3),
        json_num(e.median(|f| f.store), 3),
        json_num(e.median(|f| f.front), 3),
        json_num(e.median(|f| f.engine), 3),
        json_num(e.median(|f| f.crypto), 4),
        json_num(e.median(Figures::overhead), 4),
        json_num(e.median(Figures::all_over_crypto), 4),
        json_num(e.median(|f| f.gb_per_s), 4),
        json_num(e.median(|f| f.cores), 3),
        json_num(e.fill_gb_per_s, 3),
        json_list(&w.iter().map(|w| w.ops as f64).collect::<Vec<_>>(), 0),
        json_list(&w.iter().map(|w| w.wall).collect::<Vec<_>>(), 4),
        json_list(&w.iter().map(|w| w.cpu).collect::<Vec<_>>(), 4),
        json_list(&w.iter().map(|w| w.io_cpu).collect::<Vec<_>>(), 4),
        json_list(&w.iter().map(|w| w.store_cpu).collect::<Vec<_>>(), 4),
        json_list(&w.iter().map(|w| w.other_cpu).collect::<Vec<_>>(), 4),
        list(&|f| f.all, 3),
        list(&|f| f.store, 3),
        json_list(&e.crypto, 4),
        list(&Figures::overhead, 4),
    )
}

fn main() {
    let cfg = Config::from_env();
    let m = machine();
    println!(
        "image IO in process, queue depth {QUEUE_DEPTH}: {} CPUs ({}), {}, Linux {}",
        m.cpus, m.cpu_model, m.memory, m.kernel
    );
    println!(
        "image {} MiB, 4 MiB objects, 4 KiB sectors; {} windows of {} s per measurement (warm-up \
         {} s, then {REWARM} s), raw crypto ({} s per thread) before the first and after each; \
         timers ({} clock) {:.0} ns per timed piece of work (taken out); figures are medians \
         over the windows; GB = 10^9 bytes",
        cfg.image_size >> 20,
        cfg.reps,
        cfg.seconds,
        cfg.warmup,
        cfg.crypto_seconds,
        timer_clock().name(),
        cfg.timer_pair_ns
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(IO_THREAD)
        .build()
        .expect("tokio runtime");
    let data = Arc::new(Rng(0x1d15c).bytes(SIZES[5].max(FILL_IO)));
    let mut engine = Vec::new();
    let threads = m.cpus.max(1);
    let load_before = loadavg();
    let started = Instant::now();
    let mut seed = 1u64;
    let mut image_no = 0u64;
    for &suite in &cfg.suites {
        let layouts: Vec<LayoutKind> = cfg
            .layouts
            .iter()
            .copied()
            .filter(|l| l.fits(suite.metadata_len()))
            .collect();
        if layouts.is_empty() {
            continue;
        }
        let key = VolumeKey::generate(suite.default_key_len()).expect("OS random source");
        let cipher =
            new_cipher(suite, &key, &CipherParams::new(SECTOR, ImageId([9; 16]))).expect("cipher");
        for &size in &cfg.sizes {
            for &layout in &layouts {
                for &store in &cfg.stores {
                    image_no += 1;
                    let name = format!("bench-{}-{image_no}", std::process::id());
                    let mut options = CreateOptions::new(cfg.image_size);
                    options.suite = suite;
                    options.layout = Some(layout);
                    options.object_size = DEFAULT_OBJECT_SIZE;
                    options.pbkdf = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
                    let t0 = Instant::now();
                    let bench = rt.block_on(create_image(store, &name, &options));
                    let t_create = t0.elapsed().as_secs_f64();
                    let fill_gb = fill(&rt, &bench.image, &data);
                    let t_fill = t0.elapsed().as_secs_f64();
                    let mut line = format!(
                        "{:>17} {:>10} {:>7} {:>7}: fill {fill_gb:.2} GB/s",
                        suite.name(),
                        layout.name(),
                        store.name(),
                        size_label(size)
                    );
                    for &rw in &cfg.rws {
                        seed += 1;
                        let cap = (store != StoreKind::Map && rw.crypto() == Rw::Write)
                            .then_some(MEMORY_WRITE_CAP);
                        let map = bench.map.as_deref();
                        let load = Load {
                            rw,
                            size,
                            seed,
                            byte_cap: cap,
                        };
                        // Raw crypto before the first window and after each.
                        let c = cfg.crypto_seconds;
                        let crypto_rw = rw.crypto();
                        let mut crypto =
                            vec![crypto_cost(cipher.as_ref(), crypto_rw, size, c, threads)];
                        let windows = measure_io(&rt, &cfg, &bench.image, load, &data, map, || {
                            crypto.push(crypto_cost(cipher.as_ref(), crypto_rw, size, c, threads))
                        });
                        let e = EngineResult {
                            suite,
                            layout,
                            store,
                            size,
                            rw,
                            windows,
                            fill_gb_per_s: fill_gb,
                            crypto,
                        };
                        let _ = write!(
                            line,
                            " | {} {:.2} GB/s ({:.1} cores) {:.1} us/IO (store {:.1}, \
                             front {:.1}, crypto {:.1}) {:+.0}%",
                            rw.name(),
                            e.median(|f| f.gb_per_s),
                            e.median(|f| f.cores),
                            e.median(|f| f.all),
                            e.median(|f| f.store),
                            e.median(|f| f.front),
                            e.median(|f| f.crypto),
                            e.median(Figures::overhead) * 100.0
                        );
                        engine.push(e);
                    }
                    let t_measure = t0.elapsed().as_secs_f64();
                    rt.block_on(bench.image.close()).expect("closing the image");
                    if store == StoreKind::MemUri {
                        let uri = ImageUri::parse(&format!("mem:{name}")).expect("mem: URI");
                        rt.block_on(Image::delete(&uri, |_, _| {}))
                            .expect("deleting the image");
                    }
                    drop(bench.store);
                    let _ = write!(
                        line,
                        " [s: create {t_create:.2} fill {:.2} measure {:.2} close {:.2}]",
                        t_fill - t_create,
                        t_measure - t_fill,
                        t0.elapsed().as_secs_f64() - t_measure
                    );
                    eprintln!("{line}");
                }
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();

    // One row per measurement; scripts/bench-image renders the tables of docs/BENCHMARKS.md
    // from the JSON.
    println!(
        "\n| suite | layout | store | size | op | GB/s | CPU us/IO | store us/IO | engine us/IO | \
         crypto us/IO | engine+store / crypto | engine overhead |"
    );
    println!("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for e in &engine {
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2}x | {:+.0}% |",
            e.suite.name(),
            e.layout.name(),
            e.store.name(),
            size_label(e.size),
            e.rw.name(),
            e.median(|f| f.gb_per_s),
            e.median(|f| f.all),
            e.median(|f| f.store),
            e.median(|f| f.engine),
            e.median(|f| f.crypto),
            e.median(Figures::all_over_crypto),
            e.median(Figures::overhead) * 100.0
        );
    }
    println!("\n{elapsed:.0} s");

    let Some(path) = &cfg.json else { return };
    let mut json = String::from("{\n");
    let _ = writeln!(json, "  \"machine\": {},", m.to_json());
    let _ = writeln!(
        json,
        "  \"queue_depth\": {QUEUE_DEPTH}, \"seconds\": {}, \"warmup_seconds\": {}, \
         \"crypto_seconds\": {}, \"reps\": {}, \"image_bytes\": {}, \
         \"object_size\": {DEFAULT_OBJECT_SIZE}, \"sector_size\": {SECTOR}, \"quick\": {}, \
         \"elapsed_seconds\": {elapsed:.1}, \
         \"map_timer_ns_per_op\": {:.1}, \"timer_clock\": {}, \
         \"crypto_threads\": {threads}, \"loadavg_before\": {}, \"loadavg_after\": {},",
        cfg.seconds,
        cfg.warmup,
        cfg.crypto_seconds,
        cfg.reps,
        cfg.image_size,
        cfg.quick,
        cfg.timer_pair_ns,
        json_str(timer_clock().name()),
        json_str(&load_before),
        json_str(&loadavg())
    );
    json.push_str("  \"engine\": [\n");
    for (i, e) in engine.iter().enumerate() {
        let comma = if i + 1 < engine.len() { "," } else { "" };
        let _ = writeln!(json, "    {}{comma}", json_engine(e));
    }
    json.push_str("  ]\n}\n");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("creating the JSON directory");
    }
    std::fs::write(path, json).expect("writing the JSON samples");
    println!("samples: {}", path.display());
}
