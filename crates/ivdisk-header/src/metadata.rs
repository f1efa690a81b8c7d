//! The LUKS2 JSON metadata: keyslots, digests, segments, tokens and config, as the LUKS2
//! on-disk format specification (cryptsetup docs/on-disk-format-luks2.pdf) defines them.
//!
//! Fields this crate does not use are kept (`extra`) and written back unchanged, so a header
//! touched by cryptsetup or a newer ivdisk survives our edits.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::kdf::{Argon2Variant, Hash, Pbkdf};
use crate::HeaderError;

/// Most keyslots (and tokens, digests, segments) a LUKS2 header has.
pub const MAX_KEYSLOTS: u32 = 32;
/// cryptsetup's upper bound for the keyslots area.
pub const MAX_KEYSLOTS_SIZE: u64 = 128 * 1024 * 1024;
/// Largest volume key LUKS2 stores (cryptsetup: 512 bytes of key material per keyslot).
pub const MAX_KEY_SIZE: u32 = 512;

/// Offsets and sizes are decimal strings in LUKS2 JSON (JSON numbers lose precision past 2^53).
mod u64_string {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&value.to_string())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("`{text}` is not a decimal u64 string")))
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub(crate) fn unb64(what: &str, text: &str) -> Result<Vec<u8>, HeaderError> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| HeaderError::Metadata(format!("{what} is not valid base64: {e}")))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    pub keyslots: BTreeMap<u32, Keyslot>,
    pub tokens: BTreeMap<u32, Value>,
    pub segments: BTreeMap<u32, Segment>,
    pub digests: BTreeMap<u32, Digest>,
    pub config: Config,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Keyslot {
    #[serde(rename = "type")]
    pub kind: String,
    pub key_size: u32,
    pub af: AntiForensic,
    pub area: Area,
    pub kdf: Kdf,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub priority: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AntiForensic {
    #[serde(rename = "type")]
    pub kind: String,
    pub stripes: u32,
    pub hash: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Area {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(with = "u64_string")]
    pub offset: u64,
    #[serde(with = "u64_string")]
    pub size: u64,
    pub encryption: String,
    pub key_size: u32,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// `kdf` of a keyslot; which fields are present depends on the type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Kdf {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub hash: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub iterations: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub time: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cpus: Option<u32>,
    pub salt: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Kdf {
    pub fn new(pbkdf: &Pbkdf, salt: &[u8]) -> Kdf {
        let mut kdf = Kdf {
            kind: pbkdf.type_name().to_owned(),
            hash: None,
            iterations: None,
            time: None,
            memory: None,
            cpus: None,
            salt: b64(salt),
            extra: Map::new(),
        };
        match *pbkdf {
            Pbkdf::Pbkdf2 { hash, iterations } => {
                kdf.hash = Some(hash.name().to_owned());
                kdf.iterations = Some(iterations);
            }
            Pbkdf::Argon2 {
                time,
                memory_kib,
                parallel,
                ..
            } => {
                kdf.time = Some(time);
                kdf.memory = Some(memory_kib);
                kdf.cpus = Some(parallel);
            }
        }
        kdf
    }

    /// The derivation this describes, with its limits checked.
    pub fn pbkdf(&self) -> Result<Pbkdf, HeaderError> {
        let missing = |field: &str| {
            HeaderError::Metadata(format!("kdf `{}` lacks the `{field}` field", self.kind))
        };
        let pbkdf = match self.kind.as_str() {
            "pbkdf2" => Pbkdf::Pbkdf2 {
                hash: self
                    .hash
                    .as_deref()
                    .ok_or_else(|| missing("hash"))?
                    .parse()?,
                iterations: self.iterations.ok_or_else(|| missing("iterations"))?,
            },
            "argon2i" | "argon2id" => Pbkdf::Argon2 {
                variant: if self.kind == "argon2i" {
                    Argon2Variant::Argon2i
                } else {
                    Argon2Variant::Argon2id
                },
                time: self.time.ok_or_else(|| missing("time"))?,
                memory_kib: self.memory.ok_or_else(|| missing("memory"))?,
                parallel: self.cpus.ok_or_else(|| missing("cpus"))?,
            },
            other => return Err(HeaderError::UnsupportedKdf(other.to_owned())),
        };
        pbkdf.check_limits()?;
        Ok(pbkdf)
    }

    pub fn salt(&self) -> Result<Vec<u8>, HeaderError> {
        unb64("kdf salt", &self.salt)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(with = "u64_string")]
    pub offset: u64,
    /// `"dynamic"` (up to the end of the device) or a byte count.
    pub size: String,
    #[serde(with = "u64_string")]
    pub iv_tweak: u64,
    pub encryption: String,
    pub sector_size: u32,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub integrity: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub flags: Option<Vec<String>>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Segment {
    /// The segment's size in bytes, `None` for "dynamic".
    pub fn fixed_size(&self) -> Result<Option<u64>, HeaderError> {
        if self.size == "dynamic" {
            return Ok(None);
        }
        self.size.parse().map(Some).map_err(|_| {
            HeaderError::Metadata(format!(
                "segment size `{}` is neither \"dynamic\" nor a byte count",
                self.size
            ))
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Digest {
    #[serde(rename = "type")]
    pub kind: String,
    pub keyslots: Vec<String>,
    pub segments: Vec<String>,
    pub hash: String,
    pub iterations: u32,
    pub salt: String,
    pub digest: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Digest {
    /// A PBKDF2 digest of `volume_key` (what LUKS2 checks a recovered key against).
    pub fn compute(
        volume_key: &[u8],
        hash: Hash,
        iterations: u32,
        salt: &[u8],
    ) -> Result<Vec<u8>, HeaderError> {
        let mut out = vec![0u8; hash.output_len()];
        crate::kdf::pbkdf2(hash, volume_key, salt, iterations, &mut out)?;
        Ok(out)
    }

    pub fn new(volume_key: &[u8], iterations: u32) -> Result<Digest, HeaderError> {
        let mut salt = [0u8; 32];
        crate::random_bytes(&mut salt)?;
        let digest = Digest::compute(volume_key, Hash::Sha256, iterations, &salt)?;
        Ok(Digest {
            kind: "pbkdf2".into(),
            keyslots: Vec::new(),
            segments: vec!["0".into()],
            hash: Hash::Sha256.name().into(),
            iterations,
            salt: b64(&salt),
            digest: b64(&digest),
            extra: Map::new(),
        })
    }

    /// Whether `volume_key` is the key this digest was made of (constant-time compare).
    pub fn matches(&self, volume_key: &[u8]) -> Result<bool, HeaderError> {
        if self.kind != "pbkdf2" {
            return Err(HeaderError::Metadata(format!(
                "digest type `{}` is not supported (only pbkdf2)",
                self.kind
            )));
        }
        let hash: Hash = self.hash.parse()?;
        let expected = unb64("digest", &self.digest)?;
        let salt = unb64("digest salt", &self.salt)?;
        if !digest_len_ok(hash, expected.len()) {
            return Ok(false);
        }
        // As long as stored: a LUKS1 digest converted by cryptsetup keeps its 20 bytes.
        let mut actual = vec![0u8; expected.len()];
        crate::kdf::pbkdf2(hash, volume_key, &salt, self.iterations, &mut actual)?;
        Ok(openssl::memcmp::eq(&expected, &actual))
    }
}

/// A digest's length: the hash's, or 20 bytes whatever the hash (LUKS1's digest length, which
/// `cryptsetup convert` keeps: every LUKS1 volume made since cryptsetup 1.7 hashes with SHA-256
/// and, converted to LUKS2, has a 20-byte "sha256" digest; cryptsetup accepts both).
fn digest_len_ok(hash: Hash, len: usize) -> bool {
    len == hash.output_len() || len == crate::luks1::DIGEST_LEN
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    #[serde(with = "u64_string")]
    pub json_size: u64,
    #[serde(with = "u64_string")]
    pub keyslots_size: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub flags: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub requirements: Option<Requirements>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Requirements {
    #[serde(default)]
    pub mandatory: Vec<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Config {
    pub fn mandatory_requirements(&self) -> &[String] {
        self.requirements
            .as_ref()
            .map(|r| r.mandatory.as_slice())
            .unwrap_or(&[])
    }
}

fn out_of_spec(message: String) -> HeaderError {
    HeaderError::Metadata(message)
}

impl Metadata {
    /// Parse the JSON area's text.
    pub fn parse(text: &[u8]) -> Result<Metadata, HeaderError> {
        let value: Value =
            serde_json::from_slice(text).map_err(|e| HeaderError::Json(e.to_string()))?;
        if !value.is_object() {
            return Err(HeaderError::Json(
                "the JSON area is not a JSON object".into(),
            ));
        }
        let requirements: Vec<String> = value
            .pointer("/config/requirements/mandatory")
            .and_then(Value::as_array)
            .map(|all| {
                all.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        serde_json::from_value(value).map_err(|e| match requirements.is_empty() {
            true => HeaderError::Metadata(e.to_string()),
            // What cryptsetup writes while an operation runs (a reencryption's `linear`
            // segment, say) need not follow the plain layout: the requirement says why, and
            // what the parser missed would only mislead.
            false => {
                tracing::debug!(error = %e, "LUKS2 metadata with requirements does not parse");
                HeaderError::UnmetRequirements(requirements)
            }
        })
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("metadata serializes")
    }

    /// Check the rules of the LUKS2 specification that protect what we do with the header:
    /// areas inside the keyslots area and apart, references that resolve, costs in range.
    /// `metadata_size` is one binary header plus its JSON area.
    pub fn validate(&self, metadata_size: u64) -> Result<(), HeaderError> {
        if self.config.json_size != metadata_size - 4096 {
            return Err(out_of_spec(format!(
                "config.json_size {} does not match the header size {metadata_size}",
                self.config.json_size
            )));
        }
        let keyslots_size = self.config.keyslots_size;
        if !keyslots_size.is_multiple_of(4096) || keyslots_size > MAX_KEYSLOTS_SIZE {
            return Err(out_of_spec(format!(
                "config.keyslots_size {keyslots_size} is not a multiple of 4096 up to \
                 {MAX_KEYSLOTS_SIZE}"
            )));
        }
        let area_start = 2 * metadata_size;
        let area_end = area_start + keyslots_size;
        for (what, count) in [
            ("keyslots", self.keyslots.keys().max()),
            ("tokens", self.tokens.keys().max()),
            ("digests", self.digests.keys().max()),
            ("segments", self.segments.keys().max()),
        ] {
            if let Some(&id) = count {
                if id >= MAX_KEYSLOTS {
                    return Err(out_of_spec(format!(
                        "{what} id {id} is out of range (0..{MAX_KEYSLOTS})"
                    )));
                }
            }
        }
        let mut areas: Vec<(u64, u64, u32)> = Vec::new();
        for (&id, slot) in &self.keyslots {
            let area = &slot.area;
            if slot.kind != "luks2" {
                return Err(out_of_spec(format!(
                    "keyslot {id} has type `{}` (only luks2 keyslots are supported)",
                    slot.kind
                )));
            }
            if slot.key_size == 0 || slot.key_size > MAX_KEY_SIZE {
                return Err(out_of_spec(format!(
                    "keyslot {id} key_size {} is out of range 1..={MAX_KEY_SIZE}",
                    slot.key_size
                )));
            }
            if slot.af.kind != "luks1" || slot.af.stripes != crate::af::STRIPES {
                return Err(out_of_spec(format!(
                    "keyslot {id} anti-forensic splitter `{}` with {} stripes is not supported \
                     (luks1 with {} stripes)",
                    slot.af.kind,
                    slot.af.stripes,
                    crate::af::STRIPES
                )));
            }
            let _: Hash = slot.af.hash.parse()?;
            if area.kind != "raw" {
                return Err(out_of_spec(format!(
                    "keyslot {id} area type `{}` is not supported (raw)",
                    area.kind
                )));
            }
            let end = area.offset.checked_add(area.size);
            if area.offset < area_start || end.is_none_or(|end| end > area_end) {
                return Err(out_of_spec(format!(
                    "keyslot {id} area [{}, +{}) lies outside the keyslots area [{area_start}, \
                     {area_end})",
                    area.offset, area.size
                )));
            }
            let needed = crate::keyslot::material_len(slot.key_size);
            if area.size < needed {
                return Err(out_of_spec(format!(
                    "keyslot {id} area of {} bytes is smaller than its key material ({needed})",
                    area.size
                )));
            }
            slot.kdf.pbkdf()?;
            slot.kdf.salt()?;
            areas.push((area.offset, area.offset + area.size, id));
        }
        areas.sort();
        for pair in areas.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(out_of_spec(format!(
                    "keyslots {} and {} have overlapping areas",
                    pair[0].2, pair[1].2
                )));
            }
        }
        for (&id, segment) in &self.segments {
            if !matches!(segment.sector_size, 512 | 1024 | 2048 | 4096) {
                return Err(out_of_spec(format!(
                    "segment {id} sector_size {} is not 512, 1024, 2048 or 4096",
                    segment.sector_size
                )));
            }
            if segment.offset % 512 != 0 {
                return Err(out_of_spec(format!(
                    "segment {id} offset {} is not a multiple of 512",
                    segment.offset
                )));
            }
            if let Some(size) = segment.fixed_size()? {
                if size % segment.sector_size as u64 != 0 {
                    return Err(out_of_spec(format!(
                        "segment {id} size {size} is not a multiple of its sector size"
                    )));
                }
            }
            if segment.offset != 0 && segment.offset < area_end {
                return Err(out_of_spec(format!(
                    "segment {id} offset {} overlaps the header and keyslots area (ends at \
                     {area_end})",
                    segment.offset
                )));
            }
        }
        let parse_ref = |what: &str, id: &str, exists: bool| -> Result<(), HeaderError> {
            if !exists {
                return Err(out_of_spec(format!(
                    "a digest names {what} `{id}`, which does not exist"
                )));
            }
            Ok(())
        };
        for (&id, digest) in &self.digests {
            for slot in &digest.keyslots {
                let exists = slot
                    .parse::<u32>()
                    .is_ok_and(|s| self.keyslots.contains_key(&s));
                parse_ref("keyslot", slot, exists)?;
            }
            for segment in &digest.segments {
                let exists = segment
                    .parse::<u32>()
                    .is_ok_and(|s| self.segments.contains_key(&s));
                parse_ref("segment", segment, exists)?;
            }
            let hash: Hash = digest.hash.parse()?;
            if digest.kind != "pbkdf2" || digest.iterations == 0 {
                return Err(out_of_spec(format!(
                    "digest {id} is `{}` with {} iterations (pbkdf2 with >= 1 expected)",
                    digest.kind, digest.iterations
                )));
            }
            if !digest_len_ok(hash, unb64("digest", &digest.digest)?.len()) {
                return Err(out_of_spec(format!(
                    "digest {id} has the wrong length for {hash}"
                )));
            }
            unb64("digest salt", &digest.salt)?;
        }
        for &id in self.keyslots.keys() {
            if self.digest_of_keyslot(id).is_none() {
                return Err(out_of_spec(format!(
                    "keyslot {id} is not assigned to any digest"
                )));
            }
        }
        for (&id, token) in &self.tokens {
            let ok = token.get("type").is_some_and(Value::is_string)
                && token.get("keyslots").is_some_and(Value::is_array);
            if !ok {
                return Err(out_of_spec(format!(
                    "token {id} lacks a string `type` or a `keyslots` array"
                )));
            }
        }
        Ok(())
    }

    pub fn digest_of_keyslot(&self, slot: u32) -> Option<(u32, &Digest)> {
        let name = slot.to_string();
        self.digests
            .iter()
            .find(|(_, d)| d.keyslots.contains(&name))
            .map(|(&id, d)| (id, d))
    }

    /// Whether keyslot `slot` holds the data segment's key: its digest is bound to segment
    /// 0. A keyslot may hold another key (`cryptsetup luksAddKey --unbound`), which its own
    /// digest confirms but which decrypts nothing of the volume.
    pub fn keyslot_opens_segment(&self, slot: u32) -> bool {
        self.digest_of_keyslot(slot)
            .is_some_and(|(_, digest)| digest.segments.iter().any(|s| s == "0"))
    }

    /// The digest bound to the data segment (segment 0).
    pub fn segment_digest(&self) -> Option<(u32, &Digest)> {
        self.digests
            .iter()
            .find(|(_, d)| d.segments.iter().any(|s| s == "0"))
            .map(|(&id, d)| (id, d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header that cryptsetup's reencryption left mid-way has a `linear` segment without
    /// the fields of a `crypt` one: the error names the requirement and what to do, not only
    /// the missing field.
    #[test]
    fn metadata_that_does_not_parse_names_its_requirements() {
        let json = br#"{"keyslots":{},"tokens":{},"digests":{},
            "segments":{"0":{"type":"linear","offset":"16777216","size":"dynamic"}},
            "config":{"json_size":"12288","keyslots_size":"16744448",
                      "requirements":{"mandatory":["online-reencrypt-v2"]}}}"#;
        let err = Metadata::parse(json).unwrap_err().to_string();
        assert!(
            err.contains("online-reencrypt-v2")
                && err.contains("cryptsetup reencrypt --resume-only")
                && !err.contains("missing field"),
            "{err}"
        );
        let plain = br#"{"keyslots":{},"tokens":{},"digests":{},
            "segments":{"0":{"type":"linear","offset":"16777216","size":"dynamic"}},
            "config":{"json_size":"12288","keyslots_size":"16744448"}}"#;
        let err = Metadata::parse(plain).unwrap_err().to_string();
        assert!(!err.contains("requirements"), "{err}");
    }
}
