//! Snapshots (issue 9): what a snapshot reads never changes after it is taken, on every
//! backend (memory, local, RADOS); names, rollback, removal and the refusals; and the paper's
//! point as a test: with `aes-xts-plain64` the stored versions of a sector leak which 16-byte
//! blocks changed and that a later version equals an earlier one, with every random suite no
//! two versions share a 16-byte block.

mod common;

use common::{place, raw_sector, Backend, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{Image, ImageError, LayoutKind, OpenOptions};

const OBJECT: u64 = 64 << 10;

fn at_snapshot(name: &str) -> OpenOptions {
    OpenOptions {
        snapshot: Some(name.to_owned()),
        ..OpenOptions::read_only()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i % 251) as u8))
        .collect()
}

async fn read_all(image: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; image.size() as usize];
    image.read(0, &mut buf).await.unwrap();
    buf
}

async fn snapshot_life(backend: Backend) {
    let place = place(backend, "snap");
    let uri = &place.uri;
    let size = 3 * OBJECT;
    let options = common::options(size, Suite::DEFAULT, LayoutKind::ObjectEnd, 4096, OBJECT);
    let image = Image::create(uri, &options, PASS).await.unwrap();

    // Version 1: the first two objects written, the third never.
    let v1 = {
        let mut v = pattern(1, 2 * OBJECT as usize);
        v.resize(size as usize, 0);
        v
    };
    image.write(0, &v1[..2 * OBJECT as usize]).await.unwrap();
    let s1 = image.create_snapshot("s1").await.unwrap();
    assert_eq!((s1.name.as_str(), s1.size), ("s1", size));

    // Version 2: an overwrite at an odd offset, a discard of a whole object, the third
    // object written for the first time, and a grow.
    let mut v2 = v1.clone();
    let over = pattern(2, 10_000);
    image.write(5_000, &over).await.unwrap();
    v2[5_000..15_000].copy_from_slice(&over);
    image.discard(OBJECT, OBJECT).await.unwrap();
    v2[OBJECT as usize..2 * OBJECT as usize].fill(0);
    let third = pattern(3, 4096);
    image.write(2 * OBJECT + 8192, &third).await.unwrap();
    v2[2 * OBJECT as usize + 8192..2 * OBJECT as usize + 12288].copy_from_slice(&third);
    image.resize(4 * OBJECT, false).await.unwrap();
    v2.resize(4 * OBJECT as usize, 0);
    assert_eq!(read_all(&image).await, v2);
    let s2 = image.create_snapshot("s2").await.unwrap();
    assert!(s2.id > s1.id);
    assert_eq!(s2.size, 4 * OBJECT);

    // Version 3 (the head): more writes after the second snapshot.
    image.write(0, &pattern(4, 3 * 4096)).await.unwrap();
    image.write(3 * OBJECT, &pattern(5, 4096)).await.unwrap();
    let head = read_all(&image).await;
    assert_ne!(head, v2);

    // A taken name, a bad name.
    assert!(matches!(
        image.create_snapshot("s1").await,
        Err(ImageError::SnapshotExists { snapshot, .. }) if snapshot == "s1"
    ));
    for bad in ["", "a/b", "x@y", &"n".repeat(129)] {
        assert!(
            matches!(
                image.create_snapshot(bad).await,
                Err(ImageError::InvalidParameter { .. })
            ),
            "{bad:?} accepted"
        );
    }

    // Each snapshot reads its version, at its size, while the writer is still open.
    let at1 = Image::open(uri, PASS, &at_snapshot("s1")).await.unwrap();
    assert_eq!((at1.size(), at1.snapshot()), (size, Some("s1")));
    assert!(at1.is_read_only());
    assert_eq!(read_all(&at1).await, v1);
    assert!(matches!(
        at1.write(0, b"nope").await,
        Err(ImageError::ReadOnly { .. })
    ));
    // The never-written third object is a hole in s1, data in s2.
    let holes = at1.allocation(2 * OBJECT, OBJECT).await.unwrap();
    assert!(holes.iter().all(|e| !e.allocated), "{holes:?}");
    let at2 = Image::open(uri, PASS, &at_snapshot("s2")).await.unwrap();
    assert_eq!(read_all(&at2).await, v2);
    let alloc = at2.allocation(2 * OBJECT, OBJECT).await.unwrap();
    assert!(alloc.iter().all(|e| e.allocated), "{alloc:?}");
    assert!(matches!(
        Image::open(uri, PASS, &at_snapshot("nope")).await,
        Err(ImageError::SnapshotNotFound { snapshot, .. }) if snapshot == "nope"
    ));

    // Snapshot changes by address need the writer lock: refused while the writer is open.
    assert!(matches!(
        Image::rollback_snapshot(uri, "s1", |_, _| {}).await,
        Err(ImageError::Locked { .. })
    ));
    assert!(matches!(
        Image::create_snapshot_of(uri, "s3").await,
        Err(ImageError::Locked { .. })
    ));
    assert!(matches!(
        Image::remove_snapshot(uri, "s1").await,
        Err(ImageError::Locked { .. })
    ));
    image.close().await.unwrap();

    let names: Vec<_> = Image::snapshots(uri)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["s1", "s2"]);
    assert_eq!(Image::info(uri).await.unwrap().snapshots.len(), 2);

    // Not while a reader has s1 open, where the store keeps readers' marks (local) or
    // watches (RADOS); the reader of s2 does not count.
    // (`mem:` images live in one process: nothing to keep apart.)
    let refusal = match backend {
        Backend::Memory => Ok(()),
        _ => Image::remove_snapshot(uri, "s1").await,
    };
    match backend {
        Backend::Local => assert!(
            matches!(
                &refusal,
                Err(ImageError::OpenByReaders { image, pids })
                    if image == &uri.at_snapshot("s1") && pids == &[std::process::id()]
            ),
            "{refusal:?}"
        ),
        Backend::Rados => assert!(
            matches!(
                &refusal,
                Err(ImageError::WatchedByReaders { image, readers })
                    if image == &uri.at_snapshot("s1") && readers.len() == 1
                        && readers[0].starts_with(&format!("process {} on host ", std::process::id()))
            ),
            "{refusal:?}"
        ),
        Backend::Memory => {}
    }
    at1.close().await.unwrap();
    // Removing s1 leaves s2 whole; s1 is gone.
    Image::remove_snapshot(uri, "s1").await.unwrap();
    assert!(matches!(
        Image::remove_snapshot(uri, "s1").await,
        Err(ImageError::SnapshotNotFound { .. })
    ));
    assert!(matches!(
        Image::open(uri, PASS, &at_snapshot("s1")).await,
        Err(ImageError::SnapshotNotFound { .. })
    ));
    assert_eq!(read_all(&at2).await, v2);

    // A snapshot taken by address (no one has the image open) reads the head.
    let s3 = Image::create_snapshot_of(uri, "s3").await.unwrap();
    assert_eq!(s3.size, 4 * OBJECT);
    let at3 = Image::open(uri, PASS, &at_snapshot("s3")).await.unwrap();
    assert_eq!(read_all(&at3).await, head);

    // Rollback to s2: the head reads v2 again, at s2's size; s3 still reads the old head.
    let mut calls = 0;
    let rolled = Image::rollback_snapshot(uri, "s2", |done, all| {
        calls += 1;
        assert!(done <= all);
    })
    .await
    .unwrap();
    assert_eq!(rolled.id, s2.id);
    assert!(calls > 0);
    let image = Image::open(uri, PASS, &OpenOptions::default())
        .await
        .unwrap();
    assert_eq!(image.size(), 4 * OBJECT);
    assert_eq!(read_all(&image).await, v2);
    assert_eq!(read_all(&at3).await, head);
    // Writes after the rollback keep s2 and s3 intact.
    image.write(0, &pattern(6, 2 * 4096)).await.unwrap();
    image.close().await.unwrap();
    assert_eq!(read_all(&at2).await, v2);
    assert_eq!(read_all(&at3).await, head);

    // An image with snapshots is not deleted behind the user's back.
    assert!(matches!(
        Image::delete(uri, |_, _| {}).await,
        Err(ImageError::HasSnapshots { names, .. }) if names == ["s2", "s3"]
    ));
    for snap in [at2, at3] {
        snap.close().await.unwrap();
    }
    Image::remove_snapshot(uri, "s2").await.unwrap();
    Image::remove_snapshot(uri, "s3").await.unwrap();

    // Nor is it deleted under a reader of its head (but for `mem:`, in one process).
    let reader = Image::open(uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    if backend != Backend::Memory {
        let refusal = Image::delete(uri, |_, _| {}).await;
        assert!(
            matches!(
                &refusal,
                Err(ImageError::OpenByReaders { .. } | ImageError::WatchedByReaders { .. })
            ),
            "{refusal:?}"
        );
        let mut sector = vec![0u8; 4096];
        reader.read(0, &mut sector).await.unwrap();
        assert_eq!(sector, pattern(6, 4096));
    }
    reader.close().await.unwrap();
    Image::delete(uri, |_, _| {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_on_memory() {
    snapshot_life(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_on_local() {
    snapshot_life(Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_on_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    snapshot_life(Backend::Rados).await;
}

/// A writer removes snapshots itself (what `ivdisk serve` does for `ivdisk snap rm`): the
/// others keep their content through the writes that follow, and the removed one is gone.
async fn snapshots_removed_by_the_writer(backend: Backend) {
    let place = place(backend, "snaprm");
    let uri = &place.uri;
    let size = 2 * OBJECT;
    let options = common::options(size, Suite::DEFAULT, LayoutKind::OmapPacked, 4096, OBJECT);
    let image = Image::create(uri, &options, PASS).await.unwrap();
    let version = |seed| pattern(seed, size as usize);
    image.write(0, &version(1)).await.unwrap();
    image.create_snapshot("a").await.unwrap();
    image.write(0, &version(2)).await.unwrap();
    image.create_snapshot("b").await.unwrap();
    image.write(4096, &version(3)[..8192]).await.unwrap();

    image.remove_own_snapshot("a").await.unwrap();
    assert!(matches!(
        image.remove_own_snapshot("a").await,
        Err(ImageError::SnapshotNotFound { .. })
    ));
    assert!(matches!(
        Image::open(uri, PASS, &at_snapshot("a")).await,
        Err(ImageError::SnapshotNotFound { .. })
    ));
    // Writes after the removal still preserve b.
    image.write(0, &version(4)).await.unwrap();
    let at_b = Image::open(uri, PASS, &at_snapshot("b")).await.unwrap();
    assert_eq!(read_all(&at_b).await, version(2));
    at_b.close().await.unwrap();
    let names: Vec<String> = Image::snapshots(uri)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["b"]);

    image.remove_own_snapshot("b").await.unwrap();
    image.write(0, &version(5)).await.unwrap();
    assert_eq!(read_all(&image).await, version(5));
    assert!(Image::snapshots(uri).await.unwrap().is_empty());
    image.close().await.unwrap();
    Image::delete(uri, |_, _| {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_removed_by_the_writer_on_memory() {
    snapshots_removed_by_the_writer(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_removed_by_the_writer_on_local() {
    snapshots_removed_by_the_writer(Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_removed_by_the_writer_on_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    snapshots_removed_by_the_writer(Backend::Rados).await;
}

/// The 16-byte blocks at which two stored versions of a sector are equal.
fn equal_blocks(a: &[u8], b: &[u8]) -> Vec<usize> {
    a.chunks(16)
        .zip(b.chunks(16))
        .enumerate()
        .filter(|(_, (x, y))| x == y)
        .map(|(i, _)| i)
        .collect()
}

/// Write P, snapshot, write P' (P with one 16-byte block changed), snapshot, write P again,
/// snapshot; return the three stored ciphertexts of the sector.
async fn three_versions(backend: Backend, suite: Suite) -> [Vec<u8>; 3] {
    let place = place(backend, "paper");
    let uri = &place.uri;
    let layout = LayoutKind::default_for(suite.metadata_len());
    let options = common::options(4 * OBJECT, suite, layout, 4096, OBJECT);
    let image = Image::create(uri, &options, PASS).await.unwrap();
    let lba = 21;
    let p = pattern(7, 4096);
    let mut p2 = p.clone();
    for b in &mut p2[1024..1040] {
        *b ^= 0x5a;
    }
    for (version, data) in [&p, &p2, &p].into_iter().enumerate() {
        image.write(lba * 4096, data).await.unwrap();
        image.create_snapshot(&format!("v{version}")).await.unwrap();
    }
    image.close().await.unwrap();
    let mut out = Vec::new();
    for version in 0..3 {
        let snap = Image::open(uri, PASS, &at_snapshot(&format!("v{version}")))
            .await
            .unwrap();
        // The snapshot decrypts to what was written...
        let mut plain = vec![0u8; 4096];
        snap.read(lba * 4096, &mut plain).await.unwrap();
        assert_eq!(&plain, if version == 1 { &p2 } else { &p }, "{suite}");
        // ...and its stored ciphertext is what we compare.
        out.push(raw_sector(&snap, lba).await.0);
        snap.close().await.unwrap();
    }
    out.try_into().unwrap()
}

async fn the_papers_point(backend: Backend) {
    // Deterministic XTS: the unchanged blocks of P' match P's, and the third version is the
    // first one again (an attacker with two snapshots sees what changed, and reverts).
    let [a, b, c] = three_versions(backend, Suite::AesXtsPlain64).await;
    let changed = 1024 / 16;
    let expected: Vec<usize> = (0..256).filter(|&i| i != changed).collect();
    assert_eq!(equal_blocks(&a, &b), expected, "aes-xts-plain64 leaks");
    assert_eq!(a, c, "aes-xts-plain64: the third version equals the first");

    // Wide-block HCTR2: one changed block changes the whole sector, but writing P again
    // still gives the same ciphertext (deterministic per sector).
    let [a, b, c] = three_versions(backend, Suite::AesHctr2Plain64).await;
    assert!(equal_blocks(&a, &b).is_empty());
    assert_eq!(a, c, "aes-hctr2-plain64 is deterministic");

    // Random IVs: no two versions share any 16-byte block at the same position.
    for suite in Suite::ALL.into_iter().filter(|s| s.is_randomized()) {
        let [a, b, c] = three_versions(backend, suite).await;
        for (x, y, what) in [(&a, &b, "v0/v1"), (&b, &c, "v1/v2"), (&a, &c, "v0/v2")] {
            assert!(
                equal_blocks(x, y).is_empty(),
                "{suite}: {what} share blocks {:?}",
                equal_blocks(x, y)
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_papers_point_on_memory() {
    the_papers_point(Backend::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_papers_point_on_local() {
    the_papers_point(Backend::Local).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_papers_point_on_rados() {
    if common::rados_uri("probe").is_none() {
        return;
    }
    the_papers_point(Backend::Rados).await;
}

/// A store that lists fewer omap pairs per read than asked (RADOS: 1024) still gives the
/// whole snapshot table: every snapshot is kept by later writes and opens. The table was read
/// in one operation, and snapshots past the first listing were lost (their data overwritten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_table_longer_than_one_listing_is_read_whole() {
    let store = std::sync::Arc::new(common::ShortListings::new(3));
    let options = ivdisk_image::CreateOptions {
        object_size: OBJECT,
        pbkdf: ivdisk_header::PbkdfRequest::fast_for_tests(ivdisk_header::PbkdfKind::Pbkdf2),
        ..ivdisk_image::CreateOptions::new(4 * OBJECT)
    };
    let image = Image::create_on(store.clone(), "img", &options, PASS)
        .await
        .unwrap();
    for n in 0..8u8 {
        image.write(0, &pattern(n, OBJECT as usize)).await.unwrap();
        image.create_snapshot(&format!("s{n}")).await.unwrap();
    }
    image.write(0, &pattern(99, OBJECT as usize)).await.unwrap();
    image.close().await.unwrap();
    for n in 0..8u8 {
        let at = Image::open_on(store.clone(), "img", PASS, &at_snapshot(&format!("s{n}")))
            .await
            .unwrap_or_else(|e| panic!("snapshot s{n}: {e}"));
        let mut first = vec![0u8; OBJECT as usize];
        at.read(0, &mut first).await.unwrap();
        assert!(
            first == pattern(n, OBJECT as usize),
            "snapshot s{n} kept its data"
        );
    }
}

/// A rollback stopped part-way (here: its task panics at the first progress report, after 64
/// objects, as a kill would stop it) leaves an image no open accepts, whose snapshot it goes
/// back to cannot be removed, and the rollback run again finishes it. Objects of both states opened without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_rollback_leaves_no_image_that_opens() {
    for backend in [Backend::Local, Backend::Memory] {
        let place = place(backend, "half-rolled");
        let uri = place.uri.clone();
        let size = 128 * OBJECT;
        let options = common::options(size, Suite::DEFAULT, LayoutKind::ObjectEnd, 4096, OBJECT);
        let image = Image::create(&uri, &options, PASS).await.unwrap();
        let old = pattern(1, size as usize);
        image.write(0, &old).await.unwrap();
        image.create_snapshot("s").await.unwrap();
        image.write(0, &pattern(2, size as usize)).await.unwrap();
        image.create_snapshot("t").await.unwrap();
        image.close().await.unwrap();
        let rolling = uri.clone();
        let stopped = tokio::spawn(async move {
            Image::rollback_snapshot(&rolling, "s", |_, _| panic!("stopped")).await
        })
        .await;
        assert!(stopped.is_err(), "{backend:?}: the rollback went on");
        for options in [OpenOptions::default(), OpenOptions::read_only()] {
            match Image::open(&uri, PASS, &options).await {
                Err(ImageError::RollbackUnfinished { snapshot, .. }) => assert_eq!(snapshot, "s"),
                Err(e) => panic!("{backend:?}: expected RollbackUnfinished, got {e}"),
                Ok(_) => panic!("{backend:?}: a half-rolled-back image opened"),
            }
        }
        // Its snapshots open (read-only, as ever): the rollback changed the head alone, and
        // reading a snapshot is how a user rescues data (an export of one was refused).
        for (snapshot, expected) in [("s", &old), ("t", &pattern(2, size as usize))] {
            let at = Image::open(&uri, PASS, &at_snapshot(snapshot))
                .await
                .unwrap_or_else(|e| panic!("{backend:?}: snapshot {snapshot}: {e}"));
            assert!(
                read_all(&at).await == *expected,
                "{backend:?}: snapshot {snapshot} read"
            );
            at.close().await.unwrap();
        }
        // Nor is it rolled back to another snapshot before this one is finished (that one
        // visits only the objects its own sizes cover).
        match Image::rollback_snapshot(&uri, "t", |_, _| {}).await {
            Err(ImageError::RollbackUnfinished { snapshot, .. }) => assert_eq!(snapshot, "s"),
            other => panic!("{backend:?}: expected RollbackUnfinished, got {other:?}"),
        }
        // Nor is the snapshot it goes back to removed: the only way to finish it (removed, it
        // left an image every open refused, for good).
        match Image::remove_snapshot(&uri, "s").await {
            Err(ImageError::RollbackUnfinished { snapshot, .. }) => assert_eq!(snapshot, "s"),
            other => panic!("{backend:?}: expected RollbackUnfinished, got {other:?}"),
        }
        Image::rollback_snapshot(&uri, "s", |_, _| {})
            .await
            .unwrap();
        let image = Image::open(&uri, PASS, &OpenOptions::read_only())
            .await
            .unwrap();
        assert!(
            read_all(&image).await == old,
            "{backend:?}: at the snapshot"
        );
    }
}
