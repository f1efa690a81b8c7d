//! Damaged, truncated, foreign and out-of-spec headers: each must give a precise error (or a
//! warning and a usable copy), never a panic, and never an unbounded allocation.
//!
//! Inputs are made by formatting a valid header in memory and damaging it. Syntactically valid
//! but out-of-spec JSON is written with `binary::encode_copy` (which does not validate) into
//! both copies; byte-level damage to the JSON text comes with a recomputed checksum where the
//! test needs the checksum to pass.

use std::io::Write as _;

use ivdisk_crypto::{Suite, VolumeKey};
use ivdisk_header::binary::{self, BinaryHeader};
use ivdisk_header::metadata::{Kdf, Metadata};
use ivdisk_header::{
    FormatSpec, Header, HeaderError, HeaderIo, MemoryHeaderIo, PbkdfKind, PbkdfRequest,
};

const PASSPHRASE: &[u8] = b"correct horse";
/// The default LUKS2 header size (binary header + JSON area) the tests format with.
const HDR: usize = 16 << 10;
const CSUM_OFFSET: usize = 448;
const CSUM_FIELD_LEN: usize = 64;

fn fast() -> PbkdfRequest {
    PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2)
}

fn spec() -> FormatSpec {
    let mut spec = FormatSpec::new(Suite::AesXtsPlain64, 4096);
    spec.pbkdf = fast();
    spec.digest_iterations = Some(1000);
    spec
}

/// A freshly formatted header with one keyslot (slot 0) for `PASSPHRASE`.
fn formatted() -> (MemoryHeaderIo, Header, VolumeKey) {
    let mut io = MemoryHeaderIo::default();
    let key = VolumeKey::generate(64).unwrap();
    let header = Header::format(&mut io, &spec(), &key, PASSPHRASE).unwrap();
    (io, header, key)
}

/// A formatted header with keyslots 0, 1 and 2 (passphrases `PASSPHRASE`, "second", "third").
fn formatted_with_three_keyslots() -> MemoryHeaderIo {
    let (mut io, mut header, key) = formatted();
    assert_eq!(
        header
            .add_keyslot(&mut io, &key, b"second", None, &fast())
            .unwrap(),
        1
    );
    assert_eq!(
        header
            .add_keyslot(&mut io, &key, b"third", None, &fast())
            .unwrap(),
        2
    );
    io
}

/// The primary copy as read from `io` (binary fields and metadata).
fn primary_copy(io: &MemoryHeaderIo) -> (BinaryHeader, Metadata) {
    let copy = binary::read_copy(io, 0, "primary").unwrap();
    (copy.binary, copy.metadata)
}

/// Rewrite both copies with `edit` applied to the metadata, unvalidated but checksummed.
fn rewrite_metadata(io: &mut MemoryHeaderIo, edit: impl FnOnce(&mut Metadata)) {
    let (binary_header, mut metadata) = primary_copy(io);
    edit(&mut metadata);
    for offset in [0, binary_header.hdr_size] {
        let bytes = binary::encode_copy(&binary_header, &metadata, offset).unwrap();
        io.write_at(offset, &bytes).unwrap();
    }
}

/// Recompute the SHA-256 checksum of the copy at `offset` (hdr_size bytes, the 64-byte
/// checksum field zeroed while hashing).
fn fix_checksum(bytes: &mut [u8], offset: usize) {
    let copy = &mut bytes[offset..offset + HDR];
    copy[CSUM_OFFSET..CSUM_OFFSET + CSUM_FIELD_LEN].fill(0);
    let sum = openssl::sha::sha256(copy);
    copy[CSUM_OFFSET..CSUM_OFFSET + sum.len()].copy_from_slice(&sum);
}

/// A header whose seqid is at its maximum cannot be changed: the change is refused, where
/// the next seqid overflowed (a panic with overflow checks; wrapped to 0 otherwise, so a torn
/// write's stale copy won the next read and undid the change).
#[test]
fn a_header_at_the_last_seqid_is_refused_changes() {
    let (mut io, _, key) = formatted();
    let (mut binary_header, metadata) = primary_copy(&io);
    binary_header.seqid = u64::MAX;
    for offset in [0, binary_header.hdr_size] {
        let bytes = binary::encode_copy(&binary_header, &metadata, offset).unwrap();
        io.write_at(offset, &bytes).unwrap();
    }
    let mut header = Header::read(&io).unwrap();
    let err = header
        .add_keyslot(&mut io, &key, b"second", None, &fast())
        .unwrap_err();
    assert!(err.to_string().contains("seqid"), "{err}");
    // Both copies as they were (only the unused keyslot area may hold the new material).
    for offset in [0, binary_header.hdr_size] {
        let copy = binary::read_copy(&io, offset, "copy").unwrap();
        assert_eq!(copy.binary.seqid, u64::MAX);
        assert_eq!(copy.metadata, metadata);
    }
}

/// `Header::read` must fail with `BothHeadersDamaged`; returns (primary, secondary, Display).
fn expect_both_damaged(io: &dyn HeaderIo) -> (String, String, String) {
    match Header::read(io) {
        Err(e @ HeaderError::BothHeadersDamaged { .. }) => {
            let text = e.to_string();
            assert!(
                text.contains("ivdisk header restore"),
                "no restore hint in: {text}"
            );
            for which in ["primary", "secondary"] {
                let twice = format!("{which}: {which}");
                assert!(!text.contains(&twice), "`{twice}` in: {text}");
            }
            // Without the advice, for a restore that just followed it.
            let damage = e.damage();
            assert!(text.starts_with(&damage), "{damage} / {text}");
            assert!(!damage.contains("header restore"), "{damage}");
            let HeaderError::BothHeadersDamaged { primary, secondary } = e else {
                unreachable!()
            };
            (primary, secondary, text)
        }
        other => panic!("expected BothHeadersDamaged, got {other:?}"),
    }
}

/// Both copies are checksum-valid but unusable (out of spec, unsupported): `Header::read` says
/// what is wrong, exactly as the primary copy alone does, and does not call it damaged.
fn expect_intact_but_unusable(io: &dyn HeaderIo) -> HeaderError {
    let err = Header::read(io).expect_err("the header must be refused");
    assert!(
        !matches!(err, HeaderError::BothHeadersDamaged { .. }),
        "an intact header was called damaged: {err}"
    );
    assert_eq!(err.to_string(), primary_error(io).to_string());
    err
}

/// The error of the primary copy on its own (the variant `BothHeadersDamaged` flattens to text).
fn primary_error(io: &dyn HeaderIo) -> HeaderError {
    binary::read_copy(io, 0, "primary").expect_err("the primary copy must be rejected")
}

fn assert_contains(text: &str, needle: &str) {
    assert!(text.contains(needle), "`{needle}` not in: {text}");
}

/// Deterministic noise (xorshift64*), so a failure reproduces.
fn noise(len: usize, mut state: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// One damaged copy: the other one is used, with a warning.

/// A header region that records its writes and syncs.
struct Recording {
    io: MemoryHeaderIo,
    log: Vec<String>,
}

impl HeaderIo for Recording {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.io.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        self.log.push(format!("write {offset}"));
        self.io.write_at(offset, buf)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.log.push("sync".into());
        self.io.sync()
    }
    fn size(&self) -> std::io::Result<u64> {
        self.io.size()
    }
    fn ensure_len(&mut self, len: u64) -> std::io::Result<()> {
        self.io.ensure_len(len)
    }
}

/// A device whose first write at byte 0 is torn: the binary header and the start of the JSON
/// text land, then the power goes.
struct TornAtZero {
    io: MemoryHeaderIo,
    torn: bool,
}

impl HeaderIo for TornAtZero {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.io.read_at(offset, buf)
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        if offset == 0 && !self.torn {
            self.torn = true;
            self.io.write_at(0, &buf[..4096 + 64])?;
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        self.io.write_at(offset, buf)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.io.sync()
    }
    fn size(&self) -> std::io::Result<u64> {
        self.io.size()
    }
    fn ensure_len(&mut self, len: u64) -> std::io::Result<()> {
        self.io.ensure_len(len)
    }
}

/// A header change while the secondary copy is damaged (or out of date) writes it first: the
/// primary, the only current copy, is rewritten only once a current secondary is on disk. It
/// was rewritten first, and a write torn there left no valid copy (or only the stale one, whose
/// older keyslots came back).
#[test]
fn a_change_beside_a_bad_secondary_writes_the_secondary_first() {
    for stale in [false, true] {
        let (mut io, _, key) = formatted();
        if stale {
            // A change that reached only the primary: the secondary is one seqid behind.
            let before = io.0[HDR..2 * HDR].to_vec();
            let mut header = Header::read(&io).unwrap();
            header
                .add_keyslot(&mut io, &key, b"second", None, &fast())
                .unwrap();
            io.0[HDR..2 * HDR].copy_from_slice(&before);
        } else {
            io.0[HDR + 4096 + 20] ^= 0x01; // inside the secondary's JSON text
        }
        let mut header = Header::read(&io).unwrap();
        assert!(header.warning().is_some_and(|w| w.contains("secondary")));
        let mut torn = TornAtZero { io, torn: false };
        assert!(header
            .add_keyslot(&mut torn, &key, b"third", None, &fast())
            .is_err());
        let header = Header::read(&torn.io)
            .unwrap_or_else(|e| panic!("stale {stale}: the header after the torn write: {e}"));
        assert!(header.unlock(&torn.io, PASSPHRASE).is_ok());
        assert!(header.unlock(&torn.io, b"third").is_ok(), "stale {stale}");
        if stale {
            assert!(header.unlock(&torn.io, b"second").is_ok());
        }
    }
}

/// A device that refuses every write (a full file system).
struct Full(MemoryHeaderIo);

impl HeaderIo for Full {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&mut self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::ErrorKind::StorageFull.into())
    }
    fn sync(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn size(&self) -> std::io::Result<u64> {
        self.0.size()
    }
    fn ensure_len(&mut self, len: u64) -> std::io::Result<()> {
        self.0.ensure_len(len)
    }
}

/// A header change on a device that refuses writes says writing failed, not reading: it said
/// "reading the header failed at byte ...: No space left on device", pointing at damage.
#[test]
fn a_write_that_fails_is_reported_as_a_write() {
    let (io, mut header, key) = formatted();
    let mut io = Full(io);
    let err = header
        .add_keyslot(&mut io, &key, b"second", None, &fast())
        .unwrap_err();
    assert!(matches!(err, HeaderError::Write { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("writing the header failed") && !text.contains("reading"),
        "{text}"
    );
}

/// Each header copy is synced before the other is written, so a power cut can tear only the
/// one being written (with one sync after both, the medium could keep part of each).
#[test]
fn each_header_copy_is_synced_before_the_other_is_written() {
    let (io, mut header, key) = formatted();
    let mut io = Recording {
        io,
        log: Vec::new(),
    };
    header
        .add_keyslot(&mut io, &key, b"second", None, &fast())
        .unwrap();
    let copies: Vec<&str> = io
        .log
        .iter()
        .map(String::as_str)
        .skip_while(|entry| *entry != "write 0")
        .collect();
    assert_eq!(
        copies,
        ["write 0", "sync", &format!("write {HDR}"), "sync"],
        "{:?}",
        io.log
    );
}

#[test]
fn damaged_primary_json_falls_back_to_secondary() {
    let (mut io, _, key) = formatted();
    io.0[4096 + 20] ^= 0x01; // inside the primary JSON text; the checksum no longer matches
    let header = Header::read(&io).unwrap();
    let warning = header.warning().expect("a warning about the primary");
    assert_contains(warning, "primary LUKS2 header is damaged");
    assert_contains(warning, "checksum does not match");
    assert_contains(warning, "using the secondary");
    let unlocked = header.unlock(&io, PASSPHRASE).unwrap();
    assert_eq!(unlocked.keyslot, 0);
    assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());
}

/// A primary whose version field is damaged (into an unknown version, or into LUKS1's) is a
/// damaged primary like any other: the secondary is read, with a warning. It was refused as
/// an unsupported version, or read as LUKS1 and refused, though the secondary was intact.
#[test]
fn damaged_primary_version_falls_back_to_secondary() {
    for version in [3u8, 1] {
        let (mut io, _, key) = formatted();
        io.0[7] = version;
        let header = Header::read(&io).unwrap_or_else(|e| panic!("version {version}: {e}"));
        assert!(
            header.warning().is_some_and(|w| w.contains("primary")),
            "version {version}: {:?}",
            header.warning()
        );
        let unlocked = header.unlock(&io, PASSPHRASE).unwrap();
        assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());
    }
}

#[test]
fn zeroed_primary_binary_header_falls_back_to_secondary() {
    let (mut io, _, key) = formatted();
    io.0[..4096].fill(0); // magic, sizes, checksum: all gone
    let header = Header::read(&io).unwrap();
    assert_eq!(header.version(), 2);
    let warning = header.warning().expect("a warning about the primary");
    assert_contains(warning, "primary LUKS2 header is damaged");
    assert_contains(warning, "no LUKS2 magic");
    let unlocked = header.unlock(&io, PASSPHRASE).unwrap();
    assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());
}

#[test]
fn invalid_json_in_primary_only_falls_back_to_secondary() {
    let (mut io, _, _) = formatted();
    io.0[4096] = b'x'; // "x"keyslots"..." instead of {"keyslots"...
    fix_checksum(&mut io.0, 0);
    let header = Header::read(&io).unwrap();
    let warning = header.warning().unwrap();
    assert_contains(warning, "primary LUKS2 header is damaged");
    assert_contains(warning, "JSON metadata is invalid");
    assert!(header.unlock(&io, PASSPHRASE).is_ok());
}

// ---------------------------------------------------------------------------------------------
// Both copies damaged.

#[test]
fn both_copies_damaged() {
    let (mut io, _, _) = formatted();
    io.0[4096 + 20] ^= 0x01; // primary JSON: checksum mismatch
    io.0[HDR..HDR + 4096].fill(0); // secondary binary header: magic gone
    let (primary, secondary, text) = expect_both_damaged(&io);
    assert_contains(&primary, "checksum does not match");
    assert_contains(&secondary, "no secondary LUKS2 header found");
    assert_contains(&text, "both LUKS2 headers are damaged");
}

/// A restore onto a header whose two copies are damaged but whose UUID fields still name the
/// volume: a backup of another volume is refused without `force` and nothing is written (it
/// went through, and its keyslots buried this volume's key); this volume's own backup, or
/// another one with `force`, is restored.
#[test]
fn a_restore_over_both_damaged_copies_checks_the_uuid_they_still_name() {
    let (mut io, here, _) = formatted();
    let (other, there, _) = formatted();
    assert_ne!(here.uuid(), there.uuid());
    let mut own_backup = MemoryHeaderIo::default();
    here.backup(&io, &mut own_backup).unwrap();
    for offset in [0, HDR] {
        io.0[offset + 4096] = b'}'; // each copy's JSON: checksum mismatch
    }
    expect_both_damaged(&io);
    let damaged = io.0.clone();
    let err = Header::restore(&mut io, &other, false).unwrap_err();
    assert_contains(&err.to_string(), "not of this volume");
    assert_contains(&err.to_string(), here.uuid());
    assert_eq!(io.0, damaged, "a refused restore wrote");
    assert_eq!(
        Header::restore(&mut io.clone(), &other, true)
            .unwrap()
            .uuid(),
        there.uuid()
    );
    let restored = Header::restore(&mut io, &own_backup, false).unwrap();
    assert_eq!(restored.uuid(), here.uuid());
    assert!(restored.warning().is_none());
}

/// A backup whose data starts elsewhere than this volume's is refused, forced or not, and the
/// refusal says why without suggesting a --force that could not help (it did when the
/// volumes' UUIDs differed too).
#[test]
fn a_backup_whose_data_starts_elsewhere_is_refused_without_suggesting_force() {
    let formatted_at = |data_offset: u64| {
        let mut spec = spec();
        spec.data_offset = data_offset;
        let mut io = MemoryHeaderIo::default();
        let key = VolumeKey::generate(64).unwrap();
        Header::format(&mut io, &spec, &key, PASSPHRASE).unwrap();
        io
    };
    let mut volume = formatted_at(16 << 20);
    let detached = formatted_at(0);
    let before = volume.0.clone();
    for force in [false, true] {
        let err = Header::restore(&mut volume, &detached, force).unwrap_err();
        assert_contains(&err.to_string(), "data starts at byte 0");
        assert!(!err.to_string().contains("--force"), "{err}");
        assert_eq!(volume.0, before, "a refused restore wrote");
    }
}

/// Adding a keyslot when the metadata would no longer fit its JSON area is refused before
/// anything is written (the add wrote the new keyslot's 252 KiB of material first and then said
/// "nothing was changed"), and the header in memory is still the device's (a change works).
#[test]
fn a_keyslot_that_does_not_fit_the_json_area_writes_nothing() {
    let (mut io, _, key) = formatted();
    // A token that leaves the JSON area about 300 bytes short of another keyslot (~600).
    let room = HDR - 4096 - primary_copy(&io).1.to_json().len();
    rewrite_metadata(&mut io, |m| {
        let blob = "A".repeat(room - 300 - 40);
        m.tokens.insert(
            0,
            serde_json::json!({"type": "big", "keyslots": [], "blob": blob}),
        );
    });
    let mut header = Header::read(&io).unwrap();
    let before = io.0.clone();
    let err = header
        .add_keyslot(&mut io, &key, b"second", None, &fast())
        .unwrap_err();
    assert_contains(&err.to_string(), "does not fit its");
    assert!(io.0 == before, "a refused add wrote");
    // The header in memory is the one on the device: a change that fits goes through.
    header
        .change_passphrase(&mut io, PASSPHRASE, b"second", None, &fast())
        .unwrap();
    assert_eq!(
        Header::read(&io)
            .unwrap()
            .unlock(&io, b"second")
            .unwrap()
            .keyslot,
        0
    );
}

#[test]
fn checksum_mismatch_in_both_copies() {
    let (mut io, _, _) = formatted();
    io.0[CSUM_OFFSET] ^= 0xff;
    io.0[HDR + CSUM_OFFSET] ^= 0xff;
    assert!(matches!(
        primary_error(&io),
        HeaderError::Checksum { which: "primary" }
    ));
    let (primary, secondary, text) = expect_both_damaged(&io);
    assert_eq!(
        primary,
        "primary LUKS2 header checksum does not match (the header is damaged)"
    );
    assert_eq!(
        secondary,
        "secondary LUKS2 header checksum does not match (the header is damaged)"
    );
    assert_contains(&text, "checksum");
}

/// Invalid JSON text with a correct checksum in both copies: `HeaderError::Json` (the bytes are
/// what was written, so this is not damage).
#[test]
fn invalid_json_text_in_both_copies() {
    let (mut io, _, _) = formatted();
    for offset in [0, HDR] {
        io.0[offset + 4096] = b'x';
        fix_checksum(&mut io.0, offset);
    }
    match primary_error(&io) {
        HeaderError::Json(message) => assert_contains(&message, "expected value"),
        other => panic!("expected Json, got {other:?}"),
    }
    let err = expect_intact_but_unusable(&io);
    assert!(matches!(err, HeaderError::Json(_)), "{err:?}");
    assert_contains(
        &err.to_string(),
        "LUKS2 JSON metadata is invalid: expected value",
    );
}

#[test]
fn json_area_without_nul_terminator() {
    let (mut io, _, _) = formatted();
    for offset in [0, HDR] {
        io.0[offset + 4096..offset + HDR].fill(b' ');
        fix_checksum(&mut io.0, offset);
    }
    match primary_error(&io) {
        HeaderError::Json(message) => assert_contains(&message, "not NUL-terminated"),
        other => panic!("expected Json, got {other:?}"),
    }
    let err = expect_intact_but_unusable(&io);
    assert_contains(
        &err.to_string(),
        "the primary JSON area is not NUL-terminated",
    );
}

// ---------------------------------------------------------------------------------------------
// Syntactically valid JSON that breaks the LUKS2 specification (in both copies).

/// Both copies carry the same out-of-spec metadata: `Metadata` containing `needle`.
fn assert_out_of_spec(io: &MemoryHeaderIo, needle: &str) {
    match primary_error(io) {
        HeaderError::Metadata(message) => assert_contains(&message, needle),
        other => panic!("expected Metadata, got {other:?}"),
    }
    let err = expect_intact_but_unusable(io);
    assert!(matches!(err, HeaderError::Metadata(_)), "{err:?}");
    assert_contains(&err.to_string(), "LUKS2 metadata is out of spec");
    assert_contains(&err.to_string(), needle);
}

#[test]
fn keyslot_area_outside_the_keyslots_area() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        let end = 2 * HDR as u64 + m.config.keyslots_size;
        m.keyslots.get_mut(&0).unwrap().area.offset = end;
    });
    assert_out_of_spec(
        &io,
        "keyslot 0 area [16777216, +258048) lies outside the keyslots area",
    );
}

#[test]
fn keyslot_area_inside_the_binary_headers() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| m.keyslots.get_mut(&0).unwrap().area.offset = 0);
    assert_out_of_spec(&io, "lies outside the keyslots area [32768, 16777216)");
}

#[test]
fn keyslot_area_offset_overflowing_u64() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.keyslots.get_mut(&0).unwrap().area.offset = u64::MAX - 10;
    });
    assert_out_of_spec(&io, "lies outside the keyslots area");
}

#[test]
fn overlapping_keyslot_areas() {
    let mut io = formatted_with_three_keyslots();
    rewrite_metadata(&mut io, |m| {
        let first = m.keyslots[&0].area.offset;
        m.keyslots.get_mut(&1).unwrap().area.offset = first + 4096;
    });
    assert_out_of_spec(&io, "keyslots 0 and 1 have overlapping areas");
}

#[test]
fn digest_naming_a_missing_keyslot() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.digests.get_mut(&0).unwrap().keyslots.push("5".into());
    });
    assert_out_of_spec(&io, "a digest names keyslot `5`, which does not exist");
}

#[test]
fn segment_sector_size_1000() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.segments.get_mut(&0).unwrap().sector_size = 1000
    });
    assert_out_of_spec(
        &io,
        "segment 0 sector_size 1000 is not 512, 1024, 2048 or 4096",
    );
}

#[test]
fn keyslot_id_40() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        let slot = m.keyslots.remove(&0).unwrap();
        m.keyslots.insert(40, slot);
        m.digests.get_mut(&0).unwrap().keyslots = vec!["40".into()];
    });
    assert_out_of_spec(&io, "keyslots id 40 is out of range (0..32)");
}

// ---------------------------------------------------------------------------------------------
// Unsupported algorithms.

#[test]
fn unknown_kdf_scrypt() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.keyslots.get_mut(&0).unwrap().kdf.kind = "scrypt".into();
    });
    assert!(matches!(
        primary_error(&io),
        HeaderError::UnsupportedKdf(ref kdf) if kdf == "scrypt"
    ));
    let err = expect_intact_but_unusable(&io);
    assert_eq!(
        err.to_string(),
        "unsupported key derivation function `scrypt` (ivdisk supports argon2id, argon2i and pbkdf2)"
    );
}

/// An unknown keyslot area cipher passes validation (it only matters for unlocking). Opening
/// that keyslot names the cipher, and so does `unlock` when no keyslot could be tried at all.
#[test]
fn unknown_keyslot_area_cipher_twofish() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.keyslots.get_mut(&0).unwrap().area.encryption = "twofish-xts-plain64".into();
    });
    let header = Header::read(&io).unwrap();
    assert_eq!(header.warning(), None);
    match header.unlock_keyslot(&io, 0, PASSPHRASE) {
        Err(e @ HeaderError::UnsupportedCipher(..)) => assert_eq!(
            e.to_string(),
            "unsupported cipher `twofish-xts-plain64 (512 bits)` for keyslot areas (ivdisk \
             supports aes-xts-plain64 there)"
        ),
        other => panic!("expected UnsupportedCipher, got {other:?}"),
    }
    let err = header.unlock(&io, PASSPHRASE).unwrap_err();
    assert!(matches!(err, HeaderError::UnsupportedCipher(..)), "{err:?}");
}

#[test]
fn unknown_hash_in_digest() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        m.digests.get_mut(&0).unwrap().hash = "whirlpool".into()
    });
    assert!(matches!(
        primary_error(&io),
        HeaderError::UnsupportedHash(ref hash) if hash == "whirlpool"
    ));
    let err = expect_intact_but_unusable(&io);
    assert_eq!(
        err.to_string(),
        "unsupported hash `whirlpool` (ivdisk supports sha1, sha256, sha512)"
    );
}

// ---------------------------------------------------------------------------------------------
// Oversized areas and costs: rejected from the header's numbers, before any allocation.

#[test]
fn keyslots_size_of_1_gib() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| m.config.keyslots_size = 1 << 30);
    assert_out_of_spec(
        &io,
        "config.keyslots_size 1073741824 is not a multiple of 4096 up to 134217728",
    );
}

#[test]
fn binary_hdr_size_of_8_mib() {
    let (mut io, _, _) = formatted();
    for offset in [0, HDR] {
        io.0[offset + 8..offset + 16].copy_from_slice(&(8u64 << 20).to_be_bytes());
        fix_checksum(&mut io.0, offset);
    }
    match primary_error(&io) {
        HeaderError::BinaryHeader { which, reason } => {
            assert_eq!(which, "primary LUKS2");
            assert_contains(&reason, "header size 8388608 is not one LUKS2 allows");
        }
        other => panic!("expected BinaryHeader, got {other:?}"),
    }
    let (primary, secondary, _) = expect_both_damaged(&io);
    assert_contains(&primary, "header size 8388608 is not one LUKS2 allows");
    assert_contains(&secondary, "header size 8388608 is not one LUKS2 allows");
}

#[test]
fn argon2_memory_of_8_gib() {
    let (mut io, _, _) = formatted();
    rewrite_metadata(&mut io, |m| {
        let kdf = &mut m.keyslots.get_mut(&0).unwrap().kdf;
        *kdf = Kdf {
            kind: "argon2id".into(),
            hash: None,
            iterations: None,
            time: Some(4),
            memory: Some(8 * 1024 * 1024), // KiB
            cpus: Some(1),
            salt: kdf.salt.clone(),
            extra: Default::default(),
        };
    });
    assert_out_of_spec(&io, "argon2 costs out of range: time 4, memory 8388608 KiB");
}

// ---------------------------------------------------------------------------------------------
// Truncation.

/// Cut inside the primary's JSON area: neither copy can be read in full.
#[test]
fn truncated_at_10_kib() {
    let (mut io, _, _) = formatted();
    io.0.truncate(10 << 10);
    match primary_error(&io) {
        HeaderError::Truncated { offset, needed } => assert_eq!((offset, needed), (0, HDR as u64)),
        other => panic!("expected Truncated, got {other:?}"),
    }
    let (primary, secondary, _) = expect_both_damaged(&io);
    assert_eq!(
        primary,
        "the header is truncated: 16384 bytes are needed at byte 0, but the device ends before \
         that"
    );
    assert_contains(
        &secondary,
        "no secondary LUKS2 header found at any allowed offset",
    );
}

/// Cut inside keyslot 0's material (in a real file): the header reads, opening that keyslot
/// says `Truncated`, and so does `unlock` (the only keyslot could not be tried).
#[test]
fn truncated_inside_keyslot_material() {
    let (io, _, _) = formatted();
    let cut = 2 * HDR + 100_000;
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(&io.0[..cut]).unwrap();
    let header = Header::read(&file).unwrap();
    assert_eq!(header.warning(), None);
    match header.unlock_keyslot(&file, 0, PASSPHRASE) {
        Err(e @ HeaderError::Truncated { .. }) => {
            assert!(matches!(
                e,
                HeaderError::Truncated {
                    offset: 32768,
                    needed: 256_000
                }
            ));
            assert_contains(&e.to_string(), "the header is truncated");
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    let err = header.unlock(&file, PASSPHRASE).unwrap_err();
    assert!(matches!(err, HeaderError::Truncated { .. }), "{err:?}");
}

#[test]
fn empty_device() {
    let io = MemoryHeaderIo::default();
    assert!(matches!(Header::read(&io), Err(HeaderError::NotLuks)));
}

// ---------------------------------------------------------------------------------------------
// Not LUKS at all.

#[test]
fn file_of_zeros_is_not_luks() {
    let io = MemoryHeaderIo(vec![0; 1 << 20]);
    let err = Header::read(&io).unwrap_err();
    assert!(matches!(err, HeaderError::NotLuks), "{err:?}");
    assert_contains(&err.to_string(), "no LUKS header found");
}

#[test]
fn random_file_is_not_luks() {
    let io = MemoryHeaderIo(noise(1 << 20, 0x1234_5678_9abc_def0));
    assert_ne!(io.0[..6], binary::MAGIC_PRIMARY);
    let err = Header::read(&io).unwrap_err();
    assert!(matches!(err, HeaderError::NotLuks), "{err:?}");
}

#[test]
fn luks_magic_with_version_3() {
    let mut bytes = vec![0u8; 64 << 10];
    bytes[..6].copy_from_slice(&binary::MAGIC_PRIMARY);
    bytes[6..8].copy_from_slice(&3u16.to_be_bytes());
    let err = Header::read(&MemoryHeaderIo(bytes)).unwrap_err();
    assert!(matches!(err, HeaderError::UnsupportedVersion(3)), "{err:?}");
    assert_contains(&err.to_string(), "unsupported LUKS version 3");
}

// ---------------------------------------------------------------------------------------------
// Wrong passphrase.

#[test]
fn wrong_passphrase_with_three_keyslots() {
    let io = formatted_with_three_keyslots();
    let header = Header::read(&io).unwrap();
    assert_eq!(header.keyslots().len(), 3);
    let err = header.unlock(&io, b"not the passphrase").unwrap_err();
    assert!(
        matches!(err, HeaderError::WrongPassphrase { tried: 3, .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "no keyslot matches this passphrase (3 keyslot(s) tried)"
    );
    // The right ones still work.
    assert_eq!(header.unlock(&io, b"third").unwrap().keyslot, 2);
}

/// A header whose last keyslot was removed (forced) opens with no passphrase at all: the
/// error says so and what brings access back, rather than blaming the passphrase.
#[test]
fn a_header_without_keyslots_says_so() {
    let (mut io, mut header, _key) = formatted();
    header.remove_keyslot(&mut io, 0, true).unwrap();
    let header = Header::read(&io).unwrap();
    assert!(header.keyslots().is_empty());
    let err = header.unlock(&io, b"anything").unwrap_err();
    assert!(
        matches!(err, HeaderError::WrongPassphrase { tried: 0, .. }),
        "{err:?}"
    );
    assert_contains(&err.to_string(), "the header has no keyslots left");
    assert_contains(&err.to_string(), "ivdisk header restore");
    // The volume key's way back names a command that takes it (`passphrase add` does not).
    assert_contains(
        &err.to_string(),
        "`ivdisk key add HEADER --volume-key-file FILE`",
    );
}

// ---------------------------------------------------------------------------------------------
// LUKS1 (read-only), built by hand per the LUKS1 on-disk format specification 1.2.3.

const LUKS1_ENABLED: u32 = 0x00AC_71F3;
const LUKS1_DISABLED: u32 = 0x0000_DEAD;

fn put_str(dst: &mut [u8], text: &str) {
    dst[..text.len()].copy_from_slice(text.as_bytes());
}

/// A 592-byte LUKS1 header: aes-xts-plain64, sha256, 64-byte key, keyslot 0 enabled with its
/// material at sector 8 (which the returned bytes do not contain), the others disabled.
fn luks1_header() -> Vec<u8> {
    let mut h = vec![0u8; 592];
    h[..6].copy_from_slice(&binary::MAGIC_PRIMARY);
    h[6..8].copy_from_slice(&1u16.to_be_bytes());
    put_str(&mut h[8..40], "aes");
    put_str(&mut h[40..72], "xts-plain64");
    put_str(&mut h[72..104], "sha256");
    h[104..108].copy_from_slice(&4096u32.to_be_bytes()); // payload offset, sectors
    h[108..112].copy_from_slice(&64u32.to_be_bytes()); // key bytes
    h[112..132].fill(0x11); // master key digest
    h[132..164].fill(0x22); // digest salt
    h[164..168].copy_from_slice(&1000u32.to_be_bytes()); // digest iterations
    put_str(&mut h[168..208], "3f1c2a9e-5b7d-4e1f-9a2b-6c8d0e4f1a2b");
    for slot in 0..8 {
        let at = 208 + slot * 48;
        let state = if slot == 0 {
            LUKS1_ENABLED
        } else {
            LUKS1_DISABLED
        };
        h[at..at + 4].copy_from_slice(&state.to_be_bytes());
        h[at + 4..at + 8].copy_from_slice(&1000u32.to_be_bytes());
        h[at + 8..at + 40].fill(0x33);
        h[at + 40..at + 44].copy_from_slice(&(8 + slot as u32 * 512).to_be_bytes());
        h[at + 44..at + 48].copy_from_slice(&4000u32.to_be_bytes());
    }
    h
}

/// The hand-made header is valid: it reads, and unlocking with its material missing from the
/// device reports the truncation rather than panicking.
#[test]
fn luks1_hand_made_header_reads() {
    let io = MemoryHeaderIo(luks1_header());
    let header = Header::read(&io).unwrap();
    assert_eq!(header.version(), 1);
    assert_eq!(header.keyslots().len(), 1);
    assert_eq!(header.segment().unwrap().cipher, "aes-xts-plain64");
    let err = header.unlock(&io, PASSPHRASE).unwrap_err();
    assert!(matches!(err, HeaderError::Truncated { .. }), "{err:?}");
}

#[test]
fn luks1_truncated_header() {
    let mut bytes = luks1_header();
    bytes.truncate(300);
    let err = Header::read(&MemoryHeaderIo(bytes)).unwrap_err();
    assert!(
        matches!(
            err,
            HeaderError::Truncated {
                offset: 0,
                needed: 592
            }
        ),
        "{err:?}"
    );
}

#[test]
fn luks1_keyslot_state_0x12345678() {
    let mut bytes = luks1_header();
    let at = 208 + 3 * 48;
    bytes[at..at + 4].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    match Header::read(&MemoryHeaderIo(bytes)) {
        Err(e @ HeaderError::BinaryHeader { .. }) => {
            let text = e.to_string();
            let HeaderError::BinaryHeader { which, reason } = e else {
                unreachable!()
            };
            assert_eq!(which, "LUKS1");
            assert_eq!(reason, "keyslot 3 has state 0x12345678");
            assert_eq!(
                text,
                "LUKS1 header is invalid: keyslot 3 has state 0x12345678"
            );
        }
        other => panic!("expected BinaryHeader, got {other:?}"),
    }
}

#[test]
fn luks1_keyslot_with_zero_stripes() {
    let mut bytes = luks1_header();
    bytes[208 + 44..208 + 48].fill(0);
    let err = Header::read(&MemoryHeaderIo(bytes)).unwrap_err();
    assert!(
        matches!(err, HeaderError::BinaryHeader { which: "LUKS1", ref reason }
            if reason == "keyslot 0 has 0 stripes and 1000 iterations"),
        "{err:?}"
    );
}

/// A header read with a damaged or stale copy backs up repaired (both copies rewritten from
/// the valid one): the backup restores, and opens with the passphrase. It was a byte copy of
/// the damage, which every restore refused ("it is itself damaged").
#[test]
fn a_header_with_a_bad_copy_backs_up_restorable() {
    for damaged in ["primary", "secondary"] {
        let (mut io, _, key) = formatted();
        match damaged {
            "primary" => io.0[4096 + 20] ^= 0x01,
            _ => io.0[HDR + 4096 + 20] ^= 0x01,
        }
        let header = Header::read(&io).unwrap();
        assert!(
            header.warning().is_some_and(|w| w.contains(damaged)),
            "{damaged}: {:?}",
            header.warning()
        );
        let mut backup = MemoryHeaderIo::default();
        header.backup(&io, &mut backup).unwrap();
        let saved = Header::read(&backup).unwrap();
        assert_eq!(
            saved.warning(),
            None,
            "{damaged}: the backup holds the damage"
        );
        let mut target = formatted().0;
        let restored = Header::restore(&mut target, &backup, true)
            .unwrap_or_else(|e| panic!("{damaged}: the backup does not restore: {e}"));
        assert_eq!(restored.uuid(), header.uuid());
        let unlocked = restored.unlock(&target, PASSPHRASE).unwrap();
        assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());
    }
}

/// One copy intact but unsupported (another tool's newer change: here an unknown hash), the
/// other usable but older: the header is refused with what is unsupported. It was opened
/// from the stale copy, with a warning that the intact one was "damaged", and the next change
/// "repaired" that copy with the stale state.
#[test]
fn an_intact_unsupported_copy_is_not_passed_over_for_a_stale_one() {
    for unsupported_at in ["primary", "secondary"] {
        let (mut io, _, _) = formatted();
        let (mut binary_header, mut metadata) = primary_copy(&io);
        binary_header.seqid += 1;
        metadata.digests.get_mut(&0).unwrap().hash = "whirlpool".into();
        let offset = match unsupported_at {
            "primary" => 0,
            _ => binary_header.hdr_size,
        };
        let bytes = binary::encode_copy(&binary_header, &metadata, offset).unwrap();
        io.write_at(offset, &bytes).unwrap();
        match Header::read(&io) {
            Err(HeaderError::UnsupportedHash(hash)) => assert_eq!(hash, "whirlpool"),
            Err(e) => panic!("{unsupported_at}: expected UnsupportedHash, got {e:?}"),
            Ok(h) => panic!(
                "{unsupported_at}: opened from the other copy, warning {:?}",
                h.warning()
            ),
        }
    }
}
