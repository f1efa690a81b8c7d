//! The image header as users and the image layer see it: format, unlock, keyslot changes,
//! backup and restore, over LUKS2 (read-write) and LUKS1 (read-only).

use std::collections::BTreeMap;

use ivdisk_crypto::{new_cipher, CipherParams, ImageId, SectorCipher, Suite, VolumeKey};
use serde_json::{json, Map, Value};

use crate::binary::{self, BinaryHeader};
use crate::io::{read_vec, HeaderIo};
use crate::kdf::PbkdfRequest;
use crate::keyslot::{self, AreaCipher, KeyslotSpec};
use crate::luks1::Luks1Header;
use crate::metadata::{
    AntiForensic, Area, Config, Digest, Kdf, Keyslot, Metadata, Requirements, Segment, MAX_KEYSLOTS,
};
use crate::HeaderError;

/// The mandatory requirement ivdisk writes into every image that dm-crypt must not activate
/// (any suite but `aes-xts-plain64` with layout `none`). cryptsetup refuses to activate or
/// change a header with a requirement it does not know (docs/ARCHITECTURE.md, "Header").
pub const IVDISK_REQUIREMENT: &str = "ivdisk-v1";
/// The LUKS2 token type holding ivdisk's image parameters.
pub const IVDISK_TOKEN_TYPE: &str = "ivdisk";
/// The image format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// cryptsetup's LUKS2 defaults: 16 KiB headers, 16 MiB minus both headers of keyslots area.
pub const DEFAULT_HEADER_SIZE: u64 = 16 << 10;
pub const DEFAULT_KEYSLOTS_SIZE: u64 = (16 << 20) - 2 * DEFAULT_HEADER_SIZE;
/// PBKDF2 iterations of the volume key digest when not benchmarked (cryptsetup's minimum).
pub const MIN_DIGEST_ITERATIONS: u32 = 1000;

/// ivdisk's own parameters of an image, kept in an `ivdisk` token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageParams {
    pub format_version: u32,
    /// Where per-sector metadata lives (`none`, `object-end`, `unaligned`, `omap`).
    pub layout: String,
    pub object_size: u64,
    pub image_id: ImageId,
}

impl ImageParams {
    fn to_token(&self) -> Value {
        json!({
            "type": IVDISK_TOKEN_TYPE,
            "keyslots": [],
            "format_version": self.format_version,
            "layout": self.layout,
            "object_size": self.object_size.to_string(),
            "image_id": hex::encode(self.image_id.0),
        })
    }

    fn from_token(token: &Value) -> Result<Self, HeaderError> {
        let bad = |what: &str| HeaderError::Metadata(format!("the ivdisk token's {what}"));
        let format_version = token
            .get("format_version")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("format_version is missing"))?;
        if format_version != FORMAT_VERSION as u64 {
            return Err(HeaderError::Metadata(format!(
                "image format version {format_version} is not supported by this ivdisk \
                 (it reads version {FORMAT_VERSION}); upgrade ivdisk"
            )));
        }
        let layout = token
            .get("layout")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("layout is missing"))?
            .to_owned();
        let object_size = token
            .get("object_size")
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|n| n.is_power_of_two() && *n >= 4096)
            .ok_or_else(|| bad("object_size is not a power-of-two byte count >= 4096"))?;
        let id = token
            .get("image_id")
            .and_then(Value::as_str)
            .and_then(|s| hex::decode(s).ok())
            .and_then(|v| <[u8; 16]>::try_from(v).ok())
            .ok_or_else(|| bad("image_id is not 32 hex digits"))?;
        Ok(ImageParams {
            format_version: FORMAT_VERSION,
            layout,
            object_size,
            image_id: ImageId(id),
        })
    }
}

/// The image ids that the JSON areas of a header still name when it no longer reads
/// (checksums and binary headers ignored): which image a damaged header belonged to, so that
/// restoring a header backup does not put another image's header in its place. Never used
/// to open anything.
pub fn salvage_image_ids(io: &dyn HeaderIo) -> Vec<ImageId> {
    let size = io.size().unwrap_or(0);
    let mut ids = Vec::new();
    for copy_at in std::iter::once(0).chain(binary::HEADER_SIZES) {
        let json_at = copy_at + binary::BINARY_HEADER_LEN as u64;
        let longest = binary::HEADER_SIZES[binary::HEADER_SIZES.len() - 1];
        let Ok(len) = usize::try_from(size.saturating_sub(json_at).min(longest)) else {
            continue;
        };
        let Ok(area) = read_vec(io, json_at, len) else {
            continue;
        };
        let end = area.iter().position(|&b| b == 0).unwrap_or(area.len());
        let Ok(json) = serde_json::from_slice::<Value>(&area[..end]) else {
            continue;
        };
        let tokens = json.get("tokens").and_then(Value::as_object);
        for token in tokens.into_iter().flat_map(|t| t.values()) {
            if token.get("type").and_then(Value::as_str) != Some(IVDISK_TOKEN_TYPE) {
                continue;
            }
            if let Ok(params) = ImageParams::from_token(token) {
                if !ids.contains(&params.image_id) {
                    ids.push(params.image_id);
                }
            }
        }
    }
    ids
}

/// What a new header holds.
#[derive(Debug, Clone)]
pub struct FormatSpec {
    /// Data segment cipher: an ivdisk suite name (`aes-xts-plain64` for dm-crypt compatible).
    pub suite: Suite,
    pub sector_size: u32,
    /// Where the data starts on the header's device: 0 for a detached header (ivdisk images
    /// keep data in data objects), or past the keyslots area for a LUKS file.
    pub data_offset: u64,
    /// Data size in bytes; `None` = up to the end of the device ("dynamic").
    pub data_size: Option<u64>,
    /// ivdisk image parameters (`None` for a plain LUKS2 volume).
    pub image: Option<ImageParams>,
    pub label: String,
    pub pbkdf: PbkdfRequest,
    /// Digest iterations; `None` = benchmark for 125 ms as cryptsetup does.
    pub digest_iterations: Option<u32>,
    pub header_size: u64,
    pub keyslots_size: u64,
}

impl FormatSpec {
    pub fn new(suite: Suite, sector_size: u32) -> Self {
        FormatSpec {
            suite,
            sector_size,
            data_offset: 0,
            data_size: None,
            image: None,
            label: String::new(),
            pbkdf: PbkdfRequest::default(),
            digest_iterations: None,
            header_size: DEFAULT_HEADER_SIZE,
            keyslots_size: DEFAULT_KEYSLOTS_SIZE,
        }
    }

    fn needs_requirement(&self) -> bool {
        self.suite != Suite::AesXtsPlain64
            || self.image.as_ref().is_some_and(|p| p.layout != "none")
    }
}

/// The data segment: where the encrypted data is and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub cipher: String,
    pub offset: u64,
    pub size: Option<u64>,
    pub sector_size: u32,
    /// Added to the sector number of every IV (cryptsetup `iv_tweak`, in 512-byte units).
    pub iv_tweak: u64,
}

impl SegmentInfo {
    /// The sector number (in units of the segment's sector size) to pass to the cipher for the
    /// sector at `offset` bytes into the segment's data, `iv_tweak` included: as dm-crypt
    /// computes it, `(offset / 512 + iv_tweak) >> shift` in 64 bits, wrapping (a header's
    /// tweak near 2^64 overflowed here, a panic where overflow is checked).
    pub fn sector_number(&self, offset: u64) -> u64 {
        let units = u64::from(self.sector_size / 512).max(1);
        (offset / 512).wrapping_add(self.iv_tweak) / units
    }

    /// The ivdisk suite of this segment, if it is one.
    pub fn suite(&self) -> Result<Suite, HeaderError> {
        self.cipher
            .parse()
            .map_err(|_| HeaderError::UnsupportedCipher(self.cipher.clone(), "the data segment"))
    }
}

/// The data segment opened with its volume key: where the sectors are and their cipher.
#[derive(Debug)]
pub struct DataSegment {
    pub info: SegmentInfo,
    pub suite: Suite,
    pub cipher: Box<dyn SectorCipher>,
}

impl DataSegment {
    /// The sector number (in units of the segment's sector size) to pass to the cipher for the
    /// sector at `offset` bytes into the segment's data, `iv_tweak` included.
    pub fn sector_number(&self, offset: u64) -> u64 {
        self.info.sector_number(offset)
    }
}

/// The anti-forensic split `keyslot::seal` makes, as a keyslot records it.
fn sealed_af() -> AntiForensic {
    AntiForensic {
        kind: "luks1".into(),
        stripes: crate::af::STRIPES,
        hash: crate::keyslot::SEAL_AF_HASH.name().into(),
        extra: Map::new(),
    }
}

/// A keyslot as `dump` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyslotInfo {
    pub id: u32,
    pub kdf: String,
    pub kdf_params: String,
    pub key_size: u32,
    pub area_offset: u64,
    pub area_size: u64,
    /// LUKS2's keyslot priority: 0 ignore (tried only when named), 1 normal, 2 prefer.
    pub priority: Option<u32>,
    /// The keyslot holds a key that opens no data segment (`cryptsetup luksAddKey --unbound`):
    /// its passphrase unlocks nothing of the volume.
    pub unbound: bool,
}

/// A volume key recovered from a keyslot.
#[derive(Debug)]
pub struct Unlocked {
    pub keyslot: u32,
    pub volume_key: VolumeKey,
}

#[derive(Debug, Clone)]
enum Format {
    Luks1(Box<Luks1Header>),
    Luks2 {
        binary: BinaryHeader,
        metadata: Box<Metadata>,
    },
}

/// A loaded LUKS1 or LUKS2 header.
#[derive(Debug, Clone)]
pub struct Header {
    format: Format,
    warning: Option<String>,
    /// The next write goes to the secondary copy first (see `binary::write_both`).
    secondary_first: bool,
}

fn random_uuid() -> Result<String, HeaderError> {
    let mut b = [0u8; 16];
    crate::random_bytes(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    ))
}

impl Header {
    /// Read the header at the start of `io`: LUKS2 (both copies checked, the valid newest
    /// used) or LUKS1.
    pub fn read(io: &dyn HeaderIo) -> Result<Header, HeaderError> {
        let mut head = [0u8; 8];
        match io.read_at(0, &mut head) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(HeaderError::NotLuks)
            }
            other => other.map_err(HeaderError::io(0, head.len()))?,
        }
        let version = u16::from_be_bytes([head[6], head[7]]);
        // A damaged primary is fine if a LUKS2 secondary exists (the LUKS2 reader falls back
        // to it); a device with neither is not LUKS.
        let any_secondary = || {
            binary::HEADER_SIZES.iter().any(|&offset| {
                let mut magic = [0u8; 6];
                io.read_at(offset, &mut magic).is_ok() && magic == binary::MAGIC_SECONDARY
            })
        };
        if head[..6] == binary::MAGIC_PRIMARY && version == 1 {
            match Luks1Header::read(io) {
                Ok(luks1) => {
                    return Ok(Header {
                        format: Format::Luks1(Box::new(luks1)),
                        warning: None,
                        secondary_first: false,
                    })
                }
                // A LUKS2 primary whose version field was damaged into 1: its secondary
                // decides, as for any other damage to the primary.
                Err(_) if any_secondary() => {}
                Err(e) => return Err(e),
            }
        } else if head[..6] == binary::MAGIC_PRIMARY && version != 2 && !any_secondary() {
            return Err(HeaderError::UnsupportedVersion(version));
        }
        if head[..6] != binary::MAGIC_PRIMARY && !any_secondary() {
            return Err(HeaderError::NotLuks);
        }
        // A warning is returned, not logged: the caller names the image it belongs to.
        let loaded = binary::read_luks2(io)?;
        Ok(Header {
            format: Format::Luks2 {
                binary: loaded.copy.binary,
                metadata: Box::new(loaded.copy.metadata),
            },
            warning: loaded.warning,
            secondary_first: loaded.secondary_first,
        })
    }

    /// Write a new LUKS2 header with one keyslot (slot 0) for `passphrase`.
    pub fn format(
        io: &mut dyn HeaderIo,
        spec: &FormatSpec,
        volume_key: &VolumeKey,
        passphrase: &[u8],
    ) -> Result<Header, HeaderError> {
        if !spec.suite.key_lens().contains(&volume_key.len()) {
            return Err(HeaderError::InvalidParameter(format!(
                "{} takes a {}-byte volume key, not {}",
                spec.suite,
                spec.suite.default_key_len(),
                volume_key.len()
            )));
        }
        if !binary::HEADER_SIZES.contains(&spec.header_size) {
            return Err(HeaderError::InvalidParameter(format!(
                "header size {} is not one LUKS2 allows",
                spec.header_size
            )));
        }
        let metadata_end = 2 * spec.header_size + spec.keyslots_size;
        if spec.data_offset != 0 && spec.data_offset < metadata_end {
            return Err(HeaderError::InvalidParameter(format!(
                "data offset {} would overlap the header, which ends at {metadata_end}",
                spec.data_offset
            )));
        }
        let digest_iterations = match spec.digest_iterations {
            Some(n) => n.max(MIN_DIGEST_ITERATIONS),
            None => PbkdfRequest {
                kind: crate::PbkdfKind::Pbkdf2,
                iter_time: std::time::Duration::from_millis(125),
                ..PbkdfRequest::default()
            }
            .calibrate(volume_key.len())
            .map(|p| match p {
                crate::Pbkdf::Pbkdf2 { iterations, .. } => iterations,
                _ => MIN_DIGEST_ITERATIONS,
            })?,
        };
        let mut tokens = BTreeMap::new();
        if let Some(image) = &spec.image {
            tokens.insert(0, image.to_token());
        }
        let metadata = Metadata {
            keyslots: BTreeMap::new(),
            tokens,
            segments: BTreeMap::from([(
                0,
                Segment {
                    kind: "crypt".into(),
                    offset: spec.data_offset,
                    size: spec
                        .data_size
                        .map_or_else(|| "dynamic".to_owned(), |n| n.to_string()),
                    iv_tweak: 0,
                    encryption: spec.suite.name().into(),
                    sector_size: spec.sector_size,
                    integrity: None,
                    flags: None,
                    extra: Map::new(),
                },
            )]),
            digests: BTreeMap::from([(0, Digest::new(volume_key.as_bytes(), digest_iterations)?)]),
            config: Config {
                json_size: spec.header_size - binary::BINARY_HEADER_LEN as u64,
                keyslots_size: spec.keyslots_size,
                flags: None,
                requirements: spec.needs_requirement().then(|| Requirements {
                    mandatory: vec![IVDISK_REQUIREMENT.into()],
                    extra: Map::new(),
                }),
                extra: Map::new(),
            },
            extra: Map::new(),
        };
        metadata.validate(spec.header_size)?;
        let mut header = Header {
            format: Format::Luks2 {
                binary: BinaryHeader {
                    hdr_size: spec.header_size,
                    seqid: 0,
                    label: spec.label.clone().into_bytes(),
                    checksum_alg: "sha256".into(),
                    uuid: random_uuid()?,
                    subsystem: Vec::new(),
                },
                metadata: Box::new(metadata),
            },
            warning: None,
            secondary_first: false,
        };
        io.ensure_len(metadata_end)
            .map_err(|source| HeaderError::Write {
                offset: metadata_end,
                source,
            })?;
        header.add_keyslot_unchecked(io, volume_key, passphrase, Some(0), &spec.pbkdf)?;
        Ok(header)
    }

    /// A warning about the header's state (a damaged or stale copy), if reading found one.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    pub fn version(&self) -> u16 {
        match self.format {
            Format::Luks1(_) => 1,
            Format::Luks2 { .. } => 2,
        }
    }

    pub fn uuid(&self) -> &str {
        match &self.format {
            Format::Luks1(h) => &h.uuid,
            Format::Luks2 { binary, .. } => &binary.uuid,
        }
    }

    /// The LUKS2 label, shown as text (bytes that are not UTF-8 as U+FFFD; the header keeps
    /// them as they are).
    pub fn label(&self) -> std::borrow::Cow<'_, str> {
        match &self.format {
            Format::Luks1(_) => "".into(),
            Format::Luks2 { binary, .. } => String::from_utf8_lossy(&binary.label),
        }
    }

    /// LUKS2 sequence id (how many times the header was written), 0 for LUKS1.
    pub fn seqid(&self) -> u64 {
        match &self.format {
            Format::Luks1(_) => 0,
            Format::Luks2 { binary, .. } => binary.seqid,
        }
    }

    /// The LUKS2 JSON metadata (`None` for LUKS1).
    pub fn metadata(&self) -> Option<&Metadata> {
        match &self.format {
            Format::Luks1(_) => None,
            Format::Luks2 { metadata, .. } => Some(metadata),
        }
    }

    /// Bytes from the start of the device that belong to the header (what a backup holds).
    /// Where the header's metadata ends: what a backup must hold. For LUKS2 the whole region;
    /// for LUKS1 the end of the last keyslot's material (cryptsetup's LUKS1 backups end there,
    /// rounded up to 4 KiB, short of the payload offset).
    pub fn metadata_end(&self) -> u64 {
        match &self.format {
            Format::Luks1(h) => h
                .keyslots
                .iter()
                .flatten()
                .map(|k| k.material_sector as u64 * 512 + keyslot::material_len(h.key_bytes))
                .max()
                .unwrap_or(crate::luks1::HEADER_LEN as u64),
            Format::Luks2 { .. } => self.region_len(),
        }
    }

    pub fn region_len(&self) -> u64 {
        match &self.format {
            Format::Luks1(h) => {
                // Up to the end of the last keyslot's material, or the payload if earlier data
                // follows directly; ivdisk backs up to the payload offset.
                if h.payload_offset == 0 {
                    self.metadata_end()
                } else {
                    h.payload_offset as u64 * 512
                }
            }
            Format::Luks2 { binary, metadata } => {
                2 * binary.hdr_size + metadata.config.keyslots_size
            }
        }
    }

    /// The data segment (segment 0).
    pub fn segment(&self) -> Result<SegmentInfo, HeaderError> {
        match &self.format {
            Format::Luks1(h) => Ok(SegmentInfo {
                cipher: h.cipher(),
                offset: h.payload_offset as u64 * 512,
                size: None,
                sector_size: 512,
                iv_tweak: 0,
            }),
            Format::Luks2 { metadata, .. } => {
                let segment = metadata.segments.get(&0).ok_or_else(|| {
                    HeaderError::Metadata("the header has no data segment 0".into())
                })?;
                if segment.kind != "crypt" {
                    return Err(HeaderError::Metadata(format!(
                        "data segment type `{}` is not supported (crypt)",
                        segment.kind
                    )));
                }
                if segment.integrity.is_some() {
                    return Err(HeaderError::UnsupportedCipher(
                        format!("{} with dm-integrity", segment.encryption),
                        "the data segment",
                    ));
                }
                Ok(SegmentInfo {
                    cipher: segment.encryption.clone(),
                    offset: segment.offset,
                    size: segment.fixed_size()?,
                    sector_size: segment.sector_size,
                    iv_tweak: segment.iv_tweak,
                })
            }
        }
    }

    /// Build the data segment's cipher for a volume key from [`Header::unlock`]: the one path
    /// by which ivdisk images and foreign LUKS volumes (cryptsetup files, librbd images) are
    /// read. Refuses headers with requirements ivdisk does not know (for example a
    /// cryptsetup reencryption in progress).
    pub fn open_data(&self, volume_key: &VolumeKey) -> Result<DataSegment, HeaderError> {
        let foreign = self.foreign_requirements();
        if !foreign.is_empty() {
            return Err(HeaderError::UnmetRequirements(foreign));
        }
        let info = self.segment()?;
        let suite = info.suite()?;
        let units = info.sector_size as u64 / 512;
        if info.iv_tweak % units != 0 {
            return Err(HeaderError::Metadata(format!(
                "iv_tweak {} is not a multiple of the {}-byte sector size",
                info.iv_tweak, info.sector_size
            )));
        }
        let image_id = self.image_params()?.map(|p| p.image_id).unwrap_or_default();
        let cipher = new_cipher(
            suite,
            volume_key,
            &CipherParams::new(info.sector_size as usize, image_id),
        )?;
        Ok(DataSegment {
            info,
            suite,
            cipher,
        })
    }

    /// ivdisk's image parameters, `None` for a LUKS volume not made by ivdisk.
    pub fn image_params(&self) -> Result<Option<ImageParams>, HeaderError> {
        let Some(metadata) = self.metadata() else {
            return Ok(None);
        };
        metadata
            .tokens
            .values()
            .find(|t| t.get("type").and_then(Value::as_str) == Some(IVDISK_TOKEN_TYPE))
            .map(ImageParams::from_token)
            .transpose()
    }

    /// Mandatory requirements other than ivdisk's own (for example cryptsetup's reencryption
    /// in progress): ivdisk must neither use the data nor change such a header.
    pub fn foreign_requirements(&self) -> Vec<String> {
        self.metadata()
            .map(|m| {
                m.config
                    .mandatory_requirements()
                    .iter()
                    .filter(|r| *r != IVDISK_REQUIREMENT)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The keyslots in use.
    pub fn keyslots(&self) -> Vec<KeyslotInfo> {
        match &self.format {
            Format::Luks1(h) => h
                .keyslots
                .iter()
                .enumerate()
                .filter_map(|(id, k)| {
                    k.as_ref().map(|k| KeyslotInfo {
                        id: id as u32,
                        kdf: "pbkdf2".into(),
                        kdf_params: format!("{}, {} iterations", h.hash, k.iterations),
                        key_size: h.key_bytes,
                        area_offset: k.material_sector as u64 * 512,
                        area_size: keyslot::material_len(h.key_bytes),
                        priority: None,
                        unbound: false,
                    })
                })
                .collect(),
            Format::Luks2 { metadata, .. } => metadata
                .keyslots
                .iter()
                .map(|(&id, k)| KeyslotInfo {
                    id,
                    kdf: k.kdf.kind.clone(),
                    kdf_params: match k.kdf.pbkdf() {
                        Ok(crate::Pbkdf::Pbkdf2 { hash, iterations }) => {
                            format!("{hash}, {iterations} iterations")
                        }
                        Ok(crate::Pbkdf::Argon2 {
                            time,
                            memory_kib,
                            parallel,
                            ..
                        }) => format!("time {time}, memory {memory_kib} KiB, {parallel} threads"),
                        Err(e) => format!("unusable: {e}"),
                    },
                    key_size: k.key_size,
                    area_offset: k.area.offset,
                    area_size: k.area.size,
                    priority: k.priority,
                    unbound: !metadata.keyslot_opens_segment(id),
                })
                .collect(),
        }
    }

    fn keyslot_spec(&self, slot: u32) -> Result<KeyslotSpec, HeaderError> {
        match &self.format {
            Format::Luks1(h) => {
                if slot as usize >= crate::luks1::KEYSLOTS {
                    return Err(HeaderError::NoSuchKeyslot(slot));
                }
                h.keyslot_spec(slot as usize)
            }
            Format::Luks2 { metadata, .. } => {
                let k = metadata
                    .keyslots
                    .get(&slot)
                    .ok_or(HeaderError::NoSuchKeyslot(slot))?;
                Ok(KeyslotSpec {
                    pbkdf: k.kdf.pbkdf()?,
                    salt: k.kdf.salt()?,
                    area_cipher: AreaCipher::parse(
                        &k.area.encryption,
                        k.area.key_size,
                        "keyslot areas",
                    )?,
                    af_hash: k.af.hash.parse()?,
                    stripes: k.af.stripes,
                    key_size: k.key_size,
                    material_offset: k.area.offset,
                })
            }
        }
    }

    fn candidate_matches(&self, slot: u32, key: &[u8]) -> Result<bool, HeaderError> {
        match &self.format {
            Format::Luks1(h) => h.digest_matches(key),
            Format::Luks2 { metadata, .. } => match metadata.digest_of_keyslot(slot) {
                Some((_, digest)) => digest.matches(key),
                None => Ok(false),
            },
        }
    }

    /// Whether keyslot `slot` holds the volume key (`Metadata::keyslot_opens_segment`). Taken
    /// for the volume key, an unbound keyslot's key decrypted garbage and encrypted writes
    /// with the wrong key; cryptsetup tries only the keyslots bound to the segment.
    fn holds_volume_key(&self, slot: u32) -> bool {
        match &self.format {
            Format::Luks1(_) => true,
            Format::Luks2 { metadata, .. } => metadata.keyslot_opens_segment(slot),
        }
    }

    /// Try `passphrase` (or key file contents) on one keyslot.
    pub fn unlock_keyslot(
        &self,
        io: &dyn HeaderIo,
        slot: u32,
        passphrase: &[u8],
    ) -> Result<VolumeKey, HeaderError> {
        let spec = self.keyslot_spec(slot)?;
        if !self.holds_volume_key(slot) {
            return Err(HeaderError::UnboundKeyslot(slot));
        }
        let candidate = spec.open(io, passphrase)?;
        if self.candidate_matches(slot, &candidate)? {
            Ok(VolumeKey::from_slice(&candidate))
        } else {
            Err(HeaderError::KeyslotMismatch { slot })
        }
    }

    /// Try `passphrase` on every keyslot in priority order (high, then normal; slots marked
    /// "ignore" only when named), as cryptsetup does.
    pub fn unlock(&self, io: &dyn HeaderIo, passphrase: &[u8]) -> Result<Unlocked, HeaderError> {
        let mut order: Vec<(u32, u32)> = match &self.format {
            Format::Luks1(h) => h
                .keyslots
                .iter()
                .enumerate()
                .filter(|(_, k)| k.is_some())
                .map(|(i, _)| (1, i as u32))
                .collect(),
            Format::Luks2 { metadata, .. } => metadata
                .keyslots
                .iter()
                .map(|(&id, k)| (k.priority.unwrap_or(1), id))
                .filter(|&(priority, id)| priority > 0 && self.holds_volume_key(id))
                .collect(),
        };
        order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let tried = order.len();
        let mut unusable = Vec::new();
        for (_, slot) in order {
            match self.unlock_keyslot(io, slot, passphrase) {
                Ok(volume_key) => {
                    tracing::debug!(keyslot = slot, "keyslot opened");
                    return Ok(Unlocked {
                        keyslot: slot,
                        volume_key,
                    });
                }
                Err(HeaderError::KeyslotMismatch { .. }) => {}
                Err(e) => {
                    // A keyslot we cannot use (unknown cipher, truncated area) must not hide the
                    // others; the count goes into the error, the reason into the log.
                    tracing::warn!(keyslot = slot, "keyslot skipped: {e}");
                    unusable.push(e);
                }
            }
        }
        if tried > 0 && unusable.len() == tried {
            // No keyslot could even be tried: the passphrase is not the problem.
            return Err(unusable.swap_remove(0));
        }
        Err(HeaderError::WrongPassphrase {
            tried,
            unusable: unusable.len(),
        })
    }

    /// Whether a volume key that `other` takes is also this header's without checking it (a
    /// PBKDF2 run of about 125 ms): both LUKS2 with the same digest of the data segment's key
    /// (hash, iterations, salt and digest). `false` says nothing: check the key then.
    pub fn has_volume_key_digest_of(&self, other: &Header) -> bool {
        let digest = |h: &Header| match &h.format {
            Format::Luks2 { metadata, .. } => metadata.segment_digest().map(|(_, d)| {
                (
                    d.hash.clone(),
                    d.iterations,
                    d.salt.clone(),
                    d.digest.clone(),
                )
            }),
            Format::Luks1(_) => None,
        };
        digest(self).is_some_and(|mine| digest(other) == Some(mine))
    }

    /// Check a volume key (a recovery key file) against the digest.
    pub fn unlock_with_volume_key(&self, key: &[u8]) -> Result<VolumeKey, HeaderError> {
        // The length first: a file of the wrong size (a passphrase file given for a key
        // file, say) is named as such, not as a key that merely differs.
        let expected = match &self.format {
            Format::Luks1(h) => Some(h.key_bytes as usize),
            Format::Luks2 { .. } => self
                .keyslots()
                .iter()
                .find(|k| !k.unbound)
                .map(|k| k.key_size as usize),
        };
        if let Some(expected) = expected.filter(|&expected| expected != key.len()) {
            return Err(HeaderError::VolumeKeyLength {
                given: key.len(),
                expected,
            });
        }
        let matches = match &self.format {
            Format::Luks1(h) => h.digest_matches(key)?,
            Format::Luks2 { metadata, .. } => match metadata.segment_digest() {
                Some((_, d)) => d.matches(key)?,
                None => false,
            },
        };
        if matches {
            Ok(VolumeKey::from_slice(key))
        } else {
            Err(HeaderError::VolumeKeyMismatch)
        }
    }

    fn luks2_mut(&mut self) -> Result<(&mut BinaryHeader, &mut Metadata), HeaderError> {
        let foreign = self.foreign_requirements();
        if !foreign.is_empty() {
            return Err(HeaderError::UnmetRequirements(foreign));
        }
        match &mut self.format {
            Format::Luks1(_) => Err(HeaderError::Luks1ReadOnly),
            Format::Luks2 { binary, metadata } => Ok((binary, metadata)),
        }
    }

    /// Write `metadata` in place of this header's, which takes it only once it is written: a
    /// write that fails leaves `self` with the metadata it had (a torn write may have left one
    /// copy on the device new; the next read of the device chooses, as cryptsetup does).
    fn write_changed(
        &mut self,
        io: &mut dyn HeaderIo,
        metadata: Metadata,
    ) -> Result<(), HeaderError> {
        let before = std::mem::replace(self.luks2_mut()?.1, metadata);
        let written = self.write(io);
        if written.is_err() {
            *self.luks2_mut()?.1 = before;
        }
        written
    }

    fn write(&mut self, io: &mut dyn HeaderIo) -> Result<(), HeaderError> {
        let secondary_first = self.secondary_first;
        let (binary, metadata) = self.luks2_mut()?;
        // A crafted seqid of u64::MAX: wrapped to 0, a torn write's stale copy (the higher
        // seqid) would win at the next read and undo the change.
        binary.seqid = binary.seqid.checked_add(1).ok_or_else(|| {
            HeaderError::Metadata(
                "the header's sequence number (seqid) is at its maximum; it cannot be changed \
                 (restore a header backup, or make a new header)"
                    .into(),
            )
        })?;
        binary::write_both(io, binary, metadata, secondary_first)?;
        self.warning = None;
        self.secondary_first = false;
        Ok(())
    }

    /// Record a new data size (`None` = up to the end of the device) in the data segment and
    /// write both header copies: how an image grows or shrinks.
    pub fn set_data_size(
        &mut self,
        io: &mut dyn HeaderIo,
        size: Option<u64>,
    ) -> Result<(), HeaderError> {
        let (_, metadata) = self.luks2_mut()?;
        let segment = metadata
            .segments
            .get_mut(&0)
            .ok_or_else(|| HeaderError::Metadata("the header has no data segment 0".into()))?;
        if let Some(size) = size {
            if size % segment.sector_size as u64 != 0 {
                return Err(HeaderError::InvalidParameter(format!(
                    "data size {size} is not a multiple of the {}-byte sector size",
                    segment.sector_size
                )));
            }
        }
        segment.size = size.map_or_else(|| "dynamic".to_owned(), |n| n.to_string());
        self.write(io)
    }

    /// Find room for a keyslot area of `len` bytes, first fit.
    fn allocate_area(
        binary: &BinaryHeader,
        metadata: &Metadata,
        len: u64,
    ) -> Result<u64, HeaderError> {
        let start = 2 * binary.hdr_size;
        let end = start + metadata.config.keyslots_size;
        let mut used: Vec<(u64, u64)> = metadata
            .keyslots
            .values()
            .map(|k| (k.area.offset, k.area.offset + k.area.size))
            .collect();
        used.sort();
        let mut candidate = start;
        for (a, b) in used {
            if candidate + len <= a {
                break;
            }
            candidate = candidate.max(b.div_ceil(4096) * 4096);
        }
        if candidate + len > end {
            return Err(HeaderError::KeyslotAreaFull { needed: len });
        }
        Ok(candidate)
    }

    /// Add a keyslot for `new_passphrase` holding `volume_key` (which must match the digest:
    /// get it from [`Header::unlock`] or [`Header::unlock_with_volume_key`]). Returns the slot.
    pub fn add_keyslot(
        &mut self,
        io: &mut dyn HeaderIo,
        volume_key: &VolumeKey,
        new_passphrase: &[u8],
        slot: Option<u32>,
        pbkdf: &PbkdfRequest,
    ) -> Result<u32, HeaderError> {
        self.unlock_with_volume_key(volume_key.as_bytes())?;
        self.add_keyslot_unchecked(io, volume_key, new_passphrase, slot, pbkdf)
    }

    fn add_keyslot_unchecked(
        &mut self,
        io: &mut dyn HeaderIo,
        volume_key: &VolumeKey,
        new_passphrase: &[u8],
        slot: Option<u32>,
        pbkdf_request: &PbkdfRequest,
    ) -> Result<u32, HeaderError> {
        let (binary, metadata) = self.luks2_mut()?;
        let slot = match slot {
            Some(s) if s >= MAX_KEYSLOTS => {
                return Err(HeaderError::InvalidParameter(format!(
                    "keyslot {s} is out of range (keyslots are 0 to {})",
                    MAX_KEYSLOTS - 1
                )))
            }
            Some(s) if metadata.keyslots.contains_key(&s) => {
                return Err(HeaderError::KeyslotInUse(s))
            }
            Some(s) => s,
            None => (0..MAX_KEYSLOTS)
                .find(|s| !metadata.keyslots.contains_key(s))
                .ok_or(HeaderError::KeyslotsFull(MAX_KEYSLOTS as usize))?,
        };
        let (digest_id, _) = metadata
            .segment_digest()
            .ok_or_else(|| HeaderError::Metadata("the header has no segment digest".into()))?;
        let sealed = seal_material(binary, metadata, volume_key, new_passphrase, pbkdf_request)?;
        let pbkdf_name = sealed.kdf.kind.clone();
        // The new metadata is made and checked (it fits the JSON area) before anything is
        // written: a refusal then changes nothing, on the device or in `self`.
        let mut changed = metadata.clone();
        changed.keyslots.insert(
            slot,
            Keyslot {
                kind: "luks2".into(),
                key_size: volume_key.len() as u32,
                af: sealed_af(),
                area: sealed.area.clone(),
                kdf: sealed.kdf.clone(),
                priority: None,
                extra: Map::new(),
            },
        );
        let digest = changed.digests.get_mut(&digest_id).expect("found above");
        digest.keyslots.push(slot.to_string());
        digest
            .keyslots
            .sort_by_key(|s| s.parse::<u32>().unwrap_or(u32::MAX));
        binary::check_fits(binary, &changed)?;
        sealed.store(io)?;
        self.write_changed(io, changed)?;
        tracing::info!(keyslot = slot, kdf = %pbkdf_name, "keyslot added");
        Ok(slot)
    }

    /// Remove a keyslot and wipe its material. Removing the last keyslot needs `force`.
    pub fn remove_keyslot(
        &mut self,
        io: &mut dyn HeaderIo,
        slot: u32,
        force: bool,
    ) -> Result<(), HeaderError> {
        let (_, metadata) = self.luks2_mut()?;
        let removed = metadata
            .keyslots
            .get(&slot)
            .ok_or(HeaderError::NoSuchKeyslot(slot))?
            .area
            .clone();
        // The last keyslot that opens the volume: unbound ones (another key) do not count.
        let opening = metadata
            .keyslots
            .keys()
            .filter(|&&id| metadata.keyslot_opens_segment(id))
            .count();
        if metadata.keyslot_opens_segment(slot) && opening == 1 && !force {
            return Err(HeaderError::LastKeyslot(slot));
        }
        metadata.keyslots.remove(&slot);
        let name = slot.to_string();
        for digest in metadata.digests.values_mut() {
            digest.keyslots.retain(|s| *s != name);
        }
        for token in metadata.tokens.values_mut() {
            if let Some(Value::Array(slots)) = token.get_mut("keyslots") {
                slots.retain(|s| s.as_str() != Some(&name));
            }
        }
        self.write(io)?;
        wipe(io, removed.offset, removed.size)?;
        tracing::info!(keyslot = slot, "keyslot removed");
        Ok(())
    }

    /// Replace the passphrase of the keyslot `old_passphrase` opens, keeping its number (as
    /// `cryptsetup luksChangeKey`): the new material goes to a fresh area, the header switches
    /// to it in one write, then the old area is wiped.
    pub fn change_passphrase(
        &mut self,
        io: &mut dyn HeaderIo,
        old_passphrase: &[u8],
        new_passphrase: &[u8],
        slot: Option<u32>,
        pbkdf_request: &PbkdfRequest,
    ) -> Result<u32, HeaderError> {
        let unlocked = match slot {
            Some(s) => Unlocked {
                keyslot: s,
                volume_key: self.unlock_keyslot(io, s, old_passphrase)?,
            },
            None => self.unlock(io, old_passphrase)?,
        };
        let slot = unlocked.keyslot;
        let (binary, metadata) = self.luks2_mut()?;
        let old = metadata.keyslots.get(&slot).expect("unlocked").clone();
        let sealed = seal_material(
            binary,
            metadata,
            &unlocked.volume_key,
            new_passphrase,
            pbkdf_request,
        )?;
        // Made and checked before anything is written, as in `add_keyslot`.
        let mut changed = metadata.clone();
        let entry = changed.keyslots.get_mut(&slot).expect("unlocked");
        entry.area = sealed.area.clone();
        entry.kdf = sealed.kdf.clone();
        // The split the new material was made with: a slot cryptsetup made may say another
        // hash (its PBKDF's: `luksFormat --hash sha512`, sha1 after a LUKS1 conversion), and
        // kept, it made the new passphrase open nothing, while the old area was wiped.
        entry.af = sealed_af();
        binary::check_fits(binary, &changed)?;
        sealed.store(io)?;
        self.write_changed(io, changed)?;
        wipe(io, old.area.offset, old.area.size)?;
        tracing::info!(keyslot = slot, "passphrase changed");
        Ok(slot)
    }

    /// Copy the whole header region (both headers and the keyslots area) to `out`. A header
    /// read with a damaged or stale copy ([`Header::warning`]) is saved with both copies
    /// rewritten from the valid one: `restore` refuses a damaged backup, and a copy of the
    /// damage was a backup that never restored, made just when the user was warned.
    pub fn backup(&self, io: &dyn HeaderIo, out: &mut dyn HeaderIo) -> Result<u64, HeaderError> {
        let len = self.region_len();
        copy_region(io, out, len)?;
        if let Some(warning) = &self.warning {
            let mut repaired = self.clone();
            repaired.write(out).map_err(|e| {
                HeaderError::Backup(format!(
                    "the header has a damaged copy ({warning}) and could not be saved repaired \
                     ({e}): repair it first (`cryptsetup repair`)"
                ))
            })?;
        }
        out.sync()
            .map_err(|source| HeaderError::Write { offset: 0, source })?;
        Ok(len)
    }

    /// Write the header region from a backup over `io`'s. Refuses a backup that is not a
    /// valid header, and (without `force`) one of a different volume than the header in place.
    pub fn restore(
        io: &mut dyn HeaderIo,
        backup: &dyn HeaderIo,
        force: bool,
    ) -> Result<Header, HeaderError> {
        let saved = Header::read(backup).map_err(|e| HeaderError::Backup(e.damage()))?;
        if let Some(w) = saved.warning() {
            return Err(HeaderError::Backup(format!("it is itself damaged: {w}")));
        }
        // Everything is checked before the first byte is written: a restore that fails
        // half-way would leave a header that is neither.
        let have = backup
            .size()
            .map_err(|source| HeaderError::Io { offset: 0, source })?;
        if have < saved.metadata_end() {
            return Err(HeaderError::Backup(format!(
                "it is truncated: {have} bytes, and the header it holds needs {}",
                saved.metadata_end()
            )));
        }
        let current = Header::read(io);
        if let (Err(_), false) = (&current, force) {
            // Both copies damaged (the usual reason to restore): the UUID fields often survive
            // the damage of the JSON. One that names another volume means the backup is not of
            // this one, and its keyslots would bury this volume's key for good.
            let names = uuids_in_place(io);
            if !names.is_empty() && !names.iter().any(|n| n == saved.uuid()) {
                return Err(HeaderError::Backup(format!(
                    "it belongs to volume {}, and the damaged header in place still names \
                     volume {}: this backup is not of this volume; pass --force to replace it \
                     anyway",
                    saved.uuid(),
                    names.join(" and ")
                )));
            }
        }
        if let Ok(current) = current {
            // Not even forced: the data would be read from another place (cryptsetup refuses
            // this too). Checked first, so that no refusal suggests a --force that cannot help.
            let data_offset = |h: &Header| h.segment().ok().map(|s| s.offset);
            if let (Some(here), Some(there)) = (data_offset(&current), data_offset(&saved)) {
                if here != there {
                    return Err(HeaderError::Backup(format!(
                        "its data starts at byte {there}, and this volume's at byte {here} \
                         (LUKS{} here, LUKS{} in the backup): the data would be read from the \
                         wrong place; this backup is not of this volume",
                        current.version(),
                        saved.version()
                    )));
                }
            }
            if !force && current.uuid() != saved.uuid() {
                return Err(HeaderError::Backup(format!(
                    "it belongs to volume {} but this one is {}; pass --force to replace it",
                    saved.uuid(),
                    current.uuid()
                )));
            }
        }
        copy_region(backup, io, saved.region_len().min(have))?;
        io.sync()
            .map_err(|source| HeaderError::Write { offset: 0, source })?;
        Header::read(io)
    }

    /// Everything `dump --json` prints: a summary and, for LUKS2, the raw JSON metadata.
    pub fn to_json(&self) -> Value {
        let segment = self.segment().ok();
        let keyslots: Vec<Value> = self
            .keyslots()
            .into_iter()
            .map(|k| {
                json!({"id": k.id, "kdf": k.kdf, "kdf_params": k.kdf_params,
                       "key_size": k.key_size, "area_offset": k.area_offset,
                       "area_size": k.area_size, "priority": k.priority,
                       "unbound": k.unbound})
            })
            .collect();
        let image = self.image_params().ok().flatten().map(|p| {
            json!({"format_version": p.format_version, "layout": p.layout,
                   "object_size": p.object_size, "image_id": hex::encode(p.image_id.0)})
        });
        json!({
            "version": self.version(),
            "uuid": self.uuid(),
            "label": self.label(),
            "seqid": self.seqid(),
            "segment": segment.map(|s| json!({"cipher": s.cipher, "offset": s.offset,
                "size": s.size, "sector_size": s.sector_size, "iv_tweak": s.iv_tweak})),
            "image": image,
            "requirements": self.metadata().map(|m| m.config.mandatory_requirements().to_vec()),
            "keyslots": keyslots,
            "warning": self.warning,
            "luks2_json": self.metadata().map(|m| serde_json::to_value(m).expect("serializes")),
        })
    }
}

/// A new keyslot's material, sealed but not written yet, and what the header says of it.
struct SealedMaterial {
    bytes: zeroize::Zeroizing<Vec<u8>>,
    area: Area,
    kdf: Kdf,
}

impl SealedMaterial {
    /// Write the material to its area and sync it: before the header that points at it, so a
    /// crash in between leaves the old header, which does not.
    fn store(&self, io: &mut dyn HeaderIo) -> Result<(), HeaderError> {
        let offset = self.area.offset;
        io.write_at(offset, &self.bytes)
            .and_then(|_| io.sync())
            .map_err(|source| HeaderError::Write { offset, source })
    }
}

/// Seal `volume_key` for `passphrase` for a newly allocated keyslot area; nothing is written
/// ([`SealedMaterial::store`] writes it, before any header points at it).
fn seal_material(
    binary: &BinaryHeader,
    metadata: &Metadata,
    volume_key: &VolumeKey,
    passphrase: &[u8],
    pbkdf_request: &PbkdfRequest,
) -> Result<SealedMaterial, HeaderError> {
    let area_len = keyslot::area_len(volume_key.len() as u32);
    let offset = Header::allocate_area(binary, metadata, area_len)?;
    // cryptsetup's keyslot cipher: aes-xts-plain64 with a 512-bit key.
    let area_cipher = AreaCipher { key_size: 64 };
    let pbkdf = pbkdf_request.calibrate(area_cipher.key_size as usize)?;
    let mut salt = [0u8; 32];
    crate::random_bytes(&mut salt)?;
    let bytes = keyslot::seal(
        volume_key.as_bytes(),
        passphrase,
        &pbkdf,
        &salt,
        area_cipher,
    )?;
    let area = Area {
        kind: "raw".into(),
        offset,
        size: area_len,
        encryption: "aes-xts-plain64".into(),
        key_size: area_cipher.key_size,
        extra: Map::new(),
    };
    Ok(SealedMaterial {
        bytes,
        area,
        kdf: Kdf::new(&pbkdf, &salt),
    })
}

fn copy_region(from: &dyn HeaderIo, to: &mut dyn HeaderIo, len: u64) -> Result<(), HeaderError> {
    const CHUNK: u64 = 1 << 20;
    let mut offset = 0;
    while offset < len {
        let n = CHUNK.min(len - offset) as usize;
        let chunk = read_vec(from, offset, n)?;
        to.write_at(offset, &chunk)
            .map_err(|source| HeaderError::Write { offset, source })?;
        offset += n as u64;
    }
    Ok(())
}

/// Overwrite a keyslot area with random bytes, so its material cannot be read back.
fn wipe(io: &mut dyn HeaderIo, offset: u64, len: u64) -> Result<(), HeaderError> {
    let mut noise = zeroize::Zeroizing::new(vec![0u8; len as usize]);
    crate::random_bytes(&mut noise)?;
    io.write_at(offset, &noise)
        .map_err(|source| HeaderError::Write { offset, source })?;
    io.sync()
        .map_err(|source| HeaderError::Write { offset, source })
}

/// The UUIDs that the binary headers in `io` name (the primary's, and any LUKS2 secondary's at
/// the offsets it may have), however damaged the rest: magic right and the field printable.
fn uuids_in_place(io: &dyn HeaderIo) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let offsets = std::iter::once((0, binary::MAGIC_PRIMARY)).chain(
        binary::HEADER_SIZES
            .iter()
            .map(|&offset| (offset, binary::MAGIC_SECONDARY)),
    );
    for (offset, magic) in offsets {
        let mut head = [0u8; 208];
        if io.read_at(offset, &mut head).is_err() || head[..6] != magic {
            continue;
        }
        let field = &head[168..208];
        let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
        let name = &field[..len];
        if !name.is_empty() && name.iter().all(|b| b.is_ascii_graphic()) {
            let name = String::from_utf8_lossy(name).into_owned();
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(sector_size: u32, iv_tweak: u64) -> SegmentInfo {
        SegmentInfo {
            cipher: "aes-xts-plain64".into(),
            offset: 0,
            size: None,
            sector_size,
            iv_tweak,
        }
    }

    /// dm-crypt's sector numbers: the tweak (512-byte units) added before the shift to the
    /// sector size, in 64 bits that wrap.
    #[test]
    fn sector_numbers_add_the_tweak_as_dm_crypt_does() {
        assert_eq!(segment(512, 0).sector_number(3 * 512), 3);
        assert_eq!(segment(512, 10).sector_number(3 * 512), 13);
        assert_eq!(segment(4096, 16).sector_number(3 * 4096), 5);
        assert_eq!(segment(512, u64::MAX).sector_number(512), 0);
        assert_eq!(segment(512, u64::MAX).sector_number(3 * 512), 2);
        assert_eq!(segment(4096, u64::MAX - 7).sector_number(4096), 0);
    }
}
