use std::path::PathBuf;
use std::time::Duration;

/// Where and how to connect: the pieces of `rados://POOL/...?conf=PATH&id=CLIENT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RadosConfig {
    /// Ceph config file (`None`: librados' search: `$CEPH_CONF`, then /etc/ceph/ceph.conf).
    pub conf: Option<PathBuf>,
    /// The client id, without `client.` (Ceph's default: `admin`).
    pub client_id: String,
    /// Keyring file (`None`: as the config says).
    pub keyring: Option<PathBuf>,
    pub pool: String,
    /// RADOS namespace inside the pool (`""`: the default namespace).
    pub namespace: String,
    /// Give up connecting after this long (librados `client_mount_timeout` and
    /// `rados_mon_op_timeout`).
    pub connect_timeout: Duration,
    /// Fail an operation the OSDs have not answered after this long (librados
    /// `rados_osd_op_timeout`), unless the config file sets that option itself: then its
    /// value holds. `None` (the default): as the config file says; librados' own default is
    /// to wait for the OSDs to come back, resending the operation (nothing is lost, the
    /// caller just waits).
    pub op_timeout: Option<Duration>,
    /// The size objects are expected to grow to (an image's object size): passed to
    /// BlueStore as an allocation hint with every data write, as librbd does. `None`: no hint.
    pub expected_object_size: Option<u64>,
    /// Widen librados' budget of bytes in flight (`objecter_inflight_op_bytes`, as configured:
    /// 100 MiB by default) by this many thousandths of itself. The budget counts every byte an
    /// operation carries; an ivdisk write carries its sectors' metadata next to the data, so
    /// at the default budget 4 MiB writes would keep 24 operations in flight where librbd's
    /// keep 25 (docs/BENCHMARKS.md, "the client's budget of bytes in flight"). `0` (the
    /// default): the budget as configured.
    pub inflight_bytes_headroom_permille: u32,
}

impl RadosConfig {
    pub fn new(pool: impl Into<String>) -> Self {
        RadosConfig {
            conf: None,
            client_id: "admin".into(),
            keyring: None,
            pool: pool.into(),
            namespace: String::new(),
            connect_timeout: Duration::from_secs(30),
            op_timeout: None,
            expected_object_size: None,
            inflight_bytes_headroom_permille: 0,
        }
    }
}
