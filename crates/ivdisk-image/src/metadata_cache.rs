//! The metadata of an `object-end` image, held in memory while this process is the image's
//! one writer.
//!
//! Why: on RADOS the metadata of a small IO is a second extent in its operation. A read pays a
//! second extent read, and a write of 32 bytes inside a 4 KiB block costs BlueStore a
//! read-modify-write and a second deferred write (docs/BENCHMARKS.md, "RADOS write
//! operations": 0.51-0.62x the ops/s of the data alone at 4 KiB; whole 4 KiB blocks: 0.90x).
//! With the metadata known, a read fetches the data extent only, and a write sends the whole
//! 4 KiB metadata block(s) it touches, rebuilt from memory.
//!
//! Why it is right: the writer lock keeps every other writer out, so only our own operations
//! change the objects, and the store applies the operations on one object in the order they
//! were submitted (an operation counts as submitted during its future's first poll). Every
//! operation on a cached object is therefore built and submitted under the lock of its
//! object's shard ([`MetadataCache::submit`]): a write's changes enter the cache in exactly
//! the order the store applies them, and a read takes metadata matching the data it will get
//! (every write before it in the cache and in the store, none after). A block not in memory is
//! loaded by a read of the whole block in the same order; the writes submitted while that read
//! is in flight are kept as patches and applied to what it returns.
//!
//! A write that fails, or whose future is dropped once built ([`ForgetIfDropped`]: it may
//! reach the store or not), leaves its object's blocks forgotten (reloaded on next use); an
//! operation dropped while it loads blocks gives the loads up ([`InFlightLoads`]). Writes to
//! the same block submitted while it was in flight already carried its new metadata in their
//! whole-block writes, so the failed write's sectors may then read as failing authentication
//! until rewritten: what a failed write leaves in its range is undefined in any case.
//!
//! The image layer uses the cache only while the writer lock is held (not after it is lost or
//! released) and only for the head (not for snapshots, which are read-only opens).

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crossbeam_utils::CachePadded;
use ivdisk_store::WriteStep;
use smallvec::SmallVec;

/// Bytes of an object's metadata region per cache block, for stores that state no write
/// unit; the others' blocks are their unit (`ObjectStore::write_unit`: BlueStore's allocation
/// and checksum unit, 4 KiB; the local backend's inline pieces, 512 bytes).
pub(crate) const BLOCK: usize = 4096;

/// Independent locks, so operations on different objects rarely wait for each other's
/// submission (a 4 MiB write's submission copies its data). 64: with 16, two threads writing
/// 64 KiB at random over 64 objects waited on each other's shard often enough that the
/// futex calls showed in the profile.
const SHARDS: usize = 64;

/// The least memory a cache with blocks of `block` bytes works with (one block per shard).
pub(crate) fn minimum_bytes(block: usize) -> usize {
    block * SHARDS
}

/// The default memory bound: 64 MiB of metadata, 8 GiB of image data with 4 KiB sectors and
/// 32 bytes of metadata each.
pub const DEFAULT_METADATA_CACHE_BYTES: usize = 64 << 20;

pub(crate) struct MetadataCache {
    /// Where the metadata region starts in an object, and its length.
    region_offset: u64,
    region_len: usize,
    /// Bytes per block.
    block: usize,
    /// Rewrite metadata writes as whole blocks, one step each (the store prefers whole,
    /// aligned blocks of `block` bytes).
    whole_blocks: bool,
    /// Known blocks per shard before one is evicted.
    shard_capacity: usize,
    /// Each on cache lines of its own: two writes on different objects take different
    /// shards, and neighbours sharing a line made each take a miss when the other core had
    /// just taken its neighbour.
    shards: Vec<CachePadded<Mutex<Shard>>>,
    next_load: AtomicU64,
}

#[derive(Default)]
pub(crate) struct Shard {
    blocks: HashMap<(u64, u32), Block, BuildHasherDefault<KeyHasher>>,
    known: usize,
    /// The store's count of lost transactions (`ObjectStore::lost_transactions`) when this
    /// shard's blocks were last known to hold nothing that a loss took back: operations
    /// built from them carry it, and the store refuses them if it changed since.
    pub(crate) lost_seen: Option<u64>,
}

/// Hashes the cache's keys (object number, block number) with a multiply per word, as
/// rustc's `FxHasher` does. Why: SipHash, the map's default, showed in the profile of 64 KiB
/// writes (two or three lookups per IO). What it gives up, resistance to chosen keys, buys
/// nothing here: the keys come from the offsets of the image's own IO, and a client that
/// aimed its IO at colliding objects would only slow its own disk.
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl KeyHasher {
    const K: u64 = 0xf135_7aea_2e62_a9c5;

    fn add(&mut self, word: u64) {
        self.0 = (self.0 ^ word).wrapping_mul(Self::K);
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        // The product's high bits are its best mixed; hashbrown takes its bucket from the low
        // bits and its tag from the top seven.
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
}

enum Block {
    /// The block's bytes as the store holds them after every operation submitted so far.
    Known(Box<[u8]>),
    /// A read of the block is in flight (load `id`); `patches` are the changes of operations
    /// submitted after it, in order: (offset in the block, bytes).
    Loading {
        id: u64,
        patches: Vec<(usize, Vec<u8>)>,
    },
}

/// How a read gets the metadata of its sectors.
pub(crate) enum ReadPlan {
    /// From memory: the read fetches the data only.
    Cached(Vec<u8>),
    /// From the store: the read also fetches this range of the metadata region (whole
    /// blocks), and the blocks it loads are filled from it.
    Fetch { range: Range<usize>, loads: Loads },
}

/// Blocks a read is loading: (block, load id).
pub(crate) type Loads = Vec<(u32, u64)>;

/// One change of a write to the metadata region: (offset in the region, new bytes).
type Change<'a> = (usize, std::borrow::Cow<'a, [u8]>);

/// Loads an operation started, abandoned ([`MetadataCache::abandon_loads`]) if it is dropped
/// before it finished or abandoned them itself: a caller that gives up on a read or a write
/// after its operation was submitted (a timeout) would otherwise leave its blocks loading for
/// ever, so that every later read of them fetched them again and every write added a patch
/// to them. Dropped after they were finished or abandoned it changes nothing, as their
/// blocks no longer carry their ids. Made where the operation is built and kept beside it
/// until its result is handled; never dropped under the shard lock (it takes it).
pub(crate) struct InFlightLoads<'a> {
    cache: &'a MetadataCache,
    object: u64,
    loads: Loads,
}

impl std::ops::Deref for InFlightLoads<'_> {
    type Target = Loads;
    fn deref(&self) -> &Loads {
        &self.loads
    }
}

/// See [`MetadataCache::forget_if_dropped`]. Why: a write whose future is dropped after its
/// operation was built (a caller's timeout) may reach the store or not (a coalescing store
/// drops a queued operation whose caller is gone), while the cache took its metadata in. What
/// the object's blocks hold is then as unknown as after a failed write, and they are
/// forgotten in the same way (loaded again from the store, in order, at their next use).
pub(crate) struct ForgetIfDropped<'a> {
    cache: &'a MetadataCache,
    object: u64,
    armed: bool,
}

impl ForgetIfDropped<'_> {
    /// The write ended (its result is handled by the caller).
    pub(crate) fn done(mut self) {
        self.armed = false;
    }
}

impl Drop for ForgetIfDropped<'_> {
    fn drop(&mut self) {
        // Not while unwinding: a panic in an operation's building holds the shard lock.
        if self.armed && !std::thread::panicking() {
            self.cache.forget(self.object);
        }
    }
}

impl Drop for InFlightLoads<'_> {
    fn drop(&mut self) {
        // Not while unwinding: a panic in an operation's building holds the shard lock.
        if !self.loads.is_empty() && !std::thread::panicking() {
            self.cache.abandon_loads(self.object, &self.loads);
        }
    }
}

impl MetadataCache {
    /// A cache for objects whose metadata region is `region_len` bytes at `region_offset`,
    /// holding about `capacity` bytes, for a store whose write unit is `write_unit` (1: none;
    /// then metadata writes go out as they are). `None` when `capacity` is below one block per
    /// shard.
    pub(crate) fn new(
        region_offset: u64,
        region_len: usize,
        write_unit: u64,
        capacity: usize,
    ) -> Option<MetadataCache> {
        let whole_blocks = write_unit > 1;
        let block = if whole_blocks {
            usize::try_from(write_unit).ok()?
        } else {
            BLOCK
        };
        let shard_capacity = capacity / block / SHARDS;
        if shard_capacity == 0 || region_len == 0 {
            return None;
        }
        Some(MetadataCache {
            region_offset,
            region_len,
            block,
            whole_blocks,
            shard_capacity,
            shards: (0..SHARDS).map(|_| CachePadded::default()).collect(),
            next_load: AtomicU64::new(1),
        })
    }

    pub(crate) fn region_offset(&self) -> u64 {
        self.region_offset
    }

    /// `loads` of `object`, abandoned if dropped before they were finished.
    pub(crate) fn in_flight(&self, object: u64, loads: Loads) -> InFlightLoads<'_> {
        InFlightLoads {
            cache: self,
            object,
            loads,
        }
    }

    /// A guard for a write on `object` built through this cache: unless [`ForgetIfDropped::done`]
    /// is called, dropping it forgets the object's blocks.
    pub(crate) fn forget_if_dropped(&self, object: u64) -> ForgetIfDropped<'_> {
        ForgetIfDropped {
            cache: self,
            object,
            armed: true,
        }
    }

    /// The id the next load will get: every load with a lower id started before this call.
    pub(crate) fn next_load_id(&self) -> u64 {
        self.next_load.load(Ordering::Relaxed)
    }

    fn shard(&self, object: u64) -> MutexGuard<'_, Shard> {
        self.shards[(object % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn block_range(&self, block: u32) -> Range<usize> {
        let start = block as usize * self.block;
        start..(start + self.block).min(self.region_len)
    }

    /// The blocks holding region bytes `range`.
    fn blocks_of(&self, range: &Range<usize>) -> Range<u32> {
        (range.start / self.block) as u32..range.end.div_ceil(self.block) as u32
    }

    /// Build an operation under its object's shard lock and submit it (its future's first
    /// poll) before the lock is released, so the cache and the store see operations on one
    /// object in the same order. Returns what `build` returned beside the future, and the
    /// future's output.
    ///
    /// `lost`: the store's count of lost transactions, read just before. If it changed since
    /// the shard last saw it, the store took back acknowledged operations whose metadata the
    /// shard may hold: the shard forgets every block first (they are loaded again).
    pub(crate) async fn submit<X, F: Future>(
        &self,
        object: u64,
        lost: Option<u64>,
        build: impl FnOnce(&mut Shard) -> (X, F),
    ) -> (X, F::Output) {
        let mut build = Some(build);
        let mut extra = None;
        // The operation's future lives here, pinned in this one, not boxed: an allocation and a
        // copy of the future per IO showed in the profile of 64 KiB writes.
        let mut future = std::pin::pin!(None::<F>);
        let output = std::future::poll_fn(|cx| {
            if let Some(build) = build.take() {
                let mut shard = self.shard(object);
                if shard.lost_seen != lost {
                    if shard.lost_seen.is_some() {
                        tracing::warn!(
                            blocks = shard.blocks.len(),
                            "the store lost acknowledged operations: forgetting cached metadata"
                        );
                    }
                    shard.blocks.clear();
                    shard.known = 0;
                    shard.lost_seen = lost;
                }
                let (x, built) = build(&mut shard);
                extra = Some(x);
                future.set(Some(built));
                // The first poll submits, still under the shard lock (dropped after it).
                return future.as_mut().as_pin_mut().expect("just set").poll(cx);
            }
            future
                .as_mut()
                .as_pin_mut()
                .expect("set in the first poll")
                .poll(cx)
        })
        .await;
        (extra.expect("set in the first poll"), output)
    }

    /// Plan a read of sectors whose metadata is region bytes `range`: from memory when every
    /// block is known, else fetched with the data (blocks not yet in memory or loading start
    /// loading).
    pub(crate) fn plan_read(
        &self,
        shard: &mut Shard,
        object: u64,
        range: Range<usize>,
    ) -> ReadPlan {
        let blocks = self.blocks_of(&range);
        let all_known = blocks
            .clone()
            .all(|b| matches!(shard.blocks.get(&(object, b)), Some(Block::Known(_))));
        if all_known {
            let mut metadata = Vec::with_capacity(range.len());
            for b in blocks {
                let Some(Block::Known(bytes)) = shard.blocks.get(&(object, b)) else {
                    unreachable!("checked above")
                };
                let block = self.block_range(b);
                let lo = range.start.max(block.start) - block.start;
                let hi = range.end.min(block.end) - block.start;
                metadata.extend_from_slice(&bytes[lo..hi]);
            }
            return ReadPlan::Cached(metadata);
        }
        let fetch = blocks.start as usize * self.block
            ..(blocks.end as usize * self.block).min(self.region_len);
        let loads = self.start_loads(shard, object, blocks);
        ReadPlan::Fetch {
            range: fetch,
            loads,
        }
    }

    /// Mark the blocks of `blocks` that are not in memory as loading.
    fn start_loads(&self, shard: &mut Shard, object: u64, blocks: Range<u32>) -> Loads {
        let mut loads = Vec::new();
        for b in blocks {
            if let std::collections::hash_map::Entry::Vacant(entry) =
                shard.blocks.entry((object, b))
            {
                let id = self.next_load.fetch_add(1, Ordering::Relaxed);
                entry.insert(Block::Loading {
                    id,
                    patches: Vec::new(),
                });
                loads.push((b, id));
            }
        }
        loads
    }

    /// A load read returned `bytes`, region bytes `range` as the store held them at its turn
    /// (`None`: the object did not exist, all zeros). Blocks still loading with the same id
    /// become known, with the patches of later operations applied.
    pub(crate) fn finish_loads(
        &self,
        object: u64,
        loads: &Loads,
        range: &Range<usize>,
        bytes: Option<&[u8]>,
    ) {
        if loads.is_empty() {
            return;
        }
        let mut shard = self.shard(object);
        for &(b, id) in loads {
            let key = (object, b);
            let patches = match shard.blocks.get_mut(&key) {
                Some(Block::Loading {
                    id: current,
                    patches,
                }) if *current == id => std::mem::take(patches),
                _ => continue,
            };
            let block = self.block_range(b);
            let mut content = vec![0u8; block.len()].into_boxed_slice();
            if let Some(bytes) = bytes {
                content.copy_from_slice(&bytes[block.start - range.start..block.end - range.start]);
            }
            for (at, patch) in patches {
                content[at..at + patch.len()].copy_from_slice(&patch);
            }
            shard.blocks.remove(&key);
            self.insert_known(&mut shard, key, content);
        }
    }

    /// A load read failed: its blocks are no longer loading (the next use starts again).
    pub(crate) fn abandon_loads(&self, object: u64, loads: &Loads) {
        if loads.is_empty() {
            return;
        }
        let mut shard = self.shard(object);
        for &(b, id) in loads {
            if matches!(shard.blocks.get(&(object, b)), Some(Block::Loading { id: current, .. }) if *current == id)
            {
                shard.blocks.remove(&(object, b));
            }
        }
    }

    /// Forget every block of `object` (a write to it failed: what it holds is unknown).
    pub(crate) fn forget(&self, object: u64) {
        forget_in(&mut self.shard(object), object);
    }

    /// [`MetadataCache::forget`] under the shard lock the caller holds (`shard` is
    /// `object`'s), so that no other operation is built on the blocks first.
    pub(crate) fn forget_locked(&self, shard: &mut Shard, object: u64) {
        forget_in(shard, object);
    }

    fn insert_known(&self, shard: &mut Shard, key: (u64, u32), content: Box<[u8]>) {
        if let Some(Block::Known(known)) = shard.blocks.get_mut(&key) {
            *known = content;
            return;
        }
        // Any known block of another object will do (the map's order is arbitrary): the
        // cache is clean, and an evicted block costs one load when it is used again. Not one
        // of this object's: those may be what the operation being built needs next (a write's
        // partial blocks, found known before its whole blocks went in; the other blocks of one
        // load). Evicting one of them made a write across several blocks leave a partial
        // block behind, which `omap-packed` cannot store (the write failed), or, with fewer
        // blocks per shard than a write touches, load them again for ever (the write never
        // ended). So a shard may hold one object's blocks beyond its capacity.
        while shard.known >= self.shard_capacity {
            let victim = shard
                .blocks
                .iter()
                .find(|(k, b)| k.0 != key.0 && matches!(b, Block::Known(_)))
                .map(|(k, _)| *k);
            let Some(victim) = victim else {
                break;
            };
            shard.blocks.remove(&victim);
            shard.known -= 1;
        }
        shard.blocks.insert(key, Block::Known(content));
        shard.known += 1;
    }

    /// Take a write operation's changes to the metadata region into the cache, in the order
    /// of its steps, and (when the store prefers whole blocks) rewrite its metadata steps as
    /// whole-block writes where the blocks are known. Returns the blocks to load: those the
    /// write touches only in part and that are not in memory (the caller reads them right
    /// after submitting the write, so later writes find them known).
    pub(crate) fn prepare_write(
        &self,
        shard: &mut Shard,
        object: u64,
        steps: &mut Vec<WriteStep>,
    ) -> Option<(Range<usize>, Loads)> {
        let region_start = self.region_offset;
        let region_end = self.region_offset + self.region_len as u64;
        // Inline: a write has one or two metadata steps, and an allocation per IO showed in
        // the profile of 64 KiB writes.
        let mut changes: SmallVec<[Change; 2]> = SmallVec::new();
        let mut rewritable = true;
        let mut only_writes = true;
        for step in steps.iter() {
            match step {
                WriteStep::Write { offset, data } if *offset >= region_start => {
                    changes.push(((*offset - region_start) as usize, data.into()))
                }
                WriteStep::Zero { offset, len } if *offset >= region_start => {
                    only_writes = false;
                    let len = (*len).min(region_end.saturating_sub(*offset)) as usize;
                    changes.push(((*offset - region_start) as usize, vec![0; len].into()))
                }
                WriteStep::Remove => {
                    changes.push((0, vec![0; self.region_len].into()));
                    rewritable = false;
                }
                WriteStep::WriteFull(_) | WriteStep::Truncate(_) | WriteStep::Rollback(_) => {
                    // Not produced by the IO path; what the object then holds is not tracked.
                    forget_in(shard, object);
                    return None;
                }
                _ => {}
            }
        }
        if changes.is_empty() {
            return None;
        }
        let mut partial: Vec<u32> = Vec::new();
        for (at, bytes) in &changes {
            self.apply(shard, object, *at, bytes, &mut partial);
        }
        // One write of exactly one block (an aligned 64 KiB write of `omap-packed`) is already
        // the step the rebuild would make, the block's new content: kept as it is, without
        // copying the block out of the cache.
        let one_whole_block = only_writes
            && matches!(changes[..], [(at, ref bytes)]
                if self.block_range((at / self.block) as u32) == (at..at + bytes.len()));
        let rewritten = (self.whole_blocks && rewritable && !one_whole_block)
            .then(|| self.whole_block_steps(shard, object, &changes));
        drop(changes);
        if let Some(rewritten) = rewritten {
            replace_metadata_steps(region_start, steps, rewritten);
        }
        partial.sort_unstable();
        partial.dedup();
        partial.retain(|&b| !shard.blocks.contains_key(&(object, b)));
        let (first, last) = (*partial.first()?, *partial.last()?);
        // One read covering them all (a write touches at most a few neighbouring blocks).
        let loads = self.start_loads(shard, object, first..last + 1);
        let range =
            first as usize * self.block..((last as usize + 1) * self.block).min(self.region_len);
        Some((range, loads))
    }

    /// For layouts that can only write whole blocks (`omap-packed`): the blocks a write's
    /// metadata steps touch in part that are not known yet, marked as loading (the caller
    /// reads them and calls [`MetadataCache::finish_loads`] before it builds the write again).
    /// `None` when every block the write needs whole is known (or it needs none: an object
    /// removal). Changes nothing else. With `take_over_below`, blocks another load is fetching
    /// are loaded afresh by this one (that load's result is then ignored) if that load's id is
    /// below it: the caller passes [`MetadataCache::next_load_id`] as it was at its previous
    /// attempt, after which it waited for a read of its own, so a load older than that had its
    /// read answered first and its owner did not take the result (a future dropped before
    /// [`InFlightLoads`] existed, or an owner far behind). A younger load is left alone:
    /// taking any load over let two writers that both needed a block take it from each other
    /// for ever, each one's read answered just after the other had taken the block over.
    pub(crate) fn loads_before_write(
        &self,
        shard: &mut Shard,
        object: u64,
        steps: &[WriteStep],
        take_over_below: Option<u64>,
    ) -> Option<(Range<usize>, Loads)> {
        let region_start = self.region_offset;
        let region_end = self.region_offset + self.region_len as u64;
        if steps.iter().any(|s| matches!(s, WriteStep::Remove)) {
            return None;
        }
        let mut missing: Option<Range<u32>> = None;
        for step in steps {
            let (offset, len) = match step {
                WriteStep::Write { offset, data } if *offset >= region_start => {
                    (*offset, data.len() as u64)
                }
                WriteStep::Zero { offset, len } if *offset >= region_start => {
                    (*offset, (*len).min(region_end.saturating_sub(*offset)))
                }
                _ => continue,
            };
            let at = (offset - region_start) as usize;
            let range = at..at + len as usize;
            for b in self.blocks_of(&range) {
                let block = self.block_range(b);
                let whole = range.start <= block.start && block.end <= range.end;
                // A whole block needs no lookup: the write replaces it.
                if !whole && !matches!(shard.blocks.get(&(object, b)), Some(Block::Known(_))) {
                    missing = Some(match missing {
                        Some(m) => m.start.min(b)..m.end.max(b + 1),
                        None => b..b + 1,
                    });
                }
            }
        }
        let blocks = missing?;
        if let Some(below) = take_over_below {
            for b in blocks.clone() {
                if let Some(Block::Loading { id, .. }) = shard.blocks.get(&(object, b)) {
                    if *id < below {
                        shard.blocks.remove(&(object, b));
                    }
                }
            }
        }
        let range = blocks.start as usize * self.block
            ..(blocks.end as usize * self.block).min(self.region_len);
        Some((range, self.start_loads(shard, object, blocks)))
    }

    /// Apply one change to the blocks it touches; blocks not in memory and only partly
    /// covered are added to `partial`.
    fn apply(
        &self,
        shard: &mut Shard,
        object: u64,
        at: usize,
        bytes: &[u8],
        partial: &mut Vec<u32>,
    ) {
        let range = at..at + bytes.len();
        for b in self.blocks_of(&range) {
            let block = self.block_range(b);
            let lo = range.start.max(block.start);
            let hi = range.end.min(block.end);
            let piece = &bytes[lo - at..hi - at];
            match shard.blocks.get_mut(&(object, b)) {
                Some(Block::Known(content)) => {
                    content[lo - block.start..hi - block.start].copy_from_slice(piece)
                }
                Some(Block::Loading { patches, .. }) => {
                    patches.push((lo - block.start, piece.to_vec()))
                }
                None if lo == block.start && hi == block.end => {
                    self.insert_known(shard, (object, b), piece.to_vec().into_boxed_slice())
                }
                None => partial.push(b),
            }
        }
    }

    /// The steps that replace a write's metadata steps: whole-block writes of the known
    /// blocks they touch, and their exact bytes in the blocks not known.
    fn whole_block_steps(&self, shard: &Shard, object: u64, changes: &[Change]) -> Vec<WriteStep> {
        let region_start = self.region_offset;
        let blocks_of = |(at, bytes): &Change| self.blocks_of(&(*at..*at + bytes.len()));
        let mut rewritten = Vec::new();
        let mut rewrite = |b: u32| {
            let block = self.block_range(b);
            match shard.blocks.get(&(object, b)) {
                Some(Block::Known(content)) => rewritten.push(WriteStep::Write {
                    offset: region_start + block.start as u64,
                    data: content.to_vec(),
                }),
                _ => {
                    // Exact bytes, in the steps' order (later changes win).
                    for (at, bytes) in changes {
                        let lo = (*at).max(block.start);
                        let hi = (at + bytes.len()).min(block.end);
                        if lo < hi {
                            rewritten.push(WriteStep::Write {
                                offset: region_start + lo as u64,
                                data: bytes[lo - at..hi - at].to_vec(),
                            });
                        }
                    }
                }
            }
        };
        match changes {
            // One change (the usual write) touches a run of blocks in order: no list to build.
            [one] => blocks_of(one).for_each(&mut rewrite),
            _ => {
                let mut touched: Vec<u32> = changes.iter().flat_map(blocks_of).collect();
                touched.sort_unstable();
                touched.dedup();
                touched.into_iter().for_each(&mut rewrite);
            }
        }
        rewritten
    }
}

/// Put `rewritten` where a write's first metadata step (at or past `region_start`) was, in
/// place of all of them.
fn replace_metadata_steps(
    region_start: u64,
    steps: &mut Vec<WriteStep>,
    rewritten: Vec<WriteStep>,
) {
    let is_metadata = |step: &WriteStep| match step {
        WriteStep::Write { offset, .. } | WriteStep::Zero { offset, .. } => *offset >= region_start,
        _ => false,
    };
    let Some(at) = steps.iter().position(is_metadata) else {
        return;
    };
    steps.retain(|s| !is_metadata(s));
    let at = at.min(steps.len());
    steps.splice(at..at, rewritten);
}

fn forget_in(shard: &mut Shard, object: u64) {
    let before = shard.blocks.len();
    let mut known_removed = 0;
    shard.blocks.retain(|&(o, _), block| {
        let keep = o != object;
        if !keep && matches!(block, Block::Known(_)) {
            known_removed += 1;
        }
        keep
    });
    shard.known -= known_removed;
    tracing::debug!(
        object,
        blocks = before - shard.blocks.len(),
        "forgot cached metadata"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const REGION: u64 = 1 << 20;

    fn cache(whole_blocks: bool) -> MetadataCache {
        // Four blocks of metadata at 1 MiB, room for everything.
        let unit = if whole_blocks { BLOCK as u64 } else { 1 };
        MetadataCache::new(REGION, 4 * BLOCK, unit, 1 << 20).expect("capacity")
    }

    fn meta_write(at: usize, bytes: &[u8]) -> WriteStep {
        WriteStep::Write {
            offset: REGION + at as u64,
            data: bytes.to_vec(),
        }
    }

    fn data_write() -> WriteStep {
        WriteStep::Write {
            offset: 0,
            data: vec![7; 4096],
        }
    }

    fn prepare(
        cache: &MetadataCache,
        object: u64,
        steps: &mut Vec<WriteStep>,
    ) -> Option<(Range<usize>, Loads)> {
        cache.prepare_write(&mut cache.shard(object), object, steps)
    }

    fn plan(cache: &MetadataCache, object: u64, range: Range<usize>) -> ReadPlan {
        cache.plan_read(&mut cache.shard(object), object, range)
    }

    /// (offset, len) of each metadata write step.
    fn metadata_writes(steps: &[WriteStep]) -> Vec<(u64, usize)> {
        steps
            .iter()
            .filter_map(|s| match s {
                WriteStep::Write { offset, data } if *offset >= REGION => {
                    Some((*offset - REGION, data.len()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_partial_write_to_an_unknown_block_loads_it_and_later_writes_patch_the_load() {
        let cache = cache(true);
        let mut first = vec![data_write(), meta_write(32, &[1; 32])];
        let (range, loads) = prepare(&cache, 3, &mut first).expect("the block is to be loaded");
        assert_eq!(range, 0..BLOCK);
        assert_eq!(loads.len(), 1);
        // Not known yet: the exact bytes go out, after the data.
        assert_eq!(metadata_writes(&first), vec![(32, 32)]);
        assert!(matches!(&first[0], WriteStep::Write { offset: 0, .. }));
        // A second write while the load is in flight: a patch, exact bytes again, no load.
        let mut second = vec![meta_write(64, &[2; 32])];
        assert!(prepare(&cache, 3, &mut second).is_none());
        assert_eq!(metadata_writes(&second), vec![(64, 32)]);
        // Reads meanwhile fetch from the store and start no second load.
        match plan(&cache, 3, 32..64) {
            ReadPlan::Fetch { range, loads } => {
                assert_eq!(range, 0..BLOCK);
                assert!(loads.is_empty());
            }
            ReadPlan::Cached(_) => panic!("a loading block is not known"),
        }
        // The load saw the first write (submitted before it), not the second.
        let mut stored = vec![0u8; BLOCK];
        stored[32..64].fill(1);
        stored[200] = 9;
        cache.finish_loads(3, &loads, &range, Some(&stored));
        match plan(&cache, 3, 0..BLOCK) {
            ReadPlan::Cached(bytes) => {
                let mut expected = stored.clone();
                expected[64..96].fill(2);
                assert_eq!(bytes, expected);
            }
            ReadPlan::Fetch { .. } => panic!("the block is known now"),
        }
        // Known: a later write sends the whole block.
        let mut third = vec![data_write(), meta_write(96, &[3; 32])];
        assert!(prepare(&cache, 3, &mut third).is_none());
        assert_eq!(metadata_writes(&third), vec![(0, BLOCK)]);
        let WriteStep::Write { data, .. } = &third[1] else {
            panic!("metadata after the data")
        };
        assert_eq!(&data[32..64], &[1; 32]);
        assert_eq!(&data[64..96], &[2; 32]);
        assert_eq!(&data[96..128], &[3; 32]);
        assert_eq!(data[200], 9);
    }

    #[test]
    fn whole_blocks_written_are_known_at_once_and_other_objects_are_apart() {
        let cache = cache(true);
        let mut steps = vec![data_write(), meta_write(BLOCK, &[5; 2 * BLOCK])];
        assert!(prepare(&cache, 1, &mut steps).is_none());
        assert_eq!(
            metadata_writes(&steps),
            vec![(BLOCK as u64, BLOCK), (2 * BLOCK as u64, BLOCK)]
        );
        assert!(
            matches!(plan(&cache, 1, BLOCK + 100..3 * BLOCK), ReadPlan::Cached(b) if b == vec![5; 2 * BLOCK - 100])
        );
        // The block before is not known, nor is the same block of another object.
        assert!(matches!(plan(&cache, 1, 0..32), ReadPlan::Fetch { .. }));
        assert!(matches!(
            plan(&cache, 2, BLOCK..BLOCK + 32),
            ReadPlan::Fetch { .. }
        ));
    }

    #[test]
    fn a_write_of_one_whole_block_goes_out_as_written() {
        let cache = cache(true);
        let mut steps = vec![data_write(), meta_write(2 * BLOCK, &[6; BLOCK])];
        let data = match &steps[1] {
            WriteStep::Write { data, .. } => data.as_ptr(),
            _ => unreachable!(),
        };
        assert!(prepare(&cache, 1, &mut steps).is_none());
        assert_eq!(metadata_writes(&steps), vec![(2 * BLOCK as u64, BLOCK)]);
        // The very step: not rebuilt from the cache.
        assert!(matches!(&steps[1], WriteStep::Write { data: d, .. } if d.as_ptr() == data));
        assert!(
            matches!(plan(&cache, 1, 2 * BLOCK..3 * BLOCK), ReadPlan::Cached(b) if b == vec![6; BLOCK])
        );
        // A block known before and written whole again, and a whole block written twice in one
        // operation (rebuilt: one step, the later bytes).
        let mut again = vec![data_write(), meta_write(2 * BLOCK, &[7; BLOCK])];
        assert!(prepare(&cache, 1, &mut again).is_none());
        assert!(
            matches!(plan(&cache, 1, 2 * BLOCK..3 * BLOCK), ReadPlan::Cached(b) if b == vec![7; BLOCK])
        );
        let mut twice = vec![meta_write(0, &[1; BLOCK]), meta_write(0, &[2; BLOCK])];
        assert!(prepare(&cache, 1, &mut twice).is_none());
        assert_eq!(metadata_writes(&twice), vec![(0, BLOCK)]);
        assert!(matches!(&twice[0], WriteStep::Write { data, .. } if data == &vec![2; BLOCK]));
    }

    #[test]
    fn blocks_are_the_stores_unit() {
        // The local backend's unit: 512-byte pieces, each its own step.
        let unit = 512;
        let cache = MetadataCache::new(REGION, 4 * BLOCK, unit as u64, 1 << 20).expect("capacity");
        let mut fill = vec![data_write(), meta_write(0, &[1; 4 * 512])];
        assert!(prepare(&cache, 1, &mut fill).is_none());
        assert_eq!(
            metadata_writes(&fill),
            vec![(0, unit), (512, unit), (1024, unit), (1536, unit)]
        );
        // A sector's 32 bytes go out as the whole piece around them, rebuilt from memory.
        let mut one = vec![data_write(), meta_write(600, &[2; 32])];
        assert!(prepare(&cache, 1, &mut one).is_none());
        assert_eq!(metadata_writes(&one), vec![(512, unit)]);
        let WriteStep::Write { data, .. } = &one[1] else {
            panic!("a write")
        };
        assert_eq!(&data[..88], &[1; 88]);
        assert_eq!(&data[88..120], &[2; 32]);
        assert_eq!(&data[120..], &[1; 392]);
        // A piece never written is loaded alone, not the 4 KiB around it.
        let (range, _) =
            prepare(&cache, 1, &mut vec![meta_write(2048 + 32, &[3; 32])]).expect("to be loaded");
        assert_eq!(range, 2048..2048 + unit);
    }

    #[test]
    fn without_whole_blocks_the_steps_stay_as_they_are() {
        let cache = cache(false);
        let mut steps = vec![meta_write(0, &[4; BLOCK])];
        assert!(prepare(&cache, 1, &mut steps).is_none());
        let mut second = vec![data_write(), meta_write(32, &[6; 32])];
        assert!(prepare(&cache, 1, &mut second).is_none());
        assert_eq!(metadata_writes(&second), vec![(32, 32)]);
        let ReadPlan::Cached(bytes) = plan(&cache, 1, 0..64) else {
            panic!("known")
        };
        assert_eq!(&bytes[..32], &[4; 32]);
        assert_eq!(&bytes[32..], &[6; 32]);
    }

    #[test]
    fn discards_zero_the_metadata_and_removal_zeroes_every_block() {
        let cache = cache(true);
        let mut write = vec![meta_write(0, &[1; 4 * BLOCK])];
        prepare(&cache, 1, &mut write);
        let mut discard = vec![
            WriteStep::AssertExists,
            WriteStep::Zero {
                offset: 0,
                len: 8192,
            },
            WriteStep::Zero {
                offset: REGION + 64,
                len: 64,
            },
        ];
        assert!(prepare(&cache, 1, &mut discard).is_none());
        // AssertExists stays first; the metadata zeroing became a whole-block write.
        assert!(matches!(discard[0], WriteStep::AssertExists));
        assert_eq!(metadata_writes(&discard), vec![(0, BLOCK)]);
        let ReadPlan::Cached(bytes) = plan(&cache, 1, 0..192) else {
            panic!("known")
        };
        assert_eq!(&bytes[..64], &[1; 64]);
        assert_eq!(&bytes[64..128], &[0; 64]);
        assert_eq!(&bytes[128..], &[1; 64]);
        let mut remove = vec![WriteStep::AssertExists, WriteStep::Remove];
        assert!(prepare(&cache, 1, &mut remove).is_none());
        assert_eq!(remove.len(), 2, "a removal is not rewritten");
        let ReadPlan::Cached(bytes) = plan(&cache, 1, 0..4 * BLOCK) else {
            panic!("known")
        };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_load_that_lost_its_block_is_ignored() {
        let cache = cache(true);
        let ReadPlan::Fetch { range, loads } = plan(&cache, 1, 0..32) else {
            panic!("nothing known yet")
        };
        // A write failed meanwhile: the object is forgotten; a new read starts a new load.
        cache.forget(1);
        let ReadPlan::Fetch { loads: newer, .. } = plan(&cache, 1, 0..32) else {
            panic!("nothing known yet")
        };
        cache.finish_loads(1, &loads, &range, Some(&[8; BLOCK]));
        assert!(
            matches!(plan(&cache, 1, 0..32), ReadPlan::Fetch { .. }),
            "the old load filled nothing"
        );
        cache.finish_loads(1, &newer, &range, None);
        assert!(matches!(plan(&cache, 1, 0..32), ReadPlan::Cached(b) if b == vec![0; 32]));
        // A failed load frees its blocks for the next one.
        let ReadPlan::Fetch { loads, .. } = plan(&cache, 1, BLOCK..BLOCK + 1) else {
            panic!("block 1 not known")
        };
        cache.abandon_loads(1, &loads);
        let ReadPlan::Fetch { loads, .. } = plan(&cache, 1, BLOCK..BLOCK + 1) else {
            panic!("block 1 not known")
        };
        assert_eq!(loads.len(), 1);
    }

    #[test]
    fn memory_stays_bounded() {
        // One block per shard.
        let cache =
            MetadataCache::new(REGION, 4 * BLOCK, BLOCK as u64, SHARDS * BLOCK).expect("capacity");
        for object in 0..64u64 {
            for b in 0..4 {
                let mut steps = vec![meta_write(b * BLOCK, &[1; BLOCK])];
                prepare(&cache, object * SHARDS as u64, &mut steps);
            }
        }
        // The last object's four blocks (one object may go past the capacity), no other.
        let shard = cache.shard(0);
        assert_eq!(shard.known, 4);
        assert_eq!(shard.blocks.len(), 4);
        assert!(shard.blocks.keys().all(|k| k.0 == 63 * SHARDS as u64));
    }

    #[test]
    fn a_write_across_blocks_keeps_its_partial_blocks_with_one_block_per_shard() {
        let cache =
            MetadataCache::new(REGION, 4 * BLOCK, BLOCK as u64, SHARDS * BLOCK).expect("capacity");
        // Another object of the same shard holds its one block.
        let other = SHARDS as u64;
        assert!(prepare(&cache, other, &mut vec![meta_write(0, &[9; BLOCK])]).is_none());
        // The end of block 0, all of block 1, the start of block 2: 0 and 2 are loaded first.
        let steps = vec![data_write(), meta_write(BLOCK - 32, &[1; BLOCK + 64])];
        let (range, loads) = cache
            .loads_before_write(&mut cache.shard(0), 0, &steps, None)
            .expect("blocks 0 and 2 are not known");
        assert_eq!(range, 0..3 * BLOCK);
        let stored: Vec<u8> = (0..3 * BLOCK).map(|i| (i % 251) as u8).collect();
        cache.finish_loads(0, &loads, &range, Some(&stored));
        assert!(
            cache
                .loads_before_write(&mut cache.shard(0), 0, &steps, None)
                .is_none(),
            "every block the write needs whole stays known"
        );
        let mut built = steps.clone();
        assert!(prepare(&cache, 0, &mut built).is_none());
        assert_eq!(
            metadata_writes(&built),
            vec![(0, BLOCK), (BLOCK as u64, BLOCK), (2 * BLOCK as u64, BLOCK)],
            "whole blocks only"
        );
        let mut expected = stored.clone();
        expected[BLOCK - 32..2 * BLOCK + 32].fill(1);
        let written: Vec<u8> = built[1..]
            .iter()
            .flat_map(|s| match s {
                WriteStep::Write { data, .. } => data.clone(),
                _ => panic!("metadata writes only"),
            })
            .collect();
        assert!(
            written == expected,
            "the blocks as loaded, with the write over them"
        );
        // The other object's block made room; this object's blocks are all known.
        let shard = cache.shard(0);
        assert!(shard.blocks.keys().all(|k| k.0 == 0));
        assert_eq!(shard.known, 3);
    }

    #[test]
    fn a_whole_block_going_in_evicts_none_of_the_same_writes_partial_blocks() {
        // Two blocks per shard, both known: blocks 0 and 2 of object 0.
        let cache = MetadataCache::new(REGION, 4 * BLOCK, BLOCK as u64, 2 * SHARDS * BLOCK)
            .expect("capacity");
        for b in [0, 2] {
            assert!(prepare(&cache, 0, &mut vec![meta_write(b * BLOCK, &[2; BLOCK])]).is_none());
        }
        let mut steps = vec![data_write(), meta_write(BLOCK - 32, &[1; BLOCK + 64])];
        assert!(cache
            .loads_before_write(&mut cache.shard(0), 0, &steps, None)
            .is_none());
        // Block 1 goes in whole: it must not push block 0 or 2 out before they are rebuilt.
        assert!(prepare(&cache, 0, &mut steps).is_none());
        assert_eq!(
            metadata_writes(&steps),
            vec![(0, BLOCK), (BLOCK as u64, BLOCK), (2 * BLOCK as u64, BLOCK)],
            "whole blocks only"
        );
    }
    /// Two writers that both need block 0 whole and are past their second attempt, each
    /// taking over the other's load where `loads_before_write` lets it, their reads answered
    /// and handled in the order they were sent. The start: B's load is in flight and A, whose
    /// previous read went out after B's, takes it over (B fell behind). Returns the round in
    /// which one of them found the block known, if one did within 20.
    fn rounds_until_known(take_over_any: bool) -> Option<usize> {
        let cache = cache(true);
        let steps = vec![meta_write(32, &[1; 32])];
        // One attempt: the loads its read finishes (the read goes out whenever the block is
        // not known), and the next load id as it saw it.
        let attempt = |previous: &mut u64| -> Option<Loads> {
            let below = if take_over_any { u64::MAX } else { *previous };
            let mut shard = cache.shard(0);
            let loads = cache.loads_before_write(&mut shard, 0, &steps, Some(below));
            *previous = cache.next_load_id();
            loads.map(|(range, loads)| {
                assert_eq!(range, 0..BLOCK);
                loads
            })
        };
        let (mut b_seen, mut a_seen) = (0, 0);
        let b_loads = attempt(&mut b_seen).expect("nothing known yet");
        assert_eq!(b_loads.len(), 1, "B starts the load");
        a_seen = a_seen.max(cache.next_load_id());
        let a_loads = attempt(&mut a_seen).expect("B's load is in flight");
        assert_eq!(a_loads.len(), 1, "A takes B's load over");
        let mut reads: std::collections::VecDeque<(char, Loads)> =
            [('B', b_loads), ('A', a_loads)].into();
        for round in 0..20 {
            let (writer, loads) = reads.pop_front().expect("a read in flight");
            cache.finish_loads(0, &loads, &(0..BLOCK), Some(&[0; BLOCK]));
            let seen = if writer == 'A' {
                &mut a_seen
            } else {
                &mut b_seen
            };
            match attempt(seen) {
                Some(loads) => reads.push_back((writer, loads)),
                None => return Some(round),
            }
        }
        None
    }

    #[test]
    fn two_writers_do_not_take_a_block_from_each_other_for_ever() {
        // Taking over any load in flight: each writer's read comes back just after the other
        // took the block over, for ever.
        assert_eq!(rounds_until_known(true), None);
        // Only loads older than the writer's previous read: B leaves A's load alone, A's
        // read fills the block and A goes ahead.
        assert_eq!(rounds_until_known(false), Some(1));
    }

    #[test]
    fn dropped_loads_are_abandoned_and_finished_ones_stay() {
        let cache = cache(true);
        let ReadPlan::Fetch { range, loads } = plan(&cache, 1, 0..32) else {
            panic!("nothing is known yet");
        };
        // A caller that gave up: its blocks are no longer loading, the next read loads them.
        drop(cache.in_flight(1, loads));
        let ReadPlan::Fetch {
            range: again,
            loads,
        } = plan(&cache, 1, 0..32)
        else {
            panic!("the block was abandoned, not filled");
        };
        assert_eq!(again, range);
        assert_eq!(loads.len(), 1, "a new load, not a wait for the dropped one");
        // Finished, then dropped: the block stays known.
        let in_flight = cache.in_flight(1, loads);
        cache.finish_loads(1, &in_flight, &range, Some(&[4; BLOCK]));
        drop(in_flight);
        assert!(matches!(plan(&cache, 1, 0..32), ReadPlan::Cached(b) if b == vec![4; 32]));
    }
}
