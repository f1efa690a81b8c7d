//! Keeping an image, or one of its snapshots, from being removed while another open reads it:
//! a read-only open writes nothing to the store and takes no writer lock, so a removal (which
//! holds the writer lock) cannot see it there.
//!
//! - Local images: the reader marks what it reads in the store's directory
//!   (`ivdisk_store::reader_marks`, byte-range locks), and removals refuse while it is marked.
//! - RADOS images: the reader watches the header object ([`ObjectStore::watch`]), answering
//!   every notify with what it reads (the head or a snapshot id), its process and its host. A
//!   removal first records that it is under way (the header's omap key `ivdisk.removing`,
//!   naming the writer lock's cookie and what goes), then notifies the watchers and refuses
//!   if one reads what it removes or does not answer. A reader that starts watching after the
//!   notify finds the record and gives up: the OSD orders the watch, the notify and the
//!   record's write on the one object, so no reader slips between them. A record left by a
//!   removal that failed or crashed counts only while the writer lock it names is held. A
//!   watch the OSD dropped (the reader cut off or paused past the watch timeout) hides the
//!   reader from removals until it is registered again, so its reads count only while the
//!   watch is held (`Inner::check_reads_watched`, `ReaderHold::held_unbroken`).
//! - `mem:` images are in one process' memory: nothing to keep apart.

use std::time::Duration;

use ivdisk_store::reader_marks::{self, ReadTarget, ReaderMark, RemovalHold};
use ivdisk_store::{
    ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, SnapId, StoreError, Watch, WatchStatus,
    WriteOp, WriteStep,
};

use crate::{ImageError, ImageUri};

/// The header object's omap key recording a removal under way (RADOS).
pub(crate) const REMOVING_KEY: &[u8] = b"ivdisk.removing";
/// How long a removal waits for the watchers' answers: a live reader answers in
/// milliseconds; one that does not answer in this time counts as reading.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// First word of a reader's answer, so that other watchers' answers are told apart.
const REPLY_TAG: &str = "ivdisk-reader";

/// What a read-only open holds while it reads (see the module's description).
#[derive(Debug)]
pub(crate) enum ReaderHold {
    Marked(#[allow(dead_code)] ReaderMark),
    Watching(#[allow(dead_code)] Watch),
}

impl ReaderHold {
    /// How this hold keeps what it marks from removal now: `Some(true)` held without a break
    /// since it was taken, `Some(false)` held again after a break (a watch the store lost
    /// and registered again: a removal may have gone on unseen meanwhile), `None` not held
    /// (a watch lost, not registered again yet, or whose object is gone).
    pub(crate) fn held_unbroken(&self) -> Option<bool> {
        match self {
            ReaderHold::Marked(_) => Some(true),
            ReaderHold::Watching(watch) => match watch.status() {
                WatchStatus::Held { registration } => Some(registration == 0),
                WatchStatus::Lost | WatchStatus::ObjectGone => None,
            },
        }
    }
}

/// What a removal holds while it removes.
#[derive(Debug)]
pub(crate) enum RemovalGuard {
    Local(#[allow(dead_code)] RemovalHold),
    /// The removal record in the header object: removed with the header (delete) or with the
    /// snapshot's record (snap rm); a record left behind counts only while its lock is held.
    Recorded,
}

fn target(snapshot: Option<SnapId>) -> ReadTarget {
    snapshot.map_or(ReadTarget::Head, ReadTarget::Snapshot)
}

/// `what` a reader reads or a removal removes, as the answers and the record spell it:
/// `head` (a removal: the whole image) or `snap:ID`.
fn target_word(snapshot: Option<SnapId>) -> String {
    snapshot.map_or_else(|| "head".to_owned(), |id| format!("snap:{id}"))
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

/// A reader's answer to a removal's notify.
fn reader_reply(snapshot: Option<SnapId>) -> Vec<u8> {
    let host = crate::writer_lock::host_name();
    format!(
        "{REPLY_TAG} target={} pid={} host={}",
        target_word(snapshot),
        std::process::id(),
        if host.is_empty() { "?" } else { &host }
    )
    .into_bytes()
}

/// A reader's answer: (target word, pid, host). `None`: not a reader's answer.
fn parse_reply(reply: &[u8]) -> Option<(String, String, String)> {
    let text = std::str::from_utf8(reply).ok()?;
    let mut words = text.split_whitespace();
    if words.next()? != REPLY_TAG {
        return None;
    }
    let (mut target, mut pid, mut host) = (None, None, None);
    for word in words {
        match word.split_once('=') {
            Some(("target", v)) => target = Some(v.to_owned()),
            Some(("pid", v)) => pid = Some(v.to_owned()),
            Some(("host", v)) => host = Some(v.to_owned()),
            _ => {}
        }
    }
    Some((target?, pid.unwrap_or_default(), host.unwrap_or_default()))
}

/// Mark that this open reads the image at `snapshot` (`None`: the head). `None` where
/// nothing needs marking (`mem:`).
pub(crate) async fn mark_reader(
    uri: &ImageUri,
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    shown: &str,
    snapshot: Option<SnapId>,
) -> Result<Option<ReaderHold>, ImageError> {
    match uri {
        ImageUri::Local { dir } => reader_marks::mark_reader(dir, target(snapshot))
            .map(|mark| mark.map(ReaderHold::Marked))
            .map_err(refused(shown)),
        ImageUri::Rados { .. } => {
            let watch = match store.watch(header_object, reader_reply(snapshot)).await {
                Ok(watch) => watch,
                // A client whose OSD caps allow no writes (`profile rbd-read-only`, `allow
                // r`) may not watch: it reads all the same, as librbd's read-only opens do,
                // unseen by removals.
                Err(StoreError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::PermissionDenied =>
                {
                    tracing::warn!(
                        image = shown,
                        "this client may not watch the image's header (its OSD caps allow no \
                         writes): `ivdisk delete` and `snap rm` elsewhere will not see this \
                         reader"
                    );
                    None
                }
                Err(e) => return Err(ImageError::store(shown)(e)),
            };
            refuse_if_removing(store, header_object, shown, snapshot).await?;
            Ok(watch.map(ReaderHold::Watching))
        }
        ImageUri::Memory { .. } => Ok(None),
    }
}

/// Refuse a reader of the image at `snapshot` while a removal of it is under way.
pub(crate) async fn refuse_if_removing(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    shown: &str,
    snapshot: Option<SnapId>,
) -> Result<(), ImageError> {
    match removal_under_way(store, header_object, shown).await? {
        Some(removing) if removing == "head" || removing == target_word(snapshot) => {
            Err(ImageError::RemovalUnderway {
                image: shown.to_owned(),
            })
        }
        _ => Ok(()),
    }
}

/// What the header's removal record says goes (`head` or `snap:ID`), if a removal holding
/// the writer lock recorded one.
async fn removal_under_way(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    shown: &str,
) -> Result<Option<String>, ImageError> {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![REMOVING_KEY.to_vec()]));
    let results = store
        .read_op(header_object, op)
        .await
        .map_err(ImageError::store(shown))?;
    let record = match results.into_iter().next() {
        Some(ReadResult::Omap { pairs, .. }) => pairs.into_iter().next().map(|(_, v)| v.to_vec()),
        _ => None,
    };
    let Some(record) = record else {
        return Ok(None);
    };
    let record = String::from_utf8_lossy(&record).into_owned();
    let Some((cookie, what)) = record.split_once(' ') else {
        return Ok(None);
    };
    let holder = crate::writer_lock::holder(store, header_object)
        .await
        .map_err(ImageError::store(shown))?;
    Ok(holder
        .filter(|h| h.cookie == cookie)
        .map(|_| what.to_owned()))
}

/// Whose readers a change holds off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeldOff {
    /// Every reader, of the head and of every snapshot: the image is deleted.
    Everything,
    /// The head's readers: it changes in a way they cannot follow (a shrink, a rollback);
    /// a snapshot's data stays.
    Head,
    /// That snapshot's readers: it is removed.
    Snapshot(SnapId),
}

impl HeldOff {
    /// The snapshot the removal record names (`None`: the head).
    fn snapshot(self) -> Option<SnapId> {
        match self {
            HeldOff::Snapshot(id) => Some(id),
            HeldOff::Everything | HeldOff::Head => None,
        }
    }
}

/// Hold off the readers `what` names while the image changes under them; refused while one
/// reads. The caller holds the writer lock, so the store is open for writing. Unless the
/// header goes too, [`end_hold`] when done.
pub(crate) async fn hold_off_readers(
    uri: &ImageUri,
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    shown: &str,
    what: HeldOff,
) -> Result<Option<RemovalGuard>, ImageError> {
    match uri {
        ImageUri::Local { dir } => {
            let target = match what {
                HeldOff::Everything => None,
                HeldOff::Head => Some(ReadTarget::Head),
                HeldOff::Snapshot(id) => Some(ReadTarget::Snapshot(id)),
            };
            reader_marks::hold_off_readers(dir, target)
                .map(|hold| Some(RemovalGuard::Local(hold)))
                .map_err(refused(shown))
        }
        ImageUri::Rados { .. } => {
            hold_off_watchers(store, header_object, shown, what).await?;
            Ok(Some(RemovalGuard::Recorded))
        }
        ImageUri::Memory { .. } => Ok(None),
    }
}

/// After a change that held off the readers without removing the header (a shrink, a
/// rollback): the removal record goes, so that readers open again at once (it would count
/// until the lock it names is released).
pub(crate) async fn end_hold(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    held: Option<RemovalGuard>,
) {
    if let Some(RemovalGuard::Recorded) = held {
        let op = WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![REMOVING_KEY.to_vec()]));
        if let Err(e) = store.write_op(header_object, op).await {
            tracing::warn!(object = %header_object, error = %e, "removing the record that held off readers");
        }
    }
}

async fn hold_off_watchers(
    store: &dyn ObjectStore,
    header_object: &ObjectName,
    shown: &str,
    what: HeldOff,
) -> Result<(), ImageError> {
    let Some(holder) = crate::writer_lock::holder(store, header_object)
        .await
        .map_err(ImageError::store(shown))?
    else {
        return Err(ImageError::LockLost {
            image: shown.to_owned(),
            reason: "it is gone before the removal began (broken by `ivdisk lock break`?); \
                     nothing was removed, run the command again"
                .into(),
        });
    };
    let removing = target_word(what.snapshot());
    let record = format!("{} {removing}", holder.cookie).into_bytes();
    let op = WriteOp::new()
        .step(WriteStep::AssertExists)
        .omap_set(vec![(REMOVING_KEY.to_vec(), record)]);
    store
        .write_op(header_object, op)
        .await
        .map_err(ImageError::store(shown))?;
    let answers = store
        .notify(header_object, NOTIFY_TIMEOUT)
        .await
        .map_err(ImageError::store(shown));
    let readers = answers.map(|answers| readers_of(&answers, what));
    match readers {
        Ok(readers) if readers.is_empty() => Ok(()),
        refusal => {
            let op = WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![REMOVING_KEY.to_vec()]));
            if let Err(e) = store.write_op(header_object, op).await {
                tracing::warn!(image = shown, error = %e, "removing the removal record");
            }
            Err(match refusal {
                Ok(readers) => ImageError::WatchedByReaders {
                    image: shown.to_owned(),
                    readers,
                },
                Err(e) => e,
            })
        }
    }
}

/// The readers among the watchers' answers that `what` holds off, described for a message;
/// watchers that did not answer count too.
fn readers_of(answers: &ivdisk_store::NotifyReplies, what: HeldOff) -> Vec<String> {
    let reads = |target: &str| match what {
        HeldOff::Everything => true,
        HeldOff::Head | HeldOff::Snapshot(_) => target == target_word(what.snapshot()),
    };
    let mut readers: Vec<String> = answers
        .replies
        .iter()
        .filter_map(|(client, reply)| {
            let (target, pid, host) = parse_reply(reply)?;
            reads(&target).then(|| format!("process {pid} on host {host} ({client})"))
        })
        .collect();
    readers.extend(answers.unanswered.iter().map(|client| {
        format!("{client}, which did not answer (a reader that died? its watch ends within 30 s)")
    }));
    readers
}

#[cfg(test)]
mod tests {
    use super::*;
    use ivdisk_store::NotifyReplies;

    #[test]
    fn a_reply_says_what_it_reads_and_who_reads_it() {
        let (target, pid, host) = parse_reply(&reader_reply(Some(7))).unwrap();
        assert_eq!(target, "snap:7");
        assert_eq!(pid, std::process::id().to_string());
        assert!(!host.is_empty());
        assert_eq!(parse_reply(&reader_reply(None)).unwrap().0, "head");
        assert_eq!(parse_reply(b"something else"), None);
        assert_eq!(parse_reply(b""), None);
    }

    #[test]
    fn a_snapshot_removal_counts_only_that_snapshots_readers_and_the_silent() {
        let answers = NotifyReplies {
            replies: vec![
                ("client.1".into(), reader_reply(None)),
                ("client.2".into(), reader_reply(Some(3))),
                ("client.3".into(), b"not ours".to_vec()),
            ],
            unanswered: vec!["client.4".into()],
        };
        let of_snap_3 = readers_of(&answers, HeldOff::Snapshot(3));
        assert_eq!(of_snap_3.len(), 2, "{of_snap_3:?}");
        assert!(of_snap_3[0].ends_with("(client.2)"), "{of_snap_3:?}");
        assert!(of_snap_3[1].starts_with("client.4,"), "{of_snap_3:?}");
        assert_eq!(readers_of(&answers, HeldOff::Snapshot(9)).len(), 1);
        // Deleting the image: every reader counts.
        assert_eq!(readers_of(&answers, HeldOff::Everything).len(), 3);
        assert!(readers_of(&NotifyReplies::default(), HeldOff::Everything).is_empty());
        // A shrink or a rollback: the head's readers and the silent.
        let of_head = readers_of(&answers, HeldOff::Head);
        assert_eq!(of_head.len(), 2, "{of_head:?}");
        assert!(of_head[0].ends_with("(client.1)"), "{of_head:?}");
    }
}
