use std::time::Duration;

use ivdisk_crypto::{CryptoError, ImageId, Suite};
use ivdisk_header::HeaderError;
use ivdisk_rados::RadosError;
use ivdisk_store::StoreError;

/// Everything opening an image or doing IO on it can fail with. Each message names the image
/// (as the user addressed it) and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// The image URI does not parse.
    #[error("image address `{uri}`: {reason}")]
    InvalidUri { uri: String, reason: String },

    /// No image by that name on that store.
    #[error("image {image} does not exist ({})", create_hint(image))]
    NotFound { image: String },

    /// Create found an image already there.
    #[error(
        "image {image} already exists; delete it first (`ivdisk delete {}`) or pick another name",
        crate::uri::shell_word(image)
    )]
    Exists { image: String },

    /// A create/open/resize parameter is out of range.
    #[error("image {image}: {reason}")]
    InvalidParameter { image: String, reason: String },

    /// IO reaching past the end of the image; nothing was read or written.
    #[error("image {image}: IO [{offset}, +{len}) goes past the end of the {size}-byte image; nothing was done")]
    OutOfRange {
        image: String,
        offset: u64,
        len: u64,
        size: u64,
    },

    /// Sectors whose ciphertext or metadata failed authentication (tampered with, moved from
    /// another sector or image, or damaged). For a read, every other sector of the request was
    /// read: the buffer holds their plaintext, and zeros in place of the failed ones. For a
    /// write (`in_write`) into part of a sector, whose other bytes had to be read first,
    /// nothing was written.
    #[error("image {image}: integrity check failed for sector(s) at LBA {} (in {}-byte sectors{}): the stored data or its metadata was changed, moved or damaged; {}", lbas.first().copied().unwrap_or_default(), sector_size, if lbas.len() > 1 { format!(", {} sectors in all", lbas.len()) } else { String::new() }, if *in_write { "a write into part of a sector keeps its other bytes, which could not be read, so nothing was written (a write of whole sectors replaces them)" } else { "the rest of the request was read" })]
    Integrity {
        image: String,
        /// Logical block addresses (in `sector_size` units) that failed, ascending.
        lbas: Vec<u64>,
        sector_size: usize,
        /// The sectors were read for a partial-sector write, which was not done.
        in_write: bool,
    },

    /// The store lost writes it had acknowledged since the last successful flush (a local
    /// store's group commit that failed, on a full disk say; the flush after it said so).
    /// From then on this open refuses writes and flushes: a flush that succeeded after the
    /// loss would tell a client (a guest resumed after ENOSPC) that writes are durable when
    /// they are gone, and writes applied after the loss would be kept without the ones lost
    /// before them. Opening the image again starts clean at what was made durable.
    #[error("image {image}: a commit of its store failed and lost writes acknowledged since the last successful flush; this open refuses writes and flushes from now on, so no client takes them for durable: close it (stop the server), free space, and open it again (it holds what the last successful flush made durable)")]
    WritesLost { image: String },

    /// A long operation stopped on request (a restore told to stop, on SIGINT or SIGTERM);
    /// it says what it left behind.
    #[error("image {image}: stopped on request")]
    Stopped { image: String },

    /// Another client holds the image's writer lock.
    /// `breakable`: `ivdisk lock break` removes a dead holder's lock (not so for a LUKS
    /// file's flock, which ends with its process, or a librbd client's lock).
    #[error("image {image} is open for writing by {holder}{}; open it read-only, stop that writer{}", expires_in.map(|d| format!(" (lock expires in {} s unless renewed)", d.as_secs())).unwrap_or_default(), if *breakable { format!(", or if it is gone run `ivdisk lock break {}`", crate::uri::shell_word(image)) } else { String::new() })]
    Locked {
        image: String,
        holder: String,
        expires_in: Option<Duration>,
        breakable: bool,
    },

    /// The writer lock is not held while the image is open: broken or taken by another client
    /// (for good: reopen the image), or not renewed for a while (until a renewal succeeds);
    /// writes are refused meanwhile so that two writers never mix. `reason` says which.
    #[error("image {image}: the writer lock was lost ({reason}); writes are refused")]
    LockLost { image: String, reason: String },

    /// A write on an image opened read-only.
    #[error("image {image} is open read-only")]
    ReadOnly { image: String },

    /// The header or its keyslots: wrong passphrase, damaged header, unknown format.
    #[error("image {image}: {source}")]
    Header {
        image: String,
        #[source]
        source: HeaderError,
    },

    /// The cipher refused (nonce budget exhausted, bad key).
    #[error("image {image}: {source}")]
    Crypto {
        image: String,
        #[source]
        source: CryptoError,
    },

    /// The object store failed; every object the request touched holds either its old or its
    /// new content.
    #[error("image {image}: {source}")]
    Store {
        image: String,
        #[source]
        source: StoreError,
    },

    /// Connecting to the RADOS cluster failed.
    #[error("image {image}: {source}")]
    Rados {
        image: String,
        #[source]
        source: RadosError,
    },

    /// A snapshot name already taken.
    #[error("image {image} already has a snapshot named `{snapshot}`; pick another name or remove it first (`ivdisk snap rm {}`)", crate::uri::shell_word(&crate::uri::at_snapshot(image, snapshot)))]
    SnapshotExists { image: String, snapshot: String },

    /// No snapshot by that name.
    #[error(
        "image {image} has no snapshot named `{snapshot}` (list them with `ivdisk snap ls {}`)",
        crate::uri::shell_word(image)
    )]
    SnapshotNotFound { image: String, snapshot: String },

    /// Deleting an image that still has snapshots.
    #[error("image {image} has {} snapshot(s) ({}); remove them first (`ivdisk snap rm {}`), nothing was deleted", names.len(), names.join(", "), crate::uri::shell_word(&crate::uri::at_snapshot(image, "NAME")))]
    HasSnapshots { image: String, names: Vec<String> },

    /// A removal (`delete`, `snap rm`) refused: another open reads what it would remove (a
    /// read-only open writes nothing to the store, so only its mark tells; see
    /// `ivdisk_store::reader_marks`). `pids` are the processes found holding it open.
    #[error("image {image} is open read-only by {}; stop that reader (an `ivdisk serve --read-only` or of a snapshot, an export, a backup, a verify) first; nothing was changed", ivdisk_store::reader_marks::describe_processes(pids))]
    OpenByReaders { image: String, pids: Vec<u32> },

    /// A removal refused: clients of a RADOS image's store read the image or the snapshot
    /// (they watch its header object, `readers.rs`). `readers` describes each: its process and
    /// host, or a watcher that did not answer.
    #[error("image {image} is open read-only by {}; stop that reader (an `ivdisk serve --read-only` or of a snapshot, an export, a backup, a verify) first; nothing was changed", readers.join("; "))]
    WatchedByReaders { image: String, readers: Vec<String> },

    /// An open to read refused: another process, holding the writer lock, removes the image
    /// or the snapshot, or changes the head in a way readers cannot follow (a shrink, a
    /// rollback). The message said "removed" after a shrink or rollback was killed, with
    /// nothing to do about it.
    #[error(
        "image {image} is being removed or changed under its readers by another process \
         (`ivdisk delete` or `snap rm`, `resize --allow-shrink` or `snap rollback`); wait for it \
         to finish. If that process was killed, its writer lock expires within 30 s \
         (`ivdisk lock status` shows when), and the image then opens or says what is left to \
         finish"
    )]
    RemovalUnderway { image: String },

    /// The stored data does not have the shape the header describes.
    /// A read-only open of a RADOS image found, once a read had its data, that its watch on
    /// the header (which keeps `delete` and `snap rm` elsewhere from removing what it reads)
    /// was lost: the read is refused, as what it read may be gone. `removed`: what was found
    /// removed meanwhile (the image deleted, its snapshot removed), for good; `None`: the
    /// watch is not registered again yet.
    #[error("image {image}: {}", match removed { Some(what) => format!("{what} while this read-only open read it (its watch on the image's header was lost, so that went on without seeing this reader); nothing more is read from it, close it"), None => "this read-only open's watch on the image's header was lost (this client was cut off from the cluster, or stopped, for longer than the watch timeout), so a delete or `snap rm` elsewhere could have gone on without seeing it; reads waited 10 s for it and are refused until the watch is registered again and the image is found unchanged (if this goes on, check the network to the cluster)".to_owned() })]
    ReaderWatchLost {
        image: String,
        removed: Option<String>,
    },

    #[error("image {image}: {reason}")]
    Corrupt { image: String, reason: String },

    /// The header object changed between reading it and storing a change to it (another
    /// keyslot change, a resize or a header restore ran at the same time). Nothing was stored.
    #[error("image {image}: its header changed while this command ran (another keyslot change, resize or header restore at the same time); nothing was changed, run the command again")]
    HeaderChanged { image: String },

    /// A header backup that cannot be restored to an ivdisk image (not a header, damaged,
    /// truncated, not an ivdisk image's). Nothing was changed.
    #[error("image {image}: the header backup is not usable: {reason}; nothing was changed")]
    InvalidBackup { image: String, reason: String },

    /// A header backup of another image: its image id differs from the one the header in
    /// place has, or (a header that no longer reads) still names in its JSON, or the one of a
    /// local store's data objects. `found` says which.
    #[error("image {image}: the header backup belongs to image id {backup_id}, but {found} {image_id}; restore this image's own backup, or pass --force to replace its header anyway (the image then shows image {backup_id}'s data objects, if this store holds any, not its own); nothing was changed", backup_id = hex::encode(backup_id.0), image_id = hex::encode(image_id.0))]
    BackupMismatch {
        image: String,
        backup_id: ImageId,
        image_id: ImageId,
        found: &'static str,
    },

    /// A header backup whose image id another header object of the same store has (`other`):
    /// restored, both names would share that image's data objects. Refused even when forced.
    #[error("image {image}: header object {other} in the same store already has image id {} (the backup's): restoring it here would give that image's data objects a second name, with a writer lock of its own, and deleting either name would delete the other's data; restore the backup to that image instead, or delete that image first; nothing was changed", hex::encode(image_id.0))]
    HeaderIdInUse {
        image: String,
        other: String,
        image_id: ImageId,
    },

    /// Restoring the header of a suite with a write limit (`aes-gcm-random`) where the header
    /// object is gone: the count of writes made under the key went with it.
    #[error("image {image}: the header object is missing, and with it the count of writes made under the {suite} key (the suite's nonce bound counts them); restoring starts that count from zero, which can let the key pass the bound: pass --force to restore anyway, then move the data to a new image (ivdisk export, ivdisk import) soon; nothing was changed")]
    NonceCountLost { image: String, suite: Suite },

    /// A backup file (`ivdisk backup`) that is not one, or is truncated or damaged (a record
    /// checksum, the file's SHA-256 or its structure is wrong). Found before anything was
    /// written: nothing was created or changed.
    #[error("backup file {file}: {reason}; nothing was restored")]
    BackupDamaged { file: String, reason: String },

    /// Reading or writing a backup file failed.
    #[error("backup file {file}: {context}: {source}")]
    BackupIo {
        file: String,
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A backup would overwrite an existing file.
    #[error("backup file {file} exists; choose another name or pass --force to overwrite it")]
    BackupFileExists { file: String },

    /// A restore target store already holds data objects of the backed-up image's id (a
    /// half-deleted image, or the same image restored there under another name). Nothing was
    /// written.
    #[error("image {image}: the store already holds {count} data object(s) named {prefix}*, of image id {}, the id of the backup (the image itself, restored or copied there under another name, or a half-deleted one); a restore keeps the image id, so restore into another store or delete those objects first; nothing was written", prefix.trim_start_matches("ivdisk_data.").trim_end_matches('.'))]
    DataObjectsExist {
        image: String,
        prefix: String,
        count: usize,
    },

    /// An incremental backup that does not apply to this image: another image id, or the
    /// image is not in the state the increment starts from. Nothing was changed.
    #[error(
        "image {image}: this incremental backup does not apply here: {reason}; nothing was changed"
    )]
    IncrementalMismatch { image: String, reason: String },

    /// An incremental restore into the image stopped part-way (a full disk, a signal, a
    /// crash): the image holds some of its changes and none of the others, a state that was
    /// never a snapshot. It is not opened until the restore is run again (which finishes it).
    #[error("image {image}: an incremental restore into it (up to snapshot {snapshot}) did not finish, so it holds part of that increment's changes and is neither the base nor the new snapshot; run the same `ivdisk restore FILE {}` again (it finishes what is left), or delete it and restore the full backup and increments again", crate::uri::shell_word(image))]
    RestoreUnfinished { image: String, snapshot: String },

    /// An incremental restore failed in its writing pass, after it began changing objects:
    /// the backup file changed or became unreadable under it, or the image did. The image is
    /// marked as holding part of the increment (not opened until it is finished).
    #[error("image {image}: the incremental restore stopped part-way: {reason}; the image holds part of the increment and is not opened until it is finished: run the same `ivdisk restore FILE {}` again with the backup file as it was (it goes on from where it stopped), or delete the image and restore the full backup and increments again", crate::uri::shell_word(image))]
    IncrementStopped { image: String, reason: String },

    /// A delete of the image stopped after it began removing data objects (a signal, a
    /// crash, a store error): some of its data is gone, so it is not opened.
    #[error("image {image}: a delete of it did not finish, so some of its data objects are gone and it is not opened; run `ivdisk delete {}` again to finish it", crate::uri::shell_word(image))]
    DeleteUnfinished { image: String },

    /// A rollback to a snapshot stopped part-way: some objects are at the snapshot, others
    /// at the head, so it is not opened.
    #[error("image {image}: a rollback of it to snapshot {snapshot} did not finish, so it holds objects of two states and is not opened; run `ivdisk snap rollback {}` again to finish it", crate::uri::shell_word(&crate::uri::at_snapshot(image, snapshot)))]
    RollbackUnfinished { image: String, snapshot: String },

    /// The command that created the image to fill it (`what`: "an import of FILE") has not
    /// finished: it still runs, or it stopped (killed, or the machine stopped) and could not
    /// delete the image. The image holds part of the data, zeros for the rest, so it is not
    /// opened. Which of the two is told by the writer lock (the running command holds it),
    /// which this check does not read: the message says how to tell (it said "killed" and
    /// "delete it" to a user whose import was still running).
    #[error("image {image}: {what} into it has not finished, so it holds only part of the data and is not opened; if that command is still running (`ivdisk lock status {0}` names its process), wait for it; if it was killed or the machine stopped, delete the image with `ivdisk delete {0} --yes` and run the command again", crate::uri::shell_word(image))]
    FillUnfinished { image: String, what: String },

    /// A shrink (`resize --allow-shrink`) stopped part-way: the header still has the old size
    /// over objects past the new end that are partly discarded.
    #[error("image {image}: a shrink of it to {size} bytes did not finish: part of the data past that end is discarded while the header still has the old size, so it is not opened; run `ivdisk resize {} --size {size} --allow-shrink` again to finish it", crate::uri::shell_word(image))]
    ShrinkUnfinished { image: String, size: String },
}

impl ImageError {
    pub(crate) fn store(image: &str) -> impl FnOnce(StoreError) -> ImageError + '_ {
        move |source| ImageError::Store {
            image: image.to_owned(),
            source,
        }
    }

    pub(crate) fn header(image: &str) -> impl FnOnce(HeaderError) -> ImageError + '_ {
        move |source| ImageError::Header {
            image: image.to_owned(),
            source,
        }
    }

    pub(crate) fn crypto(image: &str) -> impl FnOnce(CryptoError) -> ImageError + '_ {
        move |source| ImageError::Crypto {
            image: image.to_owned(),
            source,
        }
    }

    /// Whether this is an integrity failure (EIO for the sectors named, the rest was served).
    pub fn is_integrity(&self) -> bool {
        matches!(self, ImageError::Integrity { .. })
    }

    /// Whether the store behind the image is out of space (a full file system, a disk quota,
    /// `ENOSPC`/`EDQUOT` from Ceph): nothing of the request was applied, and it can be retried
    /// once space is freed.
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            ImageError::Store {
                source: StoreError::NoSpace { .. },
                ..
            }
        )
    }
}

/// What to do about an image that does not exist: create it, unless its name is one `create`
/// refuses (an `@` in it: `IMAGE@SNAP` names a snapshot, with one `@`).
fn create_hint(image: &str) -> String {
    // A local store directory left without an image (a delete, or one stopped after the
    // header went: its store files stay) said only "create it", and `delete` "does not
    // exist": what is there, and how to remove it, are said instead.
    let path = image.strip_prefix("file:").unwrap_or(image);
    if !image.contains("://")
        && !image.starts_with("mem:")
        && std::path::Path::new(path).join("meta.sqlite").is_file()
    {
        return format!(
            "its local store directory holds no image: one was deleted there, or a delete or \
             create was stopped; `ivdisk create {0} --size SIZE` makes one in it, or remove \
             the directory with `rm -r {0}`",
            crate::uri::shell_word(image)
        );
    }
    let name = image.split('?').next().unwrap_or(image);
    match name.rsplit('/').next().unwrap_or(name).contains('@') {
        true => "no image name holds an '@': IMAGE@SNAP names snapshot SNAP of IMAGE, and \
                 `ivdisk snap ls IMAGE` lists them"
            .into(),
        false => format!(
            "create it with `ivdisk create {} --size SIZE`",
            crate::uri::shell_word(image)
        ),
    }
}
