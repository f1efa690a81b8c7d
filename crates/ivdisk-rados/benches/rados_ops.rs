//! Raw cost of the write operations behind the paper's three metadata layouts, on RADOS.
//!
//! Operations per second of one write operation kind at queue depth 32 (32 tokio tasks on a
//! multi-thread runtime, each with one operation in flight), per IO size (4 KiB, 64 KiB, 1 MiB;
//! `n` = size / 4096 sectors, 32 bytes of metadata per sector):
//! - **a** `data`: one extent of `size` bytes at a size-aligned offset (no metadata: the
//!   baseline);
//! - **b** `object-end`: the same extent plus, in the same operation, the `n` x 32 metadata
//!   bytes of those sectors as a second extent at the object's end (`4 MiB + sector x 32`);
//! - **c** `omap`: the same extent plus one omap key per sector (the paper's omap layout: key =
//!   the sector index in the object, 8 bytes big-endian; value = its 32 bytes), `n` keys;
//! - **d** `unaligned`: one extent of `n` x 4128 bytes at `sector x 4128` (each sector's 4096
//!   data bytes followed by its 32 metadata bytes, so almost no write is 4 KiB-aligned);
//! - **e** `object-end-4k` (only when `IVDISK_BENCH_CASES` names it): `b` with the metadata
//!   written as the whole 4 KiB blocks that hold it (128 sectors' worth per block), as a
//!   layout that keeps its object's metadata block in memory (under the exclusive lock) could:
//!   no partial block for BlueStore to read and merge.
//! - **f** `omap-4k` (only when `IVDISK_BENCH_CASES` names it): the same whole 4 KiB
//!   metadata blocks as `e`, each as one omap value (key: the block's index) instead of an
//!   extent: what a write costs the OSD when the second extent of `e` becomes one RocksDB key.
//! - **g** `grouped-4k` (only when `IVDISK_BENCH_CASES` names it): the object as groups of 128
//!   data sectors each followed by the 4 KiB block of their metadata (an interleaved layout);
//!   a write inside one group is its data plus its group's metadata block, close by rather
//!   than at the object's end, and a write of whole groups (512 KiB, 1 MiB, ...) is one
//!   extent holding data and metadata blocks together.
//! - **j** `omap-512` (only when `IVDISK_BENCH_CASES` names it): `f` with smaller values: one
//!   omap value per 16 sectors (their 512 bytes of metadata), so a write of up to 64 KiB
//!   (aligned) sets one 512-byte value.
//! - **h** `data-unhinted` and **i** `object-end-4k-unhinted` (only when `IVDISK_BENCH_CASES`
//!   names them): `a` and `e` without the allocation hint. librbd sends the hint only to
//!   objects its object map says may not exist, so its overwrites of a written image are `h`;
//!   these two show what the hint costs an overwrite.
//! - **k** `data-full` and **l** `omap-512-full` (only when `IVDISK_BENCH_CASES` names them):
//!   `a` and `j`, but a write of a whole object's data (4 MiB) replaces the object with
//!   `write_full` instead of writing an extent, as librbd does for a write that covers its
//!   object (`ObjectWriteRequest::add_write_ops`); at smaller sizes they are `a` and `j`.
//! - **m** `omap-2k` (only when `IVDISK_BENCH_CASES` names it): `j` with values of 64 sectors
//!   (2 KiB): a quarter of `j`'s values at 256 KiB and up, each four times as large.
//! - **n** `omap-256` (only when `IVDISK_BENCH_CASES` names it): `j` with 16 bytes per sector
//!   (256-byte values): what metadata of half the size (a tag without its nonce) would cost.
//! - **o** `omap-one-32` (only when `IVDISK_BENCH_CASES` names it): the data plus one 32-byte
//!   omap value whatever the size (always the same key): what an omap value costs a write apart
//!   from its bytes.
//! - **p** `object-end-17` (only when `IVDISK_BENCH_CASES` names it): `b` with 17 bytes of
//!   metadata per sector (`4 MiB + sector x 17`), the size of `omap-packed`'s compact values
//!   (a 16-byte tag per sector, one 16-byte first nonce per 16 sectors): the same bytes as an
//!   extent instead of omap values.
//! - **q** `object-end-17-full` (only when `IVDISK_BENCH_CASES` names it): `p`, but a write of
//!   a whole object's data replaces the object with one `write_full` of the data followed by
//!   its metadata (4 MiB + 17 KiB in one extent, no small extent of its own).
//! - **r** `tail-17-read-both` and **s** `omap-256-read-both` (only when `IVDISK_BENCH_CASES`
//!   names them; for `IVDISK_BENCH_RW=read`): objects written as `p` and as `n`, read the way a
//!   layout that kept metadata in both places (omap values, and a whole object's compact
//!   metadata at its end) would have to read them: the data, the omap values of its sectors
//!   and their 17-byte entries at the object's end in one operation. `r`'s objects have no
//!   values, `s`'s no tail (that read goes past the object's end).
//! - **t** `object-end-17-rm` (only when `IVDISK_BENCH_CASES` names it): `p` with, in the same
//!   operation, the removal of every omap key of the object (an omap key range covering them
//!   all): what a layout that moved a whole object's metadata from omap values to the object's
//!   end would send with each whole-object write, so that no stale value could shadow the new
//!   metadata. The objects have no values (as an object written only in whole would have).
//! - **u** `object-end-64k-rm` (only when `IVDISK_BENCH_CASES` names it): `t`, but a write of a
//!   whole object sends its tail as a 64 KiB extent (the 17 KiB of compact metadata, then
//!   zeros): an extent that size is not a deferred write under BlueStore's `hdd` settings
//!   (`bluestore_prefer_deferred_size_hdd`), and, a whole number of 4 KiB blocks, needs no
//!   merge of a partial block under `ssd` settings. Smaller writes send `t`'s operation.
//!
//! `IVDISK_BENCH_RW=read` measures reads instead of writes: for each case, one read operation
//! of what its writes store (the data extent, and the metadata extent or the omap values of
//! those sectors), on the prefilled objects. `g` has no read form.
//!
//! Objects are laid out as the layouts would: 1024 sectors per object, so 4 MiB of data (b, e and
//! g: 4 MiB + 32 KiB; d: 1024 x 4128 bytes). Each case has its own `IVDISK_BENCH_OBJECTS` objects
//! (default 64, i.e. 256 MiB of data per case) and writes go to a uniformly random object and
//! size-aligned sector. The objects are written in full once before any measurement (`c` also gets
//! all 1024 keys, `f` all 8 blocks), as an image in use is: the paper measured a fully written
//! image, and BlueStore overwrites differently from first writes (the unaligned case's partial
//! blocks need a read-modify-write only when there is old data). Every write carries the allocation
//! hint librbd sends (expected object size 4 MiB; `IVDISK_BENCH_ALLOC_HINT=0` drops it).
//!
//! Per size: a warm-up of every case, then `IVDISK_BENCH_REPS` rounds (default 5) of every case
//! for `IVDISK_BENCH_SECONDS` (default 3) each, interleaved (the order rotates per round:
//! abcd, bcda, ...) so that drift of the shared cluster hits all cases alike. The ratio of a
//! case is taken within a round against `a` of the same size; the table gives medians (ratios:
//! median, min..max). MB/s counts data bytes only (`size`, not metadata or keys). Operations
//! are timed from the first submission until the last of them completes; RADOS acknowledges a
//! write once it is durable on every replica, so nothing is left to flush.
//!
//! The store opens a fresh namespace of the pool (`ivdisk-bench-<random>`), and removes its
//! objects at the end (also after a failed measurement). Samples go to
//! `target/bench-rados-ops.json`; `--json` prints that document instead of the table.
//!
//! ```text
//! export CEPH_CONF=/tmp/ivdisk-ceph/ceph.conf   # eval "$(scripts/ceph-dev-cluster start)"
//! cargo bench -p ivdisk-rados --bench rados_ops
//! scripts/bench-rados        # the same, with the cluster described and OSD restarts caught
//! IVDISK_BENCH_SIZES=4 IVDISK_BENCH_CASES=a,b,e cargo bench -p ivdisk-rados --bench rados_ops
//! ```
//!
//! Knobs: `IVDISK_BENCH_SIZES` (KiB, comma-separated, powers of two from 4 to 4096),
//! `IVDISK_BENCH_CASES` (a subset of `a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s`, default `a,b,c,d`;
//! ratios need `a`), `IVDISK_BENCH_WARMUP` (seconds per case and size, default 1),
//! `IVDISK_BENCH_OBJECTS`, `IVDISK_RADOS_POOL` (default `rbd`), `IVDISK_BENCH_RW` (`write`,
//! the default, or `read`). Without `--bench` (as `cargo
//! test --all-targets` runs it) it is a smoke test of every case (all nineteen unless
//! `IVDISK_BENCH_CASES` says otherwise): one object per case, two write operations per case and
//! size at queue depth 2, two of its read operations (but `g`), then one write per case read
//! back and compared. `IVDISK_NO_CEPH=1`
//! skips it (it prints `SKIPPED`); without that, a missing `CEPH_CONF` fails it, as the RADOS
//! tests do.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt, TryStreamExt};
use ivdisk_bench_support::{
    env_or, json_list, json_str, machine, median, min_max, size_label, sizes_from_env, target_dir,
    Rng, Run,
};
use ivdisk_rados::{RadosConfig, RadosStore};
use ivdisk_store::{
    ObjectName, ObjectStore, ReadOp, ReadResult, ReadStep, StoreError, WriteOp, WriteStep,
};

const QUEUE_DEPTH: usize = 32;
const SECTOR: u64 = 4096;
/// Metadata per sector: a 16-byte IV/nonce and a 16-byte tag.
const META: u64 = 32;
/// Metadata per sector in `omap-packed`'s compact values: a 16-byte tag, and one 16-byte
/// first nonce per 16 sectors.
const COMPACT: u64 = 17;
/// The tail of case `u`'s whole-object writes: a whole object's compact metadata (17 KiB)
/// padded with zeros to 64 KiB.
const TAIL_PADDED: u64 = 64 << 10;
/// An unaligned-layout record: a sector followed by its metadata.
const RECORD: u64 = SECTOR + META;
const SECTORS_PER_OBJECT: u64 = 1024;
const OBJECT_DATA: u64 = SECTORS_PER_OBJECT * SECTOR;
const SIZES: [usize; 3] = [4 << 10, 64 << 10, 1 << 20];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Case {
    Data,
    ObjectEnd,
    Omap,
    Unaligned,
    ObjectEndBlock,
    OmapBlock,
    Grouped,
    DataUnhinted,
    ObjectEndBlockUnhinted,
    OmapChunk,
    DataFull,
    OmapChunkFull,
    OmapWideChunk,
    OmapHalf,
    OmapOne,
    ObjectEndCompact,
    ObjectEndCompactFull,
    TailReadBoth,
    OmapHalfReadBoth,
    TailClearing,
    TailPadded,
}

impl Case {
    const ALL: [Case; 21] = [
        Case::Data,
        Case::ObjectEnd,
        Case::Omap,
        Case::Unaligned,
        Case::ObjectEndBlock,
        Case::OmapBlock,
        Case::Grouped,
        Case::DataUnhinted,
        Case::ObjectEndBlockUnhinted,
        Case::OmapChunk,
        Case::DataFull,
        Case::OmapChunkFull,
        Case::OmapWideChunk,
        Case::OmapHalf,
        Case::OmapOne,
        Case::ObjectEndCompact,
        Case::ObjectEndCompactFull,
        Case::TailReadBoth,
        Case::OmapHalfReadBoth,
        Case::TailClearing,
        Case::TailPadded,
    ];
    /// What runs unless `IVDISK_BENCH_CASES` says otherwise: the paper's three layouts and
    /// the baseline.
    const DEFAULT: [Case; 4] = [Case::Data, Case::ObjectEnd, Case::Omap, Case::Unaligned];

    fn letter(self) -> char {
        match self {
            Case::Data => 'a',
            Case::ObjectEnd => 'b',
            Case::Omap => 'c',
            Case::Unaligned => 'd',
            Case::ObjectEndBlock => 'e',
            Case::OmapBlock => 'f',
            Case::Grouped => 'g',
            Case::DataUnhinted => 'h',
            Case::ObjectEndBlockUnhinted => 'i',
            Case::OmapChunk => 'j',
            Case::DataFull => 'k',
            Case::OmapChunkFull => 'l',
            Case::OmapWideChunk => 'm',
            Case::OmapHalf => 'n',
            Case::OmapOne => 'o',
            Case::ObjectEndCompact => 'p',
            Case::ObjectEndCompactFull => 'q',
            Case::TailReadBoth => 'r',
            Case::OmapHalfReadBoth => 's',
            Case::TailClearing => 't',
            Case::TailPadded => 'u',
        }
    }

    fn name(self) -> &'static str {
        match self {
            Case::Data => "data",
            Case::ObjectEnd => "object-end",
            Case::Omap => "omap",
            Case::Unaligned => "unaligned",
            Case::ObjectEndBlock => "object-end-4k",
            Case::OmapBlock => "omap-4k",
            Case::Grouped => "grouped-4k",
            Case::DataUnhinted => "data-unhinted",
            Case::ObjectEndBlockUnhinted => "object-end-4k-unhinted",
            Case::OmapChunk => "omap-512",
            Case::DataFull => "data-full",
            Case::OmapChunkFull => "omap-512-full",
            Case::OmapWideChunk => "omap-2k",
            Case::OmapHalf => "omap-256",
            Case::OmapOne => "omap-one-32",
            Case::ObjectEndCompact => "object-end-17",
            Case::ObjectEndCompactFull => "object-end-17-full",
            Case::TailReadBoth => "tail-17-read-both",
            Case::OmapHalfReadBoth => "omap-256-read-both",
            Case::TailClearing => "object-end-17-rm",
            Case::TailPadded => "object-end-64k-rm",
        }
    }

    /// The case whose operations this one sends (the unhinted cases send their hinted
    /// twin's, without the hint; the `-full` cases their twin's, with `write_full` for a whole
    /// object).
    fn base(self) -> Case {
        match self {
            Case::DataUnhinted | Case::DataFull => Case::Data,
            Case::ObjectEndBlockUnhinted => Case::ObjectEndBlock,
            Case::OmapChunkFull => Case::OmapChunk,
            Case::ObjectEndCompactFull
            | Case::TailReadBoth
            | Case::TailClearing
            | Case::TailPadded => Case::ObjectEndCompact,
            Case::OmapHalfReadBoth => Case::OmapHalf,
            other => other,
        }
    }

    /// Whether a write of a whole object's data goes out as `write_full`.
    fn writes_full(self) -> bool {
        matches!(
            self,
            Case::DataFull | Case::OmapChunkFull | Case::ObjectEndCompactFull
        )
    }

    /// Sectors per omap value of the cases that keep whole metadata pieces in omap values.
    fn sectors_per_value(self) -> u64 {
        match self.base() {
            Case::OmapChunk => 16,
            Case::OmapWideChunk => 64,
            Case::OmapHalf => 16,
            // One value for the whole object: every write sets the same single key.
            Case::OmapOne => SECTORS_PER_OBJECT,
            _ => SECTOR / META,
        }
    }

    /// Bytes per omap value of those cases.
    fn value_len(self) -> u64 {
        match self.base() {
            // 16 bytes per sector: a tag without its nonce.
            Case::OmapHalf => self.sectors_per_value() * 16,
            // 32 bytes whatever the write's size: what any omap value costs, without its bytes.
            Case::OmapOne => META,
            _ => self.sectors_per_value() * META,
        }
    }

    /// Whether its measured writes carry the allocation hint.
    fn hinted(self) -> bool {
        !matches!(self, Case::DataUnhinted | Case::ObjectEndBlockUnhinted)
    }

    /// What one operation of `size` data bytes writes.
    fn describe(self, size: usize) -> String {
        let n = size as u64 / SECTOR;
        if !self.hinted() {
            return format!("{}, no allocation hint", self.base().describe(size));
        }
        if matches!(self, Case::TailReadBoth | Case::OmapHalfReadBoth) {
            return format!("{}; read: data + values + tail", self.base().describe(size));
        }
        if self == Case::TailClearing || (self == Case::TailPadded && n < SECTORS_PER_OBJECT) {
            return format!("{} + every omap key removed", self.base().describe(size));
        }
        if self == Case::TailPadded {
            return format!(
                "{size} B + {TAIL_PADDED} B at object end ({} B of metadata, then zeros) + \
                 every omap key removed",
                n * COMPACT
            );
        }
        if self.writes_full() {
            let base = self.base().describe(size);
            return match size as u64 == OBJECT_DATA {
                true if self == Case::ObjectEndCompactFull => format!(
                    "write_full of {} B (data, then metadata)",
                    OBJECT_DATA + SECTORS_PER_OBJECT * COMPACT
                ),
                true => format!("{base}, the data by write_full"),
                false => base,
            };
        }
        match self {
            Case::Data => format!("1 extent of {size} B"),
            Case::ObjectEnd => format!("{size} B + {} B at object end", n * META),
            Case::ObjectEndCompact => format!("{size} B + {} B at object end", n * COMPACT),
            Case::Omap => format!(
                "{size} B + {n} omap key{} (8 B + {META} B)",
                if n == 1 { "" } else { "s" }
            ),
            Case::Unaligned => format!("1 extent of {} B at {RECORD}*i", n * RECORD),
            Case::ObjectEndBlock => {
                let (_, len) = meta_blocks(0, n);
                format!("{size} B + {len} B (whole 4 KiB blocks) at object end")
            }
            Case::OmapBlock
            | Case::OmapChunk
            | Case::OmapWideChunk
            | Case::OmapHalf
            | Case::OmapOne => {
                let per = self.sectors_per_value();
                let values = value_indexes(0, n, per).count();
                format!(
                    "{size} B + {values} omap key{} (8 B + {} B of metadata)",
                    if values == 1 { "" } else { "s" },
                    self.value_len()
                )
            }
            Case::Grouped if n < GROUP => {
                format!("{size} B + 4096 B (its group's metadata block, after the group)")
            }
            Case::Grouped => format!(
                "1 extent of {} B (data and its groups' metadata blocks)",
                size as u64 + n / GROUP * SECTOR
            ),
            Case::DataUnhinted
            | Case::ObjectEndBlockUnhinted
            | Case::DataFull
            | Case::OmapChunkFull
            | Case::ObjectEndCompactFull
            | Case::TailReadBoth
            | Case::OmapHalfReadBoth
            | Case::TailClearing
            | Case::TailPadded => unreachable!("handled above"),
        }
    }

    /// The object's length when written in full.
    fn object_len(self) -> u64 {
        if self == Case::TailPadded {
            return OBJECT_DATA + TAIL_PADDED;
        }
        match self.base() {
            Case::Data
            | Case::Omap
            | Case::OmapBlock
            | Case::OmapChunk
            | Case::OmapWideChunk
            | Case::OmapHalf
            | Case::OmapOne => OBJECT_DATA,
            Case::ObjectEnd | Case::ObjectEndBlock | Case::Grouped => {
                OBJECT_DATA + SECTORS_PER_OBJECT * META
            }
            Case::ObjectEndCompact => OBJECT_DATA + SECTORS_PER_OBJECT * COMPACT,
            Case::Unaligned => SECTORS_PER_OBJECT * RECORD,
            Case::DataUnhinted
            | Case::ObjectEndBlockUnhinted
            | Case::DataFull
            | Case::OmapChunkFull
            | Case::ObjectEndCompactFull
            | Case::TailReadBoth
            | Case::OmapHalfReadBoth
            | Case::TailClearing
            | Case::TailPadded => unreachable!("base() is not a variant"),
        }
    }

    /// The read operation of sectors `first..first + size / 4096` of an object: what its
    /// writes store for them (`IVDISK_BENCH_RW=read`).
    fn read_op(self, first: u64, size: usize) -> ReadOp {
        let n = size as u64 / SECTOR;
        let data = ReadStep::Read {
            offset: first * SECTOR,
            len: size as u64,
        };
        let values = |per: u64| {
            ReadStep::OmapGetByKeys(value_indexes(first, n, per).map(omap_key).collect())
        };
        let tail = ReadStep::Read {
            offset: OBJECT_DATA + first * COMPACT,
            len: n * COMPACT,
        };
        let op = ReadOp::new();
        match self {
            Case::TailReadBoth | Case::OmapHalfReadBoth => {
                return op.step(data).step(values(16)).step(tail);
            }
            Case::Grouped => panic!("case g has no read form"),
            _ => {}
        }
        match self.base() {
            Case::Data => op.step(data),
            Case::ObjectEnd => op.step(data).step(ReadStep::Read {
                offset: OBJECT_DATA + first * META,
                len: n * META,
            }),
            Case::ObjectEndBlock => {
                let (offset, len) = meta_blocks(first, n);
                op.step(data).step(ReadStep::Read { offset, len })
            }
            Case::ObjectEndCompact => op.step(data).step(tail),
            Case::Omap => op.step(data).step(ReadStep::OmapGetByKeys(
                (first..first + n).map(omap_key).collect(),
            )),
            Case::OmapBlock
            | Case::OmapChunk
            | Case::OmapWideChunk
            | Case::OmapHalf
            | Case::OmapOne => op.step(data).step(values(self.sectors_per_value())),
            Case::Unaligned => op.step(ReadStep::Read {
                offset: first * RECORD,
                len: n * RECORD,
            }),
            _ => unreachable!("base() is not a variant"),
        }
    }

    /// The write operation for the sectors `first..first + size / 4096` of an object: data from
    /// `data`, metadata (32 bytes per sector) from `meta`.
    fn op(self, first: u64, size: usize, data: &[u8], meta: &[u8]) -> WriteOp {
        let n = size as u64 / SECTOR;
        let block_meta = meta;
        let meta = &meta[..(n * META) as usize];
        let whole = self.writes_full() && first == 0 && size as u64 == OBJECT_DATA;
        if whole && self == Case::ObjectEndCompactFull {
            let mut one = Vec::with_capacity((self.object_len()) as usize);
            one.extend_from_slice(&data[..size]);
            one.extend_from_slice(&block_meta[..(n * COMPACT) as usize]);
            return WriteOp::new().step(WriteStep::WriteFull(one));
        }
        let extent = match whole {
            true => WriteOp::new().step(WriteStep::WriteFull(data[..size].to_vec())),
            false => WriteOp::new().write(first * SECTOR, &data[..size]),
        };
        match self.base() {
            Case::Data => extent,
            Case::ObjectEnd => extent.write(OBJECT_DATA + first * META, meta),
            Case::ObjectEndCompact => {
                let compact = &block_meta[..(n * COMPACT) as usize];
                let op = if self == Case::TailPadded && n == SECTORS_PER_OBJECT {
                    let mut tail = vec![0u8; TAIL_PADDED as usize];
                    tail[..compact.len()].copy_from_slice(compact);
                    extent.write(OBJECT_DATA, tail)
                } else {
                    extent.write(OBJECT_DATA + first * COMPACT, compact)
                };
                match self {
                    // Every key `omap-packed` could have set (eight hex digits); the objects
                    // of this case hold none.
                    Case::TailClearing | Case::TailPadded => op.step(WriteStep::OmapRemoveRange {
                        start: b"0".to_vec(),
                        end: b"g".to_vec(),
                    }),
                    _ => op,
                }
            }
            Case::Omap => extent.omap_set(
                meta.chunks(META as usize)
                    .zip(first..)
                    .map(|(value, sector)| (omap_key(sector), value))
                    .collect::<ivdisk_store::OmapPairs>(),
            ),
            Case::Unaligned => WriteOp::new().write(first * RECORD, &data[..(n * RECORD) as usize]),
            Case::ObjectEndBlock => {
                let (offset, len) = meta_blocks(first, n);
                extent.write(offset, &block_meta[..len as usize])
            }
            Case::OmapBlock
            | Case::OmapChunk
            | Case::OmapWideChunk
            | Case::OmapHalf
            | Case::OmapOne => {
                let per = self.sectors_per_value();
                extent.omap_set(
                    value_indexes(first, n, per)
                        .zip(block_meta.chunks(self.value_len() as usize))
                        .map(|(index, value)| (omap_key(index), value))
                        .collect::<ivdisk_store::OmapPairs>(),
                )
            }
            Case::Grouped => {
                let mut op = WriteOp::new();
                for (offset, data) in grouped_extents(first, n, data, block_meta) {
                    op = op.step(WriteStep::Write { offset, data });
                }
                op
            }
            Case::DataUnhinted
            | Case::ObjectEndBlockUnhinted
            | Case::DataFull
            | Case::OmapChunkFull
            | Case::ObjectEndCompactFull
            | Case::TailReadBoth
            | Case::OmapHalfReadBoth
            | Case::TailClearing
            | Case::TailPadded => unreachable!("base() is not a variant"),
        }
    }
}

/// Data sectors per group of the `grouped-4k` case: each group of 128 data sectors is
/// followed by the 4 KiB block of their metadata (128 x 32 bytes), so a write of whole groups
/// is one extent and a smaller one puts its metadata block next to its data.
const GROUP: u64 = 128;

/// The extents (offset, bytes) of a `grouped-4k` write of sectors `first..first + n` (within
/// one group, or whole groups, as the sizes measured are): the data from `data`, metadata
/// blocks from `meta` (4 KiB each).
fn grouped_extents(first: u64, n: u64, data: &[u8], meta: &[u8]) -> Vec<(u64, Vec<u8>)> {
    let block = SECTOR as usize;
    let at = |sector: u64| (sector / GROUP * (GROUP + 1) + sector % GROUP) * SECTOR;
    if n < GROUP {
        let group_meta = (first / GROUP * (GROUP + 1) + GROUP) * SECTOR;
        return vec![
            (at(first), data[..(n * SECTOR) as usize].to_vec()),
            (group_meta, meta[..block].to_vec()),
        ];
    }
    assert!(
        first.is_multiple_of(GROUP) && n.is_multiple_of(GROUP),
        "whole groups only"
    );
    let mut one = Vec::with_capacity(((n + n / GROUP) * SECTOR) as usize);
    for g in 0..(n / GROUP) as usize {
        let group = GROUP as usize * block;
        one.extend_from_slice(&data[g * group..(g + 1) * group]);
        one.extend_from_slice(&meta[g * block..(g + 1) * block]);
    }
    vec![(at(first), one)]
}

/// The indexes of the metadata pieces of `per` sectors each that hold the metadata of sectors
/// `first..first + n`.
fn value_indexes(first: u64, n: u64, per: u64) -> std::ops::Range<u64> {
    first / per..(first + n).div_ceil(per)
}

/// The whole 4 KiB blocks at the object's end that hold the metadata of sectors
/// `first..first + n`: offset and length.
fn meta_blocks(first: u64, n: u64) -> (u64, u64) {
    let start = (OBJECT_DATA + first * META) / SECTOR * SECTOR;
    let end = (OBJECT_DATA + (first + n) * META).div_ceil(SECTOR) * SECTOR;
    (start, end - start)
}

fn omap_key(sector: u64) -> Vec<u8> {
    sector.to_be_bytes().to_vec()
}

struct Config {
    bench: bool,
    json_stdout: bool,
    seconds: f64,
    warmup: f64,
    reps: usize,
    sizes: Vec<usize>,
    cases: Vec<Case>,
    objects: u64,
    alloc_hint: bool,
    /// `IVDISK_BENCH_RW=read`: measure each case's read operation instead of its writes.
    reads: bool,
}

impl Config {
    fn from_env() -> Config {
        let mut bench = false;
        let mut json_stdout = false;
        for arg in std::env::args().skip(1) {
            match arg.as_str() {
                "--bench" => bench = true,
                "--json" => json_stdout = true,
                // cargo test passes its own options (filters, --nocapture, ...): not ours.
                _ => {}
            }
        }
        let sizes = sizes_from_env().unwrap_or_else(|| SIZES.to_vec());
        let cases = match std::env::var("IVDISK_BENCH_CASES") {
            Ok(list) => Case::ALL
                .into_iter()
                .filter(|c| {
                    list.split(',')
                        .any(|s| s.trim() == c.letter().to_string() || s.trim() == c.name())
                })
                .collect(),
            // The smoke test checks every case, the measured run the paper's.
            Err(_) if !bench => Case::ALL.to_vec(),
            Err(_) => Case::DEFAULT.to_vec(),
        };
        assert!(
            !cases.is_empty(),
            "IVDISK_BENCH_CASES: a comma-separated subset of a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s"
        );
        let seconds = env_or("IVDISK_BENCH_SECONDS", 3.0);
        let reps = env_or("IVDISK_BENCH_REPS", 5);
        assert!(seconds > 0.0 && reps > 0);
        Config {
            bench,
            json_stdout,
            seconds,
            warmup: env_or("IVDISK_BENCH_WARMUP", 1.0),
            reps,
            sizes,
            cases,
            objects: if bench {
                env_or("IVDISK_BENCH_OBJECTS", 64)
            } else {
                1
            },
            alloc_hint: std::env::var("IVDISK_BENCH_ALLOC_HINT").as_deref() != Ok("0"),
            reads: match std::env::var("IVDISK_BENCH_RW").as_deref() {
                Ok("read") => true,
                Ok("write") | Err(_) => false,
                Ok(other) => panic!("IVDISK_BENCH_RW: `read` or `write`, not {other:?}"),
            },
        }
    }
}

/// What the measuring tasks share.
struct Bench {
    /// Sends the allocation hint with every write (the prefill's and the hinted cases').
    store: RadosStore,
    /// The same pool and namespace, without the hint.
    unhinted: RadosStore,
    /// The objects of each case, indexed like `Case::ALL`.
    names: Vec<Vec<ObjectName>>,
    /// Source bytes for extents (as long as the largest object).
    data: Vec<u8>,
    /// Source bytes for metadata.
    meta: Vec<u8>,
}

impl Bench {
    fn objects(&self, case: Case) -> &[ObjectName] {
        &self.names[case as usize]
    }

    /// The store a case's measured writes go through.
    fn store_for(&self, case: Case) -> &RadosStore {
        if case.hinted() {
            &self.store
        } else {
            &self.unhinted
        }
    }
}

#[derive(Clone, Copy)]
enum Stop {
    After(Duration),
    Ops(u64),
}

/// `depth` tasks issue operations of one case and size until `stop`; the time runs until the
/// last operation has completed.
async fn phase(
    bench: &Arc<Bench>,
    case: Case,
    size: usize,
    depth: usize,
    stop: Stop,
    seed: u64,
    reads: bool,
) -> Result<Run, StoreError> {
    let start = Instant::now();
    let budget = Arc::new(AtomicI64::new(match stop {
        Stop::Ops(n) => n as i64,
        Stop::After(_) => i64::MAX,
    }));
    let deadline = match stop {
        Stop::After(d) => start + d,
        Stop::Ops(_) => start + Duration::from_secs(24 * 3600),
    };
    let slots = SECTORS_PER_OBJECT / (size as u64 / SECTOR);
    let tasks: Vec<_> = (0..depth as u64)
        .map(|task| {
            let (bench, budget) = (bench.clone(), budget.clone());
            tokio::spawn(async move {
                let mut rng = Rng(seed.wrapping_mul(1000).wrapping_add(task));
                let objects = bench.objects(case);
                let mut ops = 0u64;
                while Instant::now() < deadline && budget.fetch_sub(1, Ordering::Relaxed) > 0 {
                    let object = &objects[rng.below(objects.len() as u64) as usize];
                    let first = rng.below(slots) * (size as u64 / SECTOR);
                    if reads {
                        let op = case.read_op(first, size);
                        bench.store.read_op(object, op).await?;
                    } else {
                        let op = case.op(first, size, &bench.data, &bench.meta);
                        bench.store_for(case).write_op(object, op).await?;
                    }
                    ops += 1;
                }
                Ok::<u64, StoreError>(ops)
            })
        })
        .collect();
    let mut ops = 0;
    let mut failed = None;
    for task in tasks {
        match task.await.expect("a write task panicked") {
            Ok(n) => ops += n,
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(Run {
            ops,
            elapsed: start.elapsed(),
        }),
    }
}

/// Write every object of the measured cases in full (and `c`'s 1024 keys), 32 at a time.
async fn prefill(bench: &Arc<Bench>, cases: &[Case]) -> Result<(), StoreError> {
    let jobs: Vec<(Case, &ObjectName)> = cases
        .iter()
        .flat_map(|&c| bench.objects(c).iter().map(move |n| (c, n)))
        .collect();
    stream::iter(jobs)
        .map(|(case, name)| async move {
            let mut op = WriteOp::new().step(WriteStep::WriteFull(
                bench.data[..case.object_len() as usize].to_vec(),
            ));
            if case == Case::Omap {
                op = op.omap_set(
                    (0..SECTORS_PER_OBJECT)
                        .map(|s| {
                            let at = (s * META) as usize;
                            (omap_key(s), &bench.meta[at..at + META as usize])
                        })
                        .collect::<ivdisk_store::OmapPairs>(),
                );
            }
            if matches!(
                case.base(),
                Case::OmapBlock
                    | Case::OmapChunk
                    | Case::OmapWideChunk
                    | Case::OmapHalf
                    | Case::OmapOne
            ) {
                let per = case.sectors_per_value();
                op = op.omap_set(
                    value_indexes(0, SECTORS_PER_OBJECT, per)
                        .zip(bench.meta.chunks(case.value_len() as usize))
                        .map(|(index, value)| (omap_key(index), value))
                        .collect::<ivdisk_store::OmapPairs>(),
                );
            }
            bench.store.write_op(name, op).await.map(drop)
        })
        .buffer_unordered(QUEUE_DEPTH)
        .try_collect::<Vec<()>>()
        .await
        .map(drop)
}

/// The bytes `[offset, offset + len)` of an object, from a read step's extents.
fn assemble(result: &ReadResult, offset: u64, len: u64) -> Vec<u8> {
    let ReadResult::Extents(extents) = result else {
        panic!("a read step returned {result:?}");
    };
    let mut out = vec![0u8; len as usize];
    for e in extents {
        let at = (e.offset - offset) as usize;
        out[at..at + e.data.len()].copy_from_slice(&e.data);
    }
    out
}

/// Write one operation of `case` with fresh bytes and read back what it should have changed.
async fn check(bench: &Bench, case: Case, size: usize, seed: u64) -> Result<(), StoreError> {
    let mut rng = Rng(seed);
    let n = size as u64 / SECTOR;
    let first = rng.below(SECTORS_PER_OBJECT / n) * n;
    let data = rng.bytes((n * RECORD) as usize);
    let (block_at, block_len) = meta_blocks(first, n);
    let meta = rng.bytes((n * META).max(block_len) as usize);
    let object = &bench.objects(case)[0];
    bench
        .store_for(case)
        .write_op(object, case.op(first, size, &data, &meta))
        .await?;
    let what = format!("{} {}", case.name(), size_label(size));
    // What to read back depends only on the layout.
    let case = case.base();
    if case == Case::Grouped {
        for (offset, bytes) in grouped_extents(first, n, &data, &meta) {
            let len = bytes.len() as u64;
            let read = ReadOp::new().step(ReadStep::Read { offset, len });
            let results = bench.store.read_op(object, read).await?;
            assert!(
                assemble(&results[0], offset, len) == bytes,
                "{what}: the extent at {offset} read back differs from the one written"
            );
        }
        return Ok(());
    }
    let (offset, len) = match case {
        Case::Unaligned => (first * RECORD, n * RECORD),
        _ => (first * SECTOR, size as u64),
    };
    let mut read = ReadOp::new().step(ReadStep::Read { offset, len });
    let (meta_at, meta_len) = match case {
        Case::ObjectEndBlock => (block_at, block_len),
        Case::ObjectEndCompact => (OBJECT_DATA + first * COMPACT, n * COMPACT),
        _ => (OBJECT_DATA + first * META, n * META),
    };
    match case {
        Case::ObjectEnd | Case::ObjectEndBlock | Case::ObjectEndCompact => {
            read = read.step(ReadStep::Read {
                offset: meta_at,
                len: meta_len,
            })
        }
        Case::Omap => {
            read = read.step(ReadStep::OmapGetByKeys(
                (first..first + n).map(omap_key).collect(),
            ))
        }
        Case::OmapBlock
        | Case::OmapChunk
        | Case::OmapWideChunk
        | Case::OmapHalf
        | Case::OmapOne => {
            read = read.step(ReadStep::OmapGetByKeys(
                value_indexes(first, n, case.sectors_per_value())
                    .map(omap_key)
                    .collect(),
            ))
        }
        _ => {}
    }
    let results = bench.store.read_op(object, read).await?;
    assert!(
        assemble(&results[0], offset, len) == data[..len as usize],
        "{what}: the extent read back differs from the one written"
    );
    match case {
        Case::ObjectEnd | Case::ObjectEndBlock | Case::ObjectEndCompact => assert!(
            assemble(&results[1], meta_at, meta_len) == meta[..meta_len as usize],
            "{what}: the object-end metadata read back differs"
        ),
        Case::Omap
        | Case::OmapBlock
        | Case::OmapChunk
        | Case::OmapWideChunk
        | Case::OmapHalf
        | Case::OmapOne => {
            // Per sector (its 32 bytes) or per piece of `sectors_per_value` sectors.
            let expected: ivdisk_store::OmapPairs = match case {
                Case::Omap => meta[..(n * META) as usize]
                    .chunks(META as usize)
                    .zip(first..)
                    .map(|(v, s)| (omap_key(s), v))
                    .collect(),
                _ => {
                    let per = case.sectors_per_value();
                    value_indexes(first, n, per)
                        .zip(meta.chunks(case.value_len() as usize))
                        .map(|(index, v)| (omap_key(index), v))
                        .collect()
                }
            };
            assert!(
                results[1]
                    == ReadResult::Omap {
                        pairs: expected,
                        more: false
                    },
                "{what}: the omap pairs read back differ"
            );
        }
        _ => {}
    }
    Ok(())
}

/// Remove the run's objects (missing ones are fine); how many remain in the namespace.
async fn cleanup(bench: &Bench) -> Result<usize, StoreError> {
    stream::iter(bench.names.iter().flatten())
        .map(|name| async move {
            match bench
                .store
                .write_op(name, WriteOp::new().step(WriteStep::Remove))
                .await
            {
                Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        })
        .buffer_unordered(QUEUE_DEPTH)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(bench.store.list("").await?.len())
}

/// Per case and size: the samples of every round.
#[derive(Default, Clone)]
struct Samples {
    ops: Vec<f64>,
    mb: Vec<f64>,
    ratio: Vec<f64>,
}

async fn measure(bench: &Arc<Bench>, cfg: &Config) -> Result<Vec<Vec<Samples>>, StoreError> {
    let mut samples = vec![vec![Samples::default(); Case::ALL.len()]; cfg.sizes.len()];
    let mut seed = 1u64;
    let mut next_seed = || {
        seed += 1;
        seed
    };
    for (i, &size) in cfg.sizes.iter().enumerate() {
        for &case in &cfg.cases {
            let warmup = Duration::from_secs_f64(cfg.warmup);
            let r = phase(
                bench,
                case,
                size,
                QUEUE_DEPTH,
                Stop::After(warmup),
                next_seed(),
                cfg.reads,
            )
            .await?;
            eprintln!(
                "warm-up {:>7} {}: {:.0} ops/s",
                size_label(size),
                case.letter(),
                r.ops_per_s()
            );
        }
        for round in 0..cfg.reps {
            let mut runs = [None; Case::ALL.len()];
            let k = cfg.cases.len();
            for j in 0..k {
                let case = cfg.cases[(j + round) % k];
                let stop = Stop::After(Duration::from_secs_f64(cfg.seconds));
                runs[case as usize] = Some(
                    phase(bench, case, size, QUEUE_DEPTH, stop, next_seed(), cfg.reads).await?,
                );
            }
            let mut line = format!("round {} {:>7}:", round + 1, size_label(size));
            let base = runs[Case::Data as usize];
            for case in Case::ALL {
                let Some(r) = runs[case as usize] else {
                    continue;
                };
                let s = &mut samples[i][case as usize];
                s.ops.push(r.ops_per_s());
                s.mb.push(r.mb_per_s(size));
                let _ = write!(line, "  {} {:.0} ops/s", case.letter(), r.ops_per_s());
                if let Some(b) = base {
                    let q = r.ops_per_s() / b.ops_per_s();
                    s.ratio.push(q);
                    let _ = write!(line, " ({q:.2})");
                }
            }
            eprintln!("{line}");
        }
    }
    Ok(samples)
}

fn table(cfg: &Config, samples: &[Vec<Samples>]) -> String {
    let mut out = String::new();
    let op = match cfg.reads {
        true => "what its writes store (each read fetches that back)",
        false => "one write op",
    };
    let _ = writeln!(
        out,
        "| size | case | {op} | ops/s | data MB/s | ratio to a (median, min..max) |"
    );
    out.push_str("|---:|---|---|---:|---:|---|\n");
    for (&size, per_case) in cfg.sizes.iter().zip(samples) {
        for &case in &cfg.cases {
            let s = &per_case[case as usize];
            let ratio = if s.ratio.is_empty() {
                "-".to_owned()
            } else {
                let (lo, hi) = min_max(&s.ratio);
                format!("{:.2} ({lo:.2}..{hi:.2})", median(&s.ratio))
            };
            let _ = writeln!(
                out,
                "| {} | {} {} | {} | {:.0} | {:.1} | {ratio} |",
                size_label(size),
                case.letter(),
                case.name(),
                case.describe(size),
                median(&s.ops),
                median(&s.mb),
            );
        }
    }
    out
}

fn json(
    cfg: &Config,
    m: &ivdisk_bench_support::Machine,
    pool: &str,
    namespace: &str,
    samples: &[Vec<Samples>],
) -> String {
    let mut json = String::from("{\n");
    let _ = writeln!(json, "  \"machine\": {},", m.to_json());
    let _ = writeln!(
        json,
        "  \"pool\": {}, \"namespace\": {}, \"objects_per_case\": {}, \"alloc_hint\": {},",
        json_str(pool),
        json_str(namespace),
        cfg.objects,
        cfg.alloc_hint
    );
    let _ = writeln!(
        json,
        "  \"queue_depth\": {QUEUE_DEPTH}, \"seconds\": {}, \"warmup_seconds\": {}, \"reps\": {}, \
         \"rw\": \"{}\",",
        cfg.seconds,
        cfg.warmup,
        cfg.reps,
        if cfg.reads { "read" } else { "write" }
    );
    json.push_str("  \"results\": [\n");
    let mut rows = Vec::new();
    for (&size, per_case) in cfg.sizes.iter().zip(samples) {
        for &case in &cfg.cases {
            let s = &per_case[case as usize];
            rows.push(format!(
                "    {{\"size\": {size}, \"case\": \"{}\", \"name\": \"{}\", \"op\": {}, \
                 \"ops_per_s\": {}, \"data_mb_per_s\": {}, \"ratio_to_a\": {}}}",
                case.letter(),
                case.name(),
                json_str(&case.describe(size)),
                json_list(&s.ops, 4),
                json_list(&s.mb, 4),
                json_list(&s.ratio, 4)
            ));
        }
    }
    json.push_str(&rows.join(",\n"));
    json.push_str("\n  ]\n}\n");
    json
}

fn main() {
    let cfg = Config::from_env();
    if std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1") {
        println!("rados_ops: SKIPPED: IVDISK_NO_CEPH=1, no Ceph cluster to measure");
        return;
    }
    let Some(conf) = std::env::var_os("CEPH_CONF") else {
        eprintln!(
            "rados_ops needs a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster start)\"` \
             (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip it"
        );
        std::process::exit(1);
    };
    let mut random = [0u8; 4];
    getrandom::getrandom(&mut random).expect("random bytes");
    let namespace = format!("ivdisk-bench-{}", hex::encode(random));
    let config = RadosConfig {
        conf: Some(PathBuf::from(&conf)),
        namespace: namespace.clone(),
        connect_timeout: Duration::from_secs(20),
        expected_object_size: cfg.alloc_hint.then_some(OBJECT_DATA),
        ..RadosConfig::new(std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into()))
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let store = runtime
        .block_on(RadosStore::open(&config))
        .unwrap_or_else(|e| {
            panic!(
                "opening pool `{}` ({}): {e}",
                config.pool,
                conf.to_string_lossy()
            )
        });

    let m = machine();
    let (log, what) = if cfg.bench {
        ("measuring", "benchmark")
    } else {
        ("smoke test (no --bench)", "smoke test")
    };
    eprintln!(
        "rados_ops {log}: pool `{}`, namespace `{namespace}`, CEPH_CONF={}",
        config.pool,
        conf.to_string_lossy()
    );
    eprintln!(
        "client: {} CPUs ({}), {}, Linux {}",
        m.cpus, m.cpu_model, m.memory, m.kernel
    );

    let mut rng = Rng(0x1d15c);
    let longest = Case::ALL.iter().map(|c| c.object_len()).max().unwrap_or(0);
    let names = Case::ALL
        .iter()
        .map(|c| {
            (0..cfg.objects)
                .map(|i| ObjectName::new(format!("bench_{}.{i:016x}", c.letter())).expect("name"))
                .collect()
        })
        .collect();
    let unhinted = runtime
        .block_on(RadosStore::open(&RadosConfig {
            expected_object_size: None,
            ..config.clone()
        }))
        .unwrap_or_else(|e| panic!("opening pool `{}` a second time: {e}", config.pool));
    let bench = Arc::new(Bench {
        store,
        unhinted,
        names,
        data: rng.bytes(longest as usize),
        meta: rng.bytes((SECTORS_PER_OBJECT * META) as usize),
    });

    let outcome = runtime.block_on(async {
        let started = Instant::now();
        prefill(&bench, &cfg.cases).await?;
        eprintln!(
            "prefilled {} objects per case in {:.1} s",
            cfg.objects,
            started.elapsed().as_secs_f64()
        );
        if cfg.bench {
            eprintln!(
                "queue depth {QUEUE_DEPTH}; {} s per measurement, {} rounds, {} s warm-up; \
                 {} objects per case; MB = 10^6 data bytes",
                cfg.seconds, cfg.reps, cfg.warmup, cfg.objects
            );
            for &size in &cfg.sizes {
                for &case in &cfg.cases {
                    check(&bench, case, size, size as u64 ^ case as u64).await?;
                }
            }
            measure(&bench, &cfg).await.map(Some)
        } else {
            for &size in &cfg.sizes {
                for &case in &cfg.cases {
                    let seed = size as u64;
                    let run = phase(&bench, case, size, 2, Stop::Ops(2), seed, false).await?;
                    assert_eq!(run.ops, 2, "{} {}", case.name(), size_label(size));
                    if case != Case::Grouped {
                        let run = phase(&bench, case, size, 2, Stop::Ops(2), seed, true).await?;
                        assert_eq!(run.ops, 2, "{} {} reads", case.name(), size_label(size));
                    }
                    check(&bench, case, size, size as u64 ^ case as u64).await?;
                }
            }
            Ok(None)
        }
    });
    let left = runtime.block_on(cleanup(&bench));
    match &left {
        Ok(0) => eprintln!("removed the objects; namespace `{namespace}` is empty"),
        Ok(n) => eprintln!("{n} objects remain in namespace `{namespace}`"),
        Err(e) => eprintln!("removing the objects of namespace `{namespace}` failed: {e}"),
    }
    let samples = match outcome {
        Ok(Some(samples)) => samples,
        Ok(None) => {
            println!(
                "rados_ops: smoke test passed ({} cases x {} sizes, 2 writes + 2 reads each)",
                cfg.cases.len(),
                cfg.sizes.len()
            );
            left.expect("removing the objects");
            return;
        }
        Err(e) => panic!("{what} failed: {e}"),
    };

    let json = json(&cfg, &m, &config.pool, &namespace, &samples);
    let out = target_dir(env!("CARGO_MANIFEST_DIR")).join("bench-rados-ops.json");
    if let Err(e) = std::fs::create_dir_all(target_dir(env!("CARGO_MANIFEST_DIR")))
        .and_then(|_| std::fs::write(&out, &json))
    {
        eprintln!("writing {}: {e}", out.display());
    } else {
        eprintln!("samples: {}", out.display());
    }
    if cfg.json_stdout {
        print!("{json}");
    } else {
        println!(
            "RADOS {} ops, queue depth {QUEUE_DEPTH}, {} objects per case; \
             client {} CPUs ({}), {}",
            if cfg.reads { "read" } else { "write" },
            cfg.objects,
            m.cpus,
            m.cpu_model,
            m.memory
        );
        println!(
            "{} rounds x {} s per case, interleaved; medians; MB = 10^6 data bytes\n",
            cfg.reps, cfg.seconds
        );
        print!("{}", table(&cfg, &samples));
    }
}
