//! The reclaim after an unclean stop (the search for segment data no committed operation
//! references, whose punch was pending when the process stopped) runs in the background while
//! the store serves. It must punch only what was dead at the open: data the store frees and
//! writes again meanwhile is not touched.
//!
//! One test per process: the reclaim's test delays (`fault_io::delay_reclaim_searches`) apply
//! to every store of the process.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, Instant};

use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt};

const OBJECTS: usize = 32;
const LEN: usize = 64 << 10;

/// Bytes the data segments span (what appends have grown them to), and occupy on disk.
fn segments(store_dir: &Path) -> (u64, u64) {
    std::fs::read_dir(store_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap())
        .fold((0, 0), |(len, used), m| {
            (len + m.len(), used + m.blocks() * 512)
        })
}

/// The content of object `i` after `round`: never zero, so a punched block shows.
fn fill(i: usize, round: usize) -> u8 {
    1 + ((i * 7 + round * 13) % 255) as u8
}

async fn write_round(store: &LocalStore, names: &[ObjectName], round: usize) {
    for (i, name) in names.iter().enumerate() {
        store
            .write(name, 0, &vec![fill(i, round); LEN])
            .await
            .unwrap();
    }
    store.flush().await.unwrap();
}

/// Writes that reuse space freed after the open, while the search is due and before its
/// punches go out, read back intact; what was dead at the open is punched.
///
/// Timeline (the search's delays set by the test hook): at the open the search takes its
/// snapshot; round 2 overwrites every object and flushes, which frees the blocks of round 1
/// (held for reuse); at 0.6 s the search reads the extents; at 1 s round 3 overwrites every
/// object into those held blocks; at 2.1 s the search queues its punches. A search that read a
/// later state than the open's (taking its snapshot when it starts reading) would find round
/// 1's blocks unreferenced and punch round 3's data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reclaim_punches_only_what_was_dead_at_the_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let names: Vec<ObjectName> = (0..OBJECTS)
        .map(|i| ObjectName::new(format!("o{i}")).unwrap())
        .collect();
    {
        let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
        write_round(&store, &names, 0).await;
        write_round(&store, &names, 1).await;
    }
    // The clean stop punched round 0's data: the first 2 MiB of the segment are holes. The
    // first MiB written again at file level is dead data no extent references, as a crash
    // leaves it when its punch was pending; the second stays a hole.
    let segment = path.join("data").join("seg-00000001");
    let (length, used) = segments(&path);
    assert_eq!(length, 2 * (OBJECTS * LEN) as u64, "two rounds appended");
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new()
            .write(true)
            .open(&segment)
            .unwrap(),
        &vec![0xa5; OBJECTS * LEN / 2],
        0,
    )
    .unwrap();
    assert_eq!(
        segments(&path).1,
        used + (OBJECTS * LEN / 2) as u64,
        "round 0's range was not all holes"
    );
    // Without its `CLEAN` marker the next open takes the last stop for a crash.
    std::fs::remove_file(path.join("CLEAN")).unwrap();
    ivdisk_store::fault_io::delay_reclaim_searches(
        Duration::from_millis(600),
        Duration::from_millis(1500),
    );
    let opened = Instant::now();
    let store = LocalStore::open(&path).unwrap();
    // Round 2 frees round 1's data (held for reuse), round 3 goes there.
    write_round(&store, &names, 2).await;
    let (after_round_2, _) = segments(&path);
    tokio::time::sleep(Duration::from_millis(1000).saturating_sub(opened.elapsed())).await;
    write_round(&store, &names, 3).await;
    assert!(
        opened.elapsed() < Duration::from_millis(2000),
        "round 3 came too late to test anything (the search's punches go out at 2.1 s)"
    );
    assert_eq!(
        segments(&path).0,
        after_round_2,
        "round 3 did not go into the space round 2 freed (the test needs that)"
    );
    store.reclaim_space().await.unwrap();
    let report = store.recovery_report();
    assert_eq!(
        report.reclaimed_bytes,
        (OBJECTS * LEN / 2) as u64,
        "the search counts the dead bytes that hold data, not the holes: {report:?}"
    );
    let live = (OBJECTS * LEN) as u64;
    let (_, used) = segments(&path);
    assert!(
        used <= live + (256 << 10),
        "{used} bytes allocated for {live} live"
    );
    for (i, name) in names.iter().enumerate() {
        let data = store.read(name, 0, LEN as u64).await.unwrap();
        assert!(
            data.iter().all(|&b| b == fill(i, 3)),
            "object {i}: written again during the reclaim, read back damaged (first bad byte \
             at {:?})",
            data.iter().position(|&b| b != fill(i, 2))
        );
    }
    drop(store);
    // A clean stop after the reclaim: the next open finds nothing to reclaim.
    let store = LocalStore::open(&path).unwrap();
    store.reclaim_space().await.unwrap();
    assert_eq!(store.recovery_report(), Default::default());
}
