//! Encrypted backups of whole images, made and restored without the passphrase (issue 9):
//! the header object's bytes (the LUKS2 region with its keyslots) and the ciphertext and
//! metadata of every data object, copied at the object level into one portable file, so the
//! result works with any layout and opens with the same passphrase wherever it is restored.
//!
//! What is copied: the header object's bytes and its omap except the snapshot records
//! (`ivdisk.snap.*`, `ivdisk.snap_seq`: a restored image has no snapshots) and this module's
//! own marker; so the nonce count of `aes-gcm-random` (`ivdisk.nonce_writes_reserved`) goes
//! along. Of each data object: its size, its non-zero 4 KiB blocks (holes and all-zero blocks,
//! which read as unwritten sectors anyway, are left out: the file is sparse) and its omap (the
//! `omap` layout's metadata). The image id is kept: it is bound into every sector's AAD.
//!
//! Consistency: a backup of the head takes the writer lock (no writer runs meanwhile); a
//! backup of a snapshot (`IMAGE@SNAP`) reads the snapshot and takes no lock, and checks at the
//! end that the snapshot was not removed meanwhile. A snapshot's backup restores with the
//! snapshot's size (the header's segment size is rewritten in the copy).
//!
//! The file (all integers little-endian):
//!
//! ```text
//! "IVDISKBK" | u32 version (1) | u32 n | n bytes of JSON (BackupDescription) | u32 CRC32 of all before
//! record*    : u8 kind | u64 len | len bytes of payload | u32 CRC32 of kind, len and payload
//!   kind 1   : the header object (first, once)  payload = object
//!   kind 2   : a data object                    payload = u64 index | object
//!   kind 3   : a data object removed since the base (incremental only)  payload = u64 index
//!   object   : u64 size | u32 runs { u64 offset | u32 len | bytes } | u32 pairs { u32 klen | key | u32 vlen | value }
//!   kinds 2, 3 in increasing index order; an incremental's kind 2 and 3 payloads end with the
//!   32-byte SHA-256 of the object's state at the base snapshot (all zeros: absent there)
//! trailer    : u8 0xFF | u64 40 | u64 record count | SHA-256 of every byte before the trailer | u32 CRC32
//! ```
//!
//! A restore reads the whole file and checks it (magic, version, every CRC, the structure,
//! the header against the description, the record count and the SHA-256) before it creates
//! anything; then it writes the data objects (each created exclusively, 32 in flight) and the
//! header object last, so that an interrupted restore leaves no image that opens; on any
//! failure it removes what it wrote.
//!
//! Incremental backups (`since`): the objects whose state differs between two snapshots (read
//! both and compared: the stores cannot tell what changed), and those removed since. They apply
//! to an image restored from a backup of the older snapshot (or brought to it by an earlier
//! increment): the restore records the state it left in the header object's omap
//! (`ivdisk.backup_state`),
//! and an increment checks it, the image id and the size, and before replacing an object checks
//! that the object is still in the base state (an image written after its restore is refused
//! where it matters). An increment applied halfway (a crash) can be applied again.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures_util::stream::{self, FuturesUnordered, StreamExt};
use ivdisk_crypto::{ImageId, Suite};
use ivdisk_header::{Header, HeaderIo, MemoryHeaderIo};
use ivdisk_store::{
    ObjectName, ObjectStore, ObjectStoreExt, ReadOp, ReadResult, ReadStep, SnapContext, SnapId,
    StoreError, WriteOp, WriteStep,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::allocation::listed_object_numbers;
use crate::header_object::{write_unless_header_changed, HeaderRegion};
use crate::image::{
    data_object_prefix, header_object_name, object_name, parse_header, read_header, Parsed,
    NONCE_KEY,
};
use crate::keyslots::missing_header;
use crate::layout::max_stored_object_len;
use crate::readers::{ReaderHold, REMOVING_KEY};
use crate::snapshot::{SnapshotTable, SNAPSHOT_KEY_PREFIX, SNAP_SEQ_KEY};
use crate::writer_lock::{
    HolderRecord, WriterLock, DEFAULT_LOCK_DURATION, LAST_WRITER_CLIENT_KEY, LAST_WRITER_KEY,
};
use crate::{Image, ImageError, ImageUri, LayoutKind};

/// The first bytes of a backup file.
pub const BACKUP_MAGIC: &[u8; 8] = b"IVDISKBK";
/// The format version this code writes and reads.
pub const BACKUP_VERSION: u32 = 1;
/// `format` in a backup's description.
const FORMAT_NAME: &str = "ivdisk-backup";

const KIND_HEADER: u8 = 1;
const KIND_DATA: u8 = 2;
const KIND_REMOVED: u8 = 3;
const KIND_TRAILER: u8 = 0xFF;
/// Trailer payload: record count and SHA-256.
const TRAILER_LEN: u64 = 8 + 32;

/// Header-object omap key where a restore records the state it left (for increments).
pub const BACKUP_STATE_KEY: &[u8] = b"ivdisk.backup_state";

/// Header omap key set by `Image::delete` before the first data object goes: an interrupted
/// delete leaves an image that no open accepts (some of its data is gone) until a delete
/// finishes it.
pub(crate) const DELETING_KEY: &[u8] = b"ivdisk.deleting";

/// Header omap key set by `Image::create_to_fill` (to what fills the image: "an import of
/// FILE") in the operation that creates the header, removed by `Image::mark_filled` once
/// everything is written: an import or conversion killed part-way (SIGKILL, a crash, power
/// loss: nothing there could delete the half-made image) leaves an image no open accepts,
/// where it looked complete and read zeros for everything not copied yet.
pub(crate) const FILLING_KEY: &[u8] = b"ivdisk.filling";

/// Header omap key set by `Image::rollback_snapshot` (to the snapshot's name) before the first
/// object is rolled back, removed with the size write at its end: a rollback stopped part-way
/// leaves objects of two states, which no open accepts until a rollback finishes.
pub(crate) const ROLLING_BACK_KEY: &[u8] = b"ivdisk.rolling_back";

/// Header omap key set by `Image::resize` (to the new size, in decimal) before a shrink
/// discards the first object past the new end, removed with the header's size write at its
/// end: a shrink killed part-way left the old size over objects partly discarded, an image
/// every command took for whole (an export and a verify passed, reading zeros there). No
/// open accepts it until a resize to that size finishes it.
pub(crate) const SHRINKING_KEY: &[u8] = b"ivdisk.shrinking";

/// Granularity of the sparse copy: blocks of an object that are all zeros are left out.
const BLOCK: usize = 4096;
/// Object reads or writes in flight.
const IN_FLIGHT: usize = 32;
/// Bytes of object data in flight at most (64 MiB objects would otherwise mean 2 GiB).
const BYTES_IN_FLIGHT: u64 = 256 << 20;
/// Longest description accepted.
const MAX_DESCRIPTION: u32 = 1 << 20;
/// Largest header object accepted (the LUKS2 region is 16 MiB by default).
const MAX_HEADER_OBJECT: u64 = 64 << 20;

/// The longest omap key and value a backup holds (the header's records and the layouts'
/// metadata are far shorter; RADOS itself refuses keys past a few KiB).
const MAX_OMAP_KEY: usize = 4096;
const MAX_OMAP_VALUE: usize = 1 << 20;
/// Largest record payload accepted (a 64 MiB object's data and metadata, its omap keys, the
/// header object): anything larger is damage, refused before allocating it.
const MAX_RECORD: u64 = 384 << 20;
/// Omap pairs read per request.
const OMAP_PAGE: usize = 1024;

/// Full or incremental.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackupKind {
    /// The whole image.
    Full,
    /// The objects that changed between two snapshots.
    Incremental,
}

/// The snapshot an incremental backup starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupBase {
    pub snapshot: String,
    pub snapshot_id: SnapId,
    /// The image's size at that snapshot.
    pub size: u64,
    /// The snapshot's uid ([`crate::SnapshotInfo::uid`]; absent in backups made before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_uid: Option<String>,
}

/// What a backup file holds (its JSON description).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupDescription {
    /// Always `ivdisk-backup`.
    pub format: String,
    pub kind: BackupKind,
    /// The image backed up, as it was addressed.
    pub image: String,
    /// The image id, 32 hex digits.
    pub image_id: String,
    pub suite: String,
    pub layout: String,
    pub sector_size: u32,
    pub object_size: u64,
    /// The size the restored image has.
    pub size: u64,
    /// The snapshot backed up (`None`: the head).
    pub snapshot: Option<String>,
    pub snapshot_id: Option<SnapId>,
    /// The snapshot's uid ([`crate::SnapshotInfo::uid`]; absent in backups made before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_uid: Option<String>,
    /// When the backup was made, seconds since the Unix epoch.
    pub created: u64,
    /// Incremental backups: the snapshot the changes are counted from.
    pub base: Option<BackupBase>,
}

impl BackupDescription {
    /// The image id as bytes.
    pub fn image_id(&self) -> Result<ImageId, String> {
        let bytes = hex::decode(&self.image_id)
            .ok()
            .and_then(|b| <[u8; 16]>::try_from(b).ok())
            .ok_or_else(|| format!("image id `{}` is not 32 hex digits", self.image_id))?;
        Ok(ImageId(bytes))
    }
}

/// What to back up.
#[derive(Debug, Clone, Default)]
pub struct BackupOptions {
    /// A snapshot (by name) instead of the head.
    pub snapshot: Option<String>,
    /// Incremental: only what changed since this (older) snapshot.
    pub since: Option<String>,
    /// Replace an existing backup file.
    pub overwrite: bool,
}

/// What a backup or restore is doing, for progress bars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackupPhase {
    /// Backup: reading objects (`done`/`total` in objects).
    Reading,
    /// Restore: checking the file (`done`/`total` in bytes of the file).
    Verifying,
    /// Restore: writing objects (`done`/`total` in bytes of the file).
    Writing,
}

/// A progress report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackupProgress {
    pub phase: BackupPhase,
    pub done: u64,
    pub total: u64,
}

/// What a backup wrote or a restore read.
#[derive(Debug, Clone, PartialEq)]
pub struct BackupSummary {
    pub description: BackupDescription,
    /// Data object records (objects copied).
    pub objects: u64,
    /// Objects recorded as removed (incremental backups).
    pub removed: u64,
    /// Bytes of object data (extents) in the file, header object included.
    pub data_bytes: u64,
    /// The file's length.
    pub file_bytes: u64,
    /// The SHA-256 in the file's trailer (of everything before it), hex.
    pub sha256: String,
    pub seconds: f64,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Object states

/// An object as the backup holds it: size, non-zero block runs, omap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct ObjectState {
    size: u64,
    /// Runs of non-zero `BLOCK`s (clipped to `size`), ascending, not adjacent.
    runs: Vec<(u64, Vec<u8>)>,
    omap: Vec<(Vec<u8>, Vec<u8>)>,
}

impl ObjectState {
    /// From a read's extents: the same content in canonical form (equal content, equal state).
    fn from_extents(
        size: u64,
        extents: Vec<ivdisk_store::Extent>,
        omap: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Self {
        let mut dense = vec![0u8; size as usize];
        for extent in extents {
            let at = extent.offset.min(size) as usize;
            let end = (at + extent.data.len()).min(dense.len());
            dense[at..end].copy_from_slice(&extent.data[..end - at]);
        }
        ObjectState {
            size,
            runs: block_runs(&dense),
            omap,
        }
    }

    fn data_bytes(&self) -> u64 {
        self.runs.iter().map(|(_, d)| d.len() as u64).sum()
    }

    /// About what the state takes in memory: its data, and its omap pairs with their
    /// vectors' own cost (what a restore counts against its bytes in flight).
    fn held_bytes(&self) -> u64 {
        self.data_bytes()
            + self
                .omap
                .iter()
                .map(|(k, v)| 64 + (k.len() + v.len()) as u64)
                .sum::<u64>()
    }

    fn encoded_len(&self) -> u64 {
        8 + 4
            + self
                .runs
                .iter()
                .map(|(_, d)| 12 + d.len() as u64)
                .sum::<u64>()
            + 4
            + self
                .omap
                .iter()
                .map(|(k, v)| 8 + (k.len() + v.len()) as u64)
                .sum::<u64>()
    }

    fn encode(&self, out: &mut dyn FnMut(&[u8])) {
        out(&self.size.to_le_bytes());
        out(&(self.runs.len() as u32).to_le_bytes());
        for (offset, data) in &self.runs {
            out(&offset.to_le_bytes());
            out(&(data.len() as u32).to_le_bytes());
            out(data);
        }
        out(&(self.omap.len() as u32).to_le_bytes());
        for (k, v) in &self.omap {
            out(&(k.len() as u32).to_le_bytes());
            out(k);
            out(&(v.len() as u32).to_le_bytes());
            out(v);
        }
    }

    /// The SHA-256 of the state (incremental backups check the target against it).
    fn digest(state: Option<&ObjectState>) -> [u8; 32] {
        let Some(state) = state else {
            return [0; 32];
        };
        let mut hasher = Sha256::new();
        state.encode(&mut |b| hasher.update(b));
        hasher.finalize().into()
    }

    /// The whole object as one byte vector (holes as zeros).
    fn dense(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.size as usize];
        for (offset, data) in &self.runs {
            out[*offset as usize..*offset as usize + data.len()].copy_from_slice(data);
        }
        out
    }

    /// Steps writing this state into an object that is empty (created or truncated to 0).
    fn write_steps(&self, op: &mut WriteOp) {
        for (offset, data) in &self.runs {
            op.steps.push(WriteStep::Write {
                offset: *offset,
                data: data.clone(),
            });
        }
        op.steps.push(WriteStep::Truncate(self.size));
        if !self.omap.is_empty() {
            op.steps.push(WriteStep::OmapSet(
                self.omap.iter().map(|(k, v)| (k, v)).collect(),
            ));
        }
    }
}

/// Runs of `bytes`' non-zero `BLOCK`s, as (offset, bytes).
fn block_runs(bytes: &[u8]) -> Vec<(u64, Vec<u8>)> {
    let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut current: Option<(usize, usize)> = None;
    for (i, block) in bytes.chunks(BLOCK).enumerate() {
        let at = i * BLOCK;
        if block.iter().all(|&b| b == 0) {
            if let Some((start, end)) = current.take() {
                runs.push((start as u64, bytes[start..end].to_vec()));
            }
            continue;
        }
        current = Some(match current {
            Some((start, _)) => (start, at + block.len()),
            None => (at, at + block.len()),
        });
    }
    if let Some((start, end)) = current {
        runs.push((start as u64, bytes[start..end].to_vec()));
    }
    runs
}

/// Read an object (at a snapshot, or the head) whole: `None` if it does not exist there.
/// `bound` is the largest size it may have.
async fn read_object(
    store: &dyn ObjectStore,
    object: &ObjectName,
    snap: Option<SnapId>,
    bound: u64,
) -> Result<Option<ObjectState>, StoreError> {
    let op = ReadOp {
        steps: vec![
            ReadStep::Stat,
            ReadStep::Read {
                offset: 0,
                len: bound,
            },
            ReadStep::OmapGetRange {
                start: Vec::new(),
                end: None,
                max: OMAP_PAGE,
            },
        ],
        snap,
    };
    let results = match store.read_op(object, op).await {
        Ok(r) => r,
        Err(StoreError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut results = results.into_iter();
    let (
        Some(ReadResult::Stat(stat)),
        Some(ReadResult::Extents(extents)),
        Some(ReadResult::Omap { pairs, mut more }),
    ) = (results.next(), results.next(), results.next())
    else {
        return Err(StoreError::Corrupt(format!(
            "reading object `{object}` returned the wrong results"
        )));
    };
    if stat.size > bound {
        return Err(StoreError::Corrupt(format!(
            "object `{object}` is {} bytes, more than an object of this image holds ({bound})",
            stat.size
        )));
    }
    let mut pairs = pairs.to_vec();
    // More omap pairs: page on from the last key (skipped), as `omap_all` does.
    while more {
        let start = pairs.last().map(|(k, _)| k.clone()).unwrap_or_default();
        let op = ReadOp {
            steps: vec![ReadStep::OmapGetRange {
                start: start.clone(),
                end: None,
                max: OMAP_PAGE,
            }],
            snap,
        };
        let Some(ReadResult::Omap {
            pairs: page,
            more: m,
        }) = store.read_op(object, op).await?.pop()
        else {
            return Err(StoreError::Corrupt(format!(
                "an omap read of `{object}` returned the wrong result"
            )));
        };
        let fresh: Vec<_> = page
            .iter()
            .filter(|(k, _)| *k > start.as_slice())
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        if fresh.is_empty() && m {
            return Err(StoreError::Corrupt(format!(
                "omap paging of `{object}` made no progress"
            )));
        }
        pairs.extend(fresh);
        more = m;
    }
    Ok(Some(ObjectState::from_extents(stat.size, extents, pairs)))
}

/// Header-object omap keys that a backup carries, and a restore applies: not the snapshot
/// records, nor what says who writes or reads the source (its writer's client and address,
/// a removal underway). Carried, the source writer's record made the restored copy's first
/// writer fence that client, a live server of the source, if both were on one cluster.
fn carried(key: &[u8]) -> bool {
    !(key.starts_with(SNAPSHOT_KEY_PREFIX)
        || key == SNAP_SEQ_KEY
        || key == BACKUP_STATE_KEY
        || key == LAST_WRITER_KEY
        || key == LAST_WRITER_CLIENT_KEY
        || key == REMOVING_KEY
        || key == DELETING_KEY
        || key == FILLING_KEY
        || key == ROLLING_BACK_KEY
        || key == SHRINKING_KEY)
}

/// What a restore leaves recorded in the header object (`BACKUP_STATE_KEY`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct RestoredState {
    image_id: String,
    /// The snapshot whose content the image holds (`None`: a head backup's).
    snapshot_id: Option<SnapId>,
    snapshot: Option<String>,
    /// Set while an increment is being applied: the snapshot id it goes to.
    applying: Option<SnapId>,
    /// The uid of `snapshot_id`'s snapshot, when the backup carried one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot_uid: Option<String>,
}

/// Refuse an image an incremental restore left half-applied (`RestoredState::applying`), or
/// a delete, a rollback or an import half done (`DELETING_KEY`, `ROLLING_BACK_KEY`,
/// `FILLING_KEY`); the restore itself reads its header object directly, not through this. A
/// state that cannot be read (a store without omap: LUKS files) is no unfinished restore.
pub(crate) async fn refuse_unfinished_restore(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    image: &str,
) -> Result<(), ImageError> {
    refuse_unfinished(store, header_object, image, false, true, false).await
}

/// [`refuse_unfinished_restore`]; `filling`: the image is being filled by this process (just
/// created by `Image::create_to_fill`), so its `FILLING_KEY` is expected. `head`: what is
/// opened is the head; a snapshot is refused only while the image is deleted or filled, as a
/// rollback or an increment left unfinished changed the head alone (an unfinished rollback
/// refused even an export of a snapshot, the way to rescue its data). `finishing_shrink`: the
/// open is a resize's, which finishes a shrink left unfinished (`SHRINKING_KEY`).
pub(crate) async fn refuse_unfinished(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    image: &str,
    filling: bool,
    head: bool,
    finishing_shrink: bool,
) -> Result<(), ImageError> {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![
        BACKUP_STATE_KEY.to_vec(),
        DELETING_KEY.to_vec(),
        ROLLING_BACK_KEY.to_vec(),
        FILLING_KEY.to_vec(),
        SHRINKING_KEY.to_vec(),
    ]));
    let Ok(results) = store.read_op(header_object, op).await else {
        return Ok(());
    };
    let pairs = match results.into_iter().next() {
        Some(ReadResult::Omap { pairs, .. }) => pairs,
        _ => return Ok(()),
    };
    if pairs.iter().any(|(k, _)| k == DELETING_KEY) {
        return Err(ImageError::DeleteUnfinished {
            image: image.to_owned(),
        });
    }
    if let Some((_, what)) = pairs.iter().find(|(k, _)| *k == FILLING_KEY && !filling) {
        return Err(ImageError::FillUnfinished {
            image: image.to_owned(),
            what: String::from_utf8_lossy(what).into_owned(),
        });
    }
    if !head {
        return Ok(());
    }
    if let Some((_, size)) = pairs.iter().find(|(k, _)| *k == SHRINKING_KEY) {
        if !finishing_shrink {
            return Err(ImageError::ShrinkUnfinished {
                image: image.to_owned(),
                size: String::from_utf8_lossy(size).into_owned(),
            });
        }
    }
    if let Some((_, snapshot)) = pairs.iter().find(|(k, _)| *k == ROLLING_BACK_KEY) {
        return Err(ImageError::RollbackUnfinished {
            image: image.to_owned(),
            snapshot: String::from_utf8_lossy(snapshot).into_owned(),
        });
    }
    let state = pairs
        .iter()
        .find(|(k, _)| *k == BACKUP_STATE_KEY)
        .and_then(|(_, v)| serde_json::from_slice::<RestoredState>(v).ok());
    match state.and_then(|s| s.applying) {
        None => Ok(()),
        Some(id) => Err(ImageError::RestoreUnfinished {
            image: image.to_owned(),
            snapshot: format!("id {id}"),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Writing

/// The output file, hashed and counted as it is written.
struct Out<W: Write> {
    inner: W,
    hasher: Sha256,
    bytes: u64,
    records: u64,
    data_bytes: u64,
}

impl<W: Write> Out<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        self.inner.write_all(bytes)
    }

    fn start(inner: W, description: &BackupDescription) -> std::io::Result<Self> {
        let mut out = Out {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
            records: 0,
            data_bytes: 0,
        };
        let json = serde_json::to_vec(description).expect("a description serializes");
        let mut head = Vec::with_capacity(16 + json.len());
        head.extend_from_slice(BACKUP_MAGIC);
        head.extend_from_slice(&BACKUP_VERSION.to_le_bytes());
        head.extend_from_slice(&(json.len() as u32).to_le_bytes());
        head.extend_from_slice(&json);
        let crc = crc32fast::hash(&head);
        out.put(&head)?;
        out.put(&crc.to_le_bytes())?;
        Ok(out)
    }

    /// One record whose payload is `prefix`, then `object` (if any), then `suffix`.
    fn record(
        &mut self,
        kind: u8,
        prefix: &[u8],
        object: Option<&ObjectState>,
        suffix: &[u8],
    ) -> std::io::Result<()> {
        let len =
            prefix.len() as u64 + object.map_or(0, ObjectState::encoded_len) + suffix.len() as u64;
        let mut crc = crc32fast::Hasher::new();
        let mut head = [0u8; 9];
        head[0] = kind;
        head[1..].copy_from_slice(&len.to_le_bytes());
        crc.update(&head);
        self.put(&head)?;
        let mut result = Ok(());
        let mut emit = |bytes: &[u8]| {
            if result.is_ok() {
                crc.update(bytes);
                result = self.put(bytes);
            }
        };
        emit(prefix);
        if let Some(object) = object {
            object.encode(&mut emit);
        }
        emit(suffix);
        result?;
        self.put(&crc.finalize().to_le_bytes())?;
        self.records += 1;
        self.data_bytes += object.map_or(0, ObjectState::data_bytes);
        Ok(())
    }

    /// The trailer; returns the SHA-256 of everything before it.
    fn finish(mut self) -> std::io::Result<(W, u64, [u8; 32])> {
        let digest: [u8; 32] = self.hasher.clone().finalize().into();
        let mut payload = Vec::with_capacity(TRAILER_LEN as usize);
        payload.extend_from_slice(&self.records.to_le_bytes());
        payload.extend_from_slice(&digest);
        self.record(KIND_TRAILER, &payload, None, &[])?;
        self.inner.flush()?;
        Ok((self.inner, self.bytes, digest))
    }
}

/// The image being backed up: where it is and what its header says.
struct Source {
    image: String,
    store: Arc<dyn ObjectStore>,
    header_object: ObjectName,
    parsed: Parsed,
    table: SnapshotTable,
    /// What keeps the snapshots read from being removed meanwhile (`readers.rs`).
    reader_marks: Vec<ReaderHold>,
}

impl Source {
    /// Largest stored size of one data object (every layout stays within it).
    fn object_bound(&self) -> u64 {
        max_stored_object_len(
            self.parsed.params.object_size,
            self.parsed.sector_size,
            self.parsed.suite.metadata_len(),
        )
    }

    fn data_object(&self, n: u64) -> Result<ObjectName, ImageError> {
        object_name(
            &self.image,
            format!(
                "{}{n:016x}",
                data_object_prefix(&self.parsed.params.image_id)
            ),
        )
    }

    fn snapshot(&self, name: &str) -> Result<crate::SnapshotInfo, ImageError> {
        self.table
            .find(name)
            .cloned()
            .ok_or_else(|| ImageError::SnapshotNotFound {
                image: self.image.clone(),
                snapshot: name.to_owned(),
            })
    }
}

/// Refuse a LUKS file made by another tool: backups copy ivdisk images' objects.
fn refuse_luks_file(uri: &ImageUri, instead: &str) -> Result<(), ImageError> {
    match crate::foreign::luks_file_path(uri) {
        Some(path) => Err(ImageError::InvalidParameter {
            image: uri.to_string(),
            reason: format!(
                "{} is {}, not an ivdisk image; backups and restores are of ivdisk images: \
                 {instead}",
                path.display(),
                crate::foreign::describe_file(path)
            ),
        }),
        None => Ok(()),
    }
}

fn file_io(path: &Path, context: &str) -> impl FnOnce(std::io::Error) -> ImageError {
    let file = path.display().to_string();
    let context = context.to_owned();
    move |source| ImageError::BackupIo {
        file,
        context,
        source,
    }
}

/// `FILE.partial.PID`: where this process writes a backup before it is renamed to `FILE`.
/// The process id keeps two backups to one file apart: sharing `FILE.partial`, they wrote
/// into one inode, and the first renamed it to FILE and reported success while the second
/// still wrote into it.
pub fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".partial.{}", std::process::id()));
    PathBuf::from(name)
}

impl Image {
    /// Back up an ivdisk image (no passphrase needed) into the file `path`: written as
    /// `path.partial.PID`, renamed when complete; an existing `path` is refused unless
    /// `options.overwrite`. See the module documentation for what is copied.
    pub async fn backup(
        uri: &ImageUri,
        options: &BackupOptions,
        path: &Path,
        progress: impl FnMut(BackupProgress),
    ) -> Result<BackupSummary, ImageError> {
        refuse_luks_file(uri, "back it up as a file (`cp --sparse=always`), or convert it to an ivdisk image first (`ivdisk convert`)")?;
        let image = uri.to_string();
        // A snapshot is read without the writer lock, so also from a read-only directory or
        // beside a running writer; the head needs the lock (a store that can take it).
        let store = match options.snapshot {
            Some(_) => uri.open_store_read_only().await?,
            None => uri.open_store(false).await?,
        };
        let header_object = object_name(&image, header_object_name(uri.image_name()))?;
        if store
            .stat(&header_object)
            .await
            .map_err(ImageError::store(&image))?
            .is_none()
        {
            return Err(missing_header(store, uri, &image, "a backup").await);
        }
        // The snapshots read without the writer lock are kept from being removed meanwhile
        // (`readers.rs`); a name not in the table is refused by the backup itself.
        let mut marks = Vec::new();
        if options.snapshot.is_some() {
            let table = SnapshotTable::read(store.as_ref(), &header_object, &image).await?;
            for name in options.snapshot.iter().chain(&options.since) {
                if let Some(snap) = table.find(name) {
                    let shown = crate::uri::at_snapshot(&image, name);
                    let mark = crate::readers::mark_reader(
                        uri,
                        store.as_ref(),
                        &header_object,
                        &shown,
                        Some(snap.id),
                    )
                    .await?;
                    marks.extend(mark);
                }
            }
        }
        backup_in(image, store, header_object, marks, options, path, progress).await
    }

    /// [`Image::backup`] of the image `name` in an open store (see [`Image::open_on`]).
    pub async fn backup_on(
        store: Arc<dyn ObjectStore>,
        name: &str,
        options: &BackupOptions,
        path: &Path,
        progress: impl FnMut(BackupProgress),
    ) -> Result<BackupSummary, ImageError> {
        let header_object = object_name(name, header_object_name(name))?;
        backup_in(
            name.to_owned(),
            store,
            header_object,
            Vec::new(),
            options,
            path,
            progress,
        )
        .await
    }
}

async fn backup_in(
    image: String,
    store: Arc<dyn ObjectStore>,
    header_object: ObjectName,
    reader_marks: Vec<ReaderHold>,
    options: &BackupOptions,
    path: &Path,
    progress: impl FnMut(BackupProgress),
) -> Result<BackupSummary, ImageError> {
    let started = Instant::now();
    if !options.overwrite && path.exists() {
        return Err(ImageError::BackupFileExists {
            file: path.display().to_string(),
        });
    }
    let (header, _) = read_header(store.as_ref(), &header_object, &image).await?;
    let parsed = parse_header(&image, &header)?;
    if options.since.is_some() && options.snapshot.is_none() {
        // The head has no snapshot id: a restore could not mark it half-applied, and an
        // interrupted one opened as a mix of two states.
        return Err(ImageError::InvalidParameter {
            image,
            reason: "an incremental backup goes between two snapshots: name the newer one \
                     (IMAGE@SNAP) as well as --since"
                .into(),
        });
    }
    if options.since.is_some() && options.since == options.snapshot {
        return Err(ImageError::InvalidParameter {
            image,
            reason: "an incremental backup needs two different snapshots (--since names the one \
                     IMAGE@SNAP names)"
                .into(),
        });
    }
    // The head changes under a writer: hold the writer lock while reading it.
    let lock = match options.snapshot {
        Some(_) => None,
        None => Some(
            WriterLock::acquire(
                store.clone(),
                header_object.clone(),
                &image,
                DEFAULT_LOCK_DURATION,
                HolderRecord::Keep,
            )
            .await?,
        ),
    };
    let result = async {
        let mut parsed = parsed;
        if lock.is_some() {
            // A head an incremental restore left half applied is a mix of two states: it is
            // refused (as opens and snapshots refuse it), not backed up as a whole image.
            refuse_unfinished_restore(store.as_ref(), &header_object, &image).await?;
            // Read again under the lock: a resize just before it would have left the
            // description's size and the header's apart (a backup no restore accepts).
            let (header, _) = read_header(store.as_ref(), &header_object, &image).await?;
            parsed = parse_header(&image, &header)?;
            // Everything acknowledged before is what the backup reads.
            store.flush().await.map_err(ImageError::store(&image))?;
        }
        let table = SnapshotTable::read(store.as_ref(), &header_object, &image).await?;
        let source = Source {
            image: image.clone(),
            store: store.clone(),
            header_object: header_object.clone(),
            parsed,
            table,
            reader_marks,
        };
        write_file(&source, options, path, progress).await
    }
    .await;
    if let Some(lock) = lock {
        let released = lock.release().await;
        if result.is_ok() {
            released.map_err(ImageError::store(&image))?;
        }
    }
    let mut summary = result?;
    summary.seconds = started.elapsed().as_secs_f64();
    tracing::info!(image = %image, file = %path.display(), objects = summary.objects, bytes = summary.file_bytes, "backed up image");
    Ok(summary)
}

/// Write the backup to `path.partial.PID`, then rename it; the partial file goes on failure.
async fn write_file(
    source: &Source,
    options: &BackupOptions,
    path: &Path,
    progress: impl FnMut(BackupProgress),
) -> Result<BackupSummary, ImageError> {
    let partial = partial_path(path);
    // What backups to the same file killed outright left: each of up to the image's size.
    if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let prefix = format!("{}.partial.", name.to_string_lossy());
        for removed in crate::remove_abandoned_partials(dir, &prefix) {
            tracing::info!(file = %removed.display(), "removed the partial file of a backup that was killed");
        }
    }
    // The header's keyslots are in it: material for guessing a passphrase offline.
    // Created here, never reused: the 0600 applies, and a second backup to the same file in
    // this process is refused rather than written into the first one's.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&partial)
        .map_err(|e| {
            // The hint only where it applies: a missing or read-only directory got it too.
            let context = match e.kind() {
                std::io::ErrorKind::AlreadyExists => {
                    "creating it (it must not exist: another backup to the same file runs in \
                     this process, or one that was killed left it; remove it if none runs)"
                }
                _ => "creating it",
            };
            file_io(&partial, context)(e)
        })?;
    // Held while the backup runs: a later backup to the same file tells this one, still
    // being written, from one a killed backup left.
    crate::mark_partial_in_progress(&file);
    let written = write_backup(
        source,
        options,
        path,
        BufWriter::with_capacity(1 << 20, file),
        progress,
    )
    .await;
    let finished = written.and_then(|(writer, summary)| {
        let file = writer
            .into_inner()
            .map_err(|e| file_io(&partial, "writing it")(e.into_error()))?;
        file.sync_all().map_err(file_io(&partial, "syncing it"))?;
        drop(file);
        // A snapshot removed unseen while a watch was lost read as holes: a backup whose
        // watches are not held now (a break since was checked after the reads) is refused.
        if source
            .reader_marks
            .iter()
            .any(|mark| mark.held_unbroken().is_none())
        {
            return Err(ImageError::ReaderWatchLost {
                image: source.image.clone(),
                removed: None,
            });
        }
        if !options.overwrite && path.exists() {
            return Err(ImageError::BackupFileExists {
                file: path.display().to_string(),
            });
        }
        std::fs::rename(&partial, path)
            .map_err(file_io(path, "renaming the partial file to it"))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The rename is durable once the directory is.
            if let Ok(dir) = File::open(dir) {
                drop(dir.sync_all());
            }
        }
        Ok(summary)
    });
    if finished.is_err() {
        drop(std::fs::remove_file(&partial));
    }
    finished
}

async fn write_backup<W: Write>(
    source: &Source,
    options: &BackupOptions,
    path: &Path,
    writer: W,
    mut progress: impl FnMut(BackupProgress),
) -> Result<(W, BackupSummary), ImageError> {
    let image = &source.image;
    let store = source.store.as_ref();
    let parsed = &source.parsed;
    let io = |what: &str| file_io(&partial_path(path), what);
    let snap = options
        .snapshot
        .as_deref()
        .map(|name| source.snapshot(name))
        .transpose()?;
    let base = options
        .since
        .as_deref()
        .map(|name| source.snapshot(name))
        .transpose()?;
    if let (Some(base), Some(snap)) = (&base, &snap) {
        if base.id > snap.id {
            return Err(ImageError::InvalidParameter {
                image: image.clone(),
                reason: format!(
                    "--since {} is newer than {}: an increment goes from an older snapshot to a \
                     newer one",
                    base.name, snap.name
                ),
            });
        }
    }
    let size = snap.as_ref().map_or(parsed.size, |s| s.size);
    let read_snap = snap.as_ref().map(|s| s.id);
    let os = parsed.params.object_size;

    // The header object: its bytes (with the size of what is backed up) and carried omap.
    let (mut header, mut region) = read_header(store, &source.header_object, image).await?;
    if size != parsed.size {
        header
            .set_data_size(&mut region, Some(size))
            .map_err(ImageError::header(image))?;
    }
    let mut header_bytes = vec![0u8; region.len() as usize];
    region
        .read_at(0, &mut header_bytes)
        .map_err(|e| ImageError::Corrupt {
            image: image.clone(),
            reason: format!("reading the header region back: {e}"),
        })?;
    let omap = store
        .omap_all(&source.header_object)
        .await
        .map_err(ImageError::store(image))?
        .into_iter()
        .filter(|(k, _)| carried(k))
        .collect();
    let header_state = ObjectState {
        size: header_bytes.len() as u64,
        runs: block_runs(&header_bytes),
        omap,
    };
    drop(header_bytes);

    let description = BackupDescription {
        format: FORMAT_NAME.to_owned(),
        kind: if base.is_some() {
            BackupKind::Incremental
        } else {
            BackupKind::Full
        },
        image: image.clone(),
        image_id: hex::encode(parsed.params.image_id.0),
        suite: parsed.suite.name().to_owned(),
        layout: parsed.layout.name().to_owned(),
        sector_size: parsed.sector_size,
        object_size: os,
        size,
        snapshot: snap.as_ref().map(|s| s.name.clone()),
        snapshot_id: read_snap,
        snapshot_uid: snap.as_ref().and_then(|s| s.uid.clone()),
        created: now(),
        base: base.as_ref().map(|b| BackupBase {
            snapshot: b.name.clone(),
            snapshot_id: b.id,
            size: b.size,
            snapshot_uid: b.uid.clone(),
        }),
    };
    let mut out = Out::start(writer, &description).map_err(io("writing it"))?;
    out.record(KIND_HEADER, &[], Some(&header_state), &[])
        .map_err(io("writing it"))?;
    drop(header_state);

    // The data objects: those listed where the backup reads (the head or its snapshot) and,
    // for an increment, at its base (an object removed since is a change too). A store that
    // cannot list at a snapshot: every index.
    let objects = size.max(base.as_ref().map_or(0, |b| b.size)).div_ceil(os);
    let prefix = data_object_prefix(&parsed.params.image_id);
    let at: Vec<Option<SnapId>> = std::iter::once(read_snap)
        .chain(base.as_ref().map(|b| Some(b.id)))
        .collect();
    let indices: Vec<u64> = match objects {
        0 => Vec::new(),
        _ => listed_object_numbers(store, &prefix, &at, 0..=objects - 1)
            .await
            .map_err(ImageError::store(image))?
            .unwrap_or_else(|| (0..objects).collect()),
    };
    let total = indices.len() as u64;
    let bound = source.object_bound();
    let in_flight = (BYTES_IN_FLIGHT / bound.max(1)).clamp(2, IN_FLIGHT as u64) as usize;
    let base_snap = base.as_ref().map(|b| b.id);
    let mut reads = stream::iter(indices)
        .map(|n| async move {
            let object = source.data_object(n)?;
            let now = read_object(store, &object, read_snap, bound)
                .await
                .map_err(ImageError::store(image))?;
            let before = match base_snap {
                Some(id) => Some(
                    read_object(store, &object, Some(id), bound)
                        .await
                        .map_err(ImageError::store(image))?,
                ),
                None => None,
            };
            Ok::<_, ImageError>((n, now, before))
        })
        .buffered(in_flight);
    let (mut objects, mut removed, mut done) = (0u64, 0u64, 0u64);
    progress(BackupProgress {
        phase: BackupPhase::Reading,
        done,
        total,
    });
    while let Some(read) = reads.next().await {
        let (n, now, before) = read?;
        let index = n.to_le_bytes();
        match (now, before) {
            // Full backup: every object that exists.
            (Some(state), None) if base_snap.is_none() => {
                out.record(KIND_DATA, &index, Some(&state), &[])
                    .map_err(io("writing it"))?;
                objects += 1;
            }
            (None, None) => {}
            // Incremental: what differs from the base.
            (now, Some(before)) => {
                if now != before {
                    let digest = ObjectState::digest(before.as_ref());
                    match now {
                        Some(state) => {
                            out.record(KIND_DATA, &index, Some(&state), &digest)
                                .map_err(io("writing it"))?;
                            objects += 1;
                        }
                        None => {
                            out.record(KIND_REMOVED, &index, None, &digest)
                                .map_err(io("writing it"))?;
                            removed += 1;
                        }
                    }
                }
            }
            (Some(_), None) => unreachable!("base reads are made for every object of an increment"),
        }
        done += 1;
        if done % 16 == 0 || done == total {
            progress(BackupProgress {
                phase: BackupPhase::Reading,
                done,
                total,
            });
        }
    }
    drop(reads);
    // A snapshot removed while it was read reads as missing objects on RADOS: check it is
    // still there (with the same id) now that everything was read.
    if snap.is_some() || base.is_some() {
        let table = SnapshotTable::read(store, &source.header_object, image).await?;
        for s in snap.iter().chain(base.iter()) {
            if table.find(&s.name).map(|t| t.id) != Some(s.id) {
                return Err(ImageError::SnapshotNotFound {
                    image: image.clone(),
                    snapshot: s.name.clone(),
                });
            }
        }
        // A watch lost and registered again meanwhile: a removal that began unseen and has
        // not finished yet has removed the snapshot's objects before its record.
        if source
            .reader_marks
            .iter()
            .any(|mark| mark.held_unbroken() != Some(true))
        {
            for s in snap.iter().chain(base.iter()) {
                crate::readers::refuse_if_removing(
                    store,
                    &source.header_object,
                    &crate::uri::at_snapshot(image, &s.name),
                    Some(s.id),
                )
                .await?;
            }
        }
    }
    let data_bytes = out.data_bytes;
    let (writer, file_bytes, digest) = out.finish().map_err(io("writing it"))?;
    Ok((
        writer,
        BackupSummary {
            description,
            objects,
            removed,
            data_bytes,
            file_bytes,
            sha256: hex::encode(digest),
            seconds: 0.0,
        },
    ))
}

// ---------------------------------------------------------------------------------------------
// Reading

/// A record read from the file (payload checked against its CRC).
struct RawRecord {
    kind: u8,
    payload: Vec<u8>,
    /// Where it starts in the file.
    at: u64,
}

/// One record, decoded and checked.
enum Record {
    Header(ObjectState),
    Data {
        index: u64,
        state: ObjectState,
        /// Incremental: the object's state digest at the base.
        base: Option<[u8; 32]>,
    },
    Removed {
        index: u64,
        base: [u8; 32],
    },
    Trailer,
}

/// Reads a backup file, checking as it goes.
struct Reader<R: Read> {
    inner: R,
    file: String,
    hasher: Sha256,
    offset: u64,
    len: u64,
    records: u64,
    description: Option<BackupDescription>,
    /// Digest of everything before the trailer, once read.
    digest: Option<[u8; 32]>,
    last_index: Option<u64>,
    max_objects: u64,
    object_bound: u64,
}

impl<R: Read> Reader<R> {
    fn damaged(&self, reason: impl Into<String>) -> ImageError {
        ImageError::BackupDamaged {
            file: self.file.clone(),
            reason: reason.into(),
        }
    }

    fn read(&mut self, buf: &mut [u8], what: &str) -> Result<(), ImageError> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.inner.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(self.damaged(format!(
                        "it is truncated: it ends at byte {} inside {what} (a backup file is \
                         complete only with its trailer)",
                        self.offset + filled as u64
                    )))
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(ImageError::BackupIo {
                        file: self.file.clone(),
                        context: "reading it".into(),
                        source,
                    })
                }
            }
        }
        self.hasher.update(&buf[..]);
        self.offset += buf.len() as u64;
        Ok(())
    }

    fn u32(&mut self, what: &str) -> Result<u32, ImageError> {
        let mut b = [0u8; 4];
        self.read(&mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Open: magic, version, description.
    fn open(inner: R, file: String, len: u64) -> Result<Self, ImageError> {
        let mut reader = Reader {
            inner,
            file,
            hasher: Sha256::new(),
            offset: 0,
            len,
            records: 0,
            description: None,
            digest: None,
            last_index: None,
            max_objects: 0,
            object_bound: 0,
        };
        let mut magic = [0u8; 8];
        reader.read(&mut magic, "the magic")?;
        if &magic != BACKUP_MAGIC {
            return Err(reader.damaged(
                "it is not an ivdisk backup file (its first bytes are not the magic IVDISKBK)",
            ));
        }
        let mut crc = crc32fast::Hasher::new();
        crc.update(&magic);
        let version = reader.u32("the version")?;
        crc.update(&version.to_le_bytes());
        let len = reader.u32("the description's length")?;
        crc.update(&len.to_le_bytes());
        if len > MAX_DESCRIPTION {
            return Err(reader.damaged(format!(
                "its description is said to be {len} bytes long, more than any backup's"
            )));
        }
        let mut json = vec![0u8; len as usize];
        reader.read(&mut json, "the description")?;
        crc.update(&json);
        let stored = reader.u32("the description's checksum")?;
        if crc.finalize() != stored {
            return Err(reader.damaged(
                "the checksum of its description (bytes 0 to the first record) does not match: \
                 the file was damaged or changed",
            ));
        }
        if version != BACKUP_VERSION {
            return Err(reader.damaged(format!(
                "it is in backup format version {version}; this ivdisk reads version \
                 {BACKUP_VERSION}"
            )));
        }
        let description: BackupDescription = serde_json::from_slice(&json)
            .map_err(|e| reader.damaged(format!("its description does not parse: {e}")))?;
        reader.check_description(&description)?;
        let os = description.object_size;
        let suite: Suite = description.suite.parse().expect("checked");
        reader.object_bound =
            max_stored_object_len(os, description.sector_size, suite.metadata_len());
        reader.max_objects = description
            .size
            .max(description.base.as_ref().map_or(0, |b| b.size))
            .div_ceil(os);
        reader.description = Some(description);
        Ok(reader)
    }

    fn check_description(&self, d: &BackupDescription) -> Result<(), ImageError> {
        let bad = |what: String| Err(self.damaged(format!("its description is wrong: {what}")));
        if d.format != FORMAT_NAME {
            return bad(format!("format `{}` is not {FORMAT_NAME}", d.format));
        }
        if let Err(e) = d.image_id() {
            return bad(e);
        }
        let suite: Suite = match d.suite.parse() {
            Ok(s) => s,
            Err(e) => return bad(e.to_string()),
        };
        let layout: LayoutKind = match d.layout.parse() {
            Ok(l) => l,
            Err(e) => return bad(e),
        };
        if !layout.fits(suite.metadata_len()) {
            return bad(format!(
                "layout {layout} does not hold suite {suite}'s metadata"
            ));
        }
        if ![512, 4096].contains(&d.sector_size) {
            return bad(format!("sector size {}", d.sector_size));
        }
        let os = d.object_size;
        if !os.is_power_of_two() || !(4096..=crate::MAX_OBJECT_SIZE).contains(&os) {
            return bad(format!("object size {os}"));
        }
        let ss = u64::from(d.sector_size);
        let sizes = std::iter::once(d.size).chain(d.base.as_ref().map(|b| b.size));
        for size in sizes {
            if size == 0 || !size.is_multiple_of(ss) {
                return bad(format!("size {size} is not a positive multiple of {ss}"));
            }
        }
        if (d.kind == BackupKind::Incremental) != d.base.is_some() {
            return bad("an incremental backup needs a base snapshot, and only it".into());
        }
        if d.snapshot.is_some() != d.snapshot_id.is_some() {
            return bad("a snapshot without its id".into());
        }
        Ok(())
    }

    fn description(&self) -> &BackupDescription {
        self.description.as_ref().expect("read at open")
    }

    /// The next record, its CRC checked; the trailer's digest is taken before it.
    fn raw_record(&mut self) -> Result<RawRecord, ImageError> {
        let before = self.hasher.clone();
        let at = self.offset;
        let mut head = [0u8; 9];
        self.read(&mut head, &format!("record {}'s head", self.records))?;
        let kind = head[0];
        let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
        if len > MAX_RECORD || len > self.len.saturating_sub(self.offset) {
            return Err(self.damaged(format!(
                "record {} (at byte {at}) is said to be {len} bytes long, more than {}: the \
                 file is damaged or truncated",
                self.records,
                if len > MAX_RECORD {
                    "any record's".to_owned()
                } else {
                    format!(
                        "the {} bytes left in the file",
                        self.len.saturating_sub(self.offset)
                    )
                }
            )));
        }
        let mut payload = vec![0u8; len as usize];
        self.read(
            &mut payload,
            &format!("record {} (at byte {at})", self.records),
        )?;
        let stored = self.u32(&format!("record {}'s checksum", self.records))?;
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        crc.update(&payload);
        if crc.finalize() != stored {
            return Err(self.damaged(format!(
                "the checksum of record {} (at byte {at}) does not match: the file was damaged \
                 or changed",
                self.records
            )));
        }
        if kind == KIND_TRAILER {
            self.digest = Some(before.finalize().into());
        }
        Ok(RawRecord { kind, payload, at })
    }

    /// The next record, decoded, with the structure checked.
    fn record(&mut self) -> Result<Record, ImageError> {
        let raw = self.raw_record()?;
        let n = self.records;
        let incremental = self.description().kind == BackupKind::Incremental;
        let malformed = |reason: String| ImageError::BackupDamaged {
            file: self.file.clone(),
            reason: format!("record {n} (at byte {}) is malformed: {reason}", raw.at),
        };
        let mut cursor = Cursor {
            bytes: &raw.payload,
            at: 0,
        };
        let record = match raw.kind {
            KIND_HEADER => {
                if n != 0 {
                    return Err(malformed("a second header object".into()));
                }
                let state = cursor.object(MAX_HEADER_OBJECT).map_err(&malformed)?;
                Record::Header(state)
            }
            KIND_DATA | KIND_REMOVED => {
                if n == 0 {
                    return Err(malformed(
                        "the first record is not the header object".into(),
                    ));
                }
                let index = cursor.u64().map_err(&malformed)?;
                if index >= self.max_objects {
                    return Err(malformed(format!(
                        "object {index} lies past the image's end (it has {} objects)",
                        self.max_objects
                    )));
                }
                if self.last_index.is_some_and(|last| index <= last) {
                    return Err(malformed(format!(
                        "object {index} is out of order (after object {})",
                        self.last_index.unwrap_or_default()
                    )));
                }
                self.last_index = Some(index);
                if raw.kind == KIND_DATA {
                    let state = cursor.object(self.object_bound).map_err(&malformed)?;
                    let base = if incremental {
                        Some(cursor.digest().map_err(&malformed)?)
                    } else {
                        None
                    };
                    Record::Data { index, state, base }
                } else {
                    if !incremental {
                        return Err(malformed("a removed object in a full backup".into()));
                    }
                    Record::Removed {
                        index,
                        base: cursor.digest().map_err(&malformed)?,
                    }
                }
            }
            KIND_TRAILER => {
                if n == 0 {
                    return Err(malformed("no header object".into()));
                }
                let count = cursor.u64().map_err(&malformed)?;
                let digest = cursor.digest().map_err(&malformed)?;
                cursor.end().map_err(&malformed)?;
                if count != n {
                    return Err(self.damaged(format!(
                        "the trailer counts {count} records, the file holds {n}: records were \
                         removed or added"
                    )));
                }
                if Some(digest) != self.digest {
                    return Err(self.damaged(
                        "the SHA-256 in its trailer does not match its content: the file was \
                         damaged or changed",
                    ));
                }
                let mut extra = [0u8; 1];
                loop {
                    match self.inner.read(&mut extra) {
                        Ok(0) => break,
                        Ok(_) => {
                            return Err(self.damaged(format!(
                                "bytes follow its trailer (at byte {})",
                                self.offset
                            )))
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(source) => {
                            return Err(ImageError::BackupIo {
                                file: self.file.clone(),
                                context: "reading it".into(),
                                source,
                            })
                        }
                    }
                }
                return Ok(Record::Trailer);
            }
            other => return Err(malformed(format!("unknown record kind {other}"))),
        };
        cursor.end().map_err(&malformed)?;
        self.records += 1;
        Ok(record)
    }
}

/// Bounds-checked decoding of a payload.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| format!("it ends early (at payload byte {})", self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn digest(&mut self) -> Result<[u8; 32], String> {
        Ok(self.take(32)?.try_into().expect("32 bytes"))
    }
    fn end(&self) -> Result<(), String> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(format!("{} bytes too many", self.bytes.len() - self.at))
        }
    }
    fn object(&mut self, bound: u64) -> Result<ObjectState, String> {
        let size = self.u64()?;
        if size > bound {
            return Err(format!("an object of {size} bytes (at most {bound} fit)"));
        }
        let runs = self.u32()?;
        let mut state = ObjectState {
            size,
            ..ObjectState::default()
        };
        let mut end: Option<u64> = None;
        for _ in 0..runs {
            let offset = self.u64()?;
            let len = u64::from(self.u32()?);
            if len == 0
                || end.is_some_and(|end| offset < end)
                || offset.checked_add(len).is_none_or(|e| e > size)
            {
                return Err(format!(
                    "extent [{offset}, +{len}) overlaps another or lies outside the {size}-byte object"
                ));
            }
            // Runs as `block_runs` writes them: whole blocks (the last may end at the
            // object's end), with zero blocks between them. Why: a crafted file of 1-byte
            // runs, each held in its own buffer, took 24 times its size in memory (a restore
            // of 390 MB used 9 GB) while its bytes counted as a few megabytes in flight.
            let block = BLOCK as u64;
            let whole = offset % block == 0 && (len % block == 0 || offset + len == size);
            if !whole || end == Some(offset) {
                return Err(format!(
                    "extent [{offset}, +{len}) is not a run of whole {BLOCK}-byte blocks apart \
                     from the others, as backups are written"
                ));
            }
            end = Some(offset + len);
            state.runs.push((offset, self.take(len as usize)?.to_vec()));
        }
        // What any layout keeps in an object's omap: at most a key per 512-byte sector, and
        // the header's records. A record of empty pairs within the file's size limit (tens
        // of millions of them, gigabytes in memory) is refused before it is held.
        let pairs = self.u32()?;
        let most = bound / 512 + 1024;
        if u64::from(pairs) > most {
            return Err(format!(
                "{pairs} omap pairs in one object (at most {most} fit)"
            ));
        }
        for _ in 0..pairs {
            let klen = self.u32()? as usize;
            if klen > MAX_OMAP_KEY {
                return Err(format!("an omap key of {klen} bytes"));
            }
            let key = self.take(klen)?.to_vec();
            let vlen = self.u32()? as usize;
            if vlen > MAX_OMAP_VALUE {
                return Err(format!("an omap value of {vlen} bytes"));
            }
            let value = self.take(vlen)?.to_vec();
            if key.is_empty() || state.omap.last().is_some_and(|(last, _)| *last >= key) {
                return Err("omap keys are empty or out of order".into());
            }
            state.omap.push((key, value));
        }
        Ok(state)
    }
}

/// Open a backup file for a pass.
fn open_reader(path: &Path) -> Result<Reader<BufReader<File>>, ImageError> {
    let file = File::open(path).map_err(file_io(path, "opening it"))?;
    let len = file
        .metadata()
        .map_err(file_io(path, "reading its size"))?
        .len();
    Reader::open(
        BufReader::with_capacity(1 << 20, file),
        path.display().to_string(),
        len,
    )
}

/// What the checking pass learned.
struct Checked {
    description: BackupDescription,
    header: ObjectState,
    image_id: ImageId,
    objects: u64,
    removed: u64,
    data_bytes: u64,
    file_bytes: u64,
    digest: [u8; 32],
}

/// Read the whole file and check everything, creating nothing; stopped between records once
/// `stop` is set (`image` names the restore's target then: a check of a large file takes
/// minutes, and Ctrl-C went unheard through all of it).
fn check_file(
    path: &Path,
    progress: &mut dyn FnMut(BackupProgress),
    stop: (&AtomicBool, &str),
) -> Result<Checked, ImageError> {
    let mut reader = open_reader(path)?;
    let total = reader.len;
    let (mut header, mut objects, mut removed, mut data_bytes) = (None, 0, 0, 0);
    let mut reported = 0;
    loop {
        if stop.0.load(Ordering::Relaxed) {
            return Err(ImageError::Stopped {
                image: stop.1.to_owned(),
            });
        }
        match reader.record()? {
            Record::Header(state) => {
                data_bytes += state.data_bytes();
                header = Some(state);
            }
            Record::Data { state, .. } => {
                objects += 1;
                data_bytes += state.data_bytes();
            }
            Record::Removed { .. } => removed += 1,
            Record::Trailer => break,
        }
        if reader.offset - reported >= 64 << 20 {
            reported = reader.offset;
            progress(BackupProgress {
                phase: BackupPhase::Verifying,
                done: reader.offset,
                total,
            });
        }
    }
    progress(BackupProgress {
        phase: BackupPhase::Verifying,
        done: total,
        total,
    });
    let description = reader.description().clone();
    let header = header.expect("the first record is the header");
    let image_id = description.image_id().expect("checked at open");
    // The header object must be an ivdisk header saying what the description says.
    let bytes = MemoryHeaderIo(header.dense());
    let damaged = |reason: String| ImageError::BackupDamaged {
        file: path.display().to_string(),
        reason,
    };
    let parsed_header = Header::read(&bytes)
        .map_err(|e| damaged(format!("its header object does not read: {e}")))?;
    let parsed = parse_header(&description.image, &parsed_header)
        .map_err(|e| damaged(format!("its header object is not an ivdisk image's: {e}")))?;
    let agrees = parsed.params.image_id == image_id
        && parsed.suite.name() == description.suite
        && parsed.layout.name() == description.layout
        && parsed.sector_size == description.sector_size
        && parsed.params.object_size == description.object_size
        && parsed.size == description.size;
    if !agrees {
        return Err(damaged(
            "its header object and its description disagree (image id, suite, layout, sector \
             size, object size or size)"
                .into(),
        ));
    }
    Ok(Checked {
        description,
        header,
        image_id,
        objects,
        removed,
        data_bytes,
        file_bytes: reader.offset,
        digest: reader.digest.expect("the trailer was read"),
    })
}

// ---------------------------------------------------------------------------------------------
// Restoring

impl Image {
    /// Check a backup file completely (checksums, structure, header) without a store.
    pub fn verify_backup(path: &Path) -> Result<BackupSummary, ImageError> {
        let started = Instant::now();
        let checked = check_file(path, &mut |_| {}, (&AtomicBool::new(false), ""))?;
        Ok(summary_of(checked, started))
    }

    /// Restore a backup file into `uri` (any store): a full backup creates the image, which
    /// must not exist (nor any data object of its image id in that store); an incremental one
    /// updates an image restored from its base. The file is checked whole before anything is
    /// written; a failure removes what was written (full) or leaves an increment that can be
    /// applied again (incremental). No passphrase is needed.
    pub async fn restore_backup(
        path: &Path,
        uri: &ImageUri,
        progress: impl FnMut(BackupProgress),
    ) -> Result<BackupSummary, ImageError> {
        Image::restore_backup_until(path, uri, progress, &AtomicBool::new(false)).await
    }

    /// [`Image::restore_backup`], stopped with [`ImageError::Stopped`] between records once
    /// `stop` is set (the command line sets it on SIGINT and SIGTERM): as after any failure, a
    /// full restore then removes what it wrote, and an increment is resumed by running it
    /// again.
    pub async fn restore_backup_until(
        path: &Path,
        uri: &ImageUri,
        progress: impl FnMut(BackupProgress),
        stop: &AtomicBool,
    ) -> Result<BackupSummary, ImageError> {
        refuse_luks_file(
            uri,
            "restore into the address of a new image (a directory that does not exist yet)",
        )?;
        let image = uri.to_string();
        let name = uri.image_name().to_owned();
        let mut progress = progress;
        let started = Instant::now();
        // Checked before the store is opened: a bad file creates nothing, not even a
        // local store directory.
        let checked = check_file(path, &mut progress, (stop, &image))?;
        let create = checked.description.kind == BackupKind::Full;
        let store = match uri.open_store(create).await {
            // An increment goes onto the image its earlier backups were restored into.
            Err(ImageError::NotFound { .. }) if !create => {
                return Err(ImageError::InvalidParameter {
                    image: image.clone(),
                    reason: format!(
                        "{} is an incremental backup (the changes since snapshot `{}`): it \
                         applies onto the image that the backups before it were restored \
                         into, and there is no image here; restore the full backup into it \
                         first, then the increments in order",
                        path.display(),
                        checked
                            .description
                            .base
                            .as_ref()
                            .map_or("?", |b| b.snapshot.as_str())
                    ),
                })
            }
            other => other?,
        };
        restore_checked(image, store, &name, path, checked, progress, started, stop).await
    }

    /// [`Image::restore_backup`] into the image `name` of an open store.
    pub async fn restore_backup_on(
        path: &Path,
        store: Arc<dyn ObjectStore>,
        name: &str,
        progress: impl FnMut(BackupProgress),
    ) -> Result<BackupSummary, ImageError> {
        let mut progress = progress;
        let started = Instant::now();
        let checked = check_file(path, &mut progress, (&AtomicBool::new(false), name))?;
        restore_checked(
            name.to_owned(),
            store,
            name,
            path,
            checked,
            progress,
            started,
            &AtomicBool::new(false),
        )
        .await
    }
}

fn summary_of(checked: Checked, started: Instant) -> BackupSummary {
    BackupSummary {
        description: checked.description,
        objects: checked.objects,
        removed: checked.removed,
        data_bytes: checked.data_bytes,
        file_bytes: checked.file_bytes,
        sha256: hex::encode(checked.digest),
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// The target of a restore.
struct Target<'a> {
    image: &'a str,
    store: &'a Arc<dyn ObjectStore>,
    prefix: String,
    header_object: ObjectName,
    /// Snapshot context of the target's own snapshots (increments only).
    context: Option<SnapContext>,
    /// Set: stop between records ([`Image::restore_backup_until`]).
    stop: &'a AtomicBool,
}

impl Target<'_> {
    fn data_object(&self, n: u64) -> Result<ObjectName, ImageError> {
        object_name(self.image, format!("{}{n:016x}", self.prefix))
    }
}

// (The two public entries differ in how they name the image and where the store comes from;
// the rest is the restore's own state.)
#[allow(clippy::too_many_arguments)]
async fn restore_checked(
    image: String,
    store: Arc<dyn ObjectStore>,
    name: &str,
    path: &Path,
    checked: Checked,
    progress: impl FnMut(BackupProgress),
    started: Instant,
    stop: &AtomicBool,
) -> Result<BackupSummary, ImageError> {
    let target = Target {
        image: &image,
        store: &store,
        prefix: data_object_prefix(&checked.image_id),
        header_object: object_name(&image, header_object_name(name))?,
        context: None,
        stop,
    };
    match checked.description.kind {
        BackupKind::Full => restore_full(target, path, &checked, progress).await?,
        BackupKind::Incremental => apply_increment(target, path, &checked, progress).await?,
    }
    tracing::info!(image = %image, file = %path.display(), objects = checked.objects, "restored backup");
    Ok(summary_of(checked, started))
}

/// The second pass: the records again, each handed to `apply` (at most `IN_FLIGHT` and
/// `BYTES_IN_FLIGHT` at a time); the file must be the one checked (same SHA-256). Returns
/// the names `apply` reported created, also on failure (for the cleanup). `reads` is what
/// `apply` holds besides the record's own state for each record it is given (an increment
/// reads the target's object whole, removed or not: uncounted, 32 of them at once took
/// gigabytes for an increment of a few kilobytes that removed 64 MiB objects).
async fn replay<F, Fut>(
    target: &Target<'_>,
    path: &Path,
    checked: &Checked,
    progress: &mut dyn FnMut(BackupProgress),
    apply: F,
    reads: u64,
    created: &mut Vec<ObjectName>,
) -> Result<(), ImageError>
where
    F: Fn(Record) -> Fut,
    Fut: std::future::Future<Output = (Option<ObjectName>, u64, Result<(), ImageError>)>,
{
    let mut reader = open_reader(path)?;
    let total = reader.len;
    let mut pending = FuturesUnordered::new();
    let mut bytes_in_flight = 0u64;
    let mut first_error = None;
    let mut finish = |done: (Option<ObjectName>, u64, Result<(), ImageError>),
                      bytes_in_flight: &mut u64,
                      first_error: &mut Option<ImageError>| {
        let (name, bytes, result) = done;
        *bytes_in_flight -= bytes + reads;
        if let Some(name) = name {
            created.push(name);
        }
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    };
    let mut reported = 0;
    loop {
        while pending.len() >= IN_FLIGHT
            || (bytes_in_flight >= BYTES_IN_FLIGHT && !pending.is_empty())
        {
            let done = pending.next().await.expect("not empty");
            finish(done, &mut bytes_in_flight, &mut first_error);
        }
        if first_error.is_some() {
            break;
        }
        if target.stop.load(Ordering::Relaxed) {
            first_error = Some(ImageError::Stopped {
                image: target.image.to_owned(),
            });
            break;
        }
        let record = match reader.record() {
            Ok(Record::Trailer) => break,
            Ok(Record::Header(_)) => continue,
            Ok(record) => record,
            Err(e) => {
                first_error = Some(e);
                break;
            }
        };
        let bytes = match &record {
            Record::Data { state, .. } => state.held_bytes(),
            _ => 0,
        };
        bytes_in_flight += bytes + reads;
        pending.push(apply(record));
        if reader.offset - reported >= 16 << 20 {
            reported = reader.offset;
            progress(BackupProgress {
                phase: BackupPhase::Writing,
                done: reader.offset,
                total,
            });
        }
    }
    while let Some(done) = pending.next().await {
        finish(done, &mut bytes_in_flight, &mut first_error);
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    if reader.digest != Some(checked.digest) {
        return Err(reader.damaged("it changed while it was being restored"));
    }
    progress(BackupProgress {
        phase: BackupPhase::Writing,
        done: total,
        total,
    });
    Ok(())
}

/// Refuse a target that holds the image or data objects of its id.
async fn check_empty_target(target: &Target<'_>, image_id: &ImageId) -> Result<(), ImageError> {
    let image = target.image;
    if target
        .store
        .stat(&target.header_object)
        .await
        .map_err(ImageError::store(image))?
        .is_some()
    {
        return Err(ImageError::Exists {
            image: image.to_owned(),
        });
    }
    let existing = target
        .store
        .list(&target.prefix)
        .await
        .map_err(ImageError::store(image))?;
    if !existing.is_empty() {
        return Err(ImageError::DataObjectsExist {
            image: image.to_owned(),
            prefix: target.prefix.clone(),
            count: existing.len(),
        });
    }
    // An image of the same id without data objects yet (never written, or all discarded):
    // restored beside it, both names would share the data objects written from then on.
    let other = crate::header_backup::other_header_with_id(
        target.store.as_ref(),
        image,
        &target.header_object,
        image_id,
    )
    .await?;
    if let Some(other) = other {
        return Err(ImageError::HeaderIdInUse {
            image: image.to_owned(),
            other: other.to_string(),
            image_id: *image_id,
        });
    }
    Ok(())
}

async fn restore_full(
    target: Target<'_>,
    path: &Path,
    checked: &Checked,
    mut progress: impl FnMut(BackupProgress),
) -> Result<(), ImageError> {
    let image = target.image;
    let store = target.store;
    check_empty_target(&target, &checked.image_id).await?;
    let mut created = Vec::new();
    // The header object first, marked as being filled (`FILLING_KEY`, as an import's): every
    // open refuses the image until the mark goes, and a restore killed part-way leaves an
    // image `ivdisk delete` removes. With the header written last, a killed restore left
    // data objects no command could see or remove (hundreds of megabytes), and a second try
    // was refused over them. (Backups made before the writer's records were left out may
    // carry them: dropped here.)
    let mut header_state = checked.header.clone();
    header_state.omap.retain(|(k, _)| carried(k));
    let mut op = WriteOp::new().step(WriteStep::CreateExclusive);
    header_state.write_steps(&mut op);
    let state = RestoredState {
        image_id: checked.description.image_id.clone(),
        snapshot_id: checked.description.snapshot_id,
        snapshot: checked.description.snapshot.clone(),
        applying: None,
        snapshot_uid: checked.description.snapshot_uid.clone(),
    };
    op.steps.push(WriteStep::OmapSet(
        vec![
            (
                BACKUP_STATE_KEY.to_vec(),
                serde_json::to_vec(&state).expect("serializes"),
            ),
            (
                FILLING_KEY.to_vec(),
                format!("a restore of {}", path.display()).into_bytes(),
            ),
        ]
        .into(),
    ));
    let header = match store.write_op(&target.header_object, op).await {
        Ok(_) => {
            created.push(target.header_object.clone());
            Ok(())
        }
        Err(StoreError::Exists { .. }) => {
            return Err(ImageError::Exists {
                image: image.to_owned(),
            })
        }
        Err(e) => {
            // Maybe applied (a timeout): removed in the cleanup if it is there.
            created.push(target.header_object.clone());
            Err(ImageError::store(image)(e))
        }
    };
    let target_ref = &target;
    // Held from the header's creation to the end: `lock status` names the restore's process,
    // and `delete` (which the unfinished image's message suggests once that process is gone)
    // is refused while it runs. Without it, a delete removed the image under a running
    // restore, which then failed saying only that its header did not exist.
    let mut lock = None;
    let header = async {
        header?;
        lock = Some(
            WriterLock::acquire(
                store.clone(),
                target.header_object.clone(),
                image,
                DEFAULT_LOCK_DURATION,
                HolderRecord::Keep,
            )
            .await?,
        );
        // The mark durable before any data: on RADOS nothing orders writes to two objects.
        store.flush().await.map_err(ImageError::store(image))?;
        replay(
            target_ref,
            path,
            checked,
            &mut progress,
            |record| async move {
                let Record::Data { index, state, .. } = record else {
                    unreachable!("a full backup holds data objects only");
                };
                let bytes = state.held_bytes();
                let object = match target_ref.data_object(index) {
                    Ok(o) => o,
                    Err(e) => return (None, bytes, Err(e)),
                };
                let mut op = WriteOp::new().step(WriteStep::CreateExclusive);
                state.write_steps(&mut op);
                match store.write_op(&object, op).await {
                    Ok(_) => (Some(object), bytes, Ok(())),
                    // Someone else's object (another restore racing this one): not ours to
                    // remove.
                    Err(e @ StoreError::Exists { .. }) => {
                        (None, bytes, Err(ImageError::store(image)(e)))
                    }
                    // Maybe applied (a timeout): removed in the cleanup if it is there.
                    Err(e) => (Some(object), bytes, Err(ImageError::store(image)(e))),
                }
            },
            0,
            &mut created,
        )
        .await?;
        // The data durable first, then the mark removed, durably: only now does the image
        // open.
        store.flush().await.map_err(ImageError::store(image))?;
        let op = WriteOp::new()
            .step(WriteStep::AssertExists)
            .step(WriteStep::OmapRemoveKeys(vec![FILLING_KEY.to_vec()]));
        store
            .write_op(&target.header_object, op)
            .await
            .map_err(ImageError::store(image))?;
        store.flush().await.map_err(ImageError::store(image))
    }
    .await;
    // Released before a cleanup removes the header: best effort (it expires otherwise).
    if let Some(lock) = lock {
        if let Err(e) = lock.release().await {
            tracing::warn!(image, error = %e, "releasing the restore's writer lock");
        }
    }
    if let Err(e) = header {
        // The data first, and the header only once all of it is gone: the header, marked
        // unfinished, is refused by every open, and `ivdisk delete` removes the image with
        // it. Removed first, a header left data objects behind whenever the store failed
        // the cleanup too (OSDs down), which no command saw or removed, and a second
        // restore was refused over them.
        let header_object = &target.header_object;
        let had_header = created.contains(header_object);
        created.retain(|o| o != header_object);
        let all_removed = remove_objects(store.as_ref(), &created).await;
        if had_header {
            if !all_removed {
                tracing::warn!(
                    image,
                    "some data objects of the failed restore could not be removed: its header \
                     is kept, marked unfinished; delete the image (`ivdisk delete`) once the \
                     store works, to remove both"
                );
                return Err(e);
            }
            match store.remove(header_object).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                // Gone anyway (the removal went through and its answer was lost)?
                Err(removal) => {
                    if !matches!(store.stat(header_object).await, Ok(None)) {
                        tracing::warn!(
                            image,
                            error = %removal,
                            "the failed restore's header could not be removed (it is marked \
                             unfinished: no open accepts it); delete the image (`ivdisk \
                             delete`) to remove it"
                        );
                    }
                }
            }
            drop(store.flush().await);
        }
        return Err(e);
    }
    Ok(())
}

/// Remove what a failed restore wrote (best effort: failures are logged); whether every one
/// is gone.
async fn remove_objects(store: &dyn ObjectStore, objects: &[ObjectName]) -> bool {
    let mut removals = stream::iter(objects)
        .map(|o| async move {
            match store.remove(o).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => true,
                Err(e) => {
                    tracing::warn!(object = %o, error = %e, "removing an object of a failed restore");
                    false
                }
            }
        })
        .buffer_unordered(IN_FLIGHT);
    let mut all = true;
    while let Some(removed) = removals.next().await {
        all &= removed;
    }
    drop(store.flush().await);
    all
}

/// The object's current state and version at the head of the target (`None`: absent).
async fn current(
    store: &dyn ObjectStore,
    object: &ObjectName,
    bound: u64,
) -> Result<Option<(ObjectState, u64)>, StoreError> {
    let Some(stat) = store.stat(object).await? else {
        return Ok(None);
    };
    let Some(state) = read_object(store, object, None, bound).await? else {
        return Ok(None);
    };
    Ok(Some((state, stat.version)))
}

async fn apply_increment(
    mut target: Target<'_>,
    path: &Path,
    checked: &Checked,
    mut progress: impl FnMut(BackupProgress),
) -> Result<(), ImageError> {
    let image = target.image.to_owned();
    let store = target.store.clone();
    let d = &checked.description;
    let base = d.base.as_ref().expect("an increment has a base");
    let mismatch = |reason: String| ImageError::IncrementalMismatch {
        image: image.clone(),
        reason,
    };
    // No image there: what to restore first, not "create it" (an empty image takes no
    // increment).
    let (header, _) = match read_header(store.as_ref(), &target.header_object, &image).await {
        Err(ImageError::NotFound { .. }) => {
            return Err(mismatch(format!(
                "there is no image here; an increment applies onto the image restored from a \
                 backup of snapshot `{}` (restore that full backup, and the increments up to \
                 it, first)",
                base.snapshot
            )))
        }
        other => other?,
    };
    let parsed = parse_header(&image, &header)?;
    if parsed.params.image_id != checked.image_id {
        return Err(mismatch(format!(
            "it is of image id {}, this image has id {}",
            d.image_id,
            hex::encode(parsed.params.image_id.0)
        )));
    }
    // Held while the increment goes in: nothing else writes.
    let lock = WriterLock::acquire(
        store.clone(),
        target.header_object.clone(),
        &image,
        DEFAULT_LOCK_DURATION,
        HolderRecord::Keep,
    )
    .await?;
    let result = async {
        let (header, region) = read_header(store.as_ref(), &target.header_object, &image).await?;
        let parsed = parse_header(&image, &header)?;
        let omap = store
            .omap_all(&target.header_object)
            .await
            .map_err(ImageError::store(&image))?;
        let state: Option<RestoredState> = omap
            .iter()
            .find(|(k, _)| k == BACKUP_STATE_KEY)
            .and_then(|(_, v)| serde_json::from_slice(v).ok());
        let Some(mut state) = state else {
            return Err(mismatch(
                "this image was not restored from a backup (its header records no backup state)"
                    .into(),
            ));
        };
        let resuming = state.applying == d.snapshot_id && d.snapshot_id.is_some();
        if state.image_id != d.image_id {
            return Err(mismatch(
                "the recorded backup state is of another image".into(),
            ));
        }
        // Another increment from the same base stopped part-way: this one would check only
        // the objects it changes, and leave the other's writes to the rest in place.
        if let Some(applying) = state.applying.filter(|_| !resuming) {
            return Err(ImageError::RestoreUnfinished {
                image: image.clone(),
                snapshot: format!("id {applying}"),
            });
        }
        // Checked when resuming too: until the final header write the state still names the
        // base the interrupted increment started from, and its size is the base's; without
        // them an increment from another base (b→c after a→c stopped, both ending at c) went
        // on as the "same" one, checked only the objects it changes, and left the rest at a.
        if state.snapshot_id != Some(base.snapshot_id) {
            return Err(mismatch(format!(
                "it goes from snapshot `{}` (id {}), but this image holds {}",
                base.snapshot,
                base.snapshot_id,
                match (&state.snapshot, state.snapshot_id) {
                    (Some(name), Some(id)) => format!("snapshot `{name}` (id {id})"),
                    _ => "a backup of the head (no snapshot)".into(),
                }
            )));
        }
        // The same id is not the same snapshot: ids start at 1 in every local store, and
        // copies restored from one backup share the image id. A base taken on another copy
        // (a mirror fed increments of a sibling restored from the same backup) passed, and
        // only the objects the increment changes were checked and written.
        if let (Some(here), Some(there)) = (&state.snapshot_uid, &base.snapshot_uid) {
            if here != there {
                return Err(mismatch(format!(
                    "it goes from snapshot `{}` (id {}) of another copy of the image than the \
                     one this image was restored from (the snapshots' uids differ)",
                    base.snapshot, base.snapshot_id
                )));
            }
        }
        if parsed.size != base.size {
            return Err(mismatch(format!(
                "snapshot `{}` was {} bytes, this image is {} bytes (resized since its restore)",
                base.snapshot, base.size, parsed.size
            )));
        }
        drop(region);
        target.context = SnapshotTable::read(store.as_ref(), &target.header_object, &image)
            .await?
            .context();
        let bound =
            max_stored_object_len(d.object_size, d.sector_size, parsed.suite.metadata_len());
        let target_ref = &target;
        let store_ref = &store;
        let image_ref = &image;
        let mut touched = Vec::new();
        // Each record reads the target's object whole (`current`): a dense copy of up to
        // `bound` bytes, and its runs.
        let target_reads = 2 * bound;
        // Two passes: every object is checked against the base before anything is written
        // (a refused increment changes nothing), then written.
        let apply = |write: bool| {
            move |record| async move {
                let (index, new, base_digest) = match record {
                    Record::Data { index, state, base } => (
                        index,
                        Some(state),
                        base.expect("an increment's records have a base"),
                    ),
                    Record::Removed { index, base } => (index, None, base),
                    _ => unreachable!("header and trailer are not replayed"),
                };
                let bytes = new.as_ref().map_or(0, ObjectState::held_bytes);
                let result = async {
                    let object = target_ref.data_object(index)?;
                    let now = current(store_ref.as_ref(), &object, bound)
                        .await
                        .map_err(ImageError::store(image_ref))?;
                    let now_digest = ObjectState::digest(now.as_ref().map(|(s, _)| s));
                    if now_digest == ObjectState::digest(new.as_ref()) {
                        // Already there (an increment applied again after an interruption).
                        return Ok(());
                    }
                    if now_digest != base_digest {
                        return Err(ImageError::IncrementalMismatch {
                            image: image_ref.clone(),
                            reason: format!(
                                "data object {index} is not in the state of the base snapshot \
                                 (the image was written after its restore): restore a full \
                                 backup instead"
                            ),
                        });
                    }
                    if !write {
                        return Ok(());
                    }
                    let mut op = WriteOp::new();
                    op.snap_context = target_ref.context.clone();
                    match (&now, &new) {
                        (None, None) => return Ok(()),
                        (None, Some(new)) => {
                            op.steps.push(WriteStep::CreateExclusive);
                            new.write_steps(&mut op);
                        }
                        (Some((_, version)), None) => {
                            op.steps.push(WriteStep::AssertVersion(*version));
                            op.steps.push(WriteStep::Remove);
                        }
                        (Some((old, version)), Some(new)) => {
                            op.steps.push(WriteStep::AssertVersion(*version));
                            op.steps.push(WriteStep::Truncate(0));
                            if !old.omap.is_empty() {
                                op.steps.push(WriteStep::OmapRemoveKeys(
                                    old.omap.iter().map(|(k, _)| k.clone()).collect(),
                                ));
                            }
                            new.write_steps(&mut op);
                        }
                    }
                    store_ref
                        .write_op(&object, op)
                        .await
                        .map_err(ImageError::store(image_ref))?;
                    Ok(())
                }
                .await;
                (None, bytes, result)
            }
        };
        replay(
            &target,
            path,
            checked,
            &mut |_| {},
            apply(false),
            target_reads,
            &mut touched,
        )
        .await?;
        // Mark the image as being brought forward (an interruption can be resumed).
        state.applying = d.snapshot_id;
        store
            .write_op(
                &target.header_object,
                WriteOp::new().step(WriteStep::AssertExists).omap_set(vec![(
                    BACKUP_STATE_KEY.to_vec(),
                    serde_json::to_vec(&state).expect("serializes"),
                )]),
            )
            .await
            .map_err(ImageError::store(&image))?;
        // The header's bytes as marked: a keyslot change or a header restore meanwhile
        // changes them (the object's version alone also moves with the lock's renewals on
        // RADOS, every 10 s, which failed every increment that took longer).
        let marked_header = HeaderRegion::read(store.as_ref(), &target.header_object)
            .await
            .map_err(ImageError::store(&image))?
            .map(|region| region.digest());
        // The marker durable before any data changes: lost in a crash (or a failed group
        // commit) after some of them, the image would open as a mix of two states.
        store.flush().await.map_err(ImageError::store(&image))?;
        // A failure from here on leaves objects changed: errors that would say "nothing was
        // restored" or "nothing was changed" say what is true instead.
        replay(
            &target,
            path,
            checked,
            &mut progress,
            apply(true),
            target_reads,
            &mut touched,
        )
        .await
        .map_err(|e| match e {
            ImageError::BackupDamaged { file, reason } => ImageError::IncrementStopped {
                image: image.clone(),
                reason: format!("backup file {file}: {reason}"),
            },
            ImageError::IncrementalMismatch { reason, .. } => ImageError::IncrementStopped {
                image: image.clone(),
                reason,
            },
            other => other,
        })?;
        // The data durable before the header that says it is there (as a full restore does):
        // a store that acknowledges writes before its group commit may still lose them, and
        // a header naming the new snapshot over them would refuse the increment's retry.
        store.flush().await.map_err(ImageError::store(&image))?;
        // The header last: the new size and keyslots, the carried omap, the new state.
        let mut op = WriteOp::new();
        op.steps.push(WriteStep::Truncate(0));
        let mut header_state = checked.header.clone();
        header_state.omap.retain(|(k, _)| carried(k));
        // The nonce count only goes up: the larger of the image's and the backup's.
        let count = |pairs: &[(Vec<u8>, Vec<u8>)]| {
            pairs
                .iter()
                .find(|(k, _)| k == NONCE_KEY)
                .and_then(|(_, v)| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
        };
        if let Some(max) = count(&omap).max(count(&header_state.omap)) {
            header_state.omap.retain(|(k, _)| k != NONCE_KEY);
            header_state
                .omap
                .push((NONCE_KEY.to_vec(), max.to_string().into_bytes()));
            header_state.omap.sort();
        }
        header_state.write_steps(&mut op);
        state.snapshot_id = d.snapshot_id;
        state.snapshot = d.snapshot.clone();
        state.snapshot_uid = d.snapshot_uid.clone();
        state.applying = None;
        op.steps.push(WriteStep::OmapSet(
            vec![(
                BACKUP_STATE_KEY.to_vec(),
                serde_json::to_vec(&state).expect("serializes"),
            )]
            .into(),
        ));
        let stored = match marked_header {
            Some(marked) => write_unless_header_changed(
                store.as_ref(),
                &target.header_object,
                &marked,
                None,
                &op.steps,
            )
            .await
            .map_err(ImageError::store(&image))?,
            None => false,
        };
        if !stored {
            return Err(ImageError::HeaderChanged {
                image: image.clone(),
            });
        }
        store.flush().await.map_err(ImageError::store(&image))
    }
    .await;
    let released = lock.release().await;
    result?;
    released.map_err(ImageError::store(&image))
}
