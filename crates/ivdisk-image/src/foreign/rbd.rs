//! librbd images encrypted with `rbd encryption format IMAGE luks1|luks2 PASSFILE`, opened
//! through the engine directly on librbd's data objects.
//!
//! librbd keeps an image's metadata in RADOS objects: `rbd_id.NAME` holds the image id (an
//! encoded string: le32 length + bytes), the omap of `rbd_header.ID` holds `size` (le64),
//! `order` (u8; objects are `1 << order` bytes), `object_prefix` (encoded string, e.g.
//! `rbd_data.ID`), `features` (le64), one `snapshot_*` key per snapshot and `parent` for a
//! clone. Data object `n` is `{object_prefix}.{n:016x}`, holding image bytes
//! `[n << order, (n + 1) << order)`. With `rbd encryption format`, the LUKS header is at image
//! offset 0 (inside the data objects) and the encrypted data from the segment's offset on
//! (librbd aligns it to the object size), `aes-xts-plain64`, IV = offset / 512 from there.
//!
//! # When ivdisk opens an rbd image
//!
//! **No open at all** (read-only included), because ivdisk would read wrong data:
//! - a `parent` (a clone): unwritten parts come from the parent image, which ivdisk does not
//!   follow;
//! - feature `data-pool` (data objects in another pool), `migrating` (data partly in the
//!   migration source), `dirty-cache` (writes still in a persistent write-back cache), a
//!   `striping` layout other than one stripe of one object (`stripe_unit` = object size,
//!   `stripe_count` = 1), or a feature bit ivdisk does not know.
//!
//! **Read-only only** (read-write is refused with the reason, read-only works):
//! - features `object-map`, `fast-diff` (librbd trusts its object map to know which objects
//!   exist: objects ivdisk creates would stay invisible to librbd), `journaling` (librbd
//!   writes the journal first: direct object writes would be undone by a replay and bypass
//!   mirroring), `non-primary` (a mirror's secondary copy), `operations` (op_features such as
//!   clone parents, snapshot trash or groups);
//! - any snapshot (`snapshot_*` keys): a write without librbd's snapshot context would change
//!   data the snapshots share;
//! - feature `exclusive-lock` *while* its lock (`rbd_lock` on `rbd_header.ID`) has a holder:
//!   a live librbd writer (or `rbd lock add`).
//!
//! So read-write needs an image whose features are within `layering`, `exclusive-lock` (not
//! held), `deep-flatten` and default `striping`, without snapshots or parent, e.g.
//! `rbd create --image-feature layering` or after
//! `rbd feature disable IMG fast-diff object-map`.
//!
//! **Locking**: a writer takes ivdisk's writer lock (`ivdisk_writer`, renewed, expiring) on
//! `rbd_header.ID`, which keeps other ivdisk writers out, then checks the rules above again
//! under it. librbd does not know that lock: do not write the image with librbd (qemu, krbd,
//! `rbd`) while ivdisk has it open for writing, as with any two writers of an image without
//! `exclusive-lock`. Size changes made by librbd while ivdisk has the image open are not seen.
//! Nor are snapshots: one taken by librbd (`rbd snap create`) while ivdisk writes the image
//! gets the writes made after it too (ivdisk's writes carry the snapshot context it read at
//! open). Write a librbd image that is snapshotted through librbd (`rbd://`).

use std::sync::Arc;

use ivdisk_header::{Header, MemoryHeaderIo};
use ivdisk_store::{
    NumberedNames, ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, StoreError,
};

use super::{check_segment, data_size, invalid, open_segment};
use crate::image::{EngineSpec, Image};
use crate::layout::place_extents;
use crate::writer_lock::{HolderRecord, WriterLock};
use crate::{ImageError, ImageInfo, LayoutKind, OpenOptions};

const FEATURE_LAYERING: u64 = 1 << 0;
const FEATURE_STRIPINGV2: u64 = 1 << 1;
const FEATURE_EXCLUSIVE_LOCK: u64 = 1 << 2;
const FEATURE_OBJECT_MAP: u64 = 1 << 3;
const FEATURE_FAST_DIFF: u64 = 1 << 4;
const FEATURE_DEEP_FLATTEN: u64 = 1 << 5;
const FEATURE_JOURNALING: u64 = 1 << 6;
const FEATURE_DATA_POOL: u64 = 1 << 7;
const FEATURE_OPERATIONS: u64 = 1 << 8;
const FEATURE_MIGRATING: u64 = 1 << 9;
const FEATURE_NON_PRIMARY: u64 = 1 << 10;
const FEATURE_DIRTY_CACHE: u64 = 1 << 11;
const KNOWN_FEATURES: u64 = (1 << 12) - 1;

/// Features whose images ivdisk cannot read correctly from the objects.
const NO_OPEN: [(u64, &str); 3] = [
    (FEATURE_DATA_POOL, "data-pool"),
    (FEATURE_MIGRATING, "migrating"),
    (FEATURE_DIRTY_CACHE, "dirty-cache"),
];
/// Features whose images ivdisk may read but must not write.
const NO_WRITE: [(u64, &str); 5] = [
    (FEATURE_OBJECT_MAP, "object-map"),
    (FEATURE_FAST_DIFF, "fast-diff"),
    (FEATURE_JOURNALING, "journaling"),
    (FEATURE_NON_PRIMARY, "non-primary"),
    (FEATURE_OPERATIONS, "operations"),
];
/// Features with which ivdisk writes an image (`exclusive-lock` only while nobody holds it,
/// `striping` only with the default layout).
const WRITABLE: u64 =
    FEATURE_LAYERING | FEATURE_STRIPINGV2 | FEATURE_EXCLUSIVE_LOCK | FEATURE_DEEP_FLATTEN;
/// librbd's exclusive lock on the header object.
const RBD_LOCK: &str = "rbd_lock";
/// The largest LUKS header region read (LUKS2 allows keyslot areas up to 128 MiB).
const MAX_HEADER_REGION: u64 = 128 << 20;

/// An rbd image's metadata, from `rbd_id.NAME` and the omap of `rbd_header.ID`.
#[derive(Debug, Clone)]
struct RbdImage {
    header_object: ObjectName,
    /// Data object `n` is `{data_prefix}{n:016x}`.
    data_prefix: String,
    /// Raw image size (LUKS header included).
    size: u64,
    object_size: u64,
    features: u64,
    snapshots: usize,
    parent: bool,
    /// (stripe_unit, stripe_count) when the image has its own striping.
    striping: Option<(u64, u64)>,
}

fn corrupt(image: &str, reason: impl Into<String>) -> ImageError {
    ImageError::Corrupt {
        image: image.to_owned(),
        reason: reason.into(),
    }
}

fn le_u64(image: &str, key: &str, value: &[u8]) -> Result<u64, ImageError> {
    value
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| corrupt(image, format!("rbd header key `{key}` is not a le64")))
}

/// A Ceph-encoded string: le32 length, then the bytes.
fn encoded_string(image: &str, what: &str, value: &[u8]) -> Result<String, ImageError> {
    let bad = || corrupt(image, format!("{what} is not an encoded string"));
    let len = u32::from_le_bytes(value.get(..4).ok_or_else(bad)?.try_into().expect("4")) as usize;
    let bytes = value.get(4..4 + len).ok_or_else(bad)?;
    String::from_utf8(bytes.to_vec()).map_err(|_| bad())
}

fn object(image: &str, name: String) -> Result<ObjectName, ImageError> {
    ObjectName::new(name).map_err(ImageError::store(image))
}

/// Every byte of an object (`None`: it does not exist).
async fn read_object(
    store: &dyn ObjectStore,
    name: &ObjectName,
) -> Result<Option<Vec<u8>>, StoreError> {
    let size = match store
        .read_op(name, ReadOp::new().step(ReadStep::Stat))
        .await
    {
        Ok(mut r) => match r.pop() {
            Some(ReadResult::Stat(stat)) => stat.size,
            _ => 0,
        },
        Err(StoreError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let op = ReadOp::new().step(ReadStep::Read {
        offset: 0,
        len: size,
    });
    let results = match store.read_op(name, op).await {
        Ok(r) => r,
        Err(StoreError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut out = vec![0u8; size as usize];
    place_extents(results.into_iter().next(), 0, &mut out).map_err(StoreError::Corrupt)?;
    Ok(Some(out))
}

impl RbdImage {
    /// Read an image's metadata; `None` when `rbd_id.NAME` does not exist.
    async fn read(
        store: &dyn ObjectStore,
        name: &str,
        image: &str,
    ) -> Result<Option<RbdImage>, ImageError> {
        let id_object = object(image, format!("rbd_id.{name}"))?;
        let Some(id) = read_object(store, &id_object)
            .await
            .map_err(ImageError::store(image))?
        else {
            return Ok(None);
        };
        let id = encoded_string(image, &format!("`{id_object}`"), &id)?;
        let header_object = object(image, format!("rbd_header.{id}"))?;
        let mut pairs = Vec::new();
        let mut start = Vec::new();
        loop {
            let op = ReadOp::new().step(ReadStep::OmapGetRange {
                start: start.clone(),
                end: None,
                max: 1024,
            });
            let results = store
                .read_op(&header_object, op)
                .await
                .map_err(|e| match e {
                    StoreError::NotFound { .. } => corrupt(
                        image,
                        format!("`{id_object}` names image id {id} but `{header_object}` does not exist"),
                    ),
                    e => ImageError::store(image)(e),
                })?;
            let Some(ReadResult::Omap { pairs: got, more }) = results.into_iter().next() else {
                return Err(corrupt(
                    image,
                    "reading the rbd header's omap returned no pairs",
                ));
            };
            if let Some((last, _)) = got.last() {
                start = last.to_vec();
                start.push(0);
            }
            let done = !more || got.is_empty();
            pairs.extend(got.to_vec());
            if done {
                break;
            }
        }
        let get = |key: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == key.as_bytes())
                .map(|(_, v)| v.as_slice())
        };
        let need = |key: &str| {
            get(key).ok_or_else(|| {
                corrupt(
                    image,
                    format!("`{header_object}` has no `{key}`: not an rbd format 2 image header"),
                )
            })
        };
        let size = le_u64(image, "size", need("size")?)?;
        let order = *need("order")?
            .first()
            .ok_or_else(|| corrupt(image, "rbd header key `order` is empty"))?;
        if !(12..=26).contains(&order) {
            return Err(corrupt(
                image,
                format!("rbd object order {order} is outside 12..=26 (4 KiB to 64 MiB objects)"),
            ));
        }
        let prefix = encoded_string(
            image,
            "rbd header key `object_prefix`",
            need("object_prefix")?,
        )?;
        let features = le_u64(image, "features", need("features")?)?;
        let striping = match (get("stripe_unit"), get("stripe_count")) {
            (Some(unit), Some(count)) => Some((
                le_u64(image, "stripe_unit", unit)?,
                le_u64(image, "stripe_count", count)?,
            )),
            _ => None,
        };
        Ok(Some(RbdImage {
            header_object,
            data_prefix: format!("{prefix}."),
            size,
            object_size: 1 << order,
            features,
            snapshots: pairs
                .iter()
                .filter(|(k, _)| k.starts_with(b"snapshot_"))
                .count(),
            parent: get("parent").is_some(),
            striping,
        }))
    }

    fn feature_names(&self, table: &[(u64, &'static str)]) -> Vec<&'static str> {
        table
            .iter()
            .filter(|(bit, _)| self.features & bit != 0)
            .map(|&(_, name)| name)
            .collect()
    }

    /// Why ivdisk cannot open this image at all, if it cannot.
    fn refuse_open(&self) -> Option<String> {
        if self.parent {
            return Some(
                "it is a clone (it has a parent image): ivdisk does not read through to parents; \
                 flatten it first (`rbd flatten`)"
                    .into(),
            );
        }
        let features = self.feature_names(&NO_OPEN);
        if !features.is_empty() {
            return Some(format!(
                "it has feature(s) {} with which its data is not all in its own data objects",
                features.join(", ")
            ));
        }
        if self.features & !KNOWN_FEATURES != 0 {
            return Some(format!(
                "it has feature bits {:#x} ivdisk does not know",
                self.features & !KNOWN_FEATURES
            ));
        }
        if let Some((unit, count)) = self.striping {
            if self.features & FEATURE_STRIPINGV2 != 0 && (unit != self.object_size || count != 1) {
                return Some(format!(
                    "it is striped (stripe unit {unit}, stripe count {count}); ivdisk reads \
                     only the default layout of one object after the other"
                ));
            }
        }
        None
    }

    /// Why ivdisk must not write this image, if it must not (live lock holders aside).
    fn refuse_write(&self) -> Option<String> {
        let features = self.feature_names(&NO_WRITE);
        if !features.is_empty() {
            return Some(format!(
                "it has feature(s) {} that librbd keeps consistent and direct object writes \
                 would not (disable them with `rbd feature disable`, or open read-only)",
                features.join(", ")
            ));
        }
        if self.features & !WRITABLE != 0 {
            return Some(format!(
                "it has feature bits {:#x} ivdisk does not write with",
                self.features & !WRITABLE
            ));
        }
        if self.snapshots > 0 {
            return Some(format!(
                "it has {} snapshot(s), whose shared data direct object writes would change \
                 (remove them, or open read-only)",
                self.snapshots
            ));
        }
        None
    }
}

/// Read the LUKS header region at image offset 0 (the start of the data objects).
async fn read_bytes(
    store: &dyn ObjectStore,
    rbd: &RbdImage,
    image: &str,
    len: u64,
) -> Result<Vec<u8>, ImageError> {
    let mut out = vec![0u8; len as usize];
    let mut at = 0u64;
    while at < len {
        let n = at / rbd.object_size;
        let within = at % rbd.object_size;
        let chunk = (rbd.object_size - within).min(len - at);
        let name = object(image, format!("{}{n:016x}", rbd.data_prefix))?;
        let op = ReadOp::new().step(ReadStep::Read {
            offset: within,
            len: chunk,
        });
        let dst = &mut out[at as usize..(at + chunk) as usize];
        match store.read_op(&name, op).await {
            Ok(results) => place_extents(results.into_iter().next(), within, dst)
                .map_err(|reason| corrupt(image, format!("object `{name}`: {reason}")))?,
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(ImageError::store(image)(e)),
        }
        at += chunk;
    }
    Ok(out)
}

async fn read_header(
    store: &dyn ObjectStore,
    rbd: &RbdImage,
    image: &str,
) -> Result<(Header, MemoryHeaderIo), ImageError> {
    let not_luks = || {
        invalid(
            image,
            "the rbd image has no LUKS header at its start: it is not encrypted (ivdisk opens \
             rbd images formatted with `rbd encryption format IMAGE luks1|luks2 PASSFILE`)",
        )
    };
    let first = read_bytes(store, rbd, image, 4096.min(rbd.size)).await?;
    // 16 bytes at least: the magic, the version and a LUKS2 header's size (librbd images
    // may be any number of bytes long).
    if first.len() < 16 || first[..6] != *b"LUKS\xba\xbe" {
        return Err(not_luks());
    }
    let mut len = 4096u64;
    if u16::from_be_bytes([first[6], first[7]]) == 2 {
        // Both LUKS2 binary headers with their JSON areas.
        let hdr_size = u64::from_be_bytes(first[8..16].try_into().expect("8 bytes"));
        if !(4096..=4 << 20).contains(&hdr_size) {
            return Err(corrupt(
                image,
                format!("LUKS2 header size {hdr_size} is invalid"),
            ));
        }
        len = 2 * hdr_size;
    }
    let partial = MemoryHeaderIo(read_bytes(store, rbd, image, len.min(rbd.size)).await?);
    let header = Header::read(&partial).map_err(ImageError::header(image))?;
    let region = header.region_len();
    if region > MAX_HEADER_REGION || region > rbd.size {
        return Err(corrupt(
            image,
            format!("the LUKS header region ({region} bytes) is larger than the image or 128 MiB"),
        ));
    }
    let io = MemoryHeaderIo(read_bytes(store, rbd, image, region.max(len).min(rbd.size)).await?);
    let header = Header::read(&io).map_err(ImageError::header(image))?;
    if let Some(warning) = header.warning() {
        tracing::warn!(image, warning, "rbd image LUKS header");
    }
    Ok((header, io))
}

async fn metadata(
    store: &dyn ObjectStore,
    name: &str,
    image: &str,
) -> Result<RbdImage, ImageError> {
    let rbd = RbdImage::read(store, name, image)
        .await?
        .ok_or_else(|| ImageError::NotFound {
            image: image.to_owned(),
        })?;
    if let Some(reason) = rbd.refuse_open() {
        return Err(invalid(
            image,
            format!("cannot open this rbd image: {reason}"),
        ));
    }
    Ok(rbd)
}

/// Whether anyone holds librbd's exclusive lock, described.
async fn rbd_lock_holder(
    store: &dyn ObjectStore,
    rbd: &RbdImage,
    image: &str,
) -> Result<Option<String>, ImageError> {
    if rbd.features & FEATURE_EXCLUSIVE_LOCK == 0 {
        return Ok(None);
    }
    let lockers = store
        .list_lockers(&rbd.header_object, RBD_LOCK)
        .await
        .map_err(ImageError::store(image))?;
    Ok(lockers.first().map(|l| {
        let mut text = format!("{} (cookie `{}`", l.client, l.cookie);
        if !l.description.is_empty() {
            text.push_str(&format!(", {}", l.description));
        }
        text.push(')');
        text
    }))
}

/// Refuse a read-write open of `rbd` (see the module documentation).
async fn check_writable(
    store: &dyn ObjectStore,
    rbd: &RbdImage,
    image: &str,
) -> Result<(), ImageError> {
    if let Some(reason) = rbd.refuse_write() {
        return Err(invalid(
            image,
            format!("cannot open this rbd image for writing: {reason}"),
        ));
    }
    if let Some(holder) = rbd_lock_holder(store, rbd, image).await? {
        return Err(ImageError::Locked {
            image: image.to_owned(),
            holder: format!(
                "a librbd client: {holder} holds its exclusive lock `{RBD_LOCK}`; close that \
                 client (or `rbd lock rm` a stale lock)"
            ),
            expires_in: None,
            breakable: false,
        });
    }
    Ok(())
}

/// The object holding the writer lock of librbd image `name` (`rbd_header.ID`, where ivdisk's
/// writer takes `ivdisk_writer`), or `None` if there is no librbd image by that name.
pub(crate) async fn lock_object_rbd(
    store: &dyn ObjectStore,
    name: &str,
    image: &str,
) -> Result<Option<ObjectName>, ImageError> {
    Ok(RbdImage::read(store, name, image)
        .await?
        .map(|rbd| rbd.header_object))
}

/// What `ivdisk info` shows for an encrypted rbd image (no passphrase needed).
pub(crate) async fn info_rbd(
    store: Arc<dyn ObjectStore>,
    name: &str,
    image: &str,
) -> Result<ImageInfo, ImageError> {
    let rbd = metadata(store.as_ref(), name, image).await?;
    let (header, _) = read_header(store.as_ref(), &rbd, image).await?;
    let segment = check_segment(image, &header)?;
    let size = data_size(image, &segment, rbd.size)?;
    Ok(super::info(&header, &segment, size, rbd.object_size))
}

/// Open an encrypted librbd image `name` (`rbd_id.NAME`) with a passphrase.
pub(crate) async fn open_rbd(
    store: Arc<dyn ObjectStore>,
    name: &str,
    image: &str,
    passphrase: &[u8],
    options: &OpenOptions,
) -> Result<Image, ImageError> {
    if let Some(snapshot) = &options.snapshot {
        // librbd's snapshots are not ivdisk's: opened "at" one, the head was read.
        return Err(super::invalid(
            image,
            format!(
                "ivdisk does not open librbd's snapshots (`{snapshot}`) itself; read it \
                 through librbd, as an rbd:// image"
            ),
        ));
    }
    let rbd = metadata(store.as_ref(), name, image).await?;
    if !options.read_only {
        check_writable(store.as_ref(), &rbd, image).await?;
    }
    let (header, io) = read_header(store.as_ref(), &rbd, image).await?;
    let segment = check_segment(image, &header)?;
    data_size(image, &segment, rbd.size)?;
    let unlocked = header
        .unlock(&io, passphrase)
        .map_err(ImageError::header(image))?;
    let (data, iv_sector_base) = open_segment(image, &header, &unlocked.volume_key)?;
    drop(unlocked);
    let (lock, rbd) = if options.read_only {
        (None, rbd)
    } else {
        let lock = WriterLock::acquire(
            store.clone(),
            rbd.header_object.clone(),
            image,
            options.lock_duration,
            HolderRecord::None,
        )
        .await?;
        // Under the lock: the image may have changed since (snapshots, features, size, a
        // librbd writer).
        let checked = async {
            let now = metadata(store.as_ref(), name, image).await?;
            check_writable(store.as_ref(), &now, image).await?;
            Ok::<_, ImageError>(now)
        }
        .await;
        match checked {
            Ok(now) => (Some(lock), now),
            Err(e) => {
                drop(lock.release().await);
                return Err(e);
            }
        }
    };
    let size = data_size(image, &segment, rbd.size)?;
    if rbd.features & FEATURE_JOURNALING != 0 {
        tracing::warn!(
            image,
            "the rbd image has journaling: writes librbd has journaled but not yet applied are \
             not seen"
        );
    }
    tracing::info!(
        image,
        version = header.version(),
        size,
        object_size = rbd.object_size,
        "opened an encrypted rbd image"
    );
    Ok(Image::from_spec(EngineSpec {
        name: image.to_owned(),
        store,
        header_object: rbd.header_object,
        data_prefix: NumberedNames::new(rbd.data_prefix).map_err(ImageError::store(image))?,
        sector_size: segment.sector_size as usize,
        object_size: rbd.object_size,
        data_offset: segment.offset,
        iv_sector_base,
        size,
        suite: data.suite,
        layout: LayoutKind::None,
        cipher: data.cipher,
        image_id: Default::default(),
        read_only: options.read_only,
        lock,
        nonces_reserved: 0,
        foreign: true,
        snapshot: None,
        snap_context: None,
        metadata_cache_bytes: 0,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(features: u64) -> RbdImage {
        RbdImage {
            header_object: ObjectName::new("rbd_header.x").unwrap(),
            data_prefix: "rbd_data.x.".into(),
            size: 64 << 20,
            object_size: 4 << 20,
            features,
            snapshots: 0,
            parent: false,
            striping: None,
        }
    }

    #[test]
    fn every_known_feature_has_a_rule() {
        let no_open: u64 = NO_OPEN.iter().map(|f| f.0).sum();
        let no_write: u64 = NO_WRITE.iter().map(|f| f.0).sum();
        assert_eq!(no_open & no_write, 0);
        assert_eq!(no_open & WRITABLE, 0);
        assert_eq!(no_write & WRITABLE, 0);
        assert_eq!(no_open | no_write | WRITABLE, KNOWN_FEATURES);
    }

    #[test]
    fn feature_rules() {
        let plain = image(FEATURE_LAYERING | FEATURE_EXCLUSIVE_LOCK | FEATURE_DEEP_FLATTEN);
        assert!(plain.refuse_open().is_none() && plain.refuse_write().is_none());
        // librbd's default feature set: readable, not writable.
        let default = image(
            FEATURE_LAYERING
                | FEATURE_EXCLUSIVE_LOCK
                | FEATURE_OBJECT_MAP
                | FEATURE_FAST_DIFF
                | FEATURE_DEEP_FLATTEN,
        );
        assert!(default.refuse_open().is_none());
        let why = default.refuse_write().unwrap();
        assert!(
            why.contains("object-map") && why.contains("fast-diff"),
            "{why}"
        );
        assert!(image(FEATURE_DATA_POOL).refuse_open().is_some());
        assert!(image(1 << 40).refuse_open().is_some());
        let mut clone = image(FEATURE_LAYERING);
        clone.parent = true;
        assert!(clone.refuse_open().unwrap().contains("clone"));
        let mut snapped = image(FEATURE_LAYERING);
        snapped.snapshots = 2;
        assert!(snapped.refuse_open().is_none());
        assert!(snapped.refuse_write().unwrap().contains("snapshot"));
        let mut striped = image(FEATURE_STRIPINGV2);
        striped.striping = Some((4 << 20, 1));
        assert!(striped.refuse_open().is_none());
        striped.striping = Some((64 << 10, 16));
        assert!(striped.refuse_open().unwrap().contains("striped"));
    }

    /// librbd images may be any number of bytes long: one of 8..16 bytes starting with the
    /// LUKS2 magic is not LUKS (reading the header size past its end panicked).
    #[tokio::test]
    async fn a_tiny_image_with_the_luks_magic_is_not_luks() {
        use ivdisk_store::ObjectStoreExt;
        let store = ivdisk_store::MemoryStore::new().unwrap();
        let mut tiny = image(FEATURE_LAYERING);
        for len in [6u64, 8, 12, 15] {
            tiny.size = len;
            let mut bytes = b"LUKS\xba\xbe\x00\x02\x00\x00\x00\x00\x00\x00\x40".to_vec();
            bytes.truncate(len as usize);
            let data = ObjectName::new("rbd_data.x.0000000000000000").unwrap();
            store.remove(&data).await.ok();
            store.write(&data, 0, &bytes).await.unwrap();
            let err = read_header(&store, &tiny, "rados://rbd/tiny")
                .await
                .unwrap_err();
            assert!(err.to_string().contains("no LUKS header"), "{len}: {err}");
        }
    }

    #[test]
    fn decodes_encoded_strings() {
        assert_eq!(
            encoded_string("i", "x", b"\x03\x00\x00\x00abc").unwrap(),
            "abc"
        );
        assert!(encoded_string("i", "x", b"\x09\x00\x00\x00abc").is_err());
    }
}
