//! What the RADOS tests share: finding the test cluster, opening stores on it.
//!
//! The cluster comes from the environment, as scripts/test-all.sh sets it up:
//! `CEPH_CONF` (a cluster from `scripts/ceph-dev-cluster start`), optionally
//! `IVDISK_RADOS_POOL` (default `rbd`). `IVDISK_NO_CEPH=1` skips the RADOS tests, loudly;
//! without it a missing cluster fails the tests, so a CI run cannot pass without them.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use ivdisk_rados::{RadosConfig, RadosStore};

/// Why the RADOS tests do not run here, if they don't.
pub fn skip_reason() -> Option<String> {
    (std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1"))
        .then(|| "IVDISK_NO_CEPH=1: no Ceph cluster, the RADOS tests are skipped".into())
}

/// One namespace per test process, so that reruns on a long-lived pool never meet old
/// objects, and the namespace support is exercised.
pub fn namespace() -> &'static str {
    static NS: OnceLock<String> = OnceLock::new();
    NS.get_or_init(|| {
        let mut bytes = [0u8; 4];
        getrandom::getrandom(&mut bytes).expect("random bytes");
        format!("ivdisk-test-{}", hex::encode(bytes))
    })
}

pub fn config() -> RadosConfig {
    let conf = std::env::var_os("CEPH_CONF").unwrap_or_else(|| {
        panic!(
            "the RADOS tests need a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster start)\"` \
             (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip them"
        )
    });
    RadosConfig {
        conf: Some(PathBuf::from(conf)),
        namespace: namespace().into(),
        connect_timeout: Duration::from_secs(20),
        ..RadosConfig::new(std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into()))
    }
}

pub async fn open() -> RadosStore {
    RadosStore::open(&config())
        .await
        .unwrap_or_else(|e| panic!("opening the test pool: {e}"))
}
