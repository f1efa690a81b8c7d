//! The conformance suite against the memory backend.

use ivdisk_store::conformance::Clients;
use ivdisk_store::MemoryStore;

async fn memory() -> Clients<MemoryStore> {
    let a = MemoryStore::new().unwrap();
    let b = a.another_client();
    Clients::new(a, b, ())
}

ivdisk_store::conformance_tests!(memory);
