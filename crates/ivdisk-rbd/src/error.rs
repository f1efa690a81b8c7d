use std::io;

use ivdisk_header::HeaderError;
use ivdisk_rados::RadosError;

use crate::LuksFormat;

/// Everything that can go wrong with an rbd image. `image` is always `POOL/IMAGE` (with
/// `@SNAP` when a snapshot is open), as the `rbd` tool names it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RbdError {
    #[error(
        "ivdisk was built without librbd support (the `librbd` feature of ivdisk-rbd is off); \
         rebuild with it (needs librbd-dev)"
    )]
    NotBuilt,

    #[error("invalid rbd address `{uri}`: {reason}")]
    InvalidUri { uri: String, reason: String },

    #[error("rbd image {image}: {source}")]
    Rados {
        image: String,
        #[source]
        source: RadosError,
    },

    /// `pool`: where `rbd ls` lists the image's neighbours (`POOL` or `POOL/NAMESPACE`).
    #[error(
        "rbd image {image} does not exist; check the name (`rbd ls {pool}`) or create it \
         (`rbd create --size 10G {image}`)"
    )]
    NotFound { image: String, pool: String },

    #[error(
        "Ceph pool {pool} has no rbd namespace `{namespace}`; list them (`rbd namespace ls \
         {pool}`) or create it (`rbd namespace create {pool}/{namespace}`)"
    )]
    NoSuchNamespace { pool: String, namespace: String },

    #[error(
        "rbd image {image} has no snapshot `{snapshot}`; list them with `rbd snap ls {image}`"
    )]
    NoSuchSnapshot { image: String, snapshot: String },

    #[error("opening rbd image {image} failed: {source}")]
    Open {
        image: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "rbd image {image} is {format}-encrypted (librbd's `rbd encryption format`): its \
         passphrase is needed"
    )]
    PassphraseRequired { image: String, format: LuksFormat },

    #[error(
        "rbd image {image}: the passphrase opens no {format} keyslot; give the passphrase \
         of one of its keyslots (`ivdisk info` lists them); never run `rbd encryption format` \
         on it again: that makes a new key, and its data is lost"
    )]
    WrongPassphrase { image: String, format: LuksFormat },

    #[error(
        "rbd image {image} has no {expected} header{}; open it with encryption=auto to detect \
         its format, or encryption=none for a plain image",
        found.map(|f| format!(" (it is {f})")).unwrap_or_else(|| " (it is not encrypted)".into())
    )]
    NotEncrypted {
        image: String,
        expected: LuksFormat,
        found: Option<LuksFormat>,
    },

    #[error(
        "rbd image {image} starts with a LUKS header of version {version}; librbd loads LUKS1 \
         and LUKS2 only"
    )]
    UnsupportedLuksVersion { image: String, version: u16 },

    #[error("rbd image {image}: loading its {format} encryption failed: {source}")]
    EncryptionLoad {
        image: String,
        format: LuksFormat,
        #[source]
        source: io::Error,
    },

    #[error("rbd image {image}: its {format} header cannot be read: {source}")]
    Header {
        image: String,
        format: LuksFormat,
        #[source]
        source: HeaderError,
    },

    /// Another client holds the image's exclusive lock and keeps it (it took it in exclusive
    /// mode, as `ivdisk serve` and `rbd-nbd --exclusive` do).
    #[error(
        "rbd image {image} has another writer, which holds its exclusive lock and keeps it: \
         stop that one first (`rbd status {image}` lists the clients that have it open), or \
         open this one read-only (`serve --read-only`)"
    )]
    OtherWriter { image: String },

    /// librbd refused a write with EROFS on an image opened read-write: not this handle's
    /// mode, the cluster's doing.
    #[error(
        "rbd image {image}: librbd refused the {what} at offset {offset} (read-only file system) \
         although the image is open read-write: another client may hold its exclusive lock in \
         exclusive mode (`rbd status {image}`, `rbd lock ls {image}`), or it is a non-primary \
         mirror image (`rbd mirror image status {image}`)"
    )]
    WriteRefused {
        image: String,
        what: &'static str,
        offset: u64,
    },

    #[error("rbd image {image}: {len} bytes at offset {offset} lie past its end ({size} bytes)")]
    OutOfRange {
        image: String,
        offset: u64,
        len: u64,
        size: u64,
    },

    #[error("rbd image {image} is open read-only{}", if *snapshot { " (a snapshot)" } else { "" })]
    ReadOnly { image: String, snapshot: bool },

    #[error(
        "rbd image {image}: {what} at offset {offset} failed: the pool is full or over its \
         quota (`ceph df`, `ceph osd pool get-quota`)"
    )]
    NoSpace {
        image: String,
        what: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },

    /// The OSDs did not answer within `rados_osd_op_timeout` (a default of
    /// [`crate::RBD_OP_TIMEOUT`] that the Ceph config file may change).
    #[error(
        "rbd image {image}: {what} got no answer from the OSDs in time (rados_osd_op_timeout): \
         the OSDs holding it are down or the cluster is stalled; check `ceph -s` and \
         `ceph osd tree`, then retry{unsure}"
    )]
    OsdTimeout {
        image: String,
        /// `opening it`, `the write of 4096 bytes at offset 0`, ...
        what: String,
        /// What may or may not have happened (a change librbd may have applied in part),
        /// from ` (`; empty for a request that changes nothing.
        unsure: &'static str,
    },

    #[error("rbd image {image}: {} failed: {source}", describe(what, *offset, *len))]
    Io {
        image: String,
        what: &'static str,
        offset: u64,
        len: u64,
        #[source]
        source: io::Error,
    },

    #[error("rbd image {image}: {reason}")]
    Closed { image: String, reason: String },

    #[error("rbd image {image}: closing failed: {source}")]
    Close {
        image: String,
        #[source]
        source: io::Error,
    },
}

impl RbdError {
    /// The errno librbd reported, for errors that carry one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            RbdError::Open { source, .. }
            | RbdError::EncryptionLoad { source, .. }
            | RbdError::NoSpace { source, .. }
            | RbdError::Io { source, .. }
            | RbdError::Close { source, .. } => source.raw_os_error(),
            RbdError::WriteRefused { .. } => Some(libc::EROFS),
            RbdError::OsdTimeout { .. } => Some(libc::ETIMEDOUT),
            _ => None,
        }
    }
}

/// `the write of 65536 bytes at offset 4096`; `the flush` (a request without a range).
pub(crate) fn describe(what: &str, offset: u64, len: u64) -> String {
    match len {
        0 => format!("the {what}"),
        _ => format!("the {what} of {len} bytes at offset {offset}"),
    }
}
