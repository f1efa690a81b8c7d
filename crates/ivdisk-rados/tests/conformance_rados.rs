//! The object store conformance suite against a real Ceph cluster (see tests/common).

mod common;

use ivdisk_rados::RadosStore;
use ivdisk_store::conformance::Clients;

async fn store() -> Clients<RadosStore> {
    Clients::new(common::open().await, common::open().await, ())
}

mod conformance {
    ivdisk_store::conformance_tests!(super::store, skip_if: super::common::skip_reason);
}
