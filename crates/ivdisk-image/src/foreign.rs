//! LUKS volumes made by other tools, opened through the same engine as ivdisk images (issue 6,
//! point 3): with `aes-xts-plain64` and layout `none` a sector's ciphertext sits at its own
//! offset with the IV `plain64(offset / 512 + iv_tweak)`, exactly as dm-crypt, cryptsetup's
//! userspace reencryption, qemu's LUKS driver and librbd store it. So opening one is only
//! finding its header, unlocking it and telling the engine where the sectors are:
//!
//! - [`file`]: a LUKS1/LUKS2 *file* made by cryptsetup (`ImageUri::Local` naming a regular
//!   file that starts with the LUKS magic), through [`file::LuksFileStore`], an
//!   [`ivdisk_store::ObjectStore`] whose object `n` is the file's bytes
//!   `[n * object_size, (n + 1) * object_size)`.
//! - [`rbd`]: a librbd image formatted with `rbd encryption format` (`ImageUri::Rados` where
//!   no `ivdisk_header.IMAGE` exists but `rbd_id.IMAGE` does): the header is at image offset 0
//!   inside librbd's data objects, which the engine then reads and writes directly.
//!
//! What differs from the other tools, by design of the engine: a sector whose stored bytes are
//! all zeros reads as zeros ("unwritten"; dm-crypt and qemu would decrypt it to garbage), and a
//! discard zeroes the stored bytes (as dm-crypt with `allow_discards` does, other tools then
//! read garbage there: a discarded range's contents are unspecified for them). Write-zeroes,
//! even when it may unmap, stores encrypted zeros, because its caller relies on reading zeros
//! afterwards with any tool. Every sector ever written by any of them reads back identically.
//!
//! Only `aes-xts-plain64` is accepted (what `cryptsetup luksFormat` and `rbd encryption format`
//! use by default); resizing is refused (`foreign`): resize with the tool that made the volume.

pub(crate) mod file;
pub(crate) mod rbd;

use ivdisk_crypto::{ImageId, Suite, VolumeKey};
use ivdisk_header::{DataSegment, Header, HeaderError, SegmentInfo};

use crate::{ImageError, ImageInfo, LayoutKind};

pub(crate) use file::{describe_file, info_file, lock_holder_file, luks_file_path, open_file};
pub(crate) use rbd::{info_rbd, lock_object_rbd, open_rbd};

/// The one cipher accepted for foreign volumes.
pub(crate) const FOREIGN_CIPHER: &str = "aes-xts-plain64";

fn invalid(image: &str, reason: impl Into<String>) -> ImageError {
    ImageError::InvalidParameter {
        image: image.to_owned(),
        reason: reason.into(),
    }
}

/// The data segment of a foreign volume's header, checked before any passphrase is tried:
/// not an ivdisk header, `aes-xts-plain64`, no requirements ivdisk does not know.
pub(crate) fn check_segment(image: &str, header: &Header) -> Result<SegmentInfo, ImageError> {
    if header
        .image_params()
        .map_err(ImageError::header(image))?
        .is_some()
    {
        return Err(invalid(
            image,
            "this LUKS header belongs to an ivdisk image (a header backup?), not to a LUKS volume \
             with its data: open the ivdisk image itself",
        ));
    }
    let foreign = header.foreign_requirements();
    if !foreign.is_empty() {
        return Err(ImageError::header(image)(HeaderError::UnmetRequirements(
            foreign,
        )));
    }
    let info = header.segment().map_err(ImageError::header(image))?;
    if info.cipher != FOREIGN_CIPHER {
        return Err(invalid(
            image,
            format!(
                "the LUKS volume's data is encrypted with `{}`; ivdisk opens LUKS volumes made by \
                 other tools only with `{FOREIGN_CIPHER}` (cryptsetup's and librbd's default)",
                info.cipher
            ),
        ));
    }
    if info.sector_size < 512 || !info.sector_size.is_power_of_two() || info.sector_size > 4096 {
        return Err(ImageError::Corrupt {
            image: image.to_owned(),
            reason: format!("unsupported LUKS sector size {}", info.sector_size),
        });
    }
    // A detached header (`cryptsetup luksFormat --header`) says its data starts at byte 0 of
    // *another* device; opened as a volume, the engine would take the header's own bytes for
    // the data and a write would overwrite its keyslots.
    let metadata_end = header.metadata_end();
    if info.offset < metadata_end {
        return Err(invalid(
            image,
            if info.offset == 0 {
                "this is a detached LUKS header (its data segment starts at byte 0 of another \
                 device): ivdisk opens LUKS volumes whose data follows their header in the same \
                 file or image; attach the header to its data with `cryptsetup` first"
                    .to_owned()
            } else {
                format!(
                    "the LUKS data segment starts at byte {}, inside the header's own area \
                     (which ends at byte {metadata_end}): refusing to treat header bytes as data",
                    info.offset
                )
            },
        ));
    }
    if !info.offset.is_multiple_of(info.sector_size as u64) {
        return Err(ImageError::Corrupt {
            image: image.to_owned(),
            reason: format!(
                "the data offset {} is not a multiple of the {}-byte sector size",
                info.offset, info.sector_size
            ),
        });
    }
    Ok(info)
}

/// The image size: the segment's size, or for a `dynamic` segment (LUKS2 "whole device",
/// every LUKS1 volume) what follows the data offset in `total` bytes, in whole sectors.
pub(crate) fn data_size(image: &str, info: &SegmentInfo, total: u64) -> Result<u64, ImageError> {
    let ss = info.sector_size as u64;
    let available = total
        .checked_sub(info.offset)
        .ok_or_else(|| ImageError::Corrupt {
            image: image.to_owned(),
            reason: format!(
                "the LUKS data offset {} lies past the end of the volume ({total} bytes)",
                info.offset
            ),
        })?;
    let size = match info.size {
        Some(size) if size > available => {
            return Err(ImageError::Corrupt {
                image: image.to_owned(),
                reason: format!(
                    "the LUKS data segment ({size} bytes at offset {}) ends past the end of the \
                     volume ({total} bytes)",
                    info.offset
                ),
            })
        }
        Some(size) => size / ss * ss,
        None => available / ss * ss,
    };
    // As for native headers: past 2^63 - 1 bytes NBD clients and `off_t` read the size as
    // negative, and the last object's range overflows the engine's arithmetic.
    if size > crate::MAX_IMAGE_SIZE {
        return Err(invalid(
            image,
            format!(
                "the LUKS data area is {size} bytes, larger than the largest image ivdisk opens \
                 ({} bytes, 2^63 - 1)",
                crate::MAX_IMAGE_SIZE
            ),
        ));
    }
    if size == 0 {
        return Err(invalid(
            image,
            format!(
                "the LUKS volume has no data area (its data starts at byte {} of {total})",
                info.offset
            ),
        ));
    }
    Ok(size)
}

/// The data segment's cipher for an unlocked volume key, and the sector number the engine adds
/// to each LBA (`iv_tweak` in sectors; see [`DataSegment::sector_number`]).
pub(crate) fn open_segment(
    image: &str,
    header: &Header,
    volume_key: &VolumeKey,
) -> Result<(DataSegment, u64), ImageError> {
    let segment = header
        .open_data(volume_key)
        .map_err(ImageError::header(image))?;
    if segment.suite != Suite::AesXtsPlain64 {
        return Err(invalid(
            image,
            format!(
                "the data segment's cipher is {}, not {FOREIGN_CIPHER}",
                segment.suite
            ),
        ));
    }
    let iv_sector_base = segment.sector_number(0);
    Ok((segment, iv_sector_base))
}

/// What `ivdisk info` shows for a foreign volume.
pub(crate) fn info(header: &Header, info: &SegmentInfo, size: u64, object_size: u64) -> ImageInfo {
    ImageInfo {
        size,
        suite: Suite::AesXtsPlain64,
        layout: LayoutKind::None,
        sector_size: info.sector_size,
        object_size,
        image_id: ImageId::default(),
        keyslots: header.keyslots().iter().map(|k| k.id).collect(),
        snapshots: Vec::new(),
        unfinished: None,
        header_warning: header.warning().map(str::to_owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(size: Option<u64>) -> SegmentInfo {
        SegmentInfo {
            cipher: "aes-xts-plain64".to_owned(),
            offset: 16 << 20,
            size,
            sector_size: 4096,
            iv_tweak: 0,
        }
    }

    /// A foreign volume (a librbd image without an object map takes any size) larger than
    /// 2^63 - 1 bytes is refused as native headers are; before, it opened, its size read as
    /// negative by NBD clients, and a block-status or export of its last object overflowed.
    #[test]
    fn a_data_area_past_the_largest_image_is_refused() {
        let total = u64::MAX - (1 << 20);
        for info in [segment(None), segment(Some(1 << 63))] {
            let err = data_size("pool/big", &info, total).unwrap_err();
            assert!(err.to_string().contains("2^63 - 1"), "{err}");
        }
        let largest = crate::MAX_IMAGE_SIZE / 4096 * 4096;
        let fits = segment(Some(largest));
        assert_eq!(data_size("pool/big", &fits, total).unwrap(), largest);
        assert_eq!(
            data_size("pool/small", &segment(None), 32 << 20).unwrap(),
            16 << 20
        );
    }
}

#[cfg(test)]
mod io_tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use ivdisk_crypto::{CipherParams, ImageId, Suite, VolumeKey};
    use ivdisk_store::{
        MemoryStore, NumberedNames, ObjectName, ObjectStore, ReadOp, ReadResult, StoreError,
        WriteOp, WriteOutcome,
    };

    use crate::image::EngineSpec;
    use crate::{Image, LayoutKind};

    const MIB: u64 = 1 << 20;

    /// A memory store that counts the write operations each object gets.
    struct CountingStore {
        inner: MemoryStore,
        writes: Mutex<HashMap<String, u32>>,
    }

    ivdisk_store::object_store_forwarding_to_inner!(CountingStore {
        async fn write_op(
            &self,
            object: &ObjectName,
            op: WriteOp,
        ) -> Result<WriteOutcome, StoreError> {
            *self
                .writes
                .lock()
                .unwrap()
                .entry(object.to_string())
                .or_default() += 1;
            self.inner.write_op(object, op).await
        }
        async fn read_op(
            &self,
            object: &ObjectName,
            op: ReadOp,
        ) -> Result<Vec<ReadResult>, StoreError> {
            self.inner.read_op(object, op).await
        }
    });

    /// A write-zeroes over a foreign volume whose data starts inside an object (a LUKS1 file:
    /// at 2 MiB, objects of 4 MiB) takes one store operation per object. It was split at
    /// multiples of 32 MiB in image bytes, the middle of an object there: two operations on
    /// one object, with no range lock between them when the request lay in that object (a
    /// concurrent write could land between them), and half the object zeroed if the second
    /// failed.
    #[tokio::test]
    async fn write_zeroes_takes_one_operation_per_object_when_data_starts_inside_one() {
        let store = Arc::new(CountingStore {
            inner: MemoryStore::new().unwrap(),
            writes: Mutex::new(HashMap::new()),
        });
        let key = VolumeKey::generate(64).unwrap();
        let params = CipherParams::new(512, ImageId::default());
        let cipher = ivdisk_crypto::new_cipher(Suite::AesXtsPlain64, &key, &params).unwrap();
        let header = ObjectName::new("header").unwrap();
        let lock = crate::writer_lock::WriterLock::acquire(
            store.clone(),
            header.clone(),
            "luks1",
            std::time::Duration::from_secs(30),
            crate::writer_lock::HolderRecord::None,
        )
        .await
        .unwrap();
        let image = Image::from_spec(EngineSpec {
            name: "luks1".into(),
            store: store.clone() as Arc<dyn ObjectStore>,
            header_object: header,
            data_prefix: NumberedNames::new("data.").unwrap(),
            sector_size: 512,
            object_size: 4 * MIB,
            data_offset: 2 * MIB,
            iv_sector_base: 0,
            size: 62 * MIB,
            suite: Suite::AesXtsPlain64,
            layout: LayoutKind::None,
            cipher,
            image_id: ImageId::default(),
            read_only: false,
            lock: Some(lock),
            nonces_reserved: 0,
            foreign: true,
            snapshot: None,
            snap_context: None,
            metadata_cache_bytes: 0,
        });
        // Image bytes [30, 34) MiB are object 8; [6, 62) MiB span objects 2 to 15.
        for (offset, len) in [(30 * MIB, 4 * MIB), (6 * MIB, 56 * MIB)] {
            store.writes.lock().unwrap().clear();
            image.write_zeroes(offset, len, false).await.unwrap();
            let writes = store.writes.lock().unwrap();
            let objects = len / (4 * MIB);
            assert_eq!(writes.len() as u64, objects, "{writes:?}");
            assert!(writes.values().all(|&n| n == 1), "{writes:?}");
        }
    }
}
