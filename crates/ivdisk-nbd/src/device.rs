//! What the server exports: anything with a size that can read, write and flush byte ranges.
//! Discard, write-zeroes and block status have defaults so that a minimal device (a test
//! double, a plain file) needs only the four required methods; ivdisk images implement them
//! all (`image.rs`).

use async_trait::async_trait;
use ivdisk_image::{PayloadPlacement, ReadReply, WritePayload};

use crate::proto::Errno;

/// Why a device request failed, in the terms NBD can carry to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError {
    pub kind: DeviceErrorKind,
    /// For the client's user and the server log; never contains secrets.
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceErrorKind {
    /// The stored data could not be read or written.
    Io,
    /// Data failed authentication; the first bad byte is at this device offset.
    Integrity { offset: u64 },
    /// The device is read-only.
    ReadOnly,
    /// The range lies (partly) past the end of the device.
    OutOfRange,
    /// Bad parameters.
    Invalid,
    /// The operation would not be fast (write-zeroes with `FAST_ZERO`).
    NotSupported,
    /// The storage behind the device is full (NBD's ENOSPC: clients such as qemu may pause
    /// instead of failing the guest's IO).
    NoSpace,
}

impl DeviceError {
    pub fn new(kind: DeviceErrorKind, message: impl Into<String>) -> Self {
        DeviceError {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn errno(&self, write: bool) -> Errno {
        match self.kind {
            DeviceErrorKind::Io | DeviceErrorKind::Integrity { .. } => Errno::Io,
            DeviceErrorKind::ReadOnly => Errno::Perm,
            // The protocol asks for ENOSPC on writes past the end, EINVAL otherwise.
            DeviceErrorKind::OutOfRange if write => Errno::NoSpc,
            DeviceErrorKind::OutOfRange | DeviceErrorKind::Invalid => Errno::Inval,
            DeviceErrorKind::NotSupported => Errno::NotSup,
            DeviceErrorKind::NoSpace => Errno::NoSpc,
        }
    }
}

/// A run of the device with one allocation state (NBD `base:allocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// `false`: a hole that reads as zeros.
    pub allocated: bool,
}

/// A block device the server can export. Methods take `&self` and are called concurrently
/// (replies go out in completion order); the server checks ranges against [`size`] before
/// calling, and calls [`flush`] after a write that asked for FUA.
///
/// [`size`]: BlockDevice::size
/// [`flush`]: BlockDevice::flush
#[async_trait]
pub trait BlockDevice: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;

    /// Read `buf.len()` bytes at `offset`.
    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError>;

    /// Write `data` at `offset`.
    async fn write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError>;

    /// Make every completed write durable.
    async fn flush(&self) -> Result<(), DeviceError>;

    /// [`BlockDevice::read`] into a buffer the device returns (a read reply's data), which it
    /// may take from below instead of filling the server's (an ivdisk image decrypts the
    /// store's buffer in place, and may leave each sector in its slot there: the reply goes out
    /// in pieces). It must hold `len` bytes.
    async fn read_reply(&self, offset: u64, len: usize) -> Result<ReadReply, DeviceError> {
        let mut buf = vec![0u8; len];
        self.read(offset, &mut buf).await?;
        Ok(ReadReply::contiguous(buf))
    }

    /// Where the server should put the payload of a `len`-byte write at `offset` in the
    /// buffer it hands to [`BlockDevice::write_payload`]: together, with spare capacity the
    /// device appends to without moving the buffer (an ivdisk image in layout `omap-tail`
    /// appends a whole object's metadata), or in slots (an ivdisk image in layout
    /// `unaligned` encrypts each sector where its slot lies). Together with nothing to spare
    /// by default.
    fn write_placement(&self, _offset: u64, _len: usize) -> PayloadPlacement {
        PayloadPlacement::Contiguous { spare: 0 }
    }

    /// [`BlockDevice::write`] of a payload the server hands over, placed as
    /// [`BlockDevice::write_placement`] asked, which the device may use as its own instead of
    /// copying it (an ivdisk image encrypts it in place).
    async fn write_payload(&self, offset: u64, payload: WritePayload) -> Result<(), DeviceError> {
        self.write(offset, &payload.into_contiguous()).await
    }

    /// Refuses writes (the export is advertised read-only).
    fn read_only(&self) -> bool {
        false
    }

    /// The IO size below which the device does extra work (read-modify-write).
    fn preferred_block_size(&self) -> u32 {
        4096
    }

    /// The longest range a block-status request asks [`BlockDevice::allocation`] about: one a
    /// device answers cheaply (an ivdisk image without an object map lists the store's
    /// objects for longer ones). The client asks again for the rest.
    fn allocation_span(&self) -> u64 {
        u64::MAX
    }

    /// Let `[offset, offset + len)` read as zeros and free its space where possible.
    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.write_zeroes(offset, len, false).await
    }

    /// Make `[offset, offset + len)` read as zeros; `may_unmap`: its space may be freed.
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), DeviceError> {
        let _ = may_unmap;
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0u8; CHUNK.min(len) as usize];
        let mut at = offset;
        while at < offset + len {
            let n = CHUNK.min(offset + len - at);
            self.write(at, &zeros[..n as usize]).await?;
            at += n;
        }
        Ok(())
    }

    /// Whether write-zeroes of this kind is about as fast as a discard (answers NBD's
    /// `FAST_ZERO` flag: if not, the client prefers to write zeros itself). For whole blocks
    /// of [`BlockDevice::preferred_block_size`]: the server answers "not fast" for the others.
    fn fast_zero(&self, may_unmap: bool) -> bool {
        let _ = may_unmap;
        false
    }

    /// Allocation of `[offset, offset + len)`, as extents covering it in order. The default
    /// says "all data", which is always correct.
    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        let _ = offset;
        Ok(vec![Extent {
            len,
            allocated: true,
        }])
    }
}
