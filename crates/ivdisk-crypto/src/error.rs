//! The one error type of the sector crypto layer.

use crate::Suite;

/// Everything that can go wrong when building a sector cipher or running it over sectors.
///
/// Variants are matchable so that the image layer can map them: [`CryptoError::Authentication`]
/// becomes EIO for exactly the listed sectors, everything else is a programming or setup error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CryptoError {
    /// A suite name that ivdisk does not know.
    #[error("unknown cipher suite '{name}': expected one of {expected}")]
    UnknownSuite {
        /// The name that was given.
        name: String,
        /// The accepted names, comma separated.
        expected: String,
    },

    /// A key whose length the suite does not accept.
    #[error("{suite} takes a key of {expected:?} bytes, got {got} bytes")]
    KeyLength {
        /// The suite the key was meant for.
        suite: Suite,
        /// The accepted key lengths in bytes.
        expected: &'static [usize],
        /// The length that was given.
        got: usize,
    },

    /// An XTS key whose two halves are equal (IEEE 1619 forbids it: the tweak would be
    /// encrypted under the data key, which breaks the mode's security proof).
    #[error("{suite} refuses a key whose two halves are equal; generate the key again")]
    XtsKeyHalvesEqual {
        /// The XTS suite.
        suite: Suite,
    },

    /// A sector size other than the supported powers of two.
    #[error("sector size {got} is not supported: expected 512, 1024, 2048 or 4096 bytes")]
    SectorSize {
        /// The size that was given.
        got: usize,
    },

    /// A data buffer that is not a whole number of sectors (or is empty).
    #[error(
        "buffer of {len} bytes is not a non-zero multiple of the {sector_size}-byte sector size"
    )]
    BufferLength {
        /// The buffer length that was given.
        len: usize,
        /// The sector size of the cipher.
        sector_size: usize,
    },

    /// An out-of-place run whose output buffer is not as long as its input.
    #[error(
        "output buffer of {output} bytes for an input of {input} bytes: expected the same length"
    )]
    OutputLength {
        /// Input bytes.
        input: usize,
        /// Output bytes.
        output: usize,
    },

    /// A slotted run (each sector followed by its metadata) whose length is not what its
    /// sectors need: not a whole number of slots, or not one slot per sector of plaintext.
    #[error(
        "slotted run of {got} bytes: expected {expected} bytes ({slot}-byte slots, each a \
         sector and its metadata)"
    )]
    SlotsLength {
        /// The slotted run's length.
        got: usize,
        /// The length it should have: a slot per sector of the plaintext, or (with no
        /// plaintext to count by) the next whole number of slots.
        expected: usize,
        /// Sector size plus metadata length.
        slot: usize,
    },

    /// A metadata buffer whose length does not match the number of sectors.
    #[error("metadata buffer of {got} bytes does not fit {sectors} sectors of {suite}: expected {expected} bytes")]
    MetadataLength {
        /// The suite, whose metadata length per sector is fixed.
        suite: Suite,
        /// Number of sectors in the data buffer.
        sectors: usize,
        /// Expected metadata length in bytes.
        expected: usize,
        /// The length that was given.
        got: usize,
    },

    /// A run of sectors reaching past the last sector number whose byte offset / 512 fits 64
    /// bits (the IV of the plain64 suites); no disk is that large.
    #[error("sector run starting at {first} with {count} sectors goes past the last addressable sector {last_allowed}")]
    SectorOverflow {
        /// First sector of the run.
        first: u64,
        /// Number of sectors.
        count: usize,
        /// The highest sector number allowed for this sector size.
        last_allowed: u64,
    },

    /// Authentication failed for these sectors: their ciphertext or metadata was changed, moved
    /// from another sector or image, or decrypted with the wrong key. Their plaintext buffers were
    /// zeroed; every other sector of the run was decrypted normally.
    #[error("authentication failed for {} sector(s), first {}: data or metadata was tampered with, moved, or the key is wrong", sectors.len(), sectors.first().copied().unwrap_or_default())]
    Authentication {
        /// Sector numbers that failed, ascending.
        sectors: Vec<u64>,
    },

    /// The random-nonce suite reached its bound of writes under one key; more writes would risk
    /// a nonce collision. The volume must be re-keyed (re-encrypted to a new volume key).
    #[error("{suite}: nonce budget exhausted ({used} of {limit} writes under this key); re-encrypt the image to a new volume key")]
    NonceBudgetExhausted {
        /// The suite.
        suite: Suite,
        /// Writes counted so far under this key.
        used: u64,
        /// The documented bound.
        limit: u64,
    },

    /// The operating system's random source failed while seeding the nonce generator.
    #[error("the OS random number source failed: {0}")]
    Rng(String),

    /// OpenSSL reported an error (should not happen with validated inputs).
    #[error("OpenSSL failed: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
}
