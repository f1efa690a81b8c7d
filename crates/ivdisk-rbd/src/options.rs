//! What opening an image takes (encryption, snapshot, read-only) and what inspecting one
//! tells; plain data, the same with and without the `librbd` feature.

use std::fmt;
use std::str::FromStr;

use zeroize::Zeroizing;

/// The LUKS magic at byte 0 of a LUKS1/LUKS2 volume (LUKS2's primary header).
pub const LUKS_MAGIC: [u8; 6] = *b"LUKS\xba\xbe";

/// How many bytes at the start of an image [`LuksFormat::detect`] looks at.
pub const PROBE_LEN: usize = 4096;

/// The LUKS versions librbd formats and loads (`rbd encryption format IMG luks1|luks2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LuksFormat {
    Luks1,
    Luks2,
}

impl LuksFormat {
    pub fn name(self) -> &'static str {
        match self {
            LuksFormat::Luks1 => "luks1",
            LuksFormat::Luks2 => "luks2",
        }
    }

    /// What the first bytes of an image say: `Ok(None)` without the LUKS magic (a plain
    /// image, or not one librbd formatted), `Err(version)` for a LUKS version librbd does not
    /// load.
    pub fn detect(head: &[u8]) -> Result<Option<LuksFormat>, u16> {
        if head.len() < 8 || head[..6] != LUKS_MAGIC {
            return Ok(None);
        }
        match u16::from_be_bytes([head[6], head[7]]) {
            1 => Ok(Some(LuksFormat::Luks1)),
            2 => Ok(Some(LuksFormat::Luks2)),
            other => Err(other),
        }
    }
}

impl fmt::Display for LuksFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LuksFormat::Luks1 => "LUKS1",
            LuksFormat::Luks2 => "LUKS2",
        })
    }
}

/// What `encryption=` of an `rbd://` address asks for (default `auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncryptionKind {
    /// A LUKS header at byte 0 is loaded (by its version), anything else is served plain.
    #[default]
    Auto,
    /// Serve the raw bytes, a LUKS header included.
    None,
    Luks1,
    Luks2,
}

impl EncryptionKind {
    pub const NAMES: [&'static str; 4] = ["auto", "none", "luks1", "luks2"];

    pub fn name(self) -> &'static str {
        match self {
            EncryptionKind::Auto => "auto",
            EncryptionKind::None => "none",
            EncryptionKind::Luks1 => "luks1",
            EncryptionKind::Luks2 => "luks2",
        }
    }

    /// Whether opening with this kind needs a passphrase whatever the image holds (`Auto`
    /// needs one only for a LUKS image).
    pub fn needs_passphrase(self) -> bool {
        matches!(self, EncryptionKind::Luks1 | EncryptionKind::Luks2)
    }

    /// The open option for this kind. `passphrase` is ignored for `None`; for `Luks1`/`Luks2`
    /// a missing one is `Err(format)` (ask for it first).
    pub fn with_passphrase(
        self,
        passphrase: Option<Zeroizing<Vec<u8>>>,
    ) -> Result<Encryption, LuksFormat> {
        Ok(match (self, passphrase) {
            (EncryptionKind::Auto, passphrase) => Encryption::Auto { passphrase },
            (EncryptionKind::None, _) => Encryption::None,
            (EncryptionKind::Luks1, Some(passphrase)) => Encryption::Luks1 { passphrase },
            (EncryptionKind::Luks2, Some(passphrase)) => Encryption::Luks2 { passphrase },
            (EncryptionKind::Luks1, None) => return Err(LuksFormat::Luks1),
            (EncryptionKind::Luks2, None) => return Err(LuksFormat::Luks2),
        })
    }
}

impl FromStr for EncryptionKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(EncryptionKind::Auto),
            "none" => Ok(EncryptionKind::None),
            "luks1" => Ok(EncryptionKind::Luks1),
            "luks2" => Ok(EncryptionKind::Luks2),
            other => Err(format!(
                "encryption `{other}`: expected one of {}",
                EncryptionKind::NAMES.join(", ")
            )),
        }
    }
}

impl fmt::Display for EncryptionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which encryption to load when opening, with its passphrase. Passphrases live in
/// `Zeroizing` buffers and are never printed (`Debug` leaves them out).
pub enum Encryption {
    /// Read the first 4 KiB raw: a LUKS header is loaded by its version (then `passphrase`
    /// is needed: without one the open fails [`crate::RbdError::PassphraseRequired`]);
    /// anything else is served plain.
    Auto {
        passphrase: Option<Zeroizing<Vec<u8>>>,
    },
    /// No encryption: the raw image.
    None,
    Luks1 {
        passphrase: Zeroizing<Vec<u8>>,
    },
    Luks2 {
        passphrase: Zeroizing<Vec<u8>>,
    },
}

impl fmt::Debug for Encryption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Encryption::Auto { passphrase } => f
                .debug_struct("Auto")
                .field("passphrase", &passphrase.as_ref().map(|_| "<hidden>"))
                .finish(),
            Encryption::None => f.write_str("None"),
            Encryption::Luks1 { .. } => f.write_str("Luks1 { passphrase: <hidden> }"),
            Encryption::Luks2 { .. } => f.write_str("Luks2 { passphrase: <hidden> }"),
        }
    }
}

/// How to open an image: [`crate::RbdImage::open`].
#[derive(Debug)]
pub struct RbdOpenOptions {
    /// The image's name in the pool (and namespace of the config).
    pub image: String,
    /// Open at this snapshot (read-only, as librbd opens snapshots).
    pub snapshot: Option<String>,
    /// Open read-only (`rbd_open_read_only`: no watch, no exclusive lock; writes refused).
    pub read_only: bool,
    pub encryption: Encryption,
    /// For a read-write open: take librbd's exclusive lock at once and keep it until the
    /// close, as `rbd-nbd --exclusive` does, so that a second such writer is refused
    /// ([`crate::RbdError::OtherWriter`]). Without it librbd passes the lock between writers
    /// on demand, and two servers of one image both wrote.
    pub exclusive: bool,
}

impl RbdOpenOptions {
    /// Read-write at the head, encryption detected, no passphrase yet.
    pub fn new(image: impl Into<String>) -> Self {
        RbdOpenOptions {
            image: image.into(),
            snapshot: None,
            read_only: false,
            encryption: Encryption::Auto { passphrase: None },
            exclusive: false,
        }
    }
}

/// What [`crate::RbdImage::inspect`] finds without a passphrase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdInfo {
    /// `POOL/IMAGE[@SNAP]`.
    pub image: String,
    /// The image's size as librbd stores it (for a LUKS image, header included).
    pub raw_size: u64,
    /// `None`: no LUKS header at byte 0, served plain by `encryption=auto`.
    pub luks: Option<LuksInfo>,
}

impl RbdInfo {
    /// The size an open image has: the raw size, less a LUKS header region.
    pub fn size(&self) -> u64 {
        match &self.luks {
            Some(luks) => self.raw_size.saturating_sub(luks.data_offset),
            None => self.raw_size,
        }
    }
}

/// A LUKS header found at byte 0 of an rbd image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LuksInfo {
    pub format: LuksFormat,
    /// The data segment's cipher, e.g. `aes-xts-plain64`.
    pub cipher: String,
    pub sector_size: u32,
    /// Where the encrypted data starts (librbd: 16 MiB for LUKS2, the object size for LUKS1).
    pub data_offset: u64,
    /// Active keyslots.
    pub keyslots: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn luks_versions_are_detected_by_magic_and_version() {
        let mut head = vec![0u8; 4096];
        assert_eq!(LuksFormat::detect(&head), Ok(None));
        head[..6].copy_from_slice(&LUKS_MAGIC);
        head[7] = 1;
        assert_eq!(LuksFormat::detect(&head), Ok(Some(LuksFormat::Luks1)));
        head[7] = 2;
        assert_eq!(LuksFormat::detect(&head), Ok(Some(LuksFormat::Luks2)));
        head[7] = 3;
        assert_eq!(LuksFormat::detect(&head), Err(3));
        assert_eq!(LuksFormat::detect(&head[..5]), Ok(None));
        // LUKS2's secondary magic at byte 0 is not a header librbd loads from there.
        head[..6].copy_from_slice(b"SKUL\xba\xbe");
        assert_eq!(LuksFormat::detect(&head), Ok(None));
    }

    #[test]
    fn encryption_kinds_parse_and_need_passphrases() {
        for name in EncryptionKind::NAMES {
            assert_eq!(name.parse::<EncryptionKind>().unwrap().name(), name);
        }
        assert!("luks3"
            .parse::<EncryptionKind>()
            .unwrap_err()
            .contains("auto"));
        assert_eq!(
            EncryptionKind::Luks2.with_passphrase(None).unwrap_err(),
            LuksFormat::Luks2
        );
        let secret = Zeroizing::new(b"secret".to_vec());
        let encryption = EncryptionKind::Auto
            .with_passphrase(Some(secret.clone()))
            .unwrap();
        assert!(!format!("{encryption:?}").contains("secret"));
        let encryption = EncryptionKind::Luks1.with_passphrase(Some(secret)).unwrap();
        assert!(!format!("{encryption:?}").contains("secret"));
        assert!(matches!(
            EncryptionKind::None.with_passphrase(None).unwrap(),
            Encryption::None
        ));
    }
}
