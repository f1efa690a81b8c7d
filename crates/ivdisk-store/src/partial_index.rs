//! Where the held segment extents that do not cover whole blocks are, by place (segment,
//! offset, node): what the held extents have in place of SQLite's index
//! `partial_block_by_place`, read by `Engine::referenced` to widen dead ranges to whole blocks
//! at a durable commit.
//!
//! Why a sorted vector with a log of changes in front, and not a map: every put that replaces
//! a partial extent removes a place written long ago, and each lookup of a durable commit
//! descends to another. In a map both miss the CPU's caches: in the store bench's 4 KiB
//! writes, a `BTreeMap` changed in sorted batches still took 18% of the worker's time in its
//! updates (a third of it the kernel zeroing fresh pages for its nodes and buffers) and
//! 11% in the lookups (docs/BENCHMARKS.md, "The partial-block index as a sorted vector;
//! omap keys inline").
//! Here a change is a push to the log; the log is sorted when the index is read and merged
//! into the vector in one sequential pass once it is large against it, in a vector kept from
//! the merge before; and the lookups of a durable commit come in ascending order, so each
//! starts its search where the one before ended.

use std::cell::Cell;
use std::cmp::Ordering;

/// Where a segment extent that does not cover whole blocks is: segment, offset, node.
pub(crate) type PartialPlace = (u32, u64, i64);

/// A place and the extent there (`len` and `blob_end`), or, in the log, its removal
/// (`len == 0`: a held extent is never empty). 40 bytes: `seq` fills the segment's padding.
#[derive(Debug, Clone, Copy)]
struct Entry {
    seg: u32,
    /// Order of the change in the log (the last change of a place is the one that stands);
    /// not used in `sorted`.
    seq: u32,
    seg_off: u64,
    node: i64,
    len: u64,
    blob_end: u64,
}

impl Entry {
    fn place(&self) -> PartialPlace {
        (self.seg, self.seg_off, self.node)
    }
}

/// Changes waiting in the log past which they are merged even if no one reads the index
/// (between durable commits the log would otherwise only grow): about 10 MB.
pub(crate) const LOG_MAX: usize = 256 << 10;

#[derive(Default)]
pub(crate) struct PartialIndex {
    /// Sorted by place, each place once.
    sorted: Vec<Entry>,
    /// The vector `sorted` was before the last merge, emptied, for the next merge: its pages
    /// stay mapped (vectors of megabytes allocated afresh make the kernel zero their pages).
    spare: Vec<Entry>,
    /// Changes not in `sorted` yet. `log[..settled]` is sorted by place with each place once
    /// (the last change); after it, changes in the order they came.
    log: Vec<Entry>,
    settled: usize,
    next_seq: u32,
    /// Where the last lookup's search ended in `sorted`: the next lookup searches on from
    /// there when its place is above (the usual case: a durable commit's lookups ascend).
    hint: Cell<usize>,
}

impl PartialIndex {
    /// Set (`Some((len, blob_end))`) or remove (`None`) the extent at `place`.
    pub(crate) fn change(&mut self, place: PartialPlace, extent: Option<(u64, u64)>) {
        let (len, blob_end) = extent.unwrap_or((0, 0));
        debug_assert!(extent.is_none() || len > 0, "an empty extent at {place:?}");
        self.log.push(Entry {
            seg: place.0,
            seq: self.next_seq,
            seg_off: place.1,
            node: place.2,
            len,
            blob_end,
        });
        self.next_seq += 1;
        if self.log.len() >= LOG_MAX || self.next_seq == u32::MAX {
            self.merge_all();
        }
    }

    /// Make the changes so far visible to `below`: the log sorted by place, each place once,
    /// and merged into `sorted` when it is at least a sixteenth of it (a merge moves all of
    /// `sorted`; a small log is cheaper searched beside it).
    pub(crate) fn settle(&mut self) {
        if self.settled == self.log.len() {
            return;
        }
        // Unstable, by place and order: no scratch buffer to allocate (a stable sort takes
        // megabytes afresh per batch), and the order of changes of one place is kept anyway.
        self.log
            .sort_unstable_by_key(|entry| (entry.place(), entry.seq));
        let log = &mut self.log;
        let mut kept = 0;
        for i in 0..log.len() {
            if log
                .get(i + 1)
                .is_some_and(|next| next.place() == log[i].place())
            {
                continue;
            }
            log[kept] = log[i];
            kept += 1;
        }
        log.truncate(kept);
        self.settled = kept;
        if self.log.len() * 16 >= self.sorted.len() {
            self.merge();
        }
    }

    /// Settle and merge whatever the log holds.
    fn merge_all(&mut self) {
        self.settle();
        if !self.log.is_empty() {
            self.merge();
        }
    }

    /// Merge the settled log into `sorted`, in one pass into `spare`.
    fn merge(&mut self) {
        debug_assert_eq!(self.settled, self.log.len());
        let mut merged = std::mem::take(&mut self.spare);
        merged.clear();
        merged.reserve(self.sorted.len() + self.log.len());
        let (old, changes) = (&self.sorted, &self.log);
        let (mut i, mut j) = (0, 0);
        while i < old.len() && j < changes.len() {
            match old[i].place().cmp(&changes[j].place()) {
                Ordering::Less => {
                    merged.push(old[i]);
                    i += 1;
                    continue;
                }
                Ordering::Equal => i += 1,
                Ordering::Greater => {}
            }
            if changes[j].len > 0 {
                merged.push(changes[j]);
            }
            j += 1;
        }
        merged.extend_from_slice(&old[i..]);
        merged.extend(changes[j..].iter().filter(|change| change.len > 0));
        self.spare = std::mem::replace(&mut self.sorted, merged);
        self.spare.clear();
        self.log.clear();
        self.settled = 0;
        self.next_seq = 0;
        self.hint.set(0);
    }

    /// The extents of `segment` starting below `to`, from the highest start down: (start,
    /// length, blob end). Only after `settle` (changes since are not seen).
    pub(crate) fn below(
        &self,
        segment: u32,
        to: u64,
    ) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        debug_assert_eq!(self.settled, self.log.len(), "`below` before `settle`");
        let key = (segment, to, i64::MIN);
        let sorted_end = self.lower_bound(key);
        let log_end = self.log.partition_point(|change| change.place() < key);
        let mut sorted = self.sorted[..sorted_end].iter().rev().peekable();
        let mut log = self.log[..log_end].iter().rev().peekable();
        std::iter::from_fn(move || loop {
            // The two sides descend together; a change in the log replaces the entry of its
            // place.
            let next = match (sorted.peek(), log.peek()) {
                (None, None) => return None,
                (Some(_), None) => sorted.next(),
                (None, Some(_)) => log.next(),
                (Some(entry), Some(change)) => match entry.place().cmp(&change.place()) {
                    Ordering::Greater => sorted.next(),
                    Ordering::Less => log.next(),
                    Ordering::Equal => {
                        sorted.next();
                        log.next()
                    }
                },
            }?;
            if next.seg != segment {
                return None;
            }
            if next.len > 0 {
                return Some((next.seg_off, next.len, next.blob_end));
            }
        })
    }

    /// The first index of `sorted` whose place is at or above `key`.
    fn lower_bound(&self, key: PartialPlace) -> usize {
        let sorted = &self.sorted;
        let hint = self.hint.get().min(sorted.len());
        let found = if hint == 0 || sorted[hint - 1].place() < key {
            // Everything below `lo` is below `key`: gallop up from the hint, in steps that
            // double, then search the last step.
            let (mut lo, mut step) = (hint, 1);
            let hi = loop {
                let probe = lo + step - 1;
                if probe >= sorted.len() {
                    break sorted.len();
                }
                if sorted[probe].place() >= key {
                    break probe;
                }
                lo = probe + 1;
                step *= 2;
            };
            lo + sorted[lo..hi].partition_point(|entry| entry.place() < key)
        } else {
            sorted[..hint].partition_point(|entry| entry.place() < key)
        };
        self.hint.set(found);
        found
    }

    /// Forget every place.
    pub(crate) fn clear(&mut self) {
        self.sorted.clear();
        self.log.clear();
        self.settled = 0;
        self.next_seq = 0;
        self.hint.set(0);
    }

    /// Replace the index by `places` (in any order, each place once).
    pub(crate) fn rebuild(&mut self, places: impl Iterator<Item = (PartialPlace, (u64, u64))>) {
        self.clear();
        for (place, extent) in places {
            self.change(place, Some(extent));
        }
        self.merge_all();
    }

    /// Merge the log and give back the memory not in use (the store is idle: see
    /// `Engine::release_idle_memory`).
    pub(crate) fn release_idle_memory(&mut self) {
        self.merge_all();
        self.log = Vec::new();
        self.spare = Vec::new();
        self.sorted.shrink_to_fit();
    }

    /// Bytes reserved besides the places themselves (the log and the spare vector).
    #[cfg(test)]
    pub(crate) fn reserve_capacity(&self) -> usize {
        (self.log.capacity() + self.spare.capacity()) * std::mem::size_of::<Entry>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn model_below(
        model: &BTreeMap<PartialPlace, (u64, u64)>,
        segment: u32,
        to: u64,
    ) -> Vec<(u64, u64, u64)> {
        model
            .range((segment, 0, i64::MIN)..(segment, to, i64::MIN))
            .rev()
            .map(|(&(_, start, _), &(len, blob_end))| (start, len, blob_end))
            .collect()
    }

    #[test]
    fn an_entry_takes_40_bytes() {
        assert_eq!(std::mem::size_of::<Entry>(), 40);
    }

    /// Random sets, replacements and removals (the same place changed several times between
    /// reads among them), read in ascending runs and at random between settles that merge and
    /// settles that leave the log beside the vector: every lookup equals a map's that took
    /// each change as it came.
    #[test]
    fn lookups_equal_a_map_changed_one_by_one() {
        let mut index = PartialIndex::default();
        let mut model = BTreeMap::new();
        let mut next = crate::test_rng::draws_below(0x9e37_79b9_7f4a_7c15);
        let (mut merges_seen, mut unmerged_reads) = (0, 0);
        for round in 0..800 {
            // Bursts of changes of every size, so that some settles merge and some do not.
            let burst = [1, 3, 40, 2000, 20_000][next(5) as usize];
            for _ in 0..burst {
                let place = (next(3) as u32, next(20_000) * 512, next(4) as i64);
                if next(3) == 0 {
                    index.change(place, None);
                    model.remove(&place);
                } else {
                    let extent = (1 + next(4096), next(1 << 30));
                    index.change(place, Some(extent));
                    model.insert(place, extent);
                }
            }
            let before = index.sorted.len();
            index.settle();
            if index.log.is_empty() {
                merges_seen += 1;
            } else {
                unmerged_reads += 1;
                assert_eq!(index.sorted.len(), before);
            }
            let segment = next(3) as u32;
            let mut to = next(20_000) * 512 + next(2);
            for _ in 0..1 + next(50) {
                let limit = 1 + next(4) as usize;
                let got: Vec<_> = index.below(segment, to).take(limit).collect();
                let want: Vec<_> = model_below(&model, segment, to)
                    .into_iter()
                    .take(limit)
                    .collect();
                assert_eq!(got, want, "round {round}, segment {segment}, below {to}");
                // Mostly ascending, as a durable commit's lookups are; now and then down.
                to = if next(8) == 0 {
                    next(20_000) * 512
                } else {
                    to + next(3000)
                };
            }
        }
        assert!(
            merges_seen > 100 && unmerged_reads > 100,
            "{merges_seen} {unmerged_reads}"
        );
        let all: Vec<_> = (0..3)
            .flat_map(|s| index.below(s, u64::MAX).collect::<Vec<_>>())
            .collect();
        let want: Vec<_> = (0..3)
            .flat_map(|s| model_below(&model, s, u64::MAX))
            .collect();
        assert_eq!(all, want);
    }

    #[test]
    fn a_place_removed_and_set_again_in_one_batch_stands() {
        let mut index = PartialIndex::default();
        index.change((0, 512, 1), Some((100, 612)));
        index.settle();
        index.change((0, 512, 1), None);
        index.change((0, 512, 1), Some((50, 562)));
        index.change((0, 1024, 1), Some((10, 1034)));
        index.change((0, 1024, 1), None);
        index.settle();
        assert_eq!(
            index.below(0, u64::MAX).collect::<Vec<_>>(),
            [(512, 50, 562)]
        );
    }

    #[test]
    fn an_idle_index_gives_back_its_log_and_spare() {
        let mut index = PartialIndex::default();
        for i in 0..100_000u64 {
            index.change((0, i * 512, 0), Some((100, i * 512 + 100)));
        }
        index.settle();
        for i in 0..1000u64 {
            index.change((0, i * 512, 0), None);
        }
        index.settle();
        assert!(index.reserve_capacity() > 0);
        index.release_idle_memory();
        assert_eq!(index.reserve_capacity(), 0);
        assert_eq!(index.below(0, u64::MAX).count(), 99_000);
    }
}
