//! `omap-packed` (ours, not the paper's): ciphertext at the sector's own offset, as in `omap`;
//! the metadata of each run of [`SECTORS_PER_VALUE`] sectors packed into one omap value, key
//! `{run:08x}` (zeros for the sectors never written; no key: all of them unwritten).
//!
//! Why: on RADOS the metadata of a write is one more item in its operation, and what that item
//! costs the OSD depends on its kind and size. One small omap value (512 bytes with 32 bytes of
//! metadata per sector) cost less than a whole 4 KiB metadata block as a second extent (what
//! `object-end` writes from its cache) from 4 KiB to 64 KiB writes, in the RADOS bench
//! (docs/BENCHMARKS.md, "RADOS write operations"), while a key per sector (`omap`) grows with
//! the IO size.
//!
//! A write that covers a run only in part must send the run's whole value, so it needs the
//! others' metadata: images in this layout are written only through the writer's metadata
//! cache (`crate::metadata_cache`), which holds the values as blocks of a virtual metadata
//! region at [`VIRTUAL_REGION`] (never sent to a store: [`OmapPacked::lower`] turns its
//! steps into omap steps) and loads a value before a write that needs it. Reads without the
//! cache (read-only opens, snapshots) fetch the values of their runs.
//!
//! A value whose sectors' nonces count up from its first sector's (the sectors were sealed in
//! one run: a write covering the whole run, `Suite::counted_nonce_len`) is stored compact:
//! the first sector's metadata whole, then for each further sector its metadata without the
//! nonce. For AEGIS-128L that is 16 + 16 x 16 = 272 bytes instead of 512. Why: on RADOS the
//! metadata's bytes cost the OSDs in proportion to their size (docs/BENCHMARKS.md, RADOS
//! bench cases `j`, `n` and `o`), and large writes set many values. A reader tells the two
//! forms apart by length (they differ whenever the run has two sectors and the suite a counted
//! nonce); the compact form is lossless, so the cache and the cipher only ever see full
//! metadata. A changed byte of the first nonce fails every sector of the run, still detected.
//!
//! `omap-tail` is the same layout but for one kind of write: a write covering every sector of
//! an object stores the object's metadata as one extent after its data, its *tail* (each
//! run's value in its stored form, one after another: [`OmapPacked::tail_range`]), and
//! removes every value of the object in the same operation. Why: on three replicas the 64
//! compact values of a 4 MiB write cost the OSDs 5-9% of the write, the same bytes as an
//! extent 1-6% (docs/BENCHMARKS.md, RADOS bench cases `n`, `t` and `u`). Every other write
//! stores values as `omap-packed` does, and a value wins over the tail: a reader (and the
//! cache's load) fetches both and lays the values over the tail. So a discard cannot remove a
//! run's value here (the tail would show through): it stores an empty value, which reads as
//! "every sector of the run unwritten". What it costs: a read that misses the cache fetches
//! a third item (the tail's slots).

use ivdisk_crypto::nonce_add;
use ivdisk_store::{OmapPairs, ReadResult, ReadStep, WriteStep};

use super::object_end::{discard_apart, write_apart};
use super::omap::{index_of, key, key_digits};
use super::{
    extent_bytes, take_or_place_extents, Decoded, ObjectGeometry, ReadOutput, SectorLayout,
    DAMAGED_METADATA,
};

/// Sectors whose metadata share one omap value.
pub(crate) const SECTORS_PER_VALUE: u32 = 16;

/// The most metadata bytes per sector this layout stores compact (the longest suite has 48).
const MAX_METADATA_LEN: usize = 64;

/// The most nonce bytes per sector that count up (AEGIS-256's 32).
const MAX_NONCE_LEN: usize = 32;

/// Where the metadata cache places this layout's metadata region: past any object's data, so
/// a step there is always metadata; [`OmapPacked::lower`] maps it to omap values.
pub(crate) const VIRTUAL_REGION: u64 = 1 << 62;

/// The tail is written padded with zeros up to a multiple of this. Why: BlueStore stores a
/// write's part that ends inside one of its 4 KiB allocation units as a small write, which
/// reads the unit first and goes through RocksDB's log (a deferred write); an aligned tail
/// is written once, in place, as the data is (OSD counters: docs/BENCHMARKS.md).
pub(crate) const TAIL_ALIGN: u64 = 4096;

/// Where an object's metadata goes when one write covers every sector of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WholeObjects {
    /// In values, as any other write's (`omap-packed`).
    AsValues,
    /// In one extent at the object's end, its tail, every value of the object removed in the
    /// same operation (`omap-tail`).
    AtTail,
}

#[derive(Debug)]
pub(crate) struct OmapPacked(pub ObjectGeometry, pub WholeObjects);

impl OmapPacked {
    fn data_offset(&self, sector: u32) -> u64 {
        sector as u64 * self.0.sector_size as u64
    }

    /// Where the cache keeps a sector's metadata (never sent to a store).
    fn metadata_offset(&self, sector: u32) -> u64 {
        VIRTUAL_REGION + sector as u64 * self.0.metadata_len as u64
    }

    /// Bytes of one full value.
    pub(crate) fn value_len(&self) -> usize {
        SECTORS_PER_VALUE as usize * self.0.metadata_len
    }

    /// Bytes of the object's metadata region (the cache's view).
    pub(crate) fn region_len(&self) -> usize {
        self.0.sectors_per_object as usize * self.0.metadata_len
    }

    /// Bytes of run `run`'s value (the last run of an object may be shorter).
    fn value_len_of(&self, run: u32) -> usize {
        let start = run as usize * self.value_len();
        (start + self.value_len()).min(self.region_len()) - start
    }

    /// Bytes of run `run`'s value in compact form, if it has one (two sectors or more, and a
    /// counted nonce).
    fn compact_len_of(&self, run: u32) -> Option<usize> {
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        let sectors = self.value_len_of(run) / ml;
        (nl > 0 && nl < ml && sectors >= 2 && ml <= MAX_METADATA_LEN && nl <= MAX_NONCE_LEN)
            .then(|| ml + (sectors - 1) * (ml - nl))
    }

    /// Bytes of run `run`'s slot in the tail: its compact form where the run has one (a
    /// suite with a counted nonce), else its full value.
    fn slot_len_of(&self, run: u32) -> usize {
        self.compact_len_of(run)
            .unwrap_or_else(|| self.value_len_of(run))
    }

    /// The runs of the object.
    fn all_runs(&self) -> std::ops::Range<u32> {
        0..self.0.sectors_per_object.div_ceil(SECTORS_PER_VALUE)
    }

    /// Where the slots of runs `runs` lie in the object: the tail starts after the last
    /// sector's data, and every run's slot but the last has the first one's length.
    pub(crate) fn tail_range(&self, runs: &std::ops::Range<u32>) -> std::ops::Range<u64> {
        let stride = self.slot_len_of(0) as u64;
        let start = self.0.sectors_per_object as u64 * self.0.sector_size as u64;
        let last = runs.end - 1;
        start + runs.start as u64 * stride
            ..start + last as u64 * stride + self.slot_len_of(last) as u64
    }

    /// `value` (a full value of run `run`) in compact form, as the parts to join, if its
    /// sectors' nonces count up from the first one's: the first sector's metadata whole, then
    /// each further sector's without its nonce. Parts, so the caller appends them where the
    /// value goes (no buffer in between to clear and copy).
    fn compact<'v>(&self, run: u32, value: &'v [u8]) -> Option<impl Iterator<Item = &'v [u8]>> {
        self.compact_len_of(run)?;
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        if !nonces_count_up(value, ml, nl) {
            return None;
        }
        let rest = value
            .chunks_exact(ml)
            .skip(1)
            .map(move |sector| &sector[nl..]);
        Some(std::iter::once(&value[..ml]).chain(rest))
    }

    /// The full value of run `run` from its compact form `stored` into `out`.
    fn expand(&self, run: u32, stored: &[u8], out: &mut [u8]) {
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        let out = &mut out[..self.value_len_of(run)];
        out[..ml].copy_from_slice(&stored[..ml]);
        let mut nonce = [0u8; MAX_NONCE_LEN];
        let nonce = &mut nonce[..nl];
        nonce.copy_from_slice(&stored[..nl]);
        for (sector, rest) in out
            .chunks_exact_mut(ml)
            .skip(1)
            .zip(stored[ml..].chunks_exact(ml - nl))
        {
            nonce_add(nonce, 1);
            sector[..nl].copy_from_slice(nonce);
            sector[nl..].copy_from_slice(rest);
        }
    }

    /// The runs holding sectors `first..first + count`.
    fn runs(first: u32, count: u32) -> std::ops::Range<u32> {
        first / SECTORS_PER_VALUE..(first + count).div_ceil(SECTORS_PER_VALUE)
    }

    /// The read steps fetching the metadata of runs `runs`: their values, and (`omap-tail`)
    /// their slots in the tail.
    fn runs_steps(&self, steps: &mut Vec<ReadStep>, runs: std::ops::Range<u32>) {
        if self.1 == WholeObjects::AtTail {
            steps.push(ReadStep::OmapGetByKeys(runs.clone().map(key).collect()));
            let tail = self.tail_range(&runs);
            steps.push(ReadStep::Read {
                offset: tail.start,
                len: tail.end - tail.start,
            });
        } else {
            steps.push(ReadStep::OmapGetByKeys(runs.map(key).collect()));
        }
    }

    /// Place the metadata of runs `runs` from the results of [`OmapPacked::runs_steps`] into
    /// `out`, which holds region bytes from `base` on and arrives zeroed: the tail's slots
    /// first, the values over them.
    fn place_runs(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        runs: std::ops::Range<u32>,
        base: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        let values = results.next();
        if self.1 == WholeObjects::AtTail {
            self.place_tail(results.next(), runs, base, out)?;
        }
        self.place_values(values, base, out)
    }

    /// The runs whose values hold region bytes `range`.
    fn runs_of(&self, range: &std::ops::Range<usize>) -> std::ops::Range<u32> {
        let v = self.value_len();
        (range.start / v) as u32..range.end.div_ceil(v) as u32
    }

    /// The read steps fetching the metadata of the runs that hold region bytes `range` (whole
    /// values: the cache's blocks are the values).
    pub(crate) fn fetch_steps(&self, range: &std::ops::Range<usize>, steps: &mut Vec<ReadStep>) {
        self.runs_steps(steps, self.runs_of(range));
    }

    /// The region bytes `range` from the results of [`OmapPacked::fetch_steps`] (zeros where
    /// nothing is stored).
    pub(crate) fn fetched_bytes(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        range: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; range.len()];
        self.place_runs(results, self.runs_of(range), range.start, &mut out)?;
        Ok(out)
    }

    /// Copy the tail's slots of runs `runs` (the extents of the read
    /// [`OmapPacked::runs_steps`] made) as full values into `out`, which holds region bytes
    /// from `base` on. A slot of zeros (no tail, or an object shorter than it) is left alone:
    /// its sectors are unwritten unless a value says otherwise.
    fn place_tail(
        &self,
        result: Option<ReadResult>,
        runs: std::ops::Range<u32>,
        base: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        let tail = self.tail_range(&runs);
        let bytes = extent_bytes(result, tail.start, (tail.end - tail.start) as usize)?;
        let mut at = 0;
        for run in runs {
            let slot = &bytes[at..at + self.slot_len_of(run)];
            at += slot.len();
            if slot.iter().all(|&b| b == 0) {
                continue;
            }
            let mut expanded = [0u8; SECTORS_PER_VALUE as usize * MAX_METADATA_LEN];
            let value = if self.compact_len_of(run).is_some() {
                self.expand(run, slot, &mut expanded);
                &expanded[..self.value_len_of(run)]
            } else {
                slot
            };
            copy_overlap(run as usize * self.value_len(), value, base, out);
        }
        Ok(())
    }

    /// Copy the values of an omap read into `out`, which holds region bytes from `base` on.
    fn place_values(
        &self,
        result: Option<ReadResult>,
        base: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        let Some(ReadResult::Omap { pairs, .. }) = result else {
            return Err(format!(
                "expected the pairs of an omap read, got {result:?}"
            ));
        };
        for (k, value) in &pairs {
            let run = index_of(k)
                .ok_or_else(|| format!("unexpected omap key {:?}", String::from_utf8_lossy(k)))?;
            if run >= self.0.sectors_per_object.div_ceil(SECTORS_PER_VALUE) {
                return Err(format!(
                    "omap key of run {run} lies past the object's sectors"
                ));
            }
            let expected = self.value_len_of(run);
            let mut expanded = [0u8; SECTORS_PER_VALUE as usize * MAX_METADATA_LEN];
            let value = if value.is_empty() {
                // Every sector of the run unwritten (`omap-tail`'s discards: over the tail).
                expanded[..expected].fill(0);
                &expanded[..expected]
            } else if value.len() == expected {
                value
            } else if Some(value.len()) == self.compact_len_of(run) {
                self.expand(run, value, &mut expanded);
                &expanded[..expected]
            } else {
                // Neither length: damaged, its sectors fail authentication.
                expanded[..expected].fill(DAMAGED_METADATA);
                &expanded[..expected]
            };
            copy_overlap(run as usize * self.value_len(), value, base, out);
        }
        Ok(())
    }

    /// The length of a whole object's tail as written: its slots, padded to [`TAIL_ALIGN`].
    fn padded_tail_len(&self) -> usize {
        let tail = self.tail_range(&self.all_runs());
        (tail.end.next_multiple_of(TAIL_ALIGN) - tail.start) as usize
    }

    /// Append to `out` the padded tail of a write whose metadata steps are the whole values
    /// of every run of the object, in order (what the cache leaves for a write covering the
    /// object), each in its slot's form; `false` (and `out` as it was) for any other write,
    /// or if a run that has a compact form is not compact (its sectors were not sealed in one
    /// run), which then goes out as values.
    fn append_whole_object_tail(&self, steps: &[WriteStep], out: &mut Vec<u8>) -> bool {
        let runs = self.all_runs();
        // Each metadata step: `Some` for a write, `None` for anything else (never whole).
        let mut values = steps.iter().filter_map(|step| match step {
            WriteStep::Write { offset, data } if *offset >= VIRTUAL_REGION => {
                Some(Some((*offset - VIRTUAL_REGION, data)))
            }
            WriteStep::Zero { offset, .. } if *offset >= VIRTUAL_REGION => Some(None),
            _ => None,
        });
        if values.clone().count() != runs.len() {
            return false;
        }
        let before = out.len();
        out.reserve(self.padded_tail_len());
        for run in runs {
            let stored = match values.next() {
                Some(Some((offset, data)))
                    if offset == run as u64 * self.value_len() as u64
                        && data.len() == self.value_len_of(run) =>
                {
                    match self.compact_len_of(run) {
                        Some(_) => self.compact(run, data).map(|parts| {
                            for part in parts {
                                out.extend_from_slice(part);
                            }
                        }),
                        None => {
                            out.extend_from_slice(data);
                            Some(())
                        }
                    }
                }
                _ => None,
            };
            if stored.is_none() {
                out.truncate(before);
                return false;
            }
        }
        out.resize(before + self.padded_tail_len(), 0);
        true
    }

    /// `omap-tail`'s form of a write covering a whole object (see
    /// [`OmapPacked::append_whole_object_tail`]): its tail appended to the data step's buffer
    /// (or, without one, an extent of its own), its metadata steps replaced by a clear of the
    /// object's values; `false` (and `steps` as they were) for any other write.
    fn lower_whole_object(&self, steps: &mut Vec<WriteStep>) -> bool {
        // Most writes are smaller than an object: they leave here.
        if steps.iter().filter(|step| is_metadata_step(step)).count() != self.all_runs().len() {
            return false;
        }
        let start = self.tail_range(&self.all_runs()).start;
        // The tail joins the data it follows, so the operation carries one extent. Why: an
        // OSD checksums a message's data segment as it arrives and keeps that checksum with
        // the buffer; a write whose bytes are the whole segment reuses it when the primary
        // sends them on to the replicas, while a second extent (or omap values) in the
        // segment makes it checksum the data once more (docs/BENCHMARKS.md). The data buffer
        // has room for the tail (`data_headroom`), so appending does not move it.
        let data_step = steps.iter().position(|step| {
            matches!(step, WriteStep::Write { offset, data }
                if *offset < VIRTUAL_REGION && *offset + data.len() as u64 == start)
        });
        let mut buffer = match data_step.map(|at| &mut steps[at]) {
            Some(WriteStep::Write { data, .. }) => std::mem::take(data),
            _ => Vec::new(),
        };
        let whole = self.append_whole_object_tail(steps, &mut buffer);
        match data_step.map(|at| &mut steps[at]) {
            Some(WriteStep::Write { data, .. }) => *data = buffer,
            _ if whole => steps.push(WriteStep::Write {
                offset: start,
                data: buffer,
            }),
            _ => {}
        }
        if !whole {
            return false;
        }
        let is_metadata = |step: &WriteStep| matches!(step, WriteStep::Write { offset, .. } if *offset >= VIRTUAL_REGION);
        let at = steps.iter().position(is_metadata).expect("metadata steps");
        steps.retain(|step| !is_metadata(step));
        // The object's values go, so none shadows the new tail. A clear, not a removal of the
        // key range, because BlueStore skips a clear of an object with no values (every
        // whole-object write after the first), where a range removal still searches RocksDB
        // (docs/BENCHMARKS.md).
        steps.insert(at, WriteStep::OmapClear);
        true
    }

    /// [`OmapPacked::lower`] of the usual write, inside one run: its one metadata step, the
    /// last, a whole value that has a compact form, becomes the omap set in its place, built
    /// in the value's own buffer ([`key_and_compact_in_place`]). Why apart from the general
    /// walk (a retain, a splice, a vector of the lowered steps, a buffer for the pairs): that
    /// walk was a fifth of the engine's own time in 64 KiB writes. `false` (and `steps` as
    /// they were) for any other write.
    fn lower_one_compact_value(&self, steps: &mut [WriteStep]) -> bool {
        let Some((last, before)) = steps.split_last_mut() else {
            return false;
        };
        let WriteStep::Write { offset, data } = last else {
            return false;
        };
        let offset = match offset.checked_sub(VIRTUAL_REGION) {
            Some(offset) if !before.iter().any(is_metadata_step) => offset,
            _ => return false,
        };
        let v = self.value_len() as u64;
        let run = (offset / v) as u32;
        let (ml, nl) = (self.0.metadata_len, self.0.nonce_len);
        let key = key_digits(run);
        if !offset.is_multiple_of(v)
            || data.len() != self.value_len_of(run)
            || self.compact_len_of(run).is_none()
            || nl < key.len()
            || !nonces_count_up(data, ml, nl)
        {
            return false;
        }
        let mut pair = std::mem::take(data);
        key_and_compact_in_place(&mut pair, &key, ml, nl);
        *last = WriteStep::OmapSet(OmapPairs::one(pair, key.len()));
        true
    }

    /// Turn the metadata steps the cache left (whole values, at [`VIRTUAL_REGION`]) into omap
    /// steps: a value of all zeros becomes a key removal (every sector of its run unwritten;
    /// in `omap-tail` an empty value), and in `omap-tail` a write covering a whole object
    /// stores its tail instead ([`OmapPacked::lower_whole_object`]).
    /// A metadata step that is not a whole value cannot be stored: `Err` names it (the caller
    /// loads the values first, so this is a bug).
    pub(crate) fn lower(&self, steps: &mut Vec<WriteStep>) -> Result<(), String> {
        let removes_object = steps.iter().any(|s| matches!(s, WriteStep::Remove));
        if self.1 == WholeObjects::AtTail && !removes_object && self.lower_whole_object(steps) {
            return Ok(());
        }
        if !removes_object && self.lower_one_compact_value(steps) {
            return Ok(());
        }
        // Room for every value whole, so the pairs are allocated once.
        let (values, bytes) = steps.iter().fold((0, 0), |(n, b), step| match step {
            WriteStep::Write { offset, data } if *offset >= VIRTUAL_REGION => {
                (n + 1, b + data.len())
            }
            _ => (n, b),
        });
        let mut set = OmapPairs::with_capacity(values, bytes + values * 8);
        let mut removed = Vec::new();
        let mut error = None;
        let mut first_metadata = None;
        let v = self.value_len() as u64;
        let mut at = 0;
        steps.retain(|step| {
            at += 1;
            let (offset, data) = match step {
                WriteStep::Write { offset, data } if *offset >= VIRTUAL_REGION => {
                    (*offset - VIRTUAL_REGION, Some(data))
                }
                WriteStep::Zero { offset, .. } if *offset >= VIRTUAL_REGION => {
                    (*offset - VIRTUAL_REGION, None)
                }
                _ => return true,
            };
            first_metadata.get_or_insert(at - 1);
            if removes_object {
                // The object goes, and its omap with it.
                return false;
            }
            let run = (offset / v) as u32;
            match data {
                Some(data) if offset.is_multiple_of(v) && data.len() == self.value_len_of(run) => {
                    // Compact first: a value whose nonces count up is never all zeros (two
                    // sectors' nonces differ), so the usual large write skips the scan.
                    if let Some(parts) = self.compact(run, data) {
                        set.push_parts(&key_digits(run), parts);
                    } else if data.iter().all(|&b| b == 0) {
                        if self.1 == WholeObjects::AtTail {
                            // Unwritten, over whatever the tail holds for the run.
                            set.push(&key_digits(run), &[]);
                        } else {
                            removed.push(key(run));
                        }
                    } else {
                        set.push(&key_digits(run), data);
                    }
                }
                _ => {
                    error.get_or_insert_with(|| {
                        format!("metadata step at {offset} is not one whole omap value")
                    });
                }
            }
            false
        });
        if let Some(error) = error {
            return Err(error);
        }
        let at = first_metadata.map_or(steps.len(), |at| at.min(steps.len()));
        let mut lowered = Vec::new();
        if !set.is_empty() {
            lowered.push(WriteStep::OmapSet(set));
        }
        if !removed.is_empty() {
            lowered.push(WriteStep::OmapRemoveKeys(removed));
        }
        steps.splice(at..at, lowered);
        Ok(())
    }
}

/// Turn `value` (sectors of `ml` bytes of metadata, each starting with an `nl`-byte nonce
/// that counts up) into `key` followed by the value's compact form (see
/// [`OmapPacked::compact`]), in its own buffer. Every byte moves towards the front or onto
/// bytes already read or dropped: the first sector's metadata moves `key.len()` bytes back
/// over the second one's nonce, which the compact form drops, so `key` may be at most `nl`
/// bytes long.
fn key_and_compact_in_place(value: &mut Vec<u8>, key: &[u8], ml: usize, nl: usize) {
    let k = key.len();
    assert!(
        k <= nl && nl < ml && value.len() >= 2 * ml,
        "a value with a compact form"
    );
    let sectors = value.len() / ml;
    value.copy_within(0..ml, k);
    let mut at = k + ml;
    for sector in 1..sectors {
        let rest = sector * ml + nl..(sector + 1) * ml;
        value.copy_within(rest, at);
        at += ml - nl;
    }
    value[..k].copy_from_slice(key);
    value.truncate(at);
}

/// Whether `step` writes or zeroes the metadata (at [`VIRTUAL_REGION`] and after), as the
/// cache leaves it for [`OmapPacked::lower`].
fn is_metadata_step(step: &WriteStep) -> bool {
    matches!(step, WriteStep::Write { offset, .. } | WriteStep::Zero { offset, .. }
        if *offset >= VIRTUAL_REGION)
}

/// Copy `value`, region bytes from `start` on, where it overlaps `out` (region bytes from
/// `base` on).
fn copy_overlap(start: usize, value: &[u8], base: usize, out: &mut [u8]) {
    let lo = start.max(base);
    let hi = (start + value.len()).min(base + out.len());
    if lo < hi {
        out[lo - base..hi - base].copy_from_slice(&value[lo - start..hi - start]);
    }
}

/// Whether the nonces (the first `nl` bytes of each `ml`-byte sector's metadata in `value`)
/// count up by one from the first, as [`nonce_add`] counts (little-endian, wrapping). Why not
/// `nonce_add` and a slice compare per sector: a `memcmp` call per sector showed in the
/// profile of 64 KiB writes; the 16- and 32-byte nonces of the AEGIS suites compare as
/// integers.
fn nonces_count_up(value: &[u8], ml: usize, nl: usize) -> bool {
    let word = |b: &[u8]| u128::from_le_bytes(b.try_into().expect("16 bytes"));
    match nl {
        16 => {
            let first = word(&value[..16]);
            (1u128..)
                .zip(value.chunks_exact(ml).skip(1))
                .all(|(i, s)| word(&s[..16]) == first.wrapping_add(i))
        }
        32 => {
            let (lo, hi) = (word(&value[..16]), word(&value[16..32]));
            (1u128..).zip(value.chunks_exact(ml).skip(1)).all(|(i, s)| {
                let (next_lo, carry) = lo.overflowing_add(i);
                word(&s[..16]) == next_lo && word(&s[16..32]) == hi.wrapping_add(carry as u128)
            })
        }
        _ => {
            let mut nonce = [0u8; MAX_NONCE_LEN];
            let nonce = &mut nonce[..nl];
            nonce.copy_from_slice(&value[..nl]);
            value.chunks_exact(ml).skip(1).all(|sector| {
                nonce_add(nonce, 1);
                sector[..nl] == *nonce
            })
        }
    }
}

impl SectorLayout for OmapPacked {
    fn write(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        ciphertext: Vec<u8>,
        metadata: Vec<u8>,
    ) {
        // The metadata into the virtual region, as `object-end` writes its region; the cache
        // makes whole values of it and `lower` omap steps.
        write_apart(
            steps,
            (self.data_offset(first), ciphertext),
            (self.metadata_offset(first), metadata),
        );
    }

    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32) {
        let offsets = (self.data_offset(first), self.metadata_offset(first));
        discard_apart(steps, &self.0, offsets, count);
    }

    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32) {
        let ss = self.0.sector_size as u64;
        steps.push(ReadStep::Read {
            offset: first as u64 * ss,
            len: count as u64 * ss,
        });
        self.runs_steps(steps, Self::runs(first, count));
    }

    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        count: u32,
        ciphertext: &mut ReadOutput<'_>,
        metadata: &mut [u8],
    ) -> Result<Decoded, String> {
        let taken = take_or_place_extents(
            results.next(),
            first as u64 * self.0.sector_size as u64,
            ciphertext,
        )?;
        let ml = self.0.metadata_len;
        debug_assert_eq!(metadata.len(), count as usize * ml);
        self.place_runs(
            results,
            Self::runs(first, count),
            first as usize * ml,
            metadata,
        )?;
        Ok(taken.into())
    }

    fn needs_metadata_cache(&self) -> bool {
        true
    }

    fn data_headroom(&self, first: u32, count: u32) -> usize {
        if self.1 != WholeObjects::AtTail || first != 0 || count != self.0.sectors_per_object {
            return 0;
        }
        self.padded_tail_len()
    }

    fn lower_cached_steps(&self, steps: &mut Vec<WriteStep>) -> Result<(), String> {
        self.lower(steps)
    }

    fn cached_fetch_steps(
        &self,
        _region_offset: u64,
        range: &std::ops::Range<usize>,
        steps: &mut Vec<ReadStep>,
    ) {
        self.fetch_steps(range, steps)
    }

    fn cached_fetched(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        _region_offset: u64,
        range: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        self.fetched_bytes(results, range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> OmapPacked {
        OmapPacked(
            ObjectGeometry {
                sector_size: 4096,
                metadata_len: 32,
                nonce_len: 16,
                sectors_per_object: 40,
            },
            WholeObjects::AsValues,
        )
    }

    #[test]
    fn one_value_lowered_in_its_own_buffer_is_what_the_general_walk_stores() {
        // The metadata and nonce lengths of AEGIS-128L, AES-GCM and AEGIS-256.
        for (ml, nl) in [(32, 16), (28, 12), (48, 32)] {
            for whole in [WholeObjects::AsValues, WholeObjects::AtTail] {
                let geometry = ObjectGeometry {
                    sector_size: 4096,
                    metadata_len: ml,
                    nonce_len: nl,
                    sectors_per_object: 40,
                };
                let l = OmapPacked(geometry, whole);
                // Run 1 (sectors 16..32): nonces counting up over a carry, tags all different.
                let mut value = vec![0u8; 16 * ml];
                let mut nonce = vec![0xffu8; nl];
                nonce[nl - 1] = 0x12;
                for (i, sector) in value.chunks_exact_mut(ml).enumerate() {
                    sector[..nl].copy_from_slice(&nonce);
                    sector[nl..].fill(i as u8 + 1);
                    nonce_add(&mut nonce, 1);
                }
                let data = || WriteStep::Write {
                    offset: 16 * 4096,
                    data: vec![7; 16 * 4096],
                };
                let run_1 = |value: &[u8]| WriteStep::Write {
                    offset: VIRTUAL_REGION + 16 * ml as u64,
                    data: value.to_vec(),
                };
                let mut fast = vec![data(), run_1(&value)];
                l.lower(&mut fast).expect("one whole value");
                // A second value (run 0, unwritten) sends the same write through the walk.
                let run_0 = WriteStep::Write {
                    offset: VIRTUAL_REGION,
                    data: vec![0; 16 * ml],
                };
                let mut walked = vec![data(), run_0, run_1(&value)];
                l.lower(&mut walked).expect("whole values");
                let (WriteStep::OmapSet(fast_set), WriteStep::OmapSet(walked_set)) =
                    (&fast[1], &walked[1])
                else {
                    panic!("{fast:?} {walked:?}")
                };
                assert_eq!(fast.len(), 2, "{fast:?}");
                let key = key_digits(1);
                let walked_pair = walked_set.iter().find(|(k, _)| *k == key);
                assert_eq!(fast_set.to_vec().len(), 1);
                assert_eq!(fast_set.first(), walked_pair, "ml {ml} nl {nl}");
                let mut expected = value[..ml].to_vec();
                for sector in value.chunks_exact(ml).skip(1) {
                    expected.extend_from_slice(&sector[nl..]);
                }
                assert_eq!(fast_set.first(), Some((&key[..], &expected[..])));
                // Nonces that do not count up: no compact form, the value as it is.
                let mut uncounted = value.clone();
                uncounted[3 * ml] ^= 1;
                let mut steps = vec![data(), run_1(&uncounted)];
                l.lower(&mut steps).expect("one whole value");
                let WriteStep::OmapSet(set) = &steps[1] else {
                    panic!("{steps:?}")
                };
                assert_eq!(set.first(), Some((&key[..], &uncounted[..])));
            }
        }
    }

    #[test]
    fn whole_values_become_omap_steps_in_place_of_the_metadata_steps() {
        let l = layout();
        let mut steps = vec![
            WriteStep::AssertExists,
            WriteStep::Write {
                offset: 0,
                data: vec![1; 4096],
            },
            WriteStep::Write {
                offset: VIRTUAL_REGION,
                data: vec![2; 512],
            },
            WriteStep::Write {
                offset: VIRTUAL_REGION + 512,
                data: vec![0; 512],
            },
            // The last run of a 40-sector object holds 8 sectors: 256 bytes.
            WriteStep::Write {
                offset: VIRTUAL_REGION + 1024,
                data: vec![3; 256],
            },
        ];
        l.lower(&mut steps).expect("whole values");
        assert_eq!(steps.len(), 4);
        assert!(matches!(steps[0], WriteStep::AssertExists));
        assert!(matches!(steps[1], WriteStep::Write { offset: 0, .. }));
        let WriteStep::OmapSet(set) = &steps[2] else {
            panic!("{:?}", steps[2])
        };
        let set = set.to_vec();
        assert_eq!(set.len(), 2);
        assert_eq!(set[0], (b"00000000".to_vec(), vec![2; 512]));
        assert_eq!(set[1], (b"00000002".to_vec(), vec![3; 256]));
        assert!(
            matches!(&steps[3], WriteStep::OmapRemoveKeys(k) if k == &vec![b"00000001".to_vec()])
        );
    }

    /// Full metadata of `sectors` sectors sealed in one run: nonces counting up from one that
    /// carries into its second byte, tags that differ per sector.
    fn one_run(sectors: usize) -> Vec<u8> {
        one_run_from(sectors, 0xf8)
    }

    /// [`one_run`] with the nonce's first byte `start`.
    fn one_run_from(sectors: usize, start: u8) -> Vec<u8> {
        let mut value = Vec::new();
        for i in 0..sectors {
            let mut nonce = [0xf0u8; 16];
            nonce[0] = start;
            nonce_add(&mut nonce, i as u64);
            value.extend_from_slice(&nonce);
            value.extend_from_slice(&[i as u8 + 1; 16]);
        }
        value
    }

    fn stored_values(steps: &[WriteStep]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let [WriteStep::OmapSet(set)] = steps else {
            panic!("{steps:?}")
        };
        set.to_vec()
    }

    #[test]
    fn a_run_sealed_at_once_is_stored_compact_and_reads_back_whole() {
        let l = layout();
        let full = one_run(16);
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 512,
            data: full.clone(),
        }];
        l.lower(&mut steps).expect("a whole value");
        let stored = stored_values(&steps);
        assert_eq!(stored[0].0, b"00000001");
        let compact = &stored[0].1;
        assert_eq!(
            compact.len(),
            32 + 15 * 16,
            "first sector whole, then tags only"
        );
        assert_eq!(compact[..32], full[..32]);
        assert_eq!(
            compact[32..48],
            [2u8; 16],
            "the second sector's tag follows"
        );
        // Read back: any part of the run, from the compact value, is the full metadata.
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000001", compact);
        let result = || {
            Some(ReadResult::Omap {
                pairs: pairs.clone(),
                more: false,
            })
        };
        assert_eq!(
            l.fetched_bytes(&mut result().into_iter(), &(512..1024))
                .unwrap(),
            full
        );
        let mut part = vec![0u8; 3 * 32];
        l.place_values(result(), 512 + 5 * 32, &mut part).unwrap();
        assert_eq!(part, full[5 * 32..8 * 32]);

        // The last run's 8 sectors: compact too (32 + 7 x 16 bytes).
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 1024,
            data: one_run(8),
        }];
        l.lower(&mut steps).unwrap();
        assert_eq!(stored_values(&steps)[0].1.len(), 32 + 7 * 16);
    }

    #[test]
    fn a_run_whose_nonces_do_not_count_up_is_stored_whole() {
        let l = layout();
        // One sector rewritten later (another nonce), or one never written (zeros).
        for changed in [3usize, 0, 15] {
            let mut value = one_run(16);
            value[changed * 32] ^= 0x55;
            let mut steps = vec![WriteStep::Write {
                offset: VIRTUAL_REGION,
                data: value.clone(),
            }];
            l.lower(&mut steps).unwrap();
            assert_eq!(
                stored_values(&steps)[0].1,
                value,
                "sector {changed} changed"
            );
        }
        let mut value = one_run(16);
        value[7 * 32..8 * 32].fill(0);
        let mut steps = vec![WriteStep::Write {
            offset: VIRTUAL_REGION,
            data: value.clone(),
        }];
        l.lower(&mut steps).unwrap();
        assert_eq!(stored_values(&steps)[0].1, value);
        // Suites without a counted nonce never compact.
        let xts = OmapPacked(
            ObjectGeometry {
                metadata_len: 16,
                nonce_len: 0,
                ..l.0
            },
            WholeObjects::AsValues,
        );
        assert_eq!(xts.compact_len_of(0), None);
        // A value of neither length is damaged: its sectors get metadata that never
        // authenticates (and is not the unwritten state).
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000000", &[1u8; 300]);
        let bytes = l
            .fetched_bytes(
                &mut Some(ReadResult::Omap { pairs, more: false }).into_iter(),
                &(0..512),
            )
            .unwrap();
        assert_eq!(bytes, vec![DAMAGED_METADATA; 512]);
    }

    #[test]
    fn a_partial_value_is_refused_and_a_removed_object_takes_its_values_along() {
        let l = layout();
        let mut partial = vec![WriteStep::Write {
            offset: VIRTUAL_REGION + 32,
            data: vec![1; 32],
        }];
        assert!(l.lower(&mut partial).is_err());
        let mut remove = vec![
            WriteStep::Zero {
                offset: VIRTUAL_REGION + 32,
                len: 32,
            },
            WriteStep::Remove,
        ];
        l.lower(&mut remove).expect("removal");
        assert!(matches!(remove[..], [WriteStep::Remove]));
    }

    #[test]
    fn reads_place_values_and_zeros_for_missing_runs() {
        let l = layout();
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000001", &[7u8; 512]);
        let result = Some(ReadResult::Omap { pairs, more: false });
        // Sectors 14..18: two of run 0 (absent), two of run 1.
        let mut metadata = vec![9u8; 4 * 32];
        l.place_values(result, 14 * 32, &mut metadata)
            .expect("well formed");
        // place_values copies values only; the caller's buffer arrives zeroed.
        assert_eq!(&metadata[64..], &[7u8; 64][..]);
        // A key past the object's runs is malformed; a value of a wrong length is damage.
        let mut bad = OmapPairs::new();
        bad.push(b"00001000", &[7u8; 512]);
        let result = Some(ReadResult::Omap {
            pairs: bad,
            more: false,
        });
        assert!(l.place_values(result, 0, &mut metadata).is_err());
        let mut damaged = OmapPairs::new();
        damaged.push(b"00000001", &[7u8; 100]);
        let result = Some(ReadResult::Omap {
            pairs: damaged,
            more: false,
        });
        l.place_values(result, 14 * 32, &mut metadata).unwrap();
        assert_eq!(&metadata[64..], &[DAMAGED_METADATA; 64][..]);
        assert_eq!(
            l.fetched_bytes(
                &mut Some(ReadResult::Omap {
                    pairs: OmapPairs::new(),
                    more: false
                })
                .into_iter(),
                &(512..1024)
            )
            .expect("empty"),
            vec![0u8; 512]
        );
    }

    /// The integer comparisons agree with counting by `nonce_add` for every nonce length,
    /// across byte carries and the wrap at the top, and see a single wrong bit.
    #[test]
    fn nonces_count_up_agrees_with_nonce_add() {
        for nl in [12usize, 16, 24, 32] {
            let ml = nl + 16;
            for start in [[0u8; 32], [0xff; 32], {
                let mut s = [0x5au8; 32];
                s[0] = 0xfd;
                s[16] = 0xff;
                s
            }] {
                let mut value = vec![0u8; 16 * ml];
                let mut nonce = start[..nl].to_vec();
                for sector in value.chunks_exact_mut(ml) {
                    sector[..nl].copy_from_slice(&nonce);
                    sector[nl..].fill(0x33);
                    nonce_add(&mut nonce, 1);
                }
                assert!(
                    nonces_count_up(&value, ml, nl),
                    "nl {nl}, start {:02x?}",
                    &start[..4]
                );
                for bit in [0, 7, 8 * nl - 1] {
                    let mut bad = value.clone();
                    bad[5 * ml + bit / 8] ^= 1 << (bit % 8);
                    assert!(!nonces_count_up(&bad, ml, nl), "nl {nl}, bit {bit}");
                }
            }
        }
    }

    fn tail_layout() -> OmapPacked {
        OmapPacked(layout().0, WholeObjects::AtTail)
    }

    /// The metadata steps the cache leaves for a write of every sector of the 40-sector
    /// object, sealed in one run: one whole value per run (16, 16 and 8 sectors).
    fn whole_object_steps() -> (Vec<WriteStep>, Vec<u8>) {
        let mut region = one_run(16);
        region.extend(one_run_from(16, 0x10));
        region.extend(one_run_from(8, 0x20));
        let mut steps = vec![WriteStep::Write {
            offset: 0,
            data: vec![1; 40 * 4096],
        }];
        for (run, value) in [(0, 0..512), (1, 512..1024), (2, 1024..1280)] {
            steps.push(WriteStep::Write {
                offset: VIRTUAL_REGION + run * 512,
                data: region[value].to_vec(),
            });
        }
        (steps, region)
    }

    #[test]
    fn omap_tail_puts_a_whole_object_at_its_end_and_removes_every_value() {
        let l = tail_layout();
        let (mut steps, region) = whole_object_steps();
        // The data buffer as the engine makes it for a whole object: with the headroom.
        assert_eq!(l.data_headroom(0, 40), 4096);
        assert_eq!(l.data_headroom(0, 39), 0, "not the whole object");
        assert_eq!(l.data_headroom(1, 39), 0, "not the whole object");
        assert_eq!(
            layout().data_headroom(0, 40),
            0,
            "omap-packed appends nothing"
        );
        let mut sent = Vec::with_capacity(40 * 4096 + l.data_headroom(0, 40));
        sent.extend_from_slice(&[1; 40 * 4096]);
        let at = sent.as_ptr();
        steps[0] = WriteStep::Write {
            offset: 0,
            data: sent,
        };
        l.lower(&mut steps).expect("a whole object");
        // One extent: the data, then the tail right after the last sector.
        let [WriteStep::Write { offset: 0, data }, WriteStep::OmapClear] = &steps[..] else {
            panic!("{steps:?}")
        };
        assert_eq!(
            data.as_ptr(),
            at,
            "the tail went into the headroom, not a new buffer"
        );
        assert!(data[..40 * 4096].iter().all(|&b| b == 1), "the data first");
        let data = &data[40 * 4096..];
        // Two compact runs of 16 sectors, one of 8, padded with zeros to 4 KiB.
        let slots = 2 * (32 + 15 * 16) + 32 + 7 * 16;
        assert_eq!(data.len(), 4096);
        assert!(
            data[slots..].iter().all(|&b| b == 0),
            "zeros after the slots"
        );
        let data = &data[..slots];
        assert_eq!(l.tail_range(&(0..3)), 40 * 4096..40 * 4096 + slots as u64);
        assert_eq!(l.tail_range(&(1..2)), 40 * 4096 + 272..40 * 4096 + 544);

        // Read back: the tail alone gives the region; a value wins over it; an empty value
        // is a run of unwritten sectors over it.
        let tail = |from: u64| {
            ReadResult::Extents(vec![ivdisk_store::Extent {
                offset: from,
                data: data[(from - 40 * 4096) as usize..].to_vec(),
            }])
        };
        let omap = |pairs: OmapPairs| ReadResult::Omap { pairs, more: false };
        let got = l
            .fetched_bytes(
                &mut [omap(OmapPairs::new()), tail(40 * 4096)].into_iter(),
                &(0..1280),
            )
            .unwrap();
        assert_eq!(got, region);
        let mut pairs = OmapPairs::new();
        pairs.push(b"00000001", &[9u8; 512]);
        pairs.push(b"00000002", &[]);
        let got = l
            .fetched_bytes(
                &mut [omap(pairs), tail(40 * 4096 + 272)].into_iter(),
                &(512..1280),
            )
            .unwrap();
        assert_eq!(&got[..512], &[9u8; 512][..]);
        assert_eq!(&got[512..], &[0u8; 256][..]);
        // No tail (an object never written whole, or a hole): zeros where no value is.
        let hole = ReadResult::Extents(Vec::new());
        let got = l
            .fetched_bytes(&mut [omap(OmapPairs::new()), hole].into_iter(), &(0..512))
            .unwrap();
        assert_eq!(got, vec![0u8; 512]);
    }

    #[test]
    fn omap_tail_without_the_data_before_it_sends_the_tail_as_its_own_extent() {
        let l = tail_layout();
        let (mut steps, _) = whole_object_steps();
        steps.remove(0);
        l.lower(&mut steps).expect("a whole object's metadata");
        let [WriteStep::OmapClear, WriteStep::Write { offset, data }] = &steps[..] else {
            panic!("{steps:?}")
        };
        assert_eq!((*offset, data.len()), (40 * 4096, 4096));
    }

    #[test]
    fn omap_tail_keeps_values_for_anything_but_a_whole_sealed_object() {
        let l = tail_layout();
        // Not every run: values, as omap-packed; a run of zeros is an empty value.
        let (mut steps, _) = whole_object_steps();
        steps.pop();
        steps.push(WriteStep::Write {
            offset: VIRTUAL_REGION + 1024,
            data: vec![0; 256],
        });
        let mut packed = steps.clone();
        steps.remove(3);
        l.lower(&mut steps).unwrap();
        let [WriteStep::Write { offset: 0, .. }, WriteStep::OmapSet(set)] = &steps[..] else {
            panic!("{steps:?}")
        };
        assert_eq!(set.len(), 2);
        // Every run, but one of them all zeros (an unwritten run inside the write's object:
        // the write is not one sealed run): values, the zeros an empty value.
        l.lower(&mut packed).unwrap();
        let [WriteStep::Write { offset: 0, .. }, WriteStep::OmapSet(set)] = &packed[..] else {
            panic!("{packed:?}")
        };
        let set = set.to_vec();
        assert_eq!(set.len(), 3);
        assert_eq!(set[2], (b"00000002".to_vec(), Vec::new()));
        // The same in omap-packed removes the key instead.
        let (mut steps, _) = whole_object_steps();
        if let WriteStep::Write { data, .. } = &mut steps[3] {
            data.fill(0);
        }
        layout().lower(&mut steps).unwrap();
        assert!(
            matches!(&steps[2], WriteStep::OmapRemoveKeys(k) if k == &vec![b"00000002".to_vec()]),
            "{steps:?}"
        );
        // A removed object takes everything along.
        let (mut steps, _) = whole_object_steps();
        steps.push(WriteStep::Remove);
        l.lower(&mut steps).unwrap();
        assert!(matches!(
            steps[..],
            [WriteStep::Write { offset: 0, .. }, WriteStep::Remove]
        ));
    }
}
