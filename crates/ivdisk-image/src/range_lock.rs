//! Serializes writes that touch the same sectors: a read-modify-write of a partial sector must
//! not interleave with another write of that sector, or one of the two is lost. Writes to
//! disjoint sector ranges proceed in parallel; reads take no lock (each object operation is
//! atomic, and a block device promises nothing more to concurrent overlapping IO).

use std::sync::Mutex;

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub(crate) struct RangeLocks {
    held: Mutex<Vec<(u64, u64, u64)>>,
    next_id: std::sync::atomic::AtomicU64,
    released: Notify,
}

/// Holds sectors `[start, end)` until dropped.
#[derive(Debug)]
pub(crate) struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    /// Wait until no other guard overlaps `[start, end)`, then hold it.
    pub(crate) async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        loop {
            // Register for the wake-up before checking, so a release between the check and
            // the wait is not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            {
                let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                if !held.iter().any(|&(s, e, _)| s < end && start < e) {
                    held.push((start, end, id));
                    return RangeGuard { locks: self, id };
                }
            }
            released.await;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|&(_, _, id)| id != self.id);
        drop(held);
        self.locks.released.notify_waiters();
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
}
