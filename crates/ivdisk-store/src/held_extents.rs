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

use std::collections::BTreeMap;

use crate::engine::{Piece, Stored, BLOCK, INLINE_SEG};
use crate::error::StoreError;
use crate::omap_overlay::{Lookup, OmapOverlay, WriteBack};

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

#[derive(Default)]
pub(crate) struct HeldExtents {
    overlay: OmapOverlay,
    /// Held segment extents that do not cover whole blocks: (segment, offset, node) ->
    /// (length, blob end).
    partial: BTreeMap<(u32, u64, i64), (u64, u64)>,
}

/// Byte length of an encoded segment extent: `hi`, `seg`, `seg_off`, `blob`, `blob_end`.
const SEGMENT_VALUE: usize = 40;

fn key(lo: u64) -> [u8; 8] {
    lo.to_be_bytes()
}

/// `hi u64`, `seg i64` (little-endian), then for a segment extent `seg_off`, `blob`,
/// `blob_end` (u64), for an inline one its bytes.
fn encode(hi: u64, stored: &Stored) -> Vec<u8> {
    match stored {
        Stored::Segment(piece) => {
            let mut out = Vec::with_capacity(SEGMENT_VALUE);
            out.extend_from_slice(&hi.to_le_bytes());
            out.extend_from_slice(&i64::from(piece.seg).to_le_bytes());
            out.extend_from_slice(&piece.seg_off.to_le_bytes());
            out.extend_from_slice(&piece.blob.to_le_bytes());
            out.extend_from_slice(&piece.blob_end.to_le_bytes());
            out
        }
        Stored::Inline(data) => {
            let mut out = Vec::with_capacity(16 + data.len());
            out.extend_from_slice(&hi.to_le_bytes());
            out.extend_from_slice(&INLINE_SEG.to_le_bytes());
            out.extend_from_slice(data);
            out
        }
    }
}

fn decode(value: &[u8]) -> Result<(u64, Stored), StoreError> {
    let damaged = || {
        StoreError::Corrupt(
            "a held extent change (table extents_pending) is damaged; restore the store from \
             a backup"
                .to_owned(),
        )
    };
    let word = |at: usize| -> Result<u64, StoreError> {
        value
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or_else(damaged)
    };
    let hi = word(0)?;
    let seg = word(8)? as i64;
    if seg == INLINE_SEG {
        return Ok((hi, Stored::Inline(value[16..].to_vec())));
    }
    if value.len() != SEGMENT_VALUE {
        return Err(damaged());
    }
    Ok((
        hi,
        Stored::Segment(Piece {
            seg: u32::try_from(seg).map_err(|_| damaged())?,
            seg_off: word(16)?,
            blob: word(24)?,
            blob_end: word(32)?,
        }),
    ))
}

/// Where a segment extent `[lo, hi)` that does not cover whole blocks is, for `partial`.
fn partial_place(node: i64, lo: u64, hi: u64, stored: &Stored) -> Option<(u32, u64, i64)> {
    match stored {
        Stored::Segment(p)
            if !p.seg_off.is_multiple_of(BLOCK) || !(hi - lo).is_multiple_of(BLOCK) =>
        {
            Some((p.seg, p.seg_off, node))
        }
        _ => None,
    }
}

fn lookup(found: Lookup<'_>) -> Result<Held, StoreError> {
    Ok(match found {
        Lookup::Value(v) => {
            let (hi, stored) = decode(v)?;
            Held::Extent(hi, stored)
        }
        Lookup::Removed => Held::Removed,
        Lookup::Unknown => Held::Unknown,
    })
}

impl HeldExtents {
    /// Set the extent at `lo` of `node` to `[lo, hi)` stored in `stored`, or remove it (`None`),
    /// in the open transaction.
    pub(crate) fn put(
        &mut self,
        node: i64,
        lo: u64,
        extent: Option<(u64, &Stored)>,
    ) -> Result<(), StoreError> {
        if let Held::Extent(old_hi, old) = self.get(node, lo)? {
            if let Some(place) = partial_place(node, lo, old_hi, &old) {
                self.partial.remove(&place);
            }
        }
        let value = extent.map(|(hi, stored)| {
            if let (Some(place), Stored::Segment(p)) = (partial_place(node, lo, hi, stored), stored)
            {
                self.partial.insert(place, (hi - lo, p.blob_end));
            }
            encode(hi, stored)
        });
        self.overlay.put(node, key(lo).to_vec(), value);
        Ok(())
    }

    pub(crate) fn get(&self, node: i64, lo: u64) -> Result<Held, StoreError> {
        lookup(self.overlay.get(node, &key(lo)))
    }

    /// The held changes of `node` starting below `hi`, from the highest start down.
    pub(crate) fn below(
        &self,
        node: i64,
        hi: u64,
    ) -> impl Iterator<Item = Result<(u64, Held), StoreError>> + '_ {
        self.overlay.below(node, &key(hi)).map(|(k, value)| {
            let lo = u64::from_be_bytes(k.try_into().map_err(|_| {
                StoreError::Corrupt("a held extent change has a damaged key".into())
            })?);
            let held = match value {
                Some(v) => lookup(Lookup::Value(v))?,
                None => Held::Removed,
            };
            Ok((lo, held))
        })
    }

    /// Whether some change of `node` is held.
    pub(crate) fn holds_node(&self, node: i64) -> bool {
        self.overlay.holds_node(node)
    }

    /// Held segment extents of `segment` that do not cover whole blocks and start below
    /// `to`, from the highest start down: (start, length, blob end).
    pub(crate) fn partial_below(
        &self,
        segment: u32,
        to: u64,
    ) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.partial
            .range((segment, 0, i64::MIN)..(segment, to, i64::MIN))
            .rev()
            .map(|(&(_, start, _), &(len, blob_end))| (start, len, blob_end))
    }

    fn written_back(
        &mut self,
        changes: Vec<WriteBack>,
    ) -> Result<Vec<ExtentWriteBack>, StoreError> {
        changes
            .into_iter()
            .map(|((node, k), value)| {
                let lo = u64::from_be_bytes(k.as_slice().try_into().map_err(|_| {
                    StoreError::Corrupt("a held extent change has a damaged key".into())
                })?);
                let extent = value.map(|v| decode(&v)).transpose()?;
                if let Some((hi, stored)) = &extent {
                    if let Some(place) = partial_place(node, lo, *hi, stored) {
                        self.partial.remove(&place);
                    }
                }
                Ok((node, lo, extent))
            })
            .collect()
    }

    /// See `OmapOverlay::take_piece`.
    pub(crate) fn take_piece(&mut self, limit: usize) -> Result<Vec<ExtentWriteBack>, StoreError> {
        let piece = self.overlay.take_piece(limit);
        self.written_back(piece)
    }

    /// See `OmapOverlay::take_oldest`.
    pub(crate) fn take_oldest(&mut self, max: usize) -> Result<Vec<ExtentWriteBack>, StoreError> {
        let oldest = self.overlay.take_oldest(max);
        self.written_back(oldest)
    }

    /// See `OmapOverlay::take_all`.
    pub(crate) fn take_all(&mut self) -> Result<Vec<ExtentWriteBack>, StoreError> {
        let all = self.overlay.take_all();
        self.partial.clear();
        self.written_back(all)
    }

    /// See `OmapOverlay::take_node`.
    pub(crate) fn take_node(&mut self, node: i64) -> Result<Vec<ExtentWriteBack>, StoreError> {
        let changes = self.overlay.take_node(node);
        self.written_back(changes)
    }

    /// See `OmapOverlay::transaction_row`.
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

    /// Forget everything (see `OmapOverlay::clear`).
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
    pub(crate) fn index_places(&mut self) -> Result<(), StoreError> {
        let mut partial = BTreeMap::new();
        for (node, k, value) in self.overlay.iter() {
            let Some(value) = value else { continue };
            let lo = u64::from_be_bytes(k.try_into().map_err(|_| {
                StoreError::Corrupt("a held extent change has a damaged key".into())
            })?);
            let (hi, stored) = decode(value)?;
            if let (Some(place), Stored::Segment(p)) =
                (partial_place(node, lo, hi, &stored), &stored)
            {
                partial.insert(place, (hi - lo, p.blob_end));
            }
        }
        self.partial = partial;
        Ok(())
    }

    pub(crate) fn pending(&self) -> bool {
        self.overlay.pending()
    }

    /// Changes held, and about how much memory they take.
    pub(crate) fn held(&self) -> (usize, usize) {
        self.overlay.held()
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
            .map(|r| match r.unwrap() {
                (lo, Held::Extent(hi, _)) => (lo, Some(hi)),
                (lo, _) => (lo, None),
            })
            .collect()
    }

    #[test]
    fn values_round_trip_and_damage_is_refused() {
        for stored in [
            seg(3, 4097, 2048),
            Stored::Inline(b"abc".to_vec()),
            Stored::Inline(vec![]),
        ] {
            let (hi, back) = decode(&encode(77, &stored)).unwrap();
            assert_eq!(hi, 77);
            assert_eq!(format!("{back:?}"), format!("{stored:?}"));
        }
        let good = encode(1, &seg(1, 2, 3));
        for cut in 0..good.len() {
            assert!(
                matches!(decode(&good[..cut]), Err(StoreError::Corrupt(_))),
                "{cut}"
            );
        }
    }

    #[test]
    fn lookups_go_down_from_the_end_and_see_removals() {
        let mut held = HeldExtents::default();
        held.put(1, 0, Some((4096, &seg(0, 0, 4096)))).unwrap();
        held.put(1, 8192, Some((10240, &seg(0, 4096, 2048))))
            .unwrap();
        held.put(1, 4096, None).unwrap();
        held.put(2, 0, Some((1, &Stored::Inline(vec![7])))).unwrap();
        assert_eq!(ends(&held, 1, 8192), [(4096, None), (0, Some(4096))]);
        assert_eq!(ends(&held, 1, 8193).len(), 3);
        assert_eq!(ends(&held, 1, 0), []);
        assert!(matches!(held.get(1, 4096).unwrap(), Held::Removed));
        assert!(matches!(held.get(1, 12288).unwrap(), Held::Unknown));
        assert!(held.holds_node(2) && !held.holds_node(3));
    }

    /// `partial` follows every change: replaced, removed, written back, replayed.
    #[test]
    fn the_index_by_place_holds_exactly_the_held_partial_extents() {
        let mut held = HeldExtents::default();
        let places = |held: &HeldExtents| held.partial_below(0, u64::MAX).collect::<Vec<_>>();
        held.put(1, 0, Some((2048, &seg(0, 100, 2048)))).unwrap();
        held.put(1, 4096, Some((8192, &seg(0, 8192, 4096))))
            .unwrap();
        assert_eq!(places(&held), [(100, 2048, 2148)]);
        // Cut shorter at the same key: same place, new length.
        held.put(1, 0, Some((1024, &seg(0, 100, 2048)))).unwrap();
        assert_eq!(places(&held), [(100, 1024, 2148)]);
        held.put(2, 0, Some((512, &seg(0, 20000, 512)))).unwrap();
        assert_eq!(places(&held), [(20000, 512, 20512), (100, 1024, 2148)]);
        assert_eq!(held.partial_below(0, 20000).count(), 1);
        assert_eq!(held.partial_below(1, u64::MAX).count(), 0);
        held.put(2, 0, None).unwrap();
        assert_eq!(places(&held), [(100, 1024, 2148)]);

        let (seq, row) = held.transaction_row();
        let (seq, row) = (seq, row.to_vec());
        held.transaction_row_stored();
        let mut replayed = HeldExtents::default();
        replayed.replay(seq, &row).unwrap();
        replayed.index_places().unwrap();
        assert_eq!(places(&replayed), places(&held));

        let node_1 = held.take_node(1).unwrap();
        assert_eq!(node_1.len(), 2);
        assert_eq!(places(&held), []);
        assert!(held.holds_node(2) && !held.holds_node(1));
        let rest = replayed.take_all().unwrap();
        assert_eq!(rest.len(), 3);
        assert_eq!(places(&replayed), []);
    }
}
