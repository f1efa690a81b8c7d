//! Encrypted backups (`Image::backup`, `Image::restore_backup`): every layout and several
//! suites round-trip into another store and open with the same passphrase; a snapshot's backup
//! restores the snapshot (content and size) after the head moved on; the file is sparse;
//! truncated, tampered and reordered files are refused before anything is created; a store
//! failure mid-restore leaves nothing behind; existing targets are refused; increments between
//! two snapshots apply onto a restored image and nowhere else.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{FailingStore, Rng, PASS};
use ivdisk_crypto::Suite;
use ivdisk_image::{
    data_object_prefix, header_object_name, BackupKind, BackupOptions, BackupPhase, BackupProgress,
    Image, ImageError, ImageUri, LayoutKind, OpenOptions, BACKUP_STATE_KEY,
};
use ivdisk_store::{MemoryStore, ObjectName, ObjectStore, ObjectStoreExt};

const OBJECT: u64 = 64 << 10;
const NONCE_KEY: &[u8] = b"ivdisk.nonce_writes_reserved";

fn memory() -> Arc<dyn ObjectStore> {
    Arc::new(MemoryStore::new().unwrap())
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn full() -> BackupOptions {
    BackupOptions::default()
}

fn at(snapshot: &str) -> BackupOptions {
    BackupOptions {
        snapshot: Some(snapshot.to_owned()),
        ..BackupOptions::default()
    }
}

/// What an image reads, whole.
async fn contents(image: &Image) -> Vec<u8> {
    let mut buf = vec![0xEEu8; image.size() as usize];
    image.read(0, &mut buf).await.unwrap();
    buf
}

/// Write random data at a few places (a partial sector, a run across an object boundary,
/// whole objects, the last sector) into `image` and `model`.
async fn scribble(image: &Image, model: &mut [u8], rng: &mut Rng) {
    let size = image.size();
    let ss = image.sector_size() as u64;
    let places = [
        (100, 300),
        (OBJECT - 5000, 10_000),
        (3 * OBJECT, 2 * OBJECT),
        (size - ss, ss),
        (rng.below(size - 9000), 9000),
    ];
    for (offset, len) in places {
        let data = rng.bytes(len as usize);
        image.write(offset, &data).await.unwrap();
        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
    }
}

/// Every object of a store (none must be left after a refused or failed restore).
async fn objects(store: &dyn ObjectStore) -> Vec<ObjectName> {
    store.list("").await.unwrap()
}

/// The backup state recorded in the header object of image "dst" on `store`.
async fn dst_backup_state(store: &dyn ObjectStore) -> serde_json::Value {
    let header = ObjectName::new(header_object_name("dst")).unwrap();
    let (_, state) = store
        .omap_all(&header)
        .await
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == BACKUP_STATE_KEY)
        .expect("a backup state");
    serde_json::from_slice(&state).unwrap()
}

async fn nonce_count(store: &dyn ObjectStore, name: &str) -> Option<Vec<u8>> {
    let object = ObjectName::new(header_object_name(name)).unwrap();
    store
        .omap_all(&object)
        .await
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == NONCE_KEY)
        .map(|(_, v)| v)
}

/// A full round trip through a backup file between two memory stores.
async fn round_trip(suite: Suite, layout: LayoutKind, sector_size: u32, seed: u64) {
    let case = format!("{suite}/{layout}/ss{sector_size}");
    let mut rng = Rng::derive(seed, &case);
    let size = 6 * OBJECT + OBJECT / 2;
    let source = memory();
    let options = common::options(size, suite, layout, sector_size, OBJECT);
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    let mut model = vec![0u8; size as usize];
    scribble(&image, &mut model, &mut rng).await;
    // A discarded range and a whole discarded object (removed) are part of the picture too.
    image.discard(3 * OBJECT, OBJECT).await.unwrap();
    model[3 * OBJECT as usize..4 * OBJECT as usize].fill(0);
    let id = image.image_id();
    image.close().await.unwrap();

    let dir = tmp();
    let file = dir.path().join("b.ivdbak");
    let mut phases = Vec::new();
    let made = Image::backup_on(source.clone(), "src", &full(), &file, |p| {
        phases.push(p.phase)
    })
    .await
    .unwrap_or_else(|e| panic!("{case}: backup: {e}"));
    assert!(phases.iter().all(|p| *p == BackupPhase::Reading), "{case}");
    assert_eq!(made.description.kind, BackupKind::Full);
    assert_eq!(made.description.size, size);
    assert_eq!(made.file_bytes, std::fs::metadata(&file).unwrap().len());
    assert!(!ivdisk_image::partial_path(&file).exists());
    let source_objects = source.list(&data_object_prefix(&id)).await.unwrap().len() as u64;
    assert_eq!(made.objects, source_objects, "{case}");

    let target = memory();
    let restored = Image::restore_backup_on(&file, target.clone(), "dst", |_| {})
        .await
        .unwrap_or_else(|e| panic!("{case}: restore: {e}"));
    assert_eq!(restored.sha256, made.sha256);
    assert_eq!(restored.objects, made.objects);
    let copy = Image::open_on(target.clone(), "dst", PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("{case}: opening the restored image: {e}"));
    assert_eq!(copy.image_id(), id);
    assert_eq!(copy.size(), size);
    assert_eq!(copy.suite(), suite);
    assert_eq!(copy.layout(), layout);
    assert!(
        contents(&copy).await == model,
        "{case}: restored content differs"
    );
    if suite.write_limit().is_some() {
        let count = nonce_count(target.as_ref(), "dst").await;
        assert!(count.is_some(), "{case}: nonce count not carried");
        assert_eq!(count, nonce_count(source.as_ref(), "src").await, "{case}");
    }
    // The restored image is writable like any other and keeps no snapshots.
    copy.write(0, &[7u8; 4096]).await.unwrap();
    copy.close().await.unwrap();
    let copy = Image::open_on(target, "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let mut first = vec![0u8; 4096];
    copy.read(0, &mut first).await.unwrap();
    assert_eq!(first, vec![7u8; 4096]);
}

#[tokio::test(flavor = "multi_thread")]
async fn every_layout_round_trips_into_another_store() {
    let (seed, _guard) = common::seed("every_layout_round_trips_into_another_store");
    let suites = [
        Suite::Aegis128lRandom,
        Suite::AesXtsRandom,
        Suite::AesGcmRandom,
        Suite::AesXtsPlain64,
    ];
    let mut cases = 0;
    for layout in LayoutKind::ALL {
        for suite in suites {
            if layout.fits(suite.metadata_len()) {
                round_trip(suite, layout, 4096, seed).await;
                cases += 1;
            }
        }
    }
    assert!(cases >= LayoutKind::ALL.len());
    round_trip(Suite::Aegis256Random, LayoutKind::Omap, 512, seed).await;
    round_trip(Suite::Aegis128lRandom, LayoutKind::Unaligned, 512, seed).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn local_directories_round_trip_through_uris() {
    let (seed, _guard) = common::seed("local_directories_round_trip_through_uris");
    let mut rng = Rng::new(seed);
    let source = common::local_dir();
    let size = 5 * OBJECT;
    let options = common::options(
        size,
        Suite::AesGcmRandom,
        LayoutKind::ObjectEnd,
        4096,
        OBJECT,
    );
    let image = Image::create(&source.uri, &options, PASS).await.unwrap();
    let mut model = vec![0u8; size as usize];
    scribble(&image, &mut model, &mut rng).await;
    image.close().await.unwrap();
    let dir = tmp();
    let file = dir.path().join("local.ivdbak");
    let made = Image::backup(&source.uri, &full(), &file, |_| {})
        .await
        .unwrap();

    let target = common::local_dir();
    assert!(!target.path.exists());
    let restored = Image::restore_backup(&file, &target.uri, |_| {})
        .await
        .unwrap();
    assert_eq!(restored.sha256, made.sha256);
    let copy = Image::open(&target.uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert!(contents(&copy).await == model);
    copy.close().await.unwrap();
    let info = Image::info(&target.uri).await.unwrap();
    assert!(info.snapshots.is_empty());
    // Restoring it again into the same directory: the image is there.
    match Image::restore_backup(&file, &target.uri, |_| {}).await {
        Err(ImageError::Exists { .. }) => {}
        other => panic!("expected Exists, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_restores_with_its_content_and_size() {
    let (seed, _guard) = common::seed("a_snapshot_restores_with_its_content_and_size");
    let mut rng = Rng::new(seed);
    let source = memory();
    let size = 6 * OBJECT;
    let options = common::options(size, Suite::Aegis128lRandom, LayoutKind::Omap, 4096, OBJECT);
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    let mut model = vec![0u8; size as usize];
    scribble(&image, &mut model, &mut rng).await;
    let snap = image.create_snapshot("monday").await.unwrap();
    assert_eq!(snap.size, size);
    // The head moves on: overwrites, an object discarded whole (it then exists only in the
    // snapshot, and no listing shows it), and a bigger size.
    image
        .write(0, &rng.bytes(2 * OBJECT as usize))
        .await
        .unwrap();
    image.discard(3 * OBJECT, OBJECT).await.unwrap();
    image.resize(size + 4 * OBJECT, false).await.unwrap();
    image
        .write(size + OBJECT, &rng.bytes(OBJECT as usize))
        .await
        .unwrap();
    image.close().await.unwrap();

    let dir = tmp();
    let file = dir.path().join("monday.ivdbak");
    let made = Image::backup_on(source.clone(), "src", &at("monday"), &file, |_| {})
        .await
        .unwrap();
    assert_eq!(made.description.snapshot.as_deref(), Some("monday"));
    assert_eq!(made.description.size, size);
    let target = memory();
    Image::restore_backup_on(&file, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    let copy = Image::open_on(target.clone(), "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(copy.size(), size, "the snapshot's size, not the head's");
    assert!(contents(&copy).await == model, "the snapshot's content");
    assert!(Image::snapshots_on_store(&target, "dst").await.is_empty());
    // The head's own backup has the head's size.
    let head_file = dir.path().join("head.ivdbak");
    let head = Image::backup_on(source, "src", &full(), &head_file, |_| {})
        .await
        .unwrap();
    assert_eq!(head.description.size, size + 4 * OBJECT);
}

/// Snapshot records of an image in a store (none for a restored image).
trait SnapshotsOnStore {
    async fn snapshots_on_store(store: &Arc<dyn ObjectStore>, name: &str) -> Vec<Vec<u8>>;
}

impl SnapshotsOnStore for Image {
    async fn snapshots_on_store(store: &Arc<dyn ObjectStore>, name: &str) -> Vec<Vec<u8>> {
        let object = ObjectName::new(header_object_name(name)).unwrap();
        store
            .omap_all(&object)
            .await
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k.starts_with(b"ivdisk.snap"))
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_file_is_sparse() {
    let source = memory();
    let size = 256 << 20;
    let options = common::options(
        size,
        Suite::Aegis128lRandom,
        LayoutKind::ObjectEnd,
        4096,
        4 << 20,
    );
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    for lba in [0u64, 1, 5000, 65535] {
        image.write(lba * 4096, &[0x5A; 4096]).await.unwrap();
    }
    image.close().await.unwrap();
    let dir = tmp();
    let file = dir.path().join("sparse.ivdbak");
    let made = Image::backup_on(source, "src", &full(), &file, |_| {})
        .await
        .unwrap();
    let len = std::fs::metadata(&file).unwrap().len();
    assert_eq!(made.objects, 3);
    // Four sectors (and their metadata blocks) plus the header's keyslot material.
    assert!(
        len < 1 << 20,
        "a 256 MiB image with 4 sectors written: {len} bytes"
    );
    assert!(made.data_bytes < 1 << 20);
    let target = memory();
    Image::restore_backup_on(&file, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    let copy = Image::open_on(target, "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let mut buf = vec![0u8; 8192];
    copy.read(0, &mut buf).await.unwrap();
    assert!(buf.iter().all(|&b| b == 0x5A));
    copy.read(4096 * 65534, &mut buf).await.unwrap();
    assert!(buf[..4096].iter().all(|&b| b == 0) && buf[4096..].iter().all(|&b| b == 0x5A));
}

// ---------------------------------------------------------------------------------------------
// Bad input

/// A backup of a small image with a few objects (omap layout: records with omap pairs).
async fn sample_backup(dir: &Path) -> (PathBuf, Vec<u8>) {
    let source = memory();
    let size = 4 * OBJECT;
    let options = common::options(size, Suite::Aegis128lRandom, LayoutKind::Omap, 4096, OBJECT);
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    let mut rng = Rng::new(7);
    for offset in [0, OBJECT + 4096, 3 * OBJECT + 8192] {
        image.write(offset, &rng.bytes(8192)).await.unwrap();
    }
    image.close().await.unwrap();
    let file = dir.join("good.ivdbak");
    Image::backup_on(source, "src", &full(), &file, |_| {})
        .await
        .unwrap();
    let bytes = std::fs::read(&file).unwrap();
    (file, bytes)
}

/// Image `dst` of `target` reads as snapshot `snapshot` of image `src` of `source`.
async fn copy_holds(target: Arc<dyn ObjectStore>, source: Arc<dyn ObjectStore>, snapshot: &str) {
    let copy = Image::open_on(target, "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let at = OpenOptions {
        snapshot: Some(snapshot.into()),
        ..OpenOptions::read_only()
    };
    let original = Image::open_on(source, "src", PASS, &at).await.unwrap();
    assert!(
        contents(&copy).await == contents(&original).await,
        "the copy holds {snapshot}"
    );
}

/// Where each record starts (after the description), the trailer last.
fn record_starts(bytes: &[u8]) -> Vec<usize> {
    let json_len = u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize;
    let mut at = 16 + json_len + 4;
    let mut starts = Vec::new();
    while at < bytes.len() {
        starts.push(at);
        let len = u64::from_le_bytes(bytes[at + 1..at + 9].try_into().unwrap()) as usize;
        at += 9 + len + 4;
    }
    assert_eq!(at, bytes.len());
    starts
}

/// `bytes` restored must be refused as damaged, leaving the target store empty.
async fn refused(dir: &Path, bytes: &[u8], what: &str) {
    let file = dir.join("bad.ivdbak");
    std::fs::write(&file, bytes).unwrap();
    let target = memory();
    match Image::restore_backup_on(&file, target.clone(), "dst", |_| {}).await {
        Err(ImageError::BackupDamaged { .. }) => {}
        other => panic!("{what}: expected BackupDamaged, got {other:?}"),
    }
    assert!(
        objects(target.as_ref()).await.is_empty(),
        "{what}: the refused restore left objects"
    );
    match Image::verify_backup(&file) {
        Err(ImageError::BackupDamaged { .. }) => {}
        other => panic!("{what}: verify_backup: expected BackupDamaged, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn truncated_files_are_refused_and_nothing_is_created() {
    let dir = tmp();
    let (_, good) = sample_backup(dir.path()).await;
    assert!(Image::verify_backup(&dir.path().join("good.ivdbak")).is_ok());
    let starts = record_starts(&good);
    assert_eq!(starts.len(), 5, "header, 3 data objects, trailer");
    let json_end = starts[0] - 4;
    let trailer = *starts.last().unwrap();
    let cuts = [
        (0, "empty"),
        (5, "inside the magic"),
        (10, "inside the version"),
        (json_end - 7, "inside the description"),
        (starts[0], "after the description"),
        (starts[0] + 4, "inside the header record's head"),
        (starts[0] + 5000, "inside the header record"),
        (starts[2] - 2, "inside a record's checksum"),
        ((starts[2] + starts[3]) / 2, "inside a data record"),
        (starts[3], "between records"),
        (trailer, "before the trailer"),
        (trailer + 20, "inside the trailer"),
        (good.len() - 1, "one byte short"),
    ];
    for (cut, what) in cuts {
        refused(dir.path(), &good[..cut], what).await;
    }
    // And on a local directory: not even the store directory is created.
    let file = dir.path().join("cut.ivdbak");
    std::fs::write(&file, &good[..trailer]).unwrap();
    let target = common::local_dir();
    match Image::restore_backup(&file, &target.uri, |_| {}).await {
        Err(ImageError::BackupDamaged { reason, .. }) => {
            assert!(reason.contains("truncated"), "{reason}")
        }
        other => panic!("expected BackupDamaged, got {other:?}"),
    }
    assert!(!target.path.exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_flipped_byte_anywhere_is_refused() {
    let (seed, _guard) = common::seed("a_flipped_byte_anywhere_is_refused");
    let mut rng = Rng::new(seed);
    let dir = tmp();
    let (_, good) = sample_backup(dir.path()).await;
    let starts = record_starts(&good);
    // Every byte of the file's head and of each record's head, checksum and trailer; a
    // spread of payload bytes; random others.
    let mut positions: Vec<usize> = (0..starts[0] + 16).collect();
    for &s in &starts {
        positions.extend(s..s + 9);
        positions.extend(s.saturating_sub(4)..s);
    }
    positions.extend(good.len() - 60..good.len());
    positions.extend((0..good.len()).step_by(good.len() / 97));
    positions.extend((0..100).map(|_| rng.below(good.len() as u64) as usize));
    positions.sort_unstable();
    positions.dedup();
    for at in positions {
        let mut bad = good.clone();
        bad[at] ^= 1 << rng.below(8);
        refused(
            dir.path(),
            &bad,
            &format!("byte {at} of {} flipped", good.len()),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn removed_reordered_and_appended_records_are_refused() {
    let dir = tmp();
    let (_, good) = sample_backup(dir.path()).await;
    let starts = record_starts(&good);
    // A whole data record removed (its own checksum is fine).
    let mut bad = good[..starts[2]].to_vec();
    bad.extend_from_slice(&good[starts[3]..]);
    refused(dir.path(), &bad, "a record removed").await;
    // Two data records swapped.
    let mut bad = good[..starts[1]].to_vec();
    bad.extend_from_slice(&good[starts[2]..starts[3]]);
    bad.extend_from_slice(&good[starts[1]..starts[2]]);
    bad.extend_from_slice(&good[starts[3]..]);
    refused(dir.path(), &bad, "records swapped").await;
    // A record duplicated.
    let mut bad = good[..starts[2]].to_vec();
    bad.extend_from_slice(&good[starts[1]..]);
    refused(dir.path(), &bad, "a record duplicated").await;
    // Bytes after the trailer.
    let mut bad = good.clone();
    bad.extend_from_slice(b"more");
    refused(dir.path(), &bad, "bytes appended").await;
    // Not a backup at all.
    refused(
        dir.path(),
        b"LUKS\xba\xbe\x00\x02 not a backup",
        "a LUKS header",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_failure_mid_restore_leaves_nothing() {
    let dir = tmp();
    let (file, _) = sample_backup(dir.path()).await;
    // Failing the 1st..5th write: the header object (marked unfinished), three data objects,
    // then the header's mark removed.
    for fail_at in 1..=5 {
        let store = Arc::new(FailingStore::new());
        store.fail_nth_write(fail_at);
        match Image::restore_backup_on(&file, store.clone(), "dst", |_| {}).await {
            Err(ImageError::Store { .. }) => {}
            other => panic!("write {fail_at} failing: expected a store error, got {other:?}"),
        }
        store.arm(false);
        assert!(
            objects(store.as_ref()).await.is_empty(),
            "write {fail_at} failing: objects left behind: {:?}",
            objects(store.as_ref()).await
        );
        // The same file restores once the store works.
        Image::restore_backup_on(&file, store.clone(), "dst", |_| {})
            .await
            .unwrap();
        Image::open_on(store, "dst", PASS, &OpenOptions::read_only())
            .await
            .unwrap();
    }
}

/// The library refuses an increment to the head, as the command line does: the head has no
/// snapshot id, so a restore of it could not be marked half-applied.
#[tokio::test(flavor = "multi_thread")]
async fn an_increment_to_the_head_is_refused() {
    let dir = tmp();
    let (source, image) = two_object_image(1).await;
    image.create_snapshot("one").await.unwrap();
    image.close().await.unwrap();
    let file = dir.path().join("head.ivdbak");
    let options = BackupOptions {
        snapshot: None,
        since: Some("one".into()),
        overwrite: false,
    };
    match Image::backup_on(source, "src", &options, &file, |_| {}).await {
        Err(ImageError::InvalidParameter { reason, .. }) => {
            assert!(reason.contains("two snapshots"), "{reason}")
        }
        other => panic!("expected InvalidParameter, got {other:?}"),
    }
    assert!(!file.exists());
}

/// Two backups to one file at once: one is refused (its partial file exists), and a backup
/// that says it was made is a whole one. They shared the partial file: the first renamed
/// it to FILE and reported success while the second still wrote into it.
#[tokio::test(flavor = "multi_thread")]
async fn two_backups_to_one_file_never_make_a_mixed_one() {
    let dir = tmp();
    let (source, image) = two_object_image(1).await;
    image
        .write(0, &vec![3u8; 2 * OBJECT as usize])
        .await
        .unwrap();
    // Backups of snapshots take no lock: both run. Two different ones, of different content.
    image.create_snapshot("s").await.unwrap();
    image.write(0, &vec![4u8; 4096]).await.unwrap();
    image.create_snapshot("t").await.unwrap();
    image.close().await.unwrap();
    let file = dir.path().join("same.ivdbak");
    let (s, t) = (at("s"), at("t"));
    let (one, two) = tokio::join!(
        Image::backup_on(source.clone(), "src", &s, &file, |_| {}),
        Image::backup_on(source.clone(), "src", &t, &file, |_| {}),
    );
    let made = [&one, &two].iter().filter(|r| r.is_ok()).count();
    assert!(made >= 1, "{one:?} {two:?}");
    for refused in [&one, &two].into_iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(
                refused,
                ImageError::BackupIo { .. } | ImageError::BackupFileExists { .. }
            ),
            "{refused}"
        );
    }
    let summary = Image::verify_backup(&file).expect("the file that was made is whole");
    let made_sha = [one, two].into_iter().find_map(Result::ok).unwrap().sha256;
    assert_eq!(summary.sha256, made_sha);
    assert!(!ivdisk_image::partial_path(&file).exists());
}

/// A restore whose header write failed after it was applied (a RADOS timeout) and whose
/// header then could not be removed: it once removed the data beside the header, and left a
/// header without it, an image that opened and read zeros. The header is written first now,
/// marked unfinished: left behind, it does not open (and `ivdisk delete` removes it).
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_restore_never_leaves_a_header_without_its_data() {
    let dir = tmp();
    let (file, _) = sample_backup(dir.path()).await;
    let store = Arc::new(FailingStore::new());
    store.fail_object(ObjectName::new(header_object_name("dst")).unwrap());
    store.apply_before_failing_once();
    match Image::restore_backup_on(&file, store.clone(), "dst", |_| {}).await {
        Err(ImageError::Store { .. }) => {}
        other => panic!("expected a store error, got {other:?}"),
    }
    store.arm(false);
    match Image::open_on(store.clone(), "dst", PASS, &OpenOptions::read_only()).await {
        Err(ImageError::FillUnfinished { what, .. }) => {
            assert!(what.contains("a restore of"), "{what}")
        }
        Err(e) => panic!("expected FillUnfinished, got {e}"),
        Ok(_) => panic!("a header left without its data opened"),
    }
}

/// A full restore holds the image's writer lock while it writes: `lock status` names its
/// process, and a `delete` (which the unfinished image's message suggests once that process
/// is gone) is refused meanwhile. A delete removed the image under a running restore.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_holds_the_writer_lock_while_it_writes() {
    let dir = tmp();
    let (file, _) = sample_backup(dir.path()).await;
    let store = memory();
    let header = ObjectName::new(header_object_name("dst")).unwrap();
    let seen = std::sync::Mutex::new(None);
    Image::restore_backup_on(&file, store.clone(), "dst", |p| {
        // After the last data object, before the mark goes.
        if p.phase == BackupPhase::Writing && p.done == p.total {
            let lockers =
                futures_executor::block_on(store.list_lockers(&header, ivdisk_image::WRITER_LOCK));
            *seen.lock().unwrap() = Some(lockers);
        }
    })
    .await
    .unwrap();
    let lockers = seen
        .into_inner()
        .unwrap()
        .expect("no progress at the end")
        .unwrap();
    assert_eq!(lockers.len(), 1, "{lockers:?}");
    assert!(
        lockers[0]
            .description
            .contains(&format!("pid {}", std::process::id())),
        "{lockers:?}"
    );
    // Released at the end.
    let after = store
        .list_lockers(&header, ivdisk_image::WRITER_LOCK)
        .await
        .unwrap();
    assert!(after.is_empty(), "{after:?}");
}

/// A restore whose store fails part-way and stays down through its cleanup (OSDs down) keeps
/// its header, marked unfinished, once data objects it wrote cannot be removed: every open
/// refuses the image, and `ivdisk delete` removes it with its data. The header went first, and
/// the data objects left were seen and removed by no command.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_whose_cleanup_fails_keeps_its_header_marked() {
    let dir = tmp();
    let (file, _) = sample_backup(dir.path()).await;
    let store = Arc::new(FailingStore::new());
    // The header, two data objects, then the third and every data object's write after
    // fails (the first of them applied, its answer lost); the header's object stays up.
    let header = ObjectName::new(header_object_name("dst")).unwrap();
    store.spare_object(header.clone());
    store.fail_from_nth_write(4);
    store.apply_before_failing_once();
    match Image::restore_backup_on(&file, store.clone(), "dst", |_| {}).await {
        Err(ImageError::Store { .. }) => {}
        other => panic!("expected a store error, got {other:?}"),
    }
    store.arm(false);
    let left = objects(store.as_ref()).await;
    assert!(left.contains(&header), "the header went: {left:?}");
    assert!(left.len() > 1, "no data object was left: {left:?}");
    match Image::open_on(store.clone(), "dst", PASS, &OpenOptions::read_only()).await {
        Err(ImageError::FillUnfinished { .. }) => {}
        Err(e) => panic!("expected FillUnfinished, got {e}"),
        Ok(_) => panic!("the image of a failed restore opened"),
    }
}

/// Image "src" of two objects on a fresh memory store, its first block `byte`s, open.
async fn two_object_image(byte: u8) -> (Arc<dyn ObjectStore>, Image) {
    let source = memory();
    let options = common::options(
        2 * OBJECT,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        OBJECT,
    );
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    image.write(0, &[byte; 4096]).await.unwrap();
    (source, image)
}

#[tokio::test(flavor = "multi_thread")]
async fn existing_targets_and_files_are_refused() {
    let dir = tmp();
    let (source, image) = two_object_image(1).await;
    let id = image.image_id();
    // The head is read under the writer lock: refused while a writer has the image.
    let file = dir.path().join("b.ivdbak");
    match Image::backup_on(source.clone(), "src", &full(), &file, |_| {}).await {
        Err(ImageError::Locked { .. }) => {}
        other => panic!("expected Locked, got {other:?}"),
    }
    assert!(!file.exists() && !ivdisk_image::partial_path(&file).exists());
    image.close().await.unwrap();
    Image::backup_on(source.clone(), "src", &full(), &file, |_| {})
        .await
        .unwrap();
    // An existing file needs `overwrite`.
    match Image::backup_on(source.clone(), "src", &full(), &file, |_| {}).await {
        Err(ImageError::BackupFileExists { .. }) => {}
        other => panic!("expected BackupFileExists, got {other:?}"),
    }
    let overwrite = BackupOptions {
        overwrite: true,
        ..full()
    };
    Image::backup_on(source.clone(), "src", &overwrite, &file, |_| {})
        .await
        .unwrap();

    // Into the store it came from: the image exists.
    let before = objects(source.as_ref()).await;
    match Image::restore_backup_on(&file, source.clone(), "src", |_| {}).await {
        Err(ImageError::Exists { .. }) => {}
        other => panic!("expected Exists, got {other:?}"),
    }
    // Under another name in that store: its data objects (same id) are there.
    match Image::restore_backup_on(&file, source.clone(), "other", |_| {}).await {
        Err(ImageError::DataObjectsExist { count, .. }) => assert_eq!(count, 1),
        other => panic!("expected DataObjectsExist, got {other:?}"),
    }
    assert_eq!(
        objects(source.as_ref()).await,
        before,
        "nothing was written"
    );
    // A stray data object of that id in an otherwise empty store.
    let target = memory();
    let stray = ObjectName::new(format!("{}{:016x}", data_object_prefix(&id), 1)).unwrap();
    target.write(&stray, 0, b"stray").await.unwrap();
    match Image::restore_backup_on(&file, target.clone(), "dst", |_| {}).await {
        Err(ImageError::DataObjectsExist { .. }) => {}
        other => panic!("expected DataObjectsExist, got {other:?}"),
    }
    assert_eq!(objects(target.as_ref()).await, vec![stray.clone()]);
    assert_eq!(target.read(&stray, 0, 100).await.unwrap(), b"stray");
    // A missing snapshot.
    match Image::backup_on(source, "src", &at("nope"), &dir.path().join("n"), |_| {}).await {
        Err(ImageError::SnapshotNotFound { .. }) => {}
        other => panic!("expected SnapshotNotFound, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn luks_files_made_by_other_tools_are_refused() {
    let dir = tmp();
    let path = dir.path().join("luks.img");
    let mut file = std::fs::File::create(&path).unwrap();
    let key = ivdisk_crypto::VolumeKey::generate(64).unwrap();
    let mut spec = ivdisk_header::FormatSpec::new(Suite::AesXtsPlain64, 512);
    spec.data_offset = 16 << 20;
    spec.pbkdf = ivdisk_header::PbkdfRequest::fast_for_tests(ivdisk_header::PbkdfKind::Pbkdf2);
    spec.digest_iterations = Some(1000);
    ivdisk_header::Header::format(&mut file, &spec, &key, PASS).unwrap();
    file.set_len((16 << 20) + (1 << 20)).unwrap();
    drop(file);
    let uri = ImageUri::parse(path.to_str().unwrap()).unwrap();
    match Image::backup(&uri, &full(), &dir.path().join("b"), |_| {}).await {
        Err(ImageError::InvalidParameter { reason, .. }) => {
            assert!(reason.contains("LUKS file"), "{reason}")
        }
        other => panic!("expected InvalidParameter, got {other:?}"),
    }
    assert!(!dir.path().join("b").exists());
}

// ---------------------------------------------------------------------------------------------
// Incremental

#[tokio::test(flavor = "multi_thread")]
async fn increments_apply_onto_a_restored_base_only() {
    let (seed, _guard) = common::seed("increments_apply_onto_a_restored_base_only");
    let mut rng = Rng::new(seed);
    let dir = tmp();
    let source = memory();
    let size = 8 * OBJECT;
    let options = common::options(size, Suite::AesGcmRandom, LayoutKind::Omap, 4096, OBJECT);
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    let mut model = vec![0u8; size as usize];
    scribble(&image, &mut model, &mut rng).await;
    image
        .write(6 * OBJECT, &rng.bytes(OBJECT as usize))
        .await
        .unwrap();
    image.create_snapshot("one").await.unwrap();
    let model_one = {
        let mut m = model.clone();
        let mut buf = vec![0u8; OBJECT as usize];
        image.read(6 * OBJECT, &mut buf).await.unwrap();
        m[6 * OBJECT as usize..7 * OBJECT as usize].copy_from_slice(&buf);
        m
    };
    // Changes: one object rewritten in part, one removed whole, one new, and a bigger size.
    let patch = rng.bytes(5000);
    image.write(OBJECT + 10, &patch).await.unwrap();
    image.discard(6 * OBJECT, OBJECT).await.unwrap();
    image.resize(size + 2 * OBJECT, false).await.unwrap();
    let tail = rng.bytes(OBJECT as usize);
    image.write(size + OBJECT, &tail).await.unwrap();
    image.create_snapshot("two").await.unwrap();
    // And the head moves on after "two" (not part of the increment).
    image.write(0, &rng.bytes(4096)).await.unwrap();
    let two = {
        let at_two = OpenOptions {
            snapshot: Some("two".into()),
            ..OpenOptions::read_only()
        };
        let snap = Image::open_on(source.clone(), "src", PASS, &at_two)
            .await
            .unwrap();
        contents(&snap).await
    };
    image.close().await.unwrap();

    let base_file = dir.path().join("one.ivdbak");
    Image::backup_on(source.clone(), "src", &at("one"), &base_file, |_| {})
        .await
        .unwrap();
    let inc_file = dir.path().join("one-two.ivdbak");
    let inc_options = BackupOptions {
        snapshot: Some("two".into()),
        since: Some("one".into()),
        overwrite: false,
    };
    let inc = Image::backup_on(source.clone(), "src", &inc_options, &inc_file, |_| {})
        .await
        .unwrap();
    assert_eq!(inc.description.kind, BackupKind::Incremental);
    // Object 1 changed, object 6 removed, object 9 new; nothing else.
    assert_eq!((inc.objects, inc.removed), (2, 1), "{inc:?}");
    let base_len = std::fs::metadata(&base_file).unwrap().len();
    assert!(
        inc.file_bytes < base_len,
        "{} !< {base_len}",
        inc.file_bytes
    );

    // An increment does not restore on its own: the refusal says what to restore first (it
    // said to create the image).
    let empty = memory();
    match Image::restore_backup_on(&inc_file, empty.clone(), "dst", |_| {}).await {
        Err(e @ ImageError::IncrementalMismatch { .. }) => {
            let text = e.to_string();
            assert!(text.contains("restore that full backup"), "{text}");
            assert!(!text.contains("ivdisk create"), "{text}");
        }
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }
    assert!(objects(empty.as_ref()).await.is_empty());

    // Base, then increment.
    let target = memory();
    Image::restore_backup_on(&base_file, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    {
        let copy = Image::open_on(target.clone(), "dst", PASS, &OpenOptions::read_only())
            .await
            .unwrap();
        assert!(contents(&copy).await == model_one);
    }
    let applied = Image::restore_backup_on(&inc_file, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    assert_eq!(applied.sha256, inc.sha256);
    let copy = Image::open_on(target.clone(), "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(copy.size(), size + 2 * OBJECT);
    assert!(
        contents(&copy).await == two,
        "base + increment = snapshot two"
    );
    assert!(target.stat(&copy.data_object(6)).await.unwrap().is_none());
    drop(copy);
    // Nonce count never goes down.
    let count =
        |v: Option<Vec<u8>>| -> u64 { String::from_utf8(v.unwrap()).unwrap().parse().unwrap() };
    assert!(
        count(nonce_count(target.as_ref(), "dst").await)
            >= count(nonce_count(source.as_ref(), "src").await)
    );
    // Applying it again: the image is at "two" now.
    match Image::restore_backup_on(&inc_file, target.clone(), "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { .. }) => {}
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }

    // An increment that stopped part-way (as a full disk or a signal leaves it: marked as
    // being applied) is not opened, neither for reading nor for writing; running the restore
    // again finishes it.
    let header = ObjectName::new(header_object_name("dst")).unwrap();
    let state_of = |omap: Vec<(Vec<u8>, Vec<u8>)>| -> serde_json::Value {
        let (_, v) = omap
            .into_iter()
            .find(|(k, _)| k == BACKUP_STATE_KEY)
            .unwrap();
        serde_json::from_slice(&v).unwrap()
    };
    let two_id = state_of(target.omap_all(&header).await.unwrap())["snapshot_id"].clone();
    let halfway = memory();
    Image::restore_backup_on(&base_file, halfway.clone(), "dst", |_| {})
        .await
        .unwrap();
    let mut state = state_of(halfway.omap_all(&header).await.unwrap());
    state["applying"] = two_id;
    halfway
        .write_op(
            &header,
            ivdisk_store::WriteOp::new().omap_set(vec![(
                BACKUP_STATE_KEY.to_vec(),
                serde_json::to_vec(&state).unwrap(),
            )]),
        )
        .await
        .unwrap();
    for options in [OpenOptions::read_only(), OpenOptions::default()] {
        match Image::open_on(halfway.clone(), "dst", PASS, &options).await {
            Err(e @ ImageError::RestoreUnfinished { .. }) => {
                assert!(e.to_string().contains("ivdisk restore"), "{e}")
            }
            Err(e) => panic!("expected RestoreUnfinished, got {e:?}"),
            Ok(_) => panic!("a half-applied increment opened"),
        }
    }
    Image::restore_backup_on(&inc_file, halfway.clone(), "dst", |_| {})
        .await
        .unwrap();
    let finished = Image::open_on(halfway, "dst", PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert!(
        contents(&finished).await == two,
        "a resumed increment = snapshot two"
    );

    // An image restored from the head's backup, not from "one": refused.
    let head_file = dir.path().join("head.ivdbak");
    Image::backup_on(source.clone(), "src", &full(), &head_file, |_| {})
        .await
        .unwrap();
    let other = memory();
    Image::restore_backup_on(&head_file, other.clone(), "dst", |_| {})
        .await
        .unwrap();
    let before = objects(other.as_ref()).await;
    match Image::restore_backup_on(&inc_file, other.clone(), "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { .. }) => {}
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }
    assert_eq!(objects(other.as_ref()).await, before);

    // A base restored and then written where the increment changes it: refused there.
    let written = memory();
    Image::restore_backup_on(&base_file, written.clone(), "dst", |_| {})
        .await
        .unwrap();
    let w = Image::open_on(written.clone(), "dst", PASS, &OpenOptions::default())
        .await
        .unwrap();
    w.write(OBJECT, &[9u8; 4096]).await.unwrap();
    w.close().await.unwrap();
    match Image::restore_backup_on(&inc_file, written.clone(), "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { reason, .. }) => {
            assert!(reason.contains("data object 1"), "{reason}")
        }
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }

    // Another image's base: refused by id.
    let stranger = memory();
    let s = Image::create_on(stranger.clone(), "dst", &options, PASS)
        .await
        .unwrap();
    s.close().await.unwrap();
    match Image::restore_backup_on(&inc_file, stranger, "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { reason, .. }) => {
            assert!(reason.contains("image id"), "{reason}")
        }
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }
    // The state marker is not carried into a backup of a restored image.
    let again = dir.path().join("again.ivdbak");
    Image::backup_on(target.clone(), "dst", &full(), &again, |_| {})
        .await
        .unwrap();
    let third = memory();
    Image::restore_backup_on(&again, third.clone(), "dst", |_| {})
        .await
        .unwrap();
    let marker = third
        .omap_all(&ObjectName::new(header_object_name("dst")).unwrap())
        .await
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == BACKUP_STATE_KEY)
        .map(|(_, v)| String::from_utf8(v).unwrap())
        .unwrap();
    assert!(marker.contains("\"snapshot_id\":null"), "{marker}");
}

// ---------------------------------------------------------------------------------------------
// RADOS (a real cluster: see tests/common; IVDISK_NO_CEPH=1 skips, loudly)

/// Local image → backup → RADOS; a snapshot of the RADOS image → backup → memory. RADOS reads
/// holes as zeros (no sparse read): the file stays sparse all the same.
#[tokio::test(flavor = "multi_thread")]
async fn round_trips_through_rados() {
    if common::rados_uri("backup").is_none() {
        return;
    }
    let (seed, _guard) = common::seed("round_trips_through_rados");
    for layout in [LayoutKind::Omap, LayoutKind::ObjectEnd] {
        let mut rng = Rng::derive(seed, layout.name());
        let source = common::local_dir();
        let size = 6 * OBJECT;
        let options = common::options(size, Suite::AesGcmRandom, layout, 4096, OBJECT);
        let image = Image::create(&source.uri, &options, PASS).await.unwrap();
        let mut model = vec![0u8; size as usize];
        scribble(&image, &mut model, &mut rng).await;
        image.close().await.unwrap();
        let dir = tmp();
        let file = dir.path().join("to-rados.ivdbak");
        let made = Image::backup(&source.uri, &full(), &file, |_| {})
            .await
            .unwrap();

        let target = common::rados_uri(&format!("backup-{}", layout.name())).unwrap();
        Image::restore_backup(&file, &target, |_| {}).await.unwrap();
        let copy = Image::open(&target, PASS, &OpenOptions::default())
            .await
            .unwrap();
        assert!(
            contents(&copy).await == model,
            "{layout}: restored on RADOS"
        );
        copy.create_snapshot("snap").await.unwrap();
        copy.write(0, &rng.bytes(OBJECT as usize)).await.unwrap();
        copy.discard(3 * OBJECT, OBJECT).await.unwrap();
        copy.close().await.unwrap();

        let back = dir.path().join("from-rados.ivdbak");
        let from_rados = Image::backup(&target, &at("snap"), &back, |_| {})
            .await
            .unwrap();
        assert_eq!(from_rados.objects, made.objects, "{layout}");
        assert!(
            from_rados.data_bytes <= made.data_bytes + 4096,
            "{layout}: holes read back from RADOS were stored ({} vs {})",
            from_rados.data_bytes,
            made.data_bytes
        );
        let memory_target = memory();
        Image::restore_backup_on(&back, memory_target.clone(), "dst", |_| {})
            .await
            .unwrap();
        let again = Image::open_on(memory_target, "dst", PASS, &OpenOptions::read_only())
            .await
            .unwrap();
        assert!(
            contents(&again).await == model,
            "{layout}: RADOS snapshot → memory"
        );
        Image::remove_snapshot(&target, "snap").await.unwrap();
        Image::delete(&target, |_, _| {}).await.unwrap();
    }
}

/// A backup carries the source header's omap but not who writes or reads the source: its
/// writer's record (client and address) and a removal underway. Carried, the record made
/// the restored copy's first writer fence that client, a live server of the source when
/// both images are on one cluster.
#[tokio::test(flavor = "multi_thread")]
async fn a_restore_carries_no_record_of_the_sources_writer() {
    let (source, image) = two_object_image(7).await;
    image.close().await.unwrap();
    // As a RADOS writer of the source leaves them (the memory store records no addresses).
    let header = ObjectName::new(header_object_name("src")).unwrap();
    let records = [
        b"ivdisk.last_writer".as_slice(),
        b"ivdisk.last_writer_client",
        b"ivdisk.removing",
    ];
    source
        .write_op(
            &header,
            ivdisk_store::WriteOp::new().omap_set(
                records
                    .iter()
                    .map(|k| (k.to_vec(), b"client.4242 10.0.0.1:0/1".to_vec()))
                    .collect::<Vec<_>>(),
            ),
        )
        .await
        .unwrap();
    let dir = tmp();
    let file = dir.path().join("src.ivdbak");
    Image::backup_on(source, "src", &full(), &file, |_| {})
        .await
        .unwrap();
    let target = memory();
    Image::restore_backup_on(&file, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    let restored = ObjectName::new(header_object_name("dst")).unwrap();
    // (The restore, a writer itself, leaves its own `ivdisk.last_writer` cookie.)
    let pairs = target.omap_all(&restored).await.unwrap();
    for record in records {
        assert!(
            !pairs
                .iter()
                .any(|(k, v)| k == record && v.starts_with(b"client.4242")),
            "{} carried",
            String::from_utf8_lossy(record)
        );
    }
    let copy = Image::open_on(target, "dst", PASS, &OpenOptions::default())
        .await
        .unwrap();
    let mut back = vec![0u8; 4096];
    copy.read(0, &mut back).await.unwrap();
    assert_eq!(back, [7u8; 4096]);
    copy.close().await.unwrap();
}

/// A replica rolled back to one of its own snapshots no longer holds what its restore record
/// says: the next increment is refused (a full restore is needed), instead of applying on top
/// of rolled-back objects it does not check and leaving a mix of two states. Snapshot A, B
/// and C of the source change object 0, then object 1; the replica holds A, takes `safe`,
/// takes A→B, rolls back to `safe`, and is offered B→C (which touches object 1 only).
#[tokio::test(flavor = "multi_thread")]
async fn a_rollback_leaves_no_base_for_increments() {
    let dir = tmp();
    abc_backups(dir.path()).await;
    let file = |name: &str| dir.path().join(name);

    let replica = ImageUri::parse(&format!("{}", dir.path().join("replica").display())).unwrap();
    Image::restore_backup(&file("a.ivdbak"), &replica, |_| {})
        .await
        .unwrap();
    Image::create_snapshot_of(&replica, "safe").await.unwrap();
    Image::restore_backup(&file("ab.ivdbak"), &replica, |_| {})
        .await
        .unwrap();
    Image::rollback_snapshot(&replica, "safe", |_, _| {})
        .await
        .unwrap();
    match Image::restore_backup(&file("bc.ivdbak"), &replica, |_| {}).await {
        Err(ImageError::IncrementalMismatch { .. }) => {}
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }
    let copy = Image::open(&replica, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let data = contents(&copy).await;
    assert!(
        data.iter().all(|&b| b == 1),
        "the replica holds snapshot a, as rolled back"
    );
}

/// A source of two objects with snapshots a, b (object 0 changed) and c (object 1 changed),
/// and backup files in `dir`: a.ivdbak (full, at a), ab, bc and ac (increments).
async fn abc_backups(dir: &Path) -> Arc<dyn ObjectStore> {
    let (source, image) = two_object_image(1).await;
    image
        .write(0, &vec![1u8; 2 * OBJECT as usize])
        .await
        .unwrap();
    image.create_snapshot("a").await.unwrap();
    image.write(0, &vec![2u8; OBJECT as usize]).await.unwrap();
    image.create_snapshot("b").await.unwrap();
    image
        .write(OBJECT, &vec![3u8; OBJECT as usize])
        .await
        .unwrap();
    image.create_snapshot("c").await.unwrap();
    image.close().await.unwrap();
    let since = |snapshot: &str, base: &str| BackupOptions {
        snapshot: Some(snapshot.into()),
        since: Some(base.into()),
        overwrite: false,
    };
    for (options, name) in [
        (at("a"), "a.ivdbak"),
        (since("b", "a"), "ab.ivdbak"),
        (since("c", "b"), "bc.ivdbak"),
        (since("c", "a"), "ac.ivdbak"),
    ] {
        Image::backup_on(source.clone(), "src", &options, &dir.join(name), |_| {})
            .await
            .unwrap();
    }
    source
}

/// The memory store, whose header objects also change (an omap key of their own) whenever a
/// data object is written while armed, as a RADOS writer lock's renewal changes the header
/// object's version every 10 s during a long restore.
struct RenewingStore {
    inner: MemoryStore,
    armed: std::sync::atomic::AtomicBool,
}

ivdisk_store::object_store_forwarding_to_inner!(RenewingStore {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        let outcome = self.inner.write_op(object, op).await?;
        if self.armed.load(std::sync::atomic::Ordering::SeqCst)
            && object.as_str().starts_with("ivdisk_data.")
        {
            let header = ObjectName::new(header_object_name("dst")).unwrap();
            let bump = ivdisk_store::WriteOp::new()
                .omap_set(vec![(b"lock.renewed".to_vec(), b"1".to_vec())]);
            self.inner.write_op(&header, bump).await?;
        }
        Ok(outcome)
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        self.inner.read_op(object, op).await
    }
});

/// An increment whose restore outlives a lock renewal (the header object's version moves,
/// its bytes do not) goes in: its final header write asserted the version marked at the
/// start, so on RADOS every increment taking more than 10 s failed, and left the image
/// marked half-applied for good.
#[tokio::test(flavor = "multi_thread")]
async fn an_increment_outlives_the_header_objects_version() {
    let dir = tmp();
    let source = abc_backups(dir.path()).await;
    let target = Arc::new(RenewingStore {
        inner: MemoryStore::new().unwrap(),
        armed: false.into(),
    });
    Image::restore_backup_on(&dir.path().join("a.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();
    target
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    Image::restore_backup_on(&dir.path().join("ab.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();
    copy_holds(target, source, "b").await;
}

/// Two copies restored from one full backup share the image id and the snapshot id; an
/// increment between snapshots taken on one copy goes only onto images restored from that
/// copy. On the other it passed (same image id, base id 1 == 1), checked and wrote only the
/// objects the increment changes, and the image claimed a state it did not hold.
#[tokio::test(flavor = "multi_thread")]
async fn an_increment_of_a_sibling_copy_is_refused() {
    let dir = tmp();
    abc_backups(dir.path()).await;
    let full = dir.path().join("a.ivdbak");
    let (mirror, work) = (memory(), memory());
    for copy in [&mirror, &work] {
        Image::restore_backup_on(&full, copy.clone(), "dst", |_| {})
            .await
            .unwrap();
    }
    let image = Image::open_on(work.clone(), "dst", PASS, &OpenOptions::default())
        .await
        .unwrap();
    image.write(0, &vec![8u8; OBJECT as usize]).await.unwrap();
    let s = image.create_snapshot("s").await.unwrap();
    image
        .write(OBJECT, &vec![9u8; OBJECT as usize])
        .await
        .unwrap();
    image.create_snapshot("t").await.unwrap();
    image.close().await.unwrap();
    // The snapshot ids of the copy are those the restored image records (1, as "a"'s).
    let restored_id = dst_backup_state(mirror.as_ref()).await["snapshot_id"].clone();
    assert_eq!(restored_id, s.id, "the scenario needs ids that collide");
    let increment = dir.path().join("st.ivdbak");
    let options = BackupOptions {
        snapshot: Some("t".into()),
        since: Some("s".into()),
        overwrite: false,
    };
    Image::backup_on(work.clone(), "dst", &options, &increment, |_| {})
        .await
        .unwrap();
    match Image::restore_backup_on(&increment, mirror.clone(), "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { reason, .. }) => {
            assert!(reason.contains("another copy"), "{reason}")
        }
        other => panic!("expected IncrementalMismatch, got {other:?}"),
    }
}

/// The memory store as a store that acknowledges writes before they are durable sees a
/// failed group commit: once armed, data object writes are acknowledged and not applied, and
/// the next flush fails (what the local store reports when a commit failed, ENOSPC).
struct LosingStore {
    inner: MemoryStore,
    armed: std::sync::atomic::AtomicBool,
    lost: std::sync::atomic::AtomicBool,
}

#[async_trait::async_trait]
impl ObjectStore for LosingStore {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.armed.load(SeqCst) && object.as_str().starts_with("ivdisk_data.") {
            self.lost.store(true, SeqCst);
            return Ok(ivdisk_store::WriteOutcome { version: 1 });
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ivdisk_store::ReadOp,
    ) -> Result<Vec<ivdisk_store::ReadResult>, ivdisk_store::StoreError> {
        self.inner.read_op(object, op).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, ivdisk_store::StoreError> {
        self.inner.list(prefix).await
    }
    async fn snap_create(&self) -> Result<ivdisk_store::SnapId, ivdisk_store::StoreError> {
        self.inner.snap_create().await
    }
    async fn snap_remove(
        &self,
        snap: ivdisk_store::SnapId,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.snap_remove(snap).await
    }
    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: ivdisk_store::LockRequest,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.lock_exclusive(object, request).await
    }
    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.unlock(object, lock, cookie).await
    }
    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<ivdisk_store::Locker>, ivdisk_store::StoreError> {
        self.inner.list_lockers(object, lock).await
    }
    async fn break_lock(
        &self,
        object: &ObjectName,
        lock: &str,
        client: &str,
        cookie: &str,
    ) -> Result<(), ivdisk_store::StoreError> {
        self.inner.break_lock(object, lock, client, cookie).await
    }
    async fn flush(&self) -> Result<(), ivdisk_store::StoreError> {
        if self.lost.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Err(ivdisk_store::StoreError::NoSpace {
                context: "committing (test)".into(),
            });
        }
        self.inner.flush().await
    }
    fn client_id(&self) -> &str {
        self.inner.client_id()
    }
}

/// An increment whose data writes were acknowledged but lost (the flush after them fails)
/// leaves the image marked half-applied, at its base: it wrote the header naming the new
/// snapshot before it flushed, so the image opened as a mix of two states and the retry was
/// refused ("this image holds snapshot `b`").
#[tokio::test(flavor = "multi_thread")]
async fn an_increment_whose_data_was_lost_is_not_recorded_as_applied() {
    let dir = tmp();
    abc_backups(dir.path()).await;
    let target = Arc::new(LosingStore {
        inner: MemoryStore::new().unwrap(),
        armed: false.into(),
        lost: false.into(),
    });
    Image::restore_backup_on(&dir.path().join("a.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();
    target
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let applied =
        Image::restore_backup_on(&dir.path().join("ab.ivdbak"), target.clone(), "dst", |_| {})
            .await;
    assert!(applied.is_err(), "the lost writes went unreported");
    let state = dst_backup_state(target.as_ref()).await;
    assert_eq!(state["snapshot"], "a", "the image claims b: {state}");
    assert_eq!(state["applying"], 2, "no half-applied mark: {state}");
    // Once the store keeps its writes, the same increment finishes the job.
    target
        .armed
        .store(false, std::sync::atomic::Ordering::SeqCst);
    Image::restore_backup_on(&dir.path().join("ab.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();
}

/// An image an increment was left half applied in takes no other increment (from the same
/// base, it checked only the objects it changes and kept the other's writes to the rest),
/// and is not backed up whole (a mix of two states); a full restore beside an image of the
/// backup's id (never written: no data objects to refuse it by) is refused, as both names
/// would share the data objects written from then on.
#[tokio::test(flavor = "multi_thread")]
async fn half_applied_increments_and_shared_ids_are_refused() {
    let dir = tmp();
    abc_backups(dir.path()).await;
    let file = |name: &str| dir.path().join(name);
    let target = memory();
    Image::restore_backup_on(&file("a.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();
    // a→c stopped part-way: its marker names c (id 3).
    let header = ObjectName::new(header_object_name("dst")).unwrap();
    let mut state = dst_backup_state(target.as_ref()).await;
    state["applying"] = 3.into();
    let op = ivdisk_store::WriteOp::new().omap_set(vec![(
        BACKUP_STATE_KEY.to_vec(),
        serde_json::to_vec(&state).unwrap(),
    )]);
    target.write_op(&header, op).await.unwrap();
    match Image::restore_backup_on(&file("ab.ivdbak"), target.clone(), "dst", |_| {}).await {
        Err(ImageError::RestoreUnfinished { .. }) => {}
        other => panic!("expected RestoreUnfinished, got {other:?}"),
    }
    // b→c ends at c too, but starts from b: it is no resumption of a→c (it checked only the
    // objects b→c changes, and left object 0, which a→b changed, at a).
    match Image::restore_backup_on(&file("bc.ivdbak"), target.clone(), "dst", |_| {}).await {
        Err(ImageError::IncrementalMismatch { .. }) => {}
        other => panic!("b→c over a half-applied a→c: expected IncrementalMismatch, got {other:?}"),
    }
    let whole = dir.path().join("whole.ivdbak");
    match Image::backup_on(target.clone(), "dst", &full(), &whole, |_| {}).await {
        Err(ImageError::RestoreUnfinished { .. }) => {}
        other => panic!("expected RestoreUnfinished, got {other:?}"),
    }
    assert!(!whole.exists());
    // Finishing a→c works.
    Image::restore_backup_on(&file("ac.ivdbak"), target.clone(), "dst", |_| {})
        .await
        .unwrap();

    let store = memory();
    let options = common::options(
        2 * OBJECT,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        OBJECT,
    );
    let unwritten = Image::create_on(store.clone(), "one", &options, PASS)
        .await
        .unwrap();
    unwritten.close().await.unwrap();
    let backup = dir.path().join("one.ivdbak");
    Image::backup_on(store.clone(), "one", &full(), &backup, |_| {})
        .await
        .unwrap();
    match Image::restore_backup_on(&backup, store.clone(), "two", |_| {}).await {
        Err(ImageError::HeaderIdInUse { other, .. }) => {
            assert!(other.ends_with("one"), "{other}")
        }
        other => panic!("expected HeaderIdInUse, got {other:?}"),
    }
    assert!(store
        .stat(&ObjectName::new(header_object_name("two")).unwrap())
        .await
        .unwrap()
        .is_none());
}

/// A record whose checksums and file digest are right but which holds more omap pairs than
/// any layout writes into an object (empty pairs: tens of millions fit a record, gigabytes in
/// memory) is refused as damaged; it was decoded whole, and restored.
/// `good` (a backup) with its first data record's payload replaced by `payload` (the object's
/// index kept), its checksums and digest made right again.
fn with_first_data_record(good: &[u8], state: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    let starts = record_starts(good);
    let (first, trailer) = (starts[1], *starts.last().unwrap());
    let mut payload = good[first + 9..first + 17].to_vec(); // the index
    payload.extend_from_slice(state);
    // kind | length | payload | CRC-32 of the three.
    let record = |out: &mut Vec<u8>, kind: u8, payload: &[u8]| {
        let mut head = vec![kind];
        head.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        crc.update(payload);
        out.extend_from_slice(&head);
        out.extend_from_slice(payload);
        out.extend_from_slice(&crc.finalize().to_le_bytes());
    };
    let mut bad = good[..first].to_vec();
    record(&mut bad, 2, &payload); // a data record
    bad.extend_from_slice(&good[starts[2]..trailer]);
    // The trailer: the record count as it was, the digest of every byte before it.
    let mut payload = good[trailer + 9..trailer + 17].to_vec();
    payload.extend_from_slice(&sha2::Sha256::digest(&bad));
    record(&mut bad, 0xFF, &payload);
    bad
}

#[tokio::test(flavor = "multi_thread")]
async fn a_record_of_too_many_omap_pairs_is_refused() {
    let dir = tmp();
    let (_, good) = sample_backup(dir.path()).await;
    let mut state = 0u64.to_le_bytes().to_vec(); // size
    state.extend_from_slice(&0u32.to_le_bytes()); // runs
    let pairs = 2000u32; // 64 KiB objects: at most 128 + 1024
    state.extend_from_slice(&pairs.to_le_bytes());
    for i in 0..pairs {
        state.extend_from_slice(&4u32.to_le_bytes());
        state.extend_from_slice(&i.to_be_bytes());
        state.extend_from_slice(&0u32.to_le_bytes());
    }
    refused(
        dir.path(),
        &with_first_data_record(&good, &state),
        "too many omap pairs",
    )
    .await;
}

/// Runs of data are whole 4 KiB blocks with zero blocks between them, as backups are
/// written; a crafted record of 1-byte runs (each held in a buffer of its own, a restore of a
/// 390 MB file took 9 GB of memory) is refused, and so are adjacent and unaligned runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_of_runs_not_in_whole_blocks_is_refused() {
    let dir = tmp();
    let (_, good) = sample_backup(dir.path()).await;
    let state = |size: u64, runs: &[(u64, u32)]| {
        let mut state = size.to_le_bytes().to_vec();
        state.extend_from_slice(&(runs.len() as u32).to_le_bytes());
        for &(offset, len) in runs {
            state.extend_from_slice(&offset.to_le_bytes());
            state.extend_from_slice(&len.to_le_bytes());
            state.extend(std::iter::repeat_n(7u8, len as usize));
        }
        state.extend_from_slice(&0u32.to_le_bytes()); // omap pairs
        state
    };
    let tiny: Vec<(u64, u32)> = (0..1000).map(|i| (2 * i, 1)).collect();
    for (what, runs) in [
        ("1-byte runs", tiny),
        ("adjacent runs", vec![(0, 4096), (4096, 4096)]),
        ("an unaligned run", vec![(512, 4096)]),
        ("a run of part of a block", vec![(0, 100), (8192, 4096)]),
    ] {
        let bad = with_first_data_record(&good, &state(OBJECT, &runs));
        refused(dir.path(), &bad, what).await;
    }
    // The form backups have: whole blocks apart, the last one cut at the object's end.
    let fine = with_first_data_record(
        &good,
        &state(OBJECT - 100, &[(0, 4096), (OBJECT - 4096, 3996)]),
    );
    std::fs::write(dir.path().join("fine.ivdbak"), &fine).unwrap();
    Image::verify_backup(&dir.path().join("fine.ivdbak")).unwrap();
}

/// An increment whose writing pass fails part-way (here its file is cut short under it) says
/// that the image now holds part of it, not that "nothing was restored", and the same restore
/// with the file as it was finishes it.
#[tokio::test(flavor = "multi_thread")]
async fn an_increment_failing_part_way_says_so_and_finishes_when_run_again() {
    let dir = tmp();
    let source = memory();
    const MIB: u64 = 1 << 20;
    let options = common::options(
        32 * MIB,
        Suite::DEFAULT,
        LayoutKind::ObjectEnd,
        4096,
        4 * MIB,
    );
    let image = Image::create_on(source.clone(), "src", &options, PASS)
        .await
        .unwrap();
    let mut rng = Rng::new(11);
    image.write(0, &rng.bytes(32 * MIB as usize)).await.unwrap();
    image.create_snapshot("a").await.unwrap();
    image.write(0, &rng.bytes(32 * MIB as usize)).await.unwrap();
    image.create_snapshot("b").await.unwrap();
    image.close().await.unwrap();
    let (base, increment) = (dir.path().join("a.ivdbak"), dir.path().join("ab.ivdbak"));
    Image::backup_on(source.clone(), "src", &at("a"), &base, |_| {})
        .await
        .unwrap();
    let since = BackupOptions {
        snapshot: Some("b".into()),
        since: Some("a".into()),
        overwrite: false,
    };
    Image::backup_on(source.clone(), "src", &since, &increment, |_| {})
        .await
        .unwrap();
    let target = memory();
    Image::restore_backup_on(&base, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    let intact = std::fs::read(&increment).unwrap();
    // At the writing pass's first report (16 MiB into the file), the file is cut to 1 MiB.
    let cut = |p: BackupProgress| {
        if p.phase == BackupPhase::Writing && p.done < p.total {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&increment)
                .unwrap();
            file.set_len(MIB).unwrap();
        }
    };
    let failed = Image::restore_backup_on(&increment, target.clone(), "dst", cut).await;
    let Err(e @ ImageError::IncrementStopped { .. }) = failed else {
        panic!("expected IncrementStopped, got {failed:?}")
    };
    let message = e.to_string();
    assert!(
        message.contains("part of the increment") && !message.contains("nothing was"),
        "{message}"
    );
    match Image::open_on(target.clone(), "dst", PASS, &OpenOptions::read_only()).await {
        Err(ImageError::RestoreUnfinished { .. }) => {}
        other => panic!("a half-applied image opened: {:?}", other.map(|_| ())),
    }
    std::fs::write(&increment, &intact).unwrap();
    Image::restore_backup_on(&increment, target.clone(), "dst", |_| {})
        .await
        .unwrap();
    copy_holds(target, source, "b").await;
}

/// A stop asked for while the file is being checked (minutes for a large one) ends the
/// restore there, before anything is created; it went unheard until the check was done.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_during_the_check_creates_nothing() {
    let dir = tmp();
    let (file, _) = sample_backup(dir.path()).await;
    let target = dir.path().join("restored");
    let uri = ImageUri::parse(target.to_str().unwrap()).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(true);
    match Image::restore_backup_until(&file, &uri, |_| {}, &stop).await {
        Err(ImageError::Stopped { .. }) => {}
        other => panic!("expected Stopped, got {other:?}"),
    }
    assert!(!target.exists(), "a stopped check created the store");
}
