//! Which parts of an image hold data: the answer to NBD's `base:allocation` block status and
//! what `export` and `verify` skip. The granularity is the data object: an object that does
//! not exist is a hole that reads as zeros; an object that exists is reported as data even
//! where some of its sectors are unwritten (always a safe answer: "data" only means "read it").

use futures_util::future::join_all;
use ivdisk_store::{ReadOp, ReadStep, StoreError};

use crate::image::Image;
use crate::ImageError;

/// A run of bytes of the image with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocationExtent {
    pub offset: u64,
    pub len: u64,
    /// `false`: no stored object backs these bytes; they read as zeros.
    pub allocated: bool,
}

/// Objects stat'ed at once.
const STATS_IN_FLIGHT: usize = 32;

impl Image {
    /// The allocation state of `[offset, offset + len)`, as consecutive extents that cover the
    /// range exactly (adjacent extents of the same state are merged).
    pub async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<AllocationExtent>, ImageError> {
        let inner = &self.inner;
        inner.check_range(offset, len)?;
        let mut out: Vec<AllocationExtent> = Vec::new();
        if len == 0 {
            return Ok(out);
        }
        let object_size = inner.object_size;
        let base = inner.data_offset;
        let end = offset + len;
        // Image byte ranges per object, in order.
        let mut spans = Vec::new();
        let mut at = offset;
        while at < end {
            let object = (base + at) / object_size;
            let object_end = (object + 1) * object_size - base;
            let stop = object_end.min(end);
            spans.push((object, at, stop - at));
            at = stop;
        }
        for batch in spans.chunks(STATS_IN_FLIGHT) {
            let stats = batch.iter().map(|&(object, _, _)| {
                let name = inner.data_object(object);
                async move {
                    match inner
                        .store
                        .read_op(&name, {
                            let mut op = ReadOp::new().step(ReadStep::Stat);
                            op.snap = inner.read_snap();
                            op
                        })
                        .await
                    {
                        Ok(_) => Ok(true),
                        Err(StoreError::NotFound { .. }) => Ok(false),
                        Err(e) => Err(ImageError::store(&inner.name)(e)),
                    }
                }
            });
            for (result, &(_, at, len)) in join_all(stats).await.into_iter().zip(batch) {
                let allocated = result?;
                match out.last_mut() {
                    Some(last) if last.allocated == allocated => last.len += len,
                    _ => out.push(AllocationExtent {
                        offset: at,
                        len,
                        allocated,
                    }),
                }
            }
        }
        Ok(out)
    }
}
