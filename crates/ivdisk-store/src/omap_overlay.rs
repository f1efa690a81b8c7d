//! Omap changes held in memory in front of SQLite's `omap` table, and their encoding for the
//! `omap_pending` table.
//!
//! Why: an `omap-packed` image sets one omap value per 4 KiB write, and one `INSERT OR
//! REPLACE` per value into a large B-tree rewrites, at every group commit, a page for each
//! value changed, which SQLite's log and its checkpoints then copy around (docs/BENCHMARKS.md,
//! "Omap values written behind"). Instead, each group commit stores the changes of its
//! operations as one row of `omap_pending` (sequential pages, atomic with the rest of the
//! commit, so nothing new to recover after a crash or a power cut), the engine answers reads
//! from the changes it holds, and once they pass a size each commit writes the next piece of
//! them to `omap` in key order (round and round the keys): a page of the B-tree is then
//! rewritten once for all the changes held on it. A pending row is deleted once none of its
//! changes is held any more (written back, or changed again by a later row) and every older
//! row is deleted: rows are deleted oldest first. A row replays all its changes, also those
//! later rows changed again, so a newer row deleted before it would leave its older value of
//! such a key to come back over the value written back.
//!
//! The rows are replayed at the next open, oldest first; replaying a change already written
//! back writes nothing new. Steps that read or rewrite a node's omap in SQL as a whole (range
//! removal, clear, rollback, snapshot removal) first write every held change back and delete
//! every row (`Engine::write_back_omap`), so that a replay can never bring back a value such a
//! step removed; they do it in a commit of their own (`Engine::write_back_in_own_commit`),
//! which on a full disk may fail without losing an acknowledged operation. An object's
//! removal does not: the node goes with its rows, its held changes are dropped
//! (`Overlay::drop_node`), and a replay drops what older rows still hold of a node that is
//! gone (`Engine::forget_removed_nodes`). Node ids are never given twice, so no later node
//! can take those changes for its own. Why: the whole write-back, after random small writes,
//! rewrote pages all over both tables and needed more room than a full disk had, so a guest's
//! trim, the way it frees space, was refused there. A snapshot's clone copies its head's held
//! changes.
//!
//! The engine holds changed rows of its `extents` table the same way, in a second overlay
//! (the same machinery, `Overlay`, over other key and value types: `OverlayKey`,
//! `OverlayValue`) whose keys are extent starts (`u64`; big-endian in a pending row) and
//! whose pending rows go to `extents_pending` (held_extents.rs). Those changes skip the
//! operation buffer (`put`): a later step of the same operation must see an earlier step's
//! extents, and an extent change fails only with its whole transaction, after which the
//! engine replays the pending rows anyway.

use std::collections::BTreeMap;
use std::ops::Bound;

use crate::error::StoreError;

/// A key of an overlay's map, after the node: an omap key's bytes, or an extent's start.
///
/// Why not bytes for both: the extents overlay is looked up several times per small write,
/// and with owned byte keys each comparison was a `memcmp` behind a pointer (about a fifth of
/// the store worker's time in the store bench at 4 KiB, docs/BENCHMARKS.md).
pub(crate) trait OverlayKey: Ord + Clone {
    /// What callers look keys up by (`[u8]` for bytes).
    type Ref: ?Sized + Ord;
    /// The lowest key: a node's changes start at `(node, MIN)`.
    const MIN: Self;
    fn owned(key: &Self::Ref) -> Self;
    fn borrowed(&self) -> &Self::Ref;
    /// Its length in a pending row.
    fn key_len(&self) -> usize;
    /// Its bytes in a pending row.
    fn write_key(&self, out: &mut Vec<u8>);
    fn read_key(bytes: &[u8]) -> Result<Self, StoreError>;
}

/// A value of an overlay's map: an omap value's bytes, or a held extent.
pub(crate) trait OverlayValue: Clone {
    /// What reads see of it (`[u8]` for bytes).
    type Ref: ?Sized;
    fn borrowed(&self) -> &Self::Ref;
    /// Its length in a pending row.
    fn value_len(&self) -> usize;
    /// Its bytes in a pending row.
    fn write_value(&self, out: &mut Vec<u8>);
    fn read_value(bytes: &[u8]) -> Result<Self, StoreError>;
}

/// Omap keys up to this long are held inside the map's nodes (an image's keys are 8 bytes).
const INLINE_KEY: usize = 22;

/// An omap key in the overlay's map: up to `INLINE_KEY` bytes inline, longer ones behind a
/// pointer. 24 bytes, as a `Vec<u8>`.
///
/// Why: as owned vectors, every comparison of a descent read its key behind a pointer, a
/// cache miss each in a map of a million keys: the `memcmp` calls alone were 4.5% of the
/// store worker's time in the store bench's 4 KiB writes (docs/BENCHMARKS.md, "The
/// partial-block index as a sorted vector; omap keys inline").
#[derive(Clone)]
pub(crate) enum OmapKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl OmapKey {
    pub(crate) fn new(key: &[u8]) -> Self {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(key);
            OmapKey::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            OmapKey::Heap(key.into())
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            OmapKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            OmapKey::Heap(bytes) => bytes,
        }
    }
}

impl PartialEq for OmapKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for OmapKey {}

impl PartialOrd for OmapKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OmapKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl std::fmt::Debug for OmapKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_bytes().fmt(f)
    }
}

impl OverlayKey for OmapKey {
    type Ref = [u8];
    const MIN: Self = OmapKey::Inline {
        len: 0,
        bytes: [0; INLINE_KEY],
    };
    fn owned(key: &[u8]) -> Self {
        OmapKey::new(key)
    }
    fn borrowed(&self) -> &[u8] {
        self.as_bytes()
    }
    fn key_len(&self) -> usize {
        self.as_bytes().len()
    }
    fn write_key(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self.as_bytes());
    }
    fn read_key(bytes: &[u8]) -> Result<Self, StoreError> {
        Ok(OmapKey::new(bytes))
    }
}

impl OverlayValue for Vec<u8> {
    type Ref = [u8];
    fn borrowed(&self) -> &[u8] {
        self
    }
    fn value_len(&self) -> usize {
        self.len()
    }
    fn write_value(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn read_value(bytes: &[u8]) -> Result<Self, StoreError> {
        Ok(bytes.to_vec())
    }
}

/// What the overlay knows of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup<'a, T: ?Sized> {
    /// Set to this value.
    Value(&'a T),
    /// Removed.
    Removed,
    /// Not changed since the last write-back: SQLite has it.
    Unknown,
}

/// A held change: the value (`None` removes the key) and the pending row it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Change<V> {
    pub(crate) value: Option<V>,
    row: u64,
}

/// A change to write to SQLite's table: `None` removes the key.
pub(crate) type WriteBack<K = OmapKey, V = Vec<u8>> = ((i64, K), Option<V>);

/// A transaction's row buffer up to this size is kept whatever the rows that follow need.
const TXN_BUFFER_KEEP: usize = 1 << 20;

/// A larger one is given up after this many rows in a row that filled less than a quarter of
/// it: one small commit amid large ones (a flush) does not make the next large one grow a
/// buffer again.
const TXN_SMALL_ROWS_BEFORE_SHRINK: u32 = 8;

/// Memory one held change costs besides its key and value (map node, vectors).
const ENTRY_OVERHEAD: usize = 64;

/// The overlay of the `omap` table.
pub(crate) type OmapOverlay = Overlay<OmapKey, Vec<u8>>;

/// Changes held in front of one SQLite table, with their pending rows (see the module's
/// documentation).
pub(crate) struct Overlay<K, V> {
    /// Every change not written back yet: of committed transactions and of the open one.
    held: BTreeMap<(i64, K), Change<V>>,
    held_bytes: usize,
    /// Each pending row not yet deleted (and the open transaction's, once it holds a change).
    rows: BTreeMap<u64, PendingRow>,
    /// The bytes of every stored row in `rows`: what the pending-changes table holds
    /// (`take_oldest` bounds it).
    pending_bytes: usize,
    /// The number of the open transaction's row.
    txn_row: u64,
    /// A write-back in pieces goes on after this key (key order, round and round).
    cursor: Option<(i64, K)>,
    /// The changes of the operation being applied (dropped if it fails).
    op: Vec<(i64, K, Option<V>)>,
    /// The open transaction's changes, encoded for its pending row.
    txn: Vec<u8>,
    /// Rows stored since the last that filled at least a quarter of `txn`'s buffer.
    small_rows: u32,
}

impl<K, V> Default for Overlay<K, V> {
    fn default() -> Self {
        Overlay {
            held: BTreeMap::new(),
            held_bytes: 0,
            rows: BTreeMap::new(),
            pending_bytes: 0,
            txn_row: 0,
            cursor: None,
            op: Vec::new(),
            txn: Vec::new(),
            small_rows: 0,
        }
    }
}

/// What the overlay knows of one pending row.
#[derive(Default, Clone, Copy)]
struct PendingRow {
    /// How many held changes are from it. A row none of whose changes is held (each written
    /// back or changed again by a later row) is no longer needed once every older one is
    /// deleted (`take_emptied`).
    held: usize,
    /// Its size as stored (0 until it is).
    bytes: usize,
}

fn entry_bytes<K: OverlayKey, V: OverlayValue>(key: &K, value: &Option<V>) -> usize {
    key.key_len() + value.as_ref().map_or(0, V::value_len) + ENTRY_OVERHEAD
}

impl<K: OverlayKey, V: OverlayValue> Overlay<K, V> {
    /// Set `key` of `node` in the operation being applied.
    pub(crate) fn set(&mut self, node: i64, key: K, value: V) {
        self.op.push((node, key, Some(value)));
    }

    /// Remove `key` of `node` in the operation being applied.
    pub(crate) fn remove(&mut self, node: i64, key: K) {
        self.op.push((node, key, None));
    }

    /// A step of the operation being applied removed `node`'s keys from `start` to `end`
    /// (exclusive), or all of them: the operation's earlier changes of those keys go too.
    pub(crate) fn forget_in_operation(&mut self, node: i64, range: Option<(&K::Ref, &K::Ref)>) {
        self.op.retain(|(n, key, _)| {
            *n != node
                || range.is_some_and(|(start, end)| key.borrowed() < start || key.borrowed() >= end)
        });
    }

    /// A step of the operation being applied removed `node`, with its rows in SQLite: its
    /// changes go, the operation's and the held ones, and none is written back. Rows that
    /// still hold some of them replay them after a crash or a lost transaction; the engine
    /// then drops the changes of nodes that are gone (`Engine::forget_removed_nodes`).
    pub(crate) fn drop_node(&mut self, node: i64) {
        self.forget_in_operation(node, None);
        let keys: Vec<(i64, K)> = self
            .node_range(node, Bound::Unbounded)
            .map(|(key, _)| key.clone())
            .collect();
        self.take_keys(keys);
    }

    /// The nodes some change is held of, in order (one descent each).
    pub(crate) fn held_nodes(&self) -> Vec<i64> {
        let mut nodes = Vec::new();
        let mut from = Bound::Unbounded;
        while let Some(((node, _), _)) = self.held.range((from, Bound::Unbounded)).next() {
            nodes.push(*node);
            match node.checked_add(1) {
                Some(next) => from = Bound::Included((next, K::MIN)),
                None => break,
            }
        }
        nodes
    }

    /// `to` became a copy of `from` (a snapshot's clone): the held changes of `from` become
    /// changes of `to` in the operation being applied.
    pub(crate) fn copy_node(&mut self, from: i64, to: i64) {
        let copies: Vec<_> = self
            .node_range(from, Bound::Unbounded)
            .map(|((_, key), change)| (to, key.clone(), change.value.clone()))
            .collect();
        self.op.extend(copies);
    }

    /// Set (`Some`) or remove `key` of `node` in the open transaction at once, seen by the
    /// next read, without the operation buffer (the extents overlay: see the module's
    /// documentation). Returns the value it held for the key before, if it held one.
    pub(crate) fn put(&mut self, node: i64, key: K, value: Option<V>) -> Option<V> {
        debug_assert!(
            self.op.is_empty(),
            "an operation's buffered changes would reorder"
        );
        encode(&mut self.txn, node, &key, value.as_ref());
        self.hold(node, key, value, self.txn_row)
    }

    /// Take the held changes of `keys` (all held) out of the overlay, releasing their rows.
    fn take_keys(&mut self, keys: Vec<(i64, K)>) -> Vec<WriteBack<K, V>> {
        keys.into_iter()
            .map(|key| {
                let change = self.held.remove(&key).expect("a key just listed");
                self.held_bytes -= entry_bytes(&key.1, &change.value);
                self.release_row(change.row);
                (key, change.value)
            })
            .collect()
    }

    /// Every held change of `node`, in key order, to write to SQLite in the open transaction
    /// (with the rows this empties deleted, `take_emptied`): that node's rows in SQLite are
    /// then complete, for a step that reads them there (a snapshot's clone copying them).
    /// Rows that still hold older changes of the node replay them before newer ones, to
    /// the same values as written back.
    pub(crate) fn take_node(&mut self, node: i64) -> Vec<WriteBack<K, V>> {
        debug_assert!(self.op.is_empty(), "an operation is still being applied");
        let keys: Vec<(i64, K)> = self
            .node_range(node, Bound::Unbounded)
            .map(|(key, _)| key.clone())
            .collect();
        self.take_keys(keys)
    }

    /// Every held change, in key order (for rebuilding an index of them).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (i64, &K::Ref, Option<&V::Ref>)> + '_ {
        self.held.iter().map(|((node, key), change)| {
            (
                *node,
                key.borrowed(),
                change.value.as_ref().map(V::borrowed),
            )
        })
    }

    /// The highest node some change is held of.
    pub(crate) fn last_node(&self) -> Option<i64> {
        self.held.last_key_value().map(|((node, _), _)| *node)
    }

    /// Whether some change of `node` is held.
    pub(crate) fn holds_node(&self, node: i64) -> bool {
        // One descent (a bounded range takes two, see `below`).
        self.held
            .range((node, K::MIN)..)
            .next()
            .is_some_and(|((n, _), _)| *n == node)
    }

    /// The operation was applied: its changes join the open transaction's.
    pub(crate) fn operation_done(&mut self) {
        let op = std::mem::take(&mut self.op);
        for (node, key, value) in op {
            encode(&mut self.txn, node, &key, value.as_ref());
            self.hold(node, key, value, self.txn_row);
        }
    }

    /// The operation failed: its changes never happened.
    pub(crate) fn operation_failed(&mut self) {
        self.op.clear();
    }

    /// Hold `value` for `key` of `node`, from pending row `row`; returns the value held
    /// before, if any.
    fn hold(&mut self, node: i64, key: K, value: Option<V>, row: u64) -> Option<V> {
        self.held_bytes += entry_bytes(&key, &value);
        self.rows.entry(row).or_default().held += 1;
        let key_len = key.key_len();
        let old = self.held.insert((node, key), Change { value, row })?;
        self.held_bytes -= key_len + old.value.as_ref().map_or(0, V::value_len) + ENTRY_OVERHEAD;
        self.release_row(old.row);
        old.value
    }

    /// One change of `row` is no longer held.
    fn release_row(&mut self, row: u64) {
        if let Some(pending) = self.rows.get_mut(&row) {
            pending.held = pending.held.saturating_sub(1);
        }
    }

    /// The open transaction's row: its number and its changes, encoded (empty if none).
    pub(crate) fn transaction_row(&self) -> (u64, &[u8]) {
        debug_assert!(self.op.is_empty(), "an operation is still being applied");
        (self.txn_row, &self.txn)
    }

    /// The open transaction's row was stored: start the next one in the same buffer. A fresh
    /// one of tens of megabytes per commit cost the worker 3-4% in page faults, and 10% under
    /// random 4 KiB writes through `ivdisk serve`, whose rows of 40-50 MB outgrew a bound of
    /// 64 MiB the buffer was once dropped past, so that it grew again from nothing at every
    /// commit (docs/BENCHMARKS.md, "A commit's row buffer kept"). It is given up when rows have
    /// filled less than a quarter of it for a while (the burst that grew it is over) and when
    /// the store idles (`release_idle_memory`).
    pub(crate) fn transaction_row_stored(&mut self) {
        let used = self.txn.len();
        self.note_row_bytes(self.txn_row, used);
        self.txn.clear();
        if self.txn.capacity() <= TXN_BUFFER_KEEP || used >= self.txn.capacity() / 4 {
            self.small_rows = 0;
        } else {
            self.small_rows += 1;
            if self.small_rows >= TXN_SMALL_ROWS_BEFORE_SHRINK {
                self.txn = Vec::new();
                self.small_rows = 0;
            }
        }
        self.txn_row += 1;
    }

    /// The store is idle: give back the open transaction's buffer if it holds no change.
    pub(crate) fn release_idle_memory(&mut self) {
        if self.txn.is_empty() {
            self.txn = Vec::new();
        }
    }

    fn note_row_bytes(&mut self, row: u64, bytes: usize) {
        self.rows.entry(row).or_default().bytes += bytes;
        self.pending_bytes += bytes;
    }

    /// Number the next transaction's row `row` (after an open's replay: past every number
    /// used before).
    pub(crate) fn next_row(&mut self, row: u64) {
        self.txn_row = row;
    }

    /// Rows no longer needed, oldest first, to delete in the open transaction: the oldest
    /// rows none of whose changes is held, up to the first that still holds one (see the
    /// module's documentation), and never the open transaction's.
    pub(crate) fn take_emptied(&mut self) -> Vec<u64> {
        let mut emptied = Vec::new();
        while let Some((&row, &PendingRow { held: count, bytes })) = self.rows.first_key_value() {
            if count > 0 || row >= self.txn_row {
                break;
            }
            self.rows.remove(&row);
            self.pending_bytes -= bytes;
            emptied.push(row);
        }
        emptied
    }

    /// Up to `limit` held changes, the next ones in key order after the last piece (round
    /// and round), in key order, to write to SQLite's table in the open transaction (with
    /// the rows this empties deleted, `take_emptied`). Pieces in key order dirty each page
    /// of SQLite's B-tree once for every change held on it.
    pub(crate) fn take_piece(&mut self, limit: usize) -> Vec<WriteBack<K, V>> {
        debug_assert!(self.op.is_empty(), "an operation is still being applied");
        let after = match &self.cursor {
            Some(key) => Bound::Excluded(key.clone()),
            None => Bound::Unbounded,
        };
        let mut keys: Vec<(i64, K)> = self
            .held
            .range((after, Bound::Unbounded))
            .take(limit)
            .map(|(key, _)| key.clone())
            .collect();
        if keys.len() < limit && self.cursor.is_some() {
            let first = keys.first().cloned();
            let wrapped = self
                .held
                .keys()
                .take_while(|key| first.as_ref() != Some(*key))
                .take(limit - keys.len())
                .cloned();
            let wrapped: Vec<_> = wrapped.collect();
            keys.extend(wrapped);
        }
        self.cursor = keys.last().cloned();
        keys.sort_unstable();
        self.take_keys(keys)
    }

    /// Past `max` bytes of pending rows: the held changes of the oldest rows, in key order,
    /// to write to SQLite in the open transaction, so that those rows empty and are deleted
    /// (`take_emptied`), down to three quarters of `max`; none otherwise.
    ///
    /// Why: rows are deleted oldest first, and a key set once and not again (an image's
    /// header values, set at its creation) keeps its row, and with it every later row, until
    /// its change is written back. Below the bound of held changes nothing was written back,
    /// and under random 4 KiB writes through `ivdisk serve` to a 2 GiB image the table grew
    /// by 10 MiB a second, without end. An old row's changes are mostly changed again by
    /// later rows: few are left to write back.
    pub(crate) fn take_oldest(&mut self, max: usize) -> Vec<WriteBack<K, V>> {
        debug_assert!(self.op.is_empty(), "an operation is still being applied");
        if self.pending_bytes <= max {
            return Vec::new();
        }
        let target = max / 4 * 3;
        let mut left = self.pending_bytes;
        let mut last = None;
        for (&row, &PendingRow { bytes, .. }) in &self.rows {
            if left <= target || row >= self.txn_row {
                break;
            }
            left -= bytes;
            last = Some(row);
        }
        let Some(last) = last else {
            return Vec::new();
        };
        let keys: Vec<(i64, K)> = self
            .held
            .iter()
            .filter(|(_, change)| change.row <= last)
            .map(|(key, _)| key.clone())
            .collect();
        self.take_keys(keys)
    }

    /// The bytes of the pending rows not deleted yet.
    #[cfg(test)]
    pub(crate) fn pending_bytes(&self) -> usize {
        self.pending_bytes
    }

    /// The capacity of the open transaction's row buffer.
    #[cfg(test)]
    fn transaction_buffer_capacity(&self) -> usize {
        self.txn.capacity()
    }

    /// Every held change, in key order, to write to SQLite's table in the open transaction
    /// (which also deletes every pending row): the overlay is empty after.
    pub(crate) fn take_all(&mut self) -> Vec<WriteBack<K, V>> {
        debug_assert!(self.op.is_empty(), "an operation is still being applied");
        self.txn.clear();
        self.held_bytes = 0;
        self.rows.clear();
        self.pending_bytes = 0;
        self.cursor = None;
        std::mem::take(&mut self.held)
            .into_iter()
            .map(|(key, change)| (key, change.value))
            .collect()
    }

    /// Forget everything (the open transaction was lost; the caller replays the pending rows
    /// that are left).
    pub(crate) fn clear(&mut self) {
        self.op.clear();
        self.txn.clear();
        self.held.clear();
        self.held_bytes = 0;
        self.rows.clear();
        self.pending_bytes = 0;
        self.cursor = None;
    }

    /// Replay pending row number `seq` (rows oldest first).
    pub(crate) fn replay(&mut self, seq: u64, row: &[u8]) -> Result<(), StoreError> {
        self.note_row_bytes(seq, row.len());
        let mut rest = row;
        while !rest.is_empty() {
            let (node, key, value, after) = decode(rest)?;
            let value = value.map(V::read_value).transpose()?;
            self.hold(node, K::read_key(key)?, value, seq);
            rest = after;
        }
        Ok(())
    }

    /// What the overlay knows of `key` of `node`, for a read (never during an operation).
    pub(crate) fn get(&self, node: i64, key: &K::Ref) -> Lookup<'_, V::Ref> {
        // The map's keys are owned pairs: one owned copy of the key to look it up (a range
        // between two copies cost two copies and two descents).
        let found = self.held.get(&(node, K::owned(key)));
        match found.map(|change| &change.value) {
            Some(Some(v)) => Lookup::Value(v.borrowed()),
            Some(None) => Lookup::Removed,
            None => Lookup::Unknown,
        }
    }

    /// The held changes of `node` from `start` on, in key order.
    fn node_range(
        &self,
        node: i64,
        start: Bound<K>,
    ) -> impl DoubleEndedIterator<Item = (&(i64, K), &Change<V>)> + '_ {
        let lower = match start {
            Bound::Included(key) => Bound::Included((node, key)),
            Bound::Excluded(key) => Bound::Excluded((node, key)),
            Bound::Unbounded => Bound::Included((node, K::MIN)),
        };
        let upper = match node.checked_add(1) {
            Some(next) => Bound::Excluded((next, K::MIN)),
            None => Bound::Unbounded,
        };
        self.held.range((lower, upper))
    }

    /// The held changes of `node` with keys from `start` (inclusive) to `end` (exclusive; none:
    /// to the end), in key order.
    pub(crate) fn range<'a>(
        &'a self,
        node: i64,
        start: &K::Ref,
        end: Option<&K::Ref>,
    ) -> impl DoubleEndedIterator<Item = (&'a K::Ref, Option<&'a V::Ref>)> + 'a {
        let lower = Bound::Included((node, K::owned(start)));
        let upper = match end {
            // An end before the start is an empty range (`BTreeMap::range` would panic).
            Some(end) => Bound::Excluded((node, K::owned(end.max(start)))),
            None => match node.checked_add(1) {
                Some(next) => Bound::Excluded((next, K::MIN)),
                None => Bound::Unbounded,
            },
        };
        self.held
            .range((lower, upper))
            .map(|((_, key), change)| (key.borrowed(), change.value.as_ref().map(V::borrowed)))
    }

    /// The held changes of `node` with keys below `end`, from the highest key down.
    ///
    /// As `range(node, MIN, Some(end)).rev()`, in one descent of the map where that took
    /// two (a range finds both of its ends; the map's first leaf, this range's other end,
    /// stays in the CPU's caches). Walking down from `end` is every extent lookup's first step.
    pub(crate) fn below<'a>(
        &'a self,
        node: i64,
        end: &K::Ref,
    ) -> impl Iterator<Item = (&'a K::Ref, Option<&'a V::Ref>)> + 'a {
        self.held
            .range((Bound::Unbounded, Bound::Excluded((node, K::owned(end)))))
            .rev()
            .take_while(move |((n, _), _)| *n == node)
            .map(|((_, key), change)| (key.borrowed(), change.value.as_ref().map(V::borrowed)))
    }

    /// Whether nothing is held (and no change is waiting for its pending row).
    pub(crate) fn is_empty(&self) -> bool {
        self.held.is_empty() && self.txn.is_empty()
    }

    /// Whether some change or some pending row is not written back or deleted yet.
    pub(crate) fn pending(&self) -> bool {
        !self.is_empty() || !self.rows.is_empty()
    }

    /// Changes held, and about how much memory they take.
    pub(crate) fn held(&self) -> (usize, usize) {
        (self.held.len(), self.held_bytes)
    }

    /// Pending rows tracked (a read-only follower's bound, `FOLLOWED_ROWS_MAX`).
    pub(crate) fn rows_len(&self) -> usize {
        self.rows.len()
    }

    /// The oldest pending row tracked.
    pub(crate) fn first_row(&self) -> Option<u64> {
        self.rows.first_key_value().map(|(&row, _)| row)
    }
}

/// One change in a pending row (integers little-endian): `node i64`, `kind u8` (0 set, 1
/// remove), `key_len u32`, the key, and for a set `value_len u32` and the value.
fn encode<K: OverlayKey, V: OverlayValue>(
    out: &mut Vec<u8>,
    node: i64,
    key: &K,
    value: Option<&V>,
) {
    out.extend_from_slice(&node.to_le_bytes());
    out.push(u8::from(value.is_none()));
    out.extend_from_slice(&(key.key_len() as u32).to_le_bytes());
    key.write_key(out);
    if let Some(value) = value {
        out.extend_from_slice(&(value.value_len() as u32).to_le_bytes());
        value.write_value(out);
    }
}

type Decoded<'a> = (i64, &'a [u8], Option<&'a [u8]>, &'a [u8]);

/// The error of a damaged pending row.
pub(crate) fn damaged_row() -> StoreError {
    StoreError::Corrupt(
        "a row of the table omap_pending or extents_pending (changes not yet written back) is \
         damaged; restore the store from a backup"
            .to_owned(),
    )
}

fn decode(row: &[u8]) -> Result<Decoded<'_>, StoreError> {
    fn take(buf: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
        (buf.len() >= n).then(|| buf.split_at(n))
    }
    let len = |bytes: &[u8]| u32::from_le_bytes(bytes.try_into().unwrap_or([0; 4])) as usize;
    let (node, rest) = take(row, 8).ok_or_else(damaged_row)?;
    let node = i64::from_le_bytes(node.try_into().map_err(|_| damaged_row())?);
    let (kind, rest) = take(rest, 1).ok_or_else(damaged_row)?;
    let (key_len, rest) = take(rest, 4).ok_or_else(damaged_row)?;
    let (key, rest) = take(rest, len(key_len)).ok_or_else(damaged_row)?;
    match kind[0] {
        0 => {
            let (value_len, rest) = take(rest, 4).ok_or_else(damaged_row)?;
            let (value, rest) = take(rest, len(value_len)).ok_or_else(damaged_row)?;
            Ok((node, key, Some(value), rest))
        }
        1 => Ok((node, key, None, rest)),
        _ => Err(damaged_row()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn okey(s: &str) -> OmapKey {
        OmapKey::new(s.as_bytes())
    }

    /// The open transaction's row, as the engine stores it.
    fn stored(o: &mut OmapOverlay) -> (u64, Vec<u8>) {
        let (seq, row) = o.transaction_row();
        let row = (seq, row.to_vec());
        o.transaction_row_stored();
        row
    }

    fn done(o: &mut OmapOverlay, node: i64, key: &str, value: Option<&str>) {
        match value {
            Some(v) => o.set(node, okey(key), k(v)),
            None => o.remove(node, okey(key)),
        }
        o.operation_done();
    }

    /// Keys inline and behind a pointer order as their bytes do, among themselves and
    /// against each other (the map's order is the table's and the pending rows' order).
    #[test]
    fn omap_keys_order_as_their_bytes_inline_or_not() {
        assert_eq!(std::mem::size_of::<OmapKey>(), 24);
        let mut next = crate::test_rng::draws_below(0x1234_5678_9abc_def1);
        let keys: Vec<Vec<u8>> = (0..400)
            .map(|_| {
                let len = [0, 1, 8, 21, 22, 23, 40][next(7) as usize];
                // Few distinct bytes, so that keys share prefixes and differ only in length.
                (0..len).map(|_| next(2) as u8 * 255).collect()
            })
            .collect();
        for a in &keys {
            let ka = OmapKey::new(a);
            assert_eq!(ka.as_bytes(), &a[..]);
            assert_eq!(OmapKey::read_key(a).unwrap(), ka);
            for b in &keys {
                assert_eq!(ka.cmp(&OmapKey::new(b)), a.cmp(b), "{a:?} against {b:?}");
            }
        }
        assert!(OmapKey::MIN <= OmapKey::new(b""));
        assert!(matches!(OmapKey::new(&[7; 22]), OmapKey::Inline { .. }));
        assert!(matches!(OmapKey::new(&[7; 23]), OmapKey::Heap(_)));
    }

    /// A commit's row buffer outlives the commit: rows of tens of MB (random 4 KiB writes
    /// through `ivdisk serve`) must not grow a fresh one every time. It goes after a run of
    /// rows that fill less than a quarter of it, and at idle.
    #[test]
    fn a_transactions_row_buffer_is_kept_for_the_next_until_idle() {
        let mut o = OmapOverlay::default();
        let value = vec![7u8; 24 << 20];
        // Stores a row past the old bound of 64 MiB; returns the buffer's capacity after.
        let big_row = |o: &mut OmapOverlay| {
            for key in ["a", "b", "c"] {
                o.set(1, okey(key), value.clone());
            }
            o.operation_done();
            assert!(o.transaction_row().1.len() > 64 << 20);
            o.transaction_row_stored();
            o.transaction_buffer_capacity()
        };
        let small_row = |o: &mut OmapOverlay| {
            done(o, 1, "small", Some("value"));
            o.transaction_row_stored();
            o.transaction_buffer_capacity()
        };
        let kept = big_row(&mut o);
        assert!(kept > 64 << 20, "a buffer of {kept} bytes was not kept");
        assert_eq!(big_row(&mut o), kept, "the row grew a new buffer");
        for _ in 1..TXN_SMALL_ROWS_BEFORE_SHRINK {
            assert_eq!(small_row(&mut o), kept, "small rows dropped it");
        }
        assert_eq!(big_row(&mut o), kept, "the row grew a new buffer");
        let after: Vec<usize> = (0..TXN_SMALL_ROWS_BEFORE_SHRINK)
            .map(|_| small_row(&mut o))
            .collect();
        assert_eq!(after.last(), Some(&0), "a burst's buffer outlived it");

        done(&mut o, 2, "d", Some("after"));
        o.release_idle_memory();
        assert!(
            o.transaction_buffer_capacity() > 0,
            "a held change's row was dropped"
        );
        o.transaction_row_stored();
        o.release_idle_memory();
        assert_eq!(o.transaction_buffer_capacity(), 0);
    }

    #[test]
    fn reads_see_the_newest_change_and_failed_operations_none() {
        let mut o = OmapOverlay::default();
        assert_eq!(o.get(1, b"a"), Lookup::Unknown);
        done(&mut o, 1, "a", Some("one"));
        assert_eq!(o.get(1, b"a"), Lookup::Value(&b"one"[..]));
        done(&mut o, 1, "a", None);
        assert_eq!(o.get(1, b"a"), Lookup::Removed);
        o.set(1, okey("a"), k("lost"));
        o.set(2, okey("b"), k("lost"));
        o.operation_failed();
        assert_eq!(o.get(1, b"a"), Lookup::Removed);
        assert_eq!(o.get(2, b"b"), Lookup::Unknown);
        assert_eq!(o.held().0, 1);
    }

    #[test]
    fn a_transactions_row_replays_to_the_same_state() {
        let mut o = OmapOverlay::default();
        done(&mut o, 1, "a", Some("one"));
        done(&mut o, 2, "b", Some("two"));
        done(&mut o, 1, "a", Some("three"));
        let first = stored(&mut o);
        done(&mut o, 2, "b", None);
        done(&mut o, 3, "", Some(""));
        let second = stored(&mut o);
        assert_eq!(second.0, first.0 + 1);
        assert!(o.transaction_row().1.is_empty());

        let mut replayed = OmapOverlay::default();
        replayed.replay(first.0, &first.1).unwrap();
        assert_eq!(replayed.get(1, b"a"), Lookup::Value(&b"three"[..]));
        assert_eq!(replayed.get(2, b"b"), Lookup::Value(&b"two"[..]));
        replayed.replay(second.0, &second.1).unwrap();
        assert_eq!(replayed.take_all(), o.take_all());
        assert!(replayed.is_empty() && o.is_empty());
        assert_eq!(replayed.held(), (0, 0));
    }

    #[test]
    fn a_damaged_row_is_refused() {
        let mut o = OmapOverlay::default();
        done(&mut o, 7, "key", Some("value"));
        let (_, row) = stored(&mut o);
        for cut in 1..row.len() {
            let mut fresh = OmapOverlay::default();
            assert!(
                matches!(fresh.replay(1, &row[..cut]), Err(StoreError::Corrupt(_))),
                "{cut}"
            );
        }
        let mut bad_kind = row.clone();
        bad_kind[8] = 9;
        assert!(OmapOverlay::default().replay(1, &bad_kind).is_err());
    }

    #[test]
    fn ranges_stay_within_their_node_and_bounds() {
        let mut o = OmapOverlay::default();
        for (node, key) in [(1, "a"), (1, "b"), (1, "c"), (2, "a"), (i64::MAX, "z")] {
            done(&mut o, node, key, Some(key));
        }
        done(&mut o, 1, "b", None);
        let keys = |it: Vec<(&[u8], Option<&[u8]>)>| {
            it.into_iter()
                .map(|(key, value)| (String::from_utf8_lossy(key).into_owned(), value.is_some()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keys(o.range(1, b"", None).collect()),
            [("a".into(), true), ("b".into(), false), ("c".into(), true)]
        );
        assert_eq!(
            keys(o.range(1, b"b", Some(b"c")).collect()),
            [("b".into(), false)]
        );
        assert!(o.range(1, b"c", Some(b"a")).next().is_none());
        assert_eq!(
            keys(o.range(i64::MAX, b"", None).collect()),
            [("z".into(), true)]
        );
        // `below` walks down within its node, as the reversed range from the node's start.
        for (node, end) in [(1, &b"c"[..]), (1, b"bb"), (1, b"a"), (1, b"zz"), (2, b"b")] {
            assert_eq!(
                keys(o.below(node, end).collect()),
                keys(o.range(node, b"", Some(end)).rev().collect()),
                "node {node}, below {end:?}"
            );
        }
        assert_eq!(
            keys(o.below(1, b"c").collect()),
            [("b".into(), false), ("a".into(), true)]
        );
        assert!(o.below(3, b"zz").next().is_none() && o.below(2, b"a").next().is_none());
        assert!(o.holds_node(1) && o.holds_node(i64::MAX) && !o.holds_node(3));
        assert!(!o.holds_node(0) && !o.holds_node(i64::MIN));
    }

    #[test]
    fn whole_node_steps_drop_the_operations_changes_and_copies_carry_held_ones() {
        let mut o = OmapOverlay::default();
        done(&mut o, 1, "a", Some("held"));
        done(&mut o, 1, "b", None);
        o.set(1, okey("c"), k("x"));
        o.set(1, okey("d"), k("x"));
        o.set(2, okey("c"), k("other node"));
        o.forget_in_operation(1, Some((b"c", b"d")));
        o.operation_done();
        assert_eq!(o.get(1, b"c"), Lookup::Unknown);
        assert_eq!(o.get(1, b"d"), Lookup::Value(&b"x"[..]));
        assert_eq!(o.get(2, b"c"), Lookup::Value(&b"other node"[..]));
        o.set(1, okey("e"), k("x"));
        o.forget_in_operation(1, None);
        o.operation_done();
        assert_eq!(o.get(1, b"e"), Lookup::Unknown);

        o.copy_node(1, 9);
        o.operation_done();
        assert_eq!(o.get(9, b"a"), Lookup::Value(&b"held"[..]));
        assert_eq!(o.get(9, b"b"), Lookup::Removed);
        assert_eq!(o.get(9, b"d"), Lookup::Value(&b"x"[..]));
        assert_eq!(o.get(9, b"c"), Lookup::Unknown);
        // The copies are in the transaction's row, for a replay.
        let (seq, row) = stored(&mut o);
        let mut replayed = OmapOverlay::default();
        replayed.replay(seq, &row).unwrap();
        assert_eq!(replayed.take_all(), o.take_all());
    }

    /// Pieces go round the keys in order; a row is unneeded once none of its changes is held
    /// (written back, or changed again by a later row), and not before.
    #[test]
    fn pieces_go_round_and_empty_rows() {
        let mut o = OmapOverlay::default();
        o.next_row(10);
        for key in ["a", "b", "c", "d"] {
            done(&mut o, 1, key, Some("10"));
        }
        assert_eq!(stored(&mut o).0, 10);
        done(&mut o, 1, "b", Some("11"));
        done(&mut o, 1, "e", None);
        assert_eq!(stored(&mut o).0, 11);
        assert!(o.take_emptied().is_empty());

        let keys = |piece: Vec<WriteBack>| {
            piece
                .into_iter()
                .map(|((_, key), value)| {
                    (
                        String::from_utf8(key.as_bytes().to_vec()).unwrap(),
                        value.is_some(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            keys(o.take_piece(2)),
            [("a".into(), true), ("b".into(), true)]
        );
        assert!(o.take_emptied().is_empty(), "row 10 still has c and d");
        assert_eq!(o.held().0, 3);
        // Changed again meanwhile: d now in row 12, so row 10 keeps only c.
        done(&mut o, 1, "d", Some("12"));
        done(&mut o, 1, "a", Some("12"));
        assert_eq!(stored(&mut o).0, 12);
        assert!(o.take_emptied().is_empty());
        assert_eq!(
            keys(o.take_piece(2)),
            [("c".into(), true), ("d".into(), true)]
        );
        assert_eq!(o.take_emptied(), [10]);
        // Round again from the start: a (row 12), then e (row 11), not past the start.
        assert_eq!(
            keys(o.take_piece(5)),
            [("a".into(), true), ("e".into(), false)]
        );
        let mut emptied = o.take_emptied();
        emptied.sort_unstable();
        assert_eq!(emptied, [11, 12]);
        assert_eq!(o.held(), (0, 0));
        assert!(o.take_piece(3).is_empty());
    }

    /// A row whose changes are all written back stays until every older row is deleted: an
    /// older row still needed for one key also replays its superseded value of another, which
    /// the newer row must then replay over (a replay of the rows left after a crash).
    #[test]
    fn rows_are_deleted_oldest_first() {
        let mut o = OmapOverlay::default();
        o.next_row(1);
        done(&mut o, 1, "k", Some("old"));
        done(&mut o, 1, "l", Some("x"));
        let first = stored(&mut o);
        done(&mut o, 1, "k", Some("new"));
        let second = stored(&mut o);
        // Key order: k first, so row 2 (k's newest) empties while row 1 holds l.
        let piece = o.take_piece(1);
        assert_eq!(piece, [((1, okey("k")), Some(k("new")))]);
        assert!(o.take_emptied().is_empty(), "row 2 must outlive row 1");
        let mut replayed = OmapOverlay::default();
        replayed.replay(first.0, &first.1).unwrap();
        replayed.replay(second.0, &second.1).unwrap();
        assert_eq!(replayed.get(1, b"k"), Lookup::Value(&b"new"[..]));
        assert_eq!(o.take_piece(1), [((1, okey("l")), Some(k("x")))]);
        assert_eq!(o.take_emptied(), [1, 2]);
        assert!(!o.pending());
    }

    /// A key set once and never again pins its row, and every later row, until the pending
    /// rows pass their bound: then the oldest rows' held changes are written back and the
    /// rows deleted, and the rows left replay to what is held.
    #[test]
    fn the_oldest_rows_are_written_back_past_the_pending_bound() {
        let mut o = OmapOverlay::default();
        o.next_row(1);
        done(&mut o, 9, "header", Some("set once"));
        done(&mut o, 1, "a", Some("a1"));
        let mut rows = vec![stored(&mut o)];
        for round in 2..=6 {
            done(&mut o, 1, "a", Some(&format!("a{round}")));
            done(&mut o, 1, &format!("b{round}"), Some("b"));
            rows.push(stored(&mut o));
        }
        assert!(o.take_emptied().is_empty(), "row 1 still holds the header");
        let stored_bytes: usize = rows.iter().map(|(_, row)| row.len()).sum();
        assert_eq!(o.pending_bytes(), stored_bytes);
        assert!(o.take_oldest(stored_bytes).is_empty(), "within the bound");

        // Down to three quarters of a bound of half the rows' bytes: rows 1 to 4 go.
        let max = stored_bytes / 2;
        let mut left = stored_bytes;
        let mut last = 0;
        for (seq, row) in &rows {
            if left <= max / 4 * 3 {
                break;
            }
            left -= row.len();
            last = *seq;
        }
        assert!(last >= 3, "the test wants several rows written back");
        let written = o.take_oldest(max);
        let expected: Vec<WriteBack> = (2..=last)
            .map(|r| ((1, okey(&format!("b{r}"))), Some(k("b"))))
            .chain([((9, okey("header")), Some(k("set once")))])
            .collect();
        assert_eq!(
            written, expected,
            "the oldest rows' held changes, in key order"
        );
        assert_eq!(o.take_emptied(), (1..=last).collect::<Vec<_>>());
        assert_eq!(o.pending_bytes(), left);
        assert_eq!(o.get(9, b"header"), Lookup::Unknown, "written back");
        assert_eq!(o.get(1, b"a"), Lookup::Value(&b"a6"[..]));

        // The rows left replay to what the overlay still holds.
        let mut replayed = OmapOverlay::default();
        for (seq, row) in rows.iter().filter(|(seq, _)| *seq > last) {
            replayed.replay(*seq, row).unwrap();
        }
        assert_eq!(
            replayed.iter().collect::<Vec<_>>(),
            o.iter().collect::<Vec<_>>()
        );
        assert_eq!(replayed.pending_bytes(), o.pending_bytes());
    }

    /// The open transaction's row is never deleted before it is stored, even once a
    /// write-back of its node took every change it had so far.
    #[test]
    fn the_open_transactions_row_is_never_emptied() {
        let mut o = OmapOverlay::default();
        o.next_row(5);
        o.put(1, okey("a"), Some(k("v")));
        assert_eq!(o.take_node(1).len(), 1);
        assert!(o.take_emptied().is_empty());
        o.put(1, okey("b"), Some(k("w")));
        let (seq, row) = stored(&mut o);
        assert_eq!(seq, 5);
        let mut replayed = OmapOverlay::default();
        replayed.replay(seq, &row).unwrap();
        assert_eq!(replayed.get(1, b"b"), Lookup::Value(&b"w"[..]));
        assert!(o.take_emptied().is_empty(), "row 5 still holds b");
    }

    #[test]
    fn held_bytes_follow_replacements() {
        let mut o = OmapOverlay::default();
        done(&mut o, 1, "a", Some("0123456789"));
        let (_, ten) = o.held();
        done(&mut o, 1, "a", Some("01234"));
        assert_eq!(o.held(), (1, ten - 5));
        done(&mut o, 1, "a", None);
        assert_eq!(o.held(), (1, ten - 10));
        o.clear();
        assert_eq!(o.held(), (0, 0));
    }
}
