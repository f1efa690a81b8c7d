//! Dead data gives its space back: overwritten, removed and snapshot-freed extents are punched
//! out of the local store's segments, even when appends do not start on block boundaries.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt};

/// Bytes the data segments occupy on disk.
fn allocated(store_dir: &Path) -> u64 {
    std::fs::read_dir(store_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
        .sum()
}

#[tokio::test]
async fn overwrites_and_removals_free_space_with_misaligned_appends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
    // One odd-sized write first: every later append starts off a block boundary.
    store
        .write(&ObjectName::new("odd").unwrap(), 0, b"x")
        .await
        .unwrap();
    let objects: Vec<ObjectName> = (0..64)
        .map(|i| ObjectName::new(format!("o{i}")).unwrap())
        .collect();
    for pass in 0..20u8 {
        for o in &objects {
            store.write(o, 0, &[pass; 4096]).await.unwrap();
        }
        store.flush().await.unwrap();
    }
    let live = 64 * 4096;
    let used = allocated(&path);
    assert!(
        used <= live + 64 * 4096 + (64 << 10),
        "{used} bytes allocated for {live} live bytes"
    );
    for o in &objects {
        store.remove(o).await.unwrap();
    }
    store.flush().await.unwrap();
    let after = allocated(&path);
    assert!(
        after <= 16 << 10,
        "{after} bytes still allocated after removing everything"
    );
    assert_eq!(
        store
            .read(&ObjectName::new("odd").unwrap(), 0, 1)
            .await
            .unwrap(),
        b"x",
        "a live neighbour of punched blocks was damaged"
    );
}
