use std::io;

use crate::SnapId;

/// Everything an object store operation can fail with. Variants are matchable, so callers (the
/// image layer, tests) can tell an expected condition (`NotFound`, `Busy`) from a failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("object `{object}` does not exist")]
    NotFound { object: String },

    #[error("object `{object}` already exists")]
    Exists { object: String },

    #[error("object `{object}` is at version {actual}, the operation asserted {expected}")]
    VersionMismatch {
        object: String,
        expected: u64,
        actual: u64,
    },

    #[error("invalid object name `{name}`: {reason}")]
    InvalidName { name: String, reason: &'static str },

    #[error(
        "object `{object}`: range [{offset}, +{len}) goes past the {limit}-byte object size limit"
    )]
    OutOfRange {
        object: String,
        offset: u64,
        len: u64,
        limit: u64,
    },

    #[error("invalid operation on `{object}`: {reason}")]
    InvalidOperation { object: String, reason: String },

    #[error("lock `{lock}` on `{object}` is held by {holder}")]
    Busy {
        object: String,
        lock: String,
        holder: String,
    },

    #[error("lock `{lock}` on `{object}` is not held by {client} with cookie `{cookie}`")]
    NotLocked {
        object: String,
        lock: String,
        client: String,
        cookie: String,
    },

    /// [`crate::ObjectStore::fence_client`] was refused; `holder` names the client and where
    /// it is.
    #[error("cannot fence {holder}: {reason}")]
    CannotFence { holder: String, reason: String },

    /// This client was cut off from the store (RADOS: blocklisted), as another client does
    /// before it breaks or takes this one's lock: nothing it sends is applied any more, for
    /// good.
    #[error(
        "{context}: this client was fenced off the store (blocklisted: `ivdisk lock break` \
         does that to a writer before it breaks its lock, and the next writer to one that did \
         not answer it); nothing it sends is applied any more: stop it, and open the image anew \
         once the lock is free"
    )]
    Fenced { context: String },

    #[error("snapshot {0} does not exist")]
    NoSuchSnapshot(SnapId),

    #[error(
        "no space left on the device ({context}): this operation on one object was not applied \
         (others, such as the parts of a large write in other objects, may have been); free \
         space and retry (the store stays consistent)"
    )]
    NoSpace { context: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "the store at {path} is already open for writing by process {pid}; stop it first (one \
         writer per local store)"
    )]
    AlreadyOpen { path: String, pid: String },

    /// A removal (of the image, or of a snapshot) refused because readers have what it would
    /// remove open (`reader_marks`); `pids` are the processes found holding it (empty when
    /// they could not be told, for example another user's).
    #[error(
        "{what} in the store at {path} is open read-only by {}; stop that reader (an `ivdisk \
         serve --read-only` or of a snapshot, an export, a backup, a verify) first",
        crate::reader_marks::describe_processes(pids)
    )]
    OpenByReaders {
        path: String,
        what: String,
        pids: Vec<u32>,
    },

    /// A reader refused because another open is removing what it would read (`reader_marks`).
    #[error("{what} in the store at {path} is being removed by another process")]
    RemovalUnderway { path: String, what: String },

    /// A change (a write, a snapshot, a lock) asked of a store opened read-only.
    #[error("{what}: refused, the store was opened read-only")]
    ReadOnly { what: String },

    /// Opening a store for writing where its directory or files cannot be written (a
    /// read-only mount, no permission, immutable files). Nothing was changed.
    #[error(
        "the store at {path} cannot be opened for writing ({reason}); open it read-only instead \
         (e.g. `ivdisk serve --read-only`; commands that only read open it read-only by themselves)"
    )]
    NotWritable { path: String, reason: String },

    #[error("the store's metadata database failed: {0}")]
    Database(String),

    #[error("the store is damaged: {0}")]
    Corrupt(String),

    #[error("the store was closed (its worker stopped): {0}")]
    Closed(String),
}

impl StoreError {
    /// As [`StoreError::io`], with the context built only if there is an error. For the
    /// calls every operation makes (a segment's append, read or sync): formatting a segment's
    /// path up front cost a path join, a `format!` and two allocations per call, all thrown
    /// away on success.
    pub(crate) fn io_with(
        context: impl FnOnce() -> String,
    ) -> impl FnOnce(io::Error) -> StoreError {
        move |source| StoreError::io(context())(source)
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
        let context = context.into();
        move |source| StoreError::from_io(context, source)
    }

    /// `source`, met while `context`, as the store reports it: a full file system or an
    /// exhausted disk quota is [`StoreError::NoSpace`] (what the user must do is the same, and
    /// the NBD server answers it with ENOSPC, on which qemu pauses the guest by default instead
    /// of failing its IO); anything else is [`StoreError::Io`].
    pub fn from_io(context: String, source: io::Error) -> StoreError {
        match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => StoreError::NoSpace { context },
            _ => StoreError::Io { context, source },
        }
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        if let rusqlite::Error::SqliteFailure(code, _) = &e {
            if code.code == rusqlite::ErrorCode::DiskFull {
                return StoreError::NoSpace {
                    context: "writing the metadata database".into(),
                };
            }
        }
        StoreError::Database(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_system_or_quota_is_no_space_and_other_errors_stay_io() {
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = StoreError::from_io("writing seg".into(), io::Error::from_raw_os_error(errno));
            assert!(
                matches!(&e, StoreError::NoSpace { context } if context == "writing seg"),
                "errno {errno}: {e:?}"
            );
            assert!(e.to_string().contains("free space and retry"), "{e}");
        }
        let e = StoreError::from_io(
            "reading seg".into(),
            io::Error::from_raw_os_error(libc::EIO),
        );
        assert!(
            matches!(&e, StoreError::Io { source, .. } if source.raw_os_error() == Some(libc::EIO)),
            "{e:?}"
        );
    }
}
