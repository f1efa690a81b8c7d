//! Snapshots of an image: the store's self-managed snapshots (RADOS' model, which every
//! backend implements) over the image's data objects, named and recorded in the header
//! object's omap.
//!
//! - A snapshot is a store snapshot id plus the image size at that moment, under the omap key
//!   `ivdisk.snap.NAME` of the header object; `ivdisk.snap_seq` keeps the newest id ever
//!   allocated (the snapshot context's `seq` must never go back, even after a removal).
//! - Every data write of a writable image carries the snapshot context (newest id, live ids):
//!   the store preserves an object's state for the snapshots taken since its last write
//!   before changing it (copy-on-write), so writes after a snapshot never change what the
//!   snapshot reads.
//! - Nothing cryptographic changes: a snapshot keeps the ciphertext and metadata as written,
//!   and every later write draws a fresh IV. That is the point of the paper: with random IVs,
//!   versions of a sector kept side by side share nothing (tests/snapshots.rs shows it, and
//!   shows the deterministic leak of `aes-xts-plain64`).
//! - Create, remove and rollback take the image's writer lock: they run on an image that no
//!   one has open for writing (a writer would keep writing under its old snapshot context),
//!   or through [`Image::create_snapshot`] on the open image itself.
//! - The header (keyslots, passphrases) is not snapshotted: a passphrase change applies to
//!   every snapshot, whose data is under the same volume key.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use futures_util::stream::{self, StreamExt};
use ivdisk_store::{
    ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, SnapContext, SnapId, StoreError,
    WriteOp, WriteStep,
};

use crate::allocation::listed_object_numbers;
use crate::backup::{BACKUP_STATE_KEY, ROLLING_BACK_KEY};
use crate::image::{
    data_object_prefix, header_object_name, object_name, parse_header, read_header, Parsed,
};
use crate::writer_lock::{HolderRecord, WriterLock};
use crate::{Image, ImageError, ImageUri, DEFAULT_LOCK_DURATION};

/// Omap key prefix of the snapshot records in the header object.
pub(crate) const SNAPSHOT_KEY_PREFIX: &[u8] = b"ivdisk.snap.";
/// One past the prefix (`.` + 1 = `/`), the end of the records' key range.
const SNAPSHOT_KEY_END: &[u8] = b"ivdisk.snap/";
/// The newest snapshot id ever allocated for the image.
pub(crate) const SNAP_SEQ_KEY: &[u8] = b"ivdisk.snap_seq";
/// Longest snapshot name, in bytes.
pub const MAX_SNAPSHOT_NAME: usize = 128;
/// Object operations kept in flight by a rollback.
const ROLLBACK_IN_FLIGHT: usize = 32;

/// A snapshot of an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    /// The store's snapshot id (larger is newer).
    pub id: SnapId,
    /// The image's size when the snapshot was taken (what the snapshot reads as).
    pub size: u64,
    /// When it was taken, in seconds since the Unix epoch.
    pub created: u64,
    /// 32 random hex digits given at creation (`None` for snapshots taken before there were
    /// any): what tells this snapshot from another of the same id in another store, which
    /// an incremental restore must (ids start at 1 in every local store, and copies of an
    /// image restored from one backup share its image id).
    pub uid: Option<String>,
}

/// Check a snapshot name: 1 to 128 printable ASCII bytes without spaces, `/` or `@`.
pub(crate) fn check_name(image: &str, name: &str) -> Result<(), ImageError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SNAPSHOT_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'@');
    if ok {
        Ok(())
    } else {
        Err(ImageError::InvalidParameter {
            image: image.to_owned(),
            reason: format!(
                "snapshot name `{}` is not 1 to {MAX_SNAPSHOT_NAME} printable ASCII characters without spaces, '/' or '@'",
                name.escape_debug()
            ),
        })
    }
}

fn record_key(name: &str) -> Vec<u8> {
    [SNAPSHOT_KEY_PREFIX, name.as_bytes()].concat()
}

fn encode(info: &SnapshotInfo) -> Vec<u8> {
    let mut text = format!("id={} size={} created={}", info.id, info.size, info.created);
    if let Some(uid) = &info.uid {
        text.push_str(&format!(" uid={uid}"));
    }
    text.into_bytes()
}

/// A new snapshot's uid: 16 random bytes in hex.
fn new_uid(image: &str) -> Result<String, ImageError> {
    let mut bytes = [0u8; 16];
    ivdisk_crypto::fill_random(&mut bytes).map_err(ImageError::crypto(image))?;
    Ok(hex::encode(bytes))
}

fn decode(image: &str, key: &[u8], value: &[u8]) -> Result<SnapshotInfo, ImageError> {
    let corrupt = || ImageError::Corrupt {
        image: image.to_owned(),
        reason: format!(
            "snapshot record `{}` in the header object is damaged",
            String::from_utf8_lossy(key)
        ),
    };
    let name = std::str::from_utf8(&key[SNAPSHOT_KEY_PREFIX.len()..]).map_err(|_| corrupt())?;
    let text = std::str::from_utf8(value).map_err(|_| corrupt())?;
    let mut fields = [None; 3];
    let mut uid = None;
    for part in text.split(' ') {
        let (k, v) = part.split_once('=').ok_or_else(corrupt)?;
        let slot = match k {
            "id" => 0,
            "size" => 1,
            "created" => 2,
            "uid" if v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()) => {
                uid = Some(v.to_ascii_lowercase());
                continue;
            }
            "uid" => return Err(corrupt()),
            _ => continue,
        };
        fields[slot] = Some(v.parse::<u64>().map_err(|_| corrupt())?);
    }
    let [Some(id), Some(size), Some(created)] = fields else {
        return Err(corrupt());
    };
    // As the header's own size (see `parse_header`): no larger than the largest image, and
    // whole 512-byte units at least.
    if size > crate::MAX_IMAGE_SIZE || !size.is_multiple_of(512) {
        return Err(corrupt());
    }
    Ok(SnapshotInfo {
        name: name.to_owned(),
        id,
        size,
        created,
        uid,
    })
}

/// The snapshot records of an image, oldest first, and the newest id ever allocated.
#[derive(Debug, Clone, Default)]
pub(crate) struct SnapshotTable {
    pub(crate) snapshots: Vec<SnapshotInfo>,
    pub(crate) seq: SnapId,
}

impl SnapshotTable {
    pub(crate) async fn read(
        store: &dyn ObjectStore,
        header_object: &ObjectName,
        image: &str,
    ) -> Result<SnapshotTable, ImageError> {
        let op = ReadOp::new()
            .step(ReadStep::OmapGetByKeys(vec![SNAP_SEQ_KEY.to_vec()]))
            .step(ReadStep::OmapGetRange {
                start: SNAPSHOT_KEY_PREFIX.to_vec(),
                end: Some(SNAPSHOT_KEY_END.to_vec()),
                max: usize::MAX,
            });
        let results = match store.read_op(header_object, op).await {
            Ok(results) => results,
            Err(StoreError::NotFound { .. }) => {
                return Err(ImageError::NotFound {
                    image: image.to_owned(),
                })
            }
            Err(e) => return Err(ImageError::store(image)(e)),
        };
        let mut table = SnapshotTable::default();
        let mut results = results.into_iter();
        if let Some(ReadResult::Omap { pairs, .. }) = results.next() {
            if let Some((_, value)) = pairs.first() {
                table.seq = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| ImageError::Corrupt {
                        image: image.to_owned(),
                        reason: "the snapshot sequence in the header object is damaged".into(),
                    })?;
            }
        }
        if let Some(ReadResult::Omap { pairs, mut more }) = results.next() {
            for (key, value) in &pairs {
                table.snapshots.push(decode(image, key, value)?);
            }
            // A store may list fewer keys per operation than asked (RADOS: 1024): page on
            // from the last key (returned again, skipped). Read whole, a table of more
            // snapshots lost those past the first 1024, whose data later writes then did not
            // keep.
            let mut last = pairs.last().map(|(k, _)| k.to_vec());
            while more {
                let Some(start) = last.take() else { break };
                let op = ReadOp::new().step(ReadStep::OmapGetRange {
                    start: start.clone(),
                    end: Some(SNAPSHOT_KEY_END.to_vec()),
                    max: usize::MAX,
                });
                let Some(ReadResult::Omap { pairs, more: m }) = store
                    .read_op(header_object, op)
                    .await
                    .map_err(ImageError::store(image))?
                    .pop()
                else {
                    return Err(ImageError::Corrupt {
                        image: image.to_owned(),
                        reason: "a read of the snapshot table returned the wrong result".into(),
                    });
                };
                let fresh: Vec<_> = pairs
                    .iter()
                    .filter(|(k, _)| *k != start.as_slice())
                    .collect();
                if fresh.is_empty() && m {
                    return Err(ImageError::Corrupt {
                        image: image.to_owned(),
                        reason: "paging through the snapshot table made no progress".into(),
                    });
                }
                for (key, value) in fresh {
                    table.snapshots.push(decode(image, key, value)?);
                }
                last = pairs.last().map(|(k, _)| k.to_vec());
                more = m;
            }
        }
        table.snapshots.sort_by_key(|s| s.id);
        if let Some(newest) = table.snapshots.last() {
            table.seq = table.seq.max(newest.id);
        }
        Ok(table)
    }

    pub(crate) fn find(&self, name: &str) -> Option<&SnapshotInfo> {
        self.snapshots.iter().find(|s| s.name == name)
    }

    /// The context data writes carry: `None` while no snapshot lives.
    pub(crate) fn context(&self) -> Option<SnapContext> {
        if self.snapshots.is_empty() {
            return None;
        }
        Some(SnapContext {
            seq: self.seq,
            snaps: self.snapshots.iter().rev().map(|s| s.id).collect(),
        })
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// An image's store, header and writer lock, taken for a change made without opening the
/// image (snapshot commands, delete).
pub(crate) struct Locked {
    pub(crate) image: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) header_object: ObjectName,
    pub(crate) parsed: Parsed,
    pub(crate) lock: WriterLock,
}

async fn lock_image(uri: &ImageUri) -> Result<Locked, ImageError> {
    if crate::foreign::luks_file_path(uri).is_some() {
        return Err(no_foreign_snapshots(&uri.to_string()));
    }
    lock_header(uri).await
}

/// Read and parse an image's header and take its writer lock.
pub(crate) async fn lock_header(uri: &ImageUri) -> Result<Locked, ImageError> {
    let image = uri.to_string();
    let store = uri.open_store(false).await?;
    let header_object = object_name(&image, header_object_name(uri.image_name()))?;
    let (header, _) = match read_header(store.as_ref(), &header_object, &image).await {
        Err(ImageError::NotFound { .. }) if matches!(uri, ImageUri::Rados { .. }) => {
            let rbd = crate::foreign::lock_object_rbd(store.as_ref(), uri.image_name(), &image);
            return Err(match rbd.await? {
                Some(_) => ImageError::InvalidParameter {
                    image,
                    reason: "this is a librbd image, which ivdisk reads and writes (serve, \
                             export, verify, convert) but does not manage: delete, resize and \
                             snapshot it with `rbd` (rm, resize, snap); nothing was changed"
                        .into(),
                },
                None => ImageError::NotFound { image },
            });
        }
        other => other?,
    };
    parse_header(&image, &header)?;
    let lock = WriterLock::acquire(
        store.clone(),
        header_object.clone(),
        &image,
        DEFAULT_LOCK_DURATION,
        HolderRecord::Keep,
    )
    .await?;
    // Read again under the lock: a writer may have resized the image and closed between the
    // read above and the lock (a rollback would visit too few objects, a snapshot record the
    // wrong size).
    let parsed = match read_header(store.as_ref(), &header_object, &image).await {
        Ok((header, _)) => parse_header(&image, &header),
        Err(e) => Err(e),
    };
    let parsed = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            drop(lock.release().await);
            return Err(e);
        }
    };
    Ok(Locked {
        image,
        store,
        header_object,
        parsed,
        lock,
    })
}

fn no_foreign_snapshots(image: &str) -> ImageError {
    ImageError::InvalidParameter {
        image: image.to_owned(),
        reason: "snapshots of LUKS volumes made by other tools are not supported (use `rbd snap` \
                 for librbd images; convert a LUKS file with `ivdisk convert` first)"
            .into(),
    }
}

/// Why [`record_new`] failed; `maybe_made`: the table with the new snapshot, when its record
/// may have been stored after all (the write failed, and the table could not be read to
/// tell). A writer goes on preserving that snapshot then: a record stored without its
/// writer's copy-on-write is a snapshot that silently shows later data.
struct RecordFailed {
    error: ImageError,
    maybe_made: Option<SnapshotTable>,
}

impl From<ImageError> for RecordFailed {
    fn from(error: ImageError) -> RecordFailed {
        RecordFailed {
            error,
            maybe_made: None,
        }
    }
}

/// Allocate a store snapshot and record it under `name` with `size`.
async fn record_new(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    image: &str,
    name: &str,
    size: u64,
) -> Result<(SnapshotInfo, SnapshotTable), RecordFailed> {
    check_name(image, name)?;
    let mut table = SnapshotTable::read(store, header_object, image).await?;
    if table.find(name).is_some() {
        return Err(ImageError::SnapshotExists {
            image: image.to_owned(),
            snapshot: name.to_owned(),
        }
        .into());
    }
    let id = store
        .snap_create()
        .await
        .map_err(ImageError::store(image))?;
    let info = SnapshotInfo {
        name: name.to_owned(),
        id,
        size,
        created: now(),
        uid: Some(new_uid(image)?),
    };
    table.seq = table.seq.max(id);
    let op = WriteOp::new().step(WriteStep::AssertExists).omap_set(vec![
        (record_key(name), encode(&info)),
        (SNAP_SEQ_KEY.to_vec(), table.seq.to_string().into_bytes()),
    ]);
    if let Err(e) = store.write_op(header_object, op).await {
        // An error can come after the record was stored (a RADOS timeout): removing the
        // store snapshot then would leave a record of a removed snapshot, whose reads show
        // later data. So the table is read again: recorded, the snapshot was made; not
        // recorded, the id goes back; unknown, a store snapshot is leaked at worst.
        match SnapshotTable::read(store, header_object, image).await {
            Ok(now) if now.find(name).is_some_and(|s| s.id == id) => {
                tracing::warn!(image, snapshot = name, error = %e, "recording the snapshot reported an error, but the record is stored");
                tracing::info!(image, snapshot = name, id, size, "created snapshot");
                return Ok((info, now));
            }
            Ok(_) => drop(store.snap_remove(id).await),
            Err(_) => {
                tracing::warn!(image, snapshot = name, error = %e, "recording the snapshot failed, and whether its record was stored is unknown: it is preserved as if it were");
                table.snapshots.push(info);
                return Err(RecordFailed {
                    error: ImageError::store(image)(e),
                    maybe_made: Some(table),
                });
            }
        }
        return Err(ImageError::store(image)(e).into());
    }
    table.snapshots.push(info.clone());
    tracing::info!(image, snapshot = name, id, size, "created snapshot");
    Ok((info, table))
}

impl Image {
    /// The snapshots of an image, oldest first (no passphrase needed).
    pub async fn snapshots(uri: &ImageUri) -> Result<Vec<SnapshotInfo>, ImageError> {
        let image = uri.to_string();
        if crate::foreign::luks_file_path(uri).is_some() {
            return Ok(Vec::new());
        }
        let store = uri.open_store_read_only().await?;
        let header_object = object_name(&image, header_object_name(uri.image_name()))?;
        Ok(SnapshotTable::read(store.as_ref(), &header_object, &image)
            .await?
            .snapshots)
    }

    /// Snapshot an image no one has open for writing (takes its writer lock meanwhile).
    pub async fn create_snapshot_of(
        uri: &ImageUri,
        name: &str,
    ) -> Result<SnapshotInfo, ImageError> {
        let locked = lock_image(uri).await?;
        let result = async {
            // A snapshot of an image an incremental restore left half-applied would bring that
            // state back at a rollback, which clears the record that refuses it.
            crate::backup::refuse_unfinished_restore(
                locked.store.as_ref(),
                &locked.header_object,
                &locked.image,
            )
            .await?;
            // Everything acknowledged before is in the snapshot: flush the store first.
            locked
                .store
                .flush()
                .await
                .map_err(ImageError::store(&locked.image))?;
            record_new(
                locked.store.as_ref(),
                &locked.header_object,
                &locked.image,
                name,
                locked.parsed.size,
            )
            .await
            .map_err(|failed| failed.error)
        }
        .await;
        let released = locked.lock.release().await;
        let (info, _) = result?;
        released.map_err(ImageError::store(&locked.image))?;
        Ok(info)
    }

    /// Snapshot this open (writable) image: waits for the IO in flight, flushes, and from
    /// then on every write preserves the snapshot's state first.
    pub async fn create_snapshot(&self, name: &str) -> Result<SnapshotInfo, ImageError> {
        let inner = &self.inner;
        self.check_own_snapshots()?;
        let _change = inner.header_change.lock().await;
        // No write may straddle the snapshot: wait for all IO to finish, hold new IO off.
        let _all = inner.ranges.lock_exclusive(0, u64::MAX).await;
        self.flush().await?;
        let recorded = record_new(
            inner.store.as_ref(),
            &inner.header_object,
            &inner.name,
            name,
            inner.size.load(Ordering::Acquire),
        )
        .await;
        let (info, table) = match recorded {
            Ok(made) => made,
            Err(RecordFailed { error, maybe_made }) => {
                // A leaked store snapshot at worst, never a snapshot without its copies.
                if let Some(table) = maybe_made {
                    self.write_under(&table);
                }
                return Err(error);
            }
        };
        self.write_under(&table);
        // Durable, and seen by other processes (a local store shows a writer's changes to
        // its read-only openers once committed): `ivdisk backup IMAGE@SNAP` comes next.
        self.flush().await?;
        Ok(info)
    }

    /// Snapshots are changed by this open image itself: it is a writer (of an ivdisk image).
    fn check_own_snapshots(&self) -> Result<(), ImageError> {
        self.inner.check_writable()?;
        match self.inner.foreign {
            true => Err(no_foreign_snapshots(&self.inner.name)),
            false => Ok(()),
        }
    }

    /// From now on, writes preserve the snapshots of `table` (held under the whole range lock).
    fn write_under(&self, table: &SnapshotTable) {
        let inner = &self.inner;
        let context = table.context();
        let has_context = context.is_some();
        *inner
            .snap_context
            .write()
            .unwrap_or_else(|e| e.into_inner()) = context;
        inner.has_snap_context.store(has_context, Ordering::Release);
    }

    /// Remove a snapshot of this open (writable) image: waits for the IO in flight (which
    /// still preserves it), removes it, and writes from then on no longer preserve it.
    pub async fn remove_own_snapshot(&self, name: &str) -> Result<(), ImageError> {
        let inner = &self.inner;
        self.check_own_snapshots()?;
        let _change = inner.header_change.lock().await;
        let _all = inner.ranges.lock_exclusive(0, u64::MAX).await;
        let store = inner.store.as_ref();
        let removed = remove_record(
            store,
            &inner.header_object,
            &inner.name,
            name,
            inner.uri.get(),
        )
        .await;
        // Whatever happened, writes carry the context the stored table gives now.
        let table = SnapshotTable::read(store, &inner.header_object, &inner.name).await?;
        self.write_under(&table);
        removed?;
        self.flush().await
    }

    /// Remove a snapshot of an image no one has open for writing; the data only it kept is
    /// freed. Refused while another open reads the snapshot (on stores that tell).
    pub async fn remove_snapshot(uri: &ImageUri, name: &str) -> Result<(), ImageError> {
        let locked = lock_image(uri).await?;
        let result = remove_record(
            locked.store.as_ref(),
            &locked.header_object,
            &locked.image,
            name,
            Some(uri),
        )
        .await;
        let released = locked.lock.release().await;
        result?;
        released.map_err(ImageError::store(&locked.image))
    }

    /// Put an image no one has open for writing back to a snapshot: its data and its size.
    /// Newer snapshots stay. `progress` gets (objects done, objects in all).
    pub async fn rollback_snapshot(
        uri: &ImageUri,
        name: &str,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<SnapshotInfo, ImageError> {
        let locked = lock_image(uri).await?;
        let result = async {
            let Locked {
                image,
                store,
                header_object,
                parsed,
                ..
            } = &locked;
            let table = SnapshotTable::read(store.as_ref(), header_object, image).await?;
            let snap = table
                .find(name)
                .cloned()
                .ok_or_else(|| ImageError::SnapshotNotFound {
                    image: image.clone(),
                    snapshot: name.to_owned(),
                })?;
            // The image no longer holds what a restore recorded it holds: an incremental
            // restore checks only the objects it changes, so applied on top of the rolled-back
            // data it would leave a mix of two states that no snapshot of the source ever was.
            // Cleared before any object changes (an interrupted rollback is no restore's
            // base either): the next restore into this image must be a full one.
            // And the rollback under way is recorded (synced) before any object changes: one
            // stopped part-way (a signal, a crash, a store error) left objects of both states
            // in an image that opened without a word.
            // A rollback to another snapshot stopped part-way is finished first: this one
            // would visit only the objects its own sizes cover, and leave the other's past
            // them (a later grow showed that snapshot's data where zeros belong).
            let unfinished = rolling_back_to(store.as_ref(), header_object, image).await?;
            if let Some(other) = unfinished.filter(|other| other != name) {
                return Err(ImageError::RollbackUnfinished {
                    image: image.clone(),
                    snapshot: other,
                });
            }
            // Refused while another open reads the image (an export, a read-only server): it
            // read objects of both states mixed, and the size it opened with, without an
            // error. Held to the end.
            let readers_held =
                crate::readers::hold_off_readers(
                    uri,
                    store.as_ref(),
                    header_object,
                    image,
                    crate::readers::HeldOff::Head,
                )
                    .await?;
            let op = WriteOp::new()
                .step(WriteStep::AssertExists)
                .step(WriteStep::OmapRemoveKeys(vec![BACKUP_STATE_KEY.to_vec()]))
                .omap_set(vec![(ROLLING_BACK_KEY.to_vec(), name.as_bytes().to_vec())]);
            store
                .write_op(header_object, op)
                .await
                .map_err(ImageError::store(image))?;
            store.flush().await.map_err(ImageError::store(image))?;
            let object_size = parsed.params.object_size;
            let objects = parsed.size.max(snap.size).div_ceil(object_size);
            let prefix = data_object_prefix(&parsed.params.image_id);
            let context = table.context();
            // The objects at the head (those created since are removed) and at the snapshot
            // (those removed since come back); every index where the store cannot list at a
            // snapshot. Every index took 6 minutes on RADOS for an empty 1 TiB image.
            let numbers = match objects {
                0 => Vec::new(),
                _ => listed_object_numbers(
                    store.as_ref(),
                    &prefix,
                    &[None, Some(snap.id)],
                    0..=objects - 1,
                )
                .await
                .map_err(ImageError::store(image))?
                .unwrap_or_else(|| (0..objects).collect()),
            };
            let objects = numbers.len() as u64;
            let mut done = 0;
            let mut results = stream::iter(numbers)
                .map(|n| {
                    let object = object_name(image, format!("{prefix}{n:016x}"));
                    let mut op = WriteOp::new().step(WriteStep::Rollback(snap.id));
                    op.snap_context = context.clone();
                    let store = store.clone();
                    async move {
                        let object = object?;
                        match store.write_op(&object, op).await {
                            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
                            Err(e) => Err(ImageError::store(image)(e)),
                        }
                    }
                })
                .buffer_unordered(ROLLBACK_IN_FLIGHT);
            while let Some(result) = results.next().await {
                result?;
                done += 1;
                if done % 64 == 0 || done == objects {
                    progress(done, objects);
                }
            }
            drop(results);
            // Every object is at the snapshot: the size, and the record of the rollback goes.
            let done = WriteStep::OmapRemoveKeys(vec![ROLLING_BACK_KEY.to_vec()]);
            let op = if snap.size != parsed.size {
                let (mut header, mut region) =
                    read_header(store.as_ref(), header_object, image).await?;
                header
                    .set_data_size(&mut region, Some(snap.size))
                    .map_err(ImageError::header(image))?;
                let mut op = region.write_op().expect("a size change changes the header");
                op.steps.push(done);
                op
            } else {
                WriteOp::new().step(WriteStep::AssertExists).step(done)
            };
            store
                .write_op(header_object, op)
                .await
                .map_err(ImageError::store(image))?;
            store.flush().await.map_err(ImageError::store(image))?;
            crate::readers::end_hold(store.as_ref(), header_object, readers_held).await;
            tracing::info!(image = %image, snapshot = name, objects, size = snap.size, "rolled back to snapshot");
            Ok(snap)
        }
        .await;
        let released = locked.lock.release().await;
        let snap = result?;
        released.map_err(ImageError::store(&locked.image))?;
        Ok(snap)
    }

    /// The snapshot this image was opened at, if any.
    pub fn snapshot(&self) -> Option<&str> {
        self.inner.snapshot.as_ref().map(|(name, _)| name.as_str())
    }

    /// The store snapshot id reads go to (`None`: the head).
    pub fn snapshot_id(&self) -> Option<SnapId> {
        self.inner.snapshot.as_ref().map(|&(_, id)| id)
    }
}

/// Remove snapshot `name`: its record, then its store snapshot. Refused while another open
/// reads it, where the store at `uri` keeps readers' marks (`readers.rs`).
/// The snapshot a rollback stopped part-way was putting the image back to, if one did.
async fn rolling_back_to(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    image: &str,
) -> Result<Option<String>, ImageError> {
    Ok(store
        .read_op(
            header_object,
            ReadOp::new().step(ReadStep::OmapGetByKeys(vec![ROLLING_BACK_KEY.to_vec()])),
        )
        .await
        .map_err(ImageError::store(image))?
        .into_iter()
        .find_map(|r| match r {
            ReadResult::Omap { pairs, .. } => pairs
                .iter()
                .next()
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
            _ => None,
        }))
}

async fn remove_record(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    image: &str,
    name: &str,
    uri: Option<&ImageUri>,
) -> Result<(), ImageError> {
    let table = SnapshotTable::read(store, header_object, image).await?;
    let snap = table
        .find(name)
        .ok_or_else(|| ImageError::SnapshotNotFound {
            image: image.to_owned(),
            snapshot: name.to_owned(),
        })?;
    // The snapshot an unfinished rollback puts the image back to is the only way to finish
    // it: removed, the image (objects of two states, refused by every open) was lost for good.
    if rolling_back_to(store, header_object, image)
        .await?
        .as_deref()
        == Some(name)
    {
        return Err(ImageError::RollbackUnfinished {
            image: image.to_owned(),
            snapshot: name.to_owned(),
        });
    }
    // Held to the end: no reader opens it meanwhile.
    let _readers_held_off = match uri {
        Some(uri) => {
            let shown = crate::uri::at_snapshot(image, name);
            let what = crate::readers::HeldOff::Snapshot(snap.id);
            crate::readers::hold_off_readers(uri, store, header_object, &shown, what).await?
        }
        None => None,
    };
    // The record goes first: a crash in between leaves an unreferenced store snapshot
    // (space), never a record whose data is gone.
    let op = WriteOp::new()
        .step(WriteStep::AssertExists)
        .step(WriteStep::OmapRemoveKeys(vec![
            record_key(name),
            crate::readers::REMOVING_KEY.to_vec(),
        ]))
        .omap_set(vec![(
            SNAP_SEQ_KEY.to_vec(),
            table.seq.to_string().into_bytes(),
        )]);
    if let Err(e) = store.write_op(header_object, op).await {
        // The record of the removal under way would refuse the snapshot's readers until the
        // lock it names goes (for a served image: until the server stops), although the
        // snapshot is still there.
        if uri.is_some() {
            let op = WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![
                crate::readers::REMOVING_KEY.to_vec(),
            ]));
            drop(store.write_op(header_object, op).await);
        }
        return Err(ImageError::store(image)(e));
    }
    store
        .snap_remove(snap.id)
        .await
        .map_err(ImageError::store(image))?;
    // Committed while the readers are still held off: a read-only open of the local store
    // sees committed states only, and one coming between the hold's end and a later commit
    // found the record still there, opened the snapshot, and failed every read after it.
    store.flush().await.map_err(ImageError::store(image))?;
    tracing::info!(image, snapshot = name, id = snap.id, "removed snapshot");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal says what a name may hold: a space was refused by a message that allowed
    /// "printable ASCII", which a space is.
    #[test]
    fn a_refused_snapshot_name_is_told_what_names_hold() {
        for bad in ["", "a b", "a/b", "a@b", "é", "tab\there"] {
            let Err(ImageError::InvalidParameter { reason, .. }) = check_name("img", bad) else {
                panic!("{bad:?} was taken");
            };
            assert!(reason.contains("without spaces, '/' or '@'"), "{reason}");
        }
        let longest = "x".repeat(MAX_SNAPSHOT_NAME);
        for good in ["monday", "before-upgrade_2.1", "a:b+c", longest.as_str()] {
            check_name("img", good).unwrap();
        }
    }
}
