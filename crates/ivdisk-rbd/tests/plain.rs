//! Plain (unencrypted) rbd images through our librbd FFI: byte-granular IO at odd offsets and
//! lengths from many tasks at once, zeroing, read-only and snapshot opens, typed errors, and
//! requests whose futures are dropped in flight. `rbd export` is the independent judge of
//! what was written.

mod common;

use std::sync::Arc;

use common::{random, Model, TestImage, MIB, OBJECT};
use futures_util::FutureExt;
use ivdisk_rados::RadosConfig;
use ivdisk_rbd::{Encryption, RbdError, RbdImage, RbdOpenOptions};

const SIZE: u64 = 64 * MIB;

fn auto() -> Encryption {
    Encryption::Auto { passphrase: None }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn plain_images_round_trip_bytes_at_odd_offsets_from_many_tasks() {
    let Some(rbd) = TestImage::create("plain-io", SIZE, None) else {
        return;
    };
    let image = Arc::new(rbd.open(auto()).await);
    assert_eq!(image.size(), SIZE);
    assert_eq!(image.encryption(), None, "no LUKS header: served plain");
    assert!(!image.is_read_only());
    assert_eq!(image.name(), rbd.spec());
    let mut model = Model::new(SIZE);

    let writes: [(u64, usize); 7] = [
        (0, 1),                                    // the first byte
        (4095, 2),                                 // across a 4 KiB boundary
        (OBJECT - 3, 7),                           // across an object boundary
        (10 * MIB + 123, (3 * MIB + 45) as usize), // spanning objects
        (20 * MIB + 511, 513),
        (SIZE / 2 + 1, 1),
        (SIZE - 17, 17), // the last bytes
    ];
    for (offset, len) in writes {
        let data = random(len);
        image.write(offset, &data).await.unwrap();
        model.write(offset, &data);
    }

    // Many tasks at once, each on a region of its own, each reading its bytes back.
    let mut tasks = Vec::new();
    for i in 0..32u64 {
        let image = image.clone();
        let offset = 30 * MIB + i * 97_531;
        let data = random(50_000 + i as usize * 13);
        model.write(offset, &data);
        tasks.push(tokio::spawn(async move {
            image.write(offset, &data).await.unwrap();
            let mut back = vec![0u8; data.len()];
            image.read(offset, &mut back).await.unwrap();
            assert!(back == data, "task {i}: read-back differs");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    image.flush().await.unwrap();

    let mut all = vec![0u8; SIZE as usize];
    image.read(0, &mut all).await.unwrap();
    model.check(&all, "our read-back");
    // Small reads at odd places agree too.
    for (offset, len) in [(1u64, 3usize), (OBJECT - 5, 10), (SIZE - 1, 1)] {
        let mut buf = vec![0u8; len];
        image.read(offset, &mut buf).await.unwrap();
        assert_eq!(buf, &model.0[offset as usize..][..len], "read at {offset}");
    }
    Arc::try_unwrap(image).unwrap().close().await.unwrap();
    model.check(&rbd.export_raw(), "rbd export of what we wrote");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeroing_read_only_snapshots_and_bad_ranges_behave_and_say_so() {
    let Some(rbd) = TestImage::create("plain-ops", SIZE, None) else {
        return;
    };
    let image = rbd.open(Encryption::None).await;
    let mut model = Model::new(SIZE);
    let data = random((12 * MIB) as usize);
    image.write(0, &data).await.unwrap();
    model.write(0, &data);

    // Write-zeroes, unmapping or not, at odd ranges and over whole objects: zeros.
    for (offset, len, may_unmap) in [
        (100, 8000, true),
        (MIB + 7, 3 * MIB, false),
        (OBJECT, OBJECT, true),
        (9 * MIB + 1, 5, false),
    ] {
        image.write_zeroes(offset, len, may_unmap).await.unwrap();
        model.zero(offset, len);
    }
    // Discarding a whole object frees it, so it reads as zeros; librbd may keep the data of
    // ranges below its discard granularity, so only whole objects are checked.
    image.discard(2 * OBJECT, OBJECT).await.unwrap();
    model.zero(2 * OBJECT, OBJECT);
    image.discard(2 * OBJECT + OBJECT + 1, 100).await.unwrap();
    let mut all = vec![0u8; SIZE as usize];
    image.read(0, &mut all).await.unwrap();
    all[(3 * OBJECT + 1) as usize..][..100]
        .copy_from_slice(&model.0[(3 * OBJECT + 1) as usize..][..100]);
    model.check(&all, "after write-zeroes and discard");

    // Out of range: a typed error, before librbd sees it; empty requests at the end are fine.
    for (offset, len) in [(SIZE - 1, 2u64), (SIZE, 1), (u64::MAX, 1)] {
        let mut buf = vec![0u8; len as usize];
        let err = image.read(offset, &mut buf).await.unwrap_err();
        assert!(
            matches!(err, RbdError::OutOfRange { size: SIZE, .. }),
            "{err}"
        );
        assert!(err.to_string().contains(&rbd.spec()), "{err}");
        let err = image.write(offset, &buf).await.unwrap_err();
        assert!(matches!(err, RbdError::OutOfRange { .. }), "{err}");
        let err = image.write_zeroes(offset, len, true).await.unwrap_err();
        assert!(matches!(err, RbdError::OutOfRange { .. }), "{err}");
    }
    image.read(SIZE, &mut []).await.unwrap();
    image.write(SIZE, &[]).await.unwrap();
    image.close().await.unwrap();

    // A snapshot, then a change at the head.
    rbd.rbd(&["snap", "create", &format!("{}@s1", rbd.spec())]);
    let image = rbd.open(auto()).await;
    image.write(5, b"after the snapshot").await.unwrap();
    image.close().await.unwrap();

    // Read-only at the head: sees the change, refuses writes.
    let options = RbdOpenOptions {
        read_only: true,
        ..rbd.options(auto())
    };
    let image = RbdImage::open(&rbd.config(), options).await.unwrap();
    assert!(image.is_read_only());
    let mut buf = [0u8; 18];
    image.read(5, &mut buf).await.unwrap();
    assert_eq!(&buf, b"after the snapshot");
    let err = image.write(0, b"x").await.unwrap_err();
    assert!(
        matches!(
            err,
            RbdError::ReadOnly {
                snapshot: false,
                ..
            }
        ),
        "{err}"
    );
    image.flush().await.unwrap();
    image.close().await.unwrap();

    // At the snapshot: the old bytes, read-only.
    let options = RbdOpenOptions {
        snapshot: Some("s1".into()),
        ..rbd.options(auto())
    };
    let image = RbdImage::open(&rbd.config(), options).await.unwrap();
    assert!(image.is_read_only());
    assert_eq!(image.name(), format!("{}@s1", rbd.spec()));
    image.read(5, &mut buf).await.unwrap();
    assert_eq!(&buf[..], &model.0[5..23]);
    let err = image.write_zeroes(0, 4096, true).await.unwrap_err();
    assert!(
        matches!(err, RbdError::ReadOnly { snapshot: true, .. }),
        "{err}"
    );
    image.close().await.unwrap();

    // Missing snapshot, missing image.
    let options = RbdOpenOptions {
        snapshot: Some("nope".into()),
        ..rbd.options(auto())
    };
    let err = RbdImage::open(&rbd.config(), options).await.unwrap_err();
    assert!(
        matches!(&err, RbdError::NoSuchSnapshot { snapshot, .. } if snapshot == "nope"),
        "{err}"
    );
    assert!(err.to_string().contains("rbd snap ls"), "{err}");
    let missing = format!("{}-missing", rbd.name);
    let err = RbdImage::open(&rbd.config(), RbdOpenOptions::new(missing.clone()))
        .await
        .unwrap_err();
    assert!(matches!(err, RbdError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains(&missing), "{err}");
    // In a namespace that does not exist: that is what is named, not the image.
    let namespace = format!("{}-ns", rbd.name);
    let in_namespace = RadosConfig {
        namespace: namespace.clone(),
        ..rbd.config()
    };
    let err = RbdImage::open(&in_namespace, RbdOpenOptions::new(missing.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, RbdError::NoSuchNamespace { namespace: n, .. } if *n == namespace),
        "{err}"
    );
    let create = format!("`rbd namespace create {}/{namespace}`", in_namespace.pool);
    assert!(err.to_string().contains(&create), "{err}");
    // In one that exists, `rbd ls` of that namespace (the pool's lists another set).
    let spec = format!("{}/{namespace}", in_namespace.pool);
    rbd.rbd(&["namespace", "create", &spec]);
    let err = RbdImage::open(&in_namespace, RbdOpenOptions::new(missing.clone()))
        .await
        .unwrap_err();
    rbd.rbd(&["namespace", "remove", &spec]);
    assert!(matches!(err, RbdError::NotFound { .. }), "{err}");
    let ls = format!("`rbd ls {spec}`");
    assert!(err.to_string().contains(&ls), "{err}");
    let err = RbdImage::inspect(&rbd.config(), &missing, None)
        .await
        .unwrap_err();
    assert!(matches!(err, RbdError::NotFound { .. }), "{err}");

    let info = RbdImage::inspect(&rbd.config(), &rbd.name, None)
        .await
        .unwrap();
    assert_eq!((info.raw_size, info.size(), info.luks), (SIZE, SIZE, None));
}

/// Requests whose futures are dropped after submission still complete inside librbd, into
/// buffers the requests own: nothing is written into (or read from) memory the caller freed,
/// every dropped write still lands whole, and closing the image with dropped requests in
/// flight waits for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_dropped_in_flight_never_touch_freed_memory() {
    let Some(rbd) = TestImage::create("plain-drop", SIZE, None) else {
        return;
    };
    let image = rbd.open(auto()).await;
    let mut model = Model::new(SIZE);
    const CHUNK: u64 = 64 * 1024 + 3;
    let mut submitted = 0;
    for round in 0..4u64 {
        // Writes, each polled once (submitted) and dropped; their source buffers are freed
        // and the memory reused right away.
        for i in 0..64u64 {
            let offset = (round * 64 + i) * CHUNK;
            let data = random(CHUNK as usize);
            model.write(offset, &data);
            if image.write(offset, &data).now_or_never().is_none() {
                submitted += 1;
            }
            drop(data);
            let _reuse = vec![0xeeu8; CHUNK as usize];
        }
        // Reads into buffers dropped at once, over the same and other ranges.
        for i in 0..64u64 {
            let mut buf = vec![0u8; 2 * CHUNK as usize];
            let _ = image.read(i * 2 * CHUNK, &mut buf).now_or_never();
            drop(buf);
            let _reuse = vec![0x55u8; 2 * CHUNK as usize];
        }
    }
    assert!(submitted > 0, "no write was still in flight when dropped");
    // A flush waits for every write submitted before it, dropped or not.
    image.flush().await.unwrap();
    let mut all = vec![0u8; SIZE as usize];
    image.read(0, &mut all).await.unwrap();
    model.check(&all, "after dropped writes and a flush");

    // Dropped reads and writes in flight while the image closes (drop: a blocking close).
    for i in 0..64u64 {
        let mut buf = vec![0u8; CHUNK as usize];
        let _ = image.read(i * CHUNK, &mut buf).now_or_never();
        let data = vec![i as u8; 4096];
        let offset = 40 * MIB + i * 4096;
        model.write(offset, &data);
        let _ = image.write(offset, &data).now_or_never();
    }
    drop(image);
    let image = RbdImage::open(&rbd.config(), RbdOpenOptions::new(rbd.name.clone()))
        .await
        .unwrap();
    image.read(0, &mut all).await.unwrap();
    model.check(&all, "after a close with requests in flight");
    image.close().await.unwrap();
}

/// librbd refuses a write with EROFS on an image opened read-write when it is a non-primary
/// mirror image (or another client holds its exclusive lock in exclusive mode): the error
/// names those causes, not "open read-only", which it was not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_librbd_refuses_on_a_read_write_image_names_the_cause() {
    let Some(rbd) = TestImage::create("demoted", 16 * MIB, None) else {
        return;
    };
    let pool = rbd.pool.clone();
    rbd.rbd(&["mirror", "pool", "enable", &pool, "image"]);
    rbd.rbd(&["mirror", "image", "enable", &rbd.spec(), "snapshot"]);
    rbd.rbd(&["mirror", "image", "demote", &rbd.spec()]);
    let image = rbd.open(auto()).await;
    assert!(!image.is_read_only());
    let err = image.write(0, &[1; 4096]).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, RbdError::WriteRefused { .. }), "{text}");
    assert!(
        text.contains("non-primary") && !text.contains("open read-only"),
        "{text}"
    );
    assert_eq!(err.errno(), Some(libc::EROFS));
    drop(image);
    rbd.rbd(&["mirror", "image", "promote", "--force", &rbd.spec()]);
    rbd.rbd(&["mirror", "image", "disable", "--force", &rbd.spec()]);
}

/// An image larger than 2^63 - 1 bytes (librbd takes such sizes without an object map) is
/// refused at the open: NBD clients and `off_t` would read its size as negative.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_past_the_largest_size_is_refused() {
    let Some(rbd) = TestImage::create("huge", 16 * MIB, None) else {
        return;
    };
    let spec = rbd.spec();
    rbd.rbd(&["feature", "disable", &spec, "fast-diff,object-map"]);
    rbd.rbd(&["resize", "--no-progress", "--size", "9E", &spec]);
    let err = RbdImage::open(&rbd.config(), rbd.options(auto()))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(err.to_string().contains("2^63 - 1"), "{err}");
    // `rbd rm` (and a shrink) would remove its 2^41 possible objects one by one: to the trash,
    // which the throwaway test cluster takes with it.
    rbd.rbd(&["trash", "mv", &spec]);
}
