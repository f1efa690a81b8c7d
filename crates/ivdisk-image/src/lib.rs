//! ivdisk images: a virtual disk striped over the objects of any [`ivdisk_store::ObjectStore`],
//! each sector encrypted with a fresh IV/nonce whose metadata is written in the same atomic
//! store operation as the data (paper 000, "Random IVs for virtual disks").
//!
//! - [`ImageUri`]: where an image lives (`PATH`/`file:PATH` local, `rados://`, `mem:`).
//! - [`Image`]: create, open, resize, delete, and the IO path (read, write, discard,
//!   write-zeroes, flush at any byte offset and length).
//! - Passphrases ([`Image::add_passphrase`], `remove_`, `change_`; `prepare_*` make the
//!   [`HeaderChange`] without storing it, for a server to store with
//!   [`Image::apply_header_change`]) and header backups ([`Image::backup_header`],
//!   [`Image::restore_header`]) on the header object.
//! - [`LayoutKind`]: where metadata lives in an object (`object-end`, `unaligned`, `omap`,
//!   `none`); one module per layout in `layout/`.
//! - Snapshots ([`Image::create_snapshot`], [`Image::snapshots`], remove, rollback; open one
//!   read-only with [`OpenOptions::snapshot`]), in `snapshot.rs`.
//! - Encrypted backups without the passphrase ([`Image::backup`], [`Image::restore_backup`],
//!   full or incremental between snapshots), in `backup.rs`.
//! - The writer lock (one writer per image, renewed while open, breakable when stale).
//!
//! Layering: this crate uses the crypto, header and store crates and never speaks NBD or
//! parses command lines (docs/ARCHITECTURE.md).

#![deny(unsafe_code)]

mod allocation;
mod backup;
mod error;
mod foreign;
mod header_backup;
mod header_object;
mod image;
mod io;
mod keyslots;
mod layout;
mod metadata_cache;
mod object_map;
mod on_store;
mod partial_file;
mod range_lock;
mod read_reply;
mod readers;
mod snapshot;
mod uri;
mod write_payload;
mod writer_lock;

pub use allocation::AllocationExtent;
pub use backup::{
    partial_path, BackupBase, BackupDescription, BackupKind, BackupOptions, BackupPhase,
    BackupProgress, BackupSummary, BACKUP_MAGIC, BACKUP_STATE_KEY, BACKUP_VERSION,
};
pub use error::ImageError;
pub use header_backup::{HeaderBackupInfo, HeaderRestore, ReplacedHeader};
pub use image::{
    data_object_prefix, header_object_name, BrokenLock, CreateOptions, Fencing, Image, ImageInfo,
    OpenOptions, DEFAULT_OBJECT_SIZE, MAX_IMAGE_SIZE, MAX_OBJECT_SIZE, NONCE_RESERVATION,
};
pub use keyslots::HeaderChange;
pub use layout::{LayoutKind, ObjectGeometry};
pub use metadata_cache::DEFAULT_METADATA_CACHE_BYTES;
pub use partial_file::{mark_partial_in_progress, remove_abandoned_partials};
pub use read_reply::ReadReply;
pub use snapshot::{SnapshotInfo, MAX_SNAPSHOT_NAME};
pub use uri::{at_snapshot, shell_quoted, shell_word, ImageUri, LOCAL_IMAGE_NAME};
pub use write_payload::{PayloadPlacement, WritePayload};
pub use writer_lock::{DEFAULT_LOCK_DURATION, LOCK_HELD_MARGIN, LOCK_STALL_WAIT, WRITER_LOCK};

/// The `tracing` target of the log line naming sectors that failed authentication on a read
/// (level ERROR). A server's log is where those go; a command that reports them in its own
/// result (export, convert) may turn the target off so that they are not said twice.
pub const INTEGRITY_LOG_TARGET: &str = "ivdisk::integrity";
