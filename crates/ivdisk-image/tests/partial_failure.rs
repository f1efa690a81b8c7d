//! A store operation failing half way through a multi-object IO: the error reaches the caller
//! and every object holds either its old or its new content, never a mix.
//!
//! The store below the image is the real memory store behind a thin wrapper that fails the
//! write operations of one chosen object (`common::FailingStore`: a fault injected below the
//! unit under test).

mod common;

use std::sync::Arc;

use common::FailingStore;

use ivdisk_crypto::Suite;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{CreateOptions, Image, ImageError, LayoutKind, OpenOptions};
use ivdisk_store::{ObjectStoreExt, StoreError};

const PASS: &[u8] = b"partial failure";
const OBJECT: u64 = 64 << 10;

/// An image of 8 objects in `layout` on a store that fails on demand.
async fn created(layout: LayoutKind) -> (Arc<FailingStore>, Image) {
    let store = Arc::new(FailingStore::new());
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
    (store, image)
}

async fn check(layout: LayoutKind) {
    let (store, image) = created(layout).await;
    // Old content: objects 0..4 full of 0x11.
    let old = vec![0x11u8; 4 * OBJECT as usize];
    image.write(0, &old).await.unwrap();
    store.fail_object(image.data_object(2));
    // New content spans objects 1 (partly, from a sub-sector offset) .. 3 (partly).
    let (start, len) = (OBJECT + 1000, 2 * OBJECT as usize);
    let err = image.write(start, &vec![0x22u8; len]).await.unwrap_err();
    assert!(
        matches!(&err, ImageError::Store { source: StoreError::Io { context, .. }, .. } if context.contains("injected")),
        "{err}"
    );
    store.arm(false);
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

/// A shrink whose discard of the data past the new end fails: the image keeps its old size
/// (the header's), a retry discards that data, and a grow after it reads zeros there. The
/// failed shrink once left the new size in memory, so the retry found nothing to shrink,
/// discarded nothing, and the grow showed the old data again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shrink_that_fails_keeps_the_old_size_and_a_retry_frees_the_end() {
    let (store, image) = created(LayoutKind::ObjectEnd).await;
    image
        .write(0, &vec![0x11u8; 8 * OBJECT as usize])
        .await
        .unwrap();
    store.fail_object(image.data_object(7));
    image.resize(4 * OBJECT, true).await.unwrap_err();
    store.arm(false);
    assert_eq!(
        image.size(),
        8 * OBJECT,
        "the header still says the old size"
    );
    let mut last = vec![0u8; OBJECT as usize];
    image.read(7 * OBJECT, &mut last).await.unwrap();
    assert!(
        last.iter().all(|&b| b == 0x11),
        "and the old end reads as it was"
    );
    image.resize(4 * OBJECT, true).await.unwrap();
    assert_eq!(image.size(), 4 * OBJECT);
    image.resize(8 * OBJECT, false).await.unwrap();
    for n in 4..8 {
        let mut back = vec![0xAAu8; OBJECT as usize];
        image.read(n * OBJECT, &mut back).await.unwrap();
        assert!(
            back.iter().all(|&b| b == 0),
            "object {n} reads zeros after the grow"
        );
    }
}

/// A snapshot record whose write reports an error after it was stored (a RADOS timeout)
/// keeps its store snapshot: the store snapshot was removed, and the record then named a
/// removed snapshot (on RADOS its reads show later data). A record write that fails before
/// it is stored leaves neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_recorded_despite_an_error_is_kept_whole() {
    let (store, image) = created(LayoutKind::ObjectEnd).await;
    image
        .write(0, &vec![0x11u8; OBJECT as usize])
        .await
        .unwrap();
    let header = ivdisk_store::ObjectName::new("ivdisk_header.img").unwrap();
    store.apply_before_failing(true);
    store.fail_object(header.clone());
    let made = image.create_snapshot("s").await;
    store.arm(false);
    made.unwrap();
    image
        .write(0, &vec![0x22u8; OBJECT as usize])
        .await
        .unwrap();
    // Failing before it is stored: an error, and no record.
    store.apply_before_failing(false);
    store.fail_object(header);
    image.create_snapshot("t").await.unwrap_err();
    store.arm(false);
    image.close().await.unwrap();
    let at = |name: &str| OpenOptions {
        snapshot: Some(name.into()),
        ..OpenOptions::read_only()
    };
    let err = Image::open_on(store.clone(), "img", PASS, &at("t"))
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::SnapshotNotFound { .. }), "{err}");
    let old = Image::open_on(store.clone(), "img", PASS, &at("s"))
        .await
        .unwrap();
    let mut back = vec![0u8; OBJECT as usize];
    old.read(0, &mut back).await.unwrap();
    assert!(back.iter().all(|&b| b == 0x11), "the snapshot's data");
}

/// A snapshot record whose write failed after it was stored, where the writer could not read
/// the table back to tell: the writer goes on preserving the snapshot. It went on writing
/// under the old context, and the snapshot (recorded) showed the later writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_whose_record_is_unknown_is_preserved_by_its_writer() {
    let (store, image) = created(LayoutKind::OmapPacked).await;
    image
        .write(0, &vec![0x11u8; OBJECT as usize])
        .await
        .unwrap();
    let header = ivdisk_store::ObjectName::new("ivdisk_header.img").unwrap();
    store.apply_before_failing_once();
    store.fail_reads_after_next_failure(1);
    store.fail_object(header);
    image.create_snapshot("s").await.unwrap_err();
    store.arm(false);
    image
        .write(0, &vec![0x22u8; OBJECT as usize])
        .await
        .unwrap();
    image.close().await.unwrap();
    let at_s = OpenOptions {
        snapshot: Some("s".into()),
        ..OpenOptions::read_only()
    };
    let old = Image::open_on(store.clone(), "img", PASS, &at_s)
        .await
        .expect("the record was stored");
    let mut back = vec![0u8; OBJECT as usize];
    old.read(0, &mut back).await.unwrap();
    assert!(
        back.iter().all(|&b| b == 0x11),
        "the snapshot shows a write made after it"
    );
}

/// A create whose open fails on the store after the header was written (the writer lock's
/// record, say, in a RADOS timeout) removes the header again: it left a new, empty image of
/// the full size, which anything else opened and read zeros from, and which the next create
/// under the name refused as existing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_whose_open_fails_leaves_no_image() {
    let store = Arc::new(FailingStore::new());
    let options = CreateOptions {
        object_size: OBJECT,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(8 * OBJECT)
    };
    // The first write is the header's, the second the writer lock's record.
    store.fail_nth_write(2);
    let err = Image::create_on(store.clone(), "img", &options, PASS)
        .await
        .unwrap_err();
    store.arm(false);
    assert!(matches!(err, ImageError::Store { .. }), "{err}");
    let header = ivdisk_store::ObjectName::new("ivdisk_header.img").unwrap();
    assert!(
        store.stat(&header).await.unwrap().is_none(),
        "the header of the failed create is left"
    );
    Image::create_on(store.clone(), "img", &options, PASS)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
}
