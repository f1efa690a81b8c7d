//! Which data objects may exist, kept in memory so that NBD block status of a sparse image
//! costs a stat per existing object, not one per object of the range: `qemu-img convert` and
//! `nbdcopy` of an empty 1 TiB image served from RADOS asked for 262144 stats (25 s and 14 s).
//! librbd's object map serves the same purpose.
//!
//! Kept where nobody else changes the objects: by a writer (holding the writer lock, it
//! creates every object that appears) and at a snapshot (which does not change). The map is
//! a superset of the existing objects: a bit is set before a write that may create its
//! object is submitted, the objects listed at first use are added, and no bit is cleared
//! while the image is open (a discard's removal racing a write of the same object would
//! otherwise clear the bit of an object that exists again). A writer stats the objects whose
//! bit is set, so a discarded object is a hole again at once; a snapshot's listing is exact.

use std::sync::atomic::{AtomicU64, Ordering};

/// Images of more objects keep no map (16 MiB of bits): block status stats every object as
/// before, and whole-image requests list the objects (`allocation.rs`). Images of at most
/// `LIST_ABOVE_OBJECTS` keep none either (`Image::from_spec`).
const MAX_MAPPED_OBJECTS: u64 = 1 << 27;

/// Whether the map has been filled from a listing of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listing {
    NotYet,
    Done,
    /// The store cannot list (a LUKS file): the map is not used.
    Unsupported,
}

#[derive(Debug)]
pub(crate) struct ObjectMap {
    /// Bit `n % 64` of word `n / 64`: object `n` may exist.
    bits: Box<[AtomicU64]>,
    /// Held across the first listing, so concurrent requests wait for it rather than list too.
    pub(crate) listing: tokio::sync::Mutex<Listing>,
    /// Whether the map alone is exact (a snapshot's listing), or a superset whose objects are
    /// stat'ed (a writer's).
    pub(crate) exact: bool,
}

impl ObjectMap {
    /// A map for objects `0..objects`, or `None` if that is too many to keep.
    pub(crate) fn new(objects: u64, exact: bool) -> Option<ObjectMap> {
        (objects <= MAX_MAPPED_OBJECTS).then(|| ObjectMap {
            bits: (0..objects.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            listing: tokio::sync::Mutex::new(Listing::NotYet),
            exact,
        })
    }

    /// How many objects the map covers; those past it are unknown.
    pub(crate) fn capacity(&self) -> u64 {
        self.bits.len() as u64 * 64
    }

    /// Object `n` may exist from now on (call before submitting what may create it). One load
    /// of a line every core keeps shared once the bit is set: a write's whole cost.
    pub(crate) fn note(&self, n: u64) {
        let Some(word) = self.bits.get((n / 64) as usize) else {
            return;
        };
        let bit = 1u64 << (n % 64);
        if word.load(Ordering::Acquire) & bit == 0 {
            word.fetch_or(bit, Ordering::AcqRel);
        }
    }

    /// The numbers in `first..=last` (all below [`ObjectMap::capacity`]) whose bit is set, in
    /// order.
    pub(crate) fn marked(&self, first: u64, last: u64) -> impl Iterator<Item = u64> + '_ {
        debug_assert!(last < self.capacity());
        (first / 64..=last / 64).flat_map(move |w| {
            let mut word = self.bits[w as usize].load(Ordering::Acquire);
            std::iter::from_fn(move || {
                if word == 0 {
                    return None;
                }
                let bit = word.trailing_zeros() as u64;
                word &= word - 1;
                Some(w * 64 + bit)
            })
            .filter(move |&n| n >= first && n <= last)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marked_objects_come_back_in_order_within_the_range() {
        let map = ObjectMap::new(1000, false).unwrap();
        assert_eq!(map.capacity(), 1024);
        for n in [999, 0, 63, 64, 130, 500] {
            map.note(n);
        }
        map.note(64);
        map.note(5000); // past the map: ignored
        let all: Vec<u64> = map.marked(0, 1023).collect();
        assert_eq!(all, [0, 63, 64, 130, 500, 999]);
        assert_eq!(map.marked(63, 130).collect::<Vec<_>>(), [63, 64, 130]);
        assert_eq!(map.marked(1, 62).count(), 0);
        assert_eq!(map.marked(999, 999).collect::<Vec<_>>(), [999]);
        assert!(ObjectMap::new(MAX_MAPPED_OBJECTS + 1, false).is_none());
    }
}
