//! Dead segment space kept for reuse: whole 4 KiB blocks whose data died in a durable
//! commit, handed out again to appends of whole blocks (best fit), so that a store under
//! overwrites rewrites file pages it already has instead of growing its segments into fresh
//! pages and punching the old ones (docs/ARCHITECTURE.md, "Local backend", and
//! docs/BENCHMARKS.md, "dead space reused": 0.6-1.0 GB/s appending and punching against
//! 2.6-2.8 GB/s rewriting on this machine kind).
//!
//! Correctness rests on the callers: a range goes in only once no committed extent
//! references it and the commit that made it dead is durable, and it goes in once. This
//! structure keeps what it holds disjoint whatever it is given: a range overlapping one it
//! holds is merged, never held twice, so it never hands the same block to two writes.

use std::collections::{BTreeMap, BTreeSet};

/// Free ranges by place and by size, always the same set.
#[derive(Debug, Default)]
pub(crate) struct FreeSpace {
    /// (segment, start) -> end, disjoint and never touching (neighbours are merged).
    by_place: BTreeMap<(u32, u64), u64>,
    /// (length, segment, start), for best fit.
    by_size: BTreeSet<(u64, u32, u64)>,
    total: u64,
}

impl FreeSpace {
    /// Bytes held.
    pub(crate) fn total(&self) -> u64 {
        self.total
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Add `[from, to)` of `segment`, merged with the ranges it touches or overlaps.
    pub(crate) fn insert(&mut self, segment: u32, mut from: u64, mut to: u64) {
        if from >= to {
            return;
        }
        // Ranges starting at or before `to` and ending at or after `from` merge with it: the
        // last one starting at or before `from`, and every one starting inside (from, to].
        let before = self
            .by_place
            .range(..=(segment, from))
            .next_back()
            .filter(|(&(s, _), &end)| s == segment && end >= from)
            .map(|(&(_, start), &end)| (start, end));
        let inside: Vec<(u64, u64)> = self
            .by_place
            .range((segment, from)..=(segment, to))
            .map(|(&(_, start), &end)| (start, end))
            .collect();
        for (start, end) in before.into_iter().chain(inside) {
            if self.remove(segment, start, end) {
                from = from.min(start);
                to = to.max(end);
            }
        }
        self.by_place.insert((segment, from), to);
        self.by_size.insert((to - from, segment, from));
        self.total += to - from;
    }

    /// Take `len` bytes from the smallest range that holds them (its start; the rest stays).
    pub(crate) fn take(&mut self, len: u64) -> Option<(u32, u64)> {
        if len == 0 {
            return None;
        }
        let &(size, segment, start) = self.by_size.range((len, 0, 0)..).next()?;
        self.remove(segment, start, start + size);
        if size > len {
            self.by_place.insert((segment, start + len), start + size);
            self.by_size.insert((size - len, segment, start + len));
            self.total += size - len;
        }
        Some((segment, start))
    }

    /// Take up to `len` bytes: `len` of them where a range holds them (best fit, as
    /// [`FreeSpace::take`]), otherwise the whole of the largest range if it has at least
    /// `min`. Returns (segment, start, bytes taken).
    pub(crate) fn take_up_to(&mut self, len: u64, min: u64) -> Option<(u32, u64, u64)> {
        if let Some((segment, start)) = self.take(len) {
            return Some((segment, start, len));
        }
        let &(size, segment, start) = self.by_size.last()?;
        if size < min.max(1) {
            return None;
        }
        self.remove(segment, start, start + size);
        Some((segment, start, size))
    }

    /// The first `max` ranges held, by place, no longer held.
    pub(crate) fn drain_first(&mut self, max: usize) -> Vec<(u32, u64, u64)> {
        if max >= self.by_place.len() {
            self.by_size.clear();
            self.total = 0;
            return std::mem::take(&mut self.by_place)
                .into_iter()
                .map(|((segment, start), end)| (segment, start, end))
                .collect();
        }
        let first: Vec<(u32, u64, u64)> = self
            .by_place
            .iter()
            .take(max)
            .map(|(&(segment, start), &end)| (segment, start, end))
            .collect();
        for &(segment, start, end) in &first {
            self.remove(segment, start, end);
        }
        first
    }

    /// Remove the held range `[start, end)`; false if it is not held (already merged).
    fn remove(&mut self, segment: u32, start: u64, end: u64) -> bool {
        if self.by_place.remove(&(segment, start)).is_none() {
            return false;
        }
        self.by_size.remove(&(end - start, segment, start));
        self.total -= end - start;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The held ranges, checked against each other and the size index.
    fn ranges(free: &FreeSpace) -> Vec<(u32, u64, u64)> {
        let held: Vec<(u32, u64, u64)> = free
            .by_place
            .iter()
            .map(|(&(s, a), &b)| (s, a, b))
            .collect();
        for pair in held.windows(2) {
            let ((s1, _, e1), (s2, a2, _)) = (pair[0], pair[1]);
            assert!(s1 < s2 || e1 < a2, "touching or overlapping: {pair:?}");
        }
        let sizes: BTreeSet<(u64, u32, u64)> =
            held.iter().map(|&(s, a, b)| (b - a, s, a)).collect();
        assert_eq!(sizes, free.by_size);
        assert_eq!(free.total, held.iter().map(|&(_, a, b)| b - a).sum::<u64>());
        held
    }

    #[test]
    fn neighbours_and_overlaps_merge() {
        let mut free = FreeSpace::default();
        free.insert(1, 8192, 12288);
        free.insert(1, 0, 4096);
        free.insert(2, 4096, 8192);
        assert_eq!(
            ranges(&free),
            [(1, 0, 4096), (1, 8192, 12288), (2, 4096, 8192)]
        );
        free.insert(1, 4096, 8192);
        assert_eq!(ranges(&free), [(1, 0, 12288), (2, 4096, 8192)]);
        // Held already, or partly: merged, never counted twice.
        free.insert(1, 4096, 16384);
        free.insert(2, 0, 20480);
        assert_eq!(ranges(&free), [(1, 0, 16384), (2, 0, 20480)]);
        assert_eq!(free.total(), 16384 + 20480);
        free.insert(1, 100, 100);
        assert_eq!(free.total(), 16384 + 20480);
    }

    #[test]
    fn take_is_best_fit_and_keeps_the_rest() {
        let mut free = FreeSpace::default();
        free.insert(1, 0, 1 << 20);
        free.insert(1, 2 << 20, (2 << 20) + 8192);
        free.insert(3, 0, 4096);
        assert_eq!(free.take(4096), Some((3, 0)));
        assert_eq!(free.take(4096), Some((1, 2 << 20)));
        assert_eq!(free.take(8192), Some((1, 0)));
        assert_eq!(
            ranges(&free),
            [(1, 8192, 1 << 20), (1, (2 << 20) + 4096, (2 << 20) + 8192)]
        );
        assert_eq!(free.take(2 << 20), None);
        assert_eq!(free.take(0), None);
        assert_eq!(
            free.take_up_to(2 << 20, 8192),
            Some((1, 8192, (1 << 20) - 8192))
        );
        assert_eq!(
            free.take_up_to(2 << 20, 8192),
            None,
            "4096 bytes left, below the minimum"
        );
        assert_eq!(
            free.take_up_to(4096, 8192),
            Some((1, (2 << 20) + 4096, 4096))
        );
        free.insert(1, 0, 8192);
        free.insert(1, 16384, 20480);
        free.insert(2, 0, 4096);
        // By place, a part at a time; what is left stays held and can be taken.
        assert_eq!(free.drain_first(1), [(1, 0, 8192)]);
        assert_eq!(free.total(), 8192);
        assert_eq!(ranges(&free), [(1, 16384, 20480), (2, 0, 4096)]);
        let rest = free.drain_first(usize::MAX);
        assert_eq!(rest, [(1, 16384, 20480), (2, 0, 4096)]);
        assert!(free.is_empty() && free.by_size.is_empty());
        assert_eq!(free.drain_first(8), []);
    }

    /// Random inserts of disjoint dead ranges and takes: no block is ever handed out twice or
    /// handed out while held, and the bytes add up.
    #[test]
    fn random_use_never_hands_out_a_block_twice() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        const BLOCKS: u64 = 512;
        // Per block of two segments: true = in use (written and live), false = free (held).
        let mut live = vec![[true; BLOCKS as usize]; 2];
        let mut free = FreeSpace::default();
        for _ in 0..20_000 {
            let segment = (next() % 2) as u32;
            if next() % 2 == 0 {
                // A live range dies.
                let start = next() % BLOCKS;
                let len = 1 + next() % 8;
                let run: Vec<u64> = (start..(start + len).min(BLOCKS))
                    .take_while(|&b| live[segment as usize][b as usize])
                    .collect();
                if let (Some(&a), Some(&b)) = (run.first(), run.last()) {
                    for &blk in &run {
                        live[segment as usize][blk as usize] = false;
                    }
                    free.insert(segment + 1, a * 4096, (b + 1) * 4096);
                }
            } else {
                let want = (1 + next() % 16) * 4096;
                let taken = match next() % 2 {
                    0 => free.take(want).map(|(s, at)| (s, at, want)),
                    _ => free.take_up_to(want, 8192),
                };
                if let Some((s, at, len)) = taken {
                    assert!(len <= want && len % 4096 == 0);
                    for blk in at / 4096..(at + len) / 4096 {
                        let cell = &mut live[s as usize - 1][blk as usize];
                        assert!(!*cell, "block {blk} of segment {s} handed out while in use");
                        *cell = true;
                    }
                }
            }
            let held: u64 = live.iter().flatten().filter(|&&l| !l).count() as u64 * 4096;
            assert_eq!(free.total(), held);
        }
        ranges(&free);
    }
}
