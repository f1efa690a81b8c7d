use std::io;
use std::time::Duration;

/// Why a RADOS store could not be opened. Operations on an open store fail with
/// [`ivdisk_store::StoreError`] like every backend's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RadosError {
    #[error(
        "ivdisk was built without RADOS support (the `librados` feature of ivdisk-rados is \
         off); rebuild with it (needs librados-dev)"
    )]
    NotBuilt,

    #[error(
        "Ceph config: cannot read {path}: {source} (set the path with conf=PATH, or CEPH_CONF)"
    )]
    ConfigFile {
        path: String,
        #[source]
        source: io::Error,
    },

    #[error("Ceph config: option {option} = {value:?} refused: {source}")]
    ConfigOption {
        option: String,
        value: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "cannot reach the Ceph cluster as client.{client} within {timeout:?} (monitors: \
         {monitors}): check that they run (`ceph -s`) and that the config names them, or \
         allow more time (connect timeout)"
    )]
    Unreachable {
        client: String,
        monitors: String,
        timeout: Duration,
    },

    #[error(
        "the Ceph cluster refused client.{client}: {source}; check the keyring (keyring=PATH \
         or the config's `keyring`) and the client's caps (`ceph auth get client.{client}`)"
    )]
    AuthFailed {
        client: String,
        #[source]
        source: io::Error,
    },

    /// librados read the keyring but found no usable key for the client in it (EIO from
    /// its connect: a malformed `key =` line, or no `[client.NAME]` section).
    #[error(
        "no usable key for client.{client} in its keyring ({keyring}): librados could not \
         read one (Input/output error); the file needs a `[client.{client}]` section with a \
         `key = ...` line, as `ceph auth get client.{client}` prints it"
    )]
    BadKeyring { client: String, keyring: String },

    #[error(
        "client.{client} has no keyring: no file the config's `keyring` setting names exists \
         ({searched}); give one with keyring=PATH in the address, or fix `keyring` in the \
         config"
    )]
    NoKeyring { client: String, searched: String },

    #[error(
        "Ceph pool `{pool}` does not exist; create it (`ceph osd pool create {pool}`) or \
         name another"
    )]
    NoSuchPool { pool: String },

    #[error("invalid RADOS store setting: {0}")]
    Invalid(String),

    #[error("connecting to the Ceph cluster as client.{client} failed: {source}")]
    Connect {
        client: String,
        #[source]
        source: io::Error,
    },
}
