//! Suite names, their fixed parameters, and the one interface every suite implements.

use std::fmt;
use std::str::FromStr;

use crate::CryptoError;

/// A sector cipher suite: how a sector's ciphertext and metadata are made.
///
/// The names are cryptsetup's where one exists (`aes-xts-plain64`, `aes-hctr2-plain64`);
/// `-random` means a fresh random IV or nonce per write, stored in the sector's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Suite {
    /// AES-XTS, tweak = byte offset / 512 (cryptsetup and librbd compatible). No metadata.
    AesXtsPlain64,
    /// AES-XTS with a random 16-byte value per write, bound to the sector number. 16 bytes.
    AesXtsRandom,
    /// AEGIS-128L AEAD, random 128-bit nonce. 32 bytes (nonce + tag). The default.
    Aegis128lRandom,
    /// AEGIS-256 AEAD, random 256-bit nonce. 48 bytes (nonce + tag).
    Aegis256Random,
    /// AES-GCM AEAD, random 96-bit nonce, at most 2^32 writes per key. 32 bytes.
    AesGcmRandom,
    /// HCTR2 wide-block cipher, tweak = byte offset / 512. No metadata.
    AesHctr2Plain64,
}

impl Suite {
    /// Every suite, in the order `--help` lists them.
    pub const ALL: [Suite; 6] = [
        Suite::Aegis128lRandom,
        Suite::Aegis256Random,
        Suite::AesGcmRandom,
        Suite::AesXtsRandom,
        Suite::AesXtsPlain64,
        Suite::AesHctr2Plain64,
    ];

    /// The suite new images get when the user names none.
    pub const DEFAULT: Suite = Suite::Aegis128lRandom;

    /// The name used on the command line and in the image header.
    pub const fn name(self) -> &'static str {
        match self {
            Suite::AesXtsPlain64 => "aes-xts-plain64",
            Suite::AesXtsRandom => "aes-xts-random",
            Suite::Aegis128lRandom => "aegis128l-random",
            Suite::Aegis256Random => "aegis256-random",
            Suite::AesGcmRandom => "aes-gcm-random",
            Suite::AesHctr2Plain64 => "aes-hctr2-plain64",
        }
    }

    /// Bytes of per-sector metadata stored next to each sector's ciphertext.
    pub const fn metadata_len(self) -> usize {
        match self {
            Suite::AesXtsPlain64 | Suite::AesHctr2Plain64 => 0,
            Suite::AesXtsRandom => 16,
            Suite::Aegis128lRandom | Suite::AesGcmRandom => 32,
            Suite::Aegis256Random => 48,
        }
    }

    /// Bytes at the start of each sector's metadata that hold its nonce, where the sectors
    /// sealed in one run get consecutive nonces (the run's random value plus the sector's place
    /// in the run, [`crate::nonce_add`]); 0 for suites whose metadata is not such a nonce. A
    /// layout may store a run's nonces as its first one (`omap-packed` does).
    pub const fn counted_nonce_len(self) -> usize {
        match self {
            // aes-xts-random stores R = AES^-1(K_t, U), which does not count up.
            Suite::AesXtsPlain64 | Suite::AesHctr2Plain64 | Suite::AesXtsRandom => 0,
            Suite::Aegis128lRandom => 16,
            Suite::AesGcmRandom => 12,
            Suite::Aegis256Random => 32,
        }
    }

    /// Accepted volume key lengths in bytes; the first is the default.
    pub const fn key_lens(self) -> &'static [usize] {
        match self {
            // XTS keys are two AES keys: 64 bytes = AES-256-XTS ("512-bit"), 32 = AES-128-XTS.
            Suite::AesXtsPlain64 | Suite::AesXtsRandom => &[64, 32],
            Suite::Aegis128lRandom => &[16],
            Suite::Aegis256Random => &[32],
            Suite::AesGcmRandom | Suite::AesHctr2Plain64 => &[32, 16],
        }
    }

    /// The default volume key length in bytes.
    pub const fn default_key_len(self) -> usize {
        self.key_lens()[0]
    }

    /// Whether a changed ciphertext or metadata byte is detected (AEAD suites).
    pub const fn is_authenticated(self) -> bool {
        matches!(
            self,
            Suite::Aegis128lRandom | Suite::Aegis256Random | Suite::AesGcmRandom
        )
    }

    /// Whether each write gets a fresh random IV/nonce (so overwrites are unlinkable).
    pub const fn is_randomized(self) -> bool {
        self.metadata_len() > 0
    }

    /// The number of writes under one key the suite allows, if it enforces a bound.
    pub const fn write_limit(self) -> Option<u64> {
        match self {
            Suite::AesGcmRandom => Some(crate::aead::GCM_RANDOM_NONCE_WRITE_LIMIT),
            _ => None,
        }
    }

    /// One line for `--help` and `ivdisk info`.
    pub const fn summary(self) -> &'static str {
        match self {
            Suite::AesXtsPlain64 => "AES-XTS, tweak = offset/512; no metadata; LUKS2/librbd compatible, deterministic",
            Suite::AesXtsRandom => "AES-XTS with a random tweak per write bound to the sector; 16 B metadata; no integrity",
            Suite::Aegis128lRandom => "AEGIS-128L AEAD, random 128-bit nonce; 32 B metadata; integrity (default)",
            Suite::Aegis256Random => "AEGIS-256 AEAD, random 256-bit nonce; 48 B metadata; integrity",
            Suite::AesGcmRandom => "AES-GCM AEAD, random 96-bit nonce; 32 B metadata; integrity; refuses writes past 2^32 per key",
            Suite::AesHctr2Plain64 => "HCTR2 wide-block, tweak = offset/512; no metadata; one flipped bit garbles the sector",
        }
    }
}

impl fmt::Display for Suite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Suite {
    type Err = CryptoError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Suite::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| CryptoError::UnknownSuite {
                name: name.to_owned(),
                expected: Suite::ALL.map(Suite::name).join(", "),
            })
    }
}

/// A 16-byte image identity bound into the AAD of the AEAD suites, so that a sector copied
/// into another image does not authenticate. The image layer stores it in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImageId(pub [u8; 16]);

/// Parameters a suite is built with, besides its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CipherParams {
    /// Bytes per sector: 512, 1024, 2048 or 4096.
    pub sector_size: usize,
    /// Identity of the image the sectors belong to.
    pub image_id: ImageId,
    /// Writes already made under this key (from the header), for suites with a write limit.
    pub writes_used: u64,
}

impl CipherParams {
    /// Parameters for an image with the given sector size and identity, no writes yet.
    pub fn new(sector_size: usize, image_id: ImageId) -> Self {
        CipherParams {
            sector_size,
            image_id,
            writes_used: 0,
        }
    }
}

/// One interface for all suites: a run of consecutive sectors in, ciphertext and packed
/// per-sector metadata out, and back.
///
/// Sector numbers count `sector_size` units from the start of the disk. `data` holds a whole
/// number of sectors (sector `first_sector + i` at `data[i * sector_size..]`) and is transformed
/// in place; `metadata` holds `metadata_len()` bytes per sector, packed in the same order.
/// Runs are the unit of work: the hot path hands a whole IO's sectors over at once.
pub trait SectorCipher: Send + Sync + fmt::Debug {
    /// The suite this cipher implements.
    fn suite(&self) -> Suite;

    /// Bytes per sector.
    fn sector_size(&self) -> usize;

    /// Encrypt `data` in place and write each sector's metadata.
    fn encrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError>;

    /// Decrypt `data` in place using each sector's metadata.
    ///
    /// On [`CryptoError::Authentication`] the listed sectors are zeroed and every other sector
    /// of the run holds its plaintext, so a caller can fail exactly those sectors.
    fn decrypt_sectors(
        &self,
        first_sector: u64,
        data: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError>;

    /// Encrypt `plaintext` into `ciphertext` (same length) and write each sector's metadata:
    /// [`SectorCipher::encrypt_sectors`] without a copy first. Suites whose kernels read one
    /// buffer and write another do it in one pass; the others copy, then work in place.
    fn encrypt_sectors_to(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut [u8],
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(plaintext, ciphertext)?;
        ciphertext.copy_from_slice(plaintext);
        self.encrypt_sectors(first_sector, ciphertext, metadata)
    }

    /// Decrypt `ciphertext` into `plaintext` (same length): [`SectorCipher::decrypt_sectors`]
    /// without a copy first, with the same promise on [`CryptoError::Authentication`] (the
    /// failed sectors' plaintext is zeros, every other sector's is correct).
    fn decrypt_sectors_to(
        &self,
        first_sector: u64,
        ciphertext: &[u8],
        plaintext: &mut [u8],
        metadata: &[u8],
    ) -> Result<(), CryptoError> {
        check_out_of_place(ciphertext, plaintext)?;
        plaintext.copy_from_slice(ciphertext);
        self.decrypt_sectors(first_sector, plaintext, metadata)
    }

    /// Encrypt `plaintext` onto the end of `ciphertext` and write each sector's metadata:
    /// [`SectorCipher::encrypt_sectors_to`] into a buffer that grows by `plaintext.len()`. On
    /// an error `ciphertext` keeps its length.
    ///
    /// Why: the image layer builds a fresh buffer per write for the store. Out of place into
    /// `&mut [u8]` means zeroing that buffer first, a pass of its own; suites whose kernels
    /// store through pointers (AES-XTS, AEGIS-128L, AEGIS-256 through libaegis and AES-GCM
    /// through OpenSSL) write the spare capacity directly. The default
    /// zeroes and encrypts 64 KiB at a time, so what was zeroed is still in the cache when the
    /// cipher overwrites it.
    fn encrypt_sectors_append(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        ciphertext: &mut Vec<u8>,
        metadata: &mut [u8],
    ) -> Result<(), CryptoError> {
        append_by_zeroing(self, first_sector, plaintext, ciphertext, metadata)
    }

    /// Encrypt `plaintext` onto the end of `slots` as one slot per sector: its ciphertext,
    /// then its `metadata_len()` bytes of metadata (the `unaligned` layout's stored form). On
    /// an error `slots` keeps its length.
    ///
    /// Why: interleaving after encrypting is a copy of the whole run; AEGIS-128L's four-lane
    /// kernel takes a separate output per sector, and AEGIS-256, AES-GCM and
    /// `aes-xts-random` encrypt one sector at a time, so they write each slot directly. The default encrypts 32 KiB at a time and copies each
    /// piece into its slots while it is in the cache.
    fn encrypt_sectors_append_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut Vec<u8>,
    ) -> Result<(), CryptoError> {
        append_slots_piecewise(self, first_sector, plaintext, slots)
    }

    /// Encrypt `plaintext` into `slots`, a buffer of exactly the run's slots (as
    /// [`SectorCipher::encrypt_sectors_append_slots`] lays them out), wherever the caller has
    /// it.
    ///
    /// Why: the `unaligned` layout spreads a large run into slots in the run's own buffer.
    /// Where a group of sectors' slots lie wholly past that group's plaintext it encrypts
    /// them there directly; moving each sector after encrypting it in place cost AEGIS-128L a
    /// quarter to a third of a 4 MiB write through the server. The suites that write slots
    /// directly do so here too; the default encrypts one sector at a time into its slot.
    fn encrypt_sectors_to_slots(
        &self,
        first_sector: u64,
        plaintext: &[u8],
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        slots_one_by_one(self, first_sector, plaintext, slots)
    }

    /// Encrypt slots in place: `slots` holds each sector's plaintext at the start of its slot
    /// (as [`SectorCipher::encrypt_sectors_append_slots`] lays slots out); each becomes its
    /// ciphertext where it lies and its metadata is written after it, over whatever the
    /// slot's tail held. A run of another length is refused and left as it was.
    ///
    /// Why: the NBD server receives an `unaligned` write's payload straight into its slots
    /// (`ivdisk_image::WritePayload`), so no sector has to move up over the metadata of the
    /// sectors below it after it is encrypted; that move cost AEGIS-128L a quarter to a third
    /// of its cipher's time per 1 MiB write. AEGIS-128L's four-lane kernel takes each lane in
    /// place at its slot; the default encrypts one sector at a time.
    fn encrypt_sectors_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        encrypt_slots_one_by_one(self, first_sector, slots)
    }

    /// Decrypt slots (what [`SectorCipher::encrypt_sectors_append_slots`] writes: each
    /// sector's ciphertext, then its metadata) into `plaintext`, `slots.len()` being
    /// `plaintext.len()` plus the sectors' metadata; on [`CryptoError::Authentication`] the
    /// failed sectors' plaintext is zeros, every other sector's is correct. The default copies
    /// sectors and metadata apart first; the AEAD suites and `aes-xts-random` decrypt from
    /// each slot directly.
    fn decrypt_sectors_from_slots(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut [u8],
    ) -> Result<(), CryptoError> {
        check_slots(self, first_sector, slots, plaintext)?;
        decrypt_slots_apart(self, first_sector, slots, plaintext)
    }

    /// Decrypt slots onto the end of `plaintext`: [`SectorCipher::decrypt_sectors_from_slots`]
    /// into a buffer that grows by the run's sectors. On [`CryptoError::Authentication`] the
    /// run is appended all the same, the failed sectors as zeros; on any other error
    /// `plaintext` keeps its length.
    ///
    /// Why: a read that returns a buffer of its own (`Image::read_owned`, how the NBD server
    /// reads an `unaligned` image) zeroed a fresh buffer before the cipher overwrote it, a
    /// pass of its own (`memset`, 12% of the samples of 1 MiB AEGIS-128L reads in the image
    /// bench). AEGIS-128L's four-lane kernel writes the spare capacity directly; the default
    /// zeroes and decrypts 64 KiB at a time, so what was zeroed is still in the cache when the
    /// cipher overwrites it.
    fn decrypt_sectors_from_slots_append(
        &self,
        first_sector: u64,
        slots: &[u8],
        plaintext: &mut Vec<u8>,
    ) -> Result<(), CryptoError> {
        append_from_slots_by_zeroing(self, first_sector, slots, plaintext)
    }

    /// Decrypt slots (what [`SectorCipher::encrypt_sectors_append_slots`] writes) in place:
    /// each sector's ciphertext becomes its plaintext where it lies, its metadata stays after
    /// it. On [`CryptoError::Authentication`] the failed sectors' plaintext is zeros, every
    /// other sector's is correct.
    ///
    /// Why: the NBD server sends an `unaligned` read's reply from the store's buffer, each
    /// sector's plaintext in its slot (`Image::read_reply`), with no second buffer and no move
    /// of every sector down over the metadata below it. AEGIS-128L's four-lane kernel takes
    /// each lane in place at its slot; the default decrypts one sector at a time.
    fn decrypt_sectors_in_slots(
        &self,
        first_sector: u64,
        slots: &mut [u8],
    ) -> Result<(), CryptoError> {
        decrypt_slots_one_by_one(self, first_sector, slots)
    }

    /// Bytes of metadata per sector.
    fn metadata_len(&self) -> usize {
        self.suite().metadata_len()
    }

    /// Writes counted under this key so far, for suites that enforce a write limit.
    fn writes_used(&self) -> Option<u64> {
        None
    }
}

/// [`SectorCipher::encrypt_sectors_append`] for suites that write only initialised output.
pub(crate) fn append_by_zeroing<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    plaintext: &[u8],
    ciphertext: &mut Vec<u8>,
    metadata: &mut [u8],
) -> Result<(), CryptoError> {
    /// Bytes zeroed and encrypted per step: well inside the L2 cache.
    const STEP: usize = 64 << 10;
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    check_run(
        cipher.suite(),
        ss,
        first_sector,
        plaintext.len(),
        metadata.len(),
    )?;
    let at = ciphertext.len();
    ciphertext.reserve(plaintext.len());
    let step = (STEP / ss).max(1) * ss;
    for (i, plain) in plaintext.chunks(step).enumerate() {
        let start = ciphertext.len();
        ciphertext.resize(start + plain.len(), 0);
        let sectors = i * step / ss;
        let metas = &mut metadata[sectors * ml..(sectors + plain.len() / ss) * ml];
        let done = cipher.encrypt_sectors_to(
            first_sector + sectors as u64,
            plain,
            &mut ciphertext[start..],
            metas,
        );
        if let Err(e) = done {
            ciphertext.truncate(at);
            return Err(e);
        }
    }
    Ok(())
}

/// [`SectorCipher::encrypt_sectors_append_slots`] through `encrypt_sectors_append`, 32 KiB
/// at a time (the L1 data cache of current x86 cores; eight 4 KiB sectors, two groups of the
/// four-lane AEGIS-128L, a batch of XTS tweaks) into a reused buffer, each piece copied into
/// its slots.
pub(crate) fn append_slots_piecewise<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    plaintext: &[u8],
    slots: &mut Vec<u8>,
) -> Result<(), CryptoError> {
    const PIECE: usize = 32 << 10;
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let sectors = check_whole_sectors(cipher, first_sector, plaintext)?;
    if ml == 0 {
        // No metadata: a slot is the sector.
        return cipher.encrypt_sectors_append(first_sector, plaintext, slots, &mut []);
    }
    let per_piece = (PIECE / ss).clamp(1, sectors.max(1));
    let at = slots.len();
    slots.reserve(sectors * (ss + ml));
    // Reused for every piece; appended into, so never zeroed where the suite writes fresh
    // memory directly.
    let mut ciphertext = Vec::with_capacity(per_piece * ss);
    let mut metadata = vec![0u8; per_piece * ml];
    for (k, piece) in plaintext.chunks(per_piece * ss).enumerate() {
        let metadata = &mut metadata[..piece.len() / ss * ml];
        ciphertext.clear();
        let number = first_sector + (k * per_piece) as u64;
        if let Err(e) = cipher.encrypt_sectors_append(number, piece, &mut ciphertext, metadata) {
            slots.truncate(at);
            return Err(e);
        }
        for (sector, meta) in ciphertext.chunks_exact(ss).zip(metadata.chunks_exact(ml)) {
            slots.extend_from_slice(sector);
            slots.extend_from_slice(meta);
        }
    }
    Ok(())
}

/// [`SectorCipher::encrypt_sectors_to_slots`] a sector at a time, each out of place into its
/// slot; the run was checked ([`check_slots`]).
pub(crate) fn slots_one_by_one<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    plaintext: &[u8],
    slots: &mut [u8],
) -> Result<(), CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let sectors = plaintext
        .chunks_exact(ss)
        .zip(slots.chunks_exact_mut(ss + ml));
    // Numbered by index, not by zipping `first_sector..`: that range steps once past the last
    // sector, which overflowed (a panic with overflow checks) for a run ending at u64::MAX.
    for (i, (sector, slot)) in sectors.enumerate() {
        let number = first_sector + i as u64;
        let (ciphertext, metadata) = slot.split_at_mut(ss);
        cipher.encrypt_sectors_to(number, sector, ciphertext, metadata)?;
    }
    Ok(())
}

/// The sectors of a slotted run onto which plaintext of their length is appended (the run
/// checked as [`check_slots`] checks it).
pub(crate) fn check_slots_append<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &[u8],
) -> Result<usize, CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let sectors = slots.len() / (ss + ml);
    if slots.len() != sectors * (ss + ml) {
        return Err(CryptoError::SlotsLength {
            got: slots.len(),
            expected: slots.len().next_multiple_of(ss + ml),
            slot: ss + ml,
        });
    }
    check_run(cipher.suite(), ss, first_sector, sectors * ss, sectors * ml)
}

/// [`SectorCipher::encrypt_sectors_in_slots`] one sector at a time, each in place with its
/// metadata written into its slot.
pub(crate) fn encrypt_slots_one_by_one<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &mut [u8],
) -> Result<(), CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    check_slots_append(cipher, first_sector, slots)?;
    for (i, slot) in slots.chunks_exact_mut(ss + ml).enumerate() {
        let number = first_sector + i as u64;
        let (data, metadata) = slot.split_at_mut(ss);
        cipher.encrypt_sectors(number, data, metadata)?;
    }
    Ok(())
}

/// [`SectorCipher::decrypt_sectors_in_slots`] one sector at a time, each with the metadata in
/// its slot; the sectors that fail authentication are collected and named together.
pub(crate) fn decrypt_slots_one_by_one<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &mut [u8],
) -> Result<(), CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    check_slots_append(cipher, first_sector, slots)?;
    let mut failed = Vec::new();
    for (i, slot) in slots.chunks_exact_mut(ss + ml).enumerate() {
        let number = first_sector + i as u64;
        let (data, metadata) = slot.split_at_mut(ss);
        match cipher.decrypt_sectors(number, data, metadata) {
            Ok(()) => {}
            Err(CryptoError::Authentication { sectors }) => failed.extend(sectors),
            Err(e) => return Err(e),
        }
    }
    match failed.is_empty() {
        true => Ok(()),
        false => Err(CryptoError::Authentication { sectors: failed }),
    }
}

/// [`SectorCipher::decrypt_sectors_from_slots_append`] for suites that write only initialised
/// output: 64 KiB of plaintext at a time, zeroed, then decrypted into.
pub(crate) fn append_from_slots_by_zeroing<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &[u8],
    plaintext: &mut Vec<u8>,
) -> Result<(), CryptoError> {
    /// Plaintext bytes zeroed and decrypted per step: well inside the L2 cache.
    const STEP: usize = 64 << 10;
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let sectors = check_slots_append(cipher, first_sector, slots)?;
    let at = plaintext.len();
    plaintext.reserve(sectors * ss);
    let per_step = (STEP / ss).max(1);
    let mut failed = Vec::new();
    for (k, piece) in slots.chunks(per_step * (ss + ml)).enumerate() {
        let start = plaintext.len();
        plaintext.resize(start + piece.len() / (ss + ml) * ss, 0);
        let number = first_sector + (k * per_step) as u64;
        match cipher.decrypt_sectors_from_slots(number, piece, &mut plaintext[start..]) {
            Ok(()) => {}
            Err(CryptoError::Authentication { sectors }) => failed.extend(sectors),
            Err(e) => {
                plaintext.truncate(at);
                return Err(e);
            }
        }
    }
    match failed.is_empty() {
        true => Ok(()),
        false => Err(CryptoError::Authentication { sectors: failed }),
    }
}

/// [`SectorCipher::decrypt_sectors_from_slots`] by copying sectors and metadata apart, then
/// decrypting in place; the run was checked ([`check_slots`]).
pub(crate) fn decrypt_slots_apart<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &[u8],
    plaintext: &mut [u8],
) -> Result<(), CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let mut metadata = Vec::with_capacity(plaintext.len() / ss * ml);
    for (slot, sector) in slots
        .chunks_exact(ss + ml)
        .zip(plaintext.chunks_exact_mut(ss))
    {
        sector.copy_from_slice(&slot[..ss]);
        metadata.extend_from_slice(&slot[ss..]);
    }
    cipher.decrypt_sectors(first_sector, plaintext, &metadata)
}

/// [`check_run`] for a run whose metadata the caller places itself (slots); returns the
/// number of sectors.
pub(crate) fn check_whole_sectors<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    plaintext: &[u8],
) -> Result<usize, CryptoError> {
    let ss = cipher.sector_size();
    let sectors = plaintext.len() / ss;
    let metadata_len = sectors * cipher.metadata_len();
    check_run(
        cipher.suite(),
        ss,
        first_sector,
        plaintext.len(),
        metadata_len,
    )
}

/// A slotted run: whole sectors of plaintext, and a slot (sector and metadata) for each.
pub(crate) fn check_slots<C: SectorCipher + ?Sized>(
    cipher: &C,
    first_sector: u64,
    slots: &[u8],
    plaintext: &[u8],
) -> Result<usize, CryptoError> {
    let (ss, ml) = (cipher.sector_size(), cipher.metadata_len());
    let sectors = check_whole_sectors(cipher, first_sector, plaintext)?;
    if slots.len() != sectors * (ss + ml) {
        return Err(CryptoError::SlotsLength {
            got: slots.len(),
            expected: sectors * (ss + ml),
            slot: ss + ml,
        });
    }
    Ok(sectors)
}

/// An out-of-place run's output must be exactly as long as its input.
pub(crate) fn check_out_of_place(input: &[u8], output: &[u8]) -> Result<(), CryptoError> {
    if input.len() != output.len() {
        return Err(CryptoError::OutputLength {
            input: input.len(),
            output: output.len(),
        });
    }
    Ok(())
}

/// Check a run's buffers against the cipher's geometry; returns the number of sectors.
pub(crate) fn check_run(
    suite: Suite,
    sector_size: usize,
    first_sector: u64,
    data_len: usize,
    metadata_len: usize,
) -> Result<usize, CryptoError> {
    // Sector sizes are powers of two from 512 (`check_sector_size`): shifts, not divisions,
    // which showed in single-sector runs (a 64-bit division takes up to ~20 cycles).
    debug_assert!(sector_size.is_power_of_two() && sector_size >= 512);
    let shift = sector_size.trailing_zeros();
    let sectors = data_len >> shift;
    if data_len == 0 || sectors << shift != data_len {
        return Err(CryptoError::BufferLength {
            len: data_len,
            sector_size,
        });
    }
    let expected = sectors * suite.metadata_len();
    if metadata_len != expected {
        return Err(CryptoError::MetadataLength {
            suite,
            sectors,
            expected,
            got: metadata_len,
        });
    }
    // The last sector's byte offset / 512 must fit 64 bits: that is the plain64 tweak, and past
    // it two sector numbers would share one (no disk is that large: 2^73 bytes).
    let last_allowed = u64::MAX >> (shift - 9);
    match first_sector.checked_add(sectors as u64 - 1) {
        Some(last) if last <= last_allowed => {}
        _ => {
            return Err(CryptoError::SectorOverflow {
                first: first_sector,
                count: sectors,
                last_allowed,
            })
        }
    }
    Ok(sectors)
}

pub(crate) fn check_sector_size(sector_size: usize) -> Result<(), CryptoError> {
    match sector_size {
        512 | 1024 | 2048 | 4096 => Ok(()),
        got => Err(CryptoError::SectorSize { got }),
    }
}

pub(crate) fn check_key_len(suite: Suite, key: &[u8]) -> Result<(), CryptoError> {
    if suite.key_lens().contains(&key.len()) {
        Ok(())
    } else {
        Err(CryptoError::KeyLength {
            suite,
            expected: suite.key_lens(),
            got: key.len(),
        })
    }
}

/// The tweak/IV of the `plain64` suites: the sector's byte offset / 512, little endian, in
/// `len` bytes (16 for XTS, 32 for HCTR2), exactly as dm-crypt, cryptsetup and librbd compute
/// it for LUKS2 (4096-byte sectors step it by 8).
pub(crate) fn plain64_iv<const N: usize>(sector: u64, sector_size: usize) -> [u8; N] {
    let mut iv = [0u8; N];
    // check_run has refused sectors whose offset / 512 does not fit 64 bits.
    let units = sector * (sector_size / 512) as u64;
    iv[..8].copy_from_slice(&units.to_le_bytes());
    iv
}
