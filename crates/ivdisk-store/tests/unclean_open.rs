//! An open after an unclean stop makes the state it found durable (the segments, then the
//! metadata log) before its reclaim punches what that state no longer references. A process
//! killed between a group commit and the durable commit after it leaves commits in the page
//! cache only; the reclaim punched the space they had freed, and a power cut before the new
//! run's first durable commit brought back the synced state, whose extents still referenced
//! that space: flushed data read as holes. A test binary of its own: the fault-injecting file
//! layer records one store per process.

use std::path::Path;

use ivdisk_store::fault_io;
use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[test]
fn an_unclean_open_syncs_what_it_found_before_reclaiming() {
    ivdisk_store::ffi_vfs::register_default().expect("registering the fault-injecting VFS");
    let tmp = tempfile::tempdir().unwrap();
    // The paths SQLite uses are canonical: so must the recorded directory's be.
    let root = tmp.path().canonicalize().unwrap();
    let (live, disk) = (root.join("live"), root.join("disk"));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let object = ObjectName::new("unclean/o").unwrap();
    {
        let store = LocalStore::open_with(&live, &LocalStoreOptions { create: true }).unwrap();
        runtime.block_on(async {
            store.write(&object, 0, &[7u8; 65536]).await.unwrap();
            store.remove(&object).await.ok();
            store.write(&object, 0, &[9u8; 8192]).await.unwrap();
            store.flush().await.unwrap();
        });
    }
    // Without its marker, the clean stop counts as a crash: the open reclaims.
    std::fs::remove_file(live.join("CLEAN")).expect("a clean stop leaves CLEAN");
    copy_dir(&live, &disk);
    fault_io::start(&live, &disk);
    let store = LocalStore::open(&live).unwrap();
    let cut = fault_io::cut().expect("the cut right after the open");
    drop(store);
    for file in ["data/seg-00000001", "meta.sqlite"] {
        assert!(
            cut.syncs.get(Path::new(file)).is_some_and(|&n| n > 0),
            "the unclean open did not sync {file} before returning: {:?}",
            cut.syncs
        );
    }
    let reopened = LocalStore::open(&live).unwrap();
    runtime.block_on(async {
        assert_eq!(
            reopened.read(&object, 0, 8192).await.unwrap(),
            vec![9u8; 8192]
        );
    });
}
