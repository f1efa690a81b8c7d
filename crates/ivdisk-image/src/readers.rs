//! Keeping a local image, or one of its snapshots, from being removed while another open reads
//! it: a read-only open writes nothing to the store and takes no writer lock, so a removal
//! (which holds the writer lock) cannot see it there. It marks what it reads in the store's
//! directory instead (`ivdisk_store::reader_marks`), and removals refuse while it is marked.
//!
//! RADOS stores have no marks yet: there a reader does not keep `delete` or `snap rm` off.

use ivdisk_store::reader_marks::{self, ReadTarget, ReaderMark, RemovalHold};
use ivdisk_store::{SnapId, StoreError};

use crate::{ImageError, ImageUri};

fn target(snapshot: Option<SnapId>) -> ReadTarget {
    snapshot.map_or(ReadTarget::Head, ReadTarget::Snapshot)
}

/// `shown`: the image (and snapshot) as messages name it.
fn refused(shown: &str) -> impl FnOnce(StoreError) -> ImageError + '_ {
    move |e| match e {
        StoreError::OpenByReaders { pids, .. } => ImageError::OpenByReaders {
            image: shown.to_owned(),
            pids,
        },
        StoreError::RemovalUnderway { .. } => ImageError::RemovalUnderway {
            image: shown.to_owned(),
        },
        other => ImageError::store(shown)(other),
    }
}

/// Mark that this open reads the image at `snapshot` (`None`: the head). `None` where the
/// store keeps no marks.
pub(crate) fn mark_reader(
    uri: &ImageUri,
    shown: &str,
    snapshot: Option<SnapId>,
) -> Result<Option<ReaderMark>, ImageError> {
    match uri {
        ImageUri::Local { dir } => {
            reader_marks::mark_reader(dir, target(snapshot)).map_err(refused(shown))
        }
        ImageUri::Rados { .. } | ImageUri::Memory { .. } => Ok(None),
    }
}

/// Hold off the readers of the image at `snapshot` (`None`: of the image and all its
/// snapshots) while it is removed; refused while one reads it. The caller holds the writer
/// lock, so the store is open for writing.
pub(crate) fn hold_off_readers(
    uri: &ImageUri,
    shown: &str,
    snapshot: Option<SnapId>,
) -> Result<Option<RemovalHold>, ImageError> {
    match uri {
        ImageUri::Local { dir } => {
            reader_marks::hold_off_readers(dir, snapshot.map(ReadTarget::Snapshot))
                .map(Some)
                .map_err(refused(shown))
        }
        ImageUri::Rados { .. } | ImageUri::Memory { .. } => Ok(None),
    }
}
