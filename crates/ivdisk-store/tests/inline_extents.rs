//! Small writes live in their extent's row (inline extents), and stores made before that
//! existed keep working: read-only as they are, and upgraded by the next read-write open.

use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt};

fn name(s: &str) -> ObjectName {
    ObjectName::new(s).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Bytes written to the data segments (allocated or not: holes count as their size).
fn segment_bytes(store: &std::path::Path) -> u64 {
    std::fs::read_dir(store.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

#[tokio::test]
async fn small_writes_stay_out_of_the_segments_and_cut_like_any_extent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    let o = name("o");
    let before = segment_bytes(&path);
    // Small writes around and over each other: stored inline, then cut by later writes.
    store.write(&o, 100, &pattern(1, 1000)).await.unwrap();
    store.write(&o, 600, &pattern(2, 10)).await.unwrap();
    store.write(&o, 1024, &pattern(3, 1)).await.unwrap();
    assert_eq!(
        segment_bytes(&path),
        before,
        "writes of at most 1 KiB went to a segment"
    );
    let mut model = vec![0u8; 1100];
    model[100..1100].copy_from_slice(&pattern(1, 1000));
    model[600..610].copy_from_slice(&pattern(2, 10));
    model[1024] = pattern(3, 1)[0];
    assert_eq!(store.read(&o, 0, 1100).await.unwrap(), model);
    assert_eq!(store.read(&o, 599, 12).await.unwrap(), model[599..611]);

    // A large write over part of them keeps the inline pieces outside it.
    store.write(&o, 700, &pattern(4, 4096)).await.unwrap();
    model.resize(4796, 0);
    model[700..4796].copy_from_slice(&pattern(4, 4096));
    assert_eq!(store.read(&o, 0, 4796).await.unwrap(), model);
    // After a flush: small appends are gathered in memory until then.
    store.flush().await.unwrap();
    assert!(segment_bytes(&path) > before, "a 4 KiB write stayed inline");
    drop(store);

    let store = LocalStore::open(&path).unwrap();
    assert_eq!(store.read(&o, 0, 4796).await.unwrap(), model);
    drop(store);
    let store = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(store.read(&o, 0, 4796).await.unwrap(), model);
}

#[tokio::test]
async fn a_store_from_before_inline_extents_reads_and_upgrades() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let big = pattern(5, 8192);
    {
        let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
        store.write(&name("old"), 0, &big).await.unwrap();
        store.flush().await.unwrap();
    }
    // Make it look like a store of the previous format: no `inline` column.
    {
        let db = rusqlite::Connection::open(path.join("meta.sqlite")).unwrap();
        db.execute_batch("ALTER TABLE extents DROP COLUMN inline")
            .unwrap();
    }
    {
        let store = LocalStore::open_read_only(&path).unwrap();
        assert_eq!(store.read(&name("old"), 0, 8192).await.unwrap(), big);
    }
    {
        let store = LocalStore::open(&path).unwrap();
        assert_eq!(store.read(&name("old"), 0, 8192).await.unwrap(), big);
        store.write(&name("new"), 0, b"small").await.unwrap();
        store.flush().await.unwrap();
    }
    let store = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(store.read(&name("old"), 0, 8192).await.unwrap(), big);
    assert_eq!(store.read(&name("new"), 0, 5).await.unwrap(), b"small");
}

/// The extent rows of the store at `path` (closed), as (lo, hi, inline length or -1).
fn extent_rows(path: &std::path::Path) -> Vec<(i64, i64, i64)> {
    let db = rusqlite::Connection::open(path.join("meta.sqlite")).unwrap();
    let mut stmt = db
        .prepare("SELECT lo, hi, COALESCE(length(inline), -1) FROM extents ORDER BY lo")
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap();
    rows.map(Result::unwrap).collect()
}

#[tokio::test]
async fn small_writes_inside_a_whole_piece_patch_it_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    let unit = store.write_unit() as usize;
    assert_eq!(unit, 512, "the local backend's pieces");
    let o = name("o");
    // Two whole pieces, then a few bytes inside each, at the start, the middle and the end,
    // and one write across both (that one splits them, as any overlap does).
    let mut model = pattern(1, 2 * unit);
    store.write(&o, 0, &model[..unit]).await.unwrap();
    store.write(&o, unit as u64, &model[unit..]).await.unwrap();
    for (at, len, seed) in [(0, 32, 2), (200, 32, 3), (unit - 32, 32, 4), (unit, 1, 5)] {
        let bytes = pattern(seed, len);
        store.write(&o, at as u64, &bytes).await.unwrap();
        model[at..at + len].copy_from_slice(&bytes);
        assert_eq!(store.read(&o, 0, 2 * unit as u64).await.unwrap(), model);
    }
    store.flush().await.unwrap();
    drop(store);
    let (u, two) = (unit as i64, 2 * unit as i64);
    assert_eq!(
        extent_rows(&path),
        vec![(0, u, u), (u, two, u)],
        "a write inside a piece split it"
    );

    let store = LocalStore::open(&path).unwrap();
    let across = pattern(6, 64);
    store.write(&o, unit as u64 - 32, &across).await.unwrap();
    model[unit - 32..unit + 32].copy_from_slice(&across);
    // Rewriting a piece whole after it was split makes it one row again.
    let whole = pattern(7, unit);
    store.write(&o, 0, &whole).await.unwrap();
    model[..unit].copy_from_slice(&whole);
    assert_eq!(store.read(&o, 0, 2 * unit as u64).await.unwrap(), model);
    store.flush().await.unwrap();
    drop(store);
    assert_eq!(
        extent_rows(&path),
        vec![(0, u, u), (u, u + 32, 32), (u + 32, two, u - 32)]
    );
    let store = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(store.read(&o, 0, 2 * unit as u64).await.unwrap(), model);
}
