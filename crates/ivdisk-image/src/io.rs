//! The IO path: byte ranges of the image become runs of sectors, runs are split at object
//! boundaries, and each object gets ONE store operation holding all the ciphertext and
//! metadata of the request for it. Operations for different objects go out in parallel.
//!
//! A sector is *unwritten* when its stored ciphertext and metadata are all zeros (a hole, a
//! missing object, a missing omap key): it reads as zeros. A written sector's metadata is a
//! random IV/nonce (and tag) and its ciphertext random-looking, so a real write is never
//! mistaken for one (probability 2^-128 or less). Discard returns sectors to that state.

use std::sync::atomic::Ordering;

use futures_util::future::{join, join_all, Either};
use ivdisk_crypto::{CryptoError, SectorCipher};
use ivdisk_store::{ObjectName, ReadOp, ReadStep, StoreError, WriteOp, WriteOutcome, WriteStep};

use crate::image::{Image, Inner};
use crate::layout::{
    extent_bytes, take_or_place_extents, Decoded, ReadOutput, SectorLayout, SlotReply,
    UNALIGNED_DIRECT_GROUP,
};
use crate::metadata_cache::{InFlightLoads, MetadataCache, ReadPlan};
use crate::range_lock::WriteHold;
use crate::{ImageError, PayloadPlacement, ReadReply, WritePayload};

/// Objects whose operations are in flight at once for one large request (write-zeroes,
/// discard and resize can span thousands of objects).
const OBJECTS_IN_FLIGHT: usize = 16;
/// Encrypted zeros one write-zeroes that may not unmap holds at once (at least one object):
/// as much as the largest NBD write's payload, which the NBD server charges it as.
const ZEROS_IN_FLIGHT_BYTES: u64 = 32 << 20;
/// `unaligned` runs smaller than this read into a buffer the read returns are decrypted into
/// a fresh buffer, which the allocator hands out warm at these sizes ([`Inner::slots_down_pays`]).
const SLOTS_DOWN_MIN_BYTES: usize = 512 << 10;

/// The sectors of one object touched by a request.
#[derive(Debug, Clone, Copy)]
struct Piece {
    object: u64,
    /// First sector within the object.
    index: u32,
    count: u32,
    /// LBA of the piece's first sector.
    lba: u64,
}

/// What a request stores in its sectors.
#[derive(Clone, Copy)]
enum Fill<'a> {
    /// These bytes (the request's payload).
    Data(&'a [u8]),
    /// Encrypted zeros (write-zeroes that must stay allocated).
    Zeros,
    /// The unwritten state (discard, write-zeroes that may unmap).
    Unwritten,
}

/// What [`Inner::write_piece_whole_blocks`] sent in one pass.
enum PackedStep<'a> {
    /// A read of the blocks the write needs whole (region bytes, and the loads it finishes).
    Load(std::ops::Range<usize>, InFlightLoads<'a>),
    /// The write itself.
    Write,
    /// Nothing: the cache left a step the layout cannot store (a bug; the write fails).
    Unstorable(String),
}

/// Where a read run's ciphertext and metadata are, for [`Inner::decrypt_written`].
#[derive(Clone, Copy)]
enum Stored<'a> {
    /// The ciphertext already in the output buffer, with this metadata.
    InOutput(&'a [u8]),
    /// The ciphertext in the first buffer (the store's), the metadata in the second.
    Apart(&'a [u8], &'a [u8]),
    /// Slots of ciphertext and metadata (`unaligned`).
    Slots(&'a [u8]),
}

fn all_zero(bytes: &[u8]) -> bool {
    // Checking 16 bytes at a time; ciphertext fails on the first chunk almost always.
    let (chunks, rest) = bytes.split_at(bytes.len() - bytes.len() % 16);
    chunks
        .chunks_exact(16)
        .all(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")) == 0)
        && rest.iter().all(|&b| b == 0)
}

impl Inner {
    fn sectors_per_object(&self) -> u64 {
        self.object_size / self.sector_size as u64
    }

    /// Split sectors `[first, end)` at object boundaries, lazily: a trim of a whole large
    /// image of small objects has millions of pieces.
    fn pieces(&self, first: u64, end: u64) -> impl Iterator<Item = Piece> {
        let per_object = self.sectors_per_object();
        let base = self.data_offset / self.sector_size as u64;
        let mut lba = first;
        std::iter::from_fn(move || {
            if lba >= end {
                return None;
            }
            let global = base + lba;
            let index = global % per_object;
            let count = (per_object - index).min(end - lba);
            let piece = Piece {
                object: global / per_object,
                index: index as u32,
                count: count as u32,
                lba,
            };
            lba += count;
            Some(piece)
        })
    }

    /// The one piece of sectors `[first, end)` (not empty) when they lie inside one object:
    /// what [`Inner::pieces`] returns then, without a `Vec`.
    fn sectors_in_one_object(&self, first: u64, end: u64) -> Option<Piece> {
        let per_object = self.sectors_per_object();
        let global = self.data_offset / self.sector_size as u64 + first;
        let index = global % per_object;
        let count = end - first;
        (count > 0 && index + count <= per_object).then_some(Piece {
            object: global / per_object,
            index: index as u32,
            count: count as u32,
            lba: first,
        })
    }

    /// The one piece of `[offset, offset + len)` when that is whole sectors inside one object
    /// (not empty).
    fn whole_sectors_in_one_object(&self, offset: u64, len: u64) -> Option<Piece> {
        let ss = self.sector_size as u64;
        if !offset.is_multiple_of(ss) || !len.is_multiple_of(ss) {
            return None;
        }
        // A client's range may run past 2^64 (the NBD server asks where to put a payload
        // before it checks the range): not one object's, and the range check refuses it.
        let end = offset.checked_add(len)?;
        self.sectors_in_one_object(offset / ss, end / ss)
    }

    pub(crate) fn check_range(&self, offset: u64, len: u64) -> Result<(), ImageError> {
        let size = self.size.load(Ordering::Acquire);
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(ImageError::OutOfRange {
                image: self.name.clone(),
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    fn integrity(&self, lbas: Vec<u64>) -> ImageError {
        ImageError::Integrity {
            image: self.name.clone(),
            lbas,
            sector_size: self.sector_size,
            in_write: false,
        }
    }

    /// Read and decrypt whole sectors from `first` into `out`. Returns the LBAs that failed
    /// authentication (zeros in `out`); every other sector holds its plaintext.
    async fn read_sectors(&self, first: u64, out: &mut [u8]) -> Result<Vec<u64>, ImageError> {
        let ss = self.sector_size;
        let end = first + (out.len() / ss) as u64;
        if let Some(piece) = self.sectors_in_one_object(first, end) {
            // A read inside one object, the usual case: awaited as it is.
            return self.read_piece(piece, &mut ReadOutput::Borrowed(out)).await;
        }
        let mut reads = Vec::new();
        let mut rest = out;
        for piece in self.pieces(first, end) {
            let (chunk, tail) = rest.split_at_mut(piece.count as usize * ss);
            rest = tail;
            reads.push(async move {
                self.read_piece(piece, &mut ReadOutput::Borrowed(chunk))
                    .await
            });
        }
        let mut failed = Vec::new();
        let mut error = None;
        for result in join_all(reads).await {
            match result {
                Ok(lbas) => failed.extend(lbas),
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => {
                failed.sort_unstable();
                Ok(failed)
            }
        }
    }

    /// The metadata cache, while reads may use it: this process holds the writer lock (the
    /// cache is right only while no one else writes). Writes always go through it (see
    /// [`Inner::write_piece`]).
    fn usable_cache(&self) -> Option<&MetadataCache> {
        let cache = self.metadata_cache.as_ref()?;
        self.check_writable().is_ok().then_some(cache)
    }

    async fn read_piece(
        &self,
        piece: Piece,
        out: &mut ReadOutput<'_>,
    ) -> Result<Vec<u64>, ImageError> {
        if let Some(cache) = self.usable_cache().filter(|_| self.metadata_cache_reads) {
            return self.read_piece_cached(cache, piece, out).await;
        }
        let object = self.data_object(piece.object);
        let mut op = ReadOp::new();
        op.snap = self.read_snap();
        self.layout.read(&mut op.steps, piece.index, piece.count);
        let results = match self.store.read_op(&object, op).await {
            Ok(results) => results,
            Err(StoreError::NotFound { .. }) => {
                out.slice().fill(0);
                return Ok(Vec::new());
            }
            Err(e) => return Err(ImageError::store(&self.name)(e)),
        };
        let mut metadata = vec![0u8; piece.count as usize * self.cipher.metadata_len()];
        let taken = self
            .layout
            .decode(
                &mut results.into_iter(),
                piece.index,
                piece.count,
                out,
                &mut metadata,
            )
            .map_err(|reason| ImageError::Corrupt {
                image: self.name.clone(),
                reason: format!("object `{object}`: {reason}"),
            })?;
        match taken {
            Decoded::Taken(ciphertext) => self.decrypt_taken(piece.lba, ciphertext, &metadata, out),
            Decoded::Slots(mut slots) => match out {
                ReadOutput::Owned {
                    len,
                    buf: buf @ None,
                    slots: reply @ SlotReply::Allowed,
                } => {
                    let failed = self.decrypt_in_slots(piece.lba, &mut slots, *len)?;
                    *buf = Some(slots);
                    *reply = SlotReply::Returned(self.sector_size + self.cipher.metadata_len());
                    Ok(failed)
                }
                ReadOutput::Owned {
                    len,
                    buf: buf @ None,
                    ..
                } => {
                    let (plaintext, failed) = if self.slots_down_pays(*len) {
                        self.decrypt_slots_down(piece.lba, slots, *len)?
                    } else {
                        self.decrypt_slots_owned(piece.lba, &slots, *len)?
                    };
                    *buf = Some(plaintext);
                    Ok(failed)
                }
                _ => self.decrypt_written(piece.lba, Stored::Slots(&slots), out.slice()),
            },
            Decoded::Placed => {
                self.decrypt_written(piece.lba, Stored::InOutput(&metadata), out.slice())
            }
        }
    }

    /// Decrypt the store's buffer of a run: straight into the caller's buffer (one pass), or
    /// in place when the read returns a buffer, which it then is.
    fn decrypt_taken(
        &self,
        lba: u64,
        mut ciphertext: Vec<u8>,
        metadata: &[u8],
        out: &mut ReadOutput<'_>,
    ) -> Result<Vec<u64>, ImageError> {
        match out {
            ReadOutput::Borrowed(out) => {
                self.decrypt_written(lba, Stored::Apart(&ciphertext, metadata), out)
            }
            ReadOutput::Owned { buf, .. } => {
                let failed =
                    self.decrypt_written(lba, Stored::InOutput(metadata), &mut ciphertext)?;
                *buf = Some(ciphertext);
                Ok(failed)
            }
        }
    }

    /// [`Inner::read_piece`] of an `object-end` image through its metadata cache: the data
    /// extent alone when the metadata is in memory, else the data and the whole metadata
    /// blocks, which then stay in memory.
    async fn read_piece_cached(
        &self,
        cache: &MetadataCache,
        piece: Piece,
        out: &mut ReadOutput<'_>,
    ) -> Result<Vec<u64>, ImageError> {
        let object = self.data_object(piece.object);
        let (ss, ml) = (self.sector_size as u64, self.cipher.metadata_len());
        let data_offset = piece.index as u64 * ss;
        let wanted = piece.index as usize * ml..(piece.index + piece.count) as usize * ml;
        let store = &self.store;
        // The plan's loads move into `loads`, which gives them up if this read is dropped.
        let ((plan, loads), result) = cache
            .submit(piece.object, store.lost_transactions(), |shard| {
                let mut plan = cache.plan_read(shard, piece.object, wanted.clone());
                let mut op = ReadOp::new().step(ReadStep::Read {
                    offset: data_offset,
                    len: piece.count as u64 * ss,
                });
                let mut loads = Vec::new();
                if let ReadPlan::Fetch {
                    range,
                    loads: started,
                } = &mut plan
                {
                    self.layout
                        .cached_fetch_steps(cache.region_offset(), range, &mut op.steps);
                    loads = std::mem::take(started);
                }
                let loads = cache.in_flight(piece.object, loads);
                ((plan, loads), store.read_op(&object, op))
            })
            .await;
        let corrupt = |reason: String| ImageError::Corrupt {
            image: self.name.clone(),
            reason: format!("object `{object}`: {reason}"),
        };
        let results = match result {
            Ok(results) => results,
            Err(e) => {
                if let ReadPlan::Fetch { range, .. } = &plan {
                    match e {
                        // A missing object: its metadata is all zeros at this point.
                        StoreError::NotFound { .. } => {
                            cache.finish_loads(piece.object, &loads, range, None)
                        }
                        _ => cache.abandon_loads(piece.object, &loads),
                    }
                }
                return match e {
                    StoreError::NotFound { .. } => {
                        out.slice().fill(0);
                        Ok(Vec::new())
                    }
                    e => Err(ImageError::store(&self.name)(e)),
                };
            }
        };
        let mut results = results.into_iter();
        let taken = take_or_place_extents(results.next(), data_offset, out);
        let (taken, metadata) = match plan {
            ReadPlan::Cached(metadata) => (taken.map_err(corrupt)?, metadata),
            ReadPlan::Fetch { range, .. } => {
                let fetched =
                    self.layout
                        .cached_fetched(&mut results, cache.region_offset(), &range);
                match (taken, fetched) {
                    (Ok(taken), Ok(fetched)) => {
                        cache.finish_loads(piece.object, &loads, &range, Some(&fetched));
                        let wanted = wanted.start - range.start..wanted.end - range.start;
                        (taken, fetched[wanted].to_vec())
                    }
                    (Err(reason), _) | (_, Err(reason)) => {
                        cache.abandon_loads(piece.object, &loads);
                        return Err(corrupt(reason));
                    }
                }
            }
        };
        match taken {
            Some(ciphertext) => self.decrypt_taken(piece.lba, ciphertext, &metadata, out),
            None => self.decrypt_written(piece.lba, Stored::InOutput(&metadata), out.slice()),
        }
    }

    /// Apply one object's write operation through the metadata cache: its metadata changes
    /// enter the cache in submission order, whole metadata blocks go out where the store
    /// prefers them, and the blocks it touches in part and that are not in memory are read
    /// right after it (one read per block, once).
    async fn write_piece_cached(
        &self,
        cache: &MetadataCache,
        n: u64,
        object: &ObjectName,
        mut op: WriteOp,
    ) -> Result<(), StoreError> {
        let store = &self.store;
        let given_up = cache.forget_if_dropped(n);
        let (load, (written, loaded)) = cache
            .submit(n, store.lost_transactions(), |shard| {
                let load = cache
                    .prepare_write(shard, n, &mut op.steps)
                    .map(|(range, loads)| (range, cache.in_flight(n, loads)));
                // Built on the shard's blocks: refused if the store lost what they hold.
                op.unless_lost_since = shard.lost_seen;
                let write = store.write_op(object, op);
                let read = load.as_ref().map(|(range, _)| {
                    let op = ReadOp::new().step(ReadStep::Read {
                        offset: cache.region_offset() + range.start as u64,
                        len: range.len() as u64,
                    });
                    store.read_op(object, op)
                });
                // Both are submitted in the first poll, the write first.
                let both = join(write, async move {
                    match read {
                        Some(read) => Some(read.await),
                        None => None,
                    }
                });
                (load, both)
            })
            .await;
        given_up.done();
        if written.is_err() {
            // What the object holds now is unknown.
            cache.forget(n);
        }
        if let (Some((range, loads)), Some(loaded)) = (load, loaded) {
            let at = cache.region_offset() + range.start as u64;
            match loaded {
                Ok(results) => match extent_bytes(results.into_iter().next(), at, range.len()) {
                    Ok(bytes) => cache.finish_loads(n, &loads, &range, Some(&bytes)),
                    Err(_) => cache.abandon_loads(n, &loads),
                },
                Err(StoreError::NotFound { .. }) => cache.finish_loads(n, &loads, &range, None),
                Err(_) => cache.abandon_loads(n, &loads),
            }
        }
        written.map(|_| ())
    }

    /// [`Inner::write_piece_cached`] for a layout that writes whole metadata blocks only
    /// (`omap-packed`): the blocks the write needs whole and the cache does not know are read
    /// first (in the object's order, like any load), then the write is built and submitted
    /// under the shard lock, where they are known; if one was evicted or changed meanwhile, it
    /// is loaded again.
    async fn write_piece_whole_blocks(
        &self,
        cache: &MetadataCache,
        n: u64,
        object: &ObjectName,
        mut op: WriteOp,
    ) -> Result<(), StoreError> {
        let store = &self.store;
        let layout = &*self.layout;
        let given_up = cache.forget_if_dropped(n);
        // The cache's next load id at the previous attempt (see `loads_before_write`).
        let mut loads_seen = 0;
        for attempt in 0.. {
            let take_over_below = (attempt >= 2).then_some(loads_seen);
            let seen = &mut loads_seen;
            let (step, outcome) = cache
                .submit(n, store.lost_transactions(), |shard| {
                    let load = cache.loads_before_write(shard, n, &op.steps, take_over_below);
                    *seen = cache.next_load_id();
                    if let Some((range, loads)) = load {
                        let mut read = ReadOp::new();
                        layout.cached_fetch_steps(cache.region_offset(), &range, &mut read.steps);
                        let read = store.read_op(object, read);
                        let step = PackedStep::Load(range, cache.in_flight(n, loads));
                        return (step, Either::Left(async move { Err(read.await) }));
                    }
                    let mut op = std::mem::take(&mut op);
                    // Built on the shard's blocks: refused if the store lost what they hold.
                    op.unless_lost_since = shard.lost_seen;
                    // Only here do the cache's blocks change: every block this write needs
                    // whole is known, so what comes back are whole blocks (and nothing to load).
                    let load = cache.prepare_write(shard, n, &mut op.steps);
                    debug_assert!(load.is_none(), "a whole-block write left a load");
                    if let Err(reason) = layout.lower_cached_steps(&mut op.steps) {
                        // What the cache took in is not going to the store: forgotten before
                        // another operation is built on it.
                        cache.forget_locked(shard, n);
                        let nothing = async { Ok(Ok(WriteOutcome { version: 0 })) };
                        let step = PackedStep::Unstorable(reason);
                        return (step, Either::Right(Either::Right(nothing)));
                    }
                    let write = store.write_op(object, op);
                    let write = async move { Ok(write.await) };
                    (PackedStep::Write, Either::Right(Either::Left(write)))
                })
                .await;
            match (step, outcome) {
                (PackedStep::Write, Ok(written)) => {
                    given_up.done();
                    if written.is_err() {
                        cache.forget(n);
                    }
                    return written.map(|_| ());
                }
                (PackedStep::Unstorable(reason), _) => {
                    given_up.done();
                    return Err(StoreError::InvalidOperation {
                        object: object.to_string(),
                        reason: format!("metadata cache left an unstorable step: {reason}"),
                    });
                }
                (PackedStep::Load(range, loads), Err(loaded)) => match loaded {
                    Ok(results) => match layout.cached_fetched(
                        &mut results.into_iter(),
                        cache.region_offset(),
                        &range,
                    ) {
                        Ok(bytes) => cache.finish_loads(n, &loads, &range, Some(&bytes)),
                        Err(reason) => {
                            cache.abandon_loads(n, &loads);
                            return Err(StoreError::Corrupt(format!(
                                "object `{object}`: its metadata values: {reason}"
                            )));
                        }
                    },
                    Err(StoreError::NotFound { .. }) => cache.finish_loads(n, &loads, &range, None),
                    Err(e) => {
                        cache.abandon_loads(n, &loads);
                        return Err(e);
                    }
                },
                _ => unreachable!("each step has its own outcome"),
            }
        }
        unreachable!("the attempts are unbounded")
    }

    /// Decrypt the written sectors of a run into `out`, from where `stored` says the
    /// ciphertext and metadata are (zeros for the unwritten sectors).
    fn decrypt_written(
        &self,
        lba: u64,
        stored: Stored<'_>,
        out: &mut [u8],
    ) -> Result<Vec<u64>, ImageError> {
        let ss = self.sector_size;
        let ml = self.cipher.metadata_len();
        let slot = ss + ml;
        let n = out.len() / ss;
        let written = |out: &&mut [u8], i: usize| match stored {
            Stored::InOutput(metadata) => {
                !(all_zero(&metadata[i * ml..(i + 1) * ml]) && all_zero(&out[i * ss..(i + 1) * ss]))
            }
            Stored::Apart(ciphertext, metadata) => {
                !(all_zero(&metadata[i * ml..(i + 1) * ml])
                    && all_zero(&ciphertext[i * ss..(i + 1) * ss]))
            }
            Stored::Slots(slots) => !all_zero(&slots[i * slot..(i + 1) * slot]),
        };
        let mut out = out;
        self.decrypt_runs(lba, n, &mut out, written, |out, run, is_written, first| {
            let sectors = run.start * ss..run.end * ss;
            match (is_written, stored) {
                (false, Stored::InOutput(_)) => Ok(()),
                (false, _) => {
                    out[sectors].fill(0);
                    Ok(())
                }
                (true, Stored::Apart(ciphertext, metadata)) => self.cipher.decrypt_sectors_to(
                    first,
                    &ciphertext[sectors.clone()],
                    &mut out[sectors],
                    &metadata[run.start * ml..run.end * ml],
                ),
                (true, Stored::InOutput(metadata)) => self.cipher.decrypt_sectors(
                    first,
                    &mut out[sectors],
                    &metadata[run.start * ml..run.end * ml],
                ),
                (true, Stored::Slots(slots)) => self.cipher.decrypt_sectors_from_slots(
                    first,
                    &slots[run.start * slot..run.end * slot],
                    &mut out[sectors],
                ),
            }
        })
    }

    /// Whether an `unaligned` run of `len` bytes read into a buffer the read returns is
    /// decrypted in the store's buffer ([`Inner::decrypt_slots_down`]): from 512 KiB, when at
    /// least half its sectors can be decrypted straight down (from a 4 MiB run of 4 KiB
    /// sectors, a 64 KiB run of 512-byte ones). Runs of 512 KiB to 2 MiB of 4 KiB sectors,
    /// moved down and decrypted in place all through, cost AEGIS-128L 30 points more than a
    /// fresh buffer (docs/BENCHMARKS.md, "`unaligned` writes straight into their slots").
    fn slots_down_pays(&self, len: usize) -> bool {
        let (ss, ml) = (self.sector_size, self.cipher.metadata_len());
        len >= SLOTS_DOWN_MIN_BYTES && len / ss * ml >= 2 * UNALIGNED_DIRECT_GROUP * ss
    }

    /// The `unaligned` run of `len` bytes in `slots` (the store's buffer), each written
    /// sector decrypted in its slot, for a reply sent from the slots ([`crate::ReadReply`]).
    /// An unwritten sector's slot is all zeros already, its plaintext included.
    fn decrypt_in_slots(
        &self,
        lba: u64,
        slots: &mut Vec<u8>,
        len: usize,
    ) -> Result<Vec<u64>, ImageError> {
        let slot = self.sector_size + self.cipher.metadata_len();
        let written = |slots: &Vec<u8>, i: usize| !all_zero(&slots[i * slot..(i + 1) * slot]);
        self.decrypt_runs(
            lba,
            len / self.sector_size,
            slots,
            written,
            |slots, run, is_written, first| match is_written {
                true => self
                    .cipher
                    .decrypt_sectors_in_slots(first, &mut slots[run.start * slot..run.end * slot]),
                false => Ok(()),
            },
        )
    }

    /// [`Inner::decrypt_slots_owned`] in the store's buffer itself, which the read then returns:
    /// from the first sector to the last, each sector's plaintext goes down to `i * S`, onto
    /// its own slot and lower ones only, never onto a slot not yet read. A group of four or
    /// more sectors whose plaintext lies wholly below its slots (from sector 512 on, with 32
    /// bytes of metadata per 4 KiB sector) is decrypted straight there; below that, each
    /// group's metadata is set aside, its ciphertext moved down and decrypted in place. Why:
    /// a fresh buffer of a 4 MiB run missed the cache on every store (docs/BENCHMARKS.md,
    /// "`unaligned` writes straight into their slots").
    fn decrypt_slots_down(
        &self,
        lba: u64,
        mut buf: Vec<u8>,
        len: usize,
    ) -> Result<(Vec<u8>, Vec<u64>), ImageError> {
        /// Sectors moved down and decrypted at once: small enough to stay in the core's cache
        /// between the two.
        const GROUP_BYTES: usize = 32 << 10;
        let ss = self.sector_size;
        let ml = self.cipher.metadata_len();
        let slot = ss + ml;
        let group = (GROUP_BYTES / ss).max(1);
        let mut metadata = vec![0u8; group * ml];
        let written = |buf: &Vec<u8>, i: usize| !all_zero(&buf[i * slot..(i + 1) * slot]);
        let failed = self.decrypt_runs(
            lba,
            len / ss,
            &mut buf,
            written,
            |buf, run, is_written, first| {
                if !is_written {
                    buf[run.start * ss..run.end * ss].fill(0);
                    return Ok(());
                }
                let mut failed = Vec::new();
                let mut start = run.start;
                while start < run.end {
                    let number = first + (start - run.start) as u64;
                    let direct = ((start * slot / ss).min(run.end) - start)
                        / UNALIGNED_DIRECT_GROUP
                        * UNALIGNED_DIRECT_GROUP;
                    let direct_end = start + direct;
                    let done = if direct > 0 {
                        let (plaintext, slots) = buf.split_at_mut(start * slot);
                        let result = self.cipher.decrypt_sectors_from_slots(
                            number,
                            &slots[..(direct_end - start) * slot],
                            &mut plaintext[start * ss..direct_end * ss],
                        );
                        (direct_end, result)
                    } else {
                        let end = (start + group).min(run.end);
                        let metadata = &mut metadata[..(end - start) * ml];
                        for (i, m) in (start..end).zip(metadata.chunks_exact_mut(ml)) {
                            m.copy_from_slice(&buf[i * slot + ss..(i + 1) * slot]);
                        }
                        for i in start..end {
                            buf.copy_within(i * slot..i * slot + ss, i * ss);
                        }
                        let result = self.cipher.decrypt_sectors(
                            number,
                            &mut buf[start * ss..end * ss],
                            metadata,
                        );
                        (end, result)
                    };
                    match done {
                        (end, Ok(())) => start = end,
                        (end, Err(CryptoError::Authentication { sectors })) => {
                            failed.extend(sectors);
                            start = end;
                        }
                        (_, Err(e)) => return Err(e),
                    }
                }
                match failed.is_empty() {
                    true => Ok(()),
                    false => Err(CryptoError::Authentication { sectors: failed }),
                }
            },
        )?;
        buf.truncate(len);
        Ok((buf, failed))
    }

    /// [`Inner::decrypt_written`] from slots into a new buffer of `len` bytes, appended run by
    /// run: the cipher writes the written sectors' plaintext into memory that held nothing,
    /// and only unwritten sectors are zeroed. Why: zeroing the whole buffer first was a pass
    /// of its own (12% of the samples of 1 MiB `unaligned` reads as the NBD server makes them,
    /// docs/BENCHMARKS.md).
    fn decrypt_slots_owned(
        &self,
        lba: u64,
        slots: &[u8],
        len: usize,
    ) -> Result<(Vec<u8>, Vec<u64>), ImageError> {
        let ss = self.sector_size;
        let slot = ss + self.cipher.metadata_len();
        let written = |_: &Vec<u8>, i: usize| !all_zero(&slots[i * slot..(i + 1) * slot]);
        let mut out = Vec::with_capacity(len);
        let failed = self.decrypt_runs(
            lba,
            len / ss,
            &mut out,
            written,
            |out, run, is_written, first| {
                if !is_written {
                    out.resize(run.end * ss, 0);
                    return Ok(());
                }
                // On an authentication error the run is appended all the same, the failed
                // sectors as zeros.
                let run = &slots[run.start * slot..run.end * slot];
                self.cipher
                    .decrypt_sectors_from_slots_append(first, run, out)
            },
        )?;
        Ok((out, failed))
    }

    /// Walk the `n` sectors of a read from `lba` as runs of written and unwritten ones (as
    /// `written` tells them apart in `out`) and hand each to `decrypt` with the cipher's number
    /// of its first sector; the sectors that failed authentication, logged.
    fn decrypt_runs<T>(
        &self,
        lba: u64,
        n: usize,
        out: &mut T,
        written: impl Fn(&T, usize) -> bool,
        mut decrypt: impl FnMut(&mut T, std::ops::Range<usize>, bool, u64) -> Result<(), CryptoError>,
    ) -> Result<Vec<u64>, ImageError> {
        let mut failed = Vec::new();
        let mut i = 0;
        while i < n {
            let start = i;
            let is_written = written(out, i);
            while i < n && written(out, i) == is_written {
                i += 1;
            }
            let first = lba + start as u64 + self.iv_sector_base;
            match decrypt(out, start..i, is_written, first) {
                Ok(()) => {}
                Err(CryptoError::Authentication { sectors }) => {
                    failed.extend(sectors.into_iter().map(|s| s - self.iv_sector_base))
                }
                Err(e) => return Err(ImageError::crypto(&self.name)(e)),
            }
        }
        if !failed.is_empty() {
            tracing::error!(
                target: crate::INTEGRITY_LOG_TARGET,
                image = %self.name,
                lbas = ?failed,
                "sectors failed authentication"
            );
        }
        Ok(failed)
    }

    /// The plaintext of one sector, for a read-modify-write; a sector that fails
    /// authentication cannot be partly updated.
    async fn old_sector(&self, lba: u64) -> Result<Vec<u8>, ImageError> {
        let mut sector = vec![0u8; self.sector_size];
        let failed = self.read_sectors(lba, &mut sector).await?;
        if !failed.is_empty() {
            return Err(ImageError::Integrity {
                image: self.name.clone(),
                lbas: failed,
                sector_size: self.sector_size,
                in_write: true,
            });
        }
        Ok(sector)
    }

    /// Store `fill` into `[offset, offset + len)`, which lies in the image and is not empty.
    /// The caller holds the range lock on the sectors touched.
    async fn store_range(&self, offset: u64, len: u64, fill: Fill<'_>) -> Result<(), ImageError> {
        let ss = self.sector_size as u64;
        let end_byte = offset + len;
        let (first, end) = (offset / ss, end_byte.div_ceil(ss));
        let head_partial = !offset.is_multiple_of(ss) || end_byte < (first + 1) * ss;
        let tail_partial = !end_byte.is_multiple_of(ss) && end - 1 != first;
        // Partial sectors keep their other bytes: read them before anything is written.
        let head = match head_partial {
            true => Some(self.old_sector(first).await?),
            false => None,
        };
        let tail = match tail_partial {
            true => Some(self.old_sector(end - 1).await?),
            false => None,
        };
        // Sectors that are encrypted and written (all of them, unless discarding).
        let encrypted_sectors = match fill {
            Fill::Unwritten => head.is_some() as u64 + tail.is_some() as u64,
            _ => end - first,
        };
        self.reserve_nonces(encrypted_sectors).await?;
        let build = |piece| {
            self.piece_op(
                piece,
                offset,
                end_byte,
                fill,
                (first, &head),
                (end - 1, &tail),
            )
        };
        if let Some(piece) = self.sectors_in_one_object(first, end) {
            // An IO inside one object, the usual case: its operation awaited as it is.
            return self.write_piece(piece, build(piece)?).await;
        }
        let mut pieces = self.pieces(first, end).peekable();
        while pieces.peek().is_some() {
            let mut ops = Vec::with_capacity(OBJECTS_IN_FLIGHT);
            for piece in pieces.by_ref().take(OBJECTS_IN_FLIGHT) {
                ops.push(self.write_piece(piece, build(piece)?));
            }
            // Wait for every operation of the batch even if one fails, so no operation is
            // still in flight when the error is returned (each object is old or new).
            if let Some(e) = join_all(ops).await.into_iter().find_map(Result::err) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Apply one object's operation of a request (through the metadata cache when it is in
    /// use).
    async fn write_piece(&self, piece: Piece, op: WriteOp) -> Result<(), ImageError> {
        let object = self.data_object(piece.object);
        let only_if_exists = matches!(op.steps.first(), Some(WriteStep::AssertExists));
        if let (Some(map), false) = (&self.object_map, only_if_exists) {
            // Before the operation is submitted: block status never misses the object.
            map.note(piece.object);
        }
        // The cache whether or not writes are refused by now: this write was admitted while
        // they were not, and a write that went around the cache would leave it stale once the
        // lock is renewed again (the sector it wrote would then read as tampered).
        let written = match self.metadata_cache.as_ref() {
            Some(cache) if self.layout.needs_metadata_cache() => {
                self.write_piece_whole_blocks(cache, piece.object, &object, op)
                    .await
            }
            Some(cache) => {
                self.write_piece_cached(cache, piece.object, &object, op)
                    .await
            }
            None if self.layout.needs_metadata_cache() => {
                // Only a writer has the cache, and the layout cannot write without it.
                self.check_writable()?;
                return Err(ImageError::Corrupt {
                    image: self.name.clone(),
                    reason: format!(
                        "object `{object}`: layout {} is written through the metadata cache, \
                         and this open has none",
                        self.layout_kind
                    ),
                });
            }
            None => self.store.write_op(&object, op).await.map(|_| ()),
        };
        match written {
            Ok(()) => Ok(()),
            // Discarding in an object that does not exist: nothing to do.
            Err(StoreError::NotFound { .. }) if only_if_exists => Ok(()),
            Err(e) => Err(ImageError::store(&self.name)(e)),
        }
    }

    /// The one operation for one object of a request.
    fn piece_op(
        &self,
        piece: Piece,
        offset: u64,
        end_byte: u64,
        fill: Fill<'_>,
        head: (u64, &Option<Vec<u8>>),
        tail: (u64, &Option<Vec<u8>>),
    ) -> Result<WriteOp, ImageError> {
        let ss = self.sector_size as u64;
        let piece_end = piece.lba + piece.count as u64;
        let mut op = WriteOp::new();
        op.snap_context = self.snap_context();
        // The sectors of this piece that get encrypted content: all, or only partial edges
        // (at most two runs, on the stack).
        let mut runs = [(0u64, 0u64); 2];
        let count = match fill {
            Fill::Unwritten => {
                let mut count = 0;
                for (lba, old) in [head, tail] {
                    if old.is_some() && (piece.lba..piece_end).contains(&lba) {
                        runs[count] = (lba, lba + 1);
                        count += 1;
                    }
                }
                count
            }
            _ => {
                runs[0] = (piece.lba, piece_end);
                1
            }
        };
        let encrypted = &runs[..count];
        // Discard steps go after the edge sectors' writes: those create the object if it is
        // missing, and zeroing or omap removal on a missing object fails on some stores.
        let mut discard = Vec::new();
        if let Fill::Unwritten = fill {
            // Whole sectors between the partial edges go back to the unwritten state.
            let lo = piece.lba + encrypted.iter().any(|&(l, _)| l == piece.lba) as u64;
            let hi = piece_end
                - encrypted
                    .iter()
                    .any(|&(l, _)| l + 1 == piece_end && l >= lo) as u64;
            if lo < hi {
                let whole_object = hi - lo == self.sectors_per_object() && self.data_offset == 0;
                if encrypted.is_empty() {
                    // Nothing else in this operation: a missing object has nothing to discard.
                    op.steps.push(WriteStep::AssertExists);
                }
                if whole_object {
                    discard.push(WriteStep::Remove);
                } else {
                    let index = piece.index + (lo - piece.lba) as u32;
                    self.layout.discard(&mut discard, index, (hi - lo) as u32);
                }
            }
        }
        for &(start, stop) in encrypted {
            let n = (stop - start) as usize;
            let old_sector = |lba: u64| {
                [head, tail]
                    .into_iter()
                    .find(|(l, old)| *l == lba && old.is_some())
                    .and_then(|(_, old)| old.as_deref())
                    .expect("partial sectors were read before building the operation")
            };
            let (lo, hi) = (offset.max(start * ss), end_byte.min(stop * ss));
            let first = start + self.iv_sector_base;
            let index = piece.index + (start - piece.lba) as u32;
            if let Fill::Data(data) = fill {
                if lo == start * ss && hi == stop * ss {
                    // Whole sectors of the caller's data: encrypted from its buffer into the
                    // one the store gets, one pass (copying first was a full extra pass, as
                    // costly as AEGIS-128L itself). Appended into a fresh buffer: AEGIS-128L,
                    // AES-XTS and AES-GCM write it directly, the other suites zero it 64 KiB
                    // at a time just before the cipher overwrites it.
                    let plaintext = &data[(lo - offset) as usize..(hi - offset) as usize];
                    self.layout
                        .write_encrypted(&mut op.steps, index, &*self.cipher, first, plaintext)
                        .map_err(ImageError::crypto(&self.name))?;
                    continue;
                }
            }
            // Old bytes of the partial sector before the request's bytes, the request's
            // bytes (or zeros), old bytes after: built in one pass, no zero-fill first (a full
            // extra pass over the data, measured at 7-12% of a large write's CPU), then
            // encrypted in place.
            let mut plain = Vec::with_capacity(n * ss as usize);
            if lo > start * ss {
                plain.extend_from_slice(&old_sector(start)[..(lo - start * ss) as usize]);
            }
            match fill {
                Fill::Data(data) => {
                    plain.extend_from_slice(&data[(lo - offset) as usize..(hi - offset) as usize])
                }
                Fill::Zeros | Fill::Unwritten => plain.resize(plain.len() + (hi - lo) as usize, 0),
            }
            if hi < stop * ss {
                plain.extend_from_slice(&old_sector(stop - 1)[(hi - (stop - 1) * ss) as usize..]);
            }
            debug_assert_eq!(plain.len(), n * ss as usize);
            let mut metadata = vec![0u8; n * self.cipher.metadata_len()];
            self.cipher
                .encrypt_sectors(first, &mut plain, &mut metadata)
                .map_err(ImageError::crypto(&self.name))?;
            self.layout.write(&mut op.steps, index, plain, metadata);
        }
        op.steps.extend(discard);
        Ok(op)
    }

    /// Return whole sectors `[first, end)` to the unwritten state (resize).
    pub(crate) async fn discard_sectors(&self, first: u64, end: u64) -> Result<(), ImageError> {
        if first >= end {
            return Ok(());
        }
        let ss = self.sector_size as u64;
        self.store_range(first * ss, (end - first) * ss, Fill::Unwritten)
            .await
    }
}

impl Image {
    /// Read `buf.len()` bytes at `offset`. Unwritten sectors read as zeros.
    ///
    /// On [`ImageError::Integrity`] the named sectors failed authentication: their bytes in
    /// `buf` are zeros and every other byte was read correctly.
    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        let inner = &self.inner;
        let len = buf.len() as u64;
        inner.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let ss = inner.sector_size as u64;
        let first = offset / ss;
        let failed = if offset.is_multiple_of(ss) && len.is_multiple_of(ss) {
            inner.read_sectors(first, buf).await?
        } else {
            let end = (offset + len).div_ceil(ss);
            let mut sectors = vec![0u8; ((end - first) * ss) as usize];
            let failed = inner.read_sectors(first, &mut sectors).await?;
            let at = (offset - first * ss) as usize;
            buf.copy_from_slice(&sectors[at..at + buf.len()]);
            failed
        };
        inner.check_reads_watched().await?;
        if failed.is_empty() {
            Ok(())
        } else {
            Err(inner.integrity(failed))
        }
    }

    /// Write `data` at `offset`. Partial sectors are read, merged and rewritten, serialized
    /// with every other write touching them.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), ImageError> {
        self.modify(offset, data.len() as u64, Fill::Data(data))
            .await
    }

    /// [`Image::read`] into a buffer it returns (the NBD server's read replies): for whole
    /// sectors inside one object, the usual case, the store's own buffer decrypted in place,
    /// with no buffer of the caller's to allocate and zero. On [`ImageError::Integrity`] the
    /// buffer is dropped; [`Image::read`] keeps the sectors that did authenticate.
    pub async fn read_owned(&self, offset: u64, len: usize) -> Result<Vec<u8>, ImageError> {
        Ok(self
            .read_returning(offset, len, SlotReply::Refused)
            .await?
            .into_vec())
    }

    /// [`Image::read_owned`] for a reply that goes out in pieces (the NBD server's, one
    /// vectored write): an `unaligned` run inside one object comes back as the store's buffer
    /// with each sector decrypted in its slot; anything else as one buffer.
    pub async fn read_reply(&self, offset: u64, len: usize) -> Result<ReadReply, ImageError> {
        self.read_returning(offset, len, SlotReply::Allowed).await
    }

    async fn read_returning(
        &self,
        offset: u64,
        len: usize,
        slots: SlotReply,
    ) -> Result<ReadReply, ImageError> {
        let inner = &self.inner;
        inner.check_range(offset, len as u64)?;
        let Some(piece) = inner.whole_sectors_in_one_object(offset, len as u64) else {
            let mut buf = vec![0u8; len];
            self.read(offset, &mut buf).await?;
            return Ok(ReadReply::contiguous(buf));
        };
        let mut out = ReadOutput::Owned {
            len,
            buf: None,
            slots,
        };
        let failed = inner.read_piece(piece, &mut out).await?;
        inner.check_reads_watched().await?;
        if !failed.is_empty() {
            return Err(inner.integrity(failed));
        }
        Ok(out.into_reply(inner.sector_size))
    }

    /// Spare capacity, in bytes, that a buffer handed to [`Image::write_owned`] for a write
    /// of `len` bytes at `offset` should have so that it goes to the store without being
    /// moved: in layout `omap-tail`, a write of a whole object carries its metadata after
    /// its data, in the same buffer; in layout `unaligned`, a large write's sectors are
    /// spread into their slots, each sector's metadata after it, in that buffer. 0 for every
    /// other write and layout.
    pub fn write_headroom(&self, offset: u64, len: u64) -> usize {
        let inner = &self.inner;
        match inner.whole_sectors_in_one_object(offset, len) {
            Some(piece) => inner.layout.data_headroom(piece.index, piece.count),
            None => 0,
        }
    }

    /// [`Image::write`] of a buffer the caller hands over (an import's chunk; the NBD
    /// server's payload, through [`Image::write_payload`]).
    /// Whole sectors inside one object, the usual case, are encrypted in place in `data`,
    /// which then goes to the store as the data of the object's operation: no second buffer
    /// of the write's size. Anything else is written as [`Image::write`] writes it.
    pub async fn write_owned(&self, offset: u64, data: Vec<u8>) -> Result<(), ImageError> {
        let len = data.len() as u64;
        let Some(piece) = self.inner.whole_sectors_in_one_object(offset, len) else {
            return self.write(offset, &data).await;
        };
        self.write_in_one_object(piece, offset, len, |layout, steps, index, cipher, first| {
            layout.write_encrypted_owned(steps, index, cipher, first, data)
        })
        .await
    }

    /// Write `piece`, the whole sectors `[offset, offset + len)` inside one object: hold them,
    /// reserve their nonces and store the steps `encrypt` adds (given the layout, the steps,
    /// the sectors' index in the object, the cipher and the first sector's number for it) in
    /// one operation.
    async fn write_in_one_object(
        &self,
        piece: Piece,
        offset: u64,
        len: u64,
        encrypt: impl FnOnce(
            &dyn SectorLayout,
            &mut Vec<WriteStep>,
            u32,
            &dyn SectorCipher,
            u64,
        ) -> Result<(), CryptoError>,
    ) -> Result<(), ImageError> {
        let inner = &self.inner;
        let Some(_held) = self.lock_for_write(offset, len).await? else {
            return Ok(());
        };
        inner.reserve_nonces(len / inner.sector_size as u64).await?;
        let mut op = WriteOp::new();
        op.snap_context = inner.snap_context();
        let first = piece.lba + inner.iv_sector_base;
        encrypt(
            &*inner.layout,
            &mut op.steps,
            piece.index,
            &*inner.cipher,
            first,
        )
        .map_err(ImageError::crypto(&inner.name))?;
        inner.write_piece(piece, op).await
    }

    /// Where a receiver should put the plaintext of a write of `len` bytes at `offset` that
    /// it will hand to [`Image::write_payload`] (the NBD server, before it reads a payload
    /// off the socket): together, with [`Image::write_headroom`] to spare; or, for whole
    /// sectors inside one object in layout `unaligned`, each sector at the start of its slot
    /// (sector and metadata), where it is then encrypted in place.
    pub fn write_placement(&self, offset: u64, len: u64) -> PayloadPlacement {
        let inner = &self.inner;
        match inner.whole_sectors_in_one_object(offset, len) {
            Some(piece) => inner.layout.payload_placement(piece.index, piece.count),
            None => PayloadPlacement::Contiguous { spare: 0 },
        }
    }

    /// [`Image::write_owned`] of a payload placed as [`Image::write_placement`] said: slots
    /// are encrypted where they lie and go to the store as the object's extent. A payload
    /// in slots that the image did not ask for (another shape, or a range it does not place
    /// in slots) is gathered and written as [`Image::write`] writes it.
    pub async fn write_payload(
        &self,
        offset: u64,
        payload: WritePayload,
    ) -> Result<(), ImageError> {
        let Some((sector, slot)) = payload.slots() else {
            return self.write_owned(offset, payload.into_buf()).await;
        };
        let inner = &self.inner;
        let len = payload.len() as u64;
        let asked = PayloadPlacement::Slots { sector, slot };
        let piece = inner
            .whole_sectors_in_one_object(offset, len)
            .filter(|p| inner.layout.payload_placement(p.index, p.count) == asked);
        let Some(piece) = piece else {
            return self.write(offset, &payload.into_contiguous()).await;
        };
        let slots = payload.into_buf();
        self.write_in_one_object(piece, offset, len, |layout, steps, index, cipher, first| {
            layout.write_encrypted_in_slots(steps, index, cipher, first, slots)
        })
        .await
    }

    /// Make `[offset, offset + len)` read as zeros and free its space where the store can
    /// (whole objects are removed). Partial sectors at the ends are zeroed in place.
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), ImageError> {
        self.modify(offset, len, Fill::Unwritten).await
    }

    /// Make `[offset, offset + len)` read as zeros. With `may_unmap` this is a discard;
    /// without, the zeros are written (encrypted) so the range stays allocated. On foreign
    /// LUKS volumes zeros are always written encrypted, so every tool reads them as zeros.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), ImageError> {
        // A foreign LUKS volume's unwritten state (stored zeros) reads as noise in the tools
        // that made it, so zeros are written encrypted there.
        let fill = if may_unmap && !self.inner.foreign {
            Fill::Unwritten
        } else {
            Fill::Zeros
        };
        self.modify(offset, len, fill).await
    }

    /// Check that `[offset, offset + len)` may be written and hold its sectors against every
    /// other write touching them. `None`: nothing to write (`len` is 0).
    async fn lock_for_write(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Option<WriteHold<'_>>, ImageError> {
        let inner = &self.inner;
        inner.wait_writable().await?;
        inner.check_range(offset, len)?;
        if len == 0 {
            return Ok(None);
        }
        let ss = inner.sector_size as u64;
        let (start, end) = (offset / ss, (offset + len).div_ceil(ss));
        let ranges = &inner.ranges;
        let held = if !offset.is_multiple_of(ss) || !len.is_multiple_of(ss) {
            // Partial sectors are read, merged and written back: no other write of them may
            // come in between.
            ranges.lock_exclusive(start, end).await
        } else if inner.whole_sectors_in_one_object(offset, len).is_some() {
            ranges.hold_whole_sectors(start, end).await
        } else {
            WriteHold::Range {
                _range: ranges.lock(start, end).await,
            }
        };
        // The image may have shrunk while we waited.
        inner.check_range(offset, len)?;
        Ok(Some(held))
    }

    async fn modify(&self, offset: u64, len: u64, fill: Fill<'_>) -> Result<(), ImageError> {
        let inner = &self.inner;
        let Some(_held) = self.lock_for_write(offset, len).await? else {
            return Ok(());
        };
        if let Fill::Zeros = fill {
            // Bounded memory: at most a batch of objects' worth of encrypted zeros at once.
            let objects =
                (ZEROS_IN_FLIGHT_BYTES / inner.object_size).clamp(1, OBJECTS_IN_FLIGHT as u64);
            let step = inner.object_size * objects;
            // Pieces end on object boundaries, which for a foreign volume whose data starts
            // inside an object (a LUKS1 file: at 2 MiB, objects of 4 MiB) are not multiples of
            // `step` in image bytes: split there, one object took two store operations, with
            // no range lock between them when the request lay in that one object.
            let base = inner.data_offset;
            let mut at = offset;
            while at < offset + len {
                let next = ((at + base) / step + 1) * step - base;
                let stop = next.min(offset + len);
                inner.store_range(at, stop - at, fill).await?;
                at = stop;
            }
            return Ok(());
        }
        inner.store_range(offset, len, fill).await
    }

    /// Make every write acknowledged so far durable. Once the store has lost acknowledged
    /// writes (its own flush reports that first), every later flush fails too: see
    /// `ImageError::WritesLost`.
    pub async fn flush(&self) -> Result<(), ImageError> {
        let inner = &self.inner;
        inner.check_nothing_lost()?;
        inner
            .store
            .flush()
            .await
            .map_err(ImageError::store(&inner.name))?;
        inner.check_nothing_lost()
    }
}
