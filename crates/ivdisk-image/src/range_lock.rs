//! Serializes writes that touch the same sectors: a read-modify-write of a partial sector must
//! not interleave with another write of that sector, or one of the two is lost. Writes to
//! disjoint sector ranges proceed in parallel; reads take no lock (each object operation is
//! atomic, and a block device promises nothing more to concurrent overlapping IO).
//!
//! Three ways to hold sectors, by what the write is:
//! - a write of whole sectors inside one object ([`RangeLocks::hold_whole_sectors`], the usual
//!   write) takes no range lock while no exclusive holder is about: it only counts itself in
//!   flight. Two such writes of the same sectors are one object operation each, which the
//!   store (and the metadata cache) applies in some order: a serial order of the two;
//! - other writes of whole sectors (over several objects) take the range lock, so two of them
//!   never interleave object by object;
//! - a read-modify-write, a snapshot and a shrink hold [`RangeLocks::lock_exclusive`]: they
//!   announce themselves in the shards of the objects they touch (from then on every write
//!   in those shards takes the range lock), wait until no write without one is in flight
//!   there, then take the range lock. Per shard, so that a read-modify-write waits only for
//!   writes to its own objects (and those sharing their shard), not for every write of the
//!   image, which on RADOS is a round trip to the OSDs.
//!
//! Why the first: with a lock per write, taking and releasing it were cache misses on a VM
//! whose cores are far apart, the largest part of the engine's own time in 64 KiB writes.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;

use crossbeam_utils::CachePadded;
use smallvec::SmallVec;
use tokio::sync::Notify;

/// Shards of the held ranges: a range lies in granules of `granule` sectors (the image's
/// objects), and granule `g`'s part of it is held in shard `g % SHARDS`.
const SHARDS: u64 = 64;

/// Why sharded: with one lock for the image, the other core had almost always touched it
/// between a write's lock and its release, so both were cache misses. Now a write that takes
/// a range mostly finds its shard where it left it, and two on different objects do not meet.
///
/// Every locker takes its parts in the order of the shards, so two lockers never wait on
/// each other. A range over fewer than `SHARDS` granules has one part per granule, each in a
/// shard of its own; a wider one (taking the whole image for a snapshot) holds itself whole
/// in every shard, which overlaps every part in it of a granule it covers.
#[derive(Debug)]
pub(crate) struct RangeLocks {
    /// Sectors per granule (at least 1).
    granule: u64,
    /// Sectors before the first one locked by number 0: a foreign volume's data area starts
    /// `offset` sectors into its objects (a LUKS1 file's at 2 MiB of 4 MiB objects), and a
    /// granule must be an object, not the `granule` sectors from the data area's start, or
    /// a write inside one object counted in one shard was not seen by a read-modify-write of
    /// its later sectors, which announced itself in the next shard only (and lost the write).
    offset: u64,
    shards: Box<[CachePadded<Mutex<Held>>]>,
    released: Notify,
    /// Writes in flight without a range lock, counted per slot and shard: a thread counts in
    /// its own slot ([`thread_slot`]), lines other cores seldom touch. The sum over the slots
    /// is how many are in flight in a shard; one slot may go below zero (a write may finish
    /// on another thread).
    unlocked: Box<[CachePadded<[AtomicI64; SHARDS as usize]>]>,
    /// Exclusive holders waiting or holding, per shard: while there is one, writes in the
    /// shard take range locks. Read by every write and written only by exclusive holders,
    /// so the lines stay shared between the cores.
    exclusive: Box<[AtomicUsize]>,
    /// Woken when a write without a range lock finishes or backs off while an exclusive
    /// holder is about in its shard.
    drained: Notify,
}

/// Slots of [`RangeLocks::unlocked`].
const UNLOCKED_SLOTS: usize = 16;

/// This thread's slot of [`RangeLocks::unlocked`], dealt out in turn.
fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SLOT: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % UNLOCKED_SLOTS;
    }
    SLOT.with(|slot| *slot)
}

#[derive(Debug, Default)]
struct Held {
    /// (start, end, id) of every range part held. Inline for one: the shard's usual load,
    /// so taking and releasing it touch the shard's own cache line and no other.
    ranges: SmallVec<[(u64, u64, u64); 1]>,
    /// Lockers waiting for a release in this shard. Why counted: registering with `Notify`
    /// and waking it take its own lock; with nobody waiting (the usual case) a lock and its
    /// release cost one mutex each and nothing else.
    waiting: usize,
    /// The id of the next part taken here (counted under the mutex: an atomic of its own
    /// was one more shared line per write).
    next_id: u64,
}

impl Held {
    /// Hold `[start, end)` if nothing held overlaps it: its id.
    fn try_take(&mut self, start: u64, end: u64) -> Option<u64> {
        if self.ranges.iter().any(|&(s, e, _)| s < end && start < e) {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.ranges.push((start, end, id));
        Some(id)
    }
}

/// Holds sectors `[start, end)` until dropped: one part per shard it has a part in.
#[derive(Debug)]
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    /// (shard, id) of the first part held (`None` until it is), then of the others: most
    /// ranges lie in one granule, and need no vector.
    first: Option<(u64, u64)>,
    more: Vec<(u64, u64)>,
}

/// Counts one waiter of a shard while it lives (also when the waiting future is dropped).
struct Waiting<'a>(&'a RangeLocks, u64);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.held(self.1).waiting -= 1;
    }
}

impl RangeLocks {
    /// Locks for ranges of sectors, sharded by granules of `granule` sectors, the first of
    /// which holds sectors up to `granule - offset % granule` (the image's objects, the
    /// first of which starts `offset` sectors before sector 0).
    pub(crate) fn new(granule: u64, offset: u64) -> Self {
        RangeLocks {
            granule: granule.max(1),
            offset,
            shards: (0..SHARDS).map(|_| CachePadded::default()).collect(),
            released: Notify::new(),
            unlocked: (0..UNLOCKED_SLOTS)
                .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicI64::new(0))))
                .collect(),
            exclusive: (0..SHARDS).map(|_| AtomicUsize::new(0)).collect(),
            drained: Notify::new(),
        }
    }

    /// Hold `[start, end)` for a write of whole sectors inside one object: counted in flight
    /// without a range lock, or, while an exclusive holder is about, the range lock.
    pub(crate) async fn hold_whole_sectors(&self, start: u64, end: u64) -> WriteHold<'_> {
        let (start, end) = self.placed(start, end);
        let shard = self.shard_of(start);
        // Counted first, then the check: an exclusive holder announces itself first, then
        // sums the counts, so (all four sequentially consistent) either this write sees it
        // and takes the range lock, or it sees this write and waits for it to finish.
        self.unlocked[thread_slot()][shard].fetch_add(1, SeqCst);
        if self.exclusive[shard].load(SeqCst) == 0 {
            return WriteHold::Unlocked {
                _counted: UnlockedWrite(self, shard),
            };
        }
        self.uncount_unlocked(shard);
        WriteHold::Range {
            _range: self.lock_placed(start, end).await,
        }
    }

    /// Hold `[start, end)` for a write that must not overlap any other in flight (a
    /// read-modify-write of partial sectors; a snapshot or shrink, over the whole image).
    pub(crate) async fn lock_exclusive(&self, start: u64, end: u64) -> WriteHold<'_> {
        let (start, end) = self.placed(start, end);
        let shards = self.shards_of(start, end);
        for shard in shards.clone() {
            self.exclusive[shard].fetch_add(1, SeqCst);
        }
        // Withdrawn also if this future is dropped while it waits.
        let announced = Exclusive(self, shards.clone());
        loop {
            // Registered before the sums, so a write finishing after them wakes us.
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if shards
                .clone()
                .all(|shard| self.unlocked_in_flight(shard) == 0)
            {
                break;
            }
            drained.await;
        }
        WriteHold::Exclusive {
            _range: self.lock_placed(start, end).await,
            _announced: announced,
        }
    }

    /// Sectors `[start, end)` numbered from the first granule's start, as every lock below
    /// holds them (the end saturates: `u64::MAX` is the whole image).
    fn placed(&self, start: u64, end: u64) -> (u64, u64) {
        (
            start.saturating_add(self.offset),
            end.saturating_add(self.offset),
        )
    }

    /// Writes in flight without a range lock in `shard`. Never less than the true count while
    /// one is in flight: a write counted after the sum began sees the exclusive holder and
    /// uncounts at once.
    fn unlocked_in_flight(&self, shard: usize) -> i64 {
        self.unlocked
            .iter()
            .map(|counts| counts[shard].load(SeqCst))
            .sum()
    }

    fn uncount_unlocked(&self, shard: usize) {
        self.unlocked[thread_slot()][shard].fetch_sub(1, SeqCst);
        if self.exclusive[shard].load(SeqCst) > 0 {
            self.drained.notify_waiters();
        }
    }

    /// The shard of the granule holding sector `sector`.
    fn shard_of(&self, sector: u64) -> usize {
        (sector / self.granule % SHARDS) as usize
    }

    /// The shards of the granules `[start, end)` touches: consecutive, wrapping around, or
    /// every shard.
    fn shards_of(&self, start: u64, end: u64) -> ShardSpan {
        let granules = match end > start {
            true => (end - 1) / self.granule - start / self.granule + 1,
            false => 0,
        };
        ShardSpan {
            first: self.shard_of(start),
            count: granules.min(SHARDS) as usize,
        }
    }

    /// Shard `shard`, locked.
    fn held(&self, shard: u64) -> std::sync::MutexGuard<'_, Held> {
        self.shards[shard as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until no other guard overlaps `[start, end)`, then hold it.
    pub(crate) async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let (start, end) = self.placed(start, end);
        self.lock_placed(start, end).await
    }

    /// `lock`, for sectors already `placed`.
    async fn lock_placed(&self, start: u64, end: u64) -> RangeGuard<'_> {
        // Built first, so that parts taken are released if this future is dropped while it
        // waits for a later one.
        let mut guard = RangeGuard {
            locks: self,
            first: None,
            more: Vec::new(),
        };
        if start >= end {
            return guard;
        }
        let (first, last) = (start / self.granule, (end - 1) / self.granule);
        let mut hold = |shard, id| match guard.first {
            None => guard.first = Some((shard, id)),
            Some(_) => guard.more.push((shard, id)),
        };
        if first == last {
            hold(
                first % SHARDS,
                self.lock_part(first % SHARDS, start, end).await,
            );
        } else if last - first + 1 >= SHARDS {
            for shard in 0..SHARDS {
                hold(shard, self.lock_part(shard, start, end).await);
            }
        } else {
            let mut parts: Vec<(u64, u64, u64)> = (first..=last)
                .map(|g| {
                    let range = (
                        start.max(g * self.granule),
                        end.min((g + 1).saturating_mul(self.granule)),
                    );
                    (g % SHARDS, range.0, range.1)
                })
                .collect();
            parts.sort_unstable_by_key(|&(shard, ..)| shard);
            for (shard, start, end) in parts {
                hold(shard, self.lock_part(shard, start, end).await);
            }
        }
        guard
    }

    /// Hold `[start, end)` in shard `shard`: its id.
    async fn lock_part(&self, shard: u64, start: u64, end: u64) -> u64 {
        {
            let mut held = self.held(shard);
            if let Some(id) = held.try_take(start, end) {
                return id;
            }
            held.waiting += 1;
        }
        let _waiting = Waiting(self, shard);
        loop {
            // Register for the wake-up before checking again, so a release between the check
            // and the wait is not missed (a release that came before the registration is
            // seen by the check).
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(id) = self.held(shard).try_take(start, end) {
                return id;
            }
            released.await;
        }
    }

    fn release(&self, (shard, id): (u64, u64)) {
        let mut held = self.held(shard);
        held.ranges.retain(|part| part.2 != id);
        let waiting = held.waiting > 0;
        drop(held);
        if waiting {
            self.released.notify_waiters();
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        for part in self.first.into_iter().chain(self.more.drain(..)) {
            self.locks.release(part);
        }
    }
}

/// A write's hold on its sectors, until dropped (what each variant holds is released then).
#[derive(Debug)]
pub(crate) enum WriteHold<'a> {
    /// Counted in flight, no range lock.
    Unlocked { _counted: UnlockedWrite<'a> },
    /// The range lock.
    Range { _range: RangeGuard<'a> },
    /// The range lock of an exclusive holder (released before the announcement is).
    Exclusive {
        _range: RangeGuard<'a>,
        _announced: Exclusive<'a>,
    },
}

/// A write counted in flight without a range lock in a shard, uncounted when dropped.
#[derive(Debug)]
pub(crate) struct UnlockedWrite<'a>(&'a RangeLocks, usize);

impl Drop for UnlockedWrite<'_> {
    fn drop(&mut self) {
        self.0.uncount_unlocked(self.1);
    }
}

/// An exclusive holder's announcement in its shards, withdrawn when dropped.
#[derive(Debug)]
pub(crate) struct Exclusive<'a>(&'a RangeLocks, ShardSpan);

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        for shard in self.1.clone() {
            self.0.exclusive[shard].fetch_sub(1, SeqCst);
        }
    }
}

/// `count` shards from `first` on, wrapping around.
#[derive(Debug, Clone)]
pub(crate) struct ShardSpan {
    first: usize,
    count: usize,
}

impl Iterator for ShardSpan {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        if self.count == 0 {
            return None;
        }
        let shard = self.first;
        self.first = (self.first + 1) % SHARDS as usize;
        self.count -= 1;
        Some(shard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_ranges_wait_disjoint_ones_do_not() {
        // Granules of 8 sectors: these ranges have parts in two or three shards.
        let locks = Arc::new(RangeLocks::new(8, 0));
        let first = locks.lock(10, 20).await;
        // Disjoint: immediate.
        let _other = tokio::time::timeout(Duration::from_secs(1), locks.lock(20, 30))
            .await
            .expect("a disjoint range does not wait");
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _g = locks.lock(15, 16).await;
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "an overlapping range waits");
        drop(first);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("released ranges wake waiters")
            .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn contended_lockers_all_finish_and_cancelled_waiters_are_uncounted() {
        let locks = Arc::new(RangeLocks::new(8, 0));
        // A waiter given up on (its future dropped) no longer counts.
        let first = locks.lock(0, 8).await;
        let gave_up = tokio::time::timeout(Duration::from_millis(50), locks.lock(4, 5)).await;
        assert!(gave_up.is_err(), "an overlapping range waits");
        assert_eq!(locks.held(0).waiting, 0, "a dropped waiter is uncounted");
        drop(first);
        // Many tasks over few overlapping ranges: every one gets its turn, none at once with
        // an overlapping one.
        let inside = Arc::new([(); 4].map(|_| std::sync::atomic::AtomicUsize::new(0)));
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let (locks, inside) = (locks.clone(), inside.clone());
                tokio::spawn(async move {
                    for round in 0..50u64 {
                        let slot = ((i + round) % 4) as usize;
                        let _g = locks.lock(slot as u64 * 10, slot as u64 * 10 + 10).await;
                        let before = inside[slot].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(before, 0, "two holders of one range");
                        tokio::task::yield_now().await;
                        inside[slot].fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                })
            })
            .collect();
        all_finish(tasks, "no locker is left waiting").await;
        assert!(idle(&locks));
    }

    #[test]
    fn a_shard_with_one_range_fits_one_cache_line() {
        assert!(std::mem::size_of::<Mutex<Held>>() <= 64);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn whole_sector_writes_take_no_range_lock_until_an_exclusive_holder_comes() {
        // Granules of 8 sectors: sectors 0..8 in shard 0, 40..48 in shard 5, and 512..520
        // (granule 64) in shard 0 again.
        let locks = Arc::new(RangeLocks::new(8, 0));
        let wait = Duration::from_millis(50);
        let first = locks.hold_whole_sectors(0, 8).await;
        assert!(matches!(first, WriteHold::Unlocked { .. }));
        // It holds no range: a range lock of the same sectors is taken at once.
        let range = tokio::time::timeout(wait, locks.lock(0, 8)).await;
        drop(range.expect("no range lock held by a whole-sector write"));
        // An exclusive holder in another shard does not wait for it.
        let other_shard = tokio::time::timeout(wait, locks.lock_exclusive(40, 41)).await;
        drop(other_shard.expect("an exclusive holder waits only for writes in its shards"));
        // One in its shard (another object) waits for it, and given up on, is forgotten.
        let gave_up = tokio::time::timeout(wait, locks.lock_exclusive(512, 513)).await;
        assert!(
            gave_up.is_err(),
            "an exclusive holder waits for writes in flight in its shard"
        );
        assert!(matches!(
            locks.hold_whole_sectors(16, 24).await,
            WriteHold::Unlocked { .. }
        ));
        // While one waits, writes in its shard take the range lock, the others do not; it
        // gets its range once the first write is done, even though a later one holds a
        // range elsewhere in the shard.
        let (held_tx, held_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let exclusive = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _held = locks.lock_exclusive(0, 4).await;
                held_tx.send(()).unwrap();
                release_rx.await.unwrap();
            })
        };
        tokio::time::sleep(wait).await;
        let same_shard = locks.hold_whole_sectors(512, 520).await;
        assert!(matches!(same_shard, WriteHold::Range { .. }));
        let other_shard = locks.hold_whole_sectors(40, 48).await;
        assert!(matches!(other_shard, WriteHold::Unlocked { .. }));
        assert!(!exclusive.is_finished(), "waits for the write in flight");
        drop(first);
        tokio::time::timeout(Duration::from_secs(5), held_rx)
            .await
            .expect("the exclusive holder goes on once the write is done")
            .unwrap();
        let overlapping = tokio::time::timeout(wait, locks.hold_whole_sectors(0, 8)).await;
        assert!(
            overlapping.is_err(),
            "a write waits for the exclusive holder's range"
        );
        release_tx.send(()).unwrap();
        exclusive.await.unwrap();
        drop((same_shard, other_shard));
        assert!(matches!(
            locks.hold_whole_sectors(0, 8).await,
            WriteHold::Unlocked { .. }
        ));
        assert!(idle(&locks));
    }

    /// A LUKS1 file's data starts 4096 sectors into its first object of 8192: object 1 holds
    /// sectors 4096..12288. A write inside it, counted without a range lock, must be seen by
    /// a read-modify-write of any of its sectors, also of those past 8192 (in the data
    /// area's second 8192 sectors, which was another granule and shard).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn granules_are_objects_when_the_data_starts_inside_one() {
        let locks = RangeLocks::new(8192, 4096);
        let write = locks.hold_whole_sectors(8190, 8194).await;
        assert!(matches!(write, WriteHold::Unlocked { .. }));
        let beside =
            tokio::time::timeout(Duration::from_millis(200), locks.lock_exclusive(8192, 8193))
                .await;
        assert!(
            beside.is_err(),
            "a read-modify-write of sector 8192 waits for the write"
        );
        // Sector 12288 is object 2's: nothing to wait for there.
        let next_object =
            tokio::time::timeout(Duration::from_secs(5), locks.lock_exclusive(12288, 12289))
                .await
                .expect("another object's read-modify-write does not wait");
        drop(next_object);
        drop(write);
        let after = tokio::time::timeout(Duration::from_secs(5), locks.lock_exclusive(8192, 8193))
            .await
            .expect("the read-modify-write goes on once the write is done");
        drop(after);
        assert!(idle(&locks));
    }

    /// The shards an exclusive holder announces itself in: those of the granules it touches,
    /// wrapping around, and all of them for a range over as many granules as there are
    /// shards; every write in them sees it, no other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exclusive_holder_announces_itself_in_the_shards_it_touches() {
        let locks = RangeLocks::new(8, 0);
        let shards = |start, end| locks.shards_of(start, end).collect::<Vec<_>>();
        assert_eq!(shards(0, 1), [0]);
        assert_eq!(shards(7, 9), [0, 1]);
        assert_eq!(shards(62 * 8, 66 * 8), [62, 63, 0, 1]);
        assert_eq!(
            shards(8, 8 + 64 * 8),
            (1..64).chain([0]).collect::<Vec<_>>()
        );
        assert_eq!(shards(0, u64::MAX), (0..64).collect::<Vec<_>>());
        assert!(shards(5, 5).is_empty());
        let held = locks.lock_exclusive(62 * 8, 66 * 8).await;
        for shard in 0..64u64 {
            // Granule `shard + 128`: in that shard, outside the holder's range.
            let at = (shard + 128) * 8;
            let write = locks.hold_whole_sectors(at, at + 8).await;
            let announced = [62, 63, 0, 1].contains(&shard);
            assert_eq!(
                matches!(write, WriteHold::Range { .. }),
                announced,
                "shard {shard}"
            );
        }
        drop(held);
        assert!(idle(&locks));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_exclusive_holder_is_never_inside_with_another_writer_of_its_sectors() {
        use std::sync::atomic::AtomicUsize;
        let locks = Arc::new(RangeLocks::new(8, 0));
        // Per slot of 4 sectors: writers inside, and exclusive holders inside.
        let inside = Arc::new([(); 4].map(|_| (AtomicUsize::new(0), AtomicUsize::new(0))));
        let tasks: Vec<_> = (0..16u64)
            .map(|i| {
                let (locks, inside) = (locks.clone(), inside.clone());
                tokio::spawn(async move {
                    for round in 0..300u64 {
                        let slot = ((i * 7 + round) % 4) as usize;
                        let start = slot as u64 * 4;
                        let exclusive = (i + round) % 5 == 0;
                        let _held = match exclusive {
                            true => locks.lock_exclusive(start, start + 4).await,
                            false => locks.hold_whole_sectors(start, start + 4).await,
                        };
                        let (writers, holders) = &inside[slot];
                        let others = writers.fetch_add(1, SeqCst);
                        if exclusive {
                            assert_eq!(others, 0, "an exclusive holder with another writer");
                            holders.fetch_add(1, SeqCst);
                        } else {
                            assert_eq!(holders.load(SeqCst), 0, "a writer beside an exclusive one");
                        }
                        tokio::task::yield_now().await;
                        if exclusive {
                            holders.fetch_sub(1, SeqCst);
                        }
                        writers.fetch_sub(1, SeqCst);
                    }
                })
            })
            .collect();
        all_finish(tasks, "nobody waits forever").await;
        assert!(idle(&locks));
    }

    /// Wait for every task, 30 s at most each (`what` says what a timeout means).
    async fn all_finish(tasks: Vec<tokio::task::JoinHandle<()>>, what: &str) {
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect(what)
                .unwrap();
        }
    }

    /// Nothing held and nobody waiting, in any shard.
    /// Nothing held, waited for, counted in flight or announced.
    fn idle(locks: &RangeLocks) -> bool {
        (0..SHARDS).all(|g| {
            let held = locks.held(g);
            let shard = g as usize;
            held.ranges.is_empty()
                && held.waiting == 0
                && locks.unlocked_in_flight(shard) == 0
                && locks.exclusive[shard].load(SeqCst) == 0
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_range_over_granules_holds_every_part_and_gives_up_what_it_took() {
        let locks = Arc::new(RangeLocks::new(8, 0));
        // Sectors 4..28: parts in granules 0, 1, 2 and 3; also in the shard of granule
        // SHARDS + 1 (the same shard as granule 1), a range elsewhere does not wait.
        let wide = locks.lock(4, 28).await;
        for (start, end) in [(0, 5), (8, 9), (15, 17), (27, 40)] {
            let blocked = tokio::time::timeout(Duration::from_millis(30), locks.lock(start, end));
            assert!(blocked.await.is_err(), "{start}..{end} overlaps 4..28");
        }
        let far = (SHARDS + 1) * 8;
        let _far = tokio::time::timeout(Duration::from_secs(1), locks.lock(far, far + 8))
            .await
            .expect("a range in another granule of the same shard does not wait");
        drop(wide);
        // A lock over granules 0..3 that waits at granule 2 holds 0 and 1 meanwhile, and
        // gives them up when it is dropped there.
        let middle = locks.lock(17, 18).await;
        let stuck = tokio::time::timeout(Duration::from_millis(50), locks.lock(0, 32)).await;
        assert!(stuck.is_err(), "waits at granule 2");
        let _zero = tokio::time::timeout(Duration::from_secs(1), locks.lock(0, 16))
            .await
            .expect("the dropped lock's parts were released");
        drop(middle);
        drop(_zero);
        drop(_far);
        assert!(idle(&locks));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_whole_range_waits_for_every_write_and_nobody_deadlocks() {
        let locks = Arc::new(RangeLocks::new(8, 0));
        // Granules 63 and 64: shards 63 and 0, taken as 0 then 63 like the whole range.
        let straddling = (SHARDS - 1) * 8 + 4..SHARDS * 8 + 4;
        let one = locks.lock(straddling.start, straddling.end).await;
        let all = tokio::time::timeout(Duration::from_millis(50), locks.lock(0, u64::MAX));
        assert!(
            all.await.is_err(),
            "the whole range waits for a write in it"
        );
        drop(one);
        let all = locks.lock(0, u64::MAX).await;
        for (start, end) in [(0, 1), (u64::MAX - 1, u64::MAX), (1000 * 8, 1000 * 8 + 1)] {
            let blocked = tokio::time::timeout(Duration::from_millis(20), locks.lock(start, end));
            assert!(
                blocked.await.is_err(),
                "{start}..{end} waits for the whole range"
            );
        }
        drop(all);
        // Whole-range lockers and straddling ones at once, over and over: all finish.
        let tasks: Vec<_> = (0..8u64)
            .map(|i| {
                let (locks, straddling) = (locks.clone(), straddling.clone());
                tokio::spawn(async move {
                    for _ in 0..200 {
                        let _g = match i % 4 {
                            0 => locks.lock(0, u64::MAX).await,
                            _ => locks.lock(straddling.start + i, straddling.end - i).await,
                        };
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        all_finish(tasks, "no locker deadlocks").await;
        assert!(idle(&locks));
    }
}
