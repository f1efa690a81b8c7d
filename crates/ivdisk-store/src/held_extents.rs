//! Extent rows changed in memory in front of SQLite's `extents` table: the engine's second
//! overlay (omap_overlay.rs has the first, and the machinery both use).
//!
//! Why: every small write changes one to three rows of `extents` (the new extent, the cut
//! ends of the ones it overlaps), and each `INSERT`, `UPDATE` or `DELETE` descends the
//! table's B-tree and dirties a page that the commit then copies to SQLite's log; in the
//! store bench's 4 KiB operation the cuts and inserts took 43% of the worker's time
//! (docs/BENCHMARKS.md, "Extent rows written behind"). Held here instead, a change costs a
//! map insert and a few bytes in the commit's `extents_pending` row; the rows reach the
//! table in pieces in key order once more than a bound is held, and a row changed again
//! meanwhile is written once.
//!
//! Readers merge: the held change of a key, if any, replaces SQLite's row of that key
//! (`Held::Removed` hides it). Extents stay disjoint in the merged view, which is what the
//! engine's lookups rely on. `partial` is to the held extents what the index
//! `partial_block_by_place` is to the table: where the held segment extents that do not
//! cover whole blocks are, for `Engine::referenced`.

use crate::engine::{Piece, Stored, BLOCK, INLINE_SEG};
use crate::error::StoreError;
use crate::omap_overlay::{damaged_row, Lookup, Overlay, OverlayKey, OverlayValue, WriteBack};
use crate::partial_index::{PartialIndex, PartialPlace};

/// What the overlay knows of the extent starting at some offset.
#[derive(Debug, Clone)]
pub(crate) enum Held {
    /// It ends at `.0` and its bytes are where `.1` says.
    Extent(u64, Stored),
    /// There is none.
    Removed,
    /// Not changed since the last write-back: SQLite has it.
    Unknown,
}

/// A change to write to the `extents` table: node, start, and the extent (`None` deletes it).
pub(crate) type ExtentWriteBack = (i64, u64, Option<(u64, Stored)>);

/// A held extent: where it ends and where its bytes are.
#[derive(Debug, Clone)]
pub(crate) struct HeldExtent {
    pub(crate) hi: u64,
    pub(crate) stored: Stored,
}

#[derive(Default)]
pub(crate) struct HeldExtents {
    /// Keyed by the extent's start.
    overlay: Overlay<u64, HeldExtent>,
    /// Held segment extents that do not cover whole blocks: (segment, offset, node) ->
    /// (length, blob end). Read only between transactions (`partial_below`), after
    /// `settle_partial`.
    partial: PartialIndex,
}

/// Byte length of an encoded segment extent: `hi`, `seg`, `seg_off`, `blob`, `blob_end`.
const SEGMENT_VALUE: usize = 40;

/// An extent's start, big-endian in a pending row (so that byte order is offset order, as
/// the rows of an older build were written).
impl OverlayKey for u64 {
    type Ref = u64;
    const MIN: Self = 0;
    fn owned(key: &u64) -> Self {
        *key
    }
    fn borrowed(&self) -> &u64 {
        self
    }
    fn key_len(&self) -> usize {
        8
    }
    fn write_key(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_be_bytes());
    }
    fn read_key(bytes: &[u8]) -> Result<Self, StoreError> {
        bytes
            .try_into()
            .map(u64::from_be_bytes)
            .map_err(|_| damaged_row())
    }
}

/// `hi u64`, `seg i64` (little-endian), then for a segment extent `seg_off`, `blob`,
/// `blob_end` (u64), for an inline one its bytes.
impl OverlayValue for HeldExtent {
    type Ref = HeldExtent;
    fn borrowed(&self) -> &HeldExtent {
        self
    }
    fn value_len(&self) -> usize {
        match &self.stored {
            Stored::Segment(_) => SEGMENT_VALUE,
            Stored::Inline(data) => 16 + data.len(),
        }
    }
    fn write_value(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hi.to_le_bytes());
        match &self.stored {
            Stored::Segment(piece) => {
                out.extend_from_slice(&i64::from(piece.seg).to_le_bytes());
                out.extend_from_slice(&piece.seg_off.to_le_bytes());
                out.extend_from_slice(&piece.blob.to_le_bytes());
                out.extend_from_slice(&piece.blob_end.to_le_bytes());
            }
            Stored::Inline(data) => {
                out.extend_from_slice(&INLINE_SEG.to_le_bytes());
                out.extend_from_slice(data);
            }
        }
    }
    fn read_value(value: &[u8]) -> Result<Self, StoreError> {
        let word = |at: usize| -> Result<u64, StoreError> {
            value
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
                .ok_or_else(damaged_row)
        };
        let hi = word(0)?;
        let seg = word(8)? as i64;
        if seg == INLINE_SEG {
            let stored = Stored::Inline(value[16..].to_vec());
            return Ok(HeldExtent { hi, stored });
        }
        if value.len() != SEGMENT_VALUE {
            return Err(damaged_row());
        }
        let stored = Stored::Segment(Piece {
            seg: u32::try_from(seg).map_err(|_| damaged_row())?,
            seg_off: word(16)?,
            blob: word(24)?,
            blob_end: word(32)?,
        });
        Ok(HeldExtent { hi, stored })
    }
}

/// Where a segment extent `[lo, hi)` that does not cover whole blocks is, for `partial`.
fn partial_place(node: i64, lo: u64, hi: u64, stored: &Stored) -> Option<PartialPlace> {
    match stored {
        Stored::Segment(p)
            if !p.seg_off.is_multiple_of(BLOCK) || !(hi - lo).is_multiple_of(BLOCK) =>
        {
            Some((p.seg, p.seg_off, node))
        }
        _ => None,
    }
}

impl HeldExtents {
    /// Set the extent at `lo` of `node` to `[lo, hi)` stored in `stored`, or remove it (`None`),
    /// in the open transaction.
    pub(crate) fn put(&mut self, node: i64, lo: u64, extent: Option<(u64, Stored)>) {
        let place = extent.as_ref().and_then(|(hi, stored)| match stored {
            Stored::Segment(p) => {
                partial_place(node, lo, *hi, stored).map(|place| (place, (hi - lo, p.blob_end)))
            }
            Stored::Inline(_) => None,
        });
        let value = extent.map(|(hi, stored)| HeldExtent { hi, stored });
        // The map's insert hands back what it replaces: one descent, where a lookup first
        // took two (the put was 5% of the store bench's samples at 4 KiB).
        if let Some(old) = self.overlay.put(node, lo, value) {
            if let Some(old_place) = partial_place(node, lo, old.hi, &old.stored) {
                self.partial.change(old_place, None);
            }
        }
        // After the old one's removal: both may be at the same place (a cut at the same key).
        if let Some((place, entry)) = place {
            self.partial.change(place, Some(entry));
        }
    }

    /// Make the changes to `partial` so far visible to `partial_below`.
    pub(crate) fn settle_partial(&mut self) {
        self.partial.settle();
    }

    pub(crate) fn get(&self, node: i64, lo: u64) -> Held {
        match self.overlay.get(node, &lo) {
            Lookup::Value(extent) => Held::Extent(extent.hi, extent.stored.clone()),
            Lookup::Removed => Held::Removed,
            Lookup::Unknown => Held::Unknown,
        }
    }

    /// The held changes of `node` starting below `hi`, from the highest start down: the
    /// extent starting there, or `None` if it was removed.
    pub(crate) fn below(
        &self,
        node: i64,
        hi: u64,
    ) -> impl Iterator<Item = (u64, Option<&HeldExtent>)> + '_ {
        self.overlay
            .below(node, &hi)
            .map(|(lo, extent)| (*lo, extent))
    }

    /// The highest node some change is held of.
    pub(crate) fn last_node(&self) -> Option<i64> {
        self.overlay.last_node()
    }

    /// Whether some change of `node` is held.
    pub(crate) fn holds_node(&self, node: i64) -> bool {
        self.overlay.holds_node(node)
    }

    /// Settle `partial` and give back what it holds besides its places, and the overlay's
    /// transaction buffer (the store is idle: see `Engine::release_idle_memory`).
    pub(crate) fn release_idle_memory(&mut self) {
        self.partial.release_idle_memory();
        self.overlay.release_idle_memory();
    }

    #[cfg(test)]
    pub(crate) fn partial_reserve_capacity(&self) -> usize {
        self.partial.reserve_capacity()
    }

    /// Held segment extents of `segment` that do not cover whole blocks and start below
    /// `to`, from the highest start down: (start, length, blob end). Only after
    /// `settle_partial` (the changes since are not seen).
    pub(crate) fn partial_below(
        &self,
        segment: u32,
        to: u64,
    ) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.partial.below(segment, to)
    }

    fn written_back(&mut self, changes: Vec<WriteBack<u64, HeldExtent>>) -> Vec<ExtentWriteBack> {
        changes
            .into_iter()
            .map(|((node, lo), value)| {
                let extent = value.map(|HeldExtent { hi, stored }| {
                    if let Some(place) = partial_place(node, lo, hi, &stored) {
                        self.partial.change(place, None);
                    }
                    (hi, stored)
                });
                (node, lo, extent)
            })
            .collect()
    }

    /// See `Overlay::take_piece`.
    pub(crate) fn take_piece(&mut self, limit: usize) -> Vec<ExtentWriteBack> {
        let piece = self.overlay.take_piece(limit);
        self.written_back(piece)
    }

    /// See `Overlay::take_oldest`.
    pub(crate) fn take_oldest(&mut self, max: usize) -> Vec<ExtentWriteBack> {
        let oldest = self.overlay.take_oldest(max);
        self.written_back(oldest)
    }

    /// See `Overlay::take_all`.
    pub(crate) fn take_all(&mut self) -> Vec<ExtentWriteBack> {
        let all = self.overlay.take_all();
        let written_back = self.written_back(all);
        self.partial.clear();
        written_back
    }

    /// See `Overlay::take_node`.
    pub(crate) fn take_node(&mut self, node: i64) -> Vec<ExtentWriteBack> {
        let changes = self.overlay.take_node(node);
        self.written_back(changes)
    }

    /// See `Overlay::transaction_row`.
    pub(crate) fn transaction_row(&self) -> (u64, &[u8]) {
        self.overlay.transaction_row()
    }

    pub(crate) fn transaction_row_stored(&mut self) {
        self.overlay.transaction_row_stored()
    }

    pub(crate) fn next_row(&mut self, row: u64) {
        self.overlay.next_row(row)
    }

    pub(crate) fn take_emptied(&mut self) -> Vec<u64> {
        self.overlay.take_emptied()
    }

    /// Forget everything (see `Overlay::clear`).
    pub(crate) fn clear(&mut self) {
        self.overlay.clear();
        self.partial.clear();
    }

    /// Replay `extents_pending` row number `seq` (rows oldest first); `index_places` after the
    /// last one.
    pub(crate) fn replay(&mut self, seq: u64, row: &[u8]) -> Result<(), StoreError> {
        self.overlay.replay(seq, row)
    }

    /// Rebuild `partial` from the held changes (after replaying rows).
    pub(crate) fn index_places(&mut self) {
        let places = self.overlay.iter().filter_map(|(node, &lo, extent)| {
            let HeldExtent { hi, stored } = extent.as_ref()?;
            match (partial_place(node, lo, *hi, stored), stored) {
                (Some(place), Stored::Segment(p)) => Some((place, (hi - lo, p.blob_end))),
                _ => None,
            }
        });
        self.partial.rebuild(places);
    }

    pub(crate) fn pending(&self) -> bool {
        self.overlay.pending()
    }

    /// Changes held, and about how much memory they take.
    pub(crate) fn held(&self) -> (usize, usize) {
        self.overlay.held()
    }

    pub(crate) fn rows_len(&self) -> usize {
        self.overlay.rows_len()
    }

    pub(crate) fn first_row(&self) -> Option<u64> {
        self.overlay.first_row()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(seg: u32, seg_off: u64, len: u64) -> Stored {
        Stored::Segment(Piece {
            seg,
            seg_off,
            blob: seg_off,
            blob_end: seg_off + len,
        })
    }

    fn ends(held: &HeldExtents, node: i64, hi: u64) -> Vec<(u64, Option<u64>)> {
        held.below(node, hi)
            .map(|(lo, extent)| (lo, extent.map(|e| e.hi)))
            .collect()
    }

    #[test]
    fn values_round_trip_and_damage_is_refused() {
        for stored in [
            seg(3, 4097, 2048),
            Stored::Inline(b"abc".to_vec()),
            Stored::Inline(vec![]),
        ] {
            let mut bytes = Vec::new();
            let extent = HeldExtent { hi: 77, stored };
            extent.write_value(&mut bytes);
            assert_eq!(bytes.len(), extent.value_len());
            let back = HeldExtent::read_value(&bytes).unwrap();
            assert_eq!(format!("{back:?}"), format!("{extent:?}"));
        }
        let mut good = Vec::new();
        HeldExtent {
            hi: 1,
            stored: seg(1, 2, 3),
        }
        .write_value(&mut good);
        for cut in 0..good.len() {
            assert!(
                matches!(
                    HeldExtent::read_value(&good[..cut]),
                    Err(StoreError::Corrupt(_))
                ),
                "{cut}"
            );
        }
    }

    #[test]
    fn lookups_go_down_from_the_end_and_see_removals() {
        let mut held = HeldExtents::default();
        held.put(1, 0, Some((4096, seg(0, 0, 4096))));
        held.put(1, 8192, Some((10240, seg(0, 4096, 2048))));
        held.put(1, 4096, None);
        held.put(2, 0, Some((1, Stored::Inline(vec![7]))));
        assert_eq!(ends(&held, 1, 8192), [(4096, None), (0, Some(4096))]);
        assert_eq!(ends(&held, 1, 8193).len(), 3);
        assert_eq!(ends(&held, 1, 0), []);
        assert!(matches!(held.get(1, 4096), Held::Removed));
        assert!(matches!(held.get(1, 12288), Held::Unknown));
        assert!(held.holds_node(2) && !held.holds_node(3));
    }

    /// `partial` follows every change: replaced, removed, written back, replayed.
    #[test]
    fn the_index_by_place_holds_exactly_the_held_partial_extents() {
        let mut held = HeldExtents::default();
        let places = |held: &mut HeldExtents| {
            held.settle_partial();
            held.partial_below(0, u64::MAX).collect::<Vec<_>>()
        };
        held.put(1, 0, Some((2048, seg(0, 100, 2048))));
        held.put(1, 4096, Some((8192, seg(0, 8192, 4096))));
        assert_eq!(places(&mut held), [(100, 2048, 2148)]);
        // Cut shorter at the same key: same place, new length.
        held.put(1, 0, Some((1024, seg(0, 100, 2048))));
        assert_eq!(places(&mut held), [(100, 1024, 2148)]);
        held.put(2, 0, Some((512, seg(0, 20000, 512))));
        assert_eq!(places(&mut held), [(20000, 512, 20512), (100, 1024, 2148)]);
        assert_eq!(held.partial_below(0, 20000).count(), 1);
        assert_eq!(held.partial_below(1, u64::MAX).count(), 0);
        held.put(2, 0, None);
        assert_eq!(places(&mut held), [(100, 1024, 2148)]);

        let (seq, row) = held.transaction_row();
        let (seq, row) = (seq, row.to_vec());
        held.transaction_row_stored();
        let mut replayed = HeldExtents::default();
        replayed.replay(seq, &row).unwrap();
        replayed.index_places();
        assert_eq!(places(&mut replayed), places(&mut held));

        let node_1 = held.take_node(1);
        assert_eq!(node_1.len(), 2);
        assert_eq!(places(&mut held), []);
        assert!(held.holds_node(2) && !held.holds_node(1));
        let rest = replayed.take_all();
        assert_eq!(rest.len(), 3);
        assert_eq!(places(&mut replayed), []);
    }

    /// The changes held back in `partial`'s log come out as if applied one by one: after
    /// thousands of random puts, cuts at the same key, removals and write-backs (past
    /// `LOG_MAX`, so that some are merged on the way), the index equals the one
    /// rebuilt from the held extents.
    #[test]
    fn the_index_changed_in_batches_equals_the_one_rebuilt() {
        let mut held = HeldExtents::default();
        let mut next = crate::test_rng::draws_below(0x2545_f491_4f6c_dd1d);
        let mut seg_off = 0;
        let mut places = std::collections::HashMap::new();
        for round in 0..(3 * crate::partial_index::LOG_MAX as u64) {
            let node = next(8) as i64;
            let lo = next(64) * 512;
            match next(10) {
                0 => held.put(node, lo, None),
                1 if round % 7 == 0 => {
                    let _ = held.take_piece(next(50) as usize);
                }
                _ => {
                    // Sometimes whole blocks (not indexed), mostly not; sometimes the same
                    // place as the key's extent with another length (a cut at the same
                    // key); else a place of its own, as every append has.
                    let len = [512, 1024, 4096, 2048][next(4) as usize];
                    let place = match places.get(&(node, lo)) {
                        Some(&place) if next(4) == 0 => place,
                        _ => {
                            seg_off += [512, 4096][next(2) as usize];
                            (next(2) as u32, seg_off)
                        }
                    };
                    places.insert((node, lo), place);
                    held.put(node, lo, Some((lo + len, seg(place.0, place.1, len))));
                }
            }
            // Large batches are merged into the sorted places, small ones left beside them:
            // both, besides the merges at `LOG_MAX` changes.
            if round % 10_007 == 0 || (round % 2 == 1 && round % 13 == 0) {
                held.settle_partial();
            }
        }
        let all = |held: &mut HeldExtents| {
            held.settle_partial();
            let mut all: Vec<_> = held.partial_below(0, u64::MAX).collect();
            all.extend(held.partial_below(1, u64::MAX));
            all
        };
        let batched = all(&mut held);
        assert!(batched.len() > 50, "{}", batched.len());
        held.index_places();
        assert_eq!(batched, all(&mut held));
    }
}
