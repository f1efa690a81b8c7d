//! The object store conformance suite against a real Ceph cluster (see tests/common), on the
//! RADOS store wrapped in `CoalescingStore`, as images use it. A test file of its own: the
//! suite names its objects per process and case, so two runs of it in one process would
//! collide.

mod common;

use ivdisk_rados::RadosStore;
use ivdisk_store::conformance::Clients;
use ivdisk_store::CoalescingStore;

async fn store() -> Clients<CoalescingStore<RadosStore>> {
    Clients::new(
        CoalescingStore::new(common::open().await),
        CoalescingStore::new(common::open().await),
        (),
    )
}

mod conformance {
    ivdisk_store::conformance_tests!(super::store, skip_if: super::common::skip_reason);
}
