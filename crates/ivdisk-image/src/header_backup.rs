//! Header backups of ivdisk images: the header object's LUKS2 region (binary headers, JSON,
//! keyslots) as bytes, and those bytes written back as the header object.
//!
//! A backup is a plain LUKS2 header file (`cryptsetup luksDump` and `ivdisk header dump`
//! read it). Restoring one is for a header object that was damaged, deleted or changed by
//! mistake (a keyslot removed), so it must work when the object is unreadable or missing; it
//! refuses what would make things worse:
//!
//! - a backup that is not a valid ivdisk image header, or is itself damaged;
//! - a backup of another image (image id in the header's ivdisk token) while the header in
//!   place is readable and says otherwise, unless forced;
//! - an image with a writer: restore takes the writer lock for its duration, so a running
//!   writer (or a dead one's stale lock, which `ivdisk lock break` removes) refuses it, and no
//!   writer can open in the middle;
//! - a backup whose image id another header object of the same store has (forced or not):
//!   data objects are named by image id, so the two names would share them, each with a
//!   writer lock of its own, and deleting either would delete the other's data;
//! - for suites with a write limit (`aes-gcm-random`), a missing header object unless forced:
//!   the count of writes under the key lived in its omap and is gone.
//!
//! The header object's omap (the nonce reservation of `aes-gcm-random`) is never touched, so
//! the count of writes under the key only goes up. The new bytes go in ONE store operation
//! that asserts the version read (or creates the object exclusively), so a concurrent header
//! change fails it cleanly instead of being overwritten.

use ivdisk_crypto::ImageId;
use ivdisk_header::{Header, MemoryHeaderIo};
use ivdisk_store::{data_runs, ObjectStore, StoreError, WriteOp, WriteStep};

use crate::header_object::HeaderRegion;
use crate::image::{header_object_name, object_name, parse_header, read_header};
use crate::keyslots::{missing_header, refuse_luks_file};
use crate::writer_lock::{HolderRecord, WriterLock, DEFAULT_LOCK_DURATION};
use crate::{Image, ImageError, ImageUri};

/// Blocks of the header region stored as a write only when not all zeros (the region is
/// 16 MiB by default, mostly unused keyslot area: the object stays sparse).
const BLOCK: usize = 4096;

/// The start of every image's data object names (`image::data_object_prefix`).
const DATA_OBJECTS: &str = "ivdisk_data.";

/// What a header backup holds, or what a restore wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderBackupInfo {
    /// The LUKS UUID of the header.
    pub uuid: String,
    /// The ivdisk image id recorded in the header.
    pub image_id: ImageId,
    /// The keyslots in use.
    pub keyslots: Vec<u32>,
    /// Bytes of the header region (the backup's length).
    pub len: u64,
}

/// The header object a restore replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplacedHeader {
    /// A readable header of the same image.
    Same,
    /// A readable header of another image (replaced because forced).
    Other(ImageId),
    /// A header object that did not parse as an ivdisk header (the reason).
    Unreadable(String),
    /// No header object (or an empty one).
    Missing,
}

/// The result of [`Image::restore_header`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderRestore {
    /// The header now in place.
    pub restored: HeaderBackupInfo,
    /// What was there before.
    pub replaced: ReplacedHeader,
    /// The image's data objects the store holds, counted when the header was missing: none
    /// means the image reads as zeros everywhere (deleted, or never written).
    pub data_objects: Option<usize>,
}

/// The object version to assert (`None`: create the object) and what a restore of image
/// `backup_id`'s header replaces in `current`.
fn replaced_by(
    current: &Option<HeaderRegion>,
    backup_id: &ImageId,
) -> (Option<u64>, ReplacedHeader) {
    let Some(region) = current else {
        return (None, ReplacedHeader::Missing);
    };
    if region.len() == 0 {
        return (region.version(), ReplacedHeader::Missing);
    }
    let replaced = match Header::read(region) {
        Ok(header) => match header.image_params() {
            Ok(Some(p)) if p.image_id == *backup_id => ReplacedHeader::Same,
            Ok(Some(p)) => ReplacedHeader::Other(p.image_id),
            Ok(None) => {
                ReplacedHeader::Unreadable("a LUKS header without ivdisk image parameters".into())
            }
            Err(e) => ReplacedHeader::Unreadable(e.to_string()),
        },
        // Without the advice to restore a backup, which this restore just did.
        Err(e) => ReplacedHeader::Unreadable(e.damage()),
    };
    (region.version(), replaced)
}

/// Another image's id that the store still shows where the header in place says nothing
/// (it does not read, or is missing), and where it was found: the damaged header's JSON
/// areas, or the names of the data objects of a local store (which holds one image; a RADOS
/// pool holds many, whose data objects say nothing of this one). `None` when what is shown is
/// the backup's own image, or nothing.
async fn other_image_shown(
    store: &dyn ObjectStore,
    uri: &ImageUri,
    current: &Option<HeaderRegion>,
    backup_id: &ImageId,
) -> Result<Option<(ImageId, &'static str)>, ImageError> {
    if let Some(region) = current {
        let named = ivdisk_header::salvage_image_ids(region);
        if named.contains(backup_id) {
            return Ok(None);
        }
        if let Some(id) = named.first() {
            return Ok(Some((
                *id,
                "this image's damaged header still names image id",
            )));
        }
    }
    if !matches!(uri, ImageUri::Local { .. }) {
        return Ok(None);
    }
    let objects = store
        .list(DATA_OBJECTS)
        .await
        .map_err(ImageError::store(&uri.to_string()))?;
    let mut shown = None;
    for object in &objects {
        let id = object.as_str()[DATA_OBJECTS.len()..]
            .split('.')
            .next()
            .and_then(|hex_id| hex::decode(hex_id).ok())
            .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
            .map(ImageId);
        match id {
            Some(id) if id == *backup_id => return Ok(None),
            Some(id) => shown = shown.or(Some(id)),
            None => {}
        }
    }
    Ok(shown.map(|id| (id, "this store's data objects belong to image id")))
}

/// Another header object of this store whose JSON areas name image id `backup_id` (whether
/// or not the header still reads): restoring the backup under this name would give that
/// image's data objects a second name. Data objects are named by image id only.
///
/// Only the start of each header is read (the binary headers and JSON areas of the usual
/// sizes): a header object is its whole region (16 MiB, read back as zeros where sparse on
/// RADOS), and a pool may hold many.
pub(crate) async fn other_header_with_id(
    store: &dyn ObjectStore,
    image: &str,
    object: &ivdisk_store::ObjectName,
    backup_id: &ImageId,
) -> Result<Option<ivdisk_store::ObjectName>, ImageError> {
    const HEAD: u64 = 64 << 10;
    let prefix = header_object_name("");
    let headers = store
        .list(&prefix)
        .await
        .map_err(ImageError::store(image))?;
    for other in headers.into_iter().filter(|o| o != object) {
        let op = ivdisk_store::ReadOp::new().step(ivdisk_store::ReadStep::Read {
            offset: 0,
            len: HEAD,
        });
        let extents = match store.read_op(&other, op).await.map(|mut r| r.pop()) {
            Ok(Some(ivdisk_store::ReadResult::Extents(extents))) => extents,
            // Gone meanwhile, or unreadable: it names nothing this can see.
            _ => continue,
        };
        let mut head = Vec::new();
        for extent in extents {
            let end = extent.offset as usize + extent.data.len();
            if head.len() < end {
                head.resize(end, 0);
            }
            head[extent.offset as usize..end].copy_from_slice(&extent.data);
        }
        if ivdisk_header::salvage_image_ids(&MemoryHeaderIo(head)).contains(backup_id) {
            return Ok(Some(other));
        }
    }
    Ok(None)
}

fn summary(header: &Header, image_id: ImageId) -> HeaderBackupInfo {
    HeaderBackupInfo {
        uuid: header.uuid().to_owned(),
        image_id,
        keyslots: header.keyslots().iter().map(|k| k.id).collect(),
        len: header.region_len(),
    }
}

impl Image {
    /// The header region of an ivdisk image, as the bytes of a LUKS2 header file. Refused if
    /// the header does not read (a backup must be restorable).
    pub async fn backup_header(uri: &ImageUri) -> Result<(Vec<u8>, HeaderBackupInfo), ImageError> {
        let what = "a header backup";
        refuse_luks_file(uri, what)?;
        let image = uri.to_string();
        // Only reads: a local image's store opens read-only (on a read-only directory too).
        let store = uri.open_store_read_only().await?;
        let object = object_name(&image, header_object_name(uri.image_name()))?;
        let (header, region) = match read_header(store.as_ref(), &object, &image).await {
            Err(ImageError::NotFound { .. }) => {
                return Err(missing_header(store, uri, &image, what).await)
            }
            other => other?,
        };
        let parsed = parse_header(&image, &header)?;
        let mut out = MemoryHeaderIo::default();
        let len = header
            .backup(&region, &mut out)
            .map_err(ImageError::header(&image))?;
        debug_assert_eq!(len, out.0.len() as u64);
        Ok((out.0, summary(&header, parsed.params.image_id)))
    }

    /// Write a header backup (from [`Image::backup_header`] or `ivdisk header backup`) back
    /// as the image's header object. `force` replaces the header of another image, and
    /// restores a missing header of a suite with a write limit (see the module documentation).
    pub async fn restore_header(
        uri: &ImageUri,
        backup: &[u8],
        force: bool,
    ) -> Result<HeaderRestore, ImageError> {
        refuse_luks_file(uri, "restoring a header backup")?;
        let image = uri.to_string();
        let invalid = |reason: String| ImageError::InvalidBackup {
            image: image.clone(),
            reason,
        };
        // The backup first: nothing is opened or locked for a file that is no backup.
        let saved_io = MemoryHeaderIo(backup.to_vec());
        // What is wrong with the file, without the advice to restore a header backup: this is
        // that restore.
        let saved = Header::read(&saved_io).map_err(|e| invalid(e.damage()))?;
        if let Some(warning) = saved.warning() {
            return Err(invalid(format!("it is itself damaged ({warning})")));
        }
        if saved.version() != 2 {
            return Err(invalid(
                "it is a LUKS1 header; ivdisk images have LUKS2 headers".into(),
            ));
        }
        let params = match saved.image_params() {
            Ok(Some(params)) => params,
            Ok(None) => {
                return Err(invalid(
                    "it is the header of a LUKS volume, not of an ivdisk image (restore it to \
                     that volume with `ivdisk header restore VOLUME FILE` or cryptsetup)"
                        .into(),
                ))
            }
            Err(e) => return Err(invalid(e.to_string())),
        };
        let parsed = parse_header(&image, &saved).map_err(|e| invalid(e.to_string()))?;
        let len = saved.region_len();
        if (backup.len() as u64) < len {
            return Err(invalid(format!(
                "it is truncated: {} bytes, the header region is {len}",
                backup.len()
            )));
        }
        let bytes = &backup[..len as usize];

        let store = uri.open_store(false).await?;
        let object = object_name(&image, header_object_name(uri.image_name()))?;
        let read = || async {
            HeaderRegion::read(store.as_ref(), &object)
                .await
                .map_err(ImageError::store(&image))
        };
        let current = read().await?;
        if current.is_none() {
            // No header object: an image whose header was deleted, a librbd image, or nothing.
            let err = missing_header(store.clone(), uri, &image, "restoring a header backup").await;
            if !matches!(err, ImageError::NotFound { .. }) {
                return Err(err);
            }
        }
        // Refused before the lock is taken (taking it may create a missing object, on RADOS),
        // and judged again under it.
        let (image_ref, params_ref, store_ref, parsed_ref) = (&image, &params, &store, &parsed);
        let object_ref = &object;
        let judge = move |current: Option<HeaderRegion>| async move {
            let (image, params, store, parsed) = (image_ref, params_ref, store_ref, parsed_ref);
            let (version, replaced) = replaced_by(&current, &params.image_id);
            let mismatch = |image_id, found| ImageError::BackupMismatch {
                image: image.clone(),
                backup_id: params.image_id,
                image_id,
                found,
            };
            match (&replaced, force) {
                (_, true) => {}
                (ReplacedHeader::Other(image_id), false) => {
                    return Err(mismatch(*image_id, "this image's header has id"))
                }
                (ReplacedHeader::Unreadable(_) | ReplacedHeader::Missing, false) => {
                    let shown = other_image_shown(store.as_ref(), uri, &current, &params.image_id);
                    if let Some((image_id, found)) = shown.await? {
                        return Err(mismatch(image_id, found));
                    }
                    if replaced == ReplacedHeader::Missing && parsed.suite.write_limit().is_some() {
                        return Err(ImageError::NonceCountLost {
                            image: image.clone(),
                            suite: parsed.suite,
                        });
                    }
                }
                (ReplacedHeader::Same, false) => {}
            }
            // Forced or not: two headers of one image id are two writer locks over the same
            // data objects, and deleting either name deletes the other's data.
            if replaced != ReplacedHeader::Same {
                let other =
                    other_header_with_id(store.as_ref(), image, object_ref, &params.image_id);
                if let Some(other) = other.await? {
                    return Err(ImageError::HeaderIdInUse {
                        image: image.clone(),
                        other: other.to_string(),
                        image_id: params.image_id,
                    });
                }
            }
            Ok((version, replaced))
        };
        judge(current).await?;
        // Held until the new header is stored: no writer runs now, and none opens meanwhile.
        let lock = WriterLock::acquire(
            store.clone(),
            object.clone(),
            &image,
            DEFAULT_LOCK_DURATION,
            HolderRecord::KeepOnMissingHeader,
        )
        .await?;
        let result = async {
            let (version, replaced) = judge(read().await?).await?;
            let mut op = WriteOp::new().step(match version {
                Some(v) => WriteStep::AssertVersion(v),
                None => WriteStep::CreateExclusive,
            });
            // Every old byte goes (a damaged header must not survive in a gap of the new one);
            // the omap, and with it the nonce reservation, stays.
            op = op.step(WriteStep::Truncate(0));
            for (at, n) in data_runs(bytes, BLOCK) {
                op = op.write(at as u64, &bytes[at..at + n]);
            }
            op = op.step(WriteStep::Truncate(len));
            match store.write_op(&object, op).await {
                Ok(_) => {}
                Err(
                    StoreError::VersionMismatch { .. }
                    | StoreError::Exists { .. }
                    | StoreError::NotFound { .. },
                ) => {
                    return Err(ImageError::HeaderChanged {
                        image: image.clone(),
                    })
                }
                Err(e) => return Err(ImageError::store(&image)(e)),
            }
            store.flush().await.map_err(ImageError::store(&image))?;
            Ok(replaced)
        }
        .await;
        let released = lock.release().await.map_err(ImageError::store(&image));
        let replaced = result?;
        released?;
        tracing::info!(image = %image, uuid = saved.uuid(), replaced = ?replaced, "restored the image header from a backup");
        // A header restored where none was may be one of a deleted image: say whether any
        // data came back with it (on RADOS this lists the pool, as a delete does).
        let data_objects = match replaced {
            ReplacedHeader::Missing => Some(
                store
                    .list(&crate::image::data_object_prefix(&params.image_id))
                    .await
                    .map_err(ImageError::store(&image))?
                    .len(),
            ),
            _ => None,
        };
        Ok(HeaderRestore {
            restored: summary(&saved, params.image_id),
            replaced,
            data_objects,
        })
    }
}

#[cfg(test)]
mod tests {
    use ivdisk_crypto::Suite;
    use ivdisk_header::{PbkdfKind, PbkdfRequest};
    use ivdisk_store::{ObjectStoreExt, ReadOp, ReadResult, ReadStep};

    use super::*;
    use crate::{CreateOptions, OpenOptions};

    async fn image(name: &str, suite: Suite) -> (ImageUri, Vec<u8>) {
        let uri = ImageUri::parse(&format!("mem:backup-{name}")).unwrap();
        let mut options = CreateOptions::new(1 << 20);
        options.suite = suite;
        options.pbkdf = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
        let image = Image::create(&uri, &options, b"pw").await.unwrap();
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
        image.write(4096, &data).await.unwrap();
        image.close().await.unwrap();
        (uri, data)
    }

    fn header_object(uri: &ImageUri) -> ivdisk_store::ObjectName {
        object_name("t", header_object_name(uri.image_name())).unwrap()
    }

    async fn nonces(
        store: &dyn ivdisk_store::ObjectStore,
        object: &ivdisk_store::ObjectName,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![
            b"ivdisk.nonce_writes_reserved".to_vec(),
        ]));
        match store.read_op(object, op).await.unwrap().pop() {
            Some(ReadResult::Omap { pairs, .. }) => pairs.to_vec(),
            other => panic!("{other:?}"),
        }
    }

    async fn reads_back(uri: &ImageUri, data: &[u8]) {
        let image = Image::open(uri, b"pw", &OpenOptions::read_only())
            .await
            .unwrap();
        let mut buf = vec![0u8; data.len()];
        image.read(4096, &mut buf).await.unwrap();
        assert_eq!(buf, data);
    }

    #[tokio::test]
    async fn a_damaged_header_is_restored_and_the_nonce_count_kept() {
        let (uri, data) = image("damaged", Suite::AesGcmRandom).await;
        let (backup, info) = Image::backup_header(&uri).await.unwrap();
        assert_eq!(backup.len() as u64, info.len);
        assert_eq!(info.keyslots, vec![0]);
        let store = uri.open_store(false).await.unwrap();
        let object = header_object(&uri);
        let before = nonces(store.as_ref(), &object).await;
        assert_eq!(before.len(), 1, "the write reserved nonces");
        // Both binary headers overwritten: the image no longer opens.
        store.write(&object, 0, &[0xEE; 4096]).await.unwrap();
        store.write(&object, 16 << 10, &[0xEE; 4096]).await.unwrap();
        assert!(Image::info(&uri).await.is_err());

        let restored = Image::restore_header(&uri, &backup, false).await.unwrap();
        assert!(
            matches!(restored.replaced, ReplacedHeader::Unreadable(_)),
            "{restored:?}"
        );
        assert_eq!(restored.restored, info);
        assert_eq!(
            nonces(store.as_ref(), &object).await,
            before,
            "the nonce reservation stays"
        );
        reads_back(&uri, &data).await;
        // And the object holds exactly the backup.
        assert_eq!(
            store
                .read(&object, 0, backup.len() as u64 + 4096)
                .await
                .unwrap(),
            backup,
            "the header object is the backup, byte for byte"
        );
    }

    #[tokio::test]
    async fn another_images_backup_needs_force() {
        let (one, _) = image("one", Suite::DEFAULT).await;
        let (two, data_two) = image("two", Suite::DEFAULT).await;
        let (backup_one, info_one) = Image::backup_header(&one).await.unwrap();
        let id_two = Image::info(&two).await.unwrap().image_id;
        let err = Image::restore_header(&two, &backup_one, false)
            .await
            .unwrap_err();
        assert!(
            matches!(err, ImageError::BackupMismatch { backup_id, image_id, .. }
                if backup_id == info_one.image_id && image_id == id_two),
            "{err}"
        );
        reads_back(&two, &data_two).await;
        // Forced, it is still refused while image one's header has that id.
        let err = Image::restore_header(&two, &backup_one, true)
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::HeaderIdInUse { .. }), "{err}");
        reads_back(&two, &data_two).await;
        // With image one's header gone, forced, it goes in.
        let store = one.open_store(false).await.unwrap();
        store.remove(&header_object(&one)).await.unwrap();
        let restored = Image::restore_header(&two, &backup_one, true)
            .await
            .unwrap();
        assert_eq!(restored.replaced, ReplacedHeader::Other(id_two));
        assert_eq!(Image::info(&two).await.unwrap().image_id, info_one.image_id);
    }

    /// A header backup restored under a name with no header (a typo, "to try it") where the
    /// backed-up image's own header is in place: refused, forced or not. It went in, and the
    /// two names shared one set of data objects (named by image id): two writers at once,
    /// and deleting the new name deleted the first image's data.
    #[tokio::test]
    async fn a_backup_is_not_restored_as_a_second_name_of_a_live_image() {
        let (one, data) = image("alias-one", Suite::DEFAULT).await;
        let (backup, info) = Image::backup_header(&one).await.unwrap();
        let two = ImageUri::parse("mem:backup-alias-two").unwrap();
        for force in [false, true] {
            let err = Image::restore_header(&two, &backup, force)
                .await
                .unwrap_err();
            assert!(
                matches!(&err, ImageError::HeaderIdInUse { other, image_id, .. }
                    if other.ends_with("backup-alias-one") && *image_id == info.image_id),
                "{err}"
            );
            assert!(matches!(
                Image::info(&two).await,
                Err(ImageError::NotFound { .. })
            ));
        }
        reads_back(&one, &data).await;
        // A damaged header of image one still names its id: refused too.
        let store = one.open_store(false).await.unwrap();
        let object = header_object(&one);
        store.write(&object, 0, &[0xEE; 4096]).await.unwrap();
        store.write(&object, 16 << 10, &[0xEE; 4096]).await.unwrap();
        let err = Image::restore_header(&two, &backup, true)
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::HeaderIdInUse { .. }), "{err}");
        // Its own name takes it back.
        Image::restore_header(&one, &backup, false).await.unwrap();
        reads_back(&one, &data).await;
    }

    /// A header that no longer reads still names its image in its JSON areas: another
    /// image's backup is refused there too (it would show that image's data, or none).
    #[tokio::test]
    async fn another_images_backup_over_a_damaged_header_needs_force() {
        let (one, _) = image("damaged-one", Suite::DEFAULT).await;
        let (two, data_two) = image("damaged-two", Suite::DEFAULT).await;
        let (backup_one, info_one) = Image::backup_header(&one).await.unwrap();
        let (backup_two, _) = Image::backup_header(&two).await.unwrap();
        let id_two = Image::info(&two).await.unwrap().image_id;
        let store = two.open_store(false).await.unwrap();
        let object = header_object(&two);
        store.write(&object, 0, &[0xEE; 4096]).await.unwrap();
        store.write(&object, 16 << 10, &[0xEE; 4096]).await.unwrap();
        assert!(Image::info(&two).await.is_err());
        let err = Image::restore_header(&two, &backup_one, false)
            .await
            .unwrap_err();
        assert!(
            matches!(err, ImageError::BackupMismatch { backup_id, image_id, found, .. }
                if backup_id == info_one.image_id && image_id == id_two
                    && found.contains("damaged header")),
            "{err}"
        );
        assert!(Image::info(&two).await.is_err(), "nothing was changed");
        // Its own backup goes back without --force.
        let restored = Image::restore_header(&two, &backup_two, false)
            .await
            .unwrap();
        assert!(matches!(restored.replaced, ReplacedHeader::Unreadable(_)));
        reads_back(&two, &data_two).await;
        // A header whose JSON is gone too names nothing: the backup goes in (a `mem:` store
        // holds many images, so its data objects say nothing of this one), once image one's
        // own header no longer has its id.
        store
            .write(&object, 0, &vec![0xEE; 32 << 10])
            .await
            .unwrap();
        let err = Image::restore_header(&two, &backup_one, false)
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::HeaderIdInUse { .. }), "{err}");
        store.remove(&header_object(&one)).await.unwrap();
        Image::restore_header(&two, &backup_one, false)
            .await
            .unwrap();
        assert_eq!(Image::info(&two).await.unwrap().image_id, info_one.image_id);
    }

    #[tokio::test]
    async fn a_missing_header_is_restored_but_not_for_gcm_without_force() {
        for (name, suite) in [("gone", Suite::DEFAULT), ("gone-gcm", Suite::AesGcmRandom)] {
            let (uri, data) = image(name, suite).await;
            let (backup, _) = Image::backup_header(&uri).await.unwrap();
            let store = uri.open_store(false).await.unwrap();
            store.remove(&header_object(&uri)).await.unwrap();
            if suite.write_limit().is_some() {
                let err = Image::restore_header(&uri, &backup, false)
                    .await
                    .unwrap_err();
                assert!(matches!(err, ImageError::NonceCountLost { .. }), "{err}");
            }
            let restored = Image::restore_header(&uri, &backup, true).await.unwrap();
            assert_eq!(restored.replaced, ReplacedHeader::Missing);
            reads_back(&uri, &data).await;
        }
    }

    #[tokio::test]
    async fn a_writer_or_a_bad_backup_refuses_the_restore() {
        let (uri, _) = image("busy", Suite::DEFAULT).await;
        let (backup, _) = Image::backup_header(&uri).await.unwrap();
        let writer = Image::open(&uri, b"pw", &OpenOptions::default())
            .await
            .unwrap();
        let err = Image::restore_header(&uri, &backup, true)
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::Locked { .. }), "{err}");
        writer.close().await.unwrap();

        let mut damaged = backup.clone();
        damaged[..4096].fill(0xEE);
        damaged[16 << 10..(16 << 10) + 4096].fill(0xEE);
        for bad in [&b"hello"[..], &damaged, &backup[..20 << 10]] {
            let err = Image::restore_header(&uri, bad, true).await.unwrap_err();
            assert!(matches!(err, ImageError::InvalidBackup { .. }), "{err}");
        }
        // One damaged copy is a damaged backup too.
        let mut half = backup.clone();
        half[16 << 10..(16 << 10) + 4096].fill(0xEE);
        let err = Image::restore_header(&uri, &half, true).await.unwrap_err();
        assert!(matches!(err, ImageError::InvalidBackup { .. }), "{err}");
        assert!(Image::restore_header(&uri, &backup, false).await.is_ok());
    }
}
