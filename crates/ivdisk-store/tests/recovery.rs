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

/// Opening cuts the active segment after the last commit's appends. Each commit stores where
/// they end, with the version it committed; a store last written by a build that did not
/// (its commits moved the version on, not the stored position) is measured from its extents
/// instead. Either way, bytes appended after the last commit are dropped and committed data
/// is not.
#[tokio::test]
async fn appends_after_the_last_commit_are_dropped_also_after_an_older_build() {
    for older_build in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store");
        let name = ObjectName::new("r/a").unwrap();
        {
            let store = LocalStore::open_with(&path, &LocalStoreOptions { create: true }).unwrap();
            store
                .write_op(&name, WriteOp::new().write(0, vec![7u8; 65536]))
                .await
                .unwrap();
            store.flush().await.unwrap();
        }
        if older_build {
            let db = rusqlite::Connection::open(path.join("meta.sqlite")).unwrap();
            db.execute_batch(
                "UPDATE meta SET value = 0 WHERE key = 'append_offset';
                 UPDATE meta SET value = value + 1 WHERE key = 'version';",
            )
            .unwrap();
        }
        let mut segments: Vec<_> = std::fs::read_dir(path.join("data"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        segments.sort();
        let active = segments.last().unwrap().clone();
        let committed = std::fs::metadata(&active).unwrap().len();
        assert!(committed >= 65536, "{committed}");
        {
            use std::io::Write;
            let mut file = std::fs::OpenOptions::new()
                .append(true)
                .open(&active)
                .unwrap();
            file.write_all(&[0xee; 4096]).unwrap();
        }
        let store = LocalStore::open(&path).unwrap();
        assert_eq!(
            store.recovery_report().dropped_data_bytes,
            4096,
            "older build: {older_build}"
        );
        assert_eq!(std::fs::metadata(&active).unwrap().len(), committed);
        assert_eq!(
            store.read(&name, 0, 65536).await.unwrap(),
            vec![7u8; 65536],
            "older build: {older_build}"
        );
    }
}
