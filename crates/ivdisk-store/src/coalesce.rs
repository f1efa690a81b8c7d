//! [`CoalescingStore`]: write operations on one object that queue behind each other are sent
//! as one.
//!
//! Why: on RADOS the OSDs pay much of a write's cost per operation (its transaction, log
//! entry and replication), not per byte, and an `object-end` image's writes are two extents
//! each (docs/BENCHMARKS.md, "RADOS write operations"). Sequential writes at a queue depth
//! land many at a time in one object: a few go out at once (up to `MAX_IN_FLIGHT` per
//! object, so random writes, which seldom meet three at a time in an object, almost never
//! wait; writes of `DIRECT_BYTES` or more also go out at once unless writes of their object
//! are queued), the others queue, and when an operation of the object completes, the queue
//! goes out as one operation. Writes that a later one in that operation covers (the
//! same 4 KiB metadata block, twice) are left out, and contiguous writes become one extent.
//!
//! Why it is right: the store applies one operation atomically and the steps of an operation
//! in order, so one operation made of the steps of several, in their submission order, leaves
//! the object as the several would, and every one of them is acknowledged only when it has
//! applied. Only steps whose effect does not depend on the object's state are merged
//! (writes, zeros, truncates and omap changes); a step that can fail on its own (an assert, an
//! exclusive create) or that removes or rolls back the object runs as its own operation, and
//! reads that arrive while writes are queued go after them. Submission order is kept: an
//! operation goes straight to the store only when nothing of its object is queued or about
//! to be submitted, and the queue's operations are handed their turns one at a time, each
//! when the one before has been submitted (its future's first poll).
//!
//! Failures: a merged operation that the store refuses during its first poll, before sending
//! it (a bad range: the RADOS backend checks ranges first), is sent again operation by
//! operation, so each caller gets the outcome of its own operation; one that fails later
//! fails every operation in it with the same error (nothing of it applied, the store is
//! atomic).
//!
//! What it changes: operations sent as one report the one version the store gave them
//! ([`ObjectStore::merges_operations`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::Poll;

use futures_channel::oneshot;

use crate::{
    ObjectName, ObjectStore, ReadOp, ReadResult, StoreError, WriteOp, WriteOutcome, WriteStep,
};

/// Operations of one object that go to the store without waiting for each other. Beyond
/// this they queue and are merged. 2: random writes seldom have three operations in one
/// object at once, so they almost never wait; a sequential stream keeps two operations in
/// the store while the rest of its queue depth gathers into the next one.
const MAX_IN_FLIGHT: usize = 2;

/// An operation with at least this many bytes of writes goes straight to the store whenever
/// nothing of its object is queued, however many are in flight: the store's cost per
/// operation is small beside its data, so merging it gains little, and waiting would cost it
/// a round trip (sequential 1 MiB writes at queue depth 16 ran at 0.84-1.08x, median 0.87x,
/// of the old path when they queued; docs/BENCHMARKS.md).
const DIRECT_BYTES: usize = 512 << 10;

/// At most this many operations go out as one: a bound on what a refused merge sends again
/// one by one.
const MAX_MERGED_OPS: usize = 32;

/// At most this many bytes of writes go out as one operation (RADOS refuses operations above
/// `osd_max_write_size`, 90 MB by default).
const MAX_MERGED_BYTES: usize = 16 << 20;

/// A store whose write operations on one object, when they queue behind operations in
/// flight on that object, go out together as one operation (see the module doc).
pub struct CoalescingStore<S> {
    inner: S,
    /// The objects with an operation in flight through this store.
    objects: Mutex<HashMap<ObjectName, ObjectState>>,
    merged: AtomicU64,
}

#[derive(Default)]
struct ObjectState {
    /// Operations given to the store (or handed their turn) and not completed.
    in_flight: usize,
    /// A turn was handed out and its operation is not submitted yet: nothing else of this
    /// object may be submitted before it.
    turn_pending: bool,
    /// Operations waiting for their turn, in submission order.
    waiting: VecDeque<Waiter>,
}

struct Waiter {
    /// `Some`: a write waiting to be sent (with the writes queued after it, if they all
    /// merge); `None`: a read waiting for its turn.
    op: Option<WriteOp>,
    turn: oneshot::Sender<Turn>,
}

enum Turn {
    /// Send your operation `own`, and `followers` in the same operation, then hand the object
    /// on.
    Lead {
        own: WriteOp,
        followers: Vec<(WriteOp, oneshot::Sender<Turn>)>,
    },
    /// Your operation went out in another's; this is its outcome.
    Done(Result<WriteOutcome, StoreError>),
    /// Run your read now, then hand the object on.
    Alone,
}

impl<S: ObjectStore> CoalescingStore<S> {
    pub fn new(inner: S) -> Self {
        CoalescingStore {
            inner,
            objects: Mutex::new(HashMap::new()),
            merged: AtomicU64::new(0),
        }
    }

    /// The store underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many operations went out inside another's so far.
    pub fn merged_operations(&self) -> u64 {
        self.merged.load(Ordering::Relaxed)
    }

    fn objects(&self) -> MutexGuard<'_, HashMap<ObjectName, ObjectState>> {
        // No step under the lock can panic half way, so a poisoned lock is still consistent.
        self.objects.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Send `own` and the followers' operations as one, answer the followers, and hand the
    /// object on (also if this future is dropped on the way: see [`InFlight`]). `turn`: this
    /// operation was handed its turn, and the next turn waits until it is submitted.
    async fn lead(
        &self,
        object: &ObjectName,
        own: WriteOp,
        followers: Vec<(WriteOp, oneshot::Sender<Turn>)>,
        turn: bool,
    ) -> Result<WriteOutcome, StoreError> {
        let mut in_flight = InFlight {
            store: self,
            object,
            unanswered: Vec::new(),
            turn_pending: turn,
        };
        let op = if followers.is_empty() {
            own
        } else {
            let (ops, turns): (Vec<WriteOp>, Vec<_>) = followers.into_iter().unzip();
            let merged = merge(&own, &ops);
            in_flight.unanswered = std::iter::once(own)
                .chain(ops)
                .zip(
                    // The leader's own outcome is returned, not sent: a sender nobody listens to.
                    std::iter::once(oneshot::channel().0).chain(turns),
                )
                .collect();
            merged
        };
        let mut sent = self.inner.write_op(object, op);
        let first = std::future::poll_fn(|cx| Poll::Ready(sent.as_mut().poll(cx))).await;
        if let Poll::Ready(Err(e)) = &first {
            if in_flight.unanswered.len() > 1 {
                // Refused before it was sent (nothing after it is submitted yet: the turn is
                // still ours): each operation goes again on its own, in order.
                tracing::debug!(
                    object = %object,
                    operations = in_flight.unanswered.len(),
                    error = %e,
                    "merged write operation refused; sending its operations one by one"
                );
                drop(sent);
                let mut own_outcome = None;
                for (op, turn) in std::mem::take(&mut in_flight.unanswered) {
                    let outcome = self.inner.write_op(object, op).await;
                    match own_outcome {
                        None => own_outcome = Some(outcome),
                        Some(_) => {
                            let _ = turn.send(Turn::Done(outcome));
                        }
                    }
                }
                return own_outcome.expect("the leader's own operation");
            }
        }
        in_flight.submitted();
        let outcome = match first {
            Poll::Ready(outcome) => outcome,
            Poll::Pending => sent.await,
        };
        if in_flight.unanswered.is_empty() {
            return outcome;
        }
        let mut answers = std::mem::take(&mut in_flight.unanswered)
            .into_iter()
            .skip(1);
        let n = answers.len() as u64;
        match &outcome {
            Ok(done) => {
                self.merged.fetch_add(n, Ordering::Relaxed);
                for (_, turn) in answers.by_ref() {
                    // A follower that is gone no longer wants its outcome.
                    let _ = turn.send(Turn::Done(Ok(*done)));
                }
            }
            Err(e) => {
                for (_, turn) in answers.by_ref() {
                    let _ = turn.send(Turn::Done(Err(duplicate(e))));
                }
            }
        }
        outcome
    }

    /// Hand turns to waiting operations while the object has room in flight, one at a time
    /// (the next when this one is submitted); forget the object when nothing is left.
    fn hand_turns(&self, objects: &mut HashMap<ObjectName, ObjectState>, object: &ObjectName) {
        let Some(state) = objects.get_mut(object) else {
            return;
        };
        while !state.turn_pending && state.in_flight < MAX_IN_FLIGHT {
            let Some(first) = state.waiting.pop_front() else {
                break;
            };
            let Some(own) = first.op else {
                if first.turn.send(Turn::Alone).is_ok() {
                    state.in_flight += 1;
                    // A read is submitted when its owner runs it; nothing waits for that,
                    // since no write is submitted until the read completes.
                    state.turn_pending = true;
                }
                continue;
            };
            let mut followers = Vec::new();
            if mergeable(&own) {
                let mut bytes = write_bytes(&own);
                while let Some(next) = state.waiting.front() {
                    let Some(op) = &next.op else { break };
                    if !mergeable(op)
                        || op.snap_context != own.snap_context
                        || op.unless_lost_since != own.unless_lost_since
                        || followers.len() + 1 >= MAX_MERGED_OPS
                        || bytes + write_bytes(op) > MAX_MERGED_BYTES
                    {
                        break;
                    }
                    bytes += write_bytes(op);
                    let next = state.waiting.pop_front().expect("front exists");
                    followers.push((next.op.expect("checked above"), next.turn));
                }
            }
            match first.turn.send(Turn::Lead { own, followers }) {
                Ok(()) => {
                    state.in_flight += 1;
                    state.turn_pending = true;
                }
                // The waiter is gone (its caller dropped the operation): its followers go
                // back to the front for the next waiter to lead.
                Err(Turn::Lead { followers, .. }) => {
                    for (op, turn) in followers.into_iter().rev() {
                        state.waiting.push_front(Waiter { op: Some(op), turn });
                    }
                }
                Err(_) => unreachable!("sent a Lead"),
            }
        }
        if state.in_flight == 0 && state.waiting.is_empty() && !state.turn_pending {
            objects.remove(object);
        }
    }

    /// An operation of the object left flight (completed, failed or dropped). `turn_pending`:
    /// it had been handed its turn and was never submitted. `reinstate`: operations it carried
    /// and did not answer; they go back to the front of the queue, in their order.
    fn finish(
        &self,
        object: &ObjectName,
        turn_pending: bool,
        reinstate: Vec<(WriteOp, oneshot::Sender<Turn>)>,
    ) {
        let mut objects = self.objects();
        let Some(state) = objects.get_mut(object) else {
            return;
        };
        state.in_flight -= 1;
        if turn_pending {
            state.turn_pending = false;
        }
        for (op, turn) in reinstate.into_iter().rev() {
            state.waiting.push_front(Waiter { op: Some(op), turn });
        }
        self.hand_turns(&mut objects, object);
    }
}

/// One operation of an object in flight through the store: hands the object on when it is
/// submitted and when it is done or dropped. A dropped leader's unanswered followers go back
/// to the queue.
struct InFlight<'a, S: ObjectStore> {
    store: &'a CoalescingStore<S>,
    object: &'a ObjectName,
    /// The operations sent as one, the leader's first, with their owners' channels.
    unanswered: Vec<(WriteOp, oneshot::Sender<Turn>)>,
    turn_pending: bool,
}

impl<S: ObjectStore> InFlight<'_, S> {
    /// The operation is in the store's hands: the next turn may go out.
    fn submitted(&mut self) {
        if std::mem::take(&mut self.turn_pending) {
            let mut objects = self.store.objects();
            if let Some(state) = objects.get_mut(self.object) {
                state.turn_pending = false;
            }
            self.store.hand_turns(&mut objects, self.object);
        }
    }
}

impl<S: ObjectStore> Drop for InFlight<'_, S> {
    fn drop(&mut self) {
        // The leader's own operation is dropped with its caller.
        let followers = std::mem::take(&mut self.unanswered).into_iter().skip(1);
        let mut reinstate = Vec::new();
        if self.turn_pending {
            // Never submitted: the others go back to the queue.
            reinstate = followers.collect();
        } else {
            // Submitted, and maybe applied: sending them again could put them after
            // operations submitted since.
            for (_, turn) in followers {
                let _ = turn.send(Turn::Done(Err(abandoned(self.object))));
            }
        }
        self.store.finish(self.object, self.turn_pending, reinstate);
    }
}

fn abandoned(object: &ObjectName) -> StoreError {
    StoreError::InvalidOperation {
        object: object.to_string(),
        reason: "the operation carrying this write was dropped before it completed; whether \
                 it applied is unknown"
            .into(),
    }
}

/// Waits for an operation's turn. If the operation is dropped while it waits, a turn given
/// to it meanwhile is passed on, so the object does not stay busy for an operation that will
/// never run.
struct WaitTurn<'a, S: ObjectStore> {
    store: &'a CoalescingStore<S>,
    object: &'a ObjectName,
    turn: Option<oneshot::Receiver<Turn>>,
}

impl<'a, S: ObjectStore> WaitTurn<'a, S> {
    fn new(
        store: &'a CoalescingStore<S>,
        object: &'a ObjectName,
        turn: oneshot::Receiver<Turn>,
    ) -> Self {
        WaitTurn {
            store,
            object,
            turn: Some(turn),
        }
    }

    async fn wait(mut self) -> Result<Turn, oneshot::Canceled> {
        let turn = self.turn.as_mut().expect("waited once").await;
        // Taken: the caller acts on it from here, without awaiting anything first.
        self.turn = None;
        turn
    }
}

impl<S: ObjectStore> Drop for WaitTurn<'_, S> {
    fn drop(&mut self) {
        let Some(mut turn) = self.turn.take() else {
            return;
        };
        // No turn can arrive after this; one that arrived before is passed on.
        turn.close();
        match turn.try_recv() {
            Ok(Some(Turn::Lead { followers, .. })) => {
                self.store.finish(self.object, true, followers)
            }
            Ok(Some(Turn::Alone)) => self.store.finish(self.object, true, Vec::new()),
            Ok(Some(Turn::Done(_))) | Ok(None) | Err(_) => {}
        }
    }
}

/// The same error again, for each operation of a merged one that failed.
fn duplicate(e: &StoreError) -> StoreError {
    use StoreError::*;
    match e {
        NotFound { object } => NotFound {
            object: object.clone(),
        },
        Exists { object } => Exists {
            object: object.clone(),
        },
        VersionMismatch {
            object,
            expected,
            actual,
        } => VersionMismatch {
            object: object.clone(),
            expected: *expected,
            actual: *actual,
        },
        InvalidName { name, reason } => InvalidName {
            name: name.clone(),
            reason,
        },
        OutOfRange {
            object,
            offset,
            len,
            limit,
        } => OutOfRange {
            object: object.clone(),
            offset: *offset,
            len: *len,
            limit: *limit,
        },
        InvalidOperation { object, reason } => InvalidOperation {
            object: object.clone(),
            reason: reason.clone(),
        },
        Busy {
            object,
            lock,
            holder,
        } => Busy {
            object: object.clone(),
            lock: lock.clone(),
            holder: holder.clone(),
        },
        NotLocked {
            object,
            lock,
            client,
            cookie,
        } => NotLocked {
            object: object.clone(),
            lock: lock.clone(),
            client: client.clone(),
            cookie: cookie.clone(),
        },
        CannotFence { holder, reason } => CannotFence {
            holder: holder.clone(),
            reason: reason.clone(),
        },
        Fenced { context } => Fenced {
            context: context.clone(),
        },
        NoSuchSnapshot(snap) => NoSuchSnapshot(*snap),
        NoSpace { context } => NoSpace {
            context: context.clone(),
        },
        Io { context, source } => Io {
            context: context.clone(),
            source: match source.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(source.kind(), source.to_string()),
            },
        },
        AlreadyOpen { path, pid } => AlreadyOpen {
            path: path.clone(),
            pid: pid.clone(),
        },
        OpenByReaders { path, what, pids } => OpenByReaders {
            path: path.clone(),
            what: what.clone(),
            pids: pids.clone(),
        },
        RemovalUnderway { path, what } => RemovalUnderway {
            path: path.clone(),
            what: what.clone(),
        },
        ReadOnly { what } => ReadOnly { what: what.clone() },
        NotWritable { path, reason } => NotWritable {
            path: path.clone(),
            reason: reason.clone(),
        },
        Database(m) => Database(m.clone()),
        Corrupt(m) => Corrupt(m.clone()),
        Closed(m) => Closed(m.clone()),
    }
}

/// Whether every step of `op` can share an operation with others: its effect does not
/// depend on the object's state, and it cannot fail on its own. Not the omap removals: on a
/// missing object they fail (`NotFound`; RADOS answers `ENOENT`), which would fail every
/// operation merged with them. Not zeroing and truncating either: on a missing object a zero
/// fails on the memory and local stores, and a truncate does nothing on RADOS (the object
/// stays smaller than it says), so merged after a dropped covered write that created the
/// object, or in front of writes, they changed what the operations did one by one.
fn mergeable(op: &WriteOp) -> bool {
    op.steps
        .iter()
        .all(|step| matches!(step, WriteStep::Write { .. } | WriteStep::OmapSet(_)))
}

fn write_bytes(op: &WriteOp) -> usize {
    op.steps
        .iter()
        .map(|step| match step {
            WriteStep::Write { data, .. } => data.len(),
            _ => 0,
        })
        .sum()
}

/// One operation with the steps of `first` and then of each of `rest`, in order; a write
/// that a later write covers whole is left out, and writes that follow each other in the
/// list and on the object become one.
fn merge(first: &WriteOp, rest: &[WriteOp]) -> WriteOp {
    let all: Vec<&WriteStep> = std::iter::once(first)
        .chain(rest)
        .flat_map(|op| &op.steps)
        .collect();
    let range = |step: &WriteStep| match step {
        // Saturating: a range past u64::MAX is the store's to refuse, not ours to panic on.
        WriteStep::Write { offset, data } => {
            Some((*offset, offset.saturating_add(data.len() as u64)))
        }
        _ => None,
    };
    let mut steps: Vec<WriteStep> = Vec::with_capacity(all.len());
    for (i, &step) in all.iter().enumerate() {
        if let Some((start, end)) = range(step) {
            // Covered by a later write: the later one's bytes win over every byte of this one,
            // and it grows the object at least as far.
            let covered = all[i + 1..]
                .iter()
                .filter_map(|&s| range(s))
                .any(|(s, e)| s <= start && end <= e);
            if covered {
                continue;
            }
            if let Some(WriteStep::Write { offset, data }) = steps.last_mut() {
                if offset.checked_add(data.len() as u64) == Some(start) {
                    if let WriteStep::Write { data: more, .. } = step {
                        data.extend_from_slice(more);
                    }
                    continue;
                }
            }
        }
        steps.push(step.clone());
    }
    WriteOp {
        steps,
        snap_context: first.snap_context.clone(),
        unless_lost_since: first.unless_lost_since,
    }
}

crate::object_store_forwarding_to_inner!(impl[S: ObjectStore] CoalescingStore<S> {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        let waiting = {
            let mut objects = self.objects();
            let state = objects.entry(object.clone()).or_default();
            let room = state.in_flight < MAX_IN_FLIGHT || write_bytes(&op) >= DIRECT_BYTES;
            if room && state.waiting.is_empty() && !state.turn_pending {
                state.in_flight += 1;
                Ok(op)
            } else {
                let (turn, wait) = oneshot::channel();
                state.waiting.push_back(Waiter { op: Some(op), turn });
                Err(wait)
            }
        };
        // Room in flight and nothing before it: the operation goes out now, in this poll.
        let wait = match waiting {
            Ok(op) => return self.lead(object, op, Vec::new(), false).await,
            Err(wait) => wait,
        };
        match WaitTurn::new(self, object, wait).wait().await {
            Ok(Turn::Done(outcome)) => outcome,
            Ok(Turn::Lead { own, followers }) => self.lead(object, own, followers, true).await,
            Ok(Turn::Alone) => unreachable!("writes are queued with their operation"),
            // The operation that carried this one was dropped while it sent them one by one.
            Err(oneshot::Canceled) => Err(abandoned(object)),
        }
    }

    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        let wait = {
            let mut objects = self.objects();
            match objects.get_mut(object) {
                // Writes submitted before this read are queued or about to be submitted: it
                // goes after them.
                Some(state) if !state.waiting.is_empty() || state.turn_pending => {
                    let (turn, wait) = oneshot::channel();
                    state.waiting.push_back(Waiter { op: None, turn });
                    Some(wait)
                }
                // Free, or the writes before it are already in the store's hands.
                _ => None,
            }
        };
        let Some(wait) = wait else {
            return self.inner.read_op(object, op).await;
        };
        if WaitTurn::new(self, object, wait).wait().await.is_err() {
            unreachable!("a read's turn is handed or the read is gone");
        }
        // Nothing else of the object is submitted until this read completes.
        let _in_flight = InFlight {
            store: self,
            object,
            unanswered: Vec::new(),
            turn_pending: true,
        };
        self.inner.read_op(object, op).await
    }

    fn distinguishes_holes(&self) -> bool {
        self.inner.distinguishes_holes()
    }

    fn write_unit(&self) -> u64 {
        self.inner.write_unit()
    }

    fn merges_operations(&self) -> bool {
        true
    }
});

#[cfg(test)]
mod tests {
    use super::*;

    fn write(offset: u64, data: &[u8]) -> WriteStep {
        WriteStep::Write {
            offset,
            data: data.to_vec(),
        }
    }

    #[test]
    fn merge_drops_covered_writes_and_joins_contiguous_ones() {
        // Two 4 KiB-style writes next to each other, each with the same metadata block.
        let a = WriteOp::new()
            .step(write(0, b"aaaa"))
            .step(write(100, b"MMMM"));
        let b = WriteOp::new()
            .step(write(4, b"bbbb"))
            .step(write(100, b"NNNN"));
        let merged = merge(&a, std::slice::from_ref(&b));
        assert_eq!(
            merged.steps,
            vec![write(0, b"aaaabbbb"), write(100, b"NNNN")]
        );
    }

    #[test]
    fn merge_keeps_order_and_partial_overlaps() {
        let a = WriteOp::new()
            .step(write(0, b"aaaa"))
            .step(WriteStep::Zero { offset: 2, len: 4 });
        let b = WriteOp::new()
            .step(write(2, b"bb"))
            .step(WriteStep::OmapSet(
                vec![(b"k".to_vec(), b"v".to_vec())].into(),
            ));
        let merged = merge(&a, std::slice::from_ref(&b));
        assert_eq!(
            merged.steps,
            vec![
                write(0, b"aaaa"),
                WriteStep::Zero { offset: 2, len: 4 },
                write(2, b"bb"),
                WriteStep::OmapSet(vec![(b"k".to_vec(), b"v".to_vec())].into()),
            ]
        );
    }

    #[test]
    fn only_state_independent_steps_merge() {
        assert!(mergeable(&WriteOp::new().step(write(0, b"x"))));
        assert!(!mergeable(
            &WriteOp::new()
                .step(WriteStep::AssertExists)
                .step(write(0, b"x"))
        ));
        assert!(!mergeable(&WriteOp::new().step(WriteStep::Remove)));
        assert!(!mergeable(&WriteOp::new().step(WriteStep::CreateExclusive)));
        assert!(!mergeable(
            &WriteOp::new().step(WriteStep::WriteFull(vec![1]))
        ));
        assert!(!mergeable(
            &WriteOp::new()
                .step(write(0, b"x"))
                .step(WriteStep::OmapRemoveKeys(vec![b"k".to_vec()]))
        ));
        assert!(!mergeable(&WriteOp::new().step(WriteStep::OmapClear)));
        assert!(!mergeable(
            &WriteOp::new().step(WriteStep::Zero { offset: 0, len: 4 })
        ));
        assert!(!mergeable(&WriteOp::new().step(WriteStep::Truncate(8))));
    }
}
