//! Metadata compaction: once no write came for a while, the local store writes back what its
//! overlays hold, gives SQLite's free pages back to the file system and truncates its log, so
//! that objects removed (an image deleted, a disk discarded) cost no disk in the metadata
//! either, and everything still stored reads back as before.
//!
//! One test per process: the idle time is set through the environment
//! (`IVDISK_STORE_COMPACT_IDLE_MS`), which every store of the process reads when it opens.

use std::path::Path;
use std::time::{Duration, Instant};

use ivdisk_store::small_fs::SmallFileSystem;
use ivdisk_store::{
    LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt, WriteOp,
};

const OBJECTS: usize = 48;
const WRITES: usize = 160;
const BLOCK: usize = 4096;
/// The object that stays.
const KEPT: usize = 7;

/// Bytes of the metadata database and of its log.
fn metadata_files(dir: &Path) -> (u64, u64) {
    let len = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
    (len("meta.sqlite"), len("meta.sqlite-wal"))
}

fn name(i: usize) -> ObjectName {
    ObjectName::new(format!("rbd_data.c.{i:016x}")).unwrap()
}

/// Block `w` of object `i`, never zero.
fn block(i: usize, w: usize) -> Vec<u8> {
    vec![1 + ((i * 31 + w * 7) % 251) as u8; BLOCK]
}

fn key(w: usize) -> Vec<u8> {
    format!("k{w:08}").into_bytes()
}

/// Every other block of the object (so that each write is an extent of its own) and one omap
/// key per write.
async fn fill(store: &LocalStore, i: usize) {
    for w in 0..WRITES {
        let op = WriteOp::new()
            .write((2 * w * BLOCK) as u64, block(i, w))
            .omap_set(vec![(key(w), vec![w as u8; 40])]);
        store.write_op(&name(i), op).await.unwrap();
    }
}

/// A read-only store reads all along while the writer beside it writes back, rebuilds its
/// database and truncates its log (the truncation does not wait for the reader: it comes at a
/// later idle time once the reader is gone), and the writer answers at once after.
async fn reader_beside_a_compacting_writer(path: &Path) {
    let writer = LocalStore::open(path).unwrap();
    for i in (0..OBJECTS).filter(|&i| i != KEPT) {
        fill(&writer, i).await;
    }
    writer.flush().await.unwrap();
    let reader = LocalStore::open_read_only(path).unwrap();
    check_kept(&reader).await;
    for i in (0..OBJECTS).filter(|&i| i != KEPT) {
        writer.remove(&name(i)).await.unwrap();
    }
    writer.flush().await.unwrap();
    // Reads for three idle times: the compaction runs meanwhile.
    let until = Instant::now() + Duration::from_millis(1500);
    let mut reads = 0;
    while Instant::now() < until {
        check_kept(&reader).await;
        assert!(
            reader.stat(&name(0)).await.unwrap().is_none(),
            "a removed object came back for the reader"
        );
        reads += 1;
    }
    let started = Instant::now();
    fill(&writer, 1).await;
    let write_time = started.elapsed();
    assert!(
        write_time < Duration::from_secs(5),
        "{WRITES} writes took {write_time:?} after the compaction beside a reader"
    );
    drop(reader);
    writer.flush().await.unwrap();
    let (db, wal) = wait_for_compaction(path, u64::MAX).await;
    println!("beside a reader: {reads} checks of the kept object; then database {db}, log {wal}");
    check_kept(&writer).await;
    writer.remove(&name(1)).await.unwrap();
}

/// On a file system with no room left, an idle store's write-back commits fail for lack of
/// space (test builds compact whatever the room; the product leaves the last 64 MiB alone),
/// and lose nothing: no flush reports operations lost (none were in them), the data reads
/// back, and once space is freed the store writes again.
async fn on_a_full_file_system(dir: &Path) {
    let fs = SmallFileSystem::mount(&dir.join("small"), "40m");
    let path = fs.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    for i in 0..4 {
        fill(&store, i).await;
    }
    store.flush().await.unwrap();
    let filler = fs.fill("filler");
    // Six idle times: compaction is due, and only truncates the log if it can.
    tokio::time::sleep(Duration::from_secs(3)).await;
    store
        .flush()
        .await
        .expect("a flush after idle times on a full file system");
    let data = store.read(&name(2), 0, BLOCK as u64).await.unwrap();
    assert_eq!(data, block(2, 0));
    assert_eq!(store.omap_all(&name(2)).await.unwrap().len(), WRITES);
    std::fs::remove_file(filler).unwrap();
    fill(&store, 5).await;
    store.flush().await.unwrap();
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(store.omap_all(&name(5)).await.unwrap().len(), WRITES);
}

async fn check_kept(store: &LocalStore) {
    let data = store
        .read(&name(KEPT), 0, (2 * WRITES * BLOCK) as u64)
        .await
        .unwrap();
    for w in 0..WRITES {
        let at = 2 * w * BLOCK;
        assert!(
            data[at..at + BLOCK] == block(KEPT, w)[..],
            "block {w} of the kept object changed"
        );
    }
    let omap = store.omap_all(&name(KEPT)).await.unwrap();
    assert_eq!(omap.len(), WRITES, "the kept object's omap keys");
    for (w, (k, v)) in omap.iter().enumerate() {
        assert_eq!((k, v), (&key(w), &vec![w as u8; 40]));
    }
}

/// Wait until the log is truncated and the database is at most `bound` bytes.
async fn wait_for_compaction(dir: &Path, bound: u64) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (db, wal) = metadata_files(dir);
        if wal == 0 && db <= bound {
            return (db, wal);
        }
        assert!(
            Instant::now() < deadline,
            "no compaction within 60 s: database {db} bytes (bound {bound}), log {wal} bytes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_store_gives_its_metadata_space_back() {
    std::env::set_var("IVDISK_STORE_COMPACT_IDLE_MS", "500");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    for i in 0..OBJECTS {
        fill(&store, i).await;
    }
    store.flush().await.unwrap();
    let (db, wal) = metadata_files(&path);
    let full = db + wal;
    // Enough for a rebuild without the free pages once most objects are gone (test builds
    // rebuild from 256 KiB of free pages).
    assert!(full > 1 << 20, "the writes left {full} bytes of metadata");

    // While writes keep coming (every 100 ms, under the idle time), nothing is compacted: the
    // log keeps what they wrote.
    for w in 0..10 {
        let op = WriteOp::new().omap_set(vec![(b"busy".to_vec(), vec![w as u8])]);
        store.write_op(&name(KEPT), op).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        metadata_files(&path).1 > 0,
        "the log was truncated while writes kept coming"
    );
    let op = WriteOp::new().step(ivdisk_store::WriteStep::OmapRemoveKeys(vec![
        b"busy".to_vec()
    ]));
    store.write_op(&name(KEPT), op).await.unwrap();

    // Idle with everything in use: the log goes, the kept data stays.
    let (compacted_db, _) = wait_for_compaction(&path, u64::MAX).await;
    check_kept(&store).await;

    // Every object but one removed: the database shrinks to a fraction.
    for i in (0..OBJECTS).filter(|&i| i != KEPT) {
        store.remove(&name(i)).await.unwrap();
    }
    store.flush().await.unwrap();
    let (small, _) = wait_for_compaction(&path, compacted_db / 4).await;
    println!(
        "metadata: {full} bytes after the writes, {compacted_db} compacted, {small} after \
         removing {} of {OBJECTS} objects",
        OBJECTS - 1
    );
    check_kept(&store).await;

    // The store goes on: a write after the compaction, then a reopen.
    fill(&store, 0).await;
    store.flush().await.unwrap();
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    check_kept(&store).await;
    let data = store.read(&name(0), 0, BLOCK as u64).await.unwrap();
    assert_eq!(data, block(0, 0));
    assert_eq!(store.omap_all(&name(0)).await.unwrap().len(), WRITES);
    drop(store);

    reader_beside_a_compacting_writer(&path).await;
    on_a_full_file_system(dir.path()).await;

    // A store that removes most objects and stops before it is idle (`ivdisk delete`) leaves
    // a small database too.
    std::env::set_var("IVDISK_STORE_COMPACT_IDLE_MS", "600000");
    let store = LocalStore::open(&path).unwrap();
    for i in (0..OBJECTS).filter(|&i| i != KEPT) {
        fill(&store, i).await;
    }
    store.flush().await.unwrap();
    drop(store);
    let (before, _) = metadata_files(&path);
    let store = LocalStore::open(&path).unwrap();
    for i in (0..OBJECTS).filter(|&i| i != KEPT) {
        store.remove(&name(i)).await.unwrap();
    }
    drop(store);
    let (after, wal) = metadata_files(&path);
    println!("metadata: {before} bytes before removing the objects and stopping, {after} after");
    assert!(
        after <= before / 4 && wal == 0,
        "after the removals and a stop: database {after} bytes (before {before}), log {wal}"
    );
    let store = LocalStore::open(&path).unwrap();
    check_kept(&store).await;
}
