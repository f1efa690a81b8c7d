//! LUKS1 headers (read and unlock only): what `rbd encryption format luks1` and old
//! cryptsetup volumes carry. Layout from the LUKS1 on-disk format specification 1.2.3.

use crate::io::{read_vec, HeaderIo};
use crate::kdf::{Hash, Pbkdf};
use crate::keyslot::{AreaCipher, KeyslotSpec};
use crate::HeaderError;

pub const HEADER_LEN: usize = 592;
pub const KEYSLOTS: usize = 8;
const KEYSLOT_ENABLED: u32 = 0x00AC_71F3;
const KEYSLOT_DISABLED: u32 = 0x0000_DEAD;
pub(crate) const DIGEST_LEN: usize = 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks1Keyslot {
    pub iterations: u32,
    pub salt: [u8; 32],
    /// In 512-byte sectors from the start of the device.
    pub material_sector: u32,
    pub stripes: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Luks1Header {
    pub cipher_name: String,
    pub cipher_mode: String,
    pub hash: Hash,
    /// Data start in 512-byte sectors.
    pub payload_offset: u32,
    pub key_bytes: u32,
    pub digest: [u8; DIGEST_LEN],
    pub digest_salt: [u8; 32],
    pub digest_iterations: u32,
    pub uuid: String,
    pub keyslots: [Option<Luks1Keyslot>; KEYSLOTS],
}

fn field(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

impl Luks1Header {
    pub fn read(io: &dyn HeaderIo) -> Result<Self, HeaderError> {
        let h = read_vec(io, 0, HEADER_LEN)?;
        let bad = |reason: String| HeaderError::BinaryHeader {
            which: "LUKS1",
            reason,
        };
        if h[..6] != crate::binary::MAGIC_PRIMARY || u16::from_be_bytes([h[6], h[7]]) != 1 {
            return Err(bad("no LUKS1 magic".into()));
        }
        let be32 = |at: usize| u32::from_be_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        let hash: Hash = field(&h[72..104]).parse()?;
        let key_bytes = be32(108);
        if !matches!(key_bytes, 16 | 32 | 48 | 64) {
            return Err(bad(format!("key size {key_bytes} bytes is not supported")));
        }
        let digest_iterations = be32(164);
        if digest_iterations == 0 {
            return Err(bad("master key digest has 0 iterations".into()));
        }
        let mut keyslots: [Option<Luks1Keyslot>; KEYSLOTS] = Default::default();
        for (i, slot) in keyslots.iter_mut().enumerate() {
            let at = 208 + i * 48;
            match be32(at) {
                KEYSLOT_DISABLED => {}
                KEYSLOT_ENABLED => {
                    let stripes = be32(at + 44);
                    let iterations = be32(at + 4);
                    if stripes == 0 || stripes > crate::af::STRIPES || iterations == 0 {
                        return Err(bad(format!(
                            "keyslot {i} has {stripes} stripes and {iterations} iterations"
                        )));
                    }
                    *slot = Some(Luks1Keyslot {
                        iterations,
                        salt: h[at + 8..at + 40].try_into().expect("32 bytes"),
                        material_sector: be32(at + 40),
                        stripes,
                    });
                }
                other => return Err(bad(format!("keyslot {i} has state {other:#x}"))),
            }
        }
        Ok(Luks1Header {
            cipher_name: field(&h[8..40]),
            cipher_mode: field(&h[40..72]),
            hash,
            payload_offset: be32(104),
            key_bytes,
            digest: h[112..132].try_into().expect("20 bytes"),
            digest_salt: h[132..164].try_into().expect("32 bytes"),
            digest_iterations,
            uuid: field(&h[168..208]),
            keyslots,
        })
    }

    /// `cipher-mode` as cryptsetup prints it (e.g. `aes-xts-plain64`).
    pub fn cipher(&self) -> String {
        format!("{}-{}", self.cipher_name, self.cipher_mode)
    }

    pub(crate) fn keyslot_spec(&self, slot: usize) -> Result<KeyslotSpec, HeaderError> {
        let ks = self.keyslots[slot]
            .as_ref()
            .ok_or(HeaderError::NoSuchKeyslot(slot as u32))?;
        Ok(KeyslotSpec {
            pbkdf: Pbkdf::Pbkdf2 {
                hash: self.hash,
                iterations: ks.iterations,
            },
            salt: ks.salt.to_vec(),
            area_cipher: AreaCipher::parse(&self.cipher(), self.key_bytes, "LUKS1 keyslots")?,
            af_hash: self.hash,
            stripes: ks.stripes,
            key_size: self.key_bytes,
            material_offset: ks.material_sector as u64 * 512,
        })
    }

    pub fn digest_matches(&self, volume_key: &[u8]) -> Result<bool, HeaderError> {
        let mut out = [0u8; DIGEST_LEN];
        crate::kdf::pbkdf2(
            self.hash,
            volume_key,
            &self.digest_salt,
            self.digest_iterations,
            &mut out,
        )?;
        Ok(openssl::memcmp::eq(&out, &self.digest))
    }
}
