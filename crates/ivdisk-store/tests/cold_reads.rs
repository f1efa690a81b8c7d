//! Reads of data that is no longer in the page cache. An object written in many small pieces
//! is read as many pieces of the segments; when the first of them has to come from the disk,
//! the store asks for all the others at once (`Segments::prefetch`) and then reads them one by
//! one. Here the segment files' pages are dropped before each read, so that path runs: every
//! byte must come back as written, through a writer's open and a read-only one.

use std::path::Path;

use ivdisk_store::{
    LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt, WriteOp, WriteStep,
};

const BLOCK: usize = 4096;
const BLOCKS: usize = 256;

fn piece(k: usize, len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (k as u8) ^ salt)
        .collect()
}

/// Make the segment files' pages clean and drop them from the page cache. Returns whether
/// the file system dropped them (tmpfs cannot: there every read is from memory).
fn drop_cached_pages(dir: &Path) -> bool {
    let mut dropped = true;
    for entry in std::fs::read_dir(dir.join("data")).unwrap() {
        let path = entry.unwrap().path();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        // A one-byte read that may not wait for the disk fails when the page is gone.
        let mut byte = [0u8; 1];
        let slices = &mut [std::io::IoSliceMut::new(&mut byte)];
        let cached = rustix::io::preadv2(&file, slices, 0, rustix::io::ReadWriteFlags::NOWAIT);
        dropped &= cached.is_err();
    }
    dropped
}

async fn check(store: &LocalStore, object: &ObjectName, model: &[u8]) {
    let whole = store.read(object, 0, model.len() as u64).await.unwrap();
    assert!(whole == model, "the whole object read back as written");
    // A range that starts and ends inside pieces.
    let (from, to) = (5000, 900_001);
    let part = store
        .read(object, from as u64, (to - from) as u64)
        .await
        .unwrap();
    assert!(
        part == model[from..to],
        "a range inside the object read back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fragmented_data_read_from_the_disk_comes_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let object = ObjectName::new("fragmented").unwrap();
    let mut model = vec![0u8; BLOCKS * BLOCK];
    {
        let store = LocalStore::open_with(dir.path(), &LocalStoreOptions { create: true }).unwrap();
        // Blocks written in a scrambled order, each its own extent, so that neighbours in the
        // object lie apart in the segments; then 1 KiB pieces over some of them.
        for i in 0..BLOCKS {
            let k = (i * 97) % BLOCKS;
            let data = piece(k, BLOCK, 1);
            model[k * BLOCK..(k + 1) * BLOCK].copy_from_slice(&data);
            let op = WriteOp::new().step(WriteStep::Write {
                offset: (k * BLOCK) as u64,
                data,
            });
            store.write_op(&object, op).await.unwrap();
        }
        for k in (3..BLOCKS).step_by(7) {
            let at = k * BLOCK + 1536;
            let data = piece(k, 1024, 2);
            model[at..at + 1024].copy_from_slice(&data);
            let op = WriteOp::new().step(WriteStep::Write {
                offset: at as u64,
                data,
            });
            store.write_op(&object, op).await.unwrap();
        }
        store.flush().await.unwrap();
        check(&store, &object, &model).await;
    }

    let dropped = drop_cached_pages(dir.path());
    if !dropped {
        eprintln!("note: this file system keeps the pages; the reads below come from memory");
    }
    {
        let store = LocalStore::open(dir.path()).unwrap();
        check(&store, &object, &model).await;
    }
    drop_cached_pages(dir.path());
    let store = LocalStore::open_read_only(dir.path()).unwrap();
    check(&store, &object, &model).await;
}

/// Many reads of one to four pieces at once, their pages dropped: the worker takes them in bursts,
/// makes each without waiting for the disk, asks the disk for those it missed, and reads those
/// again (`Engine::handle_reads`). Every read returns its own bytes, through a writer's open
/// (even rounds) and a read-only one (odd rounds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_from_the_disk_each_return_their_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let objects: Vec<ObjectName> = (0..4)
        .map(|o| ObjectName::new(format!("obj{o}")).unwrap())
        .collect();
    {
        let store = LocalStore::open_with(dir.path(), &LocalStoreOptions { create: true }).unwrap();
        for i in 0..BLOCKS {
            let k = (i * 97) % BLOCKS;
            for (o, object) in objects.iter().enumerate() {
                let op = WriteOp::new().step(WriteStep::Write {
                    offset: (k * BLOCK) as u64,
                    data: piece(k, BLOCK, o as u8),
                });
                store.write_op(object, op).await.unwrap();
            }
        }
        store.flush().await.unwrap();
    }
    for round in 0..4 {
        drop_cached_pages(dir.path());
        let store = match round % 2 {
            0 => LocalStore::open(dir.path()).unwrap(),
            _ => LocalStore::open_read_only(dir.path()).unwrap(),
        };
        let reads = (0..128).map(|i| {
            let (store, objects) = (&store, &objects);
            async move {
                let o = (i + round) % objects.len();
                // One to four blocks: as many pieces, each elsewhere in the segments.
                let n = 1 + i % 4;
                let k = (i * 37 + round * 11) % (BLOCKS - n);
                let bytes = store
                    .read(&objects[o], (k * BLOCK) as u64, (n * BLOCK) as u64)
                    .await
                    .unwrap();
                (o, k, n, bytes)
            }
        });
        for (o, k, n, bytes) in futures_util::future::join_all(reads).await {
            let written: Vec<u8> = (k..k + n).flat_map(|b| piece(b, BLOCK, o as u8)).collect();
            assert!(
                bytes == written,
                "round {round}: blocks {k}..{} of object {o} read back as written",
                k + n
            );
        }
    }
}
