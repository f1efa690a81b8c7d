//! Where a sector's ciphertext and metadata live inside an object: the paper's three layouts
//! (`object-end`, `unaligned`, `omap`) and `none` for suites without metadata.
//!
//! A layout only turns "these sectors of this object" into store steps and back; the image
//! layer (`crate::io`) owns splitting IO, what gets encrypted and deciding what is unwritten.
//! A layout whose stored form rearranges the ciphertext (`unaligned`) may call the cipher
//! itself, piece by piece, to write straight into that form
//! ([`SectorLayout::write_encrypted`]). Adding a
//! layout: a module here implementing [`SectorLayout`], a [`LayoutKind`] variant, and a line in
//! [`LayoutKind::build`]; the matrix tests iterate [`LayoutKind::ALL`].

mod none;
mod object_end;
mod omap;
mod omap_packed;
mod unaligned;

pub(crate) use unaligned::DIRECT_GROUP as UNALIGNED_DIRECT_GROUP;

use omap_packed::WholeObjects;

use std::fmt;
use std::str::FromStr;

use ivdisk_crypto::{CryptoError, SectorCipher};
use ivdisk_store::{Extent, ReadResult, ReadStep, WriteStep};

use crate::{PayloadPlacement, WritePayload};

/// The layout of an image, chosen at create time and recorded in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayoutKind {
    /// No per-sector metadata: ciphertext at the sector's offset, as LUKS2/librbd store it.
    None,
    /// All data sectors first, then the object's packed metadata at its end (the paper's best).
    ObjectEnd,
    /// Each sector's metadata right after its ciphertext (slots of sector size + metadata).
    Unaligned,
    /// Metadata in the object's omap, key = sector index within the object (8 hex digits).
    Omap,
    /// Metadata in the object's omap, one value per run of 16 sectors (ours: one small value
    /// per write up to 64 KiB; written through the writer's metadata cache).
    OmapPacked,
    /// `omap-packed`, but a write covering a whole object puts the object's metadata at its
    /// end and removes its values (ours: the metadata of large writes as an extent).
    OmapTail,
}

impl LayoutKind {
    /// Every layout, in the order `--help` lists them.
    pub const ALL: [LayoutKind; 6] = [
        LayoutKind::ObjectEnd,
        LayoutKind::Unaligned,
        LayoutKind::Omap,
        LayoutKind::OmapPacked,
        LayoutKind::OmapTail,
        LayoutKind::None,
    ];

    /// The layouts that store metadata (for suites that have some).
    pub const WITH_METADATA: [LayoutKind; 5] = [
        LayoutKind::ObjectEnd,
        LayoutKind::Unaligned,
        LayoutKind::Omap,
        LayoutKind::OmapPacked,
        LayoutKind::OmapTail,
    ];

    /// The layout new images get when the user names none: `omap-packed` for suites with
    /// metadata, `none` for those without. `omap-packed` because on RADOS its writes cost the
    /// OSDs what librbd LUKS2's do up to 64 KiB, where `object-end`'s second extent costs them
    /// 11-15% more, and random writes of VMs are mostly that small; from 128 KiB to 4 MiB,
    /// with its compact values, it is within a few percent of `object-end` either way, and
    /// ties on the local store (docs/BENCHMARKS.md, "omap-packed as the default" and
    /// "Smaller metadata for large writes").
    pub fn default_for(metadata_len: usize) -> LayoutKind {
        if metadata_len == 0 {
            LayoutKind::None
        } else {
            LayoutKind::OmapPacked
        }
    }

    /// The name used on the command line and in the header.
    pub const fn name(self) -> &'static str {
        match self {
            LayoutKind::None => "none",
            LayoutKind::ObjectEnd => "object-end",
            LayoutKind::Unaligned => "unaligned",
            LayoutKind::Omap => "omap",
            LayoutKind::OmapPacked => "omap-packed",
            LayoutKind::OmapTail => "omap-tail",
        }
    }

    /// One line for `--help`.
    pub const fn summary(self) -> &'static str {
        match self {
            LayoutKind::None => {
                "no metadata (aes-xts-plain64, aes-hctr2-plain64); LUKS2/librbd-compatible objects"
            }
            LayoutKind::ObjectEnd => "data sectors first, packed metadata at the object's end",
            LayoutKind::Unaligned => "each sector's metadata right after it",
            LayoutKind::Omap => "metadata in the object's key/value map",
            LayoutKind::OmapPacked => {
                "metadata in the object's key/value map, 16 sectors per value (default)"
            }
            LayoutKind::OmapTail => {
                "as omap-packed, but a write of a whole object puts its metadata at its end"
            }
        }
    }

    /// The layouts for suites with metadata, for messages: "object-end, unaligned, ... or X".
    pub fn with_metadata_names() -> String {
        let names: Vec<_> = Self::WITH_METADATA.iter().map(|l| l.name()).collect();
        let (last, rest) = names.split_last().expect("layouts with metadata");
        format!("{} or {last}", rest.join(", "))
    }

    /// Whether this layout can hold `metadata_len` bytes per sector.
    pub fn fits(self, metadata_len: usize) -> bool {
        (self == LayoutKind::None) == (metadata_len == 0)
    }

    pub(crate) fn build(self, geometry: ObjectGeometry) -> Box<dyn SectorLayout> {
        match self {
            LayoutKind::None => Box::new(none::NoMetadata(geometry)),
            LayoutKind::ObjectEnd => Box::new(object_end::ObjectEnd(geometry)),
            LayoutKind::Unaligned => Box::new(unaligned::Unaligned(geometry)),
            LayoutKind::Omap => Box::new(omap::Omap(geometry)),
            LayoutKind::OmapPacked => {
                Box::new(omap_packed::OmapPacked(geometry, WholeObjects::AsValues))
            }
            LayoutKind::OmapTail => {
                Box::new(omap_packed::OmapPacked(geometry, WholeObjects::AtTail))
            }
        }
    }

    /// For layouts whose metadata the writer keeps in its metadata cache: where the cache
    /// places the object's metadata region, its length, and the bytes the cache writes as one
    /// whole block (`None`: the store's write unit).
    pub(crate) fn cached_region(
        self,
        geometry: ObjectGeometry,
    ) -> Option<(u64, usize, Option<u64>)> {
        let region_len = geometry.sectors_per_object as usize * geometry.metadata_len;
        match self {
            LayoutKind::ObjectEnd => Some((
                geometry.sectors_per_object as u64 * geometry.sector_size as u64,
                region_len,
                None,
            )),
            LayoutKind::OmapPacked | LayoutKind::OmapTail => {
                let layout = omap_packed::OmapPacked(geometry, WholeObjects::AsValues);
                Some((
                    omap_packed::VIRTUAL_REGION,
                    region_len,
                    Some(layout.value_len() as u64),
                ))
            }
            _ => None,
        }
    }
}

impl fmt::Display for LayoutKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LayoutKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        LayoutKind::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = LayoutKind::ALL.iter().map(|l| l.name()).collect();
                format!("unknown layout `{s}` (known: {})", names.join(", "))
            })
    }
}

/// The shape of one data object: sectors of `sector_size` bytes, `metadata_len` bytes of
/// metadata each, `sectors_per_object` of them. The first `nonce_len` bytes of a sector's
/// metadata are a nonce that counts up across the sectors sealed in one run
/// (`Suite::counted_nonce_len`; 0: none), which a layout may store once per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectGeometry {
    pub sector_size: usize,
    pub metadata_len: usize,
    pub nonce_len: usize,
    pub sectors_per_object: u32,
}

/// Turns "sectors `first..first + count` of one object" into store steps and back. Sector
/// indexes are within the object. Implementations add steps to the caller's lists so that one
/// IO's data and metadata for an object go out in one atomic operation.
pub(crate) trait SectorLayout: Send + Sync + fmt::Debug {
    /// Steps storing the ciphertext (`count * sector_size` bytes) and packed metadata of
    /// `count` sectors, both taken by value so they can become write steps without a copy.
    fn write(&self, steps: &mut Vec<WriteStep>, first: u32, ciphertext: Vec<u8>, metadata: Vec<u8>);

    /// Encrypt the whole sectors of `plaintext` (`first_sector` is the first one's number for
    /// the cipher) and add the steps storing them at sector index `first`. By default one
    /// call encrypts the run into a fresh buffer that [`SectorLayout::write`] stores.
    fn write_encrypted(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        plaintext: &[u8],
    ) -> Result<(), CryptoError> {
        let sectors = plaintext.len() / cipher.sector_size();
        let headroom = self.data_headroom(first, sectors as u32);
        let mut ciphertext = Vec::with_capacity(plaintext.len() + headroom);
        let mut metadata = vec![0u8; sectors * cipher.metadata_len()];
        cipher.encrypt_sectors_append(first_sector, plaintext, &mut ciphertext, &mut metadata)?;
        self.write(steps, first, ciphertext, metadata);
        Ok(())
    }

    /// [`SectorLayout::write_encrypted`] for a plaintext the caller hands over (the NBD
    /// server's write payload): by default encrypted in place and stored as it is, so a write
    /// needs no second buffer of its size (for 4 MiB writes, fresh memory the kernel zeroes
    /// page by page). A layout that stores the ciphertext rearranged overrides this too.
    fn write_encrypted_owned(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        mut plaintext: Vec<u8>,
    ) -> Result<(), CryptoError> {
        let sectors = plaintext.len() / cipher.sector_size();
        let mut metadata = vec![0u8; sectors * cipher.metadata_len()];
        cipher.encrypt_sectors(first_sector, &mut plaintext, &mut metadata)?;
        self.write(steps, first, plaintext, metadata);
        Ok(())
    }

    /// Spare capacity, in bytes, that the data buffer of a write of sectors `first..first +
    /// count` should have, so that it goes to the store without being moved: `omap-tail`
    /// appends a whole object's metadata to its data ([`SectorLayout::lower_cached_steps`]).
    /// 0 for the rest.
    fn data_headroom(&self, _first: u32, _count: u32) -> usize {
        0
    }

    /// Where a receiver should put the plaintext of a write of sectors `first..first +
    /// count` that it hands over: together with [`SectorLayout::data_headroom`] to spare, or
    /// (`unaligned`) in the slots the layout stores, for
    /// [`SectorLayout::write_encrypted_in_slots`].
    fn payload_placement(&self, first: u32, count: u32) -> PayloadPlacement {
        PayloadPlacement::Contiguous {
            spare: self.data_headroom(first, count),
        }
    }

    /// [`SectorLayout::write_encrypted_owned`] of a plaintext handed over in slots of
    /// `sector_size + metadata_len` bytes, each sector at the start of its slot, as
    /// [`SectorLayout::payload_placement`] asked for. By default (a layout that does not
    /// ask for slots) the sectors are gathered into one buffer first.
    fn write_encrypted_in_slots(
        &self,
        steps: &mut Vec<WriteStep>,
        first: u32,
        cipher: &dyn SectorCipher,
        first_sector: u64,
        slots: Vec<u8>,
    ) -> Result<(), CryptoError> {
        let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
        let plaintext = WritePayload::in_slots(slots, ss, ss + ml).into_contiguous();
        self.write_encrypted_owned(steps, first, cipher, first_sector, plaintext)
    }

    /// Steps returning sectors to the unwritten state (zeros in data and metadata, or no
    /// metadata key), freeing space where the store can.
    fn discard(&self, steps: &mut Vec<WriteStep>, first: u32, count: u32);

    /// Read steps fetching the ciphertext and metadata of `count` sectors.
    fn read(&self, steps: &mut Vec<ReadStep>, first: u32, count: u32);

    /// Fill `metadata`, and `ciphertext` or the returned buffer, from the results of
    /// [`SectorLayout::read`]'s steps (consumed from `results` in order). Bytes never written
    /// come out zero: `metadata` arrives zeroed, `ciphertext` may arrive holding anything (it
    /// is the caller's read buffer) and must be overwritten whole, unless the ciphertext comes
    /// back in the store's own buffer ([`Decoded::Taken`] or [`Decoded::Slots`], `ciphertext`
    /// untouched: an owned output is then never made), so the caller can decrypt from it
    /// straight into its buffer, or in place, instead of copying first. An `Err` names what
    /// was malformed.
    fn decode(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        first: u32,
        count: u32,
        ciphertext: &mut ReadOutput<'_>,
        metadata: &mut [u8],
    ) -> Result<Decoded, String>;

    /// Whether writes must go through the writer's metadata cache (the layout cannot store a
    /// metadata change without the metadata around it).
    fn needs_metadata_cache(&self) -> bool {
        false
    }

    /// Turn the metadata steps the cache left (region offsets) into the store's steps. `Err`
    /// names a step that cannot be stored as it is.
    fn lower_cached_steps(&self, _steps: &mut Vec<WriteStep>) -> Result<(), String> {
        Ok(())
    }

    /// The read steps fetching bytes `range` of the metadata region that the cache places at
    /// `region_offset` (the cache asks for whole blocks).
    fn cached_fetch_steps(
        &self,
        region_offset: u64,
        range: &std::ops::Range<usize>,
        steps: &mut Vec<ReadStep>,
    ) {
        steps.push(ReadStep::Read {
            offset: region_offset + range.start as u64,
            len: range.len() as u64,
        })
    }

    /// Region bytes `range` from the results of [`SectorLayout::cached_fetch_steps`]
    /// (consumed from `results` in order).
    fn cached_fetched(
        &self,
        results: &mut dyn Iterator<Item = ReadResult>,
        region_offset: u64,
        range: &std::ops::Range<usize>,
    ) -> Result<Vec<u8>, String> {
        extent_bytes(
            results.next(),
            region_offset + range.start as u64,
            range.len(),
        )
    }
}

/// The metadata a layout hands over for sectors whose stored metadata is malformed (an omap
/// value of the wrong length): bytes that never authenticate and are not the all-zero
/// unwritten state, so an authenticated suite reports exactly those sectors as failing (EIO,
/// listed by `verify`) instead of the whole read failing. Suites without a MAC cannot tell, as
/// for any change to their metadata.
pub(crate) const DAMAGED_METADATA: u8 = 0xFF;

/// Where [`SectorLayout::decode`] left a run.
#[derive(Debug)]
pub(crate) enum Decoded {
    /// In the caller's `ciphertext` and `metadata`.
    Placed,
    /// The ciphertext in this buffer (exactly the run's length); the metadata in the caller's
    /// `metadata`.
    Taken(Vec<u8>),
    /// Ciphertext and metadata as slots in this buffer, each sector's ciphertext followed by
    /// its metadata (`unaligned`); the caller's buffers untouched.
    Slots(Vec<u8>),
}

impl From<Option<Vec<u8>>> for Decoded {
    /// What [`take_or_place_extents`] returns, as a [`Decoded`].
    fn from(taken: Option<Vec<u8>>) -> Self {
        taken.map_or(Decoded::Placed, Decoded::Taken)
    }
}

/// The largest stored size of one data object in any layout: every sector's data and
/// metadata, rounded up to a multiple of 4 KiB (`omap-tail` pads its tail to that).
pub(crate) fn max_stored_object_len(
    object_size: u64,
    sector_size: u32,
    metadata_len: usize,
) -> u64 {
    let ss = u64::from(sector_size);
    (object_size / ss * (ss + metadata_len as u64)).next_multiple_of(omap_packed::TAIL_ALIGN)
}

/// The store's buffer of a read of `[base, base + out.len())` when one extent covers exactly
/// that (the common case: a written run), or else `None` after [`place_extents`] into `out`.
pub(crate) fn take_or_place_extents(
    result: Option<ReadResult>,
    base: u64,
    out: &mut ReadOutput<'_>,
) -> Result<Option<Vec<u8>>, String> {
    match whole_extent(result, base, out.len()) {
        Ok(data) => Ok(Some(data)),
        Err(other) => place_extents(other, base, out.slice()).map(|()| None),
    }
}

/// Where a read's plaintext goes.
pub(crate) enum ReadOutput<'a> {
    /// Into the caller's buffer.
    Borrowed(&'a mut [u8]),
    /// Into a buffer the read returns (`Image::read_owned`): the store's own, decrypted in
    /// place, when it hands one over for the whole run (no second buffer, and the cipher works
    /// in place, as in its raw cost); else a new one of `len` bytes, made on first use.
    /// `slots`: whether the read may return an `unaligned` run's slots as they are, each
    /// sector decrypted in its slot (`Image::read_reply`), and then the slot's size.
    Owned {
        len: usize,
        buf: Option<Vec<u8>>,
        slots: SlotReply,
    },
}

/// Whether an owned read's buffer may hold, or holds, slots (`ReadOutput::Owned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotReply {
    /// The caller takes the plaintext together only.
    Refused,
    /// The caller takes slots too.
    Allowed,
    /// The buffer holds slots of this many bytes, each sector's plaintext at its start.
    Returned(usize),
}

impl ReadOutput<'_> {
    /// The buffer to place and decrypt into.
    pub(crate) fn slice(&mut self) -> &mut [u8] {
        match self {
            ReadOutput::Borrowed(out) => out,
            ReadOutput::Owned { len, buf, .. } => buf.get_or_insert_with(|| vec![0u8; *len]),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            ReadOutput::Borrowed(out) => out.len(),
            ReadOutput::Owned { len, .. } => *len,
        }
    }

    /// An owned output's plaintext (a buffer of zeros if nothing was read into it), as the
    /// slots it was decrypted in where the read returned them.
    pub(crate) fn into_reply(self, sector_size: usize) -> crate::ReadReply {
        match self {
            ReadOutput::Borrowed(out) => crate::ReadReply::contiguous(out.to_vec()),
            ReadOutput::Owned {
                len,
                buf: Some(buf),
                slots: SlotReply::Returned(slot),
            } => crate::ReadReply::in_slots(buf, len, sector_size, slot),
            ReadOutput::Owned { len, buf, .. } => {
                crate::ReadReply::contiguous(buf.unwrap_or_else(|| vec![0u8; len]))
            }
        }
    }
}

/// The bytes of a read of `[base, base + len)`: the store's buffer when one extent covers
/// exactly that, else a new buffer the extents are placed into.
pub(crate) fn extent_bytes(
    result: Option<ReadResult>,
    base: u64,
    len: usize,
) -> Result<Vec<u8>, String> {
    whole_extent(result, base, len).or_else(|other| {
        let mut out = vec![0u8; len];
        place_extents(other, base, &mut out).map(|()| out)
    })
}

/// `Ok(buffer)` (cut to `len`) if `result` is one extent starting at `base` with at least `len`
/// bytes, else the result back.
fn whole_extent(
    result: Option<ReadResult>,
    base: u64,
    len: usize,
) -> Result<Vec<u8>, Option<ReadResult>> {
    match result {
        Some(ReadResult::Extents(mut extents))
            if extents.len() == 1 && extents[0].offset == base && extents[0].data.len() >= len =>
        {
            let mut data = extents.pop().expect("one extent").data;
            data.truncate(len);
            Ok(data)
        }
        other => Err(other),
    }
}

/// Copy the extents of a read of `[base, base + out.len())` into `out` and zero what no
/// extent covers (holes, and the part past a short object), touching each byte once.
pub(crate) fn place_extents(
    result: Option<ReadResult>,
    base: u64,
    out: &mut [u8],
) -> Result<(), String> {
    let extents: Vec<Extent> = match result {
        Some(ReadResult::Extents(extents)) => extents,
        other => return Err(format!("expected the extents of a read, got {other:?}")),
    };
    // Everything before `covered` is zeroed or copied already; extents may come in any order.
    let mut covered = 0;
    for extent in extents {
        let start = extent
            .offset
            .checked_sub(base)
            .filter(|&s| s as usize <= out.len())
            .ok_or_else(|| {
                format!(
                    "extent at {} lies outside the read at {base}",
                    extent.offset
                )
            })? as usize;
        let len = extent.data.len().min(out.len() - start);
        if start > covered {
            out[covered..start].fill(0);
        }
        out[start..start + len].copy_from_slice(&extent.data[..len]);
        covered = covered.max(start + len);
    }
    out[covered..].fill(0);
    Ok(())
}
