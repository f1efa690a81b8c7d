//! The one-writer rule: opening an image for writing takes the store's advisory exclusive lock
//! on the header object, renewed by a background thread while the image is open. A holder
//! that dies stops renewing and its lock expires; `ivdisk lock break` removes one at once. (On
//! the local store the next writer takes it over at once, see `ivdisk-store`'s engine.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ivdisk_store::{
    LockRequest, Locker, ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, StoreError, Watch,
    WriteOp, WriteStep,
};

use crate::ImageError;

/// [`crate::Image::refuse_if_write_locked`] leaves a lock with less than this left to the
/// open: the clocks of this host and of the OSDs, which decide expiry, may differ by a little.
pub const LOCK_HELD_MARGIN: Duration = Duration::from_secs(2);
/// How long a write waits while writes are refused only until the writer lock is renewed
/// (the store did not answer a renewal in time: an OSD stalled or restarted), before it fails
/// with the reason. librbd holds writes while it cannot renew its lock; a client then sees a
/// slow write rather than an I/O error (fio stopped, a guest's file system went read-only,
/// after a single OSD stalled for 16 s).
pub const LOCK_STALL_WAIT: Duration = Duration::from_secs(300);
/// The lock's name on the header object.
pub const WRITER_LOCK: &str = "ivdisk_writer";
/// How long a lock lives without renewal; renewed every third of it.
pub const DEFAULT_LOCK_DURATION: Duration = Duration::from_secs(30);
/// The header object's omap key naming the last holder of the writer lock (its cookie),
/// written right after taking the lock and before anything else: a writer whose lock expired
/// takes it again only if this still names it, that is, if nobody held it meanwhile.
pub(crate) const LAST_WRITER_KEY: &[u8] = b"ivdisk.last_writer";
/// The header object's omap key saying where the writer that holds (or last held) the lock
/// runs, `CLIENT ADDRESS` (RADOS: `client.4123 10.0.0.1:0/3825123`), while it has the image
/// open: set with [`LAST_WRITER_KEY`], removed when it closes. Found by the next writer, it
/// names a writer that did not close (killed, crashed, paused, cut off by the network): that
/// one is fenced before the next one writes, as librbd fences a lock owner that stopped
/// answering.
pub(crate) const LAST_WRITER_CLIENT_KEY: &[u8] = b"ivdisk.last_writer_client";
/// First word of a writer's answer to a notify on its header object (readers answer with
/// their own tag, see readers.rs).
const WRITER_REPLY_TAG: &str = "ivdisk-writer";
/// How long an open that finds the lock held waits for its holder to answer: a live writer
/// answers in milliseconds (librados answers from its own thread).
const HOLDER_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Take the lock of a holder that does not answer, as librbd takes an exclusive lock from an
/// owner that stopped answering: fence it, then break its lock, so the caller can take it at
/// once instead of waiting up to the lock's duration for the expiry. Only for a writer that
/// records itself ([`LAST_WRITER_CLIENT_KEY`] names its client) and so watches the header
/// (registered before the record is written): asked through a notify, a live one answers. One
/// that does not and no longer watches (killed or cut off from the cluster for longer than
/// the OSDs' watch timeout), or whose process on this host is gone, is fenced: even if it
/// runs again, nothing it sends is applied. One still watching is left alone (paused or
/// overloaded for a moment). `true` when the lock was taken from it.
pub(crate) async fn take_over_if_silent(
    store: &dyn ObjectStore,
    object: &ObjectName,
    holder: &Locker,
    image: &str,
) -> bool {
    let Some(address) = &holder.address else {
        return false;
    };
    let recorded = recorded_writer(store, object).await;
    if recorded
        .as_deref()
        .and_then(|r| r.split_once(' '))
        .map(|(c, _)| c)
        != Some(holder.client.as_str())
    {
        return false;
    }
    let answers = match store.notify(object, HOLDER_ANSWER_TIMEOUT).await {
        Ok(answers) => answers,
        Err(e) => {
            tracing::debug!(image, error = %e, "could not ask the writer lock's holder");
            return false;
        }
    };
    if answers
        .replies
        .iter()
        .any(|(client, _)| *client == holder.client)
    {
        return false;
    }
    // Not answering with its watch still registered (the OSDs sent it the notify) is a
    // holder paused or overloaded, not one that died: the OSDs drop a dead client's watch
    // once it times out. librbd leaves the lock of an owner that still watches alone too;
    // fencing here failed every request of a server that had stopped for 5 s (a routine
    // `snap create` beside it did that). A holder on this host whose process is gone is dead
    // for sure, and is taken over before its watch times out.
    if answers.unanswered.contains(&holder.client) && !holder_process_gone(holder) {
        tracing::warn!(
            image,
            holder = %describe(holder),
            "the writer lock's holder did not answer within {} s, but is still connected to \
             the cluster (its watch on the header object is alive): not fencing it. It is \
             paused or overloaded, or stopped less than the OSDs' watch timeout ago \
             (osd_client_watch_timeout, 30 s by default), after which it is taken over",
            HOLDER_ANSWER_TIMEOUT.as_secs()
        );
        return false;
    }
    match store.fence_client(&holder.client, address).await {
        Ok(true) => {}
        Ok(false) => return false,
        Err(e) => {
            tracing::warn!(
                image,
                error = %e,
                "the writer lock's holder does not answer, but cannot be fenced: waiting for \
                 its lock to expire"
            );
            return false;
        }
    }
    remove_writer_record(store, object, &holder.client).await;
    match store
        .break_lock(object, WRITER_LOCK, &holder.client, &holder.cookie)
        .await
    {
        Ok(()) | Err(StoreError::NotLocked { .. }) => {
            tracing::warn!(
                image,
                client = %holder.client,
                %address,
                description = %holder.description,
                "the writer lock's holder did not answer within {} s; fenced it (blocklisted) \
                 and took its lock",
                HOLDER_ANSWER_TIMEOUT.as_secs()
            );
            true
        }
        Err(e) => {
            tracing::warn!(image, error = %e, "breaking the lock of a fenced holder");
            false
        }
    }
}

/// Whether `holder` ran on this host in a process that no longer exists (its description
/// says `ivdisk pid PID on HOST`, see [`WriterLock::acquire`]). A process of that number that
/// exists may be another one that reuses it: then the holder counts as alive.
fn holder_process_gone(holder: &Locker) -> bool {
    let Some((pid, host)) = holder
        .description
        .strip_prefix("ivdisk pid ")
        .and_then(|rest| rest.split_once(" on "))
    else {
        return false;
    };
    match pid.parse::<u32>() {
        Ok(pid) => host == host_name() && !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        Err(_) => false,
    }
}

/// Whether taking the lock records its holder in the header object's omap (see
/// [`LAST_WRITER_KEY`]). Without the record a lock that expired is lost for good: there is no
/// telling whether another writer held it meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HolderRecord {
    /// ivdisk images: their header object is ours (and must be there: see `after_taking`).
    Keep,
    /// As `Keep`, where the header object may be missing: a header restored where none is.
    KeepOnMissingHeader,
    /// Headers of other tools (a LUKS file, a librbd image's `rbd_header`): left as they are.
    None,
}

impl HolderRecord {
    /// Whether the writer records itself in the header object.
    fn keeps(self) -> bool {
        matches!(self, HolderRecord::Keep | HolderRecord::KeepOnMissingHeader)
    }
}

/// A held writer lock and the thread renewing it.
pub(crate) struct WriterLock {
    store: Arc<dyn ObjectStore>,
    object: ObjectName,
    cookie: String,
    /// Whether this writer recorded itself in the header object (and takes its
    /// [`LAST_WRITER_CLIENT_KEY`] away again when it closes).
    record: HolderRecord,
    /// The header object's watch that answers openers that find the lock held (RADOS).
    watch: Option<Watch>,
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<JoinHandle<()>>,
    /// Why writes are refused, while they are (for good once the lock is lost, until the next
    /// successful renewal when renewals failed).
    lost: Arc<Mutex<Option<String>>>,
    /// True while held and not lost: what every write checks, one atomic load (the two
    /// mutexes behind `lost` cost a write of 64 KiB a few percent with two threads).
    healthy: Arc<AtomicBool>,
    /// True while writes are refused only until a renewal succeeds ([`Refusal::Stalled`]):
    /// writes then wait ([`WriterLock::stalled`]).
    stalled: Arc<AtomicBool>,
    /// Told whenever the refusal changes, and when the renewals stop.
    changed: Arc<tokio::sync::Notify>,
    /// How long a write waits while [`WriterLock::stalled`] ([`LOCK_STALL_WAIT`] unless
    /// set: `OpenOptions::stalled_write_wait`).
    stall_wait: Duration,
}

/// Why the renewal thread refuses writes.
pub(crate) enum Refusal {
    /// Until a renewal succeeds again: the store did not answer one in time.
    Stalled(String),
    /// For good: the lock is lost.
    Lost(String),
}

impl std::fmt::Debug for WriterLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterLock")
            .field("object", &self.object)
            .field("cookie", &self.cookie)
            .finish()
    }
}

pub(crate) fn describe(locker: &Locker) -> String {
    let mut text = format!("client {}", locker.client);
    if !locker.description.is_empty() {
        text.push_str(&format!(" ({})", locker.description));
    }
    text
}

/// The current holder of an image's writer lock, if any.
pub(crate) async fn holder(
    store: &dyn ObjectStore,
    object: &ObjectName,
) -> Result<Option<Locker>, StoreError> {
    Ok(store
        .list_lockers(object, WRITER_LOCK)
        .await?
        .into_iter()
        .next())
}

/// How often the renewal thread looks whether a renewal call that has not come back has
/// outlived the time writes may go on without one.
const RENEWAL_POLL: Duration = Duration::from_millis(50);

/// The renewal thread's loop: renew every third of `duration` until `stopped` says stop.
///
/// A failed renewal does not give the lock up at once: a store that is away for a while (an
/// OSD down, a full pool) comes back, and the image with it. Writes go on while the lock may
/// still be held (less than two thirds of `duration` since the last renewal was sent, which
/// the store received later), are refused after that (`set_refused(Some(Refusal::Stalled))`:
/// writes then wait, up to [`LOCK_STALL_WAIT`]), and resume once a renewal succeeds again
/// (`set_refused(None)`): a lock that expired meanwhile is taken
/// again if nobody else took it, and kept only if nobody else held it meanwhile either (the
/// holder record still names `request.cookie`; a writer that took it, wrote and closed would
/// otherwise be overwritten from a stale metadata cache and a client's stale view). It is lost
/// for good when another client holds it or held it, or when it is gone although it cannot
/// have expired (broken by `ivdisk lock break`).
fn renew_until_stopped(
    (store, object, request, sent): (&dyn ObjectStore, &ObjectName, LockRequest, Instant),
    image: &str,
    record: HolderRecord,
    stopped: mpsc::Receiver<()>,
    mut set_refused: impl FnMut(Option<Refusal>),
) {
    let duration = request.duration.unwrap_or(DEFAULT_LOCK_DURATION);
    // When the lock was last sent and found held: it was taken (or renewed) before this
    // thread started, maybe a while before.
    let mut last_sent_ok = sent;
    // Renewals go out a third of `duration` after the last one that succeeded was sent, not
    // after it came back: one that came back late is followed by the next at once.
    let mut next = last_sent_ok + duration / 3;
    let mut refused = false;
    // Taken again after it expired, and not yet seen to be still ours.
    let mut retaken = false;
    loop {
        match stopped.recv_timeout(next.saturating_duration_since(Instant::now())) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let sent = Instant::now();
        // The call may hang far longer than the lock lives (an OSD that does not answer, the
        // store's timeout 60 s): writes are refused once two thirds of `duration` passed
        // since the last renewal was sent, whether or not the call has come back (writes went
        // on while it hung, past the lock's expiry, beside a writer that took it).
        let renewed = std::thread::scope(|scope| {
            let retaken = &mut retaken;
            // A thread that cannot be started is a failed renewal (tried again), not a panic
            // that ends the renewals.
            let call = std::thread::Builder::new()
                .name("ivdisk-lock-call".into())
                .spawn_scoped(scope, || {
                    match futures_executor::block_on(store.lock_exclusive(object, request.clone()))
                    {
                        // Gone. If it may have expired, take it again unless someone else has.
                        // (May have: the call came back a duration after the last renewal sent,
                        // so the store may have seen it only after the expiry.)
                        Err(StoreError::NotLocked { .. })
                            if Instant::now() >= last_sent_ok + duration && record.keeps() =>
                        {
                            let taken = futures_executor::block_on(store.lock_exclusive(
                                object,
                                LockRequest {
                                    renew: false,
                                    ..request.clone()
                                },
                            ));
                            *retaken |= taken.is_ok();
                            taken
                        }
                        other => other,
                    }
                });
            let call = match call {
                Ok(call) => call,
                Err(e) => {
                    return Err(StoreError::Io {
                        context: "starting a thread to renew the writer lock".into(),
                        source: e,
                    })
                }
            };
            let deadline = last_sent_ok + duration * 2 / 3;
            while !call.is_finished() {
                if !refused && Instant::now() >= deadline {
                    tracing::error!(
                        image,
                        "renewing the writer lock has not answered; writes wait until it is \
                         renewed (and fail after the open's stalled_write_wait)"
                    );
                    refused = true;
                    set_refused(Some(Refusal::Stalled(format!(
                        "not renewed since {:.0?} ago: the store has not answered the renewal; \
                         writes resume once it is",
                        last_sent_ok.elapsed()
                    ))));
                }
                std::thread::sleep(RENEWAL_POLL.min(duration / 10));
            }
            call.join().expect("the renewal call does not panic")
        });
        let renewed = match renewed {
            Ok(()) if retaken => match last_holder(store, object) {
                Ok(holder) if holder.as_deref() == Some(request.cookie.as_bytes()) => {
                    retaken = false;
                    Ok(())
                }
                Ok(_) => {
                    // Someone else wrote meanwhile: what this writer holds in memory (its
                    // metadata cache, its clients' caches) may be stale. Give the lock back.
                    let _ = futures_executor::block_on(store.unlock(
                        object,
                        WRITER_LOCK,
                        &request.cookie,
                    ));
                    let why = format!(
                        "the writer lock of {image} expired while the store was away, and \
                         another writer held it meanwhile; reopen the image"
                    );
                    tracing::error!(image, "{why}; refusing further writes");
                    set_refused(Some(Refusal::Lost(why)));
                    return;
                }
                // Not known yet: still refused, asked again at the next renewal.
                Err(e) => Err(e),
            },
            other => other,
        };
        match renewed {
            Ok(()) => {
                last_sent_ok = sent;
                next = sent + duration / 3;
                // A renewal that came back after writes were refused resumes them only if it
                // was sent recently enough that the lock outlives the next two thirds of a
                // duration; otherwise the next one goes out at once.
                let in_time = sent.elapsed() < duration * 2 / 3;
                if refused && in_time && stopped.try_recv() != Err(mpsc::TryRecvError::Disconnected)
                {
                    tracing::warn!(image, "the writer lock is renewed again; writes resume");
                    refused = false;
                    set_refused(None);
                } else if !in_time && !refused {
                    refused = true;
                    set_refused(Some(Refusal::Stalled(format!(
                        "the last renewal of the writer lock took {:.0?}; writes resume once one \
                         comes back in time",
                        sent.elapsed()
                    ))));
                }
            }
            Err(
                e @ (StoreError::Busy { .. }
                | StoreError::NotLocked { .. }
                | StoreError::Fenced { .. }),
            ) => {
                tracing::error!(image, error = %e, "the writer lock was lost; refusing further writes");
                set_refused(Some(Refusal::Lost(format!("{e}; reopen the image"))));
                return;
            }
            Err(e) if Instant::now() >= last_sent_ok + duration * 2 / 3 => {
                next = Instant::now() + duration / 3;
                if !refused {
                    tracing::error!(image, error = %e, "renewing the writer lock failed; writes wait until it is renewed (and fail after the open's stalled_write_wait)");
                    refused = true;
                }
                set_refused(Some(Refusal::Stalled(format!(
                    "not renewed since {:.0?} ago: {e}; writes resume once it is",
                    last_sent_ok.elapsed()
                ))));
            }
            Err(e) => {
                // Again by the time writes would have to stop without a renewal, so that a
                // call is out (and refuses them if it hangs) when that time comes.
                next = (Instant::now() + duration / 3).min(last_sent_ok + duration * 2 / 3);
                tracing::warn!(image, error = %e, "renewing the writer lock failed; trying again")
            }
        }
    }
}

/// This machine's host name, as lock holders and readers name where they run ("" if unknown).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// Fence the writer that [`LAST_WRITER_CLIENT_KEY`] names, if one is named: it did not close,
/// and may still run past its lock's expiry (paused, cut off by the network) with writes in
/// flight. Called with the lock just taken, before this writer writes anything. A store that
/// cannot fence (a cephx user without `osd blocklist`) leaves a warning: the image opens as it
/// did before fencing existed.
async fn fence_an_unclosed_writer(store: &dyn ObjectStore, object: &ObjectName, image: &str) {
    let Some(recorded) = recorded_writer(store, object).await else {
        return;
    };
    let Some((client, address)) = recorded.split_once(' ') else {
        tracing::warn!(image, %recorded, "the record of the image's last writer is not `CLIENT ADDRESS`; not fencing it");
        return;
    };
    match store.fence_client(client, address).await {
        Ok(true) => tracing::warn!(
            image,
            client,
            address,
            "the image's last writer did not close; fenced it (blocklisted) before writing"
        ),
        Ok(false) => {}
        Err(e) => tracing::warn!(
            image,
            error = %e,
            "the image's last writer did not close and could not be fenced: if it still runs \
             (paused, or cut off by the network), writes it has in flight may land beside this \
             writer's"
        ),
    }
}

/// What [`LAST_WRITER_CLIENT_KEY`] holds, if anything (nothing either where the store has no
/// omap, a LUKS file, or cannot be read now).
async fn recorded_writer(store: &dyn ObjectStore, object: &ObjectName) -> Option<String> {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![
        LAST_WRITER_CLIENT_KEY.to_vec()
    ]));
    match store.read_op(object, op).await.ok()?.into_iter().next() {
        Some(ReadResult::Omap { pairs, .. }) => pairs
            .into_iter()
            .next()
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
        _ => None,
    }
}

/// Take `client`'s [`LAST_WRITER_CLIENT_KEY`] record away, if it is still `client`'s (so
/// that a writer whose lock was broken unfenced does not remove its successor's): by a writer
/// that closes, and after `client` was fenced and before its lock is broken (so the next
/// writer does not fence it a second time).
///
/// The record is read with the object's version, and removed only at that version: a
/// successor that records itself between the read and the removal changes the version, so
/// the removal fails and the record is read again (a lost successor record would let a
/// successor that dies silently go unfenced). Other changes of the header object (a lock's
/// renewal) fail it too; a few tries get past those.
pub(crate) async fn remove_writer_record(
    store: &dyn ObjectStore,
    object: &ObjectName,
    client: &str,
) {
    const TRIES: usize = 4;
    for _ in 0..TRIES {
        let op = ReadOp::new()
            .step(ReadStep::OmapGetByKeys(vec![
                LAST_WRITER_CLIENT_KEY.to_vec()
            ]))
            .step(ReadStep::Stat);
        let (mut recorded, mut version) = (None, None);
        // A store that cannot read it (no omap: a LUKS file; unreachable now) has no record
        // of ours to remove.
        let Ok(results) = store.read_op(object, op).await else {
            return;
        };
        for result in results {
            match result {
                ReadResult::Omap { pairs, .. } => {
                    recorded = pairs
                        .into_iter()
                        .next()
                        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                }
                ReadResult::Stat(stat) => version = Some(stat.version),
                ReadResult::Extents(_) => {}
            }
        }
        let named = recorded
            .as_deref()
            .and_then(|r| r.split_once(' '))
            .is_some_and(|(c, _)| c == client);
        let (true, Some(version)) = (named, version) else {
            return;
        };
        let op =
            WriteOp::new()
                .step(WriteStep::AssertVersion(version))
                .step(WriteStep::OmapRemoveKeys(vec![
                    LAST_WRITER_CLIENT_KEY.to_vec()
                ]));
        match store.write_op(object, op).await {
            Ok(_) => return,
            Err(StoreError::VersionMismatch { .. }) => continue,
            Err(e) => {
                tracing::debug!(error = %e, client, "could not remove a writer's record");
                return;
            }
        }
    }
    tracing::debug!(
        client,
        "a writer's record was not removed: the header object kept changing"
    );
}

/// The cookie the holder record names (see [`LAST_WRITER_KEY`]), if any.
fn last_holder(
    store: &dyn ObjectStore,
    object: &ObjectName,
) -> Result<Option<Vec<u8>>, StoreError> {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![LAST_WRITER_KEY.to_vec()]));
    let results = futures_executor::block_on(store.read_op(object, op))?;
    Ok(match results.into_iter().next() {
        Some(ReadResult::Omap { pairs, .. }) => pairs.into_iter().next().map(|(_, v)| v.to_vec()),
        _ => None,
    })
}

impl WriterLock {
    pub(crate) async fn acquire(
        store: Arc<dyn ObjectStore>,
        object: ObjectName,
        image: &str,
        duration: Duration,
        record: HolderRecord,
    ) -> Result<WriterLock, ImageError> {
        let mut cookie = [0u8; 8];
        ivdisk_crypto::fill_random(&mut cookie).map_err(ImageError::crypto(image))?;
        let cookie = hex::encode(cookie);
        let host = host_name();
        let request = LockRequest {
            name: WRITER_LOCK.into(),
            cookie: cookie.clone(),
            description: format!("ivdisk pid {} on {host}", std::process::id()),
            duration: Some(duration),
            renew: false,
        };
        // When the lock was last sent (taken or renewed): the steps below can take longer
        // than the lock lives (fencing waits up to the monitors' timeout), and writes may go
        // on only two thirds of `duration` past it.
        let mut sent = Instant::now();
        let mut taken = store.lock_exclusive(&object, request.clone()).await;
        if matches!(taken, Err(StoreError::Busy { .. })) && record.keeps() {
            if let Ok(Some(locker)) = holder(store.as_ref(), &object).await {
                if take_over_if_silent(store.as_ref(), &object, &locker, image).await {
                    sent = Instant::now();
                    taken = store.lock_exclusive(&object, request.clone()).await;
                }
            }
        }
        match taken {
            Ok(()) => {}
            Err(StoreError::Busy { holder: h, .. }) => {
                let locker = holder(store.as_ref(), &object).await.ok().flatten();
                return Err(ImageError::Locked {
                    image: image.to_owned(),
                    holder: locker.as_ref().map(describe).unwrap_or(h),
                    expires_in: locker.and_then(|l| l.expires_in),
                    breakable: true,
                });
            }
            Err(e) => return Err(ImageError::store(image)(e)),
        }
        // Past this point the lock is held: an open that fails gives it back (before, a
        // failed flush or thread start left it to its expiry, refusing the next opener).
        let held =
            Self::after_taking(store.clone(), object.clone(), image, request, record, sent).await;
        if held.is_err() {
            let _ = store.unlock(&object, WRITER_LOCK, &cookie).await;
        }
        held
    }

    /// Renew the lock now if a third of its duration passed since it was last `sent`, so
    /// that the renewal thread starts on a lock known to be held (the thread's first renewal
    /// comes a third of the duration after it starts); a lock lost meanwhile fails the open.
    async fn renew_if_late(
        store: &dyn ObjectStore,
        object: &ObjectName,
        image: &str,
        request: &LockRequest,
        sent: &mut Instant,
    ) -> Result<(), ImageError> {
        let duration = request.duration.unwrap_or(DEFAULT_LOCK_DURATION);
        if sent.elapsed() < duration / 3 {
            return Ok(());
        }
        let now = Instant::now();
        let renew = LockRequest {
            renew: true,
            ..request.clone()
        };
        match store.lock_exclusive(object, renew).await {
            Ok(()) if now.elapsed() < duration * 2 / 3 => {
                *sent = now;
                Ok(())
            }
            Ok(()) => Err(ImageError::LockLost {
                image: image.to_owned(),
                reason: "renewing the writer lock while opening took longer than the lock may \
                         be trusted; try again"
                    .into(),
            }),
            Err(e) => Err(ImageError::LockLost {
                image: image.to_owned(),
                reason: format!(
                    "opening took {:.0?}, longer than the writer lock lives ({duration:?}), and \
                     it could not be renewed: {e}; try again",
                    sent.elapsed()
                ),
            }),
        }
    }

    /// The rest of [`WriterLock::acquire`] once the lock is taken (at `sent`).
    async fn after_taking(
        store: Arc<dyn ObjectStore>,
        object: ObjectName,
        image: &str,
        request: LockRequest,
        record: HolderRecord,
        mut sent: Instant,
    ) -> Result<WriterLock, ImageError> {
        let cookie = request.cookie.clone();
        let mut record = record;
        let mut watch = None;
        if record.keeps() {
            fence_an_unclosed_writer(store.as_ref(), &object, image).await;
            // Answering the next opener's notify (`take_over_if_silent`), registered before
            // the record that lets that opener take the lock from a writer that is silent.
            let reply = format!("{WRITER_REPLY_TAG} {cookie}").into_bytes();
            match store.watch(&object, reply).await {
                Ok(registered) => watch = registered,
                // Without a watch this writer could not answer, so it must not record itself
                // (the record is what lets a next opener take a silent holder's lock): it is
                // then left to its lock's expiry, as before fencing.
                Err(e) => tracing::warn!(
                    image,
                    error = %e,
                    "cannot watch the image's header: a writer that finds this one's lock will \
                     wait for its expiry"
                ),
            }
            // Where this writer runs, as the store lists it (the address the next writer
            // would fence), recorded only if it answers.
            let own = match watch.is_some() {
                true => store
                    .list_lockers(&object, WRITER_LOCK)
                    .await
                    .ok()
                    .and_then(|lockers| lockers.into_iter().find(|l| l.cookie == cookie))
                    .and_then(|l| l.address.map(|address| format!("{} {address}", l.client))),
                false => None,
            };
            // Not over another writer's record: a lock that expired during the fencing may
            // have been taken by another writer, who recorded itself.
            Self::renew_if_late(store.as_ref(), &object, image, &request, &mut sent).await?;
            // Only on a header that is there: the lock outlives its object (the stores keep
            // locks apart, RADOS's class creates it), and an open that lost a race with a
            // delete made an empty header object with this record, which no command opened,
            // deleted or created over.
            let mut op = match record {
                HolderRecord::KeepOnMissingHeader => WriteOp::new(),
                _ => WriteOp::new().step(WriteStep::AssertExists),
            }
            .omap_set(vec![(LAST_WRITER_KEY.to_vec(), cookie.as_bytes().to_vec())]);
            op = match own {
                Some(own) => op.omap_set(vec![(LAST_WRITER_CLIENT_KEY.to_vec(), own.into_bytes())]),
                None => op.step(WriteStep::OmapRemoveKeys(vec![
                    LAST_WRITER_CLIENT_KEY.to_vec()
                ])),
            };
            match store.write_op(&object, op).await {
                Ok(_) => {}
                // A store without omap (a LUKS file): no record, no taking it again.
                Err(StoreError::InvalidOperation { .. }) => record = HolderRecord::None,
                Err(StoreError::NotFound { .. }) => {
                    return Err(ImageError::NotFound {
                        image: image.to_owned(),
                    })
                }
                Err(e) => return Err(ImageError::store(image)(e)),
            }
        }
        // Make the lock (and the record) durable now, so a holder that crashes right after
        // opening still leaves it behind (until it expires) rather than losing it with the
        // unflushed tail.
        // A full file system fails this first commit: say what was not done (the store's
        // own words are about the operations since the last flush, here only the lock's).
        store.flush().await.map_err(|e| {
            ImageError::store(image)(match e {
                StoreError::NoSpace { .. } => StoreError::NoSpace {
                    context: "recording this writer's lock on the image's store; nothing of \
                              the image was changed"
                        .into(),
                },
                e => e,
            })
        })?;
        Self::renew_if_late(store.as_ref(), &object, image, &request, &mut sent).await?;
        let lost = Arc::new(Mutex::new(None));
        let healthy = Arc::new(AtomicBool::new(true));
        let stalled = Arc::new(AtomicBool::new(false));
        let changed = Arc::new(tokio::sync::Notify::new());
        let (stop, stopped) = mpsc::channel::<()>();
        let renewer = {
            let store = store.clone();
            let object = object.clone();
            let lost = lost.clone();
            let healthy = healthy.clone();
            let stalled = stalled.clone();
            let changed = changed.clone();
            let request = LockRequest {
                renew: true,
                ..request
            };
            let name = image.to_owned();
            std::thread::Builder::new()
                .name("ivdisk-lock-renew".into())
                .spawn(move || {
                    let lock = (&*store, &object, request, sent);
                    let set_refused = |refusal: Option<Refusal>| {
                        // `Some`: writes refused, and why; `None`: held again.
                        let (why, until_renewed) = match refusal {
                            None => (None, false),
                            Some(Refusal::Stalled(why)) => (Some(why), true),
                            Some(Refusal::Lost(why)) => (Some(why), false),
                        };
                        let held = why.is_none();
                        *lost.lock().unwrap_or_else(|e| e.into_inner()) = why;
                        stalled.store(until_renewed, Ordering::Release);
                        healthy.store(held, Ordering::Release);
                        changed.notify_waiters();
                    };
                    let renewing = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        renew_until_stopped(lock, &name, record, stopped, set_refused)
                    }));
                    // Nobody renews the lock any more, so it expires and another writer may
                    // take it: writes must stop (they went on unchecked when this panicked).
                    if renewing.is_err() {
                        tracing::error!(image = %name, "the writer lock's renewal failed; refusing further writes");
                        set_refused(Some(Refusal::Lost(
                            "the writer lock's renewal failed (see the log); reopen the image"
                                .into(),
                        )));
                    }
                })
                .map_err(|e| ImageError::Store {
                    image: image.to_owned(),
                    source: StoreError::Io {
                        context: "starting the lock renewal thread".into(),
                        source: e,
                    },
                })?
        };
        Ok(WriterLock {
            store,
            object,
            cookie,
            record,
            watch,
            stop: Some(stop),
            renewer: Some(renewer),
            lost,
            healthy,
            stalled,
            changed,
            stall_wait: LOCK_STALL_WAIT,
        })
    }

    /// Why this lock no longer covers writes, if it does not: lost as the renewals saw it, or
    /// no longer this writer's in the store though the renewals have not seen that yet (a
    /// break, a fencing, a successor; they look every third of its life). A store that does
    /// not answer counts as still held.
    pub(crate) fn confirm_held(
        &self,
    ) -> Result<impl std::future::Future<Output = Option<String>> + Send + 'static, String> {
        if let Some(why) = self.lost() {
            return Err(why);
        }
        let (store, object, cookie) =
            (self.store.clone(), self.object.clone(), self.cookie.clone());
        Ok(async move {
            let lockers = match store.list_lockers(&object, WRITER_LOCK).await {
                Ok(lockers) => lockers,
                // A fenced client reads nothing either.
                Err(e @ StoreError::Fenced { .. }) => return Some(e.to_string()),
                Err(_) => return None,
            };
            let ours = lockers
                .iter()
                .any(|l| l.cookie == cookie && l.client == store.client_id());
            (!ours).then(|| "it is no longer this writer's: broken, or taken by another".into())
        })
    }

    /// How long writes wait while the lock is not renewed in time (see [`LOCK_STALL_WAIT`]).
    pub(crate) fn set_stall_wait(&mut self, wait: Duration) {
        self.stall_wait = wait;
    }

    /// A flag that stays true while the lock is held and not lost ([`WriterLock::lost`] says
    /// why once it turns false).
    pub(crate) fn healthy(&self) -> Arc<AtomicBool> {
        self.healthy.clone()
    }

    /// Why the lock was lost, if it was.
    pub(crate) fn lost(&self) -> Option<String> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// While writes are refused only until a renewal succeeds: what tells when that changes
    /// (the lock renewed, lost for good, or no longer renewed).
    /// Also how long a write may wait for it.
    pub(crate) fn stalled(&self) -> Option<(Arc<tokio::sync::Notify>, Duration)> {
        (self.stalled.load(Ordering::Acquire) && self.renewer.is_some())
            .then(|| (self.changed.clone(), self.stall_wait))
    }

    fn stop_renewing(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.renewer.take() {
            let _ = thread.join();
        }
        // Writes waiting for a renewal wait no more.
        self.changed.notify_waiters();
    }

    /// Stop renewing and remove the locked object itself, then release the lock (on RADOS it
    /// is gone with the object; other stores keep it apart). The object goes while the lock is
    /// still held, so no one takes the lock or opens the object in between (`delete`).
    /// `Ok(Err(why))`, nothing removed, if the lock was lost meanwhile.
    pub(crate) async fn remove_locked_object(mut self) -> Result<Result<(), String>, StoreError> {
        self.stop_renewing();
        if let Some(why) = self.lost() {
            return Ok(Err(why));
        }
        // Unwatched first: the OSD drops the watch of a removed object, and librados reports
        // that as a watch lost (two warnings on every delete, which read as a sick cluster).
        drop(self.watch.take());
        let removed = self
            .store
            .write_op(&self.object, WriteOp::new().step(WriteStep::Remove))
            .await;
        let unlocked = self
            .store
            .unlock(&self.object, WRITER_LOCK, &self.cookie)
            .await;
        self.cookie.clear();
        removed?;
        match unlocked {
            Ok(()) | Err(StoreError::NotLocked { .. } | StoreError::NotFound { .. }) => Ok(Ok(())),
            Err(e) => Err(e),
        }
    }

    /// Stop renewing and release the lock.
    pub(crate) async fn release(mut self) -> Result<(), StoreError> {
        self.stop_renewing();
        if self.record.keeps() && self.lost().is_none() {
            // Closed: the next writer has nothing to fence. Best effort: left behind, it costs
            // the next writer a fencing of a client that is gone.
            let client = self.store.client_id().to_owned();
            remove_writer_record(self.store.as_ref(), &self.object, &client).await;
        }
        let result = self
            .store
            .unlock(&self.object, WRITER_LOCK, &self.cookie)
            .await;
        self.cookie.clear();
        match result {
            Ok(()) | Err(StoreError::NotLocked { .. }) if self.lost().is_some() => Ok(()),
            // Fenced before its lock was broken: the lock is not this writer's to release.
            Err(StoreError::Fenced { .. }) => Ok(()),
            other => other,
        }
    }
}

impl Drop for WriterLock {
    fn drop(&mut self) {
        self.stop_renewing();
        if !self.cookie.is_empty() {
            // Dropped without `release` (the image was not closed): unlock best effort so the
            // next writer does not wait for the expiry.
            let _ = futures_executor::block_on(self.store.unlock(
                &self.object,
                WRITER_LOCK,
                &self.cookie,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ivdisk_store::{MemoryStore, ObjectStoreExt, WriteOutcome};

    /// The memory store, noting who held the writer lock when an object was removed, and,
    /// once `successor_after_read` is armed, letting a successor record itself right after
    /// the next read of the writer record, before the reader can act on what it read.
    struct WatchedStore {
        inner: MemoryStore,
        seen: Mutex<Vec<Vec<String>>>,
        successor_after_read: AtomicBool,
    }

    const SUCCESSOR: &str = "client.successor 10.0.0.2:0/2";

    impl WatchedStore {
        fn new() -> WatchedStore {
            WatchedStore {
                inner: MemoryStore::new().unwrap(),
                seen: Mutex::new(Vec::new()),
                successor_after_read: AtomicBool::new(false),
            }
        }
    }

    ivdisk_store::object_store_forwarding_to_inner!(WatchedStore {
        async fn write_op(
            &self,
            object: &ObjectName,
            op: WriteOp,
        ) -> Result<WriteOutcome, StoreError> {
            if op.steps.contains(&WriteStep::Remove) {
                let lockers = self.inner.list_lockers(object, WRITER_LOCK).await?;
                let cookies = lockers.into_iter().map(|l| l.cookie).collect();
                self.seen.lock().unwrap().push(cookies);
            }
            self.inner.write_op(object, op).await
        }
        async fn read_op(
            &self,
            object: &ObjectName,
            op: ReadOp,
        ) -> Result<Vec<ReadResult>, StoreError> {
            let reads_record = op.steps.iter().any(|step| {
                matches!(step, ReadStep::OmapGetByKeys(keys)
                    if keys.iter().any(|k| k == LAST_WRITER_CLIENT_KEY))
            });
            let results = self.inner.read_op(object, op).await;
            if reads_record && self.successor_after_read.swap(false, Ordering::SeqCst) {
                let record = vec![(LAST_WRITER_CLIENT_KEY.to_vec(), SUCCESSOR.as_bytes().to_vec())];
                self.inner
                    .write_op(object, WriteOp::new().omap_set(record))
                    .await?;
            }
            results
        }
    });

    /// `delete` removes the header under its lock: were the lock released first, a writer or
    /// reader opening in between would find a header whose data objects are gone.
    #[tokio::test]
    async fn the_locked_object_is_removed_before_the_lock_goes() {
        let store = Arc::new(WatchedStore::new());
        let object = ObjectName::new("img.header").unwrap();
        store
            .write_op(&object, WriteOp::new().write(0, b"header".to_vec()))
            .await
            .unwrap();
        let lock = WriterLock::acquire(
            store.clone(),
            object.clone(),
            "img",
            Duration::from_secs(30),
            HolderRecord::Keep,
        )
        .await
        .unwrap();
        let cookie = lock.cookie.clone();
        assert_eq!(lock.remove_locked_object().await.unwrap(), Ok(()));
        assert_eq!(*store.seen.lock().unwrap(), vec![vec![cookie]]);
        assert_eq!(store.stat(&object).await.unwrap(), None);
        assert!(store
            .list_lockers(&object, WRITER_LOCK)
            .await
            .unwrap()
            .is_empty());
    }

    /// The memory store, whose lock renewals panic (a fault in the store or in the renewal).
    struct RenewalPanics(MemoryStore);

    // By hand: the forwarding macro passes `lock_exclusive` on unchanged.
    #[async_trait::async_trait]
    impl ObjectStore for RenewalPanics {
        async fn lock_exclusive(
            &self,
            object: &ObjectName,
            request: LockRequest,
        ) -> Result<(), StoreError> {
            assert!(!request.renew, "a renewal fails (on purpose, in this test)");
            self.0.lock_exclusive(object, request).await
        }
        async fn write_op(
            &self,
            object: &ObjectName,
            op: WriteOp,
        ) -> Result<WriteOutcome, StoreError> {
            self.0.write_op(object, op).await
        }
        async fn read_op(
            &self,
            object: &ObjectName,
            op: ReadOp,
        ) -> Result<Vec<ReadResult>, StoreError> {
            self.0.read_op(object, op).await
        }
        async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
            self.0.list(prefix).await
        }
        async fn snap_create(&self) -> Result<ivdisk_store::SnapId, StoreError> {
            self.0.snap_create().await
        }
        async fn snap_remove(&self, snap: ivdisk_store::SnapId) -> Result<(), StoreError> {
            self.0.snap_remove(snap).await
        }
        async fn unlock(
            &self,
            object: &ObjectName,
            lock: &str,
            cookie: &str,
        ) -> Result<(), StoreError> {
            self.0.unlock(object, lock, cookie).await
        }
        async fn list_lockers(
            &self,
            object: &ObjectName,
            lock: &str,
        ) -> Result<Vec<Locker>, StoreError> {
            self.0.list_lockers(object, lock).await
        }
        async fn break_lock(
            &self,
            object: &ObjectName,
            lock: &str,
            client: &str,
            cookie: &str,
        ) -> Result<(), StoreError> {
            self.0.break_lock(object, lock, client, cookie).await
        }
        async fn flush(&self) -> Result<(), StoreError> {
            self.0.flush().await
        }
        fn client_id(&self) -> &str {
            self.0.client_id()
        }
    }

    /// A renewal thread that dies refuses writes: nobody renews the lock any more, so it
    /// expires and another writer may take it (writes went on as if it were held).
    #[tokio::test]
    async fn writes_are_refused_once_the_renewal_thread_dies() {
        let store = Arc::new(RenewalPanics(MemoryStore::new().unwrap()));
        let object = ObjectName::new("img.header").unwrap();
        store
            .write_op(&object, WriteOp::new().write(0, b"header".to_vec()))
            .await
            .unwrap();
        let lock = WriterLock::acquire(
            store.clone(),
            object.clone(),
            "img",
            Duration::from_secs(3),
            HolderRecord::Keep,
        )
        .await
        .unwrap();
        let healthy = lock.healthy();
        assert!(healthy.load(Ordering::Acquire));
        // The first renewal goes out after a third of the duration (1 s) and panics. (Writes
        // may be refused first for want of an answer, if printing the panic takes past two
        // thirds of the duration; only the dead thread's refusal names the failed renewal.)
        let refused_by = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let why = lock.lost();
            if why.as_deref().is_some_and(|w| w.contains("renewal failed")) {
                break;
            }
            assert!(
                std::time::Instant::now() < refused_by,
                "no refusal for the dead renewal thread (writes allowed: {}, refused: {why:?})",
                healthy.load(Ordering::Acquire)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!healthy.load(Ordering::Acquire));
    }

    async fn record_of(store: &dyn ObjectStore, object: &ObjectName) -> Option<String> {
        recorded_writer(store, object).await
    }

    /// A writer that closes takes its own record away, and never a successor's, even one
    /// written between its read of the record and its removal.
    #[tokio::test]
    async fn a_closing_writer_removes_its_own_record_and_never_a_successors() {
        let store = WatchedStore::new();
        let object = ObjectName::new("img.header").unwrap();
        let own = vec![(
            LAST_WRITER_CLIENT_KEY.to_vec(),
            b"client.old 10.0.0.1:0/1".to_vec(),
        )];
        store
            .write_op(&object, WriteOp::new().omap_set(own.clone()))
            .await
            .unwrap();

        // Nobody else: the record goes.
        remove_writer_record(&store, &object, "client.old").await;
        assert_eq!(record_of(&store, &object).await, None);

        // Another client's record stays.
        store
            .write_op(&object, WriteOp::new().omap_set(own.clone()))
            .await
            .unwrap();
        remove_writer_record(&store, &object, "client.other").await;
        assert_eq!(
            record_of(&store, &object).await.as_deref(),
            Some("client.old 10.0.0.1:0/1")
        );

        // A successor records itself right after the old writer read its own record.
        store.successor_after_read.store(true, Ordering::SeqCst);
        remove_writer_record(&store, &object, "client.old").await;
        assert!(
            !store.successor_after_read.load(Ordering::SeqCst),
            "the successor wrote"
        );
        assert_eq!(record_of(&store, &object).await.as_deref(), Some(SUCCESSOR));
    }
}
