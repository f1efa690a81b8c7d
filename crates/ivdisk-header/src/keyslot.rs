//! Keyslot material: the volume key, split by the anti-forensic splitter and encrypted with a
//! key derived from the passphrase, stored in the keyslot's area.

use ivdisk_crypto::{new_cipher, CipherParams, ImageId, Suite, VolumeKey};
use zeroize::Zeroizing;

use crate::af;
use crate::kdf::{Hash, Pbkdf};
use crate::HeaderError;

/// Bytes a keyslot's encrypted material takes: key × stripes, rounded up to 512-byte sectors.
pub fn material_len(key_size: u32) -> u64 {
    (key_size as u64 * af::STRIPES as u64).div_ceil(512) * 512
}

/// Bytes of keyslots area a new keyslot reserves (cryptsetup aligns areas to 4096).
pub fn area_len(key_size: u32) -> u64 {
    material_len(key_size).div_ceil(4096) * 4096
}

/// How a keyslot's material is encrypted: `aes-xts-plain64` with sector 0 at the start of the
/// area, 512-byte sectors (LUKS1 and LUKS2 alike).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AreaCipher {
    pub key_size: u32,
}

impl AreaCipher {
    pub fn parse(encryption: &str, key_size: u32, what: &'static str) -> Result<Self, HeaderError> {
        if encryption != "aes-xts-plain64" || !matches!(key_size, 32 | 64) {
            return Err(HeaderError::UnsupportedCipher(
                format!("{encryption} ({} bits)", key_size * 8),
                what,
            ));
        }
        Ok(AreaCipher { key_size })
    }

    fn crypt(&self, key: &[u8], material: &mut [u8], encrypt: bool) -> Result<(), HeaderError> {
        let key = VolumeKey::from_slice(key);
        let cipher = new_cipher(
            Suite::AesXtsPlain64,
            &key,
            &CipherParams::new(512, ImageId::default()),
        )?;
        if encrypt {
            cipher.encrypt_sectors(0, material, &mut [])?;
        } else {
            cipher.decrypt_sectors(0, material, &[])?;
        }
        Ok(())
    }
}

/// Everything needed to open one keyslot, taken from a LUKS1 or LUKS2 header.
pub(crate) struct KeyslotSpec {
    pub pbkdf: Pbkdf,
    pub salt: Vec<u8>,
    pub area_cipher: AreaCipher,
    pub af_hash: Hash,
    pub stripes: u32,
    pub key_size: u32,
    pub material_offset: u64,
}

impl KeyslotSpec {
    /// Derive the area key from `passphrase`, decrypt the material and merge it into the
    /// candidate volume key (which the caller checks against the digest).
    pub fn open(
        &self,
        io: &dyn crate::HeaderIo,
        passphrase: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, HeaderError> {
        let len = (self.key_size as u64 * self.stripes as u64).div_ceil(512) * 512;
        let mut material = Zeroizing::new(vec![0u8; len as usize]);
        io.read_at(self.material_offset, &mut material)
            .map_err(HeaderError::io(self.material_offset, material.len()))?;
        let mut area_key = Zeroizing::new(vec![0u8; self.area_cipher.key_size as usize]);
        self.pbkdf.derive(passphrase, &self.salt, &mut area_key)?;
        self.area_cipher.crypt(&area_key, &mut material, false)?;
        af::merge(
            &material,
            self.key_size as usize,
            self.stripes,
            self.af_hash,
        )
    }
}

/// The hash of the anti-forensic split of the material `seal` makes.
pub(crate) const SEAL_AF_HASH: Hash = Hash::Sha256;

/// Make the encrypted material of a new keyslot holding `volume_key`.
pub(crate) fn seal(
    volume_key: &[u8],
    passphrase: &[u8],
    pbkdf: &Pbkdf,
    salt: &[u8],
    area_cipher: AreaCipher,
) -> Result<Zeroizing<Vec<u8>>, HeaderError> {
    let split = af::split(volume_key, af::STRIPES, SEAL_AF_HASH)?;
    let mut material = Zeroizing::new(vec![0u8; material_len(volume_key.len() as u32) as usize]);
    material[..split.len()].copy_from_slice(&split);
    let mut area_key = Zeroizing::new(vec![0u8; area_cipher.key_size as usize]);
    pbkdf.derive(passphrase, salt, &mut area_key)?;
    area_cipher.crypt(&area_key, &mut material, true)?;
    Ok(material)
}
