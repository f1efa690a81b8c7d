//! A local store that its own data fills up: what it takes in before the disk is full must
//! survive the commit after it. The store keeps room for its commits (local.rs,
//! `CommitRoom`) and commits sooner when the file system is short of space
//! (`Engine::commit_bytes` in engine.rs).
//!
//! Its own test binary: the stores of this process commit only when they must (no timer
//! within the test's time, `IVDISK_STORE_COMMIT_INTERVAL_MS`), as a release build under a
//! fast client does within its 2 s (the tests' build commits every 500 ms).

use ivdisk_store::small_fs::SmallFileSystem;
use std::time::Duration;

use ivdisk_store::{
    LocalStore, LocalStoreOptions, LockRequest, ObjectName, ObjectStore, ObjectStoreExt,
    StoreError, WriteOp,
};

const CREATE: LocalStoreOptions = LocalStoreOptions { create: true };

/// Commits only when the store must (every test here calls it before it opens a store).
fn long_transactions() {
    std::env::set_var("IVDISK_STORE_COMMIT_INTERVAL_MS", "600000");
}

fn full_name(n: usize) -> ObjectName {
    ObjectName::new(format!("full/o{n:03}")).unwrap()
}

/// `len` bytes that depend on `seed` and the position.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            (i.wrapping_mul(0x9E37_79B9)
                .wrapping_add(seed.wrapping_mul(31))
                >> 7) as u8
        })
        .collect()
}

/// Where write `n` of `len` bytes goes: 64 writes per object side by side.
fn place(n: usize, len: usize) -> (ObjectName, u64) {
    (full_name(n / 64), ((n % 64) * len) as u64)
}

/// Write `n`'s omap key.
fn key(n: usize) -> Vec<u8> {
    format!("n{n:06}").into_bytes()
}

/// Write `n`'s omap value: its number, then `pad` bytes (0 for an image's write).
fn value(n: usize, pad: usize) -> Vec<u8> {
    let mut value = (n as u64).to_be_bytes().to_vec();
    value.extend(pattern(!(n as u64), pad));
    value
}

/// Write `n`: its data and its omap key, as an image writes.
fn op(n: usize, len: usize, pad: usize) -> WriteOp {
    WriteOp::new()
        .write(place(n, len).1, pattern(n as u64, len))
        .omap_set(vec![(key(n), value(n, pad))])
}

/// The omaps of the objects read so far, each read whole once.
type OmapsRead = std::collections::HashMap<ObjectName, std::collections::HashMap<Vec<u8>, Vec<u8>>>;

/// Assert that write `n` of `len` bytes reads back as `pattern(seed)`
/// and that its omap key holds `omap_value`.
async fn assert_write_present(
    store: &LocalStore,
    omaps: &mut OmapsRead,
    (n, len): (usize, usize),
    seed: u64,
    omap_value: Vec<u8>,
    what: &str,
) {
    let (o, at) = place(n, len);
    assert!(
        store.read(&o, at, len as u64).await.unwrap() == pattern(seed, len),
        "{what}: its data reads back wrong"
    );
    if !omaps.contains_key(&o) {
        let all = store.omap_all(&o).await.unwrap().into_iter().collect();
        omaps.insert(o.clone(), all);
    }
    assert_eq!(
        omaps[&o].get(&key(n)),
        Some(&omap_value),
        "{what}: its omap key"
    );
}

/// Fill the store's file system with its own data, as a client copying into an image until
/// ENOSPC does (eight writes in flight, no flush; writes of each of `sizes` in turn, until
/// one does not fit, which must fail with `NoSpace`), each with an omap value of `pad`
/// bytes more than an image's. Returns every acknowledged write (number, length).
async fn fill_with_own_writes(
    store: &LocalStore,
    sizes: &[usize],
    pad: usize,
) -> Vec<(usize, usize)> {
    // One durable write first, so the store has committed (and taken its room) before.
    store
        .write_op(&place(0, 4096).0, op(0, 4096, pad))
        .await
        .unwrap();
    store.flush().await.unwrap();
    // (write number, length) of every acknowledged write.
    let mut acknowledged = vec![(0, 4096)];
    let mut next = 64;
    for &len in sizes {
        let mut refused = None;
        while refused.is_none() {
            let ns: Vec<usize> = (next..next + 8).collect();
            next += 8;
            let names: Vec<ObjectName> = ns.iter().map(|&n| place(n, len).0).collect();
            let results = futures_util::future::join_all(
                ns.iter()
                    .zip(&names)
                    .map(|(&n, name)| store.write_op(name, op(n, len, pad))),
            )
            .await;
            for (&n, result) in ns.iter().zip(results) {
                match result {
                    Ok(_) => acknowledged.push((n, len)),
                    Err(e @ StoreError::NoSpace { .. }) => refused = Some(e),
                    Err(e) => panic!("write {n}: {e:?}"),
                }
            }
            assert!(next < 1_000_000, "the disk never filled up");
        }
        println!(
            "{} writes acknowledged, then one of {len} bytes: {}",
            acknowledged.len(),
            refused.unwrap()
        );
        // The next size starts in objects of its own.
        next = next.next_multiple_of(64);
    }
    assert!(acknowledged.len() >= 16, "only {} fit", acknowledged.len());
    acknowledged
}

/// The store's own data filling the disk (`fill_with_own_writes`). The write that does not
/// fit fails itself, and every write acknowledged before it survives the flush and a reopen.
/// Before the store kept room for its commits, the appends took the last blocks and the
/// commit after them lost every write since the last flush; with the room, a transaction of
/// 20k small writes still needed more than it had, until commits came sooner on a file
/// system short of space.
async fn own_data_filling_the_disk_loses_no_acknowledged_write(
    fs: &SmallFileSystem,
    sizes: &[usize],
    pad: usize,
) {
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let acknowledged = fill_with_own_writes(&store, sizes, pad).await;
    store
        .flush()
        .await
        .unwrap_or_else(|e| panic!("the flush after the disk filled up: {e}"));
    let check = |store: LocalStore, when: &'static str| {
        let acknowledged = acknowledged.clone();
        async move {
            let mut omaps = OmapsRead::new();
            for &(n, len) in &acknowledged {
                let what = format!("acknowledged write {n} {when}");
                assert_write_present(&store, &mut omaps, (n, len), n as u64, value(n, pad), &what)
                    .await;
            }
            store
        }
    };
    let store = check(store, "after the flush").await;
    drop(store);
    // Reopened for writing, twice, on the file system the data filled: the open's first
    // commit (an image's writer lock) still has room. It had none when the clean close
    // wrote the held metadata back, or SQLite's checkpoint at the close took every free
    // block and failed.
    for reopen in 1..=2 {
        let store = LocalStore::open(&path).unwrap();
        let store = check(store, "after a reopen").await;
        let lock_key = format!("reopen {reopen}").into_bytes();
        store
            .write_op(
                &full_name(0),
                WriteOp::new().omap_set(vec![(lock_key.clone(), b"held".to_vec())]),
            )
            .await
            .unwrap_or_else(|e| panic!("the first write of reopen {reopen}: {e}"));
        store
            .flush()
            .await
            .unwrap_or_else(|e| panic!("the first flush of reopen {reopen}: {e}"));
        let all = store.omap_all(&full_name(0)).await.unwrap();
        assert!(
            all.contains(&(lock_key, b"held".to_vec())),
            "reopen {reopen}'s key"
        );
        drop(store);
    }
}

/// Large writes. On ext4, which showed it (on tmpfs the commit found room in the last blocks
/// anyway); ext4 also keeps 2% of itself from root while counting it as free: the store must
/// not take that for room.
#[tokio::test]
async fn own_data_filling_an_ext4_loses_nothing() {
    long_transactions();
    let dir = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount_ext4(&dir.path().join("mnt"), &dir.path().join("fs.img"), 128);
    own_data_filling_the_disk_loses_no_acknowledged_write(&fs, &[256 << 10, 64 << 10], 0).await;
}

/// Small writes (4 KiB, an image's random writes), whose metadata is large for their data:
/// 13k of them fill this file system, and one transaction of them needed more than the room
/// the store keeps for its commits (1 MiB here).
#[tokio::test]
async fn small_writes_filling_an_ext4_lose_nothing() {
    long_transactions();
    let dir = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount_ext4(&dir.path().join("mnt"), &dir.path().join("fs.img"), 64);
    own_data_filling_the_disk_loses_no_acknowledged_write(&fs, &[4096], 0).await;
}

/// Small writes whose omap values are large (16 KiB each): a transaction commits early by
/// the bytes its pending rows hold, not by a guess per operation. With 512 bytes counted per
/// operation, such a transaction needed twice the room it had, and its commit lost it.
#[tokio::test]
async fn small_writes_with_large_omap_values_filling_an_ext4_lose_nothing() {
    long_transactions();
    let dir = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount_ext4(&dir.path().join("mnt"), &dir.path().join("fs.img"), 64);
    own_data_filling_the_disk_loses_no_acknowledged_write(&fs, &[4096], 16 << 10).await;
}

/// An image's writer lock renewed while its data keeps the disk full. There SQLite's log
/// cannot be checkpointed (the database file would have to grow by what the log holds), so
/// every page a commit writes stays in the log, and each renewal (every 10 s) added three:
/// 4.4 MB an hour, until the room kept for the commits was gone. Renewals there now store a
/// longer expiry once and nothing while it lasts, and a commit that moved nothing writes no
/// page of its own.
#[tokio::test]
async fn lock_renewals_on_a_full_disk_do_not_grow_the_log() {
    long_transactions();
    let dir = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount_ext4(&dir.path().join("mnt"), &dir.path().join("fs.img"), 64);
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let header = ObjectName::new("header").unwrap();
    let duration = Duration::from_secs(30);
    let request = |renew| LockRequest {
        name: "writer".into(),
        cookie: "cookie".into(),
        description: "a test".into(),
        duration: Some(duration),
        renew,
    };
    store.lock_exclusive(&header, request(false)).await.unwrap();
    fill_with_own_writes(&store, &[4096], 0).await;
    store.flush().await.unwrap();
    let wal = path.join("meta.sqlite-wal");
    let wal_len = || std::fs::metadata(&wal).unwrap().len();
    let before = wal_len();
    let free = rustix::fs::statvfs(fs.path()).unwrap();
    let free = free.f_bavail * free.f_frsize;
    // The state this test is about: the log holds more than the file system has free, so
    // it cannot be checkpointed.
    assert!(
        before > free,
        "the log ({before} bytes) fits in the free space ({free} bytes): the disk is not full"
    );
    for renewal in 0..30 {
        store
            .lock_exclusive(&header, request(true))
            .await
            .unwrap_or_else(|e| panic!("renewal {renewal}: {e}"));
        store.flush().await.unwrap();
    }
    let grown = wal_len() - before;
    // At most one renewal stored: a log frame is a 4 KiB page and its 24-byte header.
    assert!(
        grown <= 2 * (4096 + 24),
        "30 renewals and flushes grew the log by {grown} bytes"
    );
    let lockers = store.list_lockers(&header, "writer").await.unwrap();
    assert_eq!(lockers.len(), 1, "the lock is still held: {lockers:?}");
    assert!(
        lockers[0].expires_in.unwrap() >= duration,
        "the lock expires within its duration: {lockers:?}"
    );
}

/// Objects removed on a disk that random small writes filled, as a trim of an image frees
/// its space. A removal once wrote back every omap and extent change the store held in
/// memory first (so that a replay could not bring back a value it removed). After random
/// overwrites those changes are spread over the whole of both tables, and their write-back
/// needed more than the room kept for a commit: the commit failed, and with it every write
/// acknowledged since the last flush, and the image layer then refused all IO until a
/// restart (`ivdisk serve` on a 64 MiB ext4 filled by fio, then `discard`). Then the
/// write-back got a commit of its own, and the removal alone was refused (`NoSpace`) until
/// space was freed elsewhere: a guest's trim, its way to free space, failed on a full disk.
/// Now a removal writes nothing back (its node's held changes are dropped): it goes through,
/// and nothing acknowledged is lost.
#[tokio::test]
async fn removals_on_a_disk_random_writes_filled_lose_no_acknowledged_write() {
    long_transactions();
    let dir = tempfile::tempdir().unwrap();
    let fs = SmallFileSystem::mount_ext4(&dir.path().join("mnt"), &dir.path().join("fs.img"), 64);
    // Space another program holds, freed later.
    let filler = fs.path().join("filler");
    std::fs::write(&filler, vec![0x5au8; 8 << 20]).unwrap();
    let path = fs.path().join("store");
    const LEN: usize = 4096;
    const PAD: usize = 200;
    // More blocks than the file system holds.
    const BLOCKS: usize = 16384;
    // Each block's last acknowledged write's version (None: never written). A quarter of
    // the blocks are written first, then the store is closed, which writes back what it
    // held: the tables' rows then lie all over their pages.
    let mut latest: Vec<Option<u64>> = vec![None; BLOCKS];
    let write = |n: usize, version: u64| {
        let seed = (version << 32) | n as u64;
        WriteOp::new()
            .write(place(n, LEN).1, pattern(seed, LEN))
            .omap_set(vec![(key(n), value(seed as usize, PAD))])
    };
    {
        let store = LocalStore::open_with(&path, &CREATE).unwrap();
        for chunk in (0..BLOCKS).step_by(4).collect::<Vec<_>>().chunks(32) {
            let results = futures_util::future::join_all(
                chunk
                    .iter()
                    .map(|&n| (place(n, LEN).0, write(n, 0)))
                    .map(|(name, op)| {
                        let store = &store;
                        async move { store.write_op(&name, op).await }
                    }),
            )
            .await;
            results.into_iter().for_each(|r| {
                r.unwrap();
            });
            chunk.iter().for_each(|&n| latest[n] = Some(0));
        }
        store.flush().await.unwrap();
    }
    // Random writes, most of them to blocks not written yet, eight in flight, no flush,
    // until one does not fit.
    let store = LocalStore::open(&path).unwrap();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next_block = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % BLOCKS as u64) as usize
    };
    let mut overwrites = 0;
    'fill: for version in 1.. {
        let blocks: Vec<usize> = (0..8).map(|_| next_block()).collect();
        let results = futures_util::future::join_all(
            blocks
                .iter()
                .map(|&n| (place(n, LEN).0, write(n, version)))
                .map(|(name, op)| {
                    let store = &store;
                    async move { store.write_op(&name, op).await }
                }),
        )
        .await;
        let mut full = false;
        for (&n, result) in blocks.iter().zip(results) {
            match result {
                Ok(_) => {
                    latest[n] = Some(version);
                    overwrites += 1;
                }
                Err(StoreError::NoSpace { .. }) => full = true,
                Err(e) => panic!("overwrite of block {n}: {e:?}"),
            }
        }
        if full {
            break 'fill;
        }
        assert!(version < 10_000, "the disk never filled up");
    }
    println!("{overwrites} random writes acknowledged before the disk was full");
    // The last objects go, the others stay.
    let objects: std::collections::BTreeSet<ObjectName> =
        (0..BLOCKS).map(|n| place(n, LEN).0).collect();
    let removed: Vec<ObjectName> = objects.iter().rev().take(4).cloned().collect();
    for object in &removed {
        store
            .remove(object)
            .await
            .unwrap_or_else(|e| panic!("removal of {object} on the full disk: {e:?}"));
    }
    store
        .flush()
        .await
        .unwrap_or_else(|e| panic!("the flush after removals on a full disk: {e}"));
    std::fs::remove_file(&filler).unwrap();
    store.flush().await.unwrap();
    assert_eq!(
        store.lost_transactions(),
        Some(0),
        "transactions lost on the way"
    );
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    let mut omaps = OmapsRead::new();
    for (n, &version) in latest.iter().enumerate() {
        let Some(version) = version.filter(|_| !removed.contains(&place(n, LEN).0)) else {
            continue;
        };
        let seed = (version << 32) | n as u64;
        let what = format!("block {n}'s last acknowledged write (version {version})");
        assert_write_present(
            &store,
            &mut omaps,
            (n, LEN),
            seed,
            value(seed as usize, PAD),
            &what,
        )
        .await;
    }
    for object in &removed {
        assert_eq!(
            store.stat(object).await.unwrap(),
            None,
            "{object} was removed"
        );
    }
}
