//! A store operation failing half way through a multi-object IO: the error reaches the caller
//! and every object holds either its old or its new content, never a mix.
//!
//! The store below the image is the real memory store behind a thin wrapper that fails the
//! write operations of one chosen object (a fault injected below the unit under test).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ivdisk_crypto::Suite;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{CreateOptions, Image, ImageError, LayoutKind, OpenOptions};
use ivdisk_store::{
    LockRequest, Locker, MemoryStore, ObjectName, ObjectStore, ReadOp, ReadResult, SnapId,
    StoreError, WriteOp, WriteOutcome,
};

const PASS: &[u8] = b"partial failure";
const OBJECT: u64 = 64 << 10;

/// The memory store, except that while `armed`, write operations on `victim` fail.
struct FailingStore {
    inner: MemoryStore,
    victim: std::sync::Mutex<Option<ObjectName>>,
    armed: AtomicBool,
}

#[async_trait::async_trait]
impl ObjectStore for FailingStore {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        let victim = self.victim.lock().unwrap().clone();
        if self.armed.load(Ordering::SeqCst) && victim.as_ref() == Some(object) {
            return Err(StoreError::Io {
                context: format!("injected failure writing `{object}`"),
                source: std::io::ErrorKind::Other.into(),
            });
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        self.inner.read_op(object, op).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
        self.inner.list(prefix).await
    }
    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        self.inner.snap_create().await
    }
    async fn snap_remove(&self, snap: SnapId) -> Result<(), StoreError> {
        self.inner.snap_remove(snap).await
    }
    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError> {
        self.inner.lock_exclusive(object, request).await
    }
    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        self.inner.unlock(object, lock, cookie).await
    }
    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError> {
        self.inner.list_lockers(object, lock).await
    }
    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        self.inner.break_lock(object, lock, client, cookie).await
    }
    async fn flush(&self) -> Result<(), StoreError> {
        self.inner.flush().await
    }
    fn client_id(&self) -> &str {
        self.inner.client_id()
    }
}

async fn check(layout: LayoutKind) {
    let store = Arc::new(FailingStore {
        inner: MemoryStore::new().unwrap(),
        victim: std::sync::Mutex::new(None),
        armed: AtomicBool::new(false),
    });
    let options = CreateOptions {
        suite: Suite::DEFAULT,
        layout: Some(layout),
        object_size: OBJECT,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(8 * OBJECT)
    };
    let image = Image::create_on(store.clone(), "img", &options, PASS)
        .await
        .unwrap();
    // Old content: objects 0..4 full of 0x11.
    let old = vec![0x11u8; 4 * OBJECT as usize];
    image.write(0, &old).await.unwrap();
    *store.victim.lock().unwrap() = Some(image.data_object(2));
    store.armed.store(true, Ordering::SeqCst);
    // New content spans objects 1 (partly, from a sub-sector offset) .. 3 (partly).
    let (start, len) = (OBJECT + 1000, 2 * OBJECT as usize);
    let err = image.write(start, &vec![0x22u8; len]).await.unwrap_err();
    assert!(
        matches!(&err, ImageError::Store { source: StoreError::Io { context, .. }, .. } if context.contains("injected")),
        "{err}"
    );
    store.armed.store(false, Ordering::SeqCst);
    // Every object is whole: old, or new where the request covered it.
    let mut now = vec![0u8; 4 * OBJECT as usize];
    image.read(0, &mut now).await.unwrap();
    for n in 0..4usize {
        let range = n * OBJECT as usize..(n + 1) * OBJECT as usize;
        let mut new_version = old[range.clone()].to_vec();
        for (i, byte) in new_version.iter_mut().enumerate() {
            let at = (range.start + i) as u64;
            if at >= start && at < start + len as u64 {
                *byte = 0x22;
            }
        }
        let got = &now[range];
        assert!(
            got == &old[n * OBJECT as usize..(n + 1) * OBJECT as usize] || got == &new_version[..],
            "{layout}: object {n} holds a mix of old and new content"
        );
        if n == 2 {
            assert_eq!(
                got,
                &old[n * OBJECT as usize..(n + 1) * OBJECT as usize],
                "the failed object is old"
            );
        }
    }
    // The image stays usable: the same write succeeds once the store does.
    image.write(start, &vec![0x22u8; len]).await.unwrap();
    image.close().await.unwrap();
    let image = Image::open_on(store, "img", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let mut back = vec![0u8; len];
    image.read(start, &mut back).await.unwrap();
    assert!(back.iter().all(|&b| b == 0x22));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_object_leaves_every_object_old_or_new() {
    for layout in LayoutKind::WITH_METADATA {
        check(layout).await;
    }
}
