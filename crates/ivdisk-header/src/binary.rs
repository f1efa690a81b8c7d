//! The LUKS2 binary header (4096 bytes) in front of each JSON area, its checksum, and how the
//! two copies are found, chosen between and written (LUKS2 specification, section 2).

use openssl::hash::Hasher;

use crate::io::{read_vec, HeaderIo};
use crate::kdf::Hash;
use crate::metadata::Metadata;
use crate::HeaderError;

pub const MAGIC_PRIMARY: [u8; 6] = *b"LUKS\xba\xbe";
pub const MAGIC_SECONDARY: [u8; 6] = *b"SKUL\xba\xbe";
pub const BINARY_HEADER_LEN: usize = 4096;
/// The sizes a LUKS2 header (binary + JSON area) may have; the secondary copy starts right
/// after the primary, so these are also where a lost primary's secondary is searched.
pub const HEADER_SIZES: [u64; 9] = [
    16 << 10,
    32 << 10,
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
];

const CSUM_OFFSET: usize = 448;
const CSUM_LEN: usize = 64;

/// The fields of one binary header that are not the checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinaryHeader {
    pub hdr_size: u64,
    pub seqid: u64,
    /// The label and subsystem as stored, up to their NUL: cryptsetup takes any bytes
    /// there (`--label`), not only UTF-8, and a header written again keeps them as they were.
    pub label: Vec<u8>,
    pub checksum_alg: String,
    pub uuid: String,
    pub subsystem: Vec<u8>,
}

/// A NUL-terminated field's bytes (all of them if it has no NUL).
fn c_bytes(field: &[u8]) -> Vec<u8> {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    field[..end].to_vec()
}

fn c_string(field: &[u8]) -> String {
    String::from_utf8_lossy(&c_bytes(field)).into_owned()
}

fn put_c_string(dst: &mut [u8], text: &[u8]) -> Result<(), HeaderError> {
    if text.len() >= dst.len() {
        return Err(HeaderError::InvalidParameter(format!(
            "`{}` is longer than the {} bytes the LUKS2 header holds",
            String::from_utf8_lossy(text),
            dst.len() - 1
        )));
    }
    dst[..text.len()].copy_from_slice(text);
    Ok(())
}

fn checksum(alg: &str, header: &[u8]) -> Result<Vec<u8>, HeaderError> {
    let hash: Hash = alg.parse()?;
    let mut hasher = Hasher::new(hash.openssl()).map_err(|e| HeaderError::Kdf(e.to_string()))?;
    hasher
        .update(&header[..CSUM_OFFSET])
        .and_then(|_| hasher.update(&[0u8; CSUM_LEN]))
        .and_then(|_| hasher.update(&header[CSUM_OFFSET + CSUM_LEN..]))
        .map_err(|e| HeaderError::Kdf(e.to_string()))?;
    Ok(hasher
        .finish()
        .map_err(|e| HeaderError::Kdf(e.to_string()))?
        .to_vec())
}

/// One copy read from the device, checked.
#[derive(Debug, Clone)]
pub struct Copy {
    pub binary: BinaryHeader,
    pub metadata: Metadata,
}

/// Parse and check the copy at `offset`. `which` names it in errors.
pub fn read_copy(io: &dyn HeaderIo, offset: u64, which: &'static str) -> Result<Copy, HeaderError> {
    let bad = |reason: String| HeaderError::BinaryHeader {
        which: if offset == 0 {
            "primary LUKS2"
        } else {
            "secondary LUKS2"
        },
        reason,
    };
    let head = read_vec(io, offset, BINARY_HEADER_LEN)?;
    let magic = if offset == 0 {
        MAGIC_PRIMARY
    } else {
        MAGIC_SECONDARY
    };
    if head[..6] != magic {
        return Err(bad("no LUKS2 magic".into()));
    }
    let version = u16::from_be_bytes([head[6], head[7]]);
    if version != 2 {
        return Err(bad(format!("version {version}, expected 2")));
    }
    let be64 = |at: usize| u64::from_be_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let hdr_size = be64(8);
    if !HEADER_SIZES.contains(&hdr_size) {
        return Err(bad(format!(
            "header size {hdr_size} is not one LUKS2 allows (16 KiB .. 4 MiB, powers of two)"
        )));
    }
    let hdr_offset = be64(256);
    if hdr_offset != offset {
        return Err(bad(format!(
            "it says it lives at byte {hdr_offset} but was found at {offset}"
        )));
    }
    if offset != 0 && offset != hdr_size {
        return Err(bad(format!(
            "a secondary header of size {hdr_size} cannot be at byte {offset}"
        )));
    }
    let whole = read_vec(io, offset, hdr_size as usize)?;
    let checksum_alg = c_string(&head[72..104]);
    let computed = checksum(&checksum_alg, &whole)?;
    if whole[CSUM_OFFSET..CSUM_OFFSET + computed.len()] != computed[..] {
        return Err(HeaderError::Checksum { which });
    }
    let json = &whole[BINARY_HEADER_LEN..];
    let json_len = json
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| HeaderError::Json(format!("the {which} JSON area is not NUL-terminated")))?;
    let metadata = Metadata::parse(&json[..json_len])?;
    metadata.validate(hdr_size)?;
    Ok(Copy {
        binary: BinaryHeader {
            hdr_size,
            seqid: be64(16),
            label: c_bytes(&head[24..72]),
            checksum_alg,
            uuid: c_string(&head[168..208]),
            subsystem: c_bytes(&head[208..256]),
        },
        metadata,
    })
}

/// The header and a warning when only one copy was usable or the copies disagreed.
pub struct Loaded {
    pub copy: Copy,
    pub warning: Option<String>,
    /// The primary was used and the secondary is damaged or out of date: the next write
    /// goes to the secondary first (see [`write_both`]).
    pub secondary_first: bool,
}

/// Read both copies and choose as cryptsetup does: the valid one, or the newer of two valid.
pub fn read_luks2(io: &dyn HeaderIo) -> Result<Loaded, HeaderError> {
    let primary = read_copy(io, 0, "primary");
    let secondary = match &primary {
        Ok(p) => read_copy(io, p.binary.hdr_size, "secondary"),
        Err(_) => {
            // The primary's size field cannot be trusted; look at every possible position.
            let mut found = Err(HeaderError::BinaryHeader {
                which: "secondary LUKS2",
                reason: "no secondary LUKS2 header found at any allowed offset".into(),
            });
            for &offset in &HEADER_SIZES {
                let mut magic = [0u8; 6];
                if io.read_at(offset, &mut magic).is_ok() && magic == MAGIC_SECONDARY {
                    found = read_copy(io, offset, "secondary");
                    if found.is_ok() {
                        break;
                    }
                }
            }
            found
        }
    };
    match (primary, secondary) {
        (Ok(p), Ok(s)) => {
            if s.binary.seqid > p.binary.seqid {
                Ok(Loaded {
                    warning: Some(format!(
                        "the secondary LUKS2 header is newer (seqid {} > {}); using it, the \
                         next header change rewrites the primary",
                        s.binary.seqid, p.binary.seqid
                    )),
                    copy: s,
                    secondary_first: false,
                })
            } else {
                let warning = (p.binary.seqid > s.binary.seqid || p.metadata != s.metadata)
                    .then(|| "the secondary LUKS2 header is out of date; using the primary".into());
                let secondary_first = warning.is_some();
                Ok(Loaded {
                    copy: p,
                    warning,
                    secondary_first,
                })
            }
        }
        // One copy intact (checksum-valid) but using what this ivdisk does not support, which
        // neither a torn write nor a bug makes: another tool wrote it, maybe after the other
        // copy, which may then be stale (its next change, "repairing" the intact copy,
        // overwrote that tool's state). Say what is unsupported rather than open the other.
        // (Malformed JSON or metadata out of spec falls back to the other copy, as
        // cryptsetup's does.)
        (Ok(_), Err(e)) | (Err(e), Ok(_)) if is_unsupported(&e) => Err(e),
        (Ok(p), Err(e)) => Ok(Loaded {
            copy: p,
            warning: Some(format!(
                "the secondary LUKS2 header is damaged ({e}); using the primary, the next \
                 header change repairs it"
            )),
            secondary_first: true,
        }),
        (Err(e), Ok(s)) => Ok(Loaded {
            copy: s,
            warning: Some(format!(
                "the primary LUKS2 header is damaged ({e}); using the secondary, the next \
                 header change repairs it"
            )),
            secondary_first: false,
        }),
        // Both copies checksum-valid but unusable (an algorithm or field this ivdisk does not
        // support, out-of-spec JSON): the header is intact, so say what is wrong with it rather
        // than calling it damaged.
        (Err(p), Err(s)) if !is_damage(&p) && !is_damage(&s) => Err(p),
        (Err(p), Err(s)) => Err(HeaderError::BothHeadersDamaged {
            primary: p.to_string(),
            secondary: s.to_string(),
        }),
    }
}

/// Whether a copy's error means its bytes are damaged (as opposed to a checksum-valid header
/// that is out of spec or uses something unsupported).
fn is_damage(e: &HeaderError) -> bool {
    matches!(
        e,
        HeaderError::Io { .. }
            | HeaderError::Truncated { .. }
            | HeaderError::BinaryHeader { .. }
            | HeaderError::Checksum { .. }
    )
}

/// Whether a copy's error means it uses an algorithm or version this ivdisk does not support.
fn is_unsupported(e: &HeaderError) -> bool {
    matches!(
        e,
        HeaderError::UnsupportedVersion(_)
            | HeaderError::UnsupportedKdf(_)
            | HeaderError::UnsupportedHash(_)
            | HeaderError::UnsupportedCipher(..)
            | HeaderError::UnmetRequirements(_)
    )
}

/// Whether `metadata` fits the JSON area of a header of `binary`'s size (with its NUL).
pub fn check_fits(binary: &BinaryHeader, metadata: &Metadata) -> Result<(), HeaderError> {
    fits(binary, &metadata.to_json())
}

fn fits(binary: &BinaryHeader, json: &[u8]) -> Result<(), HeaderError> {
    let area = (binary.hdr_size as usize).saturating_sub(BINARY_HEADER_LEN);
    if json.len() >= area {
        return Err(HeaderError::InvalidParameter(format!(
            "the LUKS2 metadata ({} bytes) does not fit its {area}-byte JSON area",
            json.len(),
        )));
    }
    Ok(())
}

/// Serialize one copy: binary header + JSON area, checksummed.
pub fn encode_copy(
    binary: &BinaryHeader,
    metadata: &Metadata,
    offset: u64,
) -> Result<Vec<u8>, HeaderError> {
    let hdr_size = binary.hdr_size as usize;
    let json = metadata.to_json();
    fits(binary, &json)?;
    let mut out = vec![0u8; hdr_size];
    out[..6].copy_from_slice(if offset == 0 {
        &MAGIC_PRIMARY
    } else {
        &MAGIC_SECONDARY
    });
    out[6..8].copy_from_slice(&2u16.to_be_bytes());
    out[8..16].copy_from_slice(&binary.hdr_size.to_be_bytes());
    out[16..24].copy_from_slice(&binary.seqid.to_be_bytes());
    put_c_string(&mut out[24..72], &binary.label)?;
    put_c_string(&mut out[72..104], binary.checksum_alg.as_bytes())?;
    crate::random_bytes(&mut out[104..168])?;
    put_c_string(&mut out[168..208], binary.uuid.as_bytes())?;
    put_c_string(&mut out[208..256], &binary.subsystem)?;
    out[256..264].copy_from_slice(&offset.to_be_bytes());
    out[BINARY_HEADER_LEN..BINARY_HEADER_LEN + json.len()].copy_from_slice(&json);
    let csum = checksum(&binary.checksum_alg, &out)?;
    out[CSUM_OFFSET..CSUM_OFFSET + csum.len()].copy_from_slice(&csum);
    Ok(out)
}

/// Write both copies, each synced before the next is written: a crash or power cut tears at
/// most the copy being written, so one valid copy stays, with either the old or the new
/// seqid, and readers take the newest valid one. (With one sync after both, the medium could
/// have kept part of each.) The primary goes first, unless it is the only current copy
/// (`secondary_first`: the secondary is damaged or out of date): writing it first, a torn
/// write left no valid copy, or only the stale one, whose older keyslots came back.
pub fn write_both(
    io: &mut dyn HeaderIo,
    binary: &BinaryHeader,
    metadata: &Metadata,
    secondary_first: bool,
) -> Result<(), HeaderError> {
    metadata.validate(binary.hdr_size)?;
    let order = match secondary_first {
        true => [binary.hdr_size, 0],
        false => [0, binary.hdr_size],
    };
    for offset in order {
        let bytes = encode_copy(binary, metadata, offset)?;
        io.write_at(offset, &bytes)
            .map_err(|source| HeaderError::Write { offset, source })?;
        io.sync()
            .map_err(|source| HeaderError::Write { offset, source })?;
    }
    Ok(())
}
