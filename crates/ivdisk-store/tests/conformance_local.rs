//! The conformance suite against the local embedded backend (a fresh store directory per case).

use ivdisk_store::conformance::Clients;
use ivdisk_store::{LocalStore, LocalStoreOptions};

async fn local() -> Clients<LocalStore> {
    let dir = tempfile::tempdir().unwrap();
    let a = LocalStore::open_with(
        dir.path().join("store"),
        &LocalStoreOptions { create: true },
    )
    .unwrap();
    let b = a.another_client();
    Clients::new(a, b, dir)
}

ivdisk_store::conformance_tests!(local);
