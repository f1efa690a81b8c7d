//! Where a header lives: anything that reads and writes bytes at offsets.
//!
//! The header crate never assumes a file: the image layer keeps headers in a header object,
//! the command line in LUKS files and header backups, tests in memory.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Byte access to the region holding a header (binary headers, JSON areas, keyslots area).
pub trait HeaderIo {
    /// Fill `buf` from `offset`; reading past the end is `io::ErrorKind::UnexpectedEof`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Write all of `buf` at `offset`, growing the region if needed.
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Make every write so far durable.
    fn sync(&mut self) -> io::Result<()>;
    /// The region's current length in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Grow the region to at least `len` bytes (sparse where the medium allows), so tools
    /// that check a header device's size (cryptsetup) find the whole keyslots area.
    fn ensure_len(&mut self, len: u64) -> io::Result<()>;
}

impl HeaderIo for File {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }
    fn sync(&mut self) -> io::Result<()> {
        self.sync_data()
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn ensure_len(&mut self, len: u64) -> io::Result<()> {
        if self.metadata()?.len() < len {
            self.set_len(len)?;
        }
        Ok(())
    }
}

/// A header held in memory (tests, and the image layer after reading a header object).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryHeaderIo(pub Vec<u8>);

impl HeaderIo for MemoryHeaderIo {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let end = start
            .checked_add(buf.len())
            .filter(|&end| end <= self.0.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(&self.0[start..end]);
        Ok(())
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        let end = start + buf.len();
        if self.0.len() < end {
            self.0.resize(end, 0);
        }
        self.0[start..end].copy_from_slice(buf);
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.len() as u64)
    }
    fn ensure_len(&mut self, len: u64) -> io::Result<()> {
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        if self.0.len() < len {
            self.0.resize(len, 0);
        }
        Ok(())
    }
}

pub(crate) fn read_vec(
    io: &dyn HeaderIo,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, crate::HeaderError> {
    let mut buf = vec![0; len];
    io.read_at(offset, &mut buf)
        .map_err(crate::HeaderError::io(offset, len))?;
    Ok(buf)
}
