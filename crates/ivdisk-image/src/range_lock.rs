//! Serializes writes that touch the same sectors: a read-modify-write of a partial sector must
//! not interleave with another write of that sector, or one of the two is lost. Writes to
//! disjoint sector ranges proceed in parallel; reads take no lock (each object operation is
//! atomic, and a block device promises nothing more to concurrent overlapping IO).

use std::sync::Mutex;

use crossbeam_utils::CachePadded;
use smallvec::SmallVec;
use tokio::sync::Notify;

/// Shards of the held ranges: a range lies in granules of `granule` sectors (the image's
/// objects), and granule `g`'s part of it is held in shard `g % SHARDS`.
const SHARDS: u64 = 64;

/// Why sharded: every write takes and releases a range, and with one lock for the image the
/// other core had almost always touched it in between, so both were cache misses (the largest
/// part of the engine's own time in 64 KiB writes on a VM whose cores are far apart). Now a
/// write mostly finds its shard where it left it, and two writes on different objects do not
/// meet at all.
///
/// Every locker takes its parts in the order of the shards, so two lockers never wait on
/// each other. A range over fewer than `SHARDS` granules has one part per granule, each in a
/// shard of its own; a wider one (taking the whole image for a snapshot) holds itself whole
/// in every shard, which overlaps every part in it of a granule it covers.
#[derive(Debug)]
pub(crate) struct RangeLocks {
    /// Sectors per granule (at least 1).
    granule: u64,
    shards: Box<[CachePadded<Mutex<Held>>]>,
    released: Notify,
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
    /// Locks for ranges of sectors, sharded by granules of `granule` sectors.
    pub(crate) fn new(granule: u64) -> Self {
        RangeLocks {
            granule: granule.max(1),
            shards: (0..SHARDS).map(|_| CachePadded::default()).collect(),
            released: Notify::new(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn overlapping_ranges_wait_disjoint_ones_do_not() {
        // Granules of 8 sectors: these ranges have parts in two or three shards.
        let locks = Arc::new(RangeLocks::new(8));
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
        let locks = Arc::new(RangeLocks::new(8));
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
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("no locker is left waiting")
                .unwrap();
        }
        assert!(idle(&locks));
    }

    #[test]
    fn a_shard_with_one_range_fits_one_cache_line() {
        assert!(std::mem::size_of::<Mutex<Held>>() <= 64);
    }

    /// Nothing held and nobody waiting, in any shard.
    fn idle(locks: &RangeLocks) -> bool {
        (0..SHARDS).all(|g| {
            let held = locks.held(g);
            held.ranges.is_empty() && held.waiting == 0
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_range_over_granules_holds_every_part_and_gives_up_what_it_took() {
        let locks = Arc::new(RangeLocks::new(8));
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
        let locks = Arc::new(RangeLocks::new(8));
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
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(30), task)
                .await
                .expect("no locker deadlocks")
                .unwrap();
        }
        assert!(idle(&locks));
    }
}
