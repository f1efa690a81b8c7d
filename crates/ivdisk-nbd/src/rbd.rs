//! librbd images (ivdisk-rbd's `RbdImage`, plain or with librbd's LUKS loaded) as NBD block
//! devices, so that librbd and ivdisk images are served by the same NBD front end. librbd
//! takes any byte offset and length (its crypto layer does read-modify-write of partial
//! sectors), so this is error mapping and the zeroing semantics.

use async_trait::async_trait;
use ivdisk_rbd::{RbdError, RbdImage};

use crate::device::{BlockDevice, DeviceError, DeviceErrorKind};
use crate::handshake::MAX_PAYLOAD;

fn device_error(error: RbdError) -> DeviceError {
    let kind = match &error {
        RbdError::ReadOnly { .. } => DeviceErrorKind::ReadOnly,
        RbdError::OutOfRange { .. } => DeviceErrorKind::OutOfRange,
        RbdError::NoSpace { .. } => DeviceErrorKind::NoSpace,
        // librbd's own errno, where one fits NBD's short list better than EIO.
        e => match e.errno() {
            Some(libc::EROFS) => DeviceErrorKind::ReadOnly,
            Some(libc::EINVAL) => DeviceErrorKind::Invalid,
            Some(libc::ENOSPC | libc::EDQUOT) => DeviceErrorKind::NoSpace,
            _ => DeviceErrorKind::Io,
        },
    };
    DeviceError::new(kind, error.to_string())
}

/// librbd's write-zeroes, in pieces of at most [`MAX_PAYLOAD`] one after another where it
/// writes data (not [`BlockDevice::fast_zero`]: under LUKS its crypto layer writes every
/// object of the range as encrypted zeros, all of them at once). The server charges such a
/// request like a write of at most that many bytes; whole, a 4 GiB trim held 4 GiB of
/// buffers in librbd at once, and a client could send thousands.
async fn zero_in_pieces(
    image: &RbdImage,
    offset: u64,
    len: u64,
    may_unmap: bool,
) -> Result<(), DeviceError> {
    let piece = match image.fast_zero(may_unmap) {
        true => len.max(1),
        false => u64::from(MAX_PAYLOAD),
    };
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let n = piece.min(end - at);
        RbdImage::write_zeroes(image, at, n, may_unmap)
            .await
            .map_err(device_error)?;
        at += n;
    }
    Ok(())
}

#[async_trait]
impl BlockDevice for RbdImage {
    fn size(&self) -> u64 {
        RbdImage::size(self)
    }

    fn read_only(&self) -> bool {
        self.is_read_only()
    }

    fn preferred_block_size(&self) -> u32 {
        // librbd's LUKS2 uses 4096-byte sectors: smaller or unaligned IO costs a
        // read-modify-write in its crypto layer. LUKS1 (512-byte sectors) and plain images
        // take any size, but 4 KiB keeps the client off partial RADOS object extents and
        // is what every client aligns to anyway.
        4096
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        RbdImage::read(self, offset, buf)
            .await
            .map_err(device_error)
    }

    async fn write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        RbdImage::write(self, offset, data)
            .await
            .map_err(device_error)
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        RbdImage::flush(self).await.map_err(device_error)
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        // The trait promises that a discarded range reads as zeros; librbd's discard skips
        // ranges below its discard granularity (they keep their data), its write-zeroes does
        // not, and deallocates whole objects just the same.
        zero_in_pieces(self, offset, len, true).await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), DeviceError> {
        zero_in_pieces(self, offset, len, may_unmap).await
    }

    fn fast_zero(&self, may_unmap: bool) -> bool {
        // On a plain image librbd's unmapping write-zeroes removes or truncates objects (a
        // discard that also zeroes partial ones). Allocated zeros are written like data, and
        // under LUKS the crypto layer may encrypt and write them too: not fast, so there
        // clients write zeros themselves.
        may_unmap && self.encryption().is_none()
    }
}
