//! The ivdisk image header, in the LUKS2 on-disk format: two checksummed binary headers with
//! JSON metadata, keyslots (Argon2id or PBKDF2, anti-forensic splitter, digest check), and
//! ivdisk's image parameters in a token. LUKS1 and LUKS2 volumes made by cryptsetup or
//! librbd are read and unlocked too.
//!
//! An own implementation rather than libcryptsetup; why is in docs/ARCHITECTURE.md
//! ("Header"). cryptsetup itself checks our headers in `tests/cryptsetup_interop.rs`.
//!
//! ```
//! use ivdisk_crypto::{Suite, VolumeKey};
//! use ivdisk_header::{FormatSpec, Header, MemoryHeaderIo, PbkdfKind, PbkdfRequest};
//!
//! let mut device = MemoryHeaderIo::default();
//! let mut spec = FormatSpec::new(Suite::DEFAULT, 4096);
//! spec.pbkdf = PbkdfRequest::fast_for_tests(PbkdfKind::Argon2id);
//! spec.digest_iterations = Some(1000);
//! let key = VolumeKey::generate(Suite::DEFAULT.default_key_len()).unwrap();
//! Header::format(&mut device, &spec, &key, b"correct horse").unwrap();
//!
//! let header = Header::read(&device).unwrap();
//! let unlocked = header.unlock(&device, b"correct horse").unwrap();
//! assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());
//! assert!(header.unlock(&device, b"wrong").is_err());
//! ```

#![deny(unsafe_code)]

pub mod af;
pub mod binary;
mod error;
mod header;
mod io;
pub mod kdf;
mod keyslot;
pub mod luks1;
pub mod metadata;

pub use error::HeaderError;
pub use header::{
    salvage_image_ids, DataSegment, FormatSpec, Header, ImageParams, KeyslotInfo, SegmentInfo,
    Unlocked, DEFAULT_HEADER_SIZE, DEFAULT_KEYSLOTS_SIZE, FORMAT_VERSION, IVDISK_REQUIREMENT,
    IVDISK_TOKEN_TYPE,
};
pub use io::{HeaderIo, MemoryHeaderIo};
pub use kdf::{Hash, Pbkdf, PbkdfKind, PbkdfRequest, ARGON2_MIN_MEMORY_KIB};

/// Salts, anti-forensic stripes, UUIDs and wipes come straight from the OS.
pub(crate) fn random_bytes(out: &mut [u8]) -> Result<(), HeaderError> {
    getrandom::getrandom(out).map_err(|e| HeaderError::Random(e.to_string()))
}
