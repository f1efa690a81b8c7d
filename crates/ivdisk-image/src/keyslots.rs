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
//! change does not touch (as `cryptsetup luksAddKey` on an active volume).
//!
//! LUKS files made by cryptsetup keep their keyslots in the file itself: change them with the
//! header crate on the file (as `ivdisk passphrase` and `ivdisk key` do); these functions
//! refuse them, and librbd's LUKS images, whose header lies inside the image's data.
//!
//! The key derivations run on the calling thread (seconds by design), as in [`Image::open`].

use std::sync::Arc;

use ivdisk_header::{Header, PbkdfRequest};
use ivdisk_store::{ObjectName, ObjectStore, StoreError};

use crate::header_object::HeaderRegion;
use crate::image::{header_object_name, object_name, read_header};
use crate::{Image, ImageError, ImageUri};

/// An image's header object, read for a change.
pub(crate) struct HeaderTarget {
    pub(crate) image: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) object: ObjectName,
    pub(crate) header: Header,
    pub(crate) region: HeaderRegion,
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
    pub(crate) async fn read(uri: &ImageUri, what: &str) -> Result<HeaderTarget, ImageError> {
        refuse_luks_file(uri, what)?;
        let image = uri.to_string();
        let store = uri.open_store(false).await?;
        let object = object_name(&image, header_object_name(uri.image_name()))?;
        let (header, region) = match read_header(store.as_ref(), &object, &image).await {
            Err(ImageError::NotFound { .. }) => {
                return Err(missing_header(store, uri, &image, what).await)
            }
            other => other?,
        };
        // Only ivdisk headers: checked before any passphrase is tried.
        crate::image::parse_header(&image, &header)?;
        Ok(HeaderTarget {
            image,
            store,
            object,
            header,
            region,
        })
    }

    /// Store every change made to the region in one version-asserted operation, durably.
    pub(crate) async fn store(self) -> Result<(), ImageError> {
        let Some(op) = self.region.write_op() else {
            return Ok(());
        };
        match self.store.write_op(&self.object, op).await {
            Ok(_) => {}
            Err(StoreError::VersionMismatch { .. } | StoreError::NotFound { .. }) => {
                return Err(ImageError::HeaderChanged { image: self.image })
            }
            Err(e) => return Err(ImageError::store(&self.image)(e)),
        }
        self.store
            .flush()
            .await
            .map_err(ImageError::store(&self.image))
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
        let image = target.image.clone();
        target.store().await?;
        tracing::info!(image = %image, keyslot = slot, "passphrase added");
        Ok(slot)
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
        let image = target.image.clone();
        target.store().await?;
        tracing::info!(image = %image, keyslot = slot, "passphrase removed");
        Ok(slot)
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
        let mut target = HeaderTarget::read(uri, "changing a passphrase").await?;
        let slot = target
            .header
            .change_passphrase(&mut target.region, old, new, slot, pbkdf)
            .map_err(ImageError::header(&target.image))?;
        let image = target.image.clone();
        target.store().await?;
        tracing::info!(image = %image, keyslot = slot, "passphrase changed");
        Ok(slot)
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
