//! The header object: the image's LUKS2-format header region (binary headers, JSON, keyslot
//! areas) stored as one object. The header crate works on a [`HeaderIo`]; here that is a copy
//! in memory that records what changed, written back in ONE store operation that asserts the
//! object's version, so a header change is atomic and two concurrent changes cannot both land.

use std::io;

use ivdisk_header::{HeaderIo, MemoryHeaderIo};
use ivdisk_store::{
    ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, StoreError, WriteOp, WriteStep,
};

/// A header region read from its object, with the byte ranges changed since.
#[derive(Debug, Default)]
pub(crate) struct HeaderRegion {
    bytes: MemoryHeaderIo,
    dirty: Vec<(u64, u64)>,
    /// Object version the copy was read at (`None`: the object did not exist).
    version: Option<u64>,
}

impl HeaderRegion {
    /// A region for a header object that does not exist yet.
    pub(crate) fn new_object() -> Self {
        HeaderRegion::default()
    }

    /// Read the whole header object.
    pub(crate) async fn read(
        store: &dyn ObjectStore,
        object: &ObjectName,
    ) -> Result<Option<Self>, StoreError> {
        // Stat first so the read asks for no more than the object holds (a backend may
        // allocate what a read step asks for); the second stat gives the version read.
        let len = match store
            .read_op(object, ReadOp::new().step(ReadStep::Stat))
            .await
        {
            Ok(mut r) => match r.pop() {
                Some(ReadResult::Stat(stat)) => stat.size,
                _ => 0,
            },
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let op = ReadOp::new()
            .step(ReadStep::Stat)
            .step(ReadStep::Read { offset: 0, len });
        let results = match store.read_op(object, op).await {
            Ok(results) => results,
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut results = results.into_iter();
        let (Some(ReadResult::Stat(stat)), Some(ReadResult::Extents(extents))) =
            (results.next(), results.next())
        else {
            return Err(StoreError::Corrupt(format!(
                "reading header object `{object}` returned the wrong results"
            )));
        };
        let mut bytes = vec![0u8; stat.size as usize];
        for extent in extents {
            let at = extent.offset as usize;
            let end = (at + extent.data.len()).min(bytes.len());
            bytes[at..end].copy_from_slice(&extent.data[..end - at]);
        }
        Ok(Some(HeaderRegion {
            bytes: MemoryHeaderIo(bytes),
            dirty: Vec::new(),
            version: Some(stat.version),
        }))
    }

    /// The write operation storing every change since reading (`None`: nothing changed).
    /// It fails with `VersionMismatch` (or `Exists`) if someone changed the object meanwhile.
    pub(crate) fn write_op(&self) -> Option<WriteOp> {
        if self.dirty.is_empty() {
            return None;
        }
        let ranges = self
            .dirty
            .iter()
            .map(|&(offset, len)| (offset, self.range(offset, len)));
        Some(header_write_op(self.version, ranges))
    }

    /// Every change since reading, as (offset, bytes), in offset order, none overlapping.
    pub(crate) fn changes(&self) -> Vec<(u64, Vec<u8>)> {
        self.dirty
            .iter()
            .map(|&(offset, len)| (offset, self.range(offset, len).to_vec()))
            .collect()
    }

    fn range(&self, offset: u64, len: u64) -> &[u8] {
        &self.bytes.0[offset as usize..(offset + len) as usize]
    }

    /// SHA-256 of the region's bytes as they are now (to tell later whether another reader
    /// sees the same header: the object's version also moves with its omap and its locks).
    pub(crate) fn digest(&self) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(&self.bytes.0).into()
    }

    /// Bytes read from the object (its size).
    pub(crate) fn len(&self) -> u64 {
        self.bytes.0.len() as u64
    }

    /// The object version the copy was read at (`None`: a region for a new object).
    pub(crate) fn version(&self) -> Option<u64> {
        self.version
    }

    /// Mark the changes as stored, at the object's new version.
    pub(crate) fn stored(&mut self, version: u64) {
        self.dirty.clear();
        self.version = Some(version);
    }

    fn mark(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.dirty.push((offset, len));
        self.dirty.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.dirty.len());
        for &(o, l) in &self.dirty {
            match merged.last_mut() {
                Some((mo, ml)) if o <= *mo + *ml => *ml = (*ml).max(o + l - *mo),
                _ => merged.push((o, l)),
            }
        }
        self.dirty = merged;
    }
}

/// The operation writing `ranges` into a header object read at `version` (`None`: one that
/// does not exist yet): it fails with `VersionMismatch` (or `Exists`) if the object changed.
pub(crate) fn header_write_op<'a>(
    version: Option<u64>,
    ranges: impl Iterator<Item = (u64, &'a [u8])>,
) -> WriteOp {
    let mut op = WriteOp::new().step(match version {
        Some(v) => WriteStep::AssertVersion(v),
        None => WriteStep::CreateExclusive,
    });
    for (offset, bytes) in ranges {
        op = op.write(offset, bytes);
    }
    op
}

/// Apply `steps` to the header object at whatever version it has, as long as its bytes are
/// still those whose digest is `made_from` (the region a change was made from): the object's
/// version also moves with things that change no header byte, a writer lock's renewal (on
/// RADOS a write of the lock's xattr, every 10 s) and omap changes. `version`: the version to
/// try first without reading the region again (the one it was read at). `Ok(false)` when the
/// header's bytes changed, the object is gone, or its version kept moving.
pub(crate) async fn write_unless_header_changed(
    store: &dyn ObjectStore,
    object: &ObjectName,
    made_from: &[u8; 32],
    mut version: Option<u64>,
    steps: &[WriteStep],
) -> Result<bool, StoreError> {
    for _ in 0..8 {
        let at = match version.take() {
            Some(at) => at,
            None => match HeaderRegion::read(store, object).await? {
                Some(now) if now.digest() == *made_from => now
                    .version()
                    .expect("a region read from its object has a version"),
                _ => return Ok(false),
            },
        };
        let mut op = WriteOp::new().step(WriteStep::AssertVersion(at));
        op.steps.extend(steps.iter().cloned());
        match store.write_op(object, op).await {
            Ok(_) => return Ok(true),
            Err(StoreError::VersionMismatch { .. } | StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// [`write_unless_header_changed`] for an image: a store error names `image`, and a header
/// that changed is `HeaderChanged`.
pub(crate) async fn store_unless_header_changed(
    store: &dyn ObjectStore,
    object: &ObjectName,
    image: &str,
    made_from: &[u8; 32],
    version: Option<u64>,
    steps: &[WriteStep],
) -> Result<(), crate::ImageError> {
    let stored = write_unless_header_changed(store, object, made_from, version, steps)
        .await
        .map_err(crate::ImageError::store(image))?;
    match stored {
        true => Ok(()),
        false => Err(crate::ImageError::HeaderChanged {
            image: image.to_owned(),
        }),
    }
}

impl HeaderIo for HeaderRegion {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.bytes.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.bytes.write_at(offset, buf)?;
        self.mark(offset, buf.len() as u64);
        Ok(())
    }
    fn sync(&mut self) -> io::Result<()> {
        // Durability comes from the single write operation that stores the region.
        Ok(())
    }
    fn size(&self) -> io::Result<u64> {
        self.bytes.size()
    }
    fn ensure_len(&mut self, len: u64) -> io::Result<()> {
        let old = self.bytes.0.len() as u64;
        self.bytes.ensure_len(len)?;
        // Only the last byte needs storing: the object grows sparsely to the full length.
        if len > old {
            self.mark(len - 1, 1);
        }
        Ok(())
    }
}
