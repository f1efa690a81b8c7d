//! `CoalescingStore`: the conformance suite, and what merging must never change.
//!
//! The store underneath is the memory backend behind [`SlowWrites`], which answers each
//! write a little after applying it (as RADOS answers after the OSDs commit), so that writes
//! queue behind each other and get merged; on the memory backend alone they hardly ever would.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use ivdisk_store::conformance::Clients;
use ivdisk_store::{
    CoalescingStore, MemoryStore, ObjectName, ObjectStore, ObjectStoreExt, ReadOp, ReadResult,
    StoreError, WriteOp, WriteOutcome, WriteStep, MAX_OBJECT_SIZE,
};

/// A store that answers each write 2 ms after the memory backend applied it.
struct SlowWrites {
    inner: MemoryStore,
}

ivdisk_store::object_store_forwarding_to_inner!(SlowWrites {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        // A range past the limit is refused during the first poll, before anything is sent,
        // as RADOS' backend does (the memory backend answers from its worker thread).
        for step in &op.steps {
            if let WriteStep::Write { offset, data } = step {
                let end = offset.checked_add(data.len() as u64);
                if end.is_none_or(|end| end > MAX_OBJECT_SIZE) {
                    return Err(StoreError::OutOfRange {
                        object: object.to_string(),
                        offset: *offset,
                        len: data.len() as u64,
                        limit: MAX_OBJECT_SIZE,
                    });
                }
            }
        }
        // Applied during the first poll (the ordering promise), answered later.
        let outcome = self.inner.write_op(object, op).await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        Ok(outcome)
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        self.inner.read_op(object, op).await
    }
});

fn coalescing() -> CoalescingStore<SlowWrites> {
    CoalescingStore::new(SlowWrites {
        inner: MemoryStore::new().unwrap(),
    })
}

async fn store() -> Clients<CoalescingStore<SlowWrites>> {
    let a = MemoryStore::new().unwrap();
    let b = a.another_client();
    Clients::new(
        CoalescingStore::new(SlowWrites { inner: a }),
        CoalescingStore::new(SlowWrites { inner: b }),
        (),
    )
}

mod conformance {
    ivdisk_store::conformance_tests!(super::store);
}

fn object(name: &str) -> ObjectName {
    ObjectName::new(name).unwrap()
}

/// What an `object-end` image sends for a write of sector `i`: the sector, and the whole
/// metadata block it falls in, as the writer's cache rebuilt it.
fn sector_write(i: u64, metadata: &mut [u8]) -> WriteOp {
    metadata[i as usize] = i as u8 + 1;
    WriteOp::new()
        .write(i * 512, vec![i as u8 + 1; 512])
        .write(64 * 512, metadata.to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_go_out_together_and_leave_what_serial_writes_leave() {
    let s = coalescing();
    let o = object("merged");
    let mut metadata = vec![0u8; 64];
    // Built in order, submitted in order by join_all's first poll of each.
    let ops: Vec<WriteOp> = (0..64).map(|i| sector_write(i, &mut metadata)).collect();
    let outcomes = join_all(ops.into_iter().map(|op| s.write_op(&o, op))).await;
    let versions: Vec<u64> = outcomes.into_iter().map(|r| r.unwrap().version).collect();
    assert!(versions.windows(2).all(|v| v[0] <= v[1]), "{versions:?}");

    assert!(
        s.merged_operations() > 0,
        "64 writes to one object behind a slow store were never merged"
    );
    let mut expected: Vec<u8> = (0..64u8).flat_map(|i| vec![i + 1; 512]).collect();
    expected.extend_from_slice(&metadata);
    assert_eq!(s.read(&o, 0, 1 << 20).await.unwrap(), expected);
    // Fewer operations than writes reached the store.
    let version = s.stat(&o).await.unwrap().unwrap().version;
    assert!(
        version < 64 + versions[0],
        "version {version}: nothing was merged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_operation_fails_alone() {
    let s = coalescing();
    let o = object("one-bad");
    // The first goes out at once; the rest queue behind it and are merged, and the merged
    // operation fails because of the bad one: each runs again alone.
    let ops = vec![
        WriteOp::new().write(0, b"first"),
        WriteOp::new().write(5, b"-second"),
        WriteOp::new().write(MAX_OBJECT_SIZE, b"past the end"),
        WriteOp::new().write(12, b"-third"),
        WriteOp::new()
            .step(WriteStep::AssertVersion(1 << 40))
            .write(0, b"never"),
        WriteOp::new().write(18, b"-fourth"),
    ];
    let results = join_all(ops.into_iter().map(|op| s.write_op(&o, op))).await;
    assert!(
        results[0].is_ok() && results[1].is_ok() && results[3].is_ok(),
        "{results:?}"
    );
    assert!(
        matches!(results[2], Err(StoreError::OutOfRange { .. })),
        "{:?}",
        results[2]
    );
    assert!(
        matches!(results[4], Err(StoreError::VersionMismatch { .. })),
        "{:?}",
        results[4]
    );
    assert!(results[5].is_ok());
    assert_eq!(
        s.read(&o, 0, 100).await.unwrap(),
        b"first-second-third-fourth"
    );
}

/// An omap removal fails on a missing object (here as on RADOS): queued behind the object's
/// removal, it fails alone and the write queued after it still lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_omap_removal_on_a_missing_object_fails_alone() {
    let s = coalescing();
    let o = object("removed-then-written");
    // The first two go out at once; the other two queue behind them.
    let ops = vec![
        WriteOp::new().write(0, b"before"),
        WriteOp::new().step(WriteStep::Remove),
        WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![b"k".to_vec()])),
        WriteOp::new().write(0, b"after"),
    ];
    let results = join_all(ops.into_iter().map(|op| s.write_op(&o, op))).await;
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    assert!(
        matches!(results[2], Err(StoreError::NotFound { .. })),
        "{:?}",
        results[2]
    );
    assert!(results[3].is_ok(), "{:?}", results[3]);
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), b"after");
}

/// Zeroing a missing object fails (the memory and local stores) and truncating one does
/// nothing (RADOS): their effect depends on the object's state, so they are not merged. A
/// zero merged with the writes around it failed them all, and a covered write dropped from a
/// merge could take the step that created the object with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_of_a_missing_object_fails_alone() {
    let s = coalescing();
    let o = object("removed-zeroed-written");
    let ops = vec![
        WriteOp::new().write(0, b"before"),
        WriteOp::new().step(WriteStep::Remove),
        WriteOp::new().write(0, vec![1u8; 8]),
        WriteOp::new().step(WriteStep::Zero { offset: 0, len: 4 }),
        WriteOp::new().write(0, vec![2u8; 8]),
    ];
    let results = join_all(ops.into_iter().map(|op| s.write_op(&o, op))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), vec![2u8; 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_queued_writes_sees_them() {
    let s = Arc::new(coalescing());
    let o = object("read-after");
    let first = s.write_op(&o, WriteOp::new().write(0, vec![1u8; 8]));
    let second = s.write_op(&o, WriteOp::new().write(0, vec![2u8; 8]));
    let read = s.read(&o, 0, 8);
    let (a, b, r) = tokio::join!(first, second, read);
    a.unwrap();
    b.unwrap();
    assert_eq!(r.unwrap(), vec![2u8; 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_operations_do_not_stall_the_object() {
    let s = Arc::new(coalescing());
    let o = object("dropped");
    // Start many writes and give up on all of them after a moment, some in flight, some
    // queued, some leading merged operations.
    for round in 0..20u8 {
        let ops = (0..8u64).map(|i| s.write_op(&o, WriteOp::new().write(i, vec![round])));
        let _ = tokio::time::timeout(Duration::from_millis(1), join_all(ops)).await;
    }
    // The object is free again: a write and a read complete.
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        s.write_op(&o, WriteOp::new().write(0, vec![0xee; 8]))
            .await
            .unwrap();
        s.read(&o, 0, 8).await.unwrap()
    })
    .await
    .expect("the object stalled after dropped operations");
    assert_eq!(done, vec![0xee; 8]);
}
