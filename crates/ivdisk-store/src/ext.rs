//! Conveniences over the minimal [`ObjectStore`] surface.

use crate::{
    Extent, ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, Stat, StoreError, WriteOp,
    WriteOutcome, WriteStep,
};

/// Helpers every store gets for free: single-step reads and writes, dense reads.
#[async_trait::async_trait]
pub trait ObjectStoreExt: ObjectStore {
    /// Write `data` at `offset` (one-step write operation).
    async fn write(
        &self,
        object: &ObjectName,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteOutcome, StoreError> {
        self.write_op(object, WriteOp::new().write(offset, data))
            .await
    }

    /// The written extents of `[offset, offset + len)` (holes left out).
    async fn read_sparse(
        &self,
        object: &ObjectName,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Extent>, StoreError> {
        let mut results = self
            .read_op(object, ReadOp::new().step(ReadStep::Read { offset, len }))
            .await?;
        match results.pop() {
            Some(ReadResult::Extents(extents)) => Ok(extents),
            other => Err(StoreError::Corrupt(format!(
                "a read step returned {other:?}"
            ))),
        }
    }

    /// `[offset, offset + len)` as bytes: holes read as zeros, reading stops at the object's
    /// end (so the result may be shorter than `len`).
    async fn read(
        &self,
        object: &ObjectName,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, StoreError> {
        let mut results = self
            .read_op(
                object,
                ReadOp::new()
                    .step(ReadStep::Stat)
                    .step(ReadStep::Read { offset, len }),
            )
            .await?;
        let (Some(ReadResult::Extents(extents)), Some(ReadResult::Stat(stat))) =
            (results.pop(), results.pop())
        else {
            return Err(StoreError::Corrupt(
                "a read returned the wrong results".into(),
            ));
        };
        let end = stat.size.min(offset.saturating_add(len));
        let mut out = vec![0u8; end.saturating_sub(offset) as usize];
        for extent in extents {
            let at = (extent.offset - offset) as usize;
            out[at..at + extent.data.len()].copy_from_slice(&extent.data);
        }
        Ok(out)
    }

    /// Size and version, or `None` if the object does not exist.
    async fn stat(&self, object: &ObjectName) -> Result<Option<Stat>, StoreError> {
        match self
            .read_op(object, ReadOp::new().step(ReadStep::Stat))
            .await
        {
            Ok(mut r) => match r.pop() {
                Some(ReadResult::Stat(stat)) => Ok(Some(stat)),
                other => Err(StoreError::Corrupt(format!("a stat returned {other:?}"))),
            },
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Delete an object.
    async fn remove(&self, object: &ObjectName) -> Result<WriteOutcome, StoreError> {
        self.write_op(object, WriteOp::new().step(WriteStep::Remove))
            .await
    }

    /// All omap pairs in key order (paging through `OmapGetRange`; each page starts at the
    /// previous page's last key, which is skipped, so that no start key needs a NUL byte).
    async fn omap_all(&self, object: &ObjectName) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        let mut out: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut start = Vec::new();
        loop {
            let mut r = self
                .read_op(
                    object,
                    ReadOp::new().step(ReadStep::OmapGetRange {
                        start: start.clone(),
                        end: None,
                        max: 1024,
                    }),
                )
                .await?;
            let Some(ReadResult::Omap { pairs, more }) = r.pop() else {
                return Err(StoreError::Corrupt(
                    "an omap read returned the wrong result".into(),
                ));
            };
            let skip = usize::from(
                matches!(out.last(), Some((last, _)) if pairs.first().is_some_and(|(k, _)| k == last.as_slice())),
            );
            if let Some((last, _)) = pairs.last() {
                start = last.to_vec();
            }
            let fresh = pairs.len() - skip;
            out.extend(
                pairs
                    .iter()
                    .skip(skip)
                    .map(|(k, v)| (k.to_vec(), v.to_vec())),
            );
            if fresh == 0 && more {
                return Err(StoreError::Corrupt(format!(
                    "omap paging of `{object}` made no progress"
                )));
            }
            if !more {
                return Ok(out);
            }
        }
    }
}

impl<T: ObjectStore + ?Sized> ObjectStoreExt for T {}
