//! Serializes writes that touch the same sectors: a read-modify-write of a partial sector must
//! not interleave with another write of that sector, or one of the two is lost. Writes to
//! disjoint sector ranges proceed in parallel; reads take no lock (each object operation is
//! atomic, and a block device promises nothing more to concurrent overlapping IO).

use std::sync::Mutex;

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub(crate) struct RangeLocks {
    held: Mutex<Held>,
    next_id: std::sync::atomic::AtomicU64,
    released: Notify,
}

#[derive(Debug, Default)]
struct Held {
    /// (start, end, id) of every range held.
    ranges: Vec<(u64, u64, u64)>,
    /// Lockers waiting for a release. Why counted: registering with `Notify` and waking it
    /// take its own lock; with nobody waiting (the usual case) a lock and its release cost
    /// one mutex each and nothing else.
    waiting: usize,
}

impl Held {
    fn try_take(&mut self, start: u64, end: u64, id: u64) -> bool {
        let free = !self.ranges.iter().any(|&(s, e, _)| s < end && start < e);
        if free {
            self.ranges.push((start, end, id));
        }
        free
    }
}

/// Holds sectors `[start, end)` until dropped.
#[derive(Debug)]
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

/// Counts one waiter while it lives (also when the waiting future is dropped).
struct Waiting<'a>(&'a RangeLocks);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.held().waiting -= 1;
    }
}

impl RangeLocks {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until no other guard overlaps `[start, end)`, then hold it.
    pub(crate) async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        {
            let mut held = self.held();
            if held.try_take(start, end, id) {
                return RangeGuard { locks: self, id };
            }
            held.waiting += 1;
        }
        let _waiting = Waiting(self);
        loop {
            // Register for the wake-up before checking again, so a release between the check
            // and the wait is not missed (a release that came before the registration is
            // seen by the check).
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if self.held().try_take(start, end, id) {
                return RangeGuard { locks: self, id };
            }
            released.await;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held();
        held.ranges.retain(|&(_, _, id)| id != self.id);
        let waiting = held.waiting > 0;
        drop(held);
        if waiting {
            self.locks.released.notify_waiters();
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
        let locks = Arc::new(RangeLocks::default());
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
        let locks = Arc::new(RangeLocks::default());
        // A waiter given up on (its future dropped) no longer counts.
        let first = locks.lock(0, 8).await;
        let gave_up = tokio::time::timeout(Duration::from_millis(50), locks.lock(4, 5)).await;
        assert!(gave_up.is_err(), "an overlapping range waits");
        assert_eq!(locks.held().waiting, 0, "a dropped waiter is uncounted");
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
        let held = locks.held();
        assert!(held.ranges.is_empty() && held.waiting == 0);
    }
}
