//! cryptsetup itself (Debian's cryptsetup-bin) reads, unlocks and changes headers ivdisk
//! writes, and ivdisk reads, unlocks and honours what cryptsetup writes.
//!
//! cryptsetup must be installed (scripts/install-deps.sh does it); a missing binary fails
//! these tests rather than skipping them.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ivdisk_crypto::{ImageId, Suite, VolumeKey};
use ivdisk_header::{
    FormatSpec, Header, HeaderError, ImageParams, PbkdfKind, PbkdfRequest, IVDISK_REQUIREMENT,
};
use openssl::symm::{Cipher, Crypter, Mode};

struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
    /// A key file holding exactly `content` (cryptsetup uses a key file's bytes verbatim).
    fn key_file(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, content).unwrap();
        path
    }
}

fn cryptsetup(args: &[&str]) -> Output {
    let output = Command::new("cryptsetup")
        .args(args)
        .output()
        .expect("cryptsetup must be installed (apt-get install cryptsetup-bin)");
    output
}

fn cryptsetup_ok(args: &[&str]) -> String {
    let out = cryptsetup(args);
    assert!(
        out.status.success(),
        "cryptsetup {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap()
}

fn spec(suite: Suite, kdf: PbkdfKind) -> FormatSpec {
    let mut spec = FormatSpec::new(suite, 4096);
    spec.pbkdf = PbkdfRequest::fast_for_tests(kdf);
    spec.digest_iterations = Some(1000);
    spec.image = Some(ImageParams {
        format_version: ivdisk_header::FORMAT_VERSION,
        layout: if suite.metadata_len() == 0 {
            "none".into()
        } else {
            "object-end".into()
        },
        object_size: 4 << 20,
        image_id: ImageId([0x42; 16]),
    });
    spec.data_size = Some(64 << 20);
    spec
}

/// An ivdisk header file for `suite`, unlocked by `passphrase` in keyslot 0.
fn ivdisk_header(
    scratch: &Scratch,
    name: &str,
    suite: Suite,
    kdf: PbkdfKind,
    passphrase: &[u8],
) -> (PathBuf, VolumeKey) {
    let path = scratch.path(name);
    let key = VolumeKey::generate(suite.default_key_len()).unwrap();
    Header::format(&mut open_rw(&path), &spec(suite, kdf), &key, passphrase).unwrap();
    (path, key)
}

fn luks_fast_pbkdf2() -> [&'static str; 4] {
    ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
}

#[test]
fn luks_dump_lists_our_keyslots_and_parameters() {
    let scratch = Scratch::new();
    let (path, _) = ivdisk_header(
        &scratch,
        "h",
        Suite::Aegis128lRandom,
        PbkdfKind::Argon2id,
        b"pw",
    );
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    let key = header.unlock(&File::open(&path).unwrap(), b"pw").unwrap();
    header
        .add_keyslot(
            &mut open_rw(&path),
            &key.volume_key,
            b"second",
            Some(5),
            &PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        )
        .unwrap();

    let dump = cryptsetup_ok(&["luksDump", s(&path)]);
    for expected in [
        "Version:       \t2",
        "cipher: aegis128l-random",
        "sector: 4096 [bytes]",
        IVDISK_REQUIREMENT,
        "0: luks2",
        "5: luks2",
        "PBKDF:      argon2id",
        "PBKDF:      pbkdf2",
        "0: ivdisk",
        &format!("UUID:          \t{}", header.uuid()),
    ] {
        assert!(
            dump.contains(expected),
            "luksDump lacks {expected:?}:\n{dump}"
        );
    }

    // cryptsetup's own JSON view carries our image parameters unchanged.
    let json: serde_json::Value = serde_json::from_str(&cryptsetup_ok(&[
        "luksDump",
        "--dump-json-metadata",
        s(&path),
    ]))
    .unwrap();
    let token = &json["tokens"]["0"];
    assert_eq!(token["type"], "ivdisk");
    assert_eq!(token["layout"], "object-end");
    assert_eq!(token["object_size"], "4194304");
    assert_eq!(token["image_id"], "42".repeat(16));
    assert_eq!(token["format_version"], 1);
    assert_eq!(json["segments"]["0"]["size"], "67108864");
    assert_eq!(
        json["config"]["requirements"]["mandatory"][0],
        IVDISK_REQUIREMENT
    );
}

#[test]
fn cryptsetup_accepts_our_passphrases_for_every_suite_and_kdf() {
    let scratch = Scratch::new();
    let good = scratch.key_file("good", b"correct horse battery staple");
    let bad = scratch.key_file("bad", b"correct horse battery stapler");
    for (i, suite) in Suite::ALL.into_iter().enumerate() {
        let kdf = [PbkdfKind::Argon2id, PbkdfKind::Pbkdf2, PbkdfKind::Argon2i][i % 3];
        let (path, _) = ivdisk_header(
            &scratch,
            &format!("h{i}"),
            suite,
            kdf,
            b"correct horse battery staple",
        );
        cryptsetup_ok(&[
            "luksOpen",
            "--test-passphrase",
            "--key-file",
            s(&good),
            s(&path),
        ]);
        let out = cryptsetup(&[
            "luksOpen",
            "--test-passphrase",
            "--key-file",
            s(&bad),
            s(&path),
        ]);
        assert!(
            !out.status.success(),
            "{suite}: cryptsetup accepted a wrong passphrase"
        );
    }
}

#[test]
fn keyslot_added_by_cryptsetup_unlocks_in_ivdisk_and_ours_in_cryptsetup() {
    let scratch = Scratch::new();
    // dm-crypt compatible image (aes-xts-plain64, layout none): cryptsetup may change it.
    let (path, key) = ivdisk_header(
        &scratch,
        "h",
        Suite::AesXtsPlain64,
        PbkdfKind::Pbkdf2,
        b"one",
    );
    let one = scratch.key_file("one", b"one");
    let two = scratch.key_file("two", b"two from cryptsetup");
    let mut args = vec!["luksAddKey", "-q", "--key-file", s(&one)];
    args.extend(luks_fast_pbkdf2());
    args.extend([s(&path), s(&two)]);
    cryptsetup_ok(&args);

    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    let unlocked = header
        .unlock(&File::open(&path).unwrap(), b"two from cryptsetup")
        .unwrap();
    assert_eq!(unlocked.keyslot, 1);
    assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());

    let slot = header
        .add_keyslot(
            &mut open_rw(&path),
            &unlocked.volume_key,
            b"three from ivdisk",
            None,
            &PbkdfRequest::fast_for_tests(PbkdfKind::Argon2id),
        )
        .unwrap();
    assert_eq!(slot, 2);
    let three = scratch.key_file("three", b"three from ivdisk");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-slot",
        "2",
        "--key-file",
        s(&three),
        s(&path),
    ]);
    // cryptsetup's view of the volume key through our keyslot is the key itself.
    let vk_out = scratch.path("vk");
    cryptsetup_ok(&[
        "luksDump",
        "-q",
        "--dump-volume-key",
        "--volume-key-file",
        s(&vk_out),
        "--key-file",
        s(&three),
        s(&path),
    ]);
    assert_eq!(std::fs::read(&vk_out).unwrap(), key.as_bytes());
}

#[test]
fn luks_change_key_and_kill_slot_are_honoured() {
    let scratch = Scratch::new();
    let (path, key) = ivdisk_header(
        &scratch,
        "h",
        Suite::AesXtsPlain64,
        PbkdfKind::Argon2id,
        b"old",
    );
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    header
        .add_keyslot(
            &mut open_rw(&path),
            &key,
            b"spare",
            Some(3),
            &PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        )
        .unwrap();
    let old = scratch.key_file("old", b"old");
    let new = scratch.key_file("new", b"new");
    let mut args = vec!["luksChangeKey", "-q", "--key-file", s(&old)];
    args.extend(luks_fast_pbkdf2());
    args.extend([s(&path), s(&new)]);
    cryptsetup_ok(&args);

    let header = Header::read(&File::open(&path).unwrap()).unwrap();
    let dev = File::open(&path).unwrap();
    assert!(matches!(
        header.unlock(&dev, b"old"),
        Err(HeaderError::WrongPassphrase { tried: 2, .. })
    ));
    assert_eq!(
        header.unlock(&dev, b"new").unwrap().volume_key.as_bytes(),
        key.as_bytes()
    );

    cryptsetup_ok(&["luksKillSlot", "-q", s(&path), "3"]);
    let header = Header::read(&File::open(&path).unwrap()).unwrap();
    assert_eq!(
        header.keyslots().iter().map(|k| k.id).collect::<Vec<_>>(),
        vec![0]
    );
    assert!(matches!(
        header.unlock(&File::open(&path).unwrap(), b"spare"),
        Err(HeaderError::WrongPassphrase { tried: 1, .. })
    ));
}

/// cryptsetup records its PBKDF's hash as the keyslot's anti-forensic hash (`--hash sha512`
/// here; sha1 in volumes converted from LUKS1). ivdisk splits new material with SHA-256, so a
/// passphrase it changes in such a slot must record that too: kept as it was, the new
/// passphrase opened nothing, and the old one's area had been wiped.
#[test]
fn a_passphrase_changed_in_a_slot_cryptsetup_made_with_another_hash_opens_it() {
    let scratch = Scratch::new();
    let path = scratch.path("vol");
    File::create(&path).unwrap().set_len(24 << 20).unwrap();
    let a = scratch.key_file("a", b"a");
    let mut args = vec!["luksFormat", "-q", "--type", "luks2", "--hash", "sha512"];
    args.extend(luks_fast_pbkdf2());
    args.extend(["--key-file", s(&a), s(&path)]);
    cryptsetup_ok(&args);
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    let before = header.unlock(&File::open(&path).unwrap(), b"a").unwrap();
    let fast = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
    header
        .change_passphrase(&mut open_rw(&path), b"a", b"b", None, &fast)
        .unwrap();
    let header = Header::read(&File::open(&path).unwrap()).unwrap();
    let after = header.unlock(&File::open(&path).unwrap(), b"b").unwrap();
    assert_eq!(after.volume_key.as_bytes(), before.volume_key.as_bytes());
    let b = scratch.key_file("b", b"b");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&b),
        s(&path),
    ]);
}

/// cryptsetup stores a label and subsystem of any bytes, not only UTF-8: a header ivdisk
/// writes again keeps them byte for byte in both copies. They were read as text, bytes that
/// are not UTF-8 replaced by U+FFFD (three bytes each): a passphrase change wrote the
/// replacement over a short label, and was refused for a long one ("longer than the 47 bytes
/// the LUKS2 header holds").
#[test]
fn a_label_that_is_not_utf8_is_kept_byte_for_byte() {
    use std::os::unix::ffi::OsStrExt;
    let scratch = Scratch::new();
    let path = scratch.path("vol");
    File::create(&path).unwrap().set_len(24 << 20).unwrap();
    let a = scratch.key_file("a", b"a");
    let label = [0xe9u8; 40];
    let subsystem = b"caf\xe9-\xff\xfe";
    let out = Command::new("cryptsetup")
        .args(["luksFormat", "-q", "--type", "luks2"])
        .args(luks_fast_pbkdf2())
        .arg("--label")
        .arg(std::ffi::OsStr::from_bytes(&label))
        .arg("--subsystem")
        .arg(std::ffi::OsStr::from_bytes(subsystem))
        .args(["--key-file", s(&a), s(&path)])
        .output()
        .expect("cryptsetup (apt install cryptsetup-bin)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The label at byte 24 and the subsystem at byte 208 of each 16 KiB copy.
    let fields = || {
        let bytes = std::fs::read(&path).unwrap();
        [0usize, 16 << 10].map(|copy| {
            (
                bytes[copy + 24..copy + 72].to_vec(),
                bytes[copy + 208..copy + 256].to_vec(),
            )
        })
    };
    let before = fields();
    assert_eq!(
        &before[0].0[..40],
        &label[..],
        "cryptsetup stored the label as given"
    );

    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    assert_eq!(header.label(), "\u{fffd}".repeat(40));
    let fast = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
    header
        .change_passphrase(&mut open_rw(&path), b"a", b"b", None, &fast)
        .unwrap();
    assert_eq!(fields(), before, "label or subsystem changed");
    let b = scratch.key_file("b", b"b");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&b),
        s(&path),
    ]);
}

/// A LUKS1 volume converted to LUKS2 by `cryptsetup convert` keeps LUKS1's 20-byte digest
/// under the name of its hash (SHA-256 by default since cryptsetup 1.7): it is read and opens
/// with its passphrase (and not with another), and a passphrase ivdisk adds opens it in
/// cryptsetup. Its header was refused as out of spec ("digest 0 has the wrong length").
#[test]
fn a_luks1_volume_converted_by_cryptsetup_opens() {
    let scratch = Scratch::new();
    let path = scratch.path("vol");
    File::create(&path).unwrap().set_len(24 << 20).unwrap();
    let a = scratch.key_file("a", b"a");
    let mut args = vec!["luksFormat", "-q", "--type", "luks1"];
    args.extend([
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        s(&a),
        s(&path),
    ]);
    cryptsetup_ok(&args);
    cryptsetup_ok(&["convert", "-q", "--type", "luks2", s(&path)]);
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    assert_eq!(header.version(), 2);
    let unlocked = header.unlock(&File::open(&path).unwrap(), b"a").unwrap();
    assert!(header.unlock(&File::open(&path).unwrap(), b"b").is_err());
    let fast = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
    header
        .add_keyslot(&mut open_rw(&path), &unlocked.volume_key, b"b", None, &fast)
        .unwrap();
    let b = scratch.key_file("b", b"b");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&b),
        s(&path),
    ]);
}

/// An unbound keyslot (`cryptsetup luksAddKey --unbound`) holds a key of its own, which its
/// own digest confirms, not the volume key: no passphrase opens the volume through it, and
/// it does not count as a keyslot that opens the volume when the last one is removed. It was
/// taken for the volume key (reads decrypted garbage, writes used the wrong key).
#[test]
fn an_unbound_keyslot_does_not_open_the_volume() {
    let scratch = Scratch::new();
    let path = scratch.path("vol");
    File::create(&path).unwrap().set_len(24 << 20).unwrap();
    let a = scratch.key_file("a", b"a");
    let u = scratch.key_file("u", b"u");
    let mut args = vec!["luksFormat", "-q", "--type", "luks2"];
    args.extend(luks_fast_pbkdf2());
    args.extend(["--key-file", s(&a), s(&path)]);
    cryptsetup_ok(&args);
    let mut args = vec!["luksAddKey", "-q", "--unbound", "--key-size", "512"];
    args.extend(luks_fast_pbkdf2());
    args.extend([s(&path), s(&u)]);
    cryptsetup_ok(&args);
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    let io = File::open(&path).unwrap();
    assert!(
        matches!(
            header.unlock(&io, b"u"),
            Err(HeaderError::WrongPassphrase { tried: 1, .. })
        ),
        "only the bound keyslot is tried"
    );
    assert!(matches!(
        header.unlock_keyslot(&io, 1, b"u"),
        Err(HeaderError::UnboundKeyslot(1))
    ));
    assert_eq!(header.unlock(&io, b"a").unwrap().keyslot, 0);
    assert!(matches!(
        header.remove_keyslot(&mut open_rw(&path), 0, false),
        Err(HeaderError::LastKeyslot(0))
    ));
    header
        .remove_keyslot(&mut open_rw(&path), 1, false)
        .unwrap();
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&a),
        s(&path),
    ]);
}

#[test]
fn ivdisk_changes_are_honoured_by_cryptsetup() {
    let scratch = Scratch::new();
    let (path, _) = ivdisk_header(
        &scratch,
        "h",
        Suite::Aegis256Random,
        PbkdfKind::Pbkdf2,
        b"a",
    );
    let mut header = Header::read(&File::open(&path).unwrap()).unwrap();
    let fast = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
    header
        .change_passphrase(&mut open_rw(&path), b"a", b"b", None, &fast)
        .unwrap();
    let a = scratch.key_file("a", b"a");
    let b = scratch.key_file("b", b"b");
    assert!(!cryptsetup(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&a),
        s(&path)
    ])
    .status
    .success());
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-slot",
        "0",
        "--key-file",
        s(&b),
        s(&path),
    ]);

    let unlocked = header.unlock(&File::open(&path).unwrap(), b"b").unwrap();
    header
        .add_keyslot(&mut open_rw(&path), &unlocked.volume_key, b"c", None, &fast)
        .unwrap();
    header
        .remove_keyslot(&mut open_rw(&path), 0, false)
        .unwrap();
    assert!(!cryptsetup(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&b),
        s(&path)
    ])
    .status
    .success());
    let c = scratch.key_file("c", b"c");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&c),
        s(&path),
    ]);
    // The last keyslot stays unless forced.
    assert!(matches!(
        header.remove_keyslot(&mut open_rw(&path), 1, false),
        Err(HeaderError::LastKeyslot(1))
    ));
}

#[test]
fn random_iv_images_are_protected_from_dm_crypt_by_a_requirement_cryptsetup_honours() {
    let scratch = Scratch::new();
    let (path, _) = ivdisk_header(&scratch, "h", Suite::AesXtsRandom, PbkdfKind::Pbkdf2, b"pw");
    let pw = scratch.key_file("pw", b"pw");
    let other = scratch.key_file("other", b"other");
    // cryptsetup refuses to change (and, by the same check in LUKS2_activate, to activate) a
    // header with a mandatory requirement it does not know.
    let mut args = vec!["luksAddKey", "-q", "--key-file", s(&pw)];
    args.extend(luks_fast_pbkdf2());
    args.extend([s(&path), s(&other)]);
    let out = cryptsetup(&args);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Unmet LUKS2 requirements"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump = cryptsetup_ok(&["luksDump", s(&path)]);
    assert!(
        dump.contains(&format!("Requirements:\t{IVDISK_REQUIREMENT}")),
        "{dump}"
    );

    // A dm-crypt compatible image carries no requirement.
    let (plain, _) = ivdisk_header(
        &scratch,
        "p",
        Suite::AesXtsPlain64,
        PbkdfKind::Pbkdf2,
        b"pw",
    );
    let dump = cryptsetup_ok(&["luksDump", s(&plain)]);
    assert!(!dump.contains(IVDISK_REQUIREMENT), "{dump}");
}

#[test]
fn header_backups_cross_between_ivdisk_and_cryptsetup() {
    let scratch = Scratch::new();
    let (path, key) = ivdisk_header(
        &scratch,
        "h",
        Suite::AesXtsPlain64,
        PbkdfKind::Pbkdf2,
        b"pw",
    );
    let header = Header::read(&File::open(&path).unwrap()).unwrap();
    let ours = scratch.path("ours.backup");
    header
        .backup(&File::open(&path).unwrap(), &mut open_rw(&ours))
        .unwrap();
    // cryptsetup reads our backup as a header.
    let pw = scratch.key_file("pw", b"pw");
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&pw),
        s(&ours),
    ]);

    // Destroy both headers, then restore from cryptsetup's own backup.
    let theirs = scratch.path("theirs.backup");
    cryptsetup_ok(&[
        "luksHeaderBackup",
        s(&path),
        "--header-backup-file",
        s(&theirs),
    ]);
    let zeros = vec![0u8; 64 << 10];
    std::os::unix::fs::FileExt::write_all_at(&open_rw(&path), &zeros, 0).unwrap();
    assert!(Header::read(&File::open(&path).unwrap()).is_err());
    let restored =
        Header::restore(&mut open_rw(&path), &File::open(&theirs).unwrap(), false).unwrap();
    assert_eq!(restored.uuid(), header.uuid());
    let unlocked = restored.unlock(&File::open(&path).unwrap(), b"pw").unwrap();
    assert_eq!(unlocked.volume_key.as_bytes(), key.as_bytes());

    // A backup of another volume is refused unless forced.
    let (other, _) = ivdisk_header(
        &scratch,
        "o",
        Suite::AesXtsPlain64,
        PbkdfKind::Pbkdf2,
        b"pw",
    );
    let err =
        Header::restore(&mut open_rw(&path), &File::open(&other).unwrap(), false).unwrap_err();
    assert!(matches!(err, HeaderError::Backup(_)), "{err}");
    assert!(err.to_string().contains("--force"));
}

/// Encrypt `plain` as dm-crypt's aes-xts-plain64 does, with OpenSSL's XTS directly (not
/// ivdisk's engines): IV = little-endian (byte offset / 512 + iv_tweak), one call per sector.
fn dm_crypt_encrypt(key: &[u8], sector_size: usize, first_offset: u64, plain: &[u8]) -> Vec<u8> {
    let cipher = if key.len() == 64 {
        Cipher::aes_256_xts()
    } else {
        Cipher::aes_128_xts()
    };
    let mut out = Vec::with_capacity(plain.len());
    for (i, sector) in plain.chunks(sector_size).enumerate() {
        let iv_sector = (first_offset + (i * sector_size) as u64) / 512;
        let mut iv = [0u8; 16];
        iv[..8].copy_from_slice(&iv_sector.to_le_bytes());
        let mut c = Crypter::new(cipher, Mode::Encrypt, key, Some(&iv)).unwrap();
        let mut buf = vec![0u8; sector_size + 16];
        let n = c.update(sector, &mut buf).unwrap();
        let m = c.finalize(&mut buf[n..]).unwrap();
        out.extend_from_slice(&buf[..n + m]);
    }
    out
}

fn known_plaintext(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect()
}

#[test]
fn volumes_formatted_by_cryptsetup_open_and_read_back_through_ivdisk() {
    let scratch = Scratch::new();
    let pw = scratch.key_file("pw", b"cryptsetup passphrase");
    let cases = [
        ("luks2", 512, 32, "argon2id"),
        ("luks2", 4096, 64, "argon2id"),
        ("luks2", 4096, 32, "pbkdf2"),
        ("luks2", 512, 64, "pbkdf2"),
        ("luks1", 512, 64, "pbkdf2"),
        ("luks1", 512, 32, "pbkdf2"),
    ];
    for (i, (luks, sector_size, key_len, kdf)) in cases.into_iter().enumerate() {
        let what = format!("{luks} sector {sector_size} key {key_len} {kdf}");
        let vk: Vec<u8> = (0..key_len as u8)
            .map(|b| b.wrapping_mul(37).wrapping_add(i as u8))
            .collect();
        let vk_file = scratch.key_file(&format!("vk{i}"), &vk);
        let path = scratch.path(&format!("vol{i}"));
        File::create(&path).unwrap().set_len(24 << 20).unwrap();
        let key_bits = (key_len * 8).to_string();
        let sector = sector_size.to_string();
        let mut args = vec![
            "luksFormat",
            "-q",
            "--type",
            luks,
            "--cipher",
            "aes-xts-plain64",
            "--key-size",
            &key_bits,
            "--volume-key-file",
            s(&vk_file),
            "--key-file",
            s(&pw),
            "--pbkdf",
            kdf,
        ];
        if luks == "luks2" {
            args.extend(["--sector-size", &sector]);
        }
        if kdf == "pbkdf2" {
            args.extend(["--pbkdf-force-iterations", "1000"]);
        } else {
            args.extend(["--pbkdf-force-iterations", "4", "--pbkdf-memory", "32768"]);
        }
        args.push(s(&path));
        cryptsetup_ok(&args);

        let header = Header::read(&File::open(&path).unwrap()).unwrap();
        assert_eq!(
            header.version(),
            if luks == "luks2" { 2 } else { 1 },
            "{what}"
        );
        let unlocked = header
            .unlock(&File::open(&path).unwrap(), b"cryptsetup passphrase")
            .unwrap();
        assert_eq!(unlocked.volume_key.as_bytes(), &vk[..], "{what}");
        assert!(matches!(
            header.unlock(&File::open(&path).unwrap(), b"nope"),
            Err(HeaderError::WrongPassphrase { tried: 1, .. })
        ));
        let recovered = header.unlock_with_volume_key(&vk).unwrap();
        assert_eq!(recovered.as_bytes(), &vk[..]);

        // Known plaintext at three places of the data area, encrypted as dm-crypt would.
        let data = header.open_data(&unlocked.volume_key).unwrap();
        assert_eq!(data.suite, Suite::AesXtsPlain64);
        assert_eq!(data.info.sector_size as usize, sector_size, "{what}");
        let file = open_rw(&path);
        for at in [0u64, 1 << 20, (8 << 20) - 3 * 4096] {
            let plain = known_plaintext(3 * 4096);
            let ct = dm_crypt_encrypt(&vk, sector_size, at, &plain);
            std::os::unix::fs::FileExt::write_all_at(&file, &ct, data.info.offset + at).unwrap();

            let mut buf = vec![0u8; plain.len()];
            std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, data.info.offset + at)
                .unwrap();
            data.cipher
                .decrypt_sectors(data.sector_number(at), &mut buf, &[])
                .unwrap();
            assert!(buf == plain, "{what}: data at {at} does not read back");
        }
    }
}

/// A LUKS1 volume of cryptsetup, restored from cryptsetup's own backup (which ends after the
/// last keyslot's material, short of the payload offset). A truncated backup, and a LUKS1
/// backup over a LUKS2 volume (whose data starts elsewhere, even with force), are refused
/// before anything is written: the volume stays byte for byte as it was.
#[test]
fn luks1_backups_of_cryptsetup_restore_and_bad_ones_write_nothing() {
    let scratch = Scratch::new();
    let pw = scratch.key_file("pw", b"pw");
    let format = |name: &str, luks: &str| {
        let path = scratch.path(name);
        File::create(&path).unwrap().set_len(24 << 20).unwrap();
        cryptsetup_ok(&[
            "luksFormat",
            "-q",
            "--type",
            luks,
            "--key-file",
            s(&pw),
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            s(&path),
        ]);
        path
    };
    let v1 = format("v1", "luks1");
    let backup = scratch.path("v1.backup");
    cryptsetup_ok(&[
        "luksHeaderBackup",
        s(&v1),
        "--header-backup-file",
        s(&backup),
    ]);
    let header = Header::read(&File::open(&v1).unwrap()).unwrap();
    let backup_len = std::fs::metadata(&backup).unwrap().len();
    assert!(
        backup_len < header.region_len(),
        "cryptsetup's LUKS1 backup ({backup_len} bytes) ends before the payload"
    );

    // Restored over a destroyed header: it unlocks again.
    std::os::unix::fs::FileExt::write_all_at(&open_rw(&v1), &[0u8; 4096], 0).unwrap();
    let restored =
        Header::restore(&mut open_rw(&v1), &File::open(&backup).unwrap(), false).unwrap();
    assert_eq!(restored.uuid(), header.uuid());
    restored.unlock(&File::open(&v1).unwrap(), b"pw").unwrap();
    cryptsetup_ok(&[
        "luksOpen",
        "--test-passphrase",
        "--key-file",
        s(&pw),
        s(&v1),
    ]);

    // A truncated backup: refused, nothing written (it wrote its first MiB before).
    let cut = scratch.path("cut.backup");
    let bytes = std::fs::read(&backup).unwrap();
    // Short of the only keyslot's material.
    std::fs::write(&cut, &bytes[..header.metadata_end() as usize - 512]).unwrap();
    let before = std::fs::read(&v1).unwrap();
    let err = Header::restore(&mut open_rw(&v1), &File::open(&cut).unwrap(), true).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(
        std::fs::read(&v1).unwrap() == before,
        "a refused restore wrote"
    );

    // LUKS1's backup over a LUKS2 volume: refused even forced, nothing written.
    let v2 = format("v2", "luks2");
    let before = std::fs::read(&v2).unwrap();
    let err = Header::restore(&mut open_rw(&v2), &File::open(&backup).unwrap(), true).unwrap_err();
    assert!(err.to_string().contains("data starts at"), "{err}");
    assert!(
        std::fs::read(&v2).unwrap() == before,
        "a refused restore wrote"
    );
}
