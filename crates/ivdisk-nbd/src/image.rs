//! ivdisk images as NBD block devices: the image's IO path already takes any byte offset and
//! length, so this is error mapping and the allocation query.

use async_trait::async_trait;
use ivdisk_image::{Image, ImageError, PayloadPlacement, ReadReply, WritePayload};

use crate::device::{BlockDevice, DeviceError, DeviceErrorKind, Extent};

fn device_error(error: ImageError) -> DeviceError {
    let kind = match &error {
        ImageError::Integrity {
            lbas, sector_size, ..
        } => DeviceErrorKind::Integrity {
            offset: lbas.first().copied().unwrap_or_default() * *sector_size as u64,
        },
        ImageError::ReadOnly { .. } => DeviceErrorKind::ReadOnly,
        ImageError::OutOfRange { .. } => DeviceErrorKind::OutOfRange,
        ImageError::InvalidParameter { .. } => DeviceErrorKind::Invalid,
        // ENOSPC, not EIO: qemu's default (`werror=enospc`) then pauses the guest until space
        // is freed, where EIO would fail the guest's write.
        _ if error.is_no_space() => DeviceErrorKind::NoSpace,
        _ => DeviceErrorKind::Io,
    };
    DeviceError::new(kind, error.to_string())
}

#[async_trait]
impl BlockDevice for Image {
    fn size(&self) -> u64 {
        Image::size(self)
    }

    fn read_only(&self) -> bool {
        self.is_read_only()
    }

    fn preferred_block_size(&self) -> u32 {
        self.sector_size() as u32
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        Image::read(self, offset, buf).await.map_err(device_error)
    }

    async fn write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        Image::write(self, offset, data).await.map_err(device_error)
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        Image::flush(self).await.map_err(device_error)
    }

    async fn read_reply(&self, offset: u64, len: usize) -> Result<ReadReply, DeviceError> {
        Image::read_reply(self, offset, len)
            .await
            .map_err(device_error)
    }

    fn write_placement(&self, offset: u64, len: usize) -> PayloadPlacement {
        Image::write_placement(self, offset, len as u64)
    }

    async fn write_payload(&self, offset: u64, payload: WritePayload) -> Result<(), DeviceError> {
        Image::write_payload(self, offset, payload)
            .await
            .map_err(device_error)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        Image::discard(self, offset, len)
            .await
            .map_err(device_error)
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), DeviceError> {
        Image::write_zeroes(self, offset, len, may_unmap)
            .await
            .map_err(device_error)
    }

    fn fast_zero(&self, may_unmap: bool) -> bool {
        // Unmapping returns sectors to the unwritten state without encrypting anything;
        // allocated zeros are encrypted and written like any data, and so are all zeros on
        // LUKS volumes of other tools (which would read the unwritten state as noise).
        may_unmap && !self.is_foreign()
    }

    fn allocation_span(&self) -> u64 {
        // On images of small objects a block status of 256 MiB listed every object of the
        // image, or of the pool on RADOS, at every request.
        self.allocation_span_unlisted()
    }

    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        Ok(Image::allocation(self, offset, len)
            .await
            .map_err(device_error)?
            .into_iter()
            .map(|e| Extent {
                len: e.len,
                allocated: e.allocated,
            })
            .collect())
    }
}
