//! A damaged or torn metadata log: the local store opens at the last valid commit and says so.

use std::path::Path;

use ivdisk_store::{
    LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt, WriteOp,
};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.join("data")).unwrap();
    for name in ["meta.sqlite", "meta.sqlite-wal"] {
        std::fs::copy(from.join(name), to.join(name)).unwrap();
    }
    for entry in std::fs::read_dir(from.join("data")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join("data").join(entry.file_name())).unwrap();
    }
}

/// Two flushed operations, then a copy of the store's files taken while it is open (as after
/// a crash: the log has not been checkpointed).
async fn crashed_copy(dir: &Path) -> (std::path::PathBuf, ObjectName, ObjectName) {
    let live = dir.join("live");
    let store = LocalStore::open_with(&live, &LocalStoreOptions { create: true }).unwrap();
    let first = ObjectName::new("r/first").unwrap();
    let second = ObjectName::new("r/second").unwrap();
    store
        .write_op(
            &first,
            WriteOp::new()
                .write(0, vec![1u8; 8192])
                .omap_set(vec![(b"k".to_vec(), b"1".to_vec())]),
        )
        .await
        .unwrap();
    store.flush().await.unwrap();
    store
        .write_op(
            &second,
            WriteOp::new()
                .write(0, vec![2u8; 8192])
                .omap_set(vec![(b"k".to_vec(), b"2".to_vec())]),
        )
        .await
        .unwrap();
    store.flush().await.unwrap();
    let copy = dir.join("copy");
    copy_dir(&live, &copy);
    drop(store);
    (copy, first, second)
}

#[tokio::test]
async fn a_damaged_log_record_is_detected_and_the_store_opens_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, first, second) = crashed_copy(dir.path()).await;
    let wal = copy.join("meta.sqlite-wal");
    let mut bytes = std::fs::read(&wal).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&wal, &bytes).unwrap();

    let store = LocalStore::open(&copy).unwrap();
    let report = store.recovery_report();
    assert!(report.discarded_log_bytes > 0, "{report:?}");
    assert!(report.replayed_commits >= 1, "{report:?}");
    assert_eq!(store.read(&first, 0, 8192).await.unwrap(), vec![1u8; 8192]);
    assert_eq!(
        store.stat(&second).await.unwrap(),
        None,
        "the damaged commit was replayed"
    );
    // The store is usable after recovery.
    store.write(&second, 0, b"again").await.unwrap();
    store.flush().await.unwrap();
    assert_eq!(store.read(&second, 0, 5).await.unwrap(), b"again");
}

#[tokio::test]
async fn a_torn_log_tail_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, first, second) = crashed_copy(dir.path()).await;
    let wal = copy.join("meta.sqlite-wal");
    let len = std::fs::metadata(&wal).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&wal)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();

    let store = LocalStore::open(&copy).unwrap();
    assert!(store.recovery_report().discarded_log_bytes > 0);
    assert_eq!(store.read(&first, 0, 1).await.unwrap(), vec![1]);
    assert_eq!(store.stat(&second).await.unwrap(), None);
}

#[tokio::test]
async fn a_clean_log_reports_nothing_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (copy, first, second) = crashed_copy(dir.path()).await;
    let store = LocalStore::open(&copy).unwrap();
    let report = store.recovery_report();
    assert_eq!(report.discarded_log_bytes, 0, "{report:?}");
    assert_eq!(store.read(&first, 0, 1).await.unwrap(), vec![1]);
    assert_eq!(store.read(&second, 0, 1).await.unwrap(), vec![2]);
}
