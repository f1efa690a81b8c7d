//! Passphrases of an ivdisk image: add, remove or change the keyslot a passphrase opens.
//!
//! The header object is read into a [`HeaderRegion`], changed there by the header crate
//! (which writes new keyslot material before the headers that point at it, and wipes removed
//! material), and stored back in ONE store operation that asserts the version read: a
//! concurrent header change (another keyslot change, a resize, a restore) makes this one fail
//! with [`ImageError::HeaderChanged`] instead of one silently overwriting the other, and a
//! crash leaves the old header or the new one, never a mix.
//!
//! A writer that has the image open keeps running: it holds the volume key, which a keyslot
//! change does not touch (as `cryptsetup luksAddKey` on an active volume). The header is read
//! through a read-only store open, so this works beside a writer in another process; where
//! that writer holds the only writable open (a local store), the [`HeaderChange`] made here is
//! stored by the writer itself ([`Image::apply_header_change`], `ivdisk serve`'s control
//! socket).
//!
//! LUKS files made by cryptsetup keep their keyslots in the file itself: change them with the
//! header crate on the file (as `ivdisk passphrase` and `ivdisk key` do); these functions
//! refuse them, and librbd's LUKS images, whose header lies inside the image's data.
//!
//! The key derivations run on the calling thread (seconds by design), as in [`Image::open`].

use std::sync::Arc;

use ivdisk_header::{Header, HeaderIo, PbkdfRequest};
use ivdisk_store::{ObjectName, ObjectStore, StoreError, WriteOp};

use crate::header_object::{header_write_op, store_unless_header_changed, HeaderRegion};
use crate::image::{header_object_name, object_name, parse_header, read_header};
use crate::{Image, ImageError, ImageUri};

/// An image's header object, read for a change.
pub(crate) struct HeaderTarget {
    pub(crate) image: String,
    pub(crate) uri: ImageUri,
    pub(crate) object: ObjectName,
    pub(crate) header: Header,
    pub(crate) region: HeaderRegion,
    /// The region's digest as read, before any change.
    pub(crate) read_digest: [u8; 32],
}

/// A change of an image's header made in memory and not stored yet: the bytes it writes and
/// the object version it was made from. [`HeaderChange::store`] stores it; while `ivdisk
/// serve` holds a local image (its store is open in one process at a time), the server
/// stores it with [`Image::apply_header_change`] instead. It holds no secret: keyslot
/// material is encrypted under its passphrase, as in the stored header.
pub struct HeaderChange {
    image: String,
    uri: ImageUri,
    object: ObjectName,
    version: Option<u64>,
    ranges: Vec<(u64, Vec<u8>)>,
    /// The digest of the header region the change was made from.
    made_from: [u8; 32],
}

impl std::fmt::Debug for HeaderChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderChange")
            .field("image", &self.image)
            .field("version", &self.version)
            .field("ranges", &self.ranges.len())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl HeaderChange {
    /// The object version the change was made from (`None`: it creates the object).
    pub fn version(&self) -> Option<u64> {
        self.version
    }

    /// What the change writes into the header object: (offset, bytes), in offset order.
    pub fn ranges(&self) -> &[(u64, Vec<u8>)] {
        &self.ranges
    }

    /// The digest of the header region the change was made from (for
    /// [`Image::apply_header_change`]: the header object's version also moves with writes
    /// that change no header byte).
    pub fn made_from(&self) -> &[u8; 32] {
        &self.made_from
    }

    /// Bytes the change writes.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Store the change in one version-asserted operation, durably, opening the image's store
    /// for writing. `HeaderChanged` if the header changed since it was read; a local image
    /// another process holds open fails with `StoreError::AlreadyOpen` (ask its server).
    pub async fn store(&self) -> Result<(), ImageError> {
        if self.ranges.is_empty() {
            return Ok(());
        }
        let store = self.uri.open_store(false).await?;
        let ranges = self.ranges.iter().map(|(o, b)| (*o, b.as_slice()));
        if self.version.is_none() {
            let op = header_write_op(None, ranges);
            return store_header_op(store.as_ref(), &self.object, &self.image, op).await;
        }
        // Stored again at a newer version while the header's bytes are the ones the change was
        // made from: a change whose key derivations ran past a lock renewal or a nonce
        // reservation failed as if another header change had come first.
        let steps = header_write_op(None, ranges).steps.split_off(1);
        store_unless_header_changed(
            store.as_ref(),
            &self.object,
            &self.image,
            &self.made_from,
            self.version,
            &steps,
        )
        .await?;
        store.flush().await.map_err(ImageError::store(&self.image))
    }
}

/// Store `op` on the header object and flush: a version that moved on is `HeaderChanged`.
async fn store_header_op(
    store: &dyn ObjectStore,
    object: &ObjectName,
    image: &str,
    op: WriteOp,
) -> Result<(), ImageError> {
    match store.write_op(object, op).await {
        Ok(_) => {}
        Err(StoreError::VersionMismatch { .. } | StoreError::NotFound { .. }) => {
            return Err(ImageError::HeaderChanged {
                image: image.to_owned(),
            })
        }
        Err(e) => return Err(ImageError::store(image)(e)),
    }
    store.flush().await.map_err(ImageError::store(image))
}

/// Refuse what is not an ivdisk image (a LUKS file), with what to use instead.
pub(crate) fn refuse_luks_file(uri: &ImageUri, what: &str) -> Result<(), ImageError> {
    match crate::foreign::luks_file_path(uri) {
        Some(path) => Err(ImageError::InvalidParameter {
            image: uri.to_string(),
            reason: format!(
                "{} is a LUKS file, not an ivdisk image: {what} works on its header through \
                 ivdisk_header::Header on the file (`ivdisk passphrase`, `ivdisk key` and \
                 `ivdisk header` do that)",
                path.display()
            ),
        }),
        None => Ok(()),
    }
}

/// `NotFound` for an image that is not there, or a clear refusal for a librbd image (no
/// ivdisk header object, but `rbd_id.NAME`), whose LUKS header ivdisk does not change.
pub(crate) async fn missing_header(
    store: Arc<dyn ObjectStore>,
    uri: &ImageUri,
    image: &str,
    what: &str,
) -> ImageError {
    match crate::foreign::info_rbd(store, uri.image_name(), image).await {
        Ok(_) => ImageError::InvalidParameter {
            image: image.to_owned(),
            reason: format!(
                "this is a librbd image (`rbd encryption format`): its LUKS header lies inside \
                 the image's data and ivdisk does not change it; {what} is for ivdisk images"
            ),
        },
        Err(ImageError::NotFound { .. }) => ImageError::NotFound {
            image: image.to_owned(),
        },
        Err(e) => e,
    }
}

impl HeaderTarget {
    /// Read the header object, opening the store read-only: a local image that `ivdisk serve`
    /// holds open is read beside it, and a passphrase is checked without writing anything.
    pub(crate) async fn read(uri: &ImageUri, what: &str) -> Result<HeaderTarget, ImageError> {
        refuse_luks_file(uri, what)?;
        let image = uri.to_string();
        let store = uri.open_store_read_only().await?;
        let object = object_name(&image, header_object_name(uri.image_name()))?;
        let (header, region) = match read_header(store.as_ref(), &object, &image).await {
            Err(ImageError::NotFound { .. }) => {
                return Err(missing_header(store, uri, &image, what).await)
            }
            other => other?,
        };
        // Only ivdisk headers: checked before any passphrase is tried.
        crate::image::parse_header(&image, &header)?;
        let read_digest = region.digest();
        Ok(HeaderTarget {
            image,
            uri: uri.clone(),
            object,
            header,
            region,
            read_digest,
        })
    }

    /// The changes made to the region, to be stored.
    pub(crate) fn into_change(self) -> HeaderChange {
        HeaderChange {
            ranges: self.region.changes(),
            version: self.region.version(),
            made_from: self.read_digest,
            image: self.image,
            uri: self.uri,
            object: self.object,
        }
    }

    /// Store every change made to the region in one version-asserted operation, durably.
    #[cfg(test)]
    pub(crate) async fn store(self) -> Result<(), ImageError> {
        self.into_change().store().await
    }
}

impl Image {
    /// The keyslot `passphrase` opens on an ivdisk image, changing nothing (to check a
    /// passphrase before asking for a new one).
    pub async fn check_passphrase(uri: &ImageUri, passphrase: &[u8]) -> Result<u32, ImageError> {
        let target = HeaderTarget::read(uri, "checking a passphrase").await?;
        let unlocked = target
            .header
            .unlock(&target.region, passphrase)
            .map_err(ImageError::header(&target.image))?;
        Ok(unlocked.keyslot)
    }

    /// Add a keyslot for `new` to an ivdisk image, authorised by `existing` (the passphrase
    /// of any keyslot). Returns the new keyslot's number (the first free one).
    pub async fn add_passphrase(
        uri: &ImageUri,
        existing: &[u8],
        new: &[u8],
        pbkdf: &PbkdfRequest,
    ) -> Result<u32, ImageError> {
        let (slot, change) = Image::prepare_add_passphrase(uri, existing, new, pbkdf).await?;
        change.store().await?;
        tracing::info!(image = %uri, keyslot = slot, "passphrase added");
        Ok(slot)
    }

    /// [`Image::add_passphrase`] made but not stored: the new keyslot's number and the
    /// header change to store.
    pub async fn prepare_add_passphrase(
        uri: &ImageUri,
        existing: &[u8],
        new: &[u8],
        pbkdf: &PbkdfRequest,
    ) -> Result<(u32, HeaderChange), ImageError> {
        let mut target = HeaderTarget::read(uri, "adding a passphrase").await?;
        let unlocked = target
            .header
            .unlock(&target.region, existing)
            .map_err(ImageError::header(&target.image))?;
        let slot = target
            .header
            .add_keyslot(&mut target.region, &unlocked.volume_key, new, None, pbkdf)
            .map_err(ImageError::header(&target.image))?;
        drop(unlocked);
        Ok((slot, target.into_change()))
    }

    /// Remove a keyslot of an ivdisk image: the one `passphrase` opens, or `slot` (then
    /// `passphrase` may be that of any keyslot: it only authorises the removal). Removing the
    /// last keyslot makes the image unopenable forever and needs `force`. Returns the keyslot
    /// removed.
    pub async fn remove_passphrase(
        uri: &ImageUri,
        passphrase: &[u8],
        slot: Option<u32>,
        force: bool,
    ) -> Result<u32, ImageError> {
        let (slot, change) = Image::prepare_remove_passphrase(uri, passphrase, slot, force).await?;
        change.store().await?;
        tracing::info!(image = %uri, keyslot = slot, "passphrase removed");
        Ok(slot)
    }

    /// [`Image::remove_passphrase`] made but not stored: the keyslot removed and the header
    /// change to store.
    pub async fn prepare_remove_passphrase(
        uri: &ImageUri,
        passphrase: &[u8],
        slot: Option<u32>,
        force: bool,
    ) -> Result<(u32, HeaderChange), ImageError> {
        let mut target = HeaderTarget::read(uri, "removing a passphrase").await?;
        let unlocked = target
            .header
            .unlock(&target.region, passphrase)
            .map_err(ImageError::header(&target.image))?;
        let slot = slot.unwrap_or(unlocked.keyslot);
        drop(unlocked);
        target
            .header
            .remove_keyslot(&mut target.region, slot, force)
            .map_err(ImageError::header(&target.image))?;
        Ok((slot, target.into_change()))
    }

    /// Replace the passphrase of the keyslot `old` opens (or of `slot`, which `old` must
    /// open) by `new`, keeping the keyslot's number. Returns that number.
    pub async fn change_passphrase(
        uri: &ImageUri,
        old: &[u8],
        new: &[u8],
        slot: Option<u32>,
        pbkdf: &PbkdfRequest,
    ) -> Result<u32, ImageError> {
        let (slot, change) = Image::prepare_change_passphrase(uri, old, new, slot, pbkdf).await?;
        change.store().await?;
        tracing::info!(image = %uri, keyslot = slot, "passphrase changed");
        Ok(slot)
    }

    /// [`Image::change_passphrase`] made but not stored: the keyslot's number and the header
    /// change to store.
    pub async fn prepare_change_passphrase(
        uri: &ImageUri,
        old: &[u8],
        new: &[u8],
        slot: Option<u32>,
        pbkdf: &PbkdfRequest,
    ) -> Result<(u32, HeaderChange), ImageError> {
        let mut target = HeaderTarget::read(uri, "changing a passphrase").await?;
        let slot = target
            .header
            .change_passphrase(&mut target.region, old, new, slot, pbkdf)
            .map_err(ImageError::header(&target.image))?;
        Ok((slot, target.into_change()))
    }

    /// Store a keyslot change that another process made ([`HeaderChange::ranges`] from
    /// `version`) through this image, which holds it open for writing: how `ivdisk serve`
    /// changes the passphrases of a local image it serves. Refused, with nothing stored, if
    /// the header moved on from `version` (`HeaderChanged`), if the result is not a valid
    /// header, or if it changes anything but keyslots (size, suite, layout, geometry, id).
    ///
    /// `made_from` ([`HeaderChange::made_from`]): the change also applies at a newer version
    /// while the header's bytes are still those it was made from. The writer's own nonce
    /// reservations (`aes-gcm-random`, every 2^16 sectors written) and snapshots move the
    /// version, and a change sent while the image was written failed every time.
    pub async fn apply_header_change(
        &self,
        version: u64,
        made_from: Option<&[u8; 32]>,
        ranges: &[(u64, Vec<u8>)],
    ) -> Result<(), ImageError> {
        let inner = &self.inner;
        let image = inner.name.as_str();
        let refuse = |reason: String| ImageError::InvalidParameter {
            image: image.to_owned(),
            reason: format!("{reason}; nothing was changed"),
        };
        if inner.foreign || inner.snapshot.is_some() {
            return Err(refuse(
                "only an ivdisk image's own header changes this way".into(),
            ));
        }
        inner.check_writable()?;
        let store = inner.store.as_ref();
        let (header, mut region) = read_header(store, &inner.header_object, image).await?;
        let read_digest = region.digest();
        if region.version() != Some(version) && made_from != Some(&read_digest) {
            return Err(ImageError::HeaderChanged {
                image: image.to_owned(),
            });
        }
        let before = parse_header(image, &header)?;
        // Keyslot material lies inside the region (binary headers, JSON, keyslot areas).
        let end = header.region_len();
        for (offset, bytes) in ranges {
            if offset.saturating_add(bytes.len() as u64) > end {
                return Err(refuse(format!(
                    "a header change writes {} bytes at {offset}, past the header's {end} bytes",
                    bytes.len(),
                )));
            }
            region
                .write_at(*offset, bytes)
                .map_err(|e| refuse(format!("the header change does not apply: {e}")))?;
        }
        let changed = Header::read(&region)
            .map_err(|e| refuse(format!("the header change leaves no valid header: {e}")))?;
        if let Some(warning) = changed.warning() {
            // Both copies must stay whole: a change may not leave one damaged or stale.
            return Err(refuse(format!(
                "the header change leaves no valid header in both copies: {warning}"
            )));
        }
        let after = parse_header(image, &changed)
            .map_err(|e| refuse(format!("the header change leaves no valid header: {e}")))?;
        if (
            after.suite,
            after.layout,
            after.sector_size,
            after.size,
            &after.params,
        ) != (
            before.suite,
            before.layout,
            before.sector_size,
            before.size,
            &before.params,
        ) {
            return Err(refuse(
                "a header change through the image's writer may change keyslots only".into(),
            ));
        }
        let Some(op) = region.write_op() else {
            return Ok(());
        };
        // At the version read, or a newer one while the bytes are those checked above.
        store_unless_header_changed(
            store,
            &inner.header_object,
            image,
            &read_digest,
            region.version(),
            &op.steps[1..],
        )
        .await?;
        store.flush().await.map_err(ImageError::store(image))?;
        tracing::info!(
            image,
            bytes = ranges.iter().map(|(_, b)| b.len()).sum::<usize>(),
            "keyslot change stored for another process"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use ivdisk_header::{HeaderError, PbkdfKind};

    use super::*;
    use crate::{CreateOptions, OpenOptions};

    fn fast() -> PbkdfRequest {
        PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2)
    }

    async fn image(name: &str) -> ImageUri {
        let uri = ImageUri::parse(&format!("mem:keyslots-{name}")).unwrap();
        let mut options = CreateOptions::new(1 << 20);
        options.pbkdf = fast();
        Image::create(&uri, &options, b"one")
            .await
            .unwrap()
            .close()
            .await
            .unwrap();
        uri
    }

    fn wrong_passphrase(e: &ImageError) -> bool {
        matches!(
            e,
            ImageError::Header {
                source: HeaderError::WrongPassphrase { .. },
                ..
            }
        )
    }

    #[tokio::test]
    async fn add_change_remove_round_trip() {
        let uri = image("round-trip").await;
        let slot = Image::add_passphrase(&uri, b"one", b"two", &fast())
            .await
            .unwrap();
        assert_eq!(slot, 1);
        assert_eq!(Image::check_passphrase(&uri, b"two").await.unwrap(), 1);
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![0, 1]);

        let changed = Image::change_passphrase(&uri, b"two", b"three", None, &fast())
            .await
            .unwrap();
        assert_eq!(changed, 1);
        let err = Image::check_passphrase(&uri, b"two").await.unwrap_err();
        assert!(wrong_passphrase(&err), "{err}");
        let opened = Image::open(&uri, b"three", &OpenOptions::read_only())
            .await
            .unwrap();
        opened.close().await.unwrap();

        // Slot 0 removed by number, authorised by slot 1's passphrase.
        assert_eq!(
            Image::remove_passphrase(&uri, b"three", Some(0), false)
                .await
                .unwrap(),
            0
        );
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![1]);
        let err = Image::remove_passphrase(&uri, b"three", None, false)
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ImageError::Header {
                    source: HeaderError::LastKeyslot(1),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![1]);
    }

    #[tokio::test]
    async fn a_wrong_passphrase_changes_nothing() {
        let uri = image("wrong").await;
        let err = Image::add_passphrase(&uri, b"nope", b"two", &fast())
            .await
            .unwrap_err();
        assert!(wrong_passphrase(&err), "{err}");
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![0]);
    }

    #[tokio::test]
    async fn a_concurrent_header_change_fails_instead_of_overwriting() {
        let uri = image("race").await;
        let mut target = HeaderTarget::read(&uri, "test").await.unwrap();
        let unlocked = target.header.unlock(&target.region, b"one").unwrap();
        target
            .header
            .add_keyslot(
                &mut target.region,
                &unlocked.volume_key,
                b"two",
                None,
                &fast(),
            )
            .unwrap();
        // Someone else changes the header object meanwhile (here: a keyslot of their own).
        Image::add_passphrase(&uri, b"one", b"other", &fast())
            .await
            .unwrap();
        let err = target.store().await.unwrap_err();
        assert!(matches!(err, ImageError::HeaderChanged { .. }), "{err}");
        // Theirs stands; ours was not stored.
        assert_eq!(Image::check_passphrase(&uri, b"other").await.unwrap(), 1);
        assert!(Image::check_passphrase(&uri, b"two").await.is_err());
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![0, 1]);
    }

    /// The header object's version moves with things that are not the header (a writer's
    /// lock renewal, a nonce reservation in its omap): a change made before such a move is
    /// stored, where it failed with `HeaderChanged` (on RADOS, about every other change beside
    /// a served image: a renewal every 10 s against seconds of key derivations).
    #[tokio::test]
    async fn a_change_is_stored_after_the_object_moved_but_not_the_header() {
        let uri = image("moved").await;
        let (slot, change) = Image::prepare_add_passphrase(&uri, b"one", b"two", &fast())
            .await
            .unwrap();
        let store = uri.open_store(false).await.unwrap();
        let object = object_name("t", header_object_name(uri.image_name())).unwrap();
        let op = WriteOp::new().omap_set(vec![(b"unrelated".to_vec(), b"x".to_vec())]);
        store.write_op(&object, op).await.unwrap();
        change.store().await.unwrap();
        assert_eq!(Image::check_passphrase(&uri, b"two").await.unwrap(), slot);
        // A change of the header's bytes meanwhile still fails it.
        let (_, late) = Image::prepare_add_passphrase(&uri, b"one", b"three", &fast())
            .await
            .unwrap();
        Image::add_passphrase(&uri, b"one", b"other", &fast())
            .await
            .unwrap();
        let err = late.store().await.unwrap_err();
        assert!(matches!(err, ImageError::HeaderChanged { .. }), "{err}");
        assert!(Image::check_passphrase(&uri, b"three").await.is_err());
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![0, 1, 2]);
    }

    #[tokio::test]
    async fn a_writer_stores_keyslot_changes_made_elsewhere_and_nothing_else() {
        let uri = image("writer-applies").await;
        let writer = Image::open(&uri, b"one", &OpenOptions::default())
            .await
            .unwrap();
        writer.write(0, &[7u8; 4096]).await.unwrap();

        // Two changes made from the same header: the first lands, the second is stale.
        let (slot, added) = Image::prepare_add_passphrase(&uri, b"one", b"two", &fast())
            .await
            .unwrap();
        let (_, stale) = Image::prepare_add_passphrase(&uri, b"one", b"late", &fast())
            .await
            .unwrap();
        assert!(added.bytes() > 0 && added.bytes() < 1 << 20, "{added:?}");
        writer
            .apply_header_change(
                added.version().unwrap(),
                Some(added.made_from()),
                added.ranges(),
            )
            .await
            .unwrap();
        assert_eq!(slot, 1);
        assert_eq!(Image::check_passphrase(&uri, b"two").await.unwrap(), 1);
        let err = writer
            .apply_header_change(
                stale.version().unwrap(),
                Some(stale.made_from()),
                stale.ranges(),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::HeaderChanged { .. }), "{err}");
        assert!(Image::check_passphrase(&uri, b"late").await.is_err());

        // A change of the size, or bytes that leave no valid header, are refused whole.
        let mut target = HeaderTarget::read(&uri, "test").await.unwrap();
        target
            .header
            .set_data_size(&mut target.region, Some(2 << 20))
            .unwrap();
        let resized = target.into_change();
        let refusals = [
            (
                resized.version().unwrap(),
                resized.ranges().to_vec(),
                "keyslots only",
            ),
            (
                resized.version().unwrap(),
                vec![(0, vec![0xa5; 4096])],
                "no valid header",
            ),
            (
                resized.version().unwrap(),
                vec![(u64::MAX - 8, vec![1; 16])],
                "past the header",
            ),
        ];
        for (version, ranges, why) in refusals {
            let err = writer
                .apply_header_change(version, None, &ranges)
                .await
                .unwrap_err();
            assert!(
                matches!(&err, ImageError::InvalidParameter { reason, .. } if reason.contains(why)),
                "{why}: {err}"
            );
        }
        let info = Image::info(&uri).await.unwrap();
        assert_eq!((info.size, info.keyslots), (1 << 20, vec![0, 1]));
        assert_eq!(Image::check_passphrase(&uri, b"one").await.unwrap(), 0);

        // Reads and writes went on; a read-only open does not store changes.
        let mut back = vec![0u8; 4096];
        writer.read(0, &mut back).await.unwrap();
        assert_eq!(back, [7u8; 4096]);
        writer.close().await.unwrap();
        let reader = Image::open(&uri, b"two", &OpenOptions::read_only())
            .await
            .unwrap();
        let (_, change) = Image::prepare_remove_passphrase(&uri, b"two", Some(0), false)
            .await
            .unwrap();
        let err = reader
            .apply_header_change(change.version().unwrap(), None, change.ranges())
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::ReadOnly { .. }), "{err}");
        reader.close().await.unwrap();
        assert_eq!(Image::info(&uri).await.unwrap().keyslots, vec![0, 1]);
    }

    /// A change sent to the writer after the header object's version moved without a header
    /// byte changing (the writer's nonce reservations, a snapshot, a lock renewal) is stored:
    /// it was refused as "changed" for as long as the image was written.
    #[tokio::test]
    async fn a_writer_stores_a_change_made_before_its_header_object_moved() {
        let uri = image("writer-moved").await;
        let writer = Image::open(&uri, b"one", &OpenOptions::default())
            .await
            .unwrap();
        let (slot, change) = Image::prepare_add_passphrase(&uri, b"one", b"two", &fast())
            .await
            .unwrap();
        let object = writer.inner.header_object.clone();
        let moved = WriteOp::new().omap_set(vec![(b"test.moved".to_vec(), b"1".to_vec())]);
        writer.store().write_op(&object, moved).await.unwrap();
        // Without the digest it made from, the moved version alone refuses it.
        let err = writer
            .apply_header_change(change.version().unwrap(), None, change.ranges())
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::HeaderChanged { .. }), "{err}");
        writer
            .apply_header_change(
                change.version().unwrap(),
                Some(change.made_from()),
                change.ranges(),
            )
            .await
            .unwrap();
        assert_eq!(Image::check_passphrase(&uri, b"two").await.unwrap(), slot);
        writer.close().await.unwrap();
    }

    #[tokio::test]
    async fn missing_images_and_luks_files_are_named() {
        let uri = ImageUri::parse("mem:keyslots-absent").unwrap();
        let err = Image::add_passphrase(&uri, b"a", b"b", &fast())
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("vol.luks");
        std::fs::write(&file, b"not even LUKS").unwrap();
        let uri = ImageUri::parse(file.to_str().unwrap()).unwrap();
        let err = Image::remove_passphrase(&uri, b"a", None, false)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::InvalidParameter { reason, .. } if reason.contains("LUKS file")),
            "{err}"
        );
    }
}
